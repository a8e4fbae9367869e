"""The typed run configuration and the flags made from it (no process group)."""

import argparse
import dataclasses
import re

import pytest

from megatron_kd.flags import Flag, add_flags, default_of, flag, from_flags
from megatron_kd.integration.args import GPU_LOSS_FLAGS, LOSS_FLAGS, KDArgs, add_kd_args
from megatron_kd.loss import GpuTuning, KDLossConfig
from megatron_kd.training import cache_command, teacher_serve
from megatron_kd.training.metrics import MetricsSection
from megatron_kd.training.run_config import (
    ArchitectureSection,
    DataSection,
    LoggingSection,
    OptimizerSection,
    ParallelSection,
    RunConfig,
    parse_args,
)

MINIMAL = ["--num-layers", "2", "--hidden-size", "8", "--num-attention-heads", "2",
           "--seq-length", "16", "--micro-batch-size", "1", "--train-iters", "3",
           "--mock-data", "--vocab-size", "100", "--kd-weight", "0", "--kd-ce-weight", "1"]
SECTIONS = (ArchitectureSection, ParallelSection, OptimizerSection, DataSection,
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

