"""The GPU path's Triton kernels on CPU through Triton's interpreter: run as a script in a
process of its own, with ``TRITON_INTERPRET=1`` set before Triton defines the kernels.

Two kinds of check, each ``name -> error message or None`` in the JSON it prints:

* ``kernel:*``: each kernel alone against a naive fp64 formula of its output (not the
  PyTorch form of the kernels, which shares the step functions' structure);
* ``loss:*``: the whole loss with ``kernels="triton"`` against the fp64 reference, value and
  both gradients, at tiny sizes (windows of 4 rows, 256-column kernel blocks over 1009
  columns, so the loop's last block is partial).

Used by tests/unit/test_loss_triton.py.
"""

from __future__ import annotations

import json
import math
import os
import sys

import torch

CASES = {
    "fwd_kl_T2_ce_mask": dict(kind="forward_kl", temperature=2.0, ce_weight=0.5, mask=True),
    "fwd_kl_recompute_T1_ce": dict(kind="forward_kl", ce_weight=0.7, backward="recompute",
                                   vocab_size=1000),
    "rev_kl_T07_ce": dict(kind="reverse_kl", temperature=0.7, ce_weight=0.3, mask=True),
    "rev_kl_recompute": dict(kind="reverse_kl", backward="recompute"),
    "jsd_b03_T15_ce": dict(kind="jsd", beta=0.3, temperature=1.5, ce_weight=0.4, mask=True),
    "jsd_recompute_ce": dict(kind="jsd", backward="recompute", ce_weight=0.2),
    "topk_renorm_T2_ce": dict(teacher="renormalize", topk_tail="renormalize", temperature=2.0,
                              ce_weight=0.5, mask=True),
    "topk_ghost_ce": dict(teacher="ghost", topk_tail="ghost", ce_weight=0.2, vocab_size=1001),
    "ce_only_T2": dict(teacher=None, kd_weight=0.0, ce_weight=1.0, temperature=2.0),
}
DTYPES = {"fp32": torch.float32, "fp64": torch.float64, "bf16": torch.bfloat16}
TRITON = dict(kernels="triton", block_v=256, window_bytes=4 * 1009 * 8 * 2)


def _kernel_checks() -> dict[str, str | None]:
    """Each kernel against an fp64 formula on a 5 x 300 block (last column block partial)."""
    from megatron_kd.loss import gpu_kernels as gk

    out: dict[str, str | None] = {}
    g = torch.Generator().manual_seed(3)
    z_s = torch.randn(5, 300, generator=g) * 4
    z_t = torch.randn(5, 300, generator=g) * 4
    t, beta = 1.7, 0.3
    a_s, a_t = z_s.double() / t, z_t.double() / t
    lse_s, lse_t = torch.logsumexp(a_s, 1), torch.logsumexp(a_t, 1)
    lse_c = torch.logsumexp(z_s.double(), 1)
    p_s, p_t = (a_s - lse_s[:, None]).exp(), (a_t - lse_t[:, None]).exp()

    def check(name, got, want, tol=1e-5):
        err = float((got.double() - want).abs().max() / want.abs().max().clamp(min=1e-30))
        out[name] = None if err <= tol else f"relative error {err:.2e} > {tol:.0e}"

    for kind, code in (("fkl", gk.KIND_FKL), ("rkl", gk.KIND_RKL)):
        st = gk.row_stats(z_s, z_t, 1 / t, code, True, torch.float32, "triton", 64).double()
        # sums relative to each row's own maximum: compare log(sum) + max with the lse
        check(f"kernel:row_stats:{kind}:lse_s", st[0] + st[1].log(), lse_s)
        check(f"kernel:row_stats:{kind}:lse_t", st[2] + st[3].log(), lse_t)
        check(f"kernel:row_stats:{kind}:lse_c", st[5] + st[6].log(), lse_c)
        if code == gk.KIND_FKL:  # sum_v p_t (a_t - a_s)
            want = (p_t * (a_t - a_s)).sum(1)
            check("kernel:row_stats:fkl:acc", st[4] / st[3], want)
        else:  # sum_v p_s (a_s - a_t)
            check("kernel:row_stats:rkl:acc", st[4] / st[1], (p_s * (a_s - a_t)).sum(1))
    log_m = torch.log(beta * p_t + (1 - beta) * p_s)
    js = gk.jsd_sums(z_s, z_t, lse_s.float(), lse_t.float(), 1 / t, beta, torch.float32,
                     "triton", 64)
    check("kernel:jsd_sums", js.double(), torch.stack([(p_t * (p_t.log() - log_m)).sum(1),
                                                       (p_s * (p_s.log() - log_m)).sum(1)]))
    coef_a, coef_b, coef_f, w_ce = (torch.rand(5, generator=g) for _ in range(4))
    label = torch.tensor([0, 299, -1, 17, 150])
    onehot = torch.zeros(5, 300, dtype=torch.float64)
    onehot[[0, 1, 3, 4], [0, 299, 17, 150]] = 1.0
    p_c = (z_s.double() - lse_c[:, None]).exp()
    c_a, c_b, c_f, c_w = (v.double()[:, None] for v in (coef_a, coef_b, coef_f, w_ce))
    wants = {
        gk.KIND_NONE: c_a * p_s,
        gk.KIND_FKL: c_a * p_s - c_f * p_t,
        gk.KIND_RKL: p_s * (c_a + c_b * (a_s - a_t)),
        gk.KIND_JSD: p_s * (c_a + c_b * (1 - beta) * (p_s.log() - log_m)),
    }
    for code, want in wants.items():
        for has_c in (False, True):
            got = gk.logit_grad_(z_s.clone(), z_t, lse_s.float(), lse_t.float(), lse_c.float(),
                                 coef_a, coef_b, coef_f, w_ce, label, 1 / t, beta, code, has_c,
                                 torch.float32, "triton", 64)
            full = want + (c_w * p_c if has_c else 0.0) - c_w * onehot
            check(f"kernel:logit_grad:{code}:ce_own_shift={has_c}", got, full)
    _extreme_checks(gk, check)
    # the accumulator's scale-and-round, over more elements than one program (its masked
    # tail included): the fp32 product, then bf16. The interpreter's cast truncates where a
    # GPU's rounds to nearest (tests/unit/test_loss_triton_compile.py checks its cvt.rn), so
    # each value is the product rounded one way or the other
    acc = torch.randn(3, 2_000, generator=g) * 1e-3
    scale = torch.tensor(1 / 3)
    got = gk.scale_round(acc, scale, torch.bfloat16, "triton")
    exact = acc * scale
    nearest = exact.to(torch.bfloat16)
    truncated = (exact.view(torch.int32) & ~0xFFFF).view(torch.float32).to(torch.bfloat16)
    bad = int(((got != nearest) & (got != truncated)).sum())
    out["kernel:scale_round"] = (None if got.dtype == torch.bfloat16 and bad == 0 else
                                 f"{bad} of {got.numel()} are neither rounding of the product")
    return out


