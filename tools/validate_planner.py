#!/usr/bin/env python
"""Validate the planner against measured ``megatron-kd train`` runs.

For each run (its ``megatron-kd train`` arguments and the JSON log it wrote with ``--log-json``):

* memory: the planner's prediction for the logging rank (rank 0: pipeline stage 0, TP rank 0)
  against the measured peak, ``max(peak_mem_bytes)`` over the run's steps. Target: within 15%.
* wire (disaggregated runs): the planner's teacher -> student bytes per step against the bytes the
  run counted (a per-step log field, ``--wire-bytes-key``). Target: equal, exactly.

Measurement method. On a GPU, ``peak_mem_bytes`` is ``torch.cuda.max_memory_allocated()`` and is
compared with the planner's terms directly (the reserve left out: the allocator statistics do not
see the CUDA context or NCCL). On CPU it is the process's peak resident set size
(``ru_maxrss``), which also holds the interpreter, torch, Megatron and the CPU shim; that
framework baseline is measured once (a process that imports exactly what ``megatron-kd train``
imports and installs the CPU shim, nothing else; or ``--baseline-bytes``), and the planner is
compared with ``peak - baseline``. Both the absolute and the baseline-subtracted ratios are printed.

How the planner is configured for a run: the architectures are the ones ``megatron-kd train`` itself
resolves (``plan_run``: the student from the flags, the teacher from its checkpoint's
``model_config.json``); precision follows ``--bf16`` (fp32 otherwise: 4-byte weights and
activations, Adam moments without a master copy); on CPU the local layer spec runs unfused
attention, norms and SwiGLU (``flash_attention``, ``fused_norm``, ``fused_swiglu`` off). Known gaps:
MLP biases (``--add-bias-linear``) and learned position embeddings are not counted; ``ru_maxrss`` is
a high-water mark over the whole process, so a transient at start-up (e.g. a checkpoint load holding
two copies of the teacher) can exceed the training peak; pipeline ranks other than the last build
the teacher and free it, which the high-water mark still sees. Validate with
``--pipeline-model-parallel-size 1`` runs.

Usage::

    # a finished run
    python tools/validate_planner.py --train-args "<the megatron-kd train flags>" \\
        --log-json run.jsonl
    # several runs described in a JSON file: [{"name": ..., "train_args": ..., "log_json": ...,
    #                                          "nproc": 1}, ...]
    python tools/validate_planner.py --cases cases.json
    # run them first (single process, or torchrun with nproc > 1), then compare
    python tools/validate_planner.py --cases cases.json --run
    # the built-in CPU cases: a random teacher checkpoint, a TP=1 and a TP=2 colocated run
    # (about three minutes on two CPU cores)
    python tools/validate_planner.py --builtin --run

Needs torch and megatron-core (it uses the training code's own argument parsing); the planner itself
does not.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
from dataclasses import dataclass

from megatron_kd.planner import memory as mem
from megatron_kd.planner import traffic as tr
from megatron_kd.planner.memory import ActivationOptions, Precision
from megatron_kd.planner.models import ModelConfig
from megatron_kd.planner.plan import PlanOptions, student_stage_terms
from megatron_kd.planner.presets import GpuSpec, LinkSpec

TOLERANCE = 0.15  # the target: predicted peak memory within 15% of the measured one
RESERVE_TERM = "reserve (context, NCCL, frag.)"

_BASELINE_CODE = (
    "import resource\n"
    "import torch, megatron.core\n"
    "import megatron_kd.training.train\n"
    "from megatron_kd.megatron_cpu import install_cpu_shim\n"
    "install_cpu_shim()\n"
    "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)\n"
)


# A random teacher (its weights do not matter for memory) and two colocated runs of a smaller
# student, sized so that the model state and activations dominate the framework's own memory.
_TEACHER_ARCH = dict(
    num_layers=6,
    hidden_size=768,
    num_attention_heads=12,
    num_query_groups=4,
    ffn_hidden_size=2048,
    vocab_size=32000,
    padded_vocab_size=32000,
    max_position_embeddings=512,
    tie_embeddings=False,
)
_STUDENT_FLAGS = (
    "--num-layers 4 --hidden-size 512 --num-attention-heads 8 --num-query-groups 4 "
    "--ffn-hidden-size 1536 --seq-length 512 --train-iters 2 --mock-data "
    "--eval-iters 0 --eval-interval 1000 --kd-teacher-load {teacher}"
)
BUILTIN_CASES = [
    ("colocated tp1 b4 s512", _STUDENT_FLAGS + " --micro-batch-size 4 --global-batch-size 4", 1),
    (
        "colocated tp2 b2 s512",
        _STUDENT_FLAGS + " --micro-batch-size 2 --global-batch-size 4 "
        "--tensor-model-parallel-size 2",
        2,
    ),
]

_MAKE_TEACHER_CODE = (
    "import json, sys\n"
    "from megatron_kd.megatron_cpu import install_cpu_shim\n"
    "install_cpu_shim()\n"
    "import torch.distributed as dist\n"
    "from megatron_kd.training.parallel import init_distributed_from_env, model_parallel\n"
    "from megatron_kd.models import GPTArchConfig, build_gpt_model, save_model_checkpoint\n"
    "init_distributed_from_env()\n"
    "arch = GPTArchConfig(**json.loads(sys.argv[2]))\n"
    "with model_parallel(tp=1):\n"
    "    save_model_checkpoint(build_gpt_model(arch, seed=1), arch, sys.argv[1])\n"
    "dist.destroy_process_group()\n"
)


def make_random_teacher(directory: str) -> None:
    """A megatron_kd checkpoint of a randomly initialised teacher (``_TEACHER_ARCH``)."""
    subprocess.run(
        [sys.executable, "-c", _MAKE_TEACHER_CODE, directory, json.dumps(_TEACHER_ARCH)], check=True
    )


@dataclass
class Case:
    """One training run to compare."""

    name: str
    train_args: str
    log_json: str | None
    nproc: int = 1


@dataclass
class Prediction:
    mode: str
    terms: dict
    wire_bytes_per_tp_rank: float | None
    wire_bytes_per_dp_rank: float | None


# --- the run's configuration, as megatron-kd train resolves it -----------------------------------


def resolve_run(train_args: str, world_size: int):
    """``(args, plan)`` exactly as ``megatron-kd train`` resolves them (no model is built)."""
    from megatron_kd.training.train import add_arguments, plan_run

    parser = argparse.ArgumentParser(prog="megatron-kd train")
    add_arguments(parser)
    args = parser.parse_args(shlex.split(train_args))
    return args, plan_run(args, world_size)


def arch_to_model(arch, name: str) -> ModelConfig:
    """A planner :class:`ModelConfig` from a ``megatron_kd.models.GPTArchConfig``; the vocabulary is
    the padded one (the planner then pads by 1, see :func:`predict`)."""
    heads = arch.num_attention_heads
    return ModelConfig(
        name=name,
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        num_attention_heads=heads,
        num_query_groups=arch.num_query_groups or heads,
        head_dim=arch.kv_channels or arch.hidden_size // heads,
        ffn_hidden_size=arch.ffn_hidden_size,
        vocab_size=arch.padded_vocab_size,
        tie_embeddings=arch.tie_embeddings,
        gated_linear_unit=arch.swiglu,
        attention_bias=arch.add_bias_linear,
        source="megatron-kd train plan_run",
    )


def predict(args, plan, on_cpu: bool) -> Prediction:
    """The planner's terms for the logging rank (stage 0) of the run."""
    import torch

    student = arch_to_model(plan.student_arch, "student")
    teacher = arch_to_model(plan.teacher_arch, "teacher") if plan.teacher_arch else student
    fp32 = plan.params_dtype == torch.float32
    precision = Precision(
        param_bytes=4 if fp32 else 2, grad_bytes=4, optimizer_bytes=8 if fp32 else 12
    )
    activation = ActivationOptions(
        flash_attention=not on_cpu,
        fused_norm=not on_cpu,
        fused_swiglu=not on_cpu,
        hidden_dropout=args.hidden_dropout > 0,
        attention_dropout=args.attention_dropout > 0,
        activation_bytes=4 if fp32 else 2,
    )
    kd_mode = plan.kd.mode
    if plan.teacher_arch is None:
        mode = "offline-cache"  # no teacher: the fused loss with the student's logits only
    else:
        mode = {
            "colocated": "colocated-fused",
            "disaggregated": "disaggregated",
            "offline": "offline-cache",
        }[kd_mode]
    gpu = GpuSpec(name="measured", memory_bytes=1 << 50, bf16_flops=1e12, nvlink_bytes_per_s=1e9)
    opts = PlanOptions(
        student=student,
        teacher=teacher,
        gpu=gpu,
        inter_node_link=LinkSpec(name="measured", bytes_per_s=1e9),
        gpus_per_node=plan.tp * plan.pp * plan.dp,
        nodes=1,
        seq_length=args.seq_length,
        micro_batch_size=args.micro_batch_size,
        global_batch_size=plan.global_batch_size,
        tp=plan.tp,
        pp=plan.pp,
        recompute="none",
        sequence_parallel=False,
        use_distributed_optimizer=False,
        window_size=plan.kd.window_size,
        precision=precision,
        activation=activation,
        reserve_bytes=0,
    )
    layout = mem.ParallelLayout(tp=plan.tp, pp=plan.pp, dp=plan.dp, make_vocab_size_divisible_by=1)
    teacher_layout = mem.ParallelLayout(
        tp=plan.tp, pp=1, dp=plan.dp, make_vocab_size_divisible_by=1
    )
    terms = student_stage_terms(
        opts, mode, layout, teacher_layout if mode.startswith("colocated") else None, 0
    )
    terms.pop(RESERVE_TERM, None)
    if plan.teacher_arch is None:
        terms.pop("cache reader", None)
    wire_tp = wire_dp = None
    if mode == "disaggregated":
        wire_dp = tr.hidden_bytes_per_step_per_dp_rank(
            teacher, plan.global_batch_size, plan.dp, args.seq_length, precision.param_bytes
        )
        wire_tp = wire_dp / plan.tp
    return Prediction(
        mode=mode, terms=terms, wire_bytes_per_tp_rank=wire_tp, wire_bytes_per_dp_rank=wire_dp
    )


