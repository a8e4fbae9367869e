"""Hugging Face weights (Llama, Qwen3, Qwen3-MoE, gpt-oss, Qwen3.5) -> Megatron-Core ``GPTModel``
weights (local spec), pure tensors.

See :mod:`megatron_kd.hf.importer` for the layout mapping; this module is the maths
of it: the architecture from a config (:func:`arch_from_hf_config`, in
:mod:`megatron_kd.arch.hf_config`), the full state dict
(:func:`convert_hf_state_dict`), a TP shard of it (:func:`shard_megatron_state_dict`),
exactly-neutral padding for a TP size that does not divide the heads
(:func:`pad_for_tensor_parallel`) and the copy into a built model
(:func:`load_converted_into_model`).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping

import torch

from megatron_kd.arch.hf_config import SUPPORTED_MODEL_TYPES, arch_from_hf_config
from megatron_kd.arch.layout import Role, check_layout
from megatron_kd.parallel import ParallelLayout, pad_vocab_size

__all__ = ["SUPPORTED_MODEL_TYPES", "arch_from_hf_config", "convert_hf_state_dict",
           "load_converted_into_model", "pad_for_tensor_parallel", "shard_megatron_state_dict",
           "strip_prefix"]

def strip_prefix(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for name, tensor in state_dict.items():
        name = name.removeprefix("model.")
        out[name] = tensor
    return out


# ----------------------------------------------------------------------------------------------
# Weights
# ----------------------------------------------------------------------------------------------


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
    h, nh, ng, d = arch.hidden_size, arch.num_attention_heads, arch.query_groups, arch.head_dim
    if arch.attention_output_gate:
        # HF (Qwen3.5): q_proj is per head [q (d rows), gate (d rows)]; Megatron: per query
        # group [its query heads, their gate heads, k, v].
        qg = _take(sd, src + "self_attn.q_proj.weight", (nh * 2 * d, h)).reshape(nh, 2, d, h)
        q = torch.cat([qg[:, 0].reshape(ng, nh // ng * d, h),
                       qg[:, 1].reshape(ng, nh // ng * d, h)], dim=1)
    else:
        q = _take(sd, src + "self_attn.q_proj.weight", (nh * d, h)).reshape(ng, nh // ng * d, h)
    k = _take(sd, src + "self_attn.k_proj.weight", (ng * d, h))
    v = _take(sd, src + "self_attn.v_proj.weight", (ng * d, h))
    # Per query group: its nh/ng query heads (and gates), then its key head, then its value head.
    qkv = torch.cat([q, k.reshape(ng, d, h), v.reshape(ng, d, h)], dim=1)
    out[dst + "self_attention.linear_qkv.weight"] = qkv.reshape(-1, h)
    out[dst + "self_attention.linear_proj.weight"] = _take(
        sd, src + "self_attn.o_proj.weight", (h, nh * d))
    if arch.add_qkv_bias:  # packed per query group like the weight
        qb = _take(sd, src + "self_attn.q_proj.bias", (nh * d,))
        kb = _take(sd, src + "self_attn.k_proj.bias", (ng * d,))
        vb = _take(sd, src + "self_attn.v_proj.bias", (ng * d,))
        out[dst + "self_attention.linear_qkv.bias"] = torch.cat(
            [qb.reshape(ng, -1), kb.reshape(ng, d), vb.reshape(ng, d)], dim=1).reshape(-1)
    if arch.add_bias_linear:
        out[dst + "self_attention.linear_proj.bias"] = _take(sd, src + "self_attn.o_proj.bias",
                                                             (h,))
    if arch.attention_sinks:
        out[dst + "self_attention.core_attention.softmax_offset"] = _take(
            sd, src + "self_attn.sinks", (nh,))
    if arch.qk_layernorm:
        # One norm of width d shared by every head (Qwen3's q_norm / k_norm).
        out[dst + "self_attention.q_layernorm.weight"] = _take(sd, src + "self_attn.q_norm.weight",
                                                               (d,))
        out[dst + "self_attention.k_layernorm.weight"] = _take(sd, src + "self_attn.k_norm.weight",
                                                               (d,))


def _deltanet_widths(arch) -> tuple[int, int, int]:
    """(key width, value width, value heads) of one Gated DeltaNet layer."""
    return (arch.linear_num_key_heads * arch.linear_key_head_dim,
            arch.linear_num_value_heads * arch.linear_value_head_dim,
            arch.linear_num_value_heads)


def _convert_deltanet(sd: dict[str, torch.Tensor], out: dict[str, torch.Tensor], arch,
                      src: str, dst: str) -> None:
    """Qwen3.5's ``linear_attn`` -> Megatron's ``GatedDeltaNet``: ``in_proj = [q; k; v; z; b;
    a]`` (HF keeps qkv, z, b, a as four projections), the convolution over ``[q; k; v]``
    channels, and the gated output norm (a plain RMSNorm: no ``1 +``)."""
    h, a, m = arch.hidden_size, src + "linear_attn.", dst + "self_attention."
    kd, vd, nv = _deltanet_widths(arch)
    conv = arch.linear_conv_kernel_dim
    out[m + "in_proj.weight"] = torch.cat([
        _take(sd, a + "in_proj_qkv.weight", (2 * kd + vd, h)),
        _take(sd, a + "in_proj_z.weight", (vd, h)),
        _take(sd, a + "in_proj_b.weight", (nv, h)),
        _take(sd, a + "in_proj_a.weight", (nv, h))], dim=0)
    out[m + "conv1d.weight"] = _take(sd, a + "conv1d.weight", (2 * kd + vd, 1, conv))
    if a + "conv1d.bias" in sd:
        raise ValueError(f"{a}conv1d.bias: a biased DeltaNet convolution is not supported "
                         f"(Megatron's GatedDeltaNet has none)")
    out[m + "A_log"] = _take(sd, a + "A_log", (nv,))
    out[m + "dt_bias"] = _take(sd, a + "dt_bias", (nv,))
    out[m + "out_norm.weight"] = _take(sd, a + "norm.weight", (arch.linear_value_head_dim,))
    out[m + "out_proj.weight"] = _take(sd, a + "out_proj.weight", (h, vd))


def _convert_experts(sd: dict[str, torch.Tensor], out: dict[str, torch.Tensor], arch,
                     src: str, dst: str) -> None:
    """Router, routed experts and (Qwen3.5-MoE) the gated shared expert. Experts come one by one
    (``experts.{e}.gate_proj``: what transformers saves) or fused as a model holds them in
    memory (``experts.gate_up_proj [E, 2f, h] = [gate; up]``, ``experts.down_proj [E, h, f]``)."""
    e_n, h, f = arch.num_experts, arch.hidden_size, arch.expert_ffn_hidden_size
    out[dst + "router.weight"] = _take(sd, src + "gate.weight", (e_n, h))
    if src + "experts.gate_up_proj" in sd:
        gate_up = _take(sd, src + "experts.gate_up_proj", (e_n, 2 * f, h))
        down = _take(sd, src + "experts.down_proj", (e_n, h, f))
        for e in range(e_n):
            out[f"{dst}experts.local_experts.{e}.linear_fc1.weight"] = gate_up[e]
            out[f"{dst}experts.local_experts.{e}.linear_fc2.weight"] = down[e]
    else:
        for e in range(e_n):
            _convert_swiglu(sd, out, f"{src}experts.{e}.", f"{dst}experts.local_experts.{e}.",
                            f, h)
    if arch.moe_shared_expert_size is not None:
        _convert_swiglu(sd, out, src + "shared_expert.", dst + "shared_experts.",
                        arch.moe_shared_expert_size, h)
    if arch.moe_shared_expert_gate:
        out[dst + "shared_experts.gate_weight"] = _take(sd, src + "shared_expert_gate.weight",
                                                        (1, h))


def _qwen35_names(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Qwen3.5 names as the text model's: the multimodal checkpoint's ``language_model.``
    prefix dropped; its vision tower (``visual.*``) and the multi-token-prediction layers
    (``mtp.*``) left out on purpose (a text teacher's logits use neither)."""
    out = {}
    for name, t in sd.items():
        if name.startswith(("visual.", "mtp.")):
            continue
        out[name.removeprefix("language_model.")] = t
    return out


