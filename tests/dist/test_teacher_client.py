"""The teacher client against real replicas without a model: 3 gloo ranks of a pool, rank 0 a
student (the real :class:`TeacherClient`), ranks 1 and 2 replicas (the real
:class:`TeacherService`, each over a one-rank group of its own, registered at a directory
endpoint), whose "model" is :func:`teacher_of`, a function of the tokens alone.

* failover: the replica in use aborts its links mid-run and stays registered (``silent``:
  gloo's abort fails this side's transfers without closing the connection, so the student finds
  out at its deadline at the latest, as with a stalled replica), or stops (``stop``: as on
  SIGTERM, it finishes its batch, withdraws and drops its links); the client connects to the
  other and re-sends what is outstanding;
* rebalance: a second replica started after the client connected takes the connection (the
  run's other connection, idle, stays on the first), once: it does not move back; the
  responses still on their way are taken from the first (its connection drained), then it is
  left; when the first fails while it is drained, the failover names it (not the replica the
  client is connected to now) and the client stays with the second;
* refusal: while the student trains, another process announces bad connections to its replica
  (one never described, malformed JSON, ``tp 0`` with a 10^9-token sequence, a real client whose
  microbatch exceeds the replica's): each is refused with its reason, read by the bad student,
  and the good student is served throughout.

Every hidden state taken must equal :func:`teacher_of` of its microbatch's tokens, and the
token-id bytes the client counts as sent must be the planner's (re-sends apart).
"""

import json
import os
import time

import pytest
import torch
import torch.distributed as dist

from megatron_kd.planner.traffic import token_bytes_per_step_per_dp_rank
from megatron_kd.teacher.client import TeacherClient
from megatron_kd.teacher.config import ClientConfig, ClientPlace, ServiceConfig
from megatron_kd.teacher.endpoint import DirectoryEndpoint, ReplicaLayout
from megatron_kd.teacher.protocol import (
    CONN_COUNTER_KEY,
    TeacherRefusedError,
    await_verdict,
    meta_key,
    replica_store,
)
from megatron_kd.teacher.service import TeacherService
from megatron_kd.teacher.wire import header_size

HIDDEN, SEQ, MBS, MICROBATCHES, STEPS, DEPTH = 8, 6, 2, 4, 5, 3
IDENTITY = {"checkpoint": "a function of the tokens", "hidden_size": HIDDEN}
#: A replica or a student silent this long is dropped, where a stall is the point: the client's
#: deadline in ``silent`` and ``drained`` (a replica whose links fail without closing), the
#: replica's for the never-described announcement in ``refuse``.
STALL_TIMEOUT_S = 4.0
#: The same deadline everywhere else: nothing is meant to stall there, so it is only a bound
#: (generous for a busy 2-core machine; a forward here takes DELAY_S).
TIMEOUT_S = 60.0
DELAY_S = 0.05
#: The serving replica loses its links at its forward number DIE_AFTER (of STEPS x MICROBATCHES).
DIE_AFTER = 6
#: With rebalance_every 4 and DEPTH 3 the client sends requests 0..3 to the first replica and
#: moves when it takes response 1; the first fails at its forward 3 (request 2, still drained).
DRAINED_FAILS_AT = 3
#: Nothing here should take this long; replicas give up waiting after it (no rank left behind).
GIVE_UP_S = 90.0


def teacher_of(tokens: torch.Tensor) -> torch.Tensor:
    """``tokens [B, s]`` -> ``[s, B, h]``: each token's id, position and channel, exact in fp32
    (ids < 1000)."""
    s = tokens.shape[1]
    return (tokens.t()[..., None].float() * 2 + torch.arange(s)[:, None, None] * 1000.0
            + torch.arange(HIDDEN) / 4)


def _tokens(step: int, microbatch: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(step * 100 + microbatch)
    return torch.randint(0, 1000, (MBS, SEQ), generator=g)


def _schedule():
    for step in range(STEPS):
        for mb in range(MICROBATCHES):
            sample_ids = [(step * MICROBATCHES + mb) * MBS + i for i in range(MBS)]
            yield step, mb, sample_ids, _tokens(step, mb)


def _claim(path: str) -> bool:
    """True for the first caller only (of every rank): the one replica that fails."""
    try:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        return True
    except FileExistsError:
        return False


def _wait_file(path: str, tmp: str) -> None:
    """Until ``path`` exists (or the student is done: it failed before)."""
    deadline = time.monotonic() + GIVE_UP_S
    while not (os.path.exists(path) or os.path.exists(f"{tmp}/done")):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} never came")
        time.sleep(0.02)


