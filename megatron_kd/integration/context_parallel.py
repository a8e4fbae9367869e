"""Context parallelism: Megatron's load-balanced split of a sequence, and the attention that runs
on it where Transformer Engine is absent.

Megatron cuts each sequence into ``2 * cp`` equal chunks and gives context-parallel rank ``r``
chunks ``r`` and ``2 * cp - 1 - r`` (``megatron.core.utils.get_batch_on_this_cp_rank``): with a
causal mask the early and the late chunks balance each rank's work. :func:`cp_positions` is that
split as indices into the sequence; the trainer, the teacher sources (a cache's rows, a replica's
answer) and the attention below all take a rank's positions from it.

:class:`ContextParallelAttention` is Megatron-Core's local ``DotProductAttention`` over a split
sequence, for CPU runs and tests (on a GPU Transformer Engine's attention does context
parallelism): the keys and values of the context-parallel group are all-gathered
(:class:`GatherSequence`: its backward reduce-scatters their gradients back to their ranks) and
each rank's queries attend to them under the causal (and sliding-window) mask of the true
positions. Megatron-Core's local attention asserts ``context_parallel_size == 1``
(``dot_product_attention.py``, megatron-core 0.16.1 and 0.19.2); this class builds it with a
configuration copy that says 1 and keeps the group itself.

:class:`ContextParallelSdpaAttention` (the choice on a GPU without Transformer Engine) computes
the same with ``scaled_dot_product_attention``
(:func:`~megatron_kd.integration.sdpa_attention.causal_attention`): the gathered keys are put in
sequence order and each of the rank's two chunks attends to the keys up to its end (from its
window's start with a sliding window), so no ``[s / cp, s]`` scores or mask are formed.
"""

from __future__ import annotations

import copy

import torch
from megatron.core import parallel_state
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType

from megatron_kd.collectives import all_gather_into, reduce_scatter_into
from megatron_kd.integration.sdpa_attention import (
    causal_attention,
    check_forward_args,
    check_sdpa_layer,
    dropout_rng,
    layer_window_left,
    sdpa_scale,
)
from megatron_kd.parallel.sequence import cp_chunk_ranges, cp_rows

__all__ = ["ContextParallelAttention", "ContextParallelSdpaAttention", "GatherSequence",
           "cp_positions", "gather_positions"]


def cp_positions(seq_length: int, cp_rank: int, cp_size: int,
                 device: torch.device | str = "cpu") -> torch.Tensor:
    """The positions ``[seq_length / cp]`` of the sequence that context-parallel rank
    ``cp_rank`` holds, in the order it holds them (:func:`~megatron_kd.parallel.sequence.
    cp_rows`: chunk ``cp_rank``, then chunk ``2 * cp_size - 1 - cp_rank`` of ``2 * cp_size``)."""
    return torch.tensor(cp_rows(seq_length, cp_rank, cp_size), dtype=torch.int64,
                        device=device)


def gather_positions(local: torch.Tensor, cp_group) -> torch.Tensor:
    """``[s / cp, ...]`` (a context-parallel rank's positions, in its order) -> ``[s, ...]`` in
    the sequence's order, on every rank of ``cp_group`` (one all-gather; no gradient: a frozen
    teacher's output, for a consumer that needs the whole sequence)."""
    size = cp_group.size()
    if size == 1:
        return local
    every = local.new_empty((local.shape[0] * size, *local.shape[1:]))
    # every rank's positions, rank after rank
    all_gather_into(every, local.contiguous(), group=cp_group)
    s = every.shape[0]
    order = torch.cat([cp_positions(s, r, size, local.device) for r in range(size)])
    out = torch.empty_like(every)
    out[order] = every
    return out


