"""The dense-logits baseline of the KD loss: the logits written, as Megatron-LM + ModelOpt's
logits KD does today. For benchmarks, not training (``KDLossConfig.path == "dense"``,
``megatron-kd train --kd-loss-path dense``).

The output layers write the ``[tokens, local_vocab_size]`` logits of the student (with autograd)
and of a dense teacher (without), both cast to fp32; the log-softmax over the vocabulary shards
and the per-token KL / JSD / CE are plain PyTorch ops on them, and autograd keeps what it needs
for backward. Nothing is windowed: memory grows with tokens x ``V / tp``. The loss and its
contract are :func:`~megatron_kd.loss.vocab_parallel_kd_loss`'s (the same checks, the same
values up to rounding), so the two can be timed against each other on one run.

How the vocabulary shards combine. Each rank computes its *share* ``L_r`` of the loss: the
per-token sums over the vocabulary (KL, JSD, CE's ``-log p_s[label]``, a top-K teacher's ids)
restricted to its shard's columns, and a term that only exists per token (a ghost tail's bucket)
on TP rank 0 alone, so that ``L = sum_r L_r``. The log-sum-exp ``lse`` that every share uses is
replicated (:class:`_SumOverShards`: its backward sums every rank's gradient, since each share
depends on it); the shares are summed once at the end
(:class:`~megatron_kd.loss.combine.ShardSum`: backward passes the gradient through, since the
sum is the replicated loss). Every rank builds the same graph (a shard of padding only too), so
the backward collectives run in the same order everywhere.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist

from megatron_kd.loss.checks import checked_inputs, compute_dtype
from megatron_kd.loss.combine import ShardMax, ShardSum, gather_sequence, reduce_hidden_grad
from megatron_kd.loss.config import KDLossConfig
from megatron_kd.loss.grads import main_grad_placeholder
from megatron_kd.loss.teacher import DenseTeacher, Teacher, TopKTeacher
from megatron_kd.loss.window import Shard, active_rows

__all__ = ["dense_logits_kd_loss"]


class _HiddenToShards(torch.autograd.Function):
    """The student's hidden states as every vocab shard's output layer sees them: the full
    sequence ``[s, b, h]`` (Megatron's copy / gather into the tensor-parallel region).

    Collectives (``tp_group``; none when ``tp_world_size`` is 1):

    * forward: with ``sp`` one all-gather of ``[s/tp, b, h]`` along the sequence; else none.
    * backward: one all-reduce of the ``[s, b, h]`` gradient (every vocab shard contributes to
      every token's gradient), a reduce-scatter to this rank's ``[s/tp, b, h]`` with ``sp``.
    """

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, tp_group: dist.ProcessGroup | None,
                tp_world_size: int, sp: bool) -> torch.Tensor:
        ctx.tp_group, ctx.tp_world_size, ctx.sp = tp_group, tp_world_size, sp
        ctx.hidden_shape = hidden.shape
        if sp:
            return gather_sequence(hidden, tp_group, tp_world_size)
        return hidden.view_as(hidden)

    @staticmethod
    def backward(ctx, grad_full: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        h = grad_full.shape[-1]
        lead = tuple(grad_full.shape[:-1])
        grad = grad_full.reshape(-1, h)
        if ctx.tp_world_size > 1 and not ctx.sp:
            grad = grad.clone()  # the all-reduce works in place; the incoming tensor is autograd's
        grad = reduce_hidden_grad(grad, ctx.tp_group, ctx.tp_world_size, ctx.sp, lead, h)
        return (
            grad.view(ctx.hidden_shape),  # hidden
            None,  # tp_group
            None,  # tp_world_size
            None,  # sp
        )


class _Logits(torch.autograd.Function):
    """The output layer's logits ``x W^T``, ``[rows, local_vocab_size]`` in the inputs' dtype,
    with Megatron's gradient-accumulation fusion: the weight gradient added to
    ``weight.main_grad`` in backward (``grad_added_to_main_grad`` set) instead of returned.

    Collectives: none in forward or backward (the hidden gradient is summed over the vocab
    shards by :class:`_HiddenToShards`).
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, fuse_wgrad: bool) -> torch.Tensor:
        ctx.fuse_wgrad = fuse_wgrad
        ctx.save_for_backward(x, weight)
        return x @ weight.t()

    @staticmethod
    def backward(ctx, grad_logits: torch.Tensor
                 ) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:
        x, weight = ctx.saved_tensors
        grad_x = grad_logits @ weight if ctx.needs_input_grad[0] else None
        grad_w = None
        if ctx.needs_input_grad[1]:
            grad_w = grad_logits.t() @ x
            if ctx.fuse_wgrad:
                weight.main_grad.add_(grad_w.to(weight.main_grad.dtype))
                grad_w = main_grad_placeholder(weight)
        return (
            grad_x,  # x
            grad_w,  # weight
            None,  # fuse_wgrad
        )


class _SumOverShards(torch.autograd.Function):
    """Per-row sums over the vocab shards, ``S = sum_r local_r``, replicated, for a value each
    rank then uses in its own share ``L_r`` of the loss (the log-sum-exp, a ghost tail's mass).

    Collectives (``tp_group``; none when ``tp_world_size`` is 1):

    * forward: one SUM all-reduce of ``[k, rows]``.
    * backward: one SUM all-reduce of the gradient: ``dL/dS = sum_r dL_r/dS``, and each rank's
      autograd sees its own share only.
    """

    @staticmethod
    def forward(ctx, local: torch.Tensor, tp_group: dist.ProcessGroup | None,
                tp_world_size: int) -> torch.Tensor:
        ctx.tp_group, ctx.tp_world_size = tp_group, tp_world_size
        out = local.clone()
        if tp_world_size > 1:
            # Each shard holds part of every row's sum over the vocabulary.
            dist.all_reduce(out, group=tp_group)
        return out

    @staticmethod
    def backward(ctx, grad_sum: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        grad = grad_sum.clone()
        if ctx.tp_world_size > 1:
            # Every rank's share of the loss depends on the replicated sum.
            dist.all_reduce(grad, group=ctx.tp_group)
        return (
            grad,  # local
            None,  # tp_group
            None,  # tp_world_size
        )


def _log_softmax(scaled: list[torch.Tensor], shard: Shard) -> list[torch.Tensor]:
    """Vocab-parallel log-softmax of each ``[rows, local_valid]`` fp32 logits (one MAX and one
    SUM all-reduce for them all): ``a - lse`` on this shard's columns."""
    rows = scaled[0].shape[0]
    local_max = torch.stack([a.detach().amax(1) if a.shape[1] else
                             a.new_full((rows,), -math.inf) for a in scaled])
    # the shift M: a constant (lse = M + log sum exp(a - M) does not depend on it)
    shift = ShardMax.apply(local_max, shard.tp_group, shard.tp_world_size)
    local_sum = torch.stack([(a - m[:, None]).exp().sum(1) for a, m in zip(scaled, shift)])
    lse = shift + _SumOverShards.apply(local_sum, shard.tp_group, shard.tp_world_size).log()
    # a frozen model's log-probs stay out of the graph (the shared collective made its lse part
    # of the student's)
    return [a - (row_lse if a.requires_grad else row_lse.detach())[:, None]
            for a, row_lse in zip(scaled, lse)]


def _forward_kl(logp_s: torch.Tensor, logp_t: torch.Tensor, config: KDLossConfig) -> torch.Tensor:
    """This shard's ``sum_v p_t (log p_t - log p_s)``."""
    return (logp_t.exp() * (logp_t - logp_s)).sum(1)


def _reverse_kl(logp_s: torch.Tensor, logp_t: torch.Tensor, config: KDLossConfig) -> torch.Tensor:
    """This shard's ``sum_v p_s (log p_s - log p_t)``."""
    return (logp_s.exp() * (logp_s - logp_t)).sum(1)


def _jsd(logp_s: torch.Tensor, logp_t: torch.Tensor, config: KDLossConfig) -> torch.Tensor:
    """This shard's ``beta KL(p_t || m) + (1 - beta) KL(p_s || m)`` terms."""
    beta = config.beta
    # log m = log(beta p_t + (1 - beta) p_s), in log space: small p do not underflow
    log_m = torch.logaddexp(logp_t + math.log(beta), logp_s + math.log1p(-beta))
    return (beta * (logp_t.exp() * (logp_t - log_m)).sum(1)
            + (1.0 - beta) * (logp_s.exp() * (logp_s - log_m)).sum(1))


#: This shard's part of the per-token divergence of a dense teacher, by ``KDLossConfig.kind``.
_DENSE_KINDS: dict[str, Callable[[torch.Tensor, torch.Tensor, KDLossConfig], torch.Tensor]] = {
    "forward_kl": _forward_kl, "reverse_kl": _reverse_kl, "jsd": _jsd}


def _owned(ids: torch.Tensor, shard: Shard) -> tuple[torch.Tensor, torch.Tensor]:
    """``(local column, whether this shard owns it)`` of global ids ``[rows, k]``."""
    local = ids - shard.vocab_start
    return local, (local >= 0) & (local < shard.local_valid)


def _pick(logp: torch.Tensor, ids: torch.Tensor, shard: Shard
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logp at the global ids [rows, k] where this shard owns them, else 0; ownership)``."""
    local, own = _owned(ids, shard)
    if logp.shape[1] == 0:
        # a shard of padding only owns no id: a zero still joined to the graph, so this rank
        # runs the same backward collectives as the others
        return logp.sum(1, keepdim=True).expand(-1, ids.shape[1]), own
    picked = logp.gather(1, local.clamp(0, logp.shape[1] - 1))
    return torch.where(own, picked, 0.0), own


def _topk_share(logp_s: torch.Tensor, ids: torch.Tensor, logprobs: torch.Tensor,
                config: KDLossConfig, shard: Shard) -> torch.Tensor:
    """This rank's share of a top-K teacher's forward KL per row (the ghost tail's bucket on
    TP rank 0)."""
    picked, own = _pick(logp_s, ids, shard)
    if config.topk_tail == "renormalize":
        log_q = torch.log_softmax(logprobs / config.temperature, dim=1)
        return torch.where(own, log_q.exp() * (log_q - picked), 0.0).sum(1)
    q = logprobs.exp()
    head = torch.where(own & (q > 0), q * (logprobs - picked), 0.0).sum(1)
    q_tail = (1.0 - q.sum(1)).clamp(min=0.0)
    # the K ids' columns on this shard (an id of another shard adds 0 to a column of this one)
    in_k = torch.zeros(logp_s.shape, dtype=logp_s.dtype, device=logp_s.device)
    if logp_s.shape[1]:
        local, _ = _owned(ids, shard)
        in_k.scatter_add_(1, local.clamp(0, logp_s.shape[1] - 1), own.to(in_k.dtype))
    in_k = in_k > 0
    # the student's mass outside the K ids, over every shard
    p_tail = _SumOverShards.apply(torch.where(in_k, 0.0, logp_s.exp()).sum(1)[None],
                                  shard.tp_group, shard.tp_world_size)[0]
    tail = torch.where(q_tail > 0, q_tail * (q_tail.log() - p_tail.log()), 0.0)
    return head + (1.0 if shard.tp_rank == 0 else 0.0) * tail


def _rows(tensor: torch.Tensor | None, lead: int, active: torch.Tensor | None
          ) -> torch.Tensor | None:
    """``tensor`` flattened to ``[tokens, ...]`` (``lead`` leading dims), the active rows."""
    if tensor is None:
        return None
    flat = tensor.reshape(-1, *tensor.shape[lead:])
    return flat if active is None else flat.index_select(0, active)


def _student_logits(hidden: torch.Tensor, weight: torch.Tensor, shard: Shard, sp: bool,
                    active: torch.Tensor | None, config: KDLossConfig,
                    cdt: torch.dtype) -> torch.Tensor:
    """The student's ``[rows, local_valid]`` logits of the active rows, cast to ``cdt``."""
    full = _HiddenToShards.apply(hidden, shard.tp_group, shard.tp_world_size, sp)
    x = _rows(full, full.dim() - 1, active)
    fuse = config.gradient_accumulation_fusion and weight.requires_grad
    return _Logits.apply(x, weight, fuse)[:, :shard.local_valid].to(cdt)


@torch.no_grad()
def _teacher_logits(teacher: DenseTeacher, shard: Shard, sp: bool, active: torch.Tensor | None,
                    cdt: torch.dtype) -> torch.Tensor:
    """The frozen teacher's ``[rows, local_valid]`` logits of the active rows, in ``cdt``."""
    hidden = teacher.hidden
    if sp:
        hidden = gather_sequence(hidden, shard.tp_group, shard.tp_world_size)
    x = _rows(hidden, hidden.dim() - 1, active)
    return (x @ teacher.weight.t())[:, :shard.local_valid].to(cdt)


def _shares(z_s: torch.Tensor, teacher: Teacher | None, labels: torch.Tensor | None,
            shard: Shard, sp: bool, active: torch.Tensor | None, lead: int,
            config: KDLossConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's per-row shares ``(KD, CE)`` (``[rows]`` each; zeros without a teacher /
    labels): summed over the TP group they are the per-token KD and CE."""
    t = config.temperature
    a_s = z_s if t == 1.0 else z_s / t
    kd = ce = torch.zeros(z_s.shape[0], dtype=z_s.dtype, device=z_s.device)
    if isinstance(teacher, DenseTeacher):
        z_t = _teacher_logits(teacher, shard, sp, active, z_s.dtype)
        a_t = z_t if t == 1.0 else z_t / t
        logp_s, logp_t = _log_softmax([a_s, a_t], shard)
        kd = _DENSE_KINDS[config.kind](logp_s, logp_t, config) * (t * t)
    elif isinstance(teacher, TopKTeacher):
        (logp_s,) = _log_softmax([a_s], shard)
        ids = _rows(teacher.ids, lead, active)
        logprobs = _rows(teacher.logprobs, lead, active).to(z_s.dtype)
        kd = _topk_share(logp_s, ids, logprobs, config, shard) * (t * t)
    else:
        logp_s = None
    if labels is not None:
        # CE at T = 1: the KD term's log-probs when T is 1
        (logp_1,) = [logp_s] if t == 1.0 and logp_s is not None else _log_softmax([z_s], shard)
        picked, _ = _pick(logp_1, _rows(labels, lead, active)[:, None], shard)
        ce = -picked[:, 0]
    return kd, ce


def _raise_if_not_finite(kd_row: torch.Tensor, ce_row: torch.Tensor, m: torch.Tensor,
                         ce_m: torch.Tensor, config: KDLossConfig) -> None:
    """``FloatingPointError`` naming the term, the first weighted non-finite active token and
    its value (the fused loss's message)."""
    first = None
    for label, row, weight in ((f"KD ({config.kind})", kd_row, m), ("CE", ce_row, ce_m)):
        bad = torch.nonzero((weight != 0) & ~torch.isfinite(row)).view(-1)
        if bad.numel() and (first is None or int(bad[0]) < first[0]):
            first = (int(bad[0]), label, float(row[bad[0]]))
    if first is not None:
        index, label, value = first
        raise FloatingPointError(
            f"non-finite {label} loss {value} at active token {index} "
            f"(check the hidden states and weights for inf/NaN)")


# ----------------------------------------------------------------------------------------------
# public entry point
# ----------------------------------------------------------------------------------------------
def dense_logits_kd_loss(
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
    """The reference baseline of :func:`~megatron_kd.loss.vocab_parallel_kd_loss`: the same
    arguments, checks, loss and gradients, from the written fp32 logits (see the module
    docstring). ``config.path`` is not read (``"dense"`` in the fused loss's config sends its
    calls here); ``window_size``, ``backward``, ``cpu_tuning`` and ``gpu_tuning`` do not apply.

    Args:
        student_hidden: ``[s, b, h_s]`` (``[s/tp, b, h_s]`` with ``config.sequence_parallel``).
        student_weight: ``[local_vocab_size, h_s]`` this rank's shard of the output layer.
        teacher: a :class:`~megatron_kd.loss.DenseTeacher`, a
            :class:`~megatron_kd.loss.TopKTeacher` or None (CE alone).
        labels: ``[s, b]`` token ids for the CE term (``ignore_index``: no CE).
        loss_mask: ``[s, b]`` per-token weights (default ones); tokens of weight 0 are left
            out before the projection, as the fused loss leaves them out.
        config: what to compute (:class:`~megatron_kd.loss.KDLossConfig`).
        tp_group: the tensor-parallel group of the vocab shards (None: one rank).
        terms_out: receives the detached unweighted sums ``kd_sum`` and ``ce_sum``.

    Returns:
        ``(loss_sum, num_tokens)``: the loss in fp32 (fp64 for fp64 inputs) with gradients for
        ``student_hidden`` and ``student_weight`` in their dtypes (the weight's into
        ``main_grad`` with ``gradient_accumulation_fusion``), and ``loss_mask.sum()``.

    Collectives (``tp_group``): the exchange of shard sizes (one all-gather of four integers);
    with ``sequence_parallel`` an all-gather of each model's hidden states; per call one MAX and
    one SUM all-reduce of ``[models, rows]`` for the log-sum-exp (one more pair for CE at
    T != 1; one more SUM for a ghost tail); one SUM all-reduce of ``1 + 2 rows`` values (the
    shares and, for the checks and ``terms_out``, the per-token terms). Backward: the SUM
    all-reduce of each log-sum-exp's (and ghost tail's) gradient, and the all-reduce
    (reduce-scatter with ``sequence_parallel``) of the hidden gradient.
    """
    config = config or KDLossConfig()
    if config.elementwise != "eager":
        raise ValueError(f"the dense-logits baseline has no elementwise={config.elementwise!r} "
                         f"(an option of the fused CPU path)")
    shard, sp, loss_mask = checked_inputs(student_hidden, student_weight, teacher, labels,
                                          loss_mask, config, tp_group)
    cdt = compute_dtype(student_hidden)
    lead = loss_mask.dim()
    active = active_rows(loss_mask)
    if active.numel() == loss_mask.numel():
        active = None  # every token counts: no row selection (no copy of the hidden states)
    z_s = _student_logits(student_hidden, student_weight, shard, sp, active, config, cdt)
    kd, ce = _shares(z_s, teacher, labels, shard, sp, active, lead, config)
    m = _rows(loss_mask, lead, active).to(cdt)
    ce_m = (m if labels is None else
            torch.where(_rows(labels, lead, active) != config.ignore_index, m, 0.0))
    # a term of weight 0 stays out of the graph (CE for terms_out only: no gradient from it);
    # which terms are in is the config's, the same on every rank
    share = sum((weight * (w * term).sum() for weight, w, term in
                 ((config.kd_weight, m, kd), (config.ce_weight, ce_m, ce)) if weight > 0),
                start=torch.zeros((), dtype=cdt, device=m.device))
    # the loss and the per-token terms in one all-reduce; the gradient reaches the share alone
    total = ShardSum.apply(torch.cat([share.view(1), kd.detach(), ce.detach()]), shard.tp_group,
                           shard.tp_world_size)
    rows = kd.shape[0]
    loss = total[0]
    kd_row, ce_row = total.detach()[1:].view(2, rows)
    if labels is None:
        ce_m = torch.zeros_like(m)
    if config.check_finite:
        _raise_if_not_finite(kd_row, ce_row, m, ce_m, config)
    if terms_out is not None:
        terms_out["kd_sum"] = (m * kd_row).sum()
        terms_out["ce_sum"] = torch.where(ce_m != 0, ce_m * ce_row, 0.0).sum()
    return loss, loss_mask.sum().to(loss.dtype)
