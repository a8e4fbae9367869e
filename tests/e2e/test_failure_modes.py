"""Nothing silent, nothing lost: what a run does when the disk, the cache, the teacher or the
scheduler goes wrong (2 gloo ranks, tiny models, the real ``megatron-kd train``).

* a flipped byte in a top-K cache stops offline training before any step uses the shard;
* a non-finite teacher output (colocated hidden states, cached log-probs) raises
  ``FloatingPointError`` naming the step, microbatch and source before the optimizer step, with
  no checkpoint holding it;
* SIGTERM (``--exit-signal-handler``) finishes the step, saves and exits; ``--load`` continues
  with the same losses;
* a save killed half way (SIGKILL) or failing on a full disk leaves the last complete checkpoint,
  which ``--load`` takes, saying so; training then resumes with the same losses.
"""

import errno
import io
import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest
from support.train_cases import STUDENT, cache_build_argv, case_cache_build, case_train, step_losses

from megatron_kd.cache.format import load_manifest

SEQ, GLOBAL_BATCH, ITERS = 32, 4, 4
COMMON = STUDENT + ["--train-iters", str(ITERS), "--eval-interval", "100", "--eval-iters", "0",
                    "--kd-ce-weight", "0.2"]


# --- cases (run on every rank) --------------------------------------------------------------

def _cache_argv(out, teacher_dir, encoding):
    return cache_build_argv(out, teacher_dir, topk=16, seq=SEQ, iters=ITERS,
                            global_batch=GLOBAL_BATCH, encoding=encoding, tp=2)


def case_train_failing(ctx, argv):
    """Train; return ``(error type, message, steps started)`` (the error is expected)."""
    from megatron_kd.commands.train import parse_args, train
    from megatron_kd.training import trainer as trainer_mod

    started = []
    original = trainer_mod.Trainer.train_step

    def spy(self, consumed):
        started.append(consumed)
        return original(self, consumed)

    trainer_mod.Trainer.train_step = spy
    try:
        train(parse_args(argv))
    except Exception as e:  # noqa: BLE001 - the error is what the test looks at
        return type(e).__name__, str(e), len(started)
    finally:
        trainer_mod.Trainer.train_step = original
    return None, "", len(started)


def case_train_nan_teacher(ctx, argv, bad_call):
    """Train with a colocated teacher whose ``bad_call``-th forward (0-based, counted on each
    rank) returns NaN hidden states."""
    import torch

    # the colocated teacher source's builder (the one place a colocated teacher is made)
    from megatron_kd.modes import colocated as sources

    build = sources.build_frozen_teacher
    calls = [0]

    def poisoned(*args, **kwargs):
        model = build(*args, **kwargs)
        if model is None:
            return model
        forward = model.forward

        def nan_forward(*a, **kw):
            out = forward(*a, **kw)
            calls[0] += 1
            return torch.full_like(out, float("nan")) if calls[0] - 1 == bad_call else out

        model.forward = nan_forward
        return model

    sources.build_frozen_teacher = poisoned
    try:
        return case_train_failing(ctx, argv)
    finally:
        sources.build_frozen_teacher = build


def case_sigterm_at_step(ctx, argv, step, rank):
    """Train; rank ``rank`` sends itself SIGTERM during step ``step`` (1-based)."""
    from megatron_kd.commands.train import parse_args, train
    from megatron_kd.training import trainer as trainer_mod

    original = trainer_mod.Trainer.train_step

    def spy(self, consumed):
        out = original(self, consumed)
        if self._step == step and ctx.rank == rank:
            os.kill(os.getpid(), signal.SIGTERM)  # as Slurm would, to one rank first
        return out

    trainer_mod.Trainer.train_step = spy
    try:
        return train(parse_args(argv))
    finally:
        trainer_mod.Trainer.train_step = original


def case_disk_full_at_save(ctx, argv, save_root, full_from_iteration):
    """Train; every file write under ``save_root``'s ``iter_<full_from_iteration>`` fails with
    ENOSPC, as on a full disk."""
    import builtins

    real_open = io.open
    marker = os.path.join(save_root, f"iter_{full_from_iteration:07d}")

    def full_disk_open(file, mode="r", *args, **kwargs):
        if any(c in mode for c in "wax") and str(file).startswith(marker):
            raise OSError(errno.ENOSPC, "No space left on device", str(file))
        return real_open(file, mode, *args, **kwargs)

    io.open = builtins.open = full_disk_open
    try:
        return case_train_failing(ctx, argv)
    finally:
        io.open = builtins.open = real_open


