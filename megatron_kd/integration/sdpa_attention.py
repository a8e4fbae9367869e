"""Core attention on ``torch.nn.functional.scaled_dot_product_attention``: no ``[s, s]`` scores.

Megatron-Core's local ``DotProductAttention`` materialises ``[b, heads, s_q, s_k]`` scores (and
their probabilities, and in backward their gradients): tens of GB a layer at 32K tokens. On a GPU
PyTorch's fused kernels (flash, memory-efficient, cuDNN) compute the same softmax attention in
tiles, keeping per query only its output and a log-sum-exp. :class:`SdpaAttention` is the
``core_attention`` of the local layer spec on them; :func:`causal_attention` is the functional
core that :class:`~megatron_kd.integration.context_parallel.ContextParallelAttention` also runs
on its chunks.

Which attention a local layer spec gets is decided once, in
:mod:`megatron_kd.integration.gpt` (``_block_spec``), from the choice
:func:`~megatron_kd.integration.gpt.build_gpt_model` is given (one of :data:`ATTENTION_CHOICES`,
the commands' ``--attention-backend``): ``auto`` is this module on a GPU without Transformer
Engine and Megatron-Core's ``DotProductAttention`` on the CPU; ``sdpa`` or ``unfused`` choose one
everywhere (e.g. whole models on SDPA on the CPU).

Semantics, against ``DotProductAttention`` (megatron-core 0.16.1 and 0.19.2):

* the same constructor (it is a subclass: the same per-partition sizes, dropout module,
  checkpoint layout) and forward signature; ``[s, b, heads, head_dim]`` in, ``[s, b, heads *
  head_dim]`` out, in the input dtype;
* causal masks only, optionally a sliding window ``(left, 0)``; the mask is implied by
  ``attn_mask_type`` (an explicit ``attention_mask``, an ``attention_bias``, packed sequences,
  other mask types and non-vanilla softmax types such as attention sinks raise ``ValueError``);
* scale: ``softmax_scale`` (default ``1/sqrt(head_dim)``); ``apply_query_key_layer_scaling``
  divides the scores by the layer number and multiplies them back inside its fp32 softmax, which
  is the same scale: here it is applied once;
* the softmax is computed in fp32 inside the kernels (flash and memory-efficient attention
  accumulate in fp32 whatever the input dtype), as ``attention_softmax_in_fp32``;
* attention dropout in training, drawn inside Megatron's model-parallel RNG fork as
  ``DotProductAttention`` draws it (a different random mask: the same distribution);
* grouped-query attention through ``enable_gqa`` where a fused kernel takes it, otherwise keys and
  values are repeated to every query head (``O(s)`` memory, as ``DotProductAttention`` does).

On a GPU the math backend (which would form the scores) is excluded: a call no fused kernel can
run raises instead of silently using ``O(s^2)`` memory; head dims are padded with zeros to a
multiple of 8 there (what the memory-efficient kernel takes). A sliding window runs in query
blocks of the window's length (at least :data:`MIN_WINDOW_BLOCK`), each against its keys only,
so a block's boolean mask is ``[block, block + window]``.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.utils import is_layer_window_attention
from torch.backends.cuda import SDPAParams, can_use_flash_attention
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

__all__ = [
    "ATTENTION_CHOICES",
    "MIN_WINDOW_BLOCK",
    "SdpaAttention",
    "causal_attention",
    "check_attention_choice",
    "check_forward_args",
    "check_sdpa_config",
    "check_sdpa_layer",
    "dropout_rng",
    "layer_window_left",
    "sdpa_scale",
]

#: The local spec's core attention (``--attention-backend``): ``auto`` (the default: SDPA on a
#: GPU, Megatron-Core's ``DotProductAttention`` on the CPU), ``sdpa`` or ``unfused`` everywhere.
ATTENTION_CHOICES = ("auto", "sdpa", "unfused")

#: Smallest query block of a sliding-window layer (fewer, larger kernel calls for short windows).
MIN_WINDOW_BLOCK = 128

# the fused kernels only: never the math backend, which forms the [s_q, s_k] scores
_FUSED_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                   SDPBackend.CUDNN_ATTENTION]


def check_attention_choice(attention: str) -> None:
    """``ValueError`` naming ``attention`` unless it is one of :data:`ATTENTION_CHOICES`."""
    if attention not in ATTENTION_CHOICES:
        raise ValueError(f"--attention-backend {attention!r}: choose from "
                         f"{', '.join(ATTENTION_CHOICES)}")


def sdpa_scale(module: DotProductAttention) -> float:
    """The scale of the scores ``DotProductAttention`` applies in all: its ``softmax_scale``,
    which ``apply_query_key_layer_scaling`` divides by the layer number for the score matmul and
    its softmax multiplies back."""
    if module.config.apply_query_key_layer_scaling:
        return module.softmax_scale * module.layer_number
    return module.softmax_scale


def check_sdpa_config(config) -> None:
    """``ValueError`` for what :func:`causal_attention` cannot compute: non-vanilla softmax
    types (attention sinks), windows that look ahead."""
    if config.softmax_type != "vanilla":
        raise ValueError(f"SDPA attention supports softmax_type='vanilla' only, got "
                         f"{config.softmax_type!r} (attention sinks need the unfused attention "
                         f"or Transformer Engine)")
    if config.window_size is not None and config.window_size[1] != 0:
        raise ValueError(f"SDPA attention supports causal windows (left, 0) only, got "
                         f"window_size={tuple(config.window_size)}")


def check_sdpa_layer(config, attn_mask_type: AttnMaskType) -> None:
    """:func:`check_sdpa_config`, and the mask type a layer asks for: causal only."""
    check_sdpa_config(config)
    if attn_mask_type != AttnMaskType.causal:
        raise ValueError(f"SDPA attention supports attn_mask_type=causal only, got "
                         f"{attn_mask_type}")


def layer_window_left(config, layer_number: int) -> int | None:
    """How many earlier positions a query of layer ``layer_number`` sees under its sliding
    window (``config.window_size``'s left side, where the layer has a window), else None."""
    if not is_layer_window_attention(config.window_size, config.window_attn_skip_freq,
                                     layer_number):
        return None
    return int(config.window_size[0])


def _kernels(device: torch.device):
    return sdpa_kernel(_FUSED_BACKENDS) if device.type == "cuda" else contextlib.nullcontext()


def _flash_takes(query, key, value, dropout_p: float, is_causal: bool) -> bool:
    """Whether the flash kernel runs this call with ``enable_gqa`` (warnings off: a no is an
    answer here, not a problem)."""
    params = SDPAParams(query, key, value, None, dropout_p, is_causal, True)
    return can_use_flash_attention(params, False)


def _sdpa(query, key, value, *, scale: float, dropout_p: float, mask=None,
          is_causal: bool = False) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` on ``[b, a, sq, d]`` queries and ``[b, g, sk, d]``
    keys / values; ``mask`` a boolean ``[sq, sk]`` (True: attend) or a ``CausalBias``."""
    heads, groups = query.shape[1], key.shape[1]
    kwargs = {}
    if groups != heads:
        # on a GPU only flash takes GQA as such (16-bit, no mask, its head dims, sm80+); the
        # memory-efficient kernel needs the groups repeated to every head
        if query.device.type != "cuda" or (mask is None and _flash_takes(
                query, key, value, dropout_p, is_causal)):
            kwargs["enable_gqa"] = True
        else:
            key = key.repeat_interleave(heads // groups, dim=1)
            value = value.repeat_interleave(heads // groups, dim=1)
    with _kernels(query.device):
        return F.scaled_dot_product_attention(query, key, value, attn_mask=mask,
                                              dropout_p=dropout_p, is_causal=is_causal,
                                              scale=scale, **kwargs)


def causal_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *,
                     scale: float, dropout_p: float = 0.0, window_left: int | None = None,
                     query_start: int = 0, key_start: int = 0) -> torch.Tensor:
    """Causal softmax attention of ``query [b, a, sq, d]`` (positions ``query_start ..
    query_start + sq - 1``) over ``key, value [b, g, sk, d]`` (positions ``key_start ..
    key_start + sk - 1``, ending where the queries end), ``a`` a multiple of ``g``; query ``i``
    sees keys ``j <= i`` (and ``j >= i - window_left``). Returns ``[b, a, sq, d]`` in the query's
    dtype."""
    sq, sk = query.shape[2], key.shape[2]
    if key_start + sk != query_start + sq:
        raise ValueError(f"keys at positions [{key_start}, {key_start + sk}) must end where the "
                         f"queries [{query_start}, {query_start + sq}) end")
    if key_start > query_start:
        raise ValueError(f"keys start at {key_start}, after the first query {query_start}")
    if query.shape[1] % key.shape[1] != 0:
        raise ValueError(f"{query.shape[1]} query heads do not split into {key.shape[1]} "
                         f"key/value groups")
    head_dim = query.shape[-1]
    pad = -head_dim % 8 if query.device.type == "cuda" else 0
    if pad:
        # the memory-efficient kernel takes head dims in multiples of 8 (4 in fp32): zero
        # columns change no score, and the value's come out as zero columns, cut off below
        query, key, value = (F.pad(t, (0, pad)) for t in (query, key, value))
        out = _causal(query, key, value, scale=scale, dropout_p=dropout_p,
                      window_left=window_left, query_start=query_start, key_start=key_start)
        return out[..., :head_dim]
    return _causal(query, key, value, scale=scale, dropout_p=dropout_p, window_left=window_left,
                   query_start=query_start, key_start=key_start)


def _causal(query, key, value, *, scale: float, dropout_p: float, window_left: int | None,
            query_start: int, key_start: int) -> torch.Tensor:
    """:func:`causal_attention` on checked arguments."""
    sq, sk = query.shape[2], key.shape[2]
    if window_left is None:
        if sq == sk:
            return _sdpa(query, key, value, scale=scale, dropout_p=dropout_p, is_causal=True)
        # queries are the last sq of the keys' positions: the causal mask aligned bottom right
        # (CausalBias runs it on the fused kernels without GQA: repeat the groups)
        heads, groups = query.shape[1], key.shape[1]
        if groups != heads:
            key = key.repeat_interleave(heads // groups, dim=1)
            value = value.repeat_interleave(heads // groups, dim=1)
        with _kernels(query.device):
            return F.scaled_dot_product_attention(query, key, value,
                                                  attn_mask=causal_lower_right(sq, sk),
                                                  dropout_p=dropout_p, scale=scale)
    block = max(window_left + 1, MIN_WINDOW_BLOCK)
    outs = []
    for lo in range(0, sq, block):
        hi = min(sq, lo + block)
        first, last = query_start + lo, query_start + hi - 1
        k_lo = max(key_start, first - window_left)  # the block's keys: its window, no further
        q_pos = torch.arange(first, last + 1, device=query.device)
        k_pos = torch.arange(k_lo, last + 1, device=query.device)
        # True where query i may attend key j: i - window_left <= j <= i
        diff = q_pos.unsqueeze(1) - k_pos.unsqueeze(0)
        allowed = (diff >= 0) & (diff <= window_left)
        ks, ke = k_lo - key_start, last + 1 - key_start
        outs.append(_sdpa(query[:, :, lo:hi], key[:, :, ks:ke], value[:, :, ks:ke],
                          scale=scale, dropout_p=dropout_p, mask=allowed))
    return torch.cat(outs, dim=2)


def dropout_rng(module: DotProductAttention):
    """Where ``DotProductAttention`` draws its dropout: the model-parallel RNG fork, except
    with sequence parallelism (each rank's own tokens)."""
    if module.config.sequence_parallel:
        return contextlib.nullcontext()
    return tensor_parallel.get_cuda_rng_tracker().fork()


class SdpaAttention(DotProductAttention):
    """``DotProductAttention`` computed by ``scaled_dot_product_attention`` (see the module
    docstring): the same constructor, parameters and checkpoint; forward refuses (``ValueError``)
    what it does not compute."""

    def __init__(self, config, layer_number: int, attn_mask_type: AttnMaskType,
                 attention_type: str, attention_dropout: float | None = None,
                 softmax_scale: float | None = None, cp_comm_type: str | None = None,
                 pg_collection=None) -> None:
        check_sdpa_layer(config, attn_mask_type)
        super().__init__(config, layer_number, attn_mask_type, attention_type,
                         attention_dropout=attention_dropout, softmax_scale=softmax_scale,
                         cp_comm_type=cp_comm_type, pg_collection=pg_collection)
        self.window_left = layer_window_left(config, layer_number)

    def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None):
        """``query [sq, b, a, d]``, ``key, value [sk, b, g, d]`` -> ``[sq, b, a * d]``."""
        check_forward_args(attention_mask, attn_mask_type, attention_bias, packed_seq_params)
        if query.shape[0] != key.shape[0]:
            raise ValueError(f"SDPA attention is self-attention: {query.shape[0]} queries, "
                             f"{key.shape[0]} keys")
        # [s, b, n, d] -> [b, n, s, d]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        dropout_p = self.attention_dropout.p if self.training else 0.0
        with dropout_rng(self):
            out = causal_attention(q, k, v, scale=sdpa_scale(self), dropout_p=dropout_p,
                                   window_left=self.window_left)
        # [b, a, sq, d] -> [sq, b, a * d]
        return out.permute(2, 0, 1, 3).reshape(out.shape[2], out.shape[0], -1)


def check_forward_args(attention_mask, attn_mask_type, attention_bias,
                       packed_seq_params) -> None:
    """``ValueError`` for forward arguments the SDPA attention does not take."""
    if attention_mask is not None:
        raise ValueError(f"SDPA attention takes its causal mask from attn_mask_type, not an "
                         f"attention_mask (got one of shape {tuple(attention_mask.shape)})")
    if attn_mask_type is not None and attn_mask_type != AttnMaskType.causal:
        raise ValueError(f"SDPA attention supports attn_mask_type=causal only, got "
                         f"{attn_mask_type}")
    if attention_bias is not None:
        raise ValueError("SDPA attention takes no attention_bias")
    if packed_seq_params is not None:
        raise ValueError("SDPA attention does not take packed sequences (packed_seq_params)")

