"""The fused vocab-parallel KD loss: the exact full-vocabulary loss without forming the logits.

Each tensor-parallel rank holds a contiguous shard ``[vocab_start, vocab_end)`` of the student's
(and, for a dense teacher, the teacher's) output layer. Rows (tokens) are processed in windows of
at most ``window_size`` rows; for each window a rank projects the hidden states onto its shard,
reduces its ``[rows, local_vocab_size]`` logits to a few numbers per row, and the ranks combine
those per-row numbers with all-reduces:

* a MAX all-reduce of the per-row maxima (the softmax shift ``M``),
* a SUM all-reduce of the per-row partial sums, all packed into one tensor: ``sum exp(a - M)``
  for student and teacher, the teacher-weighted logit differences, the label logit for CE, ...
* (JSD only) a second SUM all-reduce of two per-row sums that need the global log-sum-exp.

With ``a = z / T``, ``lse = M + log(sum exp(a - M))`` and ``p = exp(a - lse)``, per row:

* forward KL: ``KL(p_t || p_s) = sum_v p_t (a_t - a_s) - lse_t + lse_s``,
  gradient wrt ``a_s``: ``p_s - p_t``;
* reverse KL: ``KL(p_s || p_t) = sum_v p_s (a_s - a_t) - lse_s + lse_t``,
  gradient: ``p_s * (a_s - a_t - c)`` with ``c = sum_v p_s (a_s - a_t)``;
* JSD: ``beta KL(p_t || m) + (1 - beta) KL(p_s || m)``, gradient
  ``p_s * (g - sum_v p_s g)`` with ``g = (1 - beta) (log p_s - log m)``;
* sparse teacher, renormalised top-K ``q``: ``sum_k q_k log q_k - sum_k q_k a_s[id_k] + lse_s``,
  gradient ``p_s - q`` (``q`` scattered onto its ids);
* sparse teacher, ghost tail (T = 1): the K buckets plus a tail bucket with the leftover masses,
  gradient ``Q p_s - q - [v in tail] p_s q_tail / p_tail`` with ``Q = sum_k q_k + q_tail``;
* CE (T = 1): ``lse - z[label]``, gradient ``softmax(z) - onehot(label)``.

The gradient wrt the logits of the KD term is ``T^2 / T = T`` times the gradient wrt ``a_s``.

On CPU without tensor parallelism a window's elementwise work (the statistics above and the logit
gradient) runs in blocks of rows small enough for the last-level cache (``CPU_BLOCK_ELEMENTS``
per ``[rows, V_local]`` buffer), while the projections stay window-sized (a GEMM of a few rows
would re-read the whole weight shard per block). The dozen elementwise passes then read the
cache instead of memory. The per-row all-reduces run per block, so with TP > 1 (and on other
devices) a block is the whole window: on gloo the extra synchronisations cost more than the
cache saves.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_kd.loss.config import KDLossConfig

__all__ = ["vocab_parallel_kd_loss"]

# Per-row statistics kept between forward and a recomputing backward, by name.
_Stats = dict[str, torch.Tensor]

#: Elements of one ``[rows, V_local]`` fp32 block on CPU (8 MiB, 13 rows at V = 151,936): a
#: block's two or three live buffers fit a 32 MiB last-level cache. Measured on 2 cores at
#: T = 2048, V = 151,936, h 256 / 512, forward KL, fwd+bwd, median of 5: 1.21x the GEMM floor
#: unblocked, 1.13x with 4 MiB blocks, 1.08x with 8 or 16 MiB blocks. At TP = 2 on gloo (one
#: thread per rank) blocks made the loss 1.17x slower (per-block all-reduces), hence
#: ``CPU_BLOCKS_WITH_TP``.
CPU_BLOCK_ELEMENTS = 1 << 21

#: Whether CPU blocks are used when the per-row statistics need all-reduces (TP > 1).
CPU_BLOCKS_WITH_TP = False


@dataclass
class _Shard:
    """Where this rank's output-layer shard sits in the global vocabulary."""

    tp_group: dist.ProcessGroup | None
    tp_rank: int
    tp_world_size: int
    vocab_start: int
    local_vocab_size: int
    local_valid: int  # rows of the shard that are real tokens (below the true vocab size)
    vocab_size: int  # true global vocabulary


def _world(tp_group) -> tuple[int, int]:
    if tp_group is None:
        return 0, 1
    return dist.get_rank(tp_group), dist.get_world_size(tp_group)


def _all_reduce(t: torch.Tensor, shard: _Shard, op=dist.ReduceOp.SUM) -> torch.Tensor:
    if shard.tp_world_size > 1:
        dist.all_reduce(t, op=op, group=shard.tp_group)
    return t


def _row_max(a: torch.Tensor) -> torch.Tensor:
    """Per-row max; -inf for a shard with no real columns."""
    if a.shape[1] == 0:
        return a.new_full((a.shape[0],), -math.inf)
    return a.amax(dim=1)


def _row_dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per-row sum of ``a * b`` without a [rows, V] temporary (batched 1 x V @ V x 1)."""
    return torch.bmm(a.unsqueeze(1), b.unsqueeze(2)).view(-1)


class _Ids:
    """Global token ids of a window (labels or top-K ids) mapped onto this rank's shard."""

    def __init__(self, ids: torch.Tensor, shard: _Shard):
        local = ids - shard.vocab_start
        self.in_shard = (local >= 0) & (local < shard.local_valid)
        self.empty = shard.local_valid == 0
        self.index = local.clamp(0, max(shard.local_valid - 1, 0))

    def gather(self, a: torch.Tensor) -> torch.Tensor:
        """``a[row, id]`` where the id is on this shard, else 0."""
        if self.empty:
            return a.new_zeros(self.index.shape)
        return torch.where(self.in_shard, a.gather(1, self.index), 0.0)

    def scatter_add_(self, g: torch.Tensor, src: torch.Tensor) -> None:
        """``g[row, id] += src`` for the ids on this shard."""
        if not self.empty:
            g.scatter_add_(1, self.index, torch.where(self.in_shard, src, 0.0))


