"""Which positions of a sequence a rank holds: Megatron's load-balanced context-parallel split,
and the rows of a teacher's answer each student rank receives.

Context parallelism cuts a sequence into ``2 * cp`` equal chunks and gives context-parallel rank
``r`` chunks ``r`` and ``2 * cp - 1 - r`` (``megatron.core.utils.get_batch_on_this_cp_rank``:
with a causal mask the early and the late chunks balance each rank's work). A student rank
``(cp_rank c, tp_rank t)`` of a tensor- and context-parallel group is *member* ``c * tp + t``
(Megatron's rank order, TP fastest); a teacher replica answers it rows :func:`member_rows`: the
positions of CP rank ``c``, cut in ``tp`` equal slices, slice ``t`` (what a sequence-parallel
loss takes; without sequence parallelism the TP ranks gather their slices).

Pure Python: the trainer, the teacher sources, the attention and a replica take their positions
from here, and every command's check of a sequence's split (:func:`check_sequence_split`, the
one copy of the rule: ``2 cp`` equal chunks, each cut in ``tp`` slices with sequence
parallelism).
"""

from __future__ import annotations

__all__ = ["check_sequence_split", "cp_chunk_ranges", "cp_rows", "member_rows", "route_name",
           "sequence_parts"]


def sequence_parts(*, tp: int = 1, cp: int = 1, sequence_parallel: bool = False) -> int:
    """Equal parts each sequence is cut into: ``2 cp`` context-parallel chunks (with ``cp >
    1``), each cut in ``tp`` slices with sequence parallelism."""
    return (2 * cp if cp > 1 else 1) * (tp if sequence_parallel else 1)


def check_sequence_split(seq_length: int, *, tp: int = 1, cp: int = 1,
                         sequence_parallel: bool = False) -> None:
    """Raise ``ValueError`` (naming the flags and values) when a sequence of ``seq_length``
    tokens does not cut into :func:`sequence_parts` equal parts, as Megatron cuts it."""
    split = sequence_parts(tp=tp, cp=cp, sequence_parallel=sequence_parallel)
    if split > 1 and seq_length % split:
        parts = (([f"2 x --context-parallel-size {cp}"] if cp > 1 else [])
                 + ([f"--tensor-model-parallel-size {tp} (--sequence-parallel)"]
                    if sequence_parallel and tp > 1 else []))
        raise ValueError(f"--seq-length {seq_length} is not divisible by {' x '.join(parts)} = "
                         f"{split}: each sequence is split over those ranks")


def cp_chunk_ranges(seq_length: int, cp_rank: int, cp_size: int) -> tuple[range, range]:
    """The two chunks (position ranges) context-parallel rank ``cp_rank`` of ``cp_size`` holds,
    in the order it holds them."""
    if cp_size < 1 or not 0 <= cp_rank < cp_size:
        raise ValueError(f"context-parallel rank {cp_rank} of {cp_size} does not exist")
    if cp_size == 1:  # no context parallelism: the one rank holds the whole sequence
        return range(seq_length), range(seq_length, seq_length)
    check_sequence_split(seq_length, cp=cp_size)
    chunk = seq_length // (2 * cp_size)
    last = 2 * cp_size - 1 - cp_rank
    return (range(cp_rank * chunk, (cp_rank + 1) * chunk),
            range(last * chunk, (last + 1) * chunk))


def cp_rows(seq_length: int, cp_rank: int, cp_size: int) -> list[int]:
    """The positions ``[seq_length / cp_size]`` context-parallel rank ``cp_rank`` holds, in its
    order (all of them, in order, at ``cp_size`` 1)."""
    if cp_size == 1:
        return list(range(seq_length))
    first, second = cp_chunk_ranges(seq_length, cp_rank, cp_size)
    return [*first, *second]


def member_rows(seq_length: int, member: int, tp: int, cp: int) -> list[int]:
    """The positions student member ``member`` (CP rank ``member // tp``, TP rank
    ``member % tp``) receives of a teacher's answer: its CP rank's positions, TP slice."""
    if not 0 <= member < tp * cp:
        raise ValueError(f"member {member} of a group of tp {tp} x cp {cp} does not exist")
    rows = cp_rows(seq_length, member // tp, cp)
    if len(rows) % tp:
        raise ValueError(f"{len(rows)} positions per context-parallel rank do not split over "
                         f"tensor-parallel size {tp}")
    n = len(rows) // tp
    t = member % tp
    return rows[t * n:(t + 1) * n]


def route_name(member: int, tp: int, cp: int) -> str:
    """Who member ``member`` is, for messages: its TP rank and, with CP, its CP rank and
    chunks."""
    c, t = divmod(member, tp)
    if cp == 1:
        return f"TP rank {t}"
    return (f"CP rank {c} (sequence chunks {c} and {2 * cp - 1 - c} of {2 * cp}), "
            f"TP rank {t}")
