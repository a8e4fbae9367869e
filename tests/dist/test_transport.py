"""Links between two processes (2 gloo ranks of a pool playing student and teacher), and the
endpoint kinds: messages in order, a dead peer found at once, a silent one at the deadline,
never a hang; records published atomically, withdrawn, read back."""

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


def case_link(ctx, mode, tmp):
    store = _store(ctx, os.path.join(tmp, f"port-{mode}"))
    link = Link(store, f"pair/{mode}", 0 if ctx.rank == 0 else 1, device=torch.device("cpu"),
                timeout_s=2.0, peer="the other rank")
    got = []
    if ctx.rank == 1:  # the student
        try:
            for i in range(4):
                buf = torch.empty(3)
                link.wait(link.recv([buf], 7), time.monotonic() + 2.0)
                got.append(buf.tolist())
        except LinkDown as e:
            return {"got": got, "error": str(e)}
        return {"got": got}
    for i in range(4):  # the teacher
        if mode == "die" and i == 2:
            link.abort()  # as a killed process: its sockets close
            return {"sent": i}
        if mode == "stall" and i == 2:
            time.sleep(4)
            return {"sent": i}
        link.wait(link.send([torch.full((3,), float(i))], 7), time.monotonic() + 5)
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


def test_silent_peer_is_found_at_the_deadline(pool, tmp_path):
    _, student = pool.run(case_link, "stall", str(tmp_path))
    assert student["got"] == [[0.0] * 3, [1.0] * 3]
    assert "no answer within 2 s" in student["error"]


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
