"""Megatron-Core ``GPTModel`` weights (local spec, TP 1 / EP 1 names) -> Hugging Face weights:
the inverse of :func:`megatron_kd.hf.import_weights.convert_hf_state_dict`, a layer at a
time, pure tensors.

``arch`` is the checkpoint's architecture (its stored shapes); ``target`` the Hugging Face
model's (the same but for what ``import-hf --pad-for-tensor-parallel`` added: dummy query
groups at the end of ``linear_qkv`` with zero ``linear_proj`` columns, zero MLP units after
each half of ``linear_fc1``). What the padding added is cut off again, after checking it is
still exactly zero (a dummy head adds nothing only while it is). The vocabulary's padding rows
are cut to the Hugging Face config's ``vocab_size``.

Names are the ones transformers saves (``model.layers.{i}.self_attn.q_proj.weight``; experts
one by one for Qwen3-MoE and Qwen3.5-MoE, fused and interleaved for gpt-oss), so the output
loads with ``from_pretrained`` and equals the source checkpoint tensor for tensor.
"""

from __future__ import annotations

import torch

from megatron_kd.arch import GPTArchConfig

__all__ = ["export_embedding", "export_final", "export_layer"]

# Qwen3.5's x * (1 + w) norms are imported with 1 added (import_weights._ZERO_CENTRED_NORMS).
_ZERO_CENTRED = ("input_layernorm.weight", "pre_mlp_layernorm.weight",
                 "q_layernorm.weight", "k_layernorm.weight")


def _take(sd: dict[str, torch.Tensor], name: str, shape: tuple[int, ...]) -> torch.Tensor:
    if name not in sd:
        raise ValueError(f"checkpoint has no tensor {name!r}")
    t = sd.pop(name)
    if tuple(t.shape) != shape:
        raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(t.shape)}, the "
                         f"architecture implies {shape}")
    return t


def _unpad(t: torch.Tensor, keep: int, dim: int, what: str) -> torch.Tensor:
    """The first ``keep`` entries of ``t`` along ``dim``; the rest must be zero padding."""
    if t.shape[dim] == keep:
        return t
    if t.narrow(dim, keep, t.shape[dim] - keep).any():
        raise ValueError(f"{what}: the entries past {keep} along dim {dim} (padding added by "
                         f"import-hf --pad-for-tensor-parallel) are no longer zero; the model "
                         f"cannot be exported at the original size")
    return t.narrow(dim, 0, keep)


def _zero_centred(w: torch.Tensor) -> torch.Tensor:
    # x * (1 + w) in Hugging Face, x * w' with w' = 1 + w here; exact whenever 1 + w was
    return (w.float() - 1.0).to(w.dtype)


def _export_attention(sd, out, arch, target, src, dst) -> None:
    h, nh, ng, d = arch.hidden_size, arch.num_attention_heads, arch.query_groups, arch.head_dim
    ng_t, nh_t = target.query_groups, target.num_attention_heads
    per = nh // ng  # query heads per group (padding adds whole groups)
    q_rows = per * d * (2 if arch.attention_output_gate else 1)
    qkv = _take(sd, src + "self_attention.linear_qkv.weight", (ng * (q_rows + 2 * d), h))
    qkv = _unpad(qkv.reshape(ng, q_rows + 2 * d, h), ng_t, 0, src + "linear_qkv dummy groups")
    q, k, v = qkv.split([q_rows, d, d], dim=1)
    if arch.attention_output_gate:
        # Megatron: per group [its query heads, their gate heads]; HF: per head [q, gate]
        q = q.reshape(ng_t, 2, per, d, h).transpose(1, 2)
    out[dst + "self_attn.q_proj.weight"] = q.reshape(-1, h)
    out[dst + "self_attn.k_proj.weight"] = k.reshape(ng_t * d, h)
    out[dst + "self_attn.v_proj.weight"] = v.reshape(ng_t * d, h)
    proj = _take(sd, src + "self_attention.linear_proj.weight", (h, nh * d))
    out[dst + "self_attn.o_proj.weight"] = _unpad(proj, nh_t * d, 1,
                                                  src + "linear_proj dummy heads")
    if arch.add_qkv_bias:
        b = _take(sd, src + "self_attention.linear_qkv.bias", (ng * (q_rows + 2 * d),))
        qb, kb, vb = b.reshape(ng, -1)[:ng_t].split([q_rows, d, d], dim=1)
        out[dst + "self_attn.q_proj.bias"] = qb.reshape(-1)
        out[dst + "self_attn.k_proj.bias"] = kb.reshape(-1)
        out[dst + "self_attn.v_proj.bias"] = vb.reshape(-1)
    if arch.add_bias_linear:
        out[dst + "self_attn.o_proj.bias"] = _take(sd, src + "self_attention.linear_proj.bias",
                                                   (h,))
    if arch.attention_sinks:
        out[dst + "self_attn.sinks"] = _take(
            sd, src + "self_attention.core_attention.softmax_offset", (nh,))
    if arch.qk_layernorm:
        out[dst + "self_attn.q_norm.weight"] = _take(
            sd, src + "self_attention.q_layernorm.weight", (d,))
        out[dst + "self_attn.k_norm.weight"] = _take(
            sd, src + "self_attention.k_layernorm.weight", (d,))


