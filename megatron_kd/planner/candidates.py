"""Candidate layouts: every way of splitting the student, and the teacher, that Megatron accepts for
the given GPUs and options (a parallel size left as ``None`` is searched). Which candidate a plan
takes is decided in :mod:`.plan`; what each one costs, in :mod:`.evaluation`.
"""

from __future__ import annotations

from megatron_kd.planner import memory as mem
from megatron_kd.planner.memory import ParallelLayout
from megatron_kd.planner.options import RECOMPUTE_ORDER, PlanOptions


def _divisors(n: int) -> list[int]:
    """The divisors of ``n``, ascending."""
    return [d for d in range(1, n + 1) if n % d == 0]


def student_candidates(opts: PlanOptions) -> list[ParallelLayout]:
    """Every valid student layout on ``opts.world_size`` GPUs; ``ValueError`` (with the first
    reasons) when there is none."""
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
            recomputes = [opts.recompute] if opts.recompute else list(RECOMPUTE_ORDER)
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


def colocated_teacher_layout(
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


def teacher_candidates(opts: PlanOptions) -> list[ParallelLayout]:
    """Every valid disaggregated teacher replica layout (``dp`` only as wide as its experts need);
    ``ValueError`` when there is none."""
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
