"""Input checks of the fused KD loss and the exchange of shard sizes across the TP group.

Errors must stop every tensor-parallel rank together, or the ranks that pass would hang in the
next collective. So the checks come in two kinds:

* :func:`check_local` -- shapes and dtypes, which may differ between ranks: it returns the
  message instead of raising, and :func:`exchange_sizes` raises it (or names the bad rank) on
  every rank after one all-gather;
* :func:`check_global` -- values of replicated inputs (labels, top-K ids), identical on every
  rank, so every rank raises alike without communicating.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from megatron_kd.collectives import all_gather_into
from megatron_kd.loss.config import KDLossConfig
from megatron_kd.loss.teacher import DenseTeacher, Teacher, TopKTeacher
from megatron_kd.loss.window import Shard, Window
from megatron_kd.parallel.vocab import vocab_shard

__all__ = ["FiniteTracker", "check_global", "check_local", "checked_inputs", "compute_dtype",
           "exchange_sizes", "full_lead", "world", "shard_of"]


def world(tp_group: dist.ProcessGroup | None) -> tuple[int, int]:
    """``(tp_rank, tp_world_size)`` of this process in ``tp_group`` (None: one rank)."""
    if tp_group is None:
        return 0, 1
    return dist.get_rank(tp_group), dist.get_world_size(tp_group)


def compute_dtype(student_hidden: torch.Tensor) -> torch.dtype:
    """fp32 inside (fp64 for fp64 inputs, the references' dtype)."""
    return torch.float64 if student_hidden.dtype == torch.float64 else torch.float32


def full_lead(student_hidden: torch.Tensor, tp_world_size: int, sp: bool) -> tuple[int, ...]:
    """Token shape of the full sequence (``[s, b]``; ``s/tp * tp`` under sequence parallelism)."""
    lead = tuple(student_hidden.shape[:-1])
    if sp:
        lead = (lead[0] * tp_world_size, *lead[1:])
    return lead


def check_local(student_hidden, student_weight, teacher: Teacher | None, labels, loss_mask,
                config: KDLossConfig, tp_world_size: int, sp: bool) -> str | None:
    """Shape and dtype checks that may differ between ranks; returns the message or None."""
    try:
        _check_local_raise(student_hidden, student_weight, teacher, labels, loss_mask, config,
                           tp_world_size, sp)
    except ValueError as e:
        return str(e)
    return None


def _check_local_raise(student_hidden, student_weight, teacher: Teacher | None, labels,
                       loss_mask, config: KDLossConfig, tp_world_size: int, sp: bool) -> None:
    if student_hidden.dim() < 2:
        raise ValueError(f"student_hidden must be [..., h_s], got shape "
                         f"{tuple(student_hidden.shape)}")
    if student_weight.dim() != 2:
        raise ValueError(f"student_weight must be [local_vocab_size, h_s], got shape "
                         f"{tuple(student_weight.shape)}")
    if not student_hidden.is_floating_point():
        raise ValueError(f"student_hidden must be floating point, got {student_hidden.dtype}")
    if student_hidden.shape[-1] != student_weight.shape[1]:
        raise ValueError(f"student hidden size {student_hidden.shape[-1]} != student_weight "
                         f"columns {student_weight.shape[1]} (shape {tuple(student_weight.shape)})")
    if student_hidden.dtype != student_weight.dtype:
        raise ValueError(f"student_hidden dtype {student_hidden.dtype} != student_weight dtype "
                         f"{student_weight.dtype}")
    if sp and student_hidden.dim() < 2:
        raise ValueError("sequence_parallel needs hidden states of shape [s/tp, b, h]")
    lead = full_lead(student_hidden, tp_world_size, sp)
    if teacher is not None and not isinstance(teacher, (DenseTeacher, TopKTeacher)):
        raise ValueError(f"teacher must be a DenseTeacher, a TopKTeacher or None, got "
                         f"{type(teacher).__name__}")
    if config.kd_weight > 0 and teacher is None:
        raise ValueError(f"kd_weight={config.kd_weight} > 0 but no teacher was given")
    if config.elementwise == "compiled" and not isinstance(teacher, DenseTeacher):
        raise ValueError("elementwise='compiled' needs a dense teacher (DenseTeacher); got "
                         + ("a top-K teacher" if teacher is not None else "none"))
    if isinstance(teacher, DenseTeacher):
        _check_dense(teacher, student_hidden, student_weight, lead, tp_world_size, sp)
    elif isinstance(teacher, TopKTeacher):
        _check_topk(teacher, lead, config)
    if config.ce_weight > 0 and labels is None:
        raise ValueError(f"ce_weight={config.ce_weight} > 0 needs labels")
    if labels is not None and tuple(labels.shape) != lead:
        raise ValueError(f"labels shape {tuple(labels.shape)} != token shape {lead}")
    if loss_mask is not None and tuple(loss_mask.shape) != lead:
        raise ValueError(f"loss_mask shape {tuple(loss_mask.shape)} != token shape {lead}")


def _check_dense(teacher: DenseTeacher, student_hidden, student_weight, lead: tuple[int, ...],
                 tp_world_size: int, sp: bool) -> None:
    hidden, weight = teacher.hidden, teacher.weight
    if weight.dim() != 2 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"teacher hidden size {hidden.shape[-1]} != teacher.weight columns "
                         f"(shape {tuple(weight.shape)})")
    t_lead = full_lead(hidden, tp_world_size, sp)
    if t_lead != lead:
        raise ValueError(f"teacher.hidden leading shape {tuple(hidden.shape[:-1])} != "
                         f"student_hidden leading shape {tuple(student_hidden.shape[:-1])}")
    # its vocabulary rows against the student's: every rank's, after the exchange of sizes
    if hidden.dtype != weight.dtype:
        raise ValueError(f"teacher.hidden dtype {hidden.dtype} != teacher.weight dtype "
                         f"{weight.dtype}")