def _export_deltanet(sd, out, arch, src, dst) -> None:
    """``in_proj = [q; k; v; z; b; a]`` -> ``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``,
    ``in_proj_a`` (import_weights._convert_deltanet, reversed)."""
    h, m, a = arch.hidden_size, src + "self_attention.", dst + "linear_attn."
    kd = arch.linear_num_key_heads * arch.linear_key_head_dim
    vd = arch.linear_num_value_heads * arch.linear_value_head_dim
    nv = arch.linear_num_value_heads
    qkv, z, b, alpha = _take(sd, m + "in_proj.weight", (2 * kd + 2 * vd + 2 * nv, h)).split(
        [2 * kd + vd, vd, nv, nv], dim=0)
    out.update({a + "in_proj_qkv.weight": qkv, a + "in_proj_z.weight": z,
                a + "in_proj_b.weight": b, a + "in_proj_a.weight": alpha})
    out[a + "conv1d.weight"] = _take(sd, m + "conv1d.weight",
                                     (2 * kd + vd, 1, arch.linear_conv_kernel_dim))
    out[a + "A_log"] = _take(sd, m + "A_log", (nv,))
    out[a + "dt_bias"] = _take(sd, m + "dt_bias", (nv,))
    out[a + "norm.weight"] = _take(sd, m + "out_norm.weight", (arch.linear_value_head_dim,))
    out[a + "out_proj.weight"] = _take(sd, m + "out_proj.weight", (h, vd))


def _export_swiglu(sd, out, src, dst, width, keep, h) -> None:
    gate, up = _take(sd, src + "linear_fc1.weight", (2 * width, h)).chunk(2, dim=0)
    out[dst + "gate_proj.weight"] = _unpad(gate, keep, 0, src + "linear_fc1 padded units")
    out[dst + "up_proj.weight"] = _unpad(up, keep, 0, src + "linear_fc1 padded units")
    out[dst + "down_proj.weight"] = _unpad(_take(sd, src + "linear_fc2.weight", (h, width)),
                                           keep, 1, src + "linear_fc2 padded units")


def _export_experts(sd, out, arch, src, dst) -> None:
    """Router, experts one by one (what transformers saves) and the gated shared expert."""
    e_n, h, f = arch.num_experts, arch.hidden_size, arch.expert_ffn_hidden_size
    out[dst + "gate.weight"] = _take(sd, src + "router.weight", (e_n, h))
    for e in range(e_n):
        _export_swiglu(sd, out, f"{src}experts.local_experts.{e}.", f"{dst}experts.{e}.", f, f,
                       h)
    if arch.moe_shared_expert_size is not None:
        w = arch.moe_shared_expert_size
        _export_swiglu(sd, out, src + "shared_experts.", dst + "shared_expert.", w, w, h)
    if arch.moe_shared_expert_gate:
        out[dst + "shared_expert_gate.weight"] = _take(sd, src + "shared_experts.gate_weight",
                                                       (1, h))


def _export_gpt_oss_experts(sd, out, arch, src, dst) -> None:
    """gpt-oss's fused experts: ``gate_up_proj [E, h, 2f]`` with gate and up interleaved
    (gate ``[..., ::2]``, up ``[..., 1::2]``), ``down_proj [E, f, h]``, and their biases."""
    e_n, h, f = arch.num_experts, arch.hidden_size, arch.expert_ffn_hidden_size
    out[dst + "router.weight"] = _take(sd, src + "router.weight", (e_n, h))
    out[dst + "router.bias"] = _take(sd, src + "router.bias", (e_n,))
    experts = [f"{src}experts.local_experts.{e}." for e in range(e_n)]
    fc1 = torch.stack([_take(sd, x + "linear_fc1.weight", (2 * f, h)) for x in experts])
    fc1_bias = torch.stack([_take(sd, x + "linear_fc1.bias", (2 * f,)) for x in experts])
    gate_up = fc1.new_empty(e_n, h, 2 * f)
    gate_up[..., ::2], gate_up[..., 1::2] = fc1[:, :f].transpose(1, 2), fc1[:, f:].transpose(1, 2)
    gate_up_bias = fc1_bias.new_empty(e_n, 2 * f)
    gate_up_bias[:, ::2], gate_up_bias[:, 1::2] = fc1_bias[:, :f], fc1_bias[:, f:]
    out[dst + "experts.gate_up_proj"] = gate_up
    out[dst + "experts.gate_up_proj_bias"] = gate_up_bias
    out[dst + "experts.down_proj"] = torch.stack(
        [_take(sd, x + "linear_fc2.weight", (h, f)).t() for x in experts])
    out[dst + "experts.down_proj_bias"] = torch.stack(
        [_take(sd, x + "linear_fc2.bias", (h,)) for x in experts])


