"""``--kd-mode disaggregated`` end to end on gloo: the teacher on its own ranks streams hidden
states; per-step losses equal colocated training; failures are clear errors.

Layouts (issue contract): teacher 1 rank + student TP2; teacher PP2 + student TP2; one teacher
replica serving 2 student DP ranks. Each world size gets its own pool of ranks.
"""

import os

import pytest
from support.train_cases import (
    STUDENT,
    TEACHER_ARCH,
    case_make_teacher,
    case_train,
    step_losses,
)

from megatron_kd.testing import RankFailure

pytestmark = pytest.mark.filterwarnings("ignore")

BASE = STUDENT + ["--train-iters", "5", "--eval-interval", "100", "--eval-iters", "0",
                  "--kd-ce-weight", "0.2", "--kd-temperature", "1.5"]


@pytest.fixture(scope="module")
def teacher_dir(dist_pool_factory, tmp_path_factory):
    d = str(tmp_path_factory.mktemp("teacher") / "ckpt")
    dist_pool_factory(2).run(case_make_teacher, d, TEACHER_ARCH)
    return d


def _student_steps(results):
    return [r for r in results if r.get("side", "student") == "student"]


LAYOUTS = {
    # name: (colocated world, student flags, disaggregated world, teacher flags)
    "teacher1_studentTP2": (2, ["--tensor-model-parallel-size", "2"], 3,
                            ["--kd-teacher-world-size", "1"]),
    "teacherPP2_studentTP2": (2, ["--tensor-model-parallel-size", "2"], 4,
                              ["--kd-teacher-world-size", "2",
                               "--kd-teacher-pipeline-model-parallel-size", "2"]),
    "teacher1_serves_studentDP2": (2, [], 3, ["--kd-teacher-world-size", "1"]),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_disaggregated_equals_colocated(dist_pool_factory, teacher_dir, tmp_path, name):
    co_world, student, dis_world, teacher = LAYOUTS[name]
    argv = BASE + ["--kd-teacher-load", teacher_dir] + student
    colocated = dist_pool_factory(co_world).run(case_train, argv)
    log = str(tmp_path / "log.jsonl")
    dis = dist_pool_factory(dis_world).run(
        case_train, argv + ["--kd-mode", "disaggregated", "--log-json", log] + teacher)
    students = [r for r in dis if r.get("side") == "student"]
    teachers = [r for r in dis if r.get("side") == "teacher"]
    assert len(students) == co_world and len(teachers) == dis_world - co_world
    # fp32 everywhere. The colocated teacher runs tensor-parallel over the student's TP group,
    # the disaggregated one on its own layout, so its hidden states differ by summation order
    # (~1e-7 relative); 1e-5 relative bounds that after 5 steps, while a wrong or misaligned
    # teacher microbatch changes the KD loss by > 1e-2.
    assert step_losses(students[0]) == pytest.approx(step_losses(colocated[0]), rel=1e-5)
    # Wire bytes: exactly h_t x 4 bytes (fp32) per token, once per student DP rank.
    steps = students[0]["steps"]
    tokens_per_step = 4 * 32  # global batch x sequence
    assert all(r["kd_wire_bytes"] == tokens_per_step * TEACHER_ARCH["hidden_size"] * 4
               for r in steps)
    assert sum(t["bytes_sent"] for t in teachers) == sum(r["kd_wire_bytes"] for r in steps)
    # ... and equal to the planner's traffic model of this run, exactly
    from megatron_kd.planner.models import from_megatron_kd_arch
    from megatron_kd.planner.traffic import hidden_bytes_per_step_per_dp_rank

    dp = students[0]["dp"]
    predicted = hidden_bytes_per_step_per_dp_rank(from_megatron_kd_arch(TEACHER_ARCH), 4, dp,
                                                  32, elem_bytes=4)
    assert all(r["kd_wire_bytes_per_dp_rank"] == predicted for r in steps)
    with open(log, encoding="utf-8") as f:
        assert sum(1 for line in f if '"kd_wire_bytes"' in line) == 5


def _case_kill_teacher(ctx, argv, after_messages):
    from megatron_kd.teacher.wire import HiddenSender
    from megatron_kd.training.train import parse_args, train

    if ctx.rank == 2:  # the teacher: die (SIGKILL) in the middle of training, mid-stream
        send = HiddenSender.send

        def send_then_die(self, header, payload):
            if self.messages_sent >= after_messages:
                os.kill(os.getpid(), 9)
            return send(self, header, payload)

        HiddenSender.send = send_then_die
    return train(parse_args(argv))


def test_dead_teacher_raises_teacher_unavailable(dist_pool_factory, teacher_dir, tmp_path):
    pool = dist_pool_factory(3)
    ckpt = str(tmp_path / "ckpt")
    argv = (STUDENT + ["--train-iters", "100000", "--eval-iters", "0", "--kd-teacher-load",
                       teacher_dir, "--tensor-model-parallel-size", "2", "--kd-mode",
                       "disaggregated", "--kd-teacher-world-size", "1", "--kd-teacher-timeout",
                       "20", "--save", ckpt, "--save-interval", "100000"])
    with pytest.raises(RankFailure) as info:
        pool.run(_case_kill_teacher, argv, 6, timeout=120)
    text = str(info.value)
    assert "TeacherUnavailableError: teacher rank 2 unavailable" in text
    assert "rank 2 process died" in text
    # nothing was written half: no checkpoint directory at all
    assert not os.path.exists(os.path.join(ckpt, "latest_checkpointed_iteration.txt"))


def _case_wrong_samples(ctx, argv):
    """The teacher derives its samples with another seed: the header check must catch it."""
    from megatron_kd.training.train import parse_args, train

    args = parse_args(argv)
    if ctx.rank == 2:
        args.seed += 1
    return train(args)


def test_teacher_on_other_samples_is_a_header_mismatch(dist_pool_factory, teacher_dir):
    argv = BASE + ["--kd-teacher-load", teacher_dir, "--tensor-model-parallel-size", "2",
                   "--kd-mode", "disaggregated", "--kd-teacher-world-size", "1",
                   "--kd-teacher-timeout", "20"]
    with pytest.raises(RankFailure) as info:
        dist_pool_factory(3).run(_case_wrong_samples, argv, timeout=120)
    assert "HeaderMismatchError" in str(info.value)
    assert "fingerprint: teacher rank 2 sent" in str(info.value)


def _case_wrong_teacher_hidden(ctx, argv, teacher_dir_48, teacher_dir_other):
    from megatron_kd.training.train import parse_args, train

    args = parse_args(argv)
    if ctx.rank == 2:  # this teacher process loaded another checkpoint (hidden size 40)
        args.kd_teacher_load = teacher_dir_other
    return train(args)


def test_wrong_teacher_hidden_size_is_reported(dist_pool_factory, teacher_dir, tmp_path):
    other = str(tmp_path / "teacher40")
    dist_pool_factory(2).run(case_make_teacher, other, dict(TEACHER_ARCH, hidden_size=40))
    argv = BASE + ["--kd-teacher-load", teacher_dir, "--tensor-model-parallel-size", "2",
                   "--kd-mode", "disaggregated", "--kd-teacher-world-size", "1",
                   "--kd-teacher-timeout", "20"]
    with pytest.raises(RankFailure) as info:
        dist_pool_factory(3).run(_case_wrong_teacher_hidden, argv, teacher_dir, other,
                                 timeout=120)
    text = str(info.value)
    assert "HeaderMismatchError" in text
    assert "shape: teacher rank 2 sent (16, 2, 40), student rank" in text


def test_bad_layout_is_refused_before_training(dist_pool_factory, teacher_dir):
    argv = BASE + ["--kd-teacher-load", teacher_dir, "--kd-mode", "disaggregated",
                   "--kd-teacher-world-size", "2"]  # 2 teacher replicas for 1 student DP rank
    with pytest.raises(RankFailure, match=r"2 teacher replica\(s\) cannot evenly serve 1"):
        dist_pool_factory(3).run(case_train, argv, timeout=120)