# Qwen3.5's RMSNorms compute x * (1 + w) (their weights are stored zero-centred), Megatron's
# x * w: these get 1 added at import. The DeltaNet's gated out_norm is a plain x * w.
_ZERO_CENTRED_NORMS = ("input_layernorm.weight", "pre_mlp_layernorm.weight",
                       "final_layernorm.weight", "q_layernorm.weight", "k_layernorm.weight")


def _convert_swiglu(sd: dict[str, torch.Tensor], out: dict[str, torch.Tensor], src: str,
                    dst: str, width: int, h: int) -> None:
    gate = _take(sd, src + "gate_proj.weight", (width, h))
    up = _take(sd, src + "up_proj.weight", (width, h))
    out[dst + "linear_fc1.weight"] = torch.cat([gate, up], dim=0)
    out[dst + "linear_fc2.weight"] = _take(sd, src + "down_proj.weight", (h, width))


def _convert_gpt_oss_experts(sd: dict[str, torch.Tensor], out: dict[str, torch.Tensor], arch,
                             src: str, dst: str) -> None:
    """gpt-oss's fused experts: ``gate_up_proj [E, h, 2f]`` with gate and up interleaved
    (gate ``[..., ::2]``, up ``[..., 1::2]``), ``down_proj [E, f, h]``, and their biases."""
    e_n, h, f = arch.num_experts, arch.hidden_size, arch.expert_ffn_hidden_size
    if src + "experts.gate_up_proj_blocks" in sd:
        raise ValueError(f"{src}experts are MXFP4-quantised (*_blocks / *_scales), as the "
                         f"released gpt-oss checkpoints are: dequantise them first "
                         f"(transformers: from_pretrained(..., quantization_config="
                         f"Mxfp4Config(dequantize=True)), then save_pretrained)")
    out[dst + "router.weight"] = _take(sd, src + "router.weight", (e_n, h))
    out[dst + "router.bias"] = _take(sd, src + "router.bias", (e_n,))
    gate_up = _take(sd, src + "experts.gate_up_proj", (e_n, h, 2 * f))
    gate_up_bias = _take(sd, src + "experts.gate_up_proj_bias", (e_n, 2 * f))
    down = _take(sd, src + "experts.down_proj", (e_n, f, h))
    down_bias = _take(sd, src + "experts.down_proj_bias", (e_n, h))
    for e in range(e_n):
        x = f"{dst}experts.local_experts.{e}."
        out[x + "linear_fc1.weight"] = torch.cat([gate_up[e][:, ::2].t(),
                                                  gate_up[e][:, 1::2].t()], dim=0)
        out[x + "linear_fc1.bias"] = torch.cat([gate_up_bias[e][::2], gate_up_bias[e][1::2]])
        out[x + "linear_fc2.weight"] = down[e].t()
        out[x + "linear_fc2.bias"] = down_bias[e]


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
    hybrid = arch.linear_attention_layers is not None  # Qwen3.5, the one hybrid mapped
    if hybrid:
        sd = _qwen35_names(sd)
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
        if hybrid and i in arch.linear_attention_layers:
            _convert_deltanet(sd, out, arch, src, dst)
        else:
            _convert_attention(sd, out, arch, src, dst)
        if arch.num_experts is None:
            _convert_swiglu(sd, out, src + "mlp.", dst + "mlp.", f, h)
        elif arch.attention_sinks:  # gpt-oss
            _convert_gpt_oss_experts(sd, out, arch, src + "mlp.", dst + "mlp.")
        else:
            _convert_experts(sd, out, arch, src + "mlp.", dst + "mlp.")
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
    if hybrid:
        for name in out:
            if name.endswith(_ZERO_CENTRED_NORMS):
                out[name] = out[name] + 1.0
    if sd:
        raise ValueError(f"Hugging Face tensors not mapped (not the architecture its config "
                         f"names?): "
                         f"{sorted(sd)[:8]}{' ...' if len(sd) > 8 else ''}")
    return {k: v.to(dtype).contiguous() for k, v in out.items()}


