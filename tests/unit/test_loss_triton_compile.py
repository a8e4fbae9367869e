"""Fused KD loss, tier 1: the GPU path's Triton kernels compiled for a Hopper GPU (sm_90) on the
CPU, and what their machine code does per element.

Triton's interpreter (tests/unit/test_loss_triton.py) checks the kernels' values but not that
they compile for a GPU, nor what they cost there. Triton compiles to PTX and cubin without a
GPU, so this checks, at the GPU path's defaults (bf16 logits, V = 128,256, ``GpuTuning()``'s
block and warps, the pointers and row strides 16-byte aligned as Triton specialises them):

* every kernel and kind compiles;
* the logits are read in 16-byte vectors;
* ``row_stats``' loop pays one exponential per element and model, plus one per model for the
  column groups' rescale, and holds no barrier (a group's maximum stays in its warp);
* JSD's sums pay two exponentials per element pair, and no more (its mixture's logarithm is
  formed from the probabilities).

The design and its cost account: docs/loss.md (the GPU path).
"""

import os
import re

import pytest

triton = pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") == "1":  # the kernels are then Python, not compiled
    pytest.skip("TRITON_INTERPRET=1: Triton interprets its kernels instead of compiling them",
                allow_module_level=True)

from megatron_kd.loss import gpu_kernels as gk  # noqa: E402
from megatron_kd.loss.config import GpuTuning  # noqa: E402

TUNING = GpuTuning()
V = 128_256
#: elements of a block each thread holds: the block over the program's threads
PER_THREAD = TUNING.block_v // (32 * TUNING.num_warps)
_F32 = {"inv_t": "fp32", "beta": "fp32", "one_m_beta": "fp32"}


def _compile(kernel, signature: dict, constants: dict, defaults: bool = True) -> str:
    """The kernel's PTX for sm_90, its pointers and strides divisible by 16; ``defaults``: with
    the loss kernels' vocabulary, block and fp32 arithmetic."""
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    base = {"N_COLS": V, "BLOCK": TUNING.block_v, "CDT": tl.float32} if defaults else {}
    consts = {**base, **constants}
    sig = {**signature, **{name: "constexpr" for name in consts}}
    aligned = [i for i, (name, kind) in enumerate(signature.items())
               if kind.startswith("*") or name.startswith("stride") or name == "n"]
    src = ASTSource(fn=kernel, signature=sig, constexprs=consts,
                    attrs={(i,): [["tt.divisibility", 16]] for i in aligned})
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": TUNING.num_warps})
    return compiled.asm["ptx"]


def _loop(ptx: str) -> list[str]:
    """The instructions of the kernel's one loop: from its header to the branch back to it."""
    lines = [line.strip() for line in ptx.splitlines()]
    head = next(i for i, line in enumerate(lines) if "Inner Loop Header" in line)
    label = lines[head].split(":")[0]
    back = max(i for i, line in enumerate(lines) if re.search(rf"\bbra\S*\s+\{label};", line))
    assert back > head, "the loop's branch back was not found after its header"
    return lines[head:back + 1]


def _count(lines, pattern: str) -> int:
    return sum(1 for line in lines if re.search(pattern, line))


def _stats_ptx(kind: int, has_t: bool, has_c: bool) -> str:
    from megatron_kd.loss import triton_kernels as tk

    sig = {"zs": "*bf16", "zt": "*bf16", "out": "*fp32", "stride_s": "i32", "stride_t": "i32",
           "n_rows": "i32", "inv_t": "fp32"}
    return _compile(tk.stats_kernel, sig, {"KIND": kind, "HAS_T": has_t, "HAS_C": has_c,
                                           "GROUPS": TUNING.num_warps})


@pytest.mark.parametrize("kind, has_t, has_c", [
    (gk.KIND_FKL, True, False), (gk.KIND_RKL, True, True), (gk.KIND_JSD, True, False),
    (gk.KIND_NONE, False, True)])
def test_row_stats_one_exponential_per_element_and_no_barrier(kind, has_t, has_c):
    loop = _loop(_stats_ptx(kind, has_t, has_c))
    models = 1 + has_t + has_c  # softmaxes summed: student, teacher, the CE term's own
    assert _count(loop, r"ex2\.approx") == models * (PER_THREAD + 1), loop
    assert _count(loop, r"bar\.sync") == 0
    assert _count(loop, r"ld\.global\.v4\.b32") == 1 + has_t  # 8 bf16 a thread, each model


def test_jsd_sums_two_exponentials_per_element_pair():
    from megatron_kd.loss import triton_kernels as tk

    sig = {"zs": "*bf16", "zt": "*bf16", "lse_s_p": "*fp32", "lse_t_p": "*fp32", "out": "*fp32",
           "stride_s": "i32", "stride_t": "i32", "n_rows": "i32", **_F32}
    ptx = _compile(tk.jsd_kernel, sig, {})
    assert _count(ptx.splitlines(), r"ex2\.approx") == 2 * PER_THREAD
    assert _count(ptx.splitlines(), r"ld\.global\.v4\.b32") == 2


@pytest.mark.parametrize("kind", [gk.KIND_NONE, gk.KIND_FKL, gk.KIND_RKL, gk.KIND_JSD])
def test_logit_grad_compiles_and_reads_vectors(kind):
    from megatron_kd.loss import triton_kernels as tk

    sig = {"zs": "*bf16", "zt": "*bf16", "stride_s": "i32", "stride_t": "i32",
           **{name: "*fp32" for name in ("lse_s_p", "lse_t_p", "lse_c_p", "coef_a_p",
                                          "coef_b_p", "coef_f_p", "w_ce_p")},
           "label_p": "*i64", **_F32}
    ptx = _compile(tk.grad_kernel, sig, {"KIND": kind, "HAS_C": True})
    lines = ptx.splitlines()
    assert _count(lines, r"ld\.global\.v4\.b32") == 1 + (kind != gk.KIND_NONE)
    assert _count(lines, r"st\.global\.v4\.b32") == 1  # the gradient over z_s, 8 bf16 a thread
    # p_s, the CE term's softmax, and the teacher's for the kinds that read it (reverse KL
    # reads its logits, not its probabilities)
    exps = 2 + (kind in (gk.KIND_FKL, gk.KIND_JSD))
    assert _count(lines, r"ex2\.approx") == exps * PER_THREAD


def test_scale_round_is_one_vectorised_pass():
    from megatron_kd.loss import triton_kernels as tk

    consts = {"BLOCK": gk.SCALE_BLOCK}
    sig = {"src": "*fp32", "dst": "*bf16", "scale_p": "*fp32", "n": "i64"}
    ptx = _compile(tk.scale_round_kernel, sig, consts, defaults=False)
    lines = ptx.splitlines()
    per_thread = gk.SCALE_BLOCK // (32 * 8)
    assert _count(lines, r"ld\.global\.v4\.b32") == per_thread // 4  # fp32, 16 bytes a load
    assert _count(lines, r"st\.global\.v4\.b32") == per_thread // 8  # bf16, 16 bytes a store
    # rounded to nearest even (the interpreter's cast truncates: only the GPU's code shows it)
    assert _count(lines, r"cvt\.rn\.bf16x2\.f32") == per_thread // 2
    assert _count(lines, r"cvt\.r[zmp]\.") == 0
