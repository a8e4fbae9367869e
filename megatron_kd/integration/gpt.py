"""Megatron-Core GPT models for teacher and student: one place that builds them.

:func:`build_gpt_model` builds this rank's Megatron-Core ``GPTModel`` for a
:class:`~megatron_kd.arch.GPTArchConfig` (the local layer spec on CPU, Transformer
Engine's spec when it is importable and a GPU is present). Every model of the project (student,
teacher, cache-build teacher, imported checkpoints) comes from here, so a move to another
Megatron-Core model class is one change.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.fusions.fused_bias_geglu import quick_gelu
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
)
from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_block import (
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

from megatron_kd.arch import GPTArchConfig
from megatron_kd.integration.context_parallel import (
    ContextParallelAttention,
    ContextParallelSdpaAttention,
)
from megatron_kd.integration.cpu_shim import SequenceParallelNorm, install_cpu_shim, on_cpu
from megatron_kd.integration.sdpa_attention import (
    SdpaAttention,
    check_attention_choice,
    check_sdpa_config,
)
from megatron_kd.parallel import ParallelLayout
from megatron_kd.placement import compute_device, move_to_compute_device

__all__ = ["build_gpt_model", "layout_config", "model_arch", "transformer_engine_available"]


def layout_config(layout: ParallelLayout) -> dict[str, Any]:
    """The ``TransformerConfig`` settings of a trained model's layout beyond the group sizes
    (which Megatron-Core reads from the groups): sequence parallelism, virtual pipeline stages,
    activation recompute and the context-parallel exchange."""
    out: dict[str, Any] = {"sequence_parallel": layout.sequence_parallel}
    if layout.virtual_stages is not None:
        out["virtual_pipeline_model_parallel_size"] = layout.virtual_stages
    if layout.recompute == "selective":
        out["recompute_granularity"] = "selective"
    elif layout.recompute == "full":
        out.update(recompute_granularity="full", recompute_method=layout.recompute_method,
                   recompute_num_layers=layout.recompute_num_layers)
    if layout.cp > 1:
        out["cp_comm_type"] = layout.cp_comm_type
    return out


def _transformer_config(arch: GPTArchConfig, *, tp_size: int, pp_size: int, cp_size: int,
                        expert_sizes: tuple[int, int],
                        params_dtype: torch.dtype, device: torch.device | None = None,
                        **overrides: Any):
    # on the host Megatron-Core's layers initialise there; else on the current GPU
    device = compute_device() if device is None else device
    kwargs = {
        "num_layers": arch.num_layers,
        "hidden_size": arch.hidden_size,
        "num_attention_heads": arch.num_attention_heads,
        "num_query_groups": arch.num_query_groups,
        "ffn_hidden_size": arch.ffn_hidden_size,
        "kv_channels": arch.kv_channels,
        "layernorm_epsilon": arch.norm_epsilon,
        "normalization": arch.normalization,
        "gated_linear_unit": arch.swiglu,
        "activation_func": (_GATED_ACTIVATIONS[arch.gated_activation] if arch.swiglu
                            else F.gelu),
        "add_bias_linear": arch.add_bias_linear,
        "init_method_std": arch.init_method_std,
        "qk_layernorm": arch.qk_layernorm,
        "bias_activation_fusion": False,
        "tensor_model_parallel_size": tp_size,
        "pipeline_model_parallel_size": pp_size,
        "context_parallel_size": cp_size,
        "params_dtype": params_dtype,
        "pipeline_dtype": params_dtype,
        "bf16": params_dtype == torch.bfloat16,
        "fp16": params_dtype == torch.float16,
        "use_cpu_initialization": device.type == "cpu",
        "perform_initialization": True,
        "hidden_dropout": 0.0,
        "attention_dropout": 0.0,
        "bias_dropout_fusion": False,
        "apply_rope_fusion": False,
        "masked_softmax_fusion": False,
        "gradient_accumulation_fusion": False,
        "persist_layer_norm": False,
    }
    if arch.num_experts is not None:
        kwargs.update(_moe_config(arch, expert_sizes))
    kwargs.update(_attention_variant_config(arch))
    kwargs.update(overrides)
    config = TransformerConfig(**kwargs)
    if arch.yarn_factor is not None:
        # GPTModel reads these with getattr; only MLATransformerConfig declares them
        # (megatron-core 0.16.1 and 0.19.2)
        config.yarn_rotary_scaling_factor = arch.yarn_factor
        config.yarn_original_max_position_embeddings = arch.yarn_original_max_position_embeddings
        config.yarn_beta_fast = arch.yarn_beta_fast
        config.yarn_beta_slow = arch.yarn_beta_slow
        config.yarn_mscale = None  # 0.1 ln(factor) + 1, as Hugging Face's default
        config.yarn_mscale_all_dim = None
        config.yarn_correction_range_round_to_int = arch.yarn_truncate
    return config


_GATED_ACTIVATIONS = {"silu": F.silu, "quick_gelu": quick_gelu}


def _attention_variant_config(arch: GPTArchConfig) -> dict[str, Any]:
    """QKV biases, attention sinks, sliding windows and the clamped gated MLP (gpt-oss)."""
    out: dict[str, Any] = {}
    if arch.add_qkv_bias:
        out["add_qkv_bias"] = True
    if arch.attention_sinks:
        out["softmax_type"] = "learnable"
    if arch.window_size is not None:
        # Megatron's window (left, right) keeps keys j >= i - left: left = window - 1
        out["window_size"] = (arch.window_size - 1, 0)
        if arch.window_layers is not None:
            out["window_attn_skip_freq"] = [int(i in arch.window_layers)
                                            for i in range(arch.num_layers)]
    if arch.glu_linear_offset:
        out["glu_linear_offset"] = arch.glu_linear_offset
    if arch.activation_clamp is not None:
        out["activation_func_clamp_value"] = arch.activation_clamp
    if arch.attention_output_gate:
        out["attention_output_gate"] = True
    if arch.linear_attention_layers is not None:
        out.update({
            "experimental_attention_variant": "gated_delta_net",
            "linear_attention_freq": [int(i in arch.linear_attention_layers)
                                      for i in range(arch.num_layers)],
            "linear_conv_kernel_dim": arch.linear_conv_kernel_dim,
            "linear_key_head_dim": arch.linear_key_head_dim,
            "linear_value_head_dim": arch.linear_value_head_dim,
            "linear_num_key_heads": arch.linear_num_key_heads,
            "linear_num_value_heads": arch.linear_num_value_heads,
        })
    return out


def _moe_config(arch: GPTArchConfig, expert_sizes: tuple[int, int]) -> dict[str, Any]:
    """Dropless top-k routing (no capacity factor, no auxiliary loss unless overridden), the
    all-to-all dispatcher, one ``SequentialMLP`` per rank (grouped GEMM needs a GPU).
    ``expert_sizes``: (expert-parallel, expert tensor-parallel) sizes."""
    return {
        "num_moe_experts": arch.num_experts,
        "moe_ffn_hidden_size": arch.expert_ffn_hidden_size,
        "moe_router_topk": arch.moe_router_topk,
        "moe_router_pre_softmax": arch.moe_router_pre_softmax,
        "moe_router_load_balancing_type": "none",
        "moe_aux_loss_coeff": 0.0,
        "moe_token_dispatcher_type": "alltoall",
        "moe_grouped_gemm": False,
        "expert_model_parallel_size": expert_sizes[0],
        "expert_tensor_parallel_size": expert_sizes[1],
        **({} if arch.moe_shared_expert_size is None else {
            "moe_shared_expert_intermediate_size": arch.moe_shared_expert_size,
            "moe_shared_expert_gate": arch.moe_shared_expert_gate,
            "moe_shared_expert_overlap": False,
        }),
    }


def _layer_specs(arch: GPTArchConfig) -> list[ModuleSpec]:
    """One local layer spec per layer of the whole model: Gated DeltaNet for
    ``arch.linear_attention_layers``, the (gated) softmax attention layer elsewhere, both with
    the same MLP and norms.

    Local modules even on a GPU for a hybrid: Megatron-Core's own Transformer Engine hybrid
    (``get_transformer_block_with_experimental_attention_variant_spec``) fuses the
    pre-DeltaNet norm into ``in_proj``, names that ``_TE_NORM_NAMES`` (import_weights) does not
    map, and only this local spec has been checked against Hugging Face (on CPU). The
    DeltaNet's gated output norm is a plain RMSNorm of one value head. The softmax attention's
    ``DotProductAttention`` here is swapped by :func:`_block_spec` (SDPA on a GPU).
    """
    attention = get_gpt_layer_local_spec(num_experts=arch.num_experts, moe_grouped_gemm=False,
                                         qk_layernorm=arch.qk_layernorm,
                                         normalization=arch.normalization)
    if arch.linear_attention_layers is None:
        return [attention] * arch.num_layers
    deltanet = ModuleSpec(module=attention.module, submodules=dataclasses.replace(
        attention.submodules, self_attention=ModuleSpec(
            module=GatedDeltaNet,
            submodules=GatedDeltaNetSubmodules(in_proj=ColumnParallelLinear,
                                               out_norm=WrappedTorchNorm,
                                               out_proj=RowParallelLinear))))
    linear = set(arch.linear_attention_layers)
    return [deltanet if i in linear else attention for i in range(arch.num_layers)]


def _swapped(spec: Any, swaps: dict) -> Any:
    """``spec`` (a ``ModuleSpec``, or a submodules dataclass) with every module class that is a
    key of ``swaps`` replaced by its value."""
    if isinstance(spec, type) and spec in swaps:
        return swaps[spec]
    if isinstance(spec, ModuleSpec):
        return dataclasses.replace(spec, module=_swapped(spec.module, swaps),
                                   submodules=_swapped(spec.submodules, swaps))
    if dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        return dataclasses.replace(spec, **{f.name: _swapped(getattr(spec, f.name), swaps)
                                            for f in dataclasses.fields(spec)})
    return spec


def transformer_engine_available() -> bool:
    """Whether models are built with Transformer Engine's layers: a GPU, and the package."""
    if on_cpu():
        return False
    try:
        # optional GPU extra: imported only to learn whether it is there
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


