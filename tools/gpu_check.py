#!/usr/bin/env python
"""One hardware check of megatron_kd: the fused loss, its benchmark and profile, training steps
(a tiny one, TP 2 + SP, CP 2, a 1B-class student) and a cache build on the chosen device,
written up as a JSON and a Markdown report. One piece: the one script a lent GPU runs, its
steps and its report together. On the CPU every step runs at a tiny size (CI runs them all).

Steps (each in processes of its own, so one that fails or crashes does not stop the others;
``make_teacher`` first, then the others in the order below ``--jobs`` at a time: one at a time on
CUDA, two on the CPU, whose figures only show that a step runs):

* ``make_teacher``: the tiny teacher's checkpoint (``tests/support/train_cases.TEACHER_ARCH``),
  single rank; needed by the tiny train steps and ``cache_build``. Reports where the model was
  built and the attention its layers hold.
* ``parity``: ``megatron_kd.loss.vocab_parallel_kd_loss`` on the device against the fp64
  reference ``tests/support/kd_reference.py`` (loss and both gradients; forward KL, reverse KL,
  JSD, sparse top-K teachers, fp32 and bf16 inputs, gradient-accumulation fusion).
* ``train_step_bf16_te``: ``megatron-kd train`` of the tiny student for 3 iterations, with
  ``--bf16 --use-distributed-optimizer`` on CUDA (Transformer Engine layers where it imports),
  fp32 on the CPU. ``train_step_tp2_sp`` and ``train_step_cp2_te``: the same at TP 2 +
  sequence parallelism and at context parallelism 2 (two GPUs on CUDA; two gloo ranks on the
  CPU). Each reports the devices of its student's and teacher's parameters and buffers and the
  attention classes they hold, read off the built models; a model not on the check's device
  fails the step.
* ``cache_build``: ``megatron-kd cache build`` with the tiny teacher, then ``cache verify``.
* ``train_step_1b``: a random-init teacher of about twice the student's size (Llama-3.2-3B's
  width, 20 layers: 2.4B) saved in bf16, then ``megatron-kd train`` in bf16 of a student of
  Llama-3.2-1B's shape (16 layers, hidden 2048, FFN 8192, 32 heads, 8 key/value groups,
  vocabulary 128,256) at 4,096 tokens a step: step time, tokens/s and MFU (:func:`step_flops`
  counts the student's ``6 N`` a token, the teacher's ``2 N``, the causal attention and the
  loss's GEMMs). Tiny on the CPU.
* ``profile_loss``: ``tools/bench_loss.py --profile``: the fused loss's top kernels at the
  Multiverse shape (T 8192, V 128,256, h_s 3072, h_t 4096, bf16).
* ``bench_step`` (only when named in ``--steps``: it takes most of a session on one H200):
  ``tools/bench_step.py``, whole ``megatron-kd train`` steps at the seed's shapes (Llama-3.2-3B
  student, Llama-3.1-8B teacher, 8K tokens): online and offline, fused and dense-logits
  losses, the student alone; peaks beside the planner's. Tiny on the CPU.
* ``bench_loss``: ``tools/bench_loss.py`` one variant at a time, bf16 on CUDA, inside what is
  left of the time budget; its table. First the loss's targets at both shapes, Multiverse
  (V 128,256) and Qwen3 (V 151,936, h_s 2,560): the floor, ours at its defaults and its memory
  setting, Liger-Kernel's compiled loss, forward KL and JSD. Then the Multiverse shape's other
  peers (Liger's Triton loss, dense, ModelOpt), kinds and settings.

``--shared-processes`` (the CPU only; CI): fewer process start-ups (each pays the interpreter's,
torch's and Megatron-Core's imports) for steps that share nothing else: ``make_teacher``'s process
also makes ``train_step_1b``'s teacher (which that step then uses rather than making its own),
and ``train_step_tp2_sp`` and ``train_step_cp2_te`` train one after the other in one torchrun of
two ranks (each still its own ``megatron-kd train``, log and figures; the torchrun's exit status
is both steps', so a crash of either fails both). ``parity``, which needs no teacher, then runs
beside ``make_teacher`` (with ``--jobs`` above 1).

The check installs nothing: a peer (Liger-Kernel, ModelOpt, Transformer Engine) that is not
installed is reported as not measured. On CUDA every step fits one budget (``--budget``,
default 450 s: the run ends within 8 minutes on one H200).

    bash tools/gpu_check.sh                  # the device found (CUDA if there is one)
    bash tools/gpu_check.sh --device cpu --out /tmp/gpu_check_cpu
    python tools/gpu_check.py --device cpu --steps parity
    python tools/gpu_check.py --device cpu --shared-processes   # every step, fewer processes

Exit status: 0 when no step failed, 1 when one did, 2 when ``--device cuda`` was asked for and
no GPU is usable (every step is then reported as skipped).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_loss import git_commit, package_version  # noqa: E402  (a sibling tool: its run record)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.join(ROOT, "tests")
SCRIPT = os.path.abspath(__file__)

STEPS = ("make_teacher", "parity", "bench_loss", "profile_loss", "train_step_bf16_te",
         "train_step_tp2_sp", "train_step_cp2_te", "train_step_1b", "cache_build", "bench_step")
#: steps run only when ``--steps`` names them
ON_REQUEST = ("bench_step",)
# the benchmark last: it takes what is left of the time budget
RUN_ORDER = ("make_teacher", "parity", "train_step_bf16_te", "train_step_tp2_sp",
             "train_step_cp2_te", "cache_build", "profile_loss", "train_step_1b", "bench_loss",
             "bench_step")
NEEDS_TEACHER = ("train_step_bf16_te", "train_step_tp2_sp", "train_step_cp2_te", "cache_build")
NO_GPU = "skipped: no GPU"

TOLERANCE = {"fp32": 1e-5, "bf16": 2e-2}
PARITY_SIZES = {
    "tiny": dict(s=8, b=2, h_s=16, h_t=24, padded_vocab=1009, k=7, window_size=4),
    "moderate": dict(s=256, b=2, h_s=512, h_t=768, padded_vocab=32000, k=32, window_size=128),
}
# CUDA, in the order they run (the budget may end before the last): the loss's targets first,
# at both shapes (ours standalone, its memory setting, ours into main_grad as training runs it,
# and Liger's compiled loss, forward KL and JSD), then the Multiverse shape's other peers, kinds
# and settings
BENCH_GPU_CORE = ("floor", "fused_fkl", "fusedlean_fkl", "fusedmg_fkl", "liger_fkl",
                  "fused_jsd", "fusedlean_jsd", "liger_jsd")
BENCH_GPU_MORE = ("ligertriton_fkl", "ligertriton_jsd", "dense_fkl", "modelopt_fkl",
                  "fusedmgrc_fkl", "fusedbf_fkl", "fused_rkl", "fusedrc_fkl", "fusedtc_fkl",
                  "fusedlm_fkl")
MULTIVERSE = ["--tokens", "8192", "--vocab", "128256", "--h-s", "3072", "--h-t", "4096",
              "--tp", "1"]
# Qwen3-8B -> Qwen3-4B (h 2,560), bench_loss's "qwen3" shape
QWEN3 = ["--tokens", "8192", "--vocab", "151936", "--h-s", "2560", "--h-t", "4096", "--tp", "1"]
# bf16 on CUDA (the training precision), named rather than left to bench_loss's default
BENCH_SHAPES = {
    "cuda": {"multiverse_128k": [*MULTIVERSE, "--dtype", "bf16", "--repeats", "3"],
             "qwen3_152k": [*QWEN3, "--dtype", "bf16", "--repeats", "3"]},
    "cpu": {"cpu_tiny": ["--tokens", "256", "--vocab", "8192", "--h-s", "64", "--h-t", "128",
                         "--tp", "1", "--repeats", "1"]},
}
BENCH_PLAN = {
    "cuda": (("multiverse_128k", BENCH_GPU_CORE), ("qwen3_152k", BENCH_GPU_CORE),
             ("multiverse_128k", BENCH_GPU_MORE)),
    "cpu": (("cpu_tiny", ("floor", "fused_fkl", "dense_fkl", "liger_fkl", "modelopt_fkl")),),
}
# the profile step: the fused loss at the Multiverse shape on CUDA, tiny on the CPU
PROFILE_ARGS = {"cuda": [*MULTIVERSE, "--dtype", "bf16", "--repeats", "1"],
                "cpu": ["--tokens", "256", "--vocab", "8192", "--h-s", "64", "--h-t", "128",
                        "--tp", "1", "--repeats", "1"]}
#: a point's time (process start, warm-up and timed runs) the issue asks to stay under
POINT_TARGET_S = 15.0
# Megatron-Core's bf16 mixed precision and its distributed optimizer (both CUDA only)
TRAIN_PRECISION = ("--bf16", "--use-distributed-optimizer")
# an own variant in error or over its timeout (the floor or a fused one out of memory) fails
# the step; a peer (Liger, ModelOpt) that fails or is not installed is only reported
OWN_VARIANTS = ("floor", "fused", "dense")
# a peer's variants -> the module it needs (not installed: not measured, no process started)
PEER_MODULES = {"liger": "liger_kernel", "modelopt": "modelopt"}  # ligertriton_ too
# seconds: per-step timeouts, the benchmark's budget, the whole run's budget. CUDA: one H200
# run of 8 minutes in all (the two-rank steps skip on one GPU); the benchmark takes what the
# other steps leave (about 4 minutes when they take their usual time).
LIMITS = {"cuda": dict(make_teacher=60, parity=90, train_step_bf16_te=60,
                       train_step_tp2_sp=90, train_step_cp2_te=90, cache_build=60,
                       train_step_1b=180, profile_loss=45, bench=300, point=60, total=450,
                       bench_step=540),
          "cpu": dict(make_teacher=150, parity=150, train_step_bf16_te=240,
                      train_step_tp2_sp=240, train_step_cp2_te=240, cache_build=180,
                      train_step_1b=240, profile_loss=120, bench=150, point=120, total=900,
                      bench_step=600)}


# ---------------------------------------------------------------------------------------------
# processes
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Ctx:
    """What every step needs: the options, the device, where to write, the deadline."""
    args: argparse.Namespace
    device: str
    out: str
    env: dict
    deadline: float
    limits: dict
    teacher_ok: bool = False
    teacher: dict = dataclasses.field(default_factory=dict)  # make_teacher's figures
    #: --shared-processes: the 1B step's teacher as make_teacher's process made it (its
    #: figures; None: make it in the step)
    teacher_1b: dict | None = None
    #: --shared-processes: the two-rank steps' one run (set once it ended, or failed to start)
    shared_train: dict = dataclasses.field(default_factory=dict)
    shared_train_done: threading.Event = dataclasses.field(default_factory=threading.Event)

    @property
    def shared(self) -> bool:
        return bool(getattr(self.args, "shared_processes", False)) and self.device == "cpu"

    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    def path(self, *parts: str) -> str:
        p = os.path.join(self.out, *parts)
        os.makedirs(os.path.dirname(p), exist_ok=True)
        return p


def _env(device: str) -> dict:
    env = dict(os.environ)
    # this checkout's megatron_kd first (workers add tests/ to their own sys.path)
    env["PYTHONPATH"] = os.pathsep.join(
        [ROOT] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("PYTHONWARNINGS", "ignore::UserWarning")
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""  # a CPU check on a GPU machine stays on the CPU
    return env


# the sessions run_cmd has started and not yet reaped (steps may run in threads: --jobs), and
# whether the check is stopping (SIGTERM: no new command starts, the running ones are killed)
_SESSIONS: set[int] = set()
_SESSIONS_LOCK = threading.Lock()
_STOPPING = threading.Event()


def run_cmd(cmd: list[str], ctx: Ctx, log: str, timeout: float) -> dict:
    """Run ``cmd`` in a session of its own (its output appended to ``log``); on timeout, and
    after it ends (a stray grandchild would hold the GPU), every process left in that session
    is killed. Returns rc (124 on timeout), seconds, output tail."""
    t0 = time.monotonic()
    with open(log, "a", encoding="utf-8") as f:
        f.write(f"$ {shlex.join(cmd)}\n")
        f.flush()
        with _SESSIONS_LOCK:
            if _STOPPING.is_set():
                raise RuntimeError("the check is stopping (SIGTERM): no new command")
            proc = subprocess.Popen(cmd, cwd=ROOT, env=ctx.env, stdout=f,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True)
            _SESSIONS.add(proc.pid)
        try:
            rc = proc.wait(timeout=max(1.0, timeout))
            timed_out = False
        except subprocess.TimeoutExpired:
            _kill_session(proc.pid)
            proc.wait()
            rc, timed_out = 124, True
            f.write(f"\n[killed after {timeout:.0f} s]\n")
        finally:
            # what it left behind (e.g. after an inner timeout), and the whole session on
            # Ctrl-C or SIGTERM of this script (its session does not see them)
            _kill_session(proc.pid)
            with _SESSIONS_LOCK:
                _SESSIONS.discard(proc.pid)
    return {"rc": rc, "timed_out": timed_out, "seconds": round(time.monotonic() - t0, 2),
            "tail": _tail(log, 30)}


def _kill_session(pid: int) -> None:
    """SIGKILL the process group ``pid`` leads (the session ``run_cmd`` started), if any is
    left; a group id is not reused while a process of the group lives."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _stop(*_) -> None:
    """SIGTERM: kill every running step's session, start no other command, exit 143."""
    with _SESSIONS_LOCK:
        _STOPPING.set()
        for pid in _SESSIONS:
            _kill_session(pid)
    sys.exit(143)


