#!/usr/bin/env python
"""Benchmark whole training steps of ``megatron-kd train`` at the seed's shapes (not a test): a
student of Llama-3.2-3B's shape learning from a teacher of Llama-3.1-8B's shape (both random
init; V 128,256), 8,192 tokens a sequence, micro-batch 1, on one GPU: the job of Multiverse
Computing's published table, with the planner's prediction beside every measured peak.

Rows, each one ``megatron-kd train`` process with the same model, data, batch, precision,
recompute and optimizer flags (the planner's choice for one H200: TP 1, no recompute, bf16,
Megatron's mixed-precision Adam), mock data:

* ``online_fused``: the teacher colocated (``--kd-mode colocated``), the fused loss;
* ``offline_fused``: a top-100 cache of the same teacher, built in the same run by
  ``megatron-kd cache build`` for the same samples (``--kd-mode offline``), the fused loss;
* ``online_dense`` / ``offline_dense``: the same with ``--kd-loss-path dense``, the reference
  baseline that writes the ``[s, b, V/tp]`` logits and computes the KL from them;
* ``student_ce``: the student alone with cross-entropy (``--kd-weight 0 --kd-ce-weight 1``).

Per row: peak memory (CUDA: ``max_memory_allocated`` and ``max_memory_reserved``; CPU: peak
resident set size), the median step time after ``--warmup`` steps, tokens/s, the model FLOPs
of a step (docs/benchmarks.md: the student's forward and backward, ``3x`` its forward with the
output layer, and the teacher's forward with its output layer where it runs; causal attention
at the mean key count; no recompute), model TFLOP/s and MFU against the chip's dense bf16 peak,
the student-only TFLOP/s (the count Multiverse's table divides by: its rows share one FLOP
count), the planner's predicted peak for the row's exact flags (``megatron_kd.commands.
plan_adapter``) and the ratio measured / predicted, and the measured static terms (weights,
gradients, optimizer, teacher weights) beside the planner's. A table on stdout, JSON and a PNG.

    python tools/bench_step.py --device cuda --out bench_out/bench_step      # one H200
    python tools/bench_step.py --device cpu                                  # tiny, minutes

On the CPU the same rows run at a tiny size (what CI runs): the figures are the CPU's and say
nothing of a GPU; the planner's ratio there compares with the process's resident set size.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from validate_planner import (  # noqa: E402  (a sibling tool)
    BASELINE_IMPORTS,
    MEASURE_ENV,
    cache_build_argv,
    measure_baseline,
)

from megatron_kd.arch import GPTArchConfig  # noqa: E402
from megatron_kd.arch.megatron_lm_args import megatron_lm_flags  # noqa: E402
from megatron_kd.planner.memory import Term  # noqa: E402
from megatron_kd.planner.presets import MODEL_PRESETS  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: The rows, in the order they run: (name, mode, loss path). ``mode`` None: no teacher.
ROWS = (
    ("online_fused", "colocated", "auto"),
    ("offline_fused", "offline", "auto"),
    ("online_dense", "colocated", "dense"),
    ("offline_dense", "offline", "dense"),
    ("student_ce", None, "auto"),
)
ROW_NAMES = tuple(r[0] for r in ROWS)

#: Dense bf16 tensor-core peak, FLOP/s, by device name (MFU's denominator; --peak-tflops
#: overrides). H100 and H200 share the chip.
PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "B200": 2250e12, "A100": 312e12}

#: Multiverse Computing's published table (one H200, 8K, Llama-3.1-8B -> Llama-3.2-3B): peak GB,
#: s / iteration, TFLOP/s. Quoted figures, for the plot and the table's last column.
MULTIVERSE = {
    "online_fused": {"label": "online (teacher in memory)", "peak_gb": 102.8, "step_s": 25.9,
                     "tflops": 237},
    "offline_dense": {"label": "offline, dense KL from the top-100 cache", "peak_gb": 78.3,
                      "step_s": 18.5, "tflops": 331},
    "offline_fused": {"label": "offline, fused chunked KL", "peak_gb": 58.3, "step_s": 20.2,
                      "tflops": 304},
}


def _preset_arch(name: str) -> GPTArchConfig:
    return MODEL_PRESETS[name].arch


#: The sizes: ``seed`` (the GPU's: the presets' shapes) and ``tiny`` (the CPU's).
SIZES = {
    "seed": dict(student=lambda: _preset_arch("llama-3.2-3b"),
                 teacher=lambda: _preset_arch("llama-3.1-8b"),
                 seq=8192, global_batch=8, topk=100, iters=5, warmup=2),
    "tiny": dict(student=lambda: GPTArchConfig(
                     num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                     ffn_hidden_size=128, vocab_size=512, padded_vocab_size=512,
                     max_position_embeddings=128, tie_embeddings=True),
                 teacher=lambda: GPTArchConfig(
                     num_layers=2, hidden_size=96, num_attention_heads=6, num_query_groups=2,
                     ffn_hidden_size=192, vocab_size=512, padded_vocab_size=512,
                     max_position_embeddings=128, tie_embeddings=False),
                 seq=128, global_batch=2, topk=100, iters=3, warmup=1),
}

#: Megatron-LM flags ``megatron-kd train`` implies (it has no switch for them).
_IMPLIED = {"--group-query-attention", "--swiglu", "--disable-bias-linear"}


def student_flags(arch: GPTArchConfig, seq: int) -> list[str]:
    """``megatron-kd train``'s model flags for ``arch`` (Megatron-LM's spelling; the vocabulary
    is the true one, padded by the run as Megatron pads it)."""
    flags = [f for f in megatron_lm_flags(arch) if f not in _IMPLIED]
    out, i = [], 0
    while i < len(flags):  # the run's length, not the model's longest
        if flags[i] == "--max-position-embeddings":
            out += [flags[i], str(max(seq, int(flags[i + 1])))]
            i += 2
            continue
        out.append(flags[i])
        i += 1
    return [*out, "--vocab-size", str(arch.vocab_size)]


def common_argv(a, student: GPTArchConfig) -> list[str]:
    """What every row shares: model, data, batch, precision, optimizer, schedule."""
    argv = [*student_flags(student, a.seq), "--seq-length", str(a.seq),
            "--micro-batch-size", "1", "--global-batch-size", str(a.global_batch),
            "--lr", "1e-5", "--lr-warmup-iters", "1", "--mock-data", "--seed", "1234",
            "--train-iters", str(a.iters), "--eval-iters", "0", "--no-progress"]
    if a.device == "cuda":
        argv.append("--bf16")  # Megatron-Core's mixed precision (CUDA only)
    return argv


def row_argv(a, mode: str | None, path: str, teacher_dir: str,
             cache_dir: str) -> list[str]:
    """A row's own flags after :func:`common_argv`."""
    argv = []
    if mode == "colocated":
        argv += ["--kd-mode", "colocated", "--kd-teacher-load", teacher_dir,
                 "--kd-teacher-dtype", a.teacher_dtype]
    elif mode == "offline":
        argv += ["--kd-mode", "offline", "--kd-topk-cache", cache_dir]
    else:
        argv += ["--kd-weight", "0", "--kd-ce-weight", "1"]
    if path != "auto":
        argv += ["--kd-loss-path", path]
    return argv


