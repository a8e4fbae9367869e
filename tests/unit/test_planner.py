"""Planner terms against hand-computed small cases (no torch, no process group).

Every expected number is worked out by hand in the comments next to it, never by calling the code
under test. Arithmetic is exact integer or exactly representable in binary, so comparisons are
exact unless a tolerance says why.
"""

import dataclasses
import types

import pytest

from megatron_kd.arch import GPTArchConfig, check_layout
from megatron_kd.planner import memory as mem
from megatron_kd.planner import schedule, search
from megatron_kd.planner import traffic as tr
from megatron_kd.planner.memory import (
    ActivationOptions,
    FusedLossBytes,
    GpuLoss,
    ModelState,
    ParallelLayout,
    Precision,
    RingBytes,
    Term,
)
from megatron_kd.planner.models import PlannedModel
from megatron_kd.planner.plan import PlanOptions
from megatron_kd.planner.presets import GpuSpec, LinkSpec


def _model(name: str, vocab_multiple: int = 1, **arch) -> PlannedModel:
    """A planner model of a small architecture (no padding rows unless ``vocab_multiple``
    says: a layout pads the vocabulary to a multiple of it times tp; the position embeddings
    the planner does not count)."""
    arch.setdefault("padded_vocab_size", arch["vocab_size"])
    arch.setdefault("max_position_embeddings", 4096)
    return PlannedModel(name=name, arch=GPTArchConfig(**arch), vocab_multiple=vocab_multiple)


def _replace(model: PlannedModel, name: str | None = None, vocab_multiple: int | None = None,
             **arch) -> PlannedModel:
    """``model`` with some architecture fields changed (and the padding rows following)."""
    if "vocab_size" in arch:
        arch.setdefault("padded_vocab_size", arch["vocab_size"])
    return PlannedModel(name=name or model.name, arch=dataclasses.replace(model.arch, **arch),
                        vocab_multiple=vocab_multiple or model.vocab_multiple)


#: Megatron's padding (``--make-vocab-size-divisible-by`` 128): the vocabulary a multiple of
#: 128 * tp.
MEGATRON_PADDING = 128


# A tiny dense GQA/SwiGLU model: L=2, h=8, a=2, g=1, d=4, f=16, V=10, untied.
TINY = _model(
    name="tiny",
    num_layers=2,
    hidden_size=8,
    num_attention_heads=2,
    num_query_groups=1,
    kv_channels=4,
    ffn_hidden_size=16,
    vocab_size=10,
    tie_embeddings=False,
)

# A tiny MoE: L=1, h=8, a=g=2, d=4, E=4 experts of f_e=4, top-2, V=10, tied.
TINY_MOE = _model(
    name="tiny-moe",
    num_layers=1,
    hidden_size=8,
    num_attention_heads=2,
    num_query_groups=2,
    kv_channels=4,
    ffn_hidden_size=4,  # the experts' width stands in
    vocab_size=10,
    tie_embeddings=True,
    num_experts=4,
    moe_router_topk=2,
    moe_ffn_hidden_size=4,
)


# --- parameter counts ----------------------------------------------------------------------------


def test_dense_param_count():
    # attention: q 8*2*4=64, k 8*1*4=32, v 32, o 2*4*8=64 -> 192; SwiGLU 3*8*16=384; norms 2*8=16
    assert TINY.attention_params() == 192
    assert TINY.layer_dense_params(0) == 192 + 384 + 16
    # 2 layers * 592 + final norm 8 + embedding 80 + output layer 80
    assert TINY.total_params() == 1352
    # active: layers 1184 + final norm 8 + output layer 80 (input lookup excluded)
    assert TINY.active_params() == 1272
    assert TINY.active_params(include_input_embedding=True) == 1352


def test_moe_param_count():
    # attention: q, k, v, o = 8*2*4 = 64 each -> 256; experts 4 * 3*8*4 = 384; router 4*8 = 32;
    # norms 16
    assert TINY_MOE.layer_dense_params(0) == 256 + 32 + 16
    assert TINY_MOE.layer_expert_params() == 384
    # 688 + final norm 8 + tied embedding 80
    assert TINY_MOE.total_params() == 776
    # active: 256 + 2 experts * 96 + 32 + 16 = 496, + final norm 8 + output layer (tied) 80
    assert TINY_MOE.active_params() == 584
    assert TINY_MOE.active_params(include_input_embedding=True) == 584  # tied: one matrix


def test_gated_attention_and_linear_attention_params():
    m = _model(
        name="hyb",
        num_layers=4,
        hidden_size=8,
        num_attention_heads=2,
        num_query_groups=1,
        kv_channels=4,
        ffn_hidden_size=16,
        vocab_size=10,
        tie_embeddings=False,
        qk_layernorm=True,
        attention_output_gate=True,
        linear_attention_layers=[0, 1, 2],
        linear_num_key_heads=1,
        linear_num_value_heads=2,
        linear_key_head_dim=2,
        linear_value_head_dim=3,
        linear_conv_kernel_dim=4,
    )
    # gated q 2*(8*2*4)=128, k 32, v 32, o 64, qk-norm 2*4=8 -> 264
    assert m.attention_params() == 264
    # kd=1*2=2, vd=2*3=6, nv=2: qkvz 8*(4+12)=128, ba 8*4=32, conv (4+6)*4=40, A/dt 4, norm 3, out
    # 6*8=48
    assert m.linear_attention_params() == 128 + 32 + 40 + 4 + 3 + 48
    assert [m.is_full_attention(i) for i in range(4)] == [False, False, False, True]


def test_model_config_rejects_bad_values():
    with pytest.raises(ValueError, match="divisible by num_query_groups \\(3\\)"):
        _model(
            name="x",
            num_layers=1,
            hidden_size=8,
            num_attention_heads=4,
            num_query_groups=3,
            kv_channels=2,
            ffn_hidden_size=8,
            vocab_size=10,
            tie_embeddings=True,
        )
    with pytest.raises(ValueError, match="moe_router_topk \\(5\\) exceeds num_experts \\(4\\)"):
        _model(
            name="x",
            num_layers=1,
            hidden_size=8,
            num_attention_heads=2,
            num_query_groups=2,
            kv_channels=4,
            ffn_hidden_size=4,  # the experts' width stands in
            vocab_size=10,
            tie_embeddings=True,
            num_experts=4,
            moe_router_topk=5,
            moe_ffn_hidden_size=4,
        )


