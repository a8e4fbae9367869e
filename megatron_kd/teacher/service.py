"""One teacher replica serving any number of student runs (``megatron-kd teacher serve``).

Every rank of the replica's own world runs :meth:`TeacherService.serve`. Rank 0 is the front: it
serves the replica's rendezvous ``TCPStore`` (published at the endpoint), accepts connections,
receives requests (token ids) and, once per loop, decides what the replica does next: which
connections open or close, and which pending requests form the next batch (requests of several
student data-parallel ranks and runs batched together, up to ``max_batch`` samples of one
sequence length). That decision is broadcast over the replica's world; every rank runs the same
forward (the model and its pipeline schedule are the ``forward`` function it was given), and the
last pipeline stage sends each student TP rank its sequence chunk of each request's hidden
states, from the TP rank ``chunk % tp`` of that stage.

Every announced connection is checked before any link is made for it
(:class:`~megatron_kd.teacher.protocol.ConnectionLimits`: JSON, field types and ranges, sequence
length and microbatch within what the replica was started for, wire dtype, student device,
teacher identity); a bad one is refused with a reason written where its student reads it, and
costs nothing else. Each request is checked against its connection's metadata before its tokens
are received. Transfers run on threads per link (:mod:`.transport`): a slow or dead student
never stops the loop; its links are dropped after the timeout and the replica serves the
others. Rank 0 logs one JSON line per ``stats_interval_s`` (requests, samples and tokens served,
tokens/s, the bytes its links moved each way, per student run), one per connection refused, and
one on exit.
"""

from __future__ import annotations

import collections
import dataclasses
import datetime
import functools
import json
import os
import queue
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megatron_kd.parallel.sequence import member_rows, route_name
from megatron_kd.teacher.config import ServiceConfig
from megatron_kd.teacher.endpoint import Endpoint, ReplicaLayout, ReplicaRecord
from megatron_kd.teacher.protocol import (
    ACCEPTED,
    CLOSED_COUNTER_KEY,
    CONN_COUNTER_KEY,
    PENDING_KEY,
    ConnectionLimits,
    ConnectionMeta,
    HandshakeError,
    Tag,
    link_device,
    meta_key,
    publish_identity,
    refusal,
    request_prefix,
    response_prefix,
    status_key,
)
from megatron_kd.teacher.replica_stats import ReplicaStats
from megatron_kd.teacher.transport import Link, LinkDown
from megatron_kd.teacher.wire import (
    Request,
    Response,
    WireError,
    encode_hidden,
    header_size,
)

__all__ = ["TeacherService"]

_FOREVER = 365 * 24 * 3600.0  # a student may be idle for long (evaluation, checkpoints)
#: Announced connections whose metadata the front waits for at once (each waits at most the
#: timeout, then is refused): a client announcing many and describing none cannot stop the rest.
_MAX_WAITING = 64


@dataclass
class _Connection:
    """A connection as the replica knows it."""

    conn: int
    meta: ConnectionMeta
    request_link: Link | None = None
    senders: dict = field(default_factory=dict)  # chunk -> _Sender (chunks this rank sends)


class _Sender(threading.Thread):
    """Sends one link's responses in order; a dead or stalled student drops the link.
    ``sent(n)``: told the payload bytes of each response once they are handed to the link."""

    def __init__(self, link: Link, timeout_s: float, sent: Callable[[int], None]) -> None:
        super().__init__(daemon=True, name=f"kd-teacher-send-{link.peer}")
        self.link, self.timeout_s, self.sent = link, timeout_s, sent
        self.queue: queue.Queue = queue.Queue()
        self.dead = False
        self.start()

    def run(self) -> None:
        while True:
            item = self.queue.get()
            if item is None:
                return
            if self.dead:
                continue
            header, parts = item
            try:
                works = self.link.send([header], Tag.RESPONSE)
                before = self.link.bytes_sent[Tag.PAYLOAD]
                works += self.link.send(parts, Tag.PAYLOAD)
                self.sent(self.link.bytes_sent[Tag.PAYLOAD] - before)
                self.link.wait(works, time.monotonic() + self.timeout_s)
            except LinkDown:
                self.dead = True  # the student went away: drop what is queued for it

    def close(self) -> None:
        self.queue.put(None)


