"""The typed run configuration and the flags made from it (no process group)."""

import argparse
import dataclasses
import importlib
import re

import pytest

from megatron_kd.cli import SUBCOMMANDS
from megatron_kd.commands import cache as cache_command
from megatron_kd.commands import teacher_serve
from megatron_kd.flags import Flag, add_flags, default_of, flag, from_flags
from megatron_kd.loss import GpuTuning, KDLossConfig
from megatron_kd.modes.args import GPU_LOSS_FLAGS, LOSS_FLAGS, KDArgs, add_kd_args
from megatron_kd.planner.plan import PlanOptions
from megatron_kd.training.metrics import MetricsSection
from megatron_kd.training.run_config import (
    ArchitectureSection,
    DataSection,
    KernelSection,
    LoggingSection,
    OptimizerSection,
    ParallelSection,
    RunConfig,
    parse_args,
)

MINIMAL = ["--num-layers", "2", "--hidden-size", "8", "--num-attention-heads", "2",
           "--seq-length", "16", "--micro-batch-size", "1", "--train-iters", "3",
           "--mock-data", "--vocab-size", "100", "--kd-weight", "0", "--kd-ce-weight", "1"]
SECTIONS = (ArchitectureSection, ParallelSection, KernelSection, OptimizerSection, DataSection,
            LoggingSection, MetricsSection)


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Example:
    count: int = flag(3, "how many")
    name: str | None = flag(None, name="--the-name", metavar="N")
    on: bool = flag(False, "a switch", group="switches")
    needed: int = flag(type=int)
    plain: float = 0.5  # not a flag


def test_flags_take_the_fields_defaults():
    parser = argparse.ArgumentParser()
    add_flags(parser, _Example, title="example")
    args = parser.parse_args(["--needed", "7"])
    assert vars(args) == {"count": 3, "the_name": None, "on": False, "needed": 7}
    built = from_flags(_Example, args)
    assert built == _Example(needed=7)
    assert from_flags(_Example, parser.parse_args(["--needed", "1", "--the-name", "x", "--on",
                                                   "--count", "5"])) == \
        _Example(count=5, name="x", on=True, needed=1)
    with pytest.raises(SystemExit):  # a field without a default is a required flag
        parser.parse_args([])
    assert default_of(_Example, "plain") == 0.5 and default_of(_Example, "needed") is \
        dataclasses.MISSING


def test_flags_of_a_foreign_dataclass_keep_its_defaults():
    parser = argparse.ArgumentParser()
    add_flags(parser, KDLossConfig, specs=LOSS_FLAGS)
    args = parser.parse_args([])
    loss = from_flags(KDLossConfig, args, specs=LOSS_FLAGS)
    assert loss == KDLossConfig()
    assert args.kd_temperature == default_of(KDLossConfig, "temperature")


def test_every_train_flag_is_one_field_of_one_section():
    args = parse_args(MINIMAL)
    owners: dict[str, list[str]] = {}
    for section in SECTIONS + (KDArgs,):
        for f in dataclasses.fields(section):
            spec = f.metadata.get("megatron_kd.flag")
            if spec is not None:
                owners.setdefault(spec.dest(f.name), []).append(section.__name__)
    for name, spec in LOSS_FLAGS.items():
        owners.setdefault(spec.dest(name), []).append("KDLossConfig")
    for name, spec in GPU_LOSS_FLAGS.items():
        owners.setdefault(spec.dest(name), []).append("GpuTuning")
    assert sorted(owners) == sorted(vars(args)), set(owners) ^ set(vars(args))
    assert {k: v for k, v in owners.items() if len(v) > 1} == {}


