"""Shared pieces of the core-attention tests (CPU and GPU): an independent dense reference, inputs,
value-and-gradient runs, and a one-rank stand-in for the tensor-parallel group."""

import math
from types import SimpleNamespace

import torch
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.transformer_config import TransformerConfig

PARTS = ("out", "dq", "dk", "dv")  # what value_and_grads returns


class OneRank:
    """A one-rank group: all ``DotProductAttention`` asks of its tensor-parallel group."""

    def size(self) -> int:
        return 1

    def rank(self) -> int:
        return 0


def attention_config(heads, groups, head_dim, dtype=torch.float32, **kw) -> TransformerConfig:
    kw.setdefault("attention_dropout", 0.0)
    return TransformerConfig(num_layers=2, hidden_size=heads * head_dim,
                             num_attention_heads=heads, num_query_groups=groups,
                             kv_channels=head_dim, params_dtype=dtype,
                             bf16=dtype == torch.bfloat16,
                             use_cpu_initialization=not torch.cuda.is_available(),
                             masked_softmax_fusion=False, **kw)


def build_attention(cls, config, layer_number=1, **kw):
    """``cls`` (``DotProductAttention`` or a subclass) as the local spec builds it, causal."""
    return cls(config, layer_number, AttnMaskType.causal, "self",
               pg_collection=SimpleNamespace(tp=OneRank()), **kw)


def reference(q, k, v, scale, window_left=None, q_pos=None, k_pos=None):
    """Dense float64 attention, written out: ``q [s, b, a, d]``, ``k, v [s, b, g, d]`` ->
    ``[s, b, a * d]``; query at position ``q_pos[i]`` sees keys ``k_pos[j] <= q_pos[i]`` (and
    ``>= q_pos[i] - window_left``)."""
    q, k, v = q.double(), k.double(), v.double()
    sq, sk, a, g = q.shape[0], k.shape[0], q.shape[2], k.shape[2]
    q_pos = torch.arange(sq, device=q.device) if q_pos is None else q_pos.to(q.device)
    k_pos = torch.arange(sk, device=q.device) if k_pos is None else k_pos.to(q.device)
    # each query head reads the key/value group of its block of a / g heads
    heads = torch.arange(a, device=q.device) // (a // g)
    k, v = k[:, :, heads], v[:, :, heads]
    scores = torch.einsum("qbhd,kbhd->bhqk", q, k) * scale
    diff = q_pos[:, None] - k_pos[None, :]
    allowed = diff >= 0
    if window_left is not None:
        allowed &= diff <= window_left
    probs = torch.softmax(scores.masked_fill(~allowed, -math.inf), dim=-1)
    out = torch.einsum("bhqk,kbhd->qbhd", probs, v)
    return out.reshape(sq, q.shape[1], -1)


def attention_inputs(s, b, a, g, d, dtype, seed=0, sk=None, device="cpu"):
    """``q [s, b, a, d]``, ``k, v [sk, b, g, d]`` (standard normal), needing gradients."""
    gen = torch.Generator().manual_seed(seed)
    sk = s if sk is None else sk
    shapes = [(s, b, a, d), (sk, b, g, d), (sk, b, g, d)]
    return [torch.randn(shape, generator=gen).to(device=device, dtype=dtype).requires_grad_()
            for shape in shapes]


def value_and_grads(fn, q, k, v, seed=1):
    """``[out, dq, dk, dv]`` in float64 for the loss ``sum(fn(q, k, v) * w)``, ``w`` fixed."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed))
    (out.double() * weights.to(out.device)).sum().backward()
    return [out.detach().double()] + [t.grad.double() for t in (q, k, v)]


def rel_err(x, ref) -> float:
    """Largest absolute difference over the reference's largest entry."""
    return float((x - ref).abs().max() / ref.abs().max().clamp_min(1e-12))
