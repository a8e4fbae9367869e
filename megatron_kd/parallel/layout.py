"""Rank layouts of a student and a disaggregated teacher sharing one ``torch.distributed`` world.

The world is split in two contiguous blocks: the student's ranks ``[0, S)`` (so the student's
rank 0 is global rank 0, where logs and checkpoints are written) and the teacher's ranks
``[S, S + N)``. Each side has its own tensor-, pipeline- and data-parallel layout, laid out like
Megatron-Core (order ``tp-cp-ep-dp-pp``: TP fastest, PP slowest)::

    local = tp_rank + tp * (dp_rank + dp * pp_rank),   global = offset + local

Student data-parallel rank ``d`` is served by teacher replica ``d // (dp_s / dp_t)``: a replica
serves one or several student DP ranks (the student's DP size must be a multiple of the number
of teacher replicas). On the student's last pipeline stage, TP rank ``i`` receives sequence chunk
``i`` of the teacher's final hidden states from the teacher replica's last-stage TP rank
``i % tp_t`` (every teacher TP rank holds the full hidden states, so the sends are spread).

Everything here is pure rank arithmetic, testable without processes;
:mod:`megatron_kd.integration.groups` turns it into Megatron-Core process groups.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["Layout", "Route", "DisaggTopology", "check_parallel_sizes"]


@dataclass(kw_only=True, frozen=True)
class Layout:
    """One side's ranks: ``world_size`` ranks starting at global rank ``offset``."""

    world_size: int
    """Ranks of this side."""

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


@dataclass(frozen=True)
class Route:
    """One point-to-point stream: a teacher rank sends a sequence chunk to a student rank."""

    teacher_rank: int
    student_rank: int
    student_dp_rank: int
    teacher_replica: int
    chunk: int  # sequence chunk index = the receiving student's TP rank
    num_chunks: int  # the student's TP size


@dataclass(kw_only=True, frozen=True)
class DisaggTopology:
    """The student and teacher layouts of one world and the streams between them."""

    student: Layout
    teacher: Layout
    routes: tuple[Route, ...] = field(init=False)

    def __post_init__(self) -> None:
        if self.student.offset != 0:
            raise ValueError(f"the student's ranks start at 0, got offset {self.student.offset}")
        if self.teacher.offset != self.student.world_size:
            raise ValueError(f"the teacher's ranks must follow the student's: offset "
                             f"{self.teacher.offset} != student world size "
                             f"{self.student.world_size}")
        if self.student.dp % self.teacher.dp:
            raise ValueError(
                f"{self.teacher.dp} teacher replica(s) cannot evenly serve {self.student.dp} "
                f"student data-parallel rank(s): the student's DP size must be a multiple of the "
                f"number of teacher replicas (teacher world {self.teacher.world_size} = "
                f"tp {self.teacher.tp} x pp {self.teacher.pp} x dp {self.teacher.dp})")
        routes = []
        for d in range(self.student.dp):
            r = self.replica_of(d)
            for i in range(self.student.tp):
                routes.append(Route(
                    teacher_rank=self.teacher.rank_of(tp_rank=i % self.teacher.tp, dp_rank=r,
                                                      pp_rank=self.teacher.pp - 1),
                    student_rank=self.student.rank_of(tp_rank=i, dp_rank=d,
                                                      pp_rank=self.student.pp - 1),
                    student_dp_rank=d, teacher_replica=r, chunk=i, num_chunks=self.student.tp))
        object.__setattr__(self, "routes", tuple(routes))

    @classmethod
    def from_world(cls, *, world_size: int, teacher_world_size: int, student_tp: int = 1,
                   student_pp: int = 1, teacher_tp: int = 1, teacher_pp: int = 1
                   ) -> "DisaggTopology":
        if not 0 < teacher_world_size < world_size:
            raise ValueError(f"teacher world size {teacher_world_size} must be between 1 and "
                             f"world size - 1 = {world_size - 1}")
        s = world_size - teacher_world_size
        return cls(student=Layout(world_size=s, tp=student_tp, pp=student_pp, offset=0),
                   teacher=Layout(world_size=teacher_world_size, tp=teacher_tp, pp=teacher_pp,
                                  offset=s))

    @property
    def world_size(self) -> int:
        return self.student.world_size + self.teacher.world_size

    def side(self, global_rank: int) -> str:
        if self.student.contains(global_rank):
            return "student"
        if self.teacher.contains(global_rank):
            return "teacher"
        raise ValueError(f"global rank {global_rank} outside the world of {self.world_size}")

    @property
    def students_per_replica(self) -> int:
        return self.student.dp // self.teacher.dp

    def replica_of(self, student_dp_rank: int) -> int:
        """The teacher replica serving a student DP rank."""
        return student_dp_rank // self.students_per_replica

    def students_of(self, replica: int) -> list[int]:
        """Student DP ranks served by a teacher replica, in order."""
        k = self.students_per_replica
        return list(range(replica * k, (replica + 1) * k))

    def routes_from(self, teacher_rank: int) -> list[Route]:
        return [r for r in self.routes if r.teacher_rank == teacher_rank]

    def route_to(self, student_rank: int) -> Route | None:
        for r in self.routes:
            if r.student_rank == student_rank:
                return r
        return None


def check_parallel_sizes(world_size: int, tp: int, pp: int) -> int:
    """Data-parallel size for ``tp * pp`` model-parallel ranks; ValueError when it does not fit."""
    if tp < 1 or pp < 1:
        raise ValueError(f"parallel sizes must be >= 1, got tensor-model-parallel-size={tp}, "
                         f"pipeline-model-parallel-size={pp}")
    if world_size % (tp * pp):
        raise ValueError(f"world size {world_size} is not divisible by tensor-model-parallel-size "
                         f"{tp} x pipeline-model-parallel-size {pp}")
    return world_size // (tp * pp)
