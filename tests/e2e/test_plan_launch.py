"""The launch lines ``megatron-kd plan --json`` prints are accepted as printed, at the planned
layout: the student's flags pass ``megatron-kd train``'s checks (every check made before a model
is built, on the planned world size) and the Megatron-LM integration's, for the Qwen3.5-35B-A3B
-> 9B plans at 32K and 8K tokens on two H200 nodes and the Llama-3.1-8B -> 3.2-3B one at 8K.

The checkpoints are the real models' as ``import-hf`` describes them (``model_config.json``) with
the tensor metadata of a ``torch_dist`` checkpoint and no tensor data: the checks read only
those (``check_teacher``: "Reads only the checkpoint's metadata"), and 35B parameters do not fit
a test. ``--bf16`` and ``--use-distributed-optimizer`` are GPU-only in ``train`` (refused on CPU):
the checks run as on a GPU host (``on_cpu`` answered False), which is what the plan is for.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    TensorProperties,
    TensorStorageMetadata,
)

from megatron_kd.cli import main
from megatron_kd.integration.checkpoint import expected_tensor_shapes
from megatron_kd.megatron_lm import hooks as kd_lm
from megatron_kd.megatron_lm.checks import check_megatron_args
from megatron_kd.planner.presets import MODEL_PRESETS
from megatron_kd.training import run_checks
from megatron_kd.training.run_config import RunConfig, parse_args

#: name -> (teacher preset, student preset, ``megatron-kd plan`` options)
PLANS = {
    "qwen3.5-32k": ("qwen3.5-35b-a3b", "qwen3.5-9b",
                    ["--gpu", "h200-141g", "--nodes", "2", "--seq-length", "32768"]),
    "qwen3.5-8k": ("qwen3.5-35b-a3b", "qwen3.5-9b",
                   ["--gpu", "h200-141g", "--nodes", "2", "--seq-length", "8192"]),
    "llama-8k": ("llama-3.1-8b", "llama-3.2-3b",
                 ["--gpu", "h200-141g", "--nodes", "1", "--seq-length", "8192"]),
}
ONLINE = ("colocated-fused", "disaggregated")


def _metadata_only_checkpoint(directory, preset: str) -> str:
    """``directory`` as a checkpoint of ``preset``: its ``model_config.json`` and the
    ``torch_dist`` tensor metadata (global shapes, bf16), no tensor data."""
    arch = MODEL_PRESETS[preset].arch
    os.makedirs(directory, exist_ok=True)
    tensors = {key: TensorStorageMetadata(
        properties=TensorProperties(dtype=torch.bfloat16), size=torch.Size(shape),
        chunks=[ChunkStorageMetadata(offsets=torch.Size([0] * len(shape)),
                                     sizes=torch.Size(shape))])
        for key, shape in expected_tensor_shapes(arch).items()}
    with open(os.path.join(directory, ".metadata"), "wb") as f:
        pickle.dump(Metadata(state_dict_metadata=tensors), f)
    with open(os.path.join(directory, "metadata.json"), "w", encoding="utf-8") as f:
        json.dump({"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                   "common_backend": "torch", "common_backend_version": 1}, f)
    with open(os.path.join(directory, "model_config.json"), "w", encoding="utf-8") as f:
        json.dump({"format_version": 1, "arch": arch.to_dict(), "extra": {}}, f)
    return str(directory)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    presets = {p for teacher, student, _ in PLANS.values() for p in (teacher, student)}
    return {p: _metadata_only_checkpoint(root / p, p) for p in presets}


@pytest.fixture(scope="module")
def plans(checkpoints):
    """Each plan's ``--json`` output, the teacher given as its checkpoint directory (so the
    launch lines name it)."""
    out = {}
    for name, (teacher, student, options) in PLANS.items():
        out[name] = _plan_json(["--teacher", checkpoints[teacher], "--student", student,
                                *options])
    return out


def _plan_json(argv) -> dict:
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(["plan", *argv, "--json"]) == 0
    return json.loads(buf.getvalue())


def _pairs(flags: list[str]) -> dict:
    """Flag -> value (True for a switch) of a flag list."""
    out, i = {}, 0
    while i < len(flags):
        takes = i + 1 < len(flags) and not flags[i + 1].startswith("--")
        out[flags[i]] = flags[i + 1] if takes else True
        i += 2 if takes else 1
    return out


def _expand(flags: list[str], teacher_dir: str) -> list[str]:
    values = {"$TEACHER_CKPT": teacher_dir, "$KD_TEACHER_ENDPOINT": "/shared/endpoint"}
    assert {f for f in flags if f.startswith("$")} <= set(values), flags
    return [values.get(f, f) for f in flags]


def test_the_32k_plan_prints_the_student_and_teacher_launch(plans, checkpoints):
    plan = plans["qwen3.5-32k"]["plans"]["disaggregated"]
    launch = plan["launch"]
    flags = _pairs(launch["student_flags"])
    layout = plan["layout"]
    assert flags["--tensor-model-parallel-size"] == str(layout["tp"])
    assert flags["--pipeline-model-parallel-size"] == str(layout["pp"])
    assert (flags.get("--sequence-parallel") is True) == (layout["sequence_parallel"]
                                                           and layout["tp"] > 1)
    assert "--context-parallel-size" not in flags  # a Gated DeltaNet student: never CP
    assert flags["--seq-length"] == "32768" and flags["--kd-mode"] == "disaggregated"
    assert flags["--kd-teacher-load"] == checkpoints["qwen3.5-35b-a3b"]
    assert flags.get("--use-distributed-optimizer") is layout["use_distributed_optimizer"]
    teacher = plan["teacher_layout"]
    serve = launch["teacher_command"]
    assert serve[:3] == ["megatron-kd", "teacher", "serve"]
    assert _pairs(serve[3:])["--tensor-model-parallel-size"] == str(teacher["tp"])
    replicas = [line for line in launch["sbatch"] if "teacher.sbatch" in line]
    assert replicas and f"KD_TEACHER_REPLICAS={plan['teacher_replicas']}" in replicas[0]
    assert any("pretrain_gpt.py: not for" in line for line in launch["sbatch"])
    # the lever not pulled, said once
    assert any(line.startswith("context parallelism: cp=1, the student cannot split")
               for line in plan["levers"])


@pytest.mark.parametrize("mode", ONLINE)
@pytest.mark.parametrize("name", list(PLANS))
def test_train_accepts_the_planned_student_flags(plans, checkpoints, monkeypatch, name, mode):
    teacher, student, _ = PLANS[name]
    plan = plans[name]["plans"][mode]
    assert plan["fits"], plan["verdict"]
    flags = _expand(plan["launch"]["student_flags"], checkpoints[teacher])
    argv = [*flags, "--pretrained-checkpoint", checkpoints[student], "--mock-data",
            "--train-iters", "10", "--lr", "1e-4"]
    monkeypatch.setattr(run_checks, "on_cpu", lambda: False)  # as on the GPU host planned for
    run = run_checks.check_run(RunConfig.from_args(parse_args(argv)), plan["student_gpus"])
    layout = plan["layout"]
    assert (run.layout.tp, run.layout.pp, run.layout.dp, run.layout.cp, run.layout.vp) == (
        layout["tp"], layout["pp"], layout["dp"], layout["cp"], layout["vp"])
    assert run.layout.sequence_parallel == (layout["sequence_parallel"] and layout["tp"] > 1)
    assert run.kd.mode == ("colocated" if mode == "colocated-fused" else "disaggregated")


def _megatron_lm_namespace(flags: list[str], student_arch) -> argparse.Namespace:
    """What Megatron-LM's ``get_args()`` holds for ``flags`` (its own flag names and defaults
    for the fields the integration reads), with the ``--kd-*`` flags parsed by the integration's
    own parser."""
    parser = argparse.ArgumentParser(allow_abbrev=False)
    kd_lm.extra_args_provider(parser)
    for name in ("--tensor-model-parallel-size", "--pipeline-model-parallel-size",
                 "--context-parallel-size", "--num-layers-per-virtual-pipeline-stage",
                 "--expert-model-parallel-size", "--expert-tensor-parallel-size",
                 "--micro-batch-size", "--global-batch-size",
                 "--seq-length", "--recompute-num-layers"):
        parser.add_argument(name, type=int, default=None)
    for name in ("--recompute-granularity", "--recompute-method"):
        parser.add_argument(name)
    for name in ("--sequence-parallel", "--use-distributed-optimizer", "--bf16"):
        parser.add_argument(name, action="store_true")
    args = parser.parse_args(flags)
    layers = args.num_layers_per_virtual_pipeline_stage
    pp = args.pipeline_model_parallel_size
    args.virtual_pipeline_model_parallel_size = (
        student_arch.num_layers // (pp * layers) if layers else None)
    for key, value in {"context_parallel_size": 1, "padded_vocab_size": None,
                       "init_model_with_meta_device": False, "mtp_num_layers": None,
                       "vocab_size": None, "gradient_accumulation_fusion": False,
                       "num_layers": student_arch.num_layers,
                       "check_for_nan_in_loss_and_grad": True, "check_for_spiky_loss": False,
                       "pretrained_checkpoint": None}.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    return args


@pytest.mark.parametrize("mode", ONLINE)
@pytest.mark.parametrize("name", list(PLANS))
def test_the_megatron_lm_checks_accept_the_planned_student_flags(plans, checkpoints, name,
                                                                 mode):
    teacher, student, _ = PLANS[name]
    plan = plans[name]["plans"][mode]
    flags = _expand(plan["launch"]["student_flags"], checkpoints[teacher])
    args = _megatron_lm_namespace(flags, MODEL_PRESETS[student].arch)
    kd, arch = check_megatron_args(args)
    assert kd.teacher_load == checkpoints[teacher] and arch.num_layers == \
        MODEL_PRESETS[teacher].arch.num_layers
    assert args.tensor_model_parallel_size == plan["layout"]["tp"]


_REAL_CHECK = """
import json, os, sys
sys.path.insert(0, os.environ["KD_MEGATRON_LM_ROOT"])
from megatron.training.arguments import parse_args, validate_args
from megatron_kd.megatron_lm.hooks import extra_args_provider
from megatron_kd.megatron_lm.checks import check_megatron_args
sys.argv = ["pretrain_gpt.py", *json.loads(sys.argv[1])]
args = parse_args(extra_args_provider)
validate_args(args, {})
kd, _ = check_megatron_args(args)
print("CHECKED", json.dumps({"tp": args.tensor_model_parallel_size,
                             "pp": args.pipeline_model_parallel_size,
                             "dp": args.data_parallel_size,
                             "dist_opt": args.use_distributed_optimizer, "mode": kd.mode}))
