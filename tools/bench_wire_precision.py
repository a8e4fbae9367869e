#!/usr/bin/env python
"""How much the wire's precision moves the loss, on the demo's real teacher (not a test).

The demo's teacher (SmolLM2-135M-Instruct, imported by ``megatron-kd demo`` into
``<demo dir>/teacher``) runs as a ``megatron-kd teacher serve`` replica (fp32 by default: most
CPUs without bf16 instructions run bf16 tens of times slower); the demo's student trains
against it with ``--kd-mode disaggregated`` on the demo's text, once per ``--kd-wire-dtype``
(fp32, bf16, fp8), from the same initialisation and on the same batches. fp32 on the wire is
the teacher's exact output, the reference. Reported per step: the KD, LM and total loss of each
wire and their relative deviation, fp8 against bf16 (the question: what does halving bf16's
bytes cost?) and each against fp32. Step 1 isolates the wire alone (same weights); later steps
add what training did with it.

Needs a finished ``megatron-kd demo`` (its teacher and its tokenized text); nothing else is
fetched. ``--smoke`` needs neither: a tiny random teacher and student on mock data, two steps
(that the tool runs end to end, not figures). Each student run is a process of its own;
``--in-process`` runs them one after another in the tool's own process instead (each
``megatron-kd train``'s own start-up and teardown, the same seed and batches), which saves the
interpreter and Megatron-Core start-up of each (CI's smoke run).

    python tools/bench_wire_precision.py --demo-dir demo_out --steps 10
    python tools/bench_wire_precision.py --smoke --out /tmp/wire.json --plot ""
    python tools/bench_wire_precision.py --smoke --in-process --out /tmp/wire.json --plot ""
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from megatron_kd.testing.replicas import Replica


def _demo_argv(demo_dir: str, steps: int, log: str, cache: str) -> list[str]:
    """The demo's KD student flags (its own defaults), one process, ``steps`` steps."""
    from megatron_kd.demo.run import add_arguments, student_train_argv

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--output-dir", demo_dir, "--train-iters", str(steps),
                              "--tensor-model-parallel-size", "1",
                              "--eval-interval", str(steps + 1), "--eval-iters", "0"])
    teacher = os.path.join(demo_dir, "teacher")
    return student_train_argv(args, data_prefix=os.path.join(demo_dir, "data", "corpus"),
                              tokenizer_file=os.path.join(teacher, "tokenizer.json"),
                              teacher_dir=teacher, log_json=log, cache_dir=cache)


#: --smoke: a tiny random teacher (its checkpoint made here) and student on mock data
SMOKE_TEACHER = {"num_layers": 1, "hidden_size": 32, "num_attention_heads": 2,
                 "num_query_groups": 2, "ffn_hidden_size": 64, "vocab_size": 256,
                 "padded_vocab_size": 256, "max_position_embeddings": 32, "tie_embeddings": True}
SMOKE_STUDENT = ["--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2",
                 "--ffn-hidden-size", "32", "--seq-length", "32", "--micro-batch-size", "1",
                 "--global-batch-size", "1", "--lr", "1e-3", "--lr-warmup-iters", "1",
                 "--mock-data", "--seed", "1234", "--eval-iters", "0"]


def _smoke_teacher(directory: str) -> None:
    """Save a random :data:`SMOKE_TEACHER` checkpoint in ``directory`` (a world of one)."""
    import torch.distributed as dist

    from megatron_kd.arch import GPTArchConfig
    from megatron_kd.integration.checkpoint import save_model_checkpoint
    from megatron_kd.integration.gpt import build_gpt_model
    from megatron_kd.integration.groups import init_distributed_from_env, model_parallel

    arch = GPTArchConfig(**SMOKE_TEACHER)
    created = init_distributed_from_env()
    try:
        with model_parallel(tp=1):
            save_model_checkpoint(build_gpt_model(arch, seed=5), arch, directory)
    finally:
        if created:
            dist.destroy_process_group()


