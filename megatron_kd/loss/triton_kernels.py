"""The Triton form of the GPU path's three steps (:mod:`megatron_kd.loss.gpu_kernels` documents
the maths and the calling side). One program per row of a window, looping over the vocabulary
in ``BLOCK`` columns, so a row's logits are read once per step and nothing of a window's size is
written but the gradient. ``row_stats`` keeps a running maximum per column group (a warp's
columns of each block), taken over the whole group, so an element costs one exponential per
model (the sums' rescale is one per group and block, not per element) and the maximum never
leaves its warp (no barrier in the loop); JSD forms its mixture from the two probabilities (one
logarithm, no further exponential). The
vocabulary size is a compile-time constant (one compilation per shard size; a run has one or
two).

Imported only when the Triton form is used: importing it imports Triton, and Triton reads
``TRITON_INTERPRET`` when the kernels are defined, so the tests set it before their first use.
"""

import triton
import triton.language as tl

__all__ = ["grad_kernel", "jsd_kernel", "scale_round_kernel", "stats_kernel"]


@triton.jit
def _block_step(m, a):
    """One block of a row's running maxima, one per column group (a warp's): ``(new maxima,
    rescale of the groups' sums, exp(a - new maximum))`` for ``a`` of ``[GROUPS, C]`` whose
    masked lanes are ``-inf``. One exponential per element, one per group for the rescale; the
    maximum over a group's columns stays inside its warp (no barrier in the loop). A group
    that is all ``-inf`` so far gets zeros."""
    new_m = tl.maximum(m, tl.max(a, 1))
    ref = tl.where(new_m == float("-inf"), 0.0, new_m)
    return new_m, tl.exp(m - ref), tl.exp(a - ref[:, None])

@triton.jit
def _row_total(m, s):
    """A row's maximum and its groups' ``[GROUPS, C]`` sums moved onto it."""
    top = tl.max(m, 0)
    w = tl.where(m == float("-inf"), 0.0, tl.exp(m - tl.where(top == float("-inf"), 0.0, top)))
    return top, tl.sum(tl.sum(s, 1) * w, 0)

