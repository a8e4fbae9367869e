"""``megatron-kd teacher serve`` and ``--kd-mode disaggregated``: teacher replicas as processes
(and torchrun worlds) of their own, students connecting by endpoint, on gloo.

Per-step losses equal colocated training (fp32, 1e-5 relative after 5 steps) for: student TP 2
(teacher TP 1: the TP sizes differ), student PP 2, teacher TP 2, teacher PP 2, two replicas
serving four student data-parallel ranks; two student runs with different seeds share one
replica at once; a teacher of another hidden size is refused at connect naming both values; the
only replica killed mid-run gives ``TeacherUnavailableError`` within the timeout, naming it, with
no checkpoint half written. Wire bytes each way equal the planner's figure. A replica of two
ranks whose torchrun alone is SIGKILLed leaves within 10 s, its endpoint record withdrawn.
"""

import os
import signal
import subprocess
import sys
import time

import pytest
from support.train_cases import (
    STUDENT,
    TEACHER_ARCH,
    case_make_teacher,
    case_train,
    step_losses,
)

from megatron_kd.testing.replicas import process_alive

pytestmark = pytest.mark.filterwarnings("ignore")

BASE = STUDENT + ["--train-iters", "5", "--eval-interval", "100", "--eval-iters", "0",
                  "--kd-ce-weight", "0.2", "--kd-temperature", "1.5"]
SEQ, MBS, GBS = 32, 2, 4


def case_train_failing(ctx, argv, kill_pids=(), at_step=None):
    """Train; with ``at_step``, rank 0 SIGKILLs ``kill_pids`` as that step starts. Returns
    ``(error type, message, seconds from the kill to the error, steps done)``."""
    import signal

    from megatron_kd.commands.train import parse_args, train
    from megatron_kd.training import trainer as trainer_mod

    original, killed = trainer_mod.Trainer.train_step, []

    def spy(self, consumed):
        if at_step is not None and self.run.global_batch_size and \
                consumed // self.run.global_batch_size + 1 == at_step and not killed:
            if ctx.rank == 0:
                for pid in kill_pids:
                    os.kill(pid, signal.SIGKILL)
            killed.append(time.monotonic())
        return original(self, consumed)

    trainer_mod.Trainer.train_step = spy
    try:
        summary = train(parse_args(argv))
        return None, "", None, summary["iterations"]
    except Exception as e:  # noqa: BLE001 - the error is what the test looks at
        return type(e).__name__, str(e), time.monotonic() - killed[0] if killed else None, None
    finally:
        trainer_mod.Trainer.train_step = original


def _disaggregated(argv, endpoint, *flags):
    return argv + ["--kd-mode", "disaggregated", "--kd-teacher-endpoint", str(endpoint), *flags]


def _assert_same_losses(dis, colocated):
    # fp32 everywhere. The colocated teacher runs tensor-parallel over the student's TP group, a
    # replica with its own layout: the same maths in another summation order (and another
    # batching of the requests), so losses agree to ~1e-7; 1e-5 catches any misaligned sample.
    assert step_losses(dis) == pytest.approx(step_losses(colocated), rel=1e-5)


@pytest.mark.parametrize("student, teacher_layout", [
    (["--tensor-model-parallel-size", "2"], {}),  # student TP 2, teacher TP 1
    (["--pipeline-model-parallel-size", "2"], {}),  # student PP 2
    (["--tensor-model-parallel-size", "2"], {"tp": 2}),  # teacher TP 2
    ([], {"pp": 2}),  # teacher PP 2 serving 2 student DP ranks
], ids=["studentTP2", "studentPP2", "teacherTP2", "teacherPP2_studentDP2"])
def test_disaggregated_equals_colocated(pool, teacher, replicas, tmp_path, student,
                                        teacher_layout):
    argv = BASE + ["--kd-teacher-load", teacher] + student
    replica = replicas(teacher, wait=False, **teacher_layout)  # starts while colocated runs
    colocated = pool.run(case_train, argv)[0]
    replica.wait_ready()
    log = tmp_path / "log.jsonl"
    dis = pool.run(case_train, _disaggregated(argv, tmp_path / "endpoint", "--log-json",
                                              str(log)))
    assert step_losses(dis[0]) == step_losses(dis[1])
    _assert_same_losses(dis[0], colocated)
    h_t = TEACHER_ARCH["hidden_size"]
    for record in dis[0]["steps"]:  # exactly the planner's bytes (see test_planner_counts)
        assert record["kd_wire_bytes"] == GBS * SEQ * h_t * 4  # fp32 back
        assert record["kd_wire_bytes_to_teacher"] == GBS * SEQ * 4  # int32 token ids out
    status = replica.stop()  # its last record counts every request it served
    assert replica.requests_served() > 0, (status, replica.events(), replica.stderr_tail())


