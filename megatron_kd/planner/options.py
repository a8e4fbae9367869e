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

from megatron_kd.arch import context_parallel_limit
from megatron_kd.planner import memory as mem
from megatron_kd.planner import schedule
from megatron_kd.planner.memory import GIB, ParallelLayout
from megatron_kd.planner.plan import LayoutOption, Mode, ModePlan, PlanOptions, PlanResult
from megatron_kd.planner.search import evaluate, plan_mode, search_teacher
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


def plan_all(opts: PlanOptions, modes: tuple[Mode, ...] = tuple(Mode)) -> PlanResult:
    """Every mode's plan (and so the recommendation): the search's layout, replaced by an
    alternative of its options table that is better on both axes (less memory and a shorter
    step) while one is, with the reason for every lever left as it is."""
    return PlanResult(plans={m: choose(opts, plan_mode(opts, m)) for m in modes})


def choose(opts: PlanOptions, plan: ModePlan) -> ModePlan:
    """``plan``, or the alternative (one searched setting changed) that fits with less peak
    memory *and* a shorter step, repeatedly (the fastest such first); then its
    :attr:`~ModePlan.levers`. Settings the options give are never changed."""
    if plan.fits:
        for _ in range(_MAX_MOVES):
            better = [(label, alt) for label, alt, changes in _evaluated(opts, plan)
                      if alt.fits and not _given(opts, changes)
                      and alt.total_bytes < plan.total_bytes
                      and alt.step_time_s < plan.step_time_s]
            if not better:
                break
            label, alt = min(better, key=lambda x: (x[1].step_time_s, x[1].total_bytes))
            saved = (plan.total_bytes - alt.total_bytes) / GIB
            note = (f"took {label!r} over the search's first choice "
                    f"({layout_label(plan.layout)}): {saved:.1f} GiB less and "
                    f"{1 - alt.step_time_s / plan.step_time_s:.1%} faster")
            plan = replace(alt, notes=(*alt.notes, note))
    return replace(plan, levers=tuple(levers(opts, plan, _evaluated(opts, plan))))


#: Improvements taken in a row at most (each strictly better on both axes: it ends anyway).
_MAX_MOVES = 4

#: Layout fields an alternative may change that a :class:`PlanOptions` field of the same name
#: gives (None there: searched).
_GIVEN_BY_OPTIONS = frozenset({"tp", "pp", "vp", "cp", "sequence_parallel", "recompute",
                               "recompute_method", "recompute_num_layers"})


def _given(opts: PlanOptions, changes: dict) -> bool:
    """Whether ``changes`` touches a setting the options give (not searched)."""
    if "vp" in changes and opts.layers_per_virtual_stage is not None:
        return True
    return any(getattr(opts, key) is not None for key in changes if key in _GIVEN_BY_OPTIONS)


#: The levers :func:`levers` explains, each with the layout fields its alternatives change.
_LEVERS = (
    ("tensor parallelism", ("tp",)),
    ("pipeline stages", ("pp", "vp")),
    ("context parallelism", ("cp",)),
    ("recompute", ("recompute",)),
)


def levers(opts: PlanOptions, plan: ModePlan,
           evaluated: list[tuple[str, ModePlan, dict]]) -> list[str]:
    """One line per lever of the student layout saying why it is where it is: given by the
    options, refused by the model, or what its best alternative (``evaluated``, from
    :func:`_evaluated`) would cost."""
    layout = plan.layout
    lines = []
    for name, fields in _LEVERS:
        current = _lever_value(layout, name)
        given = [f for f in fields if _given(opts, {f: None})]
        if given:
            lines.append(f"{name}: {current}, as given")
            continue
        limit = context_parallel_limit(opts.student.arch)
        if name == "context parallelism" and limit:
            lines.append(f"{name}: cp=1, the student cannot split: {limit}")
            continue
        alternatives = [(label, alt) for label, alt, changes in evaluated
                        if any(f in changes for f in fields)]
        if not alternatives:
            lines.append(f"{name}: {current}; {_no_alternative(opts, layout, name)}")
            continue
        fitting = [x for x in alternatives if x[1].fits]
        label, alt = (min(fitting, key=lambda x: x[1].step_time_s) if fitting
                      else min(alternatives, key=lambda x: x[1].total_bytes))
        lines.append(f"{name}: {current}; not {label} ({_why_not(plan, alt)})")
    dp = layout.dp * layout.cp
    if layout.use_distributed_optimizer:
        lines.append(f"distributed optimizer: on (its fp32 state sharded over dp={layout.dp}, "
                     f"the same bytes moved as the all-reduce it replaces)")
    elif opts.use_distributed_optimizer is False:
        lines.append("distributed optimizer: off, as given")
    else:
        lines.append(f"distributed optimizer: off (dp={dp}: nothing to shard)")
    return lines


