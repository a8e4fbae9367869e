"""Model architecture descriptions and exact parameter counts (pure Python, no torch).

A :class:`ModelConfig` holds what the memory, FLOP and traffic models need of a decoder-only
transformer: dense or mixture-of-experts MLPs, grouped-query attention (optionally with an output
gate, as in Qwen3.5), hybrid layers mixing full attention with Gated DeltaNet linear attention
(Qwen3-Next / Qwen3.5), sliding-window attention (gpt-oss), and tied or untied embeddings.

Parameter counts are exact for the tensors listed below, counted the way the Hugging Face
checkpoints store them (text tower only):

* attention: ``q = h * a * d`` (doubled when the output gate is on: the query projection also
  produces the gate), ``k = v = h * g * d``, ``o = a * d * h``; biases ``a*d + 2*g*d + h`` when
  ``attention_bias``; QK-norm ``2 * d``; gpt-oss attention sinks ``a``.
* Gated DeltaNet (Qwen3-Next / Qwen3.5 ``linear_attention``), with key dim ``kd = nk * dk`` and
  value dim ``vd = nv * dv``: ``in_proj_qkvz = h * (2*kd + 2*vd)``, ``in_proj_ba = h * 2*nv``,
  depthwise ``conv1d = (2*kd + vd) * kernel``, ``A_log`` and ``dt_bias`` ``2 * nv``, gated RMSNorm
  ``dv``, ``out_proj = vd * h``.
* MLP: ``3 * h * f`` with a gated linear unit (SwiGLU), else ``2 * h * f``; biases ``2f + h``.
* MoE layer: ``E`` experts of ``3 * h * f_e`` each (plus ``2 f_e + h`` biases for gpt-oss), a router
  ``E * h`` (plus ``E`` bias for gpt-oss), an optional shared expert ``3 * h * f_s`` with a scalar
  gate ``h`` (Qwen3.5).
* Two RMSNorms per layer ``2h``, a final norm ``h``, the input embedding ``V * h`` and, unless tied,
  the output layer ``V * h``.

"Active" parameters count ``k`` routed experts (plus the shared one) instead of ``E``; the input
embedding is a lookup, not a matmul, and is excluded from the FLOP-relevant active count but kept in
the memory-relevant totals.

Not modelled (each below 0.1% of the parameters of the presets): multi-token-prediction heads
(Qwen3.5 ``mtp_num_hidden_layers``; not trained by megatron_kd), vision towers, rotary buffers.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields


def _check_positive(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def _check_non_negative(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{name} must be a non-negative int, got {value!r}")


@dataclass(kw_only=True, frozen=True)
class ModelConfig:
    """A decoder-only transformer, as far as memory, FLOPs and traffic are concerned."""

    name: str
    """Preset name or the path of the config it was read from."""

    num_layers: int
    """Transformer layers (``num_hidden_layers``)."""

    hidden_size: int
    """Model width ``h``."""

    num_attention_heads: int
    """Query heads ``a`` of the full-attention layers."""

    num_query_groups: int
    """Key/value heads ``g`` (grouped-query attention); equal to ``num_attention_heads`` for MHA."""

    head_dim: int
    """Per-head width ``d`` (``kv_channels``); not always ``h / a`` (Qwen3, gpt-oss, Qwen3.5)."""

    ffn_hidden_size: int
    """Dense MLP width ``f``; 0 when every layer is a mixture of experts."""

    vocab_size: int
    """Unpadded vocabulary size ``V`` of the checkpoint's embedding."""

    tie_embeddings: bool
    """Whether the output layer shares the input embedding's weight."""

    gated_linear_unit: bool = True
    """SwiGLU MLP (gate and up projections) instead of a two-matrix GeLU MLP."""

    qk_layernorm: bool = False
    """RMSNorm on queries and keys (Qwen3, Qwen3.5)."""

    attention_output_gate: bool = False
    """Sigmoid output gate on attention, produced by the query projection (Qwen3.5)."""

    attention_bias: bool = False
    """Biases on q, k, v and o projections (gpt-oss)."""

    attention_sinks: bool = False
    """One learned sink logit per head (gpt-oss)."""

    num_experts: int = 0
    """Routed experts ``E`` per MoE layer; 0 for a dense model."""

    moe_router_topk: int = 0
    """Experts each token is routed to (``k``)."""

    moe_ffn_hidden_size: int = 0
    """Width ``f_e`` of one routed expert."""

    moe_shared_expert_ffn_hidden_size: int = 0
    """Width ``f_s`` of the always-on shared expert; 0 if none."""

    moe_bias: bool = False
    """Biases in experts and router (gpt-oss)."""

    linear_attention_freq: int = 0
    """Hybrid layout: every ``linear_attention_freq``-th layer is full attention, the others Gated
    DeltaNet (Qwen3.5: 4). 0 means every layer is full attention."""

    linear_num_key_heads: int = 0
    """Gated DeltaNet key heads ``nk``."""

    linear_num_value_heads: int = 0
    """Gated DeltaNet value heads ``nv``."""

    linear_key_head_dim: int = 0
    """Gated DeltaNet key head width ``dk``."""

    linear_value_head_dim: int = 0
    """Gated DeltaNet value head width ``dv``."""

    linear_conv_kernel_dim: int = 0
    """Gated DeltaNet depthwise convolution kernel width."""

    sliding_window: int = 0
    """Sliding-window length of the windowed layers; 0 if none."""

    sliding_window_every: int = 0
    """Every ``sliding_window_every``-th layer (counting from the first) uses the window (gpt-oss:
    2, alternating); 0 if none. Only attention FLOPs depend on it: with flash attention, activation
    memory does not grow with ``s^2`` either way."""

    published_total_params: float | None = None
    """Total parameters as the model card states them, for sanity checks (None if not published)."""

    published_active_params: float | None = None
    """Active parameters per token as the model card states them (MoE only)."""

    source: str = ""
    """Where the numbers come from, and every assumption made when they were incomplete."""

    def __post_init__(self) -> None:
        for name in (
            "num_layers",
            "hidden_size",
            "num_attention_heads",
            "num_query_groups",
            "head_dim",
            "vocab_size",
        ):
            _check_positive(name, getattr(self, name))
        for name in (
            "ffn_hidden_size",
            "num_experts",
            "moe_router_topk",
            "moe_ffn_hidden_size",
            "moe_shared_expert_ffn_hidden_size",
            "linear_attention_freq",
            "linear_num_key_heads",
            "linear_num_value_heads",
            "linear_key_head_dim",
            "linear_value_head_dim",
            "linear_conv_kernel_dim",
            "sliding_window",
            "sliding_window_every",
        ):
            _check_non_negative(name, getattr(self, name))
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_query_groups={self.num_query_groups}"
            )
        if self.num_experts:
            if not 0 < self.moe_router_topk <= self.num_experts:
                raise ValueError(
                    f"moe_router_topk={self.moe_router_topk} must be in 1..num_experts="
                    f"{self.num_experts}"
                )
            if self.moe_ffn_hidden_size <= 0:
                raise ValueError(
                    f"an MoE model needs moe_ffn_hidden_size > 0, got {self.moe_ffn_hidden_size}"
                )
        else:
            if self.ffn_hidden_size <= 0:
                raise ValueError(
                    f"a dense model needs ffn_hidden_size > 0, got {self.ffn_hidden_size}"
                )
            if (
                self.moe_router_topk
                or self.moe_ffn_hidden_size
                or self.moe_shared_expert_ffn_hidden_size
            ):
                raise ValueError(
                    f"MoE fields set (moe_router_topk={self.moe_router_topk}, moe_ffn_hidden_size="
                    f"{self.moe_ffn_hidden_size}) but num_experts=0"
                )
        if self.linear_attention_freq:
            linear = (
                self.linear_num_key_heads,
                self.linear_num_value_heads,
                self.linear_key_head_dim,
                self.linear_value_head_dim,
                self.linear_conv_kernel_dim,
            )
            if min(linear) <= 0:
                raise ValueError(
                    f"linear_attention_freq={self.linear_attention_freq} needs every linear_* "
                    f"field > 0, got (nk, nv, dk, dv, kernel)={linear}"
                )
        if bool(self.sliding_window) != bool(self.sliding_window_every):
            raise ValueError(
                f"sliding_window={self.sliding_window} and sliding_window_every="
                f"{self.sliding_window_every} must both be set or both be 0"
            )

    # --- layer kinds
    # -------------------------------------------------------------------------------

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def is_full_attention(self, layer: int) -> bool:
        """Whether layer ``layer`` (0-based) is a softmax-attention layer (else Gated DeltaNet)."""
        if not self.linear_attention_freq:
            return True
        return (layer + 1) % self.linear_attention_freq == 0

    def attention_window(self, layer: int, seq_length: int) -> int:
        """Keys each query attends to at most in layer ``layer`` (the window or the sequence)."""
        if self.sliding_window_every and layer % self.sliding_window_every == 0:
            return min(self.sliding_window, seq_length)
        return seq_length

    # --- parameter counts, per piece -----------------------------------------------------------

    def attention_params(self) -> int:
        h, a, g, d = (
            self.hidden_size,
            self.num_attention_heads,
            self.num_query_groups,
            self.head_dim,
        )
        q = h * a * d * (2 if self.attention_output_gate else 1)
        n = q + 2 * h * g * d + a * d * h
        if self.attention_bias:
            n += a * d * (2 if self.attention_output_gate else 1) + 2 * g * d + h
        if self.qk_layernorm:
            n += 2 * d
        if self.attention_sinks:
            n += a
        return n

    def linear_attention_params(self) -> int:
        h = self.hidden_size
        kd = self.linear_num_key_heads * self.linear_key_head_dim
        vd = self.linear_num_value_heads * self.linear_value_head_dim
        nv = self.linear_num_value_heads
        return (
            h * (2 * kd + 2 * vd)
            + h * 2 * nv
            + (2 * kd + vd) * self.linear_conv_kernel_dim
            + 2 * nv
            + self.linear_value_head_dim
            + vd * h
        )

    def mlp_params(self, ffn: int, bias: bool = False) -> int:
        h = self.hidden_size
        n = (3 if self.gated_linear_unit else 2) * h * ffn
        if bias:
            n += (2 if self.gated_linear_unit else 1) * ffn + h
        return n

    def expert_params(self) -> int:
        """One routed expert."""
        return self.mlp_params(self.moe_ffn_hidden_size, bias=self.moe_bias)

    def router_params(self) -> int:
        return self.num_experts * self.hidden_size + (self.num_experts if self.moe_bias else 0)

    def shared_expert_params(self) -> int:
        if not self.moe_shared_expert_ffn_hidden_size:
            return 0
        return self.mlp_params(self.moe_shared_expert_ffn_hidden_size) + self.hidden_size  # + gate

    def mixer_params(self, layer: int) -> int:
        """Token mixer of layer ``layer``: attention or Gated DeltaNet."""
        return (
            self.attention_params()
            if self.is_full_attention(layer)
            else self.linear_attention_params()
        )

    def layer_dense_params(self, layer: int) -> int:
        """Parameters of layer ``layer`` that are not routed experts (mixer, dense MLP or router and
        shared expert, two norms)."""
        n = self.mixer_params(layer) + 2 * self.hidden_size
        if self.is_moe:
            n += self.router_params() + self.shared_expert_params()
        else:
            n += self.mlp_params(self.ffn_hidden_size)
        return n

    def layer_expert_params(self) -> int:
        """Routed-expert parameters of one MoE layer (all ``E`` experts)."""
        return self.num_experts * self.expert_params() if self.is_moe else 0

    def embedding_params(self, vocab_size: int | None = None) -> int:
        return (self.vocab_size if vocab_size is None else vocab_size) * self.hidden_size

    # --- totals ----------------------------------------------------------------------------------

    def total_params(self) -> int:
        """Every parameter of the text model (unpadded vocabulary)."""
        n = sum(
            self.layer_dense_params(i) + self.layer_expert_params() for i in range(self.num_layers)
        )
        n += self.hidden_size  # final norm
        n += self.embedding_params() * (1 if self.tie_embeddings else 2)
        return n

    def active_params(self, include_input_embedding: bool = False) -> int:
        """Parameters one token touches: ``k`` routed experts instead of ``E``; includes the output
        layer. The input embedding is a lookup, not a matmul: excluded by default (the gpt-oss model
        card's convention, and what FLOP counts need); the Qwen model cards include it."""
        n = sum(self.layer_dense_params(i) for i in range(self.num_layers))
        if self.is_moe:
            n += self.num_layers * self.moe_router_topk * self.expert_params()
        n += self.hidden_size + self.embedding_params()  # final norm + output layer
        if include_input_embedding and not self.tie_embeddings:
            n += self.embedding_params()
        return n

    def to_dict(self) -> dict:
        return asdict(self)