def _tail(path: str, lines: int) -> str:
    with open(path, encoding="utf-8", errors="replace") as f:
        return "".join(f.readlines()[-lines:])


def _worker_cmd(ctx: Ctx, name: str, out_json: str, *extra: str) -> list[str]:
    return [sys.executable, SCRIPT, "--worker", name, "--worker-out", out_json,
            "--device", ctx.device, *extra]


def _run_worker(ctx: Ctx, step: dict, name: str, timeout: float, *extra: str) -> dict | None:
    """A worker of this script: its JSON figures, or None (the step is then failed)."""
    out_json = ctx.path("work", f"{name}.json")
    if os.path.exists(out_json):
        os.remove(out_json)
    cmd = _worker_cmd(ctx, name, out_json, *extra)
    step["commands"].append(shlex.join(cmd))
    r = run_cmd(cmd, ctx, step["log"], timeout)
    partial = None
    if os.path.exists(out_json):
        with open(out_json, encoding="utf-8") as f:
            partial = json.load(f)
    if r["rc"] != 0:
        _fail(step, f"{name} worker exited {r['rc']}" + (" (timeout)" if r["timed_out"] else ""),
              r["tail"])
        if partial is not None:
            step["figures"] = partial  # what it had measured before it stopped
        return None
    if partial is None:
        _fail(step, f"{name} worker wrote no figures", r["tail"])
    return partial


def _fail(step: dict, reason: str, tail: str = "") -> None:
    step["status"] = "failed"
    step.setdefault("errors", []).append(reason)
    if tail:
        step["output_tail"] = tail


# ---------------------------------------------------------------------------------------------
# workers (run in their own process: ``--worker NAME``)
# ---------------------------------------------------------------------------------------------
def _parity_cases(size: str) -> list[tuple[str, dict]]:
    """(name, spec overrides) of every parity case: with labels, ce_weight 0.3, a loss mask."""
    base = dict(PARITY_SIZES[size], labels=True, ce_weight=0.3, mask=True)
    cases = []
    for dt in ("fp32", "bf16"):
        for kind in ("forward_kl", "reverse_kl", "jsd"):
            for t in (1.0, 2.0):
                cases.append((f"{kind} T={t:g} {dt}",
                              dict(base, kind=kind, temperature=t, dtype=dt)))
        for tail, t in (("renormalize", 1.0), ("renormalize", 2.0), ("ghost", 1.0)):
            cases.append((f"top-K {tail} T={t:g} {dt}",
                          dict(base, teacher=tail, topk_tail=tail, temperature=t, dtype=dt)))
    for backward, dt in (("precompute", "fp32"), ("recompute", "fp32"), ("precompute", "bf16")):
        cases.append((f"forward_kl main_grad {backward} {dt}",
                      dict(base, dtype=dt, backward=backward, gaf=True)))
    # the compiled elementwise kernels (Triton on a GPU)
    for backward, dt, t in (("precompute", "fp32", 2.0), ("recompute", "fp32", 1.0),
                            ("precompute", "bf16", 1.0)):
        cases.append((f"forward_kl compiled {backward} T={t:g} {dt}",
                      dict(base, dtype=dt, backward=backward, temperature=t,
                           elementwise="compiled")))
    return cases


def _parity_one(name: str, over: dict, device: str) -> dict:
    """One case: our loss on ``device`` against the fp64 reference on the same values."""
    import torch
    from support.kd_cases import config_of, make_inputs, reference, rel_err, spec, teacher_of

    from megatron_kd.loss import vocab_parallel_kd_loss

    over = dict(over)
    gaf, dt = over.pop("gaf", False), over.pop("dtype")
    sp = spec(**over, dtype={"fp32": torch.float32, "bf16": torch.bfloat16}[dt])
    inp = {k: v.to(device) for k, v in make_inputs(sp).items()}
    with torch.device(device):  # the reference makes its mask and buffers without a device
        ref_loss, ref_gx, ref_gw = reference(sp, inp)
    hidden = inp["student_hidden"].clone().requires_grad_(True)
    weight = inp["student_weight"].clone().requires_grad_(True)
    if gaf:
        weight.main_grad = torch.zeros(weight.shape, dtype=torch.float32, device=device)
        weight.grad_added_to_main_grad = False
    cfg = dataclasses.replace(config_of(sp), gradient_accumulation_fusion=gaf)
    _sync(device)
    t0 = time.perf_counter()
    loss, n_tokens = vocab_parallel_kd_loss(
        hidden, weight, teacher_of(inp), labels=inp.get("labels"),
        loss_mask=inp.get("loss_mask"), config=cfg)
    (loss * 0.75).backward()  # a non-unit upstream gradient must scale every gradient
    _sync(device)
    seconds = time.perf_counter() - t0
    grad_w = weight.main_grad if gaf else weight.grad
    errs = {"loss": rel_err(loss.detach(), ref_loss),
            "grad_x": rel_err(hidden.grad / 0.75, ref_gx),
            "grad_w": rel_err(grad_w / 0.75, ref_gw)}
    tol = TOLERANCE[dt]
    tokens_ok = abs(float(n_tokens) - float(inp["loss_mask"].sum())) < 1e-4
    ok = all(math.isfinite(e) and e <= tol for e in errs.values()) and tokens_ok
    row = {"case": name, "dtype": dt, "tolerance": tol, "seconds": round(seconds, 4),
           "loss": float(loss.detach()), "reference_loss": float(ref_loss),
           "num_tokens_ok": tokens_ok,
           **{f"rel_err_{k}": v for k, v in errs.items()}}
    if gaf:
        row["grad_added_to_main_grad"] = bool(weight.grad_added_to_main_grad)
        ok = ok and row["grad_added_to_main_grad"]
    elif dt == "fp32":  # context: what a textbook dense fp32 loss gets on the same inputs
        row.update(_naive_fp32_errors(sp, inp, device, ref_loss, ref_gx, ref_gw))
    row["ok"] = ok
    return row


