"""The per-block maths of each loss kind: one class per kind, one interface.

With ``a = z / T``, ``lse = M + log(sum exp(a - M))`` and ``p = exp(a - lse)``, every kind
reduces a block's ``[rows, V_valid]`` logits to a few per-row numbers. A block's statistics run
in three steps, with the combine across the vocab shards between them
(:mod:`megatron_kd.loss.combine`):

1. the per-row maxima of ``a_s`` (and ``a_t``, and ``z`` for a CE term at T != 1) go through
   one MAX all-reduce: the shift ``M`` every rank exponentiates against;
2. :meth:`KindMath.local_sums` forms this shard's per-row partial sums (``sum exp(a - M)`` for
   student and teacher, teacher-weighted logit differences, ...), packed with the CE term's into
   one SUM all-reduce;
3. :meth:`KindMath.kd_row` turns the combined sums into the per-row KD loss (JSD runs one more
   SUM all-reduce of two per-row sums that need the global log-sum-exp).

The gradient wrt the logits of the KD term is ``T^2 / T = T`` times the gradient wrt ``a_s``.
With precomputed gradients (:meth:`KindMath.grad`) it reuses the forward pass's exponentials,
relative to ``M`` and divided by the combined normalisers; the recomputing backward
(:meth:`KindMath.recomputed_grad`) projects again and exponentiates relative to the saved
``lse`` (:meth:`KindMath.exponentiate`), so its normalisers are 1 and no collective runs.

The CE term (T = 1: ``lse - z[label]``, gradient ``softmax(z) - onehot(label)``) is the same for
every kind: :class:`CETerm`. At T = 1 it shares the KD term's student softmax; at T != 1 it
needs its own shift and sum. A new kind is one subclass of :class:`KindMath`, registered in
:func:`kind_for` (and, for a dense kind, named in ``megatron_kd.loss.config.KINDS``).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from megatron_kd.loss.combine import ShardMax, ShardSum
from megatron_kd.loss.config import KDLossConfig
from megatron_kd.loss.window import Shard, Window

__all__ = ["DENSE_KINDS", "JSD", "BlockStats", "CEOnly", "CETerm", "ForwardKL", "KindMath",
           "ReverseKL", "SparseGhostTail", "SparseRenormalized", "kind_for"]

# Per-row ``[rows]`` tensors by name: the partial / combined sums, and the statistics kept
# between forward and a recomputing backward.
Sums = dict[str, torch.Tensor]
Stats = dict[str, torch.Tensor]
# ``[rows, V_valid]`` buffers of a block (exponentials, differences) by name, for its gradient.
Buffers = dict[str, torch.Tensor]


def _row_max(a: torch.Tensor) -> torch.Tensor:
    """Per-row max; -inf for a shard with no real columns."""
    if a.shape[1] == 0:
        return a.new_full((a.shape[0],), -math.inf)
    return a.amax(dim=1)


def _row_dot(a: torch.Tensor, b: torch.Tensor, win: Window) -> torch.Tensor:
    """Per-row sum of ``a * b``, the product in a scratch buffer. (A batched ``1 x V @ V x 1``
    needs no buffer but sums sequentially: 2.5e-5 relative error at V = 32,000 in fp32.)"""
    return torch.mul(a, b, out=win.scratch.take("dot", a)).sum(1)


def _shifted(a: torch.Tensor, shift: torch.Tensor, name: str, win: Window) -> torch.Tensor:
    """``a - shift[:, None]`` in the scratch buffer ``name`` (``a`` kept)."""
    return torch.sub(a, shift[:, None], out=win.scratch.take(name, a))


def _scaled(norm: torch.Tensor | None, coef: torch.Tensor) -> torch.Tensor:
    """Per-row coefficient divided by the normaliser (1 when None), as a column."""
    return (coef if norm is None else coef / norm)[:, None]


@dataclass
class BlockStats:
    """What :meth:`KindMath.stats` returns for one block."""

    kd_row: torch.Tensor | None
    """``[rows]`` the KD loss ``T^2 * KD`` per row (None without a teacher)."""

    ce_row: torch.Tensor | None
    """``[rows]`` the CE loss per row (None without labels)."""

    saved: Stats
    """Per-row values a recomputing backward needs (``lse_s``, ``lse_t``, ...)."""

    bufs: Buffers
    """The block's exponentials, which a precomputing caller turns into the gradient."""

    norm: Sums
    """The combined per-row sums; ``se_s`` / ``se_t`` / ``se_c`` normalise ``bufs``."""


