"""The simulated accelerator's memory counter (:mod:`megatron_kd.testing.devices`), tier 1.

Against allocations of known size: a storage counted once however many views share it, freed
with its last user (a view, autograd's saved tensors, a leaf's ``.grad``), ``out=`` and
in-place results, the peak and its reset, ``torch.cuda``'s functions of the same names, and a
function counted as one GPU kernel.
"""

import gc

import pytest
import torch

from megatron_kd.testing.devices import (
    as_kernel,
    max_memory_allocated,
    memory_allocated,
    on_accelerator,
    reset_peak_memory_stats,
    simulated_accelerator,
)

KIB = 1024


def test_a_tensor_and_its_views_are_one_storage():
    with simulated_accelerator():
        assert memory_allocated() == 0
        x = torch.zeros(256, device="cuda")  # 1 KiB of fp32
        assert memory_allocated() == KIB
        views = (x[10:20], x.view(16, 16).t(), x.detach(), x.bfloat16().view(torch.int16))
        assert memory_allocated() == KIB + 512  # the bf16 copy's 512 B, viewed as int16
        del x
        assert memory_allocated() == KIB + 512  # the views keep the storage
        del views
        assert memory_allocated() == 0
        assert max_memory_allocated() == KIB + 512


def test_host_tensors_and_copies_to_the_host_are_not_counted():
    with simulated_accelerator():
        host = torch.ones(1024)
        x = host.cuda()  # a device copy: counted
        back = x.cpu()
        assert not on_accelerator(back) and memory_allocated() == 4 * KIB
        del host, back
        assert memory_allocated() == 4 * KIB


def test_a_freed_temporary_leaves_its_peak():
    with simulated_accelerator():
        y = torch.ones(256, device="cuda")
        reset_peak_memory_stats()
        assert max_memory_allocated() == KIB
        (y * 2).sum()  # a 1 KiB temporary and a 4-byte sum
        assert memory_allocated() == KIB
        assert max_memory_allocated() == 2 * KIB + 4
        reset_peak_memory_stats()
        assert max_memory_allocated() == KIB
        # torch.cuda's functions read the same counter inside the simulation
        assert torch.cuda.memory_allocated() == KIB
        assert torch.cuda.max_memory_allocated(0) == KIB
        torch.cuda.reset_peak_memory_stats()


def test_out_and_in_place_results_count_their_storage_once_and_its_new_size():
    with simulated_accelerator():
        y = torch.ones(256, device="cuda")
        out = torch.empty(256, device="cuda")
        torch.mul(y, 3, out=out)
        y.add_(1)
        assert memory_allocated() == 2 * KIB
        z = torch.empty(0, device="cuda")
        torch.mul(y, 3, out=z)  # resized by out=
        assert memory_allocated() == 3 * KIB
        z.resize_(512)
        assert memory_allocated() == 4 * KIB
        z.set_(torch.zeros(16, device="cuda"))  # the 2 KiB storage freed, 64 B held
        gc.collect()
        assert memory_allocated() == 2 * KIB + 64


class _SavesATemporary(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(a * 2)  # no Python reference to it after forward
        return a.sum()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (doubled,) = ctx.saved_tensors
        return grad * doubled


def test_tensors_saved_for_backward_and_gradients_stay_counted():
    with simulated_accelerator():
        a = torch.randn(256).cuda().requires_grad_()
        loss = _SavesATemporary.apply(a)
        assert memory_allocated() == 2 * KIB + 4  # a, the saved temporary, the loss
        loss.backward()
        # the saved temporary freed with the graph; the gradient held as a.grad, which no
        # Python tensor referred to between backward's return and this read
        assert memory_allocated() == 2 * KIB + 4
        assert on_accelerator(a.grad)
        a.grad = None
        assert memory_allocated() == KIB + 4


def test_a_kernel_counts_its_results_not_its_temporaries():
    def kernel(x):
        t = torch.exp(x)  # temporaries a GPU kernel keeps in registers
        u = t * 2
        return (u + 1).sum(0)

    with simulated_accelerator():
        x = torch.randn(64, 256).cuda()  # 64 KiB
        reset_peak_memory_stats()
        out = as_kernel(kernel)(x)
        assert out.shape == (256,) and on_accelerator(out)
        assert memory_allocated() == 65 * KIB
        assert max_memory_allocated() == 65 * KIB
        reset_peak_memory_stats()
        kernel(x)  # as plain ops: t, u and u + 1 (64 KiB each) at once, and a second result
        assert max_memory_allocated() == (64 * 4 + 2) * KIB


def test_the_fp32_gemm_of_bf16_operands_runs_as_on_cuda():
    # addmm(..., out_dtype=float32): a CUDA GEMM the CPU lacks; the same sum, no upcast
    # copies of the operands counted
    g = torch.Generator().manual_seed(0)
    acc0 = torch.randn(64, 32, generator=g)
    a = torch.randn(128, 64, generator=g).bfloat16()
    b = torch.randn(128, 32, generator=g).bfloat16()
    with simulated_accelerator():
        acc, da, db = acc0.cuda(), a.cuda(), b.cuda()
        reset_peak_memory_stats()
        held = memory_allocated()
        out = torch.addmm(acc, da.t(), db, out_dtype=torch.float32, out=acc)
        assert out is acc and max_memory_allocated() == held
        got = acc.cpu()
    expected = acc0.double() + a.double().t() @ b.double()
    torch.testing.assert_close(got.double(), expected, rtol=1e-6, atol=1e-5)


def test_the_counter_is_the_simulations_own():
    with pytest.raises(RuntimeError, match="no simulated accelerator"):
        memory_allocated()
    with simulated_accelerator():
        x = torch.zeros(256, device="cuda")
        with simulated_accelerator():  # a nested simulation counts afresh
            assert memory_allocated() == 0
        assert memory_allocated() == KIB
        del x
