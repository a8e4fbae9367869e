"""Fused KD loss, tier 1: the GPU path's working memory equals its account.

The account is :func:`megatron_kd.parallel.windows.gpu_loss_memory` (docs/loss.md, the GPU
path's cost account: the same formula, with the Multiverse shape's numbers). Here the GPU path
runs on CPU under the simulated accelerator (:mod:`megatron_kd.testing.devices`), whose
counter adds up the storages the "device" tensors hold, at a scaled-down shape: 512 tokens,
V 4,096, h_s 64, h_t 96, bf16, byte windows of 128 rows (4 windows). Each case's peak above
the inputs in forward and in backward is compared with the account: the account's big terms
(window logits, accumulators, gradients, statistics) are exact, its small records (per row,
top-K entry, token and call) an allowance, so the peak must lie between the account less that
allowance (``GpuLossMemory.records``: 30 KiB here with a dense teacher, 94 KiB with top-K) and
the account. The returned gradients must equal the account's to the byte.

The kernels run in their PyTorch form (``kernels="eager"``), each call counted as one GPU
kernel (:func:`~megatron_kd.testing.devices.as_kernel`): its ``[rows, V]`` fp32 temporaries,
which the Triton kernels keep in registers, are not counted, its outputs are.
:func:`test_eager_temporaries_are_what_the_kernels_save` measures those temporaries apart.
The fp32 weight-gradient GEMM (``fp32_gemm``), CUDA-only, is the simulation's
(``addmm(..., out_dtype=float32)`` computed in fp32, no operand copies counted).
"""

import pytest
import torch

from megatron_kd.loss import (
    DenseTeacher,
    GpuTuning,
    KDLossConfig,
    TopKTeacher,
    gpu_kernels,
    vocab_parallel_kd_loss,
)
from megatron_kd.parallel.windows import gpu_loss_memory
from megatron_kd.testing import devices

N, V, H_S, H_T, K = 512, 4096, 64, 96, 16
ROWS = 128  # rows a window: 4 windows of the 512 tokens
KERNELS = ("row_stats", "jsd_sums", "logit_grad_", "scale_round")


def _inputs(teacher: str, ce: bool):
    g = torch.Generator().manual_seed(0)
    bf16 = torch.bfloat16
    out = {"x": torch.randn(N, 1, H_S, generator=g).to(bf16),
           "w": (torch.randn(V, H_S, generator=g) * 0.1).to(bf16)}
    if teacher == "dense":
        out["teacher"] = (torch.randn(N, 1, H_T, generator=g).to(bf16),
                          (torch.randn(V, H_T, generator=g) * 0.1).to(bf16))
    else:
        ids = torch.stack([torch.randperm(V, generator=g)[:K] for _ in range(N)])
        out["teacher"] = (ids.view(N, 1, K),
                          torch.log_softmax(torch.randn(N, 1, K, generator=g), -1))
    if ce:
        out["labels"] = torch.randint(0, V, (N, 1), generator=g)
    return out


def _measure(monkeypatch, *, teacher="dense", backward="precompute", weight_grad="fp32_gemm",
             fusion=False, kind="forward_kl", ce=False, topk_tail="renormalize",
             kernels_as_gpu=True):
    """``(forward peak, backward peak, returned gradients)`` in bytes above the inputs."""
    if kernels_as_gpu:
        for name in KERNELS:
            monkeypatch.setattr(gpu_kernels, name, devices.as_kernel(getattr(gpu_kernels, name)))
    host = _inputs(teacher, ce)
    models = 2 if teacher == "dense" else 1
    config = KDLossConfig(
        path="gpu", kind=kind, backward=backward, ce_weight=0.5 if ce else 0.0,
        topk_tail=topk_tail, gradient_accumulation_fusion=fusion,
        gpu_tuning=GpuTuning(kernels="eager", weight_grad=weight_grad,
                             window_bytes=ROWS * V * 2 * models))
    with devices.simulated_accelerator():
        x = host["x"].cuda().requires_grad_()
        w = host["w"].cuda().requires_grad_()
        if fusion:  # Megatron's fp32 main_grad, an input like the weight
            w.main_grad = torch.zeros(V, H_S, dtype=torch.float32, device="cuda")
            w.grad_added_to_main_grad = False
        a, b = (t.cuda() for t in host["teacher"])
        t = DenseTeacher(hidden=a, weight=b) if teacher == "dense" else \
            TopKTeacher(ids=a, logprobs=b)
        labels = host["labels"].cuda() if ce else None
        base = devices.memory_allocated()
        devices.reset_peak_memory_stats()
        loss, _ = vocab_parallel_kd_loss(x, w, t, labels=labels, config=config)
        forward = devices.max_memory_allocated() - base
        devices.reset_peak_memory_stats()
        loss.backward()
        backward_peak = devices.max_memory_allocated() - base
        returned = sum(g.untyped_storage().nbytes() for g in (x.grad, w.grad))
        assert torch.isfinite(loss).item()
    return forward, backward_peak, returned


