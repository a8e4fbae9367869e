"""Which replica a student's connection goes to (:class:`ReplicaChooser`): the least-loaded live
replica registered at the endpoint whose identity is the run's, found by probing each one's
store; replicas found dead are remembered and not probed again while others are registered.
Used by TP rank 0 of each connection (:class:`~megatron_kd.teacher.client.TeacherClient`).

One store client per replica is kept and used for every probe: torch's store client resolves
the peer's address to a name when it connects (a DNS query for ``::ffff:127.0.0.1`` even on
loopback), and a resolver that drops a query costs that connect 5 s. A client made anew for
every probe (every replica, every 8 requests of every connection) stalled every run of the
soak of ``tools/soak_service.py`` 5 s every few seconds on a machine whose resolver drops one
query in 25.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from megatron_kd.teacher.endpoint import Endpoint, ReplicaRecord
from megatron_kd.teacher.protocol import (
    ConnectionMeta,
    TeacherMismatchError,
    announce_connection,
    await_verdict,
    identity_differences,
    read_identity,
    replica_load,
    replica_load_parts,
    replica_store,
)
from megatron_kd.teacher.wire import TeacherUnavailableError

__all__ = ["PROBE_S", "ReplicaChooser"]

#: Seconds to reach a registered replica's store before taking it for dead (a live one answers
#: in milliseconds; a dead one's port refuses, and the store client retries until this).
PROBE_S = 2.0
#: What probing a replica's store raises when the replica is not there.
_UNREACHABLE = (RuntimeError, OSError, ValueError)


class ReplicaChooser:
    """One connection's replica choice.

    Args:
        endpoint: where replicas register.
        expected: the teacher identity the run needs.
        dp_rank: the student data-parallel rank (spreads equal choices round-robin).
        timeout_s: ``--kd-teacher-timeout`` (probes take at most :data:`PROBE_S` of it).
        meta: the connection's metadata, as announced to the replica chosen.
    """

    def __init__(self, *, endpoint: Endpoint, expected: dict, dp_rank: int, timeout_s: float,
                 meta: Callable[[], ConnectionMeta]) -> None:
        self.endpoint, self.expected, self.dp_rank = endpoint, expected, dp_rank
        self.timeout_s, self.meta = timeout_s, meta
        self.probe_s = min(PROBE_S, timeout_s)
        self.dead: set[str] = set()
        """Ids of replicas found dead (a restarted replica registers under a new id)."""
        self.tried: list[str] = []
        """The replicas tried so far, for messages."""
        self._stores: dict[str, object] = {}  # replica id -> its store's client (probes)

    def store(self, record: ReplicaRecord):
        """The client of ``record``'s store this chooser probes with (made once)."""
        if record.replica not in self._stores:
            self._stores[record.replica] = replica_store(record, self.probe_s)
        return self._stores[record.replica]

    def found_dead(self, record: ReplicaRecord) -> None:
        """``record``'s replica is dead: never probed again (while others are registered)."""
        self.dead.add(record.replica)
        self._stores.pop(record.replica, None)

    def choose(self, deadline: float, only: str | None = None) -> tuple[str, int]:
        """``(record JSON, connection id)`` at the least-loaded live replica (``only``: that
        one), waiting up to ``deadline`` for one. The replica's refusal raises
        :class:`~megatron_kd.teacher.protocol.TeacherRefusedError` naming its reason; another
        teacher :class:`~megatron_kd.teacher.protocol.TeacherMismatchError`; none in time
        :class:`~megatron_kd.teacher.wire.TeacherUnavailableError`."""
        reasons: list[str] = []
        while True:
            candidates = []
            records = [r for r in self.endpoint.replicas() if only in (None, r.replica)]
            # replicas found dead are tried again only when no other is registered
            records = [r for r in records if r.replica not in self.dead] or records
            for record in records:
                try:
                    store = self.store(record)
                    candidates.append((replica_load(store), record, store))
                except _UNREACHABLE as e:
                    reasons.append(f"{record}: {str(e).splitlines()[0]}")
                    self._tried(record)
                    self.found_dead(record)  # registered, not there: not probed again
            # least loaded first; among equals, data-parallel ranks spread round-robin
            n = max(1, len(candidates))
            loads = [load for load, _, _ in candidates]
            order = sorted(range(len(candidates)), key=lambda i: (loads[i], (i - self.dp_rank) % n))
            for _, record, store in (candidates[i] for i in order):
                diffs = identity_differences(read_identity(store), self.expected)
                if diffs:
                    raise TeacherMismatchError(f"the teacher at {self.endpoint} ({record}) is not "
                                               f"the one this run expects: " + "; ".join(diffs))
                conn = announce_connection(store, self.meta())
                self._tried(record)
                try:  # a refusal raises naming the replica's reason
                    await_verdict(store, conn, max(deadline - time.monotonic(), self.probe_s),
                                  str(record))
                except TimeoutError as e:  # no verdict: a replica as good as dead
                    reasons.append(str(e))
                    self.found_dead(record)
                    continue
                return record.to_json(), conn
            if time.monotonic() > deadline:
                raise TeacherUnavailableError(
                    str(self.endpoint), self.tried,
                    f"no live replica within {self.timeout_s:g} s (--kd-teacher-timeout)"
                    + (f": {'; '.join(reasons[-3:])}" if reasons else ""))
            time.sleep(0.5)

    def less_loaded(self, current: ReplicaRecord, own_requests: int = 0) -> str | None:
        """The id of a live replica loaded at least 1 less than the others on ``current`` (which
        holds this connection and up to ``own_requests`` of its requests: both are left out,
        what moves with the connection), if any. A connection alone on its replica therefore
        stays: an idle replica would only take its place, and the connection move back at the
        next check (it used to, every 8 requests, each time making new links)."""
        try:
            connections, pending = replica_load_parts(self.store(current))
        except _UNREACHABLE:
            self._stores.pop(current.replica, None)
            return None  # ours is unreachable: the next response will say so
        others = connections - 1 + max(0, pending - own_requests)
        best = None
        for record in self.endpoint.replicas():
            if record.replica == current.replica or record.replica in self.dead:
                continue
            try:
                load = replica_load(self.store(record))
            except _UNREACHABLE:
                self.found_dead(record)
                continue
            if load <= others - 1 and (best is None or load < best[0]):
                best = (load, record.replica)
        return None if best is None else best[1]

    def live(self) -> int:
        """Replicas registered at the endpoint and not found dead."""
        return sum(1 for r in self.endpoint.replicas() if r.replica not in self.dead)

    def _tried(self, record: ReplicaRecord) -> None:
        if str(record) not in self.tried:
            self.tried.append(str(record))
