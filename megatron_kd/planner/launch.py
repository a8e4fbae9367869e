"""A plan as launch lines (pure Python, no torch): the flags of the student's run, the teacher
job's (a ``teacher serve`` replica, or the ``cache build`` of the offline cache) and the
``sbatch`` lines of ``examples/slurm/`` that start them, for one mode's plan.

The student's flags are the layout, batch, precision and ``--kd-*`` flags, in Megatron-LM's
spelling: ``megatron-kd train`` and the patched ``pretrain_gpt.py`` both take them, beside the
model's flags (``megatron_lm_flags.txt`` of an imported checkpoint, or ``--pretrained-checkpoint``
for ``megatron-kd train``: :data:`MODEL_FLAGS`) and the data's (:data:`DATA_FLAGS`, the same in
the cache build's line: the cache covers exactly the samples the student reads). The lines for
``megatron-kd train`` and ``cache build`` are complete as printed. Paths and counts the plan
cannot know are shell variables the user sets: ``$TEACHER_CKPT`` (the teacher as ``megatron-kd
import-hf`` wrote it; the planned teacher's path when it was given as a checkpoint directory),
``$STUDENT_CKPT``, ``$KD_TEACHER_ENDPOINT``, ``$KD_CACHE_DIR``, ``$DATA_PREFIX`` (the indexed
dataset), ``$HF_TOKENIZER`` and ``$TRAIN_ITERS``.

The colocated-dense mode is the incumbent dense loss, planned for comparison: megatron-kd runs
the fused loss (colocated-fused), so that mode has no launch lines.

Several teachers (:mod:`.mixture`, :func:`mixture_launch`): the student's flags with one value per
teacher of the per-teacher flags, and a ``teacher serve`` or ``cache build`` line per served or
cached teacher, its variables numbered by teacher (``$TEACHER_CKPT_1``, ...); no ``sbatch`` lines
(the Slurm scripts of ``examples/slurm/`` start one teacher job).
"""

from __future__ import annotations

import math
import os
import shlex
from dataclasses import dataclass

from megatron_kd.arch import Role
from megatron_kd.arch.megatron_lm_args import megatron_lm_flags
from megatron_kd.planner.memory import GpuLoss, ParallelLayout
from megatron_kd.planner.mixture import MixtureOptions, MixturePlan
from megatron_kd.planner.plan import Mode, ModePlan, PlanOptions
from megatron_kd.planner.search import search_teacher

#: Replicas a node may hold in one ``teacher.sbatch`` job: a rendezvous port each of the job's
#: eight (examples/slurm/kd_env.sh).
REPLICAS_PER_NODE_MAX = 8

#: The data flags of the student's line and of the cache build, as one set: the cache covers
#: exactly the samples the student reads, and a run of other data flags is refused. Shell
#: variables the user sets, the names ``megatron_lm.sbatch``'s line gives them too; the sequence
#: length and the global batch, the other data flags, are the plan's own.
DATA_FLAGS = ("--data-path", "$DATA_PREFIX", "--tokenizer-model", "$HF_TOKENIZER",
              "--train-iters", "$TRAIN_ITERS")

#: The student's model for ``megatron-kd train``: its weights and architecture from the
#: checkpoint ``import-hf`` wrote (``pretrain_gpt.py`` takes the model's flags instead: the
#: ``megatron_lm.sbatch`` line's ``STUDENT``).
MODEL_FLAGS = ("--pretrained-checkpoint", "$STUDENT_CKPT")

#: The ``megatron_lm.sbatch`` driver script of each mode (examples/megatron_lm/).
_MEGATRON_LM_SCRIPT = {
    Mode.COLOCATED_FUSED: "train_kd_colocated.sh",
    Mode.OFFLINE_CACHE: "train_kd_offline.sh",
    Mode.DISAGGREGATED: "train_kd_disaggregated.sh",
}