def _uses_sdpa(config, attention: str) -> bool:
    """Whether the local spec's softmax attention layers run on ``scaled_dot_product_attention``
    (:class:`~megatron_kd.integration.sdpa_attention.SdpaAttention`) rather than Megatron-Core's
    ``DotProductAttention``, which forms ``[b, heads, s, s]`` scores, for the ``attention``
    asked for (``--attention-backend``): ``auto`` on a GPU only, ``sdpa`` or ``unfused``
    anywhere. Attention sinks (a non-vanilla ``softmax_type``) have no SDPA form: ``auto`` keeps
    them on ``DotProductAttention``, ``sdpa`` refuses them."""
    check_attention_choice(attention)  # ValueError naming a choice that is none of them
    if attention == "unfused":
        return False
    if attention == "sdpa":
        check_sdpa_config(config)  # ValueError naming what SDPA cannot compute
        return True
    if on_cpu():
        return False
    try:
        check_sdpa_config(config)
    except ValueError:
        return False  # gpt-oss's sinks: scores formed (docs/models.md, "Attention backends")
    return True


def _block_spec(arch: GPTArchConfig, config, *, vp_stage: int | None, pp_rank: int,
                attention: str):
    """This pipeline stage's (and virtual stage's) layers: Transformer Engine's spec for a
    dense or MoE transformer where it is installed (a GPU); elsewhere the local spec, sliced
    to the stage's layers as Megatron-Core's own ``get_gpt_decoder_block_spec`` slices (so a
    layer pattern, such as a DeltaNet hybrid's, splits over pipeline stages), its torch norms
    :class:`~megatron_kd.integration.cpu_shim.SequenceParallelNorm` (the same modules, with
    their weights marked for sequence parallelism), its attention
    :class:`~megatron_kd.integration.context_parallel.ContextParallelAttention` with context
    parallelism. The local spec's attention is
    :class:`~megatron_kd.integration.sdpa_attention.SdpaAttention` (its context-parallel form
    :class:`~megatron_kd.integration.context_parallel.ContextParallelSdpaAttention`) where
    :func:`_uses_sdpa` says so for ``attention`` (``--attention-backend``; ``auto``: on a GPU
    without Transformer Engine, for hybrids always)."""
    if arch.linear_attention_layers is None and transformer_engine_available():
        return get_gpt_layer_with_transformer_engine_spec(
            num_experts=arch.num_experts, moe_grouped_gemm=False, qk_layernorm=arch.qk_layernorm)
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank)
    count = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
    swaps = {WrappedTorchNorm: SequenceParallelNorm}
    sdpa = _uses_sdpa(config, attention)
    if config.context_parallel_size > 1:
        swaps[DotProductAttention] = (ContextParallelSdpaAttention if sdpa
                                      else ContextParallelAttention)
    elif sdpa:
        swaps[DotProductAttention] = SdpaAttention
    specs = [_swapped(spec, swaps) for spec in _layer_specs(arch)[offset:offset + count]]
    return TransformerBlockSubmodules(layer_specs=specs, layer_norm=SequenceParallelNorm)


