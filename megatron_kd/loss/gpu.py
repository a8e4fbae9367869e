"""The GPU path of the fused KD loss: windows sized by bytes, fused elementwise kernels, an fp32
weight gradient written by the GEMM itself.

Same maths, inputs, collectives and results as the CPU path (:mod:`megatron_kd.loss.fused`),
designed for HBM bandwidth and kernel launches instead of caches (docs/loss.md, the GPU path,
has the cost account). Per window of rows:

1. the projections ``z_s = x_s W_s^T`` (and ``z_t``) by cuBLAS into two window buffers in the
   input dtype (bf16 in training): no fp32 copy of the logits exists;
2. :func:`~megatron_kd.loss.gpu_kernels.row_stats`: one pass over both buffers gives this
   shard's per-row maxima and the sums relative to them (a running maximum, rescaled sums);
3. the combine across the vocab shards on ``[k, rows]`` device tensors (the same MAX and SUM
   all-reduces as the CPU path, :class:`~megatron_kd.loss.combine.ShardMax` /
   :class:`~megatron_kd.loss.combine.ShardSum`), then the per-row losses, all ``[rows]``
   arithmetic; JSD runs :func:`~megatron_kd.loss.gpu_kernels.jsd_sums` (a second pass) and one
   more SUM all-reduce;
4. :func:`~megatron_kd.loss.gpu_kernels.logit_grad_`: one pass writes the logit gradient over
   ``z_s``, in the input dtype (a sparse teacher's K ids are then corrected by a scatter);
5. the hidden gradient ``g W_s`` and the weight gradient ``g^T x_s``, the latter accumulated by
   the GEMM straight into an fp32 buffer (``main_grad`` with the recomputing backward and
   gradient-accumulation fusion), rounded to the weight's dtype once, at the end.

A sparse teacher's ghost tail needs the student's mass outside the K ids: the K logits are set
to ``-inf`` for :func:`row_stats` (a ``scatter_reduce`` with ``amin``, deterministic), which then
sums the tail directly, and put back before the gradient; the full sums add the K terms.
"""

from __future__ import annotations

import math

import torch

from megatron_kd.loss import gpu_kernels as gk
from megatron_kd.loss.checks import FiniteTracker
from megatron_kd.loss.combine import ShardMax, ShardSum, gather_sequence, reduce_hidden_grad
from megatron_kd.loss.config import GpuTuning, KDLossConfig
from megatron_kd.loss.grads import input_grads, main_grad_placeholder, scale_precomputed
from megatron_kd.loss.kinds import CETerm
from megatron_kd.loss.window import Scratch, Shard, Window, make_window

__all__ = ["GpuKDLoss"]

_KIND_CODE = {"forward_kl": gk.KIND_FKL, "reverse_kl": gk.KIND_RKL, "jsd": gk.KIND_JSD}
# Rows of the per-row statistics a recomputing backward keeps (and the forward computes).
_LSE_S, _LSE_T, _LSE_C, _EXTRA = range(4)


