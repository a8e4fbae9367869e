#!/usr/bin/env python
"""Benchmark the fused KD loss against its peers and the GEMM floor (not a test). One piece: every
variant runs in the same harness (its processes, timer and memory reading), so they compare.

Variants, each in a fresh process group of its own processes (so memory figures are clean), for
each loss kind (``fkl`` forward KL, ``rkl`` reverse KL, ``jsd`` Jensen-Shannon at ``--beta``):

* ``fused_<kind>``: ``megatron_kd.loss.vocab_parallel_kd_loss`` (precomputed gradients) as a
  user gets it: on CUDA its GPU path (windows of ``--window-mb`` MiB of logits, Triton kernels
  or ``--gpu-kernels``), on CPU its CPU path; ``fusedrc_<kind>``: the same with the
  recomputing backward. GPU path only: ``fusedtc_<kind>`` its kernels through
  ``torch.compile`` (the fallback where a Triton kernel fails), ``fusedadd_fkl`` its weight
  gradient added from an input-dtype product (``weight_grad="fp32_add"``), ``fusedlm_fkl`` its
  low-memory setting (256 MiB windows, the weight gradient accumulated in the input dtype),
  ``fusedbf_<kind>`` the default windows with the weight gradient accumulated in the input
  dtype (rounded once a window, as Liger's chunks are; no fp32 accumulator), ``fusedlean_<kind>``
  the memory setting (``--kd-loss-weight-grad input_dtype --kd-loss-window-mib 512``).
  ``fusedmg_<kind>`` and ``fusedmgrc_<kind>``: the loss as Megatron training runs it, with
  gradient-accumulation fusion: the weight gradient added to an fp32 ``main_grad`` that exists
  before the call (Megatron's DDP buffer, so counted with the inputs), with precomputed and with
  recomputed gradients (the latter holds no weight-gradient buffer: ``main_grad`` is the
  accumulator); what backward returns for the weight is Megatron's placeholder of its size.
  ``fusedold_fkl``: the CPU path on any device (the design the GPU path replaces);
  ``fusedc_fkl``: the CPU path with ``elementwise="compiled"`` (compiled in the warm-up run).
* ``liger_<kind>``: Liger-Kernel's ``LigerFusedLinearJSDLoss`` (its chunked fused-linear loss,
  ``torch.compile``d, chunk 1024; beta 0 is its forward KL, 1 its reverse KL; hard-loss weight
  0), TP 1 only (``peers`` extra). On CUDA also ``ligertriton_<kind>``: its Triton
  ``LigerFusedLinearJSD`` (``jsd_beta`` 0 is its forward KL), called with the ``shift_labels``
  argument Liger-Kernel 0.8.5 requires.
* ``dense_fkl``: full student and teacher logits, ``log_softmax``, autograd (TP 1 only).
* ``modelopt_fkl``: Megatron-LM's KD loss, ModelOpt's ``LogitsKLLoss``, on Megatron-style
  logit shards with its own TP all-reduces (``peers`` extra).
* ``floor``: the same four GEMMs (student and teacher projections, the hidden and weight
  gradients) with nothing else, timed for row blocks of 128, 512, 1024 and 2048 rows, of the
  fused loss's own window size, and as one full GEMM where it fits, into preallocated outputs:
  the best of those times is the floor every variant is divided by (the fastest way to do the
  FLOPs, not the loss's own blocking). The time at the window size is reported beside it: no
  loss that holds one window of full-vocabulary logit rows at a time runs faster than that.

Reported per variant: extra peak memory above the inputs (CPU: the process's peak resident set
size, ``VmHWM`` after resetting it through ``/proc/self/clear_refs``, minus the resident size
once the inputs exist, max over TP ranks; CUDA: ``torch.cuda.max_memory_allocated`` minus the
allocation after the inputs); the same less the gradients every variant returns (the hidden
states' and this rank's weight shard's: the loss's working memory); and the median
forward+backward time of ``--repeats`` runs after one untimed warm-up run (Liger's compilation
happens there). A variant that runs out of memory is reported as OOM; a peer that is not
installed as "not measured" with the reason; a variant that fails as "error" with its message,
and one over ``--point-timeout`` as "timeout": every point in its own processes, so one
failure never stops the others.

On CUDA the inputs are generated on the device and the dtype defaults to bf16 (fp32 on CPU).
``--shape multiverse qwen3`` measures the named shapes (T, V, h_s, h_t) in one run;
``--profile PATH`` writes the ``--profile-variant``'s top kernels (``torch.profiler`` key
averages by device time, CPU time on CPU) at each shape as JSON. Memory is printed in GiB and MiB
(until issue 54 labelled "GB" and "MB"; the numbers were GiB and MiB then too). The JSON's
``run`` records the commit, the command, the device and the versions, which a run filed under
``docs/gpu_runs/`` must hold (``docs/gpu_runs/README.md``).

    python tools/bench_loss.py --tokens 2048 4096 --tp 1 2   # docs/benchmarks.md's table (40 min)
    python tools/bench_loss.py --tokens 1024 --tp 1 --variants floor fused_fkl liger_fkl
    python tools/bench_loss.py --device cuda --shape multiverse qwen3 --tp 1 \
        --variants floor fused_fkl fused_jsd ligertriton_fkl ligertriton_jsd --profile prof.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

T0 = time.perf_counter()  # this process's start (a worker's setup time counts from here)
KINDS = {"fkl": "forward_kl", "rkl": "reverse_kl", "jsd": "jsd"}
LIGER_BETA = {"fkl": 0.0, "rkl": 1.0}  # Liger's generalised JSD: 0 forward KL, 1 reverse KL
VARIANTS = (["floor"] + [f"fused_{k}" for k in KINDS] + [f"liger_{k}" for k in KINDS]
            + ["fusedc_fkl", "fusedrc_fkl", "dense_fkl", "modelopt_fkl", "ligertriton_jsd",
               "ligertriton_fkl", "fusedtc_fkl", "fusedtc_jsd", "fusedadd_fkl", "fusedlm_fkl",
               "fusedold_fkl", "fusedrc_jsd", "fusedbf_fkl", "fusedbf_jsd", "fusedlean_fkl",
               "fusedlean_jsd", "fusedmg_fkl", "fusedmg_jsd", "fusedmgrc_fkl"])
DEFAULT_VARIANTS = [v for v in VARIANTS
                    if v not in ("modelopt_fkl", "ligertriton_jsd", "ligertriton_fkl",
                                 "fusedc_fkl", "fusedtc_fkl", "fusedtc_jsd", "fusedadd_fkl",
                                 "fusedlm_fkl", "fusedold_fkl", "fusedrc_jsd",
                                 "fusedbf_fkl", "fusedbf_jsd", "fusedlean_fkl",
                                 "fusedlean_jsd", "fusedmg_fkl", "fusedmg_jsd",
                                 "fusedmgrc_fkl")]
TP1_ONLY = ("liger_", "ligertriton_", "dense_")
GPU_PATH_ONLY = ("fusedtc_", "fusedadd_", "fusedlm_", "fusedbf_", "fusedlean_")
FLOOR_BLOCKS = (128, 512, 1024, 2048)
# Named shapes: (tokens, vocabulary, student hidden, teacher hidden)
SHAPES = {
    # Llama-3.1-8B -> Llama-3.2-3B, the Multiverse paper's
    "multiverse": (8192, 128256, 3072, 4096),
    # Qwen3-8B -> Qwen3-4B
    "qwen3": (8192, 151936, 2560, 4096),
}
# the peers' modules: a point whose module does not import is "not measured", not an error
PEER_MODULES = {"liger": "liger_kernel", "ligertriton": "liger_kernel", "modelopt": "modelopt"}


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
    if device.type == "cpu":
        gen = torch.Generator().manual_seed(1234)
        x_s = (torch.randn(a.tokens, 1, a.h_s, generator=gen)).to(device, dtype)
        x_t = (torch.randn(a.tokens, 1, a.h_t, generator=gen)).to(device, dtype)
        w_s_full = torch.randn(a.vocab, a.h_s, generator=gen) * (2.0 / a.h_s ** 0.5)
        w_t_full = torch.randn(a.vocab, a.h_t, generator=gen) * (2.0 / a.h_t ** 0.5)
        w_s = w_s_full[start:stop].to(device, dtype).clone()
        w_t = w_t_full[start:stop].to(device, dtype).clone()
    else:  # on the device: a host randn of a 128K x 4K weight takes seconds
        gen = torch.Generator(device=device).manual_seed(1234)

        def randn(*shape, std=1.0):
            return torch.randn(*shape, generator=gen, device=device, dtype=dtype).mul_(std)
        x_s, x_t = randn(a.tokens, 1, a.h_s), randn(a.tokens, 1, a.h_t)
        w_s_full = randn(a.vocab, a.h_s, std=2.0 / a.h_s ** 0.5)
        w_t_full = randn(a.vocab, a.h_t, std=2.0 / a.h_t ** 0.5)
        w_s, w_t = w_s_full[start:stop].clone(), w_t_full[start:stop].clone()
    del w_s_full, w_t_full
    x_s.requires_grad_(True)
    w_s.requires_grad_(True)
    _sync(device)
    setup_s = time.perf_counter() - T0  # interpreter, imports, process group, inputs

    if a.variant == "floor":
        result = {"rank": rank, **_floor(a, x_s, w_s, x_t, w_t, group)}
    else:
        run = _make_variant(a, x_s, w_s, x_t, w_t, group)
        result = {"rank": rank, **_measure(a, run, x_s, w_s, group)}
        if a.profile and a.variant == a.profile_variant and rank == 0:
            result["profile"] = _profile(run, x_s, w_s)
    result["setup_s"] = setup_s
    # the tunings the fused variants ran with, recorded by the driver beside the timings (it
    # imports no torch itself: a point's process start is seconds less)
    result["tuning"] = {"cpu_tuning": _cpu_tuning(), "gpu_tuning": _gpu_tuning_record(a)}
    result["device_name"] = (torch.cuda.get_device_name(device) if device.type == "cuda"
                             else None)  # the driver names the host's CPU itself
    with open(f"{out_file}.{rank}", "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


def _sync(device) -> None:
    import torch
    if device.type == "cuda":
        torch.cuda.synchronize()


def _measure(a, run, x_s, w_s, group) -> dict:
    """One untimed warm-up, then ``a.repeats`` timed runs; times and extra peak memory."""
    import torch
    import torch.distributed as dist

    device = x_s.device
    status = "ok"
    times: list[float] = []
    warmup_s = None
    try:
        t0 = time.perf_counter()
        run()  # warm-up: compilation (Liger), first-touch page faults, allocator caches
        x_s.grad = None
        w_s.grad = None
        _sync(device)
        warmup_s = time.perf_counter() - t0
        if device.type == "cuda":
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        else:
            import gc
            gc.collect()
            base = _rss_bytes()
            _reset_peak()
        for _ in range(a.repeats):
            x_s.grad = None
            w_s.grad = None
            dist.barrier(group)
            t0 = time.perf_counter()
            run()
            _sync(device)
            times.append(time.perf_counter() - t0)
        peak = (torch.cuda.max_memory_allocated() if device.type == "cuda"
                else _peak_bytes()) - base
    except (MemoryError, RuntimeError) as e:  # an allocation failure is a result (OOM)
        if "memory" not in str(e).lower() and not isinstance(e, MemoryError):
            raise
        status, peak = "OOM", None
    # the gradients every variant returns (the peak less them: the loss's working memory)
    grads = x_s.numel() * x_s.element_size() + w_s.numel() * w_s.element_size()
    return {"status": status, "times": times, "extra_peak_bytes": peak, "grad_bytes": grads,
            "warmup_s": warmup_s}


def _profile(run, x_s, w_s, top: int = 25) -> dict:
    """One more run under ``torch.profiler``: its top device kernels by device time (on CPU the
    top ops by CPU time), from the profiler's key averages; the operators that launched them
    are listed apart (their device time counts their kernels again)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = x_s.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    x_s.grad = None
    w_s.grad = None
    with profile(activities=activities) as prof:
        run()
        _sync(x_s.device)
    events = list(prof.key_averages())

    def device_us(e) -> float:
        for name in ("self_device_time_total", "self_cuda_time_total"):
            if hasattr(e, name):
                return float(getattr(e, name))
        return 0.0

    def on_device(e) -> bool:  # a kernel (or memcpy / memset) rather than a host operator
        return str(getattr(e, "device_type", "")).endswith(("CUDA", "PrivateUse1"))

    key = device_us if cuda else (lambda e: float(e.self_cpu_time_total))
    kernels = sorted((e for e in events if on_device(e) == cuda), key=key, reverse=True)
    ops = sorted((e for e in events if not on_device(e)), key=key, reverse=True)
    total = sum(key(e) for e in kernels)

    def rows(evts):
        return [{"name": e.key, "calls": e.count, "self_us": key(e),
                 "share": key(e) / total if total else None} for e in evts[:top]]
    return {"by": "device time of kernels" if cuda else "self CPU time of ops",
            "total_us": total, "top": rows(kernels), "ops": rows(ops) if cuda else []}


