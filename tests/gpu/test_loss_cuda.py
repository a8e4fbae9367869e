"""The fused KD loss on a GPU (skipped without one): its GPU path, the one CUDA inputs take,
against the fp64 reference on the host (value and both gradients), with each form of its
kernels and each weight-gradient accumulator; and, at a larger vocabulary, the GPU path against
the CPU path on the same device."""

import pytest
import torch
from support.kd_cases import compare, make_inputs, rel_err, run_ours, spec

from megatron_kd.loss import gpu_kernels

CASES = {
    "fwd_kl_T2_ce_mask": dict(kind="forward_kl", temperature=2.0, ce_weight=0.5, mask=True),
    "rev_kl_T07_ce": dict(kind="reverse_kl", temperature=0.7, ce_weight=0.3),
    "jsd_b03_ce": dict(kind="jsd", beta=0.3, ce_weight=0.4, mask=True),
    "topk_renorm_T2": dict(teacher="renormalize", topk_tail="renormalize", temperature=2.0,
                           ce_weight=0.5),
    "topk_ghost": dict(teacher="ghost", topk_tail="ghost", ce_weight=0.2, vocab_size=1001),
    "ce_only": dict(teacher=None, kd_weight=0.0, ce_weight=1.0),
}
KERNELS = ["triton", "compiled"] if gpu_kernels.triton_available() else ["compiled"]


def _cuda(sp, tol=None):
    inp = make_inputs(sp)
    compare(sp, inp, [run_ours(sp, inp, [sp["padded_vocab"]], 0, None, device="cuda")], 1,
            tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backward", ["precompute", "recompute"])
@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("name", list(CASES))
def test_gpu_path_against_reference(name, kernels, backward, dtype):
    case = dict(CASES[name])
    if dtype == torch.bfloat16:  # test_loss.py's bf16 case shape: T = 1, no mask
        case.update(temperature=1.0, mask=False)
    _cuda(spec(dtype=dtype, backward=backward, window_size=None,
               gpu_tuning=dict(kernels=kernels, window_bytes=4 * 1009 * 4 * 2), **case))


@pytest.mark.parametrize("weight_grad", ["fp32_gemm", "fp32_add", "input_dtype"])
def test_weight_grad_accumulators(weight_grad):
    _cuda(spec(kind="jsd", dtype=torch.bfloat16, ce_weight=0.4, window_size=None,
               gpu_tuning=dict(weight_grad=weight_grad, window_bytes=4 * 1009 * 2 * 2,
                               kernels=KERNELS[0])))


@pytest.mark.parametrize("kind", ["forward_kl", "jsd"])
def test_gpu_path_matches_cpu_path_at_32k(kind):
    # a vocabulary of 32,000 (several 2048-column kernel blocks per row) in fp32: both paths on
    # the device; TF32 is off by default, so only the order of sums differs
    sp = spec(kind=kind, dtype=torch.float32, ce_weight=0.3, temperature=1.5, s=64, b=2,
              h_s=256, h_t=384, padded_vocab=32000, window_size=None, mask=True)
    inp = make_inputs(sp)
    gpu = run_ours(sp, inp, [32000], 0, None, device="cuda")
    cpu = run_ours(dict(sp, path="cpu"), inp, [32000], 0, None, device="cuda")
    for key in ("loss", "grad_x", "grad_w"):
        assert rel_err(gpu[key], cpu[key]) < 1e-5, key


@pytest.mark.parametrize("weight_grad", ["fp32_gemm", "input_dtype"])
def test_gpu_path_peak_memory_is_the_accounts(weight_grad):
    """The extra peak of forward + backward is docs/loss.md's account, within 10% (and 8 MiB
    of small per-row buffers): the window's two bf16 logit buffers, the weight-gradient
    accumulator (fp32, or the returned bf16 gradient itself), the bf16 hidden gradient
    (written by each window's GEMM at TP 1), and backward's rounded weight gradient."""
    from megatron_kd.loss import DenseTeacher, GpuTuning, KDLossConfig, vocab_parallel_kd_loss

    n, v, h_s, h_t, rows = 4096, 32_000, 512, 768, 512
    g = torch.Generator(device="cuda").manual_seed(0)
    x_s = torch.randn(n, 1, h_s, device="cuda", dtype=torch.bfloat16, generator=g)
    x_t = torch.randn(n, 1, h_t, device="cuda", dtype=torch.bfloat16, generator=g)
    w_s = (torch.randn(v, h_s, device="cuda", generator=g) * 0.05).bfloat16()
    w_t = (torch.randn(v, h_t, device="cuda", generator=g) * 0.05).bfloat16()
    x_s.requires_grad_(True)
    w_s.requires_grad_(True)
    config = KDLossConfig(gpu_tuning=GpuTuning(window_bytes=rows * v * 2 * 2,
                                               weight_grad=weight_grad, kernels=KERNELS[0]))

    def step():
        loss, _ = vocab_parallel_kd_loss(x_s, w_s, DenseTeacher(hidden=x_t, weight=w_t),
                                         config=config)
        return torch.autograd.grad(loss, (x_s, w_s))

    step()  # compiles the kernels, makes cuBLAS's workspace
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    grads = step()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    window = 2 * rows * v * 2
    grad_w, grad_x = v * h_s * 2, n * h_s * 2
    acc = v * h_s * 4 if weight_grad == "fp32_gemm" else 0  # input_dtype: the returned one
    # forward: window + accumulator + hidden gradient; backward: + the rounded gradient
    want = max(window + max(acc, grad_w) + grad_x, acc + grad_w + grad_x)
    assert 0.9 * want <= extra <= 1.1 * want + (8 << 20), (extra, want)
    del grads
