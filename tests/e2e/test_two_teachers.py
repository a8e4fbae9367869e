"""Two teachers in one run (``--kd-mode`` once per teacher, ``--kd-teacher-weights``): the
weighted mixture's forward KL, trained by ``megatron-kd train`` on gloo with tiny models.

* One teacher colocated and one served (two replicas, one SIGKILLed mid-run) train a student at
  TP 2 with sequence parallelism with the per-step losses of the same run with both colocated
  (1e-5 relative); the failover is logged naming its teacher, and each teacher's own KD loss is
  logged beside the weighted sum.
* Two top-K caches (K = the vocabulary) read in step give the losses of both teachers
  colocated; a cache built for other data is refused, naming it; a cached and a colocated
  teacher resumed from a checkpoint give the run straight through, bit for bit.
* Weights (1, 0): bit for bit the run with the first teacher alone.
* Teachers whose vocabularies differ are refused naming both sizes and tokenizers.
"""

import signal

import pytest
from support.background import Background, log_records, steps_done, wait_for
from support.train_cases import (
    STUDENT,
    TEACHER_ARCH,
    cache_build_argv,
    case_cache_build,
    case_make_teacher,
    case_train,
    case_train_slowly,
    check_flags,
    step_losses,
)

pytestmark = pytest.mark.filterwarnings("ignore")

STEPS = 6
BASE = STUDENT + ["--train-iters", str(STEPS), "--eval-interval", "1000", "--eval-iters", "0",
                  "--kd-ce-weight", "0.2", "--kd-temperature", "1.5"]
TP2_SP = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]


@pytest.fixture(scope="module")
def other_teacher(pool, tmp_path_factory):
    """A second teacher: the first one's architecture, other weights."""
    d = str(tmp_path_factory.mktemp("other") / "ckpt")
    pool.run(case_make_teacher, d, TEACHER_ARCH, 11)
    return d


def _kd_terms(summary):
    return [(r["kd_loss"], r["teacher_kd_losses"]) for r in summary["steps"]]


def test_colocated_and_served_equal_both_colocated_through_a_failover(
        pool, teacher, other_teacher, replicas, tmp_path):
    weights = ["--kd-teacher-weights", "1", "3"]
    first, second = replicas(other_teacher, count=2, wait=False)  # start while colocated runs
    both = pool.run(case_train, BASE + TP2_SP + weights + [
        "--kd-mode", "colocated", "colocated", "--kd-teacher-load", teacher, other_teacher])[0]
    first.wait_ready()
    second.wait_ready()
    log = tmp_path / "run.jsonl"
    hold = tmp_path / "hold-3"
    hold.touch()
    argv = BASE + TP2_SP + weights + [
        "--kd-mode", "colocated", "disaggregated", "--kd-teacher-load", teacher, other_teacher,
        "--kd-teacher-endpoint", str(tmp_path / "endpoint"), "--kd-teacher-timeout", "60",
        "--log-json", str(log)]
    run = Background(pool, case_train_slowly, argv, 0.0, ((str(hold), 3),))
    wait_for(lambda: steps_done(log) >= 3)
    serving = [r for r in (first, second) if r.requests_served() > 0]
    assert serving, [(r.final_stats(), r.stderr_tail()) for r in (first, second)]
    serving[0].kill(signal.SIGKILL)
    hold.unlink()
    served = run.join()
    assert step_losses(served[0]) == step_losses(served[1])
    # fp32; the colocated teacher runs over the student's TP group, the replica at TP 1: the
    # same maths in another summation order
    assert step_losses(served[0]) == pytest.approx(step_losses(both), rel=1e-5)
    for (kd, (kd0, kd1)), (kd_ref, per_ref) in zip(_kd_terms(served[0]), _kd_terms(both),
                                                   strict=True):
        assert kd == pytest.approx(0.25 * kd0 + 0.75 * kd1, rel=1e-6)  # the weighted sum
        assert [kd0, kd1] == pytest.approx(per_ref, rel=1e-5) and kd == pytest.approx(kd_ref,
                                                                                      rel=1e-5)
        assert kd0 != pytest.approx(kd1, rel=1e-3)  # two teachers, two divergences
    events = [r for r in log_records(log) if r.get("event") == "failover"]
    assert len(events) == 1 and events[0]["teacher"] == 1, events
    assert serving[0].replica in events[0]["replica_lost"]
    steps = [r for r in log_records(log) if "loss" in r]
    assert len(steps) == STEPS and all(len(r["kd_teachers"]) == 2 for r in steps)
    assert all(r["kd_teachers"][1]["kd_wire_bytes"] > 0 for r in steps)  # the served one's
    assert all("kd_wire_bytes" not in r["kd_teachers"][0] for r in steps)  # colocated: none
    assert [t["kd_mode"] for t in [served[0]]] == [["colocated", "disaggregated"]]


