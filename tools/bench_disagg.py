#!/usr/bin/env python
"""Benchmark the disaggregated teacher against colocated distillation (not a test).

One teacher process and one student process, one CPU thread each, gloo over a ``file://``
store. Every run is ``megatron-kd train`` itself (``megatron_kd.training.train.train``) on mock
data, in fresh processes:

* ``colocated``: world 1; the teacher's forward, then the student's step, in one process
  (``--kd-mode colocated``). The teacher's ``forward`` is timed in place: that is the
  *teacher forward* time ``T`` (alone on its core).
* ``student alone``: as ``colocated`` but the teacher's forward returns the hidden states of
  its first call (memoised): the student's full step with the KD loss (teacher projection
  included), without the teacher's layers: the *student step* time ``S``.
* ``disaggregated D=1, 2, 4``: world 2, student rank 0 and teacher rank 1
  (``--kd-mode disaggregated --kd-teacher-world-size 1 --kd-prefetch-depth D``). The teacher's
  forward time, its time blocked on sends (backpressure) and the student's time waiting for
  the wire are recorded too, to tell contention from waiting.

Where the time went: per step, the student's main thread's on-CPU time and run-queue wait
(ready to run while another process had the core; Linux ``/proc/thread-self/schedstat``). A
machine check first times a single-threaded GEMM loop alone and with a second copy running: on
a small or shared machine two busy processes slow each other down, and that slowdown, not the
wire, is then what separates the disaggregated step from max(T, S).

Step times are the JSON log's ``step_time_s`` (student rank 0); each run reports the median
over the steps after ``--warmup``. The target of the issue is that with ``D >= 2`` the step
time is at most 1.05 x max(T, S): the teacher's cost hidden behind the student's (or the other
way round). The wire bytes per token are ``kd_wire_bytes / (global batch x sequence)`` and must
be exactly ``4 * h_t`` (fp32 on CPU).

    python tools/bench_disagg.py                 # the default table (a few minutes on 2 cores)
    python tools/bench_disagg.py --steps 20 --depths 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time


# ---------------------------------------------------------------------------------------------
# worker side (one process per rank)
# ---------------------------------------------------------------------------------------------
def _timed_forward(module, sink: list, *, memoize: bool = False) -> None:
    """Record the wall time of every ``module(...)`` call in ``sink``; with ``memoize`` every
    call after the first returns the first call's output (the module's work is skipped)."""
    inner = module.forward
    cache: list = []

    def forward(*args, **kwargs):
        t0 = time.perf_counter()
        if memoize and cache:
            out = cache[0]
        else:
            out = inner(*args, **kwargs)
            if memoize:
                cache.append(out)
        sink.append(time.perf_counter() - t0)
        return out

    module.forward = forward  # nn.Module.__call__ looks the instance attribute up first


def _timed_method(cls, name: str, sink: list) -> None:
    inner = getattr(cls, name)

    def method(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return inner(self, *args, **kwargs)
        finally:
            sink.append(time.perf_counter() - t0)

    setattr(cls, name, method)


def _schedstat() -> tuple[float, float]:
    """``(on-CPU s, runnable-but-waiting-for-a-CPU s)`` of this thread so far (Linux
    ``/proc/thread-self/schedstat``; zeros elsewhere)."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            on_cpu_ns, run_queue_ns = f.read().split()[:2]
        return int(on_cpu_ns) / 1e9, int(run_queue_ns) / 1e9
    except (OSError, ValueError):
        return 0.0, 0.0


def _timed_steps(cls, name: str, stats: dict) -> None:
    """Per call of ``cls.name``: this thread's on-CPU time and run-queue wait (the time it was
    ready to run but another process had the core)."""
    inner = getattr(cls, name)

    def method(self, *args, **kwargs):
        cpu0, queue0 = _schedstat()
        try:
            return inner(self, *args, **kwargs)
        finally:
            cpu1, queue1 = _schedstat()
            stats["on_cpu_s"].append(cpu1 - cpu0)
            stats["run_queue_s"].append(queue1 - queue0)

    setattr(cls, name, method)


