""":class:`~megatron_kd.arch.GPTArchConfig` -> a Hugging Face ``config.json``: the
inverse of :func:`megatron_kd.arch.hf_config.arch_from_hf_config`, one class per model
family (Llama, Qwen3, Qwen3-MoE, gpt-oss, Qwen3.5, Qwen3.5-MoE).

A config is either the one the checkpoint came from (:func:`config_for_export`: what
``import-hf`` kept, or one given by the user) or built from the architecture
(:func:`hf_config_from_arch`: the fields the architecture determines, everything else left to
transformers' defaults, token ids among them). Either way the config must import back to the
checkpoint's architecture (:func:`check_config_describes`): a field no family expresses (a
LayerNorm, biases on a Llama, learned positions...) is refused by name, never dropped.

Pure Python.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from megatron_kd.arch.config import GPTArchConfig
from megatron_kd.arch.hf_config import arch_from_hf_config

__all__ = ["HF_FAMILIES", "HFFamily", "canonical_arch", "check_config_describes",
           "config_for_export", "family_of", "hf_config_from_arch"]

# Fields that do not change the weights or the function the model computes, or that the
# embedding's padding (not the config) decides.
_NOT_COMPARED = ("init_method_std", "padded_vocab_size")


def _rope(arch: GPTArchConfig) -> dict[str, Any]:
    if arch.position_embedding_type == "yarn":
        return {"rope_type": "yarn", "rope_theta": arch.rotary_base, "factor": arch.yarn_factor,
                "original_max_position_embeddings": arch.yarn_original_max_position_embeddings,
                "beta_fast": arch.yarn_beta_fast, "beta_slow": arch.yarn_beta_slow,
                "truncate": arch.yarn_truncate}
    return {"rope_type": "default", "rope_theta": arch.rotary_base}


class HFFamily:
    """One Hugging Face model family: its ``model_type``, causal-LM class and the config
    fields an architecture gives it."""

    model_type: str
    architecture: str

    def matches(self, arch: GPTArchConfig) -> bool:
        """Whether ``arch`` is this family's (the first family that matches is taken)."""
        raise NotImplementedError

    def fields(self, arch: GPTArchConfig) -> dict[str, Any]:
        """The config fields ``arch`` determines (beyond the Llama ones)."""
        return {}

    def config(self, arch: GPTArchConfig, vocab_rows: int) -> dict[str, Any]:
        return {
            "architectures": [self.architecture], "model_type": self.model_type,
            "vocab_size": vocab_rows, "hidden_size": arch.hidden_size,
            "intermediate_size": arch.ffn_hidden_size, "num_hidden_layers": arch.num_layers,
            "num_attention_heads": arch.num_attention_heads,
            "num_key_value_heads": arch.query_groups, "head_dim": arch.head_dim,
            "max_position_embeddings": arch.max_position_embeddings,
            "rms_norm_eps": arch.norm_epsilon, "tie_word_embeddings": arch.tie_embeddings,
            "initializer_range": arch.init_method_std, "hidden_act": "silu",
            "attention_bias": arch.add_qkv_bias, "rope_parameters": _rope(arch),
            **self.fields(arch)}


class _Llama(HFFamily):
    model_type, architecture = "llama", "LlamaForCausalLM"

    def matches(self, arch):
        return True

    def fields(self, arch):
        return {"mlp_bias": arch.add_bias_linear}


class _Qwen3(HFFamily):
    model_type, architecture = "qwen3", "Qwen3ForCausalLM"

    def matches(self, arch):
        return arch.qk_layernorm


class _Qwen3Moe(HFFamily):
    model_type, architecture = "qwen3_moe", "Qwen3MoeForCausalLM"

    def matches(self, arch):
        return arch.num_experts is not None

    def fields(self, arch):
        return {"num_experts": arch.num_experts, "num_experts_per_tok": arch.moe_router_topk,
                "moe_intermediate_size": arch.expert_ffn_hidden_size,
                # HF renormalises the top k when norm_topk_prob, Megatron unless pre-softmax
                "norm_topk_prob": not arch.moe_router_pre_softmax,
                "decoder_sparse_step": 1, "mlp_only_layers": []}


class _GptOss(HFFamily):
    model_type, architecture = "gpt_oss", "GptOssForCausalLM"

    def matches(self, arch):
        return arch.attention_sinks

    def fields(self, arch):
        window = set(arch.window_layers if arch.window_layers is not None
                     else range(arch.num_layers) if arch.window_size else ())
        return {"num_local_experts": arch.num_experts,
                "num_experts_per_tok": arch.moe_router_topk,
                "intermediate_size": arch.expert_ffn_hidden_size,
                "sliding_window": arch.window_size,
                "layer_types": ["sliding_attention" if i in window else "full_attention"
                                for i in range(arch.num_layers)],
                "swiglu_limit": arch.activation_clamp}


class _Qwen35(HFFamily):
    model_type, architecture = "qwen3_5_text", "Qwen3_5ForCausalLM"

    def matches(self, arch):
        return arch.linear_attention_layers is not None

    def fields(self, arch):
        linear = set(arch.linear_attention_layers)
        # the multimodal RoPE's three sections (text: three equal position streams, so any
        # split rotates alike); Qwen's own split of the rotated half-width, e.g. 32 -> 11, 11, 10
        half = int(arch.head_dim * arch.rotary_percent) // 2
        third = math.ceil(half / 3)
        return {
            "layer_types": ["linear_attention" if i in linear else "full_attention"
                            for i in range(arch.num_layers)],
            "linear_conv_kernel_dim": arch.linear_conv_kernel_dim,
            "linear_key_head_dim": arch.linear_key_head_dim,
            "linear_value_head_dim": arch.linear_value_head_dim,
            "linear_num_key_heads": arch.linear_num_key_heads,
            "linear_num_value_heads": arch.linear_num_value_heads,
            "rope_parameters": {**_rope(arch), "partial_rotary_factor": arch.rotary_percent,
                                "mrope_section": [third, third, half - 2 * third],
                                "mrope_interleaved": True},
        }


