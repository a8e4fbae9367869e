"""Rows of the fused KD loss in windows and blocks: the walk, the token-id mapping, the records.

Rows (tokens) are projected in *windows* of at most ``window_size`` rows (a hard bound on the
rows in flight). On CPU without tensor parallelism a window's elementwise work (the per-row
statistics and the logit gradient) runs in blocks of rows small enough for the last-level cache
(:attr:`~megatron_kd.loss.config.CpuTuning.block_elements` per ``[rows, V_local]`` buffer),
while the projections stay window-sized (a GEMM of a few rows would re-read the whole weight
shard per block). The dozen elementwise passes then read the cache instead of memory. The
per-row all-reduces run per block, so with TP > 1 (and on other devices) a block is the whole
window: on gloo the extra synchronisations cost more than the cache saves. The walk takes the
CPU choices as a resolved :class:`~megatron_kd.loss.config.CpuTuning`; it reads no global.

Nothing window- or block-sized is allocated per window: the logits (:meth:`WindowWalker.logits`)
and the kinds' temporaries go into named buffers (:class:`Scratch`) reused for the whole call.
A fresh allocation of that size costs a page fault per 4 KiB on CPU (measured in
docs/benchmarks.md, the loss).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_kd.loss.config import CpuTuning, KDLossConfig
from megatron_kd.parallel.vocab import VocabShard

__all__ = ["Ids", "Shard", "Window", "WindowWalker", "Scratch", "active_rows", "make_window"]

# Rows of a window or block: a slice when every token is active, else the active row indices.
Rows = slice | torch.Tensor


@dataclass(frozen=True)
class Shard:
    """This rank's place in the tensor-parallel group and its shard of the vocabulary."""

    tp_group: dist.ProcessGroup | None
    """The group over which the vocabulary is sharded (None: one rank)."""

    tp_rank: int
    """This rank in ``tp_group``."""

    tp_world_size: int
    """Ranks in ``tp_group``."""

    vocab: VocabShard
    """Rows ``[vocab_start, vocab_end)`` of the output layer held here, and how many are real."""

    @property
    def vocab_start(self) -> int:
        """Global id of the shard's first row."""
        return self.vocab.vocab_start

    @property
    def local_vocab_size(self) -> int:
        """Rows of this shard, padding included."""
        return self.vocab.local_vocab_size

    @property
    def local_valid(self) -> int:
        """Rows of this shard that are real tokens (below the true vocab size)."""
        return self.vocab.local_valid

    @property
    def vocab_size(self) -> int:
        """The true global vocabulary."""
        return self.vocab.vocab_size


class Ids:
    """Global token ids of a window (labels or top-K ids) mapped onto this rank's shard."""

    def __init__(self, ids: torch.Tensor, shard: Shard):
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


class Scratch:
    """Named temporaries of a walk, reused window to window and block to block: the window
    logits (:meth:`WindowWalker.logits`) and the kinds' ``[rows, V_local]`` block temporaries.

    A kind's elementwise steps write their temporaries here (``out=``) instead of allocating:
    on CPU a fresh block-sized tensor per step costs page faults (a JSD call at T = 2048,
    V = 151,936 spent 4 s of system time in them). Buffers under one name must not be alive
    twice at once; every block's temporaries are dead once its gradient is stored.
    """

    def __init__(self) -> None:
        self._bufs: dict[str, torch.Tensor] = {}

    def take(self, name: str, like: torch.Tensor,
             shape: tuple[int, ...] | None = None) -> torch.Tensor:
        """A buffer of ``shape`` (default ``like``'s) with ``like``'s dtype and device
        (contents undefined); it grows when a larger one is asked for."""
        shape = tuple(like.shape) if shape is None else shape
        n = math.prod(shape)
        buf = self._bufs.get(name)
        if buf is None or buf.numel() < n or buf.dtype != like.dtype:
            buf = like.new_empty(n)
            self._bufs[name] = buf
        return buf[:n].view(shape)