class _Window:
    """One window of rows: the inputs restricted to those rows, in the compute dtype."""

    def __init__(self, **kw):
        self.__dict__.update(kw)


class _KDMath:
    """Per-window maths of every loss kind: statistics (with the collectives) and gradients.

    ``stats`` computes the per-row losses and the per-row values a gradient needs; it runs the
    all-reduces. ``grad`` turns a window's logits and those statistics into the gradient wrt the
    student logits, without any collective. The forward pass with precomputed gradients calls
    both on the same logits; the recomputing backward projects again and calls ``grad`` with the
    statistics saved by the forward pass.
    """

    def __init__(self, config: KDLossConfig, shard: _Shard, sparse: bool, dense: bool, ce: bool,
                 cdt):
        self.cfg = config
        self.shard = shard
        self.sparse = sparse
        self.dense = dense
        self.ce = ce  # labels given: the CE term is computed (and reported)
        self.ce_grad = ce and config.ce_weight > 0  # ... and it contributes to the gradient
        self.cdt = cdt
        self.inv_t = 1.0 / config.temperature
        self.t = config.temperature

    # --- projections -------------------------------------------------------------------------
    def logits(self, x: torch.Tensor, w_valid: torch.Tensor) -> torch.Tensor:
        """``x @ w_valid.T`` in the input dtype, returned in the compute dtype."""
        return (x @ w_valid.t()).to(self.cdt)

    # --- statistics ----------------------------------------------------------------------------
    def stats(self, z_s: torch.Tensor, z_t: torch.Tensor | None, win: _Window):
        """Per-row KD and CE losses and the statistics for the gradient; runs the collectives.

        Consumes (overwrites) ``z_s`` and ``z_t``. Returns ``(kd_row, ce_row, stats, bufs)`` where
        ``bufs`` holds the exponentials a precomputing caller reuses for the gradient.
        """
        cfg, shard = self.cfg, self.shard
        label_logit = win.labels.gather(z_s).view(-1) if self.ce else None
        need_ce_shift = self.ce and self.t != 1.0
        z_c = z_s.clone() if need_ce_shift else None
        a_s = z_s.mul_(self.inv_t) if self.t != 1.0 else z_s
        a_t = None
        if z_t is not None:
            a_t = z_t.mul_(self.inv_t) if self.t != 1.0 else z_t

        # Collective 1: the per-row softmax shifts (MAX), so every rank exponentiates alike.
        maxes = [_row_max(a_s)]
        if a_t is not None:
            maxes.append(_row_max(a_t))
        if need_ce_shift:
            maxes.append(_row_max(z_c))
        m = _all_reduce(torch.stack(maxes), shard, dist.ReduceOp.MAX)
        m_s = m[0]
        m_t = m[1] if a_t is not None else None
        m_c = m[-1] if need_ce_shift else None

        sums: dict[str, torch.Tensor] = {}
        bufs: dict[str, torch.Tensor] = {}
        kind = cfg.kind
        if self.sparse:
            q = win.topk_q  # teacher probabilities on the K ids (renormalised or as given)
            sums["g"] = (q * win.topk.gather(a_s)).sum(1)  # sum_k q_k a_s[id_k], this shard's ids
            e_s = a_s.sub_(m_s[:, None]).exp_()
            sums["se_s"] = e_s.sum(1)
            if cfg.topk_tail == "ghost":
                # student mass outside the K ids: mask the ids out (no cancellation)
                sums["se_tail"] = self._tail_sum(e_s, win)
            bufs["e_s"] = e_s
        elif not self.dense:  # CE only
            e_s = a_s.sub_(m_s[:, None]).exp_()
            sums["se_s"] = e_s.sum(1)
            bufs["e_s"] = e_s
        elif kind == "forward_kl":
            e_t = (a_t - m_t[:, None]).exp_()
            d = a_t.sub_(a_s)  # a_t - a_s
            sums["s"] = _row_dot(e_t, d)
            e_s = a_s.sub_(m_s[:, None]).exp_()
            sums["se_s"] = e_s.sum(1)
            sums["se_t"] = e_t.sum(1)
            bufs.update(e_s=e_s, e_t=e_t)
        elif kind == "reverse_kl":
            e_s = (a_s - m_s[:, None]).exp_()
            d = a_s.sub_(a_t)  # a_s - a_t, over the student logits (the gradient's buffer)
            e_t = a_t.sub_(m_t[:, None]).exp_()
            sums["se_t"] = e_t.sum(1)
            sums["s"] = _row_dot(e_s, d)
            sums["se_s"] = e_s.sum(1)
            bufs.update(e_s=e_s, d=d)
        else:  # jsd
            e_s = (a_s - m_s[:, None]).exp_()
            e_t = (a_t - m_t[:, None]).exp_()
            sums["se_s"] = e_s.sum(1)
            sums["se_t"] = e_t.sum(1)
            bufs.update(e_s=e_s, e_t=e_t, a_s=a_s, a_t=a_t)
        if self.ce:
            sums["zl"] = label_logit
            if need_ce_shift:
                e_c = z_c.sub_(m_c[:, None]).exp_()
                sums["se_c"] = e_c.sum(1)
                bufs["e_c"] = e_c

        # Collective 2: every per-row partial sum of this window in one all-reduce.
        names = list(sums)
        packed = _all_reduce(torch.stack([sums[n] for n in names]), shard)
        tot = dict(zip(names, packed))

        lse_s = m_s + tot["se_s"].log()
        stats: _Stats = {"lse_s": lse_s}
        kd_row = None
        if self.sparse:
            q = win.topk_q
            if cfg.topk_tail == "renormalize":
                # KL(q || p_s) = sum q log q - sum q a_s[id] + lse_s (sum q = 1)
                kd_row = (q * win.topk_logq).sum(1) - tot["g"] + lse_s
            else:
                q_tail = win.q_tail
                log_p_tail = tot["se_tail"].log() - tot["se_s"].log()
                tail = torch.where(q_tail > 0, q_tail * (q_tail.log() - log_p_tail), 0.0)
                qlogq = torch.where(q > 0, q * win.topk_logq, 0.0).sum(1)
                kd_row = qlogq - (tot["g"] - win.q_sum * lse_s) + tail
                stats["log_p_tail"] = log_p_tail
        elif not self.dense:
            pass
        elif kind == "forward_kl":
            lse_t = m_t + tot["se_t"].log()
            kd_row = tot["s"] / tot["se_t"] - lse_t + lse_s
            stats["lse_t"] = lse_t
        elif kind == "reverse_kl":
            lse_t = m_t + tot["se_t"].log()
            c = tot["s"] / tot["se_s"]  # sum_v p_s (a_s - a_t)
            kd_row = c - lse_s + lse_t
            stats["lse_t"] = lse_t
            stats["c"] = c
        else:  # jsd: needs the global lse before its elementwise terms
            lse_t = m_t + tot["se_t"].log()
            stats["lse_t"] = lse_t
            p_s, p_t, logp_s, logp_t, log_m = self._jsd_terms(bufs, tot, lse_s, lse_t)
            beta = cfg.beta
            jsd_local = (beta * p_t * (logp_t - log_m)).sum(1) + (
                (1.0 - beta) * p_s * (logp_s - log_m)).sum(1)
            g = (logp_s - log_m).mul_(1.0 - beta)
            # Collective 3 (JSD only): the divergence and sum_v p_s g need the global lse.
            packed2 = _all_reduce(torch.stack([jsd_local, _row_dot(p_s, g)]), shard)
            kd_row = packed2[0]
            stats["dot"] = packed2[1]
            bufs.update(p_s=p_s, g=g)
        if kd_row is not None:
            kd_row = kd_row * (self.t * self.t)

        ce_row = None
        if self.ce:
            lse_c = lse_s if not need_ce_shift else m_c + tot["se_c"].log()
            ce_row = lse_c - tot["zl"]
            stats["lse_c"] = lse_c
        # The shifts and normalisers the gradient of a precomputing caller uses.
        bufs["norm"] = tot
        return kd_row, ce_row, stats, bufs

    def _tail_sum(self, e_s: torch.Tensor, win: _Window) -> torch.Tensor:
        if self.shard.local_valid == 0:
            return e_s.new_zeros(e_s.shape[0])
        # one extra (dummy) column receives the ids that are not on this shard
        index = torch.where(win.topk.in_shard, win.topk.index, self.shard.local_valid)
        mask = torch.zeros(e_s.shape[0], self.shard.local_valid + 1, dtype=torch.bool,
                           device=e_s.device)
        mask.scatter_(1, index, True)
        return e_s.masked_fill(mask[:, :-1], 0.0).sum(1)

    def _jsd_terms(self, bufs, tot, lse_s, lse_t):
        """p_s, p_t, log p_s, log p_t and log m of a JSD window (buffers overwritten)."""
        beta = self.cfg.beta
        if "e_s" in bufs:  # forward pass: exponentials relative to the shift M
            p_s = bufs["e_s"].div_(tot["se_s"][:, None])
            p_t = bufs["e_t"].div_(tot["se_t"][:, None])
        else:
            p_s = (bufs["a_s"] - lse_s[:, None]).exp_()
            p_t = (bufs["a_t"] - lse_t[:, None]).exp_()
        logp_s = bufs["a_s"].sub_(lse_s[:, None])
        logp_t = bufs["a_t"].sub_(lse_t[:, None])
        log_m = torch.logaddexp(logp_t + math.log(beta), logp_s + math.log(1.0 - beta))
        return p_s, p_t, logp_s, logp_t, log_m

    # --- gradients -----------------------------------------------------------------------------
    def grad(self, bufs: dict, stats: _Stats, win: _Window) -> torch.Tensor:
        """Gradient of the window's weighted loss wrt the student logits ``z_s`` ([rows, V_valid]).

        ``bufs`` holds either the forward pass's exponentials (``e_s``... relative to the shift M,
        with normalisers ``bufs["norm"]``) or, in a recomputing backward, the fresh logits
        ``z_s`` / ``z_t`` (then the exponentials are taken relative to the saved lse directly).
        """
        cfg, t = self.cfg, self.t
        w_kd = win.w_kd * t  # d(T^2 KD)/dz = T * d KD / da
        w_ce = win.w_ce
        ce_shared = self.ce_grad and t == 1.0  # CE's softmax is the student's KD softmax
        if "norm" in bufs:
            tot = bufs["norm"]
            norm_s = tot["se_s"]
            norm_t = tot.get("se_t")
        else:
            norm_s = norm_t = None
            self._exponentiate(bufs, stats)

        def scaled(norm, coef):  # coefficient / normaliser, per row, as a column
            return (coef if norm is None else coef / norm)[:, None]

        kind = cfg.kind
        if self.sparse:
            e_s = bufs["e_s"]
            q = win.topk_q
            if cfg.topk_tail == "renormalize":
                coef_s = w_kd + (w_ce if ce_shared else 0.0)
                g_at_ids = -w_kd[:, None] * q
            else:
                p_tail = stats["log_p_tail"].exp()
                r = torch.where(win.q_tail > 0, win.q_tail / p_tail, 0.0)
                big_q = win.q_sum + win.q_tail
                coef_s = w_kd * (big_q - r) + (w_ce if ce_shared else 0.0)
                # ids are not in the tail: give them back the r p_s removed above
                p_at_ids = win.topk.gather(e_s)
                if norm_s is not None:
                    p_at_ids = p_at_ids / norm_s[:, None]
                g_at_ids = w_kd[:, None] * (r[:, None] * p_at_ids - q)
            g = e_s.mul_(scaled(norm_s, coef_s))
            win.topk.scatter_add_(g, g_at_ids)
        elif not self.dense:  # CE only
            g = bufs["e_s"].mul_(scaled(norm_s, w_ce if ce_shared else torch.zeros_like(w_ce)))
        elif kind == "forward_kl":
            g = bufs["e_s"].mul_(scaled(norm_s, w_kd + (w_ce if ce_shared else 0.0)))
            g.addcmul_(bufs["e_t"], scaled(norm_t, w_kd), value=-1.0)
        elif kind == "reverse_kl":
            # p_s * (w_kd * (d - c) + w_ce), d = a_s - a_t
            w_ce_shared = w_ce if ce_shared else torch.zeros_like(w_kd)
            g = bufs["d"].mul_(w_kd[:, None]).sub_((w_kd * stats["c"] - w_ce_shared)[:, None])
            g.mul_(bufs["e_s"])
            if norm_s is not None:
                g.div_(norm_s[:, None])
        else:  # jsd
            p_s, gg = bufs["p_s"], bufs["g"]
            g = gg.sub_(stats["dot"][:, None]).mul_(p_s).mul_(w_kd[:, None])
            if ce_shared:
                g.addcmul_(p_s, w_ce[:, None])
        if self.ce_grad:
            if not ce_shared:
                g.addcmul_(bufs["e_c"], scaled(tot["se_c"] if norm_s is not None else None, w_ce))
            win.labels.scatter_add_(g, -w_ce[:, None])
        return g

    def _exponentiate(self, bufs: dict, stats: _Stats) -> None:
        """Recomputing backward: exponentials relative to the saved lse (so normalisers are 1)."""
        cfg, t = self.cfg, self.t
        z_s, z_t = bufs.pop("z_s"), bufs.pop("z_t", None)
        if self.ce_grad and t != 1.0:
            bufs["e_c"] = (z_s - stats["lse_c"][:, None]).exp_()
        a_s = z_s.mul_(self.inv_t) if t != 1.0 else z_s
        a_t = None if z_t is None else (z_t.mul_(self.inv_t) if t != 1.0 else z_t)
        lse_s = stats["lse_s"]
        if self.sparse or not self.dense or cfg.kind == "forward_kl":
            if a_t is not None:
                bufs["e_t"] = a_t.sub_(stats["lse_t"][:, None]).exp_()
            bufs["e_s"] = a_s.sub_(lse_s[:, None]).exp_()
        elif cfg.kind == "reverse_kl":
            bufs["e_s"] = (a_s - lse_s[:, None]).exp_()
            bufs["d"] = a_s.sub_(a_t)
        else:  # jsd
            bufs.update(a_s=a_s, a_t=a_t)
            p_s, _, logp_s, _, log_m = self._jsd_terms(bufs, None, lse_s, stats["lse_t"])
            bufs["p_s"] = p_s
            bufs["g"] = (logp_s - log_m).mul_(1.0 - cfg.beta)


