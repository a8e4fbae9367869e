"""``megatron-kd plan``: per-GPU memory, time and traffic of each distillation mode.

Examples::

    megatron-kd plan --teacher qwen3.5-35b-a3b --student qwen3.5-9b --gpu h200-141g \\
        --nodes 1 --seq-length 8192 --global-batch-size 64 --use-distributed-optimizer
    megatron-kd plan --teacher qwen3-235b-a22b \\
        --from-args "--num-layers 64 ... --tensor-model-parallel-size 8" --json
    megatron-kd plan --teacher llama-3.1-8b llama-3.1-70b --kd-mode colocated disaggregated \\
        --kd-teacher-weights 1 1 --student llama-3.2-3b    # a mixture (:mod:`.mixture`)

Precedence: an option given on this command line wins over the same setting read from
``--from-args``, which wins over the defaults. A parallel size left out (or ``search``) is searched.

``--from-args``: a Megatron-LM launch's own arguments, read into planner inputs
(:func:`parse_launch_args`).

Only what changes memory, time or traffic is read; every other flag is listed back as ignored (so
nothing is dropped silently). Megatron's own defaults apply to what the launch leaves out, because
that is what the launch would run with: untied embeddings only with
``--untie-embeddings-and-output-weights``, SwiGLU only with ``--swiglu``, hidden dropout 0.1 unless
``--hidden-dropout`` says otherwise, ``--expert-tensor-parallel-size`` defaulting to the
tensor-parallel size, ``--num-query-groups`` equal to the head count without
``--group-query-attention``.

Sequence parallelism, interleaved pipelines (``--num-layers-per-virtual-pipeline-stage``,
``--num-virtual-stages-per-pipeline-rank`` or the older ``--virtual-pipeline-model-parallel-size``)
and recompute (``--recompute-granularity`` selective, or full with ``--recompute-method`` uniform
or block and any ``--recompute-num-layers``) are read into the plan's layout. Context parallelism
(``--context-parallel-size``, ``--cp-comm-type`` with one type for every layer) is read too. Launch
settings the planner does not model, or that Megatron-Core would refuse, are refused with a
``ValueError`` (``--cp-comm-type a2a+p2p`` or one type per layer, a non-default
``--microbatch-group-size-per-virtual-pipeline-stage``, one
virtual stage per rank given explicitly, full recompute without a method or a layer count, a layer
count with selective recompute, ``--fp16`` with ``--bf16``), never approximated.

The module is one piece: the launch reader fills the command's own options (keyed by their
``dest``), so the two are read together.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from dataclasses import asdict, dataclass, field

from megatron_kd.arch.megatron_lm_args import (
    arch_from_megatron_lm_args,
    complete_megatron_lm_flags,
    read_megatron_lm_flags,
)
from megatron_kd.flags import KDSharedFlags, default_of, flag_spec
from megatron_kd.planner import memory as mem
from megatron_kd.planner.launch import MixtureLaunch, launch, mixture_launch
from megatron_kd.planner.memory import (
    CP_COMM_TYPES,
    GIB,
    PHASES,
    RECOMPUTE_CHOICES,
    RECOMPUTE_METHODS,
    WEIGHT_GRADS,
    ActivationOptions,
    ParallelLayout,
    Precision,
    Term,
    total_bytes,
)
from megatron_kd.planner.mixture import (
    CALL_WORKING,
    TEACHER_MODES,
    MixtureOptions,
    MixturePlan,
    TeacherPlan,
    plan_mixture,
)
from megatron_kd.planner.models import PlannedModel
from megatron_kd.planner.options import layout_options, plan_all
from megatron_kd.planner.plan import LayoutOption, Mode, ModePlan, PlanOptions, PlanResult
from megatron_kd.planner.presets import GPU_PRESETS, LINK_PRESETS, get_gpu, get_link, load_model
from megatron_kd.planner.traffic import Traffic

#: The GPU and the link between nodes when none is given (the other defaults are
#: :class:`PlanOptions`').
DEFAULT_GPU = "h100-80g"
DEFAULT_LINK = "ib-400g"
#: :class:`PlanOptions` fields taken as given (from the command line or ``--from-args``), else
#: left to their defaults.
_AS_GIVEN = ("gpus_per_node", "nodes", "seq_length", "micro_batch_size", "global_batch_size",
             "cp_comm_type", "sequence_parallel", "use_distributed_optimizer", "window_size",
             "loss_weight_grad",
             "prefetch_depth", "topk", "cache_entry_bytes", "wire_dtype", "teacher_replicas", "mfu",
             "teacher_mfu", "link_efficiency", "headroom")


def _default(name: str):
    """:class:`PlanOptions`' default of ``name``: where every default of a plan is written."""
    return PlanOptions.__dataclass_fields__[name].default


