"""What a student's :class:`~megatron_kd.teacher.client.TeacherClient` and a replica's
:class:`~megatron_kd.teacher.service.TeacherService` agree on besides the wire messages
(:mod:`.wire`): one module both sides import.

A replica's rank 0 serves a ``TCPStore`` (its address is the endpoint's record). In it:

* :data:`IDENTITY_KEY`: what the replica serves, as JSON (the student compares it with its own
  before connecting);
* :data:`CONN_COUNTER_KEY`: connections announced so far; a student takes the next number with
  ``add(1)`` and then writes its :class:`ConnectionMeta` under :func:`meta_key` (the replica
  opens a connection once both are there);
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
from dataclasses import MISSING, asdict, dataclass, fields

import torch
import torch.distributed as dist

from megatron_kd.teacher.wire import WIRE_DTYPES

__all__ = ["CLOSED_COUNTER_KEY", "CONN_COUNTER_KEY", "ConnectionMeta", "IDENTITY_KEY",
           "PENDING_KEY", "Tag", "TeacherMismatchError", "announce_connection", "group_device",
           "identity_differences", "link_device", "meta_key", "publish_identity", "read_identity",
           "replica_load", "replica_store", "request_prefix", "response_prefix"]

#: The replica's identity (JSON, keys sorted).
IDENTITY_KEY = "identity"
#: Connections announced (a counter: the next connection's id is its value before ``add(1)``).
CONN_COUNTER_KEY = "conn_counter"
#: Connections the replica has closed (a counter).
CLOSED_COUNTER_KEY = "closed_counter"
#: Requests the replica holds, pending or in the forward running now (a decimal string).
PENDING_KEY = "pending"


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

    @property
    def members(self) -> int:
        """Student ranks the connection answers (``tp * cp``)."""
        return self.tp * self.cp

    def __post_init__(self) -> None:
        for name, low in (("run", 0), ("dp_rank", 0), ("tp", 1), ("micro_batch_size", 1),
                          ("seq_length", 1), ("max_samples", 1), ("cp", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"connection metadata: {name} must be an integer >= {low}, "
                                 f"got {value!r}")
        if self.wire_dtype not in WIRE_DTYPES:
            raise ValueError(f"connection metadata: wire_dtype must be one of "
                             f"{sorted(WIRE_DTYPES)}, got {self.wire_dtype!r}")
        if not isinstance(self.device, str) or not self.device:
            raise ValueError(f"connection metadata: device must be a device type such as "
                             f"'cpu' or 'cuda', got {self.device!r}")

    def to_json(self) -> str:
        """The JSON form; ``cp`` only when above 1 (what a student without context parallelism
        writes stays what a replica that predates it reads)."""
        d = asdict(self)
        if d["cp"] == 1:
            del d["cp"]
        return json.dumps(d, sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> "ConnectionMeta":
        """The metadata a student wrote; ``ValueError`` naming the field for anything else."""
        try:
            d = json.loads(text)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"connection metadata is not JSON: {e}") from None
        if not isinstance(d, dict):
            raise ValueError(f"connection metadata must be a JSON object, got {d!r}")
        names = {f.name for f in fields(cls)}
        required = {f.name for f in fields(cls) if f.default is MISSING}
        missing, unknown = sorted(required - set(d)), sorted(set(d) - names)
        if missing or unknown:
            raise ValueError(f"connection metadata: missing fields {missing}, unknown fields "
                             f"{unknown}")
        return cls(**d)


def announce_connection(store, meta: ConnectionMeta) -> int:
    """Student side: take the next connection id at a replica and describe it there."""
    conn = store.add(CONN_COUNTER_KEY, 1) - 1
    store.set(meta_key(conn), meta.to_json())
    return conn


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
    """A client of the store a replica (its endpoint ``record``) serves."""
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
    opened = store.add(CONN_COUNTER_KEY, 0)
    closed = store.add(CLOSED_COUNTER_KEY, 0)
    pending = int(store.get(PENDING_KEY)) if store.check([PENDING_KEY]) else 0
    return opened - closed + pending


def link_device(student_device: str, teacher_device: str) -> torch.device:
    """Where a pair's buffers live: CUDA (NCCL) when both ends have a GPU, else the host
    (gloo). Both sides compute it from what the other announced."""
    if student_device == "cuda" and teacher_device == "cuda" and dist.is_nccl_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