# ---------------------------------------------------------------------------------------------
# FLOPs (docs/benchmarks.md, "Whole training steps": the count, written once)
# ---------------------------------------------------------------------------------------------
def _dims(arch: GPTArchConfig) -> dict:
    return {"num_layers": arch.num_layers, "hidden_size": arch.hidden_size,
            "ffn_hidden_size": arch.ffn_hidden_size,
            "num_attention_heads": arch.num_attention_heads,
            "num_query_groups": arch.num_query_groups, "kv_channels": arch.kv_channels,
            "vocab_size": arch.vocab_size}


def step_flops(student: GPTArchConfig, teacher: GPTArchConfig | None, seq: int,
               sequences: int) -> dict:
    """Model FLOPs of a step of ``sequences`` sequences (the hardware check's count,
    ``gpu_check.step_flops``, written once in docs/benchmarks.md): ``student`` its forward and
    backward with its output layer's three GEMMs, ``teacher`` its forward with its output
    layer where it runs (None: offline or no KD), ``total`` both."""
    from gpu_check import step_flops as one_sequence

    f = one_sequence({"student": _dims(student),
                      "teacher": _dims(teacher) if teacher is not None else None, "seq": seq})
    s = f["student_layers"] + 6.0 * seq * student.vocab_size * student.hidden_size
    return {"student": s * sequences, "teacher": (f["total"] - s) * sequences,
            "total": f["total"] * sequences}


