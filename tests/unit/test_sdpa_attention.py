"""The SDPA core attention (:mod:`megatron_kd.integration.sdpa_attention`) against an independent
dense reference and against Megatron-Core's ``DotProductAttention``: forward value and the
gradients of q, k and v, fp32 and bf16, grouped-query attention, odd sizes, sliding windows, the
chunk geometry context parallelism uses; what it refuses; which attention the local spec picks,
and the ``--attention-backend`` flag that chooses it in each command (no process group: a
one-rank tensor-parallel stand-in).
"""

import argparse
import json
import math
from types import SimpleNamespace

import pytest
import torch
from megatron.core import parallel_state
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnBackend, AttnMaskType
from support.archs import tiny_arch
from support.attention_cases import (
    PARTS,
    OneRank,
    attention_config,
    attention_inputs,
    build_attention,
    reference,
    rel_err,
    value_and_grads,
)

from megatron_kd.cli import main
from megatron_kd.commands import cache as cache_command
from megatron_kd.commands import teacher_serve
from megatron_kd.flags import from_flags
from megatron_kd.integration import gpt, sdpa_attention
from megatron_kd.integration.context_parallel import (
    ContextParallelAttention,
    ContextParallelSdpaAttention,
)
from megatron_kd.integration.cpu_shim import device_context, install_cpu_shim
from megatron_kd.integration.sdpa_attention import (
    ATTENTION_CHOICES,
    SdpaAttention,
    causal_attention,
)
from megatron_kd.megatron_lm.checks import teacher_attention
from megatron_kd.planner.memory import ATTENTION_ASSUMPTIONS, ActivationOptions
from megatron_kd.training.run_config import KernelSection, RunConfig, parse_args

# (seq, batch, heads, groups, head_dim): odd sizes, MHA and two GQA ratios, a head dim that is
# no multiple of 8
SHAPES = [(13, 3, 6, 2, 10), (9, 2, 4, 4, 8), (17, 1, 6, 3, 12)]
# Relative to the largest entry, against the float64 reference. fp32: the same sums in another
# order (a tiled softmax). bf16: the output and each gradient rounded to bf16 (2^-8 ~ 4e-3
# relative) after a few bf16 roundings inside (DotProductAttention also rounds its scores and
# probabilities): both attentions measure 2e-3 .. 6.4e-3 on these shapes
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def _build(cls, config, layer_number=1, **kw):
    module = build_attention(cls, config, layer_number, **kw)
    if cls is DotProductAttention:
        forward = module.forward

        def on_cpu(*args, **kwargs):
            # its torch softmax builds the causal mask with device="cuda"
            with device_context():
                return forward(*args, **kwargs)

        module.forward = on_cpu
    return module


@pytest.fixture(autouse=True)
def one_rank(monkeypatch):
    """The CPU shim, Megatron's global buffer (the unfused attention's scores) and its seeded
    model-parallel RNG (dropout forks it), without a process group."""
    install_cpu_shim()
    made = parallel_state._GLOBAL_MEMORY_BUFFER is None
    if made:
        parallel_state._set_global_memory_buffer()
    model_parallel_cuda_manual_seed(7, tp_rank=0, ep_rank=0, etp_rank=0)
    yield
    if made:
        parallel_state.destroy_global_memory_buffer()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_matches_reference_and_dot_product_attention(shape, dtype):
    s, b, a, g, d = shape
    config = attention_config(a, g, d, dtype)
    sdpa, dpa = _build(SdpaAttention, config), _build(DotProductAttention, config)
    q, k, v = attention_inputs(s, b, a, g, d, dtype)
    before = [t.detach().clone() for t in (q, k, v)]
    got = value_and_grads(lambda *t: sdpa(*t, None), q, k, v)
    unfused = value_and_grads(lambda *t: dpa(*t, None), q, k, v)
    ref = value_and_grads(lambda *t: reference(*t, 1 / math.sqrt(d)), q.float(), k.float(),
                           v.float())
    for name, x, y, r in zip(PARTS, got, unfused, ref, strict=True):
        assert rel_err(x, r) < TOL[dtype], name
        assert rel_err(y, r) < TOL[dtype], name  # the reference is DotProductAttention's maths
    assert got[0].shape == (s, b, a * d)
    assert all(torch.equal(x, y) for x, y in zip(before, (q, k, v), strict=True))  # not written