def export_layer(local: dict[str, torch.Tensor], index: int, arch: GPTArchConfig,
                 target: GPTArchConfig) -> dict[str, torch.Tensor]:
    """Layer ``index``'s Hugging Face tensors (``model.layers.{index}.*``) from its local-spec
    tensors (``decoder.layers.{index}.*``, as
    :meth:`~megatron_kd.hf.checkpoint_reader.CheckpointWeights.layer` gives them).
    Every tensor of ``local`` must be used, else ``ValueError`` lists the rest."""
    sd = dict(local)
    src, dst = f"decoder.layers.{index}.", f"model.layers.{index}."
    h = arch.hidden_size
    hybrid = arch.linear_attention_layers is not None  # Qwen3.5
    if hybrid:
        for name in list(sd):
            if name.endswith(_ZERO_CENTRED):
                sd[name] = _zero_centred(sd[name])
    out: dict[str, torch.Tensor] = {}
    if hybrid and index in arch.linear_attention_layers:
        _export_deltanet(sd, out, arch, src, dst)
    else:
        _export_attention(sd, out, arch, target, src, dst)
    if arch.num_experts is None:
        _export_swiglu(sd, out, src + "mlp.", dst + "mlp.", arch.ffn_hidden_size,
                       target.ffn_hidden_size, h)
    elif arch.attention_sinks:  # gpt-oss
        _export_gpt_oss_experts(sd, out, arch, src + "mlp.", dst + "mlp.")
    else:
        _export_experts(sd, out, arch, src + "mlp.", dst + "mlp.")
    out[dst + "input_layernorm.weight"] = _take(sd, src + "input_layernorm.weight", (h,))
    out[dst + "post_attention_layernorm.weight"] = _take(sd, src + "pre_mlp_layernorm.weight",
                                                         (h,))
    if sd:
        raise ValueError(f"layer {index}: checkpoint tensors not exported (not the "
                         f"architecture its model_config names?): {sorted(sd)[:8]}"
                         f"{' ...' if len(sd) > 8 else ''}")
    return out


def export_embedding(weight: torch.Tensor, arch: GPTArchConfig,
                     vocab_rows: int) -> dict[str, torch.Tensor]:
    """``model.embed_tokens.weight``: the first ``vocab_rows`` rows (the Hugging Face config's
    ``vocab_size``) of the padded embedding."""
    _check_rows(weight, arch, vocab_rows, "embedding.word_embeddings.weight")
    return {"model.embed_tokens.weight": weight[:vocab_rows]}


def export_final(norm: torch.Tensor, output_layer: torch.Tensor | None, arch: GPTArchConfig,
                 vocab_rows: int) -> dict[str, torch.Tensor]:
    """``model.norm.weight`` and, untied, ``lm_head.weight`` (its first ``vocab_rows``
    rows)."""
    if tuple(norm.shape) != (arch.hidden_size,):
        raise ValueError(f"decoder.final_layernorm.weight has shape {tuple(norm.shape)}, "
                         f"expected {(arch.hidden_size,)}")
    out = {"model.norm.weight": _zero_centred(norm) if arch.linear_attention_layers is not None
           else norm}
    if arch.tie_embeddings:
        return out
    if output_layer is None:
        raise ValueError("untied checkpoint (tie_embeddings=False) has no output_layer.weight")
    _check_rows(output_layer, arch, vocab_rows, "output_layer.weight")
    out["lm_head.weight"] = output_layer[:vocab_rows]
    return out


def _check_rows(weight: torch.Tensor, arch: GPTArchConfig, vocab_rows: int, name: str) -> None:
    if tuple(weight.shape) != (arch.padded_vocab_size, arch.hidden_size):
        raise ValueError(f"{name} has shape {tuple(weight.shape)}, expected "
                         f"{(arch.padded_vocab_size, arch.hidden_size)}")
    if not arch.vocab_size <= vocab_rows <= arch.padded_vocab_size:
        raise ValueError(f"the Hugging Face vocabulary of {vocab_rows} rows is outside "
                         f"[{arch.vocab_size} tokens, {arch.padded_vocab_size} stored rows]")
