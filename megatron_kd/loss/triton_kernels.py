"""The Triton form of the GPU path's three steps (:mod:`megatron_kd.loss.gpu_kernels` documents
the maths and the calling side). One program per row of a window, looping over the vocabulary
in ``BLOCK`` columns with per-lane running maxima, so a row's logits are read once per step and
nothing of a window's size is written but the gradient. The vocabulary size is a compile-time
constant (one compilation per shard size; a run has one or two).

Imported only when the Triton form is used: importing it imports Triton, and Triton reads
``TRITON_INTERPRET`` when the kernels are defined, so the tests set it before their first use.
"""

import triton
import triton.language as tl

__all__ = ["grad_kernel", "jsd_kernel", "stats_kernel"]


@triton.jit
def _online(m, a, mask):
    """One step of a running per-lane maximum: ``(new max, rescale of old sums,
    exp(a - new max) masked)``."""
    new_m = tl.maximum(m, tl.where(mask, a, float("-inf")))
    alpha = tl.where(new_m == float("-inf"), 1.0, tl.exp(m - new_m))
    e = tl.where(mask & (new_m != float("-inf")), tl.exp(a - new_m), 0.0)  # an all -inf lane
    return new_m, alpha, e

@triton.jit
def _lane_total(m, s):
    """A row's maximum and its lanes' sums moved onto it."""
    top = tl.max(m, 0)
    w = tl.where(m == float("-inf"), 0.0, tl.exp(m - top))
    return top, tl.sum(s * w, 0)