# --- measurement --------------------------------------------------------------------------------


def measure_baseline() -> int:
    """Peak RSS of a process that only imports what ``megatron-kd train`` imports (CPU runs)."""
    proc = subprocess.run(
        [sys.executable, "-c", _BASELINE_CODE], capture_output=True, text=True, check=True
    )
    return int(proc.stdout.strip().splitlines()[-1])


def read_log(path: str) -> list[dict]:
    records = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if line:
                records.append(json.loads(line))
    steps = [r for r in records if "peak_mem_bytes" in r]
    if not steps:
        raise ValueError(f"{path}: no step records with peak_mem_bytes")
    return steps


def run_case(case: Case, log_path: str) -> None:
    """Run ``megatron-kd train`` for ``case`` (torchrun when ``nproc > 1``), logging to
    ``log_path``."""
    argv = shlex.split(case.train_args) + ["--log-json", log_path, "--no-progress"]
    if case.nproc > 1:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={case.nproc}",
            "-m",
            "megatron_kd",
            "train",
            *argv,
        ]
    else:
        cmd = [sys.executable, "-m", "megatron_kd", "train", *argv]
    subprocess.run(cmd, check=True)


# --- comparison ---------------------------------------------------------------------------------


def compare(case: Case, baseline: int | None, wire_key: str, wire_scope: str) -> dict:
    if case.log_json is None:
        raise ValueError(f"case {case.name!r}: no log (pass --log-json, or --run)")
    args, plan = resolve_run(case.train_args, case.nproc)
    steps = read_log(case.log_json)
    kinds = {r.get("peak_mem_kind") for r in steps}
    if len(kinds) != 1:
        raise ValueError(f"{case.log_json}: mixed peak_mem_kind {kinds}")
    kind = kinds.pop()
    on_cpu = kind == "cpu_max_rss"
    pred = predict(args, plan, on_cpu)
    predicted = sum(pred.terms.values())
    measured = max(r["peak_mem_bytes"] for r in steps)
    row = {
        "name": case.name,
        "mode": pred.mode,
        "kind": kind,
        "predicted_bytes": predicted,
        "measured_bytes": measured,
        "terms": pred.terms,
    }
    if on_cpu:
        if baseline is None:
            raise ValueError(
                "a CPU run needs the framework baseline (measured unless --baseline-bytes)"
            )
        row["baseline_bytes"] = baseline
        row["measured_minus_baseline"] = measured - baseline
        row["ratio"] = predicted / (measured - baseline)
        row["ratio_absolute"] = (predicted + baseline) / measured
    else:
        row["ratio"] = predicted / measured
    row["memory_ok"] = abs(row["ratio"] - 1) <= TOLERANCE
    if pred.wire_bytes_per_tp_rank is not None:
        if not all(wire_key in r for r in steps):
            raise ValueError(
                f"{case.log_json}: a disaggregated run must log {wire_key!r} every step"
            )
        expected = (
            pred.wire_bytes_per_tp_rank if wire_scope == "tp-rank" else pred.wire_bytes_per_dp_rank
        )
        counted = {r[wire_key] for r in steps}
        row["wire_predicted"] = expected
        row["wire_counted"] = sorted(counted)
        row["wire_ok"] = counted == {expected}
    return row


