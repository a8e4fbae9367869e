"""The planner proposes exactly what the commands accept (a property test over the presets and a
grid of GPU counts; no process group).

For each plan, its launch lines are read back by the commands' own parsers: the student's flags
by ``megatron-kd train``'s, a disaggregated plan's replica by ``teacher serve``'s, an offline
plan's build by ``cache build``'s. The layout each command builds from its flags must be the
planned one and pass that command's own check (``check_run_layout``, ``check_replica_layout``,
``check_cache_layout``). Conversely, the layouts of the search space (enumerated here, by the
test, not by the planner) that the command's check accepts are exactly the planner's candidates:
none it refuses is proposed, none it accepts is left out.
"""

import argparse
import functools
import importlib
import itertools
import math
import shlex

import pytest

from megatron_kd.arch import Role
from megatron_kd.cli import SUBCOMMANDS
from megatron_kd.commands.cache_build import check_cache_layout
from megatron_kd.commands.teacher_serve import ServeConfig, check_replica_layout
from megatron_kd.flags import from_flags
from megatron_kd.parallel import ParallelLayout
from megatron_kd.planner.cli import DEFAULT_LINK
from megatron_kd.planner.launch import launch
from megatron_kd.planner.options import plan_all
from megatron_kd.planner.plan import Mode, PlanOptions
from megatron_kd.planner.presets import MODEL_PRESETS, get_gpu, get_link
from megatron_kd.planner.search import student_candidates, teacher_candidates
from megatron_kd.training.run_checks import check_run_layout
from megatron_kd.training.run_config import DataSection, ParallelSection, RunConfig

#: Teacher -> student pairs covering every preset (families share a tokenizer); gpt-oss-20b's
#: experts with biases do not train: the planner must refuse it as a student, as train does.
PAIRS = [("llama-3.1-8b", "llama-3.2-1b"), ("llama-3.1-8b", "llama-3.2-3b"),
         ("qwen3-32b", "qwen3-8b"), ("qwen3-235b-a22b", "qwen3-30b-a3b"),
         ("qwen3.5-35b-a3b", "qwen3.5-9b"), ("gpt-oss-120b", "gpt-oss-20b")]

#: (nodes, GPUs per node) of the grid; the largest MoE pair only on the smaller grids (its
#: search is the slowest: many expert-parallel sizes).
GRID = [(1, 1), (1, 2), (1, 4), (1, 8), (2, 8)]

#: Sequence parallelism as the planner is asked: searched (on with tp > 1), or refused (the
#: Gated DeltaNet and mixture-of-experts students then train at tp 1 only).
SEQUENCE_PARALLEL = [None, False]

SEQ, BATCH = 4096, 16


def _opts(teacher: str, student: str, nodes: int, gpus: int, sp, **more) -> PlanOptions:
    gpu = get_gpu("h100-80g")
    return PlanOptions(student=MODEL_PRESETS[student], teacher=MODEL_PRESETS[teacher], gpu=gpu,
                       inter_node_link=get_link(DEFAULT_LINK, gpu), gpus_per_node=gpus,
                       nodes=nodes, seq_length=SEQ, global_batch_size=BATCH,
                       sequence_parallel=sp, **more)


@functools.cache
def _parser(command: str, action: str | None = None) -> argparse.ArgumentParser:
    """A command's own parser (a sub-command's: ``teacher serve``, ``cache build``)."""
    parser = argparse.ArgumentParser(prog=command)
    importlib.import_module(SUBCOMMANDS[command][0]).add_arguments(parser)
    if action is None:
        return parser
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    chosen = sub.choices[action]
    chosen.format_help()  # a parser that adds its flags when first used (cache build)
    return chosen


#: Values for the shell variables of the launch lines that are not paths.
_VALUES = {"$TRAIN_ITERS": "10"}


def _tokens(tokens) -> list[str]:
    """Launch tokens with the shell variables the user sets given values."""
    return [_VALUES.get(t, t.replace("$", "")) for t in tokens]


def _grid():
    for (teacher, student), (nodes, gpus), sp in itertools.product(PAIRS, GRID,
                                                                    SEQUENCE_PARALLEL):
        if student == "qwen3-30b-a3b" and (nodes, gpus, sp) not in ((1, 2, None), (1, 2, False),
                                                                    (1, 4, False)):
            continue
        yield pytest.param(teacher, student, nodes, gpus, sp,
                           id=f"{student}-{nodes}x{gpus}-sp{sp}")