def _smoke_argv(teacher: str, steps: int, log: str) -> list[str]:
    return [*SMOKE_STUDENT, "--train-iters", str(steps), "--kd-teacher-load", teacher,
            "--kd-teacher-dtype", "fp32", "--log-json", log]


def _train_in_process(argv: list[str]) -> None:
    """``megatron-kd train ARGV`` in this process (``--in-process``): one CPU thread, as the
    fresh process of the default gets from ``OMP_NUM_THREADS=1``."""
    import torch

    from megatron_kd.commands.train import parse_args, train

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        train(parse_args(argv))
    finally:
        torch.set_num_threads(threads)


def run_one(demo_dir: str, wire: str, steps: int, work: str, teacher_dtype: str,
            endpoint: str, *, smoke_teacher: str | None = None,
            in_process: bool = False) -> list[dict]:
    """One student run against the replica at ``endpoint`` with ``--kd-wire-dtype wire`` (the
    wire dtype is the connection's: one replica serves the three runs); in a process of its own,
    or in this one (``in_process``)."""
    d = os.path.join(work, wire)
    os.makedirs(d)
    teacher = smoke_teacher or os.path.join(demo_dir, "teacher")
    log = os.path.join(d, "student.jsonl")
    argv = (_smoke_argv(teacher, steps, log) if smoke_teacher else
            _demo_argv(demo_dir, steps, log, os.path.join(d, "cache")))
    argv[argv.index("--kd-teacher-dtype") + 1] = teacher_dtype
    argv += ["--kd-mode", "disaggregated", "--kd-teacher-endpoint", endpoint,
             "--kd-wire-dtype", wire, "--no-progress"]
    if in_process:
        _train_in_process(argv)
    else:
        env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
        subprocess.run([sys.executable, "-m", "megatron_kd", "train", *argv], check=True,
                       env=env, stdout=subprocess.DEVNULL)
    with open(log, encoding="utf-8") as f:
        return [r for r in (json.loads(line) for line in f if line.strip())
                if "kd_loss" in r and "step" in r]