class CETerm:
    """The student's cross-entropy against the labels at T = 1, shared by every kind."""

    def __init__(self, config: KDLossConfig, labels_given: bool):
        self.on = labels_given  # labels given: the CE term is computed (and reported)
        self.in_grad = labels_given and config.ce_weight > 0  # ... and it has a gradient
        self.own_shift = labels_given and config.temperature != 1.0  # z, not z / T
        self.shared = self.in_grad and config.temperature == 1.0  # softmax(z) = the KD p_s

    def prepare(self, z_s: torch.Tensor,
                win: Window) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """``(label logit [rows], copy of z_s at T = 1 or None)``, before z_s is scaled."""
        label_logit = win.labels.gather(z_s).view(-1) if self.on else None
        z_c = win.scratch.take("z_c", z_s).copy_(z_s) if self.own_shift else None
        return label_logit, z_c

    def local_sums(self, label_logit: torch.Tensor | None, z_c: torch.Tensor | None,
                   m_c: torch.Tensor | None, sums: Sums, bufs: Buffers) -> None:
        """Add the label logit (and at T != 1 ``sum exp(z - M_c)``) to a block's sums."""
        if not self.on:
            return
        sums["zl"] = label_logit
        if self.own_shift:
            e_c = z_c.sub_(m_c[:, None]).exp_()
            sums["se_c"] = e_c.sum(1)
            bufs["e_c"] = e_c

    def row(self, tot: Sums, lse_s: torch.Tensor, m_c: torch.Tensor | None,
            saved: Stats) -> torch.Tensor | None:
        """Per-row CE ``lse - z[label]`` from the combined sums; saves ``lse_c``."""
        if not self.on:
            return None
        lse_c = lse_s if not self.own_shift else m_c + tot["se_c"].log()
        saved["lse_c"] = lse_c
        return lse_c - tot["zl"]

    def exponentiate(self, z_s: torch.Tensor, saved: Stats, bufs: Buffers, win: Window) -> None:
        """Recomputing backward, T != 1: ``softmax(z)`` from the saved ``lse_c``."""
        if self.in_grad and self.own_shift:
            bufs["e_c"] = _shifted(z_s, saved["lse_c"], "z_c", win).exp_()

    def add_grad(self, g: torch.Tensor, bufs: Buffers, norm: Sums | None, win: Window) -> None:
        """``g += w_ce * (softmax(z) - onehot(label))`` (the softmax already in ``g`` when
        shared with the KD term)."""
        if not self.in_grad:
            return
        w_ce = win.w_ce
        if not self.shared:
            g.addcmul_(bufs["e_c"], _scaled(None if norm is None else norm["se_c"], w_ce))
        win.labels.scatter_add_(g, -w_ce[:, None])