@pytest.mark.parametrize("teacher, student, nodes, gpus, sp", list(_grid()))
def test_the_planned_launch_is_what_the_commands_accept(teacher, student, nodes, gpus, sp):
    opts = _opts(teacher, student, nodes, gpus, sp)
    if student == "gpt-oss-20b":
        # train refuses it (experts with biases); the planner proposes nothing for it
        with pytest.raises(ValueError, match="--add-bias-linear"):
            plan_all(opts)
        return
    for mode, plan in plan_all(opts).plans.items():
        if mode is Mode.COLOCATED_DENSE:
            continue  # the incumbent dense loss, planned for comparison: no launch lines
        lines = launch(opts, plan)
        # the student's flags, read by megatron-kd train
        args = _parser("train").parse_args(_tokens(lines.student_flags + lines.data_flags))
        config = RunConfig.from_args(args)
        layout = config.parallel.layout(opts.world_size, opts.student.num_layers)
        assert layout == plan.layout, (mode, shlex.join(lines.student_flags))
        online = mode is not Mode.OFFLINE_CACHE
        check_run_layout(layout, opts.student.arch_at(layout.tp), kd_mode=config.kd.mode,
                         teacher_arch=opts.teacher.arch_at(layout.tp) if online else None,
                         seq_length=config.data.seq_length,
                         num_microbatches=BATCH // (config.optimizer.micro_batch_size
                                                    * layout.dp),
                         transformer_engine=True)
        if mode is Mode.DISAGGREGATED:  # the replica's flags, read by teacher serve
            serve = _parser("teacher", "serve").parse_args(
                _tokens(lines.teacher_command[3:]) + ["--kd-teacher-endpoint", "dir"])
            cfg = ServeConfig.from_args(serve)
            tl = plan.teacher_layout
            replica = cfg.parallel.layout(tl.tp * tl.pp * tl.cp, opts.teacher.num_layers)
            assert replica == tl, shlex.join(lines.teacher_command)
            check_replica_layout(opts.teacher.arch_at(tl.tp), replica, transformer_engine=True)
        if mode is Mode.OFFLINE_CACHE:  # the build's flags, read by cache build
            # as printed: the run's data flags and --train-iters included
            build = _parser("cache", "build").parse_args(_tokens(lines.teacher_command[3:]))
            assert from_flags(DataSection, build) == config.data, shlex.join(
                lines.teacher_command)
            # the build's own section of the flags, as cache build reads them
            cache = from_flags(ParallelSection, build).layout(opts.world_size,
                                                              opts.teacher.num_layers)
            check_cache_layout(opts.teacher.arch_at(cache.tp), cache, seq_length=SEQ,
                               transformer_engine=True)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _student_space(opts: PlanOptions, mode: Mode):
    """Every student layout of the planner's search space, enumerated here: tensor parallelism
    inside a node, any pipeline, virtual stages, context parallelism and expert split of the
    GPUs, the options' sequence parallelism and recompute (given: none), whole data-parallel
    micro-batches."""
    model = opts.student
    models = [model] + ([opts.teacher] if mode.colocated else [])
    experts = [m.num_experts for m in models if m.is_moe]
    world = opts.world_size
    for t in _divisors(opts.gpus_per_node):
        for p, c in itertools.product(_divisors(world), _divisors(world)):
            if world % (t * p * c):
                continue
            dp = world // (t * p * c)
            if opts.global_batch_size % (opts.micro_batch_size * dp):
                continue
            for v, e in itertools.product(range(1, model.num_layers + 1),
                                          _divisors(math.gcd(*experts)) if experts else [1]):
                try:
                    yield ParallelLayout(
                        tp=t, pp=p, vp=v, cp=c, dp=dp, ep=e,
                        etp=opts.etp if experts else None,
                        sequence_parallel=(t > 1) if opts.sequence_parallel is None
                        else opts.sequence_parallel,
                        use_distributed_optimizer=dp > 1, cp_comm_type="p2p")
                except ValueError:
                    continue  # not a layout at all (virtual stages without a pipeline, ...)


def _accepted_by_train(opts: PlanOptions, mode: Mode, layout: ParallelLayout) -> bool:
    try:
        check_run_layout(layout, opts.student.arch_at(layout.tp),
                         kd_mode="colocated" if mode.colocated else "offline",
                         teacher_arch=opts.teacher.arch_at(layout.tp) if mode.colocated
                         else None, seq_length=opts.seq_length,
                         num_microbatches=opts.global_batch_size // (opts.micro_batch_size
                                                                     * layout.dp),
                         transformer_engine=True)
    except ValueError:
        return False
    return True


