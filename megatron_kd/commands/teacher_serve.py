"""``megatron-kd teacher``: a teacher replica as a service, and a small registry for it.

::

    # one replica: its own torchrun world, its own TP / PP; more replicas: more launches
    torchrun --nproc-per-node 8 -m megatron_kd teacher serve --kd-teacher-load /ckpt/teacher \\
        --kd-teacher-endpoint /shared/run42/teacher --tensor-model-parallel-size 4 \\
        --pipeline-model-parallel-size 2
    # students anywhere: --kd-mode disaggregated --kd-teacher-endpoint /shared/run42/teacher
    megatron-kd teacher registry --port 29555   # an endpoint without shared storage

A replica builds the frozen teacher (Megatron-Core ``GPTModel``, its own pipeline and
tensor-parallel layout over its whole world: a replica is never a data-parallel rank of another
replica's world), registers at the endpoint once it is ready, and serves any number of student
runs until it is stopped (SIGTERM or SIGINT: it finishes the batch in flight, withdraws from the
endpoint and exits 0; a rank still running ``--stop-grace`` seconds later writes its threads'
stacks to stderr, withdraws and exits 4). Each rank also exits when its launcher dies
(torchrun's agent SIGKILLed, say): within ``--launcher-grace`` + 0.5 s, the record withdrawn
(:mod:`megatron_kd.teacher.launcher_watch`; ``--no-exit-with-launcher`` for a replica meant to
outlive the shell that started it). Rank 0 writes its log lines (JSON: connections, requests and
tokens served, tokens/s, wire bytes, per student run) to stderr and ``--log-json``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from dataclasses import dataclass, field

import torch.distributed as dist
from megatron.core import parallel_state as ps

from megatron_kd.arch import Role, check_layout
from megatron_kd.commands.startup import in_layout, started
from megatron_kd.flags import add_flags, flag, from_flags
from megatron_kd.integration.gpt import transformer_engine_available
from megatron_kd.integration.teacher import (
    build_frozen_teacher,
    check_teacher,
    full_sequence_forward,
    teacher_identity,
)
from megatron_kd.modes.args import KDArgs, add_teacher_flags
from megatron_kd.parallel import ParallelLayout
from megatron_kd.placement import compute_device
from megatron_kd.teacher.config import ServiceConfig
from megatron_kd.teacher.endpoint import ReplicaLayout, parse_endpoint
from megatron_kd.teacher.launcher_watch import STOP_OVERDUE_EXIT, LauncherWatch, stop_on_signals
from megatron_kd.teacher.service import TeacherService
from megatron_kd.training.metrics import MetricsSection, MetricWriters, service_scalars
from megatron_kd.training.run_config import KernelSection, ParallelSection

__all__ = ["ServeConfig", "ServeSection", "add_arguments", "check_replica_layout", "run"]


@dataclass(frozen=True, kw_only=True)
class ServeSection:
    """What ``teacher serve`` asks beyond the teacher, its layout and its metrics: batching,
    where students reach it, logging, and how it stops."""

    max_batch_size: int = flag(16, "samples batched into one forward at most (requests of "
                                   "several student ranks and runs together)")
    """Samples in one forward at most (also the largest microbatch a student may announce)."""

    max_seq_length: int | None = flag(None, "longest request accepted (default: the teacher's "
                                            "positions)", type=int)
    """The longest sequence a connection may announce (None: the teacher's positions)."""

    host: str | None = flag(None, "the address students reach this replica at (default: this "
                                  "host's name)")
    """The address students reach rank 0 at (None: this host's name)."""

    port: int = flag(0, "rendezvous port (default: any free one)")
    """Rank 0's store port (0: any free one)."""

    seed: int = flag(1234)
    """The teacher model's initialisation seed (its weights come from the checkpoint)."""

    log_json: str | None = flag(None, "append the replica's log lines here")
    """Rank 0 appends its JSON log lines here too (None: stderr only)."""

    stats_interval: float = flag(10.0, metavar="SECONDS")
    """Seconds between ``stats`` log records."""

    exit_with_launcher: bool = flag(
        True, "each rank stops when the process that launched it (torchrun, srun, a shell) "
              "dies, and exits --launcher-grace seconds later at the latest, its endpoint "
              "record withdrawn (default: on; off for a replica started with nohup that must "
              "outlive its shell)", action=argparse.BooleanOptionalAction)
    """Each rank stops when its launcher dies (:mod:`megatron_kd.teacher.launcher_watch`)."""

    launcher_grace: float = flag(5.0, "seconds a rank whose launcher died has to stop in order "
                                      "before it leaves anyway", metavar="SECONDS")
    """Seconds a rank whose launcher died has to stop in order."""

    stop_grace: float = flag(
        30.0, f"seconds a rank has to stop in order after SIGTERM / SIGINT; still running then, "
              f"it writes its threads' stacks to stderr, withdraws and exits "
              f"{STOP_OVERDUE_EXIT}", metavar="SECONDS")
    """Seconds a rank has to stop in order after SIGTERM / SIGINT."""

    def __post_init__(self) -> None:
        if self.max_batch_size < 1:
            raise ValueError(f"--max-batch-size must be >= 1, got {self.max_batch_size}")
        for name, value in (("launcher-grace", self.launcher_grace),
                            ("stop-grace", self.stop_grace)):
            if value < 0:
                raise ValueError(f"--{name} must be >= 0, got {value}")


@dataclass(frozen=True, kw_only=True)
class ServeConfig:
    """Everything ``megatron-kd teacher serve`` was asked for, as typed sections: made once
    from the parsed flags (:meth:`from_args`); nothing past it reads argparse."""

    teacher: KDArgs
    """The teacher flags (``--kd-teacher-load``, ``-endpoint``, ``-args``, ``-dtype``,
    ``-timeout``), validated as a disaggregated teacher's."""

    parallel: ParallelSection
    """The replica's own layout (TP, PP, CP, experts, sequence parallelism)."""

    serve: ServeSection
    metrics: MetricsSection

    kernels: KernelSection = field(default_factory=KernelSection)
    """The teacher's attention kernels (``--attention-backend``, as ``train``'s)."""

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ServeConfig:
        """The sections of the flags :func:`add_arguments` added to ``serve``."""
        return cls(serve=from_flags(ServeSection, args),
                   teacher=from_flags(KDArgs, args, mode="disaggregated"),
                   parallel=from_flags(ParallelSection, args),
                   metrics=from_flags(MetricsSection, args),
                   kernels=from_flags(KernelSection, args))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    s = sub.add_parser("serve", help="run one teacher replica until stopped")
    add_teacher_flags(s, only=("teacher_load", "teacher_endpoint"),
                      required=("teacher_load", "teacher_endpoint"),
                      help={"teacher_endpoint": "where to register: a directory every student "
                                                "can read, or the host:port of `megatron-kd "
                                                "teacher registry`"})
    add_flags(s, ParallelSection, use_groups=False, only=(
        "tensor_model_parallel_size", "pipeline_model_parallel_size",
        "expert_model_parallel_size", "expert_tensor_parallel_size", "sequence_parallel",
        "context_parallel_size"))
    add_flags(s, KernelSection, use_groups=False)
    add_teacher_flags(s, only=("teacher_args", "teacher_dtype"),
                      help={"teacher_dtype": "parameter dtype of the teacher"})
    add_flags(s, ServeSection, only=("max_batch_size", "max_seq_length"))
    add_teacher_flags(s, only=("teacher_timeout",),
                      help={"teacher_timeout": "a student silent this long while a response is "
                                               "sent to it is dropped"})
    add_flags(s, ServeSection, exclude=("max_batch_size", "max_seq_length"))
    add_flags(s, MetricsSection, use_groups=False, only=(
        "tensorboard_dir", "tensorboard_queue_size", "wandb_project", "wandb_exp_name",
        "wandb_save_dir"), help={"tensorboard_dir": "the replica's stats as TensorBoard "
                                                    "scalars (teacher/...)",
                                 "wandb_project": "the replica's stats to this W&B project",
                                 "wandb_save_dir": "W&B's local directory (default: ./wandb)"})
    r = sub.add_parser("registry", help="a host:port endpoint (a TCPStore) until stopped")
    r.add_argument("--port", type=int, required=True)
    r.add_argument("--host", default="0.0.0.0")


def run(args: argparse.Namespace) -> int:
    if args.action == "registry":
        return _registry(args.host, args.port)
    return _serve(ServeConfig.from_args(args))


def _registry(host: str, port: int) -> int:
    store = dist.TCPStore(host, port, is_master=True, wait_for_workers=False)
    print(json.dumps({"event": "registry", "port": store.port}), file=sys.stderr, flush=True)
    stop = stop_on_signals()
    while not stop.wait(0.5):
        pass
    return 0


def check_replica_layout(arch, layout: ParallelLayout, *, transformer_engine: bool) -> None:
    """``teacher serve``'s layout check: ``arch`` as a replica of ``layout``
    (:func:`megatron_kd.arch.check_layout`, a replica's role); what the planner's replicas are
    held to."""
    check_layout(arch, layout, role=Role.TEACHER_REPLICA, transformer_engine=transformer_engine)


def _check(cfg: ServeConfig, world: int):
    """``(teacher directory, architecture, layout)`` of this replica, checked: the replica's
    layout over its ``world``."""
    teacher_dir, arch = check_teacher(cfg.teacher.teacher_load,
                                      seq_length=cfg.serve.max_seq_length or 1,
                                      teacher_args=cfg.teacher.teacher_args)
    layout = cfg.parallel.layout(world, arch.num_layers)
    transformer_engine = transformer_engine_available()
    cfg.kernels.check_transformer_impl(transformer_engine)
    try:
        check_replica_layout(arch, layout, transformer_engine=transformer_engine)
    except ValueError as e:
        raise ValueError(f"teacher {teacher_dir!r}: {e}") from None
    return teacher_dir, arch, layout


def _serve(cfg: ServeConfig) -> int:
    services: list[TeacherService] = []  # the one built below (what a forced exit withdraws)
    stop = stop_on_signals(cfg.serve.stop_grace,
                           lambda: [s.abandon("stop overdue") for s in services])
    watch = None
    if cfg.serve.exit_with_launcher:  # watched from before the rendezvous: it may hang there too
        watch = LauncherWatch(stop.set, lambda: [s.abandon("launcher gone") for s in services],
                              grace_s=cfg.serve.launcher_grace).start()
    try:
        with started():
            teacher_dir, arch, layout = _check(cfg, dist.get_world_size())
            with in_layout(layout):
                service = _service(cfg, teacher_dir, arch, layout)
                services.append(service)
                service.serve(stop.is_set)
        return 0
    finally:
        if watch is not None:
            watch.close()  # ended in order (a forced exit would not come back here)
        stop.ended()


def _service(cfg: ServeConfig, teacher_dir: str, arch,
             parallel: ParallelLayout) -> TeacherService:
    serve, teacher = cfg.serve, cfg.teacher
    tp, pp, cp = parallel.tp, parallel.pp, parallel.cp
    is_first, is_last = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
    sp = parallel.sequence_parallel
    model = build_frozen_teacher(arch, teacher_dir, dtype=teacher.teacher_torch_dtype,
                                 pre_process=is_first, post_process=is_last, seed=serve.seed,
                                 sequence_parallel=sp, attention=cfg.kernels.attention_backend)
    # the ranks of the last pipeline stage (TP x CP of them), each with the whole answer
    stages = [None] * dist.get_world_size()
    dist.all_gather_object(stages, is_last)
    last_stage = [r for r, last in enumerate(stages) if last]
    device = compute_device()
    log_file = open(serve.log_json, "a", encoding="utf-8") if (  # noqa: SIM115 - lives as long
            serve.log_json and dist.get_rank() == 0) else None   # as the process
    # closed at exit (atexit in both)
    writers = MetricWriters(cfg.metrics, dist.get_rank() == 0)
    started = time.monotonic()

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)
        if log_file is not None:
            log_file.write(line + "\n")
            log_file.flush()
        record = json.loads(line)
        if record.get("event") in ("stats", "stopped"):
            seconds = int(time.monotonic() - started)
            writers.step(seconds, record.get("samples", 0), service_scalars(record))
            if record["event"] == "stopped":
                writers.close()

    config = ServiceConfig(host=serve.host or socket.gethostname(), port=serve.port,
                           max_batch=serve.max_batch_size,
                           max_seq_length=serve.max_seq_length or arch.max_position_embeddings,
                           timeout_s=teacher.teacher_timeout,
                           stats_interval_s=serve.stats_interval)
    layout = ReplicaLayout(last_stage_ranks=tuple(last_stage), device=device.type,
                           world_size=dist.get_world_size(), tp=tp, pp=pp, cp=cp,
                           ep=parallel.ep, pid=os.getpid(),
                           started=round(time.time(), 3))
    return TeacherService(
        identity=teacher_identity(teacher_dir, arch, teacher.teacher_dtype),
        endpoint=parse_endpoint(teacher.teacher_endpoint),
        forward=full_sequence_forward(
            model, is_last=is_last, sp_group=ps.get_tensor_model_parallel_group() if sp else None,
            cp_group=ps.get_context_parallel_group() if cp > 1 else None),
        device=device, config=config, layout=layout, log=log)