def _loss_window_rows(a, local_vocab: int, itemsize: int, n_rows: int) -> int:
    """The fused loss's rows per window for this run (the GPU path's byte budget on CUDA,
    balanced over ``n_rows`` tokens; the CPU path's element rule on CPU)."""
    from megatron_kd.loss import KDLossConfig

    if a.device == "cuda" if a.loss_path == "auto" else a.loss_path == "gpu":
        return _gpu_tuning(a).rows_per_window(local_vocab, 2, itemsize, a.window_size, n_rows)
    return KDLossConfig(window_size=a.window_size).rows_per_window(local_vocab)


def _gpu_tuning(a, **overrides):
    """The GPU path's tuning of this run (``--window-mb``, ``--gpu-kernels``)."""
    import dataclasses

    from megatron_kd.loss import GpuTuning

    fields = {"kernels": a.gpu_kernels}
    if a.window_mb:
        fields["window_bytes"] = int(a.window_mb * (1 << 20))
    return dataclasses.replace(GpuTuning(), **{**fields, **overrides})


def _floor(a, x_s, w_s, x_t, w_t, group) -> dict:
    """The four GEMMs of the loss alone, per row-block size (and whole), into preallocated
    outputs; ``times`` are those of the fastest blocking."""
    import torch
    import torch.distributed as dist

    xs2, xt2 = x_s.detach().view(-1, x_s.shape[-1]), x_t.view(-1, x_t.shape[-1])
    ws, n = w_s.detach(), xs2.shape[0]
    gx, gw = torch.empty_like(xs2), torch.zeros_like(ws)
    # The fused loss's own window (its memory bound): the same GEMMs at that size are the
    # fastest any loss holding one window of full-vocabulary logit rows can be.
    window = min(n, _loss_window_rows(a, ws.shape[0], ws.element_size(), n))
    blocks = sorted({b for b in FLOOR_BLOCKS if b < n} | {n, window})  # n: one full GEMM
    by_block: dict[int, list[float]] = {}
    for rows in blocks:
        try:
            z_s = torch.empty(rows, ws.shape[0], dtype=ws.dtype, device=ws.device)
            z_t = torch.empty_like(z_s)
        except (MemoryError, RuntimeError):
            continue  # the full GEMM does not fit: the blocks still give the floor
        times = []
        for rep in range(a.repeats + 1):  # the first is the warm-up
            dist.barrier(group)
            t0 = time.perf_counter()
            with torch.no_grad():
                for i in range(0, n, rows):
                    r = min(rows, n - i)
                    torch.mm(xs2[i:i + r], ws.t(), out=z_s[:r])
                    torch.mm(xt2[i:i + r], w_t.t(), out=z_t[:r])
                    torch.mm(z_s[:r], ws, out=gx[i:i + r])  # z_s stands in for the gradient
                    gw.addmm_(z_s[:r].t(), xs2[i:i + r])
            _sync(ws.device)
            if rep:
                times.append(time.perf_counter() - t0)
        by_block[rows] = times
        del z_s, z_t
    best = min(by_block, key=lambda r: statistics.median(by_block[r]))
    return {"status": "ok", "times": by_block[best], "extra_peak_bytes": None,
            "floor_block": best, "floor_by_block": {str(r): statistics.median(t)
                                                    for r, t in by_block.items()},
            "window_rows": window}