class KindMath(ABC):
    """Statistics and logit gradient of one loss kind, per block of rows.

    Subclasses implement the kind-specific steps: :meth:`local_sums`, :meth:`kd_row`,
    :meth:`logit_grad` and (unless the default fits) :meth:`exponentiate`. The shared flow
    (shifts, the combine's collectives, the CE term, the T scaling) is :meth:`stats`,
    :meth:`grad` and :meth:`recomputed_grad`.
    """

    def __init__(self, config: KDLossConfig, shard: Shard, ce: CETerm):
        self.cfg = config
        self.shard = shard
        self.ce = ce
        self.t = config.temperature
        self.inv_t = 1.0 / config.temperature

    # --- kind-specific steps -------------------------------------------------------------------
    @abstractmethod
    def local_sums(self, a_s: torch.Tensor, a_t: torch.Tensor | None, m_s: torch.Tensor,
                   m_t: torch.Tensor | None, win: Window) -> tuple[Sums, Buffers]:
        """This shard's per-row partial sums (``se_s`` always) and the gradient's buffers.

        ``a_s`` / ``a_t``: ``[rows, V_valid]`` scaled logits, consumed (overwritten); ``m_s`` /
        ``m_t``: the global per-row shifts.
        """

    @abstractmethod
    def kd_row(self, tot: Sums, lse_s: torch.Tensor, m_t: torch.Tensor | None, bufs: Buffers,
               win: Window) -> tuple[torch.Tensor | None, Stats]:
        """``(per-row KD before the T^2 factor, or None; per-row values to save)`` from the
        combined sums. May add gradient buffers to ``bufs`` (and JSD runs a collective)."""

    @abstractmethod
    def logit_grad(self, bufs: Buffers, saved: Stats, win: Window, w_kd: torch.Tensor,
                   w_ce_shared: torch.Tensor | None, norm: Sums | None) -> torch.Tensor:
        """``[rows, V_valid]`` gradient wrt ``z_s`` of the weighted KD term (``w_kd`` already
        includes the factor T), plus ``w_ce_shared * p_s`` when the CE term shares the student
        softmax; usually computed in place in a buffer. ``norm``: the combined sums that
        normalise the forward pass's exponentials, or None when they are probabilities."""

    def exponentiate(self, a_s: torch.Tensor, a_t: torch.Tensor | None, saved: Stats,
                     win: Window) -> Buffers:
        """Recomputing backward: the buffers of :meth:`logit_grad` from fresh scaled logits
        (consumed), relative to the saved ``lse`` (so its normalisers are 1).

        By default ``e_s = p_s`` (and ``e_t = p_t``), for the kinds whose gradient is ``p_s``
        minus a teacher term; kinds with other buffers override it.
        """
        bufs: Buffers = {}
        if a_t is not None:
            bufs["e_t"] = a_t.sub_(saved["lse_t"][:, None]).exp_()
        bufs["e_s"] = a_s.sub_(saved["lse_s"][:, None]).exp_()
        return bufs

    # --- the combine ---------------------------------------------------------------------------
    def _max(self, local: torch.Tensor) -> torch.Tensor:
        return ShardMax.apply(local, self.shard.tp_group, self.shard.tp_world_size)

    def _sum(self, local: torch.Tensor) -> torch.Tensor:
        return ShardSum.apply(local, self.shard.tp_group, self.shard.tp_world_size)

    # --- shared flow ---------------------------------------------------------------------------
    def stats(self, z_s: torch.Tensor, z_t: torch.Tensor | None, win: Window) -> BlockStats:
        """Per-row KD and CE losses and the statistics for the gradient; runs the collectives.

        Consumes (overwrites) ``z_s`` and ``z_t``, ``[rows, V_valid]`` logits of a block.
        """
        label_logit, z_c = self.ce.prepare(z_s, win)
        a_s = z_s.mul_(self.inv_t) if self.t != 1.0 else z_s
        a_t = None
        if z_t is not None:
            a_t = z_t.mul_(self.inv_t) if self.t != 1.0 else z_t

        # Collective 1: the per-row softmax shifts (MAX), so every rank exponentiates alike.
        maxes = [_row_max(a_s)]
        if a_t is not None:
            maxes.append(_row_max(a_t))
        if z_c is not None:
            maxes.append(_row_max(z_c))
        m = self._max(torch.stack(maxes))
        m_s = m[0]
        m_t = m[1] if a_t is not None else None
        m_c = m[-1] if z_c is not None else None

        sums, bufs = self.local_sums(a_s, a_t, m_s, m_t, win)
        self.ce.local_sums(label_logit, z_c, m_c, sums, bufs)

        # Collective 2: every per-row partial sum of this block in one all-reduce.
        names = list(sums)
        tot = dict(zip(names, self._sum(torch.stack([sums[n] for n in names]))))

        lse_s = m_s + tot["se_s"].log()
        kd_row, kd_saved = self.kd_row(tot, lse_s, m_t, bufs, win)
        saved: Stats = {"lse_s": lse_s, **kd_saved}
        if kd_row is not None:
            kd_row = kd_row * (self.t * self.t)
        ce_row = self.ce.row(tot, lse_s, m_c, saved)
        return BlockStats(kd_row=kd_row, ce_row=ce_row, saved=saved, bufs=bufs, norm=tot)

    def grad(self, block: BlockStats, win: Window) -> torch.Tensor:
        """Gradient of the block's weighted loss wrt ``z_s`` ([rows, V_valid]) from the forward
        pass's exponentials (overwritten); no collective."""
        return self._grad(block.bufs, block.saved, win, block.norm)

    def recomputed_grad(self, z_s: torch.Tensor, z_t: torch.Tensor | None, saved: Stats,
                        win: Window) -> torch.Tensor:
        """The same gradient from freshly projected logits (consumed) and the saved per-row
        statistics; no collective."""
        bufs: Buffers = {}
        self.ce.exponentiate(z_s, saved, bufs, win)
        a_s = z_s.mul_(self.inv_t) if self.t != 1.0 else z_s
        a_t = None if z_t is None else (z_t.mul_(self.inv_t) if self.t != 1.0 else z_t)
        bufs.update(self.exponentiate(a_s, a_t, saved, win))
        return self._grad(bufs, saved, win, None)

    def _grad(self, bufs: Buffers, saved: Stats, win: Window, norm: Sums | None) -> torch.Tensor:
        w_kd = win.w_kd * self.t  # d(T^2 KD)/dz = T * d KD / da
        w_ce_shared = win.w_ce if self.ce.shared else None  # CE's softmax is the KD p_s
        g = self.logit_grad(bufs, saved, win, w_kd, w_ce_shared, norm)
        self.ce.add_grad(g, bufs, norm, win)
        return g