def _deviation(rows_a: list[dict], rows_b: list[dict]) -> list[dict]:
    out = []
    for r, q in zip(rows_a, rows_b):
        row = {"step": r["step"]}
        for key in ("kd_loss", "lm_loss", "loss"):
            row[key] = abs(q[key] - r[key]) / abs(r[key])
        out.append(row)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--demo-dir", default="demo_out")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--teacher-dtype", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--out", default="bench_out/bench_wire_precision.json")
    p.add_argument("--plot", default="bench_out/bench_wire_precision.png")
    p.add_argument("--smoke", action="store_true",
                   help="a tiny random teacher and student on mock data instead of the demo's, "
                        "2 steps (--demo-dir and --steps are then ignored)")
    p.add_argument("--in-process", action="store_true",
                   help="run the student runs one after another in this process rather than "
                        "each in a fresh one (saves each run's interpreter and Megatron-Core "
                        "start-up)")
    a = p.parse_args(argv)
    if a.in_process:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # as the runs' own processes: on the CPU
    teacher = os.path.join(a.demo_dir, "teacher")
    if a.smoke:
        a.steps = 2
    elif not os.path.isfile(os.path.join(teacher, "model_config.json")):
        p.error(f"no demo teacher at {teacher}: run `megatron-kd demo --output-dir "
                f"{a.demo_dir}` first")
    t0 = time.perf_counter()
    runs = {}
    wires = ("fp32", "bf16", "fp8") if a.teacher_dtype == "fp32" else ("bf16", "fp8")
    with tempfile.TemporaryDirectory(prefix="bench_wire_precision_") as work:
        smoke_teacher = None
        if a.smoke:
            smoke_teacher = os.path.join(work, "teacher")
            _smoke_teacher(smoke_teacher)
        endpoint = os.path.join(work, "endpoint")
        replica = Replica(endpoint, smoke_teacher or teacher,
                          log=os.path.join(work, "replica.jsonl"),
                          extra=("--kd-teacher-timeout", "300", "--kd-teacher-dtype",
                                 a.teacher_dtype), start_timeout_s=300)
        try:
            for wire in wires:
                runs[wire] = run_one(a.demo_dir, wire, a.steps, work, a.teacher_dtype, endpoint,
                                     smoke_teacher=smoke_teacher, in_process=a.in_process)
                print(f"{wire}: {len(runs[wire])} steps", flush=True)
        finally:
            replica.stop()
    dev = {"fp8_vs_bf16": _deviation(runs["bf16"], runs["fp8"])}
    if "fp32" in runs:
        dev["bf16_vs_fp32"] = _deviation(runs["fp32"], runs["bf16"])
        dev["fp8_vs_fp32"] = _deviation(runs["fp32"], runs["fp8"])
    lines = ["| step | KD loss, " + " | KD loss, ".join(f"{w} wire" for w in wires)
             + " | " + " | ".join(f"KD rel. dev. {k.replace('_vs_', ' vs ')}" for k in dev)
             + " | total rel. dev. fp8 vs bf16 |",
             "|---|" + "---|" * (len(wires) + len(dev) + 1)]
    for i, r in enumerate(runs["bf16"]):
        if r["step"] in (1, 2) or r["step"] % 5 == 0:
            lines.append(f"| {r['step']} | "
                         + " | ".join(f"{runs[w][i]['kd_loss']:.5f}" for w in wires) + " | "
                         + " | ".join(f"{dev[k][i]['kd_loss']:.2e}" for k in dev)
                         + f" | {dev['fp8_vs_bf16'][i]['loss']:.2e} |")
    summary = {k: {"first_step_kd_loss": v[0]["kd_loss"],
                   "max_kd_loss": max(d["kd_loss"] for d in v),
                   "max_total_loss": max(d["loss"] for d in v)} for k, v in dev.items()}
    summary["bytes_per_step"] = {w: runs[w][0]["kd_wire_bytes"] for w in wires}
    summary["fp8_over_bf16_bytes"] = (summary["bytes_per_step"]["fp8"]
                                      / summary["bytes_per_step"]["bf16"])
    table = "\n".join(lines)
    print(table)
    f8 = summary["fp8_vs_bf16"]
    print(f"fp8 vs bf16 on the wire: KD loss {f8['first_step_kd_loss']:.2e} relative at step 1 "
          f"(the wire alone), at most {f8['max_kd_loss']:.2e} over {a.steps} steps; total loss "
          f"at most {f8['max_total_loss']:.2e}; fp8 sends {summary['fp8_over_bf16_bytes']:.3f}x "
          f"bf16's bytes")
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w") as f:
        json.dump({"config": vars(a), "summary": summary, "runs": runs, "deviation": dev,
                   "table_markdown": table, "wall_s": time.perf_counter() - t0}, f, indent=1)
    print(f"wrote {a.out}")
    if a.plot:
        try:
            import matplotlib
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            print("matplotlib is not installed: no plot")
            return 0
        fig, (ax_l, ax_d) = plt.subplots(1, 2, figsize=(11, 4))
        for w in wires:
            ax_l.plot([r["step"] for r in runs[w]], [r["kd_loss"] for r in runs[w]],
                      label=f"{w} wire")
        ax_l.set(xlabel="step", ylabel="KD loss", title="KD loss, demo teacher")
        ax_l.legend()
        for k, v in dev.items():
            ax_d.semilogy([d["step"] for d in v], [max(d["kd_loss"], 1e-12) for d in v],
                          label=k.replace("_vs_", " vs "))
        ax_d.set(xlabel="step", ylabel="relative deviation of the KD loss",
                 title="wire precision")
        ax_d.legend()
        fig.tight_layout()
        os.makedirs(os.path.dirname(a.plot) or ".", exist_ok=True)
        fig.savefig(a.plot, dpi=120)
        print(f"wrote {a.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