def _make_variant(a, x_s, w_s, x_t, w_t, group):
    import torch
    import torch.nn.functional as F

    from megatron_kd.loss import DenseTeacher, KDLossConfig, vocab_parallel_kd_loss

    impl, kind = a.variant.split("_")
    if a.tp != 1 and a.variant.startswith(TP1_ONLY):
        raise SystemExit(f"{a.variant} has no TP form")
    gpu_path = a.device == "cuda" if a.loss_path == "auto" else a.loss_path == "gpu"
    if not gpu_path and a.variant.startswith(GPU_PATH_ONLY):
        raise SystemExit(f"{a.variant} has no CPU form (the GPU path's options; --loss-path gpu "
                         f"runs that path on CPU)")
    if impl.startswith("fused"):
        tuning = {"fusedtc": _gpu_tuning(a, kernels="compiled"),
                  "fusedadd": _gpu_tuning(a, weight_grad="fp32_add"),
                  "fusedlm": _gpu_tuning(a, weight_grad="input_dtype", window_bytes=256 << 20),
                  "fusedbf": _gpu_tuning(a, weight_grad="input_dtype"),
                  "fusedlean": _gpu_tuning(a, weight_grad="input_dtype", window_bytes=512 << 20),
                  }.get(impl, _gpu_tuning(a))
        fusion = impl in ("fusedmg", "fusedmgrc")
        cfg = KDLossConfig(kind=KINDS[kind], beta=a.beta, window_size=a.window_size,
                           backward=("recompute" if impl in ("fusedrc", "fusedmgrc")
                                     else "precompute"),
                           elementwise="compiled" if impl == "fusedc" else "eager",
                           path="cpu" if impl in ("fusedc", "fusedold") else a.loss_path,
                           gpu_tuning=tuning, gradient_accumulation_fusion=fusion)
        if fusion:  # Megatron's DDP buffer: there before the call, as the inputs are
            w_s.main_grad = torch.zeros(w_s.shape, dtype=torch.float32, device=w_s.device)
            w_s.grad_added_to_main_grad = False

        teacher = DenseTeacher(hidden=x_t, weight=w_t)

        def run():
            loss, _ = vocab_parallel_kd_loss(x_s, w_s, teacher, config=cfg, tp_group=group)
            loss.backward()
        return run
    if impl == "liger":
        from liger_kernel.chunked_loss import LigerFusedLinearJSDLoss

        beta = LIGER_BETA.get(kind, a.beta)
        loss_fn = LigerFusedLinearJSDLoss(weight_hard_loss=0.0, weight_soft_loss=1.0, beta=beta,
                                          compiled=True, chunk_size=1024)
        labels = torch.zeros(x_s.shape[0] * x_s.shape[1], dtype=torch.long, device=x_s.device)

        def run():
            loss_fn(x_s.view(-1, x_s.shape[-1]), w_s, x_t.view(-1, x_t.shape[-1]), w_t,
                    labels).backward()
        return run
    if impl == "ligertriton":
        from liger_kernel.transformers import LigerFusedLinearJSD

        loss_fn = LigerFusedLinearJSD(jsd_beta=LIGER_BETA.get(kind, a.beta))
        # Liger-Kernel 0.8.5 requires shift_labels; none equal to ignore_index: every token counts
        shift_labels = torch.zeros(x_s.shape[0] * x_s.shape[1], dtype=torch.long,
                                   device=x_s.device)

        def run():
            loss_fn(x_s.view(-1, x_s.shape[-1]), w_s, x_t.view(-1, x_t.shape[-1]), w_t,
                    shift_labels).backward()
        return run
    if impl == "dense":
        def run():
            z_s = (x_s @ w_s.t()).float()
            with torch.no_grad():
                logp_t = F.log_softmax((x_t @ w_t.t()).float(), dim=-1)
            logp_s = F.log_softmax(z_s, dim=-1)
            loss = F.kl_div(logp_s, logp_t, reduction="sum", log_target=True)
            loss.backward()
        return run
    if impl == "modelopt":
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
    raise SystemExit(f"unknown variant {a.variant}")