def test_output_dtype_is_the_input_dtype():
    config = attention_config(4, 2, 8, torch.bfloat16)
    q, k, v = attention_inputs(5, 2, 4, 2, 8, torch.bfloat16)
    assert _build(SdpaAttention, config)(q, k, v, None).dtype == torch.bfloat16


@pytest.mark.parametrize("min_block", [128, 1], ids=["one-block", "blocks"])
def test_sliding_window_matches_dot_product_attention(monkeypatch, min_block):
    # blocks: query blocks of window + 1 = 4 rows, each against its keys only
    monkeypatch.setattr(sdpa_attention, "MIN_WINDOW_BLOCK", min_block)
    s, b, a, g, d = 15, 2, 4, 2, 8
    config = attention_config(a, g, d, window_size=(3, 0))
    q, k, v = attention_inputs(s, b, a, g, d, torch.float32)
    got = value_and_grads(lambda *t: _build(SdpaAttention, config)(*t, None), q, k, v)
    unfused = value_and_grads(lambda *t: _build(DotProductAttention, config)(*t, None), q, k, v)
    ref = value_and_grads(lambda *t: reference(*t, 1 / math.sqrt(d), window_left=3), q, k, v)
    for name, x, y, r in zip(PARTS, got, unfused, ref, strict=True):
        assert rel_err(x, r) < 1e-5, name
        assert rel_err(y, r) < 1e-5, name


@pytest.mark.parametrize("window_left", [None, 4])
def test_causal_attention_on_a_chunk_of_the_sequence(monkeypatch, window_left):
    # context parallelism's geometry: queries at positions [12, 18) against keys [k0, 18)
    monkeypatch.setattr(sdpa_attention, "MIN_WINDOW_BLOCK", 1)
    a, g, d, b = 6, 2, 8, 2
    q_start, sq = 12, 6
    k_start = 0 if window_left is None else q_start - window_left
    sk = q_start + sq - k_start
    q, k, v = attention_inputs(sq, b, a, g, d, torch.float32, sk=sk)

    def chunk(q, k, v):
        out = causal_attention(*(t.permute(1, 2, 0, 3) for t in (q, k, v)), scale=0.3,
                               window_left=window_left, query_start=q_start, key_start=k_start)
        return out.permute(2, 0, 1, 3).reshape(sq, b, -1)

    got = value_and_grads(chunk, q, k, v)
    ref = value_and_grads(lambda *t: reference(*t, 0.3, window_left,
                                                torch.arange(q_start, q_start + sq),
                                                torch.arange(k_start, k_start + sk)), q, k, v)
    for name, x, r in zip(PARTS, got, ref, strict=True):
        assert rel_err(x, r) < 1e-5, name


@pytest.mark.parametrize("kw", [{"softmax_scale": 0.05}, {"apply_query_key_layer_scaling": True}],
                         ids=["softmax_scale", "layer-scaling"])
def test_scale_is_dot_product_attentions(kw):
    softmax_scale = kw.pop("softmax_scale", None)
    config = attention_config(4, 2, 8, **kw)
    q, k, v = attention_inputs(7, 2, 4, 2, 8, torch.float32)
    got = _build(SdpaAttention, config, 3, softmax_scale=softmax_scale)(q, k, v, None)
    want = _build(DotProductAttention, config, 3, softmax_scale=softmax_scale)(q, k, v, None)
    scale = softmax_scale or 1 / math.sqrt(8)
    assert rel_err(got.double(), reference(q, k, v, scale)) < 1e-5
    assert rel_err(want.double(), reference(q, k, v, scale)) < 1e-5


def test_attention_dropout_in_training_only():
    config = attention_config(4, 2, 8, attention_dropout=0.5)
    module = _build(SdpaAttention, config)
    q, k, v = attention_inputs(11, 2, 4, 2, 8, torch.float32)
    module.eval()
    ref = reference(q, k, v, 1 / math.sqrt(8)).float()
    assert rel_err(module(q, k, v, None), ref) < 1e-5  # no dropout in eval
    module.train()
    model_parallel_cuda_manual_seed(3, tp_rank=0, ep_rank=0, etp_rank=0)
    first = module(q, k, v, None)
    model_parallel_cuda_manual_seed(3, tp_rank=0, ep_rank=0, etp_rank=0)
    again = module(q, k, v, None)
    # drawn from the model-parallel RNG: the same seed, the same mask; some probabilities dropped
    assert torch.equal(first, again)
    assert not torch.allclose(first, ref, atol=1e-3)