def _parallel_sizes(pg_collection) -> tuple[int, ...]:
    """``(tp_size, pp_size, tp_rank, pp_rank, cp_size, ep_size, ep_rank, etp_rank, etp_size)``
    from ``pg_collection``, or from ``parallel_state`` when it is None."""
    if pg_collection is not None:
        tp_size, pp_size = pg_collection.tp.size(), pg_collection.pp.size()
        tp_rank, pp_rank = pg_collection.tp.rank(), pg_collection.pp.rank()
        ep, etp = getattr(pg_collection, "ep", None), getattr(pg_collection, "expt_tp", None)
        cp = getattr(pg_collection, "cp", None)  # a collection may leave out what it lacks
        cp_size = cp.size() if cp is not None else 1
        ep_size, ep_rank = (ep.size(), ep.rank()) if ep is not None else (1, 0)
        etp_rank, etp_size = (etp.rank(), etp.size()) if etp is not None else (tp_rank, tp_size)
    else:
        if not parallel_state.model_parallel_is_initialized():
            raise RuntimeError("build_gpt_model needs megatron.core.parallel_state initialised "
                               "(initialize_model_parallel) or an explicit pg_collection")
        tp_size = parallel_state.get_tensor_model_parallel_world_size()
        pp_size = parallel_state.get_pipeline_model_parallel_world_size()
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        pp_rank = parallel_state.get_pipeline_model_parallel_rank()
        cp_size = parallel_state.get_context_parallel_world_size()
        ep_size = parallel_state.get_expert_model_parallel_world_size()
        ep_rank = parallel_state.get_expert_model_parallel_rank()
        etp_rank = parallel_state.get_expert_tensor_parallel_rank()
        etp_size = parallel_state.get_expert_tensor_parallel_world_size()
    return (tp_size, pp_size, tp_rank, pp_rank, cp_size, ep_size, ep_rank, etp_rank,
            etp_size)


