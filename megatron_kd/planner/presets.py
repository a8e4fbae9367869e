"""Presets: public model configs, GPUs and links.

Models
------
Numbers are those of each model's Hugging Face ``config.json`` (text tower), as published by the
model's authors; the published parameter counts are those of the model cards. Each preset's
``source`` says which config it mirrors and names any assumption.

* Qwen3.5 (35B-A3B and 9B) are hybrid: three Gated DeltaNet (linear attention) layers for every
  full-attention layer (``full_attention_interval = 4``), gated attention (the query projection
  also emits a sigmoid output gate), head dim 256, vocabulary 248,320. The published model cards
  count the vision tower as well; the presets are the text tower only, and the multi-token
  prediction layer is left out (megatron_kd does not train it).
* gpt-oss alternates sliding-window (128 tokens) and full attention layers, has attention sinks and
  biases in attention and experts; its experts ship in MXFP4, but distillation trains and runs them
  in bf16, which is what the planner counts.

GPUs
----
``memory_bytes`` is the total device memory the driver reports (``nvidia-smi``: H100 SXM 81,559 MiB,
H200 143,771 MiB, B200 183,359 MiB). ``bf16_flops`` is the dense (no sparsity) bf16 tensor-core peak
from the vendor data sheets: H100 / H200 SXM 989 TFLOP/s, B200 2.25 PFLOP/s. ``nvlink_bytes_per_s``
is one direction of one GPU's NVLink (NVLink 4: 900 GB/s bidirectional; NVLink 5: 1.8 TB/s).

Links
-----
Bytes per second in one direction for one GPU: InfiniBand NDR 400 Gb/s = 50 GB/s, XDR 800 Gb/s =
100 GB/s, assuming one NIC per GPU (the DGX / HGX layout). ``nvlink`` resolves to the GPU's own
NVLink generation.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from megatron_kd.planner.models import ModelConfig, from_hf_config, from_megatron_kd_arch

_QWEN35_LINEAR = dict(
    linear_attention_freq=4,
    linear_num_key_heads=16,
    linear_num_value_heads=32,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_conv_kernel_dim=4,
    qk_layernorm=True,
    attention_output_gate=True,
)

_GPT_OSS = dict(
    hidden_size=2880,
    num_attention_heads=64,
    num_query_groups=8,
    head_dim=64,
    ffn_hidden_size=0,
    vocab_size=201088,
    tie_embeddings=False,
    attention_bias=True,
    attention_sinks=True,
    moe_router_topk=4,
    moe_ffn_hidden_size=2880,
    moe_bias=True,
    sliding_window=128,
    sliding_window_every=2,
)

_MODELS = [
    ModelConfig(
        name="llama-3.1-8b",
        num_layers=32,
        hidden_size=4096,
        num_attention_heads=32,
        num_query_groups=8,
        head_dim=128,
        ffn_hidden_size=14336,
        vocab_size=128256,
        tie_embeddings=False,
        published_total_params=8.03e9,
        source="meta-llama/Llama-3.1-8B config.json",
    ),
    ModelConfig(
        name="llama-3.2-3b",
        num_layers=28,
        hidden_size=3072,
        num_attention_heads=24,
        num_query_groups=8,
        head_dim=128,
        ffn_hidden_size=8192,
        vocab_size=128256,
        tie_embeddings=True,
        published_total_params=3.21e9,
        source="meta-llama/Llama-3.2-3B config.json",
    ),
    ModelConfig(
        name="llama-3.2-1b",
        num_layers=16,
        hidden_size=2048,
        num_attention_heads=32,
        num_query_groups=8,
        head_dim=64,
        ffn_hidden_size=8192,
        vocab_size=128256,
        tie_embeddings=True,
        published_total_params=1.24e9,
        source="meta-llama/Llama-3.2-1B config.json",
    ),
    ModelConfig(
        name="qwen3-8b",
        num_layers=36,
        hidden_size=4096,
        num_attention_heads=32,
        num_query_groups=8,
        head_dim=128,
        ffn_hidden_size=12288,
        vocab_size=151936,
        tie_embeddings=False,
        qk_layernorm=True,
        published_total_params=8.2e9,
        source="Qwen/Qwen3-8B config.json",
    ),
    ModelConfig(
        name="qwen3-32b",
        num_layers=64,
        hidden_size=5120,
        num_attention_heads=64,
        num_query_groups=8,
        head_dim=128,
        ffn_hidden_size=25600,
        vocab_size=151936,
        tie_embeddings=False,
        qk_layernorm=True,
        published_total_params=32.8e9,
        source="Qwen/Qwen3-32B config.json",
    ),
    ModelConfig(
        name="qwen3-30b-a3b",
        num_layers=48,
        hidden_size=2048,
        num_attention_heads=32,
        num_query_groups=4,
        head_dim=128,
        ffn_hidden_size=0,
        vocab_size=151936,
        tie_embeddings=False,
        qk_layernorm=True,
        num_experts=128,
        moe_router_topk=8,
        moe_ffn_hidden_size=768,
        published_total_params=30.5e9,
        published_active_params=3.3e9,
        source="Qwen/Qwen3-30B-A3B config.json",
    ),
    ModelConfig(
        name="qwen3-235b-a22b",
        num_layers=94,
        hidden_size=4096,
        num_attention_heads=64,
        num_query_groups=4,
        head_dim=128,
        ffn_hidden_size=0,
        vocab_size=151936,
        tie_embeddings=False,
        qk_layernorm=True,
        num_experts=128,
        moe_router_topk=8,
        moe_ffn_hidden_size=1536,
        published_total_params=235e9,
        published_active_params=22e9,
        source="Qwen/Qwen3-235B-A22B config.json",
    ),
    ModelConfig(
        name="qwen3.5-35b-a3b",
        num_layers=40,
        hidden_size=2048,
        num_attention_heads=16,
        num_query_groups=2,
        head_dim=256,
        ffn_hidden_size=0,
        vocab_size=248320,
        tie_embeddings=False,
        num_experts=256,
        moe_router_topk=8,
        moe_ffn_hidden_size=512,
        moe_shared_expert_ffn_hidden_size=512,
        published_total_params=35e9,
        published_active_params=3e9,
        source=(
            "Qwen/Qwen3.5-35B-A3B config.json text_config (model_type qwen3_5_moe): 40 layers, 30 "
            "Gated DeltaNet + 10 gated full attention, 256 experts top-8 + one shared expert. "
            "Published counts are the name's rounded 35B / 3B and include the vision tower; the "
            "text tower counted here is 34.7B / 3.4B (the 0.5B vision tower and the MTP layer are "
            "left out)."
        ),
        **_QWEN35_LINEAR,
    ),
    ModelConfig(
        name="qwen3.5-9b",
        num_layers=32,
        hidden_size=4096,
        num_attention_heads=16,
        num_query_groups=4,
        head_dim=256,
        ffn_hidden_size=12288,
        vocab_size=248320,
        tie_embeddings=False,
        published_total_params=9e9,
        source=(
            "Qwen/Qwen3.5-9B config.json text_config (model_type qwen3_5): 32 layers, 24 Gated "
            "DeltaNet + 8 gated full attention. The published 9B is the name's rounding and "
            "includes the vision tower; the text tower counted here is 8.95B."
        ),
        **_QWEN35_LINEAR,
    ),
    ModelConfig(
        name="gpt-oss-20b",
        num_layers=24,
        num_experts=32,
        published_total_params=20.9e9,
        published_active_params=3.6e9,
        source="openai/gpt-oss-20b config.json (experts counted in bf16, as trained)",
        **_GPT_OSS,
    ),
    ModelConfig(
        name="gpt-oss-120b",
        num_layers=36,
        num_experts=128,
        published_total_params=116.8e9,
        published_active_params=5.1e9,
        source="openai/gpt-oss-120b config.json (experts counted in bf16, as trained)",
        **_GPT_OSS,
    ),
]

MODEL_PRESETS: dict[str, ModelConfig] = {m.name: m for m in _MODELS}


@dataclass(kw_only=True, frozen=True)
class GpuSpec:
    """One accelerator."""

    name: str
    """Preset name."""

    memory_bytes: int
    """Device memory the driver reports, bytes."""

    bf16_flops: float
    """Dense bf16 tensor-core peak, FLOP/s."""

    nvlink_bytes_per_s: float
    """One direction of this GPU's NVLink, bytes/s."""

    def __post_init__(self) -> None:
        if self.memory_bytes <= 0 or self.bf16_flops <= 0 or self.nvlink_bytes_per_s <= 0:
            raise ValueError(
                f"GpuSpec {self.name!r}: memory_bytes={self.memory_bytes}, "
                f"bf16_flops={self.bf16_flops}, "
                f"nvlink_bytes_per_s={self.nvlink_bytes_per_s} must all be > 0"
            )


