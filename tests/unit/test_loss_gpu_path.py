"""Fused KD loss, tier 1: the GPU path (megatron_kd.loss.gpu) forced on CPU with ``path="gpu"``.

The path's walk, combine and gradients run here as on a GPU; its elementwise kernels run in
their PyTorch form (``kernels="eager"``; ``"compiled"`` in one case, Inductor's C++ on CPU). The
Triton form of the same kernels is tested through Triton's interpreter in
tests/unit/test_loss_triton.py. Every case is compared with the fp64 reference on the value and
both gradients (tests/support/kd_cases.py holds the tolerances and their reasons).
"""

import pytest
import torch
from support.kd_cases import make_inputs, single_case, spec, teacher_of

from megatron_kd.loss import GpuTuning, KDLossConfig, gpu, vocab_parallel_kd_loss

KINDS = ["forward_kl", "reverse_kl", "jsd"]
# 4 rows of 1009 fp64 columns for student and teacher: windows of 4 rows (1 row of a 1-model
# walk's 8): several windows per call, the last one short.
SMALL_WINDOWS = 4 * 1009 * 8 * 2
EAGER = dict(kernels="eager", window_bytes=SMALL_WINDOWS)


def gpu_spec(**kw):
    kw.setdefault("gpu_tuning", EAGER)
    return spec(path="gpu", **kw)


