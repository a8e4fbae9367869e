"""Tiny random Llama / Qwen3 / Qwen3-MoE / gpt-oss / Qwen3.5 models saved as safetensors, with
transformers' own logits on fixed tokens: the independent reference of the import tests."""

from __future__ import annotations

import os

import torch

SEQ = 13  # odd, not a power of two
BATCH = 2


def _randomise_and_save(model, out: str, vocab: int, seed: int):
    """Non-trivial weights (norms in [0.5, 1.5], so a swapped norm is caught), saved as
    safetensors, with the model's logits on fixed tokens."""
    torch.manual_seed(seed)
    model = model.float().eval()
    with torch.no_grad():
        for name_, p in model.named_parameters():
            if "norm" in name_:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.1)
    model.save_pretrained(out, safe_serialization=True)
    torch.manual_seed(0)
    tokens = torch.randint(0, vocab, (BATCH, SEQ))
    with torch.no_grad():
        logits = model(tokens).logits  # [b, s, V]
    return out, tokens, logits


def tiny_llama(tmp_path, *, tied: bool, vocab: int = 203, name: str = "hf", groups: int = 2,
               ffn: int = 72, llama3_rope_factor: float | None = None):
    """A randomly initialised tiny Llama (GQA: 6 heads in ``groups`` groups) as safetensors;
    with ``llama3_rope_factor``, Llama-3.1 / 3.2's RoPE scaling (base 500,000, as theirs, so
    that the scaling moves two of the four frequencies)."""
    from transformers import LlamaConfig, LlamaForCausalLM  # the tests skip without it

    rope = {}
    if llama3_rope_factor is not None:
        rope = {"rope_theta": 500000.0, "rope_scaling": {
            "rope_type": "llama3", "factor": llama3_rope_factor, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}
    config = LlamaConfig(
        vocab_size=vocab,  # odd: padded to 256 by the import
        hidden_size=48,
        intermediate_size=ffn,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=groups,
        max_position_embeddings=131072 if rope else 64,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tied,
        attention_bias=False,
        mlp_bias=False,
        **({"rope_theta": 5000.0} | rope),
    )
    torch.manual_seed(7 if tied else 8)
    model = LlamaForCausalLM(config)
    out = os.path.join(tmp_path, f"{name}_{'tied' if tied else 'untied'}")
    return _randomise_and_save(model, out, vocab, 7 if tied else 8)


# Shared by the tiny Qwen3 models: a head width (16) that is not hidden / heads (12), as in
# Qwen3 itself (Qwen3-0.6B: head_dim 128, hidden 1024, 16 heads).
_QWEN3_SHAPE = dict(hidden_size=48, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                    num_hidden_layers=2, max_position_embeddings=64, rms_norm_eps=1e-6,
                    rope_theta=1000000.0, attention_bias=False)


def tiny_qwen3(tmp_path, *, vocab: int = 203, tied: bool = True, name: str = "qwen3",
               layers: int = 2):
    """A randomly initialised tiny Qwen3 (QK norms, head_dim != hidden / heads)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM  # the tests skip without it

    config = Qwen3Config(vocab_size=vocab, intermediate_size=72, tie_word_embeddings=tied,
                         **{**_QWEN3_SHAPE, "num_hidden_layers": layers})
    torch.manual_seed(9)
    return _randomise_and_save(Qwen3ForCausalLM(config), os.path.join(tmp_path, name), vocab, 9)


def tiny_qwen3_moe(tmp_path, *, vocab: int = 203, norm_topk_prob: bool = True,
                   name: str = "qwen3_moe"):
    """A randomly initialised tiny Qwen3-MoE: 4 experts of width 24, top 2, untied."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM  # the tests skip without it

    config = Qwen3MoeConfig(vocab_size=vocab, intermediate_size=72, moe_intermediate_size=24,
                            num_experts=4, num_experts_per_tok=2, norm_topk_prob=norm_topk_prob,
                            tie_word_embeddings=False, **_QWEN3_SHAPE)
    torch.manual_seed(10)
    return _randomise_and_save(Qwen3MoeForCausalLM(config), os.path.join(tmp_path, name),
                               vocab, 10)


def tiny_gpt_oss(tmp_path, *, vocab: int = 203, name: str = "gpt_oss"):
    """A randomly initialised tiny gpt-oss: sinks, sliding (window 4 < SEQ) and full layers,
    biased attention and experts (4, top 2), the clamped MLP (expert biases large enough that
    the clamp at 7 acts), YaRN RoPE as in the released models."""
    from transformers import GptOssConfig, GptOssForCausalLM  # the tests skip without it

    config = GptOssConfig(
        vocab_size=vocab, hidden_size=48, intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
        num_experts_per_tok=2, sliding_window=4,
        layer_types=["sliding_attention", "full_attention"] * 2, max_position_embeddings=4096,
        rms_norm_eps=1e-5, attention_bias=True, tie_word_embeddings=False,
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0,
                         "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                         "original_max_position_embeddings": 128})
    torch.manual_seed(11)
    model = GptOssForCausalLM(config).float().eval()
    out = os.path.join(tmp_path, name)
    path, tokens, _ = _randomise_and_save(model, out, vocab, 11)
    with torch.no_grad():  # sinks and expert biases on the released models' scale
        for p_name, p in model.named_parameters():
            if p_name.endswith("sinks"):
                p.normal_(0.0, 1.0)
            elif p_name.endswith("gate_up_proj_bias"):
                p.normal_(0.0, 4.0)
        model.save_pretrained(out, safe_serialization=True)
        logits = model(tokens).logits
    return path, tokens, logits


# Shared by the tiny Qwen3.5 models: Gated DeltaNet layers (2 key heads of 16, 4 value heads of
# 12, conv width 4) and gated full-attention layers (head_dim 16 != 48 / 4, RoPE on a quarter
# of each head), as in Qwen3.5 itself.
def _qwen35_shape(layer_types):
    return dict(hidden_size=48, num_hidden_layers=len(layer_types), layer_types=layer_types,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                linear_value_head_dim=12, linear_conv_kernel_dim=4, max_position_embeddings=64,
                rms_norm_eps=1e-6, attention_bias=False, tie_word_embeddings=False,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                 "partial_rotary_factor": 0.25, "mrope_section": [1, 1, 0],
                                 "mrope_interleaved": True})


def tiny_qwen35(tmp_path, *, vocab: int = 203, name: str = "qwen3_5"):
    """A randomly initialised tiny Qwen3.5 text model: DeltaNet, attention, DeltaNet, attention."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig  # the tests skip without it

    config = Qwen3_5TextConfig(vocab_size=vocab, intermediate_size=72, **_qwen35_shape(
        ["linear_attention", "full_attention"] * 2))
    torch.manual_seed(12)
    return _randomise_and_save(Qwen3_5ForCausalLM(config), os.path.join(tmp_path, name), vocab,
                               12)


def tiny_qwen35_moe(tmp_path, *, vocab: int = 203, name: str = "qwen3_5_moe"):
    """A randomly initialised tiny Qwen3.5-MoE: 4 experts of width 24, top 2, a gated shared
    expert of width 40; three DeltaNet layers, then attention."""
    from transformers import (  # the tests skip without it
        Qwen3_5MoeForCausalLM,
        Qwen3_5MoeTextConfig,
    )

    config = Qwen3_5MoeTextConfig(
        vocab_size=vocab, moe_intermediate_size=24, num_experts=4, num_experts_per_tok=2,
        shared_expert_intermediate_size=40,
        **_qwen35_shape(["linear_attention"] * 3 + ["full_attention"]))
    config._experts_implementation = "eager"  # an fp32 loop like Megatron's SequentialMLP
    torch.manual_seed(13)
    return _randomise_and_save(Qwen3_5MoeForCausalLM(config), os.path.join(tmp_path, name),
                               vocab, 13)


def bpe_tokenizer(vocab: dict[str, int], merges: list[tuple[str, str]]):
    """A ``tokenizers`` BPE tokenizer from a vocabulary and merges."""
    from tokenizers import Tokenizer, models  # the tests skip without it

    return Tokenizer(models.BPE(vocab=vocab, merges=merges))