class _Replica:
    """One replica rank: the service, the fake model, and how it fails (``how``: None, ``silent``
    or ``stop``, at its forward number :data:`DIE_AFTER`, if no other replica failed first)."""

    def __init__(self, group, tmp: str, how: str | None, timeout_s: float = TIMEOUT_S) -> None:
        self.tmp, self.how = tmp, how
        self.forwards, self.failed = 0, False
        self.service = TeacherService(
            identity=IDENTITY, endpoint=DirectoryEndpoint(f"{tmp}/ep"), forward=self.forward,
            device=torch.device("cpu"),
            config=ServiceConfig(host="127.0.0.1", port=0, timeout_s=timeout_s, max_batch=MBS,
                                 max_seq_length=SEQ, max_samples=MBS),
            layout=ReplicaLayout(last_stage_ranks=(0,)), group=group)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        self.forwards += 1
        if self.how == "drained" and self.forwards == DRAINED_FAILS_AT:
            # the request after the rebalance point: answered only once the client has moved
            _wait_file(f"{self.tmp}/rebalanced", self.tmp)
            self.failed = True
            self._abort_links()
        if (self.how and not self.failed and self.forwards >= DIE_AFTER
                and _claim(f"{self.tmp}/failed")):
            self.failed = True
            if self.how == "silent":  # its links fail here; the student hears nothing more
                self._abort_links()
        time.sleep(DELAY_S)  # a forward takes time: requests wait at the replica
        return teacher_of(tokens)

    def _abort_links(self) -> None:
        for state in self.service.conns.values():
            for link in [state.request_link] + [s.link for s in state.senders.values()]:
                if link is not None:
                    link.abort()

    def serve(self) -> dict:
        deadline = time.monotonic() + GIVE_UP_S
        totals = self.service.serve(lambda: (self.failed and self.how == "stop")
                                    or os.path.exists(f"{self.tmp}/done")
                                    or time.monotonic() > deadline)
        return {"replica": self.service.replica, "failed": self.failed,
                "requests": totals["requests"], "bytes_in": totals["bytes_in"],
                "bytes_out": totals["bytes_out"]}


def _client(endpoint, schedule, log=None, rebalance_every=0, micro_batch_size=MBS,
            timeout_s=TIMEOUT_S):
    return TeacherClient(
        endpoint=endpoint, expected=IDENTITY,
        config=ClientConfig(micro_batch_size=micro_batch_size, seq_length=SEQ,
                            hidden_size=HIDDEN, dtype=torch.float32, wire_dtype="fp32",
                            depth=DEPTH, timeout_s=timeout_s, max_samples=micro_batch_size,
                            rebalance_every=rebalance_every),
        place=ClientPlace(run=7, dp_rank=0), device=torch.device("cpu"), schedule=schedule,
        log=log)


def _bad_student(tmp: str) -> dict:
    """Announce bad connections to the replica the student uses, mid-run; what each was told."""
    _wait_file(f"{tmp}/connected", tmp)
    endpoint = DirectoryEndpoint(f"{tmp}/ep")
    (record,) = endpoint.replicas()
    store = replica_store(record, TIMEOUT_S)
    told = {}

    def announce(text: str | None) -> int:
        conn = store.add(CONN_COUNTER_KEY, 1) - 1
        if text is not None:
            store.set(meta_key(conn), text)
        return conn

    def verdict(name: str, conn: int) -> None:
        try:
            await_verdict(store, conn, GIVE_UP_S, str(record))
            told[name] = "accepted"
        except TeacherRefusedError as e:
            told[name] = str(e)

    try:
        silent = announce(None)  # never described: must not hold up the connections after it
        verdict("malformed", announce('{"run": 7, "dp_rank": 0, "tp": '))
        verdict("huge", announce(json.dumps({
            "run": 7, "dp_rank": 0, "tp": 0, "micro_batch_size": MBS, "seq_length": 10 ** 9,
            "max_samples": MBS, "wire_dtype": "fp32", "device": "cpu", "identity": IDENTITY})))
        verdict("long", announce(json.dumps({
            "run": 7, "dp_rank": 0, "tp": 1, "micro_batch_size": MBS, "seq_length": 10 ** 9,
            "max_samples": MBS, "wire_dtype": "fp32", "device": "cpu", "identity": IDENTITY})))
        try:
            _client(endpoint, iter(()), micro_batch_size=MBS + 1).start()
            told["client"] = "accepted"
        except TeacherRefusedError as e:
            told["client"] = str(e)
        t0 = time.monotonic()
        verdict("silent", silent)
        told["silent_waited_s"] = time.monotonic() - t0
    finally:
        open(f"{tmp}/bad_done", "w").close()
    return told


