#!/usr/bin/env python
"""Validate the planner against measured ``megatron-kd train`` runs.

For each run (its ``megatron-kd train`` arguments and the JSON log it wrote with ``--log-json``):

* memory: the planner's prediction for the logging rank (rank 0: pipeline stage 0, TP rank 0)
  against the measured peak, ``max(peak_mem_bytes)`` over the run's steps. Target: within 15%.
  A disaggregated run's teacher is a replica of its own, outside the student's world (``megatron-kd
  teacher serve``, its own process or torchrun, registered at the student's
  ``--kd-teacher-endpoint``); ``--run`` starts one for each disaggregated case (the case's
  ``teacher_args``: the serve flags of its layout, ``teacher_nproc`` ranks), waits for its
  registration, runs the student against it and stops it (SIGTERM). A CPU run then adds a row for
  the replica's rank 0 (its pipeline stage 0, TP rank 0): the planner's teacher GPU
  (``search.teacher_inference_terms`` with the replica's TP and PP from its serve flags, DP 1)
  against that process's peak RSS.
* wire (disaggregated runs), both directions, each per step, each target: equal, exactly.
  Teacher -> student hidden states (``hidden_bytes_per_step_per_dp_rank`` at the run's wire
  dtype, ``--kd-wire-dtype`` or the teacher's) against a per-step log field,
  ``--wire-bytes-key``: ``megatron-kd train`` logs ``kd_wire_bytes`` (every student rank's
  received bytes, summed: scope ``all-ranks``) and ``kd_wire_bytes_per_dp_rank`` (that over the
  data-parallel size: scope ``dp-rank``, the default). Student -> teacher token ids
  (``token_bytes_per_step_per_dp_rank``, 4 bytes a token, times the data-parallel size) against
  ``kd_wire_bytes_to_teacher``, which sums what the student's ranks sent (each data-parallel
  rank's last-stage TP rank 0 sends its tokens once): scope ``all-ranks``.

Measurement method. On a GPU, ``peak_mem_bytes`` is ``torch.cuda.max_memory_allocated()`` and is
compared with the planner's terms directly (the reserve left out: the allocator statistics do not
see the CUDA context or NCCL). On CPU it is the process's peak resident set size
(``ru_maxrss``), which also holds the interpreter, torch, Megatron and the CPU shim; that
framework baseline is measured once (a process that imports exactly what ``megatron-kd train``
imports and installs the CPU shim, nothing else; or ``--baseline-bytes``), and the planner is
compared with ``peak - baseline``. Both the absolute and the baseline-subtracted ratios are printed.
The runs (``--run``) and the baseline process get ``MALLOC_MMAP_THRESHOLD_=65536`` (glibc): each
allocation of 64 KiB or more is a mapping of its own, returned to the system when freed, so peak
RSS follows the peak of live tensors, as ``max_memory_allocated`` does on a GPU. Without it
glibc's heap keeps freed activations and gradient temporaries (the offline tp1 run's RSS grows
by about 0.4 GiB from the end of step 1 to the end of step 2 with no more live tensors, and its
ratio reads 0.83), the CPU's counterpart of the caching allocator's reserved-but-free memory:
not a term of the planner. Runs made elsewhere should set it too. The peaks come from a
wrapper of the ``megatron-kd`` entry point (``megatron_kd.testing.replicas``; the student's ranks
and the replica's both run it) that writes each rank's ``ru_maxrss`` at exit (``rank<R>.json``,
the replica's in a directory of its own: it writes no training log). The replica gets the same
environment (``MALLOC_...``, and ``OMP_NUM_THREADS`` as the student has it).

How the planner is configured for a run, and what it predicts, is the package's
(:mod:`megatron_kd.commands.plan_adapter`: the run resolved as ``megatron-kd train`` resolves it,
the planner's inputs, its terms); this tool runs the runs and compares. A replica whose
``--kd-teacher-dtype`` is not the student's is refused. Known gaps: MLP biases
(``--add-bias-linear``) and learned position embeddings are not counted; ``ru_maxrss`` is a
high-water mark over the whole process, so a transient at start-up (e.g. a checkpoint load holding
two copies of the teacher) can exceed the training peak; pipeline ranks other than the last build
the teacher and free it, which the high-water mark still sees. Validate with
``--pipeline-model-parallel-size 1`` runs. The planner sums its terms, though the teacher's
forward working set is freed before the loss's window buffers are allocated (an overestimate of
the smaller of the two), and the loss holds one ``[w, V/t]`` buffer less than counted when a
micro-batch fits in one window (the tp2 cases: the previous window's gradient is what the fourth
buffer counts); both stay inside the tolerance at these sizes. The replica's send slots are
counted as ``D`` micro-batches of the student's. A replica's peak is compared on CPU only (its RSS
is host memory on a GPU machine).

Usage::

    # a finished run
    python tools/validate_planner.py --train-args "<the megatron-kd train flags>" \\
        --log-json run.jsonl
    # several runs described in a JSON file: [{"name": ..., "train_args": ..., "log_json": ...,
    #     "nproc": 1, "peak_dir": optional, and for a disaggregated run optionally
    #     "teacher_args": "--tensor-model-parallel-size 1" (its replica's serve flags besides
    #     --kd-teacher-load / --kd-teacher-endpoint, which are the student's), "teacher_nproc": 1,
    #     "teacher_peak_dir": ...}, ...]
    python tools/validate_planner.py --cases cases.json
    # run them first (single process, or torchrun with nproc > 1; a disaggregated run's replica
    # first, `megatron-kd teacher serve`, torchrun with teacher_nproc > 1), then compare
    python tools/validate_planner.py --cases cases.json --run
    # the built-in CPU cases, every mode of megatron-kd train at TP=1 and TP=2: a random teacher
    # checkpoint, its top-K cache (megatron-kd cache build), colocated, offline and disaggregated
    # runs (a replica of 1 rank + a student of 1 or 2 ranks); a few minutes on two idle CPU cores
    python tools/validate_planner.py --builtin --run [--terms]
    # only some of them: the context-parallel cases (CP 2, one sequence of 1K and 4K tokens a
    # step, colocated and disaggregated; about 3 minutes)
    python tools/validate_planner.py --builtin --run --only cp2

Needs torch and megatron-core (it uses the training code's own argument parsing); the planner itself
does not. The script is one piece: its built-in cases, running them and comparing them are the
steps of one command.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

from megatron_kd.commands.plan_adapter import (
    parse_train_args,
    predict,
    predict_teacher,
    resolve_run,
)
from megatron_kd.commands.teacher_serve import add_arguments as add_serve_arguments
from megatron_kd.planner.memory import total_bytes
from megatron_kd.planner.plan import Mode
from megatron_kd.teacher.endpoint import DirectoryEndpoint, parse_endpoint
from megatron_kd.testing.replicas import Replica, command, read_rank_peak

TOLERANCE = 0.15  # the target: predicted peak memory within 15% of the measured one
#: Seconds a --run waits for a teacher replica's registration (Python, torch, Megatron and the
#: teacher's checkpoint on a busy 2-core machine).
REPLICA_START_TIMEOUT_S = 300
#: The per-step log field with the student -> teacher token-id bytes, summed over the student.
TO_TEACHER_KEY = "kd_wire_bytes_to_teacher"

# glibc malloc: every allocation of 64 KiB or more gets a mapping of its own, unmapped when freed
# (a fixed threshold also turns off glibc's raising of it). Peak RSS then follows the peak of live
# tensors, as torch.cuda.max_memory_allocated does on a GPU, instead of also holding freed memory
# that the heap keeps (see "Measurement method" above). Applied to the runs and the baseline.
MEASURE_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536"}

#: What the baseline process does before its peak RSS is read: what ``megatron-kd train``
#: imports, and the CPU shim (``tools/bench_step.py`` reads it at the start of another process)
BASELINE_IMPORTS = (
    "import resource\n"
    "import torch, megatron.core\n"
    "import megatron_kd.commands.train\n"
    "from megatron_kd.integration.cpu_shim import install_cpu_shim\n"
    "install_cpu_shim()\n"
)
_BASELINE_CODE = (
    BASELINE_IMPORTS
    + "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)\n"
)


# A random teacher (its weights do not matter for memory) and runs of a smaller student in every
# mode of `megatron-kd train`, sized so that the model state and activations dominate the
# framework's own memory.
_TEACHER_ARCH = dict(
    num_layers=6,
    hidden_size=768,
    num_attention_heads=12,
    num_query_groups=4,
    ffn_hidden_size=2048,
    vocab_size=32000,
    padded_vocab_size=32000,
    max_position_embeddings=4096,  # the longest built-in case's sequence
    tie_embeddings=False,
)
_STUDENT_FLAGS = (
    "--num-layers 4 --hidden-size 512 --num-attention-heads 8 --num-query-groups 4 "
    "--ffn-hidden-size 1536 --seq-length 512 --train-iters 2 --mock-data "
    "--eval-iters 0 --eval-interval 1000"
)
_WITH_TEACHER = " --kd-teacher-load {teacher}"
_DISAGG = " --kd-mode disaggregated --kd-teacher-endpoint {endpoint}"
# a replica of one rank: its `megatron-kd teacher serve` layout flags and process count
_REPLICA_1 = ("--tensor-model-parallel-size 1 --pipeline-model-parallel-size 1", 1)
BUILTIN_TOPK = 64  # entries per token of the built-in offline case's cache
# (name, megatron-kd train flags with {teacher} / {cache} / {endpoint} to fill in, process count,
#  the teacher replica as (serve flags, process count), or None: no replica)
BUILTIN_CASES = [
    (
        "colocated tp1 b4 s512",
        _STUDENT_FLAGS + _WITH_TEACHER + " --micro-batch-size 4 --global-batch-size 4",
        1,
        None,
    ),
    (
        "colocated tp2 b2 s512",
        _STUDENT_FLAGS + _WITH_TEACHER + " --micro-batch-size 2 --global-batch-size 4 "
        "--tensor-model-parallel-size 2",
        2,
        None,
    ),
    (
        "offline tp1 b4 s512",
        _STUDENT_FLAGS + " --micro-batch-size 4 --global-batch-size 4 "
        "--kd-mode offline --kd-topk-cache {cache}",
        1,
        None,
    ),
    (
        "offline tp2 b4 s512",
        _STUDENT_FLAGS + " --micro-batch-size 4 --global-batch-size 4 "
        "--tensor-model-parallel-size 2 --kd-mode offline --kd-topk-cache {cache}",
        2,
        None,
    ),
    (
        "disagg tp1 b4 s512",
        _STUDENT_FLAGS + _WITH_TEACHER + " --micro-batch-size 4 --global-batch-size 4" + _DISAGG,
        1,
        _REPLICA_1,
    ),
    (
        "disagg tp2 b2 s512",
        _STUDENT_FLAGS + _WITH_TEACHER + " --micro-batch-size 2 --global-batch-size 4 "
        "--tensor-model-parallel-size 2" + _DISAGG,
        2,
        _REPLICA_1,
    ),
    # context parallelism: one sequence a step split over two ranks (the CPU's attention keeps
    # [heads, s/2, s] scores, so the sequences stay within a few GiB per rank)
    *(
        (
            f"{name} cp2 b1 s{seq}",
            _STUDENT_FLAGS + _WITH_TEACHER + f" --seq-length {seq} --micro-batch-size 1 "
            "--global-batch-size 1 --context-parallel-size 2" + extra,
            2,
            replica,
        )
        for name, extra, replica in (("colocated", "", None), ("disagg", _DISAGG, _REPLICA_1))
        for seq in (1024, 4096)
    ),
]

_MAKE_TEACHER_CODE = (
    "import json, sys\n"
    "from megatron_kd.integration.cpu_shim import install_cpu_shim\n"
    "install_cpu_shim()\n"
    "import torch.distributed as dist\n"
    "from megatron_kd.integration.groups import init_distributed_from_env, model_parallel\n"
    "from megatron_kd.arch import GPTArchConfig\n"
    "from megatron_kd.integration.checkpoint import save_model_checkpoint\n"
    "from megatron_kd.integration.gpt import build_gpt_model\n"
    "init_distributed_from_env()\n"
    "arch = GPTArchConfig(**json.loads(sys.argv[2]))\n"
    "with model_parallel(tp=1):\n"
    "    save_model_checkpoint(build_gpt_model(arch, seed=1), arch, sys.argv[1])\n"
    "dist.destroy_process_group()\n"
)


def make_random_teacher(directory: str, arch: dict | None = None) -> None:
    """A megatron_kd checkpoint of a randomly initialised teacher (``arch``: ``GPTArchConfig``
    fields, default ``_TEACHER_ARCH``), made in a process of its own."""
    subprocess.run(
        [sys.executable, "-c", _MAKE_TEACHER_CODE, directory,
         json.dumps(_TEACHER_ARCH if arch is None else arch)], check=True
    )


def cache_build_argv(
    train_args: str, world_size: int, cache_dir: str, teacher_dir: str, topk: int
) -> list[str]:
    """``megatron-kd cache build`` flags that make the cache an offline run reads: the run's data
    flags, sequence length, seed and sample count (``train_iters x global batch``), so that
    ``check_run`` accepts it (same dataset identity, tokenizer, vocabulary and length)."""
    args = parse_train_args(train_args)
    dp = world_size // (args.tensor_model_parallel_size * args.pipeline_model_parallel_size)
    gbs = args.global_batch_size or args.micro_batch_size * max(1, dp)
    argv = [
        "--out", cache_dir,
        "--kd-teacher-load", teacher_dir,
        "--kd-topk", str(topk),
        "--seq-length", str(args.seq_length),
        "--micro-batch-size", str(args.micro_batch_size),
        "--train-iters", str(args.train_iters),
        "--global-batch-size", str(gbs),
        "--eval-iters", str(args.eval_iters),
        "--seed", str(args.seed),
        "--split", args.split,
    ]  # fmt: skip
    if args.mock_data:
        argv.append("--mock-data")
    else:
        if not args.data_path or not args.tokenizer_model:
            raise ValueError(
                f"an offline run without --mock-data needs --data-path and --tokenizer-model to "
                f"build its cache, got data_path={args.data_path!r}, "
                f"tokenizer_model={args.tokenizer_model!r}"
            )
        argv += ["--data-path", *args.data_path, "--tokenizer-model", args.tokenizer_model]
        if args.eod_token is not None:
            argv += ["--eod-token", args.eod_token]
        if args.data_cache_path is not None:
            argv += ["--data-cache-path", args.data_cache_path]
    return argv


def make_topk_cache(
    cache_dir: str, teacher_dir: str, train_args: str, world_size: int, topk: int
) -> None:
    """Build the top-K cache of an offline run with ``megatron-kd cache build`` (one process)."""
    argv = cache_build_argv(train_args, world_size, cache_dir, teacher_dir, topk)
    subprocess.run([sys.executable, "-m", "megatron_kd", "cache", "build", *argv], check=True)


@dataclass
class Case:
    """One training run to compare."""

    name: str
    train_args: str
    log_json: str | None
    nproc: int = 1
    peak_dir: str | None = None
    """Where each rank wrote its process's peak RSS at exit (``rank<R>.json``; made by
    ``--run``), or None."""
    teacher_args: str | None = None
    """Disaggregated: the ``megatron-kd teacher serve`` flags of the run's one teacher replica
    besides ``--kd-teacher-load`` and ``--kd-teacher-endpoint`` (the student's) and ``--host``
    (e.g. ``"--tensor-model-parallel-size 1"``); None for the other modes, or when the replica
    is not known (no teacher row then)."""
    teacher_nproc: int = 1
    """The replica's process count (its TP x PP; torchrun when > 1)."""
    teacher_peak_dir: str | None = None
    """Where each replica rank wrote its process's peak RSS at exit (``rank<R>.json``; made by
    ``--run``), or None."""


def teacher_serve_argv(train_args: argparse.Namespace, teacher_args: str) -> list[str]:
    """The ``megatron-kd teacher serve`` flags of a disaggregated run's replica: the student's
    teacher checkpoint and endpoint, ``--host 127.0.0.1``, then ``teacher_args``."""
    return [
        "serve",
        "--kd-teacher-load", train_args.kd_teacher_load,
        "--kd-teacher-endpoint", train_args.kd_teacher_endpoint,
        "--host", "127.0.0.1",
        *shlex.split(teacher_args),
    ]  # fmt: skip


def teacher_serve_args(case: Case) -> argparse.Namespace:
    """The replica's serve flags as ``megatron-kd teacher serve`` parses them, checked against
    the student's (same checkpoint, endpoint and teacher dtype; ``teacher_nproc`` ranks)."""
    if case.teacher_args is None:
        raise ValueError(f"case {case.name!r}: no teacher replica (teacher_args is None)")
    train = parse_train_args(case.train_args)
    if train.kd_mode != "disaggregated":
        raise ValueError(
            f"case {case.name!r}: teacher_args are for --kd-mode disaggregated runs, "
            f"this one is {train.kd_mode}"
        )
    parser = argparse.ArgumentParser(prog="megatron-kd teacher")
    add_serve_arguments(parser)
    serve = parser.parse_args(teacher_serve_argv(train, case.teacher_args))
    for flag, theirs, ours in (
        ("--kd-teacher-load", serve.kd_teacher_load, train.kd_teacher_load),
        ("--kd-teacher-endpoint", serve.kd_teacher_endpoint, train.kd_teacher_endpoint),
        ("--kd-teacher-dtype", serve.kd_teacher_dtype, train.kd_teacher_dtype),
    ):
        if theirs != ours:
            raise ValueError(
                f"case {case.name!r}: the replica's {flag} {theirs!r} is not the student's {ours!r}"
            )
    world = serve.tensor_model_parallel_size * serve.pipeline_model_parallel_size
    if case.teacher_nproc != world:
        raise ValueError(
            f"case {case.name!r}: teacher_nproc={case.teacher_nproc}, but a replica's world is "
            f"its TP x PP = {world}"
        )
    return serve


# --- measurement --------------------------------------------------------------------------------


def measure_baseline() -> int:
    """Peak RSS of a process that only imports what ``megatron-kd train`` imports (CPU runs)."""
    proc = subprocess.run(
        [sys.executable, "-c", _BASELINE_CODE],
        capture_output=True,
        text=True,
        check=True,
        env=dict(os.environ, **MEASURE_ENV),
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


def _omp_threads(nproc: int) -> str | None:
    """``OMP_NUM_THREADS`` of a run of ``nproc`` processes: the caller's, else torchrun's
    default (1) when ``nproc > 1``, else unset (torch's own default)."""
    return os.environ.get("OMP_NUM_THREADS") or ("1" if nproc > 1 else None)


def start_replica(case: Case, peak_dir: str, log_path: str, env: dict) -> Replica:
    """A disaggregated case's teacher replica (``megatron-kd teacher serve`` with the case's
    serve flags, each rank writing its peak RSS into ``peak_dir``), registered at the student's
    directory endpoint, which must hold no other replica."""
    serve = teacher_serve_args(case)
    endpoint = serve.kd_teacher_endpoint
    if not isinstance(parse_endpoint(endpoint), DirectoryEndpoint):
        raise ValueError(
            f"case {case.name!r}: --run waits for the replica's registration in a directory "
            f"endpoint, got --kd-teacher-endpoint {endpoint!r}"
        )
    os.makedirs(endpoint, exist_ok=True)
    before = sorted(n for n in os.listdir(endpoint)
                    if n.startswith("replica-") and n.endswith(".json"))
    if before:
        raise RuntimeError(
            f"case {case.name!r}: the endpoint {endpoint} already has registered replicas "
            f"{before}: the student would use them too (and a stale record a dead one); give the "
            f"case an endpoint of its own"
        )
    os.makedirs(peak_dir, exist_ok=True)
    try:
        # the student's checkpoint and endpoint, then the case's serve flags (its layout among them)
        return Replica(endpoint, serve.kd_teacher_load, log=log_path,
                       tp=serve.tensor_model_parallel_size, pp=serve.pipeline_model_parallel_size,
                       extra=shlex.split(case.teacher_args), stats_interval=None, env=env,
                       peak_dir=peak_dir, start_timeout_s=REPLICA_START_TIMEOUT_S)
    except RuntimeError as exc:
        raise RuntimeError(f"case {case.name!r}: {exc}") from None


def run_case(
    case: Case, log_path: str, peak_dir: str, teacher_peak_dir: str | None = None
) -> float:
    """Run ``megatron-kd train`` for ``case`` (torchrun when ``nproc > 1``), logging to
    ``log_path``, each rank writing its peak RSS into ``peak_dir``; returns the student's wall
    seconds. A disaggregated case's teacher replica (``teacher_args``, ``teacher_nproc``) is
    started first, its ranks writing their peaks into ``teacher_peak_dir``, and stopped after
    the student (also when the student fails)."""
    train = parse_train_args(case.train_args)
    disaggregated = train.kd_mode == "disaggregated"
    if disaggregated and case.teacher_args is None:
        raise ValueError(
            f"case {case.name!r}: a disaggregated --run needs its teacher replica's serve flags "
            f"(teacher_args, e.g. '--tensor-model-parallel-size 1', and teacher_nproc)"
        )
    if disaggregated and teacher_peak_dir is None:
        raise ValueError(f"case {case.name!r}: a disaggregated --run needs a teacher_peak_dir")
    argv = ["train", *shlex.split(case.train_args), "--log-json", log_path, "--no-progress"]
    os.makedirs(peak_dir, exist_ok=True)
    env = dict(os.environ, **MEASURE_ENV)
    omp = _omp_threads(case.nproc)
    if omp is not None:
        env["OMP_NUM_THREADS"] = omp  # the same for the student and its replica
    replica = None
    if disaggregated:
        teacher_log = os.path.splitext(log_path)[0] + ".teacher.jsonl"
        t0 = time.perf_counter()
        replica = start_replica(case, teacher_peak_dir, teacher_log, env)
        print(
            f"{case.name}: teacher replica registered in {time.perf_counter() - t0:.0f} s",
            file=sys.stderr,
        )
    try:
        t0 = time.perf_counter()
        subprocess.run(command("megatron_kd", argv, case.nproc, peak_dir=peak_dir), check=True,
                       env=env)
        return time.perf_counter() - t0
    finally:
        if replica is not None:
            code = replica.stop(timeout_s=120.0)
            if code != 0:
                print(
                    f"{case.name}: the teacher replica exited with {code} (stderr: "
                    f"{replica.stderr_path})",
                    file=sys.stderr,
                )


# --- comparison ---------------------------------------------------------------------------------


def _mode_label(mode: Mode | str | None) -> str:
    """What a row prints as its mode: a planner mode's name, "no teacher", or ``mode`` itself."""
    if isinstance(mode, Mode):
        return mode.value
    return "no teacher" if mode is None else mode


def _memory_row(name, mode, kind, terms, measured, baseline, on_cpu) -> dict:
    """One row: ``terms`` (by :class:`~megatron_kd.planner.memory.Term`) against the measured
    peak."""
    predicted = total_bytes(terms)
    row = {
        "name": name,
        "mode": _mode_label(mode),
        "kind": kind,
        "predicted_bytes": predicted,
        "measured_bytes": measured,
        "terms": terms,
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
    return row


def compare(case: Case, baseline: int | None, wire_key: str, wire_scope: str) -> list[dict]:
    """The rows of one run: the logging rank, and for a disaggregated CPU run with its
    replica's serve flags and peaks, the replica's rank 0."""
    if case.log_json is None:
        raise ValueError(f"case {case.name!r}: no log (pass --log-json, or --run)")
    config, run = resolve_run(case.train_args, case.nproc)
    steps = read_log(case.log_json)
    kinds = {r.get("peak_mem_kind") for r in steps}
    if len(kinds) != 1:
        raise ValueError(f"{case.log_json}: mixed peak_mem_kind {kinds}")
    kind = kinds.pop()
    on_cpu = kind == "cpu_max_rss"
    pred = predict(config, run, on_cpu)
    measured = max(r["peak_mem_bytes"] for r in steps)
    row = _memory_row(case.name, pred.mode, kind, pred.terms, measured, baseline, on_cpu)
    rows = [row]
    if pred.wire is not None:
        if not all(wire_key in r for r in steps):
            raise ValueError(
                f"{case.log_json}: a disaggregated run must log {wire_key!r} every step"
            )
        if not all(TO_TEACHER_KEY in r for r in steps):
            raise ValueError(
                f"{case.log_json}: a disaggregated run must log {TO_TEACHER_KEY!r} every step"
            )
        counted = {r[wire_key] for r in steps}
        row["wire_predicted"] = pred.wire[wire_scope]
        row["wire_counted"] = sorted(counted)
        # kd_wire_bytes_to_teacher: summed over the student's ranks (step_wire_bytes)
        sent = {r[TO_TEACHER_KEY] for r in steps}
        row["wire_to_teacher_predicted"] = pred.wire_to_teacher["all-ranks"]
        row["wire_to_teacher_counted"] = sorted(sent)
        row["wire_ok"] = counted == {pred.wire[wire_scope]} and sent == {
            pred.wire_to_teacher["all-ranks"]
        }
        # The replica's memory: its rank 0's peak RSS (host memory: CPU runs only).
        peak = None
        if case.teacher_args is not None and case.teacher_peak_dir:
            peak = read_rank_peak(case.teacher_peak_dir, 0)
        if on_cpu and peak is not None:
            serve = teacher_serve_args(case)
            tp, pp = serve.tensor_model_parallel_size, serve.pipeline_model_parallel_size
            terms = predict_teacher(config, run, on_cpu, tp, pp)
            rows.append(
                _memory_row(
                    f"{case.name} (teacher)",
                    "disagg teacher",
                    f"cpu_max_rss of replica rank 0 (tp{tp} pp{pp})",
                    terms,
                    peak,
                    baseline,
                    on_cpu,
                )
            )
    return rows


def format_rows(rows: list[dict], with_terms: bool = False) -> str:
    gib = float(1 << 30)
    header = (
        f"{'run':<31}{'mode':<17}{'predicted GiB':>14}{'measured GiB':>14}{'baseline GiB':>14}"
        f"{'ratio':>8}{'abs.':>8}  within 15%  wire"
    )
    out = [header]
    for r in rows:
        base = r.get("baseline_bytes")
        if "wire_ok" not in r:
            wire = "n/a"
        elif r["wire_ok"]:
            wire = (
                f"equal (to student {r['wire_predicted']:.0f}, to teacher "
                f"{r['wire_to_teacher_predicted']:.0f} B/step)"
            )
        else:
            wire = (
                f"DIFFERS (to student {r['wire_predicted']:.0f} vs {r['wire_counted']}, to "
                f"teacher {r['wire_to_teacher_predicted']:.0f} vs {r['wire_to_teacher_counted']})"
            )
        out.append(
            f"{r['name']:<31}{r['mode']:<17}{r['predicted_bytes'] / gib:>14.3f}"
            f"{r['measured_bytes'] / gib:>14.3f}{(base or 0) / gib:>14.3f}{r['ratio']:>8.3f}"
            f"{r.get('ratio_absolute', r['ratio']):>8.3f}  "
            f"{'yes' if r['memory_ok'] else 'NO':<11} {wire}"
        )
        if with_terms:
            for term, value in r["terms"].items():
                out.append(f"    {term.label:<40}{value / gib:>10.3f} GiB")
    return "\n".join(out)


def rows_to_json(rows: list[dict]) -> list[dict]:
    """The rows as JSON-ready data: terms by their labels."""
    return [dict(r, terms={t.label: v for t, v in r["terms"].items()}) for r in rows]


def builtin_cases(teacher_dir: str, cache_dir: str, endpoint_dir: str) -> list[Case]:
    """The built-in cases with their teacher checkpoint, top-K cache and teacher endpoint
    directory filled in (the disaggregated cases run one after the other, each with a replica of
    its own that withdraws from the endpoint when stopped)."""
    cases = []
    for name, flags, nproc, replica in BUILTIN_CASES:
        teacher_args, teacher_nproc = replica if replica is not None else (None, 1)
        cases.append(
            Case(
                name=name,
                train_args=flags.format(
                    teacher=teacher_dir, cache=cache_dir, endpoint=endpoint_dir
                ),
                log_json=None,
                nproc=nproc,
                teacher_args=teacher_args,
                teacher_nproc=teacher_nproc,
            )
        )
    return cases


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--train-args", help="the megatron-kd train flags of one run, quoted")
    parser.add_argument("--log-json", help="its --log-json file")
    parser.add_argument("--nproc", type=int, default=1, help="its process count (world size)")
    parser.add_argument(
        "--teacher-args",
        default=None,
        help="a disaggregated run's teacher replica: its `megatron-kd teacher serve` flags besides "
        "--kd-teacher-load, --kd-teacher-endpoint and --host, quoted (e.g. "
        "'--tensor-model-parallel-size 1')",
    )
    parser.add_argument(
        "--teacher-nproc", type=int, default=1, help="the replica's process count (its TP x PP)"
    )
    parser.add_argument(
        "--cases",
        help="JSON list of {name, train_args, log_json, nproc[, peak_dir, teacher_args, "
        "teacher_nproc, teacher_peak_dir]}",
    )
    parser.add_argument(
        "--run", action="store_true", help="run each case first (logs to a temp dir)"
    )
    parser.add_argument(
        "--builtin",
        action="store_true",
        help="the built-in CPU cases, every mode (needs --run: a random teacher checkpoint and "
        "the offline case's top-K cache are made first)",
    )
    parser.add_argument(
        "--only",
        nargs="+",
        default=None,
        help="the built-in cases whose names contain one of these words (e.g. cp2)",
    )
    parser.add_argument(
        "--teacher-dir",
        help="teacher checkpoint of the built-in cases (default: made in the temp dir)",
    )
    parser.add_argument(
        "--cache-dir",
        help="top-K cache of the built-in offline case, made from --teacher-dir for that run "
        "(default: built in the temp dir)",
    )
    parser.add_argument(
        "--baseline-bytes",
        type=int,
        default=None,
        help="framework RSS baseline for CPU runs (default: measured)",
    )
    parser.add_argument(
        "--wire-bytes-key",
        default="kd_wire_bytes_per_dp_rank",
        help="per-step log field with the teacher -> student bytes counted (megatron-kd train "
        "logs kd_wire_bytes_per_dp_rank, and kd_wire_bytes summed over the student's ranks)",
    )
    parser.add_argument(
        "--wire-bytes-scope",
        choices=("dp-rank", "tp-rank", "all-ranks"),
        default="dp-rank",
        help="what the counted bytes cover: one student DP rank, one last-stage TP rank, or the "
        "whole student (all-ranks, for kd_wire_bytes)",
    )
    parser.add_argument("--terms", action="store_true", help="print every row's planner terms")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = parser.parse_args(argv)

    tmp = tempfile.mkdtemp(prefix="validate_planner_") if args.run else None
    if args.builtin:
        if not args.run:
            parser.error("--builtin needs --run (for finished runs use --cases)")
        teacher = args.teacher_dir or os.path.join(tmp, "teacher")
        cache = args.cache_dir or os.path.join(tmp, "topk_cache")
        cases = builtin_cases(teacher, cache, os.path.join(tmp, "teacher_endpoint"))
        if args.only:
            cases = [c for c in cases if any(word in c.name for word in args.only)]
            if not cases:
                parser.error(f"--only {' '.join(args.only)}: no built-in case's name has them")
        if args.teacher_dir is None:
            make_random_teacher(teacher)
        offline = [c for c in cases if "--kd-topk-cache" in c.train_args]
        if args.cache_dir is None and offline:
            # One cache for every offline case: they read the same samples (data, length, seed,
            # train_iters x global batch); check_run checks each run against it.
            make_topk_cache(cache, teacher, offline[0].train_args, offline[0].nproc, BUILTIN_TOPK)
    elif args.cases:
        with open(args.cases, encoding="utf-8") as f:
            cases = [
                Case(
                    name=c["name"],
                    train_args=c["train_args"],
                    log_json=c.get("log_json"),
                    nproc=int(c.get("nproc", 1)),
                    peak_dir=c.get("peak_dir"),
                    teacher_args=c.get("teacher_args"),
                    teacher_nproc=int(c.get("teacher_nproc", 1)),
                    teacher_peak_dir=c.get("teacher_peak_dir"),
                )
                for c in json.load(f)
            ]
    elif args.train_args:
        cases = [
            Case(
                name="run",
                train_args=args.train_args,
                log_json=args.log_json,
                nproc=args.nproc,
                teacher_args=args.teacher_args,
                teacher_nproc=args.teacher_nproc,
            )
        ]
    else:
        parser.error("give --train-args (and --log-json), --cases or --builtin --run")
    for case in cases:
        if args.run:
            stem = case.name.replace(" ", "_")
            case.log_json = os.path.join(tmp, f"{stem}.jsonl")
            case.peak_dir = os.path.join(tmp, f"{stem}.peaks")
            if case.teacher_args is not None:
                case.teacher_peak_dir = os.path.join(tmp, f"{stem}.teacher_peaks")
            seconds = run_case(case, case.log_json, case.peak_dir, case.teacher_peak_dir)
            print(f"{case.name}: ran in {seconds:.0f} s", file=sys.stderr)
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
        rows.extend(compare(case, baseline, args.wire_bytes_key, args.wire_bytes_scope))
    if args.json:
        print(json.dumps(rows_to_json(rows), indent=2))
    else:
        print(format_rows(rows, with_terms=args.terms))
    return 0 if all(r["memory_ok"] and r.get("wire_ok", True) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
