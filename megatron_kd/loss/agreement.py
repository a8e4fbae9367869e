"""How closely a student follows its teacher, for evaluation: the KL at T = 1 and the top-1
agreement, per token, over a vocab-parallel output layer, without forming the logits.

Two fixed metrics, whatever loss is trained (``KDLossConfig.kind``, ``temperature``,
``topk_tail`` do not change them):

* ``kl``: the forward KL ``KL(p_t || p_s)`` at temperature 1 over the full (true) vocabulary,
  ``p = softmax(z)``. With a top-K teacher (an offline cache) it is the KL over the teacher's
  K ids plus one bucket for the rest of the vocabulary (the ghost tail:
  ``sum_k q_k log(q_k / p_s[id_k]) + q_tail log(q_tail / p_tail)``, ``q_tail = 1 - sum_k q_k``,
  ``p_tail = 1 - sum_k p_s[id_k]``): the KL of the two distributions coarse-grained onto those
  K + 1 buckets, so ``0 <= kl <=`` the full KL, and 0 when the student's probabilities equal
  the teacher's.
* ``top1``: 1 where the student's most likely token is the teacher's, else 0. The most likely
  token of a row is its lowest id among the largest logits (``torch.argmax``'s rule on the full
  row); with a top-K teacher the teacher's is the lowest id among its largest log-probability.

Each is summed over the tokens weighted by ``loss_mask`` (0 / 1 in training data: the sum over
the valid tokens), like the loss's own reports; the caller divides by the mask's sum.

The walk is the loss's (:class:`~megatron_kd.loss.window.WindowWalker`: windows of at most
``window_size`` rows, zero-weight rows skipped), forward only; the KL's maths is the loss's own
forward-KL kinds at T = 1 (:class:`~megatron_kd.loss.kinds.ForwardKL`,
:class:`~megatron_kd.loss.kinds.SparseGhostTail`), and the argmax combines across the shards in
:class:`~megatron_kd.loss.combine.ShardArgmax`. Evaluation only: it projects the student (and a
dense teacher) once more, on any device, with eager PyTorch ops.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_kd.loss.checks import checked_inputs, compute_dtype
from megatron_kd.loss.combine import ShardArgmax, gather_sequence
from megatron_kd.loss.config import CpuTuning, KDLossConfig
from megatron_kd.loss.kinds import kind_for
from megatron_kd.loss.teacher import DenseTeacher, Teacher, TopKTeacher, teacher_tensors
from megatron_kd.loss.window import Shard, WindowWalker, active_rows

__all__ = ["AgreementSums", "metric_config", "vocab_parallel_agreement"]


@dataclass(frozen=True, kw_only=True)
class AgreementSums:
    """The sums of one call (0-d tensors in the compute dtype, replicated over the TP group)."""

    kl_sum: torch.Tensor
    """``sum(loss_mask * KL(p_t || p_s))`` at T = 1 (see the module docstring)."""

    top1_sum: torch.Tensor
    """``sum(loss_mask * [argmax z_s == argmax z_t])``."""

    num_tokens: torch.Tensor
    """``sum(loss_mask)``."""


def metric_config(config: KDLossConfig | None) -> KDLossConfig:
    """The configuration the metrics are computed under: the run's vocabulary, windows,
    sequence parallelism and CPU tuning, with the loss fixed to forward KL at T = 1 (ghost tail
    for a top-K teacher), eager, forward only."""
    config = config or KDLossConfig()
    return dataclasses.replace(config, kind="forward_kl", temperature=1.0, kd_weight=1.0,
                               ce_weight=0.0, topk_tail="ghost", elementwise="eager",
                               gradient_accumulation_fusion=False, check_finite=False,
                               path="cpu", gpu_tuning=None)


def vocab_parallel_agreement(
    student_hidden: torch.Tensor,
    student_weight: torch.Tensor,
    teacher: Teacher,
    *,
    loss_mask: torch.Tensor | None = None,
    config: KDLossConfig | None = None,
    tp_group: dist.ProcessGroup | None = None,
) -> AgreementSums:
    """Student-teacher KL at T = 1 and top-1 agreement, summed over the weighted tokens.

    Args:
        student_hidden: ``[s, b, h_s]`` (any leading dims) the student's final hidden states;
            ``[s/tp, b, h_s]`` with ``config.sequence_parallel``.
        student_weight: ``[local_vocab_size, h_s]`` this rank's shard of the student's output
            layer (rank order, possibly uneven).
        teacher: a :class:`~megatron_kd.loss.DenseTeacher` (the same vocabulary partition) or a
            :class:`~megatron_kd.loss.TopKTeacher` (log-probabilities of the full-vocabulary
            softmax at T = 1, summing to at most 1).
        loss_mask: ``[s, b]`` per-token weights (default ones).
        config: the run's loss configuration, for ``vocab_size`` (rows past it are padding and
            never a token), ``window_size``, ``sequence_parallel`` and ``cpu_tuning``; the
            metric itself is fixed (:func:`metric_config`).
        tp_group: the group the vocabulary is sharded over (None: one rank).

    Returns:
        :class:`AgreementSums`, the same on every rank of ``tp_group``.

    Collectives (``tp_group``): the loss's input checks (one all-gather of four integers per
    rank, so every rank raises a bad input together); with sequence parallelism an all-gather
    of the student's (and a dense teacher's) hidden states; per block of rows the loss's two
    (:class:`~megatron_kd.loss.combine.ShardMax`, :class:`~megatron_kd.loss.combine.ShardSum`)
    and :class:`~megatron_kd.loss.combine.ShardArgmax`'s two (a MAX, then a MIN all-reduce).

    Raises ``FloatingPointError`` when the KL of a weighted token is not finite (one host read,
    at the end); ``ValueError`` for bad inputs, ``teacher`` None included.
    """
    if not isinstance(teacher, (DenseTeacher, TopKTeacher)):
        raise ValueError(f"the student-teacher metrics need a DenseTeacher or a TopKTeacher, "
                         f"got {type(teacher).__name__}")
    cfg = metric_config(config)
    with torch.no_grad():
        shard, sp, mask = checked_inputs(student_hidden, student_weight, teacher, None,
                                         loss_mask, cfg, tp_group)
        cdt = compute_dtype(student_hidden)
        walker = _walker(student_hidden, student_weight, teacher, mask, cfg, shard, sp, cdt)
        maths = kind_for(cfg, shard, isinstance(teacher, TopKTeacher),
                         isinstance(teacher, DenseTeacher), False)
        kl_sum = torch.zeros((), dtype=cdt, device=walker.x_s.device)
        top1_sum = torch.zeros((), dtype=cdt, device=walker.x_s.device)
        bad = torch.zeros((), dtype=torch.bool, device=walker.x_s.device)
        for _, _, _, blocks in walker.windows():
            for start, win, zb_s, zb_t in blocks:
                # argmaxes first: the kind's statistics consume the logits
                agree = _top1(walker, shard, start, zb_s, zb_t)
                kl_row = maths.stats(zb_s, zb_t, win).kd_row  # T = 1: no T^2 factor
                bad |= ((win.m != 0) & ~torch.isfinite(kl_row)).any()
                kl_sum += (win.m * torch.where(win.m != 0, kl_row, 0.0)).sum()
                top1_sum += (win.m * agree).sum()
        if bool(bad):  # the one host read of the call
            raise FloatingPointError("non-finite student-teacher KL in evaluation (check the "
                                     "hidden states and weights for inf/NaN)")
        return AgreementSums(kl_sum=kl_sum, top1_sum=top1_sum, num_tokens=mask.sum().to(cdt))


def _walker(student_hidden: torch.Tensor, student_weight: torch.Tensor, teacher: Teacher,
            mask: torch.Tensor, cfg: KDLossConfig, shard: Shard, sp: bool,
            cdt: torch.dtype) -> WindowWalker:
    """The loss's window walk over the full sequence (gathered under sequence parallelism)."""
    t_hidden, t_weight, ids, logprobs = teacher_tensors(teacher)
    group, size = shard.tp_group, shard.tp_world_size
    x_s = gather_sequence(student_hidden, group, size) if sp else student_hidden
    if t_hidden is not None and sp:
        t_hidden = gather_sequence(t_hidden, group, size)
    tuning = CpuTuning.for_this_machine() if cfg.cpu_tuning is None else cfg.cpu_tuning
    return WindowWalker(x_s, student_weight, t_hidden, t_weight, ids, logprobs, None, mask,
                        active_rows(mask), cfg, shard, cdt, tuning)