def _positive_mib(text: str) -> float:
    """A size in MiB, > 0 (``--kd-loss-window-mib``)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a size in MiB, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"a size in MiB must be > 0, got {text!r}")
    return value


def _size(text: str) -> int | str:
    if text == "search":
        return text
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a positive int or 'search', got {text!r}"
        ) from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive int or 'search', got {text!r}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``megatron-kd plan`` (defaults applied in :func:`run`, after
    ``--from-args``)."""
    g = parser.add_argument_group("models and hardware")
    g.add_argument(
        "--teacher", nargs="+", action=_OneOrSeveral,
        help="preset name, a Hugging Face config.json or a megatron_kd checkpoint dir; several: "
             "a mixture of teachers, with one --kd-mode each"
    )
    g.add_argument("--student", help="the same kinds as --teacher (or the model of --from-args)")
    g.add_argument("--gpu", choices=sorted(GPU_PRESETS), help=f"default {DEFAULT_GPU}")
    g.add_argument("--gpus-per-node", type=int, help=f"default {_default('gpus_per_node')}")
    g.add_argument("--nodes", type=int, help=f"student nodes, default {_default('nodes')} "
                   f"(teacher nodes are computed)")
    g.add_argument("--inter-node-link", choices=["nvlink", *sorted(LINK_PRESETS)],
                   help=f"per-GPU link between nodes (default {DEFAULT_LINK})")
    g = parser.add_argument_group("batch")
    for flag in ("seq-length", "micro-batch-size", "global-batch-size"):
        g.add_argument(f"--{flag}", type=int, help=f"default {_default(flag.replace('-', '_'))}")
    g = parser.add_argument_group("student parallelism (N or 'search')")
    g.add_argument("--tensor-model-parallel-size", dest="tp", type=_size)
    g.add_argument("--pipeline-model-parallel-size", dest="pp", type=_size)
    g.add_argument("--expert-model-parallel-size", dest="ep", type=_size)
    g.add_argument("--expert-tensor-parallel-size", dest="etp", type=int)
    g.add_argument("--context-parallel-size", dest="cp", type=_size,
                   help="context parallelism: each sequence split over N ranks (default: search, "
                   "taken only where nothing without it fits without full recompute)")
    g.add_argument("--cp-comm-type", dest="cp_comm_type", choices=CP_COMM_TYPES,
                   help="its K/V exchange (default: p2p, or a2a for models with attention sinks "
                   "or sliding windows, as Transformer Engine requires)")
    g.add_argument("--num-virtual-stages-per-pipeline-rank", dest="vp", type=_size,
                   help="virtual pipeline stages per rank: interleaved 1F1B when > 1")
    g.add_argument("--num-layers-per-virtual-pipeline-stage", dest="layers_per_virtual_stage",
                   type=int, help="the same, as layers per virtual stage")
    g.add_argument(
        "--recompute-granularity", dest="recompute", choices=[*RECOMPUTE_CHOICES, "search"]
    )
    g.add_argument("--recompute-method", choices=RECOMPUTE_METHODS,
                   help="full recompute: uniform or block (default: searched)")
    g.add_argument("--recompute-num-layers", type=int,
                   help="full recompute: layers per group (uniform) or per chunk (block)")
    sp = g.add_mutually_exclusive_group()
    sp.add_argument(
        "--sequence-parallel", dest="sequence_parallel", action="store_const", const=True
    )
    sp.add_argument(
        "--no-sequence-parallel", dest="sequence_parallel", action="store_const", const=False
    )
    do = g.add_mutually_exclusive_group()
    do.add_argument("--use-distributed-optimizer", dest="use_distributed_optimizer",
                    action="store_const", const=True,
                    help="shard the optimizer state over data parallel (default: on where dp > 1)")
    do.add_argument("--no-use-distributed-optimizer", dest="use_distributed_optimizer",
                    action="store_const", const=False)
    g = parser.add_argument_group("teacher parallelism (N or 'search')")
    g.add_argument("--kd-teacher-tensor-model-parallel-size", dest="teacher_tp", type=_size)
    g.add_argument("--kd-teacher-pipeline-model-parallel-size", dest="teacher_pp", type=_size)
    g.add_argument("--kd-teacher-expert-model-parallel-size", dest="teacher_ep", type=_size)
    _add_distillation_arguments(parser)
    g = parser.add_argument_group("assumptions")
    g.add_argument("--mfu", type=float,
                   help=f"student training MFU (default {_default('mfu'):.2f})")
    g.add_argument("--teacher-mfu", type=float,
                   help=f"teacher forward MFU (default {_default('teacher_mfu'):.2f})")
    g.add_argument("--link-efficiency", type=float,
                   help=f"achieved / line rate (default {_default('link_efficiency'):g})")
    g.add_argument("--reserve-gib", type=float, help=f"per-GPU reserve: context, NCCL, "
                   f"fragmentation (default {_default('reserve_bytes') / GIB:g})")
    g.add_argument("--headroom", type=float,
                   help=f"fraction of each GPU's memory left free on top of the reserve "
                   f"(default {_default('headroom'):g})")
    g = parser.add_argument_group("output")
    g.add_argument("--from-args", "--launch-args", dest="from_args",
                   help="a Megatron-LM launch's own arguments, quoted as one string")
    g.add_argument("--json", action="store_true", help="print JSON instead of tables")


def _add_distillation_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("distillation")
    g.add_argument(
        "--kd-window-size",
        dest="window_size",
        type=int,
        help="fused-loss rows per window, at most (default: as many as the GPU path's "
             "--kd-loss-window-mib holds)",
    )
    g.add_argument("--kd-loss-window-mib", dest="loss_window_mib", type=_positive_mib,
                   help=f"the fused loss's bound on one window's logits on a GPU, in MiB "
                        f"(default {_default('loss_window_bytes') >> 20})")
    g.add_argument("--kd-loss-weight-grad", dest="loss_weight_grad", choices=WEIGHT_GRADS,
                   help=f"the fused loss's output-layer weight-gradient accumulator on a GPU "
                        f"(default {_default('loss_weight_grad')}; input_dtype: half its "
                        f"memory)")
    for name in ("prefetch_depth", "topk"):
        _add_shared(g, name)
    g.add_argument("--kd-cache-entry-bytes", dest="cache_entry_bytes", type=float,
                   help="bytes per cached entry on storage, a token's share included (default: "
                        "what cache build's default encoding takes for the teacher's vocabulary, "
                        "about 2.9 at K = 100)")
    g.add_argument(
        "--kd-teacher-replicas",
        dest="teacher_replicas",
        type=int,
        help="disaggregated: plan with this many teacher replicas (default: as many as needed)",
    )
    _add_shared(g, "wire_dtype", default=_default("wire_dtype"))
    g.add_argument("--modes", help=f"comma-separated subset of {','.join(m.value for m in Mode)}")
    g.add_argument("--kd-mode", dest="teacher_modes", nargs="+", choices=tuple(TEACHER_MODES),
                   help="several --teacher: one mode per teacher, as `megatron-kd train` takes "
                        "it (colocated: the fused loss's colocated mode)")
    g.add_argument("--kd-teacher-weights", dest="teacher_weights", nargs="+", type=float,
                   metavar="W", help="several --teacher: one weight per teacher (default: "
                                     "equal), written into the launch line")