@dataclass(frozen=True, kw_only=True)
class Launch:
    """How to start one mode's plan."""

    student_flags: tuple[str, ...]
    """The student run's layout, batch, precision and ``--kd-*`` flags (Megatron-LM spelling)."""

    data_flags: tuple[str, ...] = DATA_FLAGS
    """The data's flags, the student's and the cache build's alike (:data:`DATA_FLAGS`)."""

    model_flags: tuple[str, ...] = MODEL_FLAGS
    """The student's model for ``megatron-kd train`` (:data:`MODEL_FLAGS`)."""

    teacher_command: tuple[str, ...] = ()
    """``megatron-kd teacher serve ...`` (disaggregated) or ``megatron-kd cache build ...``
    (offline), with its flags; empty when the teacher runs inside the student's job."""

    sbatch: tuple[str, ...] = ()
    """Shell lines, in order: the teacher job's (with its flags written to a file first), then
    the student's with ``megatron-kd train``, then the same with ``pretrain_gpt.py``."""

    def to_dict(self) -> dict:
        return {
            **_student_dict(self),
            "teacher_command": list(self.teacher_command),
            "teacher_command_text": shell_join(self.teacher_command),
            "sbatch": list(self.sbatch),
        }

    def lines(self) -> list[str]:
        """The launch as the text report prints it."""
        out = _student_lines(self)
        if self.teacher_command:
            out += ["the teacher job:", f"  {shell_join(self.teacher_command)}"]
        out.append("on Slurm (examples/slurm/):")
        out += [f"  {line}" for line in self.sbatch]
        return out


def launch(opts: PlanOptions, plan: ModePlan) -> Launch | None:
    """The launch lines of ``plan``; None for the colocated-dense comparison."""
    if plan.mode is Mode.COLOCATED_DENSE:
        return None
    teacher = _teacher_path(opts)
    student = student_flags(opts, plan, teacher)
    teacher_command: tuple[str, ...] = ()
    sbatch: list[str] = []
    gpn = opts.gpus_per_node
    shape = f"--nodes={opts.nodes} --ntasks-per-node={gpn} --gpus-per-node={gpn}"
    if plan.mode is Mode.DISAGGREGATED and plan.teacher_layout is not None:
        teacher_command = _serve_command(opts, plan.teacher_layout, teacher)
        replicas, nodes, per_node = teacher_job_shape(
            plan.teacher_replicas, _ranks(plan.teacher_layout), gpn)
        sbatch += [
            f"printf '%s\\n' {shell_join(teacher_command[3:])} > teacher.args",
            f"KD_ARGS_FILE=$PWD/teacher.args KD_TEACHER_REPLICAS={replicas} "
            f"KD_TEACHER_ENDPOINT=$KD_TEACHER_ENDPOINT sbatch --nodes={nodes} "
            f"--ntasks-per-node={per_node} --gpus-per-node={per_node} "
            f"examples/slurm/teacher.sbatch",
        ]
    elif plan.mode is Mode.OFFLINE_CACHE:
        teacher_command, fits = _cache_command(opts, teacher)
        if not fits:
            sbatch.append(f"# cache build: no copy of {opts.teacher.name} without a pipeline "
                          f"fits a node's GPUs (the build runs none); the command below is the "
                          f"layout of least memory")
        sbatch += [
            f"printf '%s\\n' {shell_join(teacher_command[3:])} > cache.args",
            f"KD_ARGS_FILE=$PWD/cache.args KD_CACHE_DIR=$KD_CACHE_DIR sbatch {shape} "
            f"examples/slurm/cache_build.sbatch",
        ]
    script = "disaggregated.sbatch" if plan.mode is Mode.DISAGGREGATED else "colocated.sbatch"
    endpoint = ("KD_TEACHER_ENDPOINT=$KD_TEACHER_ENDPOINT "
                if plan.mode is Mode.DISAGGREGATED else "")
    sbatch += [
        f"printf '%s\\n' {shell_join(student + MODEL_FLAGS + DATA_FLAGS)} > student.args",
        f"KD_ARGS_FILE=$PWD/student.args {endpoint}sbatch {shape} examples/slurm/{script}",
        _megatron_lm_line(opts, plan, endpoint),
    ]
    return Launch(student_flags=student, teacher_command=teacher_command, sbatch=tuple(sbatch))


def student_flags(opts: PlanOptions, plan: ModePlan, teacher: str = "$TEACHER_CKPT"
                  ) -> tuple[str, ...]:
    """The student run's flags of ``plan`` (see the module docstring)."""
    layout = plan.layout
    flags = [*_layout_flags(layout, experts=_has_experts(opts, plan),
                            num_layers=opts.student.num_layers),
             "--micro-batch-size", str(opts.micro_batch_size),
             "--global-batch-size", str(opts.global_batch_size),
             "--seq-length", str(opts.seq_length), "--bf16"]
    if plan.mode is Mode.OFFLINE_CACHE:
        flags += ["--kd-mode", "offline", "--kd-topk-cache", "$KD_CACHE_DIR"]
    else:
        flags += ["--kd-mode", "colocated" if plan.mode.colocated else "disaggregated",
                  "--kd-teacher-load", teacher, "--kd-teacher-dtype", "bf16"]
    if plan.mode is Mode.DISAGGREGATED:
        flags += ["--kd-teacher-endpoint", "$KD_TEACHER_ENDPOINT",
                  "--kd-wire-dtype", opts.wire_dtype,
                  "--kd-prefetch-depth", str(opts.prefetch_depth)]
    return tuple(flags + _loss_flags(opts))


