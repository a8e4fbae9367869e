"""Replica choice, as the soak of ``tools/soak_service.py`` found it wanting:

* against an endpoint holding the records of replicas that were SIGKILLed (a killed replica
  never withdraws its record), each is found dead at once, not after the store client's
  timeout and retry (a step of every run stalled 2-5 s after each kill, and a new run's
  connect paid 3 s per stale record);
* a connection alone on its replica stays there rather than move to an idle one and back at
  every check (a lone run flipped between two replicas every 8 requests, making new links
  each time), and one among others on a busy replica moves to an idle one, once;
* the probes of a chooser reuse one store client per replica (each new client costs a name
  lookup, 5 s when the resolver drops it: every run stalled 5 s every few seconds).

Real ``TCPStore`` servers and sockets on 127.0.0.1, no process group. A dead replica's port is
a socket bound and not listening (the kernel refuses connections to it, as to a killed
process's port, and the port stays ours: no bind-then-close race). "At once" is counted, not
timed: a dead replica costs one connection attempt, which the kernel refuses, and no store
client (whose retries until its timeout were the stall).
"""

import datetime
import socket

import pytest
import torch.distributed as dist

from megatron_kd.teacher import choice, protocol
from megatron_kd.teacher.choice import ReplicaChooser
from megatron_kd.teacher.endpoint import DirectoryEndpoint, ReplicaRecord
from megatron_kd.teacher.protocol import (
    CLOSED_COUNTER_KEY,
    CONN_COUNTER_KEY,
    PENDING_KEY,
    ConnectionMeta,
    publish_identity,
    replica_store,
)

IDENTITY = {"checkpoint": "abc", "hidden_size": 8}


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


@pytest.fixture
def dialled(monkeypatch):
    """What :func:`~megatron_kd.teacher.protocol.replica_store` does, by port: ``connect``, each
    connection attempt; ``client``, each store client made. A client to a port in ``dead``
    fails the test at once (the real one would retry the refused port until its timeout)."""
    calls = {"connect": [], "client": [], "dead": set()}
    real_connect, real_store = socket.create_connection, dist.TCPStore

    def connect(address, *args, **kwargs):
        calls["connect"].append(address[1])
        return real_connect(address, *args, **kwargs)

    def store(host, port, *args, is_master=False, **kwargs):
        if not is_master:
            calls["client"].append(port)
            assert port not in calls["dead"], f"a store client for dead port {port}"
        return real_store(host, port, *args, is_master=is_master, **kwargs)

    monkeypatch.setattr(protocol.socket, "create_connection", connect)
    monkeypatch.setattr(protocol.dist, "TCPStore", store)
    return calls


META = ConnectionMeta(run=1, dp_rank=0, tp=1, micro_batch_size=1, seq_length=8, max_samples=1,
                      wire_dtype="fp32", device="cpu", identity=IDENTITY)


def _chooser(endpoint):
    return ReplicaChooser(endpoint=endpoint, expected=IDENTITY, dp_rank=0, timeout_s=10.0,
                          meta=lambda: META)


def _live_store():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=10))
    publish_identity(store, IDENTITY)
    return store


def test_a_dead_replicas_store_is_refused_at_once(dead_ports, dialled):
    (port,) = dead_ports(1)
    dialled["dead"].add(port)
    with pytest.raises(ConnectionRefusedError):
        replica_store(ReplicaRecord(replica="gone", host="127.0.0.1", port=port), 10.0)
    # one attempt, refused by the kernel, and no store client: a client retried the refused
    # port until its timeout and once more (10 s, then 10 s)
    assert dialled["connect"] == [port] and dialled["client"] == []
    live = _live_store()
    store = replica_store(ReplicaRecord(replica="here", host="127.0.0.1", port=live.port), 10.0)
    store.set("k", "v")
    assert live.get("k") == b"v"
    assert dialled["connect"] == [port, live.port] and dialled["client"] == [live.port]


def test_stale_records_cost_a_rebalance_check_nothing(tmp_path, dead_ports, dialled):
    endpoint = DirectoryEndpoint(str(tmp_path / "endpoint"))
    live = _live_store()
    current = ReplicaRecord(replica="current", host="127.0.0.1", port=live.port,
                            identity=IDENTITY)
    endpoint.publish(current)
    dead = dead_ports(3)
    dialled["dead"].update(dead)
    stale = [ReplicaRecord(replica=f"killed{i}", host="127.0.0.1", port=port, identity=IDENTITY)
             for i, port in enumerate(dead)]
    for record in stale:
        endpoint.publish(record)
    chooser = _chooser(endpoint)
    assert chooser.less_loaded(current) is None  # only dead replicas to move to
    # each stale record one refused attempt and no store client (was 3 x (a 2 s probe's
    # client and its retry)); the live replica one attempt and its one client
    assert sorted(dialled["connect"]) == sorted([live.port, *dead])
    assert dialled["client"] == [live.port]
    assert chooser.dead == {r.replica for r in stale} and chooser.live() == 1
    # found dead, not dialled again: the next check costs no attempt at all
    assert chooser.less_loaded(current) is None
    assert sorted(dialled["connect"]) == sorted([live.port, *dead])
    assert dialled["client"] == [live.port]


def _set_load(store, connections, pending):
    """What a replica publishes: connections opened and closed, requests held."""
    store.add(CONN_COUNTER_KEY, connections - store.add(CONN_COUNTER_KEY, 0)
              + store.add(CLOSED_COUNTER_KEY, 0))
    store.set(PENDING_KEY, str(pending))


def test_a_lone_connection_stays_and_a_crowded_one_moves_once(tmp_path, monkeypatch):
    made = []

    def counted(record, timeout_s):
        made.append(record.replica)
        return replica_store(record, timeout_s)

    monkeypatch.setattr(choice, "replica_store", counted)
    endpoint = DirectoryEndpoint(str(tmp_path / "endpoint"))
    servers = {name: _live_store() for name in ("a", "b")}
    records = {name: ReplicaRecord(replica=name, host="127.0.0.1", port=store.port,
                                   identity=IDENTITY) for name, store in servers.items()}
    for record in records.values():
        endpoint.publish(record)
    chooser = _chooser(endpoint)
    # alone on a, with its 2 requests held there; b idle: moving would only swap them
    _set_load(servers["a"], connections=1, pending=2)
    _set_load(servers["b"], connections=0, pending=0)
    assert chooser.less_loaded(records["a"], own_requests=2) is None
    # another connection on a: b takes this one ...
    _set_load(servers["a"], connections=2, pending=3)
    assert chooser.less_loaded(records["a"], own_requests=2) == "b"
    # ... and once there it stays (a holds the other, b this one and its requests)
    _set_load(servers["a"], connections=1, pending=1)
    _set_load(servers["b"], connections=1, pending=2)
    assert chooser.less_loaded(records["b"], own_requests=2) is None
    for _ in range(50):  # every 8 requests of a run, for as long as it trains
        chooser.less_loaded(records["b"], own_requests=2)
    assert sorted(made) == ["a", "b"]  # one store client per replica, for every probe
