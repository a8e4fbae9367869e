"""Plans: one per distillation mode, with layout search (pure Python, no torch).

Modes
-----
* ``colocated-dense``: teacher on the student's GPUs (same TP / PP, its experts spread over an
  expert-parallel size of its own), the incumbent dense KD loss (full ``[s, b, V/t]`` logits of
  both).
* ``colocated-fused``: the same, with megatron_kd's fused loss (windows of ``w`` rows).
* ``offline-cache``: no teacher at training time; the student reads top-K targets from a cache built
  beforehand (its build cost is reported as teacher GPU-hours per billion tokens).
* ``disaggregated``: teachers on their own nodes stream final hidden states ``[s, b, h_t]``; the
  student holds only the teacher's output-layer shard and the prefetch ring.

Search
------
A parallel size left as ``None`` is searched. Among the layouts that fit, the planner picks the
layouts without full recompute (it costs a third more compute), then the smallest model-parallel
size ``t * p``, then the least recompute (none < selective), then the smaller ``t``, then the larger
expert-parallel size. Sequence parallelism, when not given, is on whenever ``t > 1``. A colocated
teacher's expert-parallel size, when not given, is the largest that divides both its expert count
and ``t * dp`` (the least memory). A disaggregated teacher replica is the smallest ``t_t * p_t *
dp_t`` (``dp_t`` only as wide as its expert parallelism needs) whose inference memory fits. Nothing
fitting is reported as such with the layout of lowest peak memory: never silently replaced by
something else.

Assumptions stated here, used everywhere: the teacher's micro-batch equals the student's; tensor
parallelism stays inside a node; expert-tensor parallelism is 1 unless given; a fixed reserve
(default 4 GiB: CUDA context ~0.5-1 GiB, NCCL buffers ~1-2 GiB, allocator fragmentation) is part of
every GPU's total.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from megatron_kd.planner import memory as mem
from megatron_kd.planner import traffic as tr
from megatron_kd.planner.memory import ActivationOptions, ParallelLayout, Precision
from megatron_kd.planner.models import ModelConfig
from megatron_kd.planner.presets import GpuSpec, LinkSpec

MODES = ("colocated-dense", "colocated-fused", "offline-cache", "disaggregated")
_RECOMPUTE_ORDER = {"none": 0, "selective": 1, "full": 2}
GIB = 1 << 30


@dataclass(kw_only=True)
class PlanOptions:
    """Everything a plan depends on."""

    student: ModelConfig
    """The model being trained."""

    teacher: ModelConfig
    """The frozen teacher."""

    gpu: GpuSpec
    """GPU of every node (students and teachers)."""

    inter_node_link: LinkSpec
    """Per-GPU link between nodes (teacher -> student hidden states cross it)."""

    gpus_per_node: int = 8
    """GPUs per node; tensor parallelism stays inside a node."""

    nodes: int = 1
    """Nodes of the student (all modes); disaggregated teachers come on top, as computed."""

    seq_length: int = 4096
    """Tokens per sequence ``s``."""

    micro_batch_size: int = 1
    """Sequences per micro-batch ``b``."""

    global_batch_size: int = 128
    """Sequences per optimizer step ``G``."""

    tp: int | None = None
    """Student tensor-parallel size; None = search."""

    pp: int | None = None
    """Student pipeline-parallel size; None = search."""

    ep: int | None = None
    """Student expert-parallel size (MoE students); None = search."""

    etp: int = 1
    """Student expert-tensor-parallel size."""

    recompute: str | None = None
    """``none`` / ``selective`` / ``full``; None = search (least that fits)."""

    sequence_parallel: bool | None = None
    """None = on whenever ``tp > 1``."""

    use_distributed_optimizer: bool = False
    """Shard optimizer state over data parallel (Megatron ``--use-distributed-optimizer``)."""

    teacher_tp: int | None = None
    """Disaggregated teacher tensor-parallel size; None = search."""

    teacher_pp: int | None = None
    """Disaggregated teacher pipeline-parallel size; None = search."""

    teacher_ep: int | None = None
    """Teacher expert-parallel size (both colocated and disaggregated); None = search."""

    window_size: int | None = None
    """Fused-loss rows per window ``w`` (an upper bound on rows in flight); None = the loss's
    default, a 64 MiB fp32 ``[w, V/t]`` buffer."""

    prefetch_depth: int = 2
    """Receive slots ``D`` of the disaggregated ring, and micro-batches the cache reader decodes
    ahead (into host memory)."""

    topk: int = 64
    """Entries per token in the offline cache."""

    cache_entry_bytes: int = 6
    """Bytes per cached entry on storage (a 4-byte token id and a 2-byte value): the cache's size
    and read rate. Decoded in memory an entry takes 12 bytes (``memory.cache_reader_bytes``)."""

    loss_block_elements: int | None = None
    """Elements per block of the fused loss's elementwise work: None on a GPU and with TP > 1 (a
    block is the window); on CPU runs without TP ``megatron_kd.loss.fused.CPU_BLOCK_ELEMENTS``
    (``2^21``)."""

    cache_resident_microbatches: int = 1
    """Micro-batches of decoded top-K targets in the student's device memory: 1 on a GPU (the
    one in use; the prefetched ones wait in host memory); ``prefetch_depth + 2`` where host memory
    is the device memory (CPU runs: ``D`` queued, one being decoded, one in use)."""

    hidden_elem_bytes: int = 2
    """Bytes per element of the streamed hidden states (bf16)."""

    loss_stats: int = 5
    """fp32 per-row values the fused loss all-reduces over TP per window: forward KL needs the
    student and teacher maxima (one MAX all-reduce) and three sums (one SUM all-reduce); CE adds
    one, JSD a third all-reduce of two."""

    mfu: float = 0.40
    """Assumed model FLOP utilisation of student training."""

    teacher_mfu: float = 0.40
    """Assumed model FLOP utilisation of the teacher's forward."""

    link_efficiency: float = 0.8
    """Fraction of a link's line rate that transfers achieve."""

    reserve_bytes: int = 4 * GIB
    """Per-GPU reserve: CUDA context, NCCL buffers, allocator fragmentation."""

    precision: Precision = field(default_factory=Precision)
    """Bytes per element of weights, gradients, optimizer state and activations."""

    activation: ActivationOptions = field(default_factory=ActivationOptions)
    """Kernel choices (flash attention, dropout)."""

    def __post_init__(self) -> None:
        for name in (
            "gpus_per_node",
            "nodes",
            "seq_length",
            "micro_batch_size",
            "global_batch_size",
            "topk",
            "cache_entry_bytes",
            "cache_resident_microbatches",
            "hidden_elem_bytes",
            "loss_stats",
            "etp",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"PlanOptions.{name} must be a positive int, got {value!r}")
        for name in ("window_size", "loss_block_elements"):
            value = getattr(self, name)
            if value is not None and (
                not isinstance(value, int) or isinstance(value, bool) or value <= 0
            ):
                raise ValueError(f"PlanOptions.{name} must be a positive int or None, got {value!r}")
        if self.prefetch_depth < 1:
            raise ValueError(f"prefetch_depth must be >= 1, got {self.prefetch_depth}")
        if self.global_batch_size % self.micro_batch_size:
            raise ValueError(
                f"global_batch_size={self.global_batch_size} is not a multiple of "
                f"micro_batch_size={self.micro_batch_size}"
            )
        for name in ("mfu", "teacher_mfu", "link_efficiency"):
            value = getattr(self, name)
            if not 0 < value <= 1:
                raise ValueError(f"PlanOptions.{name} must be in (0, 1], got {value}")
        if self.recompute is not None and self.recompute not in _RECOMPUTE_ORDER:
            raise ValueError(f"recompute={self.recompute!r}; choose from {list(_RECOMPUTE_ORDER)}")
        for name in ("tp", "teacher_tp"):
            value = getattr(self, name)
            if value is not None and value > self.gpus_per_node:
                raise ValueError(
                    f"{name}={value} > gpus_per_node={self.gpus_per_node}: tensor "
                    f"parallelism must stay inside a node"
                )
        if self.reserve_bytes < 0:
            raise ValueError(f"reserve_bytes must be >= 0, got {self.reserve_bytes}")

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node


