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
teacher's top-K ids and log-probs of every training sample; :func:`~megatron_kd.training.plan.
plan_run` refuses a cache made for other data, sequence length, vocabulary or tokenizer, and the
student's vocabulary is the cache's. On the last pipeline stage a background thread decodes each
rank's microbatches (by dataset sample index, so any DP / TP / micro-batch layout reads the same
cache) ahead of the step, and the loss takes them as a sparse teacher (``forward_kl`` only).
Evaluation reports the student's cross-entropy only (the cache does not cover the validation
samples).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.pipeline_parallel import get_forward_backward_func

from megatron_kd.cache.loader import TopKPrefetcher
from megatron_kd.data.datasets import BatchPlan
from megatron_kd.integration.cpu_shim import device_context, on_cpu
from megatron_kd.integration.gpt import build_gpt_model
from megatron_kd.integration.groups import collective_device
from megatron_kd.integration.loss_func import make_kd_loss_func
from megatron_kd.integration.output_layer import bypass_output_layer, output_layer_weight, to_sbh
from megatron_kd.integration.teacher import build_frozen_teacher, unpipelined_groups
from megatron_kd.training.checkpointing import (
    load_training_checkpoint,
    save_training_checkpoint,
    stop_iteration,
)
from megatron_kd.training.disaggregated import (
    output_layer_shard,
    run_id,
    start_teacher_client,
    step_teacher_stats,
)
from megatron_kd.training.faults import ExitSignal, FiniteGuard
from megatron_kd.training.logs import (
    JsonLog,
    Progress,
    RunRecord,
    peak_memory,
    reduce_reports,
    run_summary,
    step_cache_stats,
)
from megatron_kd.training.metrics import MetricWriters, StepTimers, eval_scalars, step_scalars
from megatron_kd.training.plan import Plan, build_datasets

__all__ = ["Trainer"]


def _mean(pair: torch.Tensor | None) -> float | None:
    if pair is None or pair[1] <= 0:
        return None
    return float(pair[0] / pair[1])



def _moe_recipe(args: argparse.Namespace, arch) -> dict:
    """Megatron-Core's load-balancing auxiliary loss for a mixture-of-experts student."""
    coeff = getattr(args, "moe_aux_loss_coeff", 0.0)
    if not arch.num_experts or not coeff:
        return {}
    return {"moe_router_load_balancing_type": "aux_loss", "moe_aux_loss_coeff": coeff}

class Trainer:
    """One distillation run; ``parallel_state`` must be initialised (TP x PP).

    The teacher is local (colocated), a service (``remote``: disaggregated, see
    :mod:`megatron_kd.training.disaggregated`) or a top-K cache (``plan.topk_cache``: offline;
    no teacher model exists, ``self.teacher`` is None).
    """

    REPORT_KEYS = ("loss", "kd_loss", "lm_loss", "teacher_lm_loss")

    def __init__(self, args: argparse.Namespace, plan: Plan, *, loss_fn=None) -> None:
        self.args, self.plan = args, plan
        self.remote = None  # disaggregated, last stage: a TeacherClient (started by fit)
        self.teacher_weight = None  # disaggregated: the teacher's output-layer shard
        self.topk = None  # offline, last stage: a TopKPrefetcher (started by fit)
        self._expected: list = []
        self.loss_fn = loss_fn  # None: the fused loss; tests pass a dense reference
        self.rank = dist.get_rank()
        self.is_first = ps.is_pipeline_first_stage()
        self.is_last = ps.is_pipeline_last_stage()
        self.tp_group = ps.get_tensor_model_parallel_group()
        self.tp_rank = ps.get_tensor_model_parallel_rank()
        self.dp_rank = ps.get_data_parallel_rank()
        self.pp_rank = ps.get_pipeline_model_parallel_rank()
        self.log_rank = self.rank == 0
        # The output-layer weight gradient straight into DDP's fp32 main_grad (Megatron's
        # gradient-accumulation fusion, in the loss: no [V/tp, h] gradient tensor).
        self.loss_config = plan.kd.loss_config(vocab_size=plan.student_arch.vocab_size,
                                               gradient_accumulation_fusion=True)
        # Evaluation without teacher outputs (offline: the cache holds training samples only;
        # disaggregated: the teacher streams training microbatches only): the student's CE.
        self.ce_config = dataclasses.replace(self.loss_config, kd_weight=0.0, ce_weight=1.0)
        self._evaluating = False
        self._subgroups: list = []
        self.guard = FiniteGuard()
        self._json_log = JsonLog(None, False)
        self._events_seen = 0
        self._step = self._microbatch = 0
        self.timers = StepTimers(getattr(args, "timing_log_level", 0))
        self.writers = MetricWriters(args, False)
        self._build_student()
        self._build_teacher()
        self._build_data()

    # -- models -----------------------------------------------------------------------------
    def _build_student(self) -> None:
        args, plan = self.args, self.plan
        model = build_gpt_model(
            plan.student_arch, pre_process=self.is_first, post_process=self.is_last,
            # Megatron-LM's rule: each pipeline stage its own seed (else stages' layers would
            # start identical).
            params_dtype=plan.params_dtype, seed=args.seed + 100 * self.pp_rank,
            hidden_dropout=args.hidden_dropout, attention_dropout=args.attention_dropout,
            calculate_per_token_loss=True, **_moe_recipe(args, plan.student_arch))
        bypass_output_layer(model)
        config = model.config
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False,
            use_distributed_optimizer=args.use_distributed_optimizer, average_in_collective=False)
        self.model = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)
        config.finalize_model_grads_func = finalize_model_grads
        config.no_sync_func = self.model.no_sync
        self.config = config
        opt_config = OptimizerConfig(
            optimizer="adam", lr=args.lr, min_lr=args.min_lr, weight_decay=args.weight_decay,
            adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2, adam_eps=args.adam_eps,
            clip_grad=args.clip_grad, bf16=plan.params_dtype == torch.bfloat16,
            params_dtype=plan.params_dtype,
            use_distributed_optimizer=args.use_distributed_optimizer)
        self.optimizer = get_megatron_optimizer(opt_config, [self.model])
        decay_iters = args.lr_decay_iters or args.train_iters
        self.scheduler = OptimizerParamScheduler(
            self.optimizer, init_lr=0.0, max_lr=args.lr, min_lr=args.min_lr,
            lr_warmup_steps=args.lr_warmup_iters,
            lr_decay_steps=max(decay_iters, args.lr_warmup_iters + 1),
            lr_decay_style=args.lr_decay_style, start_wd=args.weight_decay,
            end_wd=args.weight_decay, wd_incr_steps=max(1, args.train_iters),
            wd_incr_style="constant")
        self.num_params = sum(p.numel() for p in model.parameters())

    def _build_teacher(self) -> None:
        """Every rank builds and loads the full (un-pipelined) teacher; only the last stage
        keeps it (see the module docstring)."""
        self.teacher = None
        plan = self.plan
        if plan.kd.mode == "disaggregated":
            self.run_id = run_id()
            self.teacher_weight = output_layer_shard(plan, ps.get_tensor_model_parallel_world_size())
            return
        if plan.teacher_arch is None:
            return
        pgc, single = unpipelined_groups()
        self._subgroups = [single]
        # Replicated on every pipeline stage: several ranks read the same shard.
        self.teacher = build_frozen_teacher(plan.teacher_arch, plan.kd.teacher_load,
                                            dtype=plan.kd.teacher_torch_dtype,
                                            pg_collection=pgc, replicated=True,
                                            keep=self.is_last)

    # -- data -------------------------------------------------------------------------------
    def _build_data(self) -> None:
        if self.plan.datasets is not None:  # offline: already built to check the cache
            self.train_ds, self.valid_ds = self.plan.datasets
        else:
            self.train_ds, self.valid_ds = build_datasets(
                self.args, self.plan.student_arch.vocab_size, self.plan.tokenizer,
                self.plan.global_batch_size)
        self.batches = BatchPlan(self.plan.global_batch_size, self.args.micro_batch_size,
                                 self.dp_rank, self.plan.dp)

    # -- one step ---------------------------------------------------------------------------
    def _forward_step(self, data_iterator, model):
        batch = next(data_iterator)
        m, self._microbatch = self._microbatch, self._microbatch + 1
        if not on_cpu():
            device = torch.cuda.current_device()
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        tokens, position_ids = batch["tokens"], batch["position_ids"]
        output = model(tokens, position_ids, None)
        if not self.is_last:
            return output, _never_called
        teacher = self._teacher_inputs(tokens, position_ids, m)
        has_teacher = teacher["teacher_hidden"] is not None or \
            teacher["teacher_topk_ids"] is not None
        kw = {} if self.loss_fn is None else {"loss_fn": self.loss_fn}
        loss_func = make_kd_loss_func(
            student_weight=output_layer_weight(model), **teacher, labels=batch["labels"],
            loss_mask=batch["loss_mask"],
            config=self.loss_config if has_teacher or not self._evaluating else self.ce_config,
            tp_group=self.tp_group, report_teacher_lm_loss=self._evaluating, **kw)
        return output, self._named_failures(loss_func)

    def _teacher_inputs(self, tokens, position_ids, m: int) -> dict:
        """The loss's teacher arguments for microbatch ``m``, each watched by the finite guard."""
        out = dict.fromkeys(("teacher_hidden", "teacher_weight", "teacher_topk_ids",
                             "teacher_topk_logprobs"))
        if self.remote is not None and not self._evaluating:
            step, mb, ids = self._expected.pop(0)
            with self.timers.time("teacher-wait"):
                out["teacher_hidden"] = self.remote.hidden(step, mb, ids)
            out["teacher_weight"] = self.teacher_weight
            self.guard.watch(m, f"teacher hidden states received from {self.remote.replica}",
                             out["teacher_hidden"])
        elif self.topk is not None and not self._evaluating:
            step, mb, ids = self._expected.pop(0)
            try:
                with self.timers.time("teacher-wait"):
                    out["teacher_topk_ids"], out["teacher_topk_logprobs"] = self.topk.next(ids)
            except FloatingPointError as e:  # decoded NaN / inf: named with the step here
                raise FloatingPointError(f"non-finite teacher values (NaN or inf) at step "
                                         f"{self._step}, microbatch {m}: {e}; no optimizer "
                                         f"step was taken") from e
            self.guard.watch(m, f"top-K log-probs of samples {ids} read from the cache "
                                f"{self.plan.kd.topk_cache}", out["teacher_topk_logprobs"])
        elif self.teacher is not None:
            with torch.no_grad(), self.timers.time("teacher-forward"):
                out["teacher_hidden"] = to_sbh(self.teacher(tokens, position_ids, None))
            out["teacher_weight"] = output_layer_weight(self.teacher)
            self.guard.watch(m, f"hidden states of the colocated teacher "
                                f"{self.plan.kd.teacher_load}", out["teacher_hidden"])
        return out

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
        with device_context(), self.timers.time("forward-backward"):
            return forward_backward(
                forward_step_func=self._forward_step, data_iterator=iter(microbatches),
                model=[self.model], num_microbatches=len(microbatches),
                seq_length=self.args.seq_length, micro_batch_size=self.args.micro_batch_size,
                forward_only=forward_only)

    def _reduce_reports(self, reports: list) -> dict[str, torch.Tensor | None]:
        return reduce_reports(reports, self.REPORT_KEYS, self.is_last and self.tp_rank == 0)

    def train_step(self, consumed_samples: int) -> dict:
        self.model.train()
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        microbatches = list(self.batches.microbatches(self.train_ds, consumed_samples))
        step = consumed_samples // self.plan.global_batch_size
        self._step = step + 1  # the step being taken, as logged (1-based)
        if (self.remote is not None or self.topk is not None) and self.is_last:
            n = len(self.train_ds)
            self._expected = [(step, m, self.batches.sample_ids(consumed_samples, m, n))
                              for m in range(len(microbatches))]
        reports = self._run_schedule(microbatches, forward_only=False)
        self.guard.check(self._step)  # before the optimizer takes anything from them
        with device_context(), self.timers.time("optimizer"):
            update_ok, grad_norm, _ = self.optimizer.step()
        if not update_ok:
            raise FloatingPointError("optimizer step skipped (non-finite gradients)")
        lr = self.optimizer.param_groups[0]["lr"]
        self.scheduler.step(increment=1)
        red = self._reduce_reports(reports)
        record = {"loss": _mean(red["loss"]), "kd_loss": _mean(red["kd_loss"]),
                  "lm_loss": _mean(red["lm_loss"]), "lr": lr,
                  "grad_norm": None if grad_norm is None else float(grad_norm)}
        if self.plan.kd.mode == "disaggregated":
            record.update(step_teacher_stats(self, len(microbatches)))
        elif self.plan.topk_cache is not None:
            record.update(step_cache_stats(self))
        timers = self.timers.take(collective_device())
        if timers is not None:
            record["timers"] = timers
        return record

    def evaluate(self) -> dict:
        if self.valid_ds is None or self.args.eval_iters == 0:
            return {}
        self.model.eval()
        self._evaluating = True
        reports = []
        with torch.no_grad():
            for i in range(self.args.eval_iters):
                mbs = list(self.batches.microbatches(self.valid_ds,
                                                     i * self.plan.global_batch_size))
                reports.extend(self._run_schedule(mbs, forward_only=True))
                self.guard.check(self._step)
        self.model.train()
        self._evaluating = False
        self.timers.discard()  # the step timers time training steps only
        red = self._reduce_reports(reports)
        return {"eval_loss": _mean(red["loss"]), "eval_kd_loss": _mean(red["kd_loss"]),
                "eval_lm_loss": _mean(red["lm_loss"]),
                "eval_teacher_lm_loss": _mean(red["teacher_lm_loss"])}

    def _start_topk(self, consumed: int, steps: int) -> None:
        """Offline, last stage: decode this rank's microbatches of the next ``steps`` steps from
        ``consumed`` samples on, ahead of training (``--kd-prefetch-depth`` microbatches)."""
        n, gbs = len(self.train_ds), self.plan.global_batch_size
        schedule = (self.batches.sample_ids(consumed + k * gbs, m, n)
                    for k in range(steps) for m in range(self.batches.num_microbatches))
        # Decoding threads compete with the CPU shim's own compute; on a GPU they are spare.
        threads = 1 if on_cpu() else min(4, self.args.micro_batch_size)
        device = None if on_cpu() else torch.cuda.current_device()
        self.topk = TopKPrefetcher(self.plan.topk_cache, schedule,
                                   depth=self.plan.kd.prefetch_depth, threads=threads,
                                   device=device)

    def close(self) -> None:
        """Stop the top-K decoder and the teacher client; free this rank's one-rank pipeline
        group of the teacher."""
        if self.topk is not None:
            self.topk.close()
        if self.remote is not None:
            self.remote.close()
        for group in self._subgroups:
            dist.destroy_process_group(group)
        self._subgroups = []

    # -- the loop ---------------------------------------------------------------------------
    def _resume(self) -> tuple[int, int]:
        """``(iteration, consumed samples)`` to start from (``--load``), teacher sources
        started from there."""
        args, plan = self.args, self.plan
        start_iter, consumed = 0, 0
        if args.load:
            start_iter, consumed = load_training_checkpoint(
                args.load, model=self.model, optimizer=self.optimizer, scheduler=self.scheduler,
                arch=plan.student_arch)
        stop_at = stop_iteration(args, start_iter)
        if plan.kd.mode == "disaggregated" and self.is_last:
            self.remote = start_teacher_client(self, start_iter, stop_at)
        if plan.topk_cache is not None and self.is_last:
            self._start_topk(consumed, max(0, stop_at - start_iter))
        return start_iter, consumed

    def _announce(self, progress: Progress, start_iter: int) -> None:
        args, plan = self.args, self.plan
        if plan.topk_cache is not None and self.log_rank:
            spec = plan.topk_cache.spec
            progress.message(f"megatron-kd: offline teacher: top-{spec.topk} cache "
                             f"{plan.kd.topk_cache} (teacher {spec.teacher_checkpoint}, "
                             f"tail {plan.kd.loss.topk_tail})")
        if args.load and self.log_rank:
            progress.message(f"megatron-kd: resumed from iteration {start_iter}" if start_iter
                             else f"megatron-kd: no checkpoint in --load {args.load!r}; "
                                  f"starting from iteration 0")

    def _save(self, iteration: int, consumed: int) -> None:
        args, plan = self.args, self.plan
        if not args.save:
            return
        extra = {"kind": "student", "teacher": plan.kd.teacher_load}
        if plan.topk_cache is not None:
            extra.update(teacher=plan.topk_cache.spec.teacher_checkpoint,
                         topk_cache=os.path.abspath(plan.kd.topk_cache))
        save_training_checkpoint(args.save, iteration=iteration, consumed_samples=consumed,
                                 model=self.model, optimizer=self.optimizer,
                                 scheduler=self.scheduler, arch=plan.student_arch, extra=extra)

    def _evaluate_and_log(self, iteration: int, log: JsonLog, progress: Progress,
                          evals: list) -> None:
        ev = self.evaluate()
        if not ev:
            return
        ev = {"step": iteration, "eval": True, **ev}
        evals.append(ev)
        log.write(ev)
        self.writers.evaluation(iteration, iteration * self.plan.global_batch_size,
                                eval_scalars(ev))
        progress.message(f"eval @ {iteration}: lm loss {ev['eval_lm_loss']:.4f}"
                         + (f", kd loss {ev['eval_kd_loss']:.4f}"
                            if ev.get("eval_kd_loss") is not None else ""))

    def fit(self) -> dict:
        """Train from ``--load`` (or the start) to the stop iteration; returns a summary.

        With ``--exit-signal-handler`` a SIGTERM on any rank ends the run after the step it
        arrived in: a checkpoint is saved (with ``--save``) and the summary says
        ``exit_signal: True``.
        """
        args, plan = self.args, self.plan
        start_iter, consumed = self._resume()
        stop_at = stop_iteration(args, start_iter)
        progress = Progress(args.train_iters, self.log_rank and not args.no_progress)
        log = self._json_log = JsonLog(args.log_json, self.log_rank)
        self.writers = MetricWriters(args, self.log_rank)
        exit_signal = ExitSignal() if getattr(args, "exit_signal_handler", False) else None
        self._announce(progress, start_iter)
        run = RunRecord(start_iter)
        iteration, saved_at = start_iter, None
        try:
            while iteration < stop_at:
                self._one_step(consumed, run, log, progress, stop_at)
                iteration += 1
                consumed += plan.global_batch_size
                if iteration % args.eval_interval == 0 or iteration == args.train_iters:
                    self._evaluate_and_log(iteration, log, progress, run.evals)
                if args.save_interval and iteration % args.save_interval == 0:
                    self._save(iteration, consumed)
                    saved_at = iteration
                if exit_signal is not None and exit_signal.received(collective_device()):
                    run.exit_signal = True
                    progress.message(f"megatron-kd: SIGTERM received: stopping after iteration "
                                     f"{iteration}" + (", saving a checkpoint" if args.save
                                                       else ""))
                    break
            if args.save and saved_at != iteration and iteration > start_iter:
                self._save(iteration, consumed)
        finally:
            progress.close()
            log.close()
            self.writers.close()
            if exit_signal is not None:
                exit_signal.close()
            if self.topk is not None:
                self.topk.close()
        return self._summary(run, iteration)

    def _one_step(self, consumed: int, run: "RunRecord", log: JsonLog, progress: Progress,
                  stop_at: int) -> None:
        """One training step, logged."""
        args = self.args
        tokens_per_step = self.plan.global_batch_size * args.seq_length
        t0 = time.perf_counter()
        record = self.train_step(consumed)
        dt = time.perf_counter() - t0
        iteration = self._step
        run.step_times.append(dt)
        peak, kind = peak_memory()
        record = {"step": iteration, **record, "tokens_per_s": tokens_per_step / dt,
                  "step_time_s": dt, "peak_mem_bytes": peak, "peak_mem_kind": kind}
        if "kd_replica_tokens" in record:  # disaggregated: each replica's rate for this run
            record["kd_replica_tokens_per_s"] = {
                replica: round(n / dt, 1) for replica, n in record["kd_replica_tokens"].items()}
        run.steps.append(record)
        log.write(record)
        self.writers.step(iteration, iteration * self.plan.global_batch_size,
                          step_scalars(record, args, self.plan.global_batch_size))
        recent = run.step_times[-10:]
        eta = (args.train_iters - iteration) * sum(recent) / len(recent)
        if iteration % args.log_interval == 0 or iteration == stop_at:
            progress.update(iteration, record["loss"], record["tokens_per_s"], eta)

    def _summary(self, run: "RunRecord", iteration: int) -> dict:
        return run_summary(self, run, iteration)


def _never_called(output_tensor):  # loss function of non-last pipeline stages
    raise AssertionError("loss function called on a pipeline stage that is not the last")
