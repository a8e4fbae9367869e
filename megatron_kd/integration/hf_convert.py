"""Hugging Face Llama weights -> Megatron-Core ``GPTModel`` weights (local spec), pure tensors.

See :mod:`megatron_kd.integration.hf_import` for the layout mapping; this module is the maths
of it: the architecture from a config (:func:`arch_from_hf_config`), the full state dict
(:func:`convert_hf_state_dict`), a TP shard of it (:func:`shard_megatron_state_dict`),
exactly-neutral padding for a TP size that does not divide the heads
(:func:`pad_for_tensor_parallel`) and the copy into a built model
(:func:`load_converted_into_model`).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any

import torch

from megatron_kd.integration.arch import GPTArchConfig
from megatron_kd.parallel import pad_vocab_size

__all__ = ["SUPPORTED_MODEL_TYPES", "arch_from_hf_config", "convert_hf_state_dict",
           "load_converted_into_model", "pad_for_tensor_parallel", "shard_megatron_state_dict",
           "strip_prefix"]

# Hugging Face model types this converter maps: Llama, and Llama plus QK norms (Qwen3) and
# top-k experts (Qwen3-MoE).
SUPPORTED_MODEL_TYPES = ("llama", "qwen3", "qwen3_moe")


def strip_prefix(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for name, tensor in state_dict.items():
        name = name.removeprefix("model.")
        out[name] = tensor
    return out


def _rope_theta(config: Mapping[str, Any]) -> float:
    """RoPE base from a config; refuses RoPE scaling this converter does not map."""
    params = config.get("rope_parameters") or {}
    scaling = config.get("rope_scaling") or {}
    rope_type = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type")
    if rope_type not in (None, "default"):
        raise ValueError(f"RoPE type {rope_type!r} (rope scaling) is not supported; "
                         f"only the default RoPE is")
    theta = params.get("rope_theta", config.get("rope_theta", 10000.0))
    return float(theta)


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


def _model_type_fields(config: Mapping[str, Any]) -> dict[str, Any]:
    """What a model type adds to the Llama layout."""
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"model_type {model_type!r} is not supported; this converter maps "
                         f"{SUPPORTED_MODEL_TYPES}")
    if model_type == "llama":
        return {}
    _check_full_attention(config)
    fields: dict[str, Any] = {"qk_layernorm": True}
    if model_type == "qwen3_moe":
        fields.update(_moe_fields(config))
    return fields


def arch_from_hf_config(config: Mapping[str, Any], *, make_vocab_size_divisible_by: int = 128,
                        vocab_size: int | None = None):
    """The :class:`~megatron_kd.integration.arch.GPTArchConfig` of a Hugging Face config dict
    (Llama, Qwen3 or Qwen3-MoE).

    ``vocab_size`` is the true vocabulary (the tokenizer's size); it defaults to the config's
    embedding rows. The embedding is padded to a multiple of ``make_vocab_size_divisible_by``
    (independent of the tensor-parallel size, so the checkpoint loads at any TP that divides
    that multiple).
    """
    fields = _model_type_fields(config)
    act = config.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act {act!r} is not supported (these models use silu / SwiGLU)")
    for flag in ("attention_bias", "mlp_bias"):
        if config.get(flag):
            raise ValueError(f"{flag}=True is not supported (no biases in the Llama layout)")
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
        ffn_hidden_size=int(config["intermediate_size"]),
        vocab_size=true_vocab,
        padded_vocab_size=pad_vocab_size(embedding_rows, 1, make_vocab_size_divisible_by),
        max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
        rotary_base=_rope_theta(config),
        norm_epsilon=float(config.get("rms_norm_eps", 1e-6)),
        normalization="RMSNorm",
        swiglu=True,
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        add_bias_linear=False,
        position_embedding_type="rope",
        init_method_std=float(config.get("initializer_range", 0.02)),
        kv_channels=kv_channels,
        **fields,
    )


# ----------------------------------------------------------------------------------------------
# Weights
# ----------------------------------------------------------------------------------------------


def _head_dim(arch) -> int:
    return arch.kv_channels or arch.hidden_size // arch.num_attention_heads


def _pad_rows(weight: torch.Tensor, rows: int) -> torch.Tensor:
    if weight.shape[0] > rows:
        raise ValueError(f"embedding has {weight.shape[0]} rows, more than padded_vocab_size "
                         f"{rows}")
    if weight.shape[0] == rows:
        return weight
    return torch.cat([weight, weight.new_zeros(rows - weight.shape[0], weight.shape[1])], dim=0)


def _take(state_dict: dict[str, torch.Tensor], name: str, shape: tuple[int, ...]) -> torch.Tensor:
    if name not in state_dict:
        raise ValueError(f"Hugging Face checkpoint has no tensor {name!r}")
    t = state_dict.pop(name)
    if tuple(t.shape) != shape:
        raise ValueError(f"Hugging Face tensor {name!r} has shape {tuple(t.shape)}, "
                         f"the config implies {shape}")
    return t


def _convert_attention(sd: dict[str, torch.Tensor], out: dict[str, torch.Tensor], arch,
                       src: str, dst: str) -> None:
    h, nh, ng, d = arch.hidden_size, arch.num_attention_heads, arch.query_groups, _head_dim(arch)
    q = _take(sd, src + "self_attn.q_proj.weight", (nh * d, h))
    k = _take(sd, src + "self_attn.k_proj.weight", (ng * d, h))
    v = _take(sd, src + "self_attn.v_proj.weight", (ng * d, h))
    # Per query group: its nh/ng query heads, then its key head, then its value head.
    qkv = torch.cat([q.reshape(ng, nh // ng * d, h), k.reshape(ng, d, h),
                     v.reshape(ng, d, h)], dim=1)
    out[dst + "self_attention.linear_qkv.weight"] = qkv.reshape(ng * (nh // ng + 2) * d, h)
    out[dst + "self_attention.linear_proj.weight"] = _take(
        sd, src + "self_attn.o_proj.weight", (h, nh * d))
    if arch.qk_layernorm:
        # One norm of width d shared by every head (Qwen3's q_norm / k_norm).
        out[dst + "self_attention.q_layernorm.weight"] = _take(sd, src + "self_attn.q_norm.weight",
                                                               (d,))
        out[dst + "self_attention.k_layernorm.weight"] = _take(sd, src + "self_attn.k_norm.weight",
                                                               (d,))


def _convert_swiglu(sd: dict[str, torch.Tensor], out: dict[str, torch.Tensor], src: str,
                    dst: str, width: int, h: int) -> None:
    gate = _take(sd, src + "gate_proj.weight", (width, h))
    up = _take(sd, src + "up_proj.weight", (width, h))
    out[dst + "linear_fc1.weight"] = torch.cat([gate, up], dim=0)
    out[dst + "linear_fc2.weight"] = _take(sd, src + "down_proj.weight", (h, width))


def convert_hf_state_dict(hf_state_dict: Mapping[str, torch.Tensor], arch,
                          dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Full (unsharded, TP=1, EP=1) Megatron-Core local-spec state dict from a HF state dict.

    Experts are named by their global index (``mlp.experts.local_experts.{e}``, as a model
    built at EP=1 names them); :func:`shard_megatron_state_dict` renames them per EP rank.

    ``hf_state_dict`` names may carry the ``model.`` prefix or not. Every HF tensor must be
    used (``rotary_emb.inv_freq`` buffers aside), else ``ValueError`` lists the leftovers.
    """
    sd = strip_prefix(hf_state_dict)
    sd = {k: v for k, v in sd.items() if not k.endswith("rotary_emb.inv_freq")}
    h, f = arch.hidden_size, arch.ffn_hidden_size
    vocab_rows = None
    out: dict[str, torch.Tensor] = {}

    emb = sd.pop("embed_tokens.weight", None)
    if emb is None:
        raise ValueError("Hugging Face checkpoint has no tensor 'embed_tokens.weight'")
    vocab_rows = emb.shape[0]
    out["embedding.word_embeddings.weight"] = _pad_rows(emb, arch.padded_vocab_size)
    for i in range(arch.num_layers):
        src, dst = f"layers.{i}.", f"decoder.layers.{i}."
        _convert_attention(sd, out, arch, src, dst)
        if arch.num_experts is None:
            _convert_swiglu(sd, out, src + "mlp.", dst + "mlp.", f, h)
        else:
            out[dst + "mlp.router.weight"] = _take(sd, src + "mlp.gate.weight",
                                                   (arch.num_experts, h))
            for e in range(arch.num_experts):
                _convert_swiglu(sd, out, f"{src}mlp.experts.{e}.",
                                f"{dst}mlp.experts.local_experts.{e}.",
                                arch.expert_ffn_hidden_size, h)
        out[dst + "input_layernorm.weight"] = _take(sd, src + "input_layernorm.weight", (h,))
        out[dst + "pre_mlp_layernorm.weight"] = _take(
            sd, src + "post_attention_layernorm.weight", (h,))
    out["decoder.final_layernorm.weight"] = _take(sd, "norm.weight", (h,))
    lm_head = sd.pop("lm_head.weight", None)
    if arch.tie_embeddings:
        if lm_head is not None and not torch.equal(lm_head, emb):
            raise ValueError("config says tie_word_embeddings=True but lm_head.weight differs "
                             "from embed_tokens.weight")
    else:
        if lm_head is None:
            raise ValueError("untied checkpoint (tie_word_embeddings=False) has no lm_head.weight")
        if lm_head.shape != (vocab_rows, h):
            raise ValueError(f"lm_head.weight has shape {tuple(lm_head.shape)}, "
                             f"expected {(vocab_rows, h)}")
        out["output_layer.weight"] = _pad_rows(lm_head, arch.padded_vocab_size)
    if sd:
        raise ValueError(f"Hugging Face tensors not mapped (not the architecture its config names?): "
                         f"{sorted(sd)[:8]}{' ...' if len(sd) > 8 else ''}")
    return {k: v.to(dtype).contiguous() for k, v in out.items()}


_EXPERT = re.compile(r"^(.*\.mlp\.experts\.local_experts\.)(\d+)(\..*)$")


def _local_experts(full: Mapping[str, torch.Tensor], arch, ep_rank: int,
                   ep_size: int) -> dict[str, torch.Tensor]:
    """The experts of expert-parallel rank ``ep_rank`` (a contiguous block, renumbered from 0,
    as Megatron's ``SequentialMLP`` numbers its local experts); other tensors unchanged."""
    arch.check_expert_parallel(ep_size)
    if not 0 <= ep_rank < ep_size:
        raise ValueError(f"ep_rank {ep_rank} out of range for ep_size {ep_size}")
    if ep_size == 1:
        return dict(full)
    per_rank = arch.num_experts // ep_size
    out = {}
    for name, t in full.items():
        m = _EXPERT.match(name)
        if m is None:
            out[name] = t
        elif int(m.group(2)) // per_rank == ep_rank:
            out[f"{m.group(1)}{int(m.group(2)) % per_rank}{m.group(3)}"] = t
    return out


def shard_megatron_state_dict(full: Mapping[str, torch.Tensor], arch, tp_rank: int,
                              tp_size: int, ep_rank: int = 0, ep_size: int = 1,
                              etp_rank: int | None = None,
                              etp_size: int | None = None) -> dict[str, torch.Tensor]:
    """This tensor- and expert-parallel rank's shard of a full local-spec state dict.

    Experts: rank ``ep_rank`` keeps experts ``ep_rank * E/ep_size ...`` renumbered from 0, and
    splits each over its ``etp_size`` expert tensor-parallel ranks like a dense MLP (``etp``
    defaults to the tensor-parallel rank and size); the router and the QK norms are replicated.

    Column-parallel (dim 0): ``linear_qkv`` (whole query groups per rank), the embedding and
    output layer (vocabulary rows), and ``linear_fc1`` with its gate and up halves split
    separately (a rank holds ``[gate_r; up_r]``). Row-parallel (dim 1): ``linear_proj``,
    ``linear_fc2``. Norms are replicated.
    """
    arch.check_tensor_parallel(tp_size)
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank {tp_rank} out of range for tp_size {tp_size}")

    etp_rank, etp_size = (tp_rank, tp_size) if etp_size is None else (etp_rank, etp_size)

    def chunk(t: torch.Tensor, dim: int, expert: bool = False) -> torch.Tensor:
        size, rank = (etp_size, etp_rank) if expert else (tp_size, tp_rank)
        return t.chunk(size, dim=dim)[rank].contiguous()

    out = {}
    for name, t in _local_experts(full, arch, ep_rank, ep_size).items():
        expert = ".experts." in name
        if name.endswith(("linear_qkv.weight", "word_embeddings.weight", "output_layer.weight")):
            out[name] = chunk(t, 0)
        elif name.endswith("linear_fc1.weight"):
            gate, up = t.chunk(2, dim=0)
            out[name] = torch.cat([chunk(gate, 0, expert), chunk(up, 0, expert)], dim=0)
        elif name.endswith(("linear_proj.weight", "linear_fc2.weight")):
            out[name] = chunk(t, 1, expert)
        else:
            out[name] = t
    return out


def pad_for_tensor_parallel(full: Mapping[str, torch.Tensor], arch, tp_size: int,
                            make_vocab_size_divisible_by: int = 128):
    """Pad a converted model so that it splits ``tp_size`` ways, computing the same function.

    Returns ``(full', arch')``. Query groups are padded to a multiple of ``tp_size`` with dummy
    groups (``nh/ng`` query heads each) whose q, k, v rows are zero and whose ``linear_proj``
    input columns are zero: a dummy head attends uniformly to zero values and its output is
    multiplied by zero, so it adds exactly nothing. The MLP width is padded to a multiple of
    ``tp_size`` with zero gate/up rows and zero ``linear_fc2`` columns (``silu(0) * 0 = 0``).
    The embedding rows are padded to a multiple of ``make_vocab_size_divisible_by * tp_size``.
    ``kv_channels`` is made explicit (the head width no longer equals ``h / heads``). E.g.
    SmolLM2-135M (9 heads, 3 groups) becomes 12 heads in 4 groups at ``tp_size=2``.
    """
    if tp_size < 1:
        raise ValueError(f"tp_size must be >= 1, got {tp_size}")
    if arch.num_experts is not None and arch.expert_ffn_hidden_size % tp_size:
        raise ValueError(f"padding an expert's width ({arch.expert_ffn_hidden_size}) for "
                         f"tensor-parallel size {tp_size} is not supported")
    h, d = arch.hidden_size, _head_dim(arch)
    ng, nh = arch.query_groups, arch.num_attention_heads
    per_group = nh // ng
    new_ng = -(-ng // tp_size) * tp_size
    new_nh = new_ng * per_group
    f, new_f = arch.ffn_hidden_size, -(-arch.ffn_hidden_size // tp_size) * tp_size
    new_vocab = max(arch.padded_vocab_size,
                    pad_vocab_size(arch.padded_vocab_size, tp_size, make_vocab_size_divisible_by))
    out = {}
    for name, t in full.items():
        if name.endswith("linear_qkv.weight") and new_ng != ng:
            t = torch.cat([t, t.new_zeros((new_ng - ng) * (per_group + 2) * d, h)], dim=0)
        elif name.endswith("linear_proj.weight") and new_ng != ng:
            t = torch.cat([t, t.new_zeros(h, (new_nh - nh) * d)], dim=1)
        elif ".experts." in name:
            pass  # expert widths divide tp_size (checked above)
        elif name.endswith("linear_fc1.weight") and new_f != f:
            gate, up = t.chunk(2, dim=0)
            zeros = t.new_zeros(new_f - f, h)
            t = torch.cat([gate, zeros, up, zeros], dim=0)
        elif name.endswith("linear_fc2.weight") and new_f != f:
            t = torch.cat([t, t.new_zeros(h, new_f - f)], dim=1)
        elif name.endswith(("word_embeddings.weight", "output_layer.weight")):
            t = _pad_rows(t, new_vocab)
        out[name] = t
    new_arch = dataclasses.replace(
        arch, num_attention_heads=new_nh, num_query_groups=new_ng, ffn_hidden_size=new_f,
        padded_vocab_size=new_vocab, kv_channels=d if new_nh != nh else arch.kv_channels)
    new_arch.check_tensor_parallel(tp_size)
    return out, new_arch


# Transformer Engine's spec fuses the pre-attention / pre-MLP norms into the next linear layer.
_TE_NORM_NAMES = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
}


def _to_model_names(local: dict[str, torch.Tensor],
                    model_keys: set[str]) -> dict[str, torch.Tensor]:
    out = {}
    for name, t in local.items():
        if name not in model_keys:
            for local_suffix, te_suffix in _TE_NORM_NAMES.items():
                if name.endswith(local_suffix):
                    te_name = name[: -len(local_suffix)] + te_suffix
                    if te_name in model_keys:
                        name = te_name
                    break
        out[name] = t
    return out


def load_converted_into_model(model, full_state_dict: Mapping[str, torch.Tensor], arch,
                              tp_rank: int = 0, tp_size: int = 1, ep_rank: int = 0,
                              ep_size: int = 1, etp_rank: int | None = None,
                              etp_size: int | None = None) -> None:
    """Copy a full converted state dict into this rank's ``GPTModel`` (no pipeline split).

    Every weight of the model must be covered and every converted tensor used, else
    ``ValueError``; ``_extra_state`` entries are left as they are.
    """
    local = shard_megatron_state_dict(full_state_dict, arch, tp_rank, tp_size, ep_rank, ep_size,
                                      etp_rank, etp_size)
    own = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    local = _to_model_names(local, set(own))
    missing = sorted(set(own) - set(local))
    unexpected = sorted(set(local) - set(own))
    if missing or unexpected:
        raise ValueError(f"converted weights do not fit the model: missing {missing[:6]}, "
                         f"unexpected {unexpected[:6]}")
    with torch.no_grad():
        for name, target in own.items():
            src = local[name]
            if tuple(src.shape) != tuple(target.shape):
                raise ValueError(f"{name}: converted shape {tuple(src.shape)} != model shape "
                                 f"{tuple(target.shape)}")
            target.copy_(src)