# ---------------------------------------------------------------------------------------------
# the run's pieces
# ---------------------------------------------------------------------------------------------
_MAKE_TEACHER = """
import json, sys, torch
import torch.distributed as dist
from megatron_kd.arch import GPTArchConfig
from megatron_kd.integration.checkpoint import save_model_checkpoint
from megatron_kd.integration.gpt import build_gpt_model
from megatron_kd.integration.groups import init_distributed_from_env, model_parallel
arch = GPTArchConfig(**json.loads(sys.argv[2]))
dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[sys.argv[3]]
created = init_distributed_from_env()
with model_parallel(tp=1):
    save_model_checkpoint(build_gpt_model(arch, seed=5, params_dtype=dtype), arch, sys.argv[1])
if created:
    dist.destroy_process_group()
"""
#: After :data:`_MAKE_TEACHER`, with the cache's flags (``make_teacher(cache=...)``):
#: ``megatron-kd cache build`` as ``python -m megatron_kd`` runs it; how it ended, marked
_THEN_CACHE = """
import time, traceback
from megatron_kd.cli import main as cli
t0 = time.perf_counter()
try:
    rc = cli(["cache", "build", *json.loads(sys.argv[4])])
except SystemExit as e:
    rc = e.code if isinstance(e.code, int) else 1
except Exception:
    traceback.print_exc()
    rc = 1
print(MARK + json.dumps({"rc": rc, "seconds": round(time.perf_counter() - t0, 2)}), flush=True)
"""


def _env() -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_"))}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    env.update(MEASURE_ENV)  # host memory returned when freed: the CPU's peak RSS means a peak
    return env


def _run(cmd: list[str], log: str, timeout: float) -> dict:
    t0 = time.perf_counter()
    with open(log, "w", encoding="utf-8") as f:
        f.write("$ " + shlex.join(cmd) + "\n")
        f.flush()
        try:
            rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=_env(),
                                timeout=timeout, check=False).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    with open(log, encoding="utf-8") as f:
        tail = f.read()[-3000:]
    return {"rc": rc, "seconds": round(time.perf_counter() - t0, 2), "tail": tail,
            "command": shlex.join(cmd)}


#: The lines in the teacher's log that give the baseline and the cache build's end
#: (``make_teacher(baseline=True, cache=...)``)
_BASELINE_MARK = "baseline_rss_bytes="
_CACHE_MARK = "bench_step cache build: "


def make_teacher(a, teacher: GPTArchConfig, directory: str, *, baseline: bool = False,
                 cache: list[str] | None = None) -> dict:
    """The teacher's random-init checkpoint, in its dtype (on the GPU where there is one).

    The CPU's run makes the other pieces in the same process (one process start each less):
    ``baseline``: the process first does what ``validate_planner.measure_baseline``'s own
    process does (the imports of ``megatron-kd train`` and the CPU shim, nothing else yet) and
    reads its peak RSS then, returned as ``baseline`` (None when it has none); ``cache`` (the
    flags of :func:`cache_argv`): then ``megatron-kd cache build``, its rc, seconds and command
    returned as ``cache_build`` (None when it did not end)."""
    arch = {f: getattr(teacher, f) for f in teacher.__dataclass_fields__}
    arch["max_position_embeddings"] = max(a.seq, teacher.max_position_embeddings)
    code = _MAKE_TEACHER
    if baseline:
        code = (BASELINE_IMPORTS + f"print({_BASELINE_MARK!r} + str(resource.getrusage("
                "resource.RUSAGE_SELF).ru_maxrss * 1024), flush=True)\n" + code)
    cmd = [sys.executable, "-c", code, directory, json.dumps(arch), a.teacher_dtype]
    if cache is not None:
        code += f"MARK = {_CACHE_MARK!r}\n" + _THEN_CACHE
        cmd = [sys.executable, "-c", code, directory, json.dumps(arch), a.teacher_dtype,
               json.dumps(cache)]
    log = os.path.join(a.out, "make_teacher.log")
    made = _run(cmd, log, a.timeout)
    made["baseline"] = made["cache_build"] = None
    with open(log, encoding="utf-8") as f:
        for line in f:
            if baseline and line.startswith(_BASELINE_MARK):
                made["baseline"] = int(line[len(_BASELINE_MARK):])
            elif cache is not None and line.startswith(_CACHE_MARK):
                made["cache_build"] = dict(
                    json.loads(line[len(_CACHE_MARK):]), tail=made["tail"],
                    command=shlex.join(["megatron-kd", "cache", "build", *cache])
                    + " (in the teacher's process)")
    if made["cache_build"] is not None:  # the teacher's own seconds
        made["seconds"] = round(made["seconds"] - made["cache_build"]["seconds"], 2)
    return made


