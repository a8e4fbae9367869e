"""What one layout costs: the memory of every student and teacher GPU, term by term, the step time
and the wire traffic of each mode, and the smallest disaggregated teacher replica that fits. The
modes and the assumptions are described in :mod:`.plan`; the memory formulas in :mod:`.memory`.
"""

from __future__ import annotations

import math
from dataclasses import asdict

from megatron_kd.planner import memory as mem
from megatron_kd.planner import traffic as tr
from megatron_kd.planner.candidates import colocated_teacher_layout, teacher_candidates
from megatron_kd.planner.memory import ParallelLayout
from megatron_kd.planner.options import GIB, MODES, ModePlan, PlanOptions

# --- memory of one GPU -------------------------------------------------------------------------


def num_microbatches(opts: PlanOptions, layout: ParallelLayout) -> int:
    """Micro-batches ``m`` each data-parallel rank runs per optimizer step."""
    return opts.global_batch_size // (opts.micro_batch_size * layout.dp)


def student_stage_terms(
    opts: PlanOptions,
    mode: str,
    layout: ParallelLayout,
    teacher_layout: ParallelLayout | None,
    stage: int,
) -> dict[str, float]:
    """Every memory term of one student GPU of pipeline stage ``stage`` in ``mode``."""
    if mode not in MODES:
        raise ValueError(f"mode={mode!r}; choose from {MODES}")
    terms = _student_model_terms(opts, mode, layout, stage)
    if mode.startswith("colocated"):
        assert teacher_layout is not None
        terms.update(_colocated_teacher_terms(opts, layout, teacher_layout, stage))
    if stage == layout.pp - 1:
        terms.update(_loss_terms(opts, mode, layout))
        terms.update(_teacher_input_terms(opts, mode, layout))
    terms["reserve (context, NCCL, frag.)"] = opts.reserve_bytes
    return terms


def _student_model_terms(
    opts: PlanOptions, mode: str, layout: ParallelLayout, stage: int
) -> dict[str, float]:
    """The student's own weights, gradients, optimizer state and saved activations on ``stage``."""
    s, b = opts.seq_length, opts.micro_batch_size
    student = opts.student
    m = num_microbatches(opts, layout)
    state = mem.model_state_bytes(student, layout, stage, opts.precision, trainable=True)
    terms: dict[str, float] = {
        "student weights": state["weights"],
        "student grads (main_grad)": state["grads"],
        "optimizer (Adam)": state["optimizer"],
        "activations": mem.stage_activation_bytes(student, layout, stage, s, b, m, opts.activation),
    }
    if stage == layout.pp - 1:
        terms["activations"] += mem.output_layer_activation_bytes(
            student,
            layout,
            s,
            b,
            dense_output_layer=mode == "colocated-dense",
            activation_bytes=opts.activation.activation_bytes,
        )
    return terms


def _colocated_teacher_terms(
    opts: PlanOptions, layout: ParallelLayout, teacher_layout: ParallelLayout, stage: int
) -> dict[str, float]:
    """A colocated teacher's weights and no-grad working set on ``stage``, where it has any."""
    pipelined = teacher_layout.pp == layout.pp
    # pipelined teacher, or the whole one on the last stage
    if not (pipelined or stage == layout.pp - 1):
        return {}
    teacher = opts.teacher
    t_stage = stage if pipelined else 0
    return {
        "teacher weights": mem.model_state_bytes(
            teacher, teacher_layout, t_stage, opts.precision, trainable=False
        )["weights"],
        "teacher forward (no grad)": mem.teacher_forward_working_bytes(
            teacher,
            teacher_layout,
            opts.seq_length,
            opts.micro_batch_size,
            opts.activation.activation_bytes,
            opts.activation.flash_attention,
        ),
    }


def _loss_terms(opts: PlanOptions, mode: str, layout: ParallelLayout) -> dict[str, float]:
    """The KD loss's buffers on the last stage: dense logits, or the fused loss's parts."""
    s, b = opts.seq_length, opts.micro_batch_size
    student, teacher = opts.student, opts.teacher
    if mode == "colocated-dense":
        return {"loss: dense logits": mem.dense_loss_bytes(student, teacher, layout, s, b)}
    fused = mem.fused_loss_bytes(
        student,
        layout,
        s,
        b,
        opts.window_size,
        dense_teacher=mode != "offline-cache",
        teacher_hidden_size=teacher.hidden_size,
        activation_bytes=opts.activation.activation_bytes,
        block_elements=opts.loss_block_elements,
    )
    terms = {
        "loss: window buffers": fused["window"],
        "loss: fp32 grad accumulators": fused["gradients"],
    }
    if fused["gathered"]:
        terms["loss: gathered hidden (SP)"] = fused["gathered"]
    terms["loss: row statistics"] = fused["row statistics"]
    return terms