def _naive_fp32_errors(sp, inp, device, ref_loss, ref_gx, ref_gw) -> dict:
    """Errors of the reference's own formulas evaluated in fp32 (not part of the verdict)."""
    import torch
    from support.kd_cases import IGNORE, rel_err
    from support.kd_reference import reference_kd_loss

    x = inp["student_hidden"].clone().requires_grad_(True)
    w = inp["student_weight"].clone().requires_grad_(True)
    with torch.device(device):
        loss = reference_kd_loss(
            x, w, inp.get("teacher_hidden"), inp.get("teacher_weight"),
            inp.get("teacher_topk_ids"), inp.get("teacher_topk_logprobs"), inp.get("labels"),
            inp.get("loss_mask"), kind=sp["kind"], temperature=sp["temperature"],
            beta=sp["beta"], kd_weight=sp["kd_weight"], ce_weight=sp["ce_weight"],
            topk_tail=sp["topk_tail"], vocab_size=sp["vocab_size"], ignore_index=IGNORE)
        loss.backward()
    return {"naive_fp32_rel_err_loss": rel_err(loss.detach(), ref_loss),
            "naive_fp32_rel_err_grad_x": rel_err(x.grad, ref_gx),
            "naive_fp32_rel_err_grad_w": rel_err(w.grad, ref_gw)}


def _sync(device: str) -> None:
    import torch
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def worker_parity(a: argparse.Namespace) -> dict:
    """Every case; the figures so far are written after each one (a timeout keeps them)."""
    import torch
    torch.manual_seed(0)
    size = a.parity_size or ("moderate" if a.device == "cuda" else "tiny")
    cases = _parity_cases(size)
    rows: list[dict] = []
    figures = {"size": size, "sizes": PARITY_SIZES[size], "tolerance": TOLERANCE,
               "tf32_matmul": bool(torch.backends.cuda.matmul.allow_tf32), "cases": rows}
    for name, over in cases:
        try:
            rows.append(_parity_one(name, over, a.device))
        except Exception as e:  # one broken case must not hide the others
            rows.append({"case": name, "ok": False, "error": f"{type(e).__name__}: {e}",
                         "dtype": over["dtype"]})
        worst = {}
        for dt in TOLERANCE:
            for key in ("loss", "grad_x", "grad_w"):
                vals = [r[f"rel_err_{key}"] for r in rows if r["dtype"] == dt and "error" not in r]
                worst[f"{dt}_{key}"] = max(vals) if vals else None
        figures.update(max_rel_err=worst, complete=len(rows) == len(cases),
                       all_ok=len(rows) == len(cases) and all(r["ok"] for r in rows))
        _write_json(a.worker_out, figures)
    return figures


def worker_make_teacher(a: argparse.Namespace) -> dict:
    """A random-init teacher checkpoint: the tiny one (``TEACHER_ARCH``), or ``--arch-json``'s
    (the 1B step's teacher) in ``--params-dtype``, built where ``build_gpt_model`` builds."""
    import torch
    import torch.distributed as dist
    from support.train_cases import TEACHER_ARCH

    from megatron_kd.arch import GPTArchConfig
    from megatron_kd.integration.checkpoint import save_model_checkpoint
    from megatron_kd.integration.gpt import build_gpt_model
    from megatron_kd.integration.groups import init_distributed_from_env, model_parallel

    arch_kw = json.loads(a.arch_json) if a.arch_json else TEACHER_ARCH
    arch = GPTArchConfig(**arch_kw)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[a.params_dtype]
    created = init_distributed_from_env()
    t0 = time.perf_counter()
    try:
        with model_parallel(tp=1):
            model = build_gpt_model(arch, seed=5, params_dtype=dtype)
            built_s = time.perf_counter() - t0
            save_model_checkpoint(model, arch, a.teacher_dir)
    finally:
        if created:
            dist.destroy_process_group()
    figures = {"checkpoint": a.teacher_dir, "arch": arch_kw, "params_dtype": a.params_dtype,
               "build_seconds": round(built_s, 2),
               "save_seconds": round(time.perf_counter() - t0 - built_s, 2),
               **_te_importable(), **_model_facts([model])}
    if a.also_teacher:  # --shared-processes: another step's teacher; its failure is its own
        also = json.loads(a.also_teacher)
        try:
            figures["also"] = worker_make_teacher(argparse.Namespace(
                arch_json=json.dumps(also["arch"]), params_dtype=also["params_dtype"],
                teacher_dir=also["teacher_dir"], also_teacher=None))
        except Exception:  # noqa: BLE001 - reported; that step then makes its own
            figures["also_error"] = traceback.format_exc()[-3000:]
    return figures


def _te_importable() -> dict:
    """Whether Transformer Engine imports here (not whether a model uses it: see
    :func:`_model_facts`)."""
    try:
        import transformer_engine
        return {"transformer_engine": getattr(transformer_engine, "__version__", "importable")}
    except Exception as e:  # ImportError, or a broken build raising anything at import
        return {"transformer_engine": None,
                "transformer_engine_error": f"{type(e).__name__}: {e}"[:300]}


def _model_facts(models: list) -> dict:
    """What the built modules say, not what a builder's rule would pick: the devices of every
    parameter and buffer, the parameters' dtypes and count, the attention classes each layer
    holds (``self_attention`` and its ``core_attention``) and whether any layer is Transformer
    Engine's. Read off the modules after they were built (and, in a run, wrapped)."""
    import itertools

    from torch.nn import Module

    devices, dtypes, attention, core, te, count = set(), set(), set(), set(), False, 0
    for model in models:
        # Module's own methods: Megatron's DDP wrapper has a ``buffers`` list of its own
        for t in itertools.chain(Module.parameters(model), Module.buffers(model)):
            devices.add(str(t.device))
        for p in Module.parameters(model):
            dtypes.add(str(p.dtype).removeprefix("torch."))
            count += p.numel()
        for name, m in Module.named_modules(model):
            cls = type(m)
            te = te or cls.__module__.startswith(("transformer_engine",
                                                  "megatron.core.extensions"))
            leaf = name.rsplit(".", 1)[-1]
            if leaf == "self_attention":
                attention.add(f"{cls.__module__}.{cls.__name__}")
            elif leaf == "core_attention":
                core.add(f"{cls.__module__}.{cls.__name__}")
    return {"param_devices": sorted(devices), "param_device": ", ".join(sorted(devices)),
            "param_dtypes": sorted(dtypes), "parameters": count,
            "self_attention": sorted(attention), "core_attention": sorted(core),
            "transformer_engine_layers": te,
            "layer_spec": "transformer_engine" if te else "local"}


def _run_facts(trainer) -> dict:
    """A run's student (every model chunk) and teacher (the source's model, where this rank
    holds one), through the trainer's public attributes."""
    teacher = getattr(trainer.teacher, "model", None)
    return {"teacher_source": type(trainer.teacher).__name__,
            "student": _model_facts(list(trainer.chunks)),
            "teacher": _model_facts([teacher]) if teacher is not None else None}


def worker_train(a: argparse.Namespace) -> dict | None:
    """``megatron-kd train`` (``megatron_kd.commands.train.train``) with ``--train-argv``, one
    rank of it (torchrun starts several); rank 0 returns the summary and where its models ran.
    The models are read once built, around the public ``Trainer.fit``: written at once, so a
    run that then fails still says where its models were."""
    import torch.distributed as dist

    from megatron_kd.commands.train import parse_args, train
    from megatron_kd.training.trainer import Trainer

    facts: dict = {}
    fit = Trainer.fit

    def fit_and_report(trainer):
        facts.update(_run_facts(trainer))
        if dist.get_rank() == 0:
            _write_json(a.worker_out, {"models": facts})
        return fit(trainer)

    Trainer.fit = fit_and_report
    try:
        summary = train(parse_args(json.loads(a.train_argv)))
    finally:
        Trainer.fit = fit  # a next run in this process (--shared-processes) wraps its own
    if summary["rank"] != 0:
        return None
    keep = ("iterations", "final_loss", "tokens_per_s", "wall_s", "student_params_per_rank",
            "world_size", "tp", "cp", "sequence_parallel", "kd_mode")
    return {"models": facts, "summary": {k: summary.get(k) for k in keep}}