def test_two_caches_read_in_step_equal_both_colocated(pool, teacher, other_teacher, tmp_path):
    caches = [str(tmp_path / name) for name in ("first", "second", "other-data")]
    for cache, source, extra in ((caches[0], teacher, ()), (caches[1], other_teacher, ()),
                                 (caches[2], other_teacher, ("--seed", "7"))):
        pool.run(case_cache_build, cache_build_argv(cache, source, topk=TEACHER_ARCH[
            "vocab_size"], seq=32, iters=STEPS, global_batch=4, extra=extra))
    weights = ["--kd-teacher-weights", "2", "1"]
    both = pool.run(case_train, BASE + weights + [
        "--kd-mode", "colocated", "colocated", "--kd-teacher-load", teacher, other_teacher])[0]
    cached = pool.run(case_train, BASE + weights + [
        "--kd-mode", "offline", "offline", "--kd-topk-cache", *caches[:2]])[0]
    # every token's whole distribution is cached (K = V): the same targets, fp32
    assert step_losses(cached) == pytest.approx(step_losses(both), rel=1e-5)
    for mine, theirs in zip(cached["steps"], both["steps"]):
        assert mine["teacher_kd_losses"] == pytest.approx(theirs["teacher_kd_losses"], rel=1e-5)
    with pytest.raises(ValueError, match=rf"--kd-topk-cache '{caches[2]}': .*dataset"):
        check_flags(BASE + ["--kd-mode", "offline", "offline", "--kd-topk-cache", caches[0],
                            caches[2]], 2)
    # a cached and a colocated teacher, stopped after step 3 and resumed: each source starts
    # again at the resumed step (the cache's decoders at its samples), bit for bit the run
    # straight through
    ckpt = str(tmp_path / "ckpt")
    mixed = BASE + weights + ["--kd-mode", "offline", "colocated", "--kd-topk-cache",
                              caches[0], "--kd-teacher-load", other_teacher]
    straight = step_losses(pool.run(case_train, mixed)[0])
    assert straight == pytest.approx(step_losses(both), rel=1e-5)
    first = pool.run(case_train, mixed + ["--save", ckpt, "--load", ckpt,
                                          "--exit-after-iters", "3"])[0]
    second = pool.run(case_train, mixed + ["--save", ckpt, "--load", ckpt])[0]
    assert second["start_iteration"] == 3
    assert step_losses(first) + step_losses(second) == straight


def test_weights_one_and_zero_are_the_first_teacher_alone(pool, teacher, other_teacher):
    alone = pool.run(case_train, BASE + ["--kd-teacher-load", teacher])[0]
    mixed = pool.run(case_train, BASE + ["--kd-mode", "colocated", "colocated",
                                         "--kd-teacher-load", teacher, other_teacher,
                                         "--kd-teacher-weights", "1", "0"])[0]
    assert step_losses(mixed) == step_losses(alone)  # bit for bit
    assert [r["kd_loss"] for r in mixed["steps"]] == [r["kd_loss"] for r in alone["steps"]]
    assert [r["teacher_kd_losses"][0] for r in mixed["steps"]] == \
        [r["kd_loss"] for r in alone["steps"]]
    # the weight-0 teacher's divergence is logged, not trained on
    assert all(r["teacher_kd_losses"][1] > 0 for r in mixed["steps"])


def test_teachers_of_different_vocabularies_are_refused(pool, teacher, tmp_path):
    small = str(tmp_path / "small")
    pool.run(case_make_teacher, small, {**TEACHER_ARCH, "vocab_size": 400,
                                        "padded_vocab_size": 512})
    with pytest.raises(ValueError, match=r"vocabularies differ \(teacher 0 .*: 500 tokens, no "
                                         r"tokenizer.json; teacher 1 .*small\): 400 tokens"):
        check_flags(BASE + ["--kd-mode", "colocated", "colocated",
                            "--kd-teacher-load", teacher, small], 2)