class _Walk:
    """The inputs flattened to ``[tokens, ...]``, the window size from the byte budget, the
    window buffers (allocated once per call) and the per-window steps."""

    def __init__(self, x_s, student_weight, x_t, teacher_weight, topk_ids, topk_logprobs,
                 labels, loss_mask, active, config: KDLossConfig, shard: Shard,
                 cdt: torch.dtype, tuning: GpuTuning):
        n = loss_mask.numel()
        self.x_s = x_s.reshape(n, x_s.shape[-1])
        self.x_t = None if x_t is None else x_t.reshape(n, x_t.shape[-1])
        self.w_s = student_weight[: shard.local_valid]
        self.w_t = None if teacher_weight is None else teacher_weight[: shard.local_valid]
        self.mask = loss_mask.reshape(n).to(cdt)
        self.labels = None if labels is None else labels.reshape(n)
        self.ids = None if topk_ids is None else topk_ids.reshape(n, -1)
        self.lp = None if topk_logprobs is None else topk_logprobs.reshape(n, -1)
        self.active, self.all_active = active, active.numel() == n
        self.config, self.shard, self.cdt, self.tuning = config, shard, cdt, tuning
        self.t, self.inv_t = config.temperature, 1.0 / config.temperature
        self.ce = CETerm(config, labels is not None)
        self.sparse = topk_ids is not None
        self.ghost = self.sparse and config.topk_tail == "ghost"
        dense = x_t is not None
        self.kind = _KIND_CODE[config.kind] if dense else gk.KIND_NONE
        models = 2 if dense else 1
        self.rows = tuning.rows_per_window(shard.local_valid, models, self.x_s.element_size(),
                                           config.window_size, active.numel())
        self.impl, self.block_v = tuning.kernels, tuning.block_v
        # the window buffers, in the input dtype, reused by every window
        self.z_s = self.x_s.new_empty(self.rows, shard.local_valid)
        self.z_t = None if not dense else self.x_t.new_empty(self.rows, shard.local_valid)
        self.scratch = Scratch()

    def windows(self):
        """``(first active row, rows)`` of each window; ``rows`` a slice or index tensor."""
        n_active = self.active.numel()
        for start in range(0, n_active, self.rows):
            stop = min(start + self.rows, n_active)
            yield start, (slice(start, stop) if self.all_active else self.active[start:stop])

    def project(self, rows) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, Window]:
        """``(x_s rows, z_s, z_t, window)``: the window's logits in its buffers."""
        xs = self.x_s[rows]
        n = xs.shape[0]
        z_s = torch.mm(xs, self.w_s.t(), out=self.z_s[:n])
        z_t = None
        if self.z_t is not None:
            z_t = torch.mm(self.x_t[rows], self.w_t.t(), out=self.z_t[:n])
        win = make_window(rows, self.mask, self.labels, self.ids, self.lp, self.config,
                          self.shard, self.cdt, self.scratch)
        return xs, z_s, z_t, win

    # --- forward statistics --------------------------------------------------------------------
    def stats(self, z_s, z_t, win: Window) -> tuple[torch.Tensor | None, torch.Tensor | None,
                                                      torch.Tensor]:
        """``(kd_row, ce_row, saved [4, rows])`` of a window; runs the combine's collectives.
        The logits are left as they were."""
        cdt, inv_t, n = self.cdt, self.inv_t, z_s.shape[0]
        label_logit = win.labels.gather(z_s).view(-1).to(cdt) if self.ce.on else None
        a_ids = None
        if self.sparse:
            a_ids = win.topk.gather(z_s).to(cdt) * inv_t  # 0 where the id is on another shard
        z_ids = self._mask_ids(z_s, win) if self.ghost else None
        local = gk.row_stats(z_s, z_t, inv_t, self.kind, self.ce.own_shift, cdt, self.impl,
                             self.block_v, self.tuning.num_warps)
        m_s, se_s, m_t, se_t, acc, m_c, se_c = local
        tail = None
        if self.ghost:  # the K ids back, and their terms added to the tail's sums
            if z_s.shape[1]:
                z_s.scatter_(1, win.topk.index, z_ids)  # each column gets its own value back
            tail = (se_s, m_s)
            se_s, m_s = _with_ids(se_s, m_s, a_ids, win.topk.in_shard)
        # Collective 1: the per-row shifts (MAX) every rank exponentiates against.
        top = ShardMax.apply(torch.stack([m_s, m_t, m_c]), self.shard.tp_group,
                             self.shard.tp_world_size)
        fkl = self.kind == gk.KIND_FKL
        parts = [_moved(se_s, m_s, top[0]), _moved(se_t, m_t, top[1]),
                 _moved(acc, m_t if fkl else m_s, top[1] if fkl else top[0]),
                 _moved(se_c, m_c, top[2]),
                 label_logit if label_logit is not None else torch.zeros_like(se_s)]
        if self.sparse:  # sum_k q_k a_s[id_k] over this shard's ids
            parts.append((win.topk_q * a_ids).sum(1))
        if self.ghost:
            parts.append(_moved(tail[0], tail[1], top[0]))
        # Collective 2: every per-row partial sum of the window in one all-reduce.
        tot = ShardSum.apply(torch.stack(parts), self.shard.tp_group, self.shard.tp_world_size)
        saved = torch.zeros(4, n, dtype=cdt, device=z_s.device)
        saved[_LSE_S] = top[0] + tot[0].log()
        kd_row = self._kd_row(z_s, z_t, top, tot, saved, win)
        ce_row = None
        if self.ce.on:
            lse_c = saved[_LSE_S] if not self.ce.own_shift else top[2] + tot[3].log()
            saved[_LSE_C] = lse_c
            ce_row = lse_c - tot[4]
        return kd_row, ce_row, saved

    def _mask_ids(self, z_s, win: Window) -> torch.Tensor | None:
        """Ghost tail: the K ids' logits set to ``-inf`` (so ``row_stats`` sums the tail);
        returns the values to put back. ``amin`` is deterministic where clamped ids of other
        shards share a column with a real one."""
        if not z_s.shape[1]:
            return None
        index = win.topk.index
        z_ids = z_s.gather(1, index)
        fill = torch.where(win.topk.in_shard, -math.inf, math.inf).to(z_s.dtype)
        z_s.scatter_reduce_(1, index, fill, reduce="amin")
        return z_ids

    def _kd_row(self, z_s, z_t, top, tot, saved, win: Window) -> torch.Tensor | None:
        """The per-row KD loss (times T^2) from the combined sums; fills ``saved``'s rows of
        the gradient (JSD runs its second pass and collective here)."""
        lse_s = saved[_LSE_S]
        kd_row = None
        if self.kind != gk.KIND_NONE:
            lse_t = top[1] + tot[1].log()
            saved[_LSE_T] = lse_t
            if self.kind == gk.KIND_FKL:
                kd_row = tot[2] / tot[1] - lse_t + lse_s
            elif self.kind == gk.KIND_RKL:
                c = tot[2] / tot[0]  # sum_v p_s (a_s - a_t)
                saved[_EXTRA] = c
                kd_row = c - lse_s + lse_t
            else:
                local = gk.jsd_sums(z_s, z_t, lse_s, lse_t, self.inv_t, self.config.beta,
                                    self.cdt, self.impl, self.block_v, self.tuning.num_warps)
                # Collective 3 (JSD only): its terms need the global lse first.
                jsd = ShardSum.apply(local, self.shard.tp_group, self.shard.tp_world_size)
                beta = self.config.beta
                kd_row = beta * jsd[0] + (1.0 - beta) * jsd[1]
                saved[_EXTRA] = (1.0 - beta) * jsd[1]  # sum_v p_s g
        elif self.ghost:
            log_p_tail = tot[6].log() - tot[0].log()
            saved[_EXTRA] = log_p_tail
            q, q_tail = win.topk_q, win.q_tail
            tail = torch.where(q_tail > 0, q_tail * (q_tail.log() - log_p_tail), 0.0)
            qlogq = torch.where(q > 0, q * win.topk_logq, 0.0).sum(1)
            kd_row = qlogq - (tot[5] - win.q_sum * lse_s) + tail
        elif self.sparse:
            kd_row = (win.topk_q * win.topk_logq).sum(1) - tot[5] + lse_s
        return None if kd_row is None else kd_row * (self.t * self.t)

    # --- the logit gradient --------------------------------------------------------------------
    def grad_(self, z_s, z_t, saved: torch.Tensor, win: Window,
              scale: torch.Tensor | None = None) -> torch.Tensor:
        """Overwrite ``z_s`` with the gradient of the window's weighted loss wrt the logits
        (times ``scale``, a 0-d tensor, when given); no collective."""
        cdt = self.cdt
        w_kd = win.w_kd * self.t  # d(T^2 KD)/dz = T * d KD / da
        w_ce = win.w_ce if self.ce.in_grad else torch.zeros_like(w_kd)
        shared = w_ce if self.ce.shared else torch.zeros_like(w_kd)
        if scale is not None:
            w_kd, w_ce, shared = w_kd * scale, w_ce * scale, shared * scale
        zero = torch.zeros_like(w_kd)
        coef_b, coef_f = zero, zero
        if self.kind == gk.KIND_FKL:
            coef_a, coef_f = w_kd + shared, w_kd
        elif self.kind in (gk.KIND_RKL, gk.KIND_JSD):  # p_s (w_kd (X - extra) + w_ce)
            coef_a, coef_b = shared - w_kd * saved[_EXTRA], w_kd
        elif self.ghost:
            r = torch.where(win.q_tail > 0, win.q_tail / saved[_EXTRA].exp(), 0.0)
            coef_a = w_kd * (win.q_sum + win.q_tail - r) + shared
        elif self.sparse:
            coef_a = w_kd + shared
        else:  # no teacher: the CE term alone
            coef_a = shared
        label = zero.to(torch.int64) - 1
        if self.ce.in_grad:
            label = torch.where(win.labels.in_shard, win.labels.index, -1).view(-1)
        a_ids = None
        if self.ghost:  # p_s at the ids, read before the kernel overwrites them
            a_ids = win.topk.gather(z_s).to(cdt) * self.inv_t
        gk.logit_grad_(z_s, z_t, saved[_LSE_S], saved[_LSE_T], saved[_LSE_C], coef_a, coef_b,
                       coef_f, w_ce, label, self.inv_t, self.config.beta, self.kind,
                       self.ce.in_grad and self.ce.own_shift, cdt, self.impl, self.block_v,
                       self.tuning.num_warps)
        if self.sparse:
            at_ids = -w_kd[:, None] * win.topk_q
            if self.ghost:  # ids are not in the tail: give back the r p_s taken off above
                p_ids = torch.exp(a_ids - saved[_LSE_S][:, None])
                at_ids = w_kd[:, None] * (r[:, None] * p_ids - win.topk_q)
            win.topk.scatter_add_(z_s, at_ids.to(z_s.dtype))
        return z_s

    # --- the hidden and weight gradients -------------------------------------------------------
    def hidden_grad_buffer(self) -> torch.Tensor:
        """The ``[tokens, h_s]`` hidden gradient, zeros (masked rows keep them). One vocab shard
        (TP 1): in the input dtype, each window's GEMM writing its rows directly (its sum over
        the vocabulary is in fp32 inside the GEMM, rounded once). Several: fp32, so the sum over
        the shards is rounded once, after the all-reduce."""
        dtype = self.x_s.dtype if self.shard.tp_world_size == 1 else self.cdt
        return self.x_s.new_zeros(self.mask.numel(), self.w_s.shape[1], dtype=dtype)

    def accumulate(self, g, xs, rows, grad_x, grad_w) -> None:
        """Hidden and weight gradients of one window from its logit gradient ``g`` (input
        dtype); the weight's accumulated into ``grad_w`` (fp32 by default)."""
        if grad_x is not None:
            if isinstance(rows, slice) and grad_x.dtype == g.dtype:
                torch.mm(g, self.w_s, out=grad_x[rows])
            else:
                gx = torch.mm(g, self.w_s, out=self.scratch.take("gx", g, (g.shape[0],
                                                                            self.w_s.shape[1])))
                if isinstance(rows, slice):
                    grad_x[rows] = gx
                else:
                    grad_x.index_copy_(0, rows, gx.to(grad_x.dtype))
        if grad_w is not None:
            _add_weight_grad(grad_w[: self.w_s.shape[0]], g, xs, self.tuning.weight_grad)