def _instrument(kind: str) -> dict:
    """Timers on this process's teacher forward, sends and receives (this process only)."""
    from megatron_kd.teacher import ring, server, wire
    from megatron_kd.training import disaggregated
    from megatron_kd.training import trainer as train_mod

    stats: dict[str, list] = {"teacher_forward_s": [], "teacher_blocked_s": [],
                              "teacher_serve_s": [], "student_wire_wait_s": [],
                              "on_cpu_s": [], "run_queue_s": []}
    _timed_steps(train_mod.Trainer, "train_step", stats)  # student: per step
    _timed_steps(server.TeacherServer, "serve", stats)  # teacher: the whole run
    if kind in ("colocated", "student_alone"):
        build_teacher = train_mod.Trainer._build_teacher

        def patched_build_teacher(self):
            build_teacher(self)
            if self.teacher is not None:
                _timed_forward(self.teacher, stats["teacher_forward_s"],
                               memoize=kind == "student_alone")

        train_mod.Trainer._build_teacher = patched_build_teacher
    else:
        build_frozen = disaggregated.build_frozen_teacher

        def patched_build_frozen(*args, **kwargs):
            model = build_frozen(*args, **kwargs)
            _timed_forward(model, stats["teacher_forward_s"])
            return model

        disaggregated.build_frozen_teacher = patched_build_frozen
        _timed_method(server.TeacherServer, "serve", stats["teacher_serve_s"])
        # waiting for the previous message's receive to be posted: backpressure
        _timed_method(wire.HiddenSender, "wait", stats["teacher_blocked_s"])
        # header + payload wait and header check: the student waiting for the teacher
        _timed_method(ring.PrefetchRing, "get", stats["student_wire_wait_s"])
    return stats


def _worker(rank: int, kind: str, world: int, tmp: str, payload: dict) -> None:
    import warnings

    import torch
    import torch.distributed as dist

    warnings.simplefilter("ignore")  # Megatron-Core's deprecation and Apex notices, per process
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank,
                            world_size=world)
    try:
        if kind == "make_teacher":
            from megatron_kd.integration.arch import GPTArchConfig
            from megatron_kd.integration.gpt import build_gpt_model
            from megatron_kd.integration.checkpoint import save_model_checkpoint
            from megatron_kd.integration.groups import model_parallel

            arch = GPTArchConfig(**payload["arch"])
            with model_parallel(tp=1):
                save_model_checkpoint(build_gpt_model(arch, seed=payload["seed"]), arch,
                                      payload["directory"])
            result: dict = {}
        else:
            from megatron_kd.training.train import parse_args, train

            stats = _instrument(kind)
            summary = train(parse_args(payload["argv"]))
            result = {"side": summary.get("side", "student"), "stats": stats}
            if result["side"] == "teacher":
                result.update(bytes_sent=summary["bytes_sent"],
                              messages_sent=summary["messages_sent"])
        with open(os.path.join(tmp, f"result.{rank}"), "w") as f:
            json.dump(result, f)
    finally:
        dist.destroy_process_group()


def _gemm_probe(rank: int, tmp: str, iters: int) -> None:
    """A fixed single-threaded GEMM loop (model-like shapes); writes its wall time."""
    import torch

    torch.set_num_threads(1)
    x = torch.randn(512, 512)
    w = torch.randn(512, 2048)
    (x @ w).sum()  # warm-up
    t0 = time.perf_counter()
    for _ in range(iters):
        (x @ w).relu_() @ w.t()
    with open(os.path.join(tmp, f"probe.{rank}"), "w") as f:
        f.write(str(time.perf_counter() - t0))