class _Intake:
    """Rank 0's intake: the rendezvous store, the connections announced there (admitted or
    refused), their requests, and the next batch made of them."""

    def __init__(self, store, *, limits: ConnectionLimits, timeout_s: float) -> None:
        self.store, self.limits, self.timeout_s = store, limits, timeout_s
        self.max_batch = limits.max_batch
        self.seen = 0  # connection ids taken into ``waiting`` so far
        self.waiting: dict[int, float] = {}  # announced, no metadata yet -> when first seen
        self.refused: list[tuple[int, str]] = []  # since the last control
        self.inbox: queue.Queue = queue.Queue()  # (conn, request, tokens) or ("closed", conn)
        self.pending: collections.deque = collections.deque()
        self.closed: list[int] = []

    def control(self, conns: dict, stop: bool, idle_wait_s: float = 0.005) -> dict:
        """What the replica does next (broadcast to every rank)."""
        new = self._new_connections()
        self._drain(timeout=0.0 if (new or self.pending) else idle_wait_s)
        closed, self.closed = self.closed, []
        batch = self._batch(conns, closed)
        # what a student choosing a replica reads (with the open connections: replica_load)
        self.store.set(PENDING_KEY, str(len(self.pending) + len(batch)))
        refused, self.refused = self.refused, []
        return {"new": new, "closed": closed, "batch": batch, "stop": stop, "refused": refused}

    def _new_connections(self) -> list[tuple[int, ConnectionMeta]]:
        """Announced connections whose metadata is there and acceptable (the rest are refused
        with their reason, or wait for theirs up to the timeout)."""
        announced = self.store.add(CONN_COUNTER_KEY, 0)
        now = time.monotonic()
        while self.seen < announced and len(self.waiting) < _MAX_WAITING:
            self.waiting[self.seen] = now
            self.seen += 1
        out = []
        for conn, since in list(self.waiting.items()):
            key = meta_key(conn)
            if self.store.check([key]):
                del self.waiting[conn]
                try:
                    meta = self.limits.accept(self.store.get(key))
                except HandshakeError as e:
                    self._refuse(conn, str(e))
                    continue
                # read by the student before it makes its links (every rank makes its own now)
                self.store.set(status_key(conn), ACCEPTED)
                out.append((conn, meta))
            elif now - since > self.timeout_s:
                del self.waiting[conn]
                self._refuse(conn, f"no connection metadata within {self.timeout_s:g} s of "
                                   f"its announcement")
        return out

    def _refuse(self, conn: int, reason: str) -> None:
        """Tell connection ``conn``'s student why it is refused; it no longer counts as load."""
        self.store.set(status_key(conn), refusal(reason))
        self.store.add(CLOSED_COUNTER_KEY, 1)
        self.refused.append((conn, reason))

    def _drain(self, timeout: float) -> None:
        try:
            item = self.inbox.get(timeout=timeout) if timeout > 0 else self.inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            if item[0] == "closed":
                self.closed.append(item[1])
                self.store.add(CLOSED_COUNTER_KEY, 1)
            else:
                self.pending.append(item)
            try:
                item = self.inbox.get_nowait()
            except queue.Empty:
                return

    def _batch(self, conns: dict, closed: list[int]) -> list:
        """The oldest pending requests of one sequence length, up to ``max_batch`` samples."""
        batch, samples, keep = [], 0, collections.deque()
        gone = set(closed)
        while self.pending:
            conn, req, tokens = self.pending.popleft()
            if conn in gone or conn not in conns:
                continue
            if batch and (req.seq_length != batch[0][1].seq_length
                          or samples + req.batch > self.max_batch):
                keep.append((conn, req, tokens))
                continue
            batch.append((conn, req, tokens))
            samples += req.batch
        self.pending = keep
        return batch

    def read_requests(self, conn: int, link: Link, meta: ConnectionMeta,
                      received: Callable[[int], None]) -> None:
        """A thread per connection: requests into the inbox until the link closes (or a
        request its connection's metadata does not allow: the connection is closed);
        ``received(n)``: told the bytes of each request's token ids once they arrived."""
        max_samples = meta.max_samples

        def loop() -> None:
            try:
                while True:
                    header = torch.empty(header_size(max_samples), dtype=torch.int64,
                                         device=link.device)
                    link.wait(link.recv([header], Tag.REQUEST), time.monotonic() + _FOREVER)
                    req = Request.decode(header.cpu(), max_samples)
                    _check_request(req, conn, meta)
                    tokens = torch.empty((req.batch, req.seq_length), dtype=torch.int32,
                                         device=link.device)
                    link.wait(link.recv([tokens], Tag.TOKENS),
                              time.monotonic() + self.timeout_s)
                    received(tokens.numel() * tokens.element_size())
                    self.inbox.put((conn, req, tokens.cpu()))
            except (LinkDown, WireError):
                link.abort()
                self.inbox.put(("closed", conn))

        threading.Thread(target=loop, daemon=True, name=f"kd-teacher-recv-{conn}").start()


