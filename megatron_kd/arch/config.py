"""The architecture of a decoder-only GPT (teacher or student), independent of any parallel layout.

:class:`GPTArchConfig` is what a checkpoint's ``model_config.json`` stores and what
:func:`megatron_kd.integration.gpt.build_gpt_model` builds: Llama family by default (RMSNorm,
SwiGLU, RoPE, GQA, optional tied embeddings). Pure Python: the planner and the checks read it
without Megatron. Which layouts it can be split over is
:func:`megatron_kd.arch.layout.check_layout`'s to say.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

__all__ = ["GPTArchConfig"]

_NORMALIZATIONS = ("RMSNorm", "LayerNorm")
_POSITION_EMBEDDINGS = ("rope", "yarn", "learned_absolute", "none")
_GATED_ACTIVATIONS = ("silu", "quick_gelu")


@dataclass(kw_only=True)
class GPTArchConfig:
    """Architecture of a decoder-only Megatron-Core GPT model (not the training recipe)."""

    num_layers: int
    """Number of transformer layers."""

    hidden_size: int
    """Model width ``h``."""

    num_attention_heads: int
    """Number of query heads."""

    num_query_groups: int | None
    """Number of key/value heads (grouped-query attention); None means one per query head."""

    ffn_hidden_size: int
    """Width of the MLP's hidden layer (per branch with SwiGLU)."""

    vocab_size: int
    """The true vocabulary: the tokenizer's number of tokens. Columns at or above it are padding
    and are excluded from the loss."""

    padded_vocab_size: int
    """Rows of the embedding and output layer (``>= vocab_size``); divisible by the
    tensor-parallel size the model is built with."""

    max_position_embeddings: int
    """Longest sequence the model is built for (size of learned position embeddings)."""

    rotary_base: float = 10000.0
    """RoPE base ``theta``."""

    norm_epsilon: float = 1e-5
    """Epsilon of every normalisation layer."""

    normalization: str = "RMSNorm"
    """``"RMSNorm"`` or ``"LayerNorm"``."""

    swiglu: bool = True
    """Gated SiLU MLP (Llama); False gives a GeLU MLP."""

    tie_embeddings: bool = False
    """The output layer reuses the input embedding matrix."""

    add_bias_linear: bool = False
    """Biases in the attention and MLP linear layers."""

    position_embedding_type: str = "rope"
    """``"rope"``, ``"learned_absolute"`` or ``"none"``."""

    init_method_std: float = 0.02
    """Standard deviation of the normal weight init (Megatron's; keeps tied softmaxes sane)."""

    kv_channels: int | None = None
    """Per-head width; None means ``hidden_size // num_attention_heads``."""

    qk_layernorm: bool = False
    """A normalisation of each query and key head before RoPE (Qwen3; Megatron-LM
    ``--qk-layernorm``)."""

    num_experts: int | None = None
    """Experts of every layer's mixture-of-experts MLP; None is a dense MLP
    (``--num-experts``)."""

    moe_ffn_hidden_size: int | None = None
    """Hidden width of one expert (per SwiGLU branch); None means ``ffn_hidden_size``
    (``--moe-ffn-hidden-size``)."""

    moe_router_topk: int = 2
    """Experts each token is routed to (``--moe-router-topk``)."""

    moe_router_pre_softmax: bool = False
    """Softmax over all experts, then the top k (their probabilities not renormalised); False
    is top k of the router logits, then a softmax over those k, which equals renormalising
    the top-k probabilities (``--moe-router-pre-softmax``)."""

    add_qkv_bias: bool = False
    """Biases on the query, key and value projections only (Megatron's ``add_qkv_bias``)."""

    attention_sinks: bool = False
    """A learned per-head logit in every attention softmax's denominator (gpt-oss; Megatron's
    ``softmax_type="learnable"``)."""

    window_size: int | None = None
    """Sliding-window attention: a query attends to itself and the ``window_size - 1`` tokens
    before it (Hugging Face's ``sliding_window``); None is full attention."""

    window_layers: list[int] | None = None
    """The layers (0-based) with the sliding window; None is every layer."""

    gated_activation: str = "silu"
    """The gate's activation of the gated MLP: ``"silu"`` (SwiGLU) or ``"quick_gelu"``
    (``x * sigmoid(1.702 x)``, gpt-oss)."""

    glu_linear_offset: float = 0.0
    """Added to the linear half of the gated MLP (gpt-oss: ``(up + 1)``)."""

    activation_clamp: float | None = None
    """Clamp of the gated MLP's inputs: gate to ``<= c``, linear half to ``[-c, c]`` (gpt-oss:
    7)."""

    yarn_factor: float | None = None
    """YaRN RoPE scaling (``position_embedding_type="yarn"``): the context extension factor."""

    yarn_original_max_position_embeddings: int | None = None
    """YaRN: the context length RoPE was trained at."""

    yarn_beta_fast: float = 32.0
    """YaRN: the high-frequency boundary (rotations)."""

    yarn_beta_slow: float = 1.0
    """YaRN: the low-frequency boundary (rotations)."""

    yarn_truncate: bool = True
    """YaRN: round the correction range to whole dimensions (Hugging Face's ``truncate``)."""

    rope_scaling_factor: float | None = None
    """Llama 3.1-style RoPE frequency scaling (Hugging Face ``rope_type`` "llama3"; Megatron-LM's
    ``--use-rope-scaling --rope-scaling-factor``): low frequencies divided by this factor, with
    Megatron-Core's fixed low / high frequency factors 1 and 4 and original context 8192
    (Llama-3.1: 8, Llama-3.2: 32). None: plain RoPE."""

    rotary_percent: float = 1.0
    """Fraction of each head's width that RoPE rotates (Qwen3.5: 0.25, Hugging Face's
    ``partial_rotary_factor``); the rest passes through unrotated."""

    attention_output_gate: bool = False
    """The attention output is multiplied by ``sigmoid(gate)``, a second per-head query
    projection (Qwen3.5's gated attention; Megatron's ``attention_output_gate``)."""

    linear_attention_layers: list[int] | None = None
    """The layers (0-based) that are Gated DeltaNet linear attention instead of softmax
    attention (Qwen3.5's ``layer_types == "linear_attention"``); None is none."""

    linear_conv_kernel_dim: int = 4
    """Gated DeltaNet: width of the causal depthwise convolution over q, k, v."""

    linear_key_head_dim: int | None = None
    """Gated DeltaNet: width of a key (and query) head."""

    linear_value_head_dim: int | None = None
    """Gated DeltaNet: width of a value head."""

    linear_num_key_heads: int | None = None
    """Gated DeltaNet: number of key (and query) heads."""

    linear_num_value_heads: int | None = None
    """Gated DeltaNet: number of value heads (a multiple of the key heads)."""

    moe_shared_expert_size: int | None = None
    """Width of a shared expert every token passes through beside the routed ones (Qwen3.5-MoE:
    ``shared_expert_intermediate_size``); None is no shared expert."""

    moe_shared_expert_gate: bool = False
    """The shared expert's output is scaled by ``sigmoid(w . x)`` per token (Qwen3.5-MoE)."""

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
                     "vocab_size", "padded_vocab_size", "max_position_embeddings"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"GPTArchConfig.{name} must be a positive int, got {value!r}")
        if self.padded_vocab_size < self.vocab_size:
            raise ValueError(
                f"GPTArchConfig.padded_vocab_size ({self.padded_vocab_size}) must be >= "
                f"vocab_size ({self.vocab_size})")
        groups = self.num_query_groups
        if groups is not None:
            if isinstance(groups, bool) or not isinstance(groups, int) or groups < 1:
                raise ValueError(f"GPTArchConfig.num_query_groups must be a positive int or None, "
                                 f"got {groups!r}")
            if self.num_attention_heads % groups != 0:
                raise ValueError(
                    f"GPTArchConfig.num_attention_heads ({self.num_attention_heads}) must be "
                    f"divisible by num_query_groups ({groups})")
        if self.kv_channels is None and self.hidden_size % self.num_attention_heads != 0:
            raise ValueError(
                f"GPTArchConfig.hidden_size ({self.hidden_size}) must be divisible by "
                f"num_attention_heads ({self.num_attention_heads}) unless kv_channels is given")
        if self.kv_channels is not None and (not isinstance(self.kv_channels, int)
                                             or self.kv_channels < 1):
            raise ValueError(f"GPTArchConfig.kv_channels must be a positive int or None, "
                             f"got {self.kv_channels!r}")
        self._check_moe()
        self._check_attention_variants()
        self._check_linear_attention()
        if self.normalization not in _NORMALIZATIONS:
            raise ValueError(f"GPTArchConfig.normalization must be one of {_NORMALIZATIONS}, "
                             f"got {self.normalization!r}")
        if self.position_embedding_type not in _POSITION_EMBEDDINGS:
            raise ValueError(
                f"GPTArchConfig.position_embedding_type must be one of {_POSITION_EMBEDDINGS}, "
                f"got {self.position_embedding_type!r}")
        if not self.rotary_base > 0:
            raise ValueError(f"GPTArchConfig.rotary_base must be > 0, got {self.rotary_base}")
        if not self.norm_epsilon > 0:
            raise ValueError(f"GPTArchConfig.norm_epsilon must be > 0, got {self.norm_epsilon}")
        if not self.init_method_std > 0:
            raise ValueError(f"GPTArchConfig.init_method_std must be > 0, "
                             f"got {self.init_method_std}")

    def _check_moe(self) -> None:
        if self.num_experts is None:
            if self.moe_ffn_hidden_size is not None:
                raise ValueError(f"GPTArchConfig.moe_ffn_hidden_size={self.moe_ffn_hidden_size} "
                                 f"needs num_experts")
            return
        for name in ("num_experts", "moe_router_topk"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"GPTArchConfig.{name} must be a positive int, got {value!r}")
        if self.moe_router_topk > self.num_experts:
            raise ValueError(f"GPTArchConfig.moe_router_topk ({self.moe_router_topk}) exceeds "
                             f"num_experts ({self.num_experts})")
        width = self.moe_ffn_hidden_size
        if width is not None and (isinstance(width, bool) or not isinstance(width, int)
                                  or width < 1):
            raise ValueError(f"GPTArchConfig.moe_ffn_hidden_size must be a positive int or "
                             f"None, got {width!r}")

    def _check_attention_variants(self) -> None:
        if self.window_size is not None and (not isinstance(self.window_size, int)
                                             or self.window_size < 1):
            raise ValueError(f"GPTArchConfig.window_size must be a positive int or None, "
                             f"got {self.window_size!r}")
        if self.window_layers is not None:
            if self.window_size is None:
                raise ValueError("GPTArchConfig.window_layers needs window_size")
            bad = [i for i in self.window_layers if not 0 <= i < self.num_layers]
            if bad:
                raise ValueError(f"GPTArchConfig.window_layers {bad} outside the "
                                 f"{self.num_layers} layers")
        if self.gated_activation not in _GATED_ACTIVATIONS:
            raise ValueError(f"GPTArchConfig.gated_activation must be one of "
                             f"{_GATED_ACTIVATIONS}, got {self.gated_activation!r}")
        if (self.position_embedding_type == "yarn") != (self.yarn_factor is not None):
            raise ValueError(f"GPTArchConfig: position_embedding_type="
                             f"{self.position_embedding_type!r} with yarn_factor="
                             f"{self.yarn_factor!r} (YaRN needs both, and only YaRN has a factor)")
        if self.yarn_factor is not None and self.yarn_original_max_position_embeddings is None:
            raise ValueError("GPTArchConfig: YaRN needs yarn_original_max_position_embeddings")
        if self.rope_scaling_factor is not None and (
                self.position_embedding_type != "rope" or not self.rope_scaling_factor > 0):
            raise ValueError(f"GPTArchConfig.rope_scaling_factor {self.rope_scaling_factor!r} "
                             f"needs position_embedding_type 'rope' (got "
                             f"{self.position_embedding_type!r}) and a factor > 0")

    def _check_linear_attention(self) -> None:
        if not 0 < self.rotary_percent <= 1:
            raise ValueError(f"GPTArchConfig.rotary_percent must be in (0, 1], "
                             f"got {self.rotary_percent}")
        if self.moe_shared_expert_size is not None and self.num_experts is None:
            raise ValueError("GPTArchConfig.moe_shared_expert_size needs num_experts")
        if self.moe_shared_expert_gate and self.moe_shared_expert_size is None:
            raise ValueError("GPTArchConfig.moe_shared_expert_gate needs moe_shared_expert_size")
        if self.linear_attention_layers is None:
            return
        bad = [i for i in self.linear_attention_layers if not 0 <= i < self.num_layers]
        if bad:
            raise ValueError(f"GPTArchConfig.linear_attention_layers {bad} outside the "
                             f"{self.num_layers} layers")
        for name in ("linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim",
                     "linear_num_key_heads", "linear_num_value_heads"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"GPTArchConfig.{name} must be a positive int with "
                                 f"linear_attention_layers, got {value!r}")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError(f"GPTArchConfig.linear_num_value_heads "
                             f"({self.linear_num_value_heads}) must be a multiple of "
                             f"linear_num_key_heads ({self.linear_num_key_heads})")
        if self.window_size is not None or self.attention_sinks:
            raise ValueError("GPTArchConfig: linear_attention_layers with sliding windows or "
                             "attention sinks is not supported")

    @property
    def expert_ffn_hidden_size(self) -> int:
        """One expert's hidden width, resolved (``ffn_hidden_size`` for a dense model)."""
        return self.moe_ffn_hidden_size or self.ffn_hidden_size

    @property
    def head_dim(self) -> int:
        """Width of an attention head: ``kv_channels``, else ``hidden_size / heads``."""
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def query_groups(self) -> int:
        """Number of key/value heads, resolved."""
        return self.num_query_groups or self.num_attention_heads

    def to_dict(self) -> dict:
        """A JSON-serialisable dict of every field."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> GPTArchConfig:
        """Inverse of :meth:`to_dict`; unknown keys raise ``ValueError``."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"unknown GPTArchConfig fields {unknown}")
        return cls(**d)
