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
  (``plan.teacher_inference_terms`` with the replica's TP and PP from its serve flags, DP 1)
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
not a term of the planner. Runs made elsewhere should set it too. The replica's peak comes from
a wrapper of the ``megatron-kd`` entry point (the student's ranks and the replica's both run it)
that writes each rank's ``ru_maxrss`` at exit (``rank<R>.json``, the replica's in a directory of
its own: it writes no training log). The replica gets the same environment (``MALLOC_...``, and
``OMP_NUM_THREADS`` as the student has it).

How the planner is configured for a run: the architectures are the ones ``megatron-kd train`` itself
resolves (``plan_run``: the student from the flags, the teacher from its checkpoint's
``model_config.json``, an offline run's K from its cache's manifest); precision follows ``--bf16``
(fp32 otherwise: 4-byte weights and activations, Adam moments without a master copy) and must
match ``--kd-teacher-dtype`` (the planner has one precision; a mismatch is refused, and so is a
replica whose ``--kd-teacher-dtype`` is not the student's); the streamed hidden states take the
run's wire dtype on the wire (``--kd-wire-dtype``, default the teacher's) and the teacher's
element size once decoded; one teacher replica; ``--kd-prefetch-depth`` sets the ring slots; on
CPU the local layer spec runs unfused attention, norms and SwiGLU (``flash_attention``,
``fused_norm``, ``fused_swiglu`` off) and the top-K prefetcher's host queue is device memory
(``cache_resident_microbatches = D + 2``). Known gaps: MLP biases (``--add-bias-linear``) and
learned position embeddings are not counted; ``ru_maxrss`` is a high-water mark over the whole
process, so a transient at start-up (e.g. a checkpoint load holding two copies of the teacher) can
exceed the training peak; pipeline ranks other than the last build the teacher and free it, which
the high-water mark still sees. Validate with ``--pipeline-model-parallel-size 1`` runs. The
planner sums its terms, though the teacher's forward working set is freed before the loss's
window buffers are allocated (an overestimate of the smaller of the two), and the loss holds one
``[w, V/t]`` buffer less than counted when a micro-batch fits in one window (the tp2 cases:
the previous window's gradient is what the fourth buffer counts); both stay inside the tolerance
at these sizes. The replica's send slots are counted as ``D`` micro-batches of the student's. A
replica's peak is compared on CPU only (its RSS is host memory on a GPU machine).

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

Needs torch and megatron-core (it uses the training code's own argument parsing); the planner itself
does not.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

from megatron_kd.planner import memory as mem
from megatron_kd.planner import traffic as tr
from megatron_kd.planner.memory import ActivationOptions, Precision
from megatron_kd.planner.models import ModelConfig, from_megatron_kd_arch
from megatron_kd.planner.plan import PlanOptions, student_stage_terms, teacher_inference_terms
from megatron_kd.planner.presets import GpuSpec, LinkSpec

TOLERANCE = 0.15  # the target: predicted peak memory within 15% of the measured one
RESERVE_TERM = "reserve (context, NCCL, frag.)"
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

_BASELINE_CODE = (
    "import resource\n"
    "import torch, megatron.core\n"
    "import megatron_kd.training.train\n"
    "from megatron_kd.integration.cpu_shim import install_cpu_shim\n"
    "install_cpu_shim()\n"
    "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)\n"
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
    max_position_embeddings=512,
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
]

_MAKE_TEACHER_CODE = (
    "import json, sys\n"
    "from megatron_kd.integration.cpu_shim import install_cpu_shim\n"
    "install_cpu_shim()\n"
    "import torch.distributed as dist\n"
    "from megatron_kd.integration.groups import init_distributed_from_env, model_parallel\n"
    "from megatron_kd.integration.arch import GPTArchConfig\n"
    "from megatron_kd.integration.checkpoint import save_model_checkpoint\n"
    "from megatron_kd.integration.gpt import build_gpt_model\n"
    "init_distributed_from_env()\n"
    "arch = GPTArchConfig(**json.loads(sys.argv[2]))\n"
    "with model_parallel(tp=1):\n"
    "    save_model_checkpoint(build_gpt_model(arch, seed=1), arch, sys.argv[1])\n"
    "dist.destroy_process_group()\n"
)

# Every rank of a --run records its process's peak RSS at exit (rank<R>.json in the directory
# named by _PEAK_DIR_ENV): the JSON log is rank 0's only, and a disaggregated run's teacher
# replica writes none. The `megatron-kd` entry point itself, wrapped (`train` for the student,
# `teacher serve` for the replica, each with a peak directory of its own).
_PEAK_DIR_ENV = "VALIDATE_PLANNER_PEAK_DIR"
_RANK_PEAK_CODE = (
    "import json, os, resource, sys\n"
    "from megatron_kd.cli import main\n"
    "try:\n"
    "    code = main(sys.argv[1:])\n"
    "finally:\n"
    "    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024\n"
    "    name = 'rank%s.json' % os.environ.get('RANK', '0')\n"
    f"    out = os.path.join(os.environ[{_PEAK_DIR_ENV!r}], name)\n"
    "    with open(out, 'w') as f:\n"
    "        json.dump({'peak_rss_bytes': peak}, f)\n"
    "sys.exit(code)\n"
)


def make_random_teacher(directory: str) -> None:
    """A megatron_kd checkpoint of a randomly initialised teacher (``_TEACHER_ARCH``)."""
    subprocess.run(
        [sys.executable, "-c", _MAKE_TEACHER_CODE, directory, json.dumps(_TEACHER_ARCH)], check=True
    )


def cache_build_argv(
    train_args: str, world_size: int, cache_dir: str, teacher_dir: str, topk: int
) -> list[str]:
    """``megatron-kd cache build`` flags that make the cache an offline run reads: the run's data
    flags, sequence length, seed and sample count (``train_iters x global batch``), so that
    ``plan_run`` accepts it (same dataset identity, tokenizer, vocabulary and length)."""
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


@dataclass
class Prediction:
    mode: str
    terms: dict
    wire: dict | None
    """Disaggregated: the teacher -> student bytes per step by scope (``tp-rank``: one
    last-stage TP rank; ``dp-rank``: one student DP rank; ``all-ranks``: the whole student)."""
    wire_to_teacher: dict | None = None
    """Disaggregated: the student -> teacher token-id bytes per step by scope (``dp-rank``,
    ``all-ranks``: what ``kd_wire_bytes_to_teacher`` counts)."""


# --- the run's configuration, as megatron-kd train resolves it -----------------------------------


def parse_train_args(train_args: str) -> argparse.Namespace:
    """``megatron-kd train``'s own parsing of ``train_args``."""
    from megatron_kd.training.train import add_arguments

    parser = argparse.ArgumentParser(prog="megatron-kd train")
    add_arguments(parser)
    return parser.parse_args(shlex.split(train_args))


def resolve_run(train_args: str, world_size: int):
    """``(args, plan)`` exactly as ``megatron-kd train`` resolves them (no model is built; an
    offline run's cache is opened and checked against the run)."""
    from megatron_kd.training.plan import plan_run

    args = parse_train_args(train_args)
    return args, plan_run(args, world_size)


def arch_to_model(arch, name: str) -> ModelConfig:
    """A planner :class:`ModelConfig` from a ``megatron_kd.integration.arch.GPTArchConfig``, with the padded
    vocabulary as its vocabulary (the runs' layouts then pad by 1, see :func:`predict`)."""
    model = from_megatron_kd_arch(dict(arch.to_dict(), vocab_size=arch.padded_vocab_size), name)
    return dataclasses.replace(model, source="megatron-kd train plan_run")


def _mode(plan) -> str:
    if plan.kd.mode == "offline":
        return "offline-cache"
    if plan.teacher_arch is None:
        return "no teacher"  # the fused loss with the student's logits only
    return {"colocated": "colocated-fused", "disaggregated": "disaggregated"}[plan.kd.mode]


def plan_options(
    args, plan, on_cpu: bool, teacher_tp: int | None = None, teacher_pp: int | None = None
) -> PlanOptions:
    """The planner's options for the run (see the module docstring); ``teacher_tp`` /
    ``teacher_pp``: a disaggregated run's replica layout (None: not known)."""
    import torch

    student = arch_to_model(plan.student_arch, "student")
    teacher = arch_to_model(plan.teacher_arch, "teacher") if plan.teacher_arch else student
    fp32 = plan.params_dtype == torch.float32
    param_bytes = 4 if fp32 else 2
    teacher_bytes = 4 if plan.kd.teacher_dtype == "fp32" else 2
    if plan.teacher_arch is not None and teacher_bytes != param_bytes:
        raise ValueError(
            f"--kd-teacher-dtype {plan.kd.teacher_dtype} with {'fp32' if fp32 else 'bf16'} "
            f"student parameters: the planner gives teacher and student one precision"
        )
    precision = Precision(param_bytes=param_bytes, grad_bytes=4, optimizer_bytes=8 if fp32 else 12)
    activation = ActivationOptions(
        flash_attention=not on_cpu,
        fused_norm=not on_cpu,
        fused_swiglu=not on_cpu,
        hidden_dropout=args.hidden_dropout > 0,
        attention_dropout=args.attention_dropout > 0,
        activation_bytes=4 if fp32 else 2,
    )
    extra = {}
    from megatron_kd.loss import window

    if on_cpu and (plan.tp == 1 or window.CPU_BLOCKS_WITH_TP):
        # the loss's elementwise work runs in cache-sized row blocks (CPU, no TP collectives)
        extra["loss_block_elements"] = window.CPU_BLOCK_ELEMENTS
    if plan.topk_cache is not None:
        extra["topk"] = plan.topk_cache.spec.topk
        # On CPU the prefetcher's host queue is the device memory: D queued + 1 being decoded
        # + 1 in use (see memory.cache_reader_bytes); on a GPU only the one in use.
        extra["cache_resident_microbatches"] = plan.kd.prefetch_depth + 2 if on_cpu else 1
    gpu = GpuSpec(name="measured", memory_bytes=1 << 50, bf16_flops=1e12, nvlink_bytes_per_s=1e9)
    return PlanOptions(
        student=student,
        teacher=teacher,
        gpu=gpu,
        inter_node_link=LinkSpec(name="measured", bytes_per_s=1e9),
        gpus_per_node=max(plan.tp * plan.pp * plan.dp, teacher_tp or 1),
        nodes=1,
        seq_length=args.seq_length,
        micro_batch_size=args.micro_batch_size,
        global_batch_size=plan.global_batch_size,
        tp=plan.tp,
        pp=plan.pp,
        recompute="none",
        sequence_parallel=False,
        use_distributed_optimizer=False,
        teacher_tp=teacher_tp,
        teacher_pp=teacher_pp,
        teacher_replicas=1 if plan.kd.mode == "disaggregated" else None,
        wire_dtype=plan.kd.wire,
        window_size=plan.kd.loss.window_size,
        prefetch_depth=plan.kd.prefetch_depth,
        hidden_elem_bytes=teacher_bytes,
        precision=precision,
        activation=activation,
        reserve_bytes=0,
        **extra,
    )


def predict(args, plan, on_cpu: bool) -> Prediction:
    """The planner's terms for the logging rank (student rank 0: stage 0, TP rank 0)."""
    opts = plan_options(args, plan, on_cpu)
    mode = _mode(plan)
    layout = mem.ParallelLayout(tp=plan.tp, pp=plan.pp, dp=plan.dp, make_vocab_size_divisible_by=1)
    teacher_layout = mem.ParallelLayout(
        tp=plan.tp, pp=1, dp=plan.dp, make_vocab_size_divisible_by=1
    )
    terms = student_stage_terms(
        opts,
        "offline-cache" if mode == "no teacher" else mode,
        layout,
        teacher_layout if mode.startswith("colocated") else None,
        0,
    )
    terms.pop(RESERVE_TERM, None)
    if mode == "no teacher":
        terms.pop("cache reader", None)
    wire = to_teacher = None
    if mode == "disaggregated":
        gbs, dp, s = plan.global_batch_size, plan.dp, args.seq_length
        per_dp = tr.hidden_bytes_per_step_per_dp_rank(opts.teacher, gbs, dp, s, opts.wire_dtype)
        wire = {"tp-rank": per_dp / plan.tp, "dp-rank": per_dp, "all-ranks": per_dp * dp}
        ids = tr.token_bytes_per_step_per_dp_rank(gbs, dp, s)
        to_teacher = {"dp-rank": ids, "all-ranks": ids * dp}
    return Prediction(mode=mode, terms=terms, wire=wire, wire_to_teacher=to_teacher)


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
    from megatron_kd.training.teacher_serve import add_arguments

    if case.teacher_args is None:
        raise ValueError(f"case {case.name!r}: no teacher replica (teacher_args is None)")
    train = parse_train_args(case.train_args)
    if train.kd_mode != "disaggregated":
        raise ValueError(
            f"case {case.name!r}: teacher_args are for --kd-mode disaggregated runs, "
            f"this one is {train.kd_mode}"
        )
    parser = argparse.ArgumentParser(prog="megatron-kd teacher")
    add_arguments(parser)
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


def predict_teacher(args, plan, on_cpu: bool, tp: int, pp: int) -> dict:
    """The planner's terms for rank 0 of a disaggregated run's teacher replica (its stage 0,
    TP rank 0) with the replica's layout ``tp`` x ``pp`` (a replica has no data parallelism)."""
    opts = plan_options(args, plan, on_cpu, teacher_tp=tp, teacher_pp=pp)
    layout = mem.ParallelLayout(tp=tp, pp=pp, dp=1, make_vocab_size_divisible_by=1)
    terms = teacher_inference_terms(opts, layout, 0)
    terms.pop(RESERVE_TERM, None)
    return terms


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


def read_rank_peak(peak_dir: str, rank: int) -> int | None:
    """The peak RSS rank ``rank`` wrote at exit (None when it wrote none)."""
    path = os.path.join(peak_dir, f"rank{rank}.json")
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        return int(json.load(f)["peak_rss_bytes"])


def _launch(entry_argv: list[str], nproc: int) -> list[str]:
    """``_RANK_PEAK_CODE`` running ``entry_argv``: one process, or torchrun of ``nproc``."""
    entry = [sys.executable, "-c", _RANK_PEAK_CODE]
    if nproc > 1:
        return [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={nproc}",
            "--no-python",
            *entry,
            *entry_argv,
        ]
    return [*entry, *entry_argv]


def _omp_threads(nproc: int) -> str | None:
    """``OMP_NUM_THREADS`` of a run of ``nproc`` processes: the caller's, else torchrun's
    default (1) when ``nproc > 1``, else unset (torch's own default)."""
    return os.environ.get("OMP_NUM_THREADS") or ("1" if nproc > 1 else None)


def _replica_records(endpoint: str) -> set[str]:
    if not os.path.isdir(endpoint):
        return set()
    return {n for n in os.listdir(endpoint) if n.startswith("replica-") and n.endswith(".json")}


def _tail(path: str, chars: int = 3000) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()[-chars:]
    except OSError:
        return "(no stderr)"


class TeacherReplica:
    """A disaggregated case's teacher replica (``megatron-kd teacher serve`` under
    ``_RANK_PEAK_CODE``), started in a session of its own and registered at the student's
    directory endpoint; :meth:`stop` sends its process group SIGTERM and waits."""

    def __init__(self, case: Case, peak_dir: str, log_path: str, base_env: dict) -> None:
        from megatron_kd.teacher.endpoint import DirectoryEndpoint, parse_endpoint

        serve = teacher_serve_args(case)
        self.endpoint = serve.kd_teacher_endpoint
        if not isinstance(parse_endpoint(self.endpoint), DirectoryEndpoint):
            raise ValueError(
                f"case {case.name!r}: --run waits for the replica's registration in a directory "
                f"endpoint, got --kd-teacher-endpoint {self.endpoint!r}"
            )
        os.makedirs(self.endpoint, exist_ok=True)
        before = _replica_records(self.endpoint)
        if before:
            raise RuntimeError(
                f"case {case.name!r}: the endpoint {self.endpoint} already has registered "
                f"replicas {sorted(before)}: the student would use them too (and a stale record "
                f"a dead one); give the case an endpoint of its own"
            )
        os.makedirs(peak_dir, exist_ok=True)
        argv = [
            "teacher",
            *teacher_serve_argv(parse_train_args(case.train_args), case.teacher_args),
            "--log-json", log_path,
        ]  # fmt: skip
        env = dict(base_env, **{_PEAK_DIR_ENV: peak_dir})
        for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(key, None)  # a replica is a world of its own (torchrun sets its own)
        self.stderr_path = log_path + ".stderr"
        with open(self.stderr_path, "w", encoding="utf-8") as stderr:
            self.proc = subprocess.Popen(
                _launch(argv, case.teacher_nproc),
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=stderr,
                start_new_session=True,
            )
        deadline = time.monotonic() + REPLICA_START_TIMEOUT_S
        while time.monotonic() < deadline:
            new = _replica_records(self.endpoint) - before
            if new:
                self.record = new.pop()
                return
            if self.proc.poll() is not None:
                break
            time.sleep(0.2)
        exited = self.proc.poll()
        self.stop()
        why = (
            f"exited with {exited}"
            if exited is not None
            else f"did not register within {REPLICA_START_TIMEOUT_S} s"
        )
        raise RuntimeError(
            f"case {case.name!r}: the teacher replica {why} at {self.endpoint}; its stderr "
            f"({self.stderr_path}) ends:\n{_tail(self.stderr_path)}"
        )

    def _signal(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def stop(self, timeout_s: float = 120.0) -> int | None:
        """SIGTERM to the replica's process group, then wait (SIGKILL after ``timeout_s``: it
        then writes no peak); returns its exit status."""
        if self.proc.poll() is None:
            self._signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                print(
                    f"teacher replica {self.proc.pid}: no exit {timeout_s:.0f} s after SIGTERM, "
                    f"killed (stderr: {self.stderr_path})",
                    file=sys.stderr,
                )
                self._signal(signal.SIGKILL)
                self.proc.wait(timeout=30)
        self._signal(signal.SIGKILL)  # a torchrun worker left behind
        return self.proc.returncode


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
        replica = TeacherReplica(case, teacher_peak_dir, teacher_log, env)
        print(
            f"{case.name}: teacher replica registered in {time.perf_counter() - t0:.0f} s",
            file=sys.stderr,
        )
    try:
        t0 = time.perf_counter()
        subprocess.run(
            _launch(argv, case.nproc), check=True, env=dict(env, **{_PEAK_DIR_ENV: peak_dir})
        )
        return time.perf_counter() - t0
    finally:
        if replica is not None:
            code = replica.stop()
            if code != 0:
                print(
                    f"{case.name}: the teacher replica exited with {code} (stderr: "
                    f"{replica.stderr_path})",
                    file=sys.stderr,
                )


# --- comparison ---------------------------------------------------------------------------------


def _memory_row(name, mode, kind, terms, measured, baseline, on_cpu) -> dict:
    predicted = sum(terms.values())
    row = {
        "name": name,
        "mode": mode,
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
    args, plan = resolve_run(case.train_args, case.nproc)
    steps = read_log(case.log_json)
    kinds = {r.get("peak_mem_kind") for r in steps}
    if len(kinds) != 1:
        raise ValueError(f"{case.log_json}: mixed peak_mem_kind {kinds}")
    kind = kinds.pop()
    on_cpu = kind == "cpu_max_rss"
    pred = predict(args, plan, on_cpu)
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
            terms = predict_teacher(args, plan, on_cpu, tp, pp)
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
                out.append(f"    {term:<40}{value / gib:>10.3f} GiB")
    return "\n".join(out)


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
        teacher = args.teacher_dir
        if teacher is None:
            teacher = os.path.join(tmp, "teacher")
            make_random_teacher(teacher)
        cache = args.cache_dir or os.path.join(tmp, "topk_cache")
        cases = builtin_cases(teacher, cache, os.path.join(tmp, "teacher_endpoint"))
        offline = [c for c in cases if "--kd-topk-cache" in c.train_args]
        if args.cache_dir is None and offline:
            # One cache for every offline case: they read the same samples (data, length, seed,
            # train_iters x global batch); plan_run checks each run against it.
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
        print(json.dumps(rows, indent=2))
    else:
        print(format_rows(rows, with_terms=args.terms))
    return 0 if all(r["memory_ok"] and r.get("wire_ok", True) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
