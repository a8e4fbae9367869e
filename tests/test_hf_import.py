"""``megatron-kd import-hf``: logits parity with transformers' own forward, and bad input.

Tiers: pure conversion checks (no process group), then 2 gloo ranks: the import is saved at
TP=1 and loaded through ``dist_checkpointing`` at TP=1 and TP=2 (the vocabulary shards of the
logits concatenated), compared with ``LlamaForCausalLM`` on the same tokens in fp32.
"""

from __future__ import annotations

import os

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from megatron_kd import hf_import

# fp32 end to end; the two implementations sum in different orders (fused qkv, SwiGLU as one
# matmul, TP partial sums), so logits of size ~3 agree to ~1.2e-6 (measured). 1e-5 leaves ~10x
# margin for other BLAS builds while any layout error (a swapped head, gate/up, rotary half)
# gives O(0.1..1) differences.
ATOL = 1e-5

SEQ = 13  # odd, not a power of two
BATCH = 2


def _tiny_llama(tmp_path, *, tied: bool, vocab: int = 203, name: str = "hf", groups: int = 2,
                ffn: int = 72):
    """A randomly initialised tiny Llama (GQA: 6 heads in ``groups`` groups) as safetensors."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab,  # odd: padded to 256 by the import
        hidden_size=48,
        intermediate_size=ffn,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=groups,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
        rope_theta=5000.0,
        tie_word_embeddings=tied,
        attention_bias=False,
        mlp_bias=False,
    )
    torch.manual_seed(7 if tied else 8)
    model = LlamaForCausalLM(config).float().eval()
    with torch.no_grad():
        for name_, p in model.named_parameters():
            if "norm" in name_:  # non-trivial norm weights, so a swapped norm is caught
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.1)
    out = os.path.join(tmp_path, f"{name}_{'tied' if tied else 'untied'}")
    model.save_pretrained(out, safe_serialization=True)
    torch.manual_seed(0)
    tokens = torch.randint(0, vocab, (BATCH, SEQ))
    with torch.no_grad():
        logits = model(tokens).logits  # [b, s, V]
    return out, tokens, logits


# ---------------------------------------------------------------- tier 0: no process group


def test_qkv_layout_groups_heads_like_repeat_kv():
    # Head i of q uses kv head i // (nh/ng) in HF; Megatron reads q heads of group g then k_g, v_g.
    from megatron_kd.models import GPTArchConfig

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
    full = hf_import.convert_hf_state_dict(sd, arch)
    qkv = full["decoder.layers.0.self_attention.linear_qkv.weight"][:, 0].tolist()
    assert qkv == [10, 11, 20, 30, 12, 13, 21, 31]
    fc1 = full["decoder.layers.0.mlp.linear_fc1.weight"][:, 0].tolist()
    assert fc1 == [1] * 4 + [2] * 4
    # TP=2: rank 1 holds group 1 whole, and the second halves of gate and of up.
    shard = hf_import.shard_megatron_state_dict(full, arch, 1, 2)
    qkv_1 = shard["decoder.layers.0.self_attention.linear_qkv.weight"][:, 0].tolist()
    assert qkv_1 == [12, 13, 21, 31]
    assert shard["decoder.layers.0.mlp.linear_fc1.weight"][:, 0].tolist() == [1, 1, 2, 2]


def test_arch_from_config_pads_vocab_and_records_true_size(tmp_path):
    path, _, _ = _tiny_llama(tmp_path, tied=True)
    ckpt = hf_import.load_hf_checkpoint(path)
    arch = hf_import.arch_from_hf_config(ckpt.config, make_vocab_size_divisible_by=128)
    assert (arch.vocab_size, arch.padded_vocab_size) == (203, 256)
    assert arch.tie_embeddings and arch.query_groups == 2 and arch.rotary_base == 5000.0
    arch = hf_import.arch_from_hf_config(ckpt.config, make_vocab_size_divisible_by=8,
                                         vocab_size=200)
    assert (arch.vocab_size, arch.padded_vocab_size) == (200, 208)
    with pytest.raises(ValueError, match="exceeds"):
        hf_import.arch_from_hf_config(ckpt.config, vocab_size=300)


@pytest.mark.parametrize("change, match", [
    ({"model_type": "gpt2"}, "model_type"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"attention_bias": True}, "attention_bias"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "llama3"),
])
def test_unsupported_configs_are_refused(change, match):
    config = {"model_type": "llama", "hidden_size": 8, "num_attention_heads": 2,
              "num_key_value_heads": 1, "intermediate_size": 8, "num_hidden_layers": 1,
              "vocab_size": 16, "max_position_embeddings": 8, **change}
    with pytest.raises(ValueError, match=match):
        hf_import.arch_from_hf_config(config)


def test_missing_tensor_is_refused(tmp_path):
    path, _, _ = _tiny_llama(tmp_path, tied=False)
    ckpt = hf_import.load_hf_checkpoint(path)
    arch = hf_import.arch_from_hf_config(ckpt.config)
    del ckpt.state_dict["layers.1.mlp.up_proj.weight"]
    with pytest.raises(ValueError, match="up_proj"):
        hf_import.convert_hf_state_dict(ckpt.state_dict, arch)


def _bpe_tokenizer(vocab: dict[str, int], merges: list[tuple[str, str]]):
    from tokenizers import Tokenizer, models

    return Tokenizer(models.BPE(vocab=vocab, merges=merges))


def test_check_tokenizer_compatible():
    vocab = {"a": 0, "b": 1, "ab": 2}
    same = hf_import.check_tokenizer_compatible(_bpe_tokenizer(vocab, [("a", "b")]),
                                                _bpe_tokenizer(dict(vocab), [("a", "b")]))
    assert same == 3
    with pytest.raises(hf_import.TokenizerMismatchError, match="different ids"):
        hf_import.check_tokenizer_compatible(
            _bpe_tokenizer(vocab, [("a", "b")]),
            _bpe_tokenizer({"a": 1, "b": 0, "ab": 2}, [("a", "b")]))
    with pytest.raises(hf_import.TokenizerMismatchError, match="only in student"):
        hf_import.check_tokenizer_compatible(
            _bpe_tokenizer(vocab, [("a", "b")]),
            _bpe_tokenizer({**vocab, "ba": 3}, [("a", "b"), ("b", "a")]))


def test_check_tokenizer_compatible_reads_paths(tmp_path):
    tok = _bpe_tokenizer({"a": 0, "b": 1, "ab": 2}, [("a", "b")])
    tok.save(str(tmp_path / "tokenizer.json"))
    assert hf_import.check_tokenizer_compatible(tmp_path, str(tmp_path / "tokenizer.json")) == 3


# ---------------------------------------------------------------- tier 1: 2 gloo ranks


def case_import(ctx, hf_path, save_dir, pad_for_tp=1):
    """Every rank takes part in the (collective) dist_checkpointing save at TP=1."""
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(1, 1)
    try:
        arch = hf_import.import_hf(hf_path, save_dir, pad_for_tp=pad_for_tp)
    finally:
        parallel_state.destroy_model_parallel()
    return arch.to_dict()


def case_logits(ctx, save_dir, tokens, tp_size, direct_from=None):
    """This rank's logits ``[b, s, V/tp]`` from the checkpoint (or converted straight from HF)."""
    from megatron.core import parallel_state

    from megatron_kd import models

    parallel_state.initialize_model_parallel(tp_size, 1)
    try:
        arch = models.read_checkpoint_arch(save_dir)
        model = models.build_gpt_model(arch, seed=123)
        if direct_from is None:
            models.load_model_checkpoint(model, save_dir)
        else:
            ckpt = hf_import.load_hf_checkpoint(direct_from)
            full = hf_import.convert_hf_state_dict(ckpt.state_dict, arch)
            hf_import.load_converted_into_model(
                model, full, arch, parallel_state.get_tensor_model_parallel_rank(), tp_size)
        model.eval()
        b, s = tokens.shape
        position_ids = torch.arange(s).unsqueeze(0).expand(b, s)
        # Megatron's mask convention: True = masked out (a future position).
        causal_mask = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1)[None, None]
        with torch.no_grad():
            logits = model(tokens, position_ids, causal_mask)  # [b, s, V/tp]
        return logits.float()
    finally:
        parallel_state.destroy_model_parallel()


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_logits_parity_tp1_tp2(tmp_path, dist_pool_factory, tied):
    pool = dist_pool_factory(2)
    hf_path, tokens, expected = _tiny_llama(tmp_path, tied=tied)
    if tied:
        # A tokenizer with fewer tokens (150) than embedding rows (203), as Qwen's 151,665 vs
        # 151,936: its size is recorded as the true vocabulary, and it travels with the weights.
        vocab_map = {f"t{i}": i for i in range(150)}
        _bpe_tokenizer(vocab_map, []).save(os.path.join(hf_path, "tokenizer.json"))
    save_dir = str(tmp_path / "megatron")
    arch = pool.run(case_import, hf_path, save_dir)[0]
    assert arch["tie_embeddings"] is tied
    assert (arch["vocab_size"], arch["padded_vocab_size"]) == (150 if tied else 203, 256)
    assert os.path.isfile(os.path.join(save_dir, "model_config.json"))
    assert os.path.isfile(os.path.join(save_dir, "tokenizer.json")) is tied
    vocab = expected.shape[-1]

    # TP=1 on two data-parallel ranks: each has the whole (padded) vocabulary.
    for logits in pool.run(case_logits, save_dir, tokens, 1):
        assert logits.shape == (BATCH, SEQ, 256)
        torch.testing.assert_close(logits[..., :vocab], expected, atol=ATOL, rtol=0)
        assert torch.all(logits[..., vocab:] == 0)  # zero padding rows give zero logits

    # TP=2: dist_checkpointing reshards; the vocabulary shards concatenate to the full logits.
    shards = pool.run(case_logits, save_dir, tokens, 2)
    assert shards[0].shape == (BATCH, SEQ, 128)
    torch.testing.assert_close(torch.cat(shards, dim=-1)[..., :vocab], expected, atol=ATOL, rtol=0)

    # The in-memory sharding (no checkpoint round trip) gives the same logits at TP=2.
    direct = pool.run(case_logits, save_dir, tokens, 2, direct_from=hf_path)
    torch.testing.assert_close(torch.cat(direct, dim=-1), torch.cat(shards, dim=-1),
                               atol=0, rtol=0)


