"""Presets: public model configs, GPUs and links.

Models
------
Each preset is a :class:`~megatron_kd.arch.GPTArchConfig` (the one architecture type: what an
imported checkpoint of the model stores) with a name; its numbers are those of the model's
Hugging Face ``config.json`` (text tower), as published by the model's authors; the published
parameter counts are those of the model cards. Each preset's ``source`` says which config it
mirrors and names any assumption.

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

from megatron_kd.arch import GPTArchConfig
from megatron_kd.arch.hf_config import arch_from_hf_config
from megatron_kd.planner.models import PlannedModel


def _arch(*, vocab_size: int, **fields) -> GPTArchConfig:
    """A preset's architecture: every preset's vocabulary is a multiple of 128 (Megatron's
    default padding), so its embedding has no padding rows."""
    return GPTArchConfig(vocab_size=vocab_size, padded_vocab_size=vocab_size, swiglu=True,
                         normalization="RMSNorm", **fields)


def _llama(*, layers, hidden, heads, groups, head_dim, ffn, tied,
           rope_factor) -> GPTArchConfig:
    # RoPE "llama3" scaling: factor 8 (Llama-3.1), 32 (Llama-3.2)
    return _arch(num_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                 num_query_groups=groups, kv_channels=head_dim, ffn_hidden_size=ffn,
                 vocab_size=128256, tie_embeddings=tied, max_position_embeddings=131072,
                 rotary_base=500000.0, norm_epsilon=1e-5, rope_scaling_factor=rope_factor)


def _qwen3(*, layers, hidden, heads, groups, ffn, **moe) -> GPTArchConfig:
    return _arch(num_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                 num_query_groups=groups, kv_channels=128, ffn_hidden_size=ffn,
                 vocab_size=151936, tie_embeddings=False, max_position_embeddings=40960,
                 rotary_base=1000000.0, norm_epsilon=1e-6, qk_layernorm=True, **moe)


def _qwen35(*, layers, hidden, groups, ffn, **moe) -> GPTArchConfig:
    # three Gated DeltaNet layers for every full-attention one (full_attention_interval 4)
    return _arch(num_layers=layers, hidden_size=hidden, num_attention_heads=16,
                 num_query_groups=groups, kv_channels=256, ffn_hidden_size=ffn,
                 vocab_size=248320, tie_embeddings=False, max_position_embeddings=262144,
                 rotary_base=10000000.0, norm_epsilon=1e-6, qk_layernorm=True,
                 attention_output_gate=True, rotary_percent=0.25,
                 linear_attention_layers=[i for i in range(layers) if (i + 1) % 4],
                 linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
                 linear_value_head_dim=128, linear_conv_kernel_dim=4, **moe)


def _gpt_oss(*, layers, experts) -> GPTArchConfig:
    # sliding-window (128) attention on every other layer, from the first; biased attention
    # with sinks and biased experts with the clamped x * sigmoid(1.702 x) * (up + 1) MLP
    return _arch(num_layers=layers, hidden_size=2880, num_attention_heads=64,
                 num_query_groups=8, kv_channels=64, ffn_hidden_size=2880, vocab_size=201088,
                 tie_embeddings=False, max_position_embeddings=131072, norm_epsilon=1e-5,
                 num_experts=experts, moe_ffn_hidden_size=2880, moe_router_topk=4,
                 add_bias_linear=True, add_qkv_bias=True, attention_sinks=True,
                 window_size=128, window_layers=list(range(0, layers, 2)),
                 gated_activation="quick_gelu", glu_linear_offset=1.0, activation_clamp=7.0,
                 rotary_base=150000.0, position_embedding_type="yarn", yarn_factor=32.0,
                 yarn_original_max_position_embeddings=4096)


_MODELS = [
    PlannedModel(
        name="llama-3.1-8b",
        arch=_llama(layers=32, hidden=4096, heads=32, groups=8, head_dim=128, ffn=14336,
                    tied=False, rope_factor=8.0),
        published_total_params=8.03e9,
        source="meta-llama/Llama-3.1-8B config.json",
    ),
    PlannedModel(
        name="llama-3.1-70b",
        arch=_llama(layers=80, hidden=8192, heads=64, groups=8, head_dim=128, ffn=28672,
                    tied=False, rope_factor=8.0),
        published_total_params=70.6e9,
        source="meta-llama/Llama-3.1-70B config.json",
    ),
    PlannedModel(
        name="llama-3.2-3b",
        arch=_llama(layers=28, hidden=3072, heads=24, groups=8, head_dim=128, ffn=8192,
                    tied=True, rope_factor=32.0),
        published_total_params=3.21e9,
        source="meta-llama/Llama-3.2-3B config.json",
    ),
    PlannedModel(
        name="llama-3.2-1b",
        arch=_llama(layers=16, hidden=2048, heads=32, groups=8, head_dim=64, ffn=8192,
                    tied=True, rope_factor=32.0),
        published_total_params=1.24e9,
        source="meta-llama/Llama-3.2-1B config.json",
    ),
    PlannedModel(
        name="qwen3-8b",
        arch=_qwen3(layers=36, hidden=4096, heads=32, groups=8, ffn=12288),
        published_total_params=8.2e9,
        source="Qwen/Qwen3-8B config.json",
    ),
    PlannedModel(
        name="qwen3-32b",
        arch=_qwen3(layers=64, hidden=5120, heads=64, groups=8, ffn=25600),
        published_total_params=32.8e9,
        source="Qwen/Qwen3-32B config.json",
    ),
    PlannedModel(
        name="qwen3-30b-a3b",
        arch=_qwen3(layers=48, hidden=2048, heads=32, groups=4, ffn=6144, num_experts=128,
                    moe_router_topk=8, moe_ffn_hidden_size=768),
        published_total_params=30.5e9,
        published_active_params=3.3e9,
        source="Qwen/Qwen3-30B-A3B config.json",
    ),
    PlannedModel(
        name="qwen3-235b-a22b",
        arch=_qwen3(layers=94, hidden=4096, heads=64, groups=4, ffn=12288, num_experts=128,
                    moe_router_topk=8, moe_ffn_hidden_size=1536),
        published_total_params=235e9,
        published_active_params=22e9,
        source="Qwen/Qwen3-235B-A22B config.json",
    ),
    PlannedModel(
        name="qwen3.5-35b-a3b",
        # no dense MLP: the expert width stands in for ffn_hidden_size (as on import)
        arch=_qwen35(layers=40, hidden=2048, groups=2, ffn=512, num_experts=256,
                     moe_router_topk=8, moe_ffn_hidden_size=512, moe_shared_expert_size=512,
                     moe_shared_expert_gate=True),
        published_total_params=35e9,
        published_active_params=3e9,
        source=(
            "Qwen/Qwen3.5-35B-A3B config.json text_config (model_type qwen3_5_moe): 40 layers, 30 "
            "Gated DeltaNet + 10 gated full attention, 256 experts top-8 + one shared expert. "
            "Published counts are the name's rounded 35B / 3B and include the vision tower; the "
            "text tower counted here is 34.7B / 3.4B (the 0.5B vision tower and the MTP layer are "
            "left out)."
        ),
    ),
    PlannedModel(
        name="qwen3.5-9b",
        arch=_qwen35(layers=32, hidden=4096, groups=4, ffn=12288),
        published_total_params=9e9,
        source=(
            "Qwen/Qwen3.5-9B config.json text_config (model_type qwen3_5): 32 layers, 24 Gated "
            "DeltaNet + 8 gated full attention. The published 9B is the name's rounding and "
            "includes the vision tower; the text tower counted here is 8.95B."
        ),
    ),
    PlannedModel(
        name="gpt-oss-20b",
        arch=_gpt_oss(layers=24, experts=32),
        published_total_params=20.9e9,
        published_active_params=3.6e9,
        source="openai/gpt-oss-20b config.json (experts counted in bf16, as trained)",
    ),
    PlannedModel(
        name="gpt-oss-120b",
        arch=_gpt_oss(layers=36, experts=128),
        published_total_params=116.8e9,
        published_active_params=5.1e9,
        source="openai/gpt-oss-120b config.json (experts counted in bf16, as trained)",
    ),
]

MODEL_PRESETS: dict[str, PlannedModel] = {m.name: m for m in _MODELS}


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


def load_model(spec: str) -> PlannedModel:
    """A preset name (case-insensitive), the path of a Hugging Face ``config.json``, or a
    megatron_kd checkpoint directory (its ``model_config.json``), each read into the one
    architecture type (:class:`~megatron_kd.arch.GPTArchConfig`) as what it is."""
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
        return PlannedModel(name=spec, arch=GPTArchConfig.from_dict(payload["arch"]),
                            source=f"megatron_kd checkpoint {path}")
    if os.path.isfile(spec):
        with open(spec, encoding="utf-8") as f:
            config = json.load(f)
        try:
            arch = arch_from_hf_config(config)
        except KeyError as e:
            raise ValueError(f"{spec}: missing key {e} (a {config.get('model_type')!r} "
                             f"config)") from None
        except ValueError as e:
            raise ValueError(f"{spec}: {e}") from None
        return PlannedModel(name=spec, arch=arch, source=f"read from {spec}")
    raise ValueError(
        f"unknown model {spec!r}: not a preset ({', '.join(sorted(MODEL_PRESETS))}), a config.json "
        f"file nor a megatron_kd checkpoint directory"
    )
