"""Forward KL with a block's elementwise work in compiled kernels (``elementwise="compiled"``).

The maths is :class:`~megatron_kd.loss.kinds.ForwardKL`'s; only how a block's elementwise work
runs differs. ``torch.compile`` (Inductor) turns each of the two steps between the combine's
collectives into one kernel: C++/OpenMP on CPU, Triton on a GPU. The eager kind makes a dozen
passes over a block's ``[rows, V_valid]`` logits and keeps one block temporary; here the logits
are read three times (the max, the sums, the gradient) and nothing of the block's size is
allocated. Whether that pays depends on the device (docs/benchmarks.md, the loss).
"""

from __future__ import annotations

import functools

import torch

from megatron_kd.loss.kinds import ForwardKL, KindMath

__all__ = ["DENSE_KINDS", "CompiledForwardKL", "forward_kl_grad_", "forward_kl_sums"]

# Dynamo's bound on the graphs one function may hold (its name moved in torch 2.6).
_RECOMPILE_LIMIT = ("recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit")
                    else "cache_size_limit")
#: Graphs a kernel may hold: one per dtype, device, 0/1-sized dimension and active
#: ``TorchFunctionMode``. A training run needs two or three; a test process sees a few dozen,
#: past Dynamo's default of 8, after which ``fullgraph=True`` fails.
MAX_GRAPHS = 64
# Made once (a fresh patch costs about 12 us, per block and kernel) and entered around each call.
_MORE_GRAPHS = torch._dynamo.config.patch(**{_RECOMPILE_LIMIT: MAX_GRAPHS})


def _compiled(fn):
    """``fn`` through ``torch.compile``, compiled on its first call (importing the loss compiles
    nothing): dynamic sizes, so the windows' and blocks' row counts share one graph; one graph
    per call, never a silent fall back to eager ops on a graph break."""
    compiled = None

    @functools.wraps(fn)
    def call(*args):
        nonlocal compiled
        if compiled is None:
            compiled = torch.compile(fn, dynamic=True, fullgraph=True)
        with _MORE_GRAPHS:
            return compiled(*args)
    return call


@_compiled
def forward_kl_sums(a_s: torch.Tensor, a_t: torch.Tensor, m_s: torch.Tensor,
                    m_t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Forward KL's per-row sums in one kernel, nothing ``[rows, V]`` written:
    ``(sum_v e_t (a_t - a_s), sum_v e_s, sum_v e_t)`` with ``e = exp(a - M)``."""
    e_t = torch.exp(a_t - m_t[:, None])
    return (e_t * (a_t - a_s)).sum(1), torch.exp(a_s - m_s[:, None]).sum(1), e_t.sum(1)


@_compiled
def forward_kl_grad_(a_s: torch.Tensor, a_t: torch.Tensor, lse_s: torch.Tensor,
                     lse_t: torch.Tensor, coef_s: torch.Tensor,
                     coef_t: torch.Tensor) -> torch.Tensor:
    """``a_s <- coef_s p_s - coef_t p_t`` in place, ``p = exp(a - lse)`` with per-row
    coefficients, in one kernel."""
    return a_s.copy_(torch.exp(a_s - lse_s[:, None]) * coef_s[:, None]
                     - torch.exp(a_t - lse_t[:, None]) * coef_t[:, None])


class CompiledForwardKL(ForwardKL):
    """Dense forward KL through :func:`forward_kl_sums` and :func:`forward_kl_grad_`. The sums
    leave the scaled logits as they are; the gradient exponentiates them again against the
    combined ``lse`` (as the recomputing backward does), so no exponentials are kept."""

    def local_sums(self, a_s, a_t, m_s, m_t, win):
        s, se_s, se_t = forward_kl_sums(a_s, a_t, m_s, m_t)
        return {"s": s, "se_s": se_s, "se_t": se_t}, {"a_s": a_s, "a_t": a_t}

    def exponentiate(self, a_s, a_t, saved, win):
        return {"a_s": a_s, "a_t": a_t}  # exponentiated by the gradient's kernel

    def logit_grad(self, bufs, saved, win, w_kd, w_ce_shared, norm):
        # p from the saved lse whatever `norm`: no exponentials were kept to normalise
        coef_s = w_kd + (0.0 if w_ce_shared is None else w_ce_shared)  # a tensor of its own
        return forward_kl_grad_(bufs["a_s"], bufs["a_t"], saved["lse_s"], saved["lse_t"],
                                coef_s, w_kd)


#: Dense-teacher kinds with compiled elementwise work, by ``KDLossConfig.kind``.
DENSE_KINDS: dict[str, type[KindMath]] = {"forward_kl": CompiledForwardKL}