# --- fixtures ---------------------------------------------------------------------------------

def _flip_middle_byte(path):
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0x20
    open(path, "wb").write(bytes(data))


# --- the top-K cache --------------------------------------------------------------------------

@pytest.mark.parametrize("encoding", ["log1p-u11", "fp32"])
def test_flipped_byte_stops_offline_training_before_any_step(pool, teacher, tmp_path, encoding):
    cache = str(tmp_path / "cache")
    pool.run(case_cache_build, _cache_argv(cache, teacher, encoding))
    entry = load_manifest(cache)["shards"][0]  # samples [0, 4): the first step's
    _flip_middle_byte(os.path.join(cache, entry["file"]))
    argv = COMMON + ["--tensor-model-parallel-size", "2", "--kd-mode", "offline",
                     "--kd-topk-cache", cache, "--save", str(tmp_path / "ckpt"),
                     "--save-interval", "1"]
    for kind, message, started in pool.run(case_train_failing, argv):
        assert kind == "CacheCorruptionError", (kind, message)
        assert f"{entry['file']} (samples [0, 4))" in message and "sha256 mismatch" in message
        assert entry["sha256"] in message  # the manifest's; the file's follows it
        assert started == 1  # the first step started and never reached its optimizer step
    assert not os.path.exists(tmp_path / "ckpt" / "latest_checkpointed_iteration.txt")


def test_nan_in_cached_logprobs_names_step_microbatch_and_source(pool, teacher, tmp_path):
    from megatron_kd.cache.format import CacheSpec
    from megatron_kd.cache.reader import TopKCacheReader
    from megatron_kd.cache.writer import CacheWriter

    cache = str(tmp_path / "cache")
    pool.run(case_cache_build, _cache_argv(cache, teacher, "fp32"))
    # A teacher that produced an inf: sample 6 (step 2, microbatch 1) rewritten with one.
    spec = CacheSpec.from_json(load_manifest(cache))
    reader = TopKCacheReader(cache)
    writer = CacheWriter(cache, spec)
    blobs = []
    for i in range(*spec.shard_range(1)):
        ids, logprobs = reader.sample(i)
        if i == 6:
            logprobs = logprobs.copy()
            logprobs[3, 0] = np.inf
        blobs.append(writer.encode(ids, logprobs))
    # the rewritten shard keeps its samples' token fingerprints
    writer.write_shard(1, blobs, [reader.fingerprint(i) for i in range(*spec.shard_range(1))])
    argv = COMMON + ["--tensor-model-parallel-size", "2", "--kd-mode", "offline",
                     "--kd-topk-cache", cache, "--save", str(tmp_path / "ckpt"),
                     "--save-interval", "1"]
    for kind, message, started in pool.run(case_train_failing, argv):
        assert kind == "FloatingPointError", (kind, message)
        assert "at step 2, microbatch 1" in message and "sample 6" in message
        assert spec.shard_file(1) in message and "NaN or inf" in message
        assert started == 2
    ckpt = tmp_path / "ckpt"
    assert sorted(os.listdir(ckpt)) == ["iter_0000001", "latest_checkpointed_iteration.txt"]


def test_nan_teacher_hidden_states_stop_before_the_optimizer_step(pool, teacher, tmp_path):
    # TP 2, one data-parallel rank: 2 microbatches a step; call 3 is step 2, microbatch 1.
    argv = COMMON + ["--tensor-model-parallel-size", "2", "--kd-teacher-load", teacher,
                     "--save", str(tmp_path / "ckpt"), "--save-interval", "1"]
    for kind, message, started in pool.run(case_train_nan_teacher, argv, 3):
        assert kind == "FloatingPointError", (kind, message)
        assert "at step 2, microbatch 1" in message
        assert f"hidden states of the colocated teacher {teacher}" in message
        assert started == 2
    ckpt = tmp_path / "ckpt"
    assert sorted(os.listdir(ckpt)) == ["iter_0000001", "latest_checkpointed_iteration.txt"]