# ---------------------------------------------------------------------------------------------
# driver side
# ---------------------------------------------------------------------------------------------
def _not_importable(variant: str) -> str | None:
    """Why a peer's variant cannot run here (its module does not import), or None."""
    import importlib.util

    impl = variant.split("_")[0]
    module = PEER_MODULES.get(impl)
    if module is not None and importlib.util.find_spec(module) is None:
        return f"not measured: {module} is not installed"
    return None


def _run_point(a, variant: str, tokens: int, tp: int) -> dict:
    """One variant at one size in processes of its own: its point, whatever happens (a failure
    is recorded with its message, never raised)."""
    point = {"variant": variant, "tokens": tokens, "tp": tp, "vocab": a.vocab, "h_s": a.h_s,
             "h_t": a.h_t, "shape": a.shape_name, "dtype": a.dtype}
    if variant.startswith("fused") and (a.loss_path == "gpu" or (a.loss_path == "auto"
                                                                  and a.device == "cuda")):
        point["gpu_kernels"] = ("compiled" if variant.startswith("fusedtc")
                                else a.gpu_kernels)
    reason = _not_importable(variant)
    if reason:
        return dict(point, status="not measured", reason=reason)
    with tempfile.TemporaryDirectory(prefix="bench_loss_") as tmp:
        out = os.path.join(tmp, "result")
        cmd = [sys.executable, os.path.abspath(__file__), "--_worker", "--_variant", variant,
               "--_tokens", str(tokens), "--_tp", str(tp), "--_out", out,
               "--vocab", str(a.vocab), "--h-s", str(a.h_s), "--h-t", str(a.h_t),
               "--repeats", str(a.repeats), "--threads", str(a.threads), "--device", a.device,
               "--dtype", a.dtype, "--mem-limit-gib", str(a.mem_limit_gib), "--beta", str(a.beta),
               "--gpu-kernels", a.gpu_kernels, "--loss-path", a.loss_path]
        if a.window_size:
            cmd += ["--window-size", str(a.window_size)]
        if a.window_mb:
            cmd += ["--window-mb", str(a.window_mb)]
        if a.profile:
            cmd += ["--profile", a.profile, "--profile-variant", a.profile_variant]
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=a.point_timeout)
        except subprocess.TimeoutExpired:
            return dict(point, status="timeout", wall_s=time.perf_counter() - t0,
                        reason=f"over the point timeout of {a.point_timeout:.0f} s")
        point["wall_s"] = time.perf_counter() - t0
        results = []
        for r in range(tp):
            path = f"{out}.{r}"
            if os.path.exists(path):
                with open(path) as f:
                    results.append(json.load(f))
        if proc.returncode != 0 or len(results) != tp:
            tail = (proc.stderr or "").strip().splitlines()[-3:]
            killed = proc.returncode in (-9, 137) or any("out of memory" in t.lower()
                                                         for t in tail)
            marks = [line for line in (proc.stderr or "").splitlines()
                     if "no TP form" in line or "no CPU form" in line]
            if marks:
                point.update(status="n/a", reason=marks[-1].strip()[-200:])
            elif any(m in (proc.stderr or "") for m in (
                    "No module named 'modelopt'", "No module named 'liger_kernel'")):
                point.update(status="not measured", reason=" ".join(tail)[-300:])
            else:
                point.update(status="OOM" if killed else "error", reason=" ".join(tail)[-600:])
            return point
        statuses = {r["status"] for r in results}
        times = results[0]["times"]
        peaks = [r["extra_peak_bytes"] for r in results if r["extra_peak_bytes"] is not None]
        working = [r["extra_peak_bytes"] - r["grad_bytes"] for r in results
                   if r["extra_peak_bytes"] is not None]
        point.update(
            status="OOM" if "OOM" in statuses else "ok",
            time_s=statistics.median(times) if times else None,
            times_s=times,
            extra_peak_bytes=max(peaks) if peaks else None,
            working_bytes=max(working) if working else None,
        )
        # where a point's wall time goes: the worker's imports, process group and inputs;
        # the warm-up run (compilation, autotuning)
        for key in ("floor_block", "floor_by_block", "window_rows", "profile", "setup_s",
                    "warmup_s"):
            if key in results[0]:
                point[key] = results[0][key]
        if a._tuning is None:
            a._tuning = results[0].get("tuning")
        if a._device_name is None:
            a._device_name = results[0].get("device_name")
        return point