def test_each_loss_flag_lands_in_its_own_field():
    """Every loss flag given a value no other flag has and no default is: a swapped pair
    (``--kd-temperature`` read into ``beta``, say) fails here, where every fused == dense
    end-to-end test, fed one config on both sides, would pass."""
    flags = {"--kd-loss": "forward_kl", "--kd-temperature": "3.5", "--kd-beta": "0.3",
             "--kd-weight": "0.7", "--kd-ce-weight": "0.2", "--kd-window-size": "17",
             "--kd-loss-elementwise": "compiled", "--kd-loss-path": "cpu",
             "--kd-loss-gpu-kernels": "eager", "--kd-loss-window-mib": "3",
             "--kd-loss-weight-grad": "input_dtype"}
    argv = MINIMAL[:-4] + ["--kd-teacher-load", "t"] + [x for kv in flags.items() for x in kv]
    loss = RunConfig.from_args(parse_args(argv)).kd.loss
    assert (loss.kind, loss.temperature, loss.beta, loss.kd_weight, loss.ce_weight,
            loss.window_size, loss.elementwise, loss.path) == (
        "forward_kl", 3.5, 0.3, 0.7, 0.2, 17, "compiled", "cpu")
    assert loss.gpu_tuning == GpuTuning(kernels="eager", window_bytes=3 << 20,
                                        weight_grad="input_dtype")
    names = {spec.option(n) for n, spec in (*LOSS_FLAGS.items(), *GPU_LOSS_FLAGS.items())}
    assert names - {"--kd-topk-tail"} == set(flags)  # every loss flag is in this test


# Every KDArgs flag and --kd-topk-tail given a value no other flag has and no default is. The
# modes constrain which flags go together (disaggregated needs an endpoint and a teacher;
# offline needs a cache, refuses a teacher and takes --kd-topk-tail), so two parses: together
# they give every such flag a non-default value, each parse its own.
_KD_DISAGGREGATED = {"--kd-mode": "disaggregated", "--kd-teacher-load": "/pin/teacher-load",
                     "--kd-teacher-args": "/pin/teacher-args.txt", "--kd-teacher-dtype": "bf16",
                     "--kd-teacher-endpoint": "/pin/endpoint", "--kd-teacher-timeout": "37.5",
                     "--kd-wire-dtype": "fp8", "--kd-prefetch-depth": "3",
                     "--kd-teacher-weights": "2.5"}
_KD_OFFLINE = {"--kd-mode": "offline", "--kd-topk-cache": "/pin/topk-cache",
               "--kd-topk-tail": "ghost", "--kd-prefetch-depth": "5"}


def _kd_parse_train(flags: dict) -> KDArgs:
    """``megatron-kd train``'s parser."""
    argv = MINIMAL[:-4] + [x for kv in flags.items() for x in kv]
    return RunConfig.from_args(parse_args(argv)).kd


def _kd_parse_megatron_lm(flags: dict) -> KDArgs:
    """A bare parser given the flags as Megatron-LM's ``extra_args_provider`` adds them."""
    parser = argparse.ArgumentParser(allow_abbrev=False)
    add_kd_args(parser)
    return KDArgs.from_args(parser.parse_args([x for kv in flags.items() for x in kv]))


