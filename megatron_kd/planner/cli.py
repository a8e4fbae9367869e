"""``megatron-kd plan``: per-GPU memory, time and traffic of each distillation mode.

Examples::

    megatron-kd plan --teacher qwen3.5-35b-a3b --student qwen3.5-9b --gpu h200-141g \\
        --nodes 1 --seq-length 8192 --global-batch-size 64 --use-distributed-optimizer
    megatron-kd plan --teacher qwen3-235b-a22b \\
        --from-args "--num-layers 64 ... --tensor-model-parallel-size 8" --json

Precedence: an option given on this command line wins over the same setting read from
``--from-args``, which wins over the defaults. A parallel size left out (or ``search``) is searched.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict

from megatron_kd.planner.launch_args import parse_launch_args
from megatron_kd.planner.memory import ActivationOptions, Precision
from megatron_kd.planner.plan import GIB, MODES, PlanOptions, plan_all
from megatron_kd.planner.presets import GPU_PRESETS, LINK_PRESETS, get_gpu, get_link, load_model

_DEFAULTS = {
    "gpu": "h100-80g",
    "gpus_per_node": 8,
    "nodes": 1,
    "seq_length": 4096,
    "micro_batch_size": 1,
    "global_batch_size": 128,
    "window_size": None,
    "prefetch_depth": 2,
    "topk": 64,
    "cache_entry_bytes": 6,
    "wire_dtype": "bf16",
    "inter_node_link": "ib-400g",
    "mfu": 0.40,
    "teacher_mfu": 0.40,
    "link_efficiency": 0.8,
    "reserve_gib": 4.0,
    "etp": 1,
}


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
        "--teacher", help="preset name, a Hugging Face config.json or a megatron_kd checkpoint dir"
    )
    g.add_argument("--student", help="the same kinds as --teacher (or the model of --from-args)")
    g.add_argument("--gpu", choices=sorted(GPU_PRESETS), help=f"default {_DEFAULTS['gpu']}")
    g.add_argument("--gpus-per-node", type=int, help="default 8")
    g.add_argument(
        "--nodes", type=int, help="student nodes, default 1 (teacher nodes are computed)"
    )
    g.add_argument(
        "--inter-node-link",
        choices=["nvlink", *sorted(LINK_PRESETS)],
        help="per-GPU link between nodes (default ib-400g)",
    )
    g = parser.add_argument_group("batch")
    g.add_argument("--seq-length", type=int, help="default 4096")
    g.add_argument("--micro-batch-size", type=int, help="default 1")
    g.add_argument("--global-batch-size", type=int, help="default 128")
    g = parser.add_argument_group("student parallelism (N or 'search')")
    g.add_argument("--tensor-model-parallel-size", dest="tp", type=_size)
    g.add_argument("--pipeline-model-parallel-size", dest="pp", type=_size)
    g.add_argument("--expert-model-parallel-size", dest="ep", type=_size)
    g.add_argument("--expert-tensor-parallel-size", dest="etp", type=int)
    g.add_argument(
        "--recompute-granularity", dest="recompute", choices=["none", "selective", "full", "search"]
    )
    sp = g.add_mutually_exclusive_group()
    sp.add_argument(
        "--sequence-parallel", dest="sequence_parallel", action="store_const", const=True
    )
    sp.add_argument(
        "--no-sequence-parallel", dest="sequence_parallel", action="store_const", const=False
    )
    g.add_argument("--use-distributed-optimizer", action="store_const", const=True)
    g = parser.add_argument_group("teacher parallelism (N or 'search')")
    g.add_argument("--kd-teacher-tensor-model-parallel-size", dest="teacher_tp", type=_size)
    g.add_argument("--kd-teacher-pipeline-model-parallel-size", dest="teacher_pp", type=_size)
    g.add_argument("--kd-teacher-expert-model-parallel-size", dest="teacher_ep", type=_size)
    _add_distillation_arguments(parser)
    g = parser.add_argument_group("assumptions")
    g.add_argument("--mfu", type=float, help="student training MFU (default 0.40)")
    g.add_argument("--teacher-mfu", type=float, help="teacher forward MFU (default 0.40)")
    g.add_argument("--link-efficiency", type=float, help="achieved / line rate (default 0.8)")
    g.add_argument(
        "--reserve-gib",
        type=float,
        help="per-GPU reserve: context, NCCL, fragmentation (default 4)",
    )
    g = parser.add_argument_group("output")
    g.add_argument("--from-args", help="a Megatron-LM launch's own arguments, quoted as one string")
    g.add_argument("--json", action="store_true", help="print JSON instead of tables")


def _add_distillation_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("distillation")
    g.add_argument(
        "--kd-window-size",
        dest="window_size",
        type=int,
        help="fused-loss rows per window (default: the loss's 64 MiB fp32 window)",
    )
    g.add_argument(
        "--kd-prefetch-depth", dest="prefetch_depth", type=int, help="ring slots D (default 2)"
    )
    g.add_argument(
        "--kd-topk", dest="topk", type=int, help="offline cache entries per token (default 64)"
    )
    g.add_argument(
        "--kd-cache-entry-bytes",
        dest="cache_entry_bytes",
        type=int,
        help="bytes per cached entry on storage (default 6: int32 id + bf16 value)",
    )
    g.add_argument(
        "--kd-teacher-replicas",
        dest="teacher_replicas",
        type=int,
        help="disaggregated: plan with this many teacher replicas (default: as many as needed)",
    )
    g.add_argument(
        "--kd-wire-dtype",
        dest="wire_dtype",
        choices=["fp32", "bf16", "fp8"],
        help="hidden states on the disaggregated wire (default bf16)",
    )
    g.add_argument("--modes", help=f"comma-separated subset of {','.join(MODES)}")


def build_options(args: argparse.Namespace) -> tuple[PlanOptions, list[str]]:
    """:class:`PlanOptions` from parsed options (and ``--from-args``); also the ignored launch
    flags."""
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
        if value is not None and key not in ("from_args", "json", "modes"):
            values[key] = value
    for key, value in _DEFAULTS.items():
        values.setdefault(key, value)
    if student is None:
        if not values.get("student"):
            raise ValueError(
                "no student: pass --student NAME|config.json or a model in --from-args"
            )
        student = load_model(values["student"])
    if not values.get("teacher"):
        raise ValueError("no teacher: pass --teacher NAME|config.json")
    teacher = load_model(values["teacher"])
    gpu = get_gpu(values["gpu"])

    def size(key: str) -> int | None:
        value = values.get(key)
        return None if value in (None, "search") else value

    recompute = values.get("recompute")
    opts = PlanOptions(
        student=student,
        teacher=teacher,
        gpu=gpu,
        inter_node_link=get_link(values["inter_node_link"], gpu),
        gpus_per_node=values["gpus_per_node"],
        nodes=values["nodes"],
        seq_length=values["seq_length"],
        micro_batch_size=values["micro_batch_size"],
        global_batch_size=values["global_batch_size"],
        tp=size("tp"),
        pp=size("pp"),
        ep=size("ep") if student.is_moe else None,
        etp=values["etp"] if student.is_moe else 1,
        recompute=None if recompute in (None, "search") else recompute,
        sequence_parallel=values.get("sequence_parallel"),
        use_distributed_optimizer=bool(values.get("use_distributed_optimizer", False)),
        teacher_tp=size("teacher_tp"),
        teacher_pp=size("teacher_pp"),
        teacher_ep=size("teacher_ep") if teacher.is_moe else None,
        window_size=values.get("window_size"),
        prefetch_depth=values["prefetch_depth"],
        topk=values["topk"],
        cache_entry_bytes=values["cache_entry_bytes"],
        wire_dtype=values["wire_dtype"],
        teacher_replicas=values.get("teacher_replicas"),
        mfu=values["mfu"],
        teacher_mfu=values["teacher_mfu"],
        link_efficiency=values["link_efficiency"],
        reserve_bytes=int(values["reserve_gib"] * GIB),
        precision=Precision(grad_bytes=values.get("grad_bytes", 4)),
        activation=ActivationOptions(hidden_dropout=bool(values.get("hidden_dropout", False))),
    )
    return opts, ignored


def _parse_modes(text: str | None) -> tuple[str, ...]:
    if not text:
        return MODES
    modes = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise ValueError(f"--modes: unknown {bad or text!r}; choose from {MODES}")
    return tuple(m for m in MODES if m in modes)


def _layout_line(layout: dict | None, prefix: str) -> str:
    if not layout:
        return f"{prefix}: none on the student GPUs"
    return (
        f"{prefix}: tp={layout['tp']} pp={layout['pp']} dp={layout['dp']} ep={layout['ep']} "
        f"sp={'on' if layout['sequence_parallel'] else 'off'} recompute={layout['recompute']} "
        f"dist-opt={'on' if layout['use_distributed_optimizer'] else 'off'}"
    )


def format_plan(plan, opts: PlanOptions) -> str:
    """One mode's table."""
    lines = [f"== {plan.mode}: {plan.verdict}"]
    lines.append(
        "   " + _layout_line(plan.layout, "student") + f" (worst pipeline stage {plan.worst_stage})"
    )
    tl = plan.teacher_layout
    if plan.mode.startswith("colocated") and tl:
        lines.append(f"   teacher (colocated, same tp/pp): ep={tl['ep']}")
    elif plan.mode == "disaggregated" and tl:
        lines.append(
            f"   teacher replica: tp={tl['tp']} pp={tl['pp']} dp={tl['dp']} ep={tl['ep']} "
            f"({tl['tp'] * tl['pp'] * tl['dp']} GPUs) x {plan.teacher_replicas} replica(s) = "
            f"{plan.teacher_gpus} GPUs on {plan.teacher_nodes} node(s)"
        )
    lines.append(f"   {'per-GPU memory term':<40}{'GiB':>9}")
    for name, value in plan.terms.items():
        lines.append(f"   {name:<40}{value / GIB:>9.2f}")
    status = "fits" if plan.fits else "OOM"
    lines.append(
        f"   {'total':<40}{plan.total_bytes / GIB:>9.2f}  of {plan.capacity_bytes / GIB:.1f} "
        f"({opts.gpu.name}): {status}"
    )
    if plan.teacher_terms:
        total = sum(plan.teacher_terms.values())
        parts = ", ".join(f"{k} {v / GIB:.2f}" for k, v in plan.teacher_terms.items())
        lines.append(f"   teacher GPU: {total / GIB:.2f} GiB ({parts})")
    lines.append(
        f"   step {plan.step_time_s:.2f} s at MFU {opts.mfu:.2f}: "
        f"{plan.student_tokens_per_s:,.0f} student tokens/s on {plan.student_gpus} GPUs; "
        f"teacher nodes needed: {plan.teacher_nodes}"
    )
    for name, value in plan.wire.items():
        text = (
            f"{value:,.0f}" if float(value).is_integer() or abs(value) >= 1000 else f"{value:.3g}"
        )
        lines.append(f"   {name:<48}{text:>18}")
    if plan.mode == "disaggregated":
        lines.append(
            f"   wire: {'keeps up' if plan.wire_ok else 'TOO SLOW: the student would stall'} "
            f"({opts.inter_node_link.name} x {opts.link_efficiency})"
        )
    for note in plan.notes:
        lines.append(f"   note: {note}")
    return "\n".join(lines)