def _teacher_input_terms(opts: PlanOptions, mode: str, layout: ParallelLayout) -> dict[str, float]:
    """What the last stage holds of the teacher's side, by mode: hidden states, cache, ring."""
    s, b = opts.seq_length, opts.micro_batch_size
    teacher = opts.teacher
    if mode == "colocated-fused":
        n = s * b
        sp_div = layout.tp if layout.sequence_parallel else 1
        act_bytes = opts.activation.activation_bytes
        return {"teacher final hidden": n * teacher.hidden_size * act_bytes / sp_div}
    if mode == "offline-cache":
        return {
            "cache reader": mem.cache_reader_bytes(
                s, b, opts.topk, opts.cache_resident_microbatches
            )
        }
    if mode == "disaggregated":
        shard = mem.teacher_output_layer_bytes(teacher, layout, opts.precision.param_bytes)
        ring = mem.ring_bytes(teacher, layout, s, b, opts.prefetch_depth, opts.hidden_elem_bytes,
                              tr.wire_bytes_per_token(teacher.hidden_size, opts.wire_dtype))
        return {
            "teacher output-layer shard": shard,
            "ring slots (D x 1/t seq)": ring["ring_slots"],
            "gathered hidden [s,b,h_t]": ring["gathered_hidden"],
        }
    return {}


def _peak(
    opts: PlanOptions, mode: str, layout: ParallelLayout, teacher_layout: ParallelLayout | None
) -> tuple[int, dict[str, float], float]:
    """The student stage of highest memory: ``(stage, its terms, their total)``."""
    best = (0, {}, -1.0)
    for stage in range(layout.pp):
        terms = student_stage_terms(opts, mode, layout, teacher_layout, stage)
        total = sum(terms.values())
        if total > best[2]:
            best = (stage, terms, total)
    return best


def teacher_inference_terms(
    opts: PlanOptions, layout: ParallelLayout, stage: int
) -> dict[str, float]:
    """One disaggregated teacher GPU: its weights, one layer's no-grad working set, and on the
    last stage ``D`` send slots of its share of the final hidden states.

    The last stage holds its output layer although it never runs it (the student projects the
    hidden states): ``megatron-kd train``'s teacher ranks build Megatron's ``GPTModel`` with its
    output layer (``post_process``) and load it from the checkpoint. It is a term of its own, so
    the saving of not building it is visible."""
    teacher = opts.teacher
    s, b = opts.seq_length, opts.micro_batch_size
    weights = mem.model_state_bytes(teacher, layout, stage, opts.precision, trainable=False)[
        "weights"
    ]
    output_layer = 0
    last = stage == layout.pp - 1
    if last and (not teacher.tie_embeddings or layout.pp > 1):
        output_layer = mem.teacher_output_layer_bytes(teacher, layout, opts.precision.param_bytes)
    terms = {"teacher weights (no output layer)": weights - output_layer}
    if output_layer:
        terms["teacher output layer (loaded, not run)"] = output_layer
    terms["teacher forward (no grad)"] = mem.teacher_forward_working_bytes(
        teacher, layout, s, b, opts.activation.activation_bytes, opts.activation.flash_attention
    )
    if last:
        terms["send slots (D x 1/t seq)"] = (
            opts.prefetch_depth * s * b
            * tr.wire_bytes_per_token(teacher.hidden_size, opts.wire_dtype) / layout.tp
        )
    terms["reserve (context, NCCL, frag.)"] = opts.reserve_bytes
    return terms


def search_teacher(opts: PlanOptions) -> tuple[ParallelLayout, dict[str, float], bool]:
    """Smallest disaggregated teacher replica that fits: (layout, worst-stage terms, fits)."""
    scored = []
    for tl in teacher_candidates(opts):
        worst = max(
            (teacher_inference_terms(opts, tl, st) for st in range(tl.pp)),
            key=lambda d: sum(d.values()),
        )
        total = sum(worst.values())
        scored.append((total <= opts.gpu.memory_bytes, tl, worst, total))
    fitting = [x for x in scored if x[0]]
    if fitting:
        _, tl, worst, _ = min(fitting, key=lambda x: (x[1].world_size, x[1].pp, x[1].tp))
        return tl, worst, True
    _, tl, worst, _ = min(scored, key=lambda x: x[3])
    return tl, worst, False


# --- time and traffic of one layout ------------------------------------------------------------