def _spawn_workers(a) -> None:
    import resource

    import torch.multiprocessing as mp

    a.variant, a.tokens, a.tp = a._variant, a._tokens, a._tp
    if a.mem_limit_gib > 0 and a.device == "cpu":
        # allocation failures become MemoryError/RuntimeError (reported as OOM), not the OOM killer
        limit = int(a.mem_limit_gib * (1 << 30) / a.tp)
        resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))
    init_file = a._out + ".store"
    if a.tp == 1:  # one rank: in this process (one interpreter and CUDA start less a point)
        _worker(0, a, init_file, a._out)
    else:
        mp.spawn(_worker, args=(a, init_file, a._out), nprocs=a.tp, join=True)


def _fmt_bytes(b) -> str:
    if b is None:
        return "-"
    return f"{b / (1 << 30):.2f} GiB" if b >= (1 << 30) else f"{b / (1 << 20):.0f} MiB"


def _ratio(a, b) -> str:
    return f"{a / b:.2f}" if a is not None and b else "-"


def _floor_name(p: dict) -> str:
    """The floor row's name: its best blocking, and the same GEMMs at the fused loss's own
    window size against it (no windowed loss at that memory can be faster)."""
    name = f"floor (best: {p.get('floor_block')} rows"
    by_block, window = p.get("floor_by_block") or {}, p.get("window_rows")
    at_window = by_block.get(str(window))
    if at_window is not None:
        name += f"; at the loss's {window}-row windows {at_window:.3f} s = " \
                f"{_ratio(at_window, p['time_s'])}x"
    return name + ")"


