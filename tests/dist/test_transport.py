"""Links between two processes (2 gloo ranks of a pool playing student and teacher), and the
endpoint kinds: messages in order, a dead peer found at once, a peer that aborts the link (alive)
found at once too, well within a long timeout, a silent one at the deadline, never a hang;
records published atomically, withdrawn, read back."""

import datetime
import os
import time

import pytest
import torch
import torch.distributed as dist

from megatron_kd.teacher.endpoint import (
    DirectoryEndpoint,
    RegistryEndpoint,
    ReplicaRecord,
    parse_endpoint,
)
from megatron_kd.teacher.transport import Link, LinkDown


def _store(ctx, path):
    """Rank 0 serves a TCPStore on a free port (written to a file for rank 1)."""
    if ctx.rank == 0:
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        with open(path + ".tmp", "w") as f:
            f.write(str(store.port))
        os.replace(path + ".tmp", path)
        return store
    while not os.path.exists(path):
        time.sleep(0.05)
    return dist.TCPStore("127.0.0.1", int(open(path).read()), is_master=False,
                         wait_for_workers=False)


#: The links' timeout when a student leaves (the reader must wake long before it), and every
#: deadline where no stall is meant: only a bound, generous for a busy 2-core machine.
LONG_TIMEOUT_S = 60.0
#: The deadline of the one transfer that is meant to stall (a silent peer).
STALL_TIMEOUT_S = 2.0
#: How long a student that aborted without releasing holds on (the reader stays blocked).
HOLD_S = 2.0
#: How long a student that aborted and released holds on for the reader to wake: only against a
#: hang, not a measure. Longer than any deadline of the reader's link (LONG_TIMEOUT_S), so the
#: student still holds when the reader wakes, whatever wakes it (a timeout its message tells).
WAKE_HOLD_S = 2 * LONG_TIMEOUT_S


def case_student_leaves(ctx, tmp, release):
    """The replica's request reader (rank 0) blocked without a deadline while the student
    (rank 1, alive) aborts its end; returns the reader's error, how long it waited and whether
    it woke after the student began to abort; the student, whether the reader woke while it
    held on (alive, its link not collected)."""
    store = _store(ctx, os.path.join(tmp, f"port-leave-{release}"))
    link = Link(store, f"pair/leave-{release}", ctx.rank, device=torch.device("cpu"),
                timeout_s=LONG_TIMEOUT_S, peer="the other rank", release_on_abort=release)
    woke = os.path.join(tmp, f"woke-{release}")
    aborting = os.path.join(tmp, f"aborting-{release}")
    if ctx.rank == 1:
        link.wait(link.send([torch.ones(3)], 7), time.monotonic() + LONG_TIMEOUT_S)
        time.sleep(0.5)  # the reader is blocked in its next receive by now (or soon)
        open(aborting, "w").close()  # before the abort: the reader cannot wake from it sooner
        link.abort()
        # alive, this process and its link held, until the reader has woken (with release:
        # WAKE_HOLD_S bounds a hang only; without, HOLD_S: what the reader does meanwhile is
        # the point)
        deadline = time.monotonic() + (WAKE_HOLD_S if release else HOLD_S)
        while not os.path.exists(woke) and time.monotonic() < deadline:
            time.sleep(0.05)
        return {"reader_woke": os.path.exists(woke)}  # ``link`` held until here
    link.wait(link.recv([torch.empty(3)], 7), time.monotonic() + LONG_TIMEOUT_S)
    t0 = time.monotonic()
    try:
        link.wait(link.recv([torch.empty(3)], 7), time.monotonic() + 365 * 24 * 3600.0)
        return {"error": None}
    except LinkDown as e:
        after_abort = os.path.exists(aborting)
        open(woke, "w").close()
        return {"error": str(e), "seconds": time.monotonic() - t0, "after_abort": after_abort}
    finally:
        link.abort()


