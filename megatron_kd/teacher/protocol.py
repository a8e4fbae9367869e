"""What a student's :class:`~megatron_kd.teacher.client.TeacherClient` and a replica's
:class:`~megatron_kd.teacher.service.TeacherService` agree on besides the wire messages
(:mod:`.wire`): one module both sides import.

A replica's rank 0 serves a ``TCPStore`` (its address is the endpoint's record). In it:

* :data:`IDENTITY_KEY`: what the replica serves, as JSON (the student compares it with its own
  before connecting);
* :data:`CONN_COUNTER_KEY`: connections announced so far; a student takes the next number with
  ``add(1)`` and then writes its :class:`ConnectionMeta` under :func:`meta_key`. The replica
  checks it against what it serves (:class:`ConnectionLimits`) and writes its verdict under
  :func:`status_key`: :data:`ACCEPTED`, or ``refused: <reason>`` (the student raises
  :class:`TeacherRefusedError` naming the reason; the replica serves its other connections on).
  The student makes its links only after an ``accepted``;
* :data:`CLOSED_COUNTER_KEY` and :data:`PENDING_KEY`: connections the replica has closed and
  requests it holds, written by the replica, read by students as its load
  (:func:`replica_load`);
* the link prefixes of each connection (:func:`request_prefix`, :func:`response_prefix`): the
  two-process groups of :mod:`.transport` rendezvous under them.

Messages on a link are told apart by :class:`Tag`; where a link's buffers live is
:func:`link_device` of what the two ends announced.
"""

from __future__ import annotations

import datetime
import enum
import json
import socket
from dataclasses import MISSING, asdict, dataclass, fields

import torch
import torch.distributed as dist

from megatron_kd.parallel.sequence import sequence_parts
from megatron_kd.teacher.wire import WIRE_DTYPES

__all__ = ["ACCEPTED", "CLOSED_COUNTER_KEY", "CONN_COUNTER_KEY", "IDENTITY_KEY", "MAX_META_BYTES",
           "PENDING_KEY", "ConnectionLimits", "ConnectionMeta", "HandshakeError", "Tag",
           "TeacherMismatchError", "TeacherRefusedError", "announce_connection", "await_verdict",
           "group_device", "identity_differences", "link_device", "meta_key", "publish_identity",
           "read_identity", "refusal", "replica_load", "replica_load_parts", "replica_store",
           "request_prefix", "response_prefix", "status_key"]

#: The replica's identity (JSON, keys sorted).
IDENTITY_KEY = "identity"
#: Connections announced (a counter: the next connection's id is its value before ``add(1)``).
CONN_COUNTER_KEY = "conn_counter"
#: Connections the replica has closed (a counter).
CLOSED_COUNTER_KEY = "closed_counter"
#: Requests the replica holds, pending or in the forward running now (a decimal string).
PENDING_KEY = "pending"
#: A replica's verdict on a connection it serves (else ``refused: <reason>``).
ACCEPTED = "accepted"
#: The longest connection metadata a replica reads (a real one is a few hundred bytes).
MAX_META_BYTES = 16384
#: Integers in the metadata stay below this (they travel in ``int64`` header words).
_INT_LIMIT = 2 ** 62


class HandshakeError(ValueError):
    """Connection metadata a replica cannot serve: not JSON, a field of the wrong type or out of
    range, or beyond what the replica was started for (the message names the values)."""


class TeacherRefusedError(ValueError):
    """A replica refused this student's connection; the message carries its reason."""


def status_key(conn: int) -> str:
    """Where the replica writes its verdict on connection ``conn``."""
    return f"conn/{conn}/status"


def meta_key(conn: int) -> str:
    """Where connection ``conn``'s :class:`ConnectionMeta` is written (JSON)."""
    return f"conn/{conn}/meta"


def request_prefix(conn: int) -> str:
    """The link the requests of connection ``conn`` travel on (student TP rank 0 -> rank 0)."""
    return f"conn/{conn}/req"


def response_prefix(conn: int, chunk: int) -> str:
    """The link sequence chunk ``chunk`` of each response travels on (last stage -> student
    TP rank ``chunk``)."""
    return f"conn/{conn}/resp/{chunk}"


class Tag(enum.IntEnum):
    """Point-to-point tags of a link's messages."""

    REQUEST = 1
    """A request's header."""
    TOKENS = 2
    """A request's token ids ``[b, s]`` int32."""
    RESPONSE = 3
    """A response's header."""
    PAYLOAD = 4
    """A response's payload parts (:func:`~megatron_kd.teacher.wire.payload_shapes`)."""