def format_rows(rows: list[dict]) -> str:
    gib = float(1 << 30)
    out = [
        f"{'run':<28}{'mode':<17}{'predicted GiB':>14}{'measured GiB':>14}{'baseline GiB':>14}"
        f"{'ratio':>8}{'abs.':>8}  within 15%  wire"
    ]
    for r in rows:
        base = r.get("baseline_bytes")
        wire = (
            "-"
            if "wire_ok" in r and r["wire_ok"] is None
            else (
                (
                    "equal"
                    if r["wire_ok"]
                    else f"DIFFERS {r['wire_predicted']} vs {r['wire_counted']}"
                )
                if "wire_ok" in r
                else "n/a"
            )
        )
        out.append(
            f"{r['name']:<28}{r['mode']:<17}{r['predicted_bytes'] / gib:>14.3f}"
            f"{r['measured_bytes'] / gib:>14.3f}{(base or 0) / gib:>14.3f}{r['ratio']:>8.3f}"
            f"{r.get('ratio_absolute', r['ratio']):>8.3f}  "
            f"{'yes' if r['memory_ok'] else 'NO':<11} {wire}"
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--train-args", help="the megatron-kd train flags of one run, quoted")
    parser.add_argument("--log-json", help="its --log-json file")
    parser.add_argument("--nproc", type=int, default=1, help="its process count (world size)")
    parser.add_argument("--cases", help="JSON list of {name, train_args, log_json, nproc}")
    parser.add_argument(
        "--run", action="store_true", help="run each case first (logs to a temp dir)"
    )
    parser.add_argument(
        "--builtin",
        action="store_true",
        help="the built-in CPU cases (with --run: a random teacher checkpoint is made)",
    )
    parser.add_argument(
        "--teacher-dir",
        help="teacher checkpoint of the built-in cases (default: made in the temp dir with --run)",
    )
    parser.add_argument(
        "--baseline-bytes",
        type=int,
        default=None,
        help="framework RSS baseline for CPU runs (default: measured)",
    )
    parser.add_argument(
        "--wire-bytes-key",
        default="kd_wire_bytes",
        help="per-step log field with the teacher -> student bytes a rank received",
    )
    parser.add_argument(
        "--wire-bytes-scope",
        choices=("tp-rank", "dp-rank"),
        default="tp-rank",
        help="what the counted bytes cover: one TP rank, or one DP rank's TP group",
    )
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = parser.parse_args(argv)

    tmp = tempfile.mkdtemp(prefix="validate_planner_") if args.run else None
    if args.builtin:
        teacher = args.teacher_dir
        if teacher is None:
            if not args.run:
                parser.error(
                    "--builtin without --run needs --teacher-dir and the logs (use --cases)"
                )
            teacher = os.path.join(tmp, "teacher")
            make_random_teacher(teacher)
        cases = [
            Case(name=name, train_args=flags.format(teacher=teacher), log_json=None, nproc=nproc)
            for name, flags, nproc in BUILTIN_CASES
        ]
    elif args.cases:
        with open(args.cases, encoding="utf-8") as f:
            cases = [
                Case(
                    name=c["name"],
                    train_args=c["train_args"],
                    log_json=c.get("log_json"),
                    nproc=int(c.get("nproc", 1)),
                )
                for c in json.load(f)
            ]
    elif args.train_args:
        cases = [
            Case(name="run", train_args=args.train_args, log_json=args.log_json, nproc=args.nproc)
        ]
    else:
        parser.error("give --train-args (and --log-json), --cases or --builtin")
    for case in cases:
        if args.run:
            case.log_json = os.path.join(tmp, f"{case.name.replace(' ', '_')}.jsonl")
            run_case(case, case.log_json)
    baseline = args.baseline_bytes
    rows = []
    for case in cases:
        needs_baseline = (
            baseline is None
            and case.log_json
            and read_log(case.log_json)[0].get("peak_mem_kind") == "cpu_max_rss"
        )
        if needs_baseline:
            baseline = measure_baseline()
        rows.append(compare(case, baseline, args.wire_bytes_key, args.wire_bytes_scope))
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print(format_rows(rows))
    return 0 if all(r["memory_ok"] and r.get("wire_ok", True) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