def _liger(by: dict, tp: int, t: int, vocab, kind: str) -> dict:
    """Liger's loss of ``kind`` at the same size: the chunked compiled one where measured,
    else its Triton one."""
    for impl in ("liger", "ligertriton"):
        p = by.get((1, t, vocab, f"{impl}_{kind}"), {})
        if p.get("status") == "ok":
            return p
    return {}


def _table(points: list[dict]) -> str:
    """One row per point: time against the floor, against Liger's loss of the same kind and
    against Liger's JSD; extra memory against Liger's of the same kind and Liger's JSD, and
    the working memory beyond the returned gradients against Liger's of the same kind."""
    rows = ["| TP | T | V | variant | fwd+bwd s (median) | x floor | x Liger (same kind) | "
            "x Liger JSD | extra peak memory | memory x Liger | memory x Liger JSD | beyond "
            "the gradients | x Liger |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    by = {(p["tp"], p["tokens"], p.get("vocab"), p["variant"]): p for p in points}
    for p in points:
        tp, t, v, vocab = p["tp"], p["tokens"], p["variant"], p.get("vocab")
        shown_v = "-" if vocab is None else f"{vocab:,}"
        if p["status"] != "ok":
            why = f" ({p['reason'][:120]})" if p.get("reason") else ""
            rows.append(f"| {tp} | {t} | {shown_v} | {v} | {p['status']}{why} "
                        f"| | | | | | | | |")
            continue
        floor = by.get((tp, t, vocab, "floor"), {}).get("time_s")
        liger = _liger(by, tp, t, vocab, v.split("_")[-1]) if v != "floor" else {}
        jsd = _liger(by, tp, t, vocab, "jsd") if v != "floor" else {}
        name = v if v != "floor" else _floor_name(p)
        rows.append(f"| {tp} | {t} | {shown_v} | {name} | {p['time_s']:.3f} "
                    f"| {_ratio(p['time_s'], floor)}"
                    f" | {_ratio(p['time_s'], liger.get('time_s'))}"
                    f" | {_ratio(p['time_s'], jsd.get('time_s'))} | "
                    f"{_fmt_bytes(p['extra_peak_bytes'])} | "
                    f"{_ratio(p['extra_peak_bytes'], liger.get('extra_peak_bytes'))} | "
                    f"{_ratio(p['extra_peak_bytes'], jsd.get('extra_peak_bytes'))} | "
                    f"{_fmt_bytes(p.get('working_bytes'))} | "
                    f"{_ratio(p.get('working_bytes'), liger.get('working_bytes'))} |")
    return "\n".join(rows)


def _plot(points: list[dict], path: str) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)")
        return False
    fig, (ax_m, ax_t) = plt.subplots(1, 2, figsize=(12, 4.6))
    colors = {v: f"C{i % 10}" for i, v in enumerate(VARIANTS)}  # one colour per variant
    vocabs = sorted({p.get("vocab") or 0 for p in points})
    for tp, vocab in ((tp, vocab) for tp in sorted({p["tp"] for p in points}) for vocab in vocabs):
        for v in VARIANTS:
            pts = sorted((p for p in points if p["tp"] == tp and p["variant"] == v
                          and (p.get("vocab") or 0) == vocab and p["status"] == "ok"),
                         key=lambda p: p["tokens"])
            if not pts:
                continue
            label = f"{v} TP{tp}" + (f" V={vocab}" if len(vocabs) > 1 else "")
            xs = [p["tokens"] for p in pts]
            style = ":" if v.startswith("liger") else "-" if tp == 1 else "--"
            marker = "s" if v.startswith("liger") else "o"  # peers apart from ours at a glance
            if pts[0]["extra_peak_bytes"] is not None:
                ax_m.plot(xs, [p["extra_peak_bytes"] / (1 << 30) for p in pts], style,
                          marker=marker, color=colors[v], label=label)
            ax_t.plot(xs, [p["time_s"] for p in pts], style, marker=marker, color=colors[v],
                      label=label)
            bound = [(p["tokens"], p["floor_by_block"][str(p["window_rows"])]) for p in pts
                     if str(p.get("window_rows")) in (p.get("floor_by_block") or {})]
            if bound:  # the same GEMMs at the loss's window size: a windowed loss's bound
                ax_t.plot(*zip(*bound), style, marker="x", color="black",
                          label=f"GEMMs at the loss's window TP{tp}")
    ax_m.set(xlabel="tokens T", ylabel="extra peak memory (GiB)", xscale="log", yscale="log",
             title="memory above the inputs")
    ax_t.set(xlabel="tokens T", ylabel="forward+backward (s)", xscale="log", yscale="log",
             title="time (median)")
    for ax in (ax_m, ax_t):
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def _shape_runs(a):
    """``(name, tokens list, vocab, h_s, h_t)`` per shape of the run: the named ``--shape``s,
    or the one shape of ``--tokens --vocab --h-s --h-t``."""
    if not a.shape:
        return [(None, a.tokens, a.vocab, a.h_s, a.h_t)]
    return [(name, [SHAPES[name][0]], *SHAPES[name][1:]) for name in a.shape]