def contention_probe(iters: int) -> dict:
    """The same GEMM loop in 1 process, then in 2 at once: how much two single-threaded
    processes slow each other down on this machine (shared cores, caches, memory bandwidth)."""
    import torch.multiprocessing as mp

    out = {}
    for n in (1, 2):
        tmp = tempfile.mkdtemp(prefix="bench_disagg_probe_")
        mp.spawn(_gemm_probe, args=(tmp, iters), nprocs=n, join=True)
        times = []
        for r in range(n):
            with open(os.path.join(tmp, f"probe.{r}")) as f:
                times.append(float(f.read()))
        out[f"gemm_loop_{n}_process_s"] = max(times)
    out["slowdown_2_processes"] = out["gemm_loop_2_process_s"] / out["gemm_loop_1_process_s"]
    return out


# ---------------------------------------------------------------------------------------------
# driver side
# ---------------------------------------------------------------------------------------------
def _spawn(kind: str, world: int, payload: dict) -> tuple[list[dict], str]:
    """Run ``kind`` on ``world`` fresh processes; returns their results and the run's dir."""
    import torch.multiprocessing as mp

    tmp = tempfile.mkdtemp(prefix="bench_disagg_")
    mp.spawn(_worker, args=(kind, world, tmp, payload), nprocs=world, join=True)
    results = []
    for r in range(world):
        with open(os.path.join(tmp, f"result.{r}")) as f:
            results.append(json.load(f))
    return results, tmp


def teacher_arch(a) -> dict:
    return {"num_layers": a.teacher_layers, "hidden_size": a.teacher_hidden,
            "num_attention_heads": a.teacher_heads, "num_query_groups": None,
            "ffn_hidden_size": a.teacher_ffn or 4 * a.teacher_hidden,
            "vocab_size": a.vocab, "padded_vocab_size": a.vocab,
            "max_position_embeddings": a.seq_length, "tie_embeddings": True}


def student_argv(a, teacher_dir: str, log: str) -> list[str]:
    return ["--num-layers", str(a.student_layers), "--hidden-size", str(a.student_hidden),
            "--num-attention-heads", str(a.student_heads),
            "--ffn-hidden-size", str(a.student_ffn or 4 * a.student_hidden),
            "--seq-length", str(a.seq_length), "--micro-batch-size", str(a.micro_batch_size),
            "--global-batch-size", str(a.micro_batch_size * a.microbatches),
            "--train-iters", str(a.steps), "--lr", "1e-4", "--lr-warmup-iters", "1",
            "--mock-data", "--no-progress", "--eval-iters", "0", "--eval-interval", "1000000",
            "--seed", str(a.seed), "--kd-teacher-load", teacher_dir, "--kd-ce-weight", "0.1",
            "--kd-teacher-timeout", str(a.teacher_timeout), "--log-json", log]


def _per_step(values: list[float], per_step: int) -> list[float]:
    """Sum consecutive groups of ``per_step`` values (microbatches -> steps)."""
    return [sum(values[i:i + per_step]) for i in range(0, len(values) - per_step + 1, per_step)]


def _median_after(values: list[float], warmup: int) -> float | None:
    kept = values[warmup:]
    return statistics.median(kept) if kept else None