def _student_flops_per_step(opts: PlanOptions, mode: str, recompute: str) -> float:
    """FLOPs of one step on the student's GPUs, with their share of the teacher's work."""
    tokens = opts.global_batch_size * opts.seq_length
    flops = tr.training_flops_per_token(opts.student, opts.seq_length, recompute)
    if mode.startswith("colocated"):
        flops += tr.forward_flops_per_token(opts.teacher, opts.seq_length)
    elif mode == "disaggregated":
        flops += 2.0 * opts.teacher.vocab_size * opts.teacher.hidden_size
    return tokens * flops


def evaluate(
    opts: PlanOptions,
    mode: str,
    layout: ParallelLayout,
    teacher_search: tuple[ParallelLayout, dict[str, float], bool] | None = None,
) -> ModePlan:
    """The plan of ``mode`` for a given student layout (teacher layouts searched as configured;
    ``teacher_search`` is :func:`search_teacher`'s answer, when already known)."""
    teacher_layout = None
    if mode.startswith("colocated"):
        teacher_layout = _colocated_teacher_or_raise(opts, layout, mode)
    plan = _student_plan(opts, mode, layout, teacher_layout)
    if mode == "offline-cache":
        _add_cache_traffic(plan, opts, layout)
    else:
        _add_loss_allreduce(plan, opts, mode, layout)
    if mode == "disaggregated":
        _add_disaggregated_teacher(plan, opts, layout, teacher_search or search_teacher(opts))
    return plan


def _colocated_teacher_or_raise(
    opts: PlanOptions, layout: ParallelLayout, mode: str
) -> ParallelLayout:
    """The colocated teacher's layout on the student's ranks; ``ValueError`` when there is none."""
    teacher_layout = colocated_teacher_layout(opts, layout, mode)
    if teacher_layout is None:
        raise ValueError(
            f"teacher {opts.teacher.name} cannot be colocated on tp={layout.tp} "
            f"dp={layout.dp} (teacher_ep={opts.teacher_ep})"
        )
    return teacher_layout


def _student_plan(
    opts: PlanOptions, mode: str, layout: ParallelLayout, teacher_layout: ParallelLayout | None
) -> ModePlan:
    """The plan's student side: the peak stage's memory, the step time and the tokens per second."""
    stage, terms, total = _peak(opts, mode, layout, teacher_layout)
    world = layout.world_size
    step = tr.step_time_s(
        _student_flops_per_step(opts, mode, layout.recompute),
        world,
        opts.gpu.bf16_flops,
        opts.mfu,
        layout.pp,
        num_microbatches(opts, layout),
    )
    tokens = opts.global_batch_size * opts.seq_length
    return ModePlan(
        mode=mode,
        fits=total <= opts.gpu.memory_bytes,
        layout=asdict(layout),
        teacher_layout=asdict(teacher_layout) if teacher_layout else None,
        worst_stage=stage,
        terms=terms,
        total_bytes=total,
        capacity_bytes=opts.gpu.memory_bytes,
        step_time_s=step,
        student_tokens_per_s=tokens / step,
        student_gpus=world,
    )


def _add_loss_allreduce(
    plan: ModePlan, opts: PlanOptions, mode: str, layout: ParallelLayout
) -> None:
    """The loss's tensor-parallel all-reduces per step (an online teacher's logits are sharded)."""
    m = num_microbatches(opts, layout)
    s, b, t = opts.seq_length, opts.micro_batch_size, layout.tp
    # the dense loss (ModelOpt) all-reduces each model's max and sum of exponentials: 4 per row
    stats = opts.loss_stats if mode != "colocated-dense" else 4
    ar = tr.loss_allreduce_bytes_per_step_per_rank(m, s, b, t, stats)
    plan.wire["loss all-reduce bytes/step/rank"] = ar
    plan.wire["loss all-reduce calls/step"] = (
        tr.loss_allreduce_count_per_step(
            m, s, b, mem.window_rows(opts.student, layout, opts.window_size)
        )
        if mode != "colocated-dense"
        else 2 * m
    )
    plan.wire["loss all-reduce GB/s needed (NVLink)"] = ar / plan.step_time_s / 1e9