# --- reading Hugging Face config.json ----------------------------------------------------------

_HF_REQUIRED = ("num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size")
#: Gated DeltaNet keys of a Hugging Face config, named as the :class:`ModelConfig` fields.
_HF_LINEAR_ATTENTION_KEYS = (
    "linear_num_key_heads",
    "linear_num_value_heads",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_conv_kernel_dim",
)


def from_hf_config(config: dict, name: str = "config.json") -> ModelConfig:
    """A :class:`ModelConfig` from a Hugging Face ``config.json`` dict (Llama, Qwen3, Qwen3-MoE,
    Qwen3-Next / Qwen3.5, gpt-oss). Multimodal configs are read from their ``text_config``.

    Raises ``ValueError`` naming the missing keys rather than guessing them.
    """
    config = _hf_text_config(config)
    missing = [k for k in _HF_REQUIRED if k not in config]
    if missing:
        raise ValueError(f"{name}: missing keys {missing} (have {sorted(config)})")
    heads = int(config["num_attention_heads"])
    hidden = int(config["hidden_size"])
    num_experts = int(config.get("num_experts", config.get("num_local_experts", 0)) or 0)
    model_type = str(config.get("model_type", ""))
    gpt_oss = model_type.startswith("gpt_oss")
    linear_freq = _hf_linear_attention_freq(config, name)
    sliding, sliding_every = _hf_sliding_window(config)
    dense_ffn, moe_ffn = _hf_ffn_sizes(config, name, num_experts)
    return ModelConfig(
        name=name,
        num_layers=int(config["num_hidden_layers"]),
        hidden_size=hidden,
        num_attention_heads=heads,
        num_query_groups=int(config.get("num_key_value_heads", heads)),
        head_dim=int(config.get("head_dim", hidden // heads)),
        ffn_hidden_size=dense_ffn,
        vocab_size=int(config["vocab_size"]),
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        qk_layernorm=model_type.startswith(("qwen3", "qwen3_5")),
        # Qwen3-Next and Qwen3.5 always gate (their configs may not say so)
        attention_output_gate=bool(config.get("attn_output_gate", model_type.startswith(
            ("qwen3_next", "qwen3_5")))),
        attention_bias=bool(config.get("attention_bias", False)),
        attention_sinks=gpt_oss,
        num_experts=num_experts,
        moe_router_topk=int(config.get("num_experts_per_tok", 0) or 0) if num_experts else 0,
        moe_ffn_hidden_size=moe_ffn,
        moe_shared_expert_ffn_hidden_size=int(
            config.get("shared_expert_intermediate_size", 0) or 0
        ),
        moe_bias=gpt_oss,
        **_hf_linear_attention_fields(config, linear_freq),
        sliding_window=sliding if sliding_every else 0,
        sliding_window_every=sliding_every if sliding else 0,
        source=f"read from {name}",
    )


def _hf_text_config(config: dict) -> dict:
    """The text tower's config: a multimodal one's ``text_config`` (outer tie kept), or itself."""
    if "text_config" in config and isinstance(config["text_config"], dict):
        outer_tie = config.get("tie_word_embeddings")
        config = dict(config["text_config"])
        if "tie_word_embeddings" not in config and outer_tie is not None:
            config["tie_word_embeddings"] = outer_tie
    return config


def _hf_linear_attention_freq(config: dict, name: str) -> int:
    """Every how many layers one is full attention among Gated DeltaNet ones (0: none linear)."""
    layer_types = config.get("layer_types")
    linear_freq = int(config.get("full_attention_interval", 0) or 0)
    if layer_types and "linear_attention" in layer_types and not linear_freq:
        full = [i for i, t in enumerate(layer_types) if t == "full_attention"]
        linear_freq = full[0] + 1 if full else 0  # layer i is full when (i + 1) % freq == 0
        if not full or full != list(range(linear_freq - 1, len(layer_types), linear_freq)):
            raise ValueError(
                f"{name}: cannot infer full_attention_interval from layer_types {layer_types}"
            )
    return linear_freq


def _hf_sliding_window(config: dict) -> tuple[int, int]:
    """``(window, every)``: the sliding window and every how many layers one uses it."""
    layer_types = config.get("layer_types")
    sliding = int(config.get("sliding_window", 0) or 0)
    sliding_every = 0
    if sliding and layer_types and "sliding_attention" in layer_types:
        n_sliding = sum(t == "sliding_attention" for t in layer_types)
        sliding_every = round(len(layer_types) / n_sliding)
    elif sliding and not layer_types:
        sliding = 0  # Llama / Qwen configs carry an unused sliding_window; use_sliding_window false
    if config.get("use_sliding_window") is False:
        sliding, sliding_every = 0, 0
    return sliding, sliding_every


def _hf_ffn_sizes(config: dict, name: str, num_experts: int) -> tuple[int, int]:
    """``(dense MLP width, expert MLP width)``, the one that does not apply 0."""
    if num_experts:
        return 0, int(config.get("moe_intermediate_size", config.get("intermediate_size", 0)))
    if "intermediate_size" not in config:
        raise ValueError(f"{name}: dense model without intermediate_size")
    return int(config["intermediate_size"]), 0


def _hf_linear_attention_fields(config: dict, linear_freq: int) -> dict[str, int]:
    """The Gated DeltaNet fields of :class:`ModelConfig` (all 0 without linear attention)."""
    out = {"linear_attention_freq": linear_freq}
    for key in _HF_LINEAR_ATTENTION_KEYS:
        out[key] = int(config.get(key, 0) or 0) if linear_freq else 0
    return out


def from_megatron_kd_arch(arch: dict, name: str = "model_config.json") -> ModelConfig:
    """A :class:`ModelConfig` from the ``arch`` of a megatron_kd checkpoint's ``model_config.json``
    (``GPTArchConfig`` fields: dense GPT, SwiGLU or GeLU, tied or not). The vocabulary is the true
    one; the planner pads it as Megatron does."""
    required = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "vocab_size")
    missing = [k for k in required if k not in arch]
    if missing:
        raise ValueError(f"{name}: arch lacks {missing}")
    heads = int(arch["num_attention_heads"])
    return ModelConfig(
        name=name,
        num_layers=int(arch["num_layers"]),
        hidden_size=int(arch["hidden_size"]),
        num_attention_heads=heads,
        num_query_groups=int(arch.get("num_query_groups") or heads),
        head_dim=int(arch.get("kv_channels") or int(arch["hidden_size"]) // heads),
        ffn_hidden_size=int(arch["ffn_hidden_size"]),
        vocab_size=int(arch["vocab_size"]),
        tie_embeddings=bool(arch.get("tie_embeddings", False)),
        gated_linear_unit=bool(arch.get("swiglu", True)),
        attention_bias=bool(arch.get("add_bias_linear", False)),
        source=f"megatron_kd checkpoint {name}",
    )


def model_field_names() -> list[str]:
    return [f.name for f in fields(ModelConfig)]


__all__ = [
    "ModelConfig",
    "from_hf_config",
    "from_megatron_kd_arch",
    "model_field_names",
]
