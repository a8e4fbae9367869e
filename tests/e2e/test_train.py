"""``megatron-kd train`` (colocated) end to end on 2 gloo ranks: TP=2, PP=2, fused == dense,
checkpoint resume, and bad input refused before any step.

One pool of 2 ranks serves the module; every run is a tiny model (2 layers, h 32, vocabulary
500 padded to 512, sequence 32) on synthetic tokens, a few seconds each.
"""

import json
import os

import pytest
import torch
from support.train_cases import (
    LOG_FIELDS,
    STUDENT,
    TEACHER_ARCH,
    case_plan_error,
    case_train,
    step_losses,
    student_argv,
)

from megatron_kd.training.run_config import RunConfig, parse_args


@pytest.fixture(scope="module")
def teacher_dir(teacher):
    return teacher  # the tier's tiny teacher (tests/e2e/conftest.py)


def _read_log(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


@pytest.mark.parametrize("layout", ["--tensor-model-parallel-size 2",
                                    "--pipeline-model-parallel-size 2"])
def test_trains_and_logs(pool, teacher_dir, tmp_path, layout):
    log = tmp_path / "log.jsonl"
    argv = STUDENT + ["--train-iters", "8", "--eval-interval", "4", "--eval-iters", "1",
                      "--kd-teacher-load", teacher_dir, "--kd-ce-weight", "0.2",
                      "--log-json", str(log)] + layout.split()
    s0, s1 = pool.run(case_train, argv)
    assert step_losses(s0) == step_losses(s1)  # every rank reports the same reduced loss
    losses = step_losses(s0)
    assert len(losses) == 8 and all(torch.isfinite(torch.tensor(losses)))
    assert sum(losses[-2:]) < sum(losses[:2])  # it learns
    records = _read_log(log)
    steps = [r for r in records if not r.get("eval")]
    evals = [r for r in records if r.get("eval")]
    assert [r["step"] for r in steps] == list(range(1, 9))
    for r in steps:
        for key in LOG_FIELDS:
            assert r[key] is not None, key
        assert r["peak_mem_bytes"] > 0 and r["tokens_per_s"] > 0
        # the trained loss is the weighted sum of its logged parts
        assert r["loss"] == pytest.approx(r["kd_loss"] + 0.2 * r["lm_loss"], rel=1e-5)
    assert [e["step"] for e in evals] == [4, 8]
    assert all(e["eval_lm_loss"] > 0 for e in evals)
    assert evals[-1]["eval_kd_loss"] < evals[0]["eval_kd_loss"]


# Each case's flags and, written out apart from them, the loss they mean (defaults included:
# beta 0.5, kd weight 1, ce weight 0, temperature 1).
@pytest.mark.parametrize("kd, meant", [
    ("--kd-loss forward_kl --kd-temperature 2 --kd-ce-weight 0.5",
     {"kind": "forward_kl", "temperature": 2.0, "beta": 0.5, "kd_weight": 1.0, "ce_weight": 0.5}),
    ("--kd-loss reverse_kl",
     {"kind": "reverse_kl", "temperature": 1.0, "beta": 0.5, "kd_weight": 1.0, "ce_weight": 0.0}),
    ("--kd-loss jsd --kd-beta 0.3 --kd-weight 0.7",
     {"kind": "jsd", "temperature": 1.0, "beta": 0.3, "kd_weight": 0.7, "ce_weight": 0.0}),
    ("--kd-temperature 2 --kd-ce-weight 0.5 --kd-loss-elementwise compiled",
     {"kind": "forward_kl", "temperature": 2.0, "beta": 0.5, "kd_weight": 1.0, "ce_weight": 0.5}),
])
def test_fused_equals_dense(pool, teacher_dir, kd, meant):
    argv = STUDENT + ["--train-iters", "4", "--eval-interval", "100", "--eval-iters", "0",
                      "--tensor-model-parallel-size", "2", "--kd-teacher-load",
                      teacher_dir] + kd.split()
    # the flags parse to the loss the test means ...
    parsed = RunConfig.from_args(parse_args(argv)).kd.loss
    assert {key: getattr(parsed, key) for key in meant} == meant
    # ... and the dense reference is given that loss as these literals, not the parsed
    # configuration the fused loss trains on: a flag read into the wrong field (or none) makes
    # the two differ. Vocabulary: the teacher's true 500 (the padded 512's last 12 columns are
    # padding); no label is -100 in the synthetic data.
    literal = {**meant, "vocab_size": 500, "ignore_index": -100}
    assert TEACHER_ARCH["vocab_size"] == literal["vocab_size"]
    fused = step_losses(pool.run(case_train, argv)[0])
    dense = step_losses(pool.run(case_train, argv, literal)[0])
    # fp32 throughout; the two differ only in summation order (windowed online softmax vs
    # one log_softmax). Measured: <= 7e-7 relative over 4 steps (jsd, loss ~0.16; the KLs
    # ~5e-8); 5e-6 leaves headroom for other BLAS builds while a wrong gradient (even one
    # rank's shard) moves step-2+ losses by > 1e-4.
    assert fused == pytest.approx(dense, rel=5e-6)


@pytest.mark.parametrize("layout", ["--tensor-model-parallel-size 2",
                                    "--pipeline-model-parallel-size 2"])
def test_resume_gives_identical_losses(pool, teacher_dir, tmp_path, layout):
    common = STUDENT + ["--train-iters", "6", "--eval-interval", "100", "--eval-iters", "0",
                        "--kd-teacher-load", teacher_dir, "--kd-ce-weight", "0.1",
                        "--hidden-dropout", "0.1"] + layout.split()
    straight = step_losses(pool.run(case_train, common)[0])
    ckpt = str(tmp_path / "ckpt")
    first = pool.run(case_train, common + ["--save", ckpt, "--exit-after-iters", "3"])[0]
    assert os.path.isdir(os.path.join(ckpt, "iter_0000003"))
    second = pool.run(case_train, common + ["--load", ckpt, "--save", ckpt])[0]
    assert second["start_iteration"] == 3
    # Same data position, weights, Adam moments, LR schedule and RNG (dropout is on): the
    # resumed steps are bit-identical on CPU.
    assert step_losses(first) + step_losses(second) == straight


def test_bf16_teacher(pool, teacher_dir):
    argv = STUDENT + ["--train-iters", "3", "--eval-interval", "3", "--eval-iters", "1",
                      "--pipeline-model-parallel-size", "2", "--kd-teacher-load", teacher_dir]
    fp32 = pool.run(case_train, argv)[0]
    bf16 = pool.run(case_train, argv + ["--kd-teacher-dtype", "bf16"])[0]
    # bf16 keeps 8 mantissa bits (relative rounding 2^-9 ~ 2e-3 per teacher weight and
    # activation); averaged over 128 tokens the KD loss moves far less than that.
    assert step_losses(bf16) == pytest.approx(step_losses(fp32), rel=5e-3)
    assert step_losses(bf16) != step_losses(fp32)  # the teacher really ran in bf16
    ev = bf16["evals"][0]
    assert ev["eval_teacher_lm_loss"] == pytest.approx(fp32["evals"][0]["eval_teacher_lm_loss"],
                                                       rel=5e-3)


def test_student_checkpoint_loads_as_model(pool, teacher_dir, tmp_path):
    """A training checkpoint is also a plain model checkpoint (e.g. a later teacher)."""
    ckpt = str(tmp_path / "ckpt")
    argv = STUDENT + ["--train-iters", "2", "--eval-iters", "0", "--save", ckpt,
                      "--kd-teacher-load", teacher_dir, "--tensor-model-parallel-size", "2"]
    pool.run(case_train, argv)
    from megatron_kd.integration.checkpoint import (
        check_checkpoint_tensors,
        read_checkpoint_arch,
    )
    arch = read_checkpoint_arch(os.path.join(ckpt, "iter_0000002"))
    assert arch.hidden_size == 32 and arch.vocab_size == TEACHER_ARCH["vocab_size"]
    check_checkpoint_tensors(os.path.join(ckpt, "iter_0000002"))
    # ... and a training directory is a valid --kd-teacher-load (its newest iteration)
    argv = STUDENT + ["--train-iters", "1", "--eval-iters", "0", "--kd-teacher-load", ckpt,
                      "--pipeline-model-parallel-size", "2"]
    summary = pool.run(case_train, argv)[0]
    assert summary["teacher_arch"]["hidden_size"] == 32


def test_ce_only_without_teacher(pool):
    argv = STUDENT + ["--train-iters", "6", "--eval-iters", "0", "--vocab-size", "300",
                      "--kd-weight", "0", "--kd-ce-weight", "1",
                      "--tensor-model-parallel-size", "2"]
    s = pool.run(case_train, argv)[0]
    assert s["steps"][0]["kd_loss"] is None
    assert s["steps"][-1]["lm_loss"] < s["steps"][0]["lm_loss"]


def _corrupt_copy(src, dst, **arch_changes):
    import shutil

    shutil.copytree(src, dst)
    path = os.path.join(dst, "model_config.json")
    with open(path) as f:
        payload = json.load(f)
    payload["arch"].update(arch_changes)
    with open(path, "w") as f:
        json.dump(payload, f)
    return dst


def test_bad_teacher_hidden_size(pool, teacher_dir, tmp_path):
    bad = _corrupt_copy(teacher_dir, str(tmp_path / "bad"), hidden_size=64)
    argv = STUDENT + ["--train-iters", "2", "--kd-teacher-load", bad,
                      "--tensor-model-parallel-size", "2"]
    for msg, steps in pool.run(case_plan_error, argv):
        assert steps == 0
        assert "embedding.word_embeddings.weight has shape (512, 48), expected (512, 64)" in msg


def test_bad_teacher_vocab(pool, teacher_dir):
    argv = STUDENT + ["--train-iters", "2", "--kd-teacher-load", teacher_dir,
                      "--vocab-size", "600", "--tensor-model-parallel-size", "2"]
    for msg, steps in pool.run(case_plan_error, argv):
        assert steps == 0 and "--vocab-size 600 != the teacher's vocabulary 500" in msg


def test_bad_tp_heads(pool, teacher_dir):
    argv = student_argv(num_attention_heads=3, num_query_groups=None, hidden_size=48) + [
        "--train-iters", "2", "--kd-teacher-load", teacher_dir, "--tensor-model-parallel-size", "2"]
    for msg, steps in pool.run(case_plan_error, argv):
        assert steps == 0 and "tensor-parallel size 2 does not divide num_attention_heads=3" in msg


def test_missing_data_path(pool, tmp_path):
    tok = tmp_path / "tokenizer.json"
    from support.text import write_tokenizer
    write_tokenizer(tok)
    argv = student_argv(mock_data=None) + [
        "--train-iters", "2", "--kd-weight", "0", "--kd-ce-weight", "1",
        "--data-path", str(tmp_path / "nowhere"), "--tokenizer-model", str(tok)]
    for msg, steps in pool.run(case_plan_error, argv):
        assert steps == 0 and "nowhere.bin" in msg and "megatron-kd preprocess" in msg
    argv_no_data = student_argv(mock_data=None) + [
        "--train-iters", "2", "--kd-weight", "0", "--kd-ce-weight", "1"]
    for msg, steps in pool.run(case_plan_error, argv_no_data):
        assert steps == 0 and "no training data" in msg


def test_kd_weight_needs_teacher():
    from support.train_cases import check_flags
    with pytest.raises(ValueError, match="needs --kd-teacher-load"):
        check_flags(STUDENT + ["--train-iters", "2", "--vocab-size", "300"], 2)


@pytest.mark.parametrize("flag,message", [
    ("--bf16", "--bf16 needs a GPU"),
    ("--use-distributed-optimizer", "--use-distributed-optimizer needs a GPU: Megatron-Core's "
                                    "DistributedOptimizer accepts only CUDA parameters")])
def test_gpu_only_optimizers_are_refused_on_cpu(flag, message):
    # Megatron-Core's mixed-precision and distributed optimizers raise a TypeError deep in their
    # constructors on CPU tensors; the plan refuses them first, naming the flag
    from support.train_cases import check_flags
    with pytest.raises(ValueError, match=message):
        check_flags(STUDENT + ["--train-iters", "2", "--vocab-size", "300",
                                       "--kd-weight", "0", "--kd-ce-weight", "1", flag], 2)
