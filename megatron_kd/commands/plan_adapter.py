"""The planner's view of a ``megatron-kd train`` run: the run resolved as the trainer resolves it,
turned into the planner's inputs, and the planner's prediction for the run's logging rank (rank 0:
pipeline stage 0, TP rank 0) and for rank 0 of a disaggregated run's teacher replica. What
``tools/validate_planner.py`` compares with measured runs.

How the planner is configured for a run: the architectures are the ones ``megatron-kd train``
itself resolves (``check_run``: the student from the flags, the teacher from its checkpoint's
``model_config.json``, an offline run's K from its cache's manifest), with the padded vocabulary
as the vocabulary (the layouts then pad by 1); precision follows ``--bf16`` (fp32 otherwise:
4-byte weights and activations, Adam moments without a master copy) and must match
``--kd-teacher-dtype`` (the planner has one precision; a mismatch is refused); the streamed hidden
states take the run's wire dtype on the wire (``--kd-wire-dtype``, default the teacher's) and the
teacher's element size once decoded; one teacher replica; ``--kd-prefetch-depth`` sets the ring
slots; the run's context-parallel size (``CheckedRun.cp``) is the student's and a colocated
teacher's; on CPU the local layer spec runs unfused attention, softmax, norms and SwiGLU
(``flash_attention``, ``fused_softmax``, ``fused_norm``, ``fused_swiglu`` off; with context
parallelism ``ContextParallelAttention``, which all-gathers keys and values), the loss takes the
path ``--kd-loss-path`` gives it (``auto``: the GPU path on a GPU, with the run's
``--kd-loss-window-mib`` and ``--kd-loss-weight-grad``, the CPU path on CPU) and on CPU works
through a window in cache-sized blocks (where the loss does: without TP, unless its CPU tuning
says so with TP too), and the top-K prefetcher's host queue is device memory
(``cache_resident_microbatches = D + 2``). No reserve: the measured peaks do not see it.

The trainer's resolved run is read in one place, :func:`run_shape`; everything after it works on
the :class:`RunShape` it returns.
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
from dataclasses import dataclass

import torch

from megatron_kd.arch import GPTArchConfig
from megatron_kd.loss.config import CpuTuning, GpuTuning
from megatron_kd.parallel import ParallelLayout
from megatron_kd.parallel.windows import DEFAULT_GPU_WINDOW_BYTES, DEFAULT_WEIGHT_GRAD
from megatron_kd.planner import traffic
from megatron_kd.planner.memory import ActivationOptions, Precision, Term
from megatron_kd.planner.models import PlannedModel
from megatron_kd.planner.plan import Mode, PlanOptions
from megatron_kd.planner.presets import GpuSpec, LinkSpec
from megatron_kd.planner.search import student_stage_terms, teacher_inference_terms
from megatron_kd.training.run_checks import CheckedRun, check_run
from megatron_kd.training.run_config import RunConfig, add_arguments

__all__ = ["Prediction", "RunShape", "arch_to_model", "parse_train_args", "plan_options",
           "predict", "predict_shape", "predict_teacher", "resolve_run", "run_shape"]

#: The planner's modes of the trainer's online ``--kd-mode`` values (with a teacher).
_ONLINE_MODES = {"colocated": Mode.COLOCATED_FUSED, "disaggregated": Mode.DISAGGREGATED}


def parse_train_args(train_args: str) -> argparse.Namespace:
    """``megatron-kd train``'s own parsing of ``train_args`` (one string, shell quoting)."""
    parser = argparse.ArgumentParser(prog="megatron-kd train")
    add_arguments(parser)
    return parser.parse_args(shlex.split(train_args))


def resolve_run(train_args: str, world_size: int) -> tuple[RunConfig, CheckedRun]:
    """``(config, run)``: the run configuration of the flags and the run exactly as
    ``megatron-kd train`` checks them (no model is built; an offline run's cache is opened and
    checked against the run)."""
    config = RunConfig.from_args(parse_train_args(train_args))
    return config, check_run(config, world_size)


def arch_to_model(arch: GPTArchConfig, name: str) -> PlannedModel:
    """The planner's :class:`PlannedModel` of a ``GPTArchConfig``, with the padded vocabulary as
    its vocabulary (the runs' layouts then pad by 1, see :func:`predict`)."""
    padded = dataclasses.replace(arch, vocab_size=arch.padded_vocab_size)
    return PlannedModel(name=name, arch=padded, source="megatron-kd train check_run",
                        vocab_multiple=1)