class ForwardKL(KindMath):
    """Dense forward KL: ``KL(p_t || p_s) = sum_v p_t (a_t - a_s) - lse_t + lse_s``.

    Gradient wrt ``a_s``: ``p_s - p_t``. Sums: ``s = sum_v exp(a_t - M_t) (a_t - a_s)``,
    ``se_s``, ``se_t``.
    """

    def local_sums(self, a_s, a_t, m_s, m_t, win):
        e_t = _shifted(a_t, m_t, "e_t", win).exp_()
        sums = {"s": a_t.sub_(a_s).mul_(e_t).sum(1)}  # sum_v e_t (a_t - a_s), in a_t's buffer
        e_s = a_s.sub_(m_s[:, None]).exp_()
        sums["se_s"] = e_s.sum(1)
        sums["se_t"] = e_t.sum(1)
        return sums, {"e_s": e_s, "e_t": e_t}

    def kd_row(self, tot, lse_s, m_t, bufs, win):
        lse_t = m_t + tot["se_t"].log()
        return tot["s"] / tot["se_t"] - lse_t + lse_s, {"lse_t": lse_t}

    def logit_grad(self, bufs, saved, win, w_kd, w_ce_shared, norm):
        norm_s, norm_t = (None, None) if norm is None else (norm["se_s"], norm.get("se_t"))
        coef_s = w_kd + (0.0 if w_ce_shared is None else w_ce_shared)
        g = bufs["e_s"].mul_(_scaled(norm_s, coef_s))
        g.addcmul_(bufs["e_t"], _scaled(norm_t, w_kd), value=-1.0)
        return g