"""


def _megatron_lm_checkouts():
    return [d for d in os.environ.get("MEGATRON_LM_DIR", "").split(os.pathsep) if d]


@pytest.mark.parametrize("mode", ONLINE)
def test_real_megatron_lm_accepts_the_planned_flags(plans, checkpoints, tmp_path, mode):
    """The dense pair's printed student flags, with the imported student's Megatron-LM model
    flags and ``--pretrained-checkpoint``, through Megatron-LM's own ``parse_args`` and
    ``validate_args`` at the planned world size, then the integration's checks (the real
    tier: ``MEGATRON_LM_DIR``, ``MEGATRON_LM_PYTHON`` >= 3.12)."""
    import subprocess
    import sys

    from megatron_kd.arch.megatron_lm_args import megatron_lm_flags

    roots = _megatron_lm_checkouts()
    if not roots:
        pytest.skip("MEGATRON_LM_DIR is not set (the real Megatron-LM tier)")
    python = os.environ.get("MEGATRON_LM_PYTHON", sys.executable)
    teacher, student, _ = PLANS["llama-8k"]
    plan = plans["llama-8k"]["plans"][mode]
    arch = MODEL_PRESETS[student].arch
    flags = [*map(str, megatron_lm_flags(arch)),
             *_expand(plan["launch"]["student_flags"], checkpoints[teacher]),
             "--pretrained-checkpoint", checkpoints[student], "--tokenizer-type",
             "NullTokenizer", "--vocab-size", str(arch.vocab_size), "--train-iters", "10",
             "--lr", "1e-4", "--mock-data"]
    if mode == "disaggregated":
        flags = [f.replace("/shared/endpoint", str(tmp_path / "endpoint")) for f in flags]
    layout = plan["layout"]
    for root in roots:
        env = {**os.environ, "KD_MEGATRON_LM_ROOT": root, "WORLD_SIZE": str(plan["student_gpus"]),
               "RANK": "0", "LOCAL_RANK": "0",
               "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[2]),
                                              os.environ.get("PYTHONPATH", "")])}
        done = subprocess.run([python, "-c", _REAL_CHECK, json.dumps(flags)], env=env,
                              capture_output=True, text=True, timeout=300, check=False)
        line = [x for x in done.stdout.splitlines() if x.startswith("CHECKED ")]
        assert done.returncode == 0 and line, (root, done.stdout[-2000:], done.stderr[-4000:])
        got = json.loads(line[0][len("CHECKED "):])
        assert got == {"tp": layout["tp"], "pp": layout["pp"], "dp": layout["dp"],
                       "dist_opt": layout["use_distributed_optimizer"],
                       "mode": "colocated" if mode == "colocated-fused" else "disaggregated"}