def _local_argmax(z: torch.Tensor, shard: Shard) -> tuple[torch.Tensor, torch.Tensor]:
    """``(per-row max, global id of its first column)`` of a block's ``[rows, V_valid]``
    logits on this shard (``-inf`` and any id for a shard with no real columns)."""
    if z.shape[1] == 0:
        return (z.new_full((z.shape[0],), -torch.inf),
                torch.zeros(z.shape[0], dtype=torch.int64, device=z.device))
    local_id = z.argmax(dim=1)  # the first maximal column
    return z.gather(1, local_id[:, None]).view(-1), local_id + shard.vocab_start


def _top1(walker: WindowWalker, shard: Shard, start: int, z_s: torch.Tensor,
          z_t: torch.Tensor | None) -> torch.Tensor:
    """``[rows]`` 1.0 where the block's student and teacher argmaxes agree, else 0.0."""
    max_s, id_s = _local_argmax(z_s, shard)
    if z_t is not None:  # dense teacher: both argmaxes in one combine
        max_t, id_t = _local_argmax(z_t, shard)
        ids = ShardArgmax.apply(torch.stack([max_s, max_t]), torch.stack([id_s, id_t]),
                                shard.tp_group, shard.tp_world_size)
        student, teacher = ids[0], ids[1]
    else:  # top-K teacher: its ids are replicated, its argmax needs no collective
        student = ShardArgmax.apply(max_s[None], id_s[None], shard.tp_group,
                                    shard.tp_world_size)[0]
        n = z_s.shape[0]
        rows = (slice(start, start + n) if walker.all_active
                else walker.active[start:start + n])
        ids, lp = walker.ids[rows], walker.lp[rows]
        best = lp == lp.max(dim=1, keepdim=True).values  # ties: the lowest id among them
        teacher = torch.where(best, ids.to(torch.int64), torch.iinfo(torch.int64).max).amin(1)
    return (student == teacher).to(z_s.dtype)