def _check_topk(teacher: TopKTeacher, lead: tuple[int, ...], config: KDLossConfig) -> None:
    ids, logprobs = teacher.ids, teacher.logprobs
    if config.kind != "forward_kl":
        raise ValueError(f"a sparse (top-K) teacher supports kind='forward_kl' only, got "
                         f"{config.kind!r}")
    if config.topk_tail == "ghost" and config.temperature != 1.0:
        raise ValueError(f"topk_tail='ghost' needs temperature 1, got {config.temperature}")
    if ids.shape != logprobs.shape or tuple(ids.shape[:-1]) != lead:
        raise ValueError(f"teacher.ids {tuple(ids.shape)} and teacher.logprobs "
                         f"{tuple(logprobs.shape)} must both be {lead} + [K]")
    if ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise ValueError(f"teacher.ids must be integer, got {ids.dtype}")


def exchange_sizes(student_weight: torch.Tensor, student_hidden: torch.Tensor,
                   local_error: str | None, tp_group: dist.ProcessGroup | None,
                   tp_world_size: int, teacher_rows: int = -1) -> list[int]:
    """All ranks learn every shard size, their token counts, whether any input was bad and a
    dense teacher's output-layer rows (``teacher_rows``; -1: none), which must be the
    student's shard for shard (else every rank raises the same error, naming both)."""
    n_tokens = int(math.prod(student_hidden.shape[:-1]))
    # on the inputs' device: NCCL groups reduce device tensors only
    mine = torch.tensor([student_weight.shape[0], n_tokens, 0 if local_error is None else 1,
                         teacher_rows], dtype=torch.int64, device=student_hidden.device)
    if tp_world_size == 1:
        sizes = mine.view(1, 4)
    else:
        sizes = torch.empty(tp_world_size * 4, dtype=torch.int64, device=student_hidden.device)
        # Shard offsets come from every rank's shard size; errors must stop all ranks together.
        all_gather_into(sizes, mine, group=tp_group)
        sizes = sizes.view(tp_world_size, 4)
    if local_error is not None:
        raise ValueError(local_error)
    sizes = sizes.cpu()
    bad = [r for r in range(sizes.shape[0]) if int(sizes[r, 2])]
    if bad:
        raise ValueError(f"invalid input on tensor-parallel rank(s) {bad} (see the error there)")
    tokens = sizes[:, 1].tolist()
    if len(set(tokens)) != 1:
        raise ValueError(f"tensor-parallel ranks disagree on the number of tokens: {tokens}")
    student, teacher = sizes[:, 0].tolist(), sizes[:, 3].tolist()
    if teacher_rows >= 0 and teacher != student:
        raise ValueError(
            f"the teacher's output layer has {sum(teacher)} vocabulary rows (shards {teacher} "
            f"over the {tp_world_size} TP rank(s)) but the student's has {sum(student)} "
            f"(shards {student}): teacher and student must share one vocabulary (its tokenizer "
            f"and padding), shard for shard")
    return student


def shard_of(sizes: list[int], tp_group: dist.ProcessGroup | None, tp_rank: int,
             tp_world_size: int, config: KDLossConfig) -> Shard:
    """This rank's :class:`Shard` from every rank's shard size (rank order)."""
    return Shard(tp_group=tp_group, tp_rank=tp_rank, tp_world_size=tp_world_size,
                 vocab=vocab_shard(sizes, tp_rank, config.vocab_size))