def worker_train_runs(a: argparse.Namespace) -> None:
    """``--shared-processes``: the runs of ``--train-runs`` (``[{"argv", "out"}, ...]``) one
    after the other, each as :func:`worker_train` runs it (its figures in its ``out``), in one
    world started once for all of them (torchrun's: a run ending it would leave the next one to
    rendezvous again over the same store)."""
    from megatron_kd.commands.startup import started

    with started():
        for run in json.loads(a.train_runs):
            one = argparse.Namespace(**{**vars(a), "train_argv": json.dumps(run["argv"]),
                                        "worker_out": run["out"]})
            figures = worker_train(one)
            if figures is not None:
                _write_json(run["out"], figures)


WORKERS = {"parity": worker_parity, "make_teacher": worker_make_teacher, "train": worker_train,
           "train_runs": worker_train_runs}


def worker_main(a: argparse.Namespace) -> int:
    figures = WORKERS[a.worker](a)
    if figures is not None:  # None: a rank other than 0 of a run
        _write_json(a.worker_out, figures)
    return 0


def _write_json(path: str, obj) -> None:
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1)
    os.replace(path + ".tmp", path)


# ---------------------------------------------------------------------------------------------
# steps (driver side): each fills ``step`` (status, figures, commands)
# ---------------------------------------------------------------------------------------------
def step_make_teacher(ctx: Ctx, step: dict) -> None:
    import shutil
    teacher = os.path.join(ctx.out, "teacher")
    shutil.rmtree(teacher, ignore_errors=True)
    extra = []
    if ctx.shared and "train_step_1b" in ctx.args.steps:
        spec = _teacher_1b(ctx)
        shutil.rmtree(spec["teacher_dir"], ignore_errors=True)
        extra = ["--also-teacher", json.dumps(spec)]
    figures = _run_worker(ctx, step, "make_teacher", _timeout(ctx, "make_teacher"),
                          "--teacher-dir", teacher, *extra)
    if figures is not None:
        ctx.teacher_1b = figures.pop("also", None)
        step["figures"] = ctx.teacher = figures
        ctx.teacher_ok = os.path.isfile(os.path.join(teacher, "model_config.json"))
        if not ctx.teacher_ok:
            _fail(step, "no model_config.json in the teacher checkpoint")


def step_parity(ctx: Ctx, step: dict) -> None:
    extra = ["--parity-size", ctx.args.parity_size] if ctx.args.parity_size else []
    figures = _run_worker(ctx, step, "parity", _timeout(ctx, "parity"), *extra)
    if figures is None:
        return
    step["figures"] = figures
    bad = [r["case"] for r in figures["cases"] if not r["ok"]]
    if bad:
        _fail(step, f"{len(bad)} case(s) out of tolerance or broken: {', '.join(bad)}")


def _bench_point(ctx: Ctx, step: dict, shape: str, shape_args: list[str], variant: str,
                 deadline: float) -> dict:
    """One variant of one shape through ``tools/bench_loss.py``; its point (never raises)."""
    import importlib.util

    tokens = int(shape_args[shape_args.index("--tokens") + 1])
    point = {"variant": variant, "tokens": tokens, "tp": 1}
    peer = next((m for prefix, m in PEER_MODULES.items() if variant.startswith(prefix)), None)
    if peer is not None and importlib.util.find_spec(peer) is None:
        return dict(point, status="n/a", reason=f"not measured: {peer} is not installed")
    left = deadline - time.monotonic()
    if left < 20:
        return dict(point, status="skipped", reason="time budget")
    timeout = min(ctx.limits["point"], left)
    out = ctx.path("bench_loss", shape, f"{variant}.json")
    cmd = [sys.executable, os.path.join(ROOT, "tools", "bench_loss.py"), *shape_args,
           "--device", ctx.device, "--variants", variant, "--point-timeout", f"{timeout:.0f}",
           "--out", out, "--plot", ""]
    step["commands"].append(shlex.join(cmd))
    r = run_cmd(cmd, ctx, step["log"], timeout + 15)
    if r["rc"] == 0 and os.path.exists(out):
        with open(out, encoding="utf-8") as f:
            pts = json.load(f)["points"]
        if pts:  # with the point's whole time: its process start, warm-up and timed runs
            return dict(pts[0], wall_s=r["seconds"])
    if r["timed_out"] or "TimeoutExpired" in r["tail"]:
        if timeout < ctx.limits["point"]:  # cut short by the budget, not slow by itself
            return dict(point, status="skipped",
                        reason=f"time budget ran out ({timeout:.0f} s left for this point)")
        return dict(point, status="timeout", reason=f"over the point timeout of {timeout:.0f} s")
    last = r["tail"].strip().splitlines()
    return dict(point, status="error", reason=last[-1][-300:] if last else f"exit {r['rc']}")


def _bench_table(ctx: Ctx, step: dict, shape: str, points: list[dict]) -> str:
    """bench_loss's own table (and plot) of the merged points, through its ``--from-json``."""
    merged = ctx.path("bench_loss", f"{shape}.json")
    with open(merged, "w", encoding="utf-8") as f:
        json.dump({"points": points}, f, indent=1)
    cmd = [sys.executable, os.path.join(ROOT, "tools", "bench_loss.py"), "--from-json", merged,
           "--plot", ctx.path("bench_loss", f"{shape}.png")]
    step["commands"].append(shlex.join(cmd))
    log = ctx.path("logs", f"bench_loss_{shape}_table.log")
    if os.path.exists(log):
        os.remove(log)
    r = run_cmd(cmd, ctx, log, 120)
    with open(log, encoding="utf-8") as f:
        table = "\n".join(line for line in f.read().splitlines() if line.startswith("|"))
    if r["rc"] != 0 or not table:
        _fail(step, f"bench_loss --from-json exited {r['rc']}", r["tail"])
    with open(merged, "w", encoding="utf-8") as f:
        json.dump({"points": points, "table_markdown": table}, f, indent=1)
    return table


def step_bench_loss(ctx: Ctx, step: dict) -> None:
    budget = min(ctx.limits["bench"], ctx.remaining() - 10)
    deadline = time.monotonic() + budget
    points: dict[str, list[dict]] = {}
    for shape, variants in BENCH_PLAN[ctx.device]:
        shape_args = BENCH_SHAPES[ctx.device][shape]
        points.setdefault(shape, []).extend(
            _bench_point(ctx, step, shape, shape_args, v, deadline) for v in variants)
    shapes = {}
    for shape, pts in points.items():
        args = BENCH_SHAPES[ctx.device][shape]
        shapes[shape] = {"args": " ".join(args), "points": pts,
                         "table_markdown": _bench_table(ctx, step, shape, pts)}
        for p in pts:
            own = p["variant"].startswith(OWN_VARIANTS)
            if own and (p["status"] in ("error", "timeout") or (
                    p["status"] == "OOM" and not p["variant"].startswith("dense"))):
                _fail(step, f"{shape} {p['variant']}: {p['status']} {p.get('reason', '')}")
    peers = [f"{s} {p['variant']}: {p['status']}" for s, d in shapes.items()
             for p in d["points"] if p["status"] in ("error", "timeout", "n/a", "not measured")
             and not p["variant"].startswith(OWN_VARIANTS)]
    # a point's time beyond compilation: its whole time less its warm-up run
    slow = [f"{s} {p['variant']}: {p['wall_s']:.1f} s (worker setup {p.get('setup_s') or 0:.1f} s,"
            f" warm-up {p.get('warmup_s') or 0:.1f} s)" for s, d in shapes.items()
            for p in d["points"]
            if p.get("wall_s", 0) - (p.get("warmup_s") or 0) > POINT_TARGET_S]
    step["figures"] = {"figures_of": "CUDA" if ctx.device == "cuda" else "CPU (not GPU)",
                       "budget_s": round(budget, 1), "shapes": shapes, "peers_not_measured": peers,
                       "point_target_s": POINT_TARGET_S, "points_over_target": slow}


def _bench_loss_flags() -> str:
    """``tools/bench_loss.py --help``: which flags this checkout's benchmark has."""
    r = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "bench_loss.py"), "--help"],
                       cwd=ROOT, capture_output=True, text=True, timeout=60, check=False)
    return r.stdout


