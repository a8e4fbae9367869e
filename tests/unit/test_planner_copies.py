"""The constants the planner copies from the rest of the package, each compared with its source.

The planner is standard-library only (``megatron-kd plan`` runs without torch), so it cannot
import what the loss, the cache, the teacher's wire and the trainer define; it keeps copies (the
loss's default window, its GPU path's window budget, row tile and
weight-gradient choices, a decoded top-K entry's bytes, a token id's bytes, the vocabulary padding,
the ring's default depth, Megatron-Core's pipeline schedule table and warm-up counts), and these
tests fail when a copy and its source part. (The wire's bytes
per hidden-state token, ``traffic.WIRE_ELEMENT_BYTES``, are compared with what the wire encodes
in ``tests/unit/test_wire.py``.)
"""

import argparse
import collections
import dataclasses
import importlib
import types

import numpy as np
import torch
from megatron.core.pipeline_parallel import schedules as mcore_schedules

from megatron_kd.cache.codec import LogprobCodec
from megatron_kd.cache.format import CacheSpec
from megatron_kd.cache.loader import topk_batch
from megatron_kd.cache.reader import TopKCacheReader
from megatron_kd.cache.writer import CacheWriter
from megatron_kd.cli import SUBCOMMANDS
from megatron_kd.loss import config as loss_config
from megatron_kd.parallel.vocab import pad_vocab_size
from megatron_kd.planner import memory, schedule, traffic
from megatron_kd.planner.memory import ParallelLayout
from megatron_kd.planner.plan import PlanOptions
from megatron_kd.teacher.client import TeacherClient


def _train_default(dest: str):
    """The default of a ``megatron-kd train`` flag, from the command's own parser."""
    parser = argparse.ArgumentParser()
    importlib.import_module(SUBCOMMANDS["train"][0]).add_arguments(parser)
    return parser.get_default(dest)


def _default(cls, name: str):
    return next(f.default for f in dataclasses.fields(cls) if f.name == name)


def test_default_window_is_the_loss_default():
    assert memory.DEFAULT_WINDOW_ELEMENTS == loss_config.DEFAULT_WINDOW_ELEMENTS
    # and the rows it gives, for local vocabularies below, at and above the bound, and odd
    loss = loss_config.KDLossConfig()
    for local_vocab in (1, 1009, 32000, 64128, 1 << 24, (1 << 24) + 1):
        assert memory.default_window_rows(local_vocab) == loss.rows_per_window(local_vocab)


def test_gpu_path_windows_are_the_loss_gpu_path():
    # the GPU path's defaults and choices, then its rows per window on a grid of shapes
    gpu = loss_config.GpuTuning()
    assert memory.DEFAULT_GPU_WINDOW_BYTES == gpu.window_bytes
    assert memory.GPU_ROW_TILE == loss_config.ROW_TILE
    assert memory.WEIGHT_GRADS == loss_config.WEIGHT_GRADS
    assert memory.GpuLoss() == memory.GpuLoss(window_bytes=gpu.window_bytes,
                                              weight_grad=gpu.weight_grad)
    for window_bytes in (1 << 20, 1 << 30, 3 << 28):
        tuning = loss_config.GpuTuning(window_bytes=window_bytes)
        for local_vocab in (1009, 64128, 128256, 151936):
            for models, itemsize in ((1, 2), (2, 2), (2, 4)):
                for window_size in (None, 100, 2048):
                    for n_rows in (1, 127, 4096, 8192, 32768):
                        assert memory.gpu_window_rows(
                            local_vocab, models, itemsize, window_size, n_rows, window_bytes
                        ) == tuning.rows_per_window(local_vocab, models, itemsize, window_size,
                                                    n_rows), (window_bytes, local_vocab, models,
                                                              itemsize, window_size, n_rows)


def test_decoded_topk_entry_is_what_the_cache_hands_the_trainer(tmp_path):
    # a one-sample cache, read back as the trainer reads it (torch tensors, [s, b, K])
    seq_length, topk, vocab_size = 5, 3, 50
    spec = CacheSpec(teacher_checkpoint="t", teacher_weights_hash="w", tokenizer="tok",
                     vocab_size=vocab_size, topk=topk, seq_length=seq_length, num_samples=1,
                     dataset_hash="d", samples_per_shard=1,
                     logprob_codec=LogprobCodec(name="fp32"))
    writer = CacheWriter(tmp_path, spec)
    ids = np.tile(np.arange(topk), (seq_length, 1))
    logprobs = np.full((seq_length, topk), -np.log(topk), dtype=np.float32)
    writer.write_shard(0, [writer.encode(ids, logprobs)], [0])
    got_ids, got_logprobs = topk_batch(TopKCacheReader(tmp_path), [0])
    entry = got_ids.element_size() + got_logprobs.element_size()
    assert entry == memory.DECODED_TOPK_ENTRY_BYTES
    assert got_ids.nbytes + got_logprobs.nbytes == memory.cache_reader_bytes(seq_length, 1, topk)