def check_global(teacher: Teacher | None, labels, config: KDLossConfig, shard: Shard) -> None:
    """Value checks on replicated inputs (identical on every rank, so all raise alike)."""
    v = shard.vocab_size
    if labels is not None:
        bad = (labels != config.ignore_index) & ((labels < 0) | (labels >= v))
        if bool(bad.any()):
            value = int(labels[bad][0])
            raise ValueError(f"label {value} out of range [0, {v}) (ignore_index is "
                             f"{config.ignore_index})")
    if isinstance(teacher, TopKTeacher):
        topk_ids, topk_logprobs = teacher.ids, teacher.logprobs
        bad = (topk_ids < 0) | (topk_ids >= v)
        if bool(bad.any()):
            raise ValueError(f"teacher.ids value {int(topk_ids[bad][0])} out of range "
                             f"[0, {v})")
        flat = topk_ids.reshape(-1, topk_ids.shape[-1])
        srt = flat.sort(dim=1).values
        dup = srt[:, 1:] == srt[:, :-1]
        if bool(dup.any()):
            row, col = (int(i) for i in torch.nonzero(dup)[0])
            raise ValueError(f"teacher.ids has id {int(srt[row, col])} twice in token row "
                             f"{row}")
        if bool(torch.isnan(topk_logprobs).any()):
            raise ValueError("teacher.logprobs contains NaN")
        if bool((topk_logprobs > 1e-4).any()):
            raise ValueError(f"teacher.logprobs must be log-probabilities (<= 0), max is "
                             f"{float(topk_logprobs.max())}")
        if config.topk_tail == "ghost":
            mass = topk_logprobs.double().exp().sum(-1)
            if bool((mass > 1.0 + 1e-3).any()):
                raise ValueError(f"teacher top-K probabilities sum to {float(mass.max()):.6f} > 1 "
                                 f"in some token: not log-softmax values over the full vocabulary")


def checked_inputs(student_hidden: torch.Tensor, student_weight: torch.Tensor,
                   teacher: Teacher | None, labels: torch.Tensor | None,
                   loss_mask: torch.Tensor | None, config: KDLossConfig,
                   tp_group: dist.ProcessGroup | None) -> tuple[Shard, bool, torch.Tensor]:
    """Every check of the loss's inputs, on every rank of ``tp_group`` together, before any
    path's autograd Function runs: ``(this rank's shard, whether the hidden states arrive
    sequence-parallel, the loss mask)`` (ones over the full sequence where ``loss_mask`` is
    None).

    Collectives: the one all-gather of :func:`exchange_sizes` (four integers per rank), so a
    rank whose local check fails, or a teacher whose vocabulary shards are not the student's,
    makes every rank raise.
    """
    tp_rank, tp_world_size = world(tp_group)
    sp = config.sequence_parallel and tp_world_size > 1
    local_error = check_local(student_hidden, student_weight, teacher, labels, loss_mask, config,
                              tp_world_size, sp)
    if (local_error is None and config.gradient_accumulation_fusion
            and student_weight.requires_grad and not hasattr(student_weight, "main_grad")):
        local_error = ("gradient_accumulation_fusion=True but student_weight has no main_grad "
                       "(Megatron's DDP wrapper adds it; turn the fusion off without it)")
    # The all-gather of shard sizes; raises on every rank if any rank's input is bad.
    dense = isinstance(teacher, DenseTeacher) and teacher.weight.dim() == 2
    sizes = exchange_sizes(student_weight, student_hidden, local_error, tp_group, tp_world_size,
                           teacher_rows=teacher.weight.shape[0] if dense else -1)
    shard = shard_of(sizes, tp_group, tp_rank, tp_world_size, config)
    check_global(teacher, labels, config, shard)
    if loss_mask is None:
        loss_mask = torch.ones(full_lead(student_hidden, tp_world_size, sp), dtype=torch.float32,
                               device=student_hidden.device)
    return shard, sp, loss_mask


class FiniteTracker:
    """The first weighted non-finite per-row loss of a call, kept on the device.

    :meth:`update` runs per block inside the loss's forward without a host synchronisation
    (tensor ops only); :meth:`raise_if_bad` reads the result once, after the autograd Function
    has returned, and raises ``FloatingPointError`` naming the term, the token and the value.
    """

    NONE = 1 << 62  # "no bad token yet" (larger than any token index)

    def __init__(self, device: torch.device, dtype: torch.dtype):
        self.index = torch.full((), self.NONE, dtype=torch.int64, device=device)
        self.value = torch.zeros((), dtype=dtype, device=device)
        self.term = torch.zeros((), dtype=torch.int64, device=device)  # 0: KD, 1: CE

    def update(self, kd_row: torch.Tensor | None, ce_row: torch.Tensor | None, win: Window,
               offset: int) -> None:
        """Record the block's first weighted non-finite row if it comes before the one kept."""
        for term, row, weight in ((0, kd_row, win.m), (1, ce_row, win.ce_m)):
            if row is None or row.numel() == 0:
                continue
            bad = (weight != 0) & ~torch.isfinite(row)
            first = bad.to(torch.int8).argmax()  # first True (0 when none: masked below)
            index = torch.where(bad.any(), first + offset, self.NONE)
            better = index < self.index
            self.value = torch.where(better, row[first].to(self.value.dtype), self.value)
            self.term = torch.where(better, term, self.term)
            self.index = torch.minimum(index, self.index)

    def raise_if_bad(self, config: KDLossConfig) -> None:
        """One host read of the tracked state; raises if a weighted row was not finite."""
        index, term, value = (int(self.index), int(self.term), float(self.value))
        if index == self.NONE:
            return
        label = f"KD ({config.kind})" if term == 0 else "CE"
        raise FloatingPointError(
            f"non-finite {label} loss {value} at active token {index} "
            f"(check the hidden states and weights for inf/NaN)")