def format_report(result: dict, opts: PlanOptions, ignored: list[str]) -> str:
    window = opts.window_size or "default (64 MiB fp32)"
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
    parts += [format_plan(p, opts) for p in result["plans"].values()]
    parts.append(f"recommendation: {result['recommendation']}")
    return "\n\n".join(parts)


def to_json(result: dict, opts: PlanOptions, ignored: list[str]) -> dict:
    return {
        "teacher": opts.teacher.to_dict(),
        "student": opts.student.to_dict(),
        "gpu": asdict(opts.gpu),
        "inter_node_link": asdict(opts.inter_node_link),
        "inputs": {
            k: getattr(opts, k)
            for k in (
                "gpus_per_node",
                "nodes",
                "seq_length",
                "micro_batch_size",
                "global_batch_size",
                "tp",
                "pp",
                "ep",
                "etp",
                "recompute",
                "sequence_parallel",
                "use_distributed_optimizer",
                "teacher_tp",
                "teacher_pp",
                "teacher_ep",
                "window_size",
                "prefetch_depth",
                "topk",
                "cache_entry_bytes",
            )
        },
        "assumptions": {
            "mfu": opts.mfu,
            "teacher_mfu": opts.teacher_mfu,
            "link_efficiency": opts.link_efficiency,
            "reserve_bytes": opts.reserve_bytes,
            "precision": asdict(opts.precision),
            "activation": asdict(opts.activation),
        },
        "ignored_launch_flags": ignored,
        "plans": {m: p.to_dict() for m, p in result["plans"].items()},
        "recommendation": result["recommendation"],
    }


def run(args: argparse.Namespace) -> int:
    try:
        opts, ignored = build_options(args)
        result = plan_all(opts, _parse_modes(args.modes))
    except ValueError as exc:
        print(f"megatron-kd plan: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(to_json(result, opts, ignored), indent=2))
    else:
        print(format_report(result, opts, ignored))
    return 0
