"""What the fused loss's two paths share about their gradients: the scaling of gradients
precomputed in forward, and Megatron's ``main_grad`` convention."""

from __future__ import annotations

from typing import Callable

import torch

__all__ = ["main_grad_placeholder", "scale_precomputed"]


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
        grad_w = main_grad_placeholder(weight)
    elif grad_w is not None:
        grad_w = finish_weight_grad(grad_w, grad_loss)
    return grad_x, grad_w
