"""What the fused loss's two paths share about their gradients: the scaling of gradients
precomputed in forward, Megatron's ``main_grad`` convention, and what backward returns for the
inputs both autograd Functions take."""

from __future__ import annotations

from typing import Callable

import torch

__all__ = ["input_grads", "main_grad_placeholder", "scale_precomputed"]


def main_grad_placeholder(weight: torch.Tensor) -> torch.Tensor | None:
    """What backward returns for a weight whose gradient went into ``main_grad``: Megatron's
    convention (its ``LinearWithGradAccumulationAndAsyncCommunication``): a placeholder its DDP
    hook discards once ``grad_added_to_main_grad`` is set, or None without that attribute."""
    if not hasattr(weight, "grad_added_to_main_grad"):
        return None
    weight.grad_added_to_main_grad = True
    if getattr(weight, "zero_out_wgrad", False):
        return torch.zeros(weight.main_grad.shape, dtype=weight.dtype, device=weight.device)
    return torch.empty(weight.main_grad.shape, dtype=weight.dtype, device=weight.device)


def scale_precomputed(ctx, grad_loss: torch.Tensor,
                      finish_weight_grad: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
                      ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Backward of a loss whose gradients forward computed (``ctx.grads``, released here):
    both scaled by the upstream ``grad_loss``, a device tensor (a host read of it would stall a
    GPU). The hidden gradient in place (this Function's buffer); the weight gradient added to
    ``main_grad`` when ``ctx.fuse_wgrad`` (``ctx.weight`` released), else
    ``finish_weight_grad(grad_w, grad_loss)``, which returns it scaled in the weight's dtype."""
    grad_x, grad_w = ctx.grads
    ctx.grads = None
    grad_x = None if grad_x is None else grad_x.mul_(grad_loss.to(grad_x.dtype))
    if grad_w is not None and ctx.fuse_wgrad:
        weight, ctx.weight = ctx.weight, None
        weight.main_grad.addcmul_(grad_w, grad_loss.to(weight.main_grad.dtype))
        grad_w = None  # the accumulator freed before the placeholder is allocated
        grad_w = main_grad_placeholder(weight)
    elif grad_w is not None:
        grad_w = finish_weight_grad(grad_w, grad_loss)
    return grad_x, grad_w


def input_grads(ctx, grad_x: torch.Tensor | None,
                grad_w: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
    """What the backward of either path's loss Function returns: one entry per forward input
    (both take the same ones, in this order), a gradient for the student's two only."""
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
        None,  # tuning
        None,  # active
        None,  # tracker
        None,  # terms_out
    )
