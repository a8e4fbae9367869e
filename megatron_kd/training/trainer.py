"""The trainer: one distillation run of a student on Megatron-Core (colocated, disaggregated or
offline teacher).

Student and teacher are Megatron-Core ``GPTModel``s. The student trains with Megatron-Core's
DDP, optimizer and pipeline schedule (``get_forward_backward_func``); the teacher is frozen
(eval mode, ``requires_grad=False``, no optimizer state, no DDP buffers). Neither runs its
output layer: both return their final hidden states (after the final norm), which go with the
output-layer shards into :func:`megatron_kd.loss.vocab_parallel_kd_loss`, so the
``[tokens, vocab]`` logits never exist.

Teacher placement under student pipeline parallelism
----------------------------------------------------
The loss runs on the student's last pipeline stage, so the teacher's final hidden states are
needed there. The teacher is **not pipelined**: every rank of the student's last stage holds the
*whole* teacher (all its layers), tensor-parallel over the same TP group as the student (so the
two output layers share one vocabulary partition), and runs it on the same microbatch inside
the last stage's forward step. Nothing about the teacher crosses a pipeline boundary: no extra
point-to-point traffic, no schedule changes, and the teacher's forward overlaps the pipeline
bubble of the last stage. The price is memory: the last stage holds a full (TP-sharded) teacher.
(Every rank builds and loads the teacher, since loading is collective; ranks that are not on the
last stage free it before training.) For a teacher too large for one stage, a disaggregated
teacher (``--kd-mode disaggregated``) is the answer.

Offline teacher (``--kd-mode offline --kd-topk-cache DIR``)
----------------------------------------------------------
No teacher model is built or loaded. A cache made by ``megatron-kd cache build`` holds the
teacher's top-K ids and log-probs of every training sample; :func:`~megatron_kd.training.run_checks.
check_run` refuses a cache made for other data, sequence length, vocabulary or tokenizer, and the
student's vocabulary is the cache's. On the last pipeline stage a background thread decodes each
rank's microbatches (by dataset sample index, so any DP / TP / micro-batch layout reads the same
cache) ahead of the step, and the loss takes them as a sparse teacher (``forward_kl`` only).
Evaluation reports the student's cross-entropy only (the cache does not cover the validation
samples): no KD loss, student-teacher KL (``eval_kd_kl``: forward KL at T = 1, from
:func:`~megatron_kd.loss.vocab_parallel_agreement`) or top-1 agreement (``eval_top1_agreement``),
which a colocated run's evaluation reports beside its losses (docs/training.md).

The teacher is one :class:`~megatron_kd.modes.source.TeacherSource`, built once
(the only place the KD mode is read) and asked for each microbatch's teacher arguments; the
trainer never branches on the mode.

The module is one piece: the step, the evaluation, the checkpoints and the loop read and advance
one trainer's state (its step, its data position, its model chunks and teacher source), which
split over modules would be handed back and forth on every call.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.pipeline_parallel import get_forward_backward_func

from megatron_kd.data.datasets import BatchPlan, collate
from megatron_kd.integration.checkpoint import latest_iteration, load_model_checkpoint
from megatron_kd.integration.context_parallel import cp_positions
from megatron_kd.integration.cpu_shim import device_context
from megatron_kd.integration.groups import collective_device
from megatron_kd.integration.loss_func import make_kd_loss_func
from megatron_kd.integration.output_layer import output_layer_weight, unwrap_model
from megatron_kd.modes.build import build_run_source
from megatron_kd.modes.source import Microbatch, SourceConfig, StudentPlace
from megatron_kd.modes.stats import SourceStepStats
from megatron_kd.placement import compute_device
from megatron_kd.training.checkpointing import (
    load_training_checkpoint,
    save_training_checkpoint,
    stop_iteration,
)
from megatron_kd.training.faults import EarlyExit, FiniteGuard
from megatron_kd.training.logs import (
    JsonLog,
    Progress,
    RunRecord,
    peak_memory,
    peak_reserved_memory,
    reduce_reports,
    static_memory,
)
from megatron_kd.training.metrics import MetricWriters, StepTimers, eval_scalars, step_scalars
from megatron_kd.training.run_checks import CheckedRun, build_datasets
from megatron_kd.training.run_config import RunConfig
from megatron_kd.training.student import build_student

__all__ = ["Trainer"]


def _mean(pair: torch.Tensor | None) -> float | None:
    if pair is None or pair[1] <= 0:
        return None
    return float(pair[0] / pair[1])


class Trainer:
    """One distillation run; ``parallel_state`` must be initialised (TP x PP).

    ``config``: the run's flags (:class:`~megatron_kd.training.run_config.RunConfig`);
    ``run``: what :func:`~megatron_kd.training.run_checks.check_run` resolved from them.
    """

    REPORT_KEYS = ("loss", "kd_loss", "lm_loss", "teacher_lm_loss")
    # evaluation also reports the student-teacher KL at T = 1 and top-1 agreement
    EVAL_REPORT_KEYS = (*REPORT_KEYS, "kd_kl", "top1_agreement")

    def __init__(self, config: RunConfig, run: CheckedRun, *, loss_fn=None,
                 started: float | None = None) -> None:
        self.run_config, self.run = config, run
        # when the process started (time.monotonic()): --exit-duration-in-mins counts from it
        self.started = time.monotonic() if started is None else started
        self.loss_fn = loss_fn  # None: the fused loss; tests pass a dense reference
        self.rank = dist.get_rank()
        self.is_first = ps.is_pipeline_first_stage()
        self.is_last = ps.is_pipeline_last_stage()
        self.tp_group = ps.get_tensor_model_parallel_group()
        self.tp_rank = ps.get_tensor_model_parallel_rank()
        self.dp_rank = ps.get_data_parallel_rank()
        self.pp_rank = ps.get_pipeline_model_parallel_rank()
        self.log_rank = self.rank == 0
        # context parallelism: the positions of each sequence this rank holds
        layout = run.layout
        self.positions = (cp_positions(config.data.seq_length,
                                       ps.get_context_parallel_rank(), layout.cp)
                          if layout.cp > 1 else None)
        # The output-layer weight gradient straight into DDP's fp32 main_grad (Megatron's
        # gradient-accumulation fusion, in the loss: no [V/tp, h] gradient tensor).
        self.loss_config = run.kd.loss_config(vocab_size=run.student_arch.vocab_size,
                                              gradient_accumulation_fusion=True,
                                              sequence_parallel=layout.sequence_parallel)
        # Evaluation without teacher outputs (offline: the cache holds training samples only;
        # disaggregated: the teacher streams training microbatches only): the student's CE.
        self.ce_config = dataclasses.replace(self.loss_config, kd_weight=0.0, ce_weight=1.0)
        self._evaluating = False
        self.guard = FiniteGuard()
        self._json_log = JsonLog(None, False)
        self._step = self._microbatch = 0
        self._consumed = 0  # samples consumed before the step being run
        self.timers = StepTimers(config.metrics.timing_log_level)
        self.writers = MetricWriters(config.metrics, False)
        self._build_student()
        # Every rank builds the source (a teacher's load is collective); the last stage uses it.
        cp = layout.cp > 1
        place = StudentPlace(
            active=self.is_last, dp_rank=self.dp_rank, dp_size=layout.dp,
            tp_group=self.tp_group if layout.tp > 1 else None,
            cp_group=ps.get_context_parallel_group() if cp else None,
            tp_cp_group=ps.get_tensor_and_context_parallel_group() if cp else None)
        self.teacher = build_run_source(
            run.kd, run.teacher_archs or (run.teacher_arch,), place,
            SourceConfig(micro_batch_size=config.optimizer.micro_batch_size,
                         seq_length=config.data.seq_length,
                         sequence_parallel=layout.sequence_parallel,
                         attention=config.kernels.attention_backend),
            topk_caches=run.topk_caches or (run.topk_cache,))
        # several teachers: each one's KD term is reported beside the weighted sum
        self.teacher_keys = tuple(f"kd_loss_{i}" for i in range(len(run.kd.teachers))) \
            if len(run.kd.teachers) > 1 else ()
        self._build_data()

    # -- models -----------------------------------------------------------------------------
    def _build_student(self) -> None:
        student = build_student(self.run_config, self.run, self.pp_rank)
        self.chunks, self.model_config = student.chunks, student.config
        self.optimizer, self.scheduler = student.optimizer, student.scheduler
        self.num_params = student.num_params

    # -- data -------------------------------------------------------------------------------
    def _build_data(self) -> None:
        if self.run.datasets is not None:  # offline: already built to check the cache
            self.train_ds, self.valid_ds = self.run.datasets
        else:
            self.train_ds, self.valid_ds = build_datasets(
                self.run_config.data, self.run.student_arch.vocab_size, self.run.tokenizer,
                self.run.global_batch_size)
        self.batches = BatchPlan(self.run.global_batch_size,
                                 self.run_config.optimizer.micro_batch_size, self.dp_rank,
                                 self.run.layout.dp)

    def _schedule(self, start: int, stop: int):
        """This rank's training microbatches of steps ``[start, stop)`` (0-based), in the
        order the schedule trains them; token ids are read only when a source asks."""
        n, gbs = len(self.train_ds), self.run.global_batch_size
        for step in range(start, stop):
            for m in range(self.batches.num_microbatches):
                ids = tuple(self.batches.sample_ids(step * gbs, m, n))
                yield Microbatch(step=step, index=m, sample_ids=ids,
                                 tokens=lambda ids=ids: collate(
                                     [self.train_ds[i] for i in ids])["tokens"])

    # -- one step ---------------------------------------------------------------------------
    def _forward_step(self, data_iterator, model):
        batch = next(data_iterator)
        device = compute_device()
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        if self.positions is not None:  # context parallelism: this rank's chunks of each
            batch = {k: v.index_select(1, self.positions.to(v.device))
                     for k, v in batch.items()}
        tokens, position_ids = batch["tokens"], batch["position_ids"]
        output = model(tokens, position_ids, None)
        if not unwrap_model(model).post_process:  # not the chunk with the loss
            return output, _never_called
        # the loss chunk takes the microbatches in order (interleaved schedules too)
        m, self._microbatch = self._microbatch, self._microbatch + 1
        inputs = self._teacher_inputs(tokens, position_ids, m)
        kw = {} if self.loss_fn is None else {"loss_fn": self.loss_fn}
        loss_func = make_kd_loss_func(
            student_weight=output_layer_weight(model), teacher=inputs.teacher,
            labels=batch["labels"], loss_mask=batch["loss_mask"],
            config=self.loss_config if inputs.present or not self._evaluating
            else self.ce_config,
            tp_group=self.tp_group, report_teacher_lm_loss=self._evaluating,
            report_agreement=self._evaluating, **kw)
        return output, self._named_failures(loss_func)

    def _teacher_inputs(self, tokens, position_ids, m: int):
        """The teacher's side of microbatch ``m``, watched by the finite guard."""
        step = self._consumed // self.run.global_batch_size
        ids = () if self._evaluating else tuple(
            self.batches.sample_ids(self._consumed, m, len(self.train_ds)))
        mb = Microbatch(step=step, index=m, sample_ids=ids, tokens=tokens,
                        positions=self.positions, model_inputs=((tokens, position_ids, None), {}))
        sources = getattr(self.teacher, "sources", (self.teacher,))  # a mixture: each teacher
        parts = []
        for source in sources:
            with self.timers.time(source.timer) if source.timer else contextlib.nullcontext():
                parts.append(source.inputs(mb, training=not self._evaluating))
            if parts[-1].present:
                self.guard.watch(m, parts[-1].what, parts[-1].watched)
        return self.teacher.combine(parts) if len(parts) > 1 else parts[0]

    def _named_failures(self, loss_func):
        """``loss_func``, its non-finite-loss errors naming the teacher source when it is one."""
        def named(output_tensor):
            try:
                with self.timers.time("loss-forward"):
                    return loss_func(output_tensor)
            except FloatingPointError as e:
                raise self.guard.diagnose(self._step, e) from e
        return named

    def _run_schedule(self, microbatches: list, forward_only: bool) -> list:
        forward_backward = get_forward_backward_func()
        self._microbatch = 0
        # one iterator per model chunk: each chunk reads the step's microbatches in order
        data = [iter(microbatches) for _ in self.chunks]
        with device_context(), self.timers.time("forward-backward"):
            return forward_backward(
                forward_step_func=self._forward_step,
                data_iterator=data if self.run.layout.virtual_stages else data[0],
                model=self.chunks, num_microbatches=len(microbatches),
                seq_length=self.run_config.data.seq_length,
                micro_batch_size=self.run_config.optimizer.micro_batch_size,
                forward_only=forward_only)

    def _reduce_reports(self, reports: list, keys: tuple = REPORT_KEYS
                        ) -> dict[str, torch.Tensor | None]:
        return reduce_reports(reports, keys, self.is_last and self.tp_rank == 0)

    def train_step(self, consumed_samples: int) -> tuple[dict, SourceStepStats]:
        """One optimizer step from ``consumed_samples``: its losses, learning rate, gradient
        norm (and timers), and the teacher's statistics over the world as their record (named
        when the step is logged)."""
        for chunk in self.chunks:
            chunk.train()
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        microbatches = list(self.batches.microbatches(self.train_ds, consumed_samples))
        self._consumed = consumed_samples
        self._step = consumed_samples // self.run.global_batch_size + 1  # 1-based, as logged
        reports = self._run_schedule(microbatches, forward_only=False)
        self.guard.check(self._step)  # before the optimizer takes anything from them
        with device_context(), self.timers.time("optimizer"):
            update_ok, grad_norm, _ = self.optimizer.step()
        if not update_ok:
            raise FloatingPointError("optimizer step skipped (non-finite gradients)")
        lr = self.optimizer.param_groups[0]["lr"]
        self.scheduler.step(increment=1)
        red = self._reduce_reports(reports, (*self.REPORT_KEYS, *self.teacher_keys))
        record = {"loss": _mean(red["loss"]), "kd_loss": _mean(red["kd_loss"]),
                  "lm_loss": _mean(red["lm_loss"]), "lr": lr,
                  "grad_norm": None if grad_norm is None else float(grad_norm)}
        if self.teacher_keys:  # several teachers: each one's KD term (unweighted)
            record["teacher_kd_losses"] = [_mean(red[key]) for key in self.teacher_keys]
        # the teacher's statistics over the whole world (rank 0 logs them)
        stats = self.teacher.step_stats(dist.group.WORLD)
        for event in stats.events:
            self._json_log.write({"step": self._step, **event})
        timers = self.timers.take(collective_device())
        if timers is not None:
            record["timers"] = timers
        return record, stats

    def evaluate(self) -> dict:
        if self.valid_ds is None or self.run_config.data.eval_iters == 0:
            return {}
        for chunk in self.chunks:
            chunk.eval()
        self._evaluating = True
        reports = []
        with torch.no_grad():
            for i in range(self.run_config.data.eval_iters):
                mbs = list(self.batches.microbatches(self.valid_ds,
                                                     i * self.run.global_batch_size))
                reports.extend(self._run_schedule(mbs, forward_only=True))
                self.guard.check(self._step)
        for chunk in self.chunks:
            chunk.train()
        self._evaluating = False
        self.timers.discard()  # the step timers time training steps only
        red = self._reduce_reports(reports, self.EVAL_REPORT_KEYS)
        # kd_kl / top1_agreement: None where no evaluation microbatch had a teacher
        return {"eval_loss": _mean(red["loss"]), "eval_kd_loss": _mean(red["kd_loss"]),
                "eval_lm_loss": _mean(red["lm_loss"]),
                "eval_teacher_lm_loss": _mean(red["teacher_lm_loss"]),
                "eval_kd_kl": _mean(red["kd_kl"]),
                "eval_top1_agreement": _mean(red["top1_agreement"])}

    def close(self) -> None:
        """Stop the teacher source (its client or decoder) and free what it made."""
        self.teacher.close()

    # -- the loop ---------------------------------------------------------------------------
    def _resume(self) -> tuple[int, int]:
        """``(iteration, consumed samples)`` to start from (``--load``), the teacher source
        started from there."""
        load = self.run_config.logging.load
        start_iter, consumed = 0, 0
        if load and latest_iteration(load) is not None and not self.run_config.logging.finetune:
            logging = self.run_config.logging
            start_iter, consumed = load_training_checkpoint(
                load, model=self.chunks, optimizer=self.optimizer, scheduler=self.scheduler,
                arch=self.run.student_arch, load_optim=not logging.no_load_optim,
                load_rng=not logging.no_load_rng)
        elif self.run.pretrained:  # first weights: --pretrained-checkpoint (unless --load
            # holds a checkpoint: a resumed run takes its own), or --finetune's --load
            load_model_checkpoint(self.chunks, self.run.pretrained)
            self.optimizer.reload_model_params()  # main weights (bf16) from the loaded ones
        stop = self._stop_at(start_iter)
        # re-iterable: several teachers each iterate it
        self.teacher.start(_Schedule(lambda: self._schedule(start_iter, stop)))
        return start_iter, consumed

    def _stop_at(self, start_iter: int) -> int:
        return stop_iteration(self.run_config.data.train_iters,
                              self.run_config.logging.exit_after_iters, start_iter)

    def _announce(self, progress: Progress, start_iter: int) -> None:
        load = self.run_config.logging.load
        line = self.teacher.announcement()
        if line and self.log_rank:
            progress.message(line)
        if load and self.log_rank and not self.run_config.logging.finetune:
            progress.message(f"megatron-kd: resumed from iteration {start_iter}" if start_iter
                             else f"megatron-kd: no checkpoint in --load {load!r}; "
                                  f"starting from iteration 0")
        if self.run.pretrained and not start_iter and self.log_rank:
            progress.message(f"megatron-kd: student weights from {self.run.pretrained}"
                             + (" (--finetune: iteration 0, a new optimizer)"
                                if self.run_config.logging.finetune else ""))
        for note in self.run.notes if self.log_rank else ():
            progress.message(f"megatron-kd: {note}")

    @contextlib.contextmanager
    def _parameters_gathered(self):
        """With ``--overlap-param-gather`` the updated parameters are all-gathered by the next
        forward pass's hooks: for a checkpoint or an evaluation they are gathered now and the
        hooks are off until it ends (Megatron-LM's rule)."""
        if not self.run_config.parallel.overlap_param_gather:
            yield
            return
        for chunk in self.chunks:
            chunk.disable_forward_pre_hook(param_sync=True)
        try:
            yield
        finally:
            for chunk in self.chunks:
                chunk.enable_forward_pre_hook()

    def _save(self, iteration: int, consumed: int) -> None:
        run, save = self.run, self.run_config.logging.save
        if not save:
            return
        extra = {"kind": "student", "teacher": run.kd.teacher_load,
                 # where its first weights came from (export-hf follows it to the HF config)
                 "pretrained_checkpoint": os.path.abspath(run.pretrained) if run.pretrained
                 else None, **self.teacher.checkpoint_record()}
        with self._parameters_gathered():
            save_training_checkpoint(
                save, iteration=iteration, consumed_samples=consumed, model=self.chunks,
                optimizer=self.optimizer, scheduler=self.scheduler, arch=run.student_arch,
                extra=extra, tokenizer_file=run.tokenizer.path if run.tokenizer else None)

    def _evaluate_and_log(self, iteration: int, log: JsonLog, progress: Progress,
                          evals: list) -> None:
        with self._parameters_gathered():
            ev = self.evaluate()
        if not ev:
            return
        ev = {"step": iteration, "eval": True, **ev}
        evals.append(ev)
        log.write(ev)
        self.writers.evaluation(iteration, iteration * self.run.global_batch_size,
                                eval_scalars(ev))
        progress.message(f"eval @ {iteration}: lm loss {ev['eval_lm_loss']:.4f}"
                         + (f", kd loss {ev['eval_kd_loss']:.4f}"
                            if ev.get("eval_kd_loss") is not None else "")
                         + (f", kl {ev['eval_kd_kl']:.4f}, top-1 agreement "
                            f"{ev['eval_top1_agreement']:.4f}"
                            if ev.get("eval_kd_kl") is not None else ""))

    def fit(self) -> dict:
        """Train from ``--load`` (or the start) to the stop iteration; returns a summary.

        With ``--exit-signal-handler`` a SIGTERM on any rank ends the run after the step it
        arrived in: a checkpoint is saved (with ``--save``) and the summary says
        ``exit_signal: True``. With ``--exit-duration-in-mins`` the run ends after the first
        step that ends past that many minutes of the process, saving likewise. Either way the
        JSON log's last record is ``{"event": "exit", "reason": "signal" | "duration",
        "resumable": true, ...}`` (what the sbatch scripts requeue on) and the summary's
        ``exit_reason`` names it.
        """
        logging, gbs = self.run_config.logging, self.run.global_batch_size
        train_iters = self.run_config.data.train_iters
        start_iter, consumed = self._resume()
        stop_at = self._stop_at(start_iter)
        progress = Progress(train_iters, self.log_rank and not logging.no_progress)
        log = self._json_log = JsonLog(logging.log_json, self.log_rank)
        self.writers = MetricWriters(self.run_config.metrics, self.log_rank, save=logging.save,
                                     config=self.run_config.flat())
        early = EarlyExit(signal_handler=logging.exit_signal_handler,
                          duration_mins=logging.exit_duration_in_mins, started=self.started)
        self._announce(progress, start_iter)
        record = RunRecord(start_iter)
        iteration, saved_at = start_iter, None
        try:
            while iteration < stop_at:
                self._one_step(consumed, record, log, progress, stop_at)
                iteration += 1
                consumed += gbs
                if iteration % logging.eval_interval == 0 or iteration == train_iters:
                    self._evaluate_and_log(iteration, log, progress, record.evals)
                if logging.save_interval and iteration % logging.save_interval == 0:
                    self._save(iteration, consumed)
                    saved_at = iteration
                reason = early.reason(collective_device()) if iteration < stop_at else None
                if reason is not None:
                    record.exit_reason = reason
                    what = ("SIGTERM received" if reason == "signal" else
                            f"--exit-duration-in-mins {early.duration_mins:g} passed")
                    progress.message(f"megatron-kd: {what}: stopping after iteration "
                                     f"{iteration}" + (", saving a checkpoint" if logging.save
                                                       else ""))
                    break
            if logging.save and saved_at != iteration and iteration > start_iter:
                self._save(iteration, consumed)
            if record.exit_reason is not None:  # after the save: resumable from it
                log.write({"step": iteration, "event": "exit", "reason": record.exit_reason,
                           "resumable": bool(logging.save), "train_iters": train_iters})
        finally:
            progress.close()
            log.close()
            self.writers.close()
            early.close()
        return self._summary(record, iteration)

    def _one_step(self, consumed: int, history: RunRecord, log: JsonLog, progress: Progress,
                  stop_at: int) -> None:
        """One training step, logged."""
        gbs, train_iters = self.run.global_batch_size, self.run_config.data.train_iters
        tokens_per_step = gbs * self.run_config.data.seq_length
        t0 = time.perf_counter()
        record, teacher_stats = self.train_step(consumed)
        dt = time.perf_counter() - t0
        iteration = self._step
        history.step_times.append(dt)
        peak, kind = peak_memory()
        # the teacher's statistics named here, as they are logged (rates over the step's time)
        record = {"step": iteration, **record, **teacher_stats.log_fields(dt),
                  "tokens_per_s": tokens_per_step / dt, "step_time_s": dt,
                  "peak_mem_bytes": peak, "peak_mem_kind": kind,
                  "peak_mem_reserved_bytes": peak_reserved_memory()}
        if not history.steps:
            # after the first step of this process (the optimizer's state exists from its first
            # update on): what the rank holds between steps, by the planner's terms
            record["static_mem_bytes"] = static_memory(self.chunks, self.optimizer,
                                                       getattr(self.teacher, "model", None))
        history.steps.append(record)
        log.write(record)
        self.writers.step(iteration, iteration * gbs,
                          step_scalars(record, self.run_config.metrics, gbs, teacher_stats))
        recent = history.step_times[-10:]
        eta = (train_iters - iteration) * sum(recent) / len(recent)
        if iteration % self.run_config.logging.log_interval == 0 or iteration == stop_at:
            progress.update(iteration, record["loss"], record["tokens_per_s"], eta)

    def _summary(self, record: RunRecord, iteration: int) -> dict:
        """What :meth:`fit` returns."""
        run = self.run
        tokens_per_step = run.global_batch_size * self.run_config.data.seq_length
        steps, evals, step_times = record.steps, record.evals, record.step_times
        return {
            "start_iteration": record.start_iteration,
            "iterations": iteration,
            "steps": steps,
            "evals": evals,
            "final_loss": steps[-1]["loss"] if steps else None,
            "final_eval_lm_loss": evals[-1]["eval_lm_loss"] if evals else None,
            "tokens_per_s": (len(steps) * tokens_per_step / sum(step_times)) if step_times
            else None,
            "wall_s": time.perf_counter() - record.t_start,
            "exit_signal": record.exit_signal,
            "exit_reason": record.exit_reason,
            "student_params_per_rank": self.num_params,
            "student_arch": run.student_arch.to_dict(),
            "teacher_arch": run.teacher_arch.to_dict() if run.teacher_arch else None,
            "world_size": dist.get_world_size(),
            "rank": self.rank,
            "kd_mode": run.kd.mode if not run.kd.extra_teachers
            else [t.mode for t in run.kd.teachers],
            "topk_wait_s": None,
            **self.teacher.summary(),
            "tp": run.layout.tp, "pp": run.layout.pp, "dp": run.layout.dp,
            "vp": run.layout.virtual_stages, "cp": run.layout.cp,
            "sequence_parallel": run.layout.sequence_parallel,
        }


class _Schedule:
    """An iterable that makes its iterator anew each time (a schedule several sources read)."""

    def __init__(self, make) -> None:
        self._make = make

    def __iter__(self):
        return self._make()


def _never_called(output_tensor):  # loss function of non-last pipeline stages
    raise AssertionError("loss function called on a pipeline stage that is not the last")