@pytest.mark.parametrize("parse", [_kd_parse_train, _kd_parse_megatron_lm])
def test_each_kd_flag_lands_in_its_own_field(parse):
    """A swapped pair (``--kd-teacher-load`` read into ``teacher_endpoint``, say) or a flag
    read into nothing fails here; the end-to-end runs of a mode would mostly not notice."""
    dis = parse(_KD_DISAGGREGATED)
    assert (dis.mode, dis.teacher_load, dis.teacher_args, dis.teacher_dtype,
            dis.teacher_endpoint, dis.teacher_timeout, dis.wire_dtype, dis.prefetch_depth,
            dis.topk_cache, dis.loss.topk_tail) == (
        "disaggregated", "/pin/teacher-load", "/pin/teacher-args.txt", "bf16", "/pin/endpoint",
        37.5, "fp8", 3, None, "renormalize")
    assert dis.teacher_weights == (2.5,) and dis.weights == (1.0,)  # one teacher: all of it
    off = parse(_KD_OFFLINE)
    assert (off.mode, off.teacher_load, off.teacher_args, off.teacher_dtype,
            off.teacher_endpoint, off.teacher_timeout, off.wire_dtype, off.prefetch_depth,
            off.topk_cache, off.loss.topk_tail) == (
        "offline", None, None, "fp32", None, 600.0, None, 5, "/pin/topk-cache", "ghost")
    assert off.teacher_weights is None and off.extra_teachers == ()
    # the values given differ from every default (else a flag read into nothing would pass)
    default = KDArgs(teacher_load="t")
    assert (default.mode, default.teacher_args, default.teacher_dtype, default.teacher_endpoint,
            default.teacher_timeout, default.wire_dtype, default.prefetch_depth,
            default.topk_cache, default.loss.topk_tail) == (
        "colocated", None, "fp32", None, 600.0, None, 2, None, "renormalize")
    # --kd-topk-tail moved the loss's topk_tail and nothing else of it (the other loss flags
    # have their own pin above)
    assert dataclasses.replace(off.loss, topk_tail="renormalize") == dis.loss
    # every KDArgs flag, and --kd-topk-tail, is in this test
    kd_flags = {f.metadata["megatron_kd.flag"].option(f.name) for f in dataclasses.fields(KDArgs)
                if "megatron_kd.flag" in f.metadata}
    assert kd_flags | {LOSS_FLAGS["topk_tail"].option("topk_tail")} == \
        set(_KD_DISAGGREGATED) | set(_KD_OFFLINE)


def test_run_config_defaults_are_the_sections_defaults():
    config = RunConfig.from_args(parse_args(MINIMAL))
    assert config.optimizer == OptimizerSection(micro_batch_size=1)
    assert config.logging == LoggingSection() and config.metrics == MetricsSection()
    assert config.parallel == ParallelSection()
    assert config.data == DataSection(seq_length=16, train_iters=3, mock_data=True)
    assert config.kd.loss == KDLossConfig(kd_weight=0.0, ce_weight=1.0, gpu_tuning=GpuTuning())
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.data.seed = 1  # type: ignore[misc]


def test_cache_build_reads_the_runs_data_section():
    """``cache build`` and ``train`` share one data section: the same data flags give equal
    sections (a cache and a run agree by construction), and every section field is a flag of
    both."""
    data_flags = ["--seq-length", "16", "--train-iters", "3", "--global-batch-size", "4",
                  "--mock-data", "--seed", "7", "--eval-iters", "2"]
    parser = argparse.ArgumentParser()
    cache_command.add_arguments(parser)
    cache_args = parser.parse_args(["build", "--out", "o", "--kd-teacher-load", "t",
                                    *data_flags])
    train_args = parse_args(MINIMAL[:6] + ["--micro-batch-size", "1", "--vocab-size", "100"]
                            + data_flags)
    assert from_flags(DataSection, cache_args) == from_flags(DataSection, train_args)
    for f in dataclasses.fields(DataSection):
        assert f.name in vars(cache_args) and f.name in vars(train_args), f.name


def test_loss_flag_errors_name_the_flags():
    parser = argparse.ArgumentParser()
    add_kd_args(parser)
    with pytest.raises(ValueError, match=r"--kd-temperature must be finite and > 0"):
        KDArgs.from_args(parser.parse_args(["--kd-teacher-load", "t",
                                            "--kd-temperature", "-1"]))


def test_flag_spec_names():
    assert Flag(name="--kd-loss").dest("kind") == "kd_loss"
    assert Flag().option("micro_batch_size") == "--micro-batch-size"


def _serve_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    teacher_serve.add_arguments(parser)
    return parser


SERVE = ["serve", "--kd-teacher-load", "ckpt", "--kd-teacher-endpoint", "ep"]