class _FusedKDLoss(torch.autograd.Function):
    """Fused projection + KD (+ CE) loss over a vocab-parallel output layer.

    Collectives (``tp_group``; none when it is ``None`` or of size 1):

    * forward: one all-gather of a few integers per rank (shard sizes and input checks, so that
      every rank raises the same error instead of one rank hanging the others); with
      ``sequence_parallel`` an all-gather of the hidden states; per window one MAX and one SUM
      all-reduce of ``[k, rows]`` per-row values (JSD: one more SUM); with precomputed gradients,
      one all-reduce (reduce-scatter with ``sequence_parallel``) of the ``[tokens, h_s]`` hidden
      gradient, which sums the contributions of every vocab shard.
    * backward, ``precompute``: none (the saved gradients are scaled by the incoming gradient).
    * backward, ``recompute``: the same one all-reduce / reduce-scatter of the hidden gradient;
      the per-row statistics come from the forward pass, so no per-window collective.

    The teacher's inputs are constants: no gradient flows to them.
    """

    @staticmethod
    def forward(ctx, student_hidden: torch.Tensor, student_weight: torch.Tensor,
                teacher_hidden, teacher_weight, topk_ids, topk_logprobs, labels, loss_mask,
                config: KDLossConfig, shard: _Shard, terms_out: dict | None):
        cdt = torch.float64 if student_hidden.dtype == torch.float64 else torch.float32
        h_s = student_hidden.shape[-1]
        lead = loss_mask.shape
        n_rows = loss_mask.numel()
        sp = config.sequence_parallel and shard.tp_world_size > 1

        inputs = _Rows(student_hidden, student_weight, teacher_hidden, teacher_weight, topk_ids,
                       topk_logprobs, labels, loss_mask, config, shard, sp, cdt)
        x_s = inputs.x_s
        maths = _KDMath(config, shard, topk_ids is not None, teacher_hidden is not None,
                        labels is not None, cdt)

        precompute = config.backward == "precompute" and (
            student_hidden.requires_grad or student_weight.requires_grad)
        need_grad_x = student_hidden.requires_grad
        need_grad_w = student_weight.requires_grad
        grad_x = x_s.new_zeros(n_rows, h_s, dtype=cdt) if precompute and need_grad_x else None
        grad_w = (student_weight.new_zeros(student_weight.shape, dtype=cdt)
                  if precompute and need_grad_w else None)

        kd_total = torch.zeros((), dtype=cdt, device=x_s.device)
        ce_total = torch.zeros((), dtype=cdt, device=x_s.device)
        saved_stats: list[_Stats] = []  # per block, in walking order
        for rows, xs_w, z_s, blocks in inputs.windows(maths):
            for start, win, zb_s, zb_t in blocks:
                kd_row, ce_row, stats, bufs = maths.stats(zb_s, zb_t, win)
                if config.check_finite:
                    _check_finite(kd_row, ce_row, win, config, start)
                if kd_row is not None:
                    kd_total += (win.m * kd_row).sum()
                if ce_row is not None:
                    ce_total += torch.where(win.ce_m != 0, win.ce_m * ce_row, 0.0).sum()
                if precompute:
                    _store_grad(maths.grad(bufs, stats, win), zb_s)
                elif student_hidden.requires_grad or student_weight.requires_grad:
                    saved_stats.append(stats)
                del bufs
            if precompute:  # z_s now holds the window's logit gradient
                _accumulate(z_s, xs_w, inputs.w_s, rows, grad_x, grad_w)

        loss = config.kd_weight * kd_total + config.ce_weight * ce_total
        if terms_out is not None:
            terms_out["kd_sum"] = kd_total.detach()
            terms_out["ce_sum"] = ce_total.detach()

        ctx.shard = shard
        ctx.sp = sp
        ctx.hidden_shape = student_hidden.shape
        ctx.hidden_dtype = student_hidden.dtype
        ctx.weight_dtype = student_weight.dtype
        ctx.precompute = precompute
        if precompute:
            if grad_x is not None:
                grad_x = _reduce_hidden_grad(grad_x, shard, sp, lead, h_s)
                grad_x = grad_x.to(student_hidden.dtype).view(student_hidden.shape)
            if grad_w is not None:
                grad_w = grad_w.to(student_weight.dtype)
            ctx.grads = (grad_x, grad_w)
        else:
            ctx.config = config
            ctx.maths = maths
            ctx.saved_stats = saved_stats
            ctx.lead = lead
            ctx.save_for_backward(student_hidden, student_weight, teacher_hidden, teacher_weight,
                                  topk_ids, topk_logprobs, labels, loss_mask)
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        if ctx.precompute:
            grad_x, grad_w = ctx.grads
            ctx.grads = None
            scale = grad_loss.item()
            if scale != 1.0:
                grad_x = None if grad_x is None else grad_x * scale
                grad_w = None if grad_w is None else grad_w * scale
        else:
            grad_x, grad_w = _recompute_backward(ctx, grad_loss)
        return (
            grad_x if ctx.needs_input_grad[0] else None,  # student_hidden
            grad_w if ctx.needs_input_grad[1] else None,  # student_weight
            None,  # teacher_hidden (frozen teacher)
            None,  # teacher_weight (frozen teacher)
            None,  # topk_ids
            None,  # topk_logprobs
            None,  # labels
            None,  # loss_mask
            None,  # config
            None,  # shard
            None,  # terms_out
        )