@pytest.mark.parametrize("backward", ["precompute", "recompute"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("temperature,ce_weight", [(1.0, 0.0), (2.5, 0.0), (1.0, 0.7), (0.6, 0.3)])
def test_dense_kinds_fp64(kind, temperature, ce_weight, backward):
    single_case(gpu_spec(kind=kind, temperature=temperature, ce_weight=ce_weight, backward=backward,
                     mask=True, vocab_size=1000))


@pytest.mark.parametrize("backward", ["precompute", "recompute"])
@pytest.mark.parametrize("tail,temperature", [("renormalize", 1.0), ("renormalize", 2.0),
                                              ("ghost", 1.0)])
@pytest.mark.parametrize("ce_weight", [0.0, 0.5])
def test_sparse_teacher_fp64(tail, temperature, ce_weight, backward):
    single_case(gpu_spec(teacher=tail, topk_tail=tail, temperature=temperature, ce_weight=ce_weight,
                     backward=backward, mask=True, vocab_size=1003))


@pytest.mark.parametrize("temperature", [1.0, 2.0])
@pytest.mark.parametrize("backward", ["precompute", "recompute"])
def test_ce_only(temperature, backward):
    single_case(gpu_spec(teacher=None, kd_weight=0.0, ce_weight=1.0, temperature=temperature,
                     backward=backward, mask=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", KINDS)
def test_low_precision_inputs(kind, dtype):
    # bf16: the logits and the logit gradient stay bf16 (the kernels compute in fp32), the
    # weight gradient is accumulated in fp32 and rounded once: the bf16 tolerance holds (the
    # case of test_loss.py's bf16 test, where the CPU path's errors are the same)
    single_case(gpu_spec(kind=kind, dtype=dtype, ce_weight=0.4, mask=dtype == torch.float32,
                     temperature=1.5 if dtype == torch.float32 else 1.0))


@pytest.mark.parametrize("kind", KINDS)
def test_huge_logits_do_not_overflow(kind):
    sp = gpu_spec(kind=kind, dtype=torch.float32, scale=300.0, ce_weight=0.2)
    # as in test_loss.py: rounding a logit of size |z| ~ 1200 moves exp(z) by |z| * eps
    single_case(sp, tol=8 * 1200 * torch.finfo(torch.float32).eps)


def test_huge_logits_sparse_ghost():
    # the K ids set to -inf for the tail's sums, logits ~ +-1000: same bound as above
    single_case(gpu_spec(teacher="ghost", topk_tail="ghost", scale=300.0, dtype=torch.float32),
            tol=8 * 1200 * torch.finfo(torch.float32).eps)


@pytest.mark.parametrize("window_bytes", [1, 3 * 1009 * 8 * 2, 1 << 30])
def test_window_sizes_by_bytes(window_bytes):
    # 1 byte: one row per window; 3 rows; everything in one window
    single_case(gpu_spec(gpu_tuning=dict(kernels="eager", window_bytes=window_bytes),
                     ce_weight=0.5, mask=True, window_size=None))


def test_window_rows_follow_the_byte_budget_and_window_size(monkeypatch):
    seen = []
    real = gpu._Walk.project

    def spy(self, rows):
        out = real(self, rows)
        seen.append(out[1].shape)
        return out

    monkeypatch.setattr(gpu._Walk, "project", spy)
    # 5 rows of the budget (two models, fp64, 1009 columns); window_size 3 bounds it further
    single_case(gpu_spec(gpu_tuning=dict(kernels="eager", window_bytes=5 * 1009 * 8 * 2),
                     window_size=None, s=5, b=3))
    assert [r for r, _ in seen] == [5, 5, 5]
    seen.clear()
    single_case(gpu_spec(gpu_tuning=dict(kernels="eager", window_bytes=5 * 1009 * 8 * 2),
                     window_size=3, s=5, b=3))
    assert [r for r, _ in seen] == [3, 3, 3, 3, 3]


def test_logits_stay_in_the_input_dtype_and_buffers_are_reused(monkeypatch):
    # bf16 inputs: the window's logits are bf16 (no fp32 copy), the same buffer every window
    ptrs, dtypes = set(), set()
    real = gpu._Walk.project

    def spy(self, rows):
        out = real(self, rows)
        ptrs.add(out[1].data_ptr())
        dtypes.add(out[1].dtype)
        return out

    monkeypatch.setattr(gpu._Walk, "project", spy)
    single_case(gpu_spec(dtype=torch.bfloat16, kind="jsd", ce_weight=0.3, window_size=None,
                     gpu_tuning=dict(kernels="eager", window_bytes=4 * 1009 * 2 * 2)))
    assert dtypes == {torch.bfloat16} and len(ptrs) == 1


@pytest.mark.parametrize("backward", ["precompute", "recompute"])
@pytest.mark.parametrize("weight_grad", ["fp32_add", "input_dtype"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weight_grad_accumulators(weight_grad, dtype, backward):
    # input_dtype: a bf16 accumulator rounded once per window (4 windows of 4 rows here, within
    # the bf16 tolerance); fp32_add: the fp32 one (fp32_gemm is the CUDA form of it)
    single_case(gpu_spec(kind="jsd", dtype=dtype, ce_weight=0.4, backward=backward,
                     gpu_tuning=dict(kernels="eager", weight_grad=weight_grad,
                                     window_bytes=SMALL_WINDOWS)))


def test_compiled_kernels():
    # the fallback form of the kernels: torch.compile (Inductor's C++ kernels on CPU)
    single_case(gpu_spec(kind="jsd", temperature=2.0, ce_weight=0.5, mask=True,
                     gpu_tuning=dict(kernels="compiled", window_bytes=SMALL_WINDOWS)))


def test_cuda_inputs_choose_the_gpu_path_and_cpu_inputs_the_cpu_path():
    cfg = KDLossConfig()
    assert cfg.uses_gpu_path(torch.device("cuda", 0))
    assert not cfg.uses_gpu_path(torch.device("cpu"))
    assert KDLossConfig(path="gpu").uses_gpu_path(torch.device("cpu"))
    assert not KDLossConfig(path="cpu").uses_gpu_path(torch.device("cuda", 0))
    # the CPU path's own option, asked for by name, keeps CUDA inputs on that path
    assert not KDLossConfig(elementwise="compiled").uses_gpu_path(torch.device("cuda", 0))


def test_cpu_inputs_take_the_cpu_path_by_default(monkeypatch):
    # the CPU path is unchanged: nothing of the GPU path runs for CPU inputs
    def refuse(*args, **kwargs):
        raise AssertionError("the GPU path ran for CPU inputs")

    monkeypatch.setattr(gpu.GpuKDLoss, "forward", staticmethod(refuse))
    single_case(spec(ce_weight=0.5))


@pytest.mark.parametrize("bad", [dict(window_bytes=0), dict(window_bytes=True),
                                 dict(kernels="cuda"), dict(block_v=100), dict(block_v=8),
                                 dict(num_warps=3), dict(weight_grad="bf16")])
def test_gpu_tuning_validation(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        GpuTuning(**bad)


GIB = 1 << 30


@pytest.mark.parametrize("vocab, n_rows, window_size, want, budget", [
    (128_256, 8_192, None, 2_048, GIB),  # cap 2,093: 4 windows of 2,048 (16 tiles each)
    (151_936, 8_192, None, 1_664, GIB),  # cap 1,766: 5 windows, 1,639 rounded up to 13 tiles
    (128_256, 4_096, None, 2_048, GIB),
    (128_256, 2_000, None, 2_000, GIB),  # one window: the call's rows, whatever they are
    (128_256, 8_192, 1_000, 911, GIB),  # 9 windows of 911: 1,024 is over the cap, so equal ones
    (151_936, 8_192, None, 820, GIB // 2),  # cap 883: 10 windows of 820, not 9 x 883 + 245
    (128_256, 8_192, 100, 100, GIB),  # below a tile: balanced only (82 windows of 100)
    (128_256, 4_100, 1_000, 896, GIB),  # 5 windows of 820, rounded to 896 (4,100 = 4 x 896 + 516)
])
def test_gpu_windows_are_balanced_and_whole_tiles(vocab, n_rows, window_size, want, budget):
    got = GpuTuning(window_bytes=budget).rows_per_window(vocab, 2, 2, window_size, n_rows)
    assert got == want


def test_gpu_windows_never_exceed_the_budget_nor_add_a_window():
    tuning = GpuTuning(window_bytes=3 << 20)
    for vocab in (1_009, 32_000, 50_257):
        cap = tuning.rows_per_window(vocab, 2, 2, None)
        assert cap == (3 << 20) // (4 * vocab)
        for n_rows in range(1, 6 * cap, 7):
            rows = tuning.rows_per_window(vocab, 2, 2, None, n_rows)
            assert 1 <= rows <= cap, (vocab, n_rows, rows)
            assert -(-n_rows // rows) == -(-n_rows // cap), (vocab, n_rows, rows)


def test_path_validation():
    with pytest.raises(ValueError, match=r"path must be one of .* got 'tpu'"):
        KDLossConfig(path="tpu")
    with pytest.raises(ValueError, match="gpu_tuning must be a GpuTuning"):
        KDLossConfig(gpu_tuning={"kernels": "eager"})


def test_cpu_elementwise_option_on_the_gpu_path_is_refused():
    inp = make_inputs(spec())
    with pytest.raises(ValueError, match="elementwise='compiled' is an option of the CPU path"):
        vocab_parallel_kd_loss(inp["student_hidden"], inp["student_weight"], teacher_of(inp),
                               config=KDLossConfig(path="gpu", elementwise="compiled",
                                                   gpu_tuning=GpuTuning(kernels="eager")))


def test_triton_kernels_without_triton_are_refused(monkeypatch):
    from megatron_kd.loss import gpu_kernels
    monkeypatch.setattr(gpu_kernels, "triton_available", lambda: False)
    inp = make_inputs(spec())
    with pytest.raises(ValueError, match="kernels='triton' but triton cannot be imported"):
        vocab_parallel_kd_loss(inp["student_hidden"], inp["student_weight"], teacher_of(inp),
                               config=KDLossConfig(path="gpu"))
