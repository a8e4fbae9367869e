"""The planner: closed-form per-GPU memory, compute time and network traffic of knowledge
distillation with Megatron-Core, for each way of placing the teacher (colocated with the dense or
the fused loss, an offline top-K cache, disaggregated teacher nodes). Pure Python: nothing here
imports torch, so ``megatron-kd plan`` runs on a laptop before a cluster is rented.

Modules, each name imported from the one that defines it: :mod:`.models` (architectures, exact
parameter counts, Hugging Face and megatron_kd config readers), :mod:`.presets` (public model
configs, GPUs and links, as data), :mod:`.schedule` (Megatron-Core's pipeline schedules: layers
per stage and virtual stage, micro-batches in flight, the bubble), :mod:`.memory` (every per-GPU
memory term, with its formula and source), :mod:`.traffic` (FLOPs, step time, wire bytes, teacher
replicas), :mod:`.plan` (a plan's inputs, :class:`~.plan.PlanOptions`, and its frozen results),
:mod:`.search` (candidate layouts, what each costs, the search), :mod:`.options` (what the
alternatives to a chosen layout buy), :mod:`.cli` (``megatron-kd plan`` and its ``--from-args``
reader).
"""
