"""``megatron-kd plan`` reads the one architecture type (``GPTArchConfig``): a preset, its Hugging
Face ``config.json``, a checkpoint imported from it and Megatron-LM flags each plan as what they
are (experts and top-k, QK norms, ...), and give the same plan when they describe the same model.
"""

import json
import os
import subprocess
import sys

import pytest

from megatron_kd.arch import GPTArchConfig
from megatron_kd.arch.hf_config import arch_from_hf_config, canonical_arch, hf_config_from_arch
from megatron_kd.cli import main
from megatron_kd.planner.cli import parse_launch_args
from megatron_kd.planner.presets import MODEL_PRESETS

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The plan's inputs beside the models: one node of 8 GPUs, a short sequence (the search is quick)
SHAPE = ("--seq-length", "1024", "--global-batch-size", "16")


def _plan(capsys, *argv: str) -> dict:
    assert main(["plan", *argv, *SHAPE, "--json"]) == 0, capsys.readouterr().err
    return json.loads(capsys.readouterr().out)


def _without_models(out: dict) -> dict:
    """A plan's JSON without its two models' descriptions (names, sources, spellings) and the
    launch lines (which name a teacher given as a checkpoint directory by its path)."""
    out = {k: v for k, v in out.items() if k not in ("student", "teacher")}
    out["plans"] = {mode: {k: v for k, v in plan.items() if k != "launch"}
                    for mode, plan in out["plans"].items()}
    return out


def _same_model(a: dict, b: dict) -> None:
    """Two plans' model entries describe one architecture with the same parameter counts."""
    names = {"name", "source", "published_total_params", "published_active_params",
             "total_params", "active_params"}
    arch = {k: v for k, v in a.items() if k not in names}
    other = {k: v for k, v in b.items() if k not in names}
    assert canonical_arch(GPTArchConfig(**arch)) == canonical_arch(GPTArchConfig(**other))
    assert (a["total_params"], a["active_params"]) == (b["total_params"], b["active_params"])


def _write_checkpoint_config(directory, arch) -> str:
    """The ``model_config.json`` a megatron_kd checkpoint of ``arch`` carries."""
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "model_config.json"), "w", encoding="utf-8") as f:
        json.dump({"format_version": 1, "arch": arch.to_dict(), "extra": {}}, f)
    return str(directory)


@pytest.mark.parametrize("preset, trains", [("qwen3-30b-a3b", True), ("qwen3.5-35b-a3b", True),
                                            ("gpt-oss-20b", False), ("llama-3.2-1b", True)])
def test_a_preset_its_hf_config_and_its_checkpoint_plan_alike(tmp_path, capsys, preset, trains):
    arch = MODEL_PRESETS[preset].arch
    config = tmp_path / "config.json"
    config.write_text(json.dumps(hf_config_from_arch(arch)))
    # what import-hf stores of that config.json
    checkpoint = _write_checkpoint_config(tmp_path / "ckpt", arch_from_hf_config(
        json.loads(config.read_text())))
    students = (preset, str(config), checkpoint)
    if not trains:
        # gpt-oss's experts with biases do not train (megatron-kd train refuses them): the
        # planner refuses the student whichever way it is given, for that reason
        for student in students:
            assert main(["plan", "--teacher", "qwen3-32b", "--student", student, *SHAPE]) == 2
            err = capsys.readouterr().err
            assert "no valid student layout" in err and "--add-bias-linear" in err, err
    else:
        plans = [_plan(capsys, "--teacher", "qwen3-32b", "--student", student)
                 for student in students]
        for other in plans[1:]:
            _same_model(plans[0]["student"], other["student"])
            assert _without_models(other) == _without_models(plans[0])
    # and as the teacher
    plans = [_plan(capsys, "--teacher", teacher, "--student", "llama-3.2-1b")
             for teacher in (preset, str(config), checkpoint)]
    for other in plans[1:]:
        assert _without_models(other) == _without_models(plans[0])


@pytest.fixture(scope="module")
def imported_qwen3_moe(tmp_path_factory):
    """A tiny Qwen3-MoE of transformers' own class (4 experts of width 24, top 2, QK norms) and
    its ``megatron-kd import-hf`` checkpoint: ``(hf_dir, imported_dir)``."""
    pytest.importorskip("transformers")
    from support.hf_models import tiny_qwen3_moe

    tmp = tmp_path_factory.mktemp("qwen3_moe")
    hf_dir, _, _ = tiny_qwen3_moe(tmp)
    imported = str(tmp / "imported")
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "",
           "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
    r = subprocess.run([sys.executable, "-m", "megatron_kd", "import-hf", "--hf-path", hf_dir,
                        "--save", imported], env=env, timeout=600, capture_output=True,
                       text=True, check=False)
    assert r.returncode == 0, r.stderr[-4000:]
    return hf_dir, imported


