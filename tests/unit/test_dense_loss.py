"""The dense-logits baseline (``KDLossConfig(path="dense")``), tier 1: one process.

Value and both gradients against the independent fp64 reference (tests/support/kd_reference.py)
and against the fused loss on the same inputs; the same errors as the fused loss; the run flag.
The gloo ranks (TP 2, sequence parallel) are in tests/dist/test_loss_dist.py.
"""

import dataclasses
import weakref

import pytest
import torch
from support.kd_cases import (
    config_of,
    make_inputs,
    rel_err,
    run_ours,
    single_case,
    spec,
    teacher_of,
)
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_kd.loss import (
    DenseTeacher,
    KDLossConfig,
    TopKTeacher,
    dense_logits_kd_loss,
    fused,
    vocab_parallel_kd_loss,
)
from megatron_kd.training.run_config import RunConfig, parse_args

KINDS = ["forward_kl", "reverse_kl", "jsd"]

# the least `megatron-kd train` takes (a CE-only run: no teacher needed to parse)
TRAIN_ARGV = ["--num-layers", "2", "--hidden-size", "8", "--num-attention-heads", "2",
              "--seq-length", "16", "--micro-batch-size", "1", "--train-iters", "3",
              "--mock-data", "--vocab-size", "100", "--kd-weight", "0", "--kd-ce-weight", "1"]

# fp64 on both sides: the dense and the fused loss differ in summation order only
FUSED_TOL = 1e-10


def _against_fused(sp: dict) -> None:
    """The dense path and the fused CPU path on the same inputs: loss and both gradients."""
    inp = make_inputs(sp)
    size = [sp["padded_vocab"]]
    dense = run_ours(dict(sp, path="dense"), inp, size, 0, None)
    # one window (a window's size changes the fused loss's summation order only)
    ours = run_ours(dict(sp, path="cpu", window_size=None), inp, size, 0, None)
    for key in ("loss", "grad_x", "grad_w"):
        assert rel_err(dense[key], ours[key]) <= FUSED_TOL, (key, rel_err(dense[key], ours[key]))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("temperature,ce_weight", [(1.0, 0.0), (2.5, 0.0), (0.6, 0.3)])
def test_dense_teacher_kinds(kind, temperature, ce_weight):
    # padding rows (vocab_size < rows), a fractional mask, labels with an ignore_index token
    sp = spec(path="dense", kind=kind, temperature=temperature, ce_weight=ce_weight, mask=True,
              vocab_size=1000, labels=True)
    single_case(sp)
    _against_fused(sp)


@pytest.mark.parametrize("tail,temperature", [("renormalize", 1.0), ("renormalize", 2.0),
                                              ("ghost", 1.0)])
@pytest.mark.parametrize("ce_weight", [0.0, 0.5])
def test_topk_teacher(tail, temperature, ce_weight):
    sp = spec(path="dense", teacher=tail, topk_tail=tail, temperature=temperature,
              ce_weight=ce_weight, mask=True, vocab_size=1003)
    single_case(sp)
    _against_fused(sp)


def test_ce_only_without_teacher():
    single_case(spec(path="dense", teacher=None, kd_weight=0.0, ce_weight=1.0, mask=True))


@pytest.mark.parametrize("kind", KINDS)
def test_fp32(kind):
    single_case(spec(path="dense", kind=kind, dtype=torch.float32, ce_weight=0.4,
                     temperature=1.5))


@pytest.mark.parametrize("kind", KINDS)
def test_bf16_returns_fp32_loss_and_bf16_grads(kind):
    # the tolerance of kd_cases.TOLERANCE: the logits are written in bf16 (the output layer's
    # GEMM) before the fp32 cast, and the logit gradient is rounded to bf16 for the backward
    # GEMMs: a few bf16 roundings, well inside 2e-2
    ours = single_case(spec(path="dense", kind=kind, dtype=torch.bfloat16, ce_weight=0.4))
    assert ours["loss_dtype"] == torch.float32 and ours["grad_dtype"] == torch.bfloat16


def test_huge_logits_do_not_overflow():
    # logits near +-1000: the max shift; bound as in test_loss.py (|z| * eps, 8x for the GEMM)
    sp = spec(path="dense", scale=300.0, ce_weight=0.2, dtype=torch.float32)
    single_case(sp, tol=8 * 1200 * torch.finfo(torch.float32).eps)


