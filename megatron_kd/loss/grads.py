"""What the fused loss's two paths share about the weight gradient: Megatron's ``main_grad``
convention."""

from __future__ import annotations

import torch

__all__ = ["main_grad_placeholder"]


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
