"""What a teacher client and a replica are started with, as small typed records: a client's
connection (:class:`ClientConfig`, the same on every rank of a student run) and its rank's place
(:class:`ClientPlace`), a replica's address and limits (:class:`ServiceConfig`). A replica's
layout, which its endpoint record carries, is :class:`~megatron_kd.teacher.endpoint.ReplicaLayout`.
Each is validated once, when made (``ValueError`` naming the field and value).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from megatron_kd.teacher.wire import WIRE_DTYPES

__all__ = ["ClientConfig", "ClientPlace", "ServiceConfig"]


def _check_ints(owner: str, record, lows: tuple[tuple[str, int], ...]) -> None:
    """``ValueError`` naming the first field of ``lows`` that is no integer at its low bound or
    above (a bool is no integer here)."""
    for name, low in lows:
        value = getattr(record, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{owner}: {name} must be an integer >= {low}, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class ClientConfig:
    """What a connection to a replica is: the same on every rank of a student run (made from
    its flags; :class:`ClientPlace` says where one rank stands)."""

    micro_batch_size: int
    """Samples of one request (the student's microbatch)."""

    seq_length: int
    """Tokens of each sample (the whole sequence, whatever the student's split)."""

    hidden_size: int
    """The teacher's hidden size (``h_t`` of the ``[s, b, h_t]`` answers)."""

    dtype: torch.dtype
    """The hidden states' dtype for the loss (the teacher output-layer shard's)."""

    wire_dtype: str
    """The answers' element type on the wire: a key of
    :data:`~megatron_kd.teacher.wire.WIRE_DTYPES` (``fp32``, ``bf16``, ``fp8``)."""

    depth: int
    """Requests in flight, and receive slots (``--kd-prefetch-depth``)."""

    timeout_s: float
    """How long a replica may be silent before it is dropped (``--kd-teacher-timeout``)."""

    max_samples: int = 64
    """Sample ids a request header carries at most (the headers are sized by it)."""

    rebalance_every: int = 8
    """Every this many requests a connection may move to a less-loaded replica (0: never)."""

    sequence_parallel: bool = False
    """Hand each TP rank its own chunk of the sequence (what a sequence-parallel loss takes)
    instead of all-gathering the whole sequence."""

    cp_size: int = 1
    """The student's context-parallel size: each CP rank receives its load-balanced
    positions."""

    def __post_init__(self) -> None:
        _check_ints("teacher client", self, (
            ("micro_batch_size", 1), ("seq_length", 1), ("hidden_size", 1), ("depth", 1),
            ("max_samples", 1), ("rebalance_every", 0), ("cp_size", 1)))
        if self.wire_dtype not in WIRE_DTYPES:
            raise ValueError(f"teacher client: wire_dtype must be one of {sorted(WIRE_DTYPES)}, "
                             f"got {self.wire_dtype!r}")
        if not isinstance(self.dtype, torch.dtype) or not self.dtype.is_floating_point:
            raise ValueError(f"teacher client: dtype must be a floating-point torch.dtype, got "
                             f"{self.dtype!r}")
        if not self.timeout_s > 0:
            raise ValueError(f"teacher client: timeout_s must be > 0, got {self.timeout_s!r}")


@dataclass(frozen=True, kw_only=True)
class ClientPlace:
    """Where one student rank stands: its run, its data-parallel rank, and its place among the
    student ranks one connection answers (the TP group; with context parallelism the TP x CP
    group, member ``c * tp + t``)."""

    run: int
    """The student run's id (the same on every rank of the run)."""

    dp_rank: int
    """The student data-parallel rank of this connection's ranks."""

    member: int = 0
    """This rank's place among the connection's ranks (0 sends the requests)."""

    members: int = 1
    """The connection's ranks (``tp * cp``)."""

    member_group: Any = None
    """The process group of the connection's ranks (None when there is one rank)."""

    gather_group: Any = None
    """The group the TP ranks of one CP rank all-gather their chunks over, without sequence
    parallelism (None: ``member_group`` without context parallelism, else no gather)."""

    def __post_init__(self) -> None:
        _check_ints("teacher client", self, (("run", 0), ("dp_rank", 0), ("members", 1)))
        if not 0 <= self.member < self.members:
            raise ValueError(f"teacher client: member {self.member!r} is not in [0, members "
                             f"{self.members})")
        if self.members > 1 and self.member_group is None:
            raise ValueError(f"teacher client: {self.members} members need their member_group")


@dataclass(frozen=True, kw_only=True)
class ServiceConfig:
    """What a replica is started with beside its model: where students reach it and what it
    accepts (``megatron-kd teacher serve``'s flags)."""

    host: str
    """The address students reach rank 0's store at."""

    port: int = 0
    """Rank 0's store port (0: any free one)."""

    max_batch: int
    """Samples batched into one forward at most (``--max-batch-size``; a student's microbatch
    may not exceed it)."""

    max_seq_length: int
    """The longest sequence a connection may announce (``--max-seq-length``)."""

    max_samples: int = 64
    """Sample ids a header can carry (a connection may announce up to this or ``max_batch``,
    whichever is larger)."""

    timeout_s: float
    """How long a student may be silent while a response is sent to it (and an announced
    connection wait for its metadata) before it is dropped (``--kd-teacher-timeout``)."""

    stats_interval_s: float = 10.0
    """Seconds between ``stats`` log records (``--stats-interval``)."""

    def __post_init__(self) -> None:
        if not isinstance(self.host, str) or not self.host:
            raise ValueError(f"teacher service: host must be an address, got {self.host!r}")
        if isinstance(self.port, bool) or not isinstance(self.port, int) or not (
                0 <= self.port <= 65535):
            raise ValueError(f"teacher service: port must be in [0, 65535], got {self.port!r}")
        _check_ints("teacher service", self,
                    (("max_batch", 1), ("max_seq_length", 1), ("max_samples", 1)))
        if not self.timeout_s > 0:
            raise ValueError(f"teacher service: timeout_s must be > 0, got {self.timeout_s!r}")
        if not self.stats_interval_s >= 0:
            raise ValueError(f"teacher service: stats_interval_s must be >= 0, got "
                             f"{self.stats_interval_s!r}")
