"""What the alternatives to a plan's student layout buy (pure Python, no torch): the layout the
search chose, then one setting changed at a time, each evaluated like the chosen one (peak memory
of the worst GPU, step time, pipeline bubble, tokens/s, and the time of the tensor-parallel
collectives and of the pipeline's point-to-point sends, which the step time does not count).

The alternatives: every recompute setting on the chosen split (none, selective, full uniform x1,
full block with half of a chunk's layers); every number of virtual stages per pipeline rank the
chosen pipeline allows (with ``p = 1``: a two-stage pipeline, with each ``v`` it allows); twice the
tensor-parallel size, with sequence parallelism; twice the context-parallel size, and without
context parallelism where the chosen layout has it (each trading data-parallel ranks). An
alternative Megatron-Core would refuse (a recompute group that does not divide a chunk, micro-
batches the interleaved schedule cannot take, experts that do not divide, context parallelism for
Gated DeltaNet layers or a sequence that does not split) is left out of the table, not
approximated.
"""

from __future__ import annotations

from dataclasses import replace

from megatron_kd.planner import memory as mem
from megatron_kd.planner import schedule
from megatron_kd.planner.memory import ParallelLayout
from megatron_kd.planner.plan import LayoutOption, Mode, ModePlan, PlanOptions
from megatron_kd.planner.search import evaluate, search_teacher
from megatron_kd.planner.traffic import Traffic


def layout_label(layout: ParallelLayout) -> str:
    """A layout in one short line: ``tp=2 pp=2 vp=4 sp recompute=full block x8``."""
    text = f"tp={layout.tp} pp={layout.pp}"
    if layout.pp > 1:
        text += f" vp={layout.vp}"
    if layout.sequence_parallel and layout.tp > 1:
        text += " +SP"
    if layout.cp > 1:
        text += f" cp={layout.cp}"
    return f"{text} recompute={layout.recompute_label}"


def layout_options(opts: PlanOptions, plan: ModePlan) -> list[LayoutOption]:
    """The chosen layout of ``plan`` first, then each alternative (see the module docstring)."""
    teacher_search = search_teacher(opts) if plan.mode is Mode.DISAGGREGATED else None
    rows = [_option(f"chosen: {layout_label(plan.layout)}", plan)]
    seen = {plan.layout}
    for label, changes in _alternatives(opts, plan.layout):
        try:
            layout = replace(plan.layout, **changes)
            if layout in seen:
                continue
            seen.add(layout)
            if layout.cp != plan.layout.cp:
                mem.validate_layout(opts.student, layout, "student")
                mem.validate_sequence_split(layout, opts.seq_length)
            alternative = evaluate(opts, plan.mode, layout, teacher_search)
        except ValueError:
            continue  # Megatron-Core would refuse it: not an option
        rows.append(_option(label, alternative))
    return rows


def _option(label: str, plan: ModePlan) -> LayoutOption:
    total = plan.total_bytes
    if plan.teacher_terms and not plan.fits:  # a disaggregated teacher replica may be what OOMs
        total = max(total, mem.total_bytes(plan.teacher_terms))
    return LayoutOption(
        label=label,
        layout=plan.layout,
        fits=plan.fits,
        total_bytes=total,
        step_time_s=plan.step_time_s,
        bubble=plan.bubble,
        student_tokens_per_s=plan.student_tokens_per_s,
        tp_collective_s=plan.wire.get(Traffic.TP_COLLECTIVE_SECONDS, 0.0),
        p2p_s=plan.wire.get(Traffic.P2P_SECONDS, 0.0),
        cp_exchange_s=plan.wire.get(Traffic.CP_EXCHANGE_SECONDS, 0.0),
    )


def _alternatives(opts: PlanOptions, base: ParallelLayout) -> list[tuple[str, dict]]:
    """``(label, changes to the chosen layout)`` of each alternative, in the order printed."""
    layers = opts.student.num_layers
    chunk = max(len(c) for c in schedule.chunk_layers(layers, base.pp, base.vp, 0))
    none = {"recompute_method": "uniform", "recompute_num_layers": 1}
    out: list[tuple[str, dict]] = [
        ("recompute none", {"recompute": "none", **none}),
        ("recompute selective", {"recompute": "selective", **none}),
        ("recompute full uniform x1", {"recompute": "full", **none}),
    ]
    if chunk > 1:
        out.append((f"recompute full block x{chunk // 2}",
                    {"recompute": "full", "recompute_method": "block",
                     "recompute_num_layers": chunk // 2}))
    pp, dp = base.pp, base.dp
    if pp == 1 and dp % 2 == 0:  # no pipeline: what a two-stage one would buy
        pp, dp = 2, dp // 2
    if pp > 1 and layers % pp == 0:
        m = opts.global_batch_size // (opts.micro_batch_size * dp)
        for v in _divisors(layers // pp):
            if v == 1 or (m >= pp and m % pp == 0):
                out.append((f"pp={pp} vp={v}", {"pp": pp, "dp": dp, "vp": v}))
    if base.tp * 2 <= opts.gpus_per_node and base.dp % 2 == 0:
        out.append((f"tp={base.tp * 2} +SP",
                    {"tp": base.tp * 2, "dp": base.dp // 2, "sequence_parallel": True}))
    if base.cp > 1:
        out.append(("cp=1", {"cp": 1, "dp": base.dp * base.cp}))
    if base.dp % 2 == 0:
        out.append((f"cp={base.cp * 2}", {"cp": base.cp * 2, "dp": base.dp // 2}))
    return out


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
