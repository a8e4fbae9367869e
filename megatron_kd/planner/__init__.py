"""The planner: closed-form per-GPU memory, compute time and network traffic of knowledge
distillation with Megatron-Core, for each way of placing the teacher (colocated with the dense or
the fused loss, an offline top-K cache, disaggregated teacher nodes). Pure Python: nothing here
imports torch, so ``megatron-kd plan`` runs on a laptop before a cluster is rented.

A model is the project's one architecture type, :class:`~megatron_kd.arch.GPTArchConfig`, read
by :mod:`megatron_kd.arch` whatever it comes from (a preset, a Hugging Face ``config.json``, a
checkpoint, Megatron-LM flags); the planner has no model type or reader of its own.

Modules, each name imported from the one that defines it: :mod:`.models` (a named architecture
with its exact parameter counts), :mod:`.presets` (public models as architectures, GPUs and
links, as data; a model named by a path read by :mod:`megatron_kd.arch`), :mod:`.schedule`
(Megatron-Core's pipeline schedules: layers per stage and virtual stage, micro-batches in
flight, the bubble), :mod:`.memory` (every per-GPU
memory term, with its formula and source), :mod:`.traffic` (FLOPs, step time, wire bytes, teacher
replicas), :mod:`.plan` (a plan's inputs, :class:`~.plan.PlanOptions`, and its frozen results),
:mod:`.search` (candidate layouts, what each costs, the search), :mod:`.options` (what the
alternatives to a chosen layout buy), :mod:`.mixture` (several teachers at once, one mode each),
:mod:`.cli` (``megatron-kd plan`` and its ``--from-args``
reader: the model's flags read by :mod:`megatron_kd.arch.megatron_lm_args`).
"""