@pytest.mark.parametrize("teacher, student, gpus, sp", [
    ("llama-3.1-8b", "llama-3.2-1b", 8, None),
    ("qwen3-32b", "qwen3-8b", 8, False),
    ("qwen3.5-35b-a3b", "qwen3.5-9b", 8, None),
    # the DeltaNet student without sequence parallelism: tp 1 only (train refuses tp > 1)
    ("qwen3.5-35b-a3b", "qwen3.5-9b", 8, False),
    ("qwen3-235b-a22b", "qwen3-30b-a3b", 4, None),
    ("gpt-oss-120b", "gpt-oss-20b", 8, None),
])
@pytest.mark.parametrize("mode", [Mode.COLOCATED_FUSED, Mode.OFFLINE_CACHE])
def test_the_candidates_are_the_layouts_train_accepts(teacher, student, gpus, sp, mode):
    opts = _opts(teacher, student, 1, gpus, sp, recompute="none")
    accepted = {lay for lay in _student_space(opts, mode) if _accepted_by_train(opts, mode, lay)}
    try:
        candidates = set(student_candidates(opts, mode))
    except ValueError:
        candidates = set()  # none valid: the planner says so
    assert candidates == accepted, (sorted(map(str, candidates - accepted))[:3],
                                    sorted(map(str, accepted - candidates))[:3])


@pytest.mark.parametrize("teacher", sorted(MODEL_PRESETS))
@pytest.mark.parametrize("role", [Role.TEACHER_REPLICA, Role.CACHE_TEACHER])
def test_teacher_candidates_are_the_layouts_serve_and_cache_build_accept(teacher, role):
    opts = _opts(teacher, "llama-3.2-1b", 1, 8, None)
    model = opts.teacher
    accepted = set()
    pps = [1] if role is Role.CACHE_TEACHER else range(1, min(model.num_layers, 16) + 1)
    for t, p, e in itertools.product(_divisors(8), pps,
                                     _divisors(model.num_experts) if model.is_moe else [1]):
        try:
            layout = ParallelLayout(tp=t, pp=p, ep=e, etp=1 if model.is_moe else None,
                                    sequence_parallel=t > 1)
            if role is Role.TEACHER_REPLICA:
                check_replica_layout(model.arch_at(t), layout, transformer_engine=True)
            else:
                check_cache_layout(model.arch_at(t), layout, seq_length=SEQ,
                                   transformer_engine=True)
        except ValueError:
            continue
        accepted.add(layout)
    assert set(teacher_candidates(opts, role)) == accepted


def _printed_line(text: str, section: str, heading: str) -> list[str]:
    """The line under ``heading`` in the ``== section`` part of the text report, as a user
    copies it (the shell's words)."""
    part = text.split(f"== {section}:")[1].split("\n== ")[0].splitlines()
    at = next(i for i, line in enumerate(part) if line.strip().startswith(heading))
    return shlex.split(part[at + 1])


def test_the_printed_cache_build_line_is_complete(capsys):
    """The offline plan's printed ``cache build`` line, its shell variables set, parses with
    ``cache build``'s own parser and nothing added (``--train-iters`` and the data flags are
    there), and reads the very data section the printed ``train`` line gives ``train`` (also
    parsed as printed: the student's model is there too): the cache covers the student's
    samples."""
    from megatron_kd.cli import main

    assert main(["plan", "--teacher", "qwen3.5-35b-a3b", "--student", "qwen3.5-9b", "--gpu",
                 "h200-141g", "--nodes", "1", "--seq-length", "8192",
                 "--use-distributed-optimizer", "--modes", "offline-cache"]) == 0
    text = capsys.readouterr().out
    build = _tokens(_printed_line(text, "offline-cache", "the teacher job:"))
    assert build[:3] == ["megatron-kd", "cache", "build"], build
    cache = _parser("cache", "build").parse_args(build[3:])
    student = _tokens(_printed_line(text, "offline-cache", "launch, `megatron-kd train`'s"))
    run = RunConfig.from_args(_parser("train").parse_args(student))
    data = run.data
    assert run.logging.pretrained_checkpoint == "STUDENT_CKPT"
    assert from_flags(DataSection, cache) == data
    assert (data.data_path, data.tokenizer_model, data.train_iters) == (
        ["DATA_PREFIX"], "HF_TOKENIZER", 10)
    # the Slurm line writes the same flags to the build's args file
    slurm = next(line for line in text.splitlines() if "> cache.args" in line)
    assert shlex.split(slurm)[2:shlex.split(slurm).index(">")] == \
        _printed_line(text, "offline-cache", "the teacher job:")[3:]