def _extreme_checks(gk, check) -> None:
    """Rows a random block never makes: leading blocks of ``-inf`` (the ghost tail's masked
    ids) for ``row_stats``, and logits 1,000 apart for JSD, where probabilities underflow
    to 0 in fp32 and the mixture's logarithm is ``-inf`` unless guarded."""
    g = torch.Generator().manual_seed(5)
    z = torch.randn(4, 300, generator=g) * 4
    z[0, :150] = -math.inf  # the first two 64-column blocks and part of the third
    z[1, 1:] = -math.inf  # one finite column
    st = gk.row_stats(z, None, 0.5, gk.KIND_NONE, True, torch.float32, "triton", 64).double()
    zd = z.double()
    check("kernel:row_stats:-inf_blocks:lse_s", st[0] + st[1].log(), torch.logsumexp(zd * 0.5, 1))
    check("kernel:row_stats:-inf_blocks:lse_c", st[5] + st[6].log(), torch.logsumexp(zd, 1))
    beta, t = 0.3, 1.0
    z_s = torch.randn(4, 300, generator=g) * 300  # most of a row is exp(-1000) and below
    z_t = torch.randn(4, 300, generator=g) * 300
    # the kernels take the lse in fp32 (an ulp of 6e-5 at 1,000): the formula uses the same
    lse_s, lse_t = (torch.logsumexp(v.double(), 1).float() for v in (z_s, z_t))
    lp_s = z_s.double() - lse_s.double()[:, None]
    lp_t = z_t.double() - lse_t.double()[:, None]
    log_m = torch.logaddexp(lp_t + math.log(beta), lp_s + math.log1p(-beta))  # finite
    p_s, p_t = lp_s.exp(), lp_t.exp()
    js = gk.jsd_sums(z_s, z_t, lse_s, lse_t, 1 / t, beta, torch.float32, "triton",
                     64)
    check("kernel:jsd_sums:extreme", js.double(), torch.stack([(p_t * (lp_t - log_m)).sum(1),
                                                               (p_s * (lp_s - log_m)).sum(1)]))
    ones, zeros = torch.ones(4), torch.zeros(4)
    none = torch.full((4,), -1)
    got = gk.logit_grad_(z_s.clone(), z_t, lse_s, lse_t, lse_s, zeros,
                         ones, zeros, zeros, none, 1 / t, beta, gk.KIND_JSD, False,
                         torch.float32, "triton", 64)
    want = p_s * (1 - beta) * (lp_s - log_m)
    check("kernel:logit_grad:jsd:extreme", got, want)


def _loss_checks() -> dict[str, str | None]:
    from support.kd_cases import TOLERANCE, compare, make_inputs, run_ours, spec

    out: dict[str, str | None] = {}
    for dname, dtype in DTYPES.items():
        for name, case in CASES.items():
            if dname == "bf16" and "kind" not in case:
                continue  # bf16: the dense kinds (the sparse ones share their kernels)
            if dname == "bf16":  # test_loss.py's bf16 case, within its tolerance
                case = dict(kind=case["kind"], ce_weight=0.4)
            sp = spec(path="gpu", gpu_tuning=TRITON, dtype=dtype, **case)
            inp = make_inputs(sp)
            try:
                compare(sp, inp, [run_ours(sp, inp, [sp["padded_vocab"]], 0, None)], 1,
                        TOLERANCE[dtype])
                out[f"loss:{dname}:{name}"] = None
            except Exception as e:  # noqa: BLE001 - every failure is reported by name
                out[f"loss:{dname}:{name}"] = f"{type(e).__name__}: {e}"[:2000]
    return out


def main() -> int:
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("run with TRITON_INTERPRET=1")
    results = {}
    try:
        results.update(_kernel_checks())
    except Exception as e:  # noqa: BLE001
        results["kernel:*"] = f"{type(e).__name__}: {e}"[:2000]
    results.update(_loss_checks())
    json.dump(results, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