def test_logits_parity_with_heads_padded_for_tp2(tmp_path, dist_pool_factory):
    # 6 heads in 3 groups and an MLP width of 75 do not split 2 ways: the import pads them
    # with exactly-neutral dummy heads / MLP units (8 heads in 4 groups, width 76).
    pool = dist_pool_factory(2)
    hf_path, tokens, expected = _tiny_llama(tmp_path, tied=True, groups=3, ffn=75, name="odd")
    save_dir = str(tmp_path / "megatron_padded")
    arch = pool.run(case_import, hf_path, save_dir, pad_for_tp=2)[0]
    assert (arch["num_attention_heads"], arch["num_query_groups"], arch["kv_channels"],
            arch["ffn_hidden_size"]) == (8, 4, 8, 76)
    vocab = expected.shape[-1]
    for tp in (1, 2):
        shards = pool.run(case_logits, save_dir, tokens, tp)[:tp]
        torch.testing.assert_close(torch.cat(shards, dim=-1)[..., :vocab], expected,
                                   atol=ATOL, rtol=0)


def test_unpadded_odd_groups_refuse_tp2(tmp_path):
    from megatron_kd.models import GPTArchConfig

    path, _, _ = _tiny_llama(tmp_path, tied=True, groups=3, ffn=75, name="odd")
    arch = hf_import.arch_from_hf_config(hf_import.load_hf_checkpoint(path).config)
    assert isinstance(arch, GPTArchConfig)
    with pytest.raises(ValueError, match="num_query_groups=3"):
        arch.check_tensor_parallel(2)


def test_cli_refuses_non_empty_save_dir(tmp_path):
    import argparse

    parser = argparse.ArgumentParser()
    hf_import.add_arguments(parser)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "x").write_text("")
    args = parser.parse_args(["--hf-path", str(tmp_path), "--save", str(tmp_path / "out")])
    with pytest.raises(ValueError, match="not empty"):
        hf_import.run(args)