@dataclass
class Window:
    """One block of rows: the per-token inputs restricted to those rows, in the compute dtype.

    Tensors are ``[rows]`` unless noted; ``K`` is the sparse teacher's top-K.
    """

    m: torch.Tensor
    """Loss-mask weights of the rows."""

    w_kd: torch.Tensor
    """``m * kd_weight``: the KD term's weights."""

    ce_m: torch.Tensor
    """The CE term's token weights: ``m``, 0 where the label is ``ignore_index`` (all 0 without
    labels)."""

    w_ce: torch.Tensor
    """``ce_m * ce_weight``: the CE term's weights."""

    scratch: Scratch
    """The walk's block temporaries."""

    labels: Ids | None = None
    """``[rows, 1]`` the labels on this shard (ignored labels map to no column); None without."""

    topk: Ids | None = None
    """``[rows, K]`` a sparse teacher's ids on this shard; None for a dense teacher or none."""

    topk_logq: torch.Tensor | None = None
    """``[rows, K]`` log of ``topk_q``."""

    topk_q: torch.Tensor | None = None
    """``[rows, K]`` teacher probabilities on the K ids (renormalised at T, or as given)."""

    q_sum: torch.Tensor | None = None
    """Ghost tail: ``sum_k q_k``."""

    q_tail: torch.Tensor | None = None
    """Ghost tail: the teacher's leftover mass ``max(0, 1 - q_sum)``."""


def make_window(rows: Rows, mask: torch.Tensor, labels: torch.Tensor | None,
                ids: torch.Tensor | None, lp: torch.Tensor | None, config: KDLossConfig,
                shard: Shard, cdt: torch.dtype, scratch: Scratch) -> Window:
    """The :class:`Window` of ``rows`` of the flattened per-token inputs."""
    m = mask[rows]
    w_kd = m * config.kd_weight
    if labels is not None:
        lab = labels[rows]
        valid = lab != config.ignore_index
        ce_m = torch.where(valid, m, 0.0)  # the CE term's token weights
        win = Window(m=m, w_kd=w_kd, ce_m=ce_m, w_ce=ce_m * config.ce_weight, scratch=scratch,
                     labels=Ids(torch.where(valid, lab, -1)[:, None], shard))
    else:
        zeros = torch.zeros_like(m)
        win = Window(m=m, w_kd=w_kd, ce_m=zeros, w_ce=zeros, scratch=scratch)
    if ids is not None:
        win.topk = Ids(ids[rows], shard)
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


# One window as the walk yields it: (rows, student hidden rows [rows, h_s], student logits
# [rows, V_valid], its blocks as (first active row, Window, student logits, teacher logits)).
Block = tuple[int, Window, torch.Tensor, torch.Tensor | None]
WindowItem = tuple[Rows, torch.Tensor, torch.Tensor, Iterator[Block]]


def active_rows(loss_mask: torch.Tensor) -> torch.Tensor:
    """Indices of the tokens with a non-zero loss-mask weight (the others are skipped).

    Data-dependent, so a host synchronisation on a GPU: the loss finds them once per call,
    before its autograd Function runs, and hands them in.
    """
    return torch.nonzero(loss_mask.reshape(-1) != 0).view(-1)


