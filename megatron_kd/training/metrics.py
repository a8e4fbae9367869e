"""What a run reports beyond its JSON log: TensorBoard and Weights & Biases under Megatron-LM's
flags and scalar names, and the step timers (``--timing-log-level``).

Scalar names are Megatron-LM's where it has one (``lm loss``, ``learning-rate``, ``grad-norm``,
``batch-size``, ``iteration-time``, ``throughput``, ``mem-allocated-bytes``, ``lm loss
validation``, each also ``... vs samples``); the distillation's own go under ``kd/``:

========================================  ====================================================
``kd loss``, ``total loss``               the divergence (``T^2`` included) and what is trained
``kd loss teacher <i>``                   several teachers: teacher ``i``'s own divergence (the
                                          ``kd loss`` is their weighted sum)
``kd/student - teacher lm loss``          evaluation: how far the student is from the teacher
``kd/wire-bytes``, ``kd/wire-bytes-out``  disaggregated: hidden-state bytes received, token-id
                                          bytes sent (the step's, all student ranks)
``kd/teacher-wait-s``                     disaggregated: seconds a receiving rank waited for
                                          the teacher in the step (mean over those ranks)
``kd/ring-occupancy``                     disaggregated: the fraction of the prefetched
                                          responses (up to ``D``) already arrived when the step
                                          asked for one (1: the teacher keeps ahead; 0: the
                                          student waits)
``kd/live-replicas``, ``kd/failovers``    disaggregated: replicas registered and not found
                                          dead; failovers in the step
``kd/replica-<id>/tokens-per-s``          disaggregated: tokens each replica answered for
                                          this run in the step, over the step's time
``kd/cache-wait-s``, ``kd/cache-read-``   offline: seconds the step waited for decoded top-K
``tokens-per-s``                          targets, and the decoder's rate so far
``timers/<name>``                         with ``--timing-log-level >= 1`` and
                                          ``--log-timers-to-tensorboard``
========================================  ====================================================

Megatron-LM writes from its last rank; here the logging rank (rank 0) writes, with values
reduced over the world first (the same numbers the JSON log has). The ``kd/`` names come from
the teacher source's statistics record
(:meth:`~megatron_kd.modes.stats.SourceStepStats.scalars`), which the Megatron-LM
entry points use too (there with the writing rank's own values). A teacher replica
(``megatron-kd teacher serve --tensorboard-dir``) writes its own side under ``teacher/``
(:func:`service_scalars`).
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_kd.flags import flag
from megatron_kd.modes.stats import SourceStepStats

__all__ = [
    "TIMER_NAMES",
    "MetricWriters",
    "MetricsSection",
    "StepTimers",
    "eval_scalars",
    "service_scalars",
    "step_scalars",
]

#: The step's phases ``--timing-log-level 1`` times (max over ranks); level 2 synchronises the
#: GPU at each boundary, so the times are the device's, not the launches'.
TIMER_NAMES = ("forward-backward", "teacher-forward", "teacher-wait", "loss-forward",
               "optimizer")


@dataclass(frozen=True, kw_only=True)
class MetricsSection:
    """TensorBoard, W&B and the step timers (Megatron-LM's flags, with its meanings)."""

    tensorboard_dir: str | None = flag(None, "write TensorBoard event files here (rank 0)")
    tensorboard_log_interval: int = flag(1)
    tensorboard_queue_size: int = flag(1000)
    log_timers_to_tensorboard: bool = flag(
        False, "iteration-time and the --timing-log-level timers as scalars")
    log_memory_to_tensorboard: bool = flag(False, "peak memory of the step as "
                                                  "mem-allocated-bytes")
    log_throughput: bool = flag(False, "tokens per second as the throughput scalar")
    timing_log_level: int = flag(
        0, "0: the iteration time only; 1: where the step's time goes "
           f"({', '.join(TIMER_NAMES)}; max over ranks, in the JSON log); 2: the same with the "
           "GPU synchronised at each boundary", choices=(0, 1, 2))
    wandb_project: str = flag("", "log to this W&B project (rank 0)")
    wandb_exp_name: str = flag("", "the W&B run's name")
    wandb_save_dir: str = flag("", "W&B's local directory (default: <--save>/wandb or "
                                   "./wandb); set WANDB_MODE=offline to keep everything local")


class StepTimers:
    """Named wall-clock totals of one step on this rank (``--timing-log-level``)."""

    def __init__(self, level: int) -> None:
        self.level = level
        self._totals: dict[str, float] = {}
        self._sync = level >= 2 and torch.cuda.is_available()

    @contextlib.contextmanager
    def time(self, name: str):
        if self.level < 1:
            yield
            return
        if self._sync:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if self._sync:
                torch.cuda.synchronize()
            self._totals[name] = self._totals.get(name, 0.0) + time.perf_counter() - t0

    def discard(self) -> None:
        """Forget what was timed since the last :meth:`take` (an evaluation's phases)."""
        self._totals = {}

    def take(self, device: torch.device) -> dict[str, float] | None:
        """This step's timers, max over the world (collective when ``level >= 1``); reset."""
        if self.level < 1:
            return None
        vec = torch.tensor([self._totals.get(n, 0.0) for n in TIMER_NAMES], dtype=torch.float64,
                           device=device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(vec, op=dist.ReduceOp.MAX)
        self._totals = {}
        return {n: round(float(v), 6) for n, v in zip(TIMER_NAMES, vec.tolist())}


def step_scalars(record: dict, metrics: MetricsSection, batch_size: int,
                 teacher: SourceStepStats) -> dict[str, float]:
    """Megatron-LM's scalars of one JSON step record, and the ``kd/`` ones of the step's
    teacher statistics (the record
    :meth:`~megatron_kd.modes.stats.SourceStepStats.scalars` names, its rates over
    the step record's time)."""
    out = {"lm loss": record.get("lm_loss"), "kd loss": record.get("kd_loss"),
           "total loss": record.get("loss"), "learning-rate": record.get("lr"),
           "grad-norm": record.get("grad_norm"), "batch-size": batch_size}
    for i, kd in enumerate(record.get("teacher_kd_losses") or ()):  # several teachers
        out[f"kd loss teacher {i}"] = kd
    if metrics.log_timers_to_tensorboard:
        out["iteration-time"] = record.get("step_time_s")
        for name, value in (record.get("timers") or {}).items():
            out[f"timers/{name}"] = value
    if metrics.log_throughput:
        out["throughput"] = record.get("tokens_per_s")
    if metrics.log_memory_to_tensorboard:
        out["mem-allocated-bytes"] = record.get("peak_mem_bytes")
    out.update(teacher.scalars(record.get("step_time_s")))
    return {k: float(v) for k, v in out.items() if v is not None}


def eval_scalars(record: dict) -> dict[str, float]:
    """The scalars of one evaluation record (Megatron-LM's ``<key> validation`` names; the
    student-teacher KL and top-1 agreement as ``kd/validation ...``, where the mode reports
    them)."""
    out = {"lm loss validation": record.get("eval_lm_loss"),
           "kd loss validation": record.get("eval_kd_loss"),
           "total loss validation": record.get("eval_loss"),
           "teacher lm loss validation": record.get("eval_teacher_lm_loss"),
           "kd/validation kl": record.get("eval_kd_kl"),
           "kd/validation top-1 agreement": record.get("eval_top1_agreement")}
    if record.get("eval_lm_loss") is not None and record.get("eval_teacher_lm_loss") is not None:
        out["kd/student - teacher lm loss"] = (record["eval_lm_loss"]
                                               - record["eval_teacher_lm_loss"])
    return {k: float(v) for k, v in out.items() if v is not None}


def service_scalars(record: dict) -> dict[str, float]:
    """A teacher replica's ``stats`` / ``stopped`` log record as scalars (its totals so far,
    and per student run), written against seconds since the replica started."""
    out = {f"teacher/{key}": record[key] for key in
           ("requests", "samples", "tokens", "tokens_per_s", "bytes_in", "bytes_out",
            "forward_s", "connections") if record.get(key) is not None}
    if record.get("requests"):
        out["teacher/samples-per-request"] = record["samples"] / record["requests"]
    for run, per in (record.get("runs") or {}).items():
        for key in ("requests", "tokens", "bytes_out"):
            out[f"teacher/run-{run}/{key}"] = per[key]
    return {k: float(v) for k, v in out.items()}


class MetricWriters:
    """TensorBoard (``--tensorboard-dir``) and W&B (``--wandb-project``) on the logging rank.

    A flag given without its package installed is an error naming the package, never a run
    that silently writes nothing. ``save``: the run's ``--save`` (W&B's default directory is
    under it); ``config``: the run's flags, as W&B's run config."""

    def __init__(self, metrics: MetricsSection, enabled: bool, *, save: str | None = None,
                 config: dict | None = None) -> None:
        self.metrics = metrics
        self.tb = self.wandb = None
        if not enabled:
            return
        if metrics.tensorboard_dir:
            try:
                # optional: only runs that ask for TensorBoard need the package
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:
                raise ImportError(f"--tensorboard-dir needs the tensorboard package (pip install "
                                  f"tensorboard, or megatron_kd[metrics]): {e}") from e
            self.tb = SummaryWriter(log_dir=metrics.tensorboard_dir,
                                    max_queue=metrics.tensorboard_queue_size)
        if metrics.wandb_project:
            try:
                import wandb  # optional: only runs that ask for W&B need the package
            except ImportError as e:
                raise ImportError(f"--wandb-project needs the wandb package (pip install wandb, "
                                  f"or megatron_kd[metrics]): {e}") from e
            save_dir = metrics.wandb_save_dir or (os.path.join(save, "wandb") if save
                                                  else "wandb")
            os.makedirs(save_dir, exist_ok=True)
            self.wandb = wandb.init(project=metrics.wandb_project,
                                    name=metrics.wandb_exp_name or None, dir=save_dir,
                                    config={k: v for k, v in (config or {}).items()
                                            if isinstance(v, (int, float, str, bool, type(None)))})

    def step(self, iteration: int, samples: int, scalars: dict[str, float]) -> None:
        """Scalars at ``iteration`` (and ``... vs samples``), every
        ``--tensorboard-log-interval`` iterations."""
        if iteration % max(1, self.metrics.tensorboard_log_interval):
            return
        self._write(iteration, samples, scalars)
    def evaluation(self, iteration: int, samples: int, scalars: dict[str, float]) -> None:
        self._write(iteration, samples, scalars)

    def _write(self, iteration: int, samples: int, scalars: dict[str, float]) -> None:
        if self.tb is not None:
            for name, value in scalars.items():
                self.tb.add_scalar(name, value, iteration)
                self.tb.add_scalar(f"{name} vs samples", value, samples)
        if self.wandb is not None:
            self.wandb.log(scalars, step=iteration)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.flush()
            self.tb.close()
            self.tb = None
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None