def test_all_masked_gives_zero_loss_and_zero_grads():
    sp = spec(path="dense", mask=True, ce_weight=0.5)
    inp = make_inputs(sp)
    inp["loss_mask"] = torch.zeros_like(inp["loss_mask"])
    ours = run_ours(sp, inp, [sp["padded_vocab"]], 0, None)
    assert float(ours["loss"]) == 0.0 and float(ours["num_tokens"]) == 0.0
    assert not ours["grad_x"].any() and not ours["grad_w"].any()


def test_path_dense_runs_the_dense_loss(monkeypatch):
    calls = []

    def spy(*args, **kwargs):
        calls.append(kwargs["config"].path)
        return dense_logits_kd_loss(*args, **kwargs)

    monkeypatch.setattr(fused, "dense_logits_kd_loss", spy)
    monkeypatch.setattr(fused._FusedKDLoss, "apply", None)  # the fused Function must not run
    single_case(spec(path="dense", ce_weight=0.5))
    assert calls == ["dense"]


def _run(path: str, sp: dict, inp: dict, **config) -> tuple[torch.Tensor, dict]:
    hidden = inp["student_hidden"].clone().requires_grad_(True)
    weight = inp["student_weight"].clone().requires_grad_(True)
    terms: dict = {}
    cfg = dataclasses.replace(config_of(sp), path=path, **config)
    loss, _ = vocab_parallel_kd_loss(hidden, weight, teacher_of(inp), labels=inp.get("labels"),
                                     loss_mask=inp.get("loss_mask"), config=cfg,
                                     terms_out=terms)
    return loss, terms


@pytest.mark.parametrize("ce_weight", [0.0, 0.5])
def test_terms_out_equals_the_fused_loss(ce_weight):
    sp = spec(kind="jsd", temperature=2.0, ce_weight=ce_weight, labels=True, mask=True)
    inp = make_inputs(sp)
    _, dense = _run("dense", sp, inp)
    _, ours = _run("cpu", sp, inp)
    assert set(dense) == {"kd_sum", "ce_sum"} and not dense["kd_sum"].requires_grad
    for key in ("kd_sum", "ce_sum"):
        assert rel_err(dense[key], ours[key]) <= FUSED_TOL, key


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_gradient_accumulation_fusion_adds_into_main_grad(dtype):
    sp = spec(path="dense", dtype=dtype, ce_weight=0.5, mask=True, vocab_size=1000)
    inp = make_inputs(sp)
    expected = run_ours(sp, inp, [sp["padded_vocab"]], 0, None)["grad_w"]
    hidden = inp["student_hidden"].clone().requires_grad_(True)
    weight = inp["student_weight"].clone().requires_grad_(True)
    before = torch.randn(weight.shape, dtype=torch.float32)
    weight.main_grad = before.clone()
    weight.grad_added_to_main_grad = False
    cfg = dataclasses.replace(config_of(sp), gradient_accumulation_fusion=True)
    loss, _ = vocab_parallel_kd_loss(hidden, weight, teacher_of(inp), labels=inp["labels"],
                                     loss_mask=inp["loss_mask"], config=cfg)
    (loss * 0.75).backward()
    assert weight.grad_added_to_main_grad
    # fp32 main_grad: the fp32 tolerance of kd_cases for both dtypes
    assert rel_err((weight.main_grad - before) / 0.75, expected) <= 1e-5
    assert hidden.grad is not None and hidden.grad.dtype == dtype


def test_gradient_accumulation_fusion_needs_main_grad():
    sp = spec(path="dense")
    inp = make_inputs(sp)
    cfg = dataclasses.replace(config_of(sp), gradient_accumulation_fusion=True)
    with pytest.raises(ValueError, match="student_weight has no main_grad"):
        vocab_parallel_kd_loss(inp["student_hidden"], inp["student_weight"].requires_grad_(True),
                               teacher_of(inp), config=cfg)


def _error(path: str, *args, **kwargs) -> str:
    with pytest.raises(ValueError) as info:
        vocab_parallel_kd_loss(*args, config=KDLossConfig(path=path, **kwargs))
    return str(info.value)