class GatherSequence(torch.autograd.Function):
    """All-gather of ``[s_local, ...]`` along dim 0 over ``group`` (rank order).

    Collectives: forward, one all-gather over ``group``; backward, one reduce-scatter (sum) over
    ``group``: every rank's gradient of the gathered tensor is summed into the slice each rank
    gave (the queries of every rank attend to every rank's keys).
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        out = x.new_empty((x.shape[0] * group.size(), *x.shape[1:]))
        # the split sequence's keys / values, every rank's in rank order
        all_gather_into(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out = grad.new_empty((grad.shape[0] // ctx.group.size(), *grad.shape[1:]))
        # each rank's keys / values get the gradient of every rank's queries
        reduce_scatter_into(out, grad.contiguous(), group=ctx.group)
        return out, None  # group


class ContextParallelAttention(DotProductAttention):
    """Megatron-Core's local attention on a context-parallel split sequence (see the module
    docstring); same constructor and forward as ``DotProductAttention``."""

    def __init__(self, config, layer_number: int, attn_mask_type: AttnMaskType,
                 attention_type: str, attention_dropout: float | None = None,
                 softmax_scale: float | None = None, cp_comm_type: str | None = None,
                 pg_collection=None) -> None:
        local = copy.copy(config)
        local.context_parallel_size = 1  # the split is this class's business
        super().__init__(local, layer_number, attn_mask_type, attention_type,
                         attention_dropout=attention_dropout, softmax_scale=softmax_scale,
                         cp_comm_type=cp_comm_type, pg_collection=pg_collection)
        cp = getattr(pg_collection, "cp", None) if pg_collection is not None else None
        self.cp_group = cp if cp is not None else parallel_state.get_context_parallel_group()
        self.window_left = layer_window_left(config, layer_number)
        # the softmax would build its sliding-window mask for contiguous positions; this
        # class's mask (:meth:`_mask`) holds the window of the true positions instead
        self.scale_mask_softmax.window_size = None

    def _mask(self, s_local: int, device: torch.device) -> torch.Tensor:
        """``[1, 1, s_local, s]`` True where a query of this rank may not see a key."""
        size, rank = self.cp_group.size(), self.cp_group.rank()
        s = s_local * size
        q = cp_positions(s, rank, size, device)
        k = torch.cat([cp_positions(s, r, size, device) for r in range(size)])
        masked = k.unsqueeze(0) > q.unsqueeze(1)
        if self.window_left is not None:
            masked |= k.unsqueeze(0) < q.unsqueeze(1) - self.window_left
        return masked.view(1, 1, s_local, s)

    def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None):
        if attention_mask is not None:
            raise ValueError("context-parallel attention on CPU takes causal masks only (no "
                             "attention_mask)")
        key = GatherSequence.apply(key, self.cp_group)
        value = GatherSequence.apply(value, self.cp_group)
        mask = self._mask(query.shape[0], query.device)
        return super().forward(query, key, value, mask, attn_mask_type=attn_mask_type,
                               attention_bias=attention_bias, packed_seq_params=packed_seq_params)


class ContextParallelSdpaAttention(ContextParallelAttention):
    """:class:`ContextParallelAttention` computed by ``scaled_dot_product_attention`` chunk by
    chunk (see the module docstring): the same constructor, parameters and collectives; no
    ``[s / cp, s]`` scores or mask. Refuses (``ValueError``) what
    :class:`~megatron_kd.integration.sdpa_attention.SdpaAttention` refuses."""

    def __init__(self, config, layer_number: int, attn_mask_type: AttnMaskType,
                 attention_type: str, attention_dropout: float | None = None,
                 softmax_scale: float | None = None, cp_comm_type: str | None = None,
                 pg_collection=None) -> None:
        check_sdpa_layer(config, attn_mask_type)
        super().__init__(config, layer_number, attn_mask_type, attention_type,
                         attention_dropout=attention_dropout, softmax_scale=softmax_scale,
                         cp_comm_type=cp_comm_type, pg_collection=pg_collection)

    def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None):
        """``query, key, value [s / cp, b, heads, d]`` (this rank's positions) ->
        ``[s / cp, b, a * d]``."""
        check_forward_args(attention_mask, attn_mask_type, attention_bias, packed_seq_params)
        size, rank = self.cp_group.size(), self.cp_group.rank()
        s = query.shape[0] * size
        key = GatherSequence.apply(key, self.cp_group)
        value = GatherSequence.apply(value, self.cp_group)
        # the gathered keys are every rank's positions, rank after rank: into sequence order
        order = torch.argsort(torch.cat([cp_positions(s, r, size, key.device)
                                         for r in range(size)]))
        # [s, b, n, d] -> [b, n, s, d]
        q = query.permute(1, 2, 0, 3)
        k, v = (t[order].permute(1, 2, 0, 3) for t in (key, value))
        dropout_p = self.attention_dropout.p if self.training else 0.0
        outs, local = [], 0
        with dropout_rng(self):
            for chunk in cp_chunk_ranges(s, rank, size):
                start, stop = chunk.start, chunk.stop
                k_lo = 0 if self.window_left is None else max(0, start - self.window_left)
                outs.append(causal_attention(
                    q[:, :, local:local + stop - start], k[:, :, k_lo:stop], v[:, :, k_lo:stop],
                    scale=sdpa_scale(self), dropout_p=dropout_p, window_left=self.window_left,
                    query_start=start, key_start=k_lo))
                local += stop - start
        out = torch.cat(outs, dim=2)
        # [b, a, s / cp, d] -> [s / cp, b, a * d]
        return out.permute(2, 0, 1, 3).reshape(out.shape[2], out.shape[0], -1)
