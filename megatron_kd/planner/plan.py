"""Plans: one per distillation mode, with layout search (pure Python, no torch).

This module searches; the pieces it searches with are :mod:`.options` (the inputs
:class:`PlanOptions` and the result :class:`ModePlan`), :mod:`.candidates` (the valid layouts) and
:mod:`.evaluation` (what one layout costs in memory, time and traffic). Their public names are
importable from here as well.

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

from megatron_kd.planner.candidates import student_candidates
from megatron_kd.planner.evaluation import (
    evaluate,
    search_teacher,
    student_stage_terms,
    teacher_inference_terms,
)
from megatron_kd.planner.memory import ParallelLayout
from megatron_kd.planner.options import GIB, MODES, RECOMPUTE_ORDER, ModePlan, PlanOptions

# the names callers import from here: the options and results, and the evaluation's entry points
__all__ = [
    "GIB",
    "MODES",
    "ModePlan",
    "PlanOptions",
    "evaluate",
    "plan_all",
    "plan_mode",
    "recommend",
    "search_teacher",
    "student_stage_terms",
    "teacher_inference_terms",
]


def _search_key(layout: ParallelLayout) -> tuple:
    """Sort key of the student layouts, preferred first (the order of the module docstring)."""
    # full recompute (a third more compute) only when nothing else fits; then the smallest t*p
    return (
        layout.recompute == "full",
        layout.tp * layout.pp,
        RECOMPUTE_ORDER[layout.recompute],
        layout.tp,
        -layout.ep,
    )


def plan_mode(opts: PlanOptions, mode: str) -> ModePlan:
    """Search (or take) the student layout of ``mode``; see the module docstring for the order."""
    candidates = sorted(student_candidates(opts), key=_search_key)
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
    """The plan's one-line verdict (and its ``tokens_per_s_per_gpu``, counting teacher GPUs)."""
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
