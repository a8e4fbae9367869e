"""The elementwise work of one window of the GPU path: three steps, each one pass over the logits.

Every step reads a window's ``[rows, V_valid]`` logits in the input dtype (bf16 in training),
computes in fp32 (fp64 for fp64 inputs) and writes nothing of that size except the last step,
which overwrites the student's logits with the logit gradient in the input dtype. With
``a = z / T`` and ``p = exp(a - lse)``:

* :func:`row_stats`: this shard's per-row maxima and sums relative to them, in one pass (the
  sums are rescaled as the running maximum grows): ``[7, rows]`` rows ``m_s, se_s, m_t, se_t,
  acc, m_c, se_c`` with ``acc = sum e_t (a_t - a_s)`` relative to ``m_t`` (forward KL) or
  ``sum e_s (a_s - a_t)`` relative to ``m_s`` (reverse KL), and ``m_c, se_c`` the CE term's own
  shift and sum of ``exp(z - m_c)`` at T != 1;
* :func:`jsd_sums` (JSD only, after the global ``lse``): ``[2, rows]`` this shard's
  ``sum p_t (log p_t - log m)`` and ``sum p_s (log p_s - log m)``;
* :func:`logit_grad_`: ``z_s <- p_s * (A + B * X) - F * p_t + C * softmax(z)_c
  - C * onehot(label)`` with per-row coefficients, ``X`` the kind's term (``a_s - a_t`` for
  reverse KL, ``(1 - beta)(log p_s - log m)`` for JSD, 0 otherwise), ``F`` forward KL's
  teacher weight.

Three implementations of the same steps, chosen by
:attr:`~megatron_kd.loss.config.GpuTuning.kernels`: ``triton`` (one program per row looping
over the vocabulary), ``compiled`` (the PyTorch form through ``torch.compile``) and ``eager``
(the PyTorch form as is). Triton is imported on first use only: a machine without it runs the
other two. The kernels are built on first use too, so ``TRITON_INTERPRET=1`` set before then
runs them on CPU (the tests).
"""

from __future__ import annotations

import math

import torch

from megatron_kd.loss.compiled import _compiled

__all__ = ["KIND_FKL", "KIND_JSD", "KIND_NONE", "KIND_RKL", "STAT_ROWS", "jsd_sums", "scale_round",
           "logit_grad_", "row_stats", "triton_available"]

# The kind codes of the kernels (a constant of each compiled kernel).
KIND_NONE, KIND_FKL, KIND_RKL, KIND_JSD = 0, 1, 2, 3
#: Rows of :func:`row_stats`'s output: m_s, se_s, m_t, se_t, acc, m_c, se_c.
STAT_ROWS = 7


def triton_available() -> bool:
    """Whether Triton can be imported here (the CPU-only torch build has none)."""
    try:
        import triton  # noqa: F401  # optional: the CPU-only torch build has none
    except ImportError:
        return False
    return True