_EXPERT = re.compile(r"^(.*\.mlp\.experts\.local_experts\.)(\d+)(\..*)$")


def _local_experts(full: Mapping[str, torch.Tensor], arch, ep_rank: int,
                   ep_size: int) -> dict[str, torch.Tensor]:
    """The experts of expert-parallel rank ``ep_rank`` (a contiguous block, renumbered from 0,
    as Megatron's ``SequentialMLP`` numbers its local experts); other tensors unchanged."""
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


_DELTANET_PARTS = ("in_proj.weight", "conv1d.weight", "A_log", "dt_bias")


def _shard_deltanet(name: str, t: torch.Tensor, arch, tp_rank: int,
                    tp_size: int) -> torch.Tensor:
    """A Gated DeltaNet tensor's TP shard: ``in_proj`` is column-parallel over its six parts
    ``[q; k; v; z; b; a]``, each split by heads (a rank holds ``[q_r; k_r; v_r; z_r; b_r;
    a_r]``), the convolution likewise over ``[q; k; v]`` channels, ``A_log`` and ``dt_bias``
    per value head; ``out_proj`` is row-parallel and ``out_norm`` (one head) replicated."""
    kd, vd, nv = _deltanet_widths(arch)
    parts = {"in_proj.weight": [kd, kd, vd, vd, nv, nv],
             "conv1d.weight": [kd, kd, vd]}.get(name.rsplit(".self_attention.", 1)[1], [nv])
    return torch.cat([p.chunk(tp_size, dim=0)[tp_rank] for p in t.split(parts, dim=0)],
                     dim=0).contiguous()


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
    check_layout(arch, ParallelLayout.of_model(tp=tp_size, ep=ep_size, etp=etp_size),
                 role=Role.FROZEN)
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank {tp_rank} out of range for tp_size {tp_size}")

    etp_rank, etp_size = (tp_rank, tp_size) if etp_size is None else (etp_rank, etp_size)

    def chunk(t: torch.Tensor, dim: int, expert: bool = False) -> torch.Tensor:
        size, rank = (etp_size, etp_rank) if expert else (tp_size, tp_rank)
        return t.chunk(size, dim=dim)[rank].contiguous()

    out = {}
    for name, t in _local_experts(full, arch, ep_rank, ep_size).items():
        if ".self_attention." in name and name.endswith(_DELTANET_PARTS):
            out[name] = _shard_deltanet(name, t, arch, tp_rank, tp_size)
            continue
        expert = ".experts." in name
        if name.endswith(("linear_qkv.weight", "linear_qkv.bias", "word_embeddings.weight",
                          "output_layer.weight", "softmax_offset")):
            out[name] = chunk(t, 0)
        elif name.endswith("linear_fc1.weight"):
            gate, up = t.chunk(2, dim=0)
            out[name] = torch.cat([chunk(gate, 0, expert), chunk(up, 0, expert)], dim=0)
        elif name.endswith(("linear_proj.weight", "linear_fc2.weight", "out_proj.weight")):
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
    if arch.add_qkv_bias or arch.attention_sinks:
        raise ValueError("padding for tensor parallelism is not supported for models with QKV "
                         "biases or attention sinks")
    if arch.attention_output_gate or arch.linear_attention_layers is not None:
        raise ValueError("padding for tensor parallelism is not supported for gated attention "
                         "or Gated DeltaNet layers (Qwen3.5)")
    if arch.num_experts is not None and arch.expert_ffn_hidden_size % tp_size:
        raise ValueError(f"padding an expert's width ({arch.expert_ffn_hidden_size}) for "
                         f"tensor-parallel size {tp_size} is not supported")
    h, d = arch.hidden_size, arch.head_dim
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
    check_layout(new_arch, ParallelLayout.of_model(tp=tp_size), role=Role.FROZEN)
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
