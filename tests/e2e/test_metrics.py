"""TensorBoard, W&B, timers and ``megatron-kd report``, read back after real short runs.

* colocated, with Megatron-LM's TensorBoard / W&B / timer flags: TensorBoard's own event reader
  and W&B's offline run directory hold every scalar of every step, equal to the JSON log's;
* disaggregated against a real replica: the wire, wait, ring and replica scalars, and the
  replica's own ``teacher/`` scalars;
* a deliberately slow teacher shows the student waiting and an empty ring, a teacher kept
  ahead (the student asks only for responses already there) next to no wait and a full ring;
  ``megatron-kd report`` plots both runs and tabulates them.
"""

import os
import statistics

import pytest
from support.scalars import records, tensorboard_scalars, wandb_history
from support.train_cases import STUDENT, case_train_slowly

pytestmark = pytest.mark.filterwarnings("ignore")


def test_tensorboard_and_wandb_hold_the_json_log(pool, teacher, tmp_path, monkeypatch):
    pytest.importorskip("tensorboard")
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    log, tb, wb = tmp_path / "run.jsonl", tmp_path / "tb", tmp_path / "wandb"
    argv = STUDENT + ["--train-iters", "4", "--eval-interval", "2", "--eval-iters", "1",
                      "--kd-teacher-load", teacher, "--kd-ce-weight", "0.3",
                      "--log-json", str(log), "--tensorboard-dir", str(tb),
                      "--log-timers-to-tensorboard", "--log-throughput",
                      "--log-memory-to-tensorboard", "--timing-log-level", "1",
                      "--wandb-project", "kd-test", "--wandb-exp-name", "metrics",
                      "--wandb-save-dir", str(wb)]
    import subprocess
    import sys

    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="offline", WANDB_SILENT="true")
    proc = subprocess.run([sys.executable, "-m", "megatron_kd", "train", *argv], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    logged = records(log)
    steps = [r for r in logged if "step_time_s" in r]
    evals = [r for r in logged if r.get("eval")]
    assert len(steps) == 4 and [e["step"] for e in evals] == [2, 4]
    scalars = tensorboard_scalars(tb)
    by_name = {"lm loss": "lm_loss", "kd loss": "kd_loss", "total loss": "loss",
               "learning-rate": "lr", "grad-norm": "grad_norm", "iteration-time": "step_time_s",
               "throughput": "tokens_per_s", "mem-allocated-bytes": "peak_mem_bytes"}
    for tag, key in by_name.items():
        assert set(scalars[tag]) == {1, 2, 3, 4}, tag
        for r in steps:  # TensorBoard stores float32
            assert scalars[tag][r["step"]] == pytest.approx(r[key], rel=1e-6), (tag, r["step"])
        assert f"{tag} vs samples" in scalars
    assert scalars["batch-size"][1] == 4
    # where the step's time went: every phase timed, the parts inside the whole
    for r in steps:
        t = r["timers"]
        assert set(t) == {"forward-backward", "teacher-forward", "teacher-wait",
                          "loss-forward", "optimizer"}
        assert 0 < t["teacher-forward"] < t["forward-backward"] <= r["step_time_s"]
        assert 0 < t["loss-forward"] < t["forward-backward"] and t["optimizer"] > 0
        assert scalars["timers/forward-backward"][r["step"]] == pytest.approx(
            t["forward-backward"], rel=1e-6)
    for e in evals:
        assert scalars["lm loss validation"][e["step"]] == pytest.approx(e["eval_lm_loss"],
                                                                         rel=1e-6)
        assert scalars["teacher lm loss validation"][e["step"]] == pytest.approx(
            e["eval_teacher_lm_loss"], rel=1e-6)
        assert scalars["kd/student - teacher lm loss"][e["step"]] == pytest.approx(
            e["eval_lm_loss"] - e["eval_teacher_lm_loss"], rel=1e-5)
        assert scalars["kd/validation kl"][e["step"]] == pytest.approx(e["eval_kd_kl"],
                                                                       rel=1e-6)
        assert scalars["kd/validation top-1 agreement"][e["step"]] == pytest.approx(
            e["eval_top1_agreement"], rel=1e-6)
    # W&B, offline: the run's directory, read back with W&B's own reader of its run file
    runs = [d for d in (wb / "wandb").iterdir() if d.name.startswith("offline-run-")]
    assert len(runs) == 1
    history = wandb_history(runs[0])
    for r in steps:
        row = history[r["step"]]
        assert row["lm loss"] == pytest.approx(r["lm_loss"], rel=1e-12)
        assert row["kd loss"] == pytest.approx(r["kd_loss"], rel=1e-12)
        assert row["learning-rate"] == pytest.approx(r["lr"], rel=1e-12)
    assert history[4]["lm loss validation"] == pytest.approx(evals[-1]["eval_lm_loss"],
                                                             rel=1e-12)
    assert history[4]["kd/validation top-1 agreement"] == pytest.approx(
        evals[-1]["eval_top1_agreement"], rel=1e-12)


def _disaggregated(pool, teacher, tmp_path, replicas, *, teacher_sleep, teacher_ahead, steps=6):
    replica = replicas(teacher, sleep_per_token=teacher_sleep,
                       extra=("--tensorboard-dir", str(tmp_path / "tb_teacher")))
    log = tmp_path / "run.jsonl"
    argv = STUDENT + ["--train-iters", str(steps), "--eval-iters", "0", "--eval-interval",
                      "100", "--kd-teacher-load", teacher, "--kd-mode", "disaggregated",
                      "--kd-teacher-endpoint", str(replica.endpoint), "--kd-prefetch-depth",
                      "2", "--log-json", str(log), "--tensorboard-dir", str(tmp_path / "tb")]
    summary = pool.run(case_train_slowly, argv, 0.0, (), teacher_ahead)[0]
    replica.stop()
    return [r for r in records(log) if "step_time_s" in r], log, summary["step_wall_s"]


def test_slow_and_fast_teacher_in_scalars_and_report(pool, teacher, tmp_path, replicas):
    pytest.importorskip("tensorboard")
    pytest.importorskip("matplotlib")
    # slow: 0.8 s a microbatch (2 x 32 tokens) against a student that does not wait itself.
    # The student's own work overlaps the teacher's (prefetch depth 2), so its wait a
    # microbatch is the teacher's time less its own: on a loaded 2-core CI machine its own is
    # up to ~0.3 s a microbatch (0.4 s of sleep once left it waiting only 44% of its step)
    (tmp_path / "slow").mkdir()
    slow, slow_log, slow_walls = _disaggregated(pool, teacher, tmp_path / "slow", replicas,
                                                teacher_sleep=0.8 / 64, teacher_ahead=False)
    # fast: the real teacher, each microbatch asked for only once every prefetched response is
    # there (held by the student, not raced against a sleep)
    (tmp_path / "fast").mkdir()
    fast, fast_log, _ = _disaggregated(pool, teacher, tmp_path / "fast", replicas,
                                       teacher_sleep=0.0, teacher_ahead=True)
    for rows in (slow, fast):
        assert len(rows) == 6
        for r in rows:
            assert r["kd_live_replicas"] == 1 and r["failovers"] == 0
            assert r["kd_wire_bytes"] == 4 * 32 * 48 * 4  # G=4 x s=32 x h_t=48, fp32
    steady = slice(2, -1)  # after the first requests' head start, before the drained end
    slow_wait = statistics.mean(r["kd_teacher_wait_s"] for r in slow[steady])
    slow_step = statistics.mean(r["step_time_s"] for r in slow[steady])
    fast_wait = statistics.mean(r["kd_teacher_wait_s"] for r in fast[steady])
    # relative, not absolute: the slow teacher's student spends most of its step waiting (a
    # step is >= 1.6 s of teacher sleep, the student's own work a small part of it); the fast
    # one takes responses already there, a small fraction of that wait
    assert slow_wait > 0.5 * slow_step and fast_wait < 0.1 * slow_wait
    # behind the slow teacher at most 1 of 2 there (the median of the steady steps: it holds
    # while a student microbatch takes less than the teacher's 0.8 s); the fast run's ring is
    # full at every ask, by construction
    assert statistics.median(r["kd_ring_occupancy"] for r in slow[steady]) <= 0.5
    assert [r["kd_ring_occupancy"] for r in fast] == [1.0] * 6
    # TensorBoard: the student's scalars equal the JSON log's; the replica wrote its own
    scalars = tensorboard_scalars(tmp_path / "slow" / "tb")
    for r in slow:
        assert scalars["kd/teacher-wait-s"][r["step"]] == pytest.approx(
            r["kd_teacher_wait_s"], rel=1e-5, abs=1e-7)
        assert scalars["kd/ring-occupancy"][r["step"]] == pytest.approx(r["kd_ring_occupancy"])
        assert scalars["kd/wire-bytes"][r["step"]] == r["kd_wire_bytes"]
        assert scalars["kd/wire-bytes-out"][r["step"]] == r["kd_wire_bytes_to_teacher"]
        assert scalars["kd/live-replicas"][r["step"]] == 1
        assert scalars["kd/failovers"][r["step"]] == 0
        # each replica's rate for this run: the step's 4 x 32 tokens over the step's time as
        # the test measured it around the trainer's step (the two clocks apart by a call, or a
        # preemption on a busy machine: 5%; a rate of one microbatch's tokens would be 2x off)
        (replica, rate), = r["kd_replica_tokens_per_s"].items()
        assert rate == pytest.approx(4 * 32 / slow_walls[r["step"] - 1], rel=0.05)
        assert scalars[f"kd/replica-{replica}/tokens-per-s"][r["step"]] == pytest.approx(
            rate, rel=1e-6)
    served = tensorboard_scalars(tmp_path / "slow" / "tb_teacher")
    assert max(served["teacher/requests"].values()) >= 12  # 6 steps x 2 microbatches
    assert max(served["teacher/tokens"].values()) >= 12 * 64
    # the report: every plot, and a table with both runs
    from megatron_kd.commands.report import read_run, write_report

    out = tmp_path / "report"
    written = write_report([read_run(f"slow teacher={slow_log}"),
                            read_run(f"fast teacher={fast_log}")], str(out))
    for name in ("loss.png", "throughput.png", "teacher.png", "memory.png"):
        assert os.path.getsize(written[name]) > 10_000, name
    table = (out / "summary.md").read_text()
    slow_row = next(line for line in table.splitlines() if line.startswith("| slow teacher"))
    fast_row = next(line for line in table.splitlines() if line.startswith("| fast teacher"))
    # its median teacher wait a step: the logs' own, to the table's 4 decimals
    for row, rows in ((slow_row, slow), (fast_row, fast)):
        median = statistics.median(r["kd_teacher_wait_s"] for r in rows)
        assert float(row.split("|")[9]) == pytest.approx(median, abs=5e-5)