def test_teacher_serve_flags_make_its_config_once():
    args = _serve_parser().parse_args(SERVE + [
        "--tensor-model-parallel-size", "2", "--kd-teacher-dtype", "bf16", "--port", "7",
        "--no-exit-with-launcher", "--stop-grace", "0", "--tensorboard-dir", "tb"])
    cfg = teacher_serve.ServeConfig.from_args(args)
    assert cfg.serve == teacher_serve.ServeSection(port=7, exit_with_launcher=False,
                                                   stop_grace=0.0)
    assert (cfg.teacher.teacher_load, cfg.teacher.teacher_endpoint) == ("ckpt", "ep")
    assert cfg.teacher.teacher_dtype == "bf16" and cfg.teacher.teacher_timeout == \
        default_of(KDArgs, "teacher_timeout")
    assert cfg.parallel == ParallelSection(tensor_model_parallel_size=2)
    assert cfg.metrics == MetricsSection(tensorboard_dir="tb")
    # the defaults are the sections' own: the launcher watched unless asked otherwise
    plain = teacher_serve.ServeConfig.from_args(_serve_parser().parse_args(SERVE))
    assert plain.serve == teacher_serve.ServeSection() and plain.serve.exit_with_launcher


@pytest.mark.parametrize("flags, message", [
    (["--max-batch-size", "0"], "--max-batch-size must be >= 1, got 0"),
    (["--launcher-grace", "-1"], "--launcher-grace must be >= 0, got -1.0"),
    (["--stop-grace", "-0.5"], "--stop-grace must be >= 0, got -0.5"),
    (["--kd-teacher-timeout", "0"], "--kd-teacher-timeout must be > 0, got 0.0"),
])
def test_teacher_serve_config_refuses_bad_values(flags, message):
    args = _serve_parser().parse_args(SERVE + flags)
    with pytest.raises(ValueError, match=re.escape(message)):
        teacher_serve.ServeConfig.from_args(args)


def _options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {option: action for action in parser._actions for option in action.option_strings}


def _cache_build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    importlib.import_module(SUBCOMMANDS["cache"][0]).add_arguments(parser)
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    build = sub.choices["build"]
    build.format_help()  # its flags are added when first used (parsing or --help)
    return build


def _default(cls, name: str):
    return next(f.default for f in dataclasses.fields(cls) if f.name == name)


def test_the_planners_kd_flags_are_the_training_commands():
    # the --kd-* flags `megatron-kd plan` shares with `train` (and the Megatron-LM hooks) and
    # `cache build`: the same flag, choices and help, and the plan's default is theirs
    planner = argparse.ArgumentParser()
    importlib.import_module(SUBCOMMANDS["plan"][0]).add_arguments(planner)
    train = argparse.ArgumentParser()
    importlib.import_module(SUBCOMMANDS["train"][0]).add_arguments(train)
    plan, trained, cache = _options(planner), _options(train), _options(_cache_build_parser())
    for option, other, field in (("--kd-prefetch-depth", trained, "prefetch_depth"),
                                 ("--kd-window-size", trained, "window_size"),
                                 ("--kd-wire-dtype", trained, "wire_dtype"),
                                 ("--kd-topk", cache, "topk")):
        assert plan[option].choices == other[option].choices, option
        assert plan[option].type == other[option].type, option
        # None on the planner's command line: given, or else --from-args's, else the plan's
        assert plan[option].default is None and plan[option].dest == field
        if field != "wire_dtype":
            assert _default(PlanOptions, field) == other[option].default, option
        if field != "window_size":
            assert plan[option].help.startswith(other[option].help), option
    # one pinned K: cache build's, and the plan's when none is given
    assert _default(PlanOptions, "topk") == cache["--kd-topk"].default == 100
    # the wire's default is the teacher's dtype, which the plan takes as bf16 (its weights')
    assert trained["--kd-wire-dtype"].default is None
    assert _default(PlanOptions, "wire_dtype") == "bf16"
    assert _default(PlanOptions, "hidden_elem_bytes") == 2