def _account(*, teacher="dense", backward="precompute", weight_grad="fp32_gemm",
             fusion=False, **_):
    return gpu_loss_memory(N, V, H_S, 2, teacher=teacher, topk=K if teacher == "topk" else 0,
                           backward=backward, weight_grad=weight_grad,
                           main_grad_fusion=fusion,
                           window_bytes=ROWS * V * 2 * (2 if teacher == "dense" else 1))


CASES = [dict(teacher=teacher, backward=backward, weight_grad=weight_grad, fusion=fusion)
         for teacher in ("dense", "topk") for backward in ("precompute", "recompute")
         for weight_grad in ("fp32_gemm", "fp32_add", "input_dtype")
         for fusion in (False, True)]
# the kinds and terms change the small records only
CASES += [dict(kind="jsd", ce=True), dict(kind="reverse_kl", ce=True, backward="recompute"),
          dict(teacher="topk", topk_tail="ghost", ce=True)]


def _case_id(case):
    return "-".join(str(v) if not isinstance(v, bool) else (k if v else f"no_{k}")
                    for k, v in case.items())


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_peak_equals_the_account(monkeypatch, case):
    forward, backward, returned = _measure(monkeypatch, **case)
    account = _account(**case)
    assert account.rows == ROWS and account.windows == 4
    assert returned == account.returned
    # the big terms to the byte; the small records within their allowance
    assert 0 <= account.forward - forward <= account.records, (forward, account)
    assert 0 <= account.backward - backward <= account.records, (backward, account)


def test_eager_temporaries_are_what_the_kernels_save(monkeypatch):
    # the same run with the eager kernels' temporaries counted: at least two [rows, V] fp32
    # buffers more than the account (seven at this shape; a Triton kernel holds none), so the
    # account is checked against the kernels counted as GPU kernels, not against the eager form
    forward, _, _ = _measure(monkeypatch, kernels_as_gpu=False)
    assert forward - _account().forward >= 2 * ROWS * V * 4


def test_the_account_catches_a_needless_buffer(monkeypatch):
    # the check can fail: a [rows, V] fp32 copy of the student's logits kept for the window
    # (what the GPU path was designed without) is past the account
    from megatron_kd.loss import gpu
    real = gpu._Walk.project

    def project_with_copy(self, rows):
        out = real(self, rows)
        self.kept = out[1].float()
        return out

    monkeypatch.setattr(gpu._Walk, "project", project_with_copy)
    forward, _, _ = _measure(monkeypatch)
    assert forward > _account().forward


@pytest.mark.parametrize("bad, match", [
    (dict(teacher="sparse"), "teacher must be one of"),
    (dict(backward="both"), "backward must be one of"),
    (dict(weight_grad="bf16"), "weight_grad must be one of"),
    (dict(teacher="topk"), r"topk entries \(0\)"),
    (dict(topk=8), r"topk entries \(8\) are for teacher='topk' only"),
])
def test_account_validation(bad, match):
    with pytest.raises(ValueError, match=match):
        gpu_loss_memory(N, V, H_S, 2, **bad)


def _docs_account_rows() -> list[list[str]]:
    """The cells of docs/loss.md's account table at the Multiverse shape."""
    import pathlib

    text = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "loss.md").read_text()
    head = "| backward | `weight_grad` | fusion | forward | backward | peak | beyond `X + W` |"
    lines = text[text.index(head):].splitlines()[2:]
    rows = []
    for line in lines:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip("|").split("|")])
    return rows


def test_the_docs_account_is_the_function_at_the_multiverse_shape():
    """Every row of docs/loss.md's table (T 8,192, V 128,256, h_s 3,072, bf16, a dense
    teacher) is :func:`gpu_loss_memory`'s, to the printed 0.01 GiB; "off / on" cells hold
    both fusion settings."""
    gib = float(1 << 30)
    rows = _docs_account_rows()
    assert len(rows) >= 8, rows
    for backward_cell, grad_cell, fusion_cell, *figures in rows:
        backward = "recompute" if backward_cell.startswith("recompute") else "precompute"
        window = (512 << 20) if "512 MiB" in backward_cell else (1 << 30)
        grads = [g.strip("` ") for g in grad_cell.replace("(default)", "").split(" or ")]
        fusions = {"off": [False], "on": [True], "off / on": [False, True]}[fusion_cell]
        for weight_grad in grads:
            for fusion in fusions:
                m = gpu_loss_memory(8192, 128256, 3072, 2, backward=backward,
                                    weight_grad=weight_grad, main_grad_fusion=fusion,
                                    window_bytes=window)
                got = {"forward": m.forward / gib, "backward": m.backward / gib,
                       "peak": m.peak / gib, "beyond": m.beyond_returned / gib}
                cells = dict(zip(("forward", "backward", "peak", "beyond"), figures))
                for key, cell in cells.items():
                    options = [float(x) for x in cell.split(" / ")]
                    want = options[fusion] if len(options) == 2 else options[0]
                    assert round(got[key], 2) == want, (backward_cell, weight_grad, fusion,
                                                        key, got[key], cell)