def _run(a, name: str, kind: str, depth: int | None, teacher_dir: str) -> dict:
    log_dir = tempfile.mkdtemp(prefix="bench_disagg_log_")
    log = os.path.join(log_dir, "log.jsonl")
    argv = student_argv(a, teacher_dir, log)
    world = 1
    if kind == "disaggregated":
        world = 2
        argv += ["--kd-mode", "disaggregated", "--kd-teacher-world-size", "1",
                 "--kd-prefetch-depth", str(depth)]
    t0 = time.perf_counter()
    results, _ = _spawn(kind, world, {"argv": argv})
    wall = time.perf_counter() - t0
    with open(log, encoding="utf-8") as f:
        records = [json.loads(line) for line in f if line.strip()]
    steps = [r for r in records if "step_time_s" in r]
    step_times = [r["step_time_s"] for r in steps]
    student = next(r for r in results if r["side"] == "student")
    teacher = next((r for r in results if r["side"] == "teacher"), None)
    m = a.microbatches
    point = {"name": name, "kind": kind, "depth": depth, "world_size": world, "wall_s": wall,
             "step_times_s": step_times,
             "step_time_s": _median_after(step_times, a.warmup),
             "student_on_cpu_s": _median_after(student["stats"]["on_cpu_s"], a.warmup),
             "student_run_queue_s": _median_after(student["stats"]["run_queue_s"], a.warmup)}
    if kind in ("colocated", "student_alone"):
        fwd = _per_step(student["stats"]["teacher_forward_s"], m)
        point["teacher_forward_per_step_s"] = fwd
        point["teacher_forward_s"] = _median_after(fwd, a.warmup)
    else:
        tokens = a.micro_batch_size * m * a.seq_length
        wire = [r["kd_wire_bytes"] for r in steps]
        wait = _per_step(student["stats"]["student_wire_wait_s"], m)
        fwd = _per_step(teacher["stats"]["teacher_forward_s"], m)
        point.update(
            kd_wire_bytes_per_step=wire,
            wire_bytes_per_token=(wire[0] / tokens) if wire and len(set(wire)) == 1 else None,
            teacher_bytes_sent=teacher["bytes_sent"],
            student_wire_wait_per_step_s=wait,
            student_wire_wait_s=_median_after(wait, a.warmup),
            student_compute_s=_median_after(
                [s - w for s, w in zip(step_times, wait)], a.warmup),
            teacher_forward_per_step_s=fwd,
            teacher_forward_s=_median_after(fwd, a.warmup),
            teacher_blocked_total_s=sum(teacher["stats"]["teacher_blocked_s"]),
            teacher_on_cpu_per_step_s=sum(teacher["stats"]["on_cpu_s"]) / a.steps,
            teacher_run_queue_per_step_s=sum(teacher["stats"]["run_queue_s"]) / a.steps,
            # the teacher's own work per step (forward, schedule, sends), blocked time excluded
            teacher_busy_per_step_s=(sum(teacher["stats"]["teacher_serve_s"])
                                     - sum(teacher["stats"]["teacher_blocked_s"])) / a.steps)
    return point


def _fmt(x, digits: int = 3) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def summarise(a, points: list[dict]) -> dict:
    by = {p["name"]: p for p in points}
    t = by["colocated"]["teacher_forward_s"]
    s = by["student_alone"]["step_time_s"]
    bound = max(t, s)
    h_t = a.teacher_hidden
    for p in points:
        p["x_max_teacher_student"] = p["step_time_s"] / bound
    disagg = [p for p in points if p["kind"] == "disaggregated"]
    wire = {p["wire_bytes_per_token"] for p in disagg}
    target = [p for p in disagg if p["depth"] >= 2]
    return {
        "teacher_forward_s": t, "student_step_s": s, "max_teacher_student_s": bound,
        "wire_bytes_per_token": wire.pop() if len(wire) == 1 else sorted(wire, key=str),
        "wire_bytes_per_token_expected": 4 * h_t,
        "wire_bytes_exact": all(p["wire_bytes_per_token"] == 4 * h_t for p in disagg),
        "target_ratio": 1.05,
        "target_met": bool(target) and all(p["x_max_teacher_student"] <= 1.05 for p in target),
    }