def step_profile_loss(ctx: Ctx, step: dict) -> None:
    """The fused forward-KL loss's top kernels (``tools/bench_loss.py --profile``: the
    profiler's key averages by device time) at the Multiverse shape on CUDA, tiny on the CPU."""
    if "--profile" not in _bench_loss_flags():
        step["status"] = "skipped: tools/bench_loss.py has no --profile in this checkout"
        return
    prof = ctx.path("profile_loss", "fused_fkl_profile.json")
    out = ctx.path("profile_loss", "fused_fkl.json")
    for path in (prof, out):
        if os.path.exists(path):
            os.remove(path)
    timeout = _timeout(ctx, "profile_loss")
    cmd = [sys.executable, os.path.join(ROOT, "tools", "bench_loss.py"),
           *PROFILE_ARGS[ctx.device], "--device", ctx.device, "--variants", "fused_fkl",
           "--point-timeout", f"{max(5.0, timeout - 10):.0f}", "--out", out, "--plot", "",
           "--profile", prof, "--profile-variant", "fused_fkl"]
    step["commands"].append(shlex.join(cmd))
    r = run_cmd(cmd, ctx, step["log"], timeout)
    figures = step["figures"] = {"args": " ".join(PROFILE_ARGS[ctx.device]),
                                 "profile_json": os.path.relpath(prof, ctx.out),
                                 "seconds": r["seconds"]}
    if r["rc"] != 0:
        _fail(step, f"bench_loss --profile exited {r['rc']}"
              + (" (timeout)" if r["timed_out"] else ""), r["tail"])
        return
    if not os.path.exists(prof):
        _fail(step, f"bench_loss --profile wrote no {prof}", r["tail"])
        return
    with open(prof, encoding="utf-8") as f:
        figures["profile"] = json.load(f)
    if not figures["profile"].get("profiles"):
        _fail(step, f"no profile in {prof}: {figures['profile'].get('note')}", r["tail"])


def step_train(ctx: Ctx, step: dict) -> None:
    _train(ctx, step, "train_step_bf16_te", [])


def _second_gpu(step: dict, ctx: Ctx, what: str) -> bool:
    """On CUDA a two-rank step needs two GPUs (NCCL puts no two ranks of a group on one
    device); on the CPU two gloo ranks share the cores."""
    import torch

    if ctx.device == "cuda" and torch.cuda.device_count() < 2:
        step["status"] = (f"skipped: {what} needs two GPUs, this machine has "
                          f"{torch.cuda.device_count()}")
        return False
    return True


TP2_SP = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
CP2 = ["--context-parallel-size", "2"]


def _shared_two_rank(ctx: Ctx) -> bool:
    """``--shared-processes`` and both two-rank steps asked for: one torchrun trains both."""
    return ctx.shared and {"train_step_tp2_sp", "train_step_cp2_te"} <= set(ctx.args.steps)


def step_train_tp2_sp(ctx: Ctx, step: dict) -> None:
    """One colocated run at TP 2 + sequence parallelism with Transformer Engine's norms where
    it is installed (which mark their weights for the TP all-reduce, as the CPU shim's do)."""
    if not _shared_two_rank(ctx):
        if _second_gpu(step, ctx, "TP 2"):
            _train(ctx, step, "train_step_tp2_sp", TP2_SP, nproc=2)
        return
    try:  # --shared-processes: this run and then train_step_cp2_te's, one torchrun
        runs = [("train_step_tp2_sp", _train_argv(ctx, TP2_SP)),
                ("train_step_cp2_te", _train_argv(ctx, CP2))]
        ctx.shared_train.update(_launch_train(ctx, step, runs, nproc=2, timeout=min(
            ctx.remaining(), ctx.limits["train_step_tp2_sp"] + ctx.limits["train_step_cp2_te"])))
        _train_figures(ctx, step, "train_step_tp2_sp", ctx.shared_train["train_step_tp2_sp"])
    finally:
        ctx.shared_train_done.set()


def step_train_cp2_te(ctx: Ctx, step: dict) -> None:
    """One colocated run at context parallelism 2: Transformer Engine's attention takes the
    load-balanced sequence chunks and exchanges keys and values itself where it is installed
    (elsewhere the project's own context-parallel attention does)."""
    if not _shared_two_rank(ctx):
        if _second_gpu(step, ctx, "CP 2"):
            _train(ctx, step, "train_step_cp2_te", CP2, nproc=2)
        return
    # --shared-processes: trained in train_step_tp2_sp's torchrun, after its run
    ctx.shared_train_done.wait(max(1.0, ctx.remaining()))
    run = ctx.shared_train.get("train_step_cp2_te")
    if run is None:
        _fail(step, "train_step_tp2_sp's torchrun (which trains this run too: "
                    "--shared-processes) did not run")
        return
    step["commands"].append(run["command"])
    with open(step["log"], "a", encoding="utf-8") as f:
        f.write(f"(--shared-processes: trained in train_step_tp2_sp's torchrun, after its run;"
                f" its output in {os.path.relpath(run['log'], ctx.out)})\n")
    _train_figures(ctx, step, "train_step_cp2_te", run)


def _train_cmd(ctx: Ctx, out_json: str, argv: list[str], nproc: int) -> list[str]:
    """This script's train worker: one process, or a torchrun of ``nproc``."""
    launch = ([sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={nproc}"] if nproc > 1 else [sys.executable])
    return [*launch, SCRIPT, "--worker", "train", "--worker-out", out_json,
            "--device", ctx.device, "--train-argv", json.dumps(argv)]


def _launch_train(ctx: Ctx, step: dict, runs: list[tuple[str, list[str]]], *, nproc: int,
                  timeout: float, iters: int = 3) -> dict[str, dict]:
    """``--shared-processes``: the train worker's runs ``(name, argv)``, one after the other in
    one process (a torchrun of ``nproc``); per name what :func:`_train_figures` reads."""
    planned, jobs = {}, []
    for name, argv in runs:
        log_json, out_json = ctx.path(name, "log.jsonl"), ctx.path("work", f"{name}.json")
        for path in (log_json, out_json):
            if os.path.exists(path):
                os.remove(path)
        argv = [*argv, "--train-iters", str(iters), "--eval-iters", "0", "--log-json", log_json]
        planned[name] = {"argv": argv, "log_json": log_json, "out_json": out_json,
                         "iters": iters}
        jobs.append({"argv": argv, "out": out_json})
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", SCRIPT, "--worker", "train_runs", "--device",
           ctx.device, "--train-runs", json.dumps(jobs)]
    step["commands"].append(shlex.join(cmd))
    r = run_cmd(cmd, ctx, step["log"], timeout)
    for run in planned.values():
        run.update(r=r, command=shlex.join(cmd), log=step["log"])
    return planned


def _run_train(ctx: Ctx, step: dict, name: str, argv: list[str], *, nproc: int = 1,
               iters: int, timeout: float | None = None) -> tuple[dict, list[dict]]:
    """``megatron-kd train`` with ``argv`` through the train worker; fills the step's figures
    (where the models ran, losses, peak memory) and returns them with the step records. Fails
    the step on a non-zero exit, a missing or non-finite loss, or a model (a parameter or a
    buffer) that is not on the device of the check."""
    log_json = ctx.path(name, "log.jsonl")
    out_json = ctx.path("work", f"{name}.json")
    for path in (log_json, out_json):
        if os.path.exists(path):
            os.remove(path)
    argv = [*argv, "--train-iters", str(iters), "--eval-iters", "0", "--log-json", log_json]
    cmd = _train_cmd(ctx, out_json, argv, nproc)
    step["commands"].append(shlex.join(cmd))
    r = run_cmd(cmd, ctx, step["log"], _timeout(ctx, name) if timeout is None else timeout)
    return _train_figures(ctx, step, name, {"argv": argv, "log_json": log_json,
                                            "out_json": out_json, "iters": iters, "r": r})


def _train_figures(ctx: Ctx, step: dict, name: str, run: dict) -> tuple[dict, list[dict]]:
    """The step's figures of a train worker's ``run`` (its argv, log and figures' paths, the
    steps asked for, how the command ended); see :func:`_run_train`."""
    argv, log_json, out_json = run["argv"], run["log_json"], run["out_json"]
    iters, r = run["iters"], run["r"]
    records = []
    if os.path.exists(log_json):
        with open(log_json, encoding="utf-8") as f:
            records = [json.loads(line) for line in f if line.strip()]
    steps = [x for x in records if "step" in x and not x.get("eval") and "loss" in x]
    worker = {}
    if os.path.exists(out_json):
        with open(out_json, encoding="utf-8") as f:
            worker = json.load(f)
    models = worker.get("models") or {}
    student, teacher = models.get("student") or {}, models.get("teacher") or {}
    figures = step["figures"] = {
        "precision": "bf16" if "--bf16" in argv else "fp32",
        "student_param_device": student.get("param_device"),
        "teacher_param_device": teacher.get("param_device"),
        "student_attention": student.get("core_attention") or student.get("self_attention"),
        "teacher_attention": teacher.get("core_attention") or teacher.get("self_attention"),
        "transformer_engine_used": bool(student.get("transformer_engine_layers")),
        "models": models, "summary": worker.get("summary"),
        "loss_lines": [{k: x.get(k) for k in ("step", "loss", "kd_loss", "lm_loss", "grad_norm",
                                              "step_time_s", "tokens_per_s", "peak_mem_bytes")}
                       for x in steps],
        "peak_mem_bytes": max((x.get("peak_mem_bytes") or 0 for x in steps), default=None),
        "peak_mem_kind": steps[-1].get("peak_mem_kind") if steps else None,
        "train_seconds": r["seconds"]}
    # a model left on the host of a GPU run (or the other way round) is a failure, whatever
    # the losses say
    want = "cuda" if ctx.device == "cuda" else "cpu"
    for who, facts in (("student", student), ("teacher", teacher)):
        wrong = [d for d in facts.get("param_devices", []) if not d.startswith(want)]
        if wrong:
            _fail(step, f"the {who}'s parameters or buffers are on {', '.join(wrong)}, not "
                        f"on {want}")
    if r["rc"] != 0:
        _fail(step, f"megatron-kd train exited {r['rc']}"
              + (" (timeout)" if r["timed_out"] else ""), r["tail"])
    elif len(steps) != iters or not all(math.isfinite(x.get("loss") or math.nan)
                                        for x in steps):
        _fail(step, f"expected {iters} finite step losses in {log_json}, got {len(steps)} "
                    f"steps", r["tail"])
    elif not student:
        _fail(step, "the train worker did not say where its models ran", r["tail"])
    return figures, steps


def _precision(ctx: Ctx) -> list[str]:
    # Megatron-Core's bf16 mixed precision and its distributed optimizer: CUDA only
    return list(TRAIN_PRECISION) if ctx.device == "cuda" else []


def _train_argv(ctx: Ctx, layout: list[str]) -> list[str]:
    from support.train_cases import student_argv

    return [*student_argv(), *_precision(ctx), *layout,
            "--kd-teacher-load", os.path.join(ctx.out, "teacher")]


def _train(ctx: Ctx, step: dict, name: str, layout: list[str], nproc: int = 1) -> None:
    _run_train(ctx, step, name, _train_argv(ctx, layout), nproc=nproc, iters=3)


# ---------------------------------------------------------------------------------------------
# the 1B-class step: a student of Llama-3.2-1B's shape, a teacher about twice its size
# ---------------------------------------------------------------------------------------------
#: Llama-3.2-1B's shape (random init); the teacher: Llama-3.2-3B's width with 20 layers
#: instead of 28 (2.4B parameters, 1.95x the student). On the CPU the same step at a tiny size.
ONE_B = {
    "cuda": dict(seq=4096, iters=4, teacher_dtype="bf16",
                 student=dict(num_layers=16, hidden_size=2048, ffn_hidden_size=8192,
                              num_attention_heads=32, num_query_groups=8, vocab_size=128256),
                 teacher=dict(num_layers=20, hidden_size=3072, ffn_hidden_size=8192,
                              num_attention_heads=24, num_query_groups=8, vocab_size=128256)),
    "cpu": dict(seq=64, iters=3, teacher_dtype="bf16",
                student=dict(num_layers=2, hidden_size=64, ffn_hidden_size=256,
                             num_attention_heads=4, num_query_groups=2, vocab_size=512),
                teacher=dict(num_layers=2, hidden_size=96, ffn_hidden_size=384,
                             num_attention_heads=6, num_query_groups=2, vocab_size=512)),
}
#: dense bf16 tensor-core peak, FLOP/s (the MFU's denominator; --peak-tflops overrides)
PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12}