@dataclass(kw_only=True, frozen=True)
class RunShape:
    """What the planner needs of a resolved run."""

    kd_mode: str
    """The run's ``--kd-mode``."""
    student: PlannedModel
    teacher: PlannedModel | None
    """None: no teacher (the fused loss with the student's logits only)."""
    fp32: bool
    """Parameters in fp32 (no ``--bf16``)."""
    teacher_dtype: str
    """``--kd-teacher-dtype``."""
    layout: ParallelLayout
    """The run's layout (``CheckedRun.layout``): the student's, and a colocated teacher's in
    its groups."""
    seq_length: int
    micro_batch_size: int
    global_batch_size: int
    hidden_dropout: bool
    attention_dropout: bool
    topk: int | None
    """An offline run's K (its cache's); None without a cache."""
    prefetch_depth: int
    wire_dtype: str
    """The hidden states' type on the wire."""
    window_size: int | None
    """The loss's rows per window; None: its default."""
    loss_path: str = "auto"
    """The fused loss's path (``--kd-loss-path``): ``auto`` is the GPU path on a GPU."""
    loss_window_bytes: int = DEFAULT_GPU_WINDOW_BYTES
    """The GPU path's bound on a window's logits (``--kd-loss-window-mib``)."""
    loss_weight_grad: str = DEFAULT_WEIGHT_GRAD
    """The GPU path's weight-gradient accumulator (``--kd-loss-weight-grad``)."""

    @property
    def mode(self) -> Mode | None:
        """The planner's mode of the run; None: no teacher. A colocated run on the dense path
        is the planner's colocated-dense mode."""
        if self.kd_mode == "offline":
            return Mode.OFFLINE_CACHE
        if self.teacher is None:
            return None
        if self.kd_mode == "colocated" and self.loss_path == "dense":
            return Mode.COLOCATED_DENSE
        return _ONLINE_MODES[self.kd_mode]


def run_shape(config: RunConfig, run: CheckedRun) -> RunShape:
    """The one place that reads the trainer's resolved run: ``config`` and ``run`` of
    :func:`resolve_run`."""
    if run.kd.extra_teachers:
        raise ValueError(f"--kd-mode {' '.join(t.mode for t in run.kd.teachers)}: the "
                         f"planner's prediction of a run takes one teacher so far")
    gpu_tuning = run.kd.loss.gpu_tuning or GpuTuning()
    return RunShape(
        kd_mode=run.kd.mode,
        student=arch_to_model(run.student_arch, "student"),
        teacher=arch_to_model(run.teacher_arch, "teacher") if run.teacher_arch else None,
        fp32=run.params_dtype == torch.float32,
        teacher_dtype=run.kd.teacher_dtype,
        layout=run.layout,
        seq_length=config.data.seq_length,
        micro_batch_size=config.optimizer.micro_batch_size,
        global_batch_size=run.global_batch_size,
        hidden_dropout=config.arch.hidden_dropout > 0,
        attention_dropout=config.arch.attention_dropout > 0,
        topk=run.topk_cache.spec.topk if run.topk_cache is not None else None,
        prefetch_depth=run.kd.prefetch_depth,
        wire_dtype=run.kd.wire,
        window_size=run.kd.loss.window_size,
        loss_path=run.kd.loss.path,
        loss_window_bytes=gpu_tuning.window_bytes,
        loss_weight_grad=gpu_tuning.weight_grad,
    )


@dataclass(kw_only=True, frozen=True)
class Prediction:
    """The planner's prediction for a run's logging rank."""

    mode: Mode | None
    """None: no teacher."""
    terms: dict[Term, float]
    """Memory of the logging rank, bytes (no reserve)."""
    wire: dict[str, float] | None
    """Disaggregated: the teacher -> student bytes per step by scope (``tp-rank``: one
    last-stage TP x CP rank, ``1/(tp*cp)`` of its DP rank's; ``dp-rank``: one student DP rank;
    ``all-ranks``: the whole student)."""
    wire_to_teacher: dict[str, float] | None = None
    """Disaggregated: the student -> teacher token-id bytes per step by scope (``dp-rank``,
    ``all-ranks``: what ``kd_wire_bytes_to_teacher`` counts)."""


def plan_options(config: RunConfig, run: CheckedRun, on_cpu: bool,
                 teacher_tp: int | None = None, teacher_pp: int | None = None) -> PlanOptions:
    """The planner's options for the run (see the module docstring); ``teacher_tp`` /
    ``teacher_pp``: a disaggregated run's replica layout (None: not known)."""
    return _options(run_shape(config, run), on_cpu, teacher_tp, teacher_pp)


