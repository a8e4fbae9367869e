"""How a plan is found (pure Python, no torch): the candidate layouts (every way of splitting the
student, and the teacher, that Megatron accepts for the given GPUs and options), what one layout
costs (the memory of every student and teacher GPU, term by term, the step time and the traffic
of each mode), and the search among them. The modes and the plan's inputs and results are in
:mod:`.plan`; the memory formulas in :mod:`.memory`, time and traffic in :mod:`.traffic`.

The module is one piece: the search order, the candidates it orders and the costs that decide
between them are read together (a candidate is kept or dropped by what it costs); split, each part
would have to be read with the others open.

Search
------
A parallel size left as ``None`` is searched, and so are virtual pipeline stages (with ``p > 1``:
every ``v`` that gives each virtual stage the same whole number of layers, where the micro-batches
allow Megatron-Core's interleaved schedule) and recompute (none, selective, and full recompute
with method ``uniform`` in groups of any ``N`` dividing a chunk's layers or ``block`` with any ``N``
below them), and context parallelism (every ``cp`` dividing the GPUs of a tensor x pipeline
group whose ``2 cp`` chunks split the sequence; none for Gated DeltaNet students, which Megatron-
Core 0.16.1 does not split). Among the layouts that fit, the planner picks the layouts without
full recompute (up to a third more compute), then the smallest model-parallel size ``t * p * cp``
(context parallelism shards activations only, pipeline stages shard weights too: each competes
on its time below), then the least
recompute compute (none < selective < full block x1 < ... < full uniform), then the smaller ``t``,
then the least pipeline and exchange time (the bubble, smaller with more virtual stages, plus the
point-to-point sends, more with more virtual stages, plus context parallelism's K/V exchange, each
counted at link speed as if not overlapped; more virtual stages also cost activation memory on the
first stages, which is why they are tried in turn), then the smaller uniform group, then the
larger expert-parallel size. Sequence parallelism, when
not given, is on whenever ``t > 1``. A colocated teacher's expert-parallel size, when not given,
is the largest that divides both its expert count and ``t * dp`` (the least memory). A
disaggregated teacher replica is the smallest ``t_t * p_t * dp_t`` (``dp_t`` only as wide as its
expert parallelism needs) whose inference memory fits. Nothing fitting is reported as such with
the layout of lowest peak memory: never silently replaced by something else.
"""

from __future__ import annotations

import math
from dataclasses import replace

from megatron_kd.arch import Role, check_layout
from megatron_kd.parallel.layout import microbatches_per_step, virtual_stages_of
from megatron_kd.planner import memory as mem
from megatron_kd.planner import schedule
from megatron_kd.planner import traffic as tr
from megatron_kd.planner.memory import GIB, RECOMPUTE_METHODS, ParallelLayout, Term
from megatron_kd.planner.models import PlannedModel
from megatron_kd.planner.plan import Mode, ModePlan, PlanOptions
from megatron_kd.planner.traffic import Traffic

#: A disaggregated teacher replica found by :func:`search_teacher`: its layout, the terms of its
#: GPU of highest memory, and whether they fit.
TeacherSearch = tuple[ParallelLayout, dict[Term, float], bool]

_CACHE_NOTE = (
    "needs a cache built beforehand (cost above); top-K targets approximate the teacher's full "
    "distribution"
)


# --- the search ------------------------------------------------------------------------------


def plan_mode(opts: PlanOptions, mode: Mode) -> ModePlan:
    """Search (or take) the student layout of ``mode``; see the module docstring for the order."""
    candidates = sorted(student_candidates(opts, mode),
                        key=lambda layout: _search_key(opts, layout))
    teacher_search = search_teacher(opts) if mode is Mode.DISAGGREGATED else None
    return first_fit(candidates, lambda layout: evaluate(opts, mode, layout, teacher_search),
                     f"{mode.value}: no layout could be evaluated for {opts.student.name} <- "
                     f"{opts.teacher.name}")


def first_fit(candidates: list, evaluate_one, nothing: str):
    """The plan of the first of ``candidates`` (layouts, preferred first) that fits, else the
    one of lowest peak memory, with a note; ``evaluate_one(layout)`` plans one (its
    ``ValueError`` skips the layout, or is raised when it is the only one). ``nothing``: the
    ``ValueError`` when no layout could be evaluated."""
    best_oom = None
    for layout in candidates:
        try:
            plan = evaluate_one(layout)
        except ValueError:
            if len(candidates) == 1:
                raise
            continue
        if plan.fits:
            return plan
        if best_oom is None or plan.total_bytes < best_oom.total_bytes:
            best_oom = plan
    if best_oom is None:
        raise ValueError(nothing)
    if len(candidates) > 1:
        note = f"no layout of {len(candidates)} searched fits; shown: lowest peak memory"
        best_oom = replace(best_oom, notes=(*best_oom.notes, note))
    return best_oom