# --- preemption -------------------------------------------------------------------------------

def test_sigterm_saves_exits_and_resumes_with_the_same_losses(pool, teacher, tmp_path):
    base = COMMON + ["--tensor-model-parallel-size", "2", "--kd-teacher-load", teacher]
    straight = step_losses(pool.run(case_train, base)[0])
    ckpt = str(tmp_path / "ckpt")
    flags = base + ["--save", ckpt, "--load", ckpt, "--exit-signal-handler"]
    first = pool.run(case_sigterm_at_step, flags, 2, 1)  # rank 1 only: both must stop
    assert all(s["exit_signal"] for s in first)
    assert [s["iterations"] for s in first] == [2, 2]
    assert open(os.path.join(ckpt, "latest_checkpointed_iteration.txt")).read() == "2"
    second = pool.run(case_train, flags)[0]
    assert second["start_iteration"] == 2 and not second["exit_signal"]
    assert step_losses(first[0]) + step_losses(second) == straight


# --- a save that does not finish ------------------------------------------------------------

_KILLED_SAVE = """
import os, signal, sys
sys.path[:0] = {path!r}
from megatron_kd.training import checkpointing
save = checkpointing.dist_checkpointing.save
def dying_save(state, directory, **kw):
    save(state, directory, **kw)          # every shard written ...
    if state["iteration"] == 3:
        os.kill(os.getpid(), signal.SIGKILL)  # ... and killed before the checkpoint is complete
checkpointing.dist_checkpointing.save = dying_save
from megatron_kd.commands.train import parse_args, run
sys.exit(run(parse_args(sys.argv[1:])))
"""


def test_killed_mid_save_resumes_from_the_last_complete_checkpoint(pool, teacher, tmp_path):
    base = COMMON + ["--kd-teacher-load", teacher]
    straight = step_losses(pool.run(case_train, base + ["--global-batch-size", "4",
                                                        "--tensor-model-parallel-size", "2"])[0])
    ckpt = str(tmp_path / "ckpt")
    argv = base + ["--tensor-model-parallel-size", "1", "--save", ckpt, "--load", ckpt,
                   "--save-interval", "1", "--log-json", str(tmp_path / "log.jsonl")]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", _KILLED_SAVE.format(path=sys.path), *argv],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert sorted(os.listdir(ckpt)) == ["iter_0000001", "iter_0000002", "iter_0000003.partial",
                                        "latest_checkpointed_iteration.txt"]
    proc = subprocess.run([sys.executable, "-m", "megatron_kd", "train", *argv],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "resuming from iteration 2 of" in proc.stderr
    assert "iter_0000003.partial was never finished" in proc.stderr
    steps = [json.loads(line) for line in open(tmp_path / "log.jsonl")]
    losses = {r["step"]: r["loss"] for r in steps if not r.get("eval")}  # the last run wins
    # one process vs TP 2: the same maths in another summation order
    assert [losses[i] for i in range(1, ITERS + 1)] == pytest.approx(straight, rel=1e-5)


def test_full_disk_while_saving_keeps_the_last_checkpoint_and_resumes(pool, teacher, tmp_path):
    base = COMMON + ["--tensor-model-parallel-size", "2", "--kd-teacher-load", teacher]
    straight = step_losses(pool.run(case_train, base)[0])
    ckpt = str(tmp_path / "ckpt")
    flags = base + ["--save", ckpt, "--load", ckpt, "--save-interval", "1"]
    for kind, message, started in pool.run(case_disk_full_at_save, flags, ckpt, 2):
        assert kind == "CheckpointWriteError", (kind, message)
        assert "iter_0000002.partial" in message and "no space left on device" in message
        assert "it needs about" in message and "previous complete checkpoint is untouched" \
            in message
        assert started == 2
    assert open(os.path.join(ckpt, "latest_checkpointed_iteration.txt")).read() == "1"
    assert "iter_0000001" in os.listdir(ckpt) and "iter_0000002" not in os.listdir(ckpt)
    resumed = pool.run(case_train, flags)[0]  # space freed
    assert resumed["start_iteration"] == 1
    assert step_losses(resumed) == straight[1:]