class _OneOrSeveral(argparse.Action):
    """``nargs="+"``: one value stored as it is (a one-teacher command's namespace is what it
    always was), several as a list."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values[0] if len(values) == 1 else list(values))


def _add_shared(group, name: str, *, default=None) -> None:
    """A ``--kd-*`` flag other commands take too, as they declare it
    (:class:`~megatron_kd.flags.KDSharedFlags`: its name, type, help and choices; the default
    :class:`PlanOptions` takes unless ``default``), with ``dest`` the :class:`PlanOptions`
    field; None when not given (``--from-args`` may give it)."""
    spec = flag_spec(KDSharedFlags, name)
    shared = default_of(KDSharedFlags, name)
    group.add_argument(spec.option(name), dest=name,
                       type=spec.type or (str if shared is None else type(shared)),
                       choices=spec.choices,
                       help=f"{spec.help} (default {shared if default is None else default})")


def build_options(args: argparse.Namespace) -> tuple[PlanOptions, list[str]]:
    """:class:`PlanOptions` from parsed options (and ``--from-args``); also the ignored launch
    flags. What neither gives is left to :class:`PlanOptions`' defaults."""
    values: dict = {}
    student = None
    ignored: list[str] = []
    if args.from_args:
        launch = parse_launch_args(args.from_args)
        values.update(launch.values)
        student = launch.student
        ignored = launch.ignored
        if student is not None and args.student:
            raise ValueError(
                "--student given and --from-args also describes a model; give one of them"
            )
    for key, value in vars(args).items():
        if value is not None and key not in ("from_args", "json", "modes", "teacher_modes",
                                             "teacher_weights"):
            values[key] = value
    _command_line_wins(args, values)
    if student is None:
        if not values.get("student"):
            raise ValueError(
                "no student: pass --student NAME|config.json or a model in --from-args"
            )
        student = load_model(values["student"])
    if not values.get("teacher"):
        raise ValueError("no teacher: pass --teacher NAME|config.json")
    teacher = load_model(values["teacher"])
    gpu = get_gpu(values.get("gpu", DEFAULT_GPU))

    def size(key: str) -> int | None:
        value = values.get(key)
        return None if value in (None, "search") else value

    given = {key: values[key] for key in _AS_GIVEN if values.get(key) is not None}
    if "loss_window_mib" in values:
        given["loss_window_bytes"] = int(values["loss_window_mib"] * (1 << 20))
    if "reserve_gib" in values:
        given["reserve_bytes"] = int(values["reserve_gib"] * GIB)
    if student.is_moe and "etp" in values:
        given["etp"] = values["etp"]
    if "grad_bytes" in values:
        given["precision"] = Precision(grad_bytes=values["grad_bytes"])
    if "hidden_dropout" in values:
        given["activation"] = ActivationOptions(hidden_dropout=bool(values["hidden_dropout"]))
    recompute = values.get("recompute")
    given.update({k: values[k] for k in ("layers_per_virtual_stage", "recompute_method",
                                         "recompute_num_layers") if values.get(k) is not None})
    opts = PlanOptions(
        student=student,
        teacher=teacher,
        gpu=gpu,
        inter_node_link=get_link(values.get("inter_node_link", DEFAULT_LINK), gpu),
        tp=size("tp"),
        pp=size("pp"),
        vp=size("vp"),
        cp=size("cp"),
        ep=size("ep") if student.is_moe else None,
        recompute=None if recompute in (None, "search") else recompute,
        teacher_tp=size("teacher_tp"),
        teacher_pp=size("teacher_pp"),
        teacher_ep=size("teacher_ep") if teacher.is_moe else None,
        **given,
    )
    return opts, ignored


def _command_line_wins(args: argparse.Namespace, values: dict) -> None:
    """Drop what ``--from-args`` set that contradicts the command line's own options: a virtual
    pipeline given the other way, a recompute method or layer count under another granularity."""
    for given, other in (("vp", "layers_per_virtual_stage"), ("layers_per_virtual_stage", "vp")):
        if getattr(args, given) is not None and getattr(args, other) is None:
            values.pop(other, None)
    if args.recompute is not None:
        for key in ("recompute_method", "recompute_num_layers"):
            if getattr(args, key) is None:
                values.pop(key, None)


def _parse_modes(text: str | None) -> tuple[Mode, ...]:
    names = tuple(m.value for m in Mode)
    if not text:
        return tuple(Mode)
    modes = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in modes if m not in names]
    if bad or not modes:
        raise ValueError(f"--modes: unknown {bad or text!r}; choose from {names}")
    return tuple(m for m in Mode if m.value in modes)