def _search_key(opts: PlanOptions, layout: ParallelLayout) -> tuple:
    """Sort key of the student layouts, preferred first (the order of the module docstring)."""
    # full recompute (up to a third more compute) only when nothing else fits; then the smallest
    # t*p*cp; then the least recompute compute
    recomputed = mem.recomputed_layers(opts.student.num_layers, layout)
    flops = tr.training_flops_per_token(opts.student, opts.seq_length, layout.recompute,
                                        recomputed)
    # the pipeline's and the context-parallel exchange's cost, as a fraction of the step's
    # compute: bubble + point-to-point time + K/V exchange time
    compute_s = (opts.global_batch_size * opts.seq_length * flops
                 / (layout.world_size * opts.gpu.bf16_flops * opts.mfu))
    pipeline = (schedule.bubble_fraction(layout.pp, layout.vp, num_microbatches(opts, layout))
                + (_p2p_seconds(opts, layout) + _cp_seconds(opts, layout)) / compute_s)
    return (
        layout.recompute == "full",
        layout.tp * layout.pp * layout.cp,
        flops,
        layout.tp,
        pipeline,
        layout.recompute_num_layers,
        -layout.ep,
    )


# --- candidate layouts -----------------------------------------------------------------------


def _divisors(n: int) -> list[int]:
    """The divisors of ``n``, ascending."""
    return [d for d in range(1, n + 1) if n % d == 0]


