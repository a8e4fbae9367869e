"""The student of ``megatron-kd train``: its model chunks on this rank, wrapped in Megatron-Core's
DDP, with one optimizer and learning-rate schedule over them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from megatron.core import parallel_state as ps
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from megatron_kd.integration.gpt import build_gpt_model, layout_config
from megatron_kd.integration.groups import collective_device
from megatron_kd.integration.output_layer import bypass_output_layer
from megatron_kd.training.run_checks import CheckedRun
from megatron_kd.training.run_config import RunConfig

__all__ = ["Student", "build_student"]


@dataclass
class Student:
    """A rank's share of the student and what trains it."""

    chunks: list
    """The model chunks (one, or one per virtual pipeline stage), each in Megatron-Core's DDP;
    their output layers bypassed (they return final hidden states)."""

    config: Any
    """The chunks' ``TransformerConfig`` (the pipeline schedule reads it)."""

    optimizer: Any
    scheduler: Any
    num_params: int
    """Parameters on this rank."""


def _moe_recipe(coeff: float, arch) -> dict:
    """Megatron-Core's load-balancing auxiliary loss for a mixture-of-experts student."""
    if not arch.num_experts or not coeff:
        return {}
    return {"moe_router_load_balancing_type": "aux_loss", "moe_aux_loss_coeff": coeff}


def build_student(cfg: RunConfig, run: CheckedRun, pp_rank: int) -> Student:
    """The student's model chunks on this rank (one, or one per virtual pipeline stage), each
    wrapped in Megatron-Core's DDP, and one optimizer over them."""
    opt = cfg.optimizer
    chunks = []
    vp = run.layout.virtual_stages
    for vp_stage in range(vp or 1):
        stage = vp_stage if vp else None
        model = build_gpt_model(
            run.student_arch, pre_process=ps.is_pipeline_first_stage(
                ignore_virtual=False, vp_stage=stage),
            post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage),
            # Megatron-LM's rule: each pipeline stage its own seed (else stages' layers
            # would start identical), seeded once before its chunks are built.
            params_dtype=run.params_dtype,
            seed=cfg.data.seed + 100 * pp_rank if vp_stage == 0 else None,
            vp_stage=stage, attention=cfg.kernels.attention_backend,
            hidden_dropout=cfg.arch.hidden_dropout,
            attention_dropout=cfg.arch.attention_dropout, calculate_per_token_loss=True,
            **layout_config(run.layout), **_moe_recipe(cfg.arch.moe_aux_loss_coeff,
                                                 run.student_arch))
        bypass_output_layer(model)
        chunks.append(model)
    config = chunks[0].config
    distributed = run.layout.use_distributed_optimizer
    overlap = cfg.parallel.ddp_overlap()
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=distributed,
        average_in_collective=False, align_param_gather=overlap["overlap_param_gather"],
        **overlap)
    # Megatron-LM's wrapping: bucketing for the first chunk only
    wrapped = [DistributedDataParallel(config=model.config, ddp_config=ddp_config,
                                       module=model, disable_bucketing=i > 0)
               for i, model in enumerate(chunks)]
    config.finalize_model_grads_func = finalize_model_grads
    no_sync = [chunk.no_sync for chunk in wrapped]
    config.no_sync_func = no_sync if vp else no_sync[0]
    # Megatron-LM's wiring of the overlaps into the pipeline schedule: each chunk's gradient
    # reduction started by the schedule as its last microbatch's backward ends (its
    # --align-grad-reduce default), each chunk's parameter gather before its first forward
    if overlap["overlap_grad_reduce"]:
        grad_sync = [chunk.start_grad_sync for chunk in wrapped]
        config.grad_sync_func = grad_sync if vp else grad_sync[0]
    if overlap["overlap_param_gather"]:
        param_sync = [chunk.start_param_sync for chunk in wrapped]
        config.param_sync_func = param_sync if vp else param_sync[0]
    if vp and collective_device().type == "cpu":
        # Interleaved schedules with batched p2p gave wrong losses for later microbatches
        # on gloo (2 stages x 2 virtual stages, megatron-core 0.16.1): one op at a time.
        config.batch_p2p_comm = False
    opt_config = OptimizerConfig(
        optimizer="adam", lr=opt.lr, min_lr=opt.min_lr, weight_decay=opt.weight_decay,
        adam_beta1=opt.adam_beta1, adam_beta2=opt.adam_beta2, adam_eps=opt.adam_eps,
        clip_grad=opt.clip_grad, bf16=run.params_dtype == torch.bfloat16,
        params_dtype=run.params_dtype, use_distributed_optimizer=distributed)
    optimizer = get_megatron_optimizer(opt_config, wrapped)
    train_iters = cfg.data.train_iters
    decay_iters = opt.lr_decay_iters or train_iters
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=opt.lr, min_lr=opt.min_lr,
        lr_warmup_steps=opt.lr_warmup_iters,
        lr_decay_steps=max(decay_iters, opt.lr_warmup_iters + 1),
        lr_decay_style=opt.lr_decay_style, start_wd=opt.weight_decay,
        end_wd=opt.weight_decay, wd_incr_steps=max(1, train_iters),
        wd_incr_style="constant")
    return Student(chunks=wrapped, config=config, optimizer=optimizer, scheduler=scheduler,
                   num_params=sum(p.numel() for model in chunks for p in model.parameters()))