# --- layout helpers -------------------------------------------------------------------------------


def test_padded_vocab_like_megatron():
    # multiple of 128 * tp: 151936 / 1024 = 148.375 -> 149 * 1024
    qwen3 = PlannedModel(name="v", arch=dataclasses.replace(TINY.arch, vocab_size=151936,
                                                            padded_vocab_size=151936))
    assert qwen3.padded_vocab(8) == 152576
    assert qwen3.arch_at(8).padded_vocab_size == 152576
    # 248320 / 512 = 485 exactly (tp=4)
    qwen35 = PlannedModel(name="v", arch=dataclasses.replace(TINY.arch, vocab_size=248320,
                                                             padded_vocab_size=248320))
    assert qwen35.padded_vocab(4) == 248320
    assert qwen35.padded_vocab(8) == 248832
    # a model whose vocabulary is already the padded one (vocab_multiple 1): padded by tp only
    assert TINY.padded_vocab(1) == 10 and TINY.padded_vocab(4) == 12


def test_stage_layers_and_in_flight():
    # 94 layers over 4 stages: 24, 24, 23, 23, contiguous
    assert [len(schedule.stage_layers(94, 4, i)) for i in range(4)] == [24, 24, 23, 23]
    assert schedule.stage_layers(94, 4, 2) == range(48, 71)
    # 1F1B: stage i holds min(p - i, m)
    assert [schedule.in_flight_microbatches(4, i, 8) for i in range(4)] == [4, 3, 2, 1]
    assert schedule.in_flight_microbatches(4, 0, 2) == 2


# --- model state
# ------------------------------------------------------------------------------------


def test_model_state_bytes_dense():
    layout = ParallelLayout(dp=2, use_distributed_optimizer=True)
    out = mem.model_state_bytes(TINY, layout, 0, Precision(), trainable=True)
    # 1352 params: bf16 2 * 1352, fp32 grads 4 * 1352, Adam 12 * 1352 / dp 2
    assert out == ModelState(weights=2704, grads=5408, optimizer=8112)
    layout = ParallelLayout(dp=2)
    assert mem.model_state_bytes(TINY, layout, 0, Precision(), trainable=True).optimizer == 16224
    # a frozen teacher: weights only
    assert mem.model_state_bytes(TINY, layout, 0, Precision(), trainable=False) == ModelState(
        weights=2704)


def test_rank_params_pipeline_and_tensor_parallel():
    # pp=2: stage 0 = layer 0 (592) + embedding 80; stage 1 = layer 1 (592) + final norm 8 + output
    # 80
    layout = ParallelLayout(pp=2)
    assert mem.rank_params(TINY, layout, 0) == (672, 0)
    assert mem.rank_params(TINY, layout, 1) == (680, 0)
    # tp=2: per layer (192 + 384) / 2 + replicated norms 16 = 304, two layers 608;
    # vocab padded to a multiple of 1*2 = 10: embedding and output 10*8/2 = 40 each; final norm 8
    layout = ParallelLayout(tp=2)
    assert mem.rank_params(TINY, layout, 0) == (608 + 40 + 40 + 8, 0)


def test_rank_params_experts_over_ep():
    # ep=2: 2 of 4 experts (96 each) = 192; dense = attention 256 + router 32 + norms 16 + tied
    # embedding 80 (pp=1: one copy) + final norm 8
    layout = ParallelLayout(dp=2, ep=2)
    assert mem.rank_params(TINY_MOE, layout, 0) == (256 + 32 + 16 + 80 + 8, 192)
    out = mem.model_state_bytes(
        TINY_MOE,
        ParallelLayout(dp=2, ep=2, use_distributed_optimizer=True),
        0,
        Precision(),
        trainable=True,
    )
    # expert-data-parallel size = tp*dp/(ep*etp) = 1: expert Adam state unsharded
    # optimizer = 12*392/2 + 12*192/1 = 2352 + 2304
    assert out.optimizer == 4656


# --- activations
# --------------------------------------------------------------------------------------


GPT = _model(
    name="gpt",
    num_layers=1,
    hidden_size=64,
    num_attention_heads=4,
    num_query_groups=4,
    kv_channels=16,
    ffn_hidden_size=256,
    vocab_size=128,
    tie_embeddings=True,
    swiglu=False,
)
PAPER = ActivationOptions(flash_attention=False, hidden_dropout=True, attention_dropout=True)