@dataclass(kw_only=True, frozen=True)
class LinkSpec:
    """One link class, seen from one GPU."""

    name: str
    """Preset name."""

    bytes_per_s: float
    """Line rate in one direction, bytes/s."""

    def __post_init__(self) -> None:
        if self.bytes_per_s <= 0:
            raise ValueError(f"LinkSpec {self.name!r}: bytes_per_s={self.bytes_per_s} must be > 0")


_MIB = 1 << 20

GPU_PRESETS: dict[str, GpuSpec] = {
    g.name: g
    for g in (
        GpuSpec(
            name="h100-80g", memory_bytes=81559 * _MIB, bf16_flops=989e12, nvlink_bytes_per_s=450e9
        ),
        GpuSpec(
            name="h200-141g",
            memory_bytes=143771 * _MIB,
            bf16_flops=989e12,
            nvlink_bytes_per_s=450e9,
        ),
        GpuSpec(
            name="b200", memory_bytes=183359 * _MIB, bf16_flops=2250e12, nvlink_bytes_per_s=900e9
        ),
    )
}

LINK_PRESETS: dict[str, LinkSpec] = {
    link.name: link
    for link in (
        LinkSpec(name="ib-400g", bytes_per_s=400e9 / 8),
        LinkSpec(name="ib-800g", bytes_per_s=800e9 / 8),
    )
}