def _loss_flags(opts: PlanOptions) -> list[str]:
    """The loss's flags of ``opts``: its window bound, and the GPU path's settings where they
    are not the defaults."""
    flags = []
    if opts.window_size is not None:
        flags += ["--kd-window-size", str(opts.window_size)]
    gpu, default = opts.gpu_loss, GpuLoss()
    if gpu is not None:
        if gpu.window_bytes != default.window_bytes:
            flags += ["--kd-loss-window-mib", f"{gpu.window_bytes / (1 << 20):g}"]
        if gpu.weight_grad != default.weight_grad:
            flags += ["--kd-loss-weight-grad", gpu.weight_grad]
    return flags


def _layout_flags(layout: ParallelLayout, *, experts: bool, num_layers: int) -> list[str]:
    """The layout's flags (Megatron-LM's spelling) for a model of ``num_layers`` layers;
    ``experts``: a model of the groups has experts (their sizes are given, the expert-tensor
    size always: Megatron's default is the tensor-parallel size, the plan's is its own)."""
    flags = ["--tensor-model-parallel-size", str(layout.tp),
             "--pipeline-model-parallel-size", str(layout.pp)]
    if layout.vp > 1:
        flags += ["--num-layers-per-virtual-pipeline-stage",
                  str(num_layers // (layout.pp * layout.vp))]
    if layout.sequence_parallel:
        flags.append("--sequence-parallel")
    if layout.cp > 1:
        flags += ["--context-parallel-size", str(layout.cp)]
        if layout.cp_comm_type != "p2p":
            flags += ["--cp-comm-type", layout.cp_comm_type]
    if experts:
        flags += ["--expert-model-parallel-size", str(layout.ep), "--expert-tensor-parallel-size",
                  str(layout.expert_tp)]
    if layout.recompute == "selective":
        flags += ["--recompute-granularity", "selective"]
    elif layout.recompute == "full":
        flags += ["--recompute-granularity", "full", "--recompute-method",
                  layout.recompute_method, "--recompute-num-layers",
                  str(layout.recompute_num_layers)]
    if layout.use_distributed_optimizer:
        flags.append("--use-distributed-optimizer")
    return flags


def _has_experts(opts: PlanOptions, plan: ModePlan) -> bool:
    """Whether a model of the student's groups has experts: the student, or a colocated
    teacher (it runs in the student's expert groups)."""
    return opts.student.is_moe or (plan.mode.colocated and opts.teacher.is_moe)


def _ranks(layout: ParallelLayout) -> int:
    return layout.tp * layout.pp * layout.dp


def teacher_job_shape(replicas: int, ranks: int, gpus_per_node: int) -> tuple[int, int, int]:
    """``(replicas, nodes, tasks per node)`` of one ``teacher.sbatch`` job holding at least
    ``replicas`` replicas of ``ranks`` ranks each: replicas packed into nodes when one fits a
    node (whole nodes: the count rounds up to fill them), else each over whole nodes."""
    if ranks <= gpus_per_node:
        per_node = min(gpus_per_node // ranks, REPLICAS_PER_NODE_MAX)
        if replicas <= per_node:
            return replicas, 1, replicas * ranks
        nodes = math.ceil(replicas / per_node)
        return nodes * per_node, nodes, per_node * ranks
    if ranks % gpus_per_node:
        raise ValueError(f"a teacher replica of {ranks} ranks is not whole nodes of "
                         f"{gpus_per_node} GPUs")
    return replicas, replicas * ranks // gpus_per_node, gpus_per_node


def _serve_command(opts: PlanOptions, layout: ParallelLayout, teacher: str) -> tuple[str, ...]:
    flags = ["megatron-kd", "teacher", "serve", "--kd-teacher-load", teacher,
             *_layout_flags(layout, experts=opts.teacher.is_moe,
                            num_layers=opts.teacher.num_layers),
             "--max-seq-length", str(opts.seq_length), "--kd-teacher-dtype", "bf16"]
    return tuple(flags)


def _cache_command(opts: PlanOptions, teacher: str) -> tuple[tuple[str, ...], bool]:
    """``cache build`` with the smallest copy of the teacher without a pipeline (the build runs
    none) that fits, and whether one fits."""
    layout, _, fits = search_teacher(opts, Role.CACHE_TEACHER)
    flags = ["megatron-kd", "cache", "build", "--kd-teacher-load", teacher,
             *_without(_layout_flags(layout, experts=opts.teacher.is_moe,
                                     num_layers=opts.teacher.num_layers),
                       {"--pipeline-model-parallel-size"}),  # the build runs no pipeline
             "--kd-topk", str(opts.topk), "--seq-length", str(opts.seq_length),
             "--micro-batch-size", str(opts.micro_batch_size),
             "--global-batch-size", str(opts.global_batch_size),
             "--kd-teacher-dtype", "bf16", "--out", "$KD_CACHE_DIR", *DATA_FLAGS]
    return tuple(flags), fits


def _megatron_lm_line(opts: PlanOptions, plan: ModePlan, endpoint: str) -> str:
    """The student with the patched ``pretrain_gpt.py``: the driver script's own variables for
    the layout and batch (it derives the vocabulary padding from ``TP``), the rest appended; a
    comment saying why where Megatron-LM's GPT flags cannot build the student."""
    try:
        megatron_lm_flags(opts.student.arch)
    except ValueError as exc:
        return f"# pretrain_gpt.py: not for {opts.student.name}: {exc}"
    layout = plan.layout
    env = [f"TP={layout.tp}", f"PP={layout.pp}", f"CP={layout.cp}"]
    if layout.vp > 1:
        env.append(f"VP_LAYERS={opts.student.num_layers // (layout.pp * layout.vp)}")
    env += [f"SEQ_LENGTH={opts.seq_length}", f"MICRO_BATCH={opts.micro_batch_size}",
            f"GLOBAL_BATCH={opts.global_batch_size}", "TRAIN_ITERS=$TRAIN_ITERS"]
    extra = _without(_layout_flags(layout, experts=_has_experts(opts, plan),
                                   num_layers=opts.student.num_layers),
                     {"--tensor-model-parallel-size", "--pipeline-model-parallel-size",
                      "--context-parallel-size", "--num-layers-per-virtual-pipeline-stage",
                      "--sequence-parallel"})
    script = _MEGATRON_LM_SCRIPT[plan.mode]
    source = "$KD_CACHE_DIR" if plan.mode is Mode.OFFLINE_CACHE else "$TEACHER_CKPT"
    return (f"MEGATRON_LM_DIR=$MEGATRON_LM_DIR STUDENT=$STUDENT_CKPT {' '.join(env)} "
            f"{endpoint}KD_MEGATRON_LM_SCRIPT={script} "
            f"KD_EXTRA_ARGS={shlex.quote(' '.join(extra))} "
            f"KD_MEGATRON_LM_ARGS=\"$RUN_DIR $TB_DIR {source} $DATA_PREFIX $HF_TOKENIZER\" "
            f"sbatch --nodes={opts.nodes} --gpus-per-node={opts.gpus_per_node} "
            f"examples/slurm/megatron_lm.sbatch")


def _without(flags: list[str], names: set[str]) -> list[str]:
    """``flags`` less the flags ``names`` and their values."""
    out: list[str] = []
    skipping = False
    for token in flags:
        if token.startswith("--"):
            skipping = token in names
        if not skipping:
            out.append(token)
    return out


def shell_join(tokens) -> str:
    """``tokens`` as one shell line: ``$NAME`` tokens double-quoted (the shell expands them),
    the rest quoted as needed."""
    return " ".join(f'"{t}"' if t.startswith("$") and t[1:].isidentifier() else shlex.quote(t)
                    for t in tokens)


def _teacher_path(opts: PlanOptions, variable: str = "$TEACHER_CKPT") -> str:
    """The teacher's checkpoint: the planned path when it is a directory, else ``variable``."""
    name = opts.teacher.name
    return name if os.path.isdir(name) else variable


# --- several teachers ---------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class MixtureLaunch:
    """How to start a mixture's plan: the student's ``megatron-kd train`` flags and one teacher
    job per served teacher (``teacher serve``) and per cached teacher (``cache build``)."""

    student_flags: tuple[str, ...]
    data_flags: tuple[str, ...] = DATA_FLAGS
    model_flags: tuple[str, ...] = MODEL_FLAGS
    teacher_jobs: tuple[tuple[int, tuple[str, ...]], ...] = ()
    """``(teacher, command)``: ``teacher serve ...`` or ``cache build ...`` of each served or
    cached teacher, in teacher order (a colocated teacher runs in the student's job)."""

    def to_dict(self) -> dict:
        return {
            **_student_dict(self),
            "teacher_commands": [{"teacher": i, "command": list(c),
                                  "command_text": shell_join(c)}
                                 for i, c in self.teacher_jobs],
        }

    def lines(self) -> list[str]:
        out = _student_lines(self)
        for i, command in self.teacher_jobs:
            out += [f"teacher {i}'s job:", f"  {shell_join(command)}"]
        return out


def _student_dict(launch: Launch | MixtureLaunch) -> dict:
    """The student's part of a launch's JSON: its flags, the data's and the model's."""
    return {"student_flags": list(launch.student_flags),
            "student_flags_text": shell_join(launch.student_flags),
            "data_flags": list(launch.data_flags), "model_flags": list(launch.model_flags)}


def _student_lines(launch: Launch | MixtureLaunch) -> list[str]:
    """The student's part of a launch's text: ``megatron-kd train``'s flags."""
    return ["launch, `megatron-kd train`'s flags (the student's, the model's, the data's):",
            f"  {shell_join(launch.student_flags + launch.model_flags + launch.data_flags)}"]


def mixture_launch(mopts: MixtureOptions, plan: MixturePlan) -> MixtureLaunch:
    """The launch lines of a mixture's plan (:mod:`.mixture`): ``--kd-mode`` one mode per
    teacher, ``--kd-teacher-load`` one checkpoint per colocated or disaggregated teacher,
    ``--kd-teacher-endpoint`` one per disaggregated teacher, ``--kd-topk-cache`` one per offline
    teacher, ``--kd-teacher-weights`` as given; the shell variables of teacher ``i`` are
    ``$TEACHER_CKPT_i``, ``$KD_TEACHER_ENDPOINT_i``, ``$KD_CACHE_DIR_i``."""
    opts, modes = mopts.base, mopts.modes
    paths = [_teacher_path(mopts.teacher_options(i), f"$TEACHER_CKPT_{i}")
             for i in range(len(modes))]
    loaded = [i for i, m in enumerate(modes) if m != "offline"]
    served = [i for i, m in enumerate(modes) if m == "disaggregated"]
    cached = [i for i, m in enumerate(modes) if m == "offline"]
    experts = opts.student.is_moe or any(mopts.teachers[i].is_moe for i, m in enumerate(modes)
                                         if m == "colocated")
    flags = [*_layout_flags(plan.layout, experts=experts, num_layers=opts.student.num_layers),
             "--micro-batch-size", str(opts.micro_batch_size),
             "--global-batch-size", str(opts.global_batch_size),
             "--seq-length", str(opts.seq_length), "--bf16", "--kd-mode", *modes]
    if loaded:
        flags += ["--kd-teacher-load", *(paths[i] for i in loaded), "--kd-teacher-dtype", "bf16"]
    if served:
        flags += ["--kd-teacher-endpoint", *(f"$KD_TEACHER_ENDPOINT_{i}" for i in served),
                  "--kd-wire-dtype", opts.wire_dtype,
                  "--kd-prefetch-depth", str(opts.prefetch_depth)]
    if cached:
        flags += ["--kd-topk-cache", *(f"$KD_CACHE_DIR_{i}" for i in cached)]
    if mopts.weights is not None:
        flags += ["--kd-teacher-weights", *(f"{w:g}" for w in mopts.weights)]
    flags += _loss_flags(opts)
    jobs = []
    for i, teacher in enumerate(plan.teachers):
        if teacher.mode == "disaggregated":
            jobs.append((i, _serve_command(mopts.teacher_options(i), teacher.teacher_layout,
                                           paths[i])))
        elif teacher.mode == "offline":
            command, _ = _cache_command(mopts.teacher_options(i), paths[i])
            jobs.append((i, tuple(f"$KD_CACHE_DIR_{i}" if t == "$KD_CACHE_DIR" else t
                                  for t in command)))
    return MixtureLaunch(student_flags=tuple(flags), teacher_jobs=tuple(jobs))
