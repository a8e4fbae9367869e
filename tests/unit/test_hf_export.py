"""``megatron-kd export-hf``, pure checks (no process group, no checkpoint): the weight mapping
inverts the import's for every family, dummy heads are cut off only while they are still zero,
a config built from the architecture is the original one field for field, and what no family
expresses is refused by name."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

from support.hf_models import (
    tiny_gpt_oss,
    tiny_llama,
    tiny_qwen3,
    tiny_qwen3_moe,
    tiny_qwen35,
    tiny_qwen35_moe,
)

from megatron_kd.arch import GPTArchConfig
from megatron_kd.arch.hf_config import arch_from_hf_config, config_for_export, hf_config_from_arch
from megatron_kd.hf.export_weights import (
    export_embedding,
    export_final,
    export_layer,
)
from megatron_kd.hf.exporter import parse_size
from megatron_kd.hf.import_weights import convert_hf_state_dict, pad_for_tensor_parallel

FAMILIES = {
    "llama_tied": lambda t: tiny_llama(t, tied=True),
    "llama_untied": lambda t: tiny_llama(t, tied=False),
    "qwen3": tiny_qwen3,
    "qwen3_moe": tiny_qwen3_moe,
    "qwen3_moe_softmax_topk": lambda t: tiny_qwen3_moe(t, norm_topk_prob=False, name="pre"),
    "gpt_oss": tiny_gpt_oss,
    "qwen35": tiny_qwen35,
    "qwen35_moe": tiny_qwen35_moe,
}


def _hf(path):
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    return config, safetensors_torch.load_file(os.path.join(path, "model.safetensors"))


def _export_all(full, arch, target, rows):
    """The exporter run over a converted state dict, unit by unit as export-hf runs it."""
    full = dict(full)
    out = export_embedding(full.pop("embedding.word_embeddings.weight"), arch, rows)
    for i in range(arch.num_layers):
        prefix = f"decoder.layers.{i}."
        out.update(export_layer({k: full.pop(k) for k in list(full) if k.startswith(prefix)},
                                i, arch, target))
    out.update(export_final(full.pop("decoder.final_layernorm.weight"),
                            full.pop("output_layer.weight", None), arch, rows))
    assert not full
    return out


def _zero_centred(name):
    """Qwen3.5's ``x * (1 + w)`` norms (not the DeltaNet's gated ``linear_attn.norm``)."""
    return name == "model.norm.weight" or name.endswith(
        ("input_layernorm.weight", "post_attention_layernorm.weight", "q_norm.weight",
         "k_norm.weight"))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_export_inverts_the_import(tmp_path, family):
    config, original = _hf(FAMILIES[family](tmp_path)[0])
    arch = arch_from_hf_config(config)
    out = _export_all(convert_hf_state_dict(original, arch), arch, arch, config["vocab_size"])
    assert sorted(out) == sorted(original)
    for name, tensor in original.items():
        if family.startswith("qwen35") and _zero_centred(name):
            # Qwen3.5's x * (1 + w) norms are stored as 1 + w in fp32, which rounds away the
            # last bit of a w in [0.5, 1): the export gives back fl(fl(1 + w) - 1) exactly
            expected = ((tensor + 1.0) - 1.0)
            assert torch.equal(out[name], expected), name
            assert (out[name] - tensor).abs().max() <= 2.0 ** -23, name
        else:
            assert torch.equal(out[name], tensor), name


def test_dummy_heads_are_cut_off_while_still_zero(tmp_path):
    config, original = _hf(tiny_llama(tmp_path, tied=True, groups=3, ffn=75, name="odd")[0])
    target = arch_from_hf_config(config)
    full, padded = pad_for_tensor_parallel(convert_hf_state_dict(original, target), target, 2)
    assert (padded.num_query_groups, padded.ffn_hidden_size) == (4, 76)
    out = _export_all(full, padded, target, config["vocab_size"])
    assert all(torch.equal(out[k], v) for k, v in original.items())
    # a dummy head that learned something: the smaller model would compute another function
    qkv = "decoder.layers.1.self_attention.linear_qkv.weight"
    full[qkv] = full[qkv].clone()
    full[qkv][-1, 0] = 1e-3
    with pytest.raises(ValueError, match="no longer zero"):
        _export_all(full, padded, target, config["vocab_size"])


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_config_built_from_the_architecture_is_the_original(tmp_path, family):
    config, _ = _hf(FAMILIES[family](tmp_path)[0])
    built = hf_config_from_arch(arch_from_hf_config(config))
    # as transformers reads them (its defaults filled in on both sides); the tiny models keep
    # transformers' default token ids, the fields an architecture does not hold
    read = transformers.AutoConfig.for_model(**config).to_dict()
    read_built = transformers.AutoConfig.for_model(**built).to_dict()
    assert {k: v for k, v in read_built.items() if k != "dtype"} == \
        {k: v for k, v in read.items() if k != "dtype"}


def test_a_multimodal_qwen35_config_exports_its_text_model(tmp_path):
    config, _ = _hf(tiny_qwen35_moe(tmp_path)[0])
    arch = arch_from_hf_config(config)
    text = {k: v for k, v in config.items() if k not in ("architectures", "model_type",
                                                         "tie_word_embeddings")}
    outer = {"model_type": "qwen3_5_moe", "architectures": ["Qwen3_5MoeForConditionalGeneration"],
             "tie_word_embeddings": False, "text_config": text, "vision_config": {"depth": 2}}
    out = config_for_export(outer, arch, dtype="bfloat16")
    assert (out["model_type"], out["architectures"]) == ("qwen3_5_moe_text",
                                                         ["Qwen3_5MoeForCausalLM"])
    assert "vision_config" not in out and out["dtype"] == "bfloat16"
    assert out["num_experts"] == 4


_LLAMA = {"num_layers": 2, "hidden_size": 48, "num_attention_heads": 6, "num_query_groups": 2,
          "ffn_hidden_size": 72, "vocab_size": 203, "padded_vocab_size": 256,
          "max_position_embeddings": 64}


@pytest.mark.parametrize("change, field", [
    ({"normalization": "LayerNorm"}, "normalization"),
    ({"position_embedding_type": "learned_absolute"}, "position_embedding_type"),
    ({"swiglu": False}, "swiglu"),
    ({"add_bias_linear": True}, "mlp_bias"),
    ({"rotary_percent": 0.5}, "rotary_percent"),
    ({"num_experts": 4, "moe_ffn_hidden_size": 24}, "qk_layernorm"),  # Mixtral: not mapped
])
def test_architectures_no_family_expresses_are_refused_by_name(change, field):
    arch = GPTArchConfig(**{**_LLAMA, **change})
    with pytest.raises(ValueError, match=field):
        hf_config_from_arch(arch)


def test_a_config_that_does_not_describe_the_checkpoint_is_refused(tmp_path):
    config, _ = _hf(tiny_qwen3(tmp_path)[0])
    arch = arch_from_hf_config(config)
    other = dataclasses.replace(arch, rotary_base=10000.0)
    with pytest.raises(ValueError, match="rotary_base"):
        config_for_export(config, other, dtype="float32")


@pytest.mark.parametrize("text, expected", [("5GB", 5 * 10**9), ("500MB", 5 * 10**8),
                                            ("2GiB", 2 * 2**30), ("50KB", 50_000),
                                            ("123", 123), (7, 7)])
def test_shard_sizes_read_as_transformers_writes_them(text, expected):
    assert parse_size(text) == expected
    with pytest.raises(ValueError, match="5GB"):
        parse_size("five gigabytes")


def test_a_training_checkpoint_finds_the_files_its_import_kept(tmp_path):
    # import-hf keeps the source's files in hf/; a training checkpoint that records the
    # checkpoint it started from (which may itself be a training run's --save root) leads there
    from megatron_kd.hf.exporter import PRETRAINED_KEY, _kept_hf_dir

    def checkpoint(path, extra):
        os.makedirs(path)
        with open(os.path.join(path, "model_config.json"), "w", encoding="utf-8") as f:
            json.dump({"format_version": 1, "arch": {}, "extra": extra}, f)
        return str(path)

    imported = checkpoint(tmp_path / "imported", {})
    os.makedirs(os.path.join(imported, "hf"))
    open(os.path.join(imported, "hf", "config.json"), "w").close()
    first = checkpoint(tmp_path / "run1" / "iter_0000004", {PRETRAINED_KEY: imported})
    with open(tmp_path / "run1" / "latest_checkpointed_iteration.txt", "w") as f:
        f.write("4")
    second = checkpoint(tmp_path / "run2" / "iter_0000002",
                        {PRETRAINED_KEY: str(tmp_path / "run1")})
    assert _kept_hf_dir(second, {PRETRAINED_KEY: str(tmp_path / "run1")}) == \
        os.path.join(imported, "hf")
    assert _kept_hf_dir(first, {}) is None  # records nothing: a config built from the arch