def _layout_line(layout: ParallelLayout, prefix: str) -> str:
    return (
        f"{prefix}: tp={layout.tp} pp={layout.pp} vp={layout.vp}"
        + (f" cp={layout.cp} ({layout.cp_comm_type})" if layout.cp > 1 else "")
        + f" dp={layout.dp} ep={layout.ep} "
        f"sp={'on' if layout.sequence_parallel else 'off'} recompute={layout.recompute_label} "
        f"dist-opt={'on' if layout.use_distributed_optimizer else 'off'}"
    )


def format_plan(plan: ModePlan, opts: PlanOptions) -> str:
    """One mode's table."""
    lines = [f"== {plan.mode.value}: {plan.verdict}"]
    lines.append(
        "   " + _layout_line(plan.layout, "student") + f" (worst pipeline stage {plan.worst_stage})"
    )
    tl = plan.teacher_layout
    if plan.mode.colocated and tl:
        lines.append(f"   teacher (colocated, same tp/pp): ep={tl.ep}")
    elif plan.mode is Mode.DISAGGREGATED and tl:
        lines.append(
            f"   teacher replica: tp={tl.tp} pp={tl.pp} dp={tl.dp} ep={tl.ep} "
            f"({tl.tp * tl.pp * tl.dp} GPUs) x {plan.teacher_replicas} replica(s) = "
            f"{plan.teacher_gpus} GPUs on {plan.teacher_nodes} node(s)"
        )
    lines.append(f"   {'per-GPU memory term':<40}{'GiB':>9}")
    for term, value in plan.terms.items():
        lines.append(f"   {term.label:<40}{value / GIB:>9.2f}")
    status = "fits" if plan.fits else "OOM"
    lines.append(
        f"   {'total':<40}{plan.total_bytes / GIB:>9.2f}  of {plan.usable_bytes / GIB:.1f} "
        f"({opts.gpu.name}'s {plan.capacity_bytes / GIB:.1f} less {opts.headroom:.0%} "
        f"headroom): {status}"
    )
    phases = [phase for phase in PHASES if any(plan.terms.get(t) for t in phase)]
    if len(phases) > 1:
        lines.append("   (the teacher's forward and the attention backward never overlap: the "
                     "total counts the larger)")
    if plan.teacher_terms:
        total = total_bytes(plan.teacher_terms)
        parts = ", ".join(f"{t.label} {v / GIB:.2f}" for t, v in plan.teacher_terms.items())
        lines.append(f"   teacher GPU: {total / GIB:.2f} GiB ({parts})")
    lines.append(
        f"   step {plan.step_time_s:.2f} s at MFU {opts.mfu:.2f} (pipeline bubble "
        f"{plan.bubble:.1%}): "
        f"{plan.student_tokens_per_s:,.0f} student tokens/s on {plan.student_gpus} GPUs; "
        f"teacher nodes needed: {plan.teacher_nodes}"
    )
    for figure, value in plan.wire.items():
        text = (
            f"{value:,.0f}" if float(value).is_integer() or abs(value) >= 1000 else f"{value:.3g}"
        )
        lines.append(f"   {figure.label:<48}{text:>18}")
    if plan.mode is Mode.DISAGGREGATED:
        lines.append(
            f"   wire: {'keeps up' if plan.wire_ok else 'TOO SLOW: the student would stall'} "
            f"({opts.inter_node_link.name} x {opts.link_efficiency})"
        )
    for note in plan.notes:
        lines.append(f"   note: {note}")
    for lever in plan.levers:
        lines.append(f"   why: {lever}")
    start = launch(opts, plan)
    if start is not None:
        lines += [f"   {line}" for line in start.lines()]
    return "\n".join(lines)


def format_options(mode: Mode, rows: list[LayoutOption]) -> str:
    """The "what the options buy" table of ``mode``'s chosen student layout."""
    chosen = rows[0]
    title = (f"what the options buy ({mode.value} student; one change to the chosen layout at a "
             f"time; the step time counts the pipeline bubble; the TP collectives, the "
             f"pipeline's p2p sends and context parallelism's K/V exchange are their time at "
             f"link speed, not in the step):")
    header = (f"   {'option':<44}{'peak GiB':>9}{'Δ GiB':>8}{'step s':>8}{'Δ step':>8}"
              f"{'bubble':>8}{'TP s':>7}{'p2p s':>7}{'CP s':>7}  fits")
    lines = [title, header]
    for row in rows:
        # (+ 0.0: a saving that rounds to nothing prints as +0.0, not -0.0)
        delta_gib = ("" if row is chosen
                     else f"{round((row.total_bytes - chosen.total_bytes) / GIB, 1) + 0.0:+.1f}")
        delta_step = ("" if row is chosen
                      else f"{row.step_time_s / chosen.step_time_s - 1:+.1%}")
        lines.append(
            f"   {row.label:<44}{row.total_bytes / GIB:>9.1f}{delta_gib:>8}"
            f"{row.step_time_s:>8.2f}{delta_step:>8}{row.bubble:>8.1%}"
            f"{row.tp_collective_s:>7.2f}{row.p2p_s:>7.2f}{row.cp_exchange_s:>7.2f}  "
            f"{'yes' if row.fits else 'OOM'}"
        )
    return "\n".join(lines)


def report_options(result: PlanResult, opts: PlanOptions) -> tuple[Mode, list[LayoutOption]] | None:
    """The recommended mode and its layout options (None when nothing fits)."""
    mode = result.recommended_mode
    if mode is None:
        return None
    return mode, layout_options(opts, result.plans[mode])