def _measure_all(a, after_point=None) -> list[dict]:
    """Every point, ``a.rounds`` times over (variants interleaved within a round, so a drift in
    the machine's speed hits every variant alike); a point's time is the median of all its
    rounds' timed runs, its memory the largest. ``after_point`` gets the merged points so far
    after each one."""
    rounds: dict[tuple, list[dict]] = {}
    for r in range(a.rounds):
        for shape_name, tokens_list, vocab, h_s, h_t in _shape_runs(a):
            a.shape_name, a.vocab, a.h_s, a.h_t = shape_name, vocab, h_s, h_t
            for tp in a.tp:
                for tokens in tokens_list:
                    for v in a.variants:
                        if tp != 1 and v.startswith(TP1_ONLY):
                            continue
                        pt = _run_point(a, v, tokens, tp)
                        rounds.setdefault((vocab, tp, tokens, v), []).append(pt)
                        msg = (f"{pt['time_s']:.3f} s, {_fmt_bytes(pt['extra_peak_bytes'])}"
                               if pt["status"] == "ok"
                               else f"{pt['status']} {pt.get('reason', '')}")
                        print(f"round {r + 1}: V={vocab} TP={tp} T={tokens} {v}: {msg}",
                              flush=True)
                        if after_point is not None:
                            after_point([_merge_rounds(p) for p in rounds.values()])
    return [_merge_rounds(pts) for pts in rounds.values()]


def _merge_rounds(pts: list[dict]) -> dict:
    bad = [p for p in pts if p["status"] != "ok"]
    if bad:
        return bad[0]
    out = dict(pts[-1])
    times = [t for p in pts for t in p["times_s"]]
    out.update(time_s=statistics.median(times), times_s=times,
               round_medians_s=[p["time_s"] for p in pts])
    for key in ("extra_peak_bytes", "working_bytes"):
        vals = [p[key] for p in pts if p.get(key) is not None]
        out[key] = max(vals) if vals else None
    return out


def _cpu_tuning() -> dict:
    """The fused loss's CPU tuning on this machine (the workers' too: they run here and pass
    no ``cpu_tuning``), recorded beside the CPU timings that depend on it."""
    import dataclasses

    from megatron_kd.loss import CpuTuning

    return dataclasses.asdict(CpuTuning.for_this_machine())


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=os.path.dirname(os.path.abspath(__file__)),
                              capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def git_commit() -> str:
    """This checkout's commit, marked ``(dirty)`` when tracked files differ from it; "unknown"
    outside a git checkout (a run record's ``git_commit``; tools/gpu_check.py's too)."""
    commit = _git("rev-parse", "HEAD") or "unknown"
    return commit + " (dirty)" if _git("status", "--porcelain", "--untracked-files=no") \
        else commit


def package_version(*dists: str) -> str:
    """The version of the first of ``dists`` (names of one package) that is installed, without
    importing it (no torch here); "not installed" when none is."""
    import importlib.metadata as md
    for d in dists:
        try:
            return md.version(d)
        except md.PackageNotFoundError:
            continue
    return "not installed"


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _run_record(a) -> dict:
    """What a run filed under ``docs/gpu_runs/`` records beside its figures: the commit (marked
    dirty when tracked files differ from it), the command, the device and the versions."""
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": git_commit(),
        "command": shlex.join(["python", "tools/bench_loss.py", *a._argv]),
        # the workers' device (None until a point has run there); the host's CPU on CPU
        "device": a._device_name if a.device == "cuda" else _cpu_name(),
        "versions": {"python": platform.python_version(),
                     **{d: package_version(d) for d in ("torch", "triton", "liger-kernel",
                                                 "nvidia-modelopt", "megatron-core")}},
    }