class _Rows:
    """The inputs flattened to ``[tokens, ...]`` and the windows over the weighted tokens; the
    forward pass and the recomputing backward walk the same windows in the same order."""

    def __init__(self, student_hidden, student_weight, teacher_hidden, teacher_weight, topk_ids,
                 topk_logprobs, labels, loss_mask, config: KDLossConfig, shard: _Shard, sp: bool,
                 cdt):
        n_rows = loss_mask.numel()
        x_s = _gather_sequence(student_hidden, shard) if sp else student_hidden
        self.x_s = x_s.reshape(n_rows, student_hidden.shape[-1])
        self.x_t = None
        if teacher_hidden is not None:
            x_t = _gather_sequence(teacher_hidden, shard) if sp else teacher_hidden
            self.x_t = x_t.reshape(n_rows, teacher_hidden.shape[-1])
        self.w_s = student_weight[: shard.local_valid]
        self.w_t = None if teacher_weight is None else teacher_weight[: shard.local_valid]
        self.mask = loss_mask.reshape(n_rows).to(cdt)
        self.active = torch.nonzero(self.mask != 0).view(-1)  # zero-weight tokens are skipped
        self.all_active = self.active.numel() == n_rows
        self.labels = None if labels is None else labels.reshape(n_rows)
        self.ids = None if topk_ids is None else topk_ids.reshape(n_rows, -1)
        self.lp = None if topk_logprobs is None else topk_logprobs.reshape(n_rows, -1)
        self.config, self.shard, self.cdt = config, shard, cdt
        self.rows_per_window = config.rows_per_window(shard.local_vocab_size)
        if self.x_s.device.type == "cpu" and (shard.tp_world_size == 1 or CPU_BLOCKS_WITH_TP):
            self.rows_per_block = max(1, CPU_BLOCK_ELEMENTS // max(1, shard.local_valid))
        else:
            self.rows_per_block = self.rows_per_window

    def windows(self, maths: _KDMath):
        """``(rows, student hidden rows, z_s, blocks)`` per window of active rows, where
        ``blocks`` yields ``(start, block window, z_s rows, z_t rows)`` with views of the
        window's logits and ``start`` the block's first active row."""
        n_active = self.active.numel()
        for start in range(0, n_active, self.rows_per_window):
            stop = min(start + self.rows_per_window, n_active)
            rows = slice(start, stop) if self.all_active else self.active[start:stop]
            xs_w = self.x_s[rows]
            z_s = maths.logits(xs_w, self.w_s)
            z_t = maths.logits(self.x_t[rows], self.w_t) if self.x_t is not None else None
            yield rows, xs_w, z_s, self._blocks(start, stop, z_s, z_t)

    def _blocks(self, start: int, stop: int, z_s, z_t):
        for b0 in range(0, stop - start, self.rows_per_block):
            b1 = min(b0 + self.rows_per_block, stop - start)
            rows = (slice(start + b0, start + b1) if self.all_active
                    else self.active[start + b0:start + b1])
            win = _make_window(rows, self.mask, self.labels, self.ids, self.lp, self.config,
                               self.shard, self.cdt)
            yield start + b0, win, z_s[b0:b1], None if z_t is None else z_t[b0:b1]


def _recompute_backward(ctx, grad_loss):
    (student_hidden, student_weight, teacher_hidden, teacher_weight, topk_ids, topk_logprobs,
     labels, loss_mask) = ctx.saved_tensors
    shard, maths = ctx.shard, ctx.maths
    cdt = maths.cdt
    h_s = student_hidden.shape[-1]
    n_rows = loss_mask.numel()
    sp = ctx.sp
    inputs = _Rows(student_hidden, student_weight, teacher_hidden, teacher_weight, topk_ids,
                   topk_logprobs, labels, loss_mask, ctx.config, shard, sp, cdt)
    grad_x = inputs.x_s.new_zeros(n_rows, h_s, dtype=cdt) if ctx.needs_input_grad[0] else None
    grad_w = (student_weight.new_zeros(student_weight.shape, dtype=cdt)
              if ctx.needs_input_grad[1] else None)
    stats = iter(ctx.saved_stats)
    for rows, xs_w, z_s, blocks in inputs.windows(maths):
        for _, win, zb_s, zb_t in blocks:
            bufs = {"z_s": zb_s} if zb_t is None else {"z_s": zb_s, "z_t": zb_t}
            _store_grad(maths.grad(bufs, next(stats), win), zb_s)
        _accumulate(z_s, xs_w, inputs.w_s, rows, grad_x, grad_w)
    ctx.saved_stats = None
    scale = grad_loss.to(cdt)
    if grad_x is not None:
        grad_x = _reduce_hidden_grad(grad_x, shard, sp, ctx.lead, h_s)
        grad_x = (grad_x * scale).to(ctx.hidden_dtype).view(ctx.hidden_shape)
    if grad_w is not None:
        grad_w = (grad_w * scale).to(ctx.weight_dtype)
    return grad_x, grad_w


def _store_grad(g: torch.Tensor, z_s: torch.Tensor) -> None:
    """Leave a block's logit gradient in its student logits (most kinds compute it in place)."""
    if g.data_ptr() != z_s.data_ptr():
        z_s.copy_(g)


def _accumulate(g, xs_w, w_s, rows, grad_x, grad_w) -> None:
    """Hidden and weight gradients of one window from its logit gradient ``g``."""
    gd = g.to(xs_w.dtype)
    if grad_x is not None:
        gx = (gd @ w_s).to(grad_x.dtype)
        if isinstance(rows, slice):
            grad_x[rows] = gx
        else:
            grad_x.index_copy_(0, rows, gx)
    if grad_w is not None:
        n_valid = w_s.shape[0]
        if gd.dtype == grad_w.dtype:
            grad_w[:n_valid].addmm_(gd.t(), xs_w)
        else:
            grad_w[:n_valid] += (gd.t() @ xs_w).to(grad_w.dtype)


def _gather_sequence(hidden: torch.Tensor, shard: _Shard) -> torch.Tensor:
    """All-gather sequence-parallel hidden states ``[s/tp, ...]`` into ``[s, ...]``."""
    out = hidden.new_empty((hidden.shape[0] * shard.tp_world_size, *hidden.shape[1:]))
    # Forward of sequence parallelism: every rank needs every token for its vocab shard.
    dist.all_gather_into_tensor(out, hidden.contiguous(), group=shard.tp_group)
    return out


def _reduce_hidden_grad(grad_x, shard: _Shard, sp: bool, lead, h_s) -> torch.Tensor:
    """Sum the per-shard hidden gradients over the TP group (reduce-scatter under SP)."""
    if shard.tp_world_size == 1:
        return grad_x
    if sp:
        full = grad_x.view(*lead, h_s)
        out = full.new_empty((lead[0] // shard.tp_world_size, *lead[1:], h_s))
        # Each rank keeps the gradient of its own sequence chunk, summed over vocab shards.
        dist.reduce_scatter_tensor(out, full.contiguous(), group=shard.tp_group)
        return out
    # Every vocab shard contributes to every token's hidden gradient.
    dist.all_reduce(grad_x, group=shard.tp_group)
    return grad_x


def _make_window(rows, mask, labels, ids, lp, config: KDLossConfig, shard: _Shard, cdt):
    m = mask[rows]
    win = _Window(m=m, w_kd=m * config.kd_weight, labels=None, topk=None)
    if labels is not None:
        lab = labels[rows]
        valid = lab != config.ignore_index
        win.ce_m = torch.where(valid, m, 0.0)  # the CE term's token weights
        win.w_ce = win.ce_m * config.ce_weight
        win.labels = _Ids(torch.where(valid, lab, -1)[:, None], shard)
    else:
        win.w_ce = win.ce_m = torch.zeros_like(m)
    if ids is not None:
        win.topk = _Ids(ids[rows], shard)
        lp_w = lp[rows].to(cdt)
        if config.topk_tail == "renormalize":
            scaled = lp_w / config.temperature
            win.topk_logq = torch.log_softmax(scaled, dim=1)
            win.topk_q = win.topk_logq.exp()
        else:
            win.topk_logq = lp_w
            win.topk_q = lp_w.exp()
            win.q_sum = win.topk_q.sum(1)
            win.q_tail = (1.0 - win.q_sum).clamp_(min=0.0)
    return win


def _check_finite(kd_row, ce_row, win, config: KDLossConfig, offset: int) -> None:
    for name, row, weight in (("KD", kd_row, win.m), ("CE", ce_row, win.ce_m)):
        if row is None:
            continue
        bad = (weight != 0) & ~torch.isfinite(row)
        if bool(bad.any()):
            i = int(torch.nonzero(bad)[0])
            label = f"KD ({config.kind})" if name == "KD" else "CE"
            raise FloatingPointError(
                f"non-finite {label} loss {row[i].item()} at active token {offset + i} "
                f"(check the hidden states and weights for inf/NaN)")


# ----------------------------------------------------------------------------------------------
# public entry point
# ----------------------------------------------------------------------------------------------
def vocab_parallel_kd_loss(
    student_hidden: torch.Tensor,
    student_weight: torch.Tensor,
    teacher_hidden: torch.Tensor | None = None,
    teacher_weight: torch.Tensor | None = None,
    teacher_topk_ids: torch.Tensor | None = None,
    teacher_topk_logprobs: torch.Tensor | None = None,
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
        teacher_hidden: ``[s, b, h_t]`` teacher hidden states after its final norm (dense teacher).
        teacher_weight: ``[local_vocab_size, h_t]`` teacher output layer, same vocab partition.
        teacher_topk_ids: ``[s, b, K]`` global token ids of a sparse teacher (instead of dense).
        teacher_topk_logprobs: ``[s, b, K]`` teacher log-probs at T = 1 (full-vocab log-softmax).
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
    """
    config = config or KDLossConfig()
    tp_rank, tp_world_size = _world(tp_group)
    sp = config.sequence_parallel and tp_world_size > 1
    local_error = _check_local(student_hidden, student_weight, teacher_hidden, teacher_weight,
                               teacher_topk_ids, teacher_topk_logprobs, labels, loss_mask, config,
                               tp_world_size, sp)
    sizes = _exchange_sizes(student_weight, student_hidden, local_error, tp_group, tp_world_size)
    shard = _shard_from_sizes(sizes, tp_rank, tp_group, tp_world_size, config)
    lead = _full_lead(student_hidden, tp_world_size, sp)
    if loss_mask is None:
        loss_mask = torch.ones(lead, dtype=torch.float32, device=student_hidden.device)
    _check_global(teacher_topk_ids, teacher_topk_logprobs, labels, config, shard)
    loss = _FusedKDLoss.apply(student_hidden, student_weight, teacher_hidden, teacher_weight,
                              teacher_topk_ids, teacher_topk_logprobs, labels, loss_mask, config,
                              shard, terms_out)
    num_tokens = loss_mask.sum().to(loss.dtype)
    return loss, num_tokens


def _full_lead(student_hidden, tp_world_size, sp):
    lead = tuple(student_hidden.shape[:-1])
    if sp:
        lead = (lead[0] * tp_world_size, *lead[1:])
    return lead


def _check_local(student_hidden, student_weight, teacher_hidden, teacher_weight, topk_ids,
                 topk_logprobs, labels, loss_mask, config, tp_world_size, sp) -> str | None:
    """Shape and dtype checks that may differ between ranks; returns the message or None."""
    try:
        _check_local_raise(student_hidden, student_weight, teacher_hidden, teacher_weight,
                           topk_ids, topk_logprobs, labels, loss_mask, config, tp_world_size, sp)
    except ValueError as e:
        return str(e)
    return None


def _check_local_raise(student_hidden, student_weight, teacher_hidden, teacher_weight, topk_ids,
                       topk_logprobs, labels, loss_mask, config, tp_world_size, sp) -> None:
    if student_hidden.dim() < 2:
        raise ValueError(f"student_hidden must be [..., h_s], got shape {tuple(student_hidden.shape)}")
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
    lead = _full_lead(student_hidden, tp_world_size, sp)
    dense = teacher_hidden is not None or teacher_weight is not None
    sparse = topk_ids is not None or topk_logprobs is not None
    if dense and sparse:
        raise ValueError("give either a dense teacher (teacher_hidden, teacher_weight) or a sparse "
                         "one (teacher_topk_ids, teacher_topk_logprobs), not both")
    if config.kd_weight > 0 and not dense and not sparse:
        raise ValueError(f"kd_weight={config.kd_weight} > 0 but no teacher was given")
    if dense:
        if teacher_hidden is None or teacher_weight is None:
            raise ValueError("a dense teacher needs both teacher_hidden and teacher_weight")
        if teacher_weight.dim() != 2 or teacher_hidden.shape[-1] != teacher_weight.shape[1]:
            raise ValueError(f"teacher hidden size {teacher_hidden.shape[-1]} != teacher_weight "
                             f"columns (shape {tuple(teacher_weight.shape)})")
        t_lead = _full_lead(teacher_hidden, tp_world_size, sp)
        if t_lead != lead:
            raise ValueError(f"teacher_hidden leading shape {tuple(teacher_hidden.shape[:-1])} != "
                             f"student_hidden leading shape {tuple(student_hidden.shape[:-1])}")
        if teacher_weight.shape[0] != student_weight.shape[0]:
            raise ValueError(f"teacher shard has {teacher_weight.shape[0]} vocab rows but the "
                             f"student shard has {student_weight.shape[0]} (same partition needed)")
        if teacher_hidden.dtype != teacher_weight.dtype:
            raise ValueError(f"teacher_hidden dtype {teacher_hidden.dtype} != teacher_weight dtype "
                             f"{teacher_weight.dtype}")
    if sparse:
        if topk_ids is None or topk_logprobs is None:
            raise ValueError("a sparse teacher needs both teacher_topk_ids and "
                             "teacher_topk_logprobs")
        if config.kind != "forward_kl":
            raise ValueError(f"a sparse (top-K) teacher supports kind='forward_kl' only, got "
                             f"{config.kind!r}")
        if config.topk_tail == "ghost" and config.temperature != 1.0:
            raise ValueError(f"topk_tail='ghost' needs temperature 1, got {config.temperature}")
        if topk_ids.shape != topk_logprobs.shape or tuple(topk_ids.shape[:-1]) != lead:
            raise ValueError(f"teacher_topk_ids {tuple(topk_ids.shape)} and teacher_topk_logprobs "
                             f"{tuple(topk_logprobs.shape)} must both be {lead} + [K]")
        if topk_ids.dtype.is_floating_point or topk_ids.dtype == torch.bool:
            raise ValueError(f"teacher_topk_ids must be integer, got {topk_ids.dtype}")
    if config.ce_weight > 0 and labels is None:
        raise ValueError(f"ce_weight={config.ce_weight} > 0 needs labels")
    if labels is not None and tuple(labels.shape) != lead:
        raise ValueError(f"labels shape {tuple(labels.shape)} != token shape {lead}")
    if loss_mask is not None and tuple(loss_mask.shape) != lead:
        raise ValueError(f"loss_mask shape {tuple(loss_mask.shape)} != token shape {lead}")


def _exchange_sizes(student_weight, student_hidden, local_error, tp_group, tp_world_size):
    """All ranks learn every shard size, their token counts and whether any input was bad."""
    n_tokens = int(math.prod(student_hidden.shape[:-1]))
    # on the inputs' device: NCCL groups reduce device tensors only
    mine = torch.tensor([student_weight.shape[0], n_tokens, 0 if local_error is None else 1],
                        dtype=torch.int64, device=student_hidden.device)
    if tp_world_size == 1:
        sizes = mine.view(1, 3)
    else:
        sizes = torch.empty(tp_world_size * 3, dtype=torch.int64, device=student_hidden.device)
        # Shard offsets come from every rank's shard size; errors must stop all ranks together.
        dist.all_gather_into_tensor(sizes, mine, group=tp_group)
        sizes = sizes.view(tp_world_size, 3)
    if local_error is not None:
        raise ValueError(local_error)
    sizes = sizes.cpu()
    bad = [r for r in range(sizes.shape[0]) if int(sizes[r, 2])]
    if bad:
        raise ValueError(f"invalid input on tensor-parallel rank(s) {bad} (see the error there)")
    tokens = sizes[:, 1].tolist()
    if len(set(tokens)) != 1:
        raise ValueError(f"tensor-parallel ranks disagree on the number of tokens: {tokens}")
    return sizes[:, 0].tolist()


def _shard_from_sizes(sizes, tp_rank, tp_group, tp_world_size, config) -> _Shard:
    padded = int(sum(sizes))
    vocab_size = padded if config.vocab_size is None else config.vocab_size
    if vocab_size > padded:
        raise ValueError(f"vocab_size {vocab_size} > rows of the output layer over all shards "
                         f"{padded} (shard sizes {sizes})")
    start = int(sum(sizes[:tp_rank]))
    local = int(sizes[tp_rank])
    valid = max(0, min(local, vocab_size - start))
    return _Shard(tp_group=tp_group, tp_rank=tp_rank, tp_world_size=tp_world_size,
                  vocab_start=start, local_vocab_size=local, local_valid=valid,
                  vocab_size=vocab_size)


def _check_global(topk_ids, topk_logprobs, labels, config, shard: _Shard) -> None:
    """Value checks on replicated inputs (identical on every rank, so all raise alike)."""
    v = shard.vocab_size
    if labels is not None:
        bad = (labels != config.ignore_index) & ((labels < 0) | (labels >= v))
        if bool(bad.any()):
            value = int(labels[bad][0])
            raise ValueError(f"label {value} out of range [0, {v}) (ignore_index is "
                             f"{config.ignore_index})")
    if topk_ids is not None:
        bad = (topk_ids < 0) | (topk_ids >= v)
        if bool(bad.any()):
            raise ValueError(f"teacher_topk_ids value {int(topk_ids[bad][0])} out of range "
                             f"[0, {v})")
        flat = topk_ids.reshape(-1, topk_ids.shape[-1])
        srt = flat.sort(dim=1).values
        dup = srt[:, 1:] == srt[:, :-1]
        if bool(dup.any()):
            row, col = (int(i) for i in torch.nonzero(dup)[0])
            raise ValueError(f"teacher_topk_ids has id {int(srt[row, col])} twice in token row "
                             f"{row}")
        if bool(torch.isnan(topk_logprobs).any()):
            raise ValueError("teacher_topk_logprobs contains NaN")
        if bool((topk_logprobs > 1e-4).any()):
            raise ValueError(f"teacher_topk_logprobs must be log-probabilities (<= 0), max is "
                             f"{float(topk_logprobs.max())}")
        if config.topk_tail == "ghost":
            mass = topk_logprobs.double().exp().sum(-1)
            if bool((mass > 1.0 + 1e-3).any()):
                raise ValueError(f"teacher top-K probabilities sum to {float(mass.max()):.6f} > 1 "
                                 f"in some token: not log-softmax values over the full vocabulary")
