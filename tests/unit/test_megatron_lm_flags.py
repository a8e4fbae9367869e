"""``megatron_lm_flags(arch)``: the Megatron-LM model flags of an architecture, read back by the
flag reader into the same architecture (Llama-3.2-3B and Llama-3.1-8B with their RoPE scaling,
a Qwen3-MoE shape, a GPT-2-style LayerNorm model with biases); a model those flags cannot say
(a Gated DeltaNet hybrid, gpt-oss) is refused naming what. The literal flag lists are written
from the models' published configs, not from the function."""

import dataclasses

import pytest

from megatron_kd.arch import GPTArchConfig
from megatron_kd.arch.megatron_lm_args import (
    arch_from_megatron_lm_args,
    megatron_lm_flags,
    parse_megatron_lm_flags,
)

# meta-llama/Llama-3.2-3B config.json: 28 layers, h 3072, 24 heads, 8 KV heads, MLP 8192,
# vocabulary 128,256, RoPE base 500,000 with llama3 scaling factor 32, tied embeddings
LLAMA_32_3B = GPTArchConfig(
    num_layers=28, hidden_size=3072, num_attention_heads=24, num_query_groups=8,
    ffn_hidden_size=8192, vocab_size=128256, padded_vocab_size=128256,
    max_position_embeddings=131072, rotary_base=500000.0, norm_epsilon=1e-5,
    tie_embeddings=True, rope_scaling_factor=32.0)
LLAMA_32_3B_FLAGS = (
    "--num-layers 28 --hidden-size 3072 --ffn-hidden-size 8192 --num-attention-heads 24 "
    "--group-query-attention --num-query-groups 8 --max-position-embeddings 131072 "
    "--position-embedding-type rope --rotary-base 500000 --use-rope-scaling "
    "--rope-scaling-factor 32 --normalization RMSNorm --norm-epsilon 1e-05 --swiglu "
    "--disable-bias-linear --init-method-std 0.02").split()
# meta-llama/Llama-3.1-8B: 32 layers, h 4096, 32 heads / 8, MLP 14336, factor 8, untied
LLAMA_31_8B = dataclasses.replace(
    LLAMA_32_3B, num_layers=32, hidden_size=4096, num_attention_heads=32,
    ffn_hidden_size=14336, tie_embeddings=False, rope_scaling_factor=8.0)
QWEN3_MOE = GPTArchConfig(
    num_layers=4, hidden_size=64, num_attention_heads=4, num_query_groups=2, kv_channels=32,
    ffn_hidden_size=96, vocab_size=1000, padded_vocab_size=1024, max_position_embeddings=4096,
    rotary_base=1000000.0, norm_epsilon=1e-6, qk_layernorm=True, num_experts=8,
    moe_ffn_hidden_size=24, moe_router_topk=2)
GPT2_STYLE = GPTArchConfig(
    num_layers=2, hidden_size=48, num_attention_heads=4, num_query_groups=4,
    ffn_hidden_size=192, vocab_size=300, padded_vocab_size=384, max_position_embeddings=128,
    normalization="LayerNorm", swiglu=False, tie_embeddings=True, add_bias_linear=True,
    position_embedding_type="learned_absolute", init_method_std=0.01)


def _read_back(flags: list[str], arch: GPTArchConfig) -> GPTArchConfig:
    args = parse_megatron_lm_flags(" ".join(flags))
    return arch_from_megatron_lm_args(args, embedding_rows=arch.padded_vocab_size,
                                      vocab_size=arch.vocab_size)


def test_llama_3_2_3b_flags_are_its_published_shape():
    assert megatron_lm_flags(LLAMA_32_3B) == LLAMA_32_3B_FLAGS


@pytest.mark.parametrize("arch", [LLAMA_32_3B, LLAMA_31_8B, QWEN3_MOE, GPT2_STYLE],
                         ids=["llama-3.2-3b", "llama-3.1-8b", "qwen3-moe", "gpt2-style"])
def test_flags_read_back_as_the_same_architecture(arch):
    assert _read_back(megatron_lm_flags(arch), arch) == arch


def test_the_flags_omit_no_difference():
    """Each field the flags carry changes them: a model one field away gives other flags."""
    base = megatron_lm_flags(LLAMA_32_3B)
    for change in ({"rope_scaling_factor": None}, {"rope_scaling_factor": 8.0},
                   {"rotary_base": 10000.0}, {"tie_embeddings": False}, {"norm_epsilon": 1e-6},
                   {"num_query_groups": 24}, {"qk_layernorm": True}, {"kv_channels": 64}):
        assert megatron_lm_flags(dataclasses.replace(LLAMA_32_3B, **change)) != base, change


@pytest.mark.parametrize("change, named", [
    ({"linear_attention_layers": [0, 1, 2], "linear_num_key_heads": 2,
      "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16},
     "Gated DeltaNet layers"),
    ({"attention_sinks": True}, "attention sinks"),
    ({"rotary_percent": 0.25}, "partial RoPE"),
])
def test_a_model_the_flags_cannot_say_is_refused_naming_what(change, named):
    with pytest.raises(ValueError, match=named):
        megatron_lm_flags(dataclasses.replace(LLAMA_32_3B, **change))


def _tool():
    import importlib.util
    import os

    path = os.path.join(os.path.dirname(__file__), "..", "..", "tools", "write_model_args.py")
    spec = importlib.util.spec_from_file_location("write_model_args", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_shipped_model_args_files_are_the_presets():
    """``examples/megatron_lm/model_args/*.txt`` equal what the presets give (no drift), one
    for each preset the flags can say; Llama-3.2-3B's reads back as its published shape."""
    import os

    tool = _tool()
    assert tool.main(["--check"]) == 0
    assert sorted(os.listdir(tool.DIRECTORY)) == sorted(tool.expected())
    assert {"llama-3.2-3b.txt", "llama-3.1-8b.txt", "qwen3-8b.txt"} <= set(tool.expected())
    assert "qwen3.5-9b.txt" not in tool.expected()  # a Gated DeltaNet hybrid
    path = os.path.join(tool.DIRECTORY, "llama-3.2-3b.txt")
    args = parse_megatron_lm_flags(path)
    assert arch_from_megatron_lm_args(args, embedding_rows=128256) == LLAMA_32_3B
