"""A model as the planner counts it: a view of the one architecture type,
:class:`~megatron_kd.arch.GPTArchConfig`, with exact parameter counts (pure Python, no torch).

:class:`PlannedModel` holds a ``GPTArchConfig`` (whatever it was read from: a preset, a Hugging
Face ``config.json``, a megatron_kd checkpoint, Megatron-LM flags; :mod:`~megatron_kd.planner.
presets`) and names what the memory, FLOP and traffic models read of it: dense or
mixture-of-experts MLPs (routed, top-k, shared), grouped-query attention with QK norms and an
optional output gate (Qwen3.5), hybrid layers mixing full attention with Gated DeltaNet linear
attention (Qwen3-Next / Qwen3.5), sliding-window attention (gpt-oss), tied or untied embeddings.

Parameter counts are exact for the tensors listed below, counted the way the Hugging Face
checkpoints store them (text tower only):

* attention: ``q = h * a * d`` (doubled when the output gate is on: the query projection also
  produces the gate), ``k = v = h * g * d``, ``o = a * d * h``; biases ``a*d + 2*g*d`` on q, k,
  v (``add_qkv_bias`` or ``add_bias_linear``) and ``h`` on o (``add_bias_linear``); QK-norm
  ``2 * d``; gpt-oss attention sinks ``a``.
* Gated DeltaNet (Qwen3-Next / Qwen3.5 ``linear_attention``), with key dim ``kd = nk * dk`` and
  value dim ``vd = nv * dv``: ``in_proj_qkvz = h * (2*kd + 2*vd)``, ``in_proj_ba = h * 2*nv``,
  depthwise ``conv1d = (2*kd + vd) * kernel``, ``A_log`` and ``dt_bias`` ``2 * nv``, gated RMSNorm
  ``dv``, ``out_proj = vd * h``.
* MLP: ``3 * h * f`` with a gated linear unit (SwiGLU), else ``2 * h * f``; biases ``2f + h``
  (``f + h`` without the gate) with ``add_bias_linear``.
* MoE layer: ``E`` experts of ``3 * h * f_e`` each (plus biases with ``add_bias_linear``,
  gpt-oss), a router ``E * h`` (plus ``E`` bias for gpt-oss), an optional shared expert
  ``3 * h * f_s`` with, when gated, a scalar gate ``h`` (Qwen3.5).
* Two norms per layer ``2h``, a final norm ``h``, the input embedding ``V * h`` and, unless tied,
  the output layer ``V * h``.

"Active" parameters count ``k`` routed experts (plus the shared one) instead of ``E``; the input
embedding is a lookup, not a matmul, and is excluded from the FLOP-relevant active count but kept in
the memory-relevant totals.

Not modelled (each below 0.1% of the parameters of the presets): multi-token-prediction heads
(Qwen3.5 ``mtp_num_hidden_layers``; not trained by megatron_kd), vision towers, rotary buffers,
LayerNorm biases and learned absolute position embeddings (Megatron-LM's defaults without
``--normalization RMSNorm`` / ``--position-embedding-type rope``).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from functools import lru_cache

from megatron_kd.arch import GPTArchConfig
from megatron_kd.parallel.vocab import MAKE_VOCAB_SIZE_DIVISIBLE_BY, pad_vocab_size

__all__ = ["PlannedModel"]


@dataclass(kw_only=True, frozen=True)
class PlannedModel:
    """A named :class:`~megatron_kd.arch.GPTArchConfig`, as far as memory, FLOPs and traffic are
    concerned. Every number below is read from ``arch``; nothing is stored twice."""

    name: str
    """Preset name, or the path (or ``from-args``) it was read from."""

    arch: GPTArchConfig
    """The architecture. ``arch.vocab_size`` is the vocabulary the planner pads per layout as
    Megatron does."""

    published_total_params: float | None = None
    """Total parameters as the model card states them, for sanity checks (None if not published)."""

    published_active_params: float | None = None
    """Active parameters per token as the model card states them (MoE only)."""

    source: str = ""
    """Where the numbers come from, and every assumption made when they were incomplete."""

    vocab_multiple: int = MAKE_VOCAB_SIZE_DIVISIBLE_BY
    """A layout pads the vocabulary to a multiple of this times its tensor-parallel size, as
    Megatron does (``--make-vocab-size-divisible-by``; 1 keeps ``arch.vocab_size``, for a model
    whose vocabulary is already the padded one)."""

    _key: str = field(init=False, repr=False, compare=False)
    """The architecture as canonical JSON: the hash of a model (the memory terms are cached
    per model; ``arch`` is not changed once planned)."""

    _hash: int = field(init=False, repr=False, compare=False)
    """``hash((name, _key))``, computed once: the caches hash a model millions of times."""

    def __post_init__(self) -> None:
        if not isinstance(self.arch, GPTArchConfig):
            raise ValueError(f"PlannedModel {self.name!r}: arch must be a GPTArchConfig, "
                             f"got {type(self.arch).__name__}")
        object.__setattr__(self, "_key", json.dumps(self.arch.to_dict(), sort_keys=True))
        object.__setattr__(self, "_hash", hash((self.name, self._key, self.vocab_multiple)))

    def __hash__(self) -> int:
        return self._hash

    # --- the architecture, in the formulas' names ------------------------------------------------

    @property
    def num_layers(self) -> int:
        return self.arch.num_layers

    @property
    def hidden_size(self) -> int:
        return self.arch.hidden_size

    @property
    def num_attention_heads(self) -> int:
        return self.arch.num_attention_heads

    @property
    def num_query_groups(self) -> int:
        """Key/value heads ``g``, resolved (the head count without grouped-query attention)."""
        return self.arch.query_groups

    @property
    def head_dim(self) -> int:
        """Per-head width ``d``, resolved (not always ``h / a``: Qwen3, gpt-oss, Qwen3.5)."""
        return self.arch.head_dim

    @property
    def ffn_hidden_size(self) -> int:
        """Dense MLP width ``f``; 0 when every layer is a mixture of experts."""
        return 0 if self.is_moe else self.arch.ffn_hidden_size

    @property
    def vocab_size(self) -> int:
        return self.arch.vocab_size

    @property
    def tie_embeddings(self) -> bool:
        return self.arch.tie_embeddings

    @property
    def gated_linear_unit(self) -> bool:
        return self.arch.swiglu

    @property
    def qk_layernorm(self) -> bool:
        return self.arch.qk_layernorm

    @property
    def attention_output_gate(self) -> bool:
        return self.arch.attention_output_gate

    @property
    def attention_sinks(self) -> bool:
        return self.arch.attention_sinks

    @property
    def is_moe(self) -> bool:
        return self.arch.num_experts is not None

    @property
    def num_experts(self) -> int:
        """Routed experts ``E`` per MoE layer; 0 for a dense model."""
        return self.arch.num_experts or 0

    @property
    def moe_router_topk(self) -> int:
        """Experts each token is routed to (``k``); 0 for a dense model."""
        return self.arch.moe_router_topk if self.is_moe else 0

    @property
    def moe_ffn_hidden_size(self) -> int:
        """Width ``f_e`` of one routed expert; 0 for a dense model."""
        return self.arch.expert_ffn_hidden_size if self.is_moe else 0

    @property
    def moe_shared_expert_ffn_hidden_size(self) -> int:
        """Width ``f_s`` of the always-on shared expert; 0 if none."""
        return self.arch.moe_shared_expert_size or 0

    @property
    def linear_attention_layers(self) -> tuple[int, ...]:
        """The Gated DeltaNet layers (0-based); empty when every layer is full attention."""
        return tuple(self.arch.linear_attention_layers or ())

    @property
    def linear_num_key_heads(self) -> int:
        return self.arch.linear_num_key_heads or 0

    @property
    def linear_num_value_heads(self) -> int:
        return self.arch.linear_num_value_heads or 0

    @property
    def linear_key_head_dim(self) -> int:
        return self.arch.linear_key_head_dim or 0

    @property
    def linear_value_head_dim(self) -> int:
        return self.arch.linear_value_head_dim or 0

    @property
    def linear_conv_kernel_dim(self) -> int:
        return self.arch.linear_conv_kernel_dim

    @property
    def sliding_window(self) -> int:
        """Sliding-window length of the windowed layers; 0 if none."""
        return self.arch.window_size or 0

    # --- layer kinds -----------------------------------------------------------------------------

    def is_full_attention(self, layer: int) -> bool:
        """Whether layer ``layer`` (0-based) is a softmax-attention layer (else Gated DeltaNet)."""
        return layer not in self.linear_attention_layers

    def attention_window(self, layer: int, seq_length: int) -> int:
        """Keys each query attends to at most in layer ``layer`` (the window or the sequence).
        Only attention FLOPs depend on it: with flash attention, activation memory does not grow
        with ``s^2`` either way."""
        windowed = self.arch.window_layers
        if self.sliding_window and (windowed is None or layer in windowed):
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
        if self.arch.add_qkv_bias or self.arch.add_bias_linear:
            n += a * d * (2 if self.attention_output_gate else 1) + 2 * g * d
        if self.arch.add_bias_linear:
            n += h
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
        return self.mlp_params(self.moe_ffn_hidden_size, bias=self.arch.add_bias_linear)

    def router_params(self) -> int:
        return self.num_experts * self.hidden_size + (
            self.num_experts if self.arch.add_bias_linear else 0)

    def shared_expert_params(self) -> int:
        if not self.moe_shared_expert_ffn_hidden_size:
            return 0
        gate = self.hidden_size if self.arch.moe_shared_expert_gate else 0
        return self.mlp_params(self.moe_shared_expert_ffn_hidden_size) + gate

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
            n += self.mlp_params(self.ffn_hidden_size, bias=self.arch.add_bias_linear)
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

    def padded_vocab(self, tp: int) -> int:
        """The vocabulary as a layout of tensor-parallel size ``tp`` pads it
        (:func:`megatron_kd.parallel.vocab.pad_vocab_size`)."""
        return pad_vocab_size(self.vocab_size, tp, self.vocab_multiple)

    def arch_at(self, tp: int) -> GPTArchConfig:
        """The architecture as a run at tensor-parallel size ``tp`` builds it (the vocabulary
        padded for it): what :func:`megatron_kd.arch.check_layout` checks."""
        return _arch_at(self, tp)

    def to_dict(self) -> dict:
        """The name, every architecture field, the parameter counts and where they come from."""
        return {"name": self.name, **self.arch.to_dict(),
                "total_params": self.total_params(), "active_params": self.active_params(),
                "published_total_params": self.published_total_params,
                "published_active_params": self.published_active_params,
                "source": self.source}


@lru_cache(maxsize=1024)
def _arch_at(model: PlannedModel, tp: int) -> GPTArchConfig:
    return dataclasses.replace(model.arch, padded_vocab_size=model.padded_vocab(tp))