def build_gpt_model(
    arch: GPTArchConfig,
    *,
    pre_process: bool = True,
    post_process: bool = True,
    params_dtype: torch.dtype = torch.float32,
    pg_collection=None,
    seed: int | None = 1234,
    vp_stage: int | None = None,
    device: torch.device | None = None,
    attention: str = "auto",
    **config_overrides: Any,
):
    """Build this rank's Megatron-Core ``GPTModel`` for ``arch``.

    ``megatron.core.parallel_state`` must be initialised, or ``pg_collection`` (a
    ``ProcessGroupCollection``) given. With ``seed`` not None, Megatron's model-parallel RNG is
    seeded first (``model_parallel_cuda_manual_seed``; on CPU the CPU generator stands in for
    the CUDA one), so the same seed gives the same weights at any tensor-parallel size.
    ``config_overrides`` go to ``TransformerConfig`` (e.g. ``hidden_dropout=0.1``,
    ``sequence_parallel=True``, ``virtual_pipeline_model_parallel_size=2``, the recompute
    settings). ``vp_stage``: the virtual pipeline stage this chunk is (interleaved schedules).
    The model carries its architecture as ``model.kd_arch``. It is built on, or moved to,
    ``device`` (default: :func:`megatron_kd.placement.compute_device`, the GPU on a GPU
    machine) and checked there: every parameter and buffer, the norms torch builds on the host
    included. ``attention``: the local spec's core attention, one of
    :data:`~megatron_kd.integration.sdpa_attention.ATTENTION_CHOICES` (a command's
    ``--attention-backend``: ``auto`` SDPA on a GPU and Megatron-Core's ``DotProductAttention``
    on the CPU, ``sdpa`` or ``unfused`` everywhere; Transformer Engine's spec, where a dense or
    MoE model is built with it, has its own).
    """
    install_cpu_shim()
    (tp_size, pp_size, tp_rank, pp_rank, cp_size, ep_size, ep_rank, etp_rank,
     etp_size) = _parallel_sizes(pg_collection)
    if seed is not None:
        model_parallel_cuda_manual_seed(seed, tp_rank=tp_rank, ep_rank=ep_rank,
                                        etp_rank=etp_rank)
    device = compute_device() if device is None else torch.device(device)
    config = _transformer_config(arch, tp_size=tp_size, pp_size=pp_size, cp_size=cp_size,
                                 expert_sizes=(ep_size, etp_size), params_dtype=params_dtype,
                                 device=device, **config_overrides)
    kwargs = {}
    if pg_collection is not None:
        kwargs["pg_collection"] = pg_collection
    if vp_stage is not None:
        kwargs["vp_stage"] = vp_stage
    model = GPTModel(
        config=config,
        transformer_layer_spec=_block_spec(arch, config, vp_stage=vp_stage, pp_rank=pp_rank,
                                           attention=attention),
        vocab_size=arch.padded_vocab_size,
        max_sequence_length=arch.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=arch.tie_embeddings,
        position_embedding_type=arch.position_embedding_type,
        rotary_base=arch.rotary_base,
        rotary_percent=arch.rotary_percent,
        rope_scaling=arch.rope_scaling_factor is not None,
        rope_scaling_factor=arch.rope_scaling_factor or 8.0,
        **kwargs,
    )
    model.kd_arch = arch
    # Megatron-LM's get_model moves the model too: torch's norms are built on the host
    return move_to_compute_device(model, device, what="the GPT model")


def model_arch(model) -> GPTArchConfig:
    """The architecture a model was built with (unwrapping DDP / Float16Module wrappers)."""
    while not hasattr(model, "kd_arch") and hasattr(model, "module"):
        model = model.module
    arch = getattr(model, "kd_arch", None)
    if arch is None:
        raise ValueError("model was not built by megatron_kd.integration.gpt.build_gpt_model "
                         "(no kd_arch attribute)")
    return arch