def _add_cache_traffic(plan: ModePlan, opts: PlanOptions, layout: ParallelLayout) -> None:
    """The offline cache's read rate, its size and the teacher GPU-hours that build it."""
    s, step = opts.seq_length, plan.step_time_s
    per_dp = opts.global_batch_size // layout.dp * s * (opts.topk * opts.cache_entry_bytes + 4)
    plan.wire["cache bytes/step/DP rank"] = per_dp
    plan.wire["cache read GB/s per DP rank"] = per_dp / step / 1e9
    plan.wire["cache size GB per 1B tokens"] = 1e9 * (opts.topk * opts.cache_entry_bytes + 4) / 1e9
    build = (
        tr.forward_flops_per_token(opts.teacher, s) * 1e9 / (opts.gpu.bf16_flops * opts.teacher_mfu)
    )
    plan.wire["cache build teacher GPU-hours per 1B tokens"] = build / 3600
    plan.notes.append(
        "needs a cache built beforehand (cost above); top-K targets approximate the "
        "teacher's full distribution"
    )


def _add_disaggregated_teacher(
    plan: ModePlan,
    opts: PlanOptions,
    layout: ParallelLayout,
    teacher_search: tuple[ParallelLayout, dict[str, float], bool],
) -> None:
    """The teacher replicas the student's rate needs, and the hidden-state traffic they send."""
    tl, tterms, tfits = teacher_search
    plan.teacher_layout = asdict(tl)
    plan.teacher_terms = tterms
    replicas, per_replica = tr.replicas_needed(
        plan.student_tokens_per_s,
        tl.world_size,
        opts.gpu.bf16_flops,
        opts.teacher_mfu,
        tr.forward_flops_per_token(opts.teacher, opts.seq_length, include_output_layer=False),
    )
    if opts.teacher_replicas is not None:
        if opts.teacher_replicas < replicas:  # the student waits for its teachers
            tokens = opts.global_batch_size * opts.seq_length
            plan.student_tokens_per_s = tr.served_tokens_per_s(
                plan.student_tokens_per_s, opts.teacher_replicas, per_replica)
            plan.step_time_s = tokens / plan.student_tokens_per_s
            plan.notes.append(
                f"teacher-bound: {opts.teacher_replicas} replica(s) give "
                f"{plan.student_tokens_per_s:,.0f} tokens/s; the student's rate "
                f"needs {replicas}")
        replicas = opts.teacher_replicas
    plan.teacher_replicas = replicas
    plan.teacher_gpus = replicas * tl.world_size
    plan.teacher_nodes = math.ceil(plan.teacher_gpus / opts.gpus_per_node)
    _add_hidden_traffic(plan, opts, layout, tl, replicas)
    plan.wire["teacher replica tokens/s"] = per_replica
    if not tfits:
        plan.fits = False
        plan.notes.append(
            f"no teacher replica layout fits {opts.gpu.name}: lowest peak "
            f"{sum(tterms.values()) / GIB:.1f} GiB"
        )


def _add_hidden_traffic(
    plan: ModePlan, opts: PlanOptions, layout: ParallelLayout, tl: ParallelLayout, replicas: int
) -> None:
    """Hidden-state rates on the inter-node link and NVLink, and whether both keep up."""
    link = opts.inter_node_link.bytes_per_s * opts.link_efficiency
    nvlink = opts.gpu.nvlink_bytes_per_s * opts.link_efficiency
    m = num_microbatches(opts, layout)
    s, b, t = opts.seq_length, opts.micro_batch_size, layout.tp
    step = plan.step_time_s
    per_dp = tr.hidden_bytes_per_step_per_dp_rank(
        opts.teacher, opts.global_batch_size, layout.dp, s, opts.wire_dtype
    )
    per_tp = per_dp / t
    need = per_tp / step
    plan.wire["token id bytes/step/student DP rank (to teacher)"] = (
        tr.token_bytes_per_step_per_dp_rank(opts.global_batch_size, layout.dp, s))
    plan.wire["hidden bytes/step/student DP rank"] = per_dp
    plan.wire["hidden bytes/step/student TP rank"] = per_tp
    plan.wire["hidden GB/s needed per student GPU"] = need / 1e9
    plan.wire["inter-node link GB/s (x efficiency)"] = link / 1e9
    sender = (
        plan.student_tokens_per_s / replicas
        * tr.wire_bytes_per_token(opts.teacher.hidden_size, opts.wire_dtype)
    )
    sender /= tl.tp * tl.dp
    plan.wire["hidden GB/s needed per teacher sending GPU"] = sender / 1e9
    ag = tr.allgather_bytes_per_step_per_rank(opts.teacher, m, s, b, t, opts.hidden_elem_bytes)
    plan.wire["all-gather bytes/step/rank (NVLink)"] = ag
    plan.wire["all-gather GB/s needed (NVLink)"] = ag / step / 1e9
    plan.wire["NVLink GB/s (x efficiency)"] = nvlink / 1e9
    plan.wire_ok = need <= link and sender <= link and ag / step <= nvlink
