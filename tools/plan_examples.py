#!/usr/bin/env python
"""Plans for docs/planner.md: Qwen3.5-35B-A3B -> Qwen3.5-9B and larger pairs, and whether the
published claims are reproduced by the planner's model; and the long-context cases (8K and 32K
tokens, the layouts that fit per mode, context parallelism among them).

Claims checked (from the papers behind megatron_kd):

1. the Qwen3.5-35B-A3B -> 9B pair trains colocated with the fused loss, but disaggregated is faster;
2. larger pairs OOM colocated even with the fused loss, yet fit disaggregated.

Long-context cases (Multiverse Computing's published figures are theirs, quoted beside the table in
docs/planner.md, not computed here): Llama-3.1-8B -> Llama-3.2-3B on one H200 at 8K and 32K tokens
(top-100 cache, as theirs); gpt-oss-120b into gpt-oss-20b at 32K tokens, 4 sequences a step, one
node of H200; Qwen3.5-35B-A3B -> Qwen3.5-9B at 32K tokens, one node of H200.

Usage::

    python tools/plan_examples.py              # every plan's tables, then the markdown blocks
    python tools/plan_examples.py --markdown   # only the markdown blocks
    python tools/plan_examples.py --markdown --json plans.json   # and every plan as JSON

The tables are the docs' (docs/planner.md, README.md): each follows a line
``<!-- tools/plan_examples.py: NAME -->`` there, NAME a key of :func:`tables`, and
``tests/unit/test_docs_plan_figures.py`` regenerates them and compares. Pure Python (no torch);
runs in about a second.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping
from dataclasses import dataclass

from megatron_kd.planner.cli import format_report, report_options, to_json
from megatron_kd.planner.memory import GIB, total_bytes
from megatron_kd.planner.options import plan_all
from megatron_kd.planner.plan import Mode, ModePlan, PlanOptions, PlanResult
from megatron_kd.planner.presets import MODEL_PRESETS, get_gpu, get_link


@dataclass(frozen=True)
class Scenario:
    teacher: str
    student: str
    gpu: str
    nodes: int
    claim: int  # which claim the scenario tests (1 or 2; 0: a long-context case)
    seq_length: int = 8192
    global_batch_size: int = 64
    gpus_per_node: int = 8
    topk: int | None = None  # the offline cache's K (None: the planner's default)
    published: str = ""  # what a published report says of the case (the README's last column)

    def options(self) -> PlanOptions:
        gpu = get_gpu(self.gpu)
        extra = {} if self.topk is None else {"topk": self.topk}
        return PlanOptions(
            student=MODEL_PRESETS[self.student],
            teacher=MODEL_PRESETS[self.teacher],
            gpu=gpu,
            inter_node_link=get_link("ib-400g", gpu),
            gpus_per_node=self.gpus_per_node,
            nodes=self.nodes,
            seq_length=self.seq_length,
            micro_batch_size=1,
            global_batch_size=self.global_batch_size,
            use_distributed_optimizer=True,
            **extra,
        )

    @property
    def gpus(self) -> str:
        return f"{self.nodes} x {self.gpus_per_node} {self.gpu}"

    @property
    def title(self) -> str:
        return (
            f"{self.teacher} -> {self.student}, {self.gpus}, s={self.seq_length}, "
            f"G={self.global_batch_size}"
        )

    def command(self) -> str:
        text = (
            f"megatron-kd plan --teacher {self.teacher} --student {self.student} --gpu {self.gpu} "
            f"--nodes {self.nodes} --seq-length {self.seq_length} --global-batch-size "
            f"{self.global_batch_size} --use-distributed-optimizer"
        )
        if self.gpus_per_node != 8:
            text += f" --gpus-per-node {self.gpus_per_node}"
        if self.topk is not None:
            text += f" --kd-topk {self.topk}"
        return text


SCENARIOS = [
    Scenario("qwen3.5-35b-a3b", "qwen3.5-9b", "h200-141g", 1, claim=1),
    Scenario("qwen3.5-35b-a3b", "qwen3.5-9b", "h100-80g", 1, claim=1),
    Scenario("qwen3-235b-a22b", "qwen3-32b", "h100-80g", 1, claim=2),
    Scenario("qwen3-235b-a22b", "qwen3-32b", "h200-141g", 1, claim=2),
    Scenario("qwen3-235b-a22b", "qwen3-32b", "h100-80g", 2, claim=2),
]

LONG_CONTEXT = [
    Scenario("llama-3.1-8b", "llama-3.2-3b", "h200-141g", 1, claim=0, seq_length=8192,
             global_batch_size=1, gpus_per_node=1, topk=100,
             published="fused 58.3 GB, dense 78.3 GB (offline, top-100)"),
    Scenario("llama-3.1-8b", "llama-3.2-3b", "h200-141g", 1, claim=0, seq_length=32768,
             global_batch_size=1, gpus_per_node=1, topk=100),
    Scenario("qwen3-235b-a22b", "qwen3-30b-a3b", "h200-141g", 1, claim=0, seq_length=32768,
             global_batch_size=4,
             published="(gpt-oss-120b -> 20b: peak near 250 GB; its student does not train "
                       "here)"),
    # the recipe's batch (docs/recipes/qwen3.5-35b-a3b-to-9b.md: the plan's default, 128)
    Scenario("qwen3.5-35b-a3b", "qwen3.5-9b", "h200-141g", 1, claim=0, seq_length=32768,
             global_batch_size=128, published="(DeltaNet: no CP)"),
]

#: How the README names the models and the GPUs.
_README_NAMES = {"llama-3.1-8b": "Llama-3.1-8B", "llama-3.2-3b": "3.2-3B",
                 "qwen3-235b-a22b": "Qwen3-235B-A22B", "qwen3-30b-a3b": "30B-A3B",
                 "qwen3.5-35b-a3b": "Qwen3.5-35B-A3B", "qwen3.5-9b": "9B",
                 "h200-141g": "H200", "h100-80g": "H100"}


def layout_cell(plan: ModePlan) -> str:
    """A mode's layout and peak in one cell: ``tp1 cp2 (a2a) ep8 dp4, 117 GiB, 97k tok/s``."""
    lay = plan.layout
    parts = [f"tp{lay.tp}"]
    if lay.pp > 1:
        parts.append(f"pp{lay.pp}" + (f"x{lay.vp}" if lay.vp > 1 else ""))
    if lay.cp > 1:
        parts.append(f"cp{lay.cp} ({lay.cp_comm_type})")
    if lay.ep > 1:
        parts.append(f"ep{lay.ep}")
    parts.append(f"dp{lay.dp}")
    if lay.recompute != "none":
        parts.append(f"recompute {lay.recompute_label}")
    text = " ".join(parts)
    if not plan.fits:
        return f"OOM ({plan.total_bytes / GIB:.0f} GiB, {text})"
    text += f", {plan.total_bytes / GIB:.0f} GiB, {plan.student_tokens_per_s / 1e3:.1f}k tok/s"
    return text + _replicas(plan, ", + ")