class ReverseKL(KindMath):
    """Dense reverse KL: ``KL(p_s || p_t) = sum_v p_s (a_s - a_t) - lse_s + lse_t``.

    Gradient wrt ``a_s``: ``p_s * (a_s - a_t - c)`` with ``c = sum_v p_s (a_s - a_t)``. Sums:
    ``s = sum_v exp(a_s - M_s) (a_s - a_t)``, ``se_s``, ``se_t``.
    """

    def local_sums(self, a_s, a_t, m_s, m_t, win):
        e_s = _shifted(a_s, m_s, "e_s", win).exp_()
        d = a_s.sub_(a_t)  # a_s - a_t, over the student logits (the gradient's buffer)
        e_t = a_t.sub_(m_t[:, None]).exp_()
        sums = {"se_t": e_t.sum(1), "s": _row_dot(e_s, d, win), "se_s": e_s.sum(1)}
        return sums, {"e_s": e_s, "d": d}

    def kd_row(self, tot, lse_s, m_t, bufs, win):
        lse_t = m_t + tot["se_t"].log()
        c = tot["s"] / tot["se_s"]  # sum_v p_s (a_s - a_t)
        return c - lse_s + lse_t, {"lse_t": lse_t, "c": c}

    def logit_grad(self, bufs, saved, win, w_kd, w_ce_shared, norm):
        # p_s * (w_kd * (d - c) + w_ce), d = a_s - a_t
        w_ce = torch.zeros_like(w_kd) if w_ce_shared is None else w_ce_shared
        g = bufs["d"].mul_(w_kd[:, None]).sub_((w_kd * saved["c"] - w_ce)[:, None])
        g.mul_(bufs["e_s"])
        if norm is not None:
            g.div_(norm["se_s"][:, None])
        return g

    def exponentiate(self, a_s, a_t, saved, win):
        e_s = _shifted(a_s, saved["lse_s"], "e_s", win).exp_()
        return {"e_s": e_s, "d": a_s.sub_(a_t)}


class JSD(KindMath):
    """Dense Jensen-Shannon: ``beta KL(p_t || m) + (1 - beta) KL(p_s || m)``,
    ``m = beta p_t + (1 - beta) p_s``.

    Gradient wrt ``a_s``: ``p_s * (g - sum_v p_s g)`` with ``g = (1 - beta) (log p_s - log m)``.
    Sums: ``se_s``, ``se_t``; the divergence's terms need the global lse, so a second SUM
    all-reduce carries the per-row divergence and ``sum_v p_s g``.
    """

    def local_sums(self, a_s, a_t, m_s, m_t, win):
        e_s = _shifted(a_s, m_s, "e_s", win).exp_()
        e_t = _shifted(a_t, m_t, "e_t", win).exp_()
        sums = {"se_s": e_s.sum(1), "se_t": e_t.sum(1)}
        return sums, {"e_s": e_s, "e_t": e_t, "a_s": a_s, "a_t": a_t}

    def kd_row(self, tot, lse_s, m_t, bufs, win):
        lse_t = m_t + tot["se_t"].log()
        p_s = bufs["e_s"].div_(tot["se_s"][:, None])  # exponentials relative to the shift M
        p_t = bufs["e_t"].div_(tot["se_t"][:, None])
        d_s, d_t = self._log_ratios(bufs["a_s"], bufs["a_t"], lse_s, lse_t, win)
        beta = self.cfg.beta
        # beta KL(p_t || m) + (1 - beta) KL(p_s || m), this shard's part of each row; the
        # products in the buffers of d_t and p_t, which are not needed past them
        t_part = d_t.mul_(p_t).sum(1)
        dot_s = torch.mul(p_s, d_s, out=p_t).sum(1)
        jsd_local = beta * t_part + (1.0 - beta) * dot_s
        # Collective 3 (JSD only): the divergence and sum_v p_s g = (1 - beta) dot_s need the
        # global lse.
        packed = self._sum(torch.stack([jsd_local, (1.0 - beta) * dot_s]))
        bufs.update(p_s=p_s, g=d_s.mul_(1.0 - beta))
        return packed[0], {"lse_t": lse_t, "dot": packed[1]}

    def _log_ratios(self, a_s, a_t, lse_s, lse_t, win):
        """``(log p_s - log m, log p_t - log m)`` in ``a_s`` and ``a_t`` (overwritten), with
        one scratch buffer for ``log m = log(1 - beta) + logaddexp(log p_t + log(beta / (1 -
        beta)), log p_s)`` (the constant moved off ``log p_s``: no second buffer for it)."""
        beta = self.cfg.beta
        c = math.log(1.0 - beta)
        logp_s = a_s.sub_(lse_s[:, None])
        logp_t = a_t.sub_(lse_t[:, None])
        log_m = torch.add(logp_t, math.log(beta) - c, out=win.scratch.take("log_m", logp_t))
        torch.logaddexp(log_m, logp_s, out=log_m).add_(c)  # log m, m = beta p_t + (1-beta) p_s
        return logp_s.sub_(log_m), logp_t.sub_(log_m)

    def logit_grad(self, bufs, saved, win, w_kd, w_ce_shared, norm):
        p_s, gg = bufs["p_s"], bufs["g"]
        g = gg.sub_(saved["dot"][:, None]).mul_(p_s).mul_(w_kd[:, None])
        if w_ce_shared is not None:
            g.addcmul_(p_s, w_ce_shared[:, None])
        return g

    def exponentiate(self, a_s, a_t, saved, win):
        lse_s, lse_t = saved["lse_s"], saved["lse_t"]
        p_s = _shifted(a_s, lse_s, "e_s", win).exp_()
        d_s, _ = self._log_ratios(a_s, a_t, lse_s, lse_t, win)
        return {"p_s": p_s, "g": d_s.mul_(1.0 - self.cfg.beta)}