def _student(tmp: str, replicas_first: int, wait_for_second: bool, rebalance_every: int,
             wait_for_bad: bool = False, timeout_s: float = TIMEOUT_S) -> dict:
    endpoint = DirectoryEndpoint(f"{tmp}/ep")
    deadline = time.monotonic() + GIVE_UP_S
    while len(endpoint.replicas()) < replicas_first:
        assert time.monotonic() < deadline, "the replicas never registered"
        time.sleep(0.02)
    events = []

    def log(line: str) -> None:
        events.append(json.loads(line))
        if events[-1]["event"] == "rebalance":
            open(f"{tmp}/rebalanced", "w").close()
        failovers = [e for e in events if e["event"] == "failover"]
        # a second failover: the requests outstanding at the first were never answered
        assert len(failovers) <= 1, f"failed over again: {failovers}"

    client = _client(endpoint, _schedule(), log, rebalance_every, timeout_s=timeout_s)
    # with a rebalance, another connection of the run stays on the first replica, idle: a
    # connection alone on its replica does not move to an idle one (it would only move back)
    other = _client(endpoint, iter(())) if rebalance_every else None
    wrong, stats = [], []
    try:
        if other is not None:
            other.start()
        client.start()
        open(f"{tmp}/connected", "w").close()
        for step, mb, sample_ids, tokens in _schedule():
            if wait_for_second and (step, mb) == (0, 1):
                while len(endpoint.replicas()) < 2:
                    assert time.monotonic() < deadline, "the second replica never registered"
                    time.sleep(0.02)
            if wait_for_bad and (step, mb) == (1, 0):  # the bad connections come mid-run
                _wait_file(f"{tmp}/bad_done", tmp)
            hidden = client.hidden(step, mb, sample_ids)
            if not torch.equal(hidden, teacher_of(tokens)):
                wrong.append((step, mb))
            if mb == MICROBATCHES - 1:
                stats.append(client.take_step_stats())
        client.close()
        if other is not None:
            other.close()
    finally:
        open(f"{tmp}/done", "w").close()  # the replicas stop
    return {"wrong": wrong, "events": events, "stats": stats}


def case_service(ctx, tmp: str, scenario: str) -> dict:
    group, _ = dist.new_subgroups(group_size=1)  # each rank its own world (replicas)
    if scenario == "refuse":
        if ctx.rank == 0:
            return _student(tmp, replicas_first=1, wait_for_second=False, rebalance_every=0,
                            wait_for_bad=True)
        if ctx.rank == 1:  # its deadline refuses the announcement never described
            return _Replica(group, tmp, None, timeout_s=STALL_TIMEOUT_S).serve()
        return _bad_student(tmp)
    if ctx.rank == 0:
        rebalance = scenario in ("rebalance", "drained")
        # failover cases: no rebalance (the connection stays where the failure is made)
        return _student(tmp, replicas_first=1 if rebalance else 2, wait_for_second=rebalance,
                        rebalance_every=4 if rebalance else 0,
                        timeout_s=STALL_TIMEOUT_S if scenario in ("silent", "drained")
                        else TIMEOUT_S)
    if scenario in ("rebalance", "drained"):
        if ctx.rank == 2:  # the second replica starts once the client is connected
            _wait_file(f"{tmp}/connected", tmp)
        return _Replica(group, tmp, scenario if ctx.rank == 1 else None).serve()
    return _Replica(group, tmp, scenario).serve()


@pytest.fixture(scope="module")
def pool(dist_pool_factory):
    return dist_pool_factory(3)


def _planner_bytes_per_step() -> int:
    return token_bytes_per_step_per_dp_rank(global_batch_size=MICROBATCHES * MBS, dp=1,
                                            seq_length=SEQ)


