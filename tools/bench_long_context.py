#!/usr/bin/env python
"""Benchmark long sequences with context parallelism on CPU (not a test). One piece: the runs,
their baselines and the loss's own measurement share one table.

Every run is ``megatron-kd train`` itself in fresh processes (one process for CP 1, a torchrun of
two for CP 2), a tiny student (2 layers, h 64, 1 attention head, micro-batch 1, one sequence per
step) distilled from a tiny random teacher of the same shape on mock data, fp32, a few steps, in
two modes: ``colocated`` (the teacher in the student's processes, context-parallel with them) and
``disaggregated`` (a ``megatron-kd teacher serve`` replica of one process at CP 1, its own world,
answering each student rank its positions).

The comparison: the same job (one sequence of ``s`` tokens per step) on one rank (CP 1) and split
over two (CP 2), per rank. CP 1 is not run as DP 2: two ranks of DP would each train a whole
sequence, so a CP 2 rank would hold half the tokens of a DP rank only per micro-batch; here both
layouts train the same sequences per step and each CP 2 rank does half of each. Step times
therefore compare one rank doing the step with two ranks sharing it, each process one CPU thread
(as ``tools/bench_disagg.py``; on this shared 2-core machine two OpenMP threads in one process
ran a CP 1 step several times slower than one); the machine has two cores shared with other
work, so times are indicative.

Measured, per run:

* peak memory per rank: the process's peak resident set size at exit (``ru_maxrss``, written by
  ``megatron_kd.testing.replicas``'s wrapper of the entry point), the largest over the ranks, with
  ``MALLOC_MMAP_THRESHOLD_=65536`` so that freed tensors leave the resident set (see
  ``tools/validate_planner.py``);
* the activation peak per rank: that peak less the peak of the same run (mode, CP size,
  processes) at a tiny sequence length (``--base-seq-length``, 256): what grows with the
  sequence (saved activations, the attention's scores, the loss's rows, a colocated teacher's
  forward), the framework, weights and optimizer state subtracted;
* step time: the median of the logged ``step_time_s`` after the first step;
* wire bytes per student rank (disaggregated): the per-step ``kd_wire_bytes`` (hidden states
  received, summed over the student's ranks by the run) over the student's ranks (each CP rank
  receives its ``s/cp`` positions), with ``megatron-kd plan``'s figure for one rank beside it;
* the fused loss's extra memory against the dense loss's, alone at each sequence length:
  ``tools/bench_loss.py`` (``fused_fkl``, ``dense_fkl``) with the student's hidden size and
  vocabulary, ``extra_peak_bytes`` (peak above the inputs).

Targets (the issue's): at the longest sequence CP 2 holds at most 0.6 x CP 1's activation peak per
rank, in both modes; the wire bytes per student rank at CP 2 are half CP 1's.

    python tools/bench_long_context.py --out docs/bench_long_context.json \
        --plot docs/bench_long_context.png    # docs/benchmarks.md's table (8 min, 2 cores)
    python tools/bench_long_context.py --seq-lengths 512 1024 --skip-loss   # a quick look
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from validate_planner import MEASURE_ENV, make_random_teacher

from megatron_kd.commands.plan_adapter import predict, resolve_run
from megatron_kd.testing.replicas import Replica, command, read_rank_peak

MODES = ("colocated", "disaggregated")
CP_SIZES = (1, 2)
GIB = float(1 << 30)


def teacher_arch(a) -> dict:
    """The teacher: the student's shape (``GPTArchConfig`` fields)."""
    return {"num_layers": a.layers, "hidden_size": a.hidden, "num_attention_heads": a.heads,
            "num_query_groups": a.heads, "ffn_hidden_size": 4 * a.hidden,
            "vocab_size": a.vocab, "padded_vocab_size": a.vocab,
            "max_position_embeddings": max(a.seq_lengths), "tie_embeddings": True}


def student_flags(a, seq: int, cp: int, teacher: str) -> list[str]:
    return ["--num-layers", str(a.layers), "--hidden-size", str(a.hidden),
            "--num-attention-heads", str(a.heads), "--num-query-groups", str(a.heads),
            "--ffn-hidden-size", str(4 * a.hidden), "--seq-length", str(seq),
            "--max-position-embeddings", str(max(a.seq_lengths)),
            "--micro-batch-size", "1", "--global-batch-size", "1",
            "--train-iters", str(a.steps), "--lr", "1e-4", "--lr-warmup-iters", "1",
            "--mock-data", "--no-progress", "--eval-iters", "0", "--eval-interval", "1000000",
            "--seed", str(a.seed), "--kd-teacher-load", teacher, "--kd-ce-weight", "0.1",
            "--context-parallel-size", str(cp)]


