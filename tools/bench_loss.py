#!/usr/bin/env python
"""Benchmark the fused KD loss against dense peers (not a test).

Variants, each in a fresh process group of its own processes (so memory figures are clean):

* ``dense``: full student and teacher logits, ``log_softmax``, autograd (TP = 1 only).
* ``modelopt``: Megatron-LM's KD loss, ModelOpt's ``LogitsKLLoss``, on Megatron-style logit
  shards (``x @ W_shard.T`` per TP rank) with its own TP all-reduces (needs the ``peers`` extra).
* ``fused_precompute`` / ``fused_recompute``: ``megatron_kd.loss.vocab_parallel_kd_loss`` with
  each backward strategy.
* ``gemm``: the bare GEMMs the fused loss must do (student and teacher projections, the two
  gradient GEMMs), in the same windows: the time floor.

All variants compute forward KL at T = 1 from hidden states and output-layer shards, then the
backward pass. Reported per variant: extra peak memory above the inputs (CPU: the process's peak
resident set size, ``VmHWM`` after resetting it through ``/proc/self/clear_refs``, minus the
resident size once the inputs exist, max over TP ranks; CUDA: ``torch.cuda.max_memory_allocated``
minus the allocation after the inputs) and the median forward+backward time of ``--repeats``
runs. A variant that runs out of memory is reported as OOM.

    python tools/bench_loss.py                       # the full table (tens of minutes on 2 cores)
    python tools/bench_loss.py --tokens 1024 --tp 1  # one point
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

VARIANTS = ["dense", "modelopt", "fused_precompute", "fused_recompute", "gemm"]


# ---------------------------------------------------------------------------------------------
# worker side (one process per TP rank)
# ---------------------------------------------------------------------------------------------
def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _peak_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def _shard_range(vocab: int, tp: int, rank: int) -> tuple[int, int]:
    base, rem = divmod(vocab, tp)
    start = rank * base + min(rank, rem)
    return start, start + base + (1 if rank < rem else 0)


def _worker(rank: int, a: argparse.Namespace, init_file: str, out_file: str) -> None:
    import torch
    import torch.distributed as dist

    threads = max(1, a.threads // a.tp)
    torch.set_num_threads(threads)
    torch.set_flush_denormal(True)
    device = torch.device(a.device if a.device == "cpu" else f"cuda:{rank}")
    backend = "gloo" if a.device == "cpu" else "nccl"
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank,
                            world_size=a.tp, timeout=datetime.timedelta(seconds=3600))
    group = dist.new_group(list(range(a.tp)))
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[a.dtype]
    start, stop = _shard_range(a.vocab, a.tp, rank)
    gen = torch.Generator().manual_seed(1234)
    x_s = (torch.randn(a.tokens, 1, a.h_s, generator=gen)).to(device, dtype)
    x_t = (torch.randn(a.tokens, 1, a.h_t, generator=gen)).to(device, dtype)
    w_s_full = torch.randn(a.vocab, a.h_s, generator=gen) * (2.0 / a.h_s ** 0.5)
    w_t_full = torch.randn(a.vocab, a.h_t, generator=gen) * (2.0 / a.h_t ** 0.5)
    w_s = w_s_full[start:stop].to(device, dtype).clone()
    w_t = w_t_full[start:stop].to(device, dtype).clone()
    del w_s_full, w_t_full
    x_s.requires_grad_(True)
    w_s.requires_grad_(True)

    run = _make_variant(a, x_s, w_s, x_t, w_t, group)
    status = "ok"
    times: list[float] = []
    if device.type == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    else:
        import gc
        gc.collect()
        base = _rss_bytes()
        _reset_peak()
    try:
        for _ in range(a.repeats):
            x_s.grad = None
            w_s.grad = None
            dist.barrier(group)
            t0 = time.perf_counter()
            run()
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
    except (MemoryError, RuntimeError) as e:  # an allocation failure is a result (OOM)
        if "memory" not in str(e).lower() and not isinstance(e, MemoryError):
            raise
        status = "OOM"
    peak = (torch.cuda.max_memory_allocated() if device.type == "cuda" else _peak_bytes()) - base
    result = {"rank": rank, "status": status, "times": times, "extra_peak_bytes": peak}
    with open(f"{out_file}.{rank}", "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


def _make_variant(a, x_s, w_s, x_t, w_t, group):
    import torch
    import torch.nn.functional as F

    from megatron_kd.loss import KDLossConfig, vocab_parallel_kd_loss

    window = a.window_size
    if a.variant.startswith("fused"):
        cfg = KDLossConfig(window_size=window, backward=a.variant.split("_")[1])

        def run():
            loss, _ = vocab_parallel_kd_loss(x_s, w_s, x_t, w_t, config=cfg, tp_group=group)
            loss.backward()
        return run
    if a.variant == "dense":
        if a.tp != 1:
            raise SystemExit("dense has no TP form (its Megatron TP form is 'modelopt')")

        def run():
            z_s = (x_s @ w_s.t()).float()
            with torch.no_grad():
                logp_t = F.log_softmax((x_t @ w_t.t()).float(), dim=-1)
            logp_s = F.log_softmax(z_s, dim=-1)
            loss = F.kl_div(logp_s, logp_t, reduction="sum", log_target=True)
            loss.backward()
        return run
    if a.variant == "modelopt":
        from types import SimpleNamespace

        from megatron.core import parallel_state
        from modelopt.torch.distill.plugins.megatron import LogitsKLLoss

        if not parallel_state.model_parallel_is_initialized():
            parallel_state.initialize_model_parallel(tensor_model_parallel_size=a.tp)
        loss_fn = LogitsKLLoss(SimpleNamespace(tensor_model_parallel_size=a.tp))

        def run():
            z_s = x_s @ w_s.t()
            with torch.no_grad():
                z_t = x_t @ w_t.t()
            per_token, tp_reduce, _ = loss_fn(z_s, z_t)
            loss = per_token.sum()
            loss.backward()
        return run
    if a.variant == "gemm":
        from megatron_kd.loss.config import KDLossConfig as _C
        rows = _C(window_size=window).rows_per_window(w_s.shape[0])

        def run():
            with torch.no_grad():
                gx = torch.empty_like(x_s).view(-1, x_s.shape[-1])
                gw = torch.zeros_like(w_s)
                xs2 = x_s.view(-1, x_s.shape[-1])
                xt2 = x_t.view(-1, x_t.shape[-1])
                for i in range(0, xs2.shape[0], rows):
                    z_s = xs2[i:i + rows] @ w_s.t()
                    _ = xt2[i:i + rows] @ w_t.t()
                    gx[i:i + rows] = z_s @ w_s
                    gw.addmm_(z_s.t(), xs2[i:i + rows])  # z_s stands in for the logit gradient
        return run
    raise SystemExit(f"unknown variant {a.variant}")


# ---------------------------------------------------------------------------------------------
# driver side
# ---------------------------------------------------------------------------------------------
def _run_point(a, variant: str, tokens: int, tp: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench_loss_") as tmp:
        out = os.path.join(tmp, "result")
        cmd = [sys.executable, os.path.abspath(__file__), "--_worker", "--_variant", variant,
               "--_tokens", str(tokens), "--_tp", str(tp), "--_out", out,
               "--vocab", str(a.vocab), "--h-s", str(a.h_s), "--h-t", str(a.h_t),
               "--repeats", str(a.repeats), "--threads", str(a.threads), "--device", a.device,
               "--dtype", a.dtype, "--mem-limit-gb", str(a.mem_limit_gb)]
        if a.window_size:
            cmd += ["--window-size", str(a.window_size)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=a.point_timeout)
        results = []
        for r in range(tp):
            path = f"{out}.{r}"
            if os.path.exists(path):
                with open(path) as f:
                    results.append(json.load(f))
        point = {"variant": variant, "tokens": tokens, "tp": tp}
        if proc.returncode != 0 or len(results) != tp:
            tail = (proc.stderr or "").strip().splitlines()[-3:]
            killed = proc.returncode in (-9, 137) or any("memory" in t.lower() for t in tail)
            if "no TP form" in (proc.stderr or "") or "No module named 'modelopt'" in (
                    proc.stderr or ""):
                point.update(status="n/a", reason=" ".join(tail)[-200:])
            else:
                point.update(status="OOM" if killed else "error", reason=" ".join(tail)[-300:])
            return point
        statuses = {r["status"] for r in results}
        times = results[0]["times"]
        point.update(
            status="OOM" if "OOM" in statuses else "ok",
            time_s=statistics.median(times) if times else None,
            times_s=times,
            extra_peak_bytes=max(r["extra_peak_bytes"] for r in results),
        )
        return point


def _spawn_workers(a) -> None:
    import resource

    import torch.multiprocessing as mp

    a.variant, a.tokens, a.tp = a._variant, a._tokens, a._tp
    if a.mem_limit_gb > 0 and a.device == "cpu":
        # allocation failures become MemoryError/RuntimeError (reported as OOM), not the OOM killer
        limit = int(a.mem_limit_gb * (1 << 30) / a.tp)
        resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))
    init_file = a._out + ".store"
    mp.spawn(_worker, args=(a, init_file, a._out), nprocs=a.tp, join=True)


def _fmt_bytes(b) -> str:
    if b is None:
        return "-"
    return f"{b / (1 << 30):.2f} GB" if b >= (1 << 30) else f"{b / (1 << 20):.0f} MB"


def _table(points: list[dict]) -> str:
    rows = ["| TP | T | variant | fwd+bwd s (median) | x GEMM floor | x dense | extra peak memory |",
            "|---|---|---|---|---|---|---|"]
    by = {(p["tp"], p["tokens"], p["variant"]): p for p in points}
    for p in points:
        floor = by.get((p["tp"], p["tokens"], "gemm"), {}).get("time_s")
        dense = by.get((1, p["tokens"], "dense"), {}).get("time_s")
        if p["status"] != "ok":
            rows.append(f"| {p['tp']} | {p['tokens']} | {p['variant']} | {p['status']} | | | |")
            continue
        t = p["time_s"]
        vs_floor = f"{t / floor:.2f}" if floor else "-"
        vs_dense = f"{t / dense:.2f}" if dense else "-"
        rows.append(f"| {p['tp']} | {p['tokens']} | {p['variant']} | {t:.2f} | {vs_floor} | "
                    f"{vs_dense} | {_fmt_bytes(p['extra_peak_bytes'])} |")
    return "\n".join(rows)


def _plot(points: list[dict], path: str) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)")
        return False
    fig, (ax_m, ax_t) = plt.subplots(1, 2, figsize=(11, 4.2))
    colors = {v: f"C{i}" for i, v in enumerate(VARIANTS)}  # one colour per variant, both panels
    for tp in sorted({p["tp"] for p in points}):
        for v in VARIANTS:
            pts = sorted((p for p in points if p["tp"] == tp and p["variant"] == v
                          and p["status"] == "ok"), key=lambda p: p["tokens"])
            if not pts:
                continue
            xs = [p["tokens"] for p in pts]
            style = "-" if tp == 1 else "--"
            if v != "gemm":
                ax_m.plot(xs, [p["extra_peak_bytes"] / (1 << 30) for p in pts], style,
                          marker="o", color=colors[v], label=f"{v} TP{tp}")
            ax_t.plot(xs, [p["time_s"] for p in pts], style, marker="o", color=colors[v],
                      label=f"{v} TP{tp}")
    ax_m.set(xlabel="tokens T", ylabel="extra peak memory (GB)", xscale="log", yscale="log",
             title="memory above the inputs")
    ax_t.set(xlabel="tokens T", ylabel="forward+backward (s)", xscale="log", yscale="log",
             title="time (median)")
    for ax in (ax_m, ax_t):
        ax.grid(True, which="both", alpha=0.3)
    ax_m.legend(fontsize=7)
    ax_t.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    p.add_argument("--variants", nargs="+", default=VARIANTS, choices=VARIANTS)
    p.add_argument("--vocab", type=int, default=151936, help="vocabulary (Qwen3: 151,936)")
    p.add_argument("--h-s", type=int, default=256, help="student hidden (GPU: 1024)")
    p.add_argument("--h-t", type=int, default=512, help="teacher hidden (GPU: 2048)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                   help="CPU threads in all (split over TP ranks)")
    p.add_argument("--window-size", type=int, default=None)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--mem-limit-gb", type=float, default=20.0,
                   help="CPU: cap on the data segment of all ranks together (0: none)")
    p.add_argument("--point-timeout", type=float, default=1800)
    p.add_argument("--out", default="bench_out/bench_loss.json")
    p.add_argument("--plot", default="bench_out/bench_loss.png")
    p.add_argument("--from-json", default=None, metavar="JSON",
                   help="print the table and redraw the plot of an earlier run, measuring nothing")
    # internal: one measurement
    p.add_argument("--_worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--_variant", help=argparse.SUPPRESS)
    p.add_argument("--_tokens", type=int, help=argparse.SUPPRESS)
    p.add_argument("--_tp", type=int, help=argparse.SUPPRESS)
    p.add_argument("--_out", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a._worker:
        _spawn_workers(a)
        return 0

    if a.from_json:
        with open(a.from_json) as f:
            points = json.load(f)["points"]
        print(_table(points))
        if a.plot and _plot(points, a.plot):
            print(f"wrote {a.plot}")
        return 0
    points = []
    for tp in a.tp:
        for tokens in a.tokens:
            for v in a.variants:
                if v == "dense" and tp != 1:
                    continue
                pt = _run_point(a, v, tokens, tp)
                points.append(pt)
                msg = (f"{pt['time_s']:.2f} s, {_fmt_bytes(pt['extra_peak_bytes'])}"
                       if pt["status"] == "ok" else f"{pt['status']} {pt.get('reason', '')}")
                print(f"TP={tp} T={tokens} {v}: {msg}", flush=True)
    table = _table(points)
    print()
    print(f"V={a.vocab}, h_s={a.h_s}, h_t={a.h_t}, {a.dtype}, device={a.device}, "
          f"threads={a.threads}, repeats={a.repeats}")
    print(table)
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    meta = {k: v for k, v in vars(a).items() if not k.startswith("_")}
    with open(a.out, "w") as f:
        json.dump({"config": meta, "points": points, "table_markdown": table}, f, indent=1)
    print(f"wrote {a.out}")
    if a.plot and _plot(points, a.plot):
        print(f"wrote {a.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