class WindowWalker:
    """The inputs flattened to ``[tokens, ...]`` and the windows over the weighted tokens; the
    forward pass and the recomputing backward walk the same windows in the same order.

    ``x_s`` / ``x_t`` are the full-sequence hidden states (already all-gathered under sequence
    parallelism, see :func:`megatron_kd.loss.combine.gather_sequence`); ``tuning`` says how a
    window is worked through on CPU.
    """

    def __init__(self, x_s: torch.Tensor, student_weight: torch.Tensor, x_t: torch.Tensor | None,
                 teacher_weight: torch.Tensor | None, topk_ids: torch.Tensor | None,
                 topk_logprobs: torch.Tensor | None, labels: torch.Tensor | None,
                 loss_mask: torch.Tensor, active: torch.Tensor, config: KDLossConfig,
                 shard: Shard, cdt: torch.dtype, tuning: CpuTuning):
        n_rows = loss_mask.numel()
        self.x_s = x_s.reshape(n_rows, x_s.shape[-1])
        self.x_t = None if x_t is None else x_t.reshape(n_rows, x_t.shape[-1])
        self.w_s = student_weight[: shard.local_valid]
        self.w_t = None if teacher_weight is None else teacher_weight[: shard.local_valid]
        self.mask = loss_mask.reshape(n_rows).to(cdt)
        self.active = active  # zero-weight tokens are skipped (see active_rows)
        self.all_active = self.active.numel() == n_rows
        self.scratch = Scratch()
        self.labels = None if labels is None else labels.reshape(n_rows)
        self.ids = None if topk_ids is None else topk_ids.reshape(n_rows, -1)
        self.lp = None if topk_logprobs is None else topk_logprobs.reshape(n_rows, -1)
        self.config, self.shard, self.cdt, self.tuning = config, shard, cdt, tuning
        self.rows_per_window = config.rows_per_window(shard.local_vocab_size)
        if self.x_s.device.type == "cpu" and (shard.tp_world_size == 1 or tuning.blocks_with_tp):
            self.rows_per_block = max(1, tuning.block_elements // max(1, shard.local_valid))
        else:
            self.rows_per_block = self.rows_per_window

    def logits(self, x: torch.Tensor, w_valid: torch.Tensor, name: str) -> torch.Tensor:
        """``x @ w_valid.T`` in the input dtype, returned in the compute dtype.

        In the compute dtype the product goes into the scratch buffer ``name``, reused by
        every window: a fresh window-sized allocation per window costs a page fault per 4 KiB
        on CPU (about 1 s of a 12 s forward KL at V = 151,936 on 2 cores, docs/benchmarks.md).
        """
        if x.dtype != self.cdt or w_valid.dtype != self.cdt:
            return (x @ w_valid.t()).to(self.cdt)
        out = self.scratch.take(name, x, (x.shape[0], w_valid.shape[0]))
        if (x.device.type != "cpu" or x.shape[0] > self.tuning.chunked_projection_rows
                or w_valid.shape[0] == 0):  # a shard of padding only has no slab
            return torch.mm(x, w_valid.t(), out=out)
        return self._chunked_projection(x, w_valid, out)

    def _chunked_projection(self, x: torch.Tensor, w_valid: torch.Tensor,
                            out: torch.Tensor) -> torch.Tensor:
        """``out = x @ w_valid.T`` as ``tuning.projection_chunk``-row slabs of the weight, each
        ``w_slab @ x.T`` into one cache-sized ``[chunk, rows]`` buffer, then copied transposed
        into ``out``'s columns: for a few rows against a wide shard this runs 1.2-1.6x the one
        GEMM's rate on CPU (the one GEMM's ``[rows, V]`` output streams through memory)."""
        chunk = min(self.tuning.projection_chunk, w_valid.shape[0])
        slab_out = self.scratch.take("projection_slab", x, (chunk, x.shape[0]))
        xt = x.t()
        for c0 in range(0, w_valid.shape[0], chunk):
            c1 = min(c0 + chunk, w_valid.shape[0])
            slab = slab_out[: c1 - c0]
            torch.mm(w_valid[c0:c1], xt, out=slab)
            out[:, c0:c1].copy_(slab.t())
        return out

    def windows(self) -> Iterator[WindowItem]:
        """``(rows, student hidden rows, z_s, blocks)`` per window of active rows, where
        ``blocks`` yields ``(start, block window, z_s rows, z_t rows)`` with views of the
        window's logits and ``start`` the block's first active row."""
        n_active = self.active.numel()
        for start in range(0, n_active, self.rows_per_window):
            stop = min(start + self.rows_per_window, n_active)
            rows = slice(start, stop) if self.all_active else self.active[start:stop]
            xs_w = self.x_s[rows]
            z_s = self.logits(xs_w, self.w_s, "z_s")
            z_t = self.logits(self.x_t[rows], self.w_t, "z_t") if self.x_t is not None else None
            yield rows, xs_w, z_s, self._blocks(start, stop, z_s, z_t)

    def _blocks(self, start: int, stop: int, z_s: torch.Tensor,
                z_t: torch.Tensor | None) -> Iterator[Block]:
        for b0 in range(0, stop - start, self.rows_per_block):
            b1 = min(b0 + self.rows_per_block, stop - start)
            rows = (slice(start + b0, start + b1) if self.all_active
                    else self.active[start + b0:start + b1])
            win = make_window(rows, self.mask, self.labels, self.ids, self.lp, self.config,
                              self.shard, self.cdt, self.scratch)
            yield start + b0, win, z_s[b0:b1], None if z_t is None else z_t[b0:b1]

    def accumulate(self, g: torch.Tensor, xs_w: torch.Tensor, rows: Rows,
                   grad_x: torch.Tensor | None, grad_w: torch.Tensor | None,
                   w_scale: torch.Tensor | None = None) -> None:
        """Hidden and weight gradients of one window from its logit gradient ``g``; with
        ``w_scale`` (a 0-d tensor) the weight gradient is scaled by it as it is added (for
        ``main_grad``, which holds other microbatches' gradients)."""
        gd = g.to(xs_w.dtype)
        if grad_x is not None:
            gx = (gd @ self.w_s).to(grad_x.dtype)
            if isinstance(rows, slice):
                grad_x[rows] = gx
            else:
                grad_x.index_copy_(0, rows, gx)
        if grad_w is not None:
            n_valid = self.w_s.shape[0]
            x = xs_w if w_scale is None else xs_w * w_scale.to(xs_w.dtype)  # [rows, h]: cheap
            if gd.dtype == grad_w.dtype:
                grad_w[:n_valid].addmm_(gd.t(), x)
            else:
                grad_w[:n_valid] += (gd.t() @ x).to(grad_w.dtype)
