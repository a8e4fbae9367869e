"""Teacher failover: a run survives losing replicas and takes on new ones, with the same losses.

gloo, tiny models, replicas as processes of their own (``megatron-kd teacher serve``):

* 2 replicas, 2 student data-parallel ranks: one replica SIGKILLed mid-run; the run finishes
  with the per-step losses of colocated training (1e-5 relative) and the failover is logged;
  restarted, the replica takes work again (both replicas' request counts grow);
* the only replica SIGKILLed and a new one started within the timeout: the run continues with
  the same losses;
* a replica that stalls (SIGSTOP) is dropped after the timeout; woken (SIGCONT), it cannot
  deliver anything into the run (its links are gone; headers name the connection) and the losses
  stay exact.

The run is parked at known steps (``case_train_slowly``'s held files) while the test kills,
stops or starts replicas: nothing races the run's own pace.
"""

import signal

import pytest
from support.background import Background, log_records, steps_done, wait_for
from support.train_cases import (
    STUDENT,
    case_train,
    case_train_slowly,
    step_losses,
)

pytestmark = pytest.mark.filterwarnings("ignore")

STEPS = 26
BASE = STUDENT + ["--train-iters", str(STEPS), "--eval-interval", "1000", "--eval-iters", "0",
                  "--kd-ce-weight", "0.2", "--lr", "1e-3"]


@pytest.fixture(scope="module")
def colocated(pool, teacher):
    return step_losses(pool.run(case_train, BASE + ["--kd-teacher-load", teacher])[0])


def _argv(teacher, tmp_path, timeout_s):
    return BASE + ["--kd-teacher-load", teacher, "--kd-mode", "disaggregated",
                   "--kd-teacher-endpoint", str(tmp_path / "endpoint"), "--kd-teacher-timeout",
                   str(timeout_s), "--log-json", str(tmp_path / "run.jsonl")]


def test_killed_replica_fails_over_and_a_restarted_one_takes_work(pool, teacher, colocated,
                                                                   replicas, tmp_path):
    first, second = replicas(teacher, count=2)
    log = tmp_path / "run.jsonl"
    # the run parks after step 3 (the kill) and after step 8 (the restart: a replica's start-up
    # on a loaded machine may outlast the run); 18 steps then leave >= 2 rebalance checks (every
    # 8 requests). A killed replica's links fail at once: the timeout only bounds finding the
    # other one (generous: no stall is meant here).
    at_kill, at_restart = tmp_path / "hold-3", tmp_path / "hold-8"
    at_kill.touch()
    at_restart.touch()
    run = Background(pool, case_train_slowly, _argv(teacher, tmp_path, 60), 0.0,
                     ((str(at_kill), 3), (str(at_restart), 8)))
    wait_for(lambda: steps_done(log) >= 3)
    first.kill(signal.SIGKILL)
    at_kill.unlink()
    wait_for(lambda: steps_done(log) >= 8)
    assert steps_done(log) == 8
    # a step needs its responses: by step 8 the requests sent to the dead replica have failed
    assert any(r.get("event") == "failover" for r in log_records(log))
    served_at_restart = second.requests_served()
    third = replicas(teacher)  # the restart: a new process at the same endpoint
    at_restart.unlink()
    summary = run.join()[0]
    assert step_losses(summary) == pytest.approx(colocated, rel=1e-5)
    events = [r for r in log_records(log) if r.get("event") == "failover"]
    assert len(events) == 1
    event = events[0]
    assert first.replica in event["replica_lost"] and second.replica in event["replica_taken"]
    # found when the link failed, not at the timeout
    assert event["requests_resent"] >= 1 and event["seconds_lost"] < 60 / 2
    assert {"time", "step", "dp_rank"} <= set(event)
    second.stop()
    third.stop()
    assert third.requests_served() > 0  # the restarted replica took work...
    assert second.requests_served() > served_at_restart  # ... and the other kept serving


def test_only_replica_killed_and_replaced_within_the_timeout(pool, teacher, colocated, replicas,
                                                             tmp_path):
    only = replicas(teacher)
    log, parked = tmp_path / "run.jsonl", tmp_path / "hold-3"
    parked.touch()
    run = Background(pool, case_train_slowly, _argv(teacher, tmp_path, 120), 0.0,
                     ((str(parked), 3),))
    wait_for(lambda: steps_done(log) >= 3)  # parked: the kill and the start come mid-run
    only.kill(signal.SIGKILL)
    replacement = replicas(teacher)
    parked.unlink()
    summary = run.join()[0]
    assert step_losses(summary) == pytest.approx(colocated, rel=1e-5)
    events = [r for r in log_records(log) if r.get("event") == "failover"]
    assert events and all(replacement.replica in e["replica_taken"] for e in events)


def test_stalled_replica_is_dropped_and_cannot_deliver_stale_data(pool, teacher, colocated,
                                                                  replicas, tmp_path):
    first, second = replicas(teacher, count=2)
    log, parked = tmp_path / "run.jsonl", tmp_path / "hold-3"
    parked.touch()
    # 10 s: the stall is first's; second answers in milliseconds, well within it on a busy
    # machine too
    run = Background(pool, case_train_slowly, _argv(teacher, tmp_path, 10), 0.0,
                     ((str(parked), 3),))
    wait_for(lambda: steps_done(log) >= 3)
    first.kill(signal.SIGSTOP)
    parked.unlink()
    wait_for(lambda: any(r.get("event") == "failover" for r in log_records(log)))
    first.kill(signal.SIGCONT)  # awake: its responses are for connections that are gone
    summary = run.join()[0]
    assert step_losses(summary) == pytest.approx(colocated, rel=1e-5)
    event = next(r for r in log_records(log) if r.get("event") == "failover")
    assert first.replica in event["replica_lost"] and second.replica in event["replica_taken"]
    assert "no answer within 10 s" in event["reason"]