@pytest.mark.parametrize(
    "tp, sp, recompute, expected",
    [
        # Korthikanti et al. eq. 1: s*b*h*(34 + 5*a*s/h); s=32, b=2, h=64, a=4:
        # per token 34*64 + 5*4*32 = 2816, times 64 tokens
        (1, False, "none", 64 * 2816),
        # eq. 2 (TP, no SP): s*b*h*(10 + 24/t + 5*a*s/(h*t)), t=2: 64*(640 + 768 + 320)
        (2, False, "none", 64 * (640 + 768 + 320)),
        # eq. 4 (TP + SP): s*b*h/t*(34 + 5*a*s/h), t=2
        (2, True, "none", 64 * 2816 // 2),
        # eq. 5 (selective recompute + SP): s*b*h*34/t
        (2, True, "selective", 64 * 64 * 34 // 2),
        # full recompute keeps the layer input 2*s*b*h, /t with SP
        (2, True, "full", 64 * 2 * 64 // 2),
    ],
)
def test_activations_reproduce_korthikanti(tp, sp, recompute, expected):
    layout = ParallelLayout(tp=tp, sequence_parallel=sp, recompute=recompute)
    got = mem.layer_activation_bytes(GPT, layout, 0, 32, 2, PAPER)
    assert got == expected


def test_activations_gqa_swiglu_flash():
    m = _model(
        name="g",
        num_layers=1,
        hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        kv_channels=16,
        ffn_hidden_size=128,
        vocab_size=128,
        tie_embeddings=True,
    )
    # per token: R = attention 2h + 2h = 256, MLP 2h + 2h = 256;
    # S = Q 2ad 128 + K 2gd 64 + V 64 + O 128 + lse 4a 16 = 400; SwiGLU 6f = 768 -> 1680; s*b = 8
    assert mem.layer_activation_bytes(m, ParallelLayout(), 0, 8, 1) == 8 * 1680


def test_activations_moe():
    # attention (a=g=2, d=4, flash): R 4h = 32; S 16 + 16 + 16 + 16 + lse 8 = 72
    # MoE: R = 2h + 2h + 8E = 64; S = k*(4h + 6 f_e) = 2*(32 + 24) = 112; n = 10 tokens
    assert mem.layer_activation_bytes(TINY_MOE, ParallelLayout(), 0, 10, 1) == 10 * (
        32 + 72 + 64 + 112
    )


def test_stage_activations_pipeline_and_full_recompute():
    # pp=2, m=8: stage 0 holds 2 micro-batches of layer 0; per layer 8 tokens * 1680 (see above)
    m = _model(
        name="g",
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        kv_channels=16,
        ffn_hidden_size=128,
        vocab_size=128,
        tie_embeddings=True,
    )
    assert mem.stage_activation_bytes(m, ParallelLayout(pp=2), 0, 8, 1, 8) == 2 * 8 * 1680
    # full recompute, pp=1, m=3: 1 in flight * 2 layers * 2h*8 = 2048, plus one layer
    # re-materialised
    got = mem.stage_activation_bytes(m, ParallelLayout(recompute="full"), 0, 8, 1, 3)
    assert got == 2 * 2 * 64 * 8 + 8 * 1680


# --- pipeline schedules and recompute ----------------------------------------------------------

# The "g" model of the tests above with 8 and 16 layers: per layer and token R 512 + S 1168 = 1680
# bytes saved (no recompute); a checkpointed group keeps its input, 2h = 128 bytes a token.
G8 = _model(
    name="g8",
    num_layers=8,
    hidden_size=64,
    num_attention_heads=4,
    num_query_groups=2,
    kv_channels=16,
    ffn_hidden_size=128,
    vocab_size=128,
    tie_embeddings=True,
)
G16 = _replace(G8, name="g16", num_layers=16)
FULL = 8 * 1680  # one layer, 8 tokens
INPUT = 8 * 128  # one checkpoint input, 8 tokens


@pytest.mark.parametrize(
    "pp, vp, m, expected",
    [
        (2, 1, 4, 1 / 4),  # 1F1B: (p-1)/m
        (4, 2, 8, 3 / 16),  # interleaved: (p-1)/(v*m) = 3/16
        (8, 4, 32, 7 / 128),
        (1, 1, 5, 0.0),  # no pipeline, no bubble
    ],
)
def test_bubble_fraction(pp, vp, m, expected):
    assert schedule.bubble_fraction(pp, vp, m) == expected


def test_step_time_with_virtual_stages():
    # 1e15 / (8 * 1e14 * 0.5) = 2.5 s of compute; bubble (2-1)/(2*4) = 1/8
    assert tr.step_time_s(1e15, 8, 1e14, 0.5, 2, 4, vp=2) == pytest.approx(2.8125, rel=1e-12)


def test_chunk_layers_like_megatron_core():
    # Megatron-Core's own example: 8 layers, 2 stages, 2 chunks: rank 0 [0, 1] [4, 5],
    # rank 1 [2, 3] [6, 7]; 4 chunks: rank 0 [0] [2] [4] [6]
    assert schedule.chunk_layers(8, 2, 2, 0) == (range(2), range(4, 6))
    assert schedule.chunk_layers(8, 2, 2, 1) == (range(2, 4), range(6, 8))
    assert schedule.chunk_layers(8, 2, 4, 0) == (range(1), range(2, 3), range(4, 5),
                                                 range(6, 7))
    assert schedule.rank_layers(8, 2, 2, 1) == [2, 3, 6, 7]
    # the schedule is walked for layouts the rules accepted (megatron_kd.arch.check_layout
    # refuses 8 layers over 2 x 3 chunks: tests/unit/test_layout.py); anything else is a bug
    with pytest.raises(AssertionError):
        schedule.chunk_layers(8, 2, 3, 0)


# p=2, v=2, m=4, written out by hand from Megatron-Core's schedule table (groups of p=2
# micro-batches: forwards (mb, chunk) 0.0 1.0 0.1 1.1 2.0 3.0 2.1 3.1; backwards the same with the
# chunks reversed: 0.1 1.1 0.0 1.0 2.1 3.1 2.0 3.0). Rank 0: 2(p-1) + (v-1)p = 4 warm-up forwards,
# rank 1: 2; then one forward and one backward in turn, then the rest of the backwards.
RANK0 = ["F0.0", "F1.0", "F0.1", "F1.1",
         "F2.0", "B0.1", "F3.0", "B1.1", "F2.1", "B0.0", "F3.1", "B1.0",
         "B2.1", "B3.1", "B2.0", "B3.0"]
RANK1 = ["F0.0", "F1.0",
         "F0.1", "B0.1", "F1.1", "B1.1", "F2.0", "B0.0", "F3.0", "B1.0", "F2.1", "B2.1",
         "F3.1", "B3.1",
         "B2.0", "B3.0"]


def _walk(ops: list[str], chunk_bytes: list[float]) -> float:
    """The most bytes held along a hand-written schedule."""
    held = peak = 0.0
    for op in ops:
        size = chunk_bytes[int(op.split(".")[1])]
        held += size if op[0] == "F" else -size
        peak = max(peak, held)
    return peak


@pytest.mark.parametrize("stage, ops", [(0, RANK0), (1, RANK1)])
def test_interleaved_peak_against_hand_enumerated_schedule(stage, ops):
    assert schedule.interleaved_in_flight_chunks(2, 2, stage, 4) == _walk(ops, [1, 1])
    # counts: rank 0 holds 5 chunk-micro-batches (p*v + p - 1), rank 1 holds 3 ((v-1)p + 1)
    assert _walk(ops, [1, 1]) == (5 if stage == 0 else 3)
    # chunks of different sizes (a hybrid model): rank 0 peaks at 0.0 1.0 0.1 1.1 2.0 =
    # 10 + 10 + 100 + 100 + 10 = 230, rank 1 at 0.0 1.0 0.1 = 120
    assert schedule.peak_in_flight([10, 100], 2, stage, 4) == _walk(ops, [10, 100])
    assert _walk(ops, [10, 100]) == (230 if stage == 0 else 120)


def test_interleaved_first_stage_matches_korthikanti():
    # p=4, v=2, m=8, 16 layers (chunks of 2): the first stage holds 2*3 + 1*4 + 1 = 11 chunks =
    # 22 layers' worth = L * (1 + (p-1)/(p*v)) = 16 * 11/8; 1F1B (v=1): p * L/p = 16 layers
    layout = ParallelLayout(pp=4, vp=2)
    assert mem.stage_activation_bytes(G16, layout, 0, 8, 1, 8) == 22 * FULL
    assert mem.stage_activation_bytes(G16, ParallelLayout(pp=4), 0, 8, 1, 8) == 16 * FULL
    # the last stage: (v-1)p + 1 = 5 chunks = 10 layers (1F1B: one micro-batch of 4 layers)
    assert mem.stage_activation_bytes(G16, layout, 3, 8, 1, 8) == 10 * FULL
    # all micro-batches in warm-up (m=4 < 2*3 + 4 + 1): every chunk of every micro-batch,
    # 4 * 2 chunks * 2 layers
    assert mem.stage_activation_bytes(G16, layout, 0, 8, 1, 4) == 16 * FULL
    # m = 6 micro-batches with pp 4: refused by the layout rules before any count
    with pytest.raises(ValueError, match="6 microbatches a step .* is not a multiple of it"):
        check_layout(G16.arch, layout, num_microbatches=6)


@pytest.mark.parametrize(
    "method, n, expected",
    [
        # uniform: groups of n layers, each keeps its input; the largest group is re-run live
        ("uniform", 1, 8 * INPUT + FULL),
        ("uniform", 2, 4 * INPUT + 2 * FULL),
        ("uniform", 8, 1 * INPUT + 8 * FULL),
        # block: the first n layers checkpointed one by one, the other 8 - n keep everything
        ("block", 3, 3 * INPUT + 5 * FULL + FULL),
        ("block", 8, 8 * INPUT + FULL),
        ("block", 10, 8 * INPUT + FULL),  # more than the chunk has: every layer
    ],
)
def test_full_recompute_methods(method, n, expected):
    layout = ParallelLayout(recompute="full", recompute_method=method, recompute_num_layers=n)
    # pp=1, one micro-batch in flight
    assert mem.stage_activation_bytes(G8, layout, 0, 8, 1, 3) == expected


def test_full_recompute_per_chunk_and_recomputed_layers():
    # pp=2, vp=2: chunks of 2 layers; block x1 checkpoints the first layer of each chunk:
    # a chunk keeps INPUT + FULL; the first stage holds 5 chunks (m=4), plus one layer re-run
    layout = ParallelLayout(pp=2, vp=2, recompute="full", recompute_method="block",
                            recompute_num_layers=1)
    assert mem.stage_activation_bytes(G8, layout, 0, 8, 1, 4) == 5 * (INPUT + FULL) + FULL
    # rank 0 chunks [0, 1] [4, 5], rank 1 [2, 3] [6, 7]: the first of each
    assert sorted(mem.recomputed_layers(8, layout)) == [0, 2, 4, 6]
    uniform = ParallelLayout(recompute="full", recompute_method="uniform", recompute_num_layers=2)
    assert mem.recomputed_layers(8, uniform) == list(range(8))
    assert mem.recomputed_layers(8, ParallelLayout(recompute="selective")) == []


# --- the loss
# -------------------------------------------------------------------------------------------


def test_loss_terms():
    stu = _model(
        name="s",
        num_layers=1,
        hidden_size=8,
        num_attention_heads=2,
        num_query_groups=2,
        kv_channels=4,
        ffn_hidden_size=8,
        vocab_size=200,
        tie_embeddings=True,
        vocab_multiple=MEGATRON_PADDING,
    )
    tea = _model(
        name="t",
        num_layers=1,
        hidden_size=16,
        num_attention_heads=2,
        num_query_groups=2,
        kv_channels=8,
        ffn_hidden_size=8,
        vocab_size=250,
        tie_embeddings=True,
        vocab_multiple=MEGATRON_PADDING,
    )
    layout = ParallelLayout(tp=2)  # pads both vocabularies to 256, local 128
    # dense: n=4 tokens * (10*128 + 10*128)
    assert mem.dense_loss_bytes(stu, tea, layout, 4, 1) == 4 * 2560
    # fused, w=2 rows, v=128 local columns, dense teacher: bf16 matmul output 2 + four fp32 buffers
    # 16 -> 2*128*18 = 4608; fp32 grad accumulators: hidden 4*4*8 = 128, output layer 4*128*8 = 4096
    fused = mem.fused_loss_bytes(stu, layout, 4, 1, 2, dense_teacher=True, teacher_hidden_size=16)
    assert fused == FusedLossBytes(window=4608, gradients=4224, gathered=0.0, row_statistics=128)
    # top-K targets (two fp32 buffers), window larger than the 4 rows: clamped, 4*128*10
    assert mem.fused_loss_bytes(stu, layout, 4, 1, 100, dense_teacher=False).window == 5120
    # CPU blocks of 256 elements = 2 rows inside a 4-row window: the logits stay window-sized
    # (bf16 out 2 + fp32 student and teacher 8 -> 4*128*10), the temporaries a block's (2*128*8)
    assert mem.fused_loss_bytes(stu, layout, 4, 1, 4, dense_teacher=True,
                                block_elements=256).window == 5120 + 2048
    # a block as large as the window changes nothing: 4*128*18
    assert mem.fused_loss_bytes(stu, layout, 4, 1, 4, dense_teacher=True,
                                block_elements=1 << 21).window == 4 * 128 * 18
    # sequence parallel: the gathered student and teacher hidden states, 4 tokens * (8 + 16) * 2
    # bytes
    sp = ParallelLayout(tp=2, sequence_parallel=True)
    assert (
        mem.fused_loss_bytes(stu, sp, 4, 1, 2, dense_teacher=True, teacher_hidden_size=16).gathered
        == 192
    )
    # the loss's default window: 2^24 fp32 elements / 128 local columns
    assert mem.window_rows(stu, layout, None) == 131072
    # cache, decoded: one micro-batch in use * 4 tokens * K=3 * (int64 id 8 + fp32 log-prob 4)
    assert mem.cache_reader_bytes(4, 1, 3) == 144
    # where the host queue is device memory (CPU): D=2 queued + 1 decoding + 1 in use = 4
    assert mem.cache_reader_bytes(4, 1, 3, 4) == 576
    with pytest.raises(ValueError, match="resident_microbatches=0"):
        mem.cache_reader_bytes(4, 1, 3, 0)
    # ring, D=3: 3 slots * 4 tokens * 16 * 2 bytes / t=2 = 192; gathered 4*16*2 = 128
    assert mem.ring_bytes(tea, layout, 4, 1, 3) == RingBytes(slots=192, gathered_hidden=128)
    # teacher output layer shard: 256/2 * 16 * 2 bytes
    assert mem.teacher_output_layer_bytes(tea, layout) == 4096
    with pytest.raises(ValueError, match="prefetch_depth"):
        mem.ring_bytes(tea, layout, 4, 1, 0)


def test_gpu_path_loss_terms():
    """The fused loss's GPU path (``gpu=GpuLoss(...)``): windows of input-dtype logits from a
    byte budget, balanced in whole 128-row tiles, and its gradient accumulators."""
    stu = _model(name="s", num_layers=1, hidden_size=8, num_attention_heads=2, num_query_groups=2,
                 kv_channels=4, ffn_hidden_size=8, vocab_size=200, tie_embeddings=True,
                 vocab_multiple=MEGATRON_PADDING)
    tp1, tp2 = ParallelLayout(tp=1), ParallelLayout(tp=2)  # vocabularies padded to 256
    default = GpuLoss()
    # TP 1, 4 tokens, a dense teacher: one window of all 4 rows, two models' bf16 logits
    # 4*256*2*2; the hidden gradient in bf16 2*4*8 = 64 and the fp32 accumulator 4*256*8
    fused = mem.fused_loss_bytes(stu, tp1, 4, 1, None, dense_teacher=True, gpu=default)
    assert fused == FusedLossBytes(window=4096, gradients=64 + 8192, gathered=0.0,
                                   row_statistics=128)
    # the other accumulators: fp32 plus a bf16 product (6 bytes), or bf16 alone
    for weight_grad, accumulator in (("fp32_add", 6 * 256 * 8), ("input_dtype", 2 * 256 * 8)):
        got = mem.fused_loss_bytes(stu, tp1, 4, 1, None, dense_teacher=True,
                                   gpu=GpuLoss(weight_grad=weight_grad))
        assert got.gradients == 64 + accumulator
    # top-K targets: the student's logits only, 4*256*2
    assert mem.fused_loss_bytes(stu, tp1, 4, 1, None, dense_teacher=False,
                                gpu=default).window == 2048
    # fp32 inputs: 4-byte logits, an fp32 hidden gradient and accumulator whatever the setting
    fp32 = mem.fused_loss_bytes(stu, tp1, 4, 1, None, dense_teacher=True, activation_bytes=4,
                                gpu=GpuLoss(weight_grad="input_dtype"))
    assert (fp32.window, fp32.gradients) == (4 * 256 * 2 * 4, 4 * 4 * 8 + 4 * 256 * 8)
    # TP 2: 128 local columns, a 1 KiB budget holds 1024 // (2*128*2) = 2 rows: 2 windows of 2;
    # the hidden gradient in fp32 (summed over the shards) 4*4*8
    fused = mem.fused_loss_bytes(stu, tp2, 4, 1, None, dense_teacher=True,
                                 gpu=GpuLoss(window_bytes=1024))
    assert fused == FusedLossBytes(window=2 * 128 * 2 * 2, gradients=128 + 4 * 128 * 8,
                                   gathered=0.0, row_statistics=128)
    # balanced whole tiles: a 1 MiB budget caps 2048 rows, 5000 tokens take 3 windows of
    # 1667 -> 1792 (14 tiles); under a 1000-row --kd-window-size, 5 windows of 1000 (a whole
    # tile's 1024 would pass the bound)
    budget = GpuLoss(window_bytes=1 << 20)
    assert mem.window_rows(stu, tp2, None, budget, 5000) == 1792
    assert mem.window_rows(stu, tp2, 1000, budget, 5000) == 1000
    assert mem.window_rows(stu, tp2, None, budget, 100) == 100  # fewer tokens than the cap
    with pytest.raises(ValueError, match="n_rows"):
        mem.window_rows(stu, tp2, None, budget)
    with pytest.raises(ValueError, match="window_bytes"):
        GpuLoss(window_bytes=0)
    with pytest.raises(ValueError, match="weight_grad"):
        GpuLoss(weight_grad="fp16")


def test_teacher_inference_terms():
    opts = PlanOptions(
        student=TINY,
        teacher=TINY,
        gpu=GpuSpec(name="g", memory_bytes=1 << 30, bf16_flops=1e12, nvlink_bytes_per_s=1e9),
        inter_node_link=LinkSpec(name="l", bytes_per_s=1e9),
        seq_length=4,
        micro_batch_size=1,
        global_batch_size=1,
        reserve_bytes=0,
    )
    # one stage: TINY's 1352 bf16 params = 2704 bytes, of which the output layer 10*8*2 = 160 is
    # loaded though never run; no-grad forward, n=4 tokens: residual + norm output 4h = 32, plus
    # max(attention 2*(2ad + 2gd) = 48, SwiGLU 6f = 96) = 128 bytes per token -> 512; send slots
    # D=2 * 4 tokens * h=8 * 2 bytes = 128
    layout = ParallelLayout()
    assert search.teacher_inference_terms(opts, layout, 0) == {
        Term.REPLICA_WEIGHTS: 2544,
        Term.REPLICA_OUTPUT_LAYER: 160,
        Term.TEACHER_FORWARD: 512,
        Term.SEND_SLOTS: 128,
        Term.RESERVE: 0,
    }
    # pp=2: stage 0 holds layer 0 + embedding (672 params = 1344 bytes) and sends nothing; the
    # last stage layer 1 + final norm (600 params = 1200 bytes) and the output layer (160)
    layout = ParallelLayout(pp=2)
    first = search.teacher_inference_terms(opts, layout, 0)
    assert first[Term.REPLICA_WEIGHTS] == 1344
    assert Term.REPLICA_OUTPUT_LAYER not in first
    assert Term.SEND_SLOTS not in first
    last = search.teacher_inference_terms(opts, layout, 1)
    assert last[Term.REPLICA_WEIGHTS] == 1200
    assert last[Term.REPLICA_OUTPUT_LAYER] == 160
    # tied, one stage: the embedding is the output layer and is needed for the input anyway:
    # 1352 - 80 = 1272 params = 2544 bytes, no separate output-layer term
    tied = _replace(TINY, tie_embeddings=True)
    opts = dataclasses.replace(opts, teacher=tied)
    terms = search.teacher_inference_terms(opts, ParallelLayout(), 0)
    assert terms[Term.REPLICA_WEIGHTS] == 2544
    assert Term.REPLICA_OUTPUT_LAYER not in terms


# --- FLOPs, time, traffic -----------------------------------------------------------------------


def test_attention_keys():
    # causal, s=8: (1+...+8)/8 = 4.5; window 4: (1+2+3+4+4+4+4+4)/8 = 3.25
    assert tr.attention_keys_mean(8, 8) == 4.5
    assert tr.attention_keys_mean(8, 4) == 3.25


def test_flops_per_token():
    # forward: 2 * 1272 + per layer 4*a*d*keys = 4*2*4*4.5 = 144, two layers -> 2544 + 288
    assert tr.forward_flops_per_token(TINY, 8) == 2832
    assert tr.training_flops_per_token(TINY, 8, "none") == 3 * 2832
    # full recompute runs the layers' forward again, not the output layer's: 2 * 1184 + 288 = 2656
    # (the planner counted 4 x the whole forward, output layer included, before it modelled which
    # layers Megatron-Core recomputes)
    assert tr.training_flops_per_token(TINY, 8, "full") == 3 * 2832 + 2656
    # block recompute of layer 0 only: 2 * 592 + 144
    assert tr.training_flops_per_token(TINY, 8, "full", [0]) == 3 * 2832 + 1328
    assert tr.training_flops_per_token(TINY, 8, "selective") == 3 * 2832 + 288
    # without the output layer: 2 * (1272 - 80) + 288
    assert tr.forward_flops_per_token(TINY, 8, include_output_layer=False) == 2384 + 288


def test_step_time_and_replicas():
    # 1e15 / (8 * 1e14 * 0.5) * (1 + 1/4) = 2.5 * 1.25
    assert tr.step_time_s(1e15, 8, 1e14, 0.5, 2, 4) == pytest.approx(
        3.125, rel=1e-12
    )  # float division
    # one replica: 2 GPUs * 100 * 0.5 / 40 flops = 2.5 tokens/s; 1000 tokens/s needs 400
    assert tr.replicas_needed(1000.0, 2, 100.0, 0.5, 40.0) == (400, 2.5)
    assert tr.replicas_needed(1.0, 2, 100.0, 0.5, 40.0)[0] == 1


def test_tp_collective_and_p2p_bytes():
    # TINY (dense: mixer + MLP per layer), t=2, 8 tokens: a volume is 1/2 * 8 * h=8 * 2 = 64
    # bytes; with SP 5 volumes per sub-layer, 2 more where recomputed: layer 0 2*5, layer 1
    # (recomputed) 2*7 -> 24 volumes * 64 * m=2
    assert tr.tp_collective_bytes_per_step_per_rank(TINY, [0, 1], [1], 2, 8, 1, 2, True) == 3072
    # without SP an all-reduce each way (4 volumes): 2*4 + 2*6 = 20 * 64 * 2
    assert tr.tp_collective_bytes_per_step_per_rank(TINY, [0, 1], [1], 2, 8, 1, 2, False) == 2560
    # a routed-expert MLP stays on its rank: only the mixer, 5 volumes * 64 * 2
    assert tr.tp_collective_bytes_per_step_per_rank(TINY_MOE, [0], [], 2, 8, 1, 2, True) == 640
    assert tr.tp_collective_bytes_per_step_per_rank(TINY, [0, 1], [], 2, 8, 1, 1, True) == 0
    # p2p: m=4 micro-batches * 2v=4 sends * 16 tokens * h=32 * 2 bytes, /t=2 with SP
    assert tr.p2p_bytes_per_step_per_rank(4, 16, 1, 32, 2, True, 2, 2) == 8192
    assert tr.p2p_bytes_per_step_per_rank(4, 16, 1, 32, 2, False, 2, 2) == 16384
    assert tr.p2p_bytes_per_step_per_rank(4, 16, 1, 32, 2, False, 1, 1) == 0


def test_wire_bytes():
    tea = _model(
        name="t",
        num_layers=1,
        hidden_size=32,
        num_attention_heads=2,
        num_query_groups=2,
        kv_channels=16,
        ffn_hidden_size=8,
        vocab_size=10,
        tie_embeddings=True,
    )
    # G=8 sequences over dp=2 -> 4 per DP rank * s=16 * h_t=32 * 2 bytes (bf16)
    assert tr.hidden_bytes_per_step_per_dp_rank(tea, 8, 2, 16) == 4096
    assert tr.hidden_bytes_per_step_per_dp_rank(tea, 8, 2, 16, "fp32") == 8192
    # fp8: one byte an element plus a 4-byte scale per token: 64 tokens * (32 + 4)
    assert tr.hidden_bytes_per_step_per_dp_rank(tea, 8, 2, 16, "fp8") == 2304
    # token ids the other way: 64 tokens * 4 bytes
    assert tr.token_bytes_per_step_per_dp_rank(8, 2, 16) == 256
    with pytest.raises(ValueError, match="wire dtype must be one of"):
        tr.wire_bytes_per_token(32, "fp16")
    # all-gather: m=4 * 3/4 * 16 tokens * 32 * 2
    assert tr.allgather_bytes_per_step_per_rank(tea, 4, 16, 1, 4) == 3072
    # loss all-reduce: m=4 * 16 rows * 6 stats * 4 bytes * 2*3/4
    assert tr.loss_allreduce_bytes_per_step_per_rank(4, 16, 1, 4, 6) == 2304
    # 16 rows in windows of 5 -> 4 windows * 2 rounds * m=4
    assert tr.loss_allreduce_count_per_step(4, 16, 1, 5) == 32
    assert tr.loss_allreduce_bytes_per_step_per_rank(4, 16, 1, 1, 6) == 0  # tp=1: no peers
    with pytest.raises(ValueError, match="global_batch_size=7"):
        tr.hidden_bytes_per_step_per_dp_rank(tea, 7, 2, 16)


# --- context parallelism -------------------------------------------------------------------------

UNFUSED_TORCH = ActivationOptions(flash_attention=False, fused_softmax=False)


def test_context_parallel_activations():
    # TINY with flash attention, per token: R 2h+2h (attention) + 2h+2h (MLP) = 64; S Q 2ad 16 +
    # K 2gd 8 + V 8 + O 16 + lse 4a 8 + SwiGLU 6f 96 = 152 -> 216; s=8, b=1
    assert mem.layer_activation_bytes(TINY, ParallelLayout(), 0, 8, 1) == 8 * 216
    # CP 2: each rank holds 4 of the 8 tokens
    assert mem.layer_activation_bytes(TINY, ParallelLayout(cp=2), 0, 8, 1) == 4 * 216
    # the local attention with the torch softmax, CP 1: K and V repeated to a=2 heads 2*2ad = 32,
    # scores 2*a*s = 32: S 16 + 32 + 16 + 32 + 96 = 192, + R 64 -> 256 a token; the mask s*s = 64
    assert mem.layer_activation_bytes(TINY, ParallelLayout(), 0, 8, 1, UNFUSED_TORCH) == (
        8 * 256 + 64)
    # CP 2: the gathered K and V of the whole sequence, 2*2ad*cp = 64; scores of local queries
    # against every key, 2*a*s = 32: S 16 + 64 + 16 + 32 + 96 = 224, + R 64 -> 288 a local
    # token; the mask [s/cp, s] = 4*8
    assert mem.layer_activation_bytes(TINY, ParallelLayout(cp=2), 0, 8, 1, UNFUSED_TORCH) == (
        4 * 288 + 32)
    # one [b, a, s/cp, s] score tensor: 1 * 2 * 4 * 8 * 2 bytes
    assert mem.attention_score_bytes(TINY, ParallelLayout(cp=2), 8, 1, UNFUSED_TORCH) == 128


def test_context_parallel_model_state_and_world():
    layout = ParallelLayout(cp=2, dp=2, use_distributed_optimizer=True)
    assert layout.world_size == 4 and layout.optimizer_shards == 4
    # TINY's parameters on one rank: 2 layers * (attention 64+32+32+64 + SwiGLU 3*8*16 + norms
    # 16) = 1184, embedding 128*8 (V padded to 128), final norm 8, output layer 128*8 -> 3240;
    # weights and gradients are replicated over cp, Adam's 12 bytes shard over dp*cp = 4
    padded = _replace(TINY, vocab_multiple=MEGATRON_PADDING)
    state = mem.model_state_bytes(padded, layout, 0, Precision(), trainable=True)
    assert state == ModelState(weights=2 * 3240, grads=4 * 3240, optimizer=12 * 3240 // 4)
    # experts fold context parallelism into their grid: ep*etp must divide tp*cp*dp
    assert ParallelLayout(cp=2, dp=1, ep=2).expert_data_parallel_size == 1
    with pytest.raises(ValueError, match="expert-model-parallel-size 4 x "
                       "expert-tensor-parallel-size 1 does not divide the 2 ranks"):
        ParallelLayout(cp=2, dp=1, ep=4)


def test_default_context_parallel_exchange():
    # Transformer Engine runs attention sinks and sliding windows with context parallelism only
    # as a2a: what the planner takes for gpt-oss when none is given
    from megatron_kd.planner.presets import MODEL_PRESETS

    gpt_oss = MODEL_PRESETS["gpt-oss-20b"]
    assert mem.default_cp_comm_type(gpt_oss) == "a2a" and mem.default_cp_comm_type(TINY) == "p2p"


def test_context_parallel_exchange():
    # a local K/V chunk: 8/2 tokens * 2 (K, V) * g=1 * d=4 = 32 elements
    # memory, one layer's buffers: p2p four chunks, 128 elements * 2 bytes
    assert mem.cp_exchange_bytes(TINY, ParallelLayout(cp=2), 8, 1) == 256
    # all_gather: the whole sequence's K, V and their gradients: 4 * 8 * 2 * 4 = 256 elements
    assert mem.cp_exchange_bytes(TINY, ParallelLayout(cp=2, cp_comm_type="all_gather"), 8,
                                 1) == 512
    # a2a: the sequence-gathered Q, K, V of 1/cp of the heads: 8 * (2 + 2*1) * 4 / 2 elements
    assert mem.cp_exchange_bytes(TINY, ParallelLayout(cp=2, cp_comm_type="a2a"), 8, 1) == 128
    assert mem.cp_exchange_bytes(TINY, ParallelLayout(), 8, 1) == 0
    # traffic, p2p: 3 (cp-1) chunks of 64 bytes per layer: 2 layers * 192; layer 1 recomputed
    # sends its forward chunk again (+64); m=1
    args = (1, 8, 1, 1, 2)
    assert tr.cp_exchange_bytes_per_step_per_rank(TINY, [0, 1], [], *args, "p2p") == 384
    assert tr.cp_exchange_bytes_per_step_per_rank(TINY, [0, 1], [1], *args, "p2p") == 448
    assert tr.cp_exchange_bytes_per_step_per_rank(TINY, [0, 1], [], *args, "all_gather") == 384
    # a2a: (cp-1)/cp of 4 local tokens * (2a + 2g) * d * 2 bytes = 96 each way, per layer
    assert tr.cp_exchange_bytes_per_step_per_rank(TINY, [0, 1], [], *args, "a2a") == 384
    assert tr.cp_exchange_bytes_per_step_per_rank(TINY, [0, 1], [], 1, 8, 1, 1, 1, "p2p") == 0
    # a teacher's forward over its 4 local tokens: 4 * (4h 32 + SwiGLU 6f 96) + the p2p buffers
    assert mem.teacher_forward_working_bytes(TINY, ParallelLayout(cp=2), 8, 1) == 4 * 128 + 256


def test_context_parallel_loss_ring_and_cache():
    stu = _replace(TINY, vocab_size=200, vocab_multiple=MEGATRON_PADDING)
    tea = _replace(TINY, hidden_size=16, vocab_size=250, vocab_multiple=MEGATRON_PADDING)
    layout = ParallelLayout(tp=2, cp=2)  # local vocabulary 128; 2 of the 4 rows on each rank
    # window w=2 rows: 2*128*(2 + 8) + a block of the elementwise temporaries 2*128*8; gradients
    # 4*2*8 (hidden, the rank's rows) + 4*128*8 (output layer); 8 statistics * 4 bytes * 2 rows
    fused = mem.fused_loss_bytes(stu, layout, 4, 1, 2, dense_teacher=True, teacher_hidden_size=16)
    assert fused == FusedLossBytes(window=4608, gradients=4160, gathered=0.0, row_statistics=64)
    # the dense loss over the rank's 2 rows: 2 * (10*128 + 10*128)
    assert mem.dense_loss_bytes(stu, tea, layout, 4, 1) == 2 * 2560
    # ring D=3: each rank receives 1/t of its 2 positions: 3 * 2 * 16 * 2 / 2; gathered 2*16*2
    assert mem.ring_bytes(tea, layout, 4, 1, 3) == RingBytes(slots=96, gathered_hidden=64)
    # cache: the whole micro-batch decoded (4 * 3 * 12) and the rank's half of it selected
    assert mem.cache_reader_bytes(4, 1, 3, cp=2) == 144 + 72
    # loss all-reduces over the rank's rows: m=4 * 8 rows * 6 stats * 4 bytes * 2*3/4
    assert tr.loss_allreduce_bytes_per_step_per_rank(4, 16, 1, 4, 6, cp=2) == 1152


def test_total_bytes_counts_the_larger_phase():
    terms = {Term.ACTIVATIONS: 10.0, Term.TEACHER_FORWARD: 5.0, Term.ATTENTION_BACKWARD: 3.0,
             Term.CP_EXCHANGE: 4.0}
    # the teacher's forward (5) and the attention backward (3 + 4) never overlap
    assert mem.total_bytes(terms) == 10 + 7
    assert mem.total_bytes({Term.ACTIVATIONS: 10.0, Term.TEACHER_FORWARD: 5.0}) == 15
    assert mem.total_bytes({Term.ACTIVATIONS: 10.0}) == 10


def _p2p(pp: int, rank: int, vp: int | None) -> types.SimpleNamespace:
    """What ``get_pp_rank_microbatches`` asks of a P2P communicator: the pipeline group's size and
    this rank, and the virtual pipeline size (None without interleaving)."""
    group = types.SimpleNamespace(size=lambda: pp, rank=lambda: rank)
    return types.SimpleNamespace(pp_group=group, virtual_pipeline_model_parallel_size=vp)


def test_pipeline_schedule_is_megatron_cores():
    # the forwards' chunk order and every rank's warm-up, against Megatron-Core's own functions
    # (the group size defaults to pp), for several p, v and m (m a multiple of p, as it requires)
    # Megatron-Core (and torch) only here: the rest of this module plans without them
    from megatron.core.pipeline_parallel import schedules as mcore_schedules
    for pp in (2, 3, 4):
        for vp in (2, 3, 4):
            for m in (pp, 2 * pp, 5 * pp):
                table = mcore_schedules.get_schedule_table(m, vp, pp)
                assert schedule.schedule_chunks(pp, vp, m) == [chunk for _, chunk in table]
                for rank in range(pp):
                    _, _, warmup, _ = mcore_schedules.get_pp_rank_microbatches(
                        m, vp, pp, p2p_communicator=_p2p(pp, rank, vp))
                    assert schedule.interleaved_warmup(pp, vp, rank, m) == warmup
        # 1F1B: p - r - 1 warm-up forwards, then one in flight more
        for m in (1, pp, 3 * pp + 1):
            for rank in range(pp):
                _, _, warmup, _ = mcore_schedules.get_pp_rank_microbatches(
                    m, 1, pp, p2p_communicator=_p2p(pp, rank, None))
                assert schedule.in_flight_microbatches(pp, rank, m) == min(warmup + 1, m)
