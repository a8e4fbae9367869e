"""The student side of a teacher service: one :class:`TeacherClient` per student rank on the last
pipeline stage.

Each student data-parallel rank's TP group makes one connection to a replica: its TP rank 0
sends the requests (token ids, ``depth`` microbatches ahead of training, from a look-ahead over
the trainer's own data), and every TP rank ``i`` receives sequence chunk ``i`` of each response
into a ring of ``depth`` receive slots posted ahead, then the ranks all-gather the chunks
(inside their TP group) into the ``[s, b, h_t]`` hidden states the fused loss takes with the
teacher's output-layer shard. Per microbatch the TP group also exchanges a few integers (did
every rank get its chunk of the same request?), so they always agree on what happens next.

Replica choice (:mod:`.choice`) and failover: a connection goes to the least-loaded replica
registered at the endpoint whose identity matches the run's (a mismatch is refused at once,
naming both values).
The replica checks the connection's metadata too; a refusal is
:class:`~megatron_kd.teacher.protocol.TeacherRefusedError` naming the replica's reason (a
configuration error: not failed over).
A replica that dies or is silent past ``timeout_s`` is dropped: the group connects to another
live one (or waits up to ``timeout_s`` for one to register) and re-sends the requests it still
holds; the teacher's output depends only on the tokens, so training continues with the same
losses. Each failover is one JSON event (``log``). With no live replica in time:
:class:`~megatron_kd.teacher.wire.TeacherUnavailableError` naming the endpoint and the replicas
tried.
"""

from __future__ import annotations

import collections
import json
import time
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

from megatron_kd.collectives import all_gather_into
from megatron_kd.parallel.sequence import check_sequence_split
from megatron_kd.teacher.choice import ReplicaChooser
from megatron_kd.teacher.config import ClientConfig, ClientPlace
from megatron_kd.teacher.endpoint import Endpoint, ReplicaRecord
from megatron_kd.teacher.protocol import (
    ConnectionMeta,
    Tag,
    TeacherMismatchError,
    TeacherRefusedError,
    group_device,
    link_device,
    replica_store,
    request_prefix,
    response_prefix,
)
from megatron_kd.teacher.ring import Outstanding, SendBuffers, SentBytes, Slot
from megatron_kd.teacher.step_stats import ClientStepStats
from megatron_kd.teacher.transport import Link, LinkDown
from megatron_kd.teacher.wire import (
    HeaderMismatchError,
    Request,
    Response,
    TeacherUnavailableError,
    WireError,
    decode_hidden,
    header_size,
    payload_shapes,
    token_fingerprint,
    wire_bytes_per_token,
)

__all__ = ["TeacherClient"]