def test_token_id_bytes_are_what_a_student_sends():
    # the client's request for one micro-batch, taken where it would go on the wire
    client = TeacherClient.__new__(TeacherClient)  # nothing connected: only the request is built
    client.member, client.next_request = 0, 0
    client.outstanding = collections.deque()
    tokens = torch.arange(6, dtype=torch.int64).reshape(2, 3)
    client.schedule = iter([(0, 0, (0, 1), tokens)])
    sent = []
    client._transmit = sent.append
    client._send_next()
    (request,) = sent
    assert request.tokens.element_size() == traffic.TOKEN_ID_BYTES
    assert request.tokens.nbytes == traffic.token_bytes_per_step_per_dp_rank(2, 1, 3)


def test_vocabulary_padding_is_the_trainers():
    # the default multiple, and the padded size for vocabularies that do and do not divide
    multiple = _default(ParallelLayout, "make_vocab_size_divisible_by")
    assert multiple == _train_default("make_vocab_size_divisible_by")
    for vocab in (1, 1009, 32000, 128256, 151936, 248320):
        for tp in (1, 2, 3, 8):
            assert ParallelLayout(tp=tp).padded_vocab(vocab) == pad_vocab_size(vocab, tp, multiple)


def test_prefetch_depth_is_the_trainers_default():
    assert _default(PlanOptions, "prefetch_depth") == _train_default("kd_prefetch_depth")


def _options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {option: action for action in parser._actions for option in action.option_strings}


def _cache_build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    importlib.import_module(SUBCOMMANDS["cache"][0]).add_arguments(parser)
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    build = sub.choices["build"]
    build.format_help()  # its flags are added when first used (parsing or --help)
    return build


def test_kd_flags_are_the_training_commands():
    # the --kd-* flags `megatron-kd plan` shares with `train` (and the Megatron-LM hooks) and
    # `cache build`: the same flag, choices and help, and the plan's default is theirs
    planner = argparse.ArgumentParser()
    importlib.import_module(SUBCOMMANDS["plan"][0]).add_arguments(planner)
    train = argparse.ArgumentParser()
    importlib.import_module(SUBCOMMANDS["train"][0]).add_arguments(train)
    plan, trained, cache = _options(planner), _options(train), _options(_cache_build_parser())
    for option, other, field in (("--kd-prefetch-depth", trained, "prefetch_depth"),
                                 ("--kd-window-size", trained, "window_size"),
                                 ("--kd-wire-dtype", trained, "wire_dtype"),
                                 ("--kd-topk", cache, "topk")):
        assert plan[option].choices == other[option].choices, option
        assert plan[option].type == other[option].type, option
        # None on the planner's command line: given, or else --from-args's, else the plan's
        assert plan[option].default is None and plan[option].dest == field
        if field != "wire_dtype":
            assert _default(PlanOptions, field) == other[option].default, option
        if field != "window_size":
            assert plan[option].help.startswith(other[option].help), option
    # one pinned K: cache build's, and the plan's when none is given
    assert _default(PlanOptions, "topk") == cache["--kd-topk"].default == 100
    # the wire's default is the teacher's dtype, which the plan takes as bf16 (its weights')
    assert trained["--kd-wire-dtype"].default is None
    assert _default(PlanOptions, "wire_dtype") == "bf16"
    assert _default(PlanOptions, "hidden_elem_bytes") == 2


def _p2p(pp: int, rank: int, vp: int | None) -> types.SimpleNamespace:
    """What ``get_pp_rank_microbatches`` asks of a P2P communicator: the pipeline group's size and
    this rank, and the virtual pipeline size (None without interleaving)."""
    group = types.SimpleNamespace(size=lambda: pp, rank=lambda: rank)
    return types.SimpleNamespace(pp_group=group, virtual_pipeline_model_parallel_size=vp)


def test_pipeline_schedule_is_megatron_cores():
    # the forwards' chunk order and every rank's warm-up, against Megatron-Core's own functions
    # (the group size defaults to pp), for several p, v and m (m a multiple of p, as it requires)
    for pp in (2, 3, 4):
        for vp in (2, 3, 4):
            for m in (pp, 2 * pp, 5 * pp):
                table = mcore_schedules.get_schedule_table(m, vp, pp)
                assert schedule.schedule_chunks(pp, vp, m) == [chunk for _, chunk in table]
                for rank in range(pp):
                    _, _, warmup, _ = mcore_schedules.get_pp_rank_microbatches(
                        m, vp, pp, p2p_communicator=_p2p(pp, rank, vp))
                    assert schedule.interleaved_warmup(pp, vp, rank, m) == warmup
        # 1F1B: p - r - 1 warm-up forwards, then one in flight more
        for m in (1, pp, 3 * pp + 1):
            for rank in range(pp):
                _, _, warmup, _ = mcore_schedules.get_pp_rank_microbatches(
                    m, 1, pp, p2p_communicator=_p2p(pp, rank, None))
                assert schedule.in_flight_microbatches(pp, rank, m) == min(warmup + 1, m)