@triton.jit
def stats_kernel(zs, zt, out, stride_s, stride_t, n_rows, inv_t,
                 N_COLS: tl.constexpr, KIND: tl.constexpr, HAS_T: tl.constexpr,
                 HAS_C: tl.constexpr, BLOCK: tl.constexpr, CDT: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    m_s = tl.full([BLOCK], float("-inf"), CDT)
    l_s = tl.zeros([BLOCK], CDT)
    m_t = tl.full([BLOCK], float("-inf"), CDT)
    l_t = tl.zeros([BLOCK], CDT)
    acc = tl.zeros([BLOCK], CDT)
    m_c = tl.full([BLOCK], float("-inf"), CDT)
    l_c = tl.zeros([BLOCK], CDT)
    for start in range(0, N_COLS, BLOCK):
        cols = start + offs
        mask = cols < N_COLS
        z = tl.load(zs + row * stride_s + cols, mask=mask, other=0.0).to(CDT)
        a_s = z * inv_t
        m_s, alpha_s, e_s = _online(m_s, a_s, mask)
        l_s = l_s * alpha_s + e_s
        if HAS_T:
            a_t = tl.load(zt + row * stride_t + cols, mask=mask, other=0.0).to(CDT) * inv_t
            m_t, alpha_t, e_t = _online(m_t, a_t, mask)
            l_t = l_t * alpha_t + e_t
            if KIND == 1:  # forward KL: sum e_t (a_t - a_s), relative to m_t
                acc = acc * alpha_t + e_t * (a_t - a_s)
            if KIND == 2:  # reverse KL: sum e_s (a_s - a_t), relative to m_s
                acc = acc * alpha_s + e_s * (a_s - a_t)
        if HAS_C:  # the CE term's own softmax at T = 1
            m_c, alpha_c, e_c = _online(m_c, z, mask)
            l_c = l_c * alpha_c + e_c
    top_s, se_s = _lane_total(m_s, l_s)
    tl.store(out + row, top_s)
    tl.store(out + n_rows + row, se_s)
    if HAS_T:
        top_t, se_t = _lane_total(m_t, l_t)
        tl.store(out + 2 * n_rows + row, top_t)
        tl.store(out + 3 * n_rows + row, se_t)
        if KIND == 1:
            _, acc_t = _lane_total(m_t, acc)
            tl.store(out + 4 * n_rows + row, acc_t)
        if KIND == 2:
            _, acc_s = _lane_total(m_s, acc)
            tl.store(out + 4 * n_rows + row, acc_s)
    if HAS_C:
        top_c, se_c = _lane_total(m_c, l_c)
        tl.store(out + 5 * n_rows + row, top_c)
        tl.store(out + 6 * n_rows + row, se_c)

@triton.jit
def _log_m_tl(lp_s, lp_t, log_beta, log_1mb):
    x = lp_t + log_beta
    y = lp_s + log_1mb
    top = tl.maximum(x, y)
    return top + tl.log(tl.exp(x - top) + tl.exp(y - top))

@triton.jit
def jsd_kernel(zs, zt, lse_s_p, lse_t_p, out, stride_s, stride_t, n_rows, inv_t,
               log_beta, log_1mb, N_COLS: tl.constexpr, BLOCK: tl.constexpr,
               CDT: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    lse_s = tl.load(lse_s_p + row).to(CDT)
    lse_t = tl.load(lse_t_p + row).to(CDT)
    t_acc = tl.zeros([BLOCK], CDT)
    s_acc = tl.zeros([BLOCK], CDT)
    for start in range(0, N_COLS, BLOCK):
        cols = start + offs
        mask = cols < N_COLS
        lp_s = tl.load(zs + row * stride_s + cols, mask=mask, other=0.0).to(CDT) * inv_t \
            - lse_s
        lp_t = tl.load(zt + row * stride_t + cols, mask=mask, other=0.0).to(CDT) * inv_t \
            - lse_t
        log_m = _log_m_tl(lp_s, lp_t, log_beta, log_1mb)
        t_acc += tl.where(mask, tl.exp(lp_t) * (lp_t - log_m), 0.0)
        s_acc += tl.where(mask, tl.exp(lp_s) * (lp_s - log_m), 0.0)
    tl.store(out + row, tl.sum(t_acc, 0))
    tl.store(out + n_rows + row, tl.sum(s_acc, 0))

@triton.jit
def grad_kernel(zs, zt, stride_s, stride_t, lse_s_p, lse_t_p, lse_c_p, coef_a_p,
                coef_b_p, coef_f_p, w_ce_p, label_p, inv_t, one_m_beta, log_beta, log_1mb,
                N_COLS: tl.constexpr, KIND: tl.constexpr, HAS_C: tl.constexpr,
                BLOCK: tl.constexpr, CDT: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    lse_s = tl.load(lse_s_p + row).to(CDT)
    coef_a = tl.load(coef_a_p + row).to(CDT)
    w_ce = tl.load(w_ce_p + row).to(CDT)
    label = tl.load(label_p + row)
    lse_t = tl.load(lse_t_p + row).to(CDT)  # every pointer is valid: unused ones are 0s
    coef_b = tl.load(coef_b_p + row).to(CDT)
    coef_f = tl.load(coef_f_p + row).to(CDT)
    lse_c = tl.load(lse_c_p + row).to(CDT)
    for start in range(0, N_COLS, BLOCK):
        cols = start + offs
        mask = cols < N_COLS
        z = tl.load(zs + row * stride_s + cols, mask=mask, other=0.0).to(CDT)
        a_s = z * inv_t
        p_s = tl.exp(a_s - lse_s)
        g = p_s * coef_a
        if KIND == 1:
            a_t = tl.load(zt + row * stride_t + cols, mask=mask, other=0.0).to(CDT) * inv_t
            g -= coef_f * tl.exp(a_t - lse_t)
        if KIND == 2:
            a_t = tl.load(zt + row * stride_t + cols, mask=mask, other=0.0).to(CDT) * inv_t
            g += p_s * coef_b * (a_s - a_t)
        if KIND == 3:
            a_t = tl.load(zt + row * stride_t + cols, mask=mask, other=0.0).to(CDT) * inv_t
            lp_s = a_s - lse_s
            lp_t = a_t - lse_t
            g += p_s * coef_b * (one_m_beta * (lp_s - _log_m_tl(lp_s, lp_t, log_beta,
                                                                 log_1mb)))
        if HAS_C:
            g += w_ce * tl.exp(z - lse_c)
        g = tl.where(cols == label, g - w_ce, g)
        tl.store(zs + row * stride_s + cols, g.to(zs.dtype.element_ty), mask=mask)

