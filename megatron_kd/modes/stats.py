"""A teacher source's statistics of a step, as records until they are logged.

:meth:`~megatron_kd.modes.source.TeacherSource.step_stats` returns one record per
step, combined over the student's ranks field by field, for both trainers (``megatron-kd train``
and Megatron-LM's patched ``pretrain_gpt.py``):

=========================  ==========================================================
:class:`SourceStepStats`   no statistics: no teacher, or a colocated one
:class:`RemoteStepStats`   a disaggregated teacher: its clients'
                           :class:`~megatron_kd.teacher.step_stats.ClientStepStats`
:class:`CacheStepStats`    an offline teacher: its cache readers
:class:`MixtureStepStats`  several teachers: each one's record
=========================  ==========================================================

They are named only when logged, here and nowhere else: :meth:`~SourceStepStats.log_fields` gives
the JSON step log's keys (``megatron-kd train --log-json``; ``megatron-kd report`` and the docs
read them, old logs included, so they never change) and :meth:`~SourceStepStats.scalars` the
``kd/`` scalars both trainers write to TensorBoard and W&B (:data:`SCALAR_NAMES`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from megatron_kd.teacher.step_stats import ClientStepStats

__all__ = ["SCALAR_NAMES", "CacheStepStats", "MixtureStepStats", "RemoteStepStats",
           "SourceStepStats", "replica_rates"]

#: A step log key -> the ``kd/`` scalar it is written as (keys not here are the JSON log's only;
#: each replica's rate is ``kd/replica-<id>/tokens-per-s``).
SCALAR_NAMES = {"kd_wire_bytes": "kd/wire-bytes", "kd_wire_bytes_to_teacher": "kd/wire-bytes-out",
                "kd_teacher_wait_s": "kd/teacher-wait-s",
                "kd_ring_occupancy": "kd/ring-occupancy", "kd_live_replicas": "kd/live-replicas",
                "failovers": "kd/failovers", "kd_cache_wait_s": "kd/cache-wait-s",
                "kd_cache_read_tokens_per_s": "kd/cache-read-tokens-per-s"}


def replica_rates(tokens_by_replica: dict[str, int], seconds: float | None) -> dict[str, float]:
    """Tokens each replica answered, per second of ``seconds`` (none without a time)."""
    if not seconds:
        return {}
    return {replica: round(n / seconds, 1) for replica, n in tokens_by_replica.items()}


@dataclass(frozen=True, kw_only=True)
class SourceStepStats:
    """A step's statistics of a source that has none (no teacher, a colocated one); the base of
    the records that have some: no log keys, no scalars, no events."""

    @property
    def events(self) -> list[dict]:
        """The step's events, one JSON log line each (a disaggregated teacher's failovers)."""
        return []

    def log_fields(self, step_time_s: float | None = None) -> dict[str, Any]:
        """The JSON step log's keys of these statistics; ``step_time_s``: the step's seconds
        (what a rate over the step divides by; None: no rates)."""
        return {}

    def scalars(self, step_time_s: float | None = None) -> dict[str, float]:
        """The ``kd/`` scalars: each key of :meth:`log_fields` :data:`SCALAR_NAMES` names (where
        not None), and each replica's tokens per second of ``step_time_s``."""
        logged = self.log_fields(step_time_s)
        out = {name: float(logged[key]) for key, name in SCALAR_NAMES.items()
               if logged.get(key) is not None}
        for replica, rate in (logged.get("kd_replica_tokens_per_s") or {}).items():
            out[f"kd/replica-{replica}/tokens-per-s"] = float(rate)
        return out