def _read_log(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [r for r in (json.loads(line) for line in f if line.strip()) if "step" in r
                and "step_time_s" in r]


def run_one(a, workdir: str, teacher: str, mode: str, seq: int, cp: int) -> dict:
    """One ``megatron-kd train`` run (and, disaggregated, its replica): peaks, times, bytes."""
    d = os.path.join(workdir, f"{mode}_s{seq}_cp{cp}")
    os.makedirs(d)
    log, peaks = os.path.join(d, "train.jsonl"), os.path.join(d, "peaks")
    os.makedirs(peaks)
    flags = student_flags(a, seq, cp, teacher)
    env = dict(os.environ, **MEASURE_ENV)
    env["OMP_NUM_THREADS"] = str(a.threads)  # per process
    replica = None
    if mode == "disaggregated":
        endpoint = os.path.join(d, "endpoint")
        flags += ["--kd-mode", "disaggregated", "--kd-teacher-endpoint", endpoint]
        os.makedirs(os.path.join(d, "replica_peaks"))
        replica = Replica(endpoint, teacher, log=os.path.join(d, "replica.jsonl"),
                          stats_interval=None, peak_dir=os.path.join(d, "replica_peaks"),
                          env=env, start_timeout_s=600)
    t0 = time.perf_counter()
    try:
        with open(os.path.join(d, "stderr"), "w") as stderr:
            done = subprocess.run(command("megatron_kd", ["train", *flags, "--log-json", log], cp,
                                          peak_dir=peaks), env=env, stdout=subprocess.DEVNULL,
                                  stderr=stderr, check=False)
    finally:
        if replica is not None:
            replica.stop(timeout_s=120.0)
    if done.returncode:
        with open(os.path.join(d, "stderr")) as f:
            tail = f.read()[-3000:]
        raise RuntimeError(f"{mode} s={seq} cp={cp} exited with {done.returncode}:\n{tail}")
    wall = time.perf_counter() - t0
    steps = _read_log(log)
    rank_peaks = [read_rank_peak(peaks, r) for r in range(cp)]
    point = {"mode": mode, "seq_length": seq, "cp": cp, "ranks": cp, "wall_s": wall,
             # the machine's 1-minute load average at the end: other work on the cores
             "load_average": os.getloadavg()[0],
             "peak_rss_bytes_per_rank": rank_peaks, "peak_rss_bytes": max(rank_peaks),
             "step_times_s": [r["step_time_s"] for r in steps],
             "step_time_s": statistics.median(r["step_time_s"] for r in steps[1:]),
             "tokens_per_step": seq}
    if replica is not None:
        point["replica_peak_rss_bytes"] = read_rank_peak(os.path.join(d, "replica_peaks"), 0)
        counted = {r["kd_wire_bytes"] for r in steps}
        if len(counted) != 1:
            raise RuntimeError(f"{log}: kd_wire_bytes differs between steps: {sorted(counted)}")
        point["wire_bytes_per_step"] = counted.pop()
        point["wire_bytes_per_student_rank"] = point["wire_bytes_per_step"] / cp
        config, run = resolve_run(" ".join(flags), cp)
        point["planner_wire_bytes_per_student_rank"] = predict(config, run, True).wire["tp-rank"]
    return point


def loss_memory(a, workdir: str) -> list[dict]:
    """``tools/bench_loss.py``'s fused and dense forward KL alone at each sequence length."""
    out = os.path.join(workdir, "bench_loss.json")
    tool = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench_loss.py")
    subprocess.run([sys.executable, tool, "--tokens", *map(str, a.seq_lengths), "--tp", "1",
                    "--variants", "fused_fkl", "dense_fkl", "--vocab", str(a.vocab),
                    "--h-s", str(a.hidden), "--h-t", str(a.hidden), "--repeats", "1",
                    "--threads", str(a.threads), "--out", out, "--plot", ""], check=True)
    with open(out) as f:
        points = json.load(f)["points"]
    return [{"variant": p["variant"], "seq_length": p["tokens"], "status": p["status"],
             "extra_peak_bytes": p.get("extra_peak_bytes"), "time_s": p.get("time_s")}
            for p in points]


def loss_growth(loss: list[dict]) -> dict:
    """Each loss's extra peak at the longest sequence over that at the shortest (1.0: flat)."""
    out = {}
    for variant in ("fused_fkl", "dense_fkl"):
        pts = sorted((p["seq_length"], p["extra_peak_bytes"]) for p in loss
                     if p["variant"] == variant and p["status"] == "ok"
                     and p["extra_peak_bytes"] is not None)
        if len(pts) > 1:
            out[variant] = {"from": pts[0][0], "to": pts[-1][0],
                            "growth": pts[-1][1] / pts[0][1]}
    return out


def summarise(a, points: list[dict]) -> dict:
    """Activation peaks (less the base run's), the CP 2 / CP 1 ratios and the targets."""
    by = {(p["mode"], p["seq_length"], p["cp"]): p for p in points}
    for p in points:
        base = by[(p["mode"], a.base_seq_length, p["cp"])]
        p["activation_peak_bytes"] = p["peak_rss_bytes"] - base["peak_rss_bytes"]
    longest = max(a.seq_lengths)
    out: dict = {"longest": longest, "per_mode": {}}
    for mode in a.modes:
        one, two = by[(mode, longest, 1)], by[(mode, longest, 2)]
        ratio = two["activation_peak_bytes"] / one["activation_peak_bytes"]
        entry = {"activation_ratio": ratio, "activation_target_met": ratio <= 0.6}
        if mode == "disaggregated":
            wire = two["wire_bytes_per_student_rank"] / one["wire_bytes_per_student_rank"]
            entry.update(wire_ratio=wire, wire_target_met=wire == 0.5)
        out["per_mode"][mode] = entry
    return out


def _gib(b) -> str:
    return "-" if b is None else f"{b / GIB:.3f}"


def table(a, points: list[dict]) -> str:
    by = {(p["mode"], p["seq_length"], p["cp"]): p for p in points}
    lines = [("| mode | tokens | CP | peak RSS GiB/rank | activation peak GiB/rank | CP 2 / CP 1 "
              "| step s (median) | wire bytes/step/student rank (run, plan) | CP 2 / CP 1 |"),
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for mode in a.modes:
        for seq in a.seq_lengths:
            for cp in CP_SIZES:
                p = by[(mode, seq, cp)]
                one = by[(mode, seq, 1)]
                act = (f"{p['activation_peak_bytes'] / one['activation_peak_bytes']:.2f}"
                       if cp == 2 else "")
                wire = wire_ratio = ""
                per_rank = p.get("wire_bytes_per_student_rank")
                if per_rank is not None:
                    wire = f"{per_rank:,.0f} ({p['planner_wire_bytes_per_student_rank']:,.0f})"
                    if cp == 2:
                        wire_ratio = f"{per_rank / one['wire_bytes_per_student_rank']:.2f}"
                lines.append(f"| {mode} | {seq} | {cp} | {_gib(p['peak_rss_bytes'])} | "
                             f"{_gib(p['activation_peak_bytes'])} | {act} | "
                             f"{p['step_time_s']:.2f} | {wire} | {wire_ratio} |")
    return "\n".join(lines)


def loss_table(loss: list[dict]) -> str:
    by = {(p["variant"], p["seq_length"]): p for p in loss}
    seqs = sorted({p["seq_length"] for p in loss})
    lines = ["| tokens | fused loss extra MiB | dense loss extra MiB |", "|---:|---:|---:|"]
    for s in seqs:
        cells = []
        for v in ("fused_fkl", "dense_fkl"):
            p = by.get((v, s))
            cells.append("-" if p is None or p["extra_peak_bytes"] is None
                         else f"{p['extra_peak_bytes'] / 2**20:.0f}")
        lines.append(f"| {s} | {cells[0]} | {cells[1]} |")
    return "\n".join(lines)


def plot(a, points: list[dict], loss: list[dict], path: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot", file=sys.stderr)
        return False
    by = {(p["mode"], p["seq_length"], p["cp"]): p for p in points}
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for mode, style in zip(a.modes, ("-", "--"), strict=False):
        for cp, color in zip(CP_SIZES, ("tab:red", "tab:blue"), strict=True):
            xs = a.seq_lengths
            axes[0].plot(xs, [by[(mode, s, cp)]["activation_peak_bytes"] / GIB for s in xs],
                         style, color=color, marker="o", label=f"{mode}, CP {cp}")
            axes[1].plot(xs, [by[(mode, s, cp)]["step_time_s"] for s in xs], style,
                         color=color, marker="o", label=f"{mode}, CP {cp}")
    axes[0].set(xlabel="tokens per sequence", ylabel="GiB per rank",
                title="activation peak per rank (peak RSS - tiny-sequence run)")
    axes[1].set(xlabel="tokens per sequence", ylabel="s", title="step time (median)")
    for ax in axes[:2]:
        ax.set_xscale("log", base=2)
        ax.legend(fontsize=8)
    if loss:
        for v, color in (("fused_fkl", "tab:green"), ("dense_fkl", "tab:gray")):
            pts = sorted((p["seq_length"], p["extra_peak_bytes"]) for p in loss
                         if p["variant"] == v and p["extra_peak_bytes"] is not None)
            axes[2].plot([x for x, _ in pts], [y / 2**20 for _, y in pts], marker="o",
                         color=color, label=v.replace("_fkl", " forward KL"))
        axes[2].set(xlabel="tokens", ylabel="MiB", title="the loss alone: extra peak memory")
        axes[2].set_xscale("log", base=2)
        axes[2].legend(fontsize=8)
    else:
        axes[2].axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def machine() -> dict:
    """What ran it: the CPU model and cores (lscpu), memory, the date."""
    info = {"date": datetime.date.today().isoformat(), "cpu_count": os.cpu_count(),
            "platform": platform.platform()}
    if shutil.which("lscpu"):
        text = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        for line in text.splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("Model name", "CPU(s)", "Thread(s) per core", "L3 cache"):
                info[key.strip()] = value.strip()
    try:
        with open("/proc/meminfo") as f:
            info["MemTotal"] = f.readline().split(":")[1].strip()
    except OSError:
        pass
    return info


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq-lengths", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
    p.add_argument("--base-seq-length", type=int, default=256,
                   help="the tiny sequence whose run's peak is subtracted (activation peak)")
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--heads", type=int, default=1,
                   help="attention heads (the CPU's attention keeps [heads, s/cp, s] scores)")
    p.add_argument("--vocab", type=int, default=8192, help="a multiple of 128: no padding")
    p.add_argument("--steps", type=int, default=2,
                   help="steps per run (the first is left out of the step time: at 16K tokens "
                   "a CP 1 step is about a minute on one core)")
    p.add_argument("--threads", type=int, default=1, help="CPU threads per process")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--skip-loss", action="store_true", help="leave out the loss-alone rows")
    p.add_argument("--out", default="bench_out/bench_long_context.json")
    p.add_argument("--plot", default="bench_out/bench_long_context.png")
    a = p.parse_args(argv)
    if a.steps < 2:
        p.error("--steps must be >= 2 (the first step is left out of the median)")
    if any(s % 4 or s <= a.base_seq_length for s in a.seq_lengths) or a.base_seq_length % 4:
        p.error("sequence lengths must split in 2 x CP 2 chunks (multiples of 4) and exceed "
                "--base-seq-length")

    t_start = time.perf_counter()
    points = []
    with tempfile.TemporaryDirectory(prefix="bench_long_context_") as tmp:
        teacher = os.path.join(tmp, "teacher")
        make_random_teacher(teacher, teacher_arch(a))
        for mode in a.modes:
            for seq in [a.base_seq_length, *a.seq_lengths]:
                for cp in CP_SIZES:
                    pt = run_one(a, tmp, teacher, mode, seq, cp)
                    points.append(pt)
                    print(f"{mode} s={seq} cp={cp}: peak {_gib(pt['peak_rss_bytes'])} GiB/rank, "
                          f"step {pt['step_time_s']:.2f} s ({pt['wall_s']:.0f} s wall)",
                          flush=True)
        loss = [] if a.skip_loss else loss_memory(a, tmp)
    summary = summarise(a, points)
    summary["loss_growth"] = loss_growth(loss)
    kept = [pt for pt in points if pt["seq_length"] != a.base_seq_length]
    text = table(a, kept)
    print()
    print(text)
    if loss:
        print()
        print(loss_table(loss))
    for mode, entry in summary["per_mode"].items():
        line = (f"{mode} at {summary['longest']} tokens: CP 2 / CP 1 activation peak per rank "
                f"{entry['activation_ratio']:.2f} (target <= 0.6: "
                f"{'met' if entry['activation_target_met'] else 'NOT met'})")
        if "wire_ratio" in entry:
            line += (f"; wire bytes per student rank {entry['wire_ratio']:.3f} (target 0.5: "
                     f"{'met' if entry['wire_target_met'] else 'NOT met'})")
        print(line)
    for variant, g in summary["loss_growth"].items():
        print(f"{variant}: extra peak x{g['growth']:.2f} from {g['from']} to {g['to']} tokens "
              f"(x{g['to'] / g['from']:.0f} the tokens)")
    info = machine()
    print(f"{info.get('Model name', '?')}, {info.get('CPU(s)', '?')} CPUs, "
          f"{info.get('MemTotal', '?')}, {info['date']}")
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w") as f:
        json.dump({"config": vars(a), "machine": info, "points": points, "loss": loss,
                   "summary": summary, "table_markdown": text,
                   "loss_table_markdown": loss_table(loss) if loss else None,
                   "wall_s": time.perf_counter() - t_start}, f, indent=1)
    print(f"wrote {a.out}")
    if a.plot:
        os.makedirs(os.path.dirname(a.plot) or ".", exist_ok=True)
        if plot(a, kept, loss, a.plot):
            print(f"wrote {a.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