@pytest.mark.parametrize("how", ["silent", "stop"])
def test_failover_resends_outstanding_requests(pool, tmp_path, how):
    student, *replicas = pool.run(case_service, str(tmp_path), how, timeout=120)
    assert student["wrong"] == []
    failovers = [e for e in student["events"] if e["event"] == "failover"]
    assert len(failovers) == 1, student["events"]
    lost = next(r for r in replicas if r["failed"])
    taken = next(r for r in replicas if not r["failed"])
    assert lost["replica"] in failovers[0]["replica_lost"]
    assert taken["replica"] in failovers[0]["replica_taken"]
    assert failovers[0]["requests_resent"] >= 1 and taken["requests"] >= 1
    # the step statistics carry each failover once, as it was logged
    assert [e for s in student["stats"] for e in s.failovers] == failovers
    # sent = the planner's token ids + what was sent again; each request answered once
    sent = sum(s.bytes_sent for s in student["stats"])
    resent = sum(s.bytes_resent for s in student["stats"])
    per_request = MBS * SEQ * 4
    assert 0 < resent <= failovers[0]["requests_resent"] * per_request
    assert sent - resent == STEPS * _planner_bytes_per_step()


def test_second_replica_takes_the_connection(pool, tmp_path):
    student, first, second = pool.run(case_service, str(tmp_path), "rebalance", timeout=120)
    assert student["wrong"] == []
    kinds = [e["event"] for e in student["events"]]
    # moved once, and not back: then each replica has one connection of the run
    assert kinds == ["rebalance"], student["events"]
    assert first["requests"] >= 1 and second["requests"] >= 1
    assert first["requests"] + second["requests"] == STEPS * MICROBATCHES  # none lost, none twice
    by_replica = {}
    for s in student["stats"]:
        for replica, tokens in s.tokens_by_replica.items():
            by_replica[replica] = by_replica.get(replica, 0) + tokens
    assert by_replica == {first["replica"]: first["requests"] * MBS * SEQ,
                          second["replica"]: second["requests"] * MBS * SEQ}
    # without a failover the bytes sent are the planner's, step by step
    assert [s.bytes_sent for s in student["stats"]] == [_planner_bytes_per_step()] * STEPS
    assert [s.bytes_resent for s in student["stats"]] == [0] * STEPS
    # each end counts the bytes its links moved, and they agree: the token ids the replicas
    # received are those the client sent, the hidden states they sent those it received
    assert first["bytes_in"] + second["bytes_in"] == sum(s.bytes_sent for s in student["stats"])
    assert first["bytes_out"] + second["bytes_out"] == \
        sum(s.bytes_received for s in student["stats"]) == STEPS * MICROBATCHES * MBS * SEQ * \
        HIDDEN * 4  # fp32
    assert first["bytes_in"] == first["requests"] * MBS * SEQ * 4  # int32 token ids
    # and each request's header: header_size(MBS) int64 words
    assert [s.header_bytes_sent for s in student["stats"]] == \
        [MICROBATCHES * header_size(MBS) * 8] * STEPS


def test_bad_connections_are_refused_and_the_good_student_is_served(pool, tmp_path):
    student, replica, bad = pool.run(case_service, str(tmp_path), "refuse", timeout=120)
    assert student["wrong"] == [] and student["events"] == []  # no failover: never lost
    assert replica["requests"] == STEPS * MICROBATCHES
    assert "refused" in bad["malformed"] and "not JSON" in bad["malformed"], bad
    assert "tp must be an integer in [1, 2**62), got 0" in bad["huge"], bad
    assert "seq_length 1000000000 exceeds this replica's --max-seq-length 6" in bad["long"], bad
    assert f"micro_batch_size {MBS + 1} exceeds this replica's --max-batch-size {MBS}" \
        in bad["client"], bad
    # an announcement never described is refused at the timeout, holding up no other
    assert "no connection metadata within" in bad["silent"], bad
    assert bad["silent_waited_s"] < STALL_TIMEOUT_S + 2


def test_failover_names_the_drained_replica_that_failed(pool, tmp_path):
    student, first, second = pool.run(case_service, str(tmp_path), "drained", timeout=120)
    assert student["wrong"] == []
    assert first["failed"] and not second["failed"]
    kinds = [e["event"] for e in student["events"]]
    assert kinds.count("rebalance") >= 1 and kinds.count("failover") == 1, student["events"]
    (failover,) = [e for e in student["events"] if e["event"] == "failover"]
    assert first["replica"] in failover["replica_lost"], failover
    assert second["replica"] in failover["replica_taken"], failover