def _check_request(req: Request, conn: int, meta: ConnectionMeta) -> None:
    """A request as its connection announced them, before its tokens are allocated."""
    if (req.conn, req.run) != (conn, meta.run) or not (
            1 <= req.batch <= meta.micro_batch_size) or req.seq_length != meta.seq_length:
        raise WireError(f"connection {conn} (run {meta.run}, microbatches of up to "
                        f"{meta.micro_batch_size} x {meta.seq_length} tokens) sent a request of "
                        f"run {req.run} connection {req.conn}, {req.batch} x {req.seq_length}")


class TeacherService:
    """One replica's serving loop (collective over its world: every rank calls :meth:`serve`).

    Args:
        identity: what the replica serves (checked by students at connect).
        endpoint: where to register.
        forward: ``forward(tokens [B, s] int64) -> hidden [s, B, h]`` on the last stage, None
            elsewhere; called on every rank with the same batch.
        device: this rank's device (``cuda`` or ``cpu``).
        config: its address and limits (:class:`ServiceConfig`).
        layout: its layout as its endpoint record carries it; ``last_stage_ranks`` (ranks of
            ``group``, in TP order) name the ranks that send the answers (the record's device is
            ``device``'s).
        log: where rank 0's JSON log lines go, or None.
        group: the replica's world (None: the default group); ``layout.last_stage_ranks`` and
            "rank 0" are ranks of it.
    """

    def __init__(self, *, identity: dict, endpoint: Endpoint, forward: Callable,
                 device: torch.device, config: ServiceConfig, layout: ReplicaLayout,
                 log: Callable[[str], None] | None = None, group=None) -> None:
        if not layout.last_stage_ranks:
            raise ValueError("teacher service: the layout names no last-stage ranks (the ranks "
                             "that send the answers)")
        self.group, self.config = group, config
        self.rank = dist.get_rank(group)
        self._src = 0 if group is None else dist.get_global_rank(group, 0)  # rank 0's, globally
        self.last_stage_ranks = list(layout.last_stage_ranks)
        self.identity, self.endpoint, self.forward = identity, endpoint, forward
        self.device = torch.device(device)
        self.timeout_s, self.max_samples = config.timeout_s, config.max_samples
        self.log = log if self.rank == 0 else None
        self.stats_interval_s = config.stats_interval_s
        self.replica = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.conns: dict[int, _Connection] = {}
        self.stats = ReplicaStats()
        addr = [None]
        if self.rank == 0:
            self.store = dist.TCPStore(config.host, config.port, is_master=True,
                                       wait_for_workers=False,
                                       timeout=datetime.timedelta(seconds=config.timeout_s))
            publish_identity(self.store, identity)
            # compared in its JSON form: the form the student's expectation arrives in
            limits = ConnectionLimits(identity=json.loads(json.dumps(identity)),
                                      max_seq_length=config.max_seq_length,
                                      max_batch=config.max_batch, max_samples=config.max_samples)
            self.intake = _Intake(self.store, limits=limits, timeout_s=config.timeout_s)
            addr = [(config.host, self.store.port)]
        dist.broadcast_object_list(addr, src=self._src, group=group)
        self.host, self.port = addr[0]
        if self.rank != 0:
            self.store = dist.TCPStore(self.host, self.port, is_master=False,
                                       wait_for_workers=False,
                                       timeout=datetime.timedelta(seconds=config.timeout_s))
        self.record = ReplicaRecord(
            replica=self.replica, host=self.host, port=self.port, identity=identity,
            layout=dataclasses.replace(layout, device=self.device.type))

    # -- the loop -------------------------------------------------------------------------------
    def serve(self, stop: Callable[[], bool]) -> dict:
        """Serve until ``stop()`` is true on rank 0; returns the totals."""
        if self.rank == 0:
            self.endpoint.publish(self.record)
            self._say({"event": "ready", "replica": self.replica, "endpoint": str(self.endpoint),
                       "host": self.host, "port": self.port})
        try:
            self._loop(stop)
            self._gather_link_bytes()  # every rank left the loop at the same control
        except Exception as e:  # what this rank served is still known: its record says so
            self._say({"event": "stopped", "replica": self.replica,
                       "error": f"{type(e).__name__}: {e}", **self.stats.summary()})
            raise
        totals = self.stats.summary()
        self._say({"event": "stopped", "replica": self.replica, **totals})
        return totals

    def _loop(self, stop: Callable[[], bool]) -> None:
        """Rank 0 decides each turn (new and closed connections, a batch, a stats record,
        stop) and broadcasts it; every rank acts on it. Leaving, every connection is closed."""
        try:
            while True:
                ctrl = [{**self.intake.control(self.conns, stop()), "log": self._log_due()}
                        if self.rank == 0 else None]
                dist.broadcast_object_list(ctrl, src=self._src, group=self.group)
                ctrl = ctrl[0]
                for conn, reason in ctrl["refused"]:
                    self._say({"event": "refused", "conn": conn, "reason": reason})
                for conn, meta in ctrl["new"]:
                    self._open(conn, meta)
                for conn in ctrl["closed"]:
                    self._close(conn)
                if ctrl["batch"]:
                    self._serve_batch(ctrl["batch"])
                if ctrl["log"]:
                    self._log_stats()
                if ctrl["stop"]:
                    return
        finally:
            if self.rank == 0:
                self.endpoint.withdraw(self.replica)
            for conn in list(self.conns):
                self._close(conn)

    def withdraw(self) -> None:
        """Rank 0: remove this replica's endpoint record (idempotent; callable from any thread,
        e.g. a rank leaving because its launcher died); elsewhere nothing."""
        if self.rank == 0:
            self.endpoint.withdraw(self.replica)

    def abandon(self, reason: str) -> None:
        """A rank leaving without stopping in order (its launcher died, or a stop overdue),
        called from another thread: rank 0 withdraws the endpoint record and writes its
        ``stopped`` record, marked ``forced``, with what it served so far."""
        self.withdraw()
        self._say({"event": "stopped", "replica": self.replica, "forced": reason,
                   **self.stats.summary()})

    def _open(self, conn: int, meta: ConnectionMeta) -> None:
        """Make this rank's links of a new connection (the student makes its ends now too)."""
        device = link_device(meta.device, self.device.type)
        connection = _Connection(conn=conn, meta=meta)
        peer = f"student run {meta.run} dp {meta.dp_rank}"
        try:
            if self.rank == 0:
                connection.request_link = Link(self.store, request_prefix(conn), 0, device=device,
                                          timeout_s=self.timeout_s, peer=peer)
                self.intake.read_requests(conn, connection.request_link, meta,
                                         functools.partial(self.stats.received, meta.run))
            for chunk in range(meta.members):
                if self.last_stage_ranks[chunk % len(self.last_stage_ranks)] == self.rank:
                    link = Link(self.store, response_prefix(conn, chunk), 0, device=device,
                                timeout_s=self.timeout_s,
                                peer=f"{peer} {route_name(chunk, meta.tp, meta.cp)}")
                    connection.senders[chunk] = _Sender(link, self.timeout_s,
                                                   functools.partial(self.stats.sent, meta.run))
        except LinkDown as e:
            self._say({"event": "connect_failed", "conn": conn, "reason": str(e)})
        self.conns[conn] = connection
        self.stats.connected(meta)
        self._say({"event": "connected", "conn": conn, "run": meta.run, "dp_rank": meta.dp_rank,
                   "tp": meta.tp, "cp": meta.cp, "wire_dtype": meta.wire_dtype})

    def _close(self, conn: int) -> None:
        connection = self.conns.pop(conn, None)
        if connection is None:
            return
        if connection.request_link is not None:
            connection.request_link.abort()
        for sender in connection.senders.values():
            sender.link.abort()
            sender.close()

    def _serve_batch(self, batch: list) -> None:
        t0 = time.perf_counter()
        tokens = torch.cat([t for _, _, t in batch]).to(self.device, torch.int64)
        hidden = self.forward(tokens)  # [s, B, h] on the last stage, else None
        offset = 0
        for conn, req, _ in batch:
            connection = self.conns.get(conn)
            if hidden is not None and connection is not None:
                self._respond(connection, req, hidden[:, offset:offset + req.batch])
            offset += req.batch
            self.stats.served(req)
        self.stats.forward_s += time.perf_counter() - t0

    def _respond(self, connection: _Connection, req: Request, hidden: torch.Tensor) -> None:
        """Each student rank's rows of ``hidden [s, b, h]``: a contiguous slice of the
        sequence per TP rank, and with context parallelism the TP slice of its CP rank's
        load-balanced positions (:func:`~megatron_kd.parallel.sequence.member_rows`)."""
        meta = connection.meta
        for chunk, sender in connection.senders.items():
            if sender.dead:
                continue
            rows = member_rows(hidden.shape[0], chunk, meta.tp, meta.cp)
            part = (hidden[rows[0]:rows[-1] + 1] if rows == list(range(rows[0], rows[-1] + 1))
                    else hidden.index_select(0, torch.tensor(rows, device=hidden.device)))
            header = Response(run=req.run, conn=req.conn, request=req.request, step=req.step,
                              microbatch=req.microbatch, sample_ids=req.sample_ids,
                              fingerprint=req.fingerprint, chunk=chunk, num_chunks=meta.members,
                              shape=tuple(part.shape), wire_dtype=meta.wire_dtype,
                              cp_size=meta.cp)
            parts = [p.to(sender.link.device) for p in encode_hidden(part, meta.wire_dtype)]
            sender.queue.put((header.encode(meta.max_samples).to(sender.link.device), parts))

    # -- logging ----------------------------------------------------------------------------------
    def _log_due(self) -> bool:
        """Rank 0: time for a ``stats`` record (every rank then takes part in it)."""
        return self.log is not None and \
            time.monotonic() - self.stats.last_log > self.stats_interval_s

    def _log_stats(self) -> None:
        self._gather_link_bytes()
        self._say({"event": "stats", "replica": self.replica,
                   "connections": len(self.conns), **self.stats.summary()})
        self.stats.last_log = time.monotonic()

    def _gather_link_bytes(self) -> None:
        """Every rank learns the bytes the others' links moved (collective over the replica's
        world): rank 0 receives the requests, the last stage's ranks send the responses."""
        everyone = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(everyone, self.stats.link_bytes(), group=self.group)
        self.stats.others_link_bytes(everyone[:self.rank] + everyone[self.rank + 1:])

    def _say(self, record: dict) -> None:
        if self.log is not None:
            self.log(json.dumps({"time": round(time.time(), 3), **record}))