def _matmul_params(m: dict) -> int:
    """Weights a token multiplies in one pass through the layers (SwiGLU MLP, grouped-query
    attention, no biases): not the embedding (a lookup) nor the output layer (the loss)."""
    h, heads, groups = m["hidden_size"], m["num_attention_heads"], m["num_query_groups"]
    d = m.get("kv_channels") or h // heads
    attention = h * heads * d + 2 * h * groups * d + heads * d * h
    return m["num_layers"] * (attention + 3 * h * m["ffn_hidden_size"])


def _attention_flops(m: dict, seq: int) -> float:
    """Forward FLOPs of the score and value products of one causal sequence, all layers: the
    half of ``4 s^2 d`` per layer that the mask keeps (a kernel that computes the masked half
    too does more work than counted)."""
    d_attention = m["num_attention_heads"] * (m.get("kv_channels")
                                              or m["hidden_size"] // m["num_attention_heads"])
    return m["num_layers"] * 0.5 * 4.0 * seq * seq * d_attention


def step_flops(one_b: dict) -> dict:
    """Model FLOPs of one sequence of ``seq`` tokens in a training step (docs/benchmarks.md's
    count; ``tools/bench_step.py`` uses it too): the student's forward and backward (``6 N`` a
    token and three times its attention), the teacher's forward (``2 N`` a token and its
    attention; ``teacher`` None: no teacher runs, an offline or teacherless step) and the
    loss's GEMMs (the student's projection forward and its two gradients, the teacher's
    projection forward). No recompute: what the model needs, not what a run spends."""
    s, t, seq = one_b["student"], one_b.get("teacher"), one_b["seq"]
    vocab = s["vocab_size"]
    parts = {
        "student_layers": 6.0 * _matmul_params(s) * seq + 3.0 * _attention_flops(s, seq),
        "teacher_layers": (2.0 * _matmul_params(t) * seq + _attention_flops(t, seq)
                           if t is not None else 0.0),
        "loss_gemms": 2.0 * seq * vocab * (3 * s["hidden_size"]
                                           + (t["hidden_size"] if t is not None else 0)),
    }
    return {**parts, "total": sum(parts.values())}


def _arch_flags(m: dict, seq: int) -> list[str]:
    return ["--num-layers", str(m["num_layers"]), "--hidden-size", str(m["hidden_size"]),
            "--ffn-hidden-size", str(m["ffn_hidden_size"]),
            "--num-attention-heads", str(m["num_attention_heads"]),
            "--num-query-groups", str(m["num_query_groups"]), "--seq-length", str(seq),
            "--max-position-embeddings", str(seq)]


def _peak_flops(ctx: Ctx) -> tuple[float | None, str]:
    import torch

    if ctx.args.peak_tflops:
        return ctx.args.peak_tflops * 1e12, "--peak-tflops"
    if ctx.device != "cuda":
        return None, "no MFU on the CPU"
    name = torch.cuda.get_device_name(0)
    for key, peak in PEAK_BF16.items():
        if key in name:
            return peak, f"{key} dense bf16"
    return None, f"no peak known for {name} (--peak-tflops)"


def _teacher_1b(ctx: Ctx) -> dict:
    """The 1B step's teacher: where, its arch (``GPTArchConfig`` fields) and dtype."""
    one_b = ONE_B[ctx.device]
    t = one_b["teacher"]
    return {"teacher_dir": os.path.join(ctx.out, "teacher_1b"),
            "arch": dict(t, padded_vocab_size=t["vocab_size"],
                         max_position_embeddings=one_b["seq"], tie_embeddings=True),
            "params_dtype": one_b["teacher_dtype"]}


def step_train_1b(ctx: Ctx, step: dict) -> None:
    """The teacher's random-init checkpoint (built where models are built, in the teacher's
    dtype), then ``megatron-kd train`` of the 1B-class student against it, one sequence a
    step: step time, tokens/s and MFU over the steps after the first."""
    import shutil
    import statistics

    one_b = ONE_B[ctx.device]
    seq = one_b["seq"]
    deadline = time.monotonic() + _timeout(ctx, "train_step_1b")  # both parts of the step
    spec = _teacher_1b(ctx)
    teacher_dir = spec["teacher_dir"]
    made = ctx.teacher_1b  # --shared-processes: made in make_teacher's process
    if made is not None:
        with open(step["log"], "a", encoding="utf-8") as f:
            f.write(f"(--shared-processes: the teacher made in make_teacher's process, in "
                    f"{teacher_dir})\n")
    else:
        shutil.rmtree(teacher_dir, ignore_errors=True)
        made = _run_worker(ctx, step, "make_teacher", deadline - time.monotonic(),
                           "--teacher-dir", teacher_dir, "--arch-json", json.dumps(spec["arch"]),
                           "--params-dtype", spec["params_dtype"])
    if made is None:
        return
    argv = [*_arch_flags(one_b["student"], seq), "--micro-batch-size", "1",
            "--global-batch-size", "1", "--lr", "1e-4", "--lr-warmup-iters", "1",
            "--mock-data", "--no-progress", *_precision(ctx), "--kd-teacher-load", teacher_dir,
            "--kd-teacher-dtype", one_b["teacher_dtype"]]
    figures, steps = _run_train(ctx, step, "train_step_1b", argv, iters=one_b["iters"],
                                timeout=max(5.0, deadline - time.monotonic()))
    flops = step_flops(one_b)
    kept = [x["step_time_s"] for x in steps[1:] if x.get("step_time_s")]
    step_s = statistics.median(kept) if kept else None
    peak, peak_source = _peak_flops(ctx)
    achieved = flops["total"] / step_s if step_s else None
    figures.update(
        shape=one_b, teacher_checkpoint=made, step_flops=flops, step_time_s=step_s,
        tokens_per_s=seq / step_s if step_s else None, achieved_tflops=(
            achieved / 1e12 if achieved else None),
        peak_tflops=peak / 1e12 if peak else None, peak_source=peak_source,
        mfu=achieved / peak if achieved and peak else None,
        student_parameters=(figures["models"].get("student") or {}).get("parameters"),
        teacher_parameters=made.get("parameters"),
        timed_steps=f"median of steps 2-{one_b['iters']} (step 1 warms up)")


def step_cache_build(ctx: Ctx, step: dict) -> None:
    import shutil
    cache = os.path.join(ctx.out, "cache")
    shutil.rmtree(cache, ignore_errors=True)
    mk = [sys.executable, "-m", "megatron_kd", "cache"]
    build = mk + ["build", "--out", cache, "--kd-teacher-load", os.path.join(ctx.out, "teacher"),
                  "--kd-topk", "20", "--logprob-encoding", "fp32", "--samples-per-shard", "2",
                  "--window-size", "7", "--seq-length", "32", "--micro-batch-size", "2",
                  "--train-iters", "3", "--global-batch-size", "2", "--mock-data", "--seed", "5"]
    figures = {"device": ctx.device}
    step["figures"] = figures
    for name, cmd in (("build", build), ("verify", mk + ["verify", cache]),
                      ("info", mk + ["info", cache, "--json"])):
        step["commands"].append(shlex.join(cmd))
        log = ctx.path("logs", f"cache_build_{name}.log")
        if os.path.exists(log):
            os.remove(log)
        r = run_cmd(cmd, ctx, log, _timeout(ctx, "cache_build"))
        with open(log, encoding="utf-8") as f:
            text = f.read()
        with open(step["log"], "a", encoding="utf-8") as f:
            f.write(text)
        figures[f"{name}_seconds"] = r["seconds"]
        if r["rc"] != 0:
            _fail(step, f"cache {name} exited {r['rc']}", r["tail"])
            return
        _cache_figures(figures, name, text)
    if not figures.get("verify_ok"):
        _fail(step, "cache verify did not report OK")


def _cache_figures(figures: dict, name: str, text: str) -> None:
    if name == "build":
        for line in text.splitlines():
            if line.startswith("{") and "shards_written" in line:
                figures["build"] = json.loads(line)
    elif name == "verify":
        figures["verify_ok"] = any(line.rstrip().endswith(": OK") for line in text.splitlines())
    else:
        start = text.find("\n{") + 1  # past the "$ command" line; warnings may follow it
        info, _ = json.JSONDecoder().raw_decode(text, start)
        figures["info"] = {k: info.get(k) for k in ("shards_built", "shards_total", "topk",
                                                    "num_samples", "vocab_size", "bytes_per_token",
                                                    "complete")}


def step_bench_step(ctx: Ctx, step: dict) -> None:
    """``tools/bench_step.py`` on the check's device; its rows as the step's figures."""
    out = ctx.path("bench_step")
    timeout = _timeout(ctx, "bench_step")
    cmd = [sys.executable, os.path.join(ROOT, "tools", "bench_step.py"), "--device", ctx.device,
           "--out", out, "--timeout", str(int(timeout))]
    step["commands"].append(shlex.join(cmd))
    r = run_cmd(cmd, ctx, step["log"], timeout)
    path = os.path.join(out, "bench_step.json")
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            report = json.load(f)
        step["figures"] = {"rows": [
            {k: row.get(k) for k in ("row", "error", "step_s", "tokens_per_s", "peak_bytes",
                                     "peak_reserved_bytes", "predicted_peak_bytes",
                                     "measured_over_predicted", "model_tflops", "mfu")}
            for row in report["rows"]], "json": os.path.relpath(path, ctx.out)}
    if r["rc"] != 0:
        _fail(step, f"tools/bench_step.py exited {r['rc']}"
              + (" (timeout)" if r["timed_out"] else ""), r["tail"])


STEP_FUNCS = {"make_teacher": step_make_teacher, "bench_step": step_bench_step, "parity": step_parity,
              "bench_loss": step_bench_loss, "profile_loss": step_profile_loss,
              "train_step_1b": step_train_1b, "train_step_bf16_te": step_train,
              "train_step_tp2_sp": step_train_tp2_sp,
              "train_step_cp2_te": step_train_cp2_te,
              "cache_build": step_cache_build}


def _timeout(ctx: Ctx, name: str) -> float:
    return max(5.0, min(ctx.limits[name], ctx.remaining()))


def run_step(ctx: Ctx, name: str) -> dict:
    step = {"step": name, "status": "ok", "seconds": 0.0, "figures": {}, "commands": [],
            "log": ctx.path("logs", f"{name}.log")}
    if os.path.exists(step["log"]):
        os.remove(step["log"])
    if name in NEEDS_TEACHER and not ctx.teacher_ok:
        step["status"] = "skipped: no teacher checkpoint (make_teacher failed)"
    elif ctx.remaining() < 15:
        step["status"] = "skipped: time budget of the run spent"
    if step["status"] != "ok":
        step["log"] = ""
    else:
        t0 = time.monotonic()
        try:
            STEP_FUNCS[name](ctx, step)
        except Exception:  # a bug in one step must not stop the others
            _fail(step, "the check itself raised", traceback.format_exc()[-3000:])
        step["seconds"] = round(time.monotonic() - t0, 2)
        step["log"] = os.path.relpath(step["log"], ctx.out)
    print(f"[gpu_check] {name}: {step['status']} ({step['seconds']:.1f} s)", flush=True)
    return step


# ---------------------------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------------------------
def header(device: str, argv: list[str], cuda_available: bool) -> dict:
    import platform

    import torch
    name = "cpu"
    if device == "cuda" and cuda_available:
        name = torch.cuda.get_device_name(0)
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": git_commit(),
        "torch": torch.__version__,
        "megatron_core": package_version("megatron-core", "megatron_core"),
        "transformer_engine": package_version("transformer-engine", "transformer_engine",
                                       "transformer-engine-torch"),
        "liger_kernel": package_version("liger-kernel", "liger_kernel"),
        "nvidia_modelopt": package_version("nvidia-modelopt", "nvidia_modelopt", "modelopt"),
        "device": name, "device_requested": device, "cuda_available": cuda_available,
        "python": platform.python_version(), "host": platform.node(),
        "command": shlex.join(["tools/gpu_check.py", *argv]),
    }


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n / 1e6:.2f}M"


