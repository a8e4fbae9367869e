"""``megatron-kd cache build``'s run: the teacher in its model-parallel groups over the
training samples, their top-K stored (:func:`megatron_kd.cache.build.build_cache`). The command
line is :mod:`megatron_kd.commands.cache`'s, which imports this module only for
``build``: ``verify`` and ``info`` need neither torch nor Megatron-Core.
"""

from __future__ import annotations

import argparse
import json
import os

import torch.distributed as dist
from megatron.core import parallel_state as ps

from megatron_kd.arch import Role, check_layout
from megatron_kd.cache.build import build_cache
from megatron_kd.cache.codec import LogprobCodec
from megatron_kd.cache.format import CacheSpec
from megatron_kd.cache.identity import dataset_identity, tokenizer_identity
from megatron_kd.commands.startup import in_layout, started
from megatron_kd.data.datasets import collate
from megatron_kd.data.tokenizer import MockTokenizer
from megatron_kd.flags import add_flags, from_flags
from megatron_kd.integration.checkpoint import checkpoint_hash
from megatron_kd.integration.gpt import transformer_engine_available
from megatron_kd.integration.output_layer import output_layer_weight
from megatron_kd.integration.teacher import build_frozen_teacher, full_sequence_forward
from megatron_kd.modes.args import KDArgs, add_teacher_flags
from megatron_kd.parallel import ParallelLayout
from megatron_kd.training.run_checks import build_datasets, check_teacher, resolve_tokenizer
from megatron_kd.training.run_config import DataSection, KernelSection, ParallelSection

__all__ = ["add_data_flags", "add_run_flags", "check_cache_layout", "run_build"]


def add_run_flags(b: argparse.ArgumentParser) -> None:
    """The run's parallel layout and teacher flags that ``cache build`` takes."""
    add_flags(b, ParallelSection, use_groups=False, only=(
        "tensor_model_parallel_size", "expert_model_parallel_size",
        "expert_tensor_parallel_size", "sequence_parallel", "context_parallel_size"))
    add_flags(b, KernelSection, use_groups=False)
    add_teacher_flags(b, help={"teacher_dtype": "parameter dtype of the teacher (the top-K "
                                                "maths runs in fp32 either way)"})


def add_data_flags(b: argparse.ArgumentParser) -> None:
    """The run's own data section: the cache covers exactly the samples the student reads."""
    add_flags(b, DataSection, use_groups=False, required=("global_batch_size",),
              help={"eval_iters": "as in training (it sizes the dataset split and so its "
                                  "identity)", "global_batch_size": None})


def check_cache_layout(arch, layout: ParallelLayout, *, seq_length: int,
                       transformer_engine: bool) -> None:
    """``cache build``'s layout check: ``arch`` as the teacher of a cache build in ``layout``
    (:func:`megatron_kd.arch.check_layout`, a cache build's role: no pipeline, its experts
    inside its tensor-parallel group); what the planner's cache builds are held to."""
    check_layout(arch, layout, role=Role.CACHE_TEACHER, seq_length=seq_length,
                 transformer_engine=transformer_engine)