def table(points: list[dict], summary: dict) -> str:
    """Step times, and where the student's (and teacher's) wall time went: waiting for the
    wire, on a CPU, or ready to run while another process had the core (run queue)."""
    bound = summary["max_teacher_student_s"]
    rows = [("| run | step time s (median) | x max(T, S) | student wire wait s/step | "
             "student on-CPU s/step | student run-queue s/step | teacher forward s/step | "
             "teacher run-queue s/step |"),
            "|---|---|---|---|---|---|---|---|",
            (f"| teacher forward alone (T) | {_fmt(summary['teacher_forward_s'])} | "
             f"{_fmt(summary['teacher_forward_s'] / bound, 2)} | | | | | |"),
            (f"| student step alone (S) | {_fmt(summary['student_step_s'])} | "
             f"{_fmt(summary['student_step_s'] / bound, 2)} | | | | | |")]
    for p in points:
        if p["kind"] == "student_alone":
            continue
        head = (f"{_fmt(p['step_time_s'])} | {_fmt(p['x_max_teacher_student'], 2)}")
        if p["kind"] == "colocated":
            rows.append(f"| colocated (teacher then student, 1 process) | {head} | | "
                        f"{_fmt(p['student_on_cpu_s'])} | {_fmt(p['student_run_queue_s'])} | "
                        f"{_fmt(p['teacher_forward_s'])} | |")
            continue
        rows.append(f"| disaggregated, prefetch depth {p['depth']} | {head} | "
                    f"{_fmt(p['student_wire_wait_s'])} | {_fmt(p['student_on_cpu_s'])} | "
                    f"{_fmt(p['student_run_queue_s'])} | {_fmt(p['teacher_forward_s'])} | "
                    f"{_fmt(p['teacher_run_queue_per_step_s'])} |")
    return "\n".join(rows)


