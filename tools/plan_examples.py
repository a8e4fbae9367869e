#!/usr/bin/env python
"""Plans for the README: Qwen3.5-35B-A3B -> Qwen3.5-9B and larger pairs, and whether the published
claims are reproduced by the planner's model.

Claims checked (from the papers behind megatron_kd):

1. the Qwen3.5-35B-A3B -> 9B pair trains colocated with the fused loss, but disaggregated is faster;
2. larger pairs OOM colocated even with the fused loss, yet fit disaggregated.

Usage::

    python tools/plan_examples.py              # every plan's tables, then the markdown block
    python tools/plan_examples.py --markdown   # only the markdown block

Pure Python (no torch); runs in about a second.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping
from dataclasses import dataclass

from megatron_kd.planner.cli import format_report, report_options
from megatron_kd.planner.memory import GIB
from megatron_kd.planner.plan import Mode, ModePlan, PlanOptions, PlanResult
from megatron_kd.planner.presets import MODEL_PRESETS, get_gpu, get_link
from megatron_kd.planner.search import plan_all


@dataclass(frozen=True)
class Scenario:
    teacher: str
    student: str
    gpu: str
    nodes: int
    claim: int  # which claim the scenario tests (1 or 2)
    seq_length: int = 8192
    global_batch_size: int = 64

    def options(self) -> PlanOptions:
        gpu = get_gpu(self.gpu)
        return PlanOptions(
            student=MODEL_PRESETS[self.student],
            teacher=MODEL_PRESETS[self.teacher],
            gpu=gpu,
            inter_node_link=get_link("ib-400g", gpu),
            nodes=self.nodes,
            seq_length=self.seq_length,
            micro_batch_size=1,
            global_batch_size=self.global_batch_size,
            use_distributed_optimizer=True,
        )

    @property
    def title(self) -> str:
        return (
            f"{self.teacher} -> {self.student}, {self.nodes} x 8 {self.gpu}, s={self.seq_length}, "
            f"G={self.global_batch_size}"
        )

    def command(self) -> str:
        return (
            f"megatron-kd plan --teacher {self.teacher} --student {self.student} --gpu {self.gpu} "
            f"--nodes {self.nodes} --seq-length {self.seq_length} --global-batch-size "
            f"{self.global_batch_size} --use-distributed-optimizer"
        )


SCENARIOS = [
    Scenario("qwen3.5-35b-a3b", "qwen3.5-9b", "h200-141g", 1, claim=1),
    Scenario("qwen3.5-35b-a3b", "qwen3.5-9b", "h100-80g", 1, claim=1),
    Scenario("qwen3-235b-a22b", "qwen3-32b", "h100-80g", 1, claim=2),
    Scenario("qwen3-235b-a22b", "qwen3-32b", "h200-141g", 1, claim=2),
    Scenario("qwen3-235b-a22b", "qwen3-32b", "h100-80g", 2, claim=2),
    Scenario("gpt-oss-120b", "gpt-oss-20b", "h100-80g", 1, claim=2),
]


def _cell(plan: ModePlan) -> str:
    if not plan.fits:
        return f"OOM ({plan.total_bytes / GIB:.0f} GiB)"
    text = f"{plan.total_bytes / GIB:.0f} GiB, {plan.student_tokens_per_s / 1e3:.1f}k tok/s"
    if plan.mode is Mode.DISAGGREGATED:
        text += f", +{plan.teacher_gpus} teacher GPU"
        if not plan.wire_ok:
            text += " (wire-bound)"
    return text


def claim_verdict(scenario: Scenario, plans: Mapping[Mode, ModePlan]) -> tuple[bool, str]:
    """(reproduced, one sentence) for the claim the scenario tests."""
    fused, disagg = plans[Mode.COLOCATED_FUSED], plans[Mode.DISAGGREGATED]
    if scenario.claim == 1:
        faster = (
            disagg.fits
            and disagg.wire_ok
            and disagg.student_tokens_per_s > fused.student_tokens_per_s
        )
        ok = fused.fits and faster
        gain = disagg.student_tokens_per_s / fused.student_tokens_per_s - 1
        return ok, (
            f"colocated fused {'fits' if fused.fits else 'OOMs'}; disaggregated "
            f"{'is' if faster else 'is not'} faster ({gain:+.0%} student tokens/s, "
            f"+{disagg.teacher_gpus} teacher GPU)"
        )
    dense = plans[Mode.COLOCATED_DENSE]
    ok = not dense.fits and not fused.fits and disagg.fits and disagg.wire_ok
    return ok, (
        f"colocated dense {'fits' if dense.fits else 'OOMs'}, colocated fused "
        f"{'fits' if fused.fits else 'OOMs'}, disaggregated {'fits' if disagg.fits else 'OOMs'}"
    )


def markdown(results: list[tuple[Scenario, PlanResult]]) -> str:
    lines = [
        "### What the planner says about the published claims",
        "",
        ("Per-GPU peak (worst pipeline stage) and student tokens/s for the layout the planner "
         "finds (the smallest model-parallel size that fits, full recompute only when nothing else "
         "fits, then the least recompute and the least pipeline time), bf16, Adam with the "
         "distributed optimizer, micro-batch 1, 400G InfiniBand, MFU 0.40 assumed for training "
         "and for the teacher's forward, 4 GiB per-GPU reserve."),
        "",
        ("| teacher -> student | GPUs | colocated dense | colocated fused | offline cache "
         "| disaggregated | claim |"),
        "|---|---|---|---|---|---|---|",
    ]
    verdicts = []
    for sc, result in results:
        plans = result.plans
        ok, sentence = claim_verdict(sc, plans)
        verdicts.append((sc, ok, sentence))
        lines.append(
            f"| {sc.teacher} -> {sc.student} | {sc.nodes} x 8 {sc.gpu} | "
            + " | ".join(_cell(plans[m]) for m in Mode)
            + f" | {sc.claim}: {'yes' if ok else 'no'} |"
        )
    lines += [
        "",
        ("Claim 1 (35B-A3B -> 9B trains colocated with the fused loss, but disaggregated is "
         "faster):"),
    ]
    for sc, ok, sentence in verdicts:
        if sc.claim == 1:
            lines.append(
                f"- {sc.nodes} x 8 {sc.gpu}: "
                f"**{'reproduced' if ok else 'not reproduced'}**: {sentence}."
            )
    lines += [
        "",
        "Claim 2 (larger pairs OOM colocated even with the fused loss, yet fit disaggregated):",
    ]
    for sc, ok, sentence in verdicts:
        if sc.claim == 2:
            lines.append(
                f"- {sc.teacher} -> {sc.student} on {sc.nodes} x 8 {sc.gpu}: "
                f"**{'reproduced' if ok else 'not reproduced'}**: {sentence}."
            )
    lines += [
        "",
        "Reproduce: `python tools/plan_examples.py` (each row is also one `megatron-kd plan` "
        "command, e.g. `" + results[0][0].command() + "`).",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--markdown", action="store_true", help="print only the markdown block")
    args = parser.parse_args(argv)
    results = []
    for sc in SCENARIOS:
        opts = sc.options()
        result = plan_all(opts)
        results.append((sc, result))
        if not args.markdown:
            print(f"################ {sc.title}\n$ {sc.command()}\n")
            print(format_report(result, opts, [], report_options(result, opts)))
            print()
    print(markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