def run_build(build, args: argparse.Namespace) -> int:
    """Build the cache ``build`` (the command's ``CacheBuildSection``: where, top-K, encoding,
    shards, windows, micro-batch) for the run's data, parallel and teacher sections read from
    ``args``, on every rank of the job; rank 0 prints the build's summary as JSON."""
    data, parallel = from_flags(DataSection, args), from_flags(ParallelSection, args)
    kd = from_flags(KDArgs, args)
    kernels = from_flags(KernelSection, args)
    for name, value in (("kd_topk", build.topk), ("samples_per_shard", build.samples_per_shard),
                        ("window_size", build.window_size), ("seq_length", data.seq_length),
                        ("micro_batch_size", build.micro_batch_size),
                        ("train_iters", data.train_iters),
                        ("global_batch_size", data.global_batch_size)):
        if value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if data.reset_position_ids:
        raise ValueError("--reset-position-ids: the cache's teacher is given the token ids "
                         "only and numbers them 0..s-1, so a student trained with reset "
                         "positions would not match its targets; drop the flag (or distil "
                         "with --kd-mode colocated, whose teacher takes the student's "
                         "positions)")
    transformer_engine = transformer_engine_available()
    kernels.check_transformer_impl(transformer_engine)
    codec = LogprobCodec(name=build.logprob_encoding)
    with started():
        teacher_dir, arch = check_teacher(kd.teacher_load, seq_length=data.seq_length,
                                          teacher_args=kd.teacher_args)
        layout = parallel.layout(dist.get_world_size(), arch.num_layers)
        try:
            check_cache_layout(arch, layout, seq_length=data.seq_length,
                               transformer_engine=transformer_engine)
        except ValueError as e:
            raise ValueError(f"teacher {teacher_dir!r}: {e}") from None
        with in_layout(layout):
            stats = _build_in_model_parallel(build, data, layout, kd, teacher_dir, arch, codec,
                                             attention=kernels.attention_backend)
        if dist.get_rank() == 0:
            print(json.dumps({"shards_written": len(stats.shards_written),
                              "shards_skipped": len(stats.shards_skipped),
                              "tokens": stats.tokens, "seconds": round(stats.seconds, 3)}))
        dist.barrier()
        return 0


def _build_in_model_parallel(build, data: DataSection, layout: ParallelLayout, kd: KDArgs,
                             teacher_dir: str, arch, codec: LogprobCodec, *, attention: str):
    tokenizer = resolve_tokenizer(data, teacher_dir)
    if tokenizer is not None and tokenizer.vocab_size > arch.vocab_size:
        raise ValueError(f"the tokenizer has {tokenizer.vocab_size} tokens but the teacher "
                         f"vocabulary is {arch.vocab_size}")
    tokenizer = tokenizer or MockTokenizer(arch.vocab_size)
    dataset, _ = build_datasets(data, arch.vocab_size, tokenizer, data.global_batch_size,
                                need_valid=False)
    sp, cp = layout.sequence_parallel, layout.cp
    cp_group = ps.get_context_parallel_group() if cp > 1 else None
    # seeded only so Megatron's model-parallel RNG exists; the weights are loaded next
    teacher = build_frozen_teacher(arch, teacher_dir, dtype=kd.teacher_torch_dtype,
                                   seed=data.seed, sequence_parallel=sp, attention=attention)
    weight = output_layer_weight(teacher)
    tp_group = ps.get_tensor_model_parallel_group()

    # One hash of the checkpoint files, computed once and shared (same on every rank).
    ckpt_hash = [checkpoint_hash(teacher_dir) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(ckpt_hash, src=0)
    spec = CacheSpec(
        teacher_checkpoint=os.path.abspath(teacher_dir),
        teacher_weights_hash=ckpt_hash[0], tokenizer=tokenizer_identity(tokenizer),
        vocab_size=arch.vocab_size, topk=build.topk, seq_length=data.seq_length,
        num_samples=data.num_samples(data.global_batch_size)[0],
        dataset_hash=dataset_identity(dataset), samples_per_shard=build.samples_per_shard,
        logprob_codec=codec)

    # the top-K needs the whole sequence, in order, on every rank of a teacher copy
    forward = full_sequence_forward(teacher, is_last=True, sp_group=tp_group if sp else None,
                                    cp_group=cp_group)

    def teacher_forward(indices):
        return forward(collate([dataset[i] for i in indices])["tokens"].to(weight.device))

    log = print if ps.get_tensor_and_context_parallel_rank() == 0 else None
    def sample_tokens(indices):  # the whole sequences the teacher saw, fingerprinted
        return collate([dataset[i] for i in indices])["tokens"]

    return build_cache(build.out, spec, teacher_forward_fn=teacher_forward,
                       sample_tokens_fn=sample_tokens, output_weight=weight,
                       micro_batch_size=build.micro_batch_size, window_size=build.window_size,
                       tp_group=tp_group,
                       replica_group=(ps.get_tensor_and_context_parallel_group() if cp > 1
                                      else None),
                       dp_rank=ps.get_data_parallel_rank(),
                       dp_world_size=ps.get_data_parallel_world_size(), log=log)