def _options(run: RunShape, on_cpu: bool, teacher_tp: int | None,
             teacher_pp: int | None) -> PlanOptions:
    param_bytes = 4 if run.fp32 else 2
    teacher_bytes = 4 if run.teacher_dtype == "fp32" else 2
    if run.teacher is not None and teacher_bytes != param_bytes:
        raise ValueError(
            f"--kd-teacher-dtype {run.teacher_dtype} with {'fp32' if run.fp32 else 'bf16'} "
            f"student parameters: the planner gives teacher and student one precision"
        )
    precision = Precision(param_bytes=param_bytes, grad_bytes=4,
                          optimizer_bytes=8 if run.fp32 else 12)
    activation = ActivationOptions(
        flash_attention=not on_cpu,
        fused_norm=not on_cpu,
        fused_swiglu=not on_cpu,
        fused_softmax=not on_cpu,
        hidden_dropout=run.hidden_dropout,
        attention_dropout=run.attention_dropout,
        activation_bytes=4 if run.fp32 else 2,
    )
    extra = {}
    tuning = CpuTuning.for_this_machine()  # what the loss works with on this CPU
    layout = run.layout
    if on_cpu and (layout.tp == 1 or tuning.blocks_with_tp):
        # the loss's elementwise work runs in cache-sized row blocks (CPU, no TP collectives)
        extra["loss_block_elements"] = tuning.block_elements
    if run.topk is not None:
        extra["topk"] = run.topk
        # On CPU the prefetcher's host queue is the device memory: D queued + 1 being decoded
        # + 1 in use (see memory.cache_reader_bytes); on a GPU only the one in use.
        extra["cache_resident_microbatches"] = run.prefetch_depth + 2 if on_cpu else 1
    gpu = GpuSpec(name="measured", memory_bytes=1 << 50, bf16_flops=1e12, nvlink_bytes_per_s=1e9)
    return PlanOptions(
        student=run.student,
        teacher=run.teacher if run.teacher is not None else run.student,
        gpu=gpu,
        inter_node_link=LinkSpec(name="measured", bytes_per_s=1e9),
        gpus_per_node=max(layout.world_size, teacher_tp or 1),
        nodes=1,
        seq_length=run.seq_length,
        micro_batch_size=run.micro_batch_size,
        global_batch_size=run.global_batch_size,
        tp=layout.tp,
        pp=layout.pp,
        vp=layout.vp,
        cp=layout.cp,
        recompute=layout.recompute,
        recompute_method=layout.recompute_method if layout.recompute == "full" else None,
        recompute_num_layers=(layout.recompute_num_layers if layout.recompute == "full"
                              else None),
        sequence_parallel=layout.sequence_parallel,
        use_distributed_optimizer=False,
        teacher_tp=teacher_tp,
        teacher_pp=teacher_pp,
        teacher_replicas=1 if run.kd_mode == "disaggregated" else None,
        wire_dtype=run.wire_dtype,
        window_size=run.window_size,
        loss_path=("cpu" if on_cpu else "gpu") if run.loss_path == "auto" else run.loss_path,
        loss_window_bytes=run.loss_window_bytes,
        loss_weight_grad=run.loss_weight_grad,
        prefetch_depth=run.prefetch_depth,
        hidden_elem_bytes=teacher_bytes,
        precision=precision,
        activation=activation,
        reserve_bytes=0,
        **extra,
    )


def predict(config: RunConfig, run: CheckedRun, on_cpu: bool) -> Prediction:
    """The planner's terms for the logging rank (student rank 0: stage 0, TP rank 0), and for a
    disaggregated run its wire bytes both ways."""
    return predict_shape(run_shape(config, run), on_cpu)


def predict_shape(shape: RunShape, on_cpu: bool) -> Prediction:
    """:func:`predict` for a run described by its :class:`RunShape` (a run not resolved from
    its flags: e.g. one whose checkpoints do not exist yet)."""
    opts = _options(shape, on_cpu, None, None)
    mode = shape.mode
    layout = shape.layout
    # a colocated teacher runs in the student's groups, context parallelism included
    teacher_layout = layout.colocated()
    colocated = mode is not None and mode.colocated
    # no teacher: the offline mode's terms, less its cache reader
    terms = student_stage_terms(opts, Mode.OFFLINE_CACHE if mode is None else mode, layout,
                                teacher_layout if colocated else None, 0)
    terms.pop(Term.RESERVE, None)
    if mode is None:
        terms.pop(Term.CACHE_READER, None)
    wire = to_teacher = None
    if mode is Mode.DISAGGREGATED:
        gbs, dp, s = shape.global_batch_size, layout.dp, shape.seq_length
        per_dp = traffic.hidden_bytes_per_step_per_dp_rank(opts.teacher, gbs, dp, s,
                                                          opts.wire_dtype)
        # a student rank receives 1/tp of its context-parallel rank's positions
        wire = {"tp-rank": per_dp / (layout.tp * layout.cp), "dp-rank": per_dp,
                "all-ranks": per_dp * dp}
        ids = traffic.token_bytes_per_step_per_dp_rank(gbs, dp, s)
        to_teacher = {"dp-rank": ids, "all-ranks": ids * dp}
    return Prediction(mode=mode, terms=terms, wire=wire, wire_to_teacher=to_teacher)


def predict_teacher(config: RunConfig, run: CheckedRun, on_cpu: bool, tp: int,
                    pp: int) -> dict[Term, float]:
    """The planner's terms for rank 0 of a disaggregated run's teacher replica (its stage 0,
    TP rank 0) with the replica's layout ``tp`` x ``pp`` (a replica has no data parallelism)."""
    opts = plan_options(config, run, on_cpu, teacher_tp=tp, teacher_pp=pp)
    terms = teacher_inference_terms(opts, ParallelLayout(tp=tp, pp=pp), 0)
    terms.pop(Term.RESERVE, None)
    return terms
