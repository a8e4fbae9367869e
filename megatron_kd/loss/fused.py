"""The fused vocab-parallel KD loss: the exact full-vocabulary loss without forming the logits.

Each tensor-parallel rank holds a contiguous shard ``[vocab_start, vocab_end)`` of the student's
(and, for a dense teacher, the teacher's) output layer. Rows (tokens) are processed in windows of
at most ``window_size`` rows (:mod:`megatron_kd.loss.window`); for each window a rank projects the
hidden states onto its shard, reduces its ``[rows, local_vocab_size]`` logits to a few numbers
per row (:mod:`megatron_kd.loss.kinds`, one class per loss kind, where the formulas are), and the
ranks combine those per-row numbers (:mod:`megatron_kd.loss.combine`):

* a MAX all-reduce of the per-row maxima (the softmax shift ``M``),
* a SUM all-reduce of the per-row partial sums, all packed into one tensor: ``sum exp(a - M)``
  for student and teacher, the teacher-weighted logit differences, the label logit for CE, ...
* (JSD only) a second SUM all-reduce of two per-row sums that need the global log-sum-exp.

Inputs are checked in :mod:`megatron_kd.loss.checks`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_kd.loss import compiled, gpu_kernels, kinds
from megatron_kd.loss.checks import FiniteTracker, checked_inputs, compute_dtype
from megatron_kd.loss.combine import gather_sequence, reduce_hidden_grad
from megatron_kd.loss.config import CpuTuning, GpuTuning, KDLossConfig
from megatron_kd.loss.dense import dense_logits_kd_loss
from megatron_kd.loss.gpu import GpuKDLoss
from megatron_kd.loss.grads import input_grads, main_grad_placeholder, scale_precomputed
from megatron_kd.loss.kinds import KindMath, Stats, kind_for
from megatron_kd.loss.teacher import Teacher, teacher_tensors
from megatron_kd.loss.window import Shard, WindowWalker, active_rows

__all__ = ["vocab_parallel_kd_loss"]


class _FusedKDLoss(torch.autograd.Function):
    """Fused projection + KD (+ CE) loss over a vocab-parallel output layer.

    Collectives (``tp_group``; none when it is ``None`` or of size 1). Before this Function
    runs, :func:`vocab_parallel_kd_loss` all-gathers four integers per rank (shard size, token
    count, whether the local input checks failed, a dense teacher's shard rows), so every rank
    learns the shard offsets and every rank raises the same error instead of one rank hanging
    the others. Here:

    * forward: with ``sequence_parallel`` an all-gather of the student (and a dense teacher's)
      hidden states; per block of rows (a block is the whole window unless CPU blocks run with
      TP, :attr:`CpuTuning.blocks_with_tp`) one MAX and one SUM all-reduce of ``[k, rows]``
      per-row values (:class:`~megatron_kd.loss.combine.ShardMax`,
      :class:`~megatron_kd.loss.combine.ShardSum`; JSD: one more SUM); with precomputed
      gradients and a gradient for ``student_hidden``, one all-reduce (reduce-scatter with
      ``sequence_parallel``) of the ``[tokens, h_s]`` hidden gradient, which sums the
      contributions of every vocab shard.
    * backward, ``precompute``: none (the saved gradients are scaled by the incoming gradient).
    * backward, ``recompute``: with ``sequence_parallel`` the all-gather(s) of the hidden states
      again (forward does not keep the gathered sequence); with a gradient for
      ``student_hidden`` the same one all-reduce / reduce-scatter of the hidden gradient. The
      per-row statistics come from the forward pass, so no per-block collective.

    Neither pass synchronises with the host: no ``.item()``, no ``bool(tensor)``, no
    data-dependent shapes (the active rows and the value checks come from
    :func:`vocab_parallel_kd_loss`; a non-finite loss is tracked on the device by
    :class:`~megatron_kd.loss.checks.FiniteTracker`). The combine Functions run with autograd
    off inside this forward: the loss's gradients are the hand-written ones of
    :meth:`KindMath.grad` and :meth:`KindMath.recomputed_grad`. The teacher's inputs are
    constants: no gradient flows to them. They are the tensors of the caller's
    :data:`~megatron_kd.loss.teacher.Teacher` record, unpacked by
    :func:`~megatron_kd.loss.teacher.teacher_tensors` so autograd sees each (a dense teacher's
    ``teacher_hidden`` and ``teacher_weight``, or a top-K teacher's ``topk_ids`` and
    ``topk_logprobs``; the other kind's two are None).
    """

    @staticmethod
    def forward(ctx, student_hidden: torch.Tensor, student_weight: torch.Tensor,
                teacher_hidden: torch.Tensor | None, teacher_weight: torch.Tensor | None,
                topk_ids: torch.Tensor | None, topk_logprobs: torch.Tensor | None,
                labels: torch.Tensor | None, loss_mask: torch.Tensor,
                config: KDLossConfig, shard: Shard, tuning: CpuTuning, active: torch.Tensor,
                tracker: FiniteTracker | None, terms_out: dict | None) -> torch.Tensor:
        cdt = compute_dtype(student_hidden)
        h_s = student_hidden.shape[-1]
        lead = loss_mask.shape
        sp = config.sequence_parallel and shard.tp_world_size > 1
        walker = _walker(student_hidden, student_weight, teacher_hidden, teacher_weight,
                         topk_ids, topk_logprobs, labels, loss_mask, active, config, shard,
                         tuning, sp, cdt)
        maths = kind_for(config, shard, topk_ids is not None, teacher_hidden is not None,
                         labels is not None, compiled.DENSE_KINDS
                         if config.elementwise == "compiled" else kinds.DENSE_KINDS)

        needs_grad = student_hidden.requires_grad or student_weight.requires_grad
        precompute = config.backward == "precompute" and needs_grad
        fuse_wgrad = config.gradient_accumulation_fusion and student_weight.requires_grad
        grad_x = (walker.x_s.new_zeros(loss_mask.numel(), h_s, dtype=cdt)
                  if precompute and student_hidden.requires_grad else None)
        grad_w = (student_weight.new_zeros(student_weight.shape, dtype=cdt)
                  if precompute and student_weight.requires_grad else None)
        kd_total, ce_total, saved_stats = _forward_windows(walker, maths, precompute,
                                                           needs_grad, grad_x, grad_w, tracker,
                                                           cdt)

        loss = config.kd_weight * kd_total + config.ce_weight * ce_total
        if terms_out is not None:
            terms_out["kd_sum"] = kd_total.detach()
            terms_out["ce_sum"] = ce_total.detach()

        ctx.shard, ctx.tuning, ctx.sp, ctx.fuse_wgrad = shard, tuning, sp, fuse_wgrad
        ctx.hidden_shape = student_hidden.shape
        ctx.hidden_dtype = student_hidden.dtype
        ctx.weight_dtype = student_weight.dtype
        ctx.precompute = precompute
        if precompute:
            if grad_x is not None:
                grad_x = reduce_hidden_grad(grad_x, shard.tp_group, shard.tp_world_size, sp,
                                            lead, h_s)
                grad_x = grad_x.to(student_hidden.dtype).view(student_hidden.shape)
            if grad_w is not None and not fuse_wgrad:
                grad_w = grad_w.to(student_weight.dtype)
            ctx.grads = (grad_x, grad_w)
            ctx.weight = student_weight if fuse_wgrad else None
        else:
            ctx.config = config
            ctx.maths = maths
            ctx.cdt = cdt
            ctx.saved_stats = saved_stats
            ctx.lead = lead
            ctx.save_for_backward(student_hidden, student_weight, teacher_hidden, teacher_weight,
                                  topk_ids, topk_logprobs, labels, loss_mask, active)
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        if ctx.precompute:
            # the weight gradient scaled in place: this Function's buffer (a copy would double
            # its [V/tp, h] memory at the end of backward)
            grad_x, grad_w = scale_precomputed(
                ctx, grad_loss, lambda g, scale: g.mul_(scale.to(g.dtype)))
        else:
            grad_x, grad_w = _recompute_backward(ctx, grad_loss)
        return input_grads(ctx, grad_x, grad_w)


def _walker(student_hidden, student_weight, teacher_hidden, teacher_weight, topk_ids,
            topk_logprobs, labels, loss_mask, active, config: KDLossConfig, shard: Shard,
            tuning: CpuTuning, sp: bool, cdt: torch.dtype) -> WindowWalker:
    """The window walk over the full sequence (all-gathered first under sequence parallelism)."""
    group, size = shard.tp_group, shard.tp_world_size
    x_s = gather_sequence(student_hidden, group, size) if sp else student_hidden
    x_t = teacher_hidden
    if teacher_hidden is not None and sp:
        x_t = gather_sequence(teacher_hidden, group, size)
    return WindowWalker(x_s, student_weight, x_t, teacher_weight, topk_ids, topk_logprobs,
                        labels, loss_mask, active, config, shard, cdt, tuning)


def _forward_windows(walker: WindowWalker, maths: KindMath, precompute: bool,
                     needs_grad: bool, grad_x: torch.Tensor | None, grad_w: torch.Tensor | None,
                     tracker: FiniteTracker | None,
                     cdt: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, list[Stats]]:
    """Walk the windows: ``(sum of weighted KD, sum of weighted CE, per-block statistics for a
    recomputing backward)``; with ``precompute`` the gradients accumulate into ``grad_x`` /
    ``grad_w``."""
    kd_total = torch.zeros((), dtype=cdt, device=walker.x_s.device)
    ce_total = torch.zeros((), dtype=cdt, device=walker.x_s.device)
    saved_stats: list[Stats] = []  # per block, in walking order
    for rows, xs_w, z_s, blocks in walker.windows():
        for start, win, zb_s, zb_t in blocks:
            block = maths.stats(zb_s, zb_t, win)
            if tracker is not None:
                tracker.update(block.kd_row, block.ce_row, win, start)
            if block.kd_row is not None:
                kd_total += (win.m * block.kd_row).sum()
            if block.ce_row is not None:
                ce_total += torch.where(win.ce_m != 0, win.ce_m * block.ce_row, 0.0).sum()
            if precompute:
                _store_grad(maths.grad(block, win), zb_s)
            elif needs_grad:
                saved_stats.append(block.saved)
            del block
        if precompute:  # z_s now holds the window's logit gradient
            walker.accumulate(z_s, xs_w, rows, grad_x, grad_w)
    return kd_total, ce_total, saved_stats


def _recompute_backward(ctx, grad_loss: torch.Tensor
                        ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Project again window by window and turn the saved statistics into the gradients (the
    weight's straight into ``main_grad``, scaled, with gradient-accumulation fusion)."""
    (student_hidden, student_weight, teacher_hidden, teacher_weight, topk_ids, topk_logprobs,
     labels, loss_mask, active) = ctx.saved_tensors
    shard, maths, cdt, sp = ctx.shard, ctx.maths, ctx.cdt, ctx.sp
    h_s = student_hidden.shape[-1]
    walker = _walker(student_hidden, student_weight, teacher_hidden, teacher_weight, topk_ids,
                     topk_logprobs, labels, loss_mask, active, ctx.config, shard, ctx.tuning,
                     sp, cdt)
    scale = grad_loss.to(cdt)
    grad_x = (walker.x_s.new_zeros(loss_mask.numel(), h_s, dtype=cdt)
              if ctx.needs_input_grad[0] else None)
    fused = ctx.fuse_wgrad  # already False when the weight needs no gradient
    if fused:
        grad_w = student_weight.main_grad
    else:
        grad_w = (student_weight.new_zeros(student_weight.shape, dtype=cdt)
                  if ctx.needs_input_grad[1] else None)
    stats = iter(ctx.saved_stats)
    for rows, xs_w, z_s, blocks in walker.windows():
        for _, win, zb_s, zb_t in blocks:
            _store_grad(maths.recomputed_grad(zb_s, zb_t, next(stats), win), zb_s)
        walker.accumulate(z_s, xs_w, rows, grad_x, grad_w, scale if fused else None)
    ctx.saved_stats = None
    if grad_x is not None:
        grad_x = reduce_hidden_grad(grad_x, shard.tp_group, shard.tp_world_size, sp, ctx.lead,
                                    h_s)
        grad_x = grad_x.mul_(scale).to(ctx.hidden_dtype).view(ctx.hidden_shape)
    if fused:
        grad_w = main_grad_placeholder(student_weight)
    elif grad_w is not None:
        grad_w = grad_w.mul_(scale).to(ctx.weight_dtype)  # in place: this Function's buffer
    return grad_x, grad_w


def _store_grad(g: torch.Tensor, z_s: torch.Tensor) -> None:
    """Leave a block's logit gradient in its student logits (most kinds compute it in place)."""
    if g.data_ptr() != z_s.data_ptr():
        z_s.copy_(g)


def _check_gpu_path(config: KDLossConfig, tuning: GpuTuning) -> None:
    """The GPU path's options, checked before any collective (the same on every rank)."""
    if config.elementwise != "eager":
        raise ValueError(f"elementwise={config.elementwise!r} is an option of the CPU path; the "
                         f"GPU path (path={config.path!r}) fuses its elementwise work itself "
                         f"(GpuTuning.kernels={tuning.kernels!r}); set path='cpu' to run it")
    if tuning.kernels == "triton" and not gpu_kernels.triton_available():
        raise ValueError("GpuTuning.kernels='triton' but triton cannot be imported here; "
                         "install it, or set GpuTuning(kernels='compiled')")


# ----------------------------------------------------------------------------------------------
# public entry point
# ----------------------------------------------------------------------------------------------
def vocab_parallel_kd_loss(
    student_hidden: torch.Tensor,
    student_weight: torch.Tensor,
    teacher: Teacher | None = None,
    *,
    labels: torch.Tensor | None = None,
    loss_mask: torch.Tensor | None = None,
    config: KDLossConfig | None = None,
    tp_group: dist.ProcessGroup | None = None,
    terms_out: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """KD (+ CE) loss of a student against a dense or top-K teacher, never forming the logits.

    Args:
        student_hidden: ``[s, b, h_s]`` (any leading dims) student hidden states after the final
            norm; the full sequence on every TP rank (``[s/tp, b, h_s]`` with
            ``config.sequence_parallel``).
        student_weight: ``[local_vocab_size, h_s]`` this rank's contiguous shard of the student
            output layer; shards are in rank order and may be uneven.
        teacher: a :class:`~megatron_kd.loss.DenseTeacher` (``hidden [s, b, h_t]`` after its
            final norm, ``[s/tp, b, h_t]`` with ``config.sequence_parallel``; ``weight
            [local_vocab_size, h_t]``, the same vocab partition), a
            :class:`~megatron_kd.loss.TopKTeacher` (``ids [s, b, K]`` global token ids,
            ``logprobs [s, b, K]`` at T = 1, the full-vocab log-softmax), or None (the CE
            term alone, ``kd_weight`` 0).
        labels: ``[s, b]`` token ids for the CE term; ``ignore_index`` rows give no CE.
        loss_mask: ``[s, b]`` per-token weights (default ones), multiplying both terms.
        config: what to compute (:class:`KDLossConfig`).
        tp_group: the tensor-parallel group over which the vocabulary is sharded (None: 1 rank).
        terms_out: optional dict receiving the detached, *unweighted* sums ``kd_sum`` =
            ``sum(loss_mask * KD)`` and ``ce_sum`` = ``sum(loss_mask * CE)`` (CE over tokens
            whose label is not ``ignore_index``; computed whenever labels are given, also with
            ``ce_weight == 0``, for logging at no extra projection).

    Returns:
        ``(loss_sum, num_tokens)``: the scalar ``sum(loss_mask * (kd_weight*KD + ce_weight*CE))``
        in fp32 (fp64 for fp64 inputs), with gradients for ``student_hidden`` (the full gradient,
        summed over the vocab shards) and ``student_weight`` (this shard's gradient) in their
        dtypes; and ``loss_mask.sum()``.

    Collectives: all inside :class:`_FusedKDLoss` (its docstring lists them), the exchange of
    shard sizes included. Here the inputs' shapes are only checked locally: a rank whose check
    fails hands the message on, and every rank raises after the exchange.

    ``config.path == "dense"`` runs the reference baseline instead,
    :func:`~megatron_kd.loss.dense.dense_logits_kd_loss` (the logits written; same contract).
    """
    config = config or KDLossConfig()
    if config.path == "dense":
        return dense_logits_kd_loss(student_hidden, student_weight, teacher, labels=labels,
                                    loss_mask=loss_mask, config=config, tp_group=tp_group,
                                    terms_out=terms_out)
    gpu_path = config.uses_gpu_path(student_hidden.device)
    if gpu_path:
        tuning = config.gpu_tuning or GpuTuning()
        _check_gpu_path(config, tuning)
    else:
        # Resolved once per call: the walk of forward and a recomputing backward reads this one.
        tuning = CpuTuning.for_this_machine() if config.cpu_tuning is None else config.cpu_tuning
    shard, _, loss_mask = checked_inputs(student_hidden, student_weight, teacher, labels,
                                         loss_mask, config, tp_group)
    tracker = (FiniteTracker(student_hidden.device, compute_dtype(student_hidden))
               if config.check_finite else None)
    function = GpuKDLoss if gpu_path else _FusedKDLoss
    # the teacher's tensors as the Function's own inputs (hidden, weight, topk_ids, logprobs)
    loss = function.apply(student_hidden, student_weight, *teacher_tensors(teacher), labels,
                          loss_mask, config, shard, tuning, active_rows(loss_mask), tracker,
                          terms_out)
    if tracker is not None:
        tracker.raise_if_bad(config)  # the one host read of the call, after the Function
    num_tokens = loss_mask.sum().to(loss.dtype)
    return loss, num_tokens
