"""``tools/validate_planner.py`` accepts its built-in cases (every ``megatron-kd train`` mode) and
predicts what they measure; no model is built and nothing trains (the runs themselves are
``python tools/validate_planner.py --builtin --run``, minutes on CPU).

The teacher checkpoint is its ``model_config.json`` alone: ``check_checkpoint_tensors`` (which
reads the dist_checkpointing metadata of a real checkpoint, covered by e2e/test_train.py) is stubbed.
The offline cases' cache is real and complete: it is written with the spec that ``megatron-kd
cache build`` gets from the tool's own ``cache_build_argv``, so ``plan_run`` checking it against
the run also checks that the tool builds the cache the run reads.
"""

import argparse
import importlib.util
import json
import pathlib
import sys

import numpy as np
import pytest

TOOL = pathlib.Path(__file__).resolve().parents[2] / "tools" / "validate_planner.py"
TOPK = 4  # a small K keeps the cache cheap to write; the built-in runs use BUILTIN_TOPK


@pytest.fixture(scope="module")
def vp():
    spec = importlib.util.spec_from_file_location("validate_planner", TOOL)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)


@pytest.fixture
def cases(vp, tmp_path, monkeypatch):
    # where the run's checks read the teacher's tensors
    from megatron_kd.integration import teacher as models
    from megatron_kd.integration.arch import GPTArchConfig

    teacher = tmp_path / "teacher"
    teacher.mkdir()
    arch = GPTArchConfig(**vp._TEACHER_ARCH)
    (teacher / "model_config.json").write_text(
        json.dumps({"format_version": 1, "arch": arch.to_dict(), "extra": {}})
    )
    monkeypatch.setattr(models, "check_checkpoint_tensors", lambda directory, arch=None: arch)
    cache = tmp_path / "cache"
    built = vp.builtin_cases(str(teacher), str(cache))
    offline = [c for c in built if "--kd-topk-cache" in c.train_args]
    assert offline, "the built-in cases must include an offline run"
    _write_cache(vp, offline[0], str(cache), str(teacher), arch.vocab_size)
    return built


def _write_cache(vp, case, cache_dir, teacher_dir, vocab_size):
    """A complete cache with the spec `megatron-kd cache build` would record for this argv."""
    from megatron_kd.cache.format import CacheSpec
    from megatron_kd.cache.identity import dataset_identity, tokenizer_identity
    from megatron_kd.cache.writer import CacheWriter
    from megatron_kd.data.datasets import MockGPTDataset
    from megatron_kd.data.tokenizer import MockTokenizer
    from megatron_kd.training.cache_command import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    argv = vp.cache_build_argv(case.train_args, case.nproc, cache_dir, teacher_dir, TOPK)
    args = parser.parse_args(["build", *argv])
    assert args.mock_data, "the built-in offline cases use --mock-data"
    samples = args.train_iters * args.global_batch_size
    dataset = MockGPTDataset(
        vocab_size=vocab_size, seq_length=args.seq_length, num_samples=samples, seed=args.seed
    )
    spec = CacheSpec(
        teacher_checkpoint=teacher_dir,
        teacher_weights_hash="0" * 64,
        tokenizer=tokenizer_identity(MockTokenizer(vocab_size)),
        vocab_size=vocab_size,
        topk=args.kd_topk,
        seq_length=args.seq_length,
        num_samples=samples,
        dataset_hash=dataset_identity(dataset),
        samples_per_shard=samples,
    )
    writer = CacheWriter(cache_dir, spec)
    ids = np.broadcast_to(np.arange(TOPK), (args.seq_length, TOPK))
    logprobs = np.full((args.seq_length, TOPK), -np.log(TOPK), dtype=np.float32)
    writer.write_shard(0, [writer.encode(ids, logprobs)] * samples)


def test_builtin_cases_cover_every_mode(vp, cases):
    from megatron_kd.integration.args import KD_MODES

    modes = {vp.parse_train_args(c.train_args).kd_mode for c in cases}
    assert modes == set(KD_MODES)


def test_builtin_cases_resolve_and_predict(vp, cases):
    gib = 1 << 30
    # the teacher: h_t=768, V=32000, fp32; every case: G=4 sequences of s=512 tokens
    wire_per_dp_rank = 4 * 512 * 768 * 4  # G/dp * s * h_t * 4 bytes, dp = 1 in every case
    for case in cases:
        args, plan = vp.resolve_run(case.train_args, case.nproc)
        pred = vp.predict(args, plan, on_cpu=True)
        total = sum(pred.terms.values())
        # well above the ~0.35 GiB framework baseline, as the tool's docstring asks
        assert total > 0.5 * gib, (case.name, total)
        assert "reserve (context, NCCL, frag.)" not in pred.terms
        if plan.kd.mode == "colocated":
            assert pred.mode == "colocated-fused" and "teacher weights" in pred.terms
        elif plan.kd.mode == "offline":
            assert pred.mode == "offline-cache" and plan.topk_cache.spec.topk == TOPK
            # CPU: D=2 queued + 1 decoding + 1 in use, b*s tokens, K entries of 12 bytes
            b = args.micro_batch_size
            assert pred.terms["cache reader"] == 4 * b * 512 * TOPK * 12
            assert "teacher weights" not in pred.terms
        else:
            assert pred.mode == "disaggregated"
            assert pred.wire == {
                "dp-rank": wire_per_dp_rank,
                "tp-rank": wire_per_dp_rank / plan.tp,
                "all-ranks": wire_per_dp_rank,
            }
            # the student's copy of the teacher output-layer shard: V/t * h_t * 4 bytes
            assert pred.terms["teacher output-layer shard"] == 32000 // plan.tp * 768 * 4
            assert vp.teacher_rank(plan, case.nproc) == case.nproc - 1
            teacher = vp.predict_teacher(args, plan, on_cpu=True)
            # the teacher rank loads its (untied) output layer too: V * h_t * 4 bytes
            assert teacher["teacher output layer (loaded, not run)"] == 32000 * 768 * 4
            assert "reserve (context, NCCL, frag.)" not in teacher


def test_rows_and_table(vp, cases):
    case = next(c for c in cases if "disaggregated" in c.train_args)
    args, plan = vp.resolve_run(case.train_args, case.nproc)
    pred = vp.predict(args, plan, on_cpu=True)
    baseline = 1 << 28
    row = vp._memory_row(case.name, pred.mode, "cpu_max_rss", pred.terms, 1 << 31, baseline, True)
    # ratio = predicted / (measured - baseline)
    assert row["ratio"] == sum(pred.terms.values()) / ((1 << 31) - baseline)
    row.update(wire_predicted=pred.wire["dp-rank"], wire_counted=[6291456], wire_ok=True)
    table = vp.format_rows([row], with_terms=True)
    assert case.name in table and "equal (6291456 B/step)" in table
    assert "ring slots (D x 1/t seq)" in table


def test_teacher_dtype_mismatch_is_refused(vp, cases):
    case = next(c for c in cases if "colocated" in vp.parse_train_args(c.train_args).kd_mode)
    args, plan = vp.resolve_run(case.train_args + " --kd-teacher-dtype bf16", case.nproc)
    with pytest.raises(ValueError, match="--kd-teacher-dtype bf16 with fp32"):
        vp.predict(args, plan, on_cpu=True)