def _write_outputs(a, points: list[dict], complete: bool) -> list[dict]:
    """The JSON of the points so far (and the profiles), rewritten after every point, so a run
    cut short by a time limit still leaves what it measured (``complete`` says whether it
    finished). Returns the profiles."""
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    meta = {k: v for k, v in vars(a).items() if not k.startswith("_")}
    # as the points' workers ran (None until one has run)
    meta.update(a._tuning or {"cpu_tuning": None, "gpu_tuning": None})
    profiles = [dict(p["profile"], variant=p["variant"], tokens=p["tokens"],
                     vocab=p.get("vocab"), shape=p.get("shape")) for p in points
                if "profile" in p]
    kept = [{k: v for k, v in p.items() if k != "profile"} for p in points]
    with open(a.out + ".tmp", "w") as f:
        json.dump({"run": _run_record(a), "config": meta, "complete": complete, "points": kept,
                   "table_markdown": _table(kept)}, f, indent=1)
    os.replace(a.out + ".tmp", a.out)
    if a.profile:
        os.makedirs(os.path.dirname(a.profile) or ".", exist_ok=True)
        with open(a.profile + ".tmp", "w") as f:
            json.dump({"variant": a.profile_variant, "device": a.device, "dtype": a.dtype,
                       "complete": complete, "profiles": profiles,
                       "note": None if profiles else f"{a.profile_variant} not measured yet"},
                      f, indent=1)
        os.replace(a.profile + ".tmp", a.profile)
    return profiles


def _gpu_tuning_record(a) -> dict:
    """The GPU path's tuning of the fused_* variants (recorded beside the CUDA timings)."""
    import dataclasses

    return dataclasses.asdict(_gpu_tuning(a))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    p.add_argument("--variants", nargs="+", default=DEFAULT_VARIANTS, choices=VARIANTS)
    p.add_argument("--beta", type=float, default=0.5, help="JSD mixing weight (both losses)")
    p.add_argument("--vocab", type=int, default=151936, help="vocabulary (Qwen3: 151,936)")
    p.add_argument("--h-s", type=int, default=256, help="student hidden (GPU: 1024)")
    p.add_argument("--h-t", type=int, default=512, help="teacher hidden (GPU: 2048)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per point and round")
    p.add_argument("--rounds", type=int, default=1,
                   help="passes over all points (interleaved), merged per point")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                   help="CPU threads in all (split over TP ranks)")
    p.add_argument("--window-size", type=int, default=None)
    p.add_argument("--window-mb", type=float, default=None,
                   help="GPU path: MiB of logits per window (GpuTuning.window_bytes; "
                        "default its own)")
    p.add_argument("--gpu-kernels", default="triton", choices=["triton", "compiled", "eager"],
                   help="GPU path: its kernels (GpuTuning.kernels) for the fused_* variants")
    p.add_argument("--loss-path", default="auto", choices=["auto", "cpu", "gpu"],
                   help="KDLossConfig.path of the fused_* variants (gpu: the GPU path on any "
                        "device, to try it on CPU)")
    p.add_argument("--shape", nargs="+", default=None, choices=sorted(SHAPES),
                   help="named shapes (T, V, h_s, h_t), each measured; replaces --tokens "
                        "--vocab --h-s --h-t")
    p.add_argument("--profile", default=None, metavar="PATH",
                   help="write --profile-variant's top kernels (profiler key averages) as JSON")
    p.add_argument("--profile-variant", default="fused_fkl", choices=VARIANTS)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default=None, choices=["fp32", "bf16"],
                   help="default: bf16 on cuda (the training precision), fp32 on cpu")
    p.add_argument("--mem-limit-gib", "--mem-limit-gb", dest="mem_limit_gib", type=float,
                   default=20.0, help="CPU: cap in GiB on the data segment of all ranks together "
                                      "(0: none; --mem-limit-gb is its old name)")
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
    a._argv = list(sys.argv[1:] if argv is None else argv)
    a._device_name = None  # the workers' device, from the first point measured
    if a.dtype is None:
        a.dtype = "bf16" if a.device == "cuda" else "fp32"
    a.shape_name = None
    a._tuning = None  # the workers' tunings, from the first point measured
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
    points = _measure_all(a, lambda pts: _write_outputs(a, pts, complete=False))
    table = _table(points)
    print()
    shapes = ", ".join(f"{n or 'shape'}: T={t}, V={v}, h_s={hs}, h_t={ht}"
                       for n, t, v, hs, ht in _shape_runs(a))
    print(f"{shapes}; {a.dtype}, device={a.device}, threads={a.threads}, "
          f"repeats={a.repeats}, rounds={a.rounds}")
    print(table)
    profiles = _write_outputs(a, points, complete=True)
    print(f"wrote {a.out}")
    for prof in profiles:
        print(f"\ntop kernels of {prof['variant']} at T={prof['tokens']} V={prof['vocab']} "
              f"({prof['by']}):")
        print(f"  {prof['total_us'] / 1e3:9.2f} ms  in all")
        for e in prof["top"][:12]:
            print(f"  {e['self_us'] / 1e3:9.2f} ms  x{e['calls']:<4} {e['name'][:90]}")
    if a.profile:
        print(f"wrote {a.profile}")
    if a.plot and _plot(points, a.plot):
        print(f"wrote {a.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