def _moved(s: torch.Tensor, m_local: torch.Tensor, m_global: torch.Tensor) -> torch.Tensor:
    """A per-row sum relative to ``m_local``, made relative to ``m_global`` (0 where the
    shard had no column)."""
    return torch.where(m_local == -math.inf, 0.0, s * torch.exp(m_local - m_global))


def _with_ids(se_tail: torch.Tensor, m_tail: torch.Tensor, a_ids: torch.Tensor,
              in_shard: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Ghost tail: the full local ``(sum exp, shift)`` from the tail's and the K ids' scaled
    logits (a sum of positive terms, against a shift covering both)."""
    a_in = torch.where(in_shard, a_ids, -math.inf)
    m_full = torch.maximum(m_tail, a_in.amax(1))
    ids_sum = torch.where(in_shard, torch.exp(a_in - m_full[:, None]), 0.0).sum(1)
    return _moved(se_tail, m_tail, m_full) + ids_sum, m_full


def _add_weight_grad(acc: torch.Tensor, g: torch.Tensor, x: torch.Tensor, mode: str) -> None:
    """``acc += g^T x``, ``g`` and ``x`` in the input dtype, ``acc`` in it or in fp32 / fp64
    (:attr:`GpuTuning.weight_grad`; ``input_dtype`` meets an fp32 ``acc`` as ``main_grad``
    under gradient-accumulation fusion, and adds to it as ``fp32_gemm`` does)."""
    if g.dtype == acc.dtype:  # input_dtype, or fp32 / fp64 inputs: cuBLAS adds in place
        acc.addmm_(g.t(), x)
    elif mode != "fp32_add" and acc.device.type == "cuda":
        # one GEMM reading and writing the fp32 accumulator: no rounding to the input dtype
        # (input_dtype too where the accumulator is main_grad: no product buffer)
        try:
            torch.addmm(acc, g.t(), x, out_dtype=acc.dtype, out=acc)
        except RuntimeError as e:
            raise RuntimeError(f"this torch's addmm refuses an {acc.dtype} accumulator with "
                               f"{g.dtype} operands ({e}); set GpuTuning(weight_grad="
                               f"'fp32_add') (or, without gradient-accumulation fusion, "
                               f"'input_dtype')") from e
    else:  # fp32_add (and the others on CPU, which has no such GEMM): the input-dtype product
        acc.add_(g.t() @ x)  # added in acc's dtype, with no fp32 copy of the product


class GpuKDLoss(torch.autograd.Function):
    """The fused projection + KD (+ CE) loss, GPU path; the inputs and results of
    :class:`megatron_kd.loss.fused._FusedKDLoss`, which documents the arguments.

    Collectives (``tp_group``; none when it is ``None`` or of size 1), those of the CPU path:

    * forward: with ``sequence_parallel`` an all-gather of the student (and a dense teacher's)
      hidden states; per window one MAX all-reduce of ``[3, rows]`` and one SUM all-reduce of
      ``[k, rows]`` per-row values, JSD one more SUM of ``[2, rows]``; with precomputed
      gradients and a gradient for ``student_hidden``, one all-reduce (reduce-scatter with
      ``sequence_parallel``) of the ``[tokens, h_s]`` hidden gradient.
    * backward, ``precompute``: none.
    * backward, ``recompute``: the all-gather(s) again under ``sequence_parallel``, and the
      hidden gradient's all-reduce / reduce-scatter; no per-window collective.

    No host synchronisation in either pass (the active rows come from the caller); every
    collective runs on device tensors.
    """

    @staticmethod
    def forward(ctx, student_hidden: torch.Tensor, student_weight: torch.Tensor,
                teacher_hidden: torch.Tensor | None, teacher_weight: torch.Tensor | None,
                topk_ids: torch.Tensor | None, topk_logprobs: torch.Tensor | None,
                labels: torch.Tensor | None, loss_mask: torch.Tensor,
                config: KDLossConfig, shard: Shard, tuning: GpuTuning, active: torch.Tensor,
                tracker: FiniteTracker | None, terms_out: dict | None) -> torch.Tensor:
        cdt = torch.float64 if student_hidden.dtype == torch.float64 else torch.float32
        h_s = student_hidden.shape[-1]
        sp = config.sequence_parallel and shard.tp_world_size > 1
        walk = _walk(student_hidden, student_weight, teacher_hidden, teacher_weight, topk_ids,
                     topk_logprobs, labels, loss_mask, active, config, shard, cdt, tuning, sp)
        needs_grad = student_hidden.requires_grad or student_weight.requires_grad
        precompute = config.backward == "precompute" and needs_grad
        fuse_wgrad = config.gradient_accumulation_fusion and student_weight.requires_grad
        grad_x = walk.hidden_grad_buffer() if precompute and student_hidden.requires_grad else None
        grad_w = (student_weight.new_zeros(student_weight.shape, dtype=_accumulator_dtype(
            tuning, cdt, student_weight)) if precompute and student_weight.requires_grad else None)
        saved_all = (torch.zeros(4, active.numel(), dtype=cdt, device=walk.x_s.device)
                     if needs_grad and not precompute else None)
        kd_total = torch.zeros((), dtype=cdt, device=walk.x_s.device)
        ce_total = torch.zeros((), dtype=cdt, device=walk.x_s.device)
        for start, rows in walk.windows():
            xs, z_s, z_t, win = walk.project(rows)
            kd_row, ce_row, saved = walk.stats(z_s, z_t, win)
            if tracker is not None:
                tracker.update(kd_row, ce_row, win, start)
            if kd_row is not None:
                kd_total += (win.m * kd_row).sum()
            if ce_row is not None:
                ce_total += torch.where(win.ce_m != 0, win.ce_m * ce_row, 0.0).sum()
            if precompute:
                walk.accumulate(walk.grad_(z_s, z_t, saved, win), xs, rows, grad_x, grad_w)
            elif saved_all is not None:
                saved_all[:, start:start + z_s.shape[0]] = saved
            del win, kd_row, ce_row, saved  # one window's records at a time, not two
        loss = config.kd_weight * kd_total + config.ce_weight * ce_total
        if terms_out is not None:
            terms_out["kd_sum"] = kd_total.detach()
            terms_out["ce_sum"] = ce_total.detach()

        ctx.shard, ctx.tuning, ctx.sp, ctx.fuse_wgrad = shard, tuning, sp, fuse_wgrad
        ctx.hidden_shape, ctx.hidden_dtype = student_hidden.shape, student_hidden.dtype
        ctx.weight_dtype, ctx.precompute = student_weight.dtype, precompute
        if precompute:
            if grad_x is not None:
                grad_x = reduce_hidden_grad(grad_x, shard.tp_group, shard.tp_world_size, sp,
                                            loss_mask.shape, h_s)
                grad_x = grad_x.to(student_hidden.dtype).view(student_hidden.shape)
            ctx.grads = (grad_x, grad_w)  # grad_w stays fp32 until backward's scale
            ctx.weight = student_weight if fuse_wgrad else None
        else:
            ctx.config, ctx.cdt, ctx.saved_all, ctx.lead = config, cdt, saved_all, loss_mask.shape
            ctx.save_for_backward(student_hidden, student_weight, teacher_hidden, teacher_weight,
                                  topk_ids, topk_logprobs, labels, loss_mask, active)
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        if ctx.precompute:
            # the fp32 weight gradient scaled and rounded once, in one pass
            grad_x, grad_w = scale_precomputed(
                ctx, grad_loss,
                lambda g, scale: _scaled_to(g, scale, ctx.weight_dtype, ctx.tuning.kernels))
        else:
            grad_x, grad_w = _recompute_backward(ctx, grad_loss)
        return input_grads(ctx, grad_x, grad_w)


def _scaled_to(acc: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
               impl: str) -> torch.Tensor:
    """``acc * scale`` in ``dtype``: in place when it is ``acc``'s, else one pass that reads
    the accumulator once and writes the rounded result (no scaled fp32 copy;
    :func:`~megatron_kd.loss.gpu_kernels.scale_round`)."""
    if acc.dtype == dtype:
        return acc.mul_(scale.to(dtype))
    return gk.scale_round(acc, scale, dtype, impl)


def _accumulator_dtype(tuning: GpuTuning, cdt: torch.dtype,
                       weight: torch.Tensor) -> torch.dtype:
    """The weight gradient's accumulator: fp32 (fp64 for fp64 inputs), or the weight's dtype
    with ``weight_grad="input_dtype"``."""
    return weight.dtype if tuning.weight_grad == "input_dtype" else cdt


def _walk(student_hidden, student_weight, teacher_hidden, teacher_weight, topk_ids,
          topk_logprobs, labels, loss_mask, active, config, shard, cdt, tuning, sp) -> _Walk:
    """The walk over the full sequence (all-gathered first under sequence parallelism)."""
    group, size = shard.tp_group, shard.tp_world_size
    x_s = gather_sequence(student_hidden, group, size) if sp else student_hidden
    x_t = teacher_hidden
    if teacher_hidden is not None and sp:
        x_t = gather_sequence(teacher_hidden, group, size)
    return _Walk(x_s, student_weight, x_t, teacher_weight, topk_ids, topk_logprobs, labels,
                 loss_mask, active, config, shard, cdt, tuning)


def _recompute_backward(ctx, grad_loss):
    """Project again window by window; the gradient kernel takes the saved statistics and the
    incoming gradient as per-row coefficients, so its output is already scaled (and the
    weight's goes straight into ``main_grad`` with gradient-accumulation fusion)."""
    (student_hidden, student_weight, teacher_hidden, teacher_weight, topk_ids, topk_logprobs,
     labels, loss_mask, active) = ctx.saved_tensors
    shard, cdt, sp = ctx.shard, ctx.cdt, ctx.sp
    h_s = student_hidden.shape[-1]
    walk = _walk(student_hidden, student_weight, teacher_hidden, teacher_weight, topk_ids,
                 topk_logprobs, labels, loss_mask, active, ctx.config, shard, cdt, ctx.tuning,
                 sp)
    scale = grad_loss.to(cdt)
    grad_x = walk.hidden_grad_buffer() if ctx.needs_input_grad[0] else None
    if ctx.fuse_wgrad:
        grad_w = student_weight.main_grad
    else:
        grad_w = (student_weight.new_zeros(student_weight.shape, dtype=_accumulator_dtype(
            ctx.tuning, cdt, student_weight)) if ctx.needs_input_grad[1] else None)
    for start, rows in walk.windows():
        xs, z_s, z_t, win = walk.project(rows)
        saved = ctx.saved_all[:, start:start + z_s.shape[0]]
        walk.accumulate(walk.grad_(z_s, z_t, saved, win, scale), xs, rows, grad_x, grad_w)
        del win  # one window's records at a time, not two
    # the window buffers and the statistics freed before the gradients' rounded copies (or
    # main_grad's placeholder) are allocated: held there, they added the window's logits to
    # the recomputing backward's peak
    ctx.saved_all = None
    walk = xs = z_s = z_t = saved = None
    if grad_x is not None:
        grad_x = reduce_hidden_grad(grad_x, shard.tp_group, shard.tp_world_size, sp, ctx.lead,
                                    h_s)
        grad_x = grad_x.to(ctx.hidden_dtype).view(ctx.hidden_shape)
    if ctx.fuse_wgrad:
        grad_w = main_grad_placeholder(student_weight)
    elif grad_w is not None:
        grad_w = grad_w.to(ctx.weight_dtype)
    return grad_x, grad_w

