"""Fused KD loss, tier 1: what a GPU needs that a CPU run does not show by itself.

* No host synchronisation inside the loss's autograd Function, either path's: every call that
  reads a tensor's value on the host (``.item()``, ``bool()``, ``int()``, ``float()``,
  ``.tolist()``, ``.cpu()``, ``nonzero``) raises while the Function's forward or backward runs.
  The GPU path runs under the simulated accelerator (:mod:`megatron_kd.testing.devices`), its
  inputs "on the device" as in training.
* Megatron's gradient-accumulation fusion: the weight gradient lands in ``main_grad`` (added to
  what it held, scaled by the incoming gradient), against the fp64 reference.
"""

import pytest
import torch
from support.kd_cases import config_of, make_inputs, reference, rel_err, spec, teacher_of
from torch.overrides import TorchFunctionMode

from megatron_kd.loss import KDLossConfig, fused, gpu, vocab_parallel_kd_loss
from megatron_kd.testing.devices import on_accelerator, simulated_accelerator

HOST_READS = {"item", "__bool__", "__int__", "__float__", "__index__", "tolist", "cpu",
              "nonzero", "numpy"}


class NoHostReads(TorchFunctionMode):
    """Raise on any torch call that moves a tensor's value to the host."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in HOST_READS:
            raise AssertionError(f"host synchronisation {name}() inside the loss's autograd")
        return func(*args, **(kwargs or {}))


@pytest.fixture
def guarded(monkeypatch):
    """Run the forward and backward of both paths' Functions (_FusedKDLoss, GpuKDLoss) under
    NoHostReads."""
    for function in (fused._FusedKDLoss, gpu.GpuKDLoss):
        forward, backward = function.forward, function.backward

        def guarded_forward(ctx, *args, forward=forward):
            with NoHostReads():
                return forward(ctx, *args)

        def guarded_backward(ctx, *grads, backward=backward):
            with NoHostReads():
                return backward(ctx, *grads)

        monkeypatch.setattr(function, "forward", staticmethod(guarded_forward))
        monkeypatch.setattr(function, "backward", staticmethod(guarded_backward))


CASES = {
    "fwd_kl_T2_ce": dict(kind="forward_kl", temperature=2.0, ce_weight=0.5),
    "rev_kl_ce": dict(kind="reverse_kl", ce_weight=0.3),
    "jsd_ce": dict(kind="jsd", beta=0.3, ce_weight=0.4),
    "topk_renorm_T2": dict(teacher="renormalize", topk_tail="renormalize", temperature=2.0,
                           ce_weight=0.5),
    "topk_ghost": dict(teacher="ghost", topk_tail="ghost", ce_weight=0.2, vocab_size=1001),
    "ce_only": dict(teacher=None, kd_weight=0.0, ce_weight=1.0),
    # the compiled kernels: Inductor's size guards are host ints, never a tensor read
    "fwd_kl_compiled_T2_ce": dict(kind="forward_kl", temperature=2.0, ce_weight=0.5,
                                  elementwise="compiled"),
    # the GPU path, forced on CPU (its kernels in their PyTorch form)
    **{f"gpu_path_{name}": dict(case, path="gpu", gpu_tuning=dict(kernels="eager"))
       for name, case in (("fwd_kl_T2_ce", dict(kind="forward_kl", temperature=2.0,
                                                 ce_weight=0.5)),
                          ("jsd_ce", dict(kind="jsd", beta=0.3, ce_weight=0.4)),
                          ("rev_kl_T07_ce", dict(kind="reverse_kl", temperature=0.7,
                                                 ce_weight=0.3)),
                          ("topk_renorm_T2", dict(teacher="renormalize", topk_tail="renormalize",
                                                  temperature=2.0, ce_weight=0.5)),
                          ("topk_ghost", dict(teacher="ghost", topk_tail="ghost", ce_weight=0.2,
                                              vocab_size=1001)),
                          ("ce_only_T2", dict(teacher=None, kd_weight=0.0, ce_weight=1.0,
                                              temperature=2.0)))},
}


def _run(sp, weight_setup=None, scale=0.75):
    inp = make_inputs(sp)
    hidden = inp["student_hidden"].clone().requires_grad_(True)
    weight = inp["student_weight"].clone().requires_grad_(True)
    if weight_setup is not None:
        weight_setup(weight)
    loss, _ = vocab_parallel_kd_loss(
        hidden, weight, teacher_of(inp), labels=inp.get("labels"),
        loss_mask=inp.get("loss_mask"), config=config_of(sp) if weight_setup is None else
        _fusion_config(sp))
    (loss * scale).backward()
    return inp, loss, hidden, weight


def _run_on_device(sp, scale=0.75):
    """``_run`` with every input moved to the simulated accelerator ("CUDA" inputs take the
    GPU path); the results come back to the host."""
    inp = make_inputs(sp)
    with simulated_accelerator():
        dev = {k: v.cuda() for k, v in inp.items()}
        hidden = dev["student_hidden"].requires_grad_(True)
        weight = dev["student_weight"].requires_grad_(True)
        loss, _ = vocab_parallel_kd_loss(hidden, weight, teacher_of(dev),
                                         labels=dev.get("labels"),
                                         loss_mask=dev.get("loss_mask"), config=config_of(sp))
        (loss * scale).backward()
        assert on_accelerator(loss) and on_accelerator(hidden.grad)
        return inp, loss.detach().cpu(), hidden.grad.cpu(), weight.grad.cpu()


def _fusion_config(sp):
    cfg = config_of(sp)
    cfg.gradient_accumulation_fusion = True
    return cfg


@pytest.mark.parametrize("backward", ["precompute", "recompute"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_no_host_reads_inside_the_autograd_function(guarded, name, backward):
    sp = spec(backward=backward, mask=True, window_size=4, **CASES[name])
    if sp["path"] == "gpu":  # the GPU path as training runs it: its inputs on the device
        inp, loss, grad_x, grad_w = _run_on_device(sp)
    else:
        inp, loss, hidden, weight = _run(sp)
        loss, grad_x, grad_w = loss.detach(), hidden.grad, weight.grad
    ref_loss, ref_gx, ref_gw = reference(sp, inp)
    assert rel_err(loss, ref_loss) < 1e-9  # the guarded run is the real computation
    assert rel_err(grad_x, 0.75 * ref_gx) < 1e-9  # scaled by the upstream gradient
    assert rel_err(grad_w, 0.75 * ref_gw) < 1e-9


def test_the_guard_catches_a_host_read(guarded, monkeypatch):
    # the check can fail: a .item() slipped into a kind's maths is caught
    real = fused.KindMath.stats

    def stats_with_item(self, z_s, z_t, win):
        z_s.max().item()
        return real(self, z_s, z_t, win)

    monkeypatch.setattr(fused.KindMath, "stats", stats_with_item)
    with pytest.raises(AssertionError, match=r"item\(\) inside the loss's autograd"):
        _run(spec())


@pytest.mark.parametrize("step, backward", [("stats", "precompute"),  # forward
                                            ("grad_", "recompute")])  # backward
def test_the_guard_catches_a_host_read_on_the_gpu_path(guarded, monkeypatch, step, backward):
    # the GPU path's guard can fail too, in forward and in backward: a .item() slipped into a
    # window step
    real = getattr(gpu._Walk, step)

    def step_with_item(self, z_s, *args, **kwargs):
        z_s.max().item()
        return real(self, z_s, *args, **kwargs)

    monkeypatch.setattr(gpu._Walk, step, step_with_item)
    sp = spec(backward=backward, path="gpu", gpu_tuning=dict(kernels="eager"))
    with pytest.raises(AssertionError, match=r"item\(\) inside the loss's autograd"):
        _run_on_device(sp)


def test_non_finite_loss_still_raises_after_the_function():
    # the finite check moved out of the Function: it still names the term and the token
    sp = spec(ce_weight=0.5, labels=True)
    inp = make_inputs(sp)
    hidden = inp["student_hidden"].clone()
    hidden[1, 2, 0] = float("nan")  # token 1 * b + 2 = 5 of the flattened [s, b]
    with pytest.raises(FloatingPointError, match=r"non-finite KD \(forward_kl\) loss nan at "
                                                 r"active token 5"):
        vocab_parallel_kd_loss(hidden, inp["student_weight"], teacher_of(inp),
                               labels=inp["labels"], config=config_of(sp))


@pytest.mark.parametrize("path", ["auto", "gpu"])
@pytest.mark.parametrize("backward", ["precompute", "recompute"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["forward_kl", "jsd"])
def test_gradient_accumulation_fusion_adds_into_main_grad(kind, dtype, backward, path):
    # path "gpu": the GPU path forced on CPU, whose fp32 accumulator is main_grad itself
    sp = spec(kind=kind, dtype=dtype, backward=backward, ce_weight=0.4, mask=True, path=path,
              gpu_tuning=dict(kernels="eager") if path == "gpu" else None)
    held = torch.randn(sp["padded_vocab"], sp["h_s"], dtype=torch.float64,
                       generator=torch.Generator().manual_seed(5))
    main_dtype = torch.float64 if dtype == torch.float64 else torch.float32

    def setup(weight):
        weight.main_grad = held.to(main_dtype).clone()  # another microbatch's gradient
        weight.grad_added_to_main_grad = False

    inp, loss, hidden, weight = _run(sp, setup, scale=0.75)
    _, ref_gx, ref_gw = reference(sp, inp)
    tol = {torch.float64: 1e-9, torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    assert weight.grad_added_to_main_grad  # Megatron's DDP hook skips its own add
    assert weight.main_grad.dtype == main_dtype
    assert rel_err(weight.main_grad - held.to(main_dtype), 0.75 * ref_gw) < tol
    assert rel_err(hidden.grad, 0.75 * ref_gx) < tol


def test_fusion_without_the_ddp_flag_returns_no_weight_grad():
    # a main_grad without Megatron's flag: the gradient is in main_grad and .grad stays None
    sp = spec(backward="recompute")

    def setup(weight):
        weight.main_grad = torch.zeros(weight.shape, dtype=torch.float64)

    inp, _, _, weight = _run(sp, setup, scale=1.0)
    assert weight.grad is None
    assert rel_err(weight.main_grad, reference(sp, inp)[2]) < 1e-9


def test_fusion_without_main_grad_is_refused():
    inp = make_inputs(spec())
    weight = inp["student_weight"].clone().requires_grad_(True)
    with pytest.raises(ValueError, match="gradient_accumulation_fusion=True but student_weight "
                                         "has no main_grad"):
        vocab_parallel_kd_loss(inp["student_hidden"], weight, teacher_of(inp),
                               config=KDLossConfig(gradient_accumulation_fusion=True))