def get_gpu(name: str) -> GpuSpec:
    key = name.lower()
    if key not in GPU_PRESETS:
        raise ValueError(f"unknown GPU {name!r}; choose from {', '.join(GPU_PRESETS)}")
    return GPU_PRESETS[key]


def get_link(name: str, gpu: GpuSpec) -> LinkSpec:
    """A link preset; ``nvlink`` is the NVLink of ``gpu``."""
    key = name.lower()
    if key == "nvlink":
        return LinkSpec(name=f"nvlink({gpu.name})", bytes_per_s=gpu.nvlink_bytes_per_s)
    if key not in LINK_PRESETS:
        raise ValueError(f"unknown link {name!r}; choose from nvlink, {', '.join(LINK_PRESETS)}")
    return LINK_PRESETS[key]


def load_model(spec: str) -> ModelConfig:
    """A preset name (case-insensitive), the path of a Hugging Face ``config.json``, or a
    megatron_kd checkpoint directory (its ``model_config.json``)."""
    key = spec.lower()
    if key in MODEL_PRESETS:
        return MODEL_PRESETS[key]
    if os.path.isdir(spec) and os.path.isfile(os.path.join(spec, "model_config.json")):
        path = os.path.join(spec, "model_config.json")
        with open(path, encoding="utf-8") as f:
            payload = json.load(f)
        if "arch" not in payload:
            raise ValueError(
                f"{path}: no 'arch' entry (format_version {payload.get('format_version')})"
            )
        return from_megatron_kd_arch(payload["arch"], name=spec)
    if os.path.isfile(spec):
        with open(spec, encoding="utf-8") as f:
            return from_hf_config(json.load(f), name=spec)
    raise ValueError(
        f"unknown model {spec!r}: not a preset ({', '.join(sorted(MODEL_PRESETS))}), a config.json "
        f"file nor a megatron_kd checkpoint directory"
    )