class SparseRenormalized(KindMath):
    """Sparse teacher, renormalised top-K ``q = softmax(log q_K / T)`` on the K ids:
    ``KL(q || p_s) = sum_k q_k log q_k - sum_k q_k a_s[id_k] + lse_s``.

    Gradient wrt ``a_s``: ``p_s - q`` (``q`` scattered onto its ids). Sums:
    ``g = sum_k q_k a_s[id_k]`` over this shard's ids, ``se_s``.
    """

    def local_sums(self, a_s, a_t, m_s, m_t, win):
        q = win.topk_q  # teacher probabilities on the K ids (renormalised or as given)
        sums = {"g": (q * win.topk.gather(a_s)).sum(1)}  # sum_k q_k a_s[id_k], this shard's ids
        e_s = a_s.sub_(m_s[:, None]).exp_()
        sums["se_s"] = e_s.sum(1)
        return sums, {"e_s": e_s}

    def kd_row(self, tot, lse_s, m_t, bufs, win):
        # KL(q || p_s) = sum q log q - sum q a_s[id] + lse_s (sum q = 1)
        return (win.topk_q * win.topk_logq).sum(1) - tot["g"] + lse_s, {}

    def logit_grad(self, bufs, saved, win, w_kd, w_ce_shared, norm):
        coef_s = w_kd + (0.0 if w_ce_shared is None else w_ce_shared)
        g_at_ids = -w_kd[:, None] * win.topk_q
        g = bufs["e_s"].mul_(_scaled(None if norm is None else norm["se_s"], coef_s))
        win.topk.scatter_add_(g, g_at_ids)
        return g


