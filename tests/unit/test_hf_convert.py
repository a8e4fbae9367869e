"""``megatron-kd import-hf``, pure conversion checks (no process group): the q/k/v layout, the
architecture read from a config, refused configs and tensors, tokenizer compatibility."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from support.hf_models import bpe_tokenizer, tiny_llama

from megatron_kd.arch import Role, check_layout
from megatron_kd.hf import importer
from megatron_kd.parallel import ParallelLayout


def test_qkv_layout_groups_heads_like_repeat_kv():
    # Head i of q uses kv head i // (nh/ng) in HF; Megatron reads q heads of group g then k_g, v_g.
    from megatron_kd.arch import GPTArchConfig

    arch = GPTArchConfig(num_layers=1, hidden_size=4, num_attention_heads=4, num_query_groups=2,
                         ffn_hidden_size=4, vocab_size=8, padded_vocab_size=8,
                         max_position_embeddings=8, kv_channels=1)
    # Each row labelled with its role: q heads 10..13, k heads 20..21, v heads 30..31.
    sd = {
        "embed_tokens.weight": torch.zeros(8, 4),
        "layers.0.self_attn.q_proj.weight": torch.arange(10, 14.).unsqueeze(1).expand(4, 4),
        "layers.0.self_attn.k_proj.weight": torch.arange(20, 22.).unsqueeze(1).expand(2, 4),
        "layers.0.self_attn.v_proj.weight": torch.arange(30, 32.).unsqueeze(1).expand(2, 4),
        "layers.0.self_attn.o_proj.weight": torch.zeros(4, 4),
        "layers.0.mlp.gate_proj.weight": torch.full((4, 4), 1.0),
        "layers.0.mlp.up_proj.weight": torch.full((4, 4), 2.0),
        "layers.0.mlp.down_proj.weight": torch.zeros(4, 4),
        "layers.0.input_layernorm.weight": torch.ones(4),
        "layers.0.post_attention_layernorm.weight": torch.ones(4),
        "norm.weight": torch.ones(4),
        "lm_head.weight": torch.zeros(8, 4),
    }
    full = importer.convert_hf_state_dict(sd, arch)
    qkv = full["decoder.layers.0.self_attention.linear_qkv.weight"][:, 0].tolist()
    assert qkv == [10, 11, 20, 30, 12, 13, 21, 31]
    fc1 = full["decoder.layers.0.mlp.linear_fc1.weight"][:, 0].tolist()
    assert fc1 == [1] * 4 + [2] * 4
    # TP=2: rank 1 holds group 1 whole, and the second halves of gate and of up.
    shard = importer.shard_megatron_state_dict(full, arch, 1, 2)
    qkv_1 = shard["decoder.layers.0.self_attention.linear_qkv.weight"][:, 0].tolist()
    assert qkv_1 == [12, 13, 21, 31]
    assert shard["decoder.layers.0.mlp.linear_fc1.weight"][:, 0].tolist() == [1, 1, 2, 2]


def test_arch_from_config_pads_vocab_and_records_true_size(tmp_path):
    path, _, _ = tiny_llama(tmp_path, tied=True)
    ckpt = importer.load_hf_checkpoint(path)
    arch = importer.arch_from_hf_config(ckpt.config, make_vocab_size_divisible_by=128)
    assert (arch.vocab_size, arch.padded_vocab_size) == (203, 256)
    assert arch.tie_embeddings and arch.query_groups == 2 and arch.rotary_base == 5000.0
    arch = importer.arch_from_hf_config(ckpt.config, make_vocab_size_divisible_by=8,
                                         vocab_size=200)
    assert (arch.vocab_size, arch.padded_vocab_size) == (200, 208)
    with pytest.raises(ValueError, match="exceeds"):
        importer.arch_from_hf_config(ckpt.config, vocab_size=300)


@pytest.mark.parametrize("change, match", [
    ({"model_type": "gpt2"}, "model_type"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"attention_bias": True}, "attention_bias"),
    # Llama-3's scaling with other frequency factors than Megatron-Core's fixed 1 and 4
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 2.0}},
     "high_freq_factor"),
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "'dynamic'"),
])
def test_unsupported_configs_are_refused(change, match):
    config = {"model_type": "llama", "hidden_size": 8, "num_attention_heads": 2,
              "num_key_value_heads": 1, "intermediate_size": 8, "num_hidden_layers": 1,
              "vocab_size": 16, "max_position_embeddings": 8, **change}
    with pytest.raises(ValueError, match=match):
        importer.arch_from_hf_config(config)


_QWEN3_MOE = {"model_type": "qwen3_moe", "hidden_size": 8, "num_attention_heads": 2,
              "num_key_value_heads": 1, "intermediate_size": 8, "num_hidden_layers": 1,
              "vocab_size": 16, "max_position_embeddings": 8, "head_dim": 8,
              "moe_intermediate_size": 4, "num_experts": 4, "num_experts_per_tok": 2}


@pytest.mark.parametrize("change, match", [
    ({"mlp_only_layers": [0]}, "mlp_only_layers"),
    ({"decoder_sparse_step": 2}, "decoder_sparse_step"),
    ({"use_sliding_window": True, "sliding_window": 4}, "sliding-window"),
    ({"layer_types": ["sliding_attention"]}, "sliding-window"),
    ({"num_experts": None}, "needs num_experts"),
    ({"num_experts_per_tok": 5}, "exceeds num_experts"),
])
def test_unsupported_qwen3_moe_configs_are_refused(change, match):
    config = {**_QWEN3_MOE, **change}
    if config["num_experts"] is None:
        del config["num_experts"]
    with pytest.raises(ValueError, match=match):
        importer.arch_from_hf_config(config)


def test_qwen3_moe_router_convention():
    # renormalised top-k probabilities == softmax over the top-k logits (Megatron's default)
    for norm, pre_softmax in ((True, False), (False, True)):
        arch = importer.arch_from_hf_config({**_QWEN3_MOE, "norm_topk_prob": norm})
        assert arch.moe_router_pre_softmax is pre_softmax
        assert (arch.num_experts, arch.moe_ffn_hidden_size, arch.qk_layernorm) == (4, 4, True)
    # transformers 5 writes num_local_experts in place of num_experts
    alias = {k: v for k, v in _QWEN3_MOE.items() if k != "num_experts"}
    assert importer.arch_from_hf_config({**alias, "num_local_experts": 4}).num_experts == 4


def test_expert_parallel_shard_renumbers_local_experts():
    arch = importer.arch_from_hf_config(_QWEN3_MOE)
    full = {f"decoder.layers.0.mlp.experts.local_experts.{e}.linear_fc2.weight":
            torch.full((8, 4), float(e)) for e in range(4)}
    full["decoder.layers.0.mlp.router.weight"] = torch.zeros(4, 8)
    shard = importer.shard_megatron_state_dict(full, arch, 0, 1, ep_rank=1, ep_size=2)
    assert sorted(shard) == ["decoder.layers.0.mlp.experts.local_experts.0.linear_fc2.weight",
                             "decoder.layers.0.mlp.experts.local_experts.1.linear_fc2.weight",
                             "decoder.layers.0.mlp.router.weight"]
    assert shard["decoder.layers.0.mlp.experts.local_experts.1.linear_fc2.weight"][0, 0] == 3
    # expert TP 2 splits an expert's fc2 columns while the attention stays whole at TP 1
    split = importer.shard_megatron_state_dict(full, arch, 0, 1, ep_rank=0, ep_size=2,
                                                etp_rank=1, etp_size=2)
    assert split["decoder.layers.0.mlp.experts.local_experts.0.linear_fc2.weight"].shape == (8, 2)


def test_missing_tensor_is_refused(tmp_path):
    path, _, _ = tiny_llama(tmp_path, tied=False)
    ckpt = importer.load_hf_checkpoint(path)
    arch = importer.arch_from_hf_config(ckpt.config)
    del ckpt.state_dict["layers.1.mlp.up_proj.weight"]
    with pytest.raises(ValueError, match="up_proj"):
        importer.convert_hf_state_dict(ckpt.state_dict, arch)


def test_check_tokenizer_compatible():
    vocab = {"a": 0, "b": 1, "ab": 2}
    same = importer.check_tokenizer_compatible(bpe_tokenizer(vocab, [("a", "b")]),
                                                bpe_tokenizer(dict(vocab), [("a", "b")]))
    assert same == 3
    with pytest.raises(importer.TokenizerMismatchError, match="different ids"):
        importer.check_tokenizer_compatible(
            bpe_tokenizer(vocab, [("a", "b")]),
            bpe_tokenizer({"a": 1, "b": 0, "ab": 2}, [("a", "b")]))
    with pytest.raises(importer.TokenizerMismatchError, match="only in student"):
        importer.check_tokenizer_compatible(
            bpe_tokenizer(vocab, [("a", "b")]),
            bpe_tokenizer({**vocab, "ba": 3}, [("a", "b"), ("b", "a")]))


def test_check_tokenizer_compatible_reads_paths(tmp_path):
    tok = bpe_tokenizer({"a": 0, "b": 1, "ab": 2}, [("a", "b")])
    tok.save(str(tmp_path / "tokenizer.json"))
    assert importer.check_tokenizer_compatible(tmp_path, str(tmp_path / "tokenizer.json")) == 3


def test_unpadded_odd_groups_refuse_tp2(tmp_path):
    from megatron_kd.arch import GPTArchConfig

    path, _, _ = tiny_llama(tmp_path, tied=True, groups=3, ffn=75, name="odd")
    arch = importer.arch_from_hf_config(importer.load_hf_checkpoint(path).config)
    assert isinstance(arch, GPTArchConfig)
    with pytest.raises(ValueError, match="num_query_groups=3"):
        check_layout(arch, ParallelLayout(tp=2), role=Role.FROZEN)


def test_cli_refuses_non_empty_save_dir(tmp_path):
    import argparse

    parser = argparse.ArgumentParser()
    importer.add_arguments(parser)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "x").write_text("")
    args = parser.parse_args(["--hf-path", str(tmp_path), "--save", str(tmp_path / "out")])
    with pytest.raises(ValueError, match="not empty"):
        importer.run(args)


_QWEN35 = {"model_type": "qwen3_5_text", "hidden_size": 8, "num_attention_heads": 2,
           "num_key_value_heads": 2, "intermediate_size": 8, "num_hidden_layers": 4,
           "vocab_size": 16, "max_position_embeddings": 8, "head_dim": 4,
           "linear_conv_kernel_dim": 4, "linear_key_head_dim": 2, "linear_value_head_dim": 3,
           "linear_num_key_heads": 2, "linear_num_value_heads": 4,
           "rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                               "partial_rotary_factor": 0.25, "mrope_section": [1, 1, 0]}}


def test_qwen35_config_mapping():
    arch = importer.arch_from_hf_config(_QWEN35)
    # no layer_types: derived as transformers does (every 4th layer full attention)
    assert arch.linear_attention_layers == [0, 1, 2]
    assert (arch.attention_output_gate, arch.qk_layernorm, arch.rotary_percent) == (
        True, True, 0.25)
    # the multimodal config: the text model is read from text_config, the outer tie kept
    nested = {"model_type": "qwen3_5", "tie_word_embeddings": True,
              "text_config": {**_QWEN35, "model_type": "qwen3_5_text",
                              "layer_types": ["linear_attention", "full_attention"] * 2}}
    arch = importer.arch_from_hf_config(nested)
    assert (arch.linear_attention_layers, arch.tie_embeddings) == ([0, 2], True)
    moe = importer.arch_from_hf_config({
        **_QWEN35, "model_type": "qwen3_5_moe_text", "intermediate_size": None,
        "moe_intermediate_size": 4, "num_experts": 4, "num_experts_per_tok": 2,
        "shared_expert_intermediate_size": 6})
    assert (moe.ffn_hidden_size, moe.moe_shared_expert_size, moe.moe_shared_expert_gate,
            moe.moe_router_pre_softmax) == (4, 6, True, False)


@pytest.mark.parametrize("change, match", [
    ({"layer_types": ["linear_attention", "sliding_attention"] * 2}, "layer_types"),
    ({"layer_types": ["linear_attention"] * 3}, "3 for 4 layers"),
    ({"linear_num_value_heads": 3}, "multiple of linear_num_key_heads"),
    ({"hidden_act": "gelu"}, "hidden_act"),
])
def test_unsupported_qwen35_configs_are_refused(change, match):
    with pytest.raises(ValueError, match=match):
        importer.arch_from_hf_config({**_QWEN35, **change})


def test_qwen35_deltanet_shard_splits_each_part_by_heads():
    arch = importer.arch_from_hf_config(_QWEN35)
    kd, vd, nv = 4, 12, 4  # 2 key heads of 2, 4 value heads of 3
    sizes = [kd, kd, vd, vd, nv, nv]  # in_proj = [q; k; v; z; b; a]
    in_proj = torch.cat([torch.full((n, 8), float(p)) for p, n in enumerate(sizes)])
    m = "decoder.layers.0.self_attention."
    full = {m + "in_proj.weight": in_proj, m + "A_log": torch.arange(4.0),
            m + "conv1d.weight": torch.arange(2 * kd + vd, dtype=torch.float).view(-1, 1, 1),
            m + "out_proj.weight": torch.zeros(8, vd), m + "out_norm.weight": torch.ones(3)}
    shard = importer.shard_megatron_state_dict(full, arch, 1, 2)
    expected = torch.cat([torch.full((n // 2, 8), float(p)) for p, n in enumerate(sizes)])
    assert torch.equal(shard[m + "in_proj.weight"], expected)
    assert shard[m + "A_log"].tolist() == [2.0, 3.0]
    # conv channels [q; k; v]: rank 1 holds q[2:4], k[6:8], v[14:20]
    assert shard[m + "conv1d.weight"].flatten().tolist() == [2, 3, 6, 7, 14, 15, 16, 17, 18, 19]
    assert shard[m + "out_proj.weight"].shape == (8, 6)
    assert shard[m + "out_norm.weight"].shape == (3,)
    with pytest.raises(ValueError, match="Gated DeltaNet"):
        importer.pad_for_tensor_parallel(full, arch, 2)
    # the layer pattern splits with the layers (each stage builds its own slice of it)
    check_layout(arch, ParallelLayout(pp=2), role=Role.FROZEN)
    check_layout(arch, ParallelLayout(pp=2, vp=2), role=Role.FROZEN)
    with pytest.raises(ValueError, match="pipeline-parallel size 3 does not divide num_layers=4"):
        check_layout(arch, ParallelLayout(pp=3), role=Role.FROZEN)


def test_qwen35_moe_multimodal_names_and_fused_experts(tmp_path):
    # The released checkpoints are multimodal (model.language_model.*, model.visual.*, mtp.*);
    # a model in memory holds its experts fused. Both convert to what the saved text model does.
    pytest.importorskip("transformers")
    # after the skip: both need transformers
    from support.hf_models import tiny_qwen35_moe
    from transformers import AutoModelForCausalLM

    path, _, _ = tiny_qwen35_moe(tmp_path)
    ckpt = importer.load_hf_checkpoint(path)
    arch = importer.arch_from_hf_config(ckpt.config)
    reference = importer.convert_hf_state_dict(ckpt.state_dict, arch)

    fused = AutoModelForCausalLM.from_pretrained(path).state_dict()
    assert "model.layers.0.mlp.experts.gate_up_proj" in fused
    multimodal = {k.replace("model.", "model.language_model.", 1): v for k, v in fused.items()}
    multimodal["model.visual.patch_embed.proj.weight"] = torch.zeros(2, 2)
    multimodal["mtp.fc.weight"] = torch.zeros(2, 2)
    nested = importer.arch_from_hf_config({"model_type": "qwen3_5_moe",
                                            "text_config": ckpt.config})
    assert nested == arch
    converted = importer.convert_hf_state_dict(multimodal, arch)
    assert sorted(converted) == sorted(reference)
    for name, t in reference.items():
        assert torch.equal(converted[name], t), name

