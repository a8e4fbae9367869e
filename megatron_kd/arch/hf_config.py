"""Hugging Face configs -> :class:`~megatron_kd.arch.GPTArchConfig`: Llama, Qwen3,
Qwen3-MoE, gpt-oss and Qwen3.5 (dense and MoE) (the weights' side is
:mod:`megatron_kd.integration.hf_convert`).

Pure Python: what a model type adds to the Llama layout (QK norms, experts and their router
convention, biases, attention sinks, sliding windows, the clamped gated MLP, YaRN RoPE), and a
``ValueError`` naming the config field for anything not mapped.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from megatron_kd.arch.config import GPTArchConfig
from megatron_kd.parallel import pad_vocab_size

__all__ = ["SUPPORTED_MODEL_TYPES", "arch_from_hf_config"]


# Hugging Face model types this converter maps: Llama, and Llama plus QK norms (Qwen3) and
# top-k experts (Qwen3-MoE).
# Qwen3.5 (Gated DeltaNet + gated attention), dense and MoE: the text model's config
# ("*_text", Qwen3_5[Moe]ForCausalLM) or the multimodal one whose text_config is read.
SUPPORTED_MODEL_TYPES = ("llama", "qwen3", "qwen3_moe", "gpt_oss", "qwen3_5", "qwen3_5_text",
                         "qwen3_5_moe", "qwen3_5_moe_text")
_QWEN35_TYPES = ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")


def text_config(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """The language model's config: a multimodal Qwen3.5 config nests it in ``text_config``
    (its ``tie_word_embeddings`` stays at the top level); others are returned as they are."""
    if config.get("model_type") not in ("qwen3_5", "qwen3_5_moe"):
        return config
    inner = dict(config.get("text_config") or {})
    if not inner:
        raise ValueError(f"a {config['model_type']} config needs its text_config")
    inner.setdefault("tie_word_embeddings", config.get("tie_word_embeddings", False))
    inner["model_type"] = config["model_type"]
    return inner


def _rope_fields(config: Mapping[str, Any]) -> dict[str, Any]:
    """RoPE base (and YaRN scaling) from a config; refuses RoPE scaling not mapped here."""
    params = config.get("rope_parameters") or {}
    scaling = config.get("rope_scaling") or {}
    rope_type = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type")
    theta = float(params.get("rope_theta", config.get("rope_theta", 10000.0)))
    if rope_type in (None, "default"):
        return {"rotary_base": theta}
    if rope_type != "yarn":
        raise ValueError(f"RoPE type {rope_type!r} (rope scaling) is not supported; "
                         f"only the default RoPE and YaRN are")
    yarn = {**scaling, **params}
    for key in ("mscale", "mscale_all_dim", "attention_factor"):
        if yarn.get(key) not in (None, 1, 1.0) and not (key == "mscale_all_dim"
                                                         and yarn.get(key) == 0):
            raise ValueError(f"YaRN {key}={yarn.get(key)!r} is not supported")
    return {"rotary_base": theta, "position_embedding_type": "yarn",
            "yarn_factor": float(yarn["factor"]),
            "yarn_original_max_position_embeddings": int(yarn["original_max_position_embeddings"]),
            "yarn_beta_fast": float(yarn.get("beta_fast", 32.0)),
            "yarn_beta_slow": float(yarn.get("beta_slow", 1.0)),
            "yarn_truncate": bool(yarn.get("truncate", True))}


def _check_full_attention(config: Mapping[str, Any]) -> None:
    """Refuse sliding-window layers (Qwen3's ``use_sliding_window``, ``layer_types``)."""
    types = set(config.get("layer_types") or ["full_attention"])
    if config.get("use_sliding_window") or types != {"full_attention"}:
        raise ValueError(f"sliding-window attention (use_sliding_window="
                         f"{config.get('use_sliding_window')}, layer_types {sorted(types)}) is "
                         f"not supported: every layer must be full attention")


def _moe_fields(config: Mapping[str, Any]) -> dict[str, Any]:
    """The mixture-of-experts fields of a Qwen3-MoE config (every layer sparse)."""
    experts = config.get("num_experts", config.get("num_local_experts"))
    if experts is None:
        raise ValueError("a qwen3_moe config needs num_experts")
    dense_layers = list(config.get("mlp_only_layers") or [])
    step = int(config.get("decoder_sparse_step", 1))
    if dense_layers or step != 1:
        raise ValueError(f"dense layers between the expert layers (mlp_only_layers="
                         f"{dense_layers}, decoder_sparse_step={step}) are not supported: "
                         f"every layer must be a mixture of experts")
    if config.get("shared_expert_intermediate_size"):
        raise ValueError("a shared expert (shared_expert_intermediate_size) is not supported "
                         "for qwen3_moe")
    return {
        "num_experts": int(experts),
        "moe_ffn_hidden_size": int(config["moe_intermediate_size"]),
        "moe_router_topk": int(config["num_experts_per_tok"]),
        # HF: softmax over all experts, top k, renormalised when norm_topk_prob; Megatron's
        # default (top k of the logits, softmax over those k) is the renormalised form.
        "moe_router_pre_softmax": not bool(config.get("norm_topk_prob", False)),
    }


def _gpt_oss_fields(config: Mapping[str, Any]) -> dict[str, Any]:
    """gpt-oss: biased attention with sinks, alternating sliding / full layers, and biased
    experts with a clamped ``x * sigmoid(1.702 x) * (up + 1)`` MLP."""
    types = list(config.get("layer_types") or [])
    unknown = sorted(set(types) - {"sliding_attention", "full_attention"})
    if unknown:
        raise ValueError(f"gpt_oss layer_types {unknown} are not supported")
    window = [i for i, t in enumerate(types) if t == "sliding_attention"]
    return {
        "num_experts": int(config.get("num_local_experts", config.get("num_experts"))),
        "moe_ffn_hidden_size": int(config["intermediate_size"]),
        "moe_router_topk": int(config["num_experts_per_tok"]),
        "moe_router_pre_softmax": False,  # top k of the logits, then their softmax
        "add_bias_linear": True, "add_qkv_bias": True, "attention_sinks": True,
        "window_size": int(config["sliding_window"]) if window else None,
        "window_layers": window if window else None,
        "gated_activation": "quick_gelu", "glu_linear_offset": 1.0,
        "activation_clamp": float(config.get("swiglu_limit", 7.0)),
    }


def _qwen35_fields(config: Mapping[str, Any]) -> dict[str, Any]:
    """Qwen3.5: Gated DeltaNet layers (``layer_types == "linear_attention"``) between gated,
    QK-normed softmax attention layers with partial RoPE; MoE: every layer's MLP is top-k
    experts (renormalised) plus a sigmoid-gated shared expert.

    The multimodal RoPE (``mrope_section``) rotates text positions like plain RoPE (the three
    position streams are equal for text), so it maps to Megatron's 1-D RoPE. Multi-token
    prediction layers (``mtp_num_hidden_layers``, the ``mtp.*`` tensors) are not imported: the
    teacher's logits come from the main head alone.
    """
    n = int(config["num_hidden_layers"])
    types = config.get("layer_types")
    if types is None:  # as Qwen3_5TextConfig derives them
        interval = int(config.get("full_attention_interval", 4))
        types = ["linear_attention" if (i + 1) % interval else "full_attention"
                 for i in range(n)]
    unknown = sorted(set(types) - {"linear_attention", "full_attention"})
    if unknown or len(types) != n:
        raise ValueError(f"{config['model_type']} layer_types {sorted(set(types))} "
                         f"({len(types)} for {n} layers) are not supported")
    params = config.get("rope_parameters") or {}
    fields: dict[str, Any] = {
        "qk_layernorm": True, "attention_output_gate": True,
        "rotary_percent": float(params.get("partial_rotary_factor",
                                           config.get("partial_rotary_factor", 0.25))),
        "linear_attention_layers": [i for i, t in enumerate(types) if t == "linear_attention"],
        "linear_conv_kernel_dim": int(config["linear_conv_kernel_dim"]),
        "linear_key_head_dim": int(config["linear_key_head_dim"]),
        "linear_value_head_dim": int(config["linear_value_head_dim"]),
        "linear_num_key_heads": int(config["linear_num_key_heads"]),
        "linear_num_value_heads": int(config["linear_num_value_heads"]),
    }
    if config["model_type"].startswith("qwen3_5_moe"):
        fields.update({
            "num_experts": int(config["num_experts"]),
            "moe_ffn_hidden_size": int(config["moe_intermediate_size"]),
            "moe_router_topk": int(config["num_experts_per_tok"]),
            "moe_router_pre_softmax": False,  # HF always renormalises the top k
            "moe_shared_expert_size": int(config["shared_expert_intermediate_size"]),
            "moe_shared_expert_gate": True,
        })
    return fields


def _model_type_fields(config: Mapping[str, Any]) -> dict[str, Any]:
    """What a model type adds to the Llama layout."""
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"model_type {model_type!r} is not supported; this converter maps "
                         f"{SUPPORTED_MODEL_TYPES}")
    if model_type == "llama":
        return {}
    if model_type == "gpt_oss":
        return _gpt_oss_fields(config)
    if model_type in _QWEN35_TYPES:
        return _qwen35_fields(config)
    _check_full_attention(config)
    fields: dict[str, Any] = {"qk_layernorm": True}
    if model_type == "qwen3_moe":
        fields.update(_moe_fields(config))
    return fields