def test_two_replicas_serve_four_student_dp_ranks(dist_pool_factory, teacher, replicas, tmp_path):
    pool4 = dist_pool_factory(4)
    argv = BASE[:BASE.index("--global-batch-size")] + ["--global-batch-size", "8"] + \
        BASE[BASE.index("--global-batch-size") + 2:] + ["--kd-teacher-load", teacher]
    first, second = replicas(teacher, count=2, wait=False)  # start while colocated runs
    colocated = pool4.run(case_train, argv)[0]
    first.wait_ready()
    second.wait_ready()
    dis = pool4.run(case_train, _disaggregated(argv, tmp_path / "endpoint"))
    _assert_same_losses(dis[0], colocated)
    first.stop()
    second.stop()
    # least-loaded choice: the four connections spread over both replicas
    assert first.requests_served() > 0 and second.requests_served() > 0, \
        [(r.final_stats(), r.stderr_tail()) for r in (first, second)]


def test_two_runs_with_different_seeds_share_one_replica(pool, teacher, replicas, tmp_path):
    endpoint = tmp_path / "endpoint"
    replica = replicas(teacher, wait=False)
    one = BASE + ["--kd-teacher-load", teacher, "--tensor-model-parallel-size", "2"]
    other = BASE + ["--kd-teacher-load", teacher, "--seed", "77", "--train-iters", "8",
                    "--no-progress"]
    # the references, while the replica starts: the other run colocated (a world of one) ...
    other_colocated = subprocess.Popen([sys.executable, "-m", "megatron_kd", "train", *other,
                                        "--log-json", str(tmp_path / "other_co.jsonl")],
                                       stderr=subprocess.PIPE, text=True,
                                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    colocated = pool.run(case_train, one)[0]  # ... and the pool's run colocated
    _, err = other_colocated.communicate(timeout=600)
    assert other_colocated.returncode == 0, err[-2000:]
    replica.wait_ready()
    # the other run (a world of one) trains through the replica while the pool's run does
    background = subprocess.Popen([sys.executable, "-m", "megatron_kd", "train",
                                   *_disaggregated(other, endpoint), "--log-json",
                                   str(tmp_path / "other_dis.jsonl")],
                                  stderr=subprocess.PIPE, text=True,
                                  env={**os.environ, "OMP_NUM_THREADS": "1"})
    dis = pool.run(case_train, _disaggregated(one, endpoint))[0]
    assert background.wait(timeout=600) == 0, background.stderr.read()[-2000:]
    _assert_same_losses(dis, colocated)

    def losses(path):
        import json
        return [json.loads(line)["loss"] for line in open(path) if '"eval"' not in line]

    assert losses(tmp_path / "other_dis.jsonl") == pytest.approx(
        losses(tmp_path / "other_co.jsonl"), rel=1e-5)


def test_teacher_of_another_hidden_size_is_refused_at_connect(pool, teacher, replicas, tmp_path):
    other = str(tmp_path / "other_teacher")
    pool.run(case_make_teacher, other, dict(TEACHER_ARCH, hidden_size=40))
    replicas(other)
    argv = _disaggregated(BASE + ["--kd-teacher-load", teacher], tmp_path / "endpoint")
    for kind, message, _, _ in pool.run(case_train_failing, argv):
        assert kind == "TeacherMismatchError", (kind, message)
        assert "hidden_size: teacher has 40, this run expects 48" in message
        assert "checkpoint: teacher has" in message


def test_killing_the_only_replica_raises_within_the_timeout(pool, teacher, replicas, tmp_path):
    replica = replicas(teacher)
    ckpt = tmp_path / "ckpt"
    argv = _disaggregated(BASE + ["--kd-teacher-load", teacher, "--tensor-model-parallel-size",
                                  "2", "--save", str(ckpt), "--save-interval", "100"],
                          tmp_path / "endpoint", "--kd-teacher-timeout", "4")
    for kind, message, seconds, _ in pool.run(case_train_failing, argv, replica.pids, 3):
        assert kind == "TeacherUnavailableError", (kind, message)
        assert str(tmp_path / "endpoint") in message and replica.replica in message
        assert seconds < 4 + 8  # the timeout, then the search for another replica, + slack
    assert not ckpt.exists() or os.listdir(ckpt) == []  # nothing half written


def test_replica_ranks_leave_when_their_launcher_is_killed(teacher, replicas):
    replica = replicas(teacher, tp=2)  # a torchrun of two workers, each in a session of its own
    workers = [pid for pid in replica.pids if pid != replica.proc.pid]
    assert len(workers) >= 2, replica.pids
    record = replica.endpoint / replica.record_file
    assert record.is_file()
    os.kill(replica.proc.pid, signal.SIGKILL)  # the launcher only
    replica.proc.wait(timeout=30)
    deadline = time.monotonic() + 10.0  # the bound (default grace 5 s + 0.5 s poll)
    while any(process_alive(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [pid for pid in workers if process_alive(pid)]
    assert left == [], f"workers {left} still running 10 s after their launcher's SIGKILL"
    assert not record.exists()  # withdrawn: no student is sent to a replica that is gone