# ---------------------------------------------------------------------------------------------
# The PyTorch form ("eager", and "compiled" through torch.compile)
# ---------------------------------------------------------------------------------------------
def _exp_shifted(a: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """``exp(a - m)`` per row, 0 on a row whose maximum is ``-inf`` (every column masked)."""
    return torch.exp(a - torch.where(m == -math.inf, 0.0, m)[:, None])


def _stats_torch(z_s: torch.Tensor, z_t: torch.Tensor | None, inv_t: float, kind: int,
                 has_c: bool, cdt: torch.dtype) -> torch.Tensor:
    a_s = z_s.to(cdt) * inv_t
    m_s = a_s.amax(1)
    e_s = _exp_shifted(a_s, m_s)
    zero = torch.zeros_like(m_s)
    m_t, se_t, acc = torch.full_like(m_s, -math.inf), zero, zero
    if z_t is not None:
        a_t = z_t.to(cdt) * inv_t
        m_t = a_t.amax(1)
        e_t = _exp_shifted(a_t, m_t)
        se_t = e_t.sum(1)
        if kind == KIND_FKL:
            acc = (e_t * (a_t - a_s)).sum(1)
        elif kind == KIND_RKL:
            acc = (e_s * (a_s - a_t)).sum(1)
    m_c, se_c = torch.full_like(m_s, -math.inf), zero
    if has_c:
        z = z_s.to(cdt)
        m_c = z.amax(1)
        se_c = _exp_shifted(z, m_c).sum(1)
    return torch.stack([m_s, e_s.sum(1), m_t, se_t, acc, m_c, se_c])


def _log_m(lp_s: torch.Tensor, lp_t: torch.Tensor, log_beta: float,
           log_1mb: float) -> torch.Tensor:
    """``log(beta p_t + (1 - beta) p_s)`` from the log-probabilities, overflow-free."""
    return torch.logaddexp(lp_t + log_beta, lp_s + log_1mb)


def _jsd_torch(z_s: torch.Tensor, z_t: torch.Tensor, lse_s: torch.Tensor, lse_t: torch.Tensor,
               inv_t: float, beta: float, cdt: torch.dtype) -> torch.Tensor:
    lp_s = z_s.to(cdt) * inv_t - lse_s[:, None]
    lp_t = z_t.to(cdt) * inv_t - lse_t[:, None]
    log_m = _log_m(lp_s, lp_t, math.log(beta), math.log1p(-beta))
    return torch.stack([(lp_t.exp() * (lp_t - log_m)).sum(1),
                        (lp_s.exp() * (lp_s - log_m)).sum(1)])


def _grad_torch(z_s: torch.Tensor, z_t: torch.Tensor | None, lse_s: torch.Tensor,
                lse_t: torch.Tensor, lse_c: torch.Tensor, coef_a: torch.Tensor,
                coef_b: torch.Tensor, coef_f: torch.Tensor, w_ce: torch.Tensor,
                label: torch.Tensor, inv_t: float, beta: float, kind: int, has_c: bool,
                cdt: torch.dtype) -> torch.Tensor:
    z = z_s.to(cdt)
    a_s = z * inv_t
    p_s = torch.exp(a_s - lse_s[:, None])
    g = p_s * coef_a[:, None]
    if kind == KIND_FKL:
        a_t = z_t.to(cdt) * inv_t
        g = g - coef_f[:, None] * torch.exp(a_t - lse_t[:, None])
    elif kind == KIND_RKL:
        g = g + p_s * coef_b[:, None] * (a_s - z_t.to(cdt) * inv_t)
    elif kind == KIND_JSD:
        lp_s = a_s - lse_s[:, None]
        lp_t = z_t.to(cdt) * inv_t - lse_t[:, None]
        log_m = _log_m(lp_s, lp_t, math.log(beta), math.log1p(-beta))
        g = g + p_s * coef_b[:, None] * ((1.0 - beta) * (lp_s - log_m))
    if has_c:
        g = g + w_ce[:, None] * torch.exp(z - lse_c[:, None])
    cols = torch.arange(z.shape[1], device=z.device)
    g = g - torch.where(cols[None, :] == label[:, None], w_ce[:, None], 0.0)
    return z_s.copy_(g)


_stats_compiled = _compiled(_stats_torch)
_jsd_compiled = _compiled(_jsd_torch)
_grad_compiled = _compiled(_grad_torch)


# ---------------------------------------------------------------------------------------------
# The Triton form
# ---------------------------------------------------------------------------------------------
def _kernels():
    """The Triton kernels (the module that defines them imports Triton): the three steps and
    the accumulator's scale-and-round."""
    # deferred: the module imports Triton (optional), and Triton reads TRITON_INTERPRET then
    from megatron_kd.loss import triton_kernels as tk

    return tk.stats_kernel, tk.jsd_kernel, tk.grad_kernel, tk.scale_round_kernel


def _tl_dtype(cdt: torch.dtype):
    import triton.language as tl  # optional: only the Triton form reaches here
    return tl.float64 if cdt == torch.float64 else tl.float32


# ---------------------------------------------------------------------------------------------
# The steps, by implementation
# ---------------------------------------------------------------------------------------------
def row_stats(z_s: torch.Tensor, z_t: torch.Tensor | None, inv_t: float, kind: int,
              has_c: bool, cdt: torch.dtype, impl: str, block_v: int,
              num_warps: int = 8) -> torch.Tensor:
    """``[STAT_ROWS, rows]`` this shard's per-row maxima and sums (see the module docstring);
    maxima are ``-inf`` and sums 0 for a shard with no columns (or no teacher / CE term)."""
    rows, n_cols = z_s.shape
    if n_cols == 0 or rows == 0:
        out = torch.zeros(STAT_ROWS, rows, dtype=cdt, device=z_s.device)
        out[[0, 2, 5]] = -math.inf
        return out
    if impl == "triton":
        out = torch.zeros(STAT_ROWS, rows, dtype=cdt, device=z_s.device)
        out[[2, 5]] = -math.inf  # rows a kernel without a teacher / CE term leaves
        stats_kernel = _kernels()[0]
        stats_kernel[(rows,)](z_s, z_s if z_t is None else z_t, out, z_s.stride(0),
                              z_s.stride(0) if z_t is None else z_t.stride(0), rows, inv_t,
                              N_COLS=n_cols, KIND=kind, HAS_T=z_t is not None, HAS_C=has_c,
                              BLOCK=block_v, CDT=_tl_dtype(cdt),
                              GROUPS=min(num_warps, block_v), num_warps=num_warps)
        return out
    fn = _stats_compiled if impl == "compiled" else _stats_torch
    return fn(z_s, z_t, inv_t, kind, has_c, cdt)


def jsd_sums(z_s: torch.Tensor, z_t: torch.Tensor, lse_s: torch.Tensor, lse_t: torch.Tensor,
             inv_t: float, beta: float, cdt: torch.dtype, impl: str, block_v: int,
             num_warps: int = 8) -> torch.Tensor:
    """``[2, rows]`` this shard's ``sum p_t (log p_t - log m)`` and ``sum p_s (log p_s -
    log m)`` against the global ``lse``."""
    rows, n_cols = z_s.shape
    if n_cols == 0 or rows == 0:
        return torch.zeros(2, rows, dtype=cdt, device=z_s.device)
    if impl == "triton":
        out = torch.empty(2, rows, dtype=cdt, device=z_s.device)
        _kernels()[1][(rows,)](z_s, z_t, lse_s.contiguous(), lse_t.contiguous(), out,
                               z_s.stride(0), z_t.stride(0), rows, inv_t, beta, 1.0 - beta,
                               N_COLS=n_cols, BLOCK=block_v,
                               CDT=_tl_dtype(cdt), num_warps=num_warps)
        return out
    fn = _jsd_compiled if impl == "compiled" else _jsd_torch
    return fn(z_s, z_t, lse_s, lse_t, inv_t, beta, cdt)


def logit_grad_(z_s: torch.Tensor, z_t: torch.Tensor | None, lse_s: torch.Tensor,
                lse_t: torch.Tensor, lse_c: torch.Tensor, coef_a: torch.Tensor,
                coef_b: torch.Tensor, coef_f: torch.Tensor, w_ce: torch.Tensor,
                label: torch.Tensor, inv_t: float, beta: float, kind: int, has_c: bool,
                cdt: torch.dtype, impl: str, block_v: int, num_warps: int = 8) -> torch.Tensor:
    """Overwrite ``z_s`` with the logit gradient (see the module docstring); ``label`` is the
    per-row local column of the label (``-1``: none here). Returns ``z_s``."""
    rows, n_cols = z_s.shape
    if n_cols == 0 or rows == 0:
        return z_s
    if impl == "triton":
        _kernels()[2][(rows,)](z_s, z_s if z_t is None else z_t, z_s.stride(0),
                               z_s.stride(0) if z_t is None else z_t.stride(0),
                               lse_s.contiguous(), lse_t.contiguous(), lse_c.contiguous(),
                               coef_a.contiguous(), coef_b.contiguous(), coef_f.contiguous(),
                               w_ce.contiguous(), label.contiguous(), inv_t, beta, 1.0 - beta,
                               N_COLS=n_cols, KIND=kind, HAS_C=has_c, BLOCK=block_v,
                               CDT=_tl_dtype(cdt), num_warps=num_warps)
        return z_s
    fn = _grad_compiled if impl == "compiled" else _grad_torch
    return fn(z_s, z_t, lse_s, lse_t, lse_c, coef_a, coef_b, coef_f, w_ce, label, inv_t, beta,
              kind, has_c, cdt)


#: Elements per program of the Triton scale-and-round (16 a thread at 8 warps).
SCALE_BLOCK = 4096


def scale_round(acc: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
                impl: str) -> torch.Tensor:
    """``acc * scale`` (``scale`` a 0-d device tensor) in ``dtype``, ``acc`` left as it is: the
    weight gradient's one rounding. In the accumulator's precision, then rounded to nearest
    even, whichever the form: the Triton form is one vectorised pass (PyTorch's mixed-dtype
    multiply took 1.6 ms for 1.47 GiB on an H200, 2.6x a pass at the HBM rate)."""
    out = torch.empty_like(acc, dtype=dtype)
    if impl == "triton" and acc.numel():
        src = acc.contiguous()
        n = src.numel()
        _kernels()[3][(_cdiv(n, SCALE_BLOCK),)](src, out, scale.to(acc.dtype).reshape(1),
                                                      n, BLOCK=SCALE_BLOCK, num_warps=8)
        return out
    return torch.mul(acc, scale.to(acc.dtype), out=out)


def _cdiv(n: int, block: int) -> int:
    """Programs of ``block`` elements covering ``n``."""
    return -(-n // block)
