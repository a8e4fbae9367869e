"""Replica choice against an endpoint holding the records of replicas that were SIGKILLed (a
killed replica never withdraws its record): each is found dead at once, not after the store
client's timeout and retry (the soak of ``tools/soak_service.py`` saw a step of every run
stall 2-5 s after each kill, and a new run's connect pay 3 s per stale record).

Real ``TCPStore`` servers and sockets on 127.0.0.1, no process group. A dead replica's port is
a socket bound and not listening (the kernel refuses connections to it, as to a killed
process's port, and the port stays ours: no bind-then-close race).
"""

import datetime
import socket
import time

import pytest
import torch.distributed as dist

from megatron_kd.teacher.choice import ReplicaChooser
from megatron_kd.teacher.endpoint import DirectoryEndpoint, ReplicaRecord
from megatron_kd.teacher.protocol import ConnectionMeta, publish_identity, replica_store

IDENTITY = {"checkpoint": "abc", "hidden_size": 8}
#: far above what finding a refused port takes (milliseconds), far below the timeouts used
FAST_S = 1.0


@pytest.fixture
def dead_ports():
    """Ports of replicas gone: bound, never listening."""
    sockets = []

    def make(n):
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets[-n:]]

    yield make
    for s in sockets:
        s.close()


def _live_store():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=10))
    publish_identity(store, IDENTITY)
    return store


def test_a_dead_replicas_store_is_refused_at_once(dead_ports):
    (port,) = dead_ports(1)
    t0 = time.monotonic()
    with pytest.raises(ConnectionRefusedError):
        replica_store(ReplicaRecord(replica="gone", host="127.0.0.1", port=port), 10.0)
    assert time.monotonic() - t0 < FAST_S  # was the timeout and once more: 10 s, then 10 s
    live = _live_store()
    store = replica_store(ReplicaRecord(replica="here", host="127.0.0.1", port=live.port), 10.0)
    store.set("k", "v")
    assert live.get("k") == b"v"


def test_stale_records_cost_a_rebalance_check_nothing(tmp_path, dead_ports):
    endpoint = DirectoryEndpoint(str(tmp_path / "endpoint"))
    live = _live_store()
    current = ReplicaRecord(replica="current", host="127.0.0.1", port=live.port,
                            identity=IDENTITY)
    endpoint.publish(current)
    stale = [ReplicaRecord(replica=f"killed{i}", host="127.0.0.1", port=port, identity=IDENTITY)
             for i, port in enumerate(dead_ports(3))]
    for record in stale:
        endpoint.publish(record)
    meta = ConnectionMeta(run=1, dp_rank=0, tp=1, micro_batch_size=1, seq_length=8,
                          max_samples=1, wire_dtype="fp32", device="cpu", identity=IDENTITY)
    chooser = ReplicaChooser(endpoint=endpoint, expected=IDENTITY, dp_rank=0, timeout_s=10.0,
                             meta=lambda: meta)
    t0 = time.monotonic()
    assert chooser.less_loaded(current) is None  # only dead replicas to move to
    assert time.monotonic() - t0 < FAST_S  # was 3 stale records x (2 s probe + its retry)
    assert chooser.dead == {r.replica for r in stale} and chooser.live() == 1