def test_an_imported_qwen3_moe_plans_as_a_mixture_of_experts(capsys, imported_qwen3_moe):
    hf_dir, imported = imported_qwen3_moe
    out = _plan(capsys, "--teacher", imported, "--student", imported)
    for side in ("student", "teacher"):
        model = out[side]
        assert (model["num_experts"], model["moe_router_topk"], model["moe_ffn_hidden_size"]) \
            == (4, 2, 24)
        assert model["qk_layernorm"] is True and model["kv_channels"] == 16
        # per layer: attention 4*16*48 + 2*2*16*48 + 4*16*48 = 9216, QK norms 32, router 4*48,
        # norms 96; experts 3*48*24 = 3456 each (4 of them, 2 active); two layers, a final norm
        # 48 and untied 203 x 48 embedding and output layer
        dense = 9216 + 32 + 192 + 96
        assert model["total_params"] == 2 * (dense + 4 * 3456) + 48 + 2 * 203 * 48
        assert model["active_params"] == 2 * (dense + 2 * 3456) + 48 + 203 * 48
    # the Hugging Face config.json it was imported from gives the same plan
    config = os.path.join(hf_dir, "config.json")
    from_config = _plan(capsys, "--teacher", config, "--student", config)
    for side in ("student", "teacher"):
        _same_model(out[side], from_config[side])
    assert _without_models(from_config) == _without_models(out)


def test_megatron_lm_flags_plan_as_what_they_are(capsys, imported_qwen3_moe):
    # the tiny Qwen3-MoE's shape as Megatron-LM flags
    flags = ("--num-layers 2 --hidden-size 48 --num-attention-heads 4 --group-query-attention "
             "--num-query-groups 2 --kv-channels 16 --ffn-hidden-size 72 --swiglu "
             "--num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 24 --qk-layernorm "
             "--untie-embeddings-and-output-weights --disable-bias-linear --normalization "
             "RMSNorm --position-embedding-type rope --norm-epsilon 1e-6 --rotary-base 1000000 "
             "--max-position-embeddings 64 --vocab-size 203")
    student = parse_launch_args(flags).student
    assert (student.num_experts, student.moe_router_topk, student.qk_layernorm) == (4, 2, True)
    _, imported = imported_qwen3_moe
    # the launch's layout: Megatron-LM's defaults (tp, pp, cp 1, no recompute, no SP) and no
    # dropout, given to the checkpoint's plan as options
    layout = ("--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1",
              "--context-parallel-size", "1", "--recompute-granularity", "none",
              "--no-sequence-parallel", "--no-use-distributed-optimizer")
    out = _plan(capsys, "--teacher", imported, "--from-args", flags + " --hidden-dropout 0")
    checkpoint = _plan(capsys, "--teacher", imported, "--student", imported, *layout)
    _same_model(out["student"], checkpoint["student"])
    assert out["ignored_launch_flags"] == []
    assert _without_models(out)["plans"] == _without_models(checkpoint)["plans"]


@pytest.mark.parametrize("flags, ffn", [
    # Megatron-LM without --ffn-hidden-size: int(8h/3 / 64) * 64 with SwiGLU, 4h without
    ("--swiglu", 2048),
    ("", 3072),
    ("--swiglu --ffn-hidden-size 1000", 1000),
])
def test_from_args_mlp_width_is_megatron_lms(flags, ffn):
    launch = parse_launch_args(f"--num-layers 2 --hidden-size 768 --num-attention-heads 12 "
                               f"--vocab-size 1000 {flags}")
    assert launch.student.ffn_hidden_size == ffn
    # 12 heads of 64, one query group each; SwiGLU: three h x f matrices, else two
    per_layer = 4 * 768 * 768 + (3 if "swiglu" in flags else 2) * 768 * ffn
    assert launch.student.layer_dense_params(0) - 2 * 768 - _biases(ffn, "swiglu" in flags) \
        == per_layer


def _biases(ffn: int, swiglu: bool) -> int:
    """Megatron-LM's default biases (no --disable-bias-linear): q, k, v, o and the MLP's."""
    return 3 * 768 + 768 + (2 if swiglu else 1) * ffn + 768


def test_shared_experts_in_megatron_lm_flags_are_refused_by_name():
    # the one Megatron-LM reader does not build them; refused, never planned without
    with pytest.raises(ValueError, match="moe_shared_expert_intermediate_size=8"):
        parse_launch_args("--num-layers 2 --hidden-size 64 --num-attention-heads 4 "
                          "--vocab-size 100 --num-experts 4 "
                          "--moe-shared-expert-intermediate-size 8")


#: meta-llama/Llama-3.1-8B's config.json as published on the Hugging Face Hub (written out here,
#: not made by the converter under test): RoPE scaling "llama3" in the legacy key.
LLAMA_31_8B_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 14336,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.43.0.dev0",
    "use_cache": True,
    "vocab_size": 128256,
}


def test_llama3_rope_scaling_config_plans_as_its_preset(tmp_path, capsys):
    # Llama 3.1's config.json as published: the preset's model, its RoPE scaling included
    config = LLAMA_31_8B_CONFIG
    arch = arch_from_hf_config(config)  # the published numbers, field by field
    assert (arch.num_layers, arch.hidden_size, arch.ffn_hidden_size, arch.num_attention_heads,
            arch.num_query_groups, arch.vocab_size, arch.max_position_embeddings,
            arch.tie_embeddings, arch.rotary_base, arch.norm_epsilon, arch.rope_scaling_factor,
            arch.head_dim) == (32, 4096, 14336, 32, 8, 128256, 131072, False, 500000.0, 1e-5,
                               8.0, 128)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    out = _plan(capsys, "--teacher", str(path), "--student", "llama-3.2-1b")
    preset = _plan(capsys, "--teacher", "llama-3.1-8b", "--student", "llama-3.2-1b")
    _same_model(out["teacher"], preset["teacher"])
    assert MODEL_PRESETS["llama-3.1-8b"].arch.rope_scaling_factor == 8.0
    assert _without_models(out) == _without_models(preset)
