"""The teacher -> student wire on gloo: streams through the prefetch ring, and its failures."""

import time

import pytest
import torch
import torch.distributed as dist

from megatron_kd.teacher import (
    Header,
    HeaderMismatchError,
    HiddenSender,
    PrefetchRing,
    TeacherUnavailableError,
)

SHAPE = (4, 2, 8)


def _header(i, shape=SHAPE, ids=None):
    return Header(step=i // 2, microbatch=i % 2, chunk=0, num_chunks=1,
                  sample_ids=tuple(ids if ids is not None else (10 * i, 10 * i + 1)),
                  shape=shape, dtype=torch.float32)


def _payload(i, shape=SHAPE):
    return torch.arange(torch.Size(shape).numel(), dtype=torch.float32).view(shape) + 1000 * i


def _stream(ctx, n, depth, mode):
    group = dist.new_group([0, 1])  # a group of its own: a failure closes only its pairs
    if ctx.rank == 0:  # student
        ring = PrefetchRing(src=1, depth=depth, shape=SHAPE, dtype=torch.float32, max_samples=2,
                            total_messages=n, timeout=3.0, group=group)
        got = []
        try:
            for i in range(n):
                expected = _header(i)
                if mode == "wrong_ids" and i == 2:
                    expected = _header(i, ids=(0, 0))
                x = ring.get(i, expected)
                got.append(float(x.sum()))
                if mode == "slow_student":
                    time.sleep(0.05)
                ring.release(i)
            ring.close()
        except (HeaderMismatchError, TeacherUnavailableError) as e:
            dist.destroy_process_group(group)  # as the student process would, by exiting
            return {"error": type(e).__name__, "message": str(e), "got": got}
        return {"got": got, "bytes": ring.bytes_received}
    if ctx.rank == 1:  # teacher
        sender = HiddenSender(dst=0, max_samples=2, group=group, timeout=10.0)
        sent = 0
        try:
            for i in range(n):
                if mode == "stall" and i == 3:
                    time.sleep(6)  # longer than the student's timeout
                    break
                if mode == "die" and i == 3:
                    sender.wait()  # messages 0-2 left this process; die before sending 3
                    dist.destroy_process_group(group)
                    return {"sent": sent}
                shape = (4, 2, 6) if (mode == "wrong_hidden" and i == 1) else SHAPE
                sender.send(_header(i, shape=shape), _payload(i, shape))
                sent += 1
            sender.wait()
        except RuntimeError as e:
            return {"sent": sent, "teacher_error": str(e).splitlines()[0]}
        return {"sent": sent, "bytes": sender.bytes_sent}
    return None


@pytest.fixture(scope="module")
def pool(dist_pool_factory):
    return dist_pool_factory(2)


@pytest.mark.parametrize("depth", [1, 2, 4])
def test_messages_arrive_in_order_with_their_bytes(pool, depth):
    student, teacher = pool.run(_stream, 6, depth, "ok")
    assert student["got"] == [float(_payload(i).sum()) for i in range(6)]
    assert student["bytes"] == teacher["bytes"] == 6 * 4 * 2 * 8 * 4  # fp32: 4 bytes per value


def test_wrong_sample_ids_raise_header_mismatch(pool):
    student, _ = pool.run(_stream, 5, 2, "wrong_ids")
    assert student["error"] == "HeaderMismatchError"
    assert "sample_ids: teacher rank 1 sent (20, 21), student rank 0 expected (0, 0)" in \
        student["message"]
    assert len(student["got"]) == 2


def test_wrong_hidden_size_raises_header_mismatch(pool):
    student, _ = pool.run(_stream, 4, 2, "wrong_hidden")
    assert student["error"] == "HeaderMismatchError"
    assert "shape: teacher rank 1 sent (4, 2, 6), student rank 0 expected (4, 2, 8)" in \
        student["message"]


def test_stalled_teacher_raises_within_the_timeout(pool):
    t0 = time.monotonic()
    student, _ = pool.run(_stream, 6, 2, "stall")
    assert student["error"] == "TeacherUnavailableError"
    assert "teacher rank 1 unavailable while receiving message 3" in student["message"]
    assert "no data within 3 s" in student["message"]
    assert time.monotonic() - t0 < 30


def test_dead_teacher_raises_teacher_unavailable(pool):
    student, teacher = pool.run(_stream, 6, 2, "die")
    assert teacher["sent"] == 3
    assert student["error"] == "TeacherUnavailableError"
    assert student["got"] == [float(_payload(i).sum()) for i in range(3)]
    assert "teacher rank 1 unavailable while receiving message 3" in student["message"]