def cache_argv(a, train_argv: list[str], teacher_dir: str, cache_dir: str) -> list[str]:
    """``megatron-kd cache build``'s flags for the offline rows' samples (their data flags,
    seed, length and sample count), the teacher in its dtype."""
    argv = cache_build_argv(shlex.join(train_argv), 1, cache_dir, teacher_dir, a.topk)
    return [*argv, "--kd-teacher-dtype", a.teacher_dtype]


def build_cache(a, train_argv: list[str], teacher_dir: str, cache_dir: str) -> dict:
    """``megatron-kd cache build`` of the offline rows' samples in a process of its own."""
    return _run([sys.executable, "-m", "megatron_kd", "cache", "build",
                 *cache_argv(a, train_argv, teacher_dir, cache_dir)],
                os.path.join(a.out, "cache_build.log"), a.timeout)


def _read_log(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as f:
        records = [json.loads(line) for line in f if line.strip()]
    return [r for r in records if "step" in r and not r.get("eval") and "loss" in r]


def predict(train_argv: list[str], on_cpu: bool) -> dict:
    """The planner's terms (bytes) for the row's exact flags, as ``megatron-kd train``
    resolves them."""
    from megatron_kd.commands.plan_adapter import predict as plan_predict
    from megatron_kd.commands.plan_adapter import resolve_run

    config, run = resolve_run(shlex.join(train_argv), 1)
    terms = plan_predict(config, run, on_cpu).terms
    return {t.label: float(v) for t, v in terms.items()}


def row_shape(a, student: GPTArchConfig, teacher: GPTArchConfig, mode: str | None,
              path: str):
    """The planner's view of a row built from the sizes alone (no checkpoint or cache needed):
    what :func:`megatron_kd.commands.plan_adapter.run_shape` reads from the row's resolved
    flags (a test holds the two equal at the tiny size)."""
    from megatron_kd.commands.plan_adapter import RunShape, arch_to_model
    from megatron_kd.parallel import ParallelLayout

    gpu = a.device == "cuda"
    return RunShape(
        kd_mode=mode or "colocated", student=arch_to_model(student, "student"),
        teacher=arch_to_model(teacher, "teacher") if mode in ("colocated",) else None,
        fp32=not gpu, teacher_dtype=a.teacher_dtype, layout=ParallelLayout(),
        seq_length=a.seq, micro_batch_size=1, global_batch_size=a.global_batch,
        hidden_dropout=False, attention_dropout=False,
        topk=a.topk if mode == "offline" else None, prefetch_depth=2,
        wire_dtype=a.teacher_dtype, window_size=None, loss_path=path)


def predict_rows(a, student: GPTArchConfig, teacher: GPTArchConfig) -> dict[str, dict]:
    """The planner's terms (bytes) of every row at the run's sizes, from :func:`row_shape`."""
    from megatron_kd.commands.plan_adapter import predict_shape

    out = {}
    for name, mode, path in ROWS:
        if name in a.rows:
            terms = predict_shape(row_shape(a, student, teacher, mode, path),
                                  on_cpu=a.device != "cuda").terms
            out[name] = {t.label: float(v) for t, v in terms.items()}
    return out


def prediction_table(predicted: dict[str, dict]) -> str:
    """The planner's terms of each row, GiB, a column a row."""
    names = list(predicted)
    labels = list(dict.fromkeys(t for terms in predicted.values() for t in terms))
    lines = ["| planner term, GiB | " + " | ".join(names) + " |",
             "|---|" + "---|" * len(names)]
    for label in [*labels, "total"]:
        cells = [(sum(predicted[n].values()) if label == "total" else predicted[n].get(label))
                 for n in names]
        lines.append(f"| {label} | " + " | ".join("-" if c is None else f"{c / 2**30:.2f}"
                                                   for c in cells) + " |")
    return "\n".join(lines)


#: The measured static terms (``static_mem_bytes`` of the first step) and the planner's terms
#: they stand beside.
STATIC_TERMS = {"student_weights": Term.STUDENT_WEIGHTS.label,
                "student_grads": Term.STUDENT_GRADS.label,
                "optimizer": Term.OPTIMIZER.label,
                "teacher_weights": Term.TEACHER_WEIGHTS.label}


def run_row(a, name: str, mode: str | None, path: str, common: list[str], teacher_dir: str,
            cache_dir: str, flops: dict) -> dict:
    log_json = os.path.join(a.out, name, "log.jsonl")
    os.makedirs(os.path.dirname(log_json), exist_ok=True)
    if os.path.exists(log_json):
        os.remove(log_json)
    argv = [*common, *row_argv(a, mode, path, teacher_dir, cache_dir)]
    row = {"row": name, "mode": mode or "none", "loss_path": path,
           "train_argv": argv}
    try:
        terms = predict(argv, a.device != "cuda")
        row["predicted_terms_bytes"] = terms
        row["predicted_peak_bytes"] = sum(terms.values())
    except Exception as e:  # noqa: BLE001 - reported in the row, the run goes on
        row["predicted_error"] = f"{type(e).__name__}: {e}"
    r = _run([sys.executable, "-m", "megatron_kd", "train", *argv, "--log-json", log_json],
             os.path.join(a.out, name, "train.log"), a.timeout)
    row["command"] = r["command"]
    row["seconds"] = r["seconds"]
    steps = _read_log(log_json)
    if r["rc"] != 0 or len(steps) != a.iters:
        row["error"] = (f"megatron-kd train exited {r['rc']} after {len(steps)} of {a.iters} "
                        f"steps" + (" (timeout)" if r["rc"] == 124 else ""))
        row["tail"] = r["tail"]
        return row
    losses = [s["loss"] for s in steps]
    if not all(math.isfinite(x) for x in losses):
        row["error"] = f"a step's loss is not finite: {losses}"
        return row
    kept = [s["step_time_s"] for s in steps[a.warmup:]]
    step_s = statistics.median(kept)
    tokens = a.global_batch * a.seq
    row.update(
        losses=losses, step_times_s=[s["step_time_s"] for s in steps], step_s=step_s,
        tokens_per_s=tokens / step_s,
        peak_bytes=max(s["peak_mem_bytes"] for s in steps),
        peak_kind=steps[-1]["peak_mem_kind"],
        peak_reserved_bytes=max((s.get("peak_mem_reserved_bytes") or 0 for s in steps),
                                default=0) or None,
        static_bytes=steps[0].get("static_mem_bytes"),
        flops=flops, model_tflops=flops["total"] / step_s / 1e12,
        student_tflops=flops["student"] / step_s / 1e12)
    if a.peak_flops:
        row["mfu"] = flops["total"] / step_s / a.peak_flops
    if a.baseline:  # CPU: the resident set of a process that only imports, taken off
        row["peak_above_baseline_bytes"] = row["peak_bytes"] - a.baseline
    if row.get("predicted_peak_bytes"):
        measured = row.get("peak_above_baseline_bytes", row["peak_bytes"])
        row["measured_over_predicted"] = measured / row["predicted_peak_bytes"]
        static = row["static_bytes"] or {}
        row["static_vs_planner"] = {
            k: {"measured": static[k],
                "predicted": row["predicted_terms_bytes"].get(label, 0.0)}
            for k, label in STATIC_TERMS.items() if k in static}
        # the rest of the peak (activations, the loss, the teacher's forward, the cache
        # reader): the measured peak less the measured static terms, beside the planner's
        predicted_static = sum(v["predicted"] for v in row["static_vs_planner"].values())
        row["rest_vs_planner"] = {"measured": measured - sum(static.values()),
                                  "predicted": row["predicted_peak_bytes"] - predicted_static}
    return row


# ---------------------------------------------------------------------------------------------
# output
# ---------------------------------------------------------------------------------------------
def _gib(b) -> str:
    return f"{b / 2**30:.2f}" if b else "-"


def table(rows: list[dict], device: str) -> str:
    unit = "GiB" if device == "cuda" else "GiB RSS (above an importing process's)"
    head = (f"| row | peak {unit} | reserved GiB | planner GiB | measured / planner | s / step "
            f"| tokens/s | model TFLOP/s | student TFLOP/s | MFU | Multiverse (GB, s, TFLOP/s) |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        mv = MULTIVERSE.get(r["row"])
        theirs = f"{mv['peak_gb']}, {mv['step_s']}, {mv['tflops']}" if mv else ""
        if r.get("error"):
            lines.append(f"| {r['row']} | error: {r['error']} | | | | | | | | | {theirs} |")
            continue
        ratio = r.get("measured_over_predicted")
        mfu = f"{r['mfu']:.1%}" if r.get("mfu") else "-"
        lines.append(
            f"| {r['row']} | {_gib(r.get('peak_above_baseline_bytes', r['peak_bytes']))} "
            f"| {_gib(r.get('peak_reserved_bytes'))} "
            f"| {_gib(r.get('predicted_peak_bytes'))} | {f'{ratio:.2f}' if ratio else '-'} "
            f"| {r['step_s']:.3f} | {r['tokens_per_s']:,.0f} | {r['model_tflops']:.3g} "
            f"| {r['student_tflops']:.3g} | {mfu} "
            f"| {theirs} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    ok = [r for r in rows if not r.get("error")]
    if not ok:
        return False
    names = [r["row"] for r in ok]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    x = range(len(names))
    w = 0.4
    ax1.bar([i - w / 2 for i in x], [r["peak_bytes"] / 1e9 for r in ok], w, label="megatron_kd")
    ax1.bar([i + w / 2 for i in x], [MULTIVERSE.get(n, {}).get("peak_gb", 0) for n in names], w,
            label="Multiverse (published)")
    ax1.set_ylabel("peak GB")
    ax2.bar([i - w / 2 for i in x], [r["model_tflops"] for r in ok], w, label="megatron_kd")
    ax2.bar([i + w / 2 for i in x], [MULTIVERSE.get(n, {}).get("tflops", 0) for n in names], w,
            label="Multiverse (published)")
    ax2.set_ylabel("model TFLOP/s")
    for ax in (ax1, ax2):
        ax.set_xticks(list(x))
        ax.set_xticklabels(names, rotation=20, fontsize=8)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def _versions() -> dict:
    import torch

    out = {"python": sys.version.split()[0], "torch": torch.__version__}
    for pkg in ("megatron.core", "transformer_engine", "triton"):
        try:
            mod = __import__(pkg, fromlist=["__version__"])
            out[pkg] = getattr(mod, "__version__", "?")
        except ImportError:
            out[pkg] = None
    return out


def _commit() -> str | None:
    try:
        return subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def _device_name(device: str) -> str:
    if device != "cuda":
        import platform

        return platform.processor() or platform.machine()
    import torch

    return torch.cuda.get_device_name(0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--size", default=None, choices=sorted(SIZES),
                   help="default: seed on cuda, tiny on cpu")
    p.add_argument("--rows", nargs="+", default=list(ROW_NAMES), choices=ROW_NAMES)
    p.add_argument("--global-batch-size", dest="global_batch", type=int, default=None,
                   help="sequences a step, every row (default: seed 8, tiny 2)")
    p.add_argument("--iters", type=int, default=None, help="steps a row (seed 5, tiny 3)")
    p.add_argument("--warmup", type=int, default=None,
                   help="steps left out of the median (seed 2, tiny 1)")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="the chip's dense bf16 peak (default: known GPUs' own)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds a piece may take")
    p.add_argument("--out", default="bench_out/bench_step")
    p.add_argument("--predict-only", action="store_true",
                   help="print the planner's terms of each row at the sizes and stop (no "
                        "checkpoint, cache or run)")
    a = p.parse_args(argv)
    size = SIZES[a.size or ("seed" if a.device == "cuda" else "tiny")]
    a.seq = size["seq"]
    a.topk = size["topk"]
    a.global_batch = a.global_batch or size["global_batch"]
    a.iters = a.iters or size["iters"]
    a.warmup = size["warmup"] if a.warmup is None else a.warmup
    if not 0 <= a.warmup < a.iters:
        p.error(f"--warmup {a.warmup} must be in [0, --iters {a.iters})")
    a.teacher_dtype = "bf16" if a.device == "cuda" else "fp32"
    student, teacher = size["student"](), size["teacher"]()
    if a.predict_only:
        print(prediction_table(predict_rows(a, student, teacher)))
        return 0
    if a.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            p.error("--device cuda: CUDA is not available here (--predict-only needs none)")
    a.out = os.path.abspath(a.out)
    os.makedirs(a.out, exist_ok=True)
    if student.vocab_size != teacher.vocab_size:
        p.error(f"student and teacher vocabularies differ: {student.vocab_size} vs "
                f"{teacher.vocab_size}")
    a.peak_flops = None
    if a.peak_tflops:
        a.peak_flops = a.peak_tflops * 1e12
    elif a.device == "cuda":
        name = _device_name("cuda")
        a.peak_flops = next((v for k, v in PEAK_BF16.items() if k in name), None)
    common = common_argv(a, student)
    teacher_dir = os.path.join(a.out, "teacher")
    cache_dir = os.path.join(a.out, "cache")
    report = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "commit": _commit(), "command": shlex.join([sys.executable, *sys.argv]),
              "device": a.device, "device_name": _device_name(a.device),
              "versions": _versions(), "size": a.size or ("seed" if a.device == "cuda"
                                                         else "tiny"),
              "seq_length": a.seq, "global_batch_size": a.global_batch, "iters": a.iters,
              "warmup": a.warmup, "topk": a.topk, "peak_tflops": (a.peak_flops or 0) / 1e12,
              "baseline_rss_bytes": None, "multiverse": MULTIVERSE, "pieces": {},
              "rows": []}
    wanted = [r for r in ROWS if r[0] in a.rows]
    needs_teacher = any(mode is not None for _, mode, _ in wanted)
    # CPU: the peak resident set less an importing process's (what validate_planner does),
    # read in the teacher's process where there is one
    a.baseline = built = None
    offline = any(mode == "offline" for _, mode, _ in wanted)
    if needs_teacher:
        cpu = a.device != "cuda"  # the CPU: the baseline and the cache in the teacher's process
        made = make_teacher(a, teacher, teacher_dir, baseline=cpu, cache=cache_argv(
            a, common, teacher_dir, cache_dir) if cpu and offline else None)
        report["pieces"]["make_teacher"] = {k: made[k] for k in ("rc", "seconds", "command")}
        if made["rc"] != 0 and made["cache_build"] is None:
            print(made["tail"], file=sys.stderr)
            print(f"bench_step: making the teacher failed ({made['rc']})", file=sys.stderr)
            return 1
        a.baseline, built = made["baseline"], made["cache_build"]
    if a.device != "cuda" and a.baseline is None:
        a.baseline = measure_baseline()
    report["baseline_rss_bytes"] = a.baseline
    if offline:
        built = built or build_cache(a, common, teacher_dir, cache_dir)
        report["pieces"]["cache_build"] = {k: built[k] for k in ("rc", "seconds", "command")}
        if built["rc"] != 0:
            print(built["tail"], file=sys.stderr)
            print(f"bench_step: megatron-kd cache build failed ({built['rc']})",
                  file=sys.stderr)
            return 1
    for name, mode, path in wanted:
        flops = step_flops(student, teacher if mode == "colocated" else None, a.seq,
                           a.global_batch)
        row = run_row(a, name, mode, path, common, teacher_dir, cache_dir, flops)
        report["rows"].append(row)
        print(f"bench_step: {name}: " + (row["error"] if row.get("error") else
                                          f"{row['step_s']:.3f} s/step, peak "
                                          f"{_gib(row['peak_bytes'])} GiB"), flush=True)
    text = table(report["rows"], a.device)
    print(text)
    with open(os.path.join(a.out, "bench_step.json"), "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1)
    plotted = plot(report["rows"], os.path.join(a.out, "bench_step.png"))
    print(f"bench_step: wrote {os.path.join(a.out, 'bench_step.json')}"
          + (f" and {os.path.join(a.out, 'bench_step.png')}" if plotted else " (no matplotlib: "
                                                                             "no plot)"))
    return 1 if any(r.get("error") for r in report["rows"]) else 0


if __name__ == "__main__":
    sys.exit(main())