@dataclass(frozen=True, kw_only=True)
class ConnectionMeta:
    """What a student announces about a new connection (the replica makes its links from it)."""

    run: int
    """The student run's id."""
    dp_rank: int
    """The student data-parallel rank whose TP group this connection is."""
    tp: int
    """The student's tensor-parallel size."""
    micro_batch_size: int
    seq_length: int
    max_samples: int
    """Sample ids a header carries at most (headers are ``header_size(max_samples)`` words)."""
    wire_dtype: str
    """The responses' element type (a key of :data:`~megatron_kd.teacher.wire.WIRE_DTYPES`)."""
    device: str
    """The student's device type (``cuda`` or ``cpu``), for :func:`link_device`."""
    cp: int = 1
    """The student's context-parallel size: the replica sends each response in ``tp * cp``
    parts, part ``c * tp + t`` to student (CP rank ``c``, TP rank ``t``): the rows
    :func:`~megatron_kd.parallel.sequence.member_rows` names (absent from a student that
    predates context parallelism: 1)."""
    identity: dict | None = None
    """The teacher identity the student expects; a replica serving another refuses the
    connection naming the differences (and one naming none)."""

    @property
    def members(self) -> int:
        """Student ranks the connection answers (``tp * cp``)."""
        return self.tp * self.cp

    def __post_init__(self) -> None:
        for name, low in (("run", 0), ("dp_rank", 0), ("tp", 1), ("micro_batch_size", 1),
                          ("seq_length", 1), ("max_samples", 1), ("cp", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not (
                    low <= value < _INT_LIMIT):
                raise HandshakeError(f"connection metadata: {name} must be an integer in "
                                     f"[{low}, 2**62), got {_short(value)}")
        if not isinstance(self.wire_dtype, str) or self.wire_dtype not in WIRE_DTYPES:
            raise HandshakeError(f"connection metadata: wire_dtype must be one of "
                                 f"{sorted(WIRE_DTYPES)}, got {_short(self.wire_dtype)}")
        if not isinstance(self.device, str) or not self.device:
            raise HandshakeError(f"connection metadata: device must be a device type such as "
                                 f"'cpu' or 'cuda', got {_short(self.device)}")
        if self.identity is not None and not isinstance(self.identity, dict):
            raise HandshakeError(f"connection metadata: identity must be a JSON object, got "
                                 f"{_short(self.identity)}")

    def to_json(self) -> str:
        """The JSON form; ``cp`` only when above 1 (what a student without context parallelism
        writes stays what a replica that predates it reads)."""
        d = asdict(self)
        if d["cp"] == 1:
            del d["cp"]
        if d["identity"] is None:
            del d["identity"]
        return json.dumps(d, sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> "ConnectionMeta":
        """The metadata a student wrote; :class:`HandshakeError` naming the field for anything
        else (whatever the bytes: a replica reads what anyone who reaches its store wrote)."""
        if len(text) > MAX_META_BYTES:
            raise HandshakeError(f"connection metadata of {len(text)} bytes, more than the "
                                 f"{MAX_META_BYTES} a replica reads")
        try:
            d = json.loads(text)
        except (ValueError, RecursionError) as e:  # not JSON, not UTF-8, nested too deeply
            raise HandshakeError(f"connection metadata is not JSON: "
                                 f"{_short(str(e) or type(e).__name__)}") from None
        if not isinstance(d, dict):
            raise HandshakeError(f"connection metadata must be a JSON object, got {_short(d)}")
        names = {f.name for f in fields(cls)}
        required = {f.name for f in fields(cls) if f.default is MISSING}
        missing, unknown = sorted(required - set(d)), sorted(set(d) - names)
        if missing or unknown:
            shown = [u if len(u) <= 40 else f"{u[:40]}..." for u in unknown[:8]]
            raise HandshakeError(f"connection metadata: missing fields {missing}, unknown "
                                 f"fields {shown}" + (f" and {len(unknown) - 8} more"
                                                      if len(unknown) > 8 else ""))
        return cls(**d)


@dataclass(frozen=True, kw_only=True)
class ConnectionLimits:
    """What one replica was started to serve: every announced connection is checked against it
    before the replica makes a link for it (:meth:`accept`)."""

    identity: dict
    """What the replica serves (a connection expecting another teacher is refused)."""
    max_seq_length: int
    """The longest sequence it accepts (``--max-seq-length``, default the teacher's positions)."""
    max_batch: int
    """Samples in one forward at most (``--max-batch-size``): a microbatch may not exceed it."""
    max_samples: int
    """Sample ids a header may list at most (the replica allocates its headers by it)."""
    devices: tuple[str, ...] = ("cpu", "cuda")
    """Student device types it makes links to (:func:`link_device`)."""
    max_members: int = 1024
    """Student ranks one connection may answer (``tp * cp``): one link each on the last stage."""

    def accept(self, text: str | bytes) -> "ConnectionMeta":
        """The metadata in ``text`` if this replica can serve it, else :class:`HandshakeError`
        naming the field, its value and the limit."""
        meta = ConnectionMeta.from_json(text)
        if meta.identity is None:
            raise HandshakeError("connection metadata names no teacher identity (a student of "
                                 "this version always sends the one it expects)")
        diffs = identity_differences(self.identity, meta.identity)
        if diffs:
            text = "; ".join(diffs)
            raise HandshakeError("the student expects another teacher: " + (
                text if len(text) <= 400 else f"{text[:400]}..."))
        if meta.seq_length > self.max_seq_length:
            raise HandshakeError(f"seq_length {meta.seq_length} exceeds this replica's "
                                 f"--max-seq-length {self.max_seq_length}")
        if meta.micro_batch_size > self.max_batch:
            raise HandshakeError(f"micro_batch_size {meta.micro_batch_size} exceeds this "
                                 f"replica's --max-batch-size {self.max_batch}")
        if meta.max_samples > max(self.max_samples, self.max_batch):
            raise HandshakeError(f"max_samples {meta.max_samples} exceeds this replica's "
                                 f"{max(self.max_samples, self.max_batch)}")
        if meta.device not in self.devices:
            raise HandshakeError(f"device {_short(meta.device)}: this replica makes links to "
                                 f"students on {list(self.devices)}")
        split = sequence_parts(tp=meta.members // meta.cp, cp=meta.cp, sequence_parallel=True)
        if meta.members > self.max_members or meta.seq_length % split:
            raise HandshakeError(f"tp {meta.tp} x cp {meta.cp}: a connection answers at most "
                                 f"{self.max_members} student ranks, and its seq_length "
                                 f"{meta.seq_length} must divide into {split} parts")
        return meta


def _short(value, limit: int = 80) -> str:
    """``repr(value)``, cut to ``limit`` characters (what an error quotes of untrusted input)."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def announce_connection(store, meta: ConnectionMeta) -> int:
    """Student side: take the next connection id at a replica and describe it there."""
    conn = store.add(CONN_COUNTER_KEY, 1) - 1
    store.set(meta_key(conn), meta.to_json())
    return conn


def refusal(reason: str) -> str:
    """The verdict of a refused connection (what :func:`await_verdict` raises with)."""
    return f"refused: {reason}"


def await_verdict(store, conn: int, timeout_s: float, replica: str) -> None:
    """Student side: wait for the replica's verdict on connection ``conn``; returns when it
    accepted, raises :class:`TeacherRefusedError` naming its reason when it refused, and
    ``TimeoutError`` when it gave none within ``timeout_s``."""
    key = status_key(conn)
    try:
        store.wait([key], datetime.timedelta(seconds=max(timeout_s, 0.001)))
    except RuntimeError as e:  # torch's store timeout (DistStoreError is a RuntimeError)
        raise TimeoutError(f"{replica} gave no verdict on connection {conn} within "
                           f"{timeout_s:g} s: {str(e).splitlines()[0] if str(e) else e!r}") from e
    verdict = store.get(key).decode("utf-8", "replace")
    if verdict != ACCEPTED:
        raise TeacherRefusedError(f"{replica} refused this student's connection {conn}: "
                                  f"{verdict.removeprefix('refused: ')}")


def publish_identity(store, identity: dict) -> None:
    """Replica side: what it serves, for students to check before they connect."""
    store.set(IDENTITY_KEY, json.dumps(identity, sort_keys=True))


def read_identity(store) -> dict:
    """Student side: what the replica serving ``store`` serves."""
    return json.loads(store.get(IDENTITY_KEY))


class TeacherMismatchError(ValueError):
    """The teacher at the endpoint is not the one this run expects (names both values)."""


def identity_differences(teacher: dict, expected: dict) -> list[str]:
    """``"field: teacher has X, this run expects Y"`` for every field that differs."""
    return [f"{k}: teacher has {teacher.get(k)!r}, this run expects {expected.get(k)!r}"
            for k in sorted(set(teacher) | set(expected)) if teacher.get(k) != expected.get(k)]


def replica_store(record, timeout_s: float):
    """A client of the store a replica (its endpoint ``record``) serves.

    Raises ``ConnectionRefusedError`` at once when nothing listens at the record's address (a
    replica killed without withdrawing its record): torch's store client would retry the
    refused connection until ``timeout_s`` and then once more, which every student probing the
    endpoint paid (a step of every run stalled 2-5 s after each SIGKILL in the soak of
    ``tools/soak_service.py``, and a new run's connect took 3 s per stale record)."""
    # a connection opened and closed: the store's server drops it without a word
    with socket.create_connection((record.host, record.port), timeout=timeout_s):
        pass
    return dist.TCPStore(record.host, record.port, is_master=False, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=timeout_s))


def group_device(group) -> torch.device:
    """Where a collective on ``group`` wants its tensors: the GPU for NCCL, else the CPU."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def replica_load(store) -> int:
    """A replica's load as students compare it: its open connections plus the requests it
    holds."""
    return sum(replica_load_parts(store))


def replica_load_parts(store) -> tuple[int, int]:
    """``(open connections, requests held)`` of a replica (a student leaves its own out of
    them before comparing: :meth:`~megatron_kd.teacher.choice.ReplicaChooser.less_loaded`)."""
    opened = store.add(CONN_COUNTER_KEY, 0)
    closed = store.add(CLOSED_COUNTER_KEY, 0)
    pending = int(store.get(PENDING_KEY)) if store.check([PENDING_KEY]) else 0
    return opened - closed, pending


def link_device(student_device: str, teacher_device: str) -> torch.device:
    """Where a pair's buffers live: CUDA (NCCL) when both ends have a GPU, else the host
    (gloo). Both sides compute it from what the other announced."""
    if student_device == "cuda" and teacher_device == "cuda" and dist.is_nccl_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
