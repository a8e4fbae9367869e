"""A model's rank layout: ``world_size`` ranks, tensor-, pipeline- and data-parallel, laid out
like Megatron-Core (order ``tp-cp-ep-dp-pp``: TP fastest, PP slowest)::

    local = tp_rank + tp * (dp_rank + dp * pp_rank),   global = offset + local

Pure rank arithmetic, testable without processes (a teacher replica uses it to name its last
pipeline stage's ranks; the planner and the checks use the sizes).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Layout", "check_parallel_sizes"]


@dataclass(kw_only=True, frozen=True)
class Layout:
    """``world_size`` ranks starting at global rank ``offset``."""

    world_size: int
    """Ranks of the model."""

    tp: int = 1
    """Tensor-parallel size."""

    pp: int = 1
    """Pipeline-parallel size."""

    offset: int = 0
    """Global rank of this side's rank 0."""

    def __post_init__(self) -> None:
        for name in ("world_size", "tp", "pp"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.offset < 0:
            raise ValueError(f"offset must be >= 0, got {self.offset}")
        if self.world_size % (self.tp * self.pp):
            raise ValueError(f"world size {self.world_size} is not divisible by tp*pp = "
                             f"{self.tp}*{self.pp}")

    @property
    def dp(self) -> int:
        """Data-parallel size (model replicas)."""
        return self.world_size // (self.tp * self.pp)

    @property
    def ranks(self) -> range:
        return range(self.offset, self.offset + self.world_size)

    def contains(self, global_rank: int) -> bool:
        return self.offset <= global_rank < self.offset + self.world_size

    def coords(self, global_rank: int) -> tuple[int, int, int]:
        """``(tp_rank, dp_rank, pp_rank)`` of a global rank of this side."""
        if not self.contains(global_rank):
            raise ValueError(f"global rank {global_rank} is not in ranks {self.ranks}")
        local = global_rank - self.offset
        return local % self.tp, (local // self.tp) % self.dp, local // (self.tp * self.dp)

    def rank_of(self, *, tp_rank: int, dp_rank: int, pp_rank: int) -> int:
        """Global rank at these coordinates."""
        if not (0 <= tp_rank < self.tp and 0 <= dp_rank < self.dp and 0 <= pp_rank < self.pp):
            raise ValueError(f"coordinates tp={tp_rank} dp={dp_rank} pp={pp_rank} outside "
                             f"tp<{self.tp} dp<{self.dp} pp<{self.pp}")
        return self.offset + tp_rank + self.tp * (dp_rank + self.dp * pp_rank)

    def tp_group_ranks(self, *, dp_rank: int, pp_rank: int) -> list[int]:
        return [self.rank_of(tp_rank=t, dp_rank=dp_rank, pp_rank=pp_rank) for t in range(self.tp)]

    def pp_group_ranks(self, *, tp_rank: int, dp_rank: int) -> list[int]:
        return [self.rank_of(tp_rank=tp_rank, dp_rank=dp_rank, pp_rank=p) for p in range(self.pp)]


def check_parallel_sizes(world_size: int, tp: int, pp: int, ep: int = 1,
                         etp: int | None = None, cp: int = 1) -> int:
    """Data-parallel size for ``tp * pp * cp`` model-parallel ranks; ValueError when it does not
    fit.

    The experts have a layout of their own over each pipeline stage's ``tp * cp * dp`` ranks
    (Megatron-Core's "parallel folding"): ``ep`` expert-parallel times ``etp`` expert
    tensor-parallel ranks (``etp`` defaults to ``tp``) must divide ``tp * cp * dp``."""
    etp = tp if etp is None else etp
    if tp < 1 or pp < 1 or ep < 1 or etp < 1 or cp < 1:
        raise ValueError(f"parallel sizes must be >= 1, got tensor-model-parallel-size={tp}, "
                         f"pipeline-model-parallel-size={pp}, expert-model-parallel-size={ep}, "
                         f"context-parallel-size={cp}")
    if world_size % (tp * pp * cp):
        raise ValueError(f"world size {world_size} is not divisible by tensor-model-parallel-size "
                         f"{tp} x pipeline-model-parallel-size {pp}"
                         + (f" x context-parallel-size {cp}" if cp > 1 else ""))
    dp = world_size // (tp * pp * cp)
    if (tp * cp * dp) % (ep * etp):
        raise ValueError(f"expert-model-parallel-size {ep} x expert-tensor-parallel-size {etp} "
                         f"does not divide the {tp * cp * dp} ranks of a pipeline stage (world "
                         f"{world_size} / PP {pp})")
    return dp
