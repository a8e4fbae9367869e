"""A teacher client's statistics of a step, as one record (:class:`ClientStepStats`): made by
:meth:`~megatron_kd.teacher.client.TeacherClient.take_step_stats`, combined over the student's
ranks (:meth:`ClientStepStats.over_ranks`; each field says how: summed, averaged over the ranks
that have it, or gathered) into the same record, which the teacher source hands on as it is
(:class:`~megatron_kd.modes.stats.RemoteStepStats`: named only when logged).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields

import torch
import torch.distributed as dist

__all__ = ["ClientStepStats"]

# How a field of ClientStepStats combines over ranks (its ``metadata["over_ranks"]``).
_SUM = "sum"  # one float of the all-reduce vector, summed
_MEAN = "mean"  # two floats (the value or 0, whether present): the mean of the present ones
_ADD = "add"  # a dict gathered as an object: the counts of each key summed
_JOIN = "join"  # a list gathered as an object: joined in rank order


@dataclass(kw_only=True)
class ClientStepStats:
    """One step of a teacher client's traffic
    (:meth:`~megatron_kd.teacher.client.TeacherClient.take_step_stats`) and, combined over
    student ranks, the same record (each field says how it combines: :meth:`over_ranks`, which
    sums :meth:`to_vector` and gathers :meth:`gathered` over the ranks, then :meth:`combine`).
    The defaults are a rank with no client."""

    bytes_received: int = field(default=0, metadata={"over_ranks": _SUM})
    """Hidden-state bytes received."""

    bytes_sent: int = field(default=0, metadata={"over_ranks": _SUM})
    """Token-id bytes TP rank 0 handed to links for the requests whose responses were taken
    (0 elsewhere), re-sends after a failover included (without a failover: the planner's
    ``token_bytes_per_step_per_dp_rank`` in a step)."""

    bytes_resent: int = field(default=0, metadata={"over_ranks": _SUM})
    """The part of :attr:`bytes_sent` sent again after a failover."""

    header_bytes_sent: int = field(default=0, metadata={"over_ranks": _SUM})
    """The bytes of those requests' headers."""

    live_replicas: int = field(default=0, metadata={"over_ranks": _SUM})
    """Replicas registered and not found dead, where counted (an endpoint read:
    :meth:`~megatron_kd.teacher.client.TeacherClient.take_step_stats` counts them when
    asked); else 0."""

    wait_s: float | None = field(default=None, metadata={"over_ranks": _MEAN})
    """Seconds waited for responses (None: no client); combined, the mean over the ranks with
    a client."""

    occupancy: float | None = field(default=None, metadata={"over_ranks": _MEAN})
    """The mean fraction of the prefetched responses (up to ``depth``) already there when one
    was asked for (TP rank 0; None when none was, or elsewhere); combined, the mean over the
    ranks that measured it."""

    tokens_by_replica: dict[str, int] = field(default_factory=dict,
                                              metadata={"over_ranks": _ADD})
    """Tokens answered by each replica id (TP rank 0; else empty)."""

    failovers: list[dict] = field(default_factory=list, metadata={"over_ranks": _JOIN})
    """The failover events (one JSON record each) since the last report."""

    def to_vector(self) -> list[float]:
        """The numeric fields, in field order, as one vector to sum over ranks."""
        vec: list[float] = []
        for f in fields(self):
            value = getattr(self, f.name)
            if f.metadata["over_ranks"] == _SUM:
                vec.append(float(value))
            elif f.metadata["over_ranks"] == _MEAN:
                vec += [0.0 if value is None else float(value), float(value is not None)]
        return vec

    def gathered(self) -> dict:
        """The fields that travel as objects (to gather over ranks)."""
        return {f.name: getattr(self, f.name) for f in fields(self)
                if f.metadata["over_ranks"] in (_ADD, _JOIN)}

    @classmethod
    def combine(cls, vector: Sequence[float], gathered: Sequence[dict]) -> ClientStepStats:
        """The statistics over ranks: ``vector`` the sum of their :meth:`to_vector`,
        ``gathered`` their :meth:`gathered`, in rank order."""
        values: dict = {}
        at = 0
        for f in fields(cls):
            how = f.metadata["over_ranks"]
            parts = [g[f.name] for g in gathered] if how in (_ADD, _JOIN) else []
            if how == _SUM:
                values[f.name], at = int(vector[at]), at + 1
            elif how == _MEAN:
                total, count = vector[at], vector[at + 1]
                values[f.name], at = (total / count if count else None), at + 2
            elif how == _JOIN:
                values[f.name] = [item for part in parts for item in part]
            else:
                summed: dict = {}
                for part in parts:
                    for key, n in part.items():
                        summed[key] = summed.get(key, 0) + n
                values[f.name] = summed
        assert at == len(vector), (at, len(vector))
        return cls(**values)

    def over_ranks(self, group, device: torch.device) -> ClientStepStats:
        """The statistics over the ranks of ``group`` (collective on it): one all-reduce of the
        numeric fields on ``device`` (the group's: NCCL reduces device tensors, gloo host ones)
        and one object gather of the others."""
        t = torch.tensor(self.to_vector(), dtype=torch.float64, device=device)
        dist.all_reduce(t, group=group)  # the numeric fields, summed (means as sum and count)
        gathered = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, self.gathered(), group=group)  # dicts and lists
        return ClientStepStats.combine(t.tolist(), gathered)