def plot(a, points: list[dict], summary: dict, path: str) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)")
        return False
    fig, (ax_b, ax_s) = plt.subplots(1, 2, figsize=(12, 4.4))
    labels = ["teacher fwd\nalone (T)", "student step\nalone (S)"]
    values = [summary["teacher_forward_s"], summary["student_step_s"]]
    colors = ["tab:gray", "tab:gray"]
    for p in points:
        if p["kind"] == "colocated":
            labels.append("colocated")
            colors.append("tab:red")
        elif p["kind"] == "disaggregated":
            labels.append(f"disagg\nD={p['depth']}")
            colors.append("tab:blue")
        else:
            continue
        values.append(p["step_time_s"])
    ax_b.bar(range(len(values)), values, color=colors)
    ax_b.set_xticks(range(len(values)), labels, fontsize=8)
    bound = summary["max_teacher_student_s"]
    ax_b.axhline(bound, color="k", ls="--", lw=1, label="max(T, S)")
    ax_b.axhline(1.05 * bound, color="k", ls=":", lw=1, label="target 1.05 x max(T, S)")
    ax_b.set(ylabel="seconds per step (median)", title="step time")
    ax_b.legend(fontsize=8)
    for p in points:
        if p["kind"] == "student_alone":
            continue
        label = "colocated" if p["kind"] == "colocated" else f"disagg D={p['depth']}"
        ax_s.plot(range(1, len(p["step_times_s"]) + 1), p["step_times_s"], marker="o", ms=3,
                  label=label)
    ax_s.axvline(a.warmup + 0.5, color="k", lw=0.8, ls=":")
    ax_s.set(xlabel="step", ylabel="step_time_s", title="per step (dotted: end of warm-up)")
    ax_s.legend(fontsize=8)
    ax_s.grid(True, alpha=0.3)
    fig.suptitle(f"teacher {a.teacher_layers}L h{a.teacher_hidden}, student {a.student_layers}L "
                 f"h{a.student_hidden}, V {a.vocab}, seq {a.seq_length}, micro batch "
                 f"{a.micro_batch_size} x {a.microbatches}, 1 thread per process", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--teacher-layers", type=int, default=4)
    p.add_argument("--teacher-hidden", type=int, default=512)
    p.add_argument("--teacher-heads", type=int, default=8)
    p.add_argument("--teacher-ffn", type=int, default=None, help="default: 4 x hidden")
    p.add_argument("--student-layers", type=int, default=2)
    p.add_argument("--student-hidden", type=int, default=256)
    p.add_argument("--student-heads", type=int, default=4)
    p.add_argument("--student-ffn", type=int, default=None, help="default: 4 x hidden")
    p.add_argument("--vocab", type=int, default=8192,
                   help="shared vocabulary (a multiple of 128: no padding)")
    p.add_argument("--seq-length", type=int, default=256)
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--microbatches", type=int, default=2, help="microbatches per step")
    p.add_argument("--steps", type=int, default=12, help="training steps per run")
    p.add_argument("--warmup", type=int, default=2, help="first steps left out of the median")
    p.add_argument("--depths", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--teacher-timeout", type=float, default=300.0)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--probe-iters", type=int, default=200,
                   help="GEMM iterations of the machine check (two processes vs one; 0: skip)")
    p.add_argument("--out", default="bench_out/bench_disagg.json")
    p.add_argument("--plot", default="bench_out/bench_disagg.png")
    a = p.parse_args(argv)
    if a.vocab % 128:
        p.error(f"--vocab {a.vocab} must be a multiple of 128 (the student pads to 128)")
    if a.steps <= a.warmup:
        p.error(f"--steps {a.steps} must exceed --warmup {a.warmup}")

    t_start = time.perf_counter()
    load_before = os.getloadavg()
    probe = contention_probe(a.probe_iters) if a.probe_iters else None
    if probe:
        print(f"machine check: a single-threaded GEMM loop takes "
              f"{probe['gemm_loop_1_process_s']:.2f} s alone, "
              f"{probe['gemm_loop_2_process_s']:.2f} s with a second copy running ({probe['slowdown_2_processes']:.2f}x)", flush=True)
    with tempfile.TemporaryDirectory(prefix="bench_disagg_teacher_") as tmp:
        teacher_dir = os.path.join(tmp, "teacher")
        _spawn("make_teacher", 1, {"arch": teacher_arch(a), "seed": a.seed,
                                   "directory": teacher_dir})
        runs = [("colocated", "colocated", None), ("student_alone", "student_alone", None)]
        runs += [(f"disaggregated_d{d}", "disaggregated", d) for d in a.depths]
        points = []
        for name, kind, depth in runs:
            point = _run(a, name, kind, depth, teacher_dir)
            points.append(point)
            print(f"{name}: {_fmt(point['step_time_s'])} s/step (median of steps "
                  f"{a.warmup + 1}-{a.steps}), run {point['wall_s']:.0f} s", flush=True)
    summary = summarise(a, points)
    text = table(points, summary)
    print()
    print(f"teacher {a.teacher_layers} layers h {a.teacher_hidden}, student {a.student_layers} "
          f"layers h {a.student_hidden}, vocab {a.vocab}, seq {a.seq_length}, micro batch "
          f"{a.micro_batch_size} x {a.microbatches} microbatches per step, fp32, 1 thread per "
          f"process, median over steps {a.warmup + 1}-{a.steps}")
    print(text)
    print(f"wire bytes per token: {summary['wire_bytes_per_token']} (4 x h_t = "
          f"{summary['wire_bytes_per_token_expected']}: "
          f"{'exact' if summary['wire_bytes_exact'] else 'MISMATCH'})")
    for p_ in points:
        if p_["kind"] == "disaggregated" and p_["x_max_teacher_student"] < 0.97:
            print(f"note: depth {p_['depth']} ran below max(T, S): the teacher's head start "
                  f"(it serves while the student builds) had not run out; use more --steps")
    print(f"target (D >= 2 within 1.05 x max(T, S) = "
          f"{1.05 * summary['max_teacher_student_s']:.3f} s): "
          f"{'met' if summary['target_met'] else 'NOT met'}")
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w") as f:
        json.dump({"config": vars(a), "summary": summary, "machine_check": probe,
                   "cpu_count": os.cpu_count(),
                   "load_average_1_5_15_before_after": [load_before, os.getloadavg()],
                   "points": points,
                   "table_markdown": text, "wall_s": time.perf_counter() - t_start}, f,
                  indent=1)
    print(f"wrote {a.out}")
    if a.plot:
        os.makedirs(os.path.dirname(a.plot) or ".", exist_ok=True)
        if plot(a, points, summary, a.plot):
            print(f"wrote {a.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
