"""Hugging Face ``config.json`` <-> :class:`~megatron_kd.arch.config.GPTArchConfig`, both ways,
one class per model family (Llama, Qwen3, Qwen3-MoE, gpt-oss, Qwen3.5, Qwen3.5-MoE); the
weights' side is :mod:`megatron_kd.hf`.

Import (:func:`arch_from_hf_config`): what a model type adds to the Llama layout (QK norms,
experts and their router convention, biases, attention sinks, sliding windows, the clamped
gated MLP, YaRN RoPE), and a ``ValueError`` naming the config field for anything not mapped.

Export: a config is either the one the checkpoint came from (:func:`config_for_export`: what
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
from megatron_kd.parallel import pad_vocab_size

__all__ = ["HF_FAMILIES", "SUPPORTED_MODEL_TYPES", "HFFamily", "arch_from_hf_config",
           "canonical_arch", "check_config_describes", "config_for_export", "family_of",
           "hf_config_from_arch", "text_config"]

# Fields that do not change the weights or the function the model computes, or that the
# embedding's padding (not the config) decides.
_NOT_COMPARED = ("init_method_std", "padded_vocab_size")


def _rope_fields(config: Mapping[str, Any]) -> dict[str, Any]:
    """RoPE base (and YaRN scaling) from a config; refuses RoPE scaling not mapped here."""
    params = config.get("rope_parameters") or {}
    scaling = config.get("rope_scaling") or {}
    rope_type = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type")
    theta = float(params.get("rope_theta", config.get("rope_theta", 10000.0)))
    if rope_type in (None, "default"):
        return {"rotary_base": theta}
    if rope_type == "llama3":
        llama3 = {**scaling, **params}
        fixed = {"low_freq_factor": 1.0, "high_freq_factor": 4.0,
                 "original_max_position_embeddings": 8192}
        other = {k: llama3.get(k) for k, v in fixed.items() if float(llama3.get(k, v)) != v}
        if other:
            raise ValueError(f"RoPE type 'llama3' with {other}: only Megatron-Core's fixed "
                             f"{fixed} are supported (those of Llama-3.1 and 3.2)")
        return {"rotary_base": theta, "rope_scaling_factor": float(llama3["factor"])}
    if rope_type != "yarn":
        raise ValueError(f"RoPE type {rope_type!r} (rope scaling) is not supported; "
                         f"only the default RoPE, 'llama3' and YaRN are")
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


def _rope(arch: GPTArchConfig) -> dict[str, Any]:
    """The inverse of :func:`_rope_fields`: a config's ``rope_parameters``."""
    if arch.position_embedding_type == "yarn":
        return {"rope_type": "yarn", "rope_theta": arch.rotary_base, "factor": arch.yarn_factor,
                "original_max_position_embeddings": arch.yarn_original_max_position_embeddings,
                "beta_fast": arch.yarn_beta_fast, "beta_slow": arch.yarn_beta_slow,
                "truncate": arch.yarn_truncate}
    if arch.rope_scaling_factor is not None:
        return {"rope_type": "llama3", "rope_theta": arch.rotary_base,
                "factor": arch.rope_scaling_factor, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    return {"rope_type": "default", "rope_theta": arch.rotary_base}


class HFFamily:
    """One Hugging Face model family, its config both ways: the ``model_type`` values it reads
    (:meth:`arch_fields`, what they add to the Llama layout), and the ``model_type`` and
    causal-LM class it writes for an architecture that :meth:`matches` (:meth:`fields`, the
    config fields the architecture gives it)."""

    model_type: str
    architecture: str
    reads: tuple[str, ...]

    llama_mlp = True
    """Imported configs must have the Llama MLP: ``hidden_act`` silu, no biases."""

    def arch_fields(self, config: Mapping[str, Any]) -> dict[str, Any]:
        """What a config of this family adds to the Llama layout (import)."""
        return {}

    def matches(self, arch: GPTArchConfig) -> bool:
        """Whether ``arch`` is this family's (the first family that matches is taken)."""
        raise NotImplementedError

    def fields(self, arch: GPTArchConfig) -> dict[str, Any]:
        """The config fields ``arch`` determines (beyond the Llama ones)."""
        return {}

    def config(self, arch: GPTArchConfig, vocab_rows: int) -> dict[str, Any]:
        """The ``config.json`` of ``arch`` in this family, ``vocab_rows`` embedding rows."""
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
    model_type, architecture, reads = "llama", "LlamaForCausalLM", ("llama",)

    def matches(self, arch):
        return True

    def fields(self, arch):
        return {"mlp_bias": arch.add_bias_linear}


class _Qwen3(HFFamily):
    """Llama plus QK norms; every layer full attention."""

    model_type, architecture, reads = "qwen3", "Qwen3ForCausalLM", ("qwen3",)

    def arch_fields(self, config):
        # refuse sliding-window layers (Qwen3's use_sliding_window, layer_types)
        types = set(config.get("layer_types") or ["full_attention"])
        if config.get("use_sliding_window") or types != {"full_attention"}:
            raise ValueError(f"sliding-window attention (use_sliding_window="
                             f"{config.get('use_sliding_window')}, layer_types "
                             f"{sorted(types)}) is not supported: every layer must be full "
                             f"attention")
        return {"qk_layernorm": True}

    def matches(self, arch):
        return arch.qk_layernorm


class _Qwen3Moe(_Qwen3):
    """Qwen3 with top-k experts in every layer."""

    model_type, architecture, reads = "qwen3_moe", "Qwen3MoeForCausalLM", ("qwen3_moe",)

    def arch_fields(self, config):
        fields = super().arch_fields(config)
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
            raise ValueError("a shared expert (shared_expert_intermediate_size) is not "
                             "supported for qwen3_moe")
        return {
            **fields,
            "num_experts": int(experts),
            "moe_ffn_hidden_size": int(config["moe_intermediate_size"]),
            "moe_router_topk": int(config["num_experts_per_tok"]),
            # HF: softmax over all experts, top k, renormalised when norm_topk_prob; Megatron's
            # default (top k of the logits, softmax over those k) is the renormalised form.
            "moe_router_pre_softmax": not bool(config.get("norm_topk_prob", False)),
        }

    def matches(self, arch):
        return arch.num_experts is not None

    def fields(self, arch):
        return {"num_experts": arch.num_experts, "num_experts_per_tok": arch.moe_router_topk,
                "moe_intermediate_size": arch.expert_ffn_hidden_size,
                # HF renormalises the top k when norm_topk_prob, Megatron unless pre-softmax
                "norm_topk_prob": not arch.moe_router_pre_softmax,
                "decoder_sparse_step": 1, "mlp_only_layers": []}


class _GptOss(HFFamily):
    """gpt-oss: biased attention with sinks, alternating sliding / full layers, and biased
    experts with a clamped ``x * sigmoid(1.702 x) * (up + 1)`` MLP."""

    model_type, architecture, reads = "gpt_oss", "GptOssForCausalLM", ("gpt_oss",)
    llama_mlp = False  # its own activation and biases

    def arch_fields(self, config):
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
    """Qwen3.5: Gated DeltaNet layers (``layer_types == "linear_attention"``) between gated,
    QK-normed softmax attention layers with partial RoPE.

    The multimodal RoPE (``mrope_section``) rotates text positions like plain RoPE (the three
    position streams are equal for text), so it maps to Megatron's 1-D RoPE. Multi-token
    prediction layers (``mtp_num_hidden_layers``, the ``mtp.*`` tensors) are not imported: the
    teacher's logits come from the main head alone.
    """

    model_type, architecture = "qwen3_5_text", "Qwen3_5ForCausalLM"
    # the text model's config ("*_text", Qwen3_5ForCausalLM) or the multimodal one whose
    # text_config is read
    reads = ("qwen3_5", "qwen3_5_text")

    def arch_fields(self, config):
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
        return {
            "qk_layernorm": True, "attention_output_gate": True,
            "rotary_percent": float(params.get("partial_rotary_factor",
                                               config.get("partial_rotary_factor", 0.25))),
            "linear_attention_layers": [i for i, t in enumerate(types)
                                        if t == "linear_attention"],
            "linear_conv_kernel_dim": int(config["linear_conv_kernel_dim"]),
            "linear_key_head_dim": int(config["linear_key_head_dim"]),
            "linear_value_head_dim": int(config["linear_value_head_dim"]),
            "linear_num_key_heads": int(config["linear_num_key_heads"]),
            "linear_num_value_heads": int(config["linear_num_value_heads"]),
        }

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
    """Qwen3.5-MoE: Qwen3.5 whose every MLP is top-k experts (renormalised) plus a
    sigmoid-gated shared expert."""

    model_type, architecture = "qwen3_5_moe_text", "Qwen3_5MoeForCausalLM"
    reads = ("qwen3_5_moe", "qwen3_5_moe_text")

    def arch_fields(self, config):
        return {**super().arch_fields(config),
                "num_experts": int(config["num_experts"]),
                "moe_ffn_hidden_size": int(config["moe_intermediate_size"]),
                "moe_router_topk": int(config["num_experts_per_tok"]),
                "moe_router_pre_softmax": False,  # HF always renormalises the top k
                "moe_shared_expert_size": int(config["shared_expert_intermediate_size"]),
                "moe_shared_expert_gate": True}

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


_LLAMA, _QWEN3, _QWEN3_MOE = _Llama(), _Qwen3(), _Qwen3Moe()
_GPT_OSS, _QWEN3_5, _QWEN3_5_MOE = _GptOss(), _Qwen35(), _Qwen35Moe()

#: Hugging Face model types this mapping reads.
SUPPORTED_MODEL_TYPES = tuple(t for f in (_LLAMA, _QWEN3, _QWEN3_MOE, _GPT_OSS, _QWEN3_5,
                                          _QWEN3_5_MOE) for t in f.reads)

#: Tried in order: the first whose ``matches`` holds is the architecture's family.
HF_FAMILIES: tuple[HFFamily, ...] = (_GPT_OSS, _QWEN3_5_MOE, _QWEN3_5, _QWEN3_MOE, _QWEN3,
                                     _LLAMA)

_FAMILY_OF_TYPE = {t: f for f in HF_FAMILIES for t in f.reads}

# Multimodal configs (model_type -> the family of their text model): the language model's
# config is nested in ``text_config``.
_MULTIMODAL = {"qwen3_5": _QWEN3_5, "qwen3_5_moe": _QWEN3_5_MOE}


def text_config(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """The language model's config: a multimodal Qwen3.5 config nests it in ``text_config``
    (its ``tie_word_embeddings`` stays at the top level); others are returned as they are."""
    if config.get("model_type") not in _MULTIMODAL:
        return config
    inner = dict(config.get("text_config") or {})
    if not inner:
        raise ValueError(f"a {config['model_type']} config needs its text_config")
    inner.setdefault("tie_word_embeddings", config.get("tie_word_embeddings", False))
    inner["model_type"] = config["model_type"]
    return inner


def _family_of_config(config: Mapping[str, Any]) -> HFFamily:
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"model_type {model_type!r} is not supported; this converter maps "
                         f"{SUPPORTED_MODEL_TYPES}")
    return _FAMILY_OF_TYPE[model_type]


def arch_from_hf_config(config: Mapping[str, Any], *, make_vocab_size_divisible_by: int = 128,
                        vocab_size: int | None = None) -> GPTArchConfig:
    """The :class:`~megatron_kd.arch.config.GPTArchConfig` of a Hugging Face config dict (any
    of :data:`SUPPORTED_MODEL_TYPES`).

    ``vocab_size`` is the true vocabulary (the tokenizer's size); it defaults to the config's
    embedding rows. The embedding is padded to a multiple of ``make_vocab_size_divisible_by``
    (independent of the tensor-parallel size, so the checkpoint loads at any TP that divides
    that multiple).
    """
    config = text_config(config)
    rope = _rope_fields(config)
    family = _family_of_config(config)
    fields = {**rope, **family.arch_fields(config)}
    if family.llama_mlp:
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
    if config.get("model_type") not in _MULTIMODAL or "text_config" not in config:
        return dict(config)
    text = dict(config["text_config"])
    family = _MULTIMODAL[config["model_type"]]
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