def test_bad_input_raises_the_fused_loss_errors():
    h, w = torch.randn(4, 2, 8), torch.randn(50, 8)
    # the teacher's vocabulary shard differs from the student's
    teacher = DenseTeacher(hidden=torch.randn(4, 2, 6), weight=torch.randn(49, 6))
    message = _error("dense", h, w, teacher)
    assert ("the teacher's output layer has 49 vocabulary rows (shards [49] over the 1 TP "
            "rank(s)) but the student's has 50 (shards [50])") in message
    assert message == _error("cpu", h, w, teacher)
    # a true vocabulary larger than the output layer
    good = DenseTeacher(hidden=torch.randn(4, 2, 6), weight=torch.randn(50, 6))
    message = _error("dense", h, w, good, vocab_size=60)
    assert "vocab_size 60 > rows of the output layer" in message
    assert message == _error("cpu", h, w, good, vocab_size=60)


@pytest.mark.parametrize("path", ["dense", "cpu"])
def test_non_finite_raises_naming_the_term(path):
    sp = spec(ce_weight=0.5)
    inp = make_inputs(sp)
    inp["student_hidden"][1, 2, 3] = float("nan")
    with pytest.raises(FloatingPointError, match=r"non-finite KD \(forward_kl\) loss nan at "
                                                 r"active token 5"):
        _run(path, sp, inp)


def test_dense_refuses_compiled_elementwise():
    with pytest.raises(ValueError, match="path='dense'.*elementwise='compiled'"):
        KDLossConfig(path="dense", elementwise="compiled")


def test_train_flag_selects_the_dense_path():
    loss = RunConfig.from_args(parse_args(TRAIN_ARGV + ["--kd-loss-path", "dense"])).kd.loss
    assert loss.path == "dense"
    with pytest.raises(ValueError, match="--kd-loss-path"):
        RunConfig.from_args(parse_args(TRAIN_ARGV + ["--kd-loss-path", "dense",
                                                  "--kd-loss-elementwise", "compiled"]))


class _LiveBytes(TorchDispatchMode):
    """The peak of live tensor storages made inside it (each storage counted once, freed when
    its last tensor goes): what a GPU's allocator would hold for them."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self.seen: set[int] = set()

    def _track(self, t):
        if not isinstance(t, torch.Tensor):
            return
        storage = t.untyped_storage()
        key, size = storage.data_ptr(), storage.nbytes()
        if key in self.seen or size == 0:
            return
        self.seen.add(key)
        self.live += size
        self.peak = max(self.peak, self.live)

        def freed(key=key, size=size):
            self.live -= size
            self.seen.discard(key)

        weakref.finalize(t, freed)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for o in out if isinstance(out, (tuple, list)) else (out,):
            self._track(o)
        return out


@pytest.mark.parametrize("teacher_kind", ["dense", "topk"])
def test_working_memory_is_the_planners_account(teacher_kind):
    """The planner's bytes per token and vocabulary column of the dense path
    (``DENSE_PATH_BYTES_PER_LOGIT``) against the peak of live storages over one forward and
    backward (bf16, forward KL, T = 1), less the returned gradients: within 10%."""
    from megatron_kd.planner.memory import DENSE_PATH_BYTES_PER_LOGIT

    n, vocab, h_s, h_t, k = 512, 16384, 64, 96, 100
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 1, h_s, generator=g).bfloat16().requires_grad_()
    w = (torch.randn(vocab, h_s, generator=g) * 0.05).bfloat16().requires_grad_()
    if teacher_kind == "dense":
        teacher = DenseTeacher(hidden=torch.randn(n, 1, h_t, generator=g).bfloat16(),
                               weight=(torch.randn(vocab, h_t, generator=g) * 0.05).bfloat16())
    else:
        ids = torch.stack([torch.randperm(vocab, generator=g)[:k] for _ in range(n)])
        teacher = TopKTeacher(ids=ids.view(n, 1, k),
                              logprobs=torch.log_softmax(torch.randn(n, 1, k, generator=g), -1))
    tracker = _LiveBytes()
    with tracker:
        loss, _ = vocab_parallel_kd_loss(x, w, teacher,
                                         config=KDLossConfig(path="dense", vocab_size=vocab))
        loss.backward()
    returned = x.numel() * x.element_size() + w.numel() * w.element_size()
    per_logit = (tracker.peak - returned) / (n * vocab)
    assert per_logit == pytest.approx(DENSE_PATH_BYTES_PER_LOGIT[teacher_kind], rel=0.10)