@triton.jit
def stats_kernel(zs, zt, out, stride_s, stride_t, n_rows, inv_t,
                 N_COLS: tl.constexpr, KIND: tl.constexpr, HAS_T: tl.constexpr,
                 HAS_C: tl.constexpr, BLOCK: tl.constexpr, CDT: tl.constexpr,
                 GROUPS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    # a block as GROUPS rows of C contiguous columns: one group per warp
    C: tl.constexpr = BLOCK // GROUPS
    offs = tl.arange(0, GROUPS)[:, None] * C + tl.arange(0, C)[None, :]
    m_s = tl.full([GROUPS], float("-inf"), CDT)
    m_t = tl.full([GROUPS], float("-inf"), CDT)
    m_c = tl.full([GROUPS], float("-inf"), CDT)
    l_s = tl.zeros([GROUPS, C], CDT)
    l_t = tl.zeros([GROUPS, C], CDT)
    l_c = tl.zeros([GROUPS, C], CDT)
    acc = tl.zeros([GROUPS, C], CDT)
    for start in range(0, N_COLS, BLOCK):
        cols = start + offs
        mask = cols < N_COLS
        z = tl.load(zs + row * stride_s + cols, mask=mask, other=0.0).to(CDT)
        a_s = z * inv_t
        m_s, alpha_s, e_s = _block_step(m_s, tl.where(mask, a_s, float("-inf")))
        l_s = l_s * alpha_s[:, None] + e_s
        if HAS_T:
            a_t = tl.load(zt + row * stride_t + cols, mask=mask, other=0.0).to(CDT) * inv_t
            m_t, alpha_t, e_t = _block_step(m_t, tl.where(mask, a_t, float("-inf")))
            l_t = l_t * alpha_t[:, None] + e_t
            if KIND == 1:  # forward KL: sum e_t (a_t - a_s), relative to m_t
                acc = acc * alpha_t[:, None] + e_t * (a_t - a_s)
            if KIND == 2:  # reverse KL: sum e_s (a_s - a_t), relative to m_s
                acc = acc * alpha_s[:, None] + e_s * (a_s - a_t)
        if HAS_C:  # the CE term's own softmax at T = 1
            m_c, alpha_c, e_c = _block_step(m_c, tl.where(mask, z, float("-inf")))
            l_c = l_c * alpha_c[:, None] + e_c
    top_s, se_s = _row_total(m_s, l_s)
    tl.store(out + row, top_s)
    tl.store(out + n_rows + row, se_s)
    if HAS_T:
        top_t, se_t = _row_total(m_t, l_t)
        tl.store(out + 2 * n_rows + row, top_t)
        tl.store(out + 3 * n_rows + row, se_t)
        if KIND == 1:
            _, acc_t = _row_total(m_t, acc)
            tl.store(out + 4 * n_rows + row, acc_t)
        if KIND == 2:
            _, acc_s = _row_total(m_s, acc)
            tl.store(out + 4 * n_rows + row, acc_s)
    if HAS_C:
        top_c, se_c = _row_total(m_c, l_c)
        tl.store(out + 5 * n_rows + row, top_c)
        tl.store(out + 6 * n_rows + row, se_c)

@triton.jit
def _jsd_terms(p_s, lp_s, p_t, lp_t, beta, one_m_beta):
    """``(p_t (log p_t - log m), p_s (log p_s - log m))`` with ``m`` the mixture formed from
    the probabilities themselves (one logarithm, no exponential); 0 where a probability
    underflows (its term is below fp32's range, and ``log m`` may be ``-inf`` there)."""
    log_m = tl.log(beta * p_t + one_m_beta * p_s)
    t_term = tl.where(p_t > 0, p_t * (lp_t - log_m), 0.0)
    s_term = tl.where(p_s > 0, p_s * (lp_s - log_m), 0.0)
    return t_term, s_term

@triton.jit
def jsd_kernel(zs, zt, lse_s_p, lse_t_p, out, stride_s, stride_t, n_rows, inv_t,
               beta, one_m_beta, N_COLS: tl.constexpr, BLOCK: tl.constexpr,
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
        t_term, s_term = _jsd_terms(tl.exp(lp_s), lp_s, tl.exp(lp_t), lp_t, beta, one_m_beta)
        t_acc += tl.where(mask, t_term, 0.0)
        s_acc += tl.where(mask, s_term, 0.0)
    tl.store(out + row, tl.sum(t_acc, 0))
    tl.store(out + n_rows + row, tl.sum(s_acc, 0))

@triton.jit
def grad_kernel(zs, zt, stride_s, stride_t, lse_s_p, lse_t_p, lse_c_p, coef_a_p,
                coef_b_p, coef_f_p, w_ce_p, label_p, inv_t, beta, one_m_beta,
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
        lp_s = a_s - lse_s
        p_s = tl.exp(lp_s)
        g = p_s * coef_a
        if KIND == 1:
            a_t = tl.load(zt + row * stride_t + cols, mask=mask, other=0.0).to(CDT) * inv_t
            g -= coef_f * tl.exp(a_t - lse_t)
        if KIND == 2:
            a_t = tl.load(zt + row * stride_t + cols, mask=mask, other=0.0).to(CDT) * inv_t
            g += p_s * coef_b * (a_s - a_t)
        if KIND == 3:
            lp_t = tl.load(zt + row * stride_t + cols, mask=mask, other=0.0).to(CDT) * inv_t \
                - lse_t
            _, s_term = _jsd_terms(p_s, lp_s, tl.exp(lp_t), lp_t, beta, one_m_beta)
            g += coef_b * (one_m_beta * s_term)
        if HAS_C:
            g += w_ce * tl.exp(z - lse_c)
        g = tl.where(cols == label, g - w_ce, g)
        tl.store(zs + row * stride_s + cols, g.to(zs.dtype.element_ty), mask=mask)

@triton.jit
def scale_round_kernel(src, dst, scale_p, n, BLOCK: tl.constexpr):
    """``dst = src * scale`` in ``dst``'s dtype: the fp32 weight-gradient accumulator scaled by
    backward's incoming gradient (a device scalar) and rounded once, one read and one write."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    scale = tl.load(scale_p)
    x = tl.load(src + offs, mask=mask, other=0.0)
    tl.store(dst + offs, (x * scale).to(dst.dtype.element_ty), mask=mask)