@dataclass(kw_only=True)
class ModePlan:
    """The plan of one mode."""

    mode: str
    fits: bool
    layout: dict | None
    teacher_layout: dict | None = None
    worst_stage: int = 0
    terms: dict[str, float] = field(default_factory=dict)
    teacher_terms: dict[str, float] = field(default_factory=dict)
    total_bytes: float = 0.0
    capacity_bytes: int = 0
    step_time_s: float = 0.0
    student_tokens_per_s: float = 0.0
    tokens_per_s_per_gpu: float = 0.0
    student_gpus: int = 0
    teacher_gpus: int = 0
    teacher_nodes: int = 0
    teacher_replicas: int = 0
    wire: dict[str, float] = field(default_factory=dict)
    wire_ok: bool = True
    notes: list[str] = field(default_factory=list)
    verdict: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


# --- candidate layouts -------------------------------------------------------------------------


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _student_candidates(opts: PlanOptions) -> list[ParallelLayout]:
    model = opts.student
    world = opts.world_size
    tps = [opts.tp] if opts.tp else _divisors(opts.gpus_per_node)
    reasons: list[str] = []  # why candidates were dropped, for the error when none is left
    out = []
    for t in tps:
        pps = (
            [opts.pp]
            if opts.pp
            else [
                p for p in _divisors(world // t if world % t == 0 else 1) if p <= model.num_layers
            ]
        )
        for p in pps:
            if world % (t * p):
                reasons.append(f"tp*pp={t}*{p} does not divide {world} GPUs")
                continue
            dp = world // (t * p)
            if opts.global_batch_size % (opts.micro_batch_size * dp):
                reasons.append(
                    f"global_batch_size={opts.global_batch_size} is not a multiple of "
                    f"micro_batch_size*dp={opts.micro_batch_size}*{dp}"
                )
                continue
            sp = (t > 1) if opts.sequence_parallel is None else opts.sequence_parallel
            if model.is_moe:
                eps = (
                    [opts.ep]
                    if opts.ep
                    else [e for e in _divisors(model.num_experts) if (t * dp) % (e * opts.etp) == 0]
                )
            else:
                eps = [1]
            recomputes = [opts.recompute] if opts.recompute else list(_RECOMPUTE_ORDER)
            for e in eps:
                for rc in recomputes:
                    try:
                        layout = ParallelLayout(
                            tp=t,
                            pp=p,
                            dp=dp,
                            ep=e,
                            etp=opts.etp if model.is_moe else 1,
                            sequence_parallel=sp,
                            use_distributed_optimizer=opts.use_distributed_optimizer,
                            recompute=rc,
                        )
                        mem.validate_layout(model, layout, "student")
                    except ValueError as exc:
                        reasons.append(str(exc))
                        continue
                    out.append(layout)
    if not out:
        distinct = list(dict.fromkeys(reasons))
        raise ValueError(
            f"no valid student layout for {model.name} on {world} GPUs (tp={opts.tp}, "
            f"pp={opts.pp}, ep={opts.ep}): "
            + "; ".join(distinct[:3])
            + (" ..." if len(distinct) > 3 else "")
        )
    return out


def _colocated_teacher_layout(
    opts: PlanOptions, layout: ParallelLayout, mode: str
) -> ParallelLayout | None:
    """The teacher on the student's ranks: same t, dp, SP, its own expert-parallel size; pipelined
    like the student with the dense loss (ModelOpt), whole on the last stage with the fused loss
    (``megatron-kd train``)."""
    teacher = opts.teacher
    if teacher.is_moe:
        eps = (
            [opts.teacher_ep]
            if opts.teacher_ep
            else sorted(
                (e for e in _divisors(teacher.num_experts) if (layout.tp * layout.dp) % e == 0),
                reverse=True,
            )
        )
    else:
        eps = [1]
    for e in eps:
        try:
            tl = ParallelLayout(
                tp=layout.tp,
                pp=layout.pp if mode == "colocated-dense" else 1,
                dp=layout.dp,
                ep=e,
                etp=1,
                sequence_parallel=layout.sequence_parallel,
                make_vocab_size_divisible_by=layout.make_vocab_size_divisible_by,
            )
            mem.validate_layout(teacher, tl, "colocated teacher")
            return tl
        except ValueError:
            continue
    return None


def _teacher_candidates(opts: PlanOptions) -> list[ParallelLayout]:
    teacher = opts.teacher
    tps = [opts.teacher_tp] if opts.teacher_tp else _divisors(opts.gpus_per_node)
    pps = [opts.teacher_pp] if opts.teacher_pp else list(range(1, min(teacher.num_layers, 16) + 1))
    eps = (
        ([opts.teacher_ep] if opts.teacher_ep else _divisors(teacher.num_experts))
        if teacher.is_moe
        else [1]
    )
    out = []
    for t in tps:
        for p in pps:
            for e in eps:
                dp = max(1, e // t) if e % t == 0 or t % e == 0 else None
                if dp is None or (t * dp) % e:
                    continue
                try:
                    tl = ParallelLayout(tp=t, pp=p, dp=dp, ep=e, etp=1, sequence_parallel=t > 1)
                    mem.validate_layout(teacher, tl, "teacher")
                except ValueError:
                    continue
                out.append(tl)
    if not out:
        raise ValueError(
            f"no valid teacher layout for {teacher.name} (teacher_tp={opts.teacher_tp}, "
            f"teacher_pp={opts.teacher_pp}, teacher_ep={opts.teacher_ep})"
        )
    return out


# --- evaluation ------------------------------------------------------------------------------


def _num_microbatches(opts: PlanOptions, layout: ParallelLayout) -> int:
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
    s, b = opts.seq_length, opts.micro_batch_size
    student, teacher = opts.student, opts.teacher
    m = _num_microbatches(opts, layout)
    act_bytes = opts.activation.activation_bytes
    state = mem.model_state_bytes(student, layout, stage, opts.precision, trainable=True)
    terms: dict[str, float] = {
        "student weights": state["weights"],
        "student grads (main_grad)": state["grads"],
        "optimizer (Adam)": state["optimizer"],
        "activations": mem.stage_activation_bytes(student, layout, stage, s, b, m, opts.activation),
    }
    last = stage == layout.pp - 1
    if last:
        terms["activations"] += mem.output_layer_activation_bytes(
            student,
            layout,
            s,
            b,
            dense_output_layer=mode == "colocated-dense",
            activation_bytes=act_bytes,
        )
    if mode.startswith("colocated"):
        assert teacher_layout is not None
        if (
            teacher_layout.pp == layout.pp or last
        ):  # pipelined teacher, or the whole one on the last stage
            t_stage = stage if teacher_layout.pp == layout.pp else 0
            terms["teacher weights"] = mem.model_state_bytes(
                teacher, teacher_layout, t_stage, opts.precision, trainable=False
            )["weights"]
            terms["teacher forward (no grad)"] = mem.teacher_forward_working_bytes(
                teacher, teacher_layout, s, b, act_bytes, opts.activation.flash_attention
            )
    if last:
        n = s * b
        sp_div = layout.tp if layout.sequence_parallel else 1
        if mode == "colocated-dense":
            terms["loss: dense logits"] = mem.dense_loss_bytes(student, teacher, layout, s, b)
        else:
            fused = mem.fused_loss_bytes(
                student,
                layout,
                s,
                b,
                opts.window_size,
                dense_teacher=mode != "offline-cache",
                teacher_hidden_size=teacher.hidden_size,
                activation_bytes=act_bytes,
                block_elements=opts.loss_block_elements,
            )
            terms["loss: window buffers"] = fused["window"]
            terms["loss: fp32 grad accumulators"] = fused["gradients"]
            if fused["gathered"]:
                terms["loss: gathered hidden (SP)"] = fused["gathered"]
            terms["loss: row statistics"] = fused["row statistics"]
        if mode == "colocated-fused":
            terms["teacher final hidden"] = n * teacher.hidden_size * act_bytes / sp_div
        elif mode == "offline-cache":
            terms["cache reader"] = mem.cache_reader_bytes(
                s, b, opts.topk, opts.cache_resident_microbatches
            )
        elif mode == "disaggregated":
            terms["teacher output-layer shard"] = mem.teacher_output_layer_bytes(
                teacher, layout, opts.precision.param_bytes
            )
            ring = mem.ring_bytes(
                teacher, layout, s, b, opts.prefetch_depth, opts.hidden_elem_bytes
            )
            terms["ring slots (D x 1/t seq)"] = ring["ring_slots"]
            terms["gathered hidden [s,b,h_t]"] = ring["gathered_hidden"]
    terms["reserve (context, NCCL, frag.)"] = opts.reserve_bytes
    return terms


def _peak(
    opts: PlanOptions, mode: str, layout: ParallelLayout, teacher_layout: ParallelLayout | None
) -> tuple[int, dict[str, float], float]:
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
            opts.prefetch_depth * s * b * teacher.hidden_size * opts.hidden_elem_bytes / layout.tp
        )
    terms["reserve (context, NCCL, frag.)"] = opts.reserve_bytes
    return terms


def search_teacher(opts: PlanOptions) -> tuple[ParallelLayout, dict[str, float], bool]:
    """Smallest disaggregated teacher replica that fits: (layout, worst-stage terms, fits)."""
    scored = []
    for tl in _teacher_candidates(opts):
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


def _student_flops_per_step(opts: PlanOptions, mode: str, recompute: str) -> float:
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
        teacher_layout = _colocated_teacher_layout(opts, layout, mode)
        if teacher_layout is None:
            raise ValueError(
                f"teacher {opts.teacher.name} cannot be colocated on tp={layout.tp} "
                f"dp={layout.dp} (teacher_ep={opts.teacher_ep})"
            )
    stage, terms, total = _peak(opts, mode, layout, teacher_layout)
    m = _num_microbatches(opts, layout)
    world = layout.world_size
    step = tr.step_time_s(
        _student_flops_per_step(opts, mode, layout.recompute),
        world,
        opts.gpu.bf16_flops,
        opts.mfu,
        layout.pp,
        m,
    )
    tokens = opts.global_batch_size * opts.seq_length
    plan = ModePlan(
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
    link = opts.inter_node_link.bytes_per_s * opts.link_efficiency
    nvlink = opts.gpu.nvlink_bytes_per_s * opts.link_efficiency
    s, b, t = opts.seq_length, opts.micro_batch_size, layout.tp
    if mode != "offline-cache":
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
        plan.wire["loss all-reduce GB/s needed (NVLink)"] = ar / step / 1e9
    if mode == "offline-cache":
        per_dp = opts.global_batch_size // layout.dp * s * (opts.topk * opts.cache_entry_bytes + 4)
        plan.wire["cache bytes/step/DP rank"] = per_dp
        plan.wire["cache read GB/s per DP rank"] = per_dp / step / 1e9
        plan.wire["cache size GB per 1B tokens"] = (
            1e9 * (opts.topk * opts.cache_entry_bytes + 4) / 1e9
        )
        build = (
            tr.forward_flops_per_token(opts.teacher, s)
            * 1e9
            / (opts.gpu.bf16_flops * opts.teacher_mfu)
        )
        plan.wire["cache build teacher GPU-hours per 1B tokens"] = build / 3600
        plan.notes.append(
            "needs a cache built beforehand (cost above); top-K targets approximate the "
            "teacher's full distribution"
        )
    if mode == "disaggregated":
        tl, tterms, tfits = teacher_search or search_teacher(opts)
        plan.teacher_layout = asdict(tl)
        plan.teacher_terms = tterms
        replicas, per_replica = tr.replicas_needed(
            plan.student_tokens_per_s,
            tl.world_size,
            opts.gpu.bf16_flops,
            opts.teacher_mfu,
            tr.forward_flops_per_token(opts.teacher, s, include_output_layer=False),
        )
        plan.teacher_replicas = replicas
        plan.teacher_gpus = replicas * tl.world_size
        plan.teacher_nodes = math.ceil(plan.teacher_gpus / opts.gpus_per_node)
        per_dp = tr.hidden_bytes_per_step_per_dp_rank(
            opts.teacher, opts.global_batch_size, layout.dp, s, opts.hidden_elem_bytes
        )
        per_tp = per_dp / t
        need = per_tp / step
        plan.wire["hidden bytes/step/student DP rank"] = per_dp
        plan.wire["hidden bytes/step/student TP rank"] = per_tp
        plan.wire["hidden GB/s needed per student GPU"] = need / 1e9
        plan.wire["inter-node link GB/s (x efficiency)"] = link / 1e9
        sender = (
            plan.student_tokens_per_s / replicas * opts.teacher.hidden_size * opts.hidden_elem_bytes
        )
        sender /= tl.tp * tl.dp
        plan.wire["hidden GB/s needed per teacher sending GPU"] = sender / 1e9
        ag = tr.allgather_bytes_per_step_per_rank(opts.teacher, m, s, b, t, opts.hidden_elem_bytes)
        plan.wire["all-gather bytes/step/rank (NVLink)"] = ag
        plan.wire["all-gather GB/s needed (NVLink)"] = ag / step / 1e9
        plan.wire["NVLink GB/s (x efficiency)"] = nvlink / 1e9
        plan.wire_ok = need <= link and sender <= link and ag / step <= nvlink
        plan.wire["teacher replica tokens/s"] = per_replica
        if not tfits:
            plan.fits = False
            plan.notes.append(
                f"no teacher replica layout fits {opts.gpu.name}: lowest peak "
                f"{sum(tterms.values()) / GIB:.1f} GiB"
            )
    return plan


def _search_key(layout: ParallelLayout) -> tuple:
    # full recompute (a third more compute) only when nothing else fits; then the smallest t*p
    return (
        layout.recompute == "full",
        layout.tp * layout.pp,
        _RECOMPUTE_ORDER[layout.recompute],
        layout.tp,
        -layout.ep,
    )


def plan_mode(opts: PlanOptions, mode: str) -> ModePlan:
    """Search (or take) the student layout of ``mode``; see the module docstring for the order."""
    candidates = sorted(_student_candidates(opts), key=_search_key)
    teacher_search = search_teacher(opts) if mode == "disaggregated" else None
    best_oom: ModePlan | None = None
    for layout in candidates:
        try:
            plan = evaluate(opts, mode, layout, teacher_search)
        except ValueError:
            if len(candidates) == 1:
                raise
            continue
        if plan.fits:
            plan.verdict = _verdict(plan)
            return plan
        if best_oom is None or plan.total_bytes < best_oom.total_bytes:
            best_oom = plan
    if best_oom is None:
        raise ValueError(
            f"{mode}: no layout could be evaluated for {opts.student.name} <- {opts.teacher.name}"
        )
    if len(candidates) > 1:
        best_oom.notes.append(
            f"no layout of {len(candidates)} searched fits; shown: lowest peak memory"
        )
    best_oom.verdict = _verdict(best_oom)
    return best_oom


def _verdict(plan: ModePlan) -> str:
    gib = plan.total_bytes / GIB
    cap = plan.capacity_bytes / GIB
    plan.tokens_per_s_per_gpu = plan.student_tokens_per_s / (plan.student_gpus + plan.teacher_gpus)
    if not plan.fits:
        return f"OOM: {gib:.1f} GiB > {cap:.1f} GiB per GPU"
    text = f"fits: {gib:.1f} of {cap:.1f} GiB, {plan.student_tokens_per_s:,.0f} tokens/s"
    if plan.mode == "disaggregated":
        text += (
            f", +{plan.teacher_gpus} teacher GPU(s) on {plan.teacher_nodes} node(s); "
            f"{plan.tokens_per_s_per_gpu:,.0f} tokens/s per GPU counting teachers"
        )
        if not plan.wire_ok:
            text += ", WIRE-BOUND (link too slow: the student would stall)"
    return text


def plan_all(opts: PlanOptions, modes: tuple[str, ...] = MODES) -> dict:
    """Every mode's plan and a one-line recommendation."""
    plans = {m: plan_mode(opts, m) for m in modes}
    return {"plans": plans, "recommendation": recommend(plans)}


def recommend(plans: dict[str, ModePlan]) -> str:
    """One line: the fastest mode that fits (with a working wire), and what it costs."""
    ok = {m: p for m, p in plans.items() if p.fits and p.wire_ok and m != "offline-cache"}
    if not ok:
        if plans.get("offline-cache") and plans["offline-cache"].fits:
            return "only the offline cache fits: build a top-K cache, or add nodes / raise tp, pp"
        return (
            "nothing fits: add nodes, raise tp / pp, enable the distributed optimizer or recompute"
        )
    best_mode, best = max(ok.items(), key=lambda kv: kv[1].student_tokens_per_s)
    coloc = [p for m, p in ok.items() if m.startswith("colocated")]
    if best_mode == "disaggregated":
        if coloc:
            c = max(coloc, key=lambda p: p.student_tokens_per_s)
            gain = best.student_tokens_per_s / c.student_tokens_per_s - 1
            return (
                f"disaggregated: {gain:.0%} more student tokens/s than {c.mode} (which also fits), "
                f"for {best.teacher_gpus} teacher GPU(s) on {best.teacher_nodes} extra node(s); "
                f"per GPU counting teachers {best.tokens_per_s_per_gpu:,.0f} vs "
                f"{c.tokens_per_s_per_gpu:,.0f} tokens/s"
            )
        return (
            f"disaggregated: the only online mode that fits; needs {best.teacher_nodes} "
            f"teacher node(s)"
        )
    return f"{best_mode}: fits and is fastest without extra nodes"