def _lever_value(layout: ParallelLayout, name: str) -> str:
    if name == "tensor parallelism":
        return f"tp={layout.tp}" + (" +SP" if layout.sequence_parallel and layout.tp > 1 else "")
    if name == "pipeline stages":
        return f"pp={layout.pp}" + (f" vp={layout.vp}" if layout.pp > 1 else "")
    if name == "context parallelism":
        return f"cp={layout.cp}"
    return f"recompute={layout.recompute_label}"


def _no_alternative(opts: PlanOptions, layout: ParallelLayout, name: str) -> str:
    """Why :func:`_alternatives` offered nothing (or nothing Megatron-Core would run)."""
    if name == "tensor parallelism" and layout.tp * 2 > opts.gpus_per_node:
        return f"tensor parallelism stays inside a node of {opts.gpus_per_node} GPUs"
    if layout.dp % 2:
        return f"no other split of dp={layout.dp} that Megatron-Core would run"
    return "no other setting that Megatron-Core would run with this model and batch"


def _why_not(plan: ModePlan, alt: ModePlan) -> str:
    """Why ``alt`` is not the plan: its cost against the plan's, and the verdict."""
    gib = round((alt.total_bytes - plan.total_bytes) / GIB, 1) + 0.0  # (no -0.0)
    step = alt.step_time_s / plan.step_time_s - 1
    cost = f"{gib:+.1f} GiB, {step:+.1%} step time"
    comm = (_comm_s(alt) - _comm_s(plan))
    if comm > 0.005 * plan.step_time_s:
        cost += f", {comm:+.2f} s of collectives a step at link speed"
    if not alt.fits:
        return f"{cost}: does not fit"
    if step >= 0 and gib >= 0:
        return f"{cost}: no less memory, no faster"
    if step >= 0:
        return f"{cost}: no faster, and the chosen layout fits"
    return f"{cost}: faster, but not on less memory"


def _comm_s(plan: ModePlan) -> float:
    """The collectives' seconds a step that the step time does not count."""
    return sum(plan.wire.get(t, 0.0) for t in (Traffic.TP_COLLECTIVE_SECONDS,
                                                Traffic.P2P_SECONDS, Traffic.CP_EXCHANGE_SECONDS))


def layout_options(opts: PlanOptions, plan: ModePlan) -> list[LayoutOption]:
    """The chosen layout of ``plan`` first, then each alternative (see the module docstring)."""
    rows = [_option(f"chosen: {layout_label(plan.layout)}", plan)]
    rows += [_option(label, alternative) for label, alternative, _ in _evaluated(opts, plan)]
    return rows


def _evaluated(opts: PlanOptions, plan: ModePlan) -> list[tuple[str, ModePlan, dict]]:
    """``(label, plan, changes)`` of each alternative Megatron-Core would run."""
    teacher_search = search_teacher(opts) if plan.mode is Mode.DISAGGREGATED else None
    out = []
    seen = {plan.layout}
    for label, changes in _alternatives(opts, plan.layout):
        try:
            layout = replace(plan.layout, **changes)
            if layout in seen:
                continue
            seen.add(layout)
            alternative = evaluate(opts, plan.mode, layout, teacher_search)  # checks it
        except ValueError:
            continue  # Megatron-Core would refuse it: not an option
        out.append((label, alternative, changes))
    return out


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
    if pp > 1:  # every whole number of layers per virtual stage (the rules refuse the rest)
        for v in _divisors(max(1, layers // pp)):
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
