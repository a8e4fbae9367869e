"""The planner: closed-form per-GPU memory, compute time and network traffic of knowledge
distillation with Megatron-Core, for each way of placing the teacher (colocated with the dense or
the fused loss, an offline top-K cache, disaggregated teacher nodes). Pure Python: nothing here
imports torch, so ``megatron-kd plan`` runs on a laptop before a cluster is rented.

Modules: :mod:`.models` (architectures, exact parameter counts, Hugging Face config reader),
:mod:`.presets` (public model configs, GPUs, links), :mod:`.model_memory` (a model's own memory
terms: state and activations) and :mod:`.memory` (what distillation adds, and every term
re-exported), with the formulas and their sources, :mod:`.traffic` (FLOPs, step time, wire bytes,
teacher replicas), :mod:`.options` (a plan's inputs and result), :mod:`.candidates` (valid layouts),
:mod:`.evaluation` (the cost of one layout), :mod:`.plan` (modes and layout search),
:mod:`.launch_args` (a Megatron launch line), :mod:`.cli`.
"""

from megatron_kd.planner.models import ModelConfig, from_hf_config
from megatron_kd.planner.plan import MODES, ModePlan, PlanOptions, plan_all, plan_mode
from megatron_kd.planner.presets import load_model

__all__ = [
    "MODES",
    "ModePlan",
    "ModelConfig",
    "PlanOptions",
    "from_hf_config",
    "load_model",
    "plan_all",
    "plan_mode",
]
