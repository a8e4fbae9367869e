"""The SDPA core attention on a GPU (skipped without one): against the float64 reference and
Megatron-Core's ``DotProductAttention`` on the fused kernels (flash with GQA in bf16, the
memory-efficient kernel in fp32 and with masks), context parallelism's chunk geometry, and the
point of it all: no ``[s, s]`` scores (peak memory far below one score tensor at 16K tokens).
"""

import pytest
import torch
from megatron.core import parallel_state
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer.dot_product_attention import DotProductAttention
from support.archs import tiny_arch
from support.attention_cases import (
    PARTS,
    attention_config,
    attention_inputs,
    build_attention,
    reference,
    rel_err,
    value_and_grads,
)

from megatron_kd.integration import gpt
from megatron_kd.integration.sdpa_attention import SdpaAttention, causal_attention

# fp32: the memory-efficient kernel's tiled sums (TF32 off); bf16: outputs and gradients rounded
# to bf16 (2^-8 ~ 4e-3 relative) after bf16 roundings inside; DotProductAttention, which also
# rounds its scores and probabilities, is held to the same bound
TOL = {torch.float32: 1e-5, torch.bfloat16: 1.5e-2}


@pytest.fixture(autouse=True)
def one_rank():
    made = parallel_state._GLOBAL_MEMORY_BUFFER is None
    if made:
        parallel_state._set_global_memory_buffer()
    model_parallel_cuda_manual_seed(7, tp_rank=0, ep_rank=0, etp_rank=0)
    yield
    if made:
        parallel_state.destroy_global_memory_buffer()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", [(13, 3, 6, 2, 10), (128, 2, 8, 2, 64), (77, 1, 4, 4, 128)],
                         ids=lambda s: "x".join(map(str, s)))
def test_matches_reference_and_dot_product_attention(shape, dtype):
    s, b, a, g, d = shape
    config = attention_config(a, g, d, dtype)
    sdpa = build_attention(SdpaAttention, config).cuda()
    dpa = build_attention(DotProductAttention, config).cuda()
    q, k, v = attention_inputs(s, b, a, g, d, dtype, device="cuda")
    got = value_and_grads(lambda *t: sdpa(*t, None), q, k, v)
    unfused = value_and_grads(lambda *t: dpa(*t, None), q, k, v)
    ref = value_and_grads(lambda *t: reference(*t, d ** -0.5), q, k, v)
    for name, x, y, r in zip(PARTS, got, unfused, ref, strict=True):
        assert rel_err(x, r) < TOL[dtype], name
        assert rel_err(y, r) < TOL[dtype], name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("window_left", [None, 40])
def test_chunk_of_the_sequence(dtype, window_left):
    # a context-parallel rank's second chunk: queries [192, 256) against keys up to 255
    a, g, d, b, q_start, sq = 8, 2, 64, 2, 192, 64
    k_start = 0 if window_left is None else q_start - window_left
    sk = q_start + sq - k_start
    q, k, v = attention_inputs(sq, b, a, g, d, dtype, sk=sk, device="cuda")

    def chunk(q, k, v):
        out = causal_attention(*(t.permute(1, 2, 0, 3) for t in (q, k, v)), scale=0.1,
                               window_left=window_left, query_start=q_start, key_start=k_start)
        return out.permute(2, 0, 1, 3).reshape(sq, b, -1)

    got = value_and_grads(chunk, q, k, v)
    ref = value_and_grads(lambda *t: reference(*t, 0.1, window_left,
                                               torch.arange(q_start, q_start + sq),
                                               torch.arange(k_start, k_start + sk)), q, k, v)
    for name, x, r in zip(PARTS, got, ref, strict=True):
        assert rel_err(x, r) < TOL[dtype], name


def _peak_bytes(fn, *inputs) -> int:
    """Peak allocated bytes of forward + backward above what the inputs hold."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn(*inputs).float().sum().backward()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


@pytest.mark.parametrize("case", ["causal", "cp-chunk", "window", "fp32"])
def test_no_score_sized_memory(case):
    # 16K tokens, 16 heads over 4 groups: one bf16 [b, a, s, s] score tensor is 8 GiB
    s, b, a, g, d = 16384, 1, 16, 4, 128
    dtype = torch.float32 if case == "fp32" else torch.bfloat16
    sq = 4096 if case == "cp-chunk" else s
    window = 4096 if case == "window" else None
    q = torch.randn(b, a, sq, d, device="cuda", dtype=dtype, requires_grad=True)
    k = torch.randn(b, g, s, d, device="cuda", dtype=dtype, requires_grad=True)
    v = torch.randn(b, g, s, d, device="cuda", dtype=dtype, requires_grad=True)
    peak = _peak_bytes(lambda q, k, v: causal_attention(q, k, v, scale=d ** -0.5,
                                                        window_left=window,
                                                        query_start=s - sq), q, k, v)
    scores = b * a * sq * s * 2
    print(f"{case}: peak {peak / 2**20:.0f} MiB, one bf16 score tensor {scores / 2**20:.0f} MiB")
    # what the fused kernels hold: outputs, gradients, a few [b, a, s, d] copies (fp32, repeated
    # GQA groups), the window's block masks (s * 2w); unfused attention would need several
    # score tensors
    assert peak < scores / 4, (peak, scores)

def test_this_gpu_picks_sdpa_without_transformer_engine():
    if gpt.transformer_engine_available():
        pytest.skip("Transformer Engine is installed: its spec runs dense models")
    for arch_kw in ({}, {"linear_attention_layers": [0], "linear_num_key_heads": 2,
                         "linear_num_value_heads": 4, "linear_key_head_dim": 8,
                         "linear_value_head_dim": 8}):
        arch = tiny_arch(**arch_kw)
        config = gpt._transformer_config(arch, tp_size=1, pp_size=1, cp_size=1,
                                         expert_sizes=(1, 1), params_dtype=torch.bfloat16)
        block = gpt._block_spec(arch, config, vp_stage=None, pp_rank=0, attention="auto")
        found = [getattr(spec.submodules.self_attention.submodules, "core_attention", None)
                 for spec in block.layer_specs]
        found = {getattr(c, "module", c) for c in found if c is not None}
        assert found == {SdpaAttention}, arch_kw
