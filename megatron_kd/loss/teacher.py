"""The teacher's side of the fused KD loss, one record per kind of teacher.

A dense teacher gives its final hidden states and its output-layer shard (the loss projects
them itself, window by window, as it does the student's); a top-K (sparse) teacher gives the
global ids and log-probabilities of its K most likely tokens per position (the offline cache).
:data:`Teacher` is either; "dense and top-K at once" cannot be written. The records carry the
tensors only: their shapes, dtypes and values are checked by the loss
(:mod:`megatron_kd.loss.checks`), on every tensor-parallel rank together.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

__all__ = ["DenseTeacher", "Teacher", "TopKTeacher", "teacher_tensors"]


def _check_tensors(record) -> None:
    """Every field of ``record`` is a tensor (a missing one is a ``ValueError`` naming it)."""
    for f in fields(record):
        value = getattr(record, f.name)
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"{type(record).__name__}.{f.name} must be a torch.Tensor, got "
                             f"{type(value).__name__}")


# eq=False: records of tensors compare and hash by identity (a field-wise == of tensors is
# elementwise and has no truth value).
@dataclass(frozen=True, kw_only=True, eq=False)
class DenseTeacher:
    """A dense teacher: the full-vocabulary distribution, from hidden states and the output
    layer's vocabulary shard (the same partition as the student's)."""

    hidden: torch.Tensor
    """``[s, b, h_t]`` (any leading dims, the student's) final hidden states after the
    teacher's final norm; ``[s/tp, b, h_t]`` with ``KDLossConfig.sequence_parallel``. A
    constant: no gradient flows to it."""

    weight: torch.Tensor
    """``[local_vocab_size, h_t]`` this rank's contiguous shard of the teacher's output layer,
    the same vocabulary rows as the student's shard; ``hidden``'s dtype."""

    def __post_init__(self) -> None:
        _check_tensors(self)


@dataclass(frozen=True, kw_only=True, eq=False)
class TopKTeacher:
    """A sparse teacher: its K most likely tokens per position and their log-probabilities
    (``megatron-kd cache build``'s top-K cache); the tail is treated as
    ``KDLossConfig.topk_tail`` says. Forward KL only."""

    ids: torch.Tensor
    """``[s, b, K]`` global token ids (integer; distinct within a position, in
    ``[0, vocab_size)``), the whole sequence on every TP rank (also with sequence
    parallelism)."""

    logprobs: torch.Tensor
    """``[s, b, K]`` the teacher's log-probabilities of ``ids`` at T = 1 (its log-softmax over
    the full vocabulary, so ``<= 0``)."""

    def __post_init__(self) -> None:
        _check_tensors(self)


Teacher = DenseTeacher | TopKTeacher
"""The loss's teacher: dense or top-K."""


def teacher_tensors(teacher: Teacher | None) -> tuple[torch.Tensor | None, ...]:
    """``(hidden, weight, topk_ids, topk_logprobs)`` of ``teacher``, None for the fields of the
    other kind (and all four without a teacher): the loss's autograd Functions take its tensors
    as separate inputs."""
    if isinstance(teacher, DenseTeacher):
        return teacher.hidden, teacher.weight, None, None
    if isinstance(teacher, TopKTeacher):
        return None, None, teacher.ids, teacher.logprobs
    return None, None, None, None