def _short(step: dict) -> str:
    """A one-line digest of a step's figures for the summary table."""
    f, name = step.get("figures") or {}, step["step"]
    if name == "parity" and f.get("max_rel_err"):
        parts = [f"{len([r for r in f['cases'] if r['ok']])}/{len(f['cases'])} cases ok"]
        for dt, tol in TOLERANCE.items():
            errs = [v for k, v in f["max_rel_err"].items() if k.startswith(dt) and v is not None]
            if errs:
                parts.append(f"{dt} max rel err {max(errs):.2e} (tol {tol:g})")
        return "; ".join(parts)
    if name == "bench_loss" and f.get("shapes"):
        parts = []
        for shape, d in f["shapes"].items():
            ok = [p for p in d["points"] if p["status"] == "ok"]
            parts.append(f"{shape}: {len(ok)}/{len(d['points'])} points measured")
        return f"{f['figures_of']} figures; " + ", ".join(parts)
    if name == "train_step_1b" and f.get("step_time_s"):
        mfu = f"MFU {f['mfu']:.1%}" if f.get("mfu") else f"no MFU ({f['peak_source']})"
        return (f"student {_count(f['student_parameters'])} on {f['student_param_device']}, "
                f"teacher {_count(f['teacher_parameters'])} on {f['teacher_param_device']}; "
                f"{f['shape']['seq']} tokens: {f['step_time_s']:.3f} s a step, "
                f"{f['tokens_per_s']:.0f} tokens/s, {f['achieved_tflops']:.1f} TFLOP/s, {mfu}; "
                f"attention {', '.join(a.rsplit('.', 1)[-1] for a in f['student_attention'])}")
    if name.startswith("train_step") and f.get("loss_lines"):
        losses = ", ".join(f"{x['loss']:.4f}" for x in f["loss_lines"])
        attention = ", ".join(a.rsplit(".", 1)[-1] for a in f.get("student_attention") or [])
        return (f"{f['precision']}; student on {f['student_param_device']}, teacher on "
                f"{f['teacher_param_device']}; attention {attention or '?'}; TE "
                f"{'used' if f['transformer_engine_used'] else 'not used'}; losses {losses}; "
                f"peak {(f['peak_mem_bytes'] or 0) / 2**20:.0f} MiB")
    if name == "profile_loss" and (f.get("profile") or {}).get("profiles"):
        prof = f["profile"]["profiles"][0]
        top = ", ".join(f"{e['name'][:40]} {e['share']:.0%}" for e in prof["top"][:3]
                        if e.get("share") is not None)
        return f"by {prof['by']}: {top} (all in {f['profile_json']})"
    if name == "cache_build" and f.get("info"):
        return (f"on {f['device']}: {f['info']['shards_built']}/{f['info']['shards_total']} "
                f"shards, K={f['info']['topk']}, verify {'OK' if f.get('verify_ok') else 'FAILED'}")
    if name == "make_teacher" and f:
        return (f"{f['parameters']} parameters on {f['param_device']}; attention "
                f"{', '.join(a.rsplit('.', 1)[-1] for a in f['core_attention'])}")
    return ""