def student_candidates(opts: PlanOptions, mode: Mode | None = None) -> list[ParallelLayout]:
    """Every student layout on ``opts.world_size`` GPUs that :func:`check_student` accepts (in
    ``mode``: a colocated teacher runs in the student's groups and is checked with it);
    ``ValueError`` (with the first reasons) when there is none."""
    model = opts.student
    world = opts.world_size
    tps = [opts.tp] if opts.tp else _divisors(opts.gpus_per_node)
    reasons: list[str] = []  # why candidates were dropped, for the error when none is left
    out = []
    for t in tps:
        pps = [opts.pp] if opts.pp else _divisors(world // t if world % t == 0 else 1)
        for p in pps:
            for c in [opts.cp] if opts.cp is not None else _divisors(max(1, world // (t * p))):
                try:
                    dp = ParallelLayout.from_world(world, tp=t, pp=p, cp=c).dp
                    m = microbatches_per_step(opts.global_batch_size, opts.micro_batch_size, dp)
                except ValueError as exc:
                    reasons.append(str(exc))
                    continue
                out += _split_candidates(opts, mode, t, p, c, dp, m, reasons)
    if not out:
        distinct = list(dict.fromkeys(reasons))
        raise ValueError(
            f"no valid student layout for {model.name} on {world} GPUs (tp={opts.tp}, "
            f"pp={opts.pp}, vp={opts.vp}, ep={opts.ep}): "
            + "; ".join(distinct[:3])
            + (" ..." if len(distinct) > 3 else "")
        )
    return out


def _in_groups(opts: PlanOptions, mode: Mode | None) -> list[PlannedModel]:
    """The models built in the student's groups: the student, and a colocated teacher."""
    return [opts.student] + ([opts.teacher] if mode is not None and mode.colocated else [])


def _expert_sizes(opts: PlanOptions, mode: Mode | None) -> list[int]:
    """Expert-parallel sizes of the student's groups to try: as given (the student's, or for a
    dense student beside a colocated mixture-of-experts teacher the teacher's), else every
    divisor of the expert counts of the models built in the groups (one expert grid holds them
    all)."""
    counts = [m.num_experts for m in _in_groups(opts, mode) if m.is_moe]
    if not counts:
        return [1]
    if opts.student.is_moe and opts.ep:
        return [opts.ep]
    if not opts.student.is_moe and opts.teacher_ep:
        return [opts.teacher_ep]
    return _divisors(math.gcd(*counts))


def _split_candidates(opts: PlanOptions, mode: Mode | None, t: int, p: int, c: int, dp: int,
                      m: int, reasons: list[str]) -> list[ParallelLayout]:
    """Every valid layout of one tensor x pipeline x context x data split: its virtual stages,
    expert-parallel sizes and recompute settings."""
    sp = (t > 1) if opts.sequence_parallel is None else opts.sequence_parallel
    comm = opts.cp_comm_type or mem.default_cp_comm_type(opts.student)
    dist_opt = opts.use_distributed_optimizer
    if dist_opt is None:
        dist_opt = dp > 1
    # the expert-tensor size where a model of the groups has experts, else Megatron's default
    etp = opts.etp if any(m.is_moe for m in _in_groups(opts, mode)) else None
    out = []
    for v in _virtual_stages(opts, p, reasons):
        for e in _expert_sizes(opts, mode):
            for rc, method, n in _recomputes(opts, p, v):
                try:
                    layout = ParallelLayout(
                        tp=t,
                        pp=p,
                        vp=v,
                        dp=dp,
                        cp=c,
                        cp_comm_type=comm,
                        ep=e,
                        etp=etp,
                        sequence_parallel=sp,
                        use_distributed_optimizer=dist_opt,
                        recompute=rc,
                        recompute_method=method,
                        recompute_num_layers=n,
                    )
                    check_student(opts, layout, mode, m)
                except ValueError as exc:
                    reasons.append(str(exc))
                    continue
                out.append(layout)
    return out


def check_student(opts: PlanOptions, layout: ParallelLayout, mode: Mode | None = None,
                  microbatches: int | None = None) -> None:
    """``megatron-kd train``'s check of a student layout (:func:`megatron_kd.arch.check_layout`
    with the student's role, a colocated teacher of a colocated mode checked with it), on the
    GPUs the planner plans for (Transformer Engine's attention); ``ValueError`` naming the
    model."""
    colocated = mode is Mode.COLOCATED_FUSED
    m = microbatches or num_microbatches(opts, layout)
    try:
        check_layout(opts.student.arch_at(layout.tp), layout, role=Role.STUDENT,
                     seq_length=opts.seq_length, num_microbatches=m,
                     colocated_teacher=opts.teacher.arch_at(layout.tp) if colocated else None,
                     transformer_engine=True)
    except ValueError as e:
        raise ValueError(f"student {opts.student.name}: {e}") from None


def check_teacher_layout(opts: PlanOptions, model: PlannedModel, layout: ParallelLayout,
                         role: Role) -> None:
    """:func:`megatron_kd.arch.check_layout` of a teacher layout in ``role`` (a replica, a cache
    build, or the incumbent dense loss's pipelined teacher), naming the model."""
    seq_length = opts.seq_length if role is Role.CACHE_TEACHER else None
    try:
        check_layout(model.arch_at(layout.tp), layout, role=role, seq_length=seq_length,
                     transformer_engine=True)
    except ValueError as e:
        raise ValueError(f"{role.value} {model.name}: {e}") from None


def _virtual_stages(opts: PlanOptions, p: int, reasons: list[str]) -> list[int]:
    """The virtual stages per rank to try with ``p`` stages: as given (``vp``, or
    ``layers_per_virtual_stage``), else 1 and every ``v > 1`` whose virtual stages hold the same
    whole number of layers (:func:`check_student` refuses what Megatron-Core's interleaved
    schedule cannot take)."""
    layers = opts.student.num_layers
    if opts.layers_per_virtual_stage is not None:
        per = opts.layers_per_virtual_stage
        try:
            v = virtual_stages_of(layers, p, per)
        except ValueError as e:
            reasons.append(str(e))
            return []
        if p == 1 or v == 1:
            reasons.append(
                f"layers_per_virtual_stage={per} with pp={p} and num_layers={layers}: needs pp > 1 "
                f"and more than one virtual stage of whole layers per rank (Megatron-Core runs "
                f"one chunk per rank through its interleaved schedule, which the planner does not "
                f"model)")
            return []
        return [v]
    if opts.vp is not None:
        return [opts.vp]
    if p == 1 or layers % p:
        return [1]
    return _divisors(layers // p)


def _recomputes(opts: PlanOptions, p: int, v: int) -> list[tuple[str, str, int]]:
    """``(recompute, method, num_layers)`` settings to try (given, or every one; see the module
    docstring)."""
    if opts.recompute in ("none", "selective"):
        return [(opts.recompute, "uniform", 1)]
    out = [] if opts.recompute == "full" else [("none", "uniform", 1), ("selective", "uniform", 1)]
    chunk = max(1, opts.student.num_layers // (p * v))  # a model chunk's layers
    methods = [opts.recompute_method] if opts.recompute_method else list(RECOMPUTE_METHODS)
    for method in methods:
        if opts.recompute_num_layers is not None:
            counts = [opts.recompute_num_layers]
        elif method == "uniform":
            counts = _divisors(chunk)
        else:  # block with N >= a chunk's layers is uniform x1
            counts = list(range(1, chunk))
        out += [("full", method, n) for n in counts]
    return out


def colocated_teacher_layout(layout: ParallelLayout, mode: Mode) -> ParallelLayout:
    """The teacher on the student's ranks, in the student's groups (its tensor, context, data
    and expert split, its sequence parallelism): whole on the last stage with the fused loss
    (``megatron-kd train``, :meth:`ParallelLayout.colocated`), pipelined like the student with
    the incumbent dense loss (ModelOpt)."""
    teacher = layout.colocated()
    return replace(teacher, pp=layout.pp) if mode is Mode.COLOCATED_DENSE else teacher


def teacher_candidates(opts: PlanOptions, role: Role = Role.TEACHER_REPLICA
                       ) -> list[ParallelLayout]:
    """Every teacher layout ``teacher serve`` accepts for a replica (``role``
    :attr:`~Role.TEACHER_REPLICA`: one model's ``tp x pp`` ranks, its experts inside its
    tensor-parallel group), or ``cache build`` for one copy of its teacher
    (:attr:`~Role.CACHE_TEACHER`: no pipeline); ``ValueError`` when there is none."""
    teacher = opts.teacher
    tps = [opts.teacher_tp] if opts.teacher_tp else _divisors(opts.gpus_per_node)
    if role is Role.CACHE_TEACHER:
        pps = [1]
    else:
        pps = [opts.teacher_pp] if opts.teacher_pp else list(
            range(1, min(teacher.num_layers, 16) + 1))
    eps = (
        ([opts.teacher_ep] if opts.teacher_ep else _divisors(teacher.num_experts))
        if teacher.is_moe
        else [1]
    )
    out, reasons = [], []
    for t in tps:
        for p in pps:
            for e in eps:
                try:
                    tl = ParallelLayout(tp=t, pp=p, ep=e, etp=1 if teacher.is_moe else None,
                                        sequence_parallel=t > 1)
                    check_teacher_layout(opts, teacher, tl, role)
                except ValueError as exc:
                    reasons.append(str(exc))
                    continue
                out.append(tl)
    if not out:
        distinct = list(dict.fromkeys(reasons))
        raise ValueError(
            f"no valid {role.value} layout for {teacher.name} (teacher_tp={opts.teacher_tp}, "
            f"teacher_pp={opts.teacher_pp}, teacher_ep={opts.teacher_ep}): "
            + "; ".join(distinct[:3]) + (" ..." if len(distinct) > 3 else "")
        )
    return out


# --- memory of one GPU -------------------------------------------------------------------------


def num_microbatches(opts: PlanOptions, layout: ParallelLayout) -> int:
    """Micro-batches ``m`` each data-parallel rank runs per optimizer step."""
    return microbatches_per_step(opts.global_batch_size, opts.micro_batch_size, layout.dp)


def student_stage_terms(
    opts: PlanOptions,
    mode: Mode,
    layout: ParallelLayout,
    teacher_layout: ParallelLayout | None,
    stage: int,
) -> dict[Term, float]:
    """Every memory term of one student GPU of pipeline stage ``stage`` in ``mode``."""
    if not isinstance(mode, Mode):
        raise ValueError(f"mode={mode!r}; choose from {tuple(m.value for m in Mode)}")
    terms = _student_model_terms(opts, mode, layout, stage)
    if mode.colocated:
        assert teacher_layout is not None
        terms.update(_colocated_teacher_terms(opts, layout, teacher_layout, stage))
    if stage == layout.pp - 1:
        terms.update(_loss_terms(opts, mode, layout))
        terms.update(_teacher_input_terms(opts, mode, layout))
    terms[Term.RESERVE] = opts.reserve_bytes
    return terms


def _student_model_terms(
    opts: PlanOptions, mode: Mode, layout: ParallelLayout, stage: int
) -> dict[Term, float]:
    """The student's own weights, gradients, optimizer state and saved activations on ``stage``."""
    s, b = opts.seq_length, opts.micro_batch_size
    student = opts.student
    m = num_microbatches(opts, layout)
    state = mem.model_state_bytes(student, layout, stage, opts.precision, trainable=True)
    activations = mem.stage_activation_bytes(student, layout, stage, s, b, m, opts.activation)
    if stage == layout.pp - 1:
        activations += mem.output_layer_activation_bytes(
            student,
            layout,
            s,
            b,
            dense_output_layer=opts.dense_loss(mode),
            activation_bytes=opts.activation.activation_bytes,
        )
    terms = {
        Term.STUDENT_WEIGHTS: state.weights,
        Term.STUDENT_GRADS: state.grads,
        Term.OPTIMIZER: state.optimizer,
        Term.ACTIVATIONS: activations,
    }
    layers = schedule.rank_layers(student.num_layers, layout.pp, layout.vp, stage)
    if any(student.is_full_attention(i) for i in layers):
        if not opts.activation.flash_attention:
            # one layer's backward: the gradients of the probabilities and of the scores
            terms[Term.ATTENTION_BACKWARD] = 2 * mem.attention_score_bytes(
                student, layout, s, b, opts.activation)
        elif layout.cp > 1:
            # Transformer Engine's K/V exchange buffers, one layer at a time (the CPU's
            # gathered K/V are saved activations)
            terms[Term.CP_EXCHANGE] = mem.cp_exchange_bytes(student, layout, s, b,
                                                            opts.activation.activation_bytes)
    return terms


def _colocated_teacher_terms(
    opts: PlanOptions, layout: ParallelLayout, teacher_layout: ParallelLayout, stage: int
) -> dict[Term, float]:
    """A colocated teacher's weights and no-grad working set on ``stage``, where it has any."""
    pipelined = teacher_layout.pp == layout.pp
    # pipelined teacher, or the whole one on the last stage
    if not (pipelined or stage == layout.pp - 1):
        return {}
    teacher = opts.teacher
    t_stage = stage if pipelined else 0
    return {
        Term.TEACHER_WEIGHTS: mem.model_state_bytes(
            teacher, teacher_layout, t_stage, opts.precision, trainable=False
        ).weights,
        Term.TEACHER_FORWARD: mem.teacher_forward_working_bytes(
            teacher,
            teacher_layout,
            opts.seq_length,
            opts.micro_batch_size,
            opts.activation.activation_bytes,
            opts.activation.flash_attention,
        ),
    }


def _loss_terms(opts: PlanOptions, mode: Mode, layout: ParallelLayout) -> dict[Term, float]:
    """The KD loss's buffers on the last stage: dense logits, or the fused loss's parts."""
    s, b = opts.seq_length, opts.micro_batch_size
    student, teacher = opts.student, opts.teacher
    if opts.loss_path == "dense":  # the dense-logits baseline, in any mode
        return {Term.DENSE_LOGITS: mem.dense_path_loss_bytes(
            student, layout, s, b, dense_teacher=mode is not Mode.OFFLINE_CACHE,
            topk=opts.topk)}
    if mode is Mode.COLOCATED_DENSE:
        return {Term.DENSE_LOGITS: mem.dense_loss_bytes(student, teacher, layout, s, b)}
    fused = mem.fused_loss_bytes(
        student,
        layout,
        s,
        b,
        opts.window_size,
        dense_teacher=mode is not Mode.OFFLINE_CACHE,
        teacher_hidden_size=teacher.hidden_size,
        activation_bytes=opts.activation.activation_bytes,
        block_elements=opts.loss_block_elements,
        gpu=opts.gpu_loss,
    )
    terms = {Term.LOSS_WINDOW: fused.window, Term.LOSS_GRADIENTS: fused.gradients}
    if fused.gathered:
        terms[Term.LOSS_GATHERED] = fused.gathered
    terms[Term.LOSS_ROW_STATISTICS] = fused.row_statistics
    return terms


def _teacher_input_terms(
    opts: PlanOptions, mode: Mode, layout: ParallelLayout
) -> dict[Term, float]:
    """What the last stage holds of the teacher's side, by mode: hidden states, cache, ring."""
    s, b = opts.seq_length, opts.micro_batch_size
    teacher = opts.teacher
    if mode is Mode.COLOCATED_FUSED:
        n = layout.local_tokens(s, b)
        sp_div = layout.tp if layout.sequence_parallel else 1
        act_bytes = opts.activation.activation_bytes
        return {Term.TEACHER_FINAL_HIDDEN: n * teacher.hidden_size * act_bytes / sp_div}
    if mode is Mode.OFFLINE_CACHE:
        return {
            Term.CACHE_READER: mem.cache_reader_bytes(
                s, b, opts.topk, opts.cache_resident_microbatches, layout.cp
            )
        }
    if mode is Mode.DISAGGREGATED:
        shard = mem.teacher_output_layer_bytes(teacher, layout, opts.precision.param_bytes)
        ring = mem.ring_bytes(teacher, layout, s, b, opts.prefetch_depth, opts.hidden_elem_bytes,
                              tr.wire_bytes_per_token(teacher.hidden_size, opts.wire_dtype))
        return {
            Term.TEACHER_OUTPUT_SHARD: shard,
            Term.RING_SLOTS: ring.slots,
            Term.GATHERED_HIDDEN: ring.gathered_hidden,
        }
    return {}


def _peak(
    opts: PlanOptions, mode: Mode, layout: ParallelLayout, teacher_layout: ParallelLayout | None
) -> tuple[int, dict[Term, float], float]:
    """The student stage of highest memory: ``(stage, its terms, their total)``."""
    best = (0, {}, -1.0)
    for stage in range(layout.pp):
        terms = student_stage_terms(opts, mode, layout, teacher_layout, stage)
        total = mem.total_bytes(terms)
        if total > best[2]:
            best = (stage, terms, total)
    return best


def teacher_inference_terms(
    opts: PlanOptions, layout: ParallelLayout, stage: int
) -> dict[Term, float]:
    """One disaggregated teacher GPU: its weights, one layer's no-grad working set, and on the
    last stage ``D`` send slots of its share of the final hidden states.

    The last stage holds its output layer although it never runs it (the student projects the
    hidden states): ``megatron-kd train``'s teacher ranks build Megatron's ``GPTModel`` with its
    output layer (``post_process``) and load it from the checkpoint. It is a term of its own, so
    the saving of not building it is visible."""
    teacher = opts.teacher
    s, b = opts.seq_length, opts.micro_batch_size
    weights = mem.model_state_bytes(teacher, layout, stage, opts.precision, trainable=False).weights
    output_layer = 0
    last = stage == layout.pp - 1
    if last and (not teacher.tie_embeddings or layout.pp > 1):
        output_layer = mem.teacher_output_layer_bytes(teacher, layout, opts.precision.param_bytes)
    terms = {Term.REPLICA_WEIGHTS: weights - output_layer}
    if output_layer:
        terms[Term.REPLICA_OUTPUT_LAYER] = output_layer
    terms[Term.TEACHER_FORWARD] = mem.teacher_forward_working_bytes(
        teacher, layout, s, b, opts.activation.activation_bytes, opts.activation.flash_attention
    )
    if last:
        terms[Term.SEND_SLOTS] = (
            opts.prefetch_depth * s * b
            * tr.wire_bytes_per_token(teacher.hidden_size, opts.wire_dtype) / layout.tp
        )
    terms[Term.RESERVE] = opts.reserve_bytes
    return terms


def search_teacher(opts: PlanOptions, role: Role = Role.TEACHER_REPLICA) -> TeacherSearch:
    """Smallest teacher layout that fits: a disaggregated replica (``role``
    :attr:`~Role.TEACHER_REPLICA`), or one copy of the teacher of ``cache build``
    (:attr:`~Role.CACHE_TEACHER`, no pipeline: it holds the whole model on each of its ``tp``
    ranks' shares); ``(layout, worst-stage terms, fits)``."""
    scored = []
    for tl in teacher_candidates(opts, role):
        worst = max(
            (teacher_inference_terms(opts, tl, st) for st in range(tl.pp)),
            key=mem.total_bytes,
        )
        total = mem.total_bytes(worst)
        scored.append((total <= opts.usable_bytes, tl, worst, total))
    fitting = [x for x in scored if x[0]]
    if fitting:
        _, tl, worst, _ = min(fitting, key=lambda x: (x[1].world_size, x[1].pp, x[1].tp))
        return tl, worst, True
    _, tl, worst, _ = min(scored, key=lambda x: x[3])
    return tl, worst, False


# --- time and traffic of one layout ------------------------------------------------------------


def _student_flops_per_step(opts: PlanOptions, mode: Mode, layout: ParallelLayout) -> float:
    """FLOPs of one step on the student's GPUs, with their share of the teacher's work."""
    tokens = opts.global_batch_size * opts.seq_length
    recomputed = mem.recomputed_layers(opts.student.num_layers, layout)
    flops = tr.training_flops_per_token(opts.student, opts.seq_length, layout.recompute,
                                        recomputed)
    if mode.colocated:
        flops += tr.forward_flops_per_token(opts.teacher, opts.seq_length)
    elif mode is Mode.DISAGGREGATED:
        flops += 2.0 * opts.teacher.vocab_size * opts.teacher.hidden_size
    return tokens * flops


def evaluate(
    opts: PlanOptions,
    mode: Mode,
    layout: ParallelLayout,
    teacher_search: TeacherSearch | None = None,
) -> ModePlan:
    """The plan of ``mode`` for a given student layout (teacher layouts searched as configured;
    ``teacher_search`` is :func:`search_teacher`'s answer, when already known)."""
    check_student(opts, layout, mode)
    teacher_layout = None
    if mode.colocated:
        teacher_layout = colocated_teacher_layout(layout, mode)
        if mode is Mode.COLOCATED_DENSE:  # ModelOpt's pipelined teacher: its split alone
            check_teacher_layout(opts, opts.teacher, teacher_layout, Role.FROZEN)
    plan = _student_plan(opts, mode, layout, teacher_layout)
    if mode is Mode.OFFLINE_CACHE:
        wire = {**_cache_traffic(opts, layout, plan.step_time_s), **_tp_traffic(opts, layout),
                **_cp_traffic(opts, layout), **_pipeline_traffic(opts, layout)}
        return replace(plan, wire=wire, notes=(_CACHE_NOTE,))
    plan = replace(plan, wire={**_loss_allreduce(opts, mode, layout, plan.step_time_s),
                               **_tp_traffic(opts, layout), **_cp_traffic(opts, layout),
                               **_pipeline_traffic(opts, layout)})
    if mode is Mode.DISAGGREGATED:
        plan = _with_disaggregated_teacher(plan, opts, layout,
                                           teacher_search or search_teacher(opts))
    return plan


def _student_plan(
    opts: PlanOptions, mode: Mode, layout: ParallelLayout, teacher_layout: ParallelLayout | None
) -> ModePlan:
    """The plan's student side: the peak stage's memory, the step time and the tokens per second."""
    stage, terms, total = _peak(opts, mode, layout, teacher_layout)
    world = layout.world_size
    m = num_microbatches(opts, layout)
    step = tr.step_time_s(
        _student_flops_per_step(opts, mode, layout),
        world,
        opts.gpu.bf16_flops,
        opts.mfu,
        layout.pp,
        m,
        layout.vp,
    )
    tokens = opts.global_batch_size * opts.seq_length
    return ModePlan(
        mode=mode,
        fits=total <= opts.usable_bytes,
        layout=layout,
        teacher_layout=teacher_layout,
        worst_stage=stage,
        terms=terms,
        total_bytes=total,
        capacity_bytes=opts.gpu.memory_bytes,
        usable_bytes=opts.usable_bytes,
        step_time_s=step,
        bubble=schedule.bubble_fraction(layout.pp, layout.vp, m),
        student_tokens_per_s=tokens / step,
        student_gpus=world,
    )


def _p2p_bytes(opts: PlanOptions, layout: ParallelLayout) -> float:
    return tr.p2p_bytes_per_step_per_rank(
        num_microbatches(opts, layout), opts.seq_length, opts.micro_batch_size,
        opts.student.hidden_size, layout.tp, layout.sequence_parallel, layout.pp, layout.vp,
        opts.activation.activation_bytes, layout.cp)


def _p2p_seconds(opts: PlanOptions, layout: ParallelLayout) -> float:
    """The pipeline's point-to-point sends per step at link speed: NVLink when the student fits
    one node, else the link between nodes (Megatron-Core's rank order puts pipeline stages
    outermost: a multi-node pipeline crosses nodes)."""
    one_node = layout.world_size <= opts.gpus_per_node
    link = opts.gpu.nvlink_bytes_per_s if one_node else opts.inter_node_link.bytes_per_s
    return _p2p_bytes(opts, layout) / (link * opts.link_efficiency)


def _cp_bytes(opts: PlanOptions, layout: ParallelLayout) -> float:
    """Context parallelism's K/V exchange per step, on a first-stage rank (the most layers)."""
    student = opts.student
    return tr.cp_exchange_bytes_per_step_per_rank(
        student,
        schedule.rank_layers(student.num_layers, layout.pp, layout.vp, 0),
        mem.recomputed_layers(student.num_layers, layout),
        num_microbatches(opts, layout),
        opts.seq_length,
        opts.micro_batch_size,
        layout.tp,
        layout.cp,
        layout.cp_comm_type,
        opts.activation.activation_bytes,
    )


def _cp_seconds(opts: PlanOptions, layout: ParallelLayout) -> float:
    """The K/V exchange per step at link speed: NVLink when a TP x CP group fits one node
    (Megatron-Core's rank order puts ``cp`` next to ``tp``), else the link between nodes."""
    if layout.cp == 1:
        return 0.0
    one_node = layout.tp * layout.cp <= opts.gpus_per_node
    link = opts.gpu.nvlink_bytes_per_s if one_node else opts.inter_node_link.bytes_per_s
    return _cp_bytes(opts, layout) / (link * opts.link_efficiency)


def _cp_traffic(opts: PlanOptions, layout: ParallelLayout) -> dict[Traffic, float]:
    """The K/V exchange per step and its time; nothing with ``cp = 1``."""
    if layout.cp == 1:
        return {}
    return {Traffic.CP_EXCHANGE_BYTES: _cp_bytes(opts, layout),
            Traffic.CP_EXCHANGE_SECONDS: _cp_seconds(opts, layout)}


def _pipeline_traffic(opts: PlanOptions, layout: ParallelLayout) -> dict[Traffic, float]:
    """The pipeline's point-to-point sends per step and their time; nothing with ``p = 1``."""
    if layout.pp == 1:
        return {}
    return {Traffic.P2P_BYTES: _p2p_bytes(opts, layout),
            Traffic.P2P_SECONDS: _p2p_seconds(opts, layout)}


def _tp_traffic(opts: PlanOptions, layout: ParallelLayout) -> dict[Traffic, float]:
    """The student's tensor-parallel collectives per step on a first-stage rank (which holds the
    most layers), and their time at NVLink speed; nothing with ``t = 1``."""
    if layout.tp == 1:
        return {}
    student = opts.student
    layers = schedule.rank_layers(student.num_layers, layout.pp, layout.vp, 0)
    moved = tr.tp_collective_bytes_per_step_per_rank(
        student,
        layers,
        mem.recomputed_layers(student.num_layers, layout),
        num_microbatches(opts, layout),
        opts.seq_length,
        opts.micro_batch_size,
        layout.tp,
        layout.sequence_parallel,
        opts.activation.activation_bytes,
        layout.cp,
    )
    return {
        Traffic.TP_COLLECTIVE_BYTES: moved,
        Traffic.TP_COLLECTIVE_SECONDS: moved / (opts.gpu.nvlink_bytes_per_s * opts.link_efficiency),
    }


def _loss_allreduce(
    opts: PlanOptions, mode: Mode, layout: ParallelLayout, step_time_s: float
) -> dict[Traffic, float]:
    """The loss's tensor-parallel all-reduces per step (an online teacher's logits are sharded)."""
    m = num_microbatches(opts, layout)
    s, b, t = opts.seq_length, opts.micro_batch_size, layout.tp
    # the dense loss (ModelOpt) all-reduces each model's max and sum of exponentials: 4 per row
    stats = opts.loss_stats if mode is not Mode.COLOCATED_DENSE else 4
    ar = tr.loss_allreduce_bytes_per_step_per_rank(m, s, b, t, stats, layout.cp)
    rows = mem.window_rows(opts.student, layout, opts.window_size, opts.gpu_loss,
                           s * b // layout.cp, 1 if mode is Mode.OFFLINE_CACHE else 2,
                           opts.activation.activation_bytes)
    calls = (
        tr.loss_allreduce_count_per_step(m, s, b, rows, cp=layout.cp)
        if mode is not Mode.COLOCATED_DENSE
        else 2 * m
    )
    return {
        Traffic.LOSS_ALLREDUCE_BYTES: ar,
        Traffic.LOSS_ALLREDUCE_CALLS: calls,
        Traffic.LOSS_ALLREDUCE_RATE: ar / step_time_s / 1e9,
    }


def _cache_traffic(
    opts: PlanOptions, layout: ParallelLayout, step_time_s: float
) -> dict[Traffic, float]:
    """The offline cache's read rate, its size and the teacher GPU-hours that build it."""
    s = opts.seq_length
    per_token = (tr.cache_bytes_per_token(opts.teacher.vocab_size, opts.topk)
                 if opts.cache_entry_bytes is None else opts.topk * opts.cache_entry_bytes)
    per_dp = opts.global_batch_size // layout.dp * s * per_token
    build = (
        tr.forward_flops_per_token(opts.teacher, s) * 1e9 / (opts.gpu.bf16_flops * opts.teacher_mfu)
    )
    return {
        Traffic.CACHE_BYTES: per_dp,
        Traffic.CACHE_READ_RATE: per_dp / step_time_s / 1e9,
        Traffic.CACHE_SIZE: per_token,  # GB per 1B tokens: bytes a token
        Traffic.CACHE_BUILD_GPU_HOURS: build / 3600,
    }


def _with_disaggregated_teacher(
    plan: ModePlan, opts: PlanOptions, layout: ParallelLayout, teacher_search: TeacherSearch
) -> ModePlan:
    """``plan`` with the teacher replicas the student's rate needs (or the replicas given, which
    may bound the student's rate) and the hidden-state traffic they send."""
    tl, tterms, tfits = teacher_search
    replicas, per_replica = tr.replicas_needed(
        plan.student_tokens_per_s,
        tl.world_size,
        opts.gpu.bf16_flops,
        opts.teacher_mfu,
        tr.forward_flops_per_token(opts.teacher, opts.seq_length, include_output_layer=False),
    )
    tokens_per_s, step = plan.student_tokens_per_s, plan.step_time_s
    notes = list(plan.notes)
    if opts.teacher_replicas is not None:
        if opts.teacher_replicas < replicas:  # the student waits for its teachers
            tokens_per_s = tr.served_tokens_per_s(tokens_per_s, opts.teacher_replicas, per_replica)
            step = opts.global_batch_size * opts.seq_length / tokens_per_s
            notes.append(
                f"teacher-bound: {opts.teacher_replicas} replica(s) give "
                f"{tokens_per_s:,.0f} tokens/s; the student's rate needs {replicas}")
        replicas = opts.teacher_replicas
    wire, wire_ok = _hidden_traffic(opts, layout, tl, replicas, tokens_per_s, step)
    wire[Traffic.REPLICA_TOKENS_PER_S] = per_replica
    if not tfits:
        notes.append(
            f"no teacher replica layout fits {opts.gpu.name}: lowest peak "
            f"{mem.total_bytes(tterms) / GIB:.1f} GiB"
        )
    teacher_gpus = replicas * tl.world_size
    return replace(
        plan,
        fits=plan.fits and tfits,
        teacher_layout=tl,
        teacher_terms=tterms,
        step_time_s=step,
        student_tokens_per_s=tokens_per_s,
        teacher_replicas=replicas,
        teacher_gpus=teacher_gpus,
        teacher_nodes=math.ceil(teacher_gpus / opts.gpus_per_node),
        wire={**plan.wire, **wire},
        wire_ok=wire_ok,
        notes=tuple(notes),
    )


def _hidden_traffic(
    opts: PlanOptions,
    layout: ParallelLayout,
    tl: ParallelLayout,
    replicas: int,
    tokens_per_s: float,
    step_time_s: float,
) -> tuple[dict[Traffic, float], bool]:
    """Hidden-state rates on the inter-node link and NVLink, and whether both keep up."""
    link = opts.inter_node_link.bytes_per_s * opts.link_efficiency
    nvlink = opts.gpu.nvlink_bytes_per_s * opts.link_efficiency
    m = num_microbatches(opts, layout)
    s, b, t = opts.seq_length, opts.micro_batch_size, layout.tp
    per_dp = tr.hidden_bytes_per_step_per_dp_rank(
        opts.teacher, opts.global_batch_size, layout.dp, s, opts.wire_dtype
    )
    per_tp = per_dp / (t * layout.cp)  # a TP x CP rank receives its positions' 1/t
    need = per_tp / step_time_s
    sender = tokens_per_s / replicas * tr.wire_bytes_per_token(
        opts.teacher.hidden_size, opts.wire_dtype)
    sender /= tl.tp * tl.dp
    ag = tr.allgather_bytes_per_step_per_rank(opts.teacher, m, s, b, t, opts.hidden_elem_bytes,
                                              layout.cp)
    wire = {
        Traffic.TOKEN_ID_BYTES: tr.token_bytes_per_step_per_dp_rank(
            opts.global_batch_size, layout.dp, s),
        Traffic.HIDDEN_BYTES_PER_DP_RANK: per_dp,
        Traffic.HIDDEN_BYTES_PER_TP_RANK: per_tp,
        Traffic.HIDDEN_RATE_STUDENT: need / 1e9,
        Traffic.LINK_RATE: link / 1e9,
        Traffic.HIDDEN_RATE_TEACHER: sender / 1e9,
        Traffic.ALLGATHER_BYTES: ag,
        Traffic.ALLGATHER_RATE: ag / step_time_s / 1e9,
        Traffic.NVLINK_RATE: nvlink / 1e9,
    }
    return wire, need <= link and sender <= link and ag / step_time_s <= nvlink