def format_report(
    result: PlanResult,
    opts: PlanOptions,
    ignored: list[str],
    options: tuple[Mode, list[LayoutOption]] | None = None,
) -> str:
    window = _window_text(opts)
    head = (
        f"plan: teacher {opts.teacher.name} ({opts.teacher.total_params() / 1e9:.1f}B) -> student "
        f"{opts.student.name} ({opts.student.total_params() / 1e9:.1f}B) on {opts.nodes} x "
        f"{opts.gpus_per_node} {opts.gpu.name}; s={opts.seq_length} b={opts.micro_batch_size} "
        f"G={opts.global_batch_size}; window {window}, ring D={opts.prefetch_depth}, "
        f"top-K {opts.topk}"
    )
    parts = [head]
    if ignored:
        parts.append(f"ignored launch flags: {' '.join(ignored)}")
    parts += [format_plan(p, opts) for p in result.plans.values()]
    parts.append(f"recommendation: {result.recommendation}")
    if options is not None:
        parts.append(format_options(*options))
    return "\n\n".join(parts)


def _window_text(opts: PlanOptions) -> str:
    """The fused loss's windows as planned, for the report's first line."""
    rows = f"<= {opts.window_size} rows" if opts.window_size is not None else None
    if opts.gpu_loss is None:
        return rows or "default (64 MiB fp32)"
    gpu = (f"<= {opts.loss_window_bytes / (1 << 20):g} MiB of logits (GPU path), weight grad "
           f"{opts.loss_weight_grad}")
    return f"{rows}, {gpu}" if rows else gpu


def to_json(
    result: PlanResult,
    opts: PlanOptions,
    ignored: list[str],
    options: tuple[Mode, list[LayoutOption]] | None = None,
) -> dict:
    return {
        "teacher": opts.teacher.to_dict(),
        "student": opts.student.to_dict(),
        "gpu": asdict(opts.gpu),
        "inter_node_link": asdict(opts.inter_node_link),
        "inputs": {
            k: getattr(opts, k)
            for k in (
                "gpus_per_node", "nodes", "seq_length", "micro_batch_size",
                "global_batch_size", "tp", "pp", "vp", "layers_per_virtual_stage", "cp",
                "cp_comm_type", "ep", "etp",
                "recompute", "recompute_method", "recompute_num_layers", "sequence_parallel",
                "use_distributed_optimizer", "teacher_tp", "teacher_pp", "teacher_ep",
                "window_size", "loss_path", "loss_window_bytes", "loss_weight_grad",
                "prefetch_depth", "topk", "cache_entry_bytes",
            )
        },
        "assumptions": {
            "mfu": opts.mfu,
            "teacher_mfu": opts.teacher_mfu,
            "link_efficiency": opts.link_efficiency,
            "reserve_bytes": opts.reserve_bytes,
            "headroom": opts.headroom,
            "precision": asdict(opts.precision),
            "activation": asdict(opts.activation),
        },
        "ignored_launch_flags": ignored,
        "plans": {m.value: {**p.to_dict(), "launch": _launch_dict(opts, p)}
                  for m, p in result.plans.items()},
        "recommendation": result.recommendation,
        "options": None if options is None else {
            "mode": options[0].value,
            "rows": [row.to_dict() for row in options[1]],
        },
    }


def _launch_dict(opts: PlanOptions, plan: ModePlan) -> dict | None:
    start = launch(opts, plan)
    return None if start is None else start.to_dict()