class _Qwen35Moe(_Qwen35):
    model_type, architecture = "qwen3_5_moe_text", "Qwen3_5MoeForCausalLM"

    def matches(self, arch):
        return super().matches(arch) and arch.num_experts is not None

    def config(self, arch, vocab_rows):
        out = super().config(arch, vocab_rows)
        del out["intermediate_size"]  # no dense MLP: every layer's is experts
        return out

    def fields(self, arch):
        return {**super().fields(arch), "num_experts": arch.num_experts,
                "num_experts_per_tok": arch.moe_router_topk,
                "moe_intermediate_size": arch.expert_ffn_hidden_size,
                "shared_expert_intermediate_size": arch.moe_shared_expert_size}


#: Tried in order: the first whose ``matches`` holds is the architecture's family.
HF_FAMILIES: tuple[HFFamily, ...] = (_GptOss(), _Qwen35Moe(), _Qwen35(), _Qwen3Moe(),
                                     _Qwen3(), _Llama())


def family_of(arch: GPTArchConfig) -> HFFamily:
    """The Hugging Face family of ``arch`` (Llama when nothing else matches)."""
    return next(f for f in HF_FAMILIES if f.matches(arch))


def canonical_arch(arch: GPTArchConfig) -> dict[str, Any]:
    """``arch``'s fields with the defaults that have two spellings resolved (a head width of
    ``h / heads`` given or not, one query group per head as None, an expert width equal to the
    MLP's, a window on every layer as None), so equal models compare equal."""
    out = arch.to_dict()
    out.update(kv_channels=arch.head_dim, num_query_groups=arch.query_groups)
    if arch.num_experts is not None:
        out["moe_ffn_hidden_size"] = arch.expert_ffn_hidden_size
    if arch.window_size is not None and arch.window_layers is None:
        out["window_layers"] = list(range(arch.num_layers))
    return out


def check_config_describes(config: Mapping[str, Any], arch: GPTArchConfig, *,
                           what: str = "the config") -> None:
    """``ValueError`` unless ``config`` imports back to ``arch`` (every structural field; the
    vocabulary as ``arch.vocab_size`` tokens in however many rows the config has)."""
    try:
        back = arch_from_hf_config(config, vocab_size=arch.vocab_size,
                                   make_vocab_size_divisible_by=1)
    except ValueError as e:
        raise ValueError(f"{what} is not one this project maps ({e})") from None
    a, b = canonical_arch(arch), canonical_arch(back)
    wrong = [f"{name}: {what} gives {b[name]!r}, the checkpoint has {a[name]!r}"
             for name in a if name not in _NOT_COMPARED and a[name] != b[name]]
    if wrong:
        raise ValueError(f"{what} does not describe the checkpoint ({'; '.join(wrong)})")


def hf_config_from_arch(arch: GPTArchConfig, *, vocab_rows: int | None = None) -> dict[str, Any]:
    """The ``config.json`` of ``arch``'s family: the fields the architecture determines, the
    rest (token ids, dropout, cache...) left to transformers' defaults. ``vocab_rows``: the
    embedding rows to export (default: the true vocabulary). ``ValueError`` when no family
    expresses ``arch`` (naming the fields)."""
    rows = arch.vocab_size if vocab_rows is None else vocab_rows
    config = family_of(arch).config(arch, rows)
    check_config_describes(config, arch, what=f"a {config['model_type']} config")
    return config


def _text_only(config: Mapping[str, Any]) -> dict[str, Any]:
    """A multimodal Qwen3.5 config's language model as its own causal-LM config (the vision
    tower is not imported, so not exported); other configs as they are."""
    if config.get("model_type") not in ("qwen3_5", "qwen3_5_moe") or "text_config" not in config:
        return dict(config)
    text = dict(config["text_config"])
    family = _Qwen35Moe() if config["model_type"] == "qwen3_5_moe" else _Qwen35()
    text.setdefault("tie_word_embeddings", config.get("tie_word_embeddings", False))
    text.update(model_type=family.model_type, architectures=[family.architecture])
    return text


def config_for_export(stored: Mapping[str, Any] | None, arch: GPTArchConfig, *,
                      dtype: str, vocab_rows: int | None = None) -> dict[str, Any]:
    """The ``config.json`` to export: ``stored`` (the source's; a multimodal Qwen3.5's text
    part) when given, checked to describe ``arch``, else built from ``arch``; its dtype set to
    ``dtype`` (``"bfloat16"`` / ``"float32"``) and a quantisation config dropped (the weights
    are written dequantised)."""
    if stored is None:
        config = hf_config_from_arch(arch, vocab_rows=vocab_rows)
    else:
        config = _text_only(stored)
        check_config_describes(config, arch, what="the Hugging Face config")
        config.pop("quantization_config", None)
    config["dtype"] = dtype
    if "torch_dtype" in config:  # transformers 4's name
        config["torch_dtype"] = dtype
    return config