def _replicas(plan: PlanResult, lead: str) -> str:
    """A disaggregated plan's teacher replicas and the memory of one, after ``lead``; nothing
    for another mode."""
    if plan.mode is not Mode.DISAGGREGATED:
        return ""
    return (f"{lead}{plan.teacher_replicas} x {plan.teacher_layout.world_size}-GPU replica "
            f"({total_bytes(plan.teacher_terms) / GIB:.0f} GiB)")


def long_context_table(results: list[tuple[Scenario, PlanResult]]) -> list[str]:
    """docs/planner.md's long-context table: every mode's layout and peak per case."""
    lines = [
        ("| teacher -> student | GPUs | tokens, sequences/step | colocated dense | colocated fused "
         "| offline cache | disaggregated |"),
        "|---|---|---|---|---|---|---|",
    ]
    for sc, result in results:
        lines.append(
            f"| {sc.teacher} -> {sc.student} | {sc.gpus} | {sc.seq_length // 1024}K, "
            f"{sc.global_batch_size} | " + " | ".join(layout_cell(result.plans[m]) for m in Mode)
            + " |"
        )
    return lines


def long_context_markdown(results: list[tuple[Scenario, PlanResult]]) -> str:
    lines = long_context_table(results)
    lines += ["", "Reproduce: `python tools/plan_examples.py` (each row is one `megatron-kd plan` "
              "command, e.g. `" + results[-1][0].command() + "`)."]
    return "\n".join(lines)