class TeacherClient:
    """One student rank's view of the teacher service (see the module docstring).

    Args:
        endpoint: where replicas register.
        expected: the teacher identity this run needs (checked against each replica's).
        config: what the connection is (shapes, dtypes, depth, timeout, rebalancing, the
            student's sequence split).
        place: this rank's run, data-parallel rank and place among the connection's ranks.
        device: this rank's compute device.
        schedule: member 0 only: the run's microbatches in training order, as
            ``(step, microbatch, sample_ids, tokens [b, s])`` (a look-ahead reads it ahead).
        log: where failover events go (one JSON line each), or None.
    """

    def __init__(self, *, endpoint: Endpoint, expected: dict, config: ClientConfig,
                 place: ClientPlace, device: torch.device, schedule: Iterator | None = None,
                 log: Callable[[str], None] | None = None) -> None:
        if place.members % config.cp_size:
            raise ValueError(f"teacher client: {place.members} members are not a multiple of "
                             f"cp_size {config.cp_size}")
        seq_length, members, cp_size = config.seq_length, place.members, config.cp_size
        # the answer is cut for the connection's TP x CP members as sequence parallelism cuts
        # a sequence (each member receives its slice)
        check_sequence_split(seq_length, tp=members // cp_size, cp=cp_size,
                             sequence_parallel=True)
        self.config, self.place = config, place
        self.endpoint, self.expected = endpoint, expected
        self.run, self.dp_rank = place.run, place.dp_rank
        self.member_group, self.member, self.members = place.member_group, place.member, members
        self.sequence_parallel, self.cp_size = config.sequence_parallel, cp_size
        self.gather_group = place.member_group if place.gather_group is None and cp_size == 1 \
            else place.gather_group
        self.shape = (seq_length // members, config.micro_batch_size, config.hidden_size)
        self.seq_length, self.dtype, self.wire_dtype = seq_length, config.dtype, config.wire_dtype
        self.depth, self.timeout_s = config.depth, config.timeout_s
        self.device, self.max_samples = torch.device(device), config.max_samples
        self.schedule = schedule
        self.log = log
        self.outstanding: collections.deque[Outstanding] = collections.deque()
        self.next_request = 0  # the id of the next request to send
        self.bytes_this_step = 0
        self._sent = SentBytes()  # of the requests answered since take_step_stats (TP 0)
        self._tokens: dict[str, int] = {}  # this step's tokens answered, by replica id (TP 0)
        self._peer_ids: dict[str, str] = {}  # link peer name -> replica id
        self._records: dict[str, ReplicaRecord] = {}  # link peer name -> its replica
        self._wait_s = self._occupancy = 0.0  # this step's: seconds waited, ring fill summed
        self._asks = 0
        self.failovers: list[dict] = []
        self._failovers_taken = 0  # failovers reported by take_step_stats
        self.replica: ReplicaRecord | None = None
        self._links: list[Link] = []
        self._draining: list[Link] = []  # links of a connection left by a rebalance
        self.rebalance_every = config.rebalance_every
        self._chooser = ReplicaChooser(endpoint=endpoint, expected=expected, dp_rank=self.dp_rank,
                                       timeout_s=self.timeout_s, meta=self._meta)
        self._link_stores: dict[str, object] = {}  # replica id -> its store's client (links)
        self.tried = self._chooser.tried  # for messages
        self._slots: dict[int, Slot] = {}  # by request % depth
        self._sends: list[SendBuffers] = []

    # -- connection -----------------------------------------------------------------------------
    def start(self) -> None:
        """Connect, post the first receives and send the first ``depth`` requests."""
        self._connect(time.monotonic() + self.timeout_s)
        for _ in range(self.depth):
            self._send_next()

    def _connect(self, deadline: float, *, repost: bool = True, only: str | None = None) -> None:
        """TP rank 0 picks a replica (``only``: that one) and announces the connection; every
        rank makes its links; with ``repost`` it posts its receives for the outstanding
        requests (a fresh start or a failover: they are all sent to this connection)."""
        choice = [None]
        if self.member == 0:
            try:
                choice = [self._chooser.choose(deadline, only)]
            except (TeacherMismatchError, TeacherRefusedError, TeacherUnavailableError) as e:
                choice = [e]
        self._broadcast(choice)
        if isinstance(choice[0], BaseException):
            raise choice[0]
        record_json, conn = choice[0]
        record = ReplicaRecord.from_json(record_json)
        self.replica, self.conn = record, conn
        device = link_device(self.device.type, record.layout.device)
        if record.replica not in self._link_stores:  # one per replica (see .choice: DNS)
            self._link_stores[record.replica] = replica_store(record, self.timeout_s)
        store = self._link_stores[record.replica]
        peer = str(record)
        self._peer_ids[peer] = record.replica
        self._records[peer] = record
        self._links = []
        if self.member == 0:
            self.request_link = Link(store, request_prefix(conn), 1, device=device,
                                     timeout_s=self.timeout_s, peer=peer, release_on_abort=True)
            self._links.append(self.request_link)
        self.response_link = Link(store, response_prefix(conn, self.member), 1, device=device,
                                  timeout_s=self.timeout_s, peer=peer, release_on_abort=True)
        self._links.append(self.response_link)
        if repost:
            self._slots = {}
            first = self.outstanding[0].request if self.outstanding else self.next_request
            for request in range(first, first + self.depth):
                self._post(request)

    def _meta(self) -> ConnectionMeta:
        return ConnectionMeta(run=self.run, dp_rank=self.dp_rank, tp=self.members // self.cp_size,
                              cp=self.cp_size,
                              micro_batch_size=self.shape[1], seq_length=self.seq_length,
                              max_samples=self.max_samples, wire_dtype=self.wire_dtype,
                              device=self.device.type, identity=self.expected)

    # -- requests and responses -----------------------------------------------------------------
    def _send_next(self) -> None:
        """Queue the next microbatch of the schedule (TP rank 0 sends it); others count it."""
        item = [None]
        if self.member == 0:
            item = [next(self.schedule, None)] if self.schedule is not None else [None]
        if self.member == 0 and item[0] is not None:
            step, microbatch, sample_ids, tokens = item[0]
            out = Outstanding(request=self.next_request, step=step, microbatch=microbatch,
                              sample_ids=tuple(int(i) for i in sample_ids),
                              tokens=tokens.to(torch.int32), fingerprint=token_fingerprint(tokens))
            self.outstanding.append(out)
            self._transmit(out)
        elif self.member != 0:
            self.outstanding.append(Outstanding(request=self.next_request, step=-1,
                                                microbatch=-1, sample_ids=(), tokens=None,
                                                fingerprint=0))
        self.next_request += 1

    def _transmit(self, out: Outstanding) -> None:
        req = Request(run=self.run, conn=self.conn, request=out.request, step=out.step,
                      microbatch=out.microbatch, sample_ids=out.sample_ids,
                      fingerprint=out.fingerprint, batch=out.tokens.shape[0],
                      seq_length=out.tokens.shape[1])
        link = self.request_link
        header = req.encode(self.max_samples).to(link.device)
        tokens = out.tokens.to(link.device).contiguous()
        sent = link.bytes_sent.total(), link.bytes_sent[Tag.REQUEST]
        try:
            works = link.send([header], Tag.REQUEST) + link.send([tokens], Tag.TOKENS)
        except LinkDown:
            works = []  # the replica is gone: found when its response does not come
        self._sends.append(SendBuffers(works=works, header=header, tokens=tokens))
        if works:  # what the link sent beyond the header (reported when the response is taken)
            token_bytes = link.bytes_sent.total() - sent[0] - link.bytes_sent[Tag.REQUEST] + sent[1]
            if out.sends:
                out.resent_token_bytes += token_bytes
            out.sends += 1
            out.token_bytes += token_bytes
            out.header_bytes += link.bytes_sent[Tag.REQUEST] - sent[1]
        slot = self._slots.get(out.request % self.depth)
        if works and slot is not None and slot.request == out.request:
            slot.watch()  # its answer will come: arrival seen without waiting (ring occupancy)

    def _post(self, request: int) -> None:
        """Post the receive of ``request``'s response into its slot."""
        slot = request % self.depth
        link = self.response_link
        header = torch.empty(header_size(self.max_samples), dtype=torch.int64,
                             device=link.device)
        parts = [torch.empty(s, dtype=d, device=link.device)
                 for s, d in payload_shapes(self.shape, self.wire_dtype)]
        try:
            works = link.recv([header], Tag.RESPONSE) + link.recv(parts, Tag.PAYLOAD)
        except LinkDown:
            works = None
        self._slots[slot] = Slot(request=request, header=header, parts=parts, works=works,
                                  link=link, conn=self.conn)

    def hidden(self, step: int, microbatch: int, sample_ids=None) -> torch.Tensor:
        """``[s, b, h_t]`` teacher hidden states of the next microbatch (all-gathered over TP).

        On TP rank 0 ``(step, microbatch, sample_ids)`` must be the next microbatch of the
        schedule (a misaligned teacher is an error, never a wrong loss)."""
        if not self.outstanding:
            raise RuntimeError(f"teacher client: microbatch {microbatch} of step {step} asked "
                               f"for with no request outstanding")
        head = self.outstanding[0]
        if self.member == 0 and (head.step, head.microbatch) != (step, microbatch) or (
                self.member == 0 and sample_ids is not None
                and tuple(int(i) for i in sample_ids) != head.sample_ids):
            raise RuntimeError(f"teacher client: the trainer is at step {step} microbatch "
                               f"{microbatch} (samples {sample_ids}) but the next request is "
                               f"step {head.step} microbatch {head.microbatch} (samples "
                               f"{head.sample_ids})")
        if self.member == 0:  # the ring as the rank that sends sees it
            self._occupancy += self._arrived() / len(self.outstanding)
            self._asks += 1
        t0 = time.monotonic()
        while True:
            chunk, failure = self._take(head)
            if not self._agree(head, failure):
                self._failover(head, failure, t0)
                continue
            break
        self._wait_s += time.monotonic() - t0
        self.outstanding.popleft()
        self._sent.add(head)
        if self._draining and all(slot.link not in self._draining for slot in self._slots.values()
                                  if slot.request > head.request):
            for link in self._draining:  # every response of the left connection was taken
                link.abort()
            self._draining = []
        # the next request: possibly to another replica, its receive posted where it is sent
        if self.rebalance_every and self.next_request % self.rebalance_every == \
                self.dp_rank % self.rebalance_every:
            self._rebalance()
        self._post(head.request + self.depth)
        self._send_next()
        self._reap_sends()
        return self._gather(decode_hidden(chunk, self.wire_dtype, self.dtype).to(self.device))

    def _take(self, head: Outstanding):
        """``(payload parts, None)`` of ``head``'s response, or ``(None, reason)``."""
        slot = self._slots[head.request % self.depth]
        assert slot.request == head.request, (slot.request, head.request)
        link, parts = slot.link, slot.parts
        if slot.works is None:
            return None, f"{link.peer}: link down"
        try:
            link.wait(slot.works, time.monotonic() + self.timeout_s)
            response = Response.decode(slot.header.cpu(), self.max_samples)
        except LinkDown as e:
            return None, str(e)
        except WireError as e:
            raise HeaderMismatchError(f"from {self.replica}: {e}") from e
        expected = Response(run=self.run, conn=slot.conn, request=head.request,
                            step=response.step if self.member else head.step,
                            microbatch=response.microbatch if self.member else head.microbatch,
                            sample_ids=response.sample_ids if self.member else head.sample_ids,
                            fingerprint=response.fingerprint if self.member else
                            head.fingerprint, chunk=self.member, num_chunks=self.members,
                            cp_size=self.cp_size,
                            shape=self.shape, wire_dtype=self.wire_dtype)
        response.check_against(expected, replica=link.peer,
                               student_rank=dist.get_rank() if dist.is_initialized() else 0)
        self._response = response
        self.bytes_this_step += sum(p.numel() * p.element_size() for p in parts)
        if self.member == 0:
            replica = self._peer_ids.get(link.peer, link.peer)
            self._tokens[replica] = self._tokens.get(replica, 0) + self.seq_length * len(
                response.sample_ids)
        return parts, None

    def _agree(self, head: Outstanding, failure: str | None) -> bool:
        """Every TP rank got its chunk of the same request (else all fail over together)."""
        if self.members == 1:
            return failure is None
        r = self._response if failure is None else None
        mine = torch.tensor([0 if failure else 1, head.request,
                             r.step if r else -1, r.microbatch if r else -1,
                             r.fingerprint if r else -1], dtype=torch.int64,
                            device=group_device(self.member_group))
        every = torch.empty(self.members * 5, dtype=torch.int64, device=mine.device)
        all_gather_into(every, mine, group=self.member_group)
        rows = every.view(self.members, 5).cpu().tolist()
        if not all(row[0] for row in rows):
            return False
        if any(row[1:] != rows[0][1:] for row in rows):
            raise HeaderMismatchError(f"the TP ranks received chunks of different requests from "
                                      f"{self.replica}: {rows}")
        return True

    def _gather(self, chunk: torch.Tensor) -> torch.Tensor:
        group = self.gather_group
        if group is None or group.size() == 1 or self.sequence_parallel:
            return chunk.clone()
        full = chunk.new_empty((chunk.shape[0] * group.size(), *chunk.shape[1:]))
        # The sequence chunks of the TP group's ranks make the whole microbatch (intra-node).
        all_gather_into(full, chunk.contiguous(), group=group)
        return full

    def _failover(self, head: Outstanding, failure: str | None, t0: float) -> None:
        """Drop the replica that failed, connect to a live one, re-send what is outstanding.

        The replica that failed is the one ``head``'s response was to come from: after a
        rebalance, the one left (its connection still draining), not the one connected now."""
        slot = self._slots.get(head.request % self.depth)
        lost = self.replica if slot is None else self._records.get(slot.link.peer, self.replica)
        if self.members > 1:  # the rank whose receive failed may not be rank 0: all name one
            lost = self._first_failed(lost, failure)
        self._chooser.found_dead(lost)  # a restarted replica registers under a new id
        self._link_stores.pop(lost.replica, None)
        for link in self._links + self._draining:
            link.abort()
        self._draining = []
        self._connect(time.monotonic() + self.timeout_s)
        if self.member == 0:
            for out in self.outstanding:
                self._transmit(out)
        event = {"event": "failover", "time": round(time.time(), 3), "replica_lost": str(lost),
                 "replica_taken": str(self.replica), "requests_resent": len(self.outstanding),
                 "seconds_lost": round(time.monotonic() - t0, 3), "reason": failure,
                 "dp_rank": self.dp_rank, "member": self.member}
        self.failovers.append(event)
        if self.log is not None and self.member == 0:
            self.log(json.dumps(event))

    def _first_failed(self, mine: ReplicaRecord, failure: str | None) -> ReplicaRecord:
        """The replica named by the lowest TP rank whose receive failed (every rank learns it)."""
        named = [None] * self.members
        dist.all_gather_object(named, mine.to_json() if failure else None, group=self.member_group)
        first = next((n for n in named if n is not None), None)
        return mine if first is None else ReplicaRecord.from_json(first)

    def _rebalance(self) -> None:
        """Move this connection's future requests to a replica less loaded than the others on
        ours (:meth:`~megatron_kd.teacher.choice.ReplicaChooser.less_loaded`: a replica started
        later takes work this way); responses already on their way are still taken from the
        old one."""
        target = [None]
        if self.member == 0:
            target = [self._chooser.less_loaded(self.replica, own_requests=len(self.outstanding))]
        self._broadcast(target)
        if target[0] is None:
            return
        old = list(self._links)
        try:
            self._connect(time.monotonic() + self.timeout_s, repost=False, only=target[0])
        except (TeacherUnavailableError, LinkDown):
            return  # it went away meanwhile: stay
        self._draining.extend(old)
        event = {"event": "rebalance", "time": round(time.time(), 3), "replica_taken":
                 str(self.replica), "from_request": self.next_request, "dp_rank": self.dp_rank}
        if self.log is not None and self.member == 0:
            self.log(json.dumps(event))

    def _reap_sends(self) -> None:
        """Forget sends whose requests were answered (their buffers may go)."""
        keep = len(self.outstanding)
        if len(self._sends) > keep:
            self._sends = self._sends[-keep:] if keep else []

    def _broadcast(self, objects: list) -> None:
        if self.members > 1:
            src = dist.get_global_rank(self.member_group, 0)
            dist.broadcast_object_list(objects, src=src, group=self.member_group)

    # -- bookkeeping ----------------------------------------------------------------------------
    @property
    def bytes_per_token(self) -> int:
        return wire_bytes_per_token(self.shape[2], self.wire_dtype)

    def _arrived(self) -> int:
        """Outstanding responses already received in full (without waiting)."""
        n = 0
        for out in self.outstanding:
            slot = self._slots.get(out.request % self.depth)
            if slot is not None and slot.request == out.request and slot.arrived():
                n += 1
        return n

    def take_step_stats(self, *, count_live: bool = False) -> ClientStepStats:
        """This rank's statistics since the last call (see :class:`ClientStepStats`);
        ``count_live``: with the live replicas (an endpoint read)."""
        stats = ClientStepStats(
            bytes_received=self.bytes_this_step, wait_s=self._wait_s,
            occupancy=self._occupancy / self._asks if self._asks else None,
            tokens_by_replica=self._tokens, bytes_sent=self._sent.tokens,
            bytes_resent=self._sent.resent, header_bytes_sent=self._sent.headers,
            failovers=self.failovers[self._failovers_taken:],
            live_replicas=self.live_replicas() if count_live else 0)
        self.bytes_this_step, self._wait_s, self._occupancy, self._asks = 0, 0.0, 0.0, 0
        self._tokens, self._sent = {}, SentBytes()
        self._failovers_taken = len(self.failovers)
        return stats

    def live_replicas(self) -> int:
        """Replicas registered at the endpoint and not found dead by this client."""
        return self._chooser.live()

    def close(self) -> None:
        """Drop the links (any receive still posted ends; the replica forgets the connection)."""
        for link in self._links + self._draining:
            link.abort()
        self._links, self._draining = [], []

