"""How a sequence splits over a parallel layout: the rule every command checks (``train``,
``teacher serve``, ``cache build``, the Megatron-LM hooks, ``plan``), written once. Pure
Python.

Context parallelism cuts each sequence into ``2 cp`` equal chunks (Megatron's load-balanced
split, :mod:`megatron_kd.parallel.sequence`); sequence parallelism cuts each rank's part into
``tp`` slices.
"""

from __future__ import annotations

__all__ = ["check_sequence_split", "sequence_parts"]


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