def arch_from_hf_config(config: Mapping[str, Any], *, make_vocab_size_divisible_by: int = 128,
                        vocab_size: int | None = None):
    """The :class:`~megatron_kd.arch.GPTArchConfig` of a Hugging Face config dict
    (Llama, Qwen3 or Qwen3-MoE).

    ``vocab_size`` is the true vocabulary (the tokenizer's size); it defaults to the config's
    embedding rows. The embedding is padded to a multiple of ``make_vocab_size_divisible_by``
    (independent of the tensor-parallel size, so the checkpoint loads at any TP that divides
    that multiple).
    """
    config = text_config(config)
    fields = {**_rope_fields(config), **_model_type_fields(config)}
    if config.get("model_type") != "gpt_oss":  # gpt-oss: its own activation and biases
        act = config.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act {act!r} is not supported (these models use silu / "
                             f"SwiGLU)")
        for flag in ("attention_bias", "mlp_bias"):
            if config.get(flag):
                raise ValueError(f"{flag}=True is not supported (no biases in the Llama "
                                 f"layout)")
    hidden = int(config["hidden_size"])
    heads = int(config["num_attention_heads"])
    groups = int(config.get("num_key_value_heads") or heads)
    head_dim = config.get("head_dim")
    kv_channels = None
    if head_dim is not None and int(head_dim) * heads != hidden:
        kv_channels = int(head_dim)
    embedding_rows = int(config["vocab_size"])
    true_vocab = embedding_rows if vocab_size is None else int(vocab_size)
    if true_vocab > embedding_rows:
        raise ValueError(f"vocab_size {true_vocab} exceeds the checkpoint's {embedding_rows} "
                         f"embedding rows")
    if make_vocab_size_divisible_by < 1:
        raise ValueError(f"make_vocab_size_divisible_by must be >= 1, "
                         f"got {make_vocab_size_divisible_by}")
    return GPTArchConfig(
        num_layers=int(config["num_hidden_layers"]),
        hidden_size=hidden,
        num_attention_heads=heads,
        num_query_groups=groups,
        # Qwen3.5-MoE has no dense MLP width: the expert width stands in
        ffn_hidden_size=int(config.get("intermediate_size") or config["moe_intermediate_size"]),
        vocab_size=true_vocab,
        padded_vocab_size=pad_vocab_size(embedding_rows, 1, make_vocab_size_divisible_by),
        max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
        norm_epsilon=float(config.get("rms_norm_eps", 1e-6)),
        normalization="RMSNorm",
        swiglu=True,
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        init_method_std=float(config.get("initializer_range", 0.02)),
        kv_channels=kv_channels,
        **{"add_bias_linear": False, "position_embedding_type": "rope", **fields},
    )