class SparseGhostTail(KindMath):
    """Sparse teacher, ghost tail (T = 1): the K buckets ``q`` as given plus a tail bucket with
    the leftover masses ``q_tail = 1 - sum_k q_k`` and ``p_tail = 1 - sum_k p_s[id_k]``:
    ``sum_k q_k (log q_k - a_s[id_k] + lse_s) + q_tail (log q_tail - log p_tail)``.

    Gradient wrt ``a_s``: ``Q p_s - q - [v in tail] p_s q_tail / p_tail`` with
    ``Q = sum_k q_k + q_tail``. Sums: ``g``, ``se_s`` and ``se_tail``, the student mass outside
    the K ids (summed with the ids masked out, not as a difference: no cancellation).
    """

    def local_sums(self, a_s, a_t, m_s, m_t, win):
        q = win.topk_q
        sums = {"g": (q * win.topk.gather(a_s)).sum(1)}
        e_s = a_s.sub_(m_s[:, None]).exp_()
        sums["se_s"] = e_s.sum(1)
        sums["se_tail"] = self._tail_sum(e_s, win)
        return sums, {"e_s": e_s}

    def _tail_sum(self, e_s: torch.Tensor, win: Window) -> torch.Tensor:
        local_valid = self.shard.local_valid
        if local_valid == 0:
            return e_s.new_zeros(e_s.shape[0])
        # one extra (dummy) column receives the ids that are not on this shard
        index = torch.where(win.topk.in_shard, win.topk.index, local_valid)
        mask = torch.zeros(e_s.shape[0], local_valid + 1, dtype=torch.bool, device=e_s.device)
        mask.scatter_(1, index, True)
        return win.scratch.take("tail", e_s).copy_(e_s).masked_fill_(mask[:, :-1], 0.0).sum(1)

    def kd_row(self, tot, lse_s, m_t, bufs, win):
        q, q_tail = win.topk_q, win.q_tail
        log_p_tail = tot["se_tail"].log() - tot["se_s"].log()
        tail = torch.where(q_tail > 0, q_tail * (q_tail.log() - log_p_tail), 0.0)
        qlogq = torch.where(q > 0, q * win.topk_logq, 0.0).sum(1)
        return qlogq - (tot["g"] - win.q_sum * lse_s) + tail, {"log_p_tail": log_p_tail}

    def logit_grad(self, bufs, saved, win, w_kd, w_ce_shared, norm):
        norm_s = None if norm is None else norm["se_s"]
        e_s = bufs["e_s"]
        p_tail = saved["log_p_tail"].exp()
        r = torch.where(win.q_tail > 0, win.q_tail / p_tail, 0.0)
        big_q = win.q_sum + win.q_tail
        coef_s = w_kd * (big_q - r) + (0.0 if w_ce_shared is None else w_ce_shared)
        # ids are not in the tail: give them back the r p_s removed above
        p_at_ids = win.topk.gather(e_s)
        if norm_s is not None:
            p_at_ids = p_at_ids / norm_s[:, None]
        g_at_ids = w_kd[:, None] * (r[:, None] * p_at_ids - win.topk_q)
        g = e_s.mul_(_scaled(norm_s, coef_s))
        win.topk.scatter_add_(g, g_at_ids)
        return g


class CEOnly(KindMath):
    """No teacher: only the CE term (``kd_weight`` is 0). The student softmax at T = 1 is the
    CE term's (shared); at T != 1 the CE term has its own and this contributes zero."""

    def local_sums(self, a_s, a_t, m_s, m_t, win):
        e_s = a_s.sub_(m_s[:, None]).exp_()
        return {"se_s": e_s.sum(1)}, {"e_s": e_s}

    def kd_row(self, tot, lse_s, m_t, bufs, win):
        return None, {}

    def logit_grad(self, bufs, saved, win, w_kd, w_ce_shared, norm):
        coef = torch.zeros_like(win.w_ce) if w_ce_shared is None else w_ce_shared
        return bufs["e_s"].mul_(_scaled(None if norm is None else norm["se_s"], coef))


#: Dense-teacher kinds by ``KDLossConfig.kind``.
DENSE_KINDS: dict[str, type[KindMath]] = {
    "forward_kl": ForwardKL, "reverse_kl": ReverseKL, "jsd": JSD}

#: Sparse-teacher kinds (forward KL) by ``KDLossConfig.topk_tail``.
SPARSE_KINDS: dict[str, type[KindMath]] = {
    "renormalize": SparseRenormalized, "ghost": SparseGhostTail}


def kind_for(config: KDLossConfig, shard: Shard, sparse: bool, dense: bool, labels_given: bool,
             dense_kinds: dict[str, type[KindMath]] = DENSE_KINDS) -> KindMath:
    """The configured kind's maths: a sparse, a dense (from ``dense_kinds``) or no teacher."""
    if sparse:
        cls = SPARSE_KINDS[config.topk_tail]
    elif dense:
        cls = dense_kinds[config.kind]
    else:
        cls = CEOnly
    return cls(config, shard, CETerm(config, labels_given))