def test_refuses_what_it_does_not_compute():
    config = attention_config(4, 2, 8)
    module = _build(SdpaAttention, config)
    q, k, v = attention_inputs(5, 1, 4, 2, 8, torch.float32)
    with pytest.raises(ValueError,
                       match=r"not an attention_mask \(got one of shape \(1, 1, 5, 5\)"):
        module(q, k, v, torch.zeros(1, 1, 5, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match="packed sequences"):
        module(q, k, v, None, packed_seq_params=object())
    with pytest.raises(ValueError, match="attn_mask_type=causal only, got AttnMaskType.padding"):
        module(q, k, v, None, attn_mask_type=AttnMaskType.padding)
    with pytest.raises(ValueError, match="attn_mask_type=causal only, got AttnMaskType.no_mask"):
        SdpaAttention(config, 1, AttnMaskType.no_mask, "self",
                      pg_collection=SimpleNamespace(tp=OneRank()))
    with pytest.raises(ValueError, match="softmax_type='vanilla' only, got 'learnable'"):
        _build(SdpaAttention, attention_config(4, 2, 8, softmax_type="learnable"))
    with pytest.raises(ValueError, match=r"window_size=\(3, 2\)"):
        _build(SdpaAttention, attention_config(4, 2, 8, window_size=(3, 2)))
    with pytest.raises(ValueError, match="5 queries, 4 keys"):
        module(q, k[:4], v[:4], None)


def test_attention_choice_is_checked():
    assert ATTENTION_CHOICES == ("auto", "sdpa", "unfused")
    with pytest.raises(ValueError, match=r"--attention-backend 'flash': choose from auto, "
                                         r"sdpa, unfused"):
        sdpa_attention.check_attention_choice("flash")
    with pytest.raises(ValueError, match=r"--attention-backend 'flash': choose from"):
        _core_attentions({}, attention="flash")


# --- which attention the local spec picks ---------------------------------------------------

HYBRID = {"qk_layernorm": True, "linear_attention_layers": [0], "linear_num_key_heads": 2,
          "linear_num_value_heads": 4, "linear_key_head_dim": 8, "linear_value_head_dim": 8,
          "linear_conv_kernel_dim": 4, "attention_output_gate": True}


def _core_attentions(arch_kw, cp=1, attention="auto"):
    """The ``core_attention`` module of every softmax attention layer of the block spec built
    for ``attention`` (``--attention-backend``)."""
    arch = tiny_arch(**arch_kw)
    config = gpt._transformer_config(arch, tp_size=1, pp_size=1, cp_size=cp,
                                     expert_sizes=(1, 1), params_dtype=torch.float32)
    block = gpt._block_spec(arch, config, vp_stage=None, pp_rank=0, attention=attention)
    found = [getattr(spec.submodules.self_attention.submodules, "core_attention", None)
             for spec in block.layer_specs]
    # a spec entry is a module class or a ModuleSpec of one
    return [getattr(core, "module", core) for core in found if core is not None]


@pytest.fixture
def gpu_without_te(monkeypatch):
    monkeypatch.setattr(gpt, "on_cpu", lambda: False)
    monkeypatch.setattr(gpt, "transformer_engine_available", lambda: False)


@pytest.mark.parametrize("arch_kw", [{}, {"num_experts": 4, "moe_router_topk": 2,
                                          "moe_ffn_hidden_size": 16}, HYBRID],
                         ids=["dense", "moe", "hybrid"])
def test_gpu_without_te_picks_sdpa(gpu_without_te, arch_kw):
    found = _core_attentions(arch_kw)
    assert found and all(m is SdpaAttention for m in found)
    if arch_kw is HYBRID:
        assert len(found) == 1  # layer 0 is the DeltaNet (no context parallelism)
    else:
        assert set(_core_attentions(arch_kw, cp=2)) == {ContextParallelSdpaAttention}


def test_gpu_without_te_keeps_sinks_unfused(gpu_without_te, monkeypatch):
    # attention sinks have no SDPA form: the unfused attention (scores formed), or a refusal
    sinks = {"attention_sinks": True}
    assert set(_core_attentions(sinks)) == {DotProductAttention}
    with pytest.raises(ValueError, match="got 'learnable'"):
        _core_attentions(sinks, attention="sdpa")


def test_cpu_default_and_overrides(monkeypatch):
    # the environment variable that chose it before is not read any more
    monkeypatch.setenv("MEGATRON_KD_ATTENTION", "sdpa")
    assert set(_core_attentions({})) == {DotProductAttention}
    assert set(_core_attentions({}, cp=2)) == {ContextParallelAttention}
    assert set(_core_attentions(HYBRID, attention="sdpa")) == {SdpaAttention}
    monkeypatch.setattr(gpt, "on_cpu", lambda: False)
    monkeypatch.setattr(gpt, "transformer_engine_available", lambda: False)
    assert set(_core_attentions({})) == {SdpaAttention}
    assert set(_core_attentions({}, attention="unfused")) == {DotProductAttention}


def _serve_config(argv):
    parser = argparse.ArgumentParser()
    teacher_serve.add_arguments(parser)
    return teacher_serve.ServeConfig.from_args(parser.parse_args(
        ["serve", "--kd-teacher-load", "ckpt", "--kd-teacher-endpoint", "ep", *argv]))


def _cache_build_kernels(argv):
    parser = argparse.ArgumentParser()
    cache_command.add_arguments(parser)
    args = parser.parse_args(["build", "--out", "o", "--kd-teacher-load", "t", "--seq-length",
                              "16", "--train-iters", "1", "--global-batch-size", "1", *argv])
    return from_flags(KernelSection, args)


TRAIN = ["--num-layers", "2", "--hidden-size", "8", "--num-attention-heads", "2",
         "--seq-length", "16", "--micro-batch-size", "1", "--train-iters", "3", "--mock-data",
         "--vocab-size", "100", "--kd-weight", "0", "--kd-ce-weight", "1"]


@pytest.mark.parametrize("choice", ["sdpa", "unfused"])
def test_attention_backend_is_a_flag_of_every_command_that_builds_a_model(choice):
    """``--attention-backend`` reaches each command's config (and from there the model
    builder); its default is ``auto``, a value outside the choices is refused by the parser and
    by the section."""
    assert RunConfig.from_args(parse_args(TRAIN)).kernels == KernelSection()
    assert KernelSection().attention_backend == "auto"
    given = KernelSection(attention_backend=choice)
    assert RunConfig.from_args(parse_args(TRAIN + ["--attention-backend", choice])).kernels \
        == given
    assert _serve_config(["--attention-backend", choice]).kernels == given
    assert _serve_config([]).kernels == KernelSection()
    assert _cache_build_kernels(["--attention-backend", choice]) == given
    assert _cache_build_kernels([]) == KernelSection()
    with pytest.raises(SystemExit):
        parse_args(TRAIN + ["--attention-backend", "flash"])
    with pytest.raises(ValueError, match=r"--attention-backend 'flash': choose from auto, "
                                         r"sdpa, unfused"):
        KernelSection(attention_backend="flash")


@pytest.mark.parametrize("backend, teacher", [
    (None, "auto"), (AttnBackend.auto, "auto"), (AttnBackend.flash, "auto"),
    (AttnBackend.fused, "auto"), (AttnBackend.local, "unfused"),
    (AttnBackend.unfused, "unfused"), ("local", "unfused")])
def test_megatron_lm_teacher_follows_its_attention_backend(backend, teacher):
    """Inside Megatron-LM the colocated teacher's attention is read from Megatron-LM's own
    ``--attention-backend`` (an ``AttnBackend``; absent from old trees): the backends that
    form the scores keep it on ``DotProductAttention``, the others give ``auto``."""
    args = SimpleNamespace() if backend is None else SimpleNamespace(attention_backend=backend)
    assert teacher_attention(args) == teacher
    with pytest.raises(ValueError, match=r"--attention-backend 'paged'"):
        teacher_attention(SimpleNamespace(attention_backend="paged"))


# --- what the planner assumes ------------------------------------------------------------------


def test_plan_json_says_which_attention_it_assumes(capsys):
    assert main(["plan", "--teacher", "qwen3-8b", "--student", "llama-3.2-1b", "--json"]) == 0
    activation = json.loads(capsys.readouterr().out)["assumptions"]["activation"]
    assert activation["flash_attention"] is True  # a GPU plan: TE's or the SDPA module's kernels
    assert activation["attention"] == ATTENTION_ASSUMPTIONS[True]
    assert "no s x s term" in activation["attention"]
    unfused = ActivationOptions(flash_attention=False)
    assert "DotProductAttention" in unfused.attention and "scores counted" in unfused.attention