def run(args: argparse.Namespace) -> int:
    if isinstance(args.teacher, list) or args.teacher_modes or args.teacher_weights:
        return _run_mixture(args)
    try:
        opts, ignored = build_options(args)
        result = plan_all(opts, _parse_modes(args.modes))
        options = report_options(result, opts)
    except ValueError as exc:
        print(f"megatron-kd plan: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(to_json(result, opts, ignored, options), indent=2))
    else:
        print(format_report(result, opts, ignored, options))
    return 0


# --- several teachers ------------------------------------------------------------------------


def build_mixture(args: argparse.Namespace) -> tuple[MixtureOptions, list[str]]:
    """:class:`~megatron_kd.planner.mixture.MixtureOptions` from parsed options: several
    ``--teacher`` with one ``--kd-mode`` each; the other options as one teacher's."""
    names = args.teacher if isinstance(args.teacher, list) else [args.teacher]
    if len(names) < 2 or names[0] is None:
        given = [flag for flag, value in (("--kd-mode", args.teacher_modes),
                                          ("--kd-teacher-weights", args.teacher_weights))
                 if value]
        raise ValueError(f"{' and '.join(given)} with one teacher: they are for several "
                         f"--teacher (a mixture); one teacher's modes are chosen with --modes")
    if not args.teacher_modes:
        raise ValueError(f"{len(names)} teachers and no --kd-mode: give one mode per teacher "
                         f"({' | '.join(TEACHER_MODES)}), in --teacher's order")
    if args.modes:
        raise ValueError(f"--modes {args.modes} with several teachers: each teacher's mode is "
                         f"its --kd-mode")
    one = argparse.Namespace(**{**vars(args), "teacher": names[0]})
    opts, ignored = build_options(one)
    teachers = (opts.teacher, *(load_model(name) for name in names[1:]))
    return MixtureOptions(base=opts, teachers=teachers, modes=tuple(args.teacher_modes),
                          weights=args.teacher_weights), ignored


def _run_mixture(args: argparse.Namespace) -> int:
    try:
        mopts, ignored = build_mixture(args)
        plan = plan_mixture(mopts)
        start = mixture_launch(mopts, plan)
    except ValueError as exc:
        print(f"megatron-kd plan: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(mixture_to_json(mopts, plan, ignored, start), indent=2))
    else:
        print(format_mixture(mopts, plan, ignored, start))
    return 0


def _teacher_summary(plan: TeacherPlan, opts: PlanOptions) -> str:
    """A teacher's row of the teachers' table: where it runs and what it costs."""
    if plan.mode == "colocated":
        return "in the student's groups (forwards one at a time)"
    if plan.mode == "disaggregated":
        tl = plan.teacher_layout
        rate = plan.wire.get(Traffic.HIDDEN_RATE_STUDENT, 0.0)
        return (f"{plan.replicas} x (tp={tl.tp} pp={tl.pp} dp={tl.dp} ep={tl.ep}) = "
                f"{plan.gpus} GPU(s) on {plan.nodes} node(s), "
                f"{mem.total_bytes(plan.teacher_terms) / GIB:.2f} GiB a GPU"
                f"{'' if plan.fits else ' (OOM)'}; hidden "
                f"{plan.wire.get(Traffic.HIDDEN_BYTES_PER_DP_RANK, 0.0):,.0f} B/step/DP rank, "
                f"{rate:.3g} GB/s a student GPU: "
                f"{'keeps up' if plan.wire_ok else 'TOO SLOW'}")
    return (f"cache {plan.wire[Traffic.CACHE_SIZE]:,.0f} GB per 1B tokens (top-K {opts.topk}), "
            f"read {plan.wire[Traffic.CACHE_READ_RATE]:.3g} GB/s a DP rank, build "
            f"{plan.wire[Traffic.CACHE_BUILD_GPU_HOURS]:,.0f} GPU-hours per 1B tokens")


def format_mixture(mopts: MixtureOptions, plan: MixturePlan, ignored: list[str],
                   start: MixtureLaunch) -> str:
    """The text report of a mixture's plan."""
    opts = mopts.base
    teachers = ", ".join(f"{t.name} ({t.total_params() / 1e9:.1f}B, {mode}, weight {w:.3g})"
                         for t, mode, w in zip(mopts.teachers, mopts.modes,
                                               mopts.normalized_weights))
    head = (f"plan: {len(mopts.teachers)} teachers {teachers} -> student {opts.student.name} "
            f"({opts.student.total_params() / 1e9:.1f}B) on {opts.nodes} x {opts.gpus_per_node} "
            f"{opts.gpu.name}; s={opts.seq_length} b={opts.micro_batch_size} "
            f"G={opts.global_batch_size}; window {_window_text(opts)}, ring "
            f"D={opts.prefetch_depth}, top-K {opts.topk}")
    parts = [head]
    if ignored:
        parts.append(f"ignored launch flags: {' '.join(ignored)}")
    lines = [f"== mixture of {len(mopts.teachers)} teachers: {plan.verdict}",
             "   " + _layout_line(plan.layout, "student")
             + f" (worst pipeline stage {plan.worst_stage})",
             f"   {'per-GPU memory term':<40}{'GiB':>9}"]
    for term, value in plan.terms.items():
        if term is not Term.RESERVE:
            label = term.label + (" (largest call)" if term in CALL_WORKING else "")
            lines.append(f"   {label:<40}{value / GIB:>9.2f}")
    for teacher in plan.teachers:
        for term, value in teacher.terms.items():
            lines.append(f"   {f'[{teacher.index}] {term.label}':<40}{value / GIB:>9.2f}")
    lines.append(f"   {Term.RESERVE.label:<40}{plan.terms[Term.RESERVE] / GIB:>9.2f}")
    status = "fits" if plan.total_bytes <= plan.usable_bytes else "OOM"
    lines.append(
        f"   {'total':<40}{plan.total_bytes / GIB:>9.2f}  of {plan.usable_bytes / GIB:.1f} "
        f"({opts.gpu.name}'s {plan.capacity_bytes / GIB:.1f} less {opts.headroom:.0%} "
        f"headroom): {status}")
    lines.append("   (the loss runs once per teacher: each call's window buffers are freed "
                 "before the next, its gradients kept for the backward; the colocated "
                 "teachers' forwards run one at a time, never with the attention backward: "
                 "the total counts the largest)")
    lines.append(
        f"   step {plan.step_time_s:.2f} s at MFU {opts.mfu:.2f} (pipeline bubble "
        f"{plan.bubble:.1%}): {plan.student_tokens_per_s:,.0f} student tokens/s on "
        f"{plan.student_gpus} GPUs")
    lines.append(f"   {'teacher':<24}{'mode':<15}{'weight':>7}{'GiB/GPU':>9}  runs / costs")
    for t in plan.teachers:
        name = f"[{t.index}] {t.name}"
        lines.append(f"   {name:<24}{t.mode:<15}{t.weight:>7.3g}{t.student_bytes / GIB:>9.2f}  "
                     f"{_teacher_summary(t, opts)}")
    for note in (*plan.notes, *(f"teacher {t.index}: {n}" for t in plan.teachers
                                for n in t.notes)):
        lines.append(f"   note: {note}")
    lines += [f"   {line}" for line in start.lines()]
    parts.append("\n".join(lines))
    return "\n\n".join(parts)


def mixture_to_json(mopts: MixtureOptions, plan: MixturePlan, ignored: list[str],
                    start: MixtureLaunch) -> dict:
    opts = mopts.base
    return {
        "teachers": [{**t.to_dict(), "kd_mode": mode}
                     for t, mode in zip(mopts.teachers, mopts.modes)],
        "teacher_weights": mopts.weights,
        "student": opts.student.to_dict(),
        "gpu": asdict(opts.gpu),
        "inter_node_link": asdict(opts.inter_node_link),
        "ignored_launch_flags": ignored,
        "mixture": {**plan.to_dict(), "launch": start.to_dict()},
    }


# --- --from-args: a Megatron-LM launch line -----------------------------------------------

_MODEL_FLAGS = ("num_layers", "hidden_size", "num_attention_heads")

#: Launch flags (argparse ``dest``) read into planner inputs of another name.
_RENAMED = {
    "tensor_model_parallel_size": "tp",
    "pipeline_model_parallel_size": "pp",
    "expert_model_parallel_size": "ep",
    "expert_tensor_parallel_size": "etp",
    "context_parallel_size": "cp",
    "num_layers_per_virtual_pipeline_stage": "layers_per_virtual_stage",
    "kd_teacher_tensor_model_parallel_size": "teacher_tp",
    "kd_teacher_pipeline_model_parallel_size": "teacher_pp",
    "kd_teacher_expert_model_parallel_size": "teacher_ep",
    "kd_window_size": "window_size",
    "kd_prefetch_depth": "prefetch_depth",
    "kd_topk": "topk",
    "kd_wire_dtype": "wire_dtype",
    "kd_loss_window_mib": "loss_window_mib",
    "kd_loss_weight_grad": "loss_weight_grad",
}


@dataclass(kw_only=True)
class LaunchArgs:
    """What a Megatron launch line says, as far as the planner is concerned."""

    student: PlannedModel | None = None
    """The model the launch builds, when its shape flags are present (``--num-layers`` ...)."""

    values: dict = field(default_factory=dict)
    """Planner inputs read from the launch, keyed like the ``megatron-kd plan`` options'
    ``dest``."""

    ignored: list[str] = field(default_factory=list)
    """Flags present in the launch that the planner does not use."""


def _parser() -> argparse.ArgumentParser:
    """The launch flags the planner reads besides the model's (those are
    :func:`~megatron_kd.arch.megatron_lm_args.read_megatron_lm_flags`'; the others end up in
    ``LaunchArgs.ignored``)."""
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    for name in (
        "seq-length", "micro-batch-size",
        "global-batch-size", "tensor-model-parallel-size", "pipeline-model-parallel-size",
        "expert-model-parallel-size", "expert-tensor-parallel-size", "context-parallel-size",
        "num-layers-per-virtual-pipeline-stage", "virtual-pipeline-model-parallel-size",
        "num-virtual-stages-per-pipeline-rank", "microbatch-group-size-per-virtual-pipeline-stage",
        "recompute-num-layers",
        "kd-teacher-tensor-model-parallel-size", "kd-teacher-pipeline-model-parallel-size",
        "kd-teacher-expert-model-parallel-size", "kd-window-size", "kd-prefetch-depth", "kd-topk",
    ):
        p.add_argument(f"--{name}", type=int, default=None)
    for name in ("hidden-dropout", "attention-dropout"):
        p.add_argument(f"--{name}", type=float, default=None)
    p.add_argument("--kd-wire-dtype", choices=flag_spec(KDSharedFlags, "wire_dtype").choices,
                   default=None)
    p.add_argument("--kd-loss-window-mib", type=_positive_mib, default=None)
    p.add_argument("--kd-loss-weight-grad", choices=WEIGHT_GRADS, default=None)
    # Megatron-LM: one type, or one per layer
    p.add_argument("--cp-comm-type", nargs="+", default=None)
    for name in ("recompute-granularity", "recompute-method"):
        p.add_argument(f"--{name}", default=None)
    # one value or several (a mixture of teachers: refused by name, not dropped)
    p.add_argument("--kd-teacher-load", nargs="+", default=None)
    for name in (
        "sequence-parallel", "use-distributed-optimizer", "grad-reduce-in-bf16", "bf16", "fp16",
    ):
        p.add_argument(f"--{name}", action="store_true", default=False)
    return p


def parse_launch_args(text: str) -> LaunchArgs:
    """Parse a Megatron launch's argument string (shell quoting allowed): the model flags by
    the one Megatron-LM flag reader (:mod:`megatron_kd.arch.megatron_lm_args`), the layout and
    the batch here.

    Raises ``ValueError`` for settings the planner does not model and for an incomplete model.
    """
    tokens = shlex.split(text)
    try:
        ns, rest = _parser().parse_known_args(tokens)
    except SystemExit as exc:  # argparse's way of saying a value was malformed
        raise ValueError(f"--from-args: cannot parse {text!r}") from exc
    model_flags, not_model = read_megatron_lm_flags(tokens)
    out = LaunchArgs(ignored=[tok for tok in rest
                              if tok.startswith("--") and tok in set(not_model)])
    _refuse_unmodelled(ns)
    out.values.update(_planner_values(ns))
    recompute, unused = _recompute(ns)
    out.values.update(recompute)
    out.ignored += unused
    out.student = _student_model(model_flags, ns.seq_length)
    return out


def _refuse_unmodelled(ns: argparse.Namespace) -> None:
    """Raise ``ValueError`` for launch settings the planner does not model."""
    if ns.cp_comm_type is not None:
        kinds = set(ns.cp_comm_type)
        if len(kinds) > 1:
            raise ValueError(
                f"--cp-comm-type {' '.join(ns.cp_comm_type)}: the planner models one exchange "
                f"for every layer"
            )
        if not kinds <= set(CP_COMM_TYPES):
            raise ValueError(
                f"--cp-comm-type={ns.cp_comm_type[0]!r}: the planner models "
                f"{', '.join(CP_COMM_TYPES)} (a2a+p2p is not modelled)"
            )
    pp = ns.pipeline_model_parallel_size or 1
    group = ns.microbatch_group_size_per_virtual_pipeline_stage
    if group is not None and group != pp:
        raise ValueError(
            f"--microbatch-group-size-per-virtual-pipeline-stage={group}: the planner models "
            f"Megatron-Core's default group of pipeline-model-parallel-size ({pp}) micro-batches"
        )
    virtual = [f"--{name}={value}" for name, value in (
        ("num-layers-per-virtual-pipeline-stage", ns.num_layers_per_virtual_pipeline_stage),
        ("num-virtual-stages-per-pipeline-rank", ns.num_virtual_stages_per_pipeline_rank),
        ("virtual-pipeline-model-parallel-size", ns.virtual_pipeline_model_parallel_size),
    ) if value is not None]
    if len(virtual) > 1:
        raise ValueError(f"{' and '.join(virtual)}: give the virtual pipeline one way")
    stages = ns.num_virtual_stages_per_pipeline_rank or ns.virtual_pipeline_model_parallel_size
    if stages == 1 and pp > 1:
        raise ValueError(
            f"{virtual[0]}: Megatron-Core runs one chunk per rank through its interleaved "
            f"schedule (2p - 1 micro-batches in flight on the first stage), which the planner "
            f"does not model; leave the flag out for 1F1B"
        )
    if ns.fp16 and ns.bf16:
        raise ValueError("--fp16 and --bf16 both given")


def _planner_values(ns: argparse.Namespace) -> dict:
    """The planner inputs the launch sets, with Megatron's defaults for what it leaves out."""
    v = {}
    for key in ("seq_length", "micro_batch_size", "global_batch_size"):
        if getattr(ns, key) is not None:
            v[key] = getattr(ns, key)
    for src, dst in _RENAMED.items():
        if getattr(ns, src) is not None:
            v[dst] = getattr(ns, src)
    # Megatron defaults for what the launch leaves out
    v.setdefault("tp", 1)
    v.setdefault("pp", 1)
    v.setdefault("cp", 1)
    if ns.cp_comm_type is not None:
        v["cp_comm_type"] = ns.cp_comm_type[0]
    if "etp" not in v:
        # Megatron: expert_tensor_parallel_size defaults to tensor_model_parallel_size
        v["etp"] = v["tp"]
    stages = ns.num_virtual_stages_per_pipeline_rank or ns.virtual_pipeline_model_parallel_size
    if stages is not None:
        v["vp"] = stages
    v["sequence_parallel"] = ns.sequence_parallel
    v["use_distributed_optimizer"] = ns.use_distributed_optimizer
    if ns.grad_reduce_in_bf16:
        v["grad_bytes"] = 2
    hidden_dropout = 0.1 if ns.hidden_dropout is None else ns.hidden_dropout
    v["hidden_dropout"] = hidden_dropout > 0
    if ns.kd_teacher_load is not None and len(ns.kd_teacher_load) > 1:
        raise ValueError(f"--from-args with --kd-teacher-load {' '.join(ns.kd_teacher_load)}: "
                         f"a launch of several teachers is planned from --teacher A B ... "
                         f"--kd-mode M N ..., not read from its launch line")
    if ns.kd_teacher_load is not None:
        # a megatron_kd checkpoint directory (or a preset / config)
        v["teacher"] = ns.kd_teacher_load[0]
    return v


def _recompute(ns: argparse.Namespace) -> tuple[dict, list[str]]:
    """The planner's recompute settings for the launch's, and the recompute flags the launch gives
    that Megatron-Core does not use; ``ValueError`` where Megatron-Core refuses the launch
    (``TransformerConfig.__post_init__``, 0.16.1)."""
    method, layers = ns.recompute_method, ns.recompute_num_layers
    if method is not None and method not in RECOMPUTE_METHODS:
        raise ValueError(f"--recompute-method={method!r}: expected uniform or block")
    given = [flag for flag, value in (("--recompute-method", method),
                                      ("--recompute-num-layers", layers)) if value is not None]
    if ns.recompute_granularity is None:
        return {"recompute": "none"}, given  # Megatron-Core reads them only with a granularity
    if ns.recompute_granularity == "selective":
        if layers is not None:
            raise ValueError(
                f"--recompute-granularity selective --recompute-num-layers={layers}: Megatron-"
                f"Core refuses a layer count with selective recompute"
            )
        return {"recompute": "selective"}, given
    if ns.recompute_granularity == "full":
        if method is None or layers is None:
            raise ValueError(
                f"--recompute-granularity full needs --recompute-method (uniform or block) and "
                f"--recompute-num-layers (Megatron-Core refuses full recompute without them); got "
                f"method={method}, num-layers={layers}"
            )
        if layers <= 0:
            raise ValueError(f"--recompute-num-layers={layers}: expected >= 1")
        return {"recompute": "full", "recompute_method": method,
                "recompute_num_layers": layers}, []
    raise ValueError(
        f"--recompute-granularity={ns.recompute_granularity!r}: expected full or selective"
    )


def _student_model(flags: argparse.Namespace, seq_length: int | None) -> PlannedModel | None:
    """The model the launch builds (its model flags, read as Megatron-LM reads them), or None
    without shape flags; ``ValueError`` when incomplete."""
    given = [k for k in _MODEL_FLAGS if getattr(flags, k) is not None]
    if not given:
        return None
    missing = [k for k in _MODEL_FLAGS + ("vocab_size",) if getattr(flags, k) is None]
    if missing:
        names = ", ".join("--" + m.replace("_", "-") for m in missing)
        raise ValueError(f"--from-args describes a model but lacks {names}")
    if flags.max_position_embeddings is None:
        # Megatron-LM builds for --seq-length then (the planner counts no position embedding)
        flags.max_position_embeddings = seq_length or _default("seq_length")
    arch = arch_from_megatron_lm_args(complete_megatron_lm_flags(flags, what="--from-args"))
    return PlannedModel(name="from-args", arch=arch, source="Megatron-LM launch arguments")