def case_link(ctx, mode, tmp):
    """Rank 0 (the teacher) sends four messages, unless it dies (``die``) or goes silent
    (``stall``) after two; rank 1 (the student) receives them. Only the stalled message has the
    stall deadline (the link is made with a generous one, then given it): every other transfer,
    and making the link, has :data:`LONG_TIMEOUT_S`. The silent teacher stays silent until the
    student has given up (a file), not for a guessed time."""
    store = _store(ctx, os.path.join(tmp, f"port-{mode}"))
    link = Link(store, f"pair/{mode}", 0 if ctx.rank == 0 else 1, device=torch.device("cpu"),
                timeout_s=LONG_TIMEOUT_S, peer="the other rank")
    gave_up = os.path.join(tmp, f"gave-up-{mode}")
    got = []
    if ctx.rank == 1:  # the student
        try:
            for i in range(4):
                if mode == "stall" and i == 2:
                    link.timeout_s = STALL_TIMEOUT_S
                buf = torch.empty(3)
                link.wait(link.recv([buf], 7), time.monotonic() + link.timeout_s)
                got.append(buf.tolist())
        except LinkDown as e:
            return {"got": got, "error": str(e)}
        finally:
            open(gave_up, "w").close()
        return {"got": got}
    for i in range(4):  # the teacher
        if mode == "die" and i == 2:
            link.abort()  # as a killed process: its sockets close
            return {"sent": i}
        if mode == "stall" and i == 2:
            deadline = time.monotonic() + LONG_TIMEOUT_S
            while not os.path.exists(gave_up) and time.monotonic() < deadline:
                time.sleep(0.05)
            return {"sent": i}
        link.wait(link.send([torch.full((3,), float(i))], 7), time.monotonic() + LONG_TIMEOUT_S)
    return {"sent": 4}


@pytest.fixture(scope="module")
def pool(dist_pool_factory):
    return dist_pool_factory(2)


def test_messages_arrive_in_order(pool, tmp_path):
    _, student = pool.run(case_link, "ok", str(tmp_path))
    assert student == {"got": [[float(i)] * 3 for i in range(4)]}


def test_dead_peer_is_found_at_once(pool, tmp_path):
    t0 = time.monotonic()
    _, student = pool.run(case_link, "die", str(tmp_path))
    assert student["got"] == [[0.0] * 3, [1.0] * 3]
    assert "the other rank" in student["error"]
    assert time.monotonic() - t0 < 30


def test_student_leaving_wakes_the_blocked_reader(pool, tmp_path):
    reader, student = pool.run(case_student_leaves, str(tmp_path), True)
    # the peer closed, not a deadline (the reader's has none; a timeout would say "no answer")
    assert "the other rank" in reader["error"] and "no answer" not in reader["error"]
    # at once, by the order of events, not a clock: after the student began to abort, and
    # while it still lived and held its link: not never, nor when its link is collected
    assert reader["after_abort"] and student["reader_woke"], (reader, student)


def test_gloo_abort_alone_wakes_nobody(pool, tmp_path):
    # why the student's end lets go of its group: gloo's abort leaves the reader blocked (it
    # wakes only when the student's process lets the group go, here when the case returns)
    reader, student = pool.run(case_student_leaves, str(tmp_path), False)
    assert not student["reader_woke"] and reader["seconds"] >= HOLD_S - 0.5


def test_silent_peer_is_found_at_the_deadline(pool, tmp_path):
    _, student = pool.run(case_link, "stall", str(tmp_path))
    assert student["got"] == [[0.0] * 3, [1.0] * 3]
    assert f"no answer within {STALL_TIMEOUT_S:g} s" in student["error"]


def test_link_to_nobody_fails_within_its_timeout():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    with pytest.raises(LinkDown, match="could not connect to nobody"):
        Link(store, "alone", 0, device=torch.device("cpu"), timeout_s=0.5, peer="nobody")


def test_directory_endpoint(tmp_path):
    endpoint = parse_endpoint(str(tmp_path / "ep"))
    assert isinstance(endpoint, DirectoryEndpoint) and endpoint.replicas() == []
    record = ReplicaRecord(replica="r1", host="127.0.0.1", port=1234, identity={"a": 1})
    endpoint.publish(record)
    (tmp_path / "ep" / "replica-broken.json").write_text("{not json")  # half written: skipped
    assert endpoint.replicas() == [record]
    endpoint.withdraw("r1")
    assert endpoint.replicas() == []


def test_registry_endpoint():
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=10))
    endpoint = parse_endpoint(f"127.0.0.1:{server.port}")
    assert isinstance(endpoint, RegistryEndpoint)
    a = ReplicaRecord(replica="a", host="h", port=1)
    b = ReplicaRecord(replica="b", host="h", port=2)
    endpoint.publish(a)
    endpoint.publish(b)
    assert endpoint.replicas() == [a, b]
    endpoint.withdraw("a")
    assert endpoint.replicas() == [b]