def _md_step(step: dict) -> list[str]:
    f = step.get("figures") or {}
    lines = [f"## {step['step']}", "", f"- status: **{step['status']}**",
             f"- wall seconds: {step['seconds']}", f"- log: `{step['log']}`"]
    for e in step.get("errors", []):
        lines.append(f"- error: {e}")
    if step["commands"]:
        lines += ["", "Commands:", "", "```bash", *step["commands"], "```"]
    if step["step"] == "parity" and f.get("cases"):
        lines += ["", f"Sizes: `{json.dumps(f['sizes'])}`; tolerance fp32 {TOLERANCE['fp32']:g},"
                  f" bf16 {TOLERANCE['bf16']:g} (max relative error, normwise).", "",
                  "The last column, for context only: the reference's own formulas evaluated "
                  "in fp32 on the same inputs (loss / grad hidden / grad weight).", "",
                  "| case | ok | rel err loss | rel err grad hidden | rel err grad weight | s "
                  "| textbook fp32 |", "|---|---|---|---|---|---|---|"]
        for r in f["cases"]:
            if "error" in r:
                lines.append(f"| {r['case']} | **NO** | {r['error'][:120]} | | | | |")
                continue
            naive = " / ".join(f"{r[f'naive_fp32_rel_err_{k}']:.1e}" for k in
                               ("loss", "grad_x", "grad_w") if f"naive_fp32_rel_err_{k}" in r)
            lines.append(f"| {r['case']} | {'yes' if r['ok'] else '**NO**'} | "
                         f"{r['rel_err_loss']:.2e} | {r['rel_err_grad_x']:.2e} | "
                         f"{r['rel_err_grad_w']:.2e} | {r['seconds']:.3f} | {naive} |")
    elif step["step"] == "bench_loss" and f.get("shapes"):
        lines += ["", f"Figures of: {f['figures_of']}; time budget {f['budget_s']} s; one "
                  "bench_loss run per variant, the table by its --from-json."]
        for shape, d in f["shapes"].items():
            lines += ["", f"### {shape}: `{d['args']}`", "", d["table_markdown"] or "(no table)"]
            why = [f"{p['variant']}: {p['status']} ({p['reason']})" for p in d["points"]
                   if p.get("reason")]
            if why:
                lines += ["", *(f"- {w}" for w in why)]
    elif f:
        lines += ["", "Figures:", "", "```json", json.dumps(f, indent=1), "```"]
    if step.get("output_tail"):
        lines += ["", "Output (tail):", "", "```", step["output_tail"].rstrip(), "```"]
    return lines + [""]


def _guarded(render, step: dict, fallback):
    """``render(step)``, or ``fallback`` when odd figures (a None, a missing key) break it: the
    JSON report keeps them all."""
    try:
        return render(step)
    except (KeyError, TypeError, ValueError):
        return fallback


def write_reports(out: str, head: dict, steps: list[dict]) -> tuple[str, str]:
    report = {"header": head, "steps": steps,
              "failed": [s["step"] for s in steps if s["status"] == "failed"]}
    json_path, md_path = os.path.join(out, "report.json"), os.path.join(out, "report.md")
    with open(json_path, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1)
    lines = ["# megatron_kd hardware check", "", "| | |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in head.items()]
    lines += ["", "## Summary", "", "| step | status | wall s | figures |", "|---|---|---|---|"]
    for s in steps:
        lines.append(f"| {s['step']} | {s['status']} | {s['seconds']:.1f} | "
                     f"{_guarded(_short, s, '')} |")
    lines.append("")
    for s in steps:
        lines += _guarded(_md_step, s, [f"## {s['step']}", "", f"- status: **{s['status']}**",
                                        "- (figures could not be rendered: see report.json)",
                                        ""])
    with open(md_path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines))
    return json_path, md_path


# ---------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------
def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                   help="auto: CUDA when a GPU is usable, else the CPU")
    p.add_argument("--out", default="gpu_check_out", help="report directory")
    p.add_argument("--steps", nargs="+", choices=STEPS,
                   default=[s for s in STEPS if s not in ON_REQUEST],
                   help="steps to run (make_teacher is added when a later step needs it; "
                        f"{', '.join(ON_REQUEST)} only when named)")
    p.add_argument("--parity-size", choices=tuple(PARITY_SIZES), default=None,
                   help="parity sizes (default: moderate on CUDA, tiny on the CPU)")
    p.add_argument("--budget", type=float, default=None,
                   help="seconds for the whole run (default: 450 on CUDA, 900 on the CPU)")
    p.add_argument("--bench-budget", type=float, default=None,
                   help="seconds for bench_loss (default: 300 on CUDA, 150 on the CPU)")
    p.add_argument("--point-timeout", type=float, default=None,
                   help="seconds for one bench_loss point (default: 60 on CUDA, 120 on the CPU)")
    p.add_argument("--jobs", type=int, default=None,
                   help="steps run at a time after make_teacher (default: 1 on CUDA, where "
                        "steps would share the GPU and skew each other's figures; 2 on the CPU, "
                        "where the figures only show that each step runs)")
    p.add_argument("--shared-processes", action="store_true",
                   help="the CPU only: make_teacher's process also makes train_step_1b's "
                        "teacher, and the two-rank steps train in one torchrun (fewer process "
                        "start-ups; a crash of either two-rank run then fails both)")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="the device's dense bf16 peak for the 1B step's MFU (default: known "
                        "for H100, H200, A100)")
    # internal: one worker process
    p.add_argument("--worker", choices=tuple(WORKERS), help=argparse.SUPPRESS)
    p.add_argument("--worker-out", help=argparse.SUPPRESS)
    p.add_argument("--teacher-dir", help=argparse.SUPPRESS)
    p.add_argument("--arch-json", help=argparse.SUPPRESS)
    p.add_argument("--params-dtype", choices=("fp32", "bf16"), default="fp32",
                   help=argparse.SUPPRESS)
    p.add_argument("--train-argv", help=argparse.SUPPRESS)
    p.add_argument("--train-runs", help=argparse.SUPPRESS)
    p.add_argument("--also-teacher", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.jobs is not None and a.jobs < 1:
        p.error(f"--jobs {a.jobs}: must be at least 1")
    return a


def _limits(a: argparse.Namespace, device: str) -> dict:
    limits = dict(LIMITS[device])
    for key, value in (("total", a.budget), ("bench", a.bench_budget), ("point", a.point_timeout)):
        if value is not None:
            limits[key] = value
    return limits


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    a = parse_args(argv)
    if TESTS not in sys.path:
        sys.path.insert(0, TESTS)  # tests/support: the reference, the tiny models' flags
    if a.worker:
        return worker_main(a)
    signal.signal(signal.SIGTERM, _stop)  # its processes are killed too
    import torch
    cuda = torch.cuda.is_available() and a.device != "cpu"
    device = a.device if a.device != "auto" else ("cuda" if cuda else "cpu")
    out = os.path.abspath(a.out)
    os.makedirs(out, exist_ok=True)
    head = header(device, argv, cuda)
    print(f"[gpu_check] device {head['device']} ({device}), report in {out}", flush=True)
    selected = set(a.steps) | ({"make_teacher"} if set(a.steps) & set(NEEDS_TEACHER) else set())
    limits = _limits(a, device)
    ctx = Ctx(args=a, device=device, out=out, env=_env(device),
              deadline=time.monotonic() + limits["total"], limits=limits)
    run_order = [n for n in RUN_ORDER if n in selected]
    missing = [name for name, key in (("Liger-Kernel", "liger_kernel"),
                                      ("ModelOpt", "nvidia_modelopt"),
                                      ("Transformer Engine", "transformer_engine"))
               if head[key] == "not installed"]
    head.update(run_order=" -> ".join(run_order), time_budget_s=limits["total"],
                peers_not_measured=(", ".join(missing) + " (not installed)") if missing
                else "none")
    jobs = a.jobs or (1 if device == "cuda" else 2)
    head["jobs"] = jobs
    t0 = time.monotonic()

    def one(name: str) -> dict:
        if device == "cuda" and not cuda:
            return {"step": name, "status": NO_GPU + " (--device cuda but CUDA is not "
                    "available)", "seconds": 0.0, "figures": {}, "commands": [], "log": ""}
        return run_step(ctx, name)

    # the teacher first (the others need it), then the rest ``jobs`` at a time, in run order;
    # --shared-processes (the CPU): parity, which needs no teacher, beside make_teacher
    beside = [n for n in run_order if n == "parity"] if ctx.shared and jobs > 1 and \
        "make_teacher" in run_order else []
    with ThreadPoolExecutor(max_workers=jobs, thread_name_prefix="step") as pool:
        futures = [(name, pool.submit(one, name)) for name in beside]
        steps = {name: one(name) for name in run_order if name == "make_teacher"}
        futures += [(name, pool.submit(one, name)) for name in run_order
                    if name != "make_teacher" and name not in beside]
        steps.update((name, future.result()) for name, future in futures)
    head["total_seconds"] = round(time.monotonic() - t0, 1)
    ordered = [steps[n] for n in STEPS if n in steps]
    json_path, md_path = write_reports(out, head, ordered)
    print(f"[gpu_check] wrote {json_path} and {md_path}", flush=True)
    if device == "cuda" and not cuda:
        print("[gpu_check] --device cuda was asked for but CUDA is not available: nothing ran",
              file=sys.stderr)
        return 2
    failed = [s["step"] for s in ordered if s["status"] == "failed"]
    if failed:
        print(f"[gpu_check] FAILED: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
