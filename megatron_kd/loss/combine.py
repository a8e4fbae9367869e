"""Cross-rank communication of the fused KD loss: the per-row combine and the hidden mappings.

The heavy local work (projections, exponentials) stays on each rank; what crosses ranks is:

* the per-row combine, :class:`ShardMax` then :class:`ShardSum`: a MAX all-reduce of the
  per-row maxima (the softmax shift ``M``), then a SUM all-reduce of the per-row partial sums
  formed relative to that global shift. They are two steps because the sums need ``M`` first;
  folding both into one call would mean rescaling sums formed against local maxima, which
  changes the numerics;
* (evaluation only) the per-row argmax, :class:`ShardArgmax`: a MAX all-reduce of the per-row
  maxima, then a MIN all-reduce of the global ids that hold them (the lowest id among ties);
* with sequence parallelism, the all-gather of the hidden states (:func:`gather_sequence`);
* the sum of the per-shard hidden gradients (:func:`reduce_hidden_grad`).

The last two are called from inside :class:`~megatron_kd.loss.fused._FusedKDLoss`, whose
backward is hand-written, so they are plain functions, not autograd Functions.
:func:`gather_sequence` is also the one all-gather of a sequence-parallel sequence outside the
loss (``teacher serve``, ``cache build``: a frozen teacher's outputs).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_kd.collectives import all_gather_into, reduce_scatter_into

__all__ = ["ARGMAX_NONE", "ShardArgmax", "ShardMax", "ShardSum", "gather_sequence",
           "reduce_hidden_grad"]

#: The id a shard proposes for a row whose global maximum it does not hold (larger than any
#: vocabulary id, so the MIN all-reduce never picks it while some shard holds the maximum).
ARGMAX_NONE = torch.iinfo(torch.int64).max


class ShardMax(torch.autograd.Function):
    """Per-row maxima over the vocab shards: ``M = max_r local_max_r``, replicated.

    ``local_max``: ``[k, rows]`` this rank's per-row maxima (``-inf`` for a shard with no real
    columns). Returns a new ``[k, rows]`` tensor; the input is not written.

    Collectives (``tp_group``; none when ``tp_world_size`` is 1):

    * forward: one MAX all-reduce of ``[k, rows]``.
    * backward: none.

    Gradient: none. ``M`` is a softmax shift that consumers hold constant (their values do not
    depend on it: ``lse = M + log sum_v exp(a - M)``), so the map is differentiated as a
    stop-gradient.
    """

    @staticmethod
    def forward(ctx, local_max: torch.Tensor, tp_group: dist.ProcessGroup | None,
                tp_world_size: int) -> torch.Tensor:
        out = local_max.clone()
        if tp_world_size > 1:
            # Every rank must exponentiate against the same shift.
            dist.all_reduce(out, op=dist.ReduceOp.MAX, group=tp_group)
        return out

    @staticmethod
    def backward(ctx, grad_max: torch.Tensor) -> tuple[None, None, None]:
        return (
            None,  # local_max (a shift held constant)
            None,  # tp_group
            None,  # tp_world_size
        )


class ShardSum(torch.autograd.Function):
    """Per-row partial sums over the vocab shards: ``S = sum_r local_sums_r``, replicated.

    ``local_sums``: ``[n, rows]`` this rank's per-row partial sums, packed so one collective
    carries them all. Returns a new ``[n, rows]`` tensor; the input is not written.

    Collectives (``tp_group``; none when ``tp_world_size`` is 1):

    * forward: one SUM all-reduce of ``[n, rows]``.
    * backward: none. ``S`` is replicated and every rank computes the same loss from it, so
      ``dL/d local_sums_r = dL/dS`` on every rank: the incoming gradient passes through
      unchanged (summing it over ranks would count the replicated loss ``tp_world_size`` times).
    """

    @staticmethod
    def forward(ctx, local_sums: torch.Tensor, tp_group: dist.ProcessGroup | None,
                tp_world_size: int) -> torch.Tensor:
        out = local_sums.clone()
        if tp_world_size > 1:
            # Each shard holds part of every row's sums over the vocabulary.
            dist.all_reduce(out, op=dist.ReduceOp.SUM, group=tp_group)
        return out

    @staticmethod
    def backward(ctx, grad_sums: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return (
            grad_sums,  # local_sums (d S / d local_sums_r = identity)
            None,  # tp_group
            None,  # tp_world_size
        )


class ShardArgmax(torch.autograd.Function):
    """Per-row argmax over the vocab shards: the global id of each row's largest value, the
    lowest id among equal values (``torch.argmax``'s rule on the full row), replicated.

    ``local_max``: ``[k, rows]`` this rank's per-row maxima (``-inf`` for a shard with no real
    columns); ``local_argmax``: ``[k, rows]`` int64, the global id of the first column of this
    shard holding that maximum (any value for a shard with no real columns). Returns a new
    ``[k, rows]`` int64 tensor; the inputs are not written.

    Collectives (``tp_group``; none when ``tp_world_size`` is 1):

    * forward: one MAX all-reduce of the ``[k, rows]`` maxima, then one MIN all-reduce of the
      ``[k, rows]`` ids (a shard whose maximum is below the global one proposes
      :data:`ARGMAX_NONE`). The maxima are compared exactly: the MAX all-reduce returns one of
      the values it was given, so the shards that hold it see it bit for bit.
    * backward: none.

    Gradient: none (an argmax is piecewise constant; its output is an integer tensor).
    """

    @staticmethod
    def forward(ctx, local_max: torch.Tensor, local_argmax: torch.Tensor,
                tp_group: dist.ProcessGroup | None, tp_world_size: int) -> torch.Tensor:
        if tp_world_size == 1:
            return local_argmax.clone()
        global_max = local_max.clone()
        # Every shard must know the row's maximum to tell whether it holds it.
        dist.all_reduce(global_max, op=dist.ReduceOp.MAX, group=tp_group)
        ids = torch.where(local_max == global_max, local_argmax,
                          torch.full_like(local_argmax, ARGMAX_NONE))
        # The lowest global id among the shards that hold the maximum (ties: torch.argmax's).
        dist.all_reduce(ids, op=dist.ReduceOp.MIN, group=tp_group)
        return ids

    @staticmethod
    def backward(ctx, grad_ids: torch.Tensor) -> tuple[None, None, None, None]:
        return (
            None,  # local_max (an argmax has no gradient)
            None,  # local_argmax
            None,  # tp_group
            None,  # tp_world_size
        )


def gather_sequence(hidden: torch.Tensor, tp_group: dist.ProcessGroup | None,
                    tp_world_size: int | None = None) -> torch.Tensor:
    """All-gather sequence-parallel hidden states ``[s/tp, ...]`` (this rank's contiguous slice
    of the sequence, Megatron's split) into ``[s, ...]``, the slices in rank order.

    ``tp_world_size``: the size of ``tp_group`` where the caller knows it (None: read off the
    group; a ``None`` group is one rank). With one rank ``hidden`` itself is returned.

    Collectives: one all-gather over ``tp_group`` (none with one rank). No gradient: a plain
    collective into a new tensor. The loss calls it inside its autograd Functions, whose
    backward is hand-written (:func:`reduce_hidden_grad`); ``teacher serve`` and ``cache
    build`` on a frozen teacher's detached outputs, for a consumer of the whole sequence.
    """
    if tp_world_size is None:
        tp_world_size = 1 if tp_group is None else tp_group.size()
    if tp_world_size == 1:
        return hidden
    out = hidden.new_empty((hidden.shape[0] * tp_world_size, *hidden.shape[1:]))
    # Forward of sequence parallelism: every rank needs every token (the loss: for its vocab
    # shard; a teacher's top-K or a student's request: the whole sequence).
    all_gather_into(out, hidden.contiguous(), group=tp_group)
    return out


def reduce_hidden_grad(grad_x: torch.Tensor, tp_group: dist.ProcessGroup | None,
                       tp_world_size: int, sp: bool, lead: tuple[int, ...],
                       h_s: int) -> torch.Tensor:
    """Sum the per-shard hidden gradients ``[tokens, h_s]`` over the TP group (reduce-scatter
    to this rank's ``[s/tp, ...]`` chunk under sequence parallelism)."""
    if tp_world_size == 1:
        return grad_x
    if sp:
        full = grad_x.view(*lead, h_s)
        out = full.new_empty((lead[0] // tp_world_size, *lead[1:], h_s))
        # Each rank keeps the gradient of its own sequence chunk, summed over vocab shards.
        reduce_scatter_into(out, full.contiguous(), group=tp_group)
        return out
    # Every vocab shard contributes to every token's hidden gradient.
    dist.all_reduce(grad_x, group=tp_group)
    return grad_x