@dataclass(frozen=True, kw_only=True)
class RemoteStepStats(SourceStepStats):
    """A disaggregated teacher's step: what its clients counted (on one rank, or combined over
    the student's ranks: :meth:`~megatron_kd.teacher.step_stats.ClientStepStats.over_ranks`)."""

    client: ClientStepStats = field(default_factory=ClientStepStats)
    """The clients' statistics (see each field's docstring for how ranks combine)."""

    dp_size: int = 1
    """The student's data-parallel size (the bytes a data-parallel rank received are the
    received bytes over it)."""

    def __post_init__(self) -> None:
        if isinstance(self.dp_size, bool) or not isinstance(self.dp_size, int) \
                or self.dp_size < 1:
            raise ValueError(f"RemoteStepStats: dp_size must be an integer >= 1, got "
                             f"{self.dp_size!r}")

    @property
    def events(self) -> list[dict]:
        return list(self.client.failovers)

    def log_fields(self, step_time_s: float | None = None) -> dict[str, Any]:
        """Hidden-state bytes received (all ranks, and per data-parallel rank), token-id bytes
        sent, failovers, seconds waited, the prefetch ring's fill, live replicas, tokens each
        replica answered and, with ``step_time_s``, their rates."""
        c = self.client
        out = {"kd_wire_bytes": c.bytes_received,
               "kd_wire_bytes_per_dp_rank": c.bytes_received // self.dp_size,
               "kd_wire_bytes_to_teacher": c.bytes_sent, "failovers": len(c.failovers),
               "kd_teacher_wait_s": round(c.wait_s, 6) if c.wait_s is not None else 0.0,
               "kd_ring_occupancy": round(c.occupancy, 4) if c.occupancy is not None else None,
               "kd_live_replicas": c.live_replicas,
               "kd_replica_tokens": dict(c.tokens_by_replica)}
        if step_time_s is not None:
            out["kd_replica_tokens_per_s"] = replica_rates(c.tokens_by_replica, step_time_s)
        return out


@dataclass(frozen=True, kw_only=True)
class CacheStepStats(SourceStepStats):
    """An offline teacher's step: its cache readers' waits and decoding, on one rank or summed
    over ranks field by field (:meth:`over_ranks`). The defaults are a rank that reads no
    cache."""

    wait_s: float = 0.0
    """Seconds waited for decoded top-K targets this step."""

    tokens: int = 0
    """Tokens decoded so far (the decoders work ahead: a step may decode none)."""

    decode_s: float = 0.0
    """Seconds spent decoding so far."""

    readers: int = 0
    """Ranks that read the cache (1 on such a rank)."""

    def over_ranks(self, group, device: torch.device) -> CacheStepStats:
        """The statistics summed over ``group``: one all-reduce of the four fields, on
        ``device`` (the group's: NCCL reduces device tensors, gloo host ones)."""
        t = torch.tensor([self.wait_s, self.tokens, self.decode_s, self.readers],
                         dtype=torch.float64, device=device)
        dist.all_reduce(t, group=group)  # every field a sum over the ranks
        wait_s, tokens, decode_s, readers = t.tolist()
        return CacheStepStats(wait_s=wait_s, tokens=int(tokens), decode_s=decode_s,
                              readers=int(readers))

    def log_fields(self, step_time_s: float | None = None) -> dict[str, Any]:
        """Seconds waited (the mean over the ranks that read the cache) and the decoders' rate
        so far (tokens over decoding seconds)."""
        return {"kd_cache_wait_s": round(self.wait_s / self.readers, 6) if self.readers
                else 0.0,
                "kd_cache_read_tokens_per_s": (round(self.tokens / self.decode_s, 1)
                                               if self.decode_s else None)}


@dataclass(frozen=True, kw_only=True)
class MixtureStepStats(SourceStepStats):
    """A step of several teachers (:class:`~megatron_kd.modes.mixture.Mixture`): each
    teacher's own record, named per teacher when logged."""

    parts: tuple[SourceStepStats, ...] = ()
    """Teacher ``i``'s record at ``i``."""

    @property
    def events(self) -> list[dict]:
        """Each teacher's events, each naming its teacher (``"teacher": i``)."""
        return [{**event, "teacher": i} for i, part in enumerate(self.parts)
                for event in part.events]

    def log_fields(self, step_time_s: float | None = None) -> dict[str, Any]:
        """``kd_teachers``: each teacher's :meth:`~SourceStepStats.log_fields` (the keys one
        teacher's run logs), in teacher order."""
        return {"kd_teachers": [part.log_fields(step_time_s) for part in self.parts]}

    def scalars(self, step_time_s: float | None = None) -> dict[str, float]:
        """Each teacher's ``kd/`` scalars under ``kd/teacher-<i>/`` (``kd/teacher-1/wire-bytes``:
        the second teacher's ``kd/wire-bytes``)."""
        return {f"kd/teacher-{i}/{name[len('kd/'):]}": value
                for i, part in enumerate(self.parts)
                for name, value in part.scalars(step_time_s).items()}
