"""The student's architecture: from its flags, or from ``--pretrained-checkpoint``.

With a pretrained checkpoint the architecture is the checkpoint's, and the architecture flags
are optional: each one given must say what the checkpoint has (else ``ValueError`` naming the
flag and both values), so a launch line that describes another model is refused rather than
silently overridden. Without one, the flags describe the model (``--num-layers``,
``--hidden-size`` and ``--num-attention-heads`` required) with Megatron-LM's defaults
(:data:`~megatron_kd.training.run_config.ARCH_DEFAULTS`).
"""

from __future__ import annotations

from typing import Any

from megatron_kd.arch import GPTArchConfig
from megatron_kd.training.hybrid_args import hybrid_arch_fields
from megatron_kd.training.run_config import ArchitectureSection

__all__ = ["flag_values", "student_arch"]

_REQUIRED = ("num_layers", "hidden_size", "num_attention_heads")


def flag_values(arch: GPTArchConfig) -> dict[str, Any]:
    """The architecture flags' values (``ArchitectureSection`` field -> value) that describe
    ``arch``, resolved (``num_query_groups`` the key/value heads, ``kv_channels`` the head
    width, a layer pattern as one 0 / 1 per layer, 1 linear attention)."""
    linear = arch.linear_attention_layers
    return {
        "num_layers": arch.num_layers, "hidden_size": arch.hidden_size,
        "num_attention_heads": arch.num_attention_heads, "num_query_groups": arch.query_groups,
        "ffn_hidden_size": arch.ffn_hidden_size,
        "kv_channels": arch.kv_channels or arch.hidden_size // arch.num_attention_heads,
        "max_position_embeddings": arch.max_position_embeddings,
        "normalization": arch.normalization, "norm_epsilon": arch.norm_epsilon,
        "disable_swiglu": not arch.swiglu, "position_embedding_type": arch.position_embedding_type,
        "rotary_base": arch.rotary_base,
        "use_rope_scaling": arch.rope_scaling_factor is not None,
        "rope_scaling_factor": arch.rope_scaling_factor,
        "untie_embeddings_and_output_weights": not arch.tie_embeddings,
        "add_bias_linear": arch.add_bias_linear, "init_method_std": arch.init_method_std,
        "qk_layernorm": arch.qk_layernorm, "num_experts": arch.num_experts,
        "moe_ffn_hidden_size": arch.expert_ffn_hidden_size if arch.num_experts else None,
        "moe_router_topk": arch.moe_router_topk,
        "moe_router_pre_softmax": arch.moe_router_pre_softmax,
        "experimental_attention_variant": "gated_delta_net" if linear else None,
        "linear_attention_freq": ([int(i in linear) for i in range(arch.num_layers)] if linear
                                  else None),
        "linear_conv_kernel_dim": arch.linear_conv_kernel_dim if linear else None,
        "linear_key_head_dim": arch.linear_key_head_dim,
        "linear_value_head_dim": arch.linear_value_head_dim,
        "linear_num_key_heads": arch.linear_num_key_heads,
        "linear_num_value_heads": arch.linear_num_value_heads,
        "attention_output_gate": arch.attention_output_gate,
        "rotary_percent": arch.rotary_percent,
        "moe_shared_expert_intermediate_size": arch.moe_shared_expert_size,
        "moe_shared_expert_gate": arch.moe_shared_expert_gate,
    }


def _as_given(name: str, value: Any, num_layers: int) -> Any:
    """A given flag's value in :func:`flag_values`' terms."""
    if name == "experimental_attention_variant":
        return "gated_delta_net"  # gdn is its other name
    if name == "linear_attention_freq" and isinstance(value, int):
        return [int((i + 1) % value != 0) for i in range(num_layers)]
    return value


def _from_flags(flags: ArchitectureSection, seq_length: int, vocab: int,
                padded: int) -> GPTArchConfig:
    missing = [f"--{name.replace('_', '-')}" for name in _REQUIRED if getattr(flags, name) is None]
    if missing:
        raise ValueError(f"the student's architecture needs {' '.join(missing)} (or "
                         f"--pretrained-checkpoint DIR, whose architecture it then is)")
    r = flags.resolved
    return GPTArchConfig(
        num_layers=flags.num_layers, hidden_size=flags.hidden_size,
        num_attention_heads=flags.num_attention_heads, num_query_groups=flags.num_query_groups,
        ffn_hidden_size=flags.ffn_hidden_size or 4 * flags.hidden_size,
        kv_channels=flags.kv_channels, vocab_size=vocab, padded_vocab_size=padded,
        max_position_embeddings=flags.max_position_embeddings or seq_length,
        rotary_base=r("rotary_base"), norm_epsilon=r("norm_epsilon"),
        rope_scaling_factor=(flags.rope_scaling_factor or 8.0) if flags.use_rope_scaling
        else None,
        normalization=r("normalization"), swiglu=not flags.disable_swiglu,
        tie_embeddings=not flags.untie_embeddings_and_output_weights,
        add_bias_linear=flags.add_bias_linear,
        position_embedding_type=r("position_embedding_type"),
        init_method_std=r("init_method_std"), qk_layernorm=flags.qk_layernorm,
        num_experts=flags.num_experts, moe_ffn_hidden_size=flags.moe_ffn_hidden_size,
        moe_router_topk=r("moe_router_topk"), moe_router_pre_softmax=flags.moe_router_pre_softmax,
        **hybrid_arch_fields(flags))


def _from_checkpoint(flags: ArchitectureSection, pretrained: GPTArchConfig, directory: str,
                     vocab: int, padded: int) -> GPTArchConfig:
    has = flag_values(pretrained)
    wrong = [f"--{name.replace('_', '-')} {value!r} (the checkpoint has {has[name]!r})"
             for name, value in flags.given().items()
             if _as_given(name, value, pretrained.num_layers) != has[name]]
    if wrong:
        raise ValueError(f"--pretrained-checkpoint {directory!r} is another model than the "
                         f"flags say: {'; '.join(wrong)}; drop the flags to take the "
                         f"checkpoint's architecture")
    if (pretrained.vocab_size, pretrained.padded_vocab_size) != (vocab, padded):
        raise ValueError(f"--pretrained-checkpoint {directory!r} has a vocabulary of "
                         f"{pretrained.vocab_size} tokens in {pretrained.padded_vocab_size} rows; "
                         f"this run's is {vocab} in {padded} (the teacher's, or the cache's): "
                         f"student and teacher must share one vocabulary")
    return pretrained


def student_arch(flags: ArchitectureSection, *, seq_length: int, vocab: int, padded: int,
                 pretrained: GPTArchConfig | None = None,
                 pretrained_dir: str = "") -> GPTArchConfig:
    """The student's architecture (see the module docstring), checked to hold ``seq_length``
    positions; ``ValueError`` naming the values. Its layout is checked by the run's checks
    (:func:`megatron_kd.arch.check_layout`)."""
    if pretrained is None:
        arch = _from_flags(flags, seq_length, vocab, padded)
    else:
        arch = _from_checkpoint(flags, pretrained, pretrained_dir, vocab, padded)
    if arch.max_position_embeddings < seq_length:
        raise ValueError(f"--max-position-embeddings {arch.max_position_embeddings} < "
                         f"--seq-length {seq_length}")
    return arch