def _short_layout(plan: ModePlan, num_layers: int) -> str:
    """A layout in words, only what is not the default: ``TP 2 + SP, PP 2 x 4 virtual``."""
    lay = plan.layout
    parts = []
    if lay.tp > 1:
        parts.append(f"TP {lay.tp}" + (" + SP" if lay.sequence_parallel else ""))
    if lay.pp > 1:
        parts.append(f"PP {lay.pp}" + (f" x {lay.vp} virtual" if lay.vp > 1 else ""))
    if lay.cp > 1:
        parts.append(f"CP {lay.cp}")
    if lay.recompute == "full" and lay.recompute_method == "block":
        parts.append(f"recompute {lay.recompute_num_layers} of {num_layers // lay.pp} layers")
    elif lay.recompute != "none":
        parts.append(f"recompute {lay.recompute_label}")
    return ", ".join(parts)


def _readme_cell(plan: ModePlan, num_layers: int) -> str:
    layout = _short_layout(plan, num_layers)
    if not plan.fits:
        return f"OOM ({plan.total_bytes / GIB:.0f} GiB)"
    text = f"{plan.total_bytes / GIB:.0f} GiB" + (f" ({layout})" if layout else "")
    return text + _replicas(plan, " + ")


def readme_table(results: list[tuple[Scenario, PlanResult]]) -> list[str]:
    """The README's table of the long-context cases: each mode's peak per GPU and its layout
    where it is not TP 1 without recompute, beside what was published."""
    lines = [("| pair, GPUs, tokens x sequences a step | colocated dense | colocated fused "
              "| offline cache | disaggregated | published |"),
             "|---|---|---|---|---|---|"]
    for sc, result in results:
        name = (f"{_README_NAMES[sc.teacher]} -> {_README_NAMES[sc.student]}, "
                f"{sc.nodes * sc.gpus_per_node} {_README_NAMES[sc.gpu]}, "
                f"{sc.seq_length // 1024}K x {sc.global_batch_size}")
        layers = MODEL_PRESETS[sc.student].num_layers
        lines.append(f"| {name} | "
                     + " | ".join(_readme_cell(result.plans[m], layers) for m in Mode)
                     + f" | {sc.published} |")
    return lines


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


def claims_table(results: list[tuple[Scenario, PlanResult]]) -> list[str]:
    """docs/planner.md's table of the published claims: each mode's peak and rate per case."""
    lines = [("| teacher -> student | GPUs | colocated dense | colocated fused | offline cache "
              "| disaggregated | claim |"),
             "|---|---|---|---|---|---|---|"]
    for sc, result in results:
        ok, _ = claim_verdict(sc, result.plans)
        lines.append(
            f"| {sc.teacher} -> {sc.student} | {sc.nodes} x 8 {sc.gpu} | "
            + " | ".join(_cell(result.plans[m]) for m in Mode)
            + f" | {sc.claim}: {'yes' if ok else 'no'} |"
        )
    return lines


def plan_scenarios(scenarios: list[Scenario]) -> list[tuple[Scenario, PlanResult]]:
    return [(sc, plan_all(sc.options())) for sc in scenarios]


def tables() -> dict[str, list[str]]:
    """The docs' tables by name (the ``<!-- tools/plan_examples.py: NAME -->`` marks)."""
    claims, long_context = plan_scenarios(SCENARIOS), plan_scenarios(LONG_CONTEXT)
    return {"claims": claims_table(claims), "long_context": long_context_table(long_context),
            "readme": readme_table(long_context)}


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
        *claims_table(results),
    ]
    verdicts = [(sc, *claim_verdict(sc, result.plans)) for sc, result in results]
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
    parser.add_argument("--json", metavar="PATH", default=None,
                        help="also write every scenario's plan (megatron-kd plan --json's "
                        "document, with its command) and the markdown blocks there")
    args = parser.parse_args(argv)
    results, long_results = [], []
    documents: dict[str, list[dict]] = {"claims": [], "long_context": []}
    for scenarios, out, key in ((SCENARIOS, results, "claims"),
                                (LONG_CONTEXT, long_results, "long_context")):
        for sc in scenarios:
            opts = sc.options()
            result = plan_all(opts)
            out.append((sc, result))
            options = report_options(result, opts)
            if not args.markdown:
                print(f"################ {sc.title}\n$ {sc.command()}\n")
                print(format_report(result, opts, [], options))
                print()
            if args.json:
                documents[key].append({"title": sc.title, "command": sc.command(),
                                       "plan": to_json(result, opts, [], options)})
    claims, long_context = markdown(results), long_context_markdown(long_results)
    print(claims)
    print()
    print(long_context)
    print()
    print("\n".join(readme_table(long_results)))
    if args.json:
        documents["markdown"] = {"claims": claims, "long_context": long_context}
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(documents, f, indent=1)
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
