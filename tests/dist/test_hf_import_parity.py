"""``megatron-kd import-hf``: logits parity with transformers' own forward on 2 gloo ranks.

The import is saved at TP=1 and loaded through ``dist_checkpointing`` at TP=1 and TP=2 (the
vocabulary shards of the logits concatenated) and, for mixture-of-experts models, at expert
parallel 2, compared with transformers' ``LlamaForCausalLM``, ``Qwen3ForCausalLM``,
``Qwen3MoeForCausalLM``, ``GptOssForCausalLM``, ``Qwen3_5ForCausalLM`` and
``Qwen3_5MoeForCausalLM`` on the same tokens in fp32.
"""

from __future__ import annotations

import os

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from support.hf_models import (
    BATCH,
    SEQ,
    bpe_tokenizer,
    tiny_gpt_oss,
    tiny_llama,
    tiny_qwen3,
    tiny_qwen3_moe,
    tiny_qwen35,
    tiny_qwen35_moe,
)
from support.train_cases import case_import

from megatron_kd.hf import importer

# fp32 end to end; the two implementations sum in different orders (fused qkv, SwiGLU as one
# matmul, TP partial sums), so logits of size ~3 agree to ~1.2e-6 (measured). 1e-5 leaves ~10x
# margin for other BLAS builds while any layout error (a swapped head, gate/up, rotary half)
# gives O(0.1..1) differences.
ATOL = 1e-5
# Qwen3.5: both sides run the Gated DeltaNet as an fp32 chunked rule (exp of cumulative decays,
# a triangular solve), whose rounding dominates: logits of size ~6 agree to 1.1e-5 .. 2.2e-5
# (measured, dense and MoE, TP1/TP2/EP2, megatron-core 0.16.1 and 0.19.2), against ~1e-6 for
# Qwen3. 5e-5 keeps ~2x margin; a layout error (a norm without its +1, swapped z/b/a parts,
# a misplaced gate head) gives O(0.1..1).
ATOL_DELTANET = 5e-5



def case_logits(ctx, save_dir, tokens, tp_size, direct_from=None, ep_size=1, etp_size=None):
    """This rank's logits ``[b, s, V/tp]`` from the checkpoint (or converted straight from HF)."""
    from megatron.core import parallel_state

    from megatron_kd.integration import checkpoint, gpt
    from megatron_kd.integration.cpu_shim import device_context

    parallel_state.initialize_model_parallel(tp_size, 1, expert_model_parallel_size=ep_size,
                                             expert_tensor_parallel_size=etp_size)
    try:
        arch = checkpoint.read_checkpoint_arch(save_dir)
        model = gpt.build_gpt_model(arch, seed=123)
        if direct_from is None:
            checkpoint.load_model_checkpoint(model, save_dir)
        else:
            ckpt = importer.load_hf_checkpoint(direct_from)
            full = importer.convert_hf_state_dict(ckpt.state_dict, arch)
            importer.load_converted_into_model(
                model, full, arch, parallel_state.get_tensor_model_parallel_rank(), tp_size,
                parallel_state.get_expert_model_parallel_rank(), ep_size,
                parallel_state.get_expert_tensor_parallel_rank(),
                parallel_state.get_expert_tensor_parallel_world_size())
        model.eval()
        b, s = tokens.shape
        position_ids = torch.arange(s).unsqueeze(0).expand(b, s)
        # Megatron's mask convention: True = masked out (a future position).
        causal_mask = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1)[None, None]
        # device_context: as every production forward runs (the YaRN and sliding-window paths
        # make tensors on "cuda")
        with torch.no_grad(), device_context():
            logits = model(tokens, position_ids, causal_mask)  # [b, s, V/tp]
        return logits.float()
    finally:
        parallel_state.destroy_model_parallel()


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_logits_parity_tp1_tp2(tmp_path, dist_pool_factory, tied):
    pool = dist_pool_factory(2)
    hf_path, tokens, expected = tiny_llama(tmp_path, tied=tied)
    if tied:
        # A tokenizer with fewer tokens (150) than embedding rows (203), as Qwen's 151,665 vs
        # 151,936: its size is recorded as the true vocabulary, and it travels with the weights.
        vocab_map = {f"t{i}": i for i in range(150)}
        bpe_tokenizer(vocab_map, []).save(os.path.join(hf_path, "tokenizer.json"))
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
    hf_path, tokens, expected = tiny_llama(tmp_path, tied=True, groups=3, ffn=75, name="odd")
    save_dir = str(tmp_path / "megatron_padded")
    arch = pool.run(case_import, hf_path, save_dir, pad_for_tp=2)[0]
    assert (arch["num_attention_heads"], arch["num_query_groups"], arch["kv_channels"],
            arch["ffn_hidden_size"]) == (8, 4, 8, 76)
    vocab = expected.shape[-1]
    for tp in (1, 2):
        shards = pool.run(case_logits, save_dir, tokens, tp)[:tp]
        torch.testing.assert_close(torch.cat(shards, dim=-1)[..., :vocab], expected,
                                   atol=ATOL, rtol=0)


def test_llama3_rope_scaling_logits_parity_and_export(tmp_path, dist_pool_factory):
    """Llama-3.1 / 3.2's RoPE scaling (``rope_type`` "llama3", factor 32 as Llama-3.2's):
    the import's RoPE frequencies are transformers' own, its logits transformers' at TP 1 and
    TP 2, and the export writes the same ``rope_parameters`` back. Without the scaling the
    logits differ by ~1e-3 (two of the four frequencies move)."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from megatron_kd.arch import GPTArchConfig
    from megatron_kd.arch.hf_config import hf_config_from_arch

    pool = dist_pool_factory(2)
    hf_path, tokens, expected = tiny_llama(tmp_path, tied=False, llama3_rope_factor=32.0,
                                           name="llama3rope")
    save_dir = str(tmp_path / "megatron_llama3rope")
    arch = GPTArchConfig.from_dict(pool.run(case_import, hf_path, save_dir)[0])
    assert (arch.rope_scaling_factor, arch.rotary_base) == (32.0, 500000.0)
    config = LlamaConfig.from_pretrained(hf_path)
    theirs, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    ours = pool.run(case_inv_freq, save_dir)[0]
    torch.testing.assert_close(ours, theirs.float(), rtol=1e-6, atol=0)
    vocab = expected.shape[-1]
    for tp in (1, 2):
        shards = pool.run(case_logits, save_dir, tokens, tp)[:tp]
        torch.testing.assert_close(torch.cat(shards, dim=-1)[..., :vocab], expected,
                                   atol=ATOL, rtol=0)
    exported = hf_config_from_arch(arch)
    assert exported["rope_parameters"] == config.rope_parameters


def case_inv_freq(ctx, save_dir):
    """The RoPE frequencies of the model built from ``save_dir``'s architecture."""
    from megatron.core import parallel_state

    from megatron_kd.integration import checkpoint, gpt

    parallel_state.initialize_model_parallel(1, 1)
    try:
        model = gpt.build_gpt_model(checkpoint.read_checkpoint_arch(save_dir), seed=1)
        return model.rotary_pos_emb.inv_freq.detach().float().cpu()
    finally:
        parallel_state.destroy_model_parallel()


_QWEN_MODELS = {
    "qwen3": lambda tmp: tiny_qwen3(tmp),
    "qwen3_moe": lambda tmp: tiny_qwen3_moe(tmp),
    "qwen3_moe_softmax_topk": lambda tmp: tiny_qwen3_moe(tmp, norm_topk_prob=False,
                                                         name="moe_pre"),
}


@pytest.mark.parametrize("family", sorted(_QWEN_MODELS))
def test_qwen3_logits_parity_tp_ep(tmp_path, dist_pool_factory, family):
    pool = dist_pool_factory(2)
    hf_path, tokens, expected = _QWEN_MODELS[family](tmp_path)
    save_dir = str(tmp_path / "megatron")
    arch = pool.run(case_import, hf_path, save_dir)[0]
    assert arch["qk_layernorm"] is True
    assert arch["kv_channels"] == 16  # head_dim 16 != hidden 48 / 4 heads
    moe = arch["num_experts"] is not None
    assert moe is family.startswith("qwen3_moe")
    if moe:
        assert (arch["num_experts"], arch["moe_ffn_hidden_size"], arch["moe_router_topk"]) == (
            4, 24, 2)
        assert arch["moe_router_pre_softmax"] is family.endswith("softmax_topk")
    vocab = expected.shape[-1]
    # (tp, ep, expert tp) on 2 ranks; EP 2 at TP 2 folds the experts over the TP ranks
    layouts = [(1, 1, None), (2, 1, None)] + ([(1, 2, None), (2, 2, 1)] if moe else [])
    for tp, ep, etp in layouts:
        shards = pool.run(case_logits, save_dir, tokens, tp, ep_size=ep, etp_size=etp)
        full = torch.cat(shards[:tp], dim=-1)[..., :vocab]
        torch.testing.assert_close(full, expected, atol=ATOL, rtol=0,
                                   msg=lambda m, tp=tp, ep=ep: f"TP{tp} EP{ep}: {m}")
        if tp == 1:  # the other rank (data- or expert-parallel) computes the same logits
            torch.testing.assert_close(shards[1], shards[0], atol=0, rtol=0)
    if moe:  # the in-memory EP split (no checkpoint round trip) gives the same logits
        direct = pool.run(case_logits, save_dir, tokens, 2, direct_from=hf_path, ep_size=2,
                          etp_size=1)
        torch.testing.assert_close(torch.cat(direct, dim=-1)[..., :vocab], expected, atol=ATOL,
                                   rtol=0)


def test_gpt_oss_logits_parity_tp_ep(tmp_path, dist_pool_factory):
    pool = dist_pool_factory(2)
    hf_path, tokens, expected = tiny_gpt_oss(tmp_path)
    save_dir = str(tmp_path / "megatron")
    arch = pool.run(case_import, hf_path, save_dir)[0]
    assert (arch["attention_sinks"], arch["window_size"], arch["window_layers"]) == (True, 4,
                                                                                     [0, 2])
    assert (arch["position_embedding_type"], arch["yarn_factor"]) == ("yarn", 32.0)
    assert (arch["gated_activation"], arch["activation_clamp"]) == ("quick_gelu", 7.0)
    vocab = expected.shape[-1]
    # biased experts: expert TP 1 (Megatron-Core's rule), so TP 2 folds the experts
    for tp, ep in ((1, 1), (2, 1), (1, 2), (2, 2)):
        shards = pool.run(case_logits, save_dir, tokens, tp, ep_size=ep, etp_size=1)
        full = torch.cat(shards[:tp], dim=-1)[..., :vocab]
        # logits of size ~3; measured 3e-7 relative (fp32, another summation order)
        torch.testing.assert_close(full, expected, atol=ATOL, rtol=0,
                                   msg=lambda m, tp=tp, ep=ep: f"TP{tp} EP{ep}: {m}")


@pytest.mark.parametrize("family", ["qwen35", "qwen35_moe"])
def test_qwen35_logits_parity_tp(tmp_path, dist_pool_factory, family):
    # Gated DeltaNet layers (Megatron's torch chunked rule on CPU, cpu_shim) between gated
    # attention layers with partial RoPE; the x * (1 + w) norms imported as x * w'.
    pool = dist_pool_factory(2)
    moe = family == "qwen35_moe"
    hf_path, tokens, expected = (tiny_qwen35_moe if moe else tiny_qwen35)(tmp_path)
    save_dir = str(tmp_path / "megatron")
    arch = pool.run(case_import, hf_path, save_dir)[0]
    assert (arch["attention_output_gate"], arch["qk_layernorm"], arch["rotary_percent"]) == (
        True, True, 0.25)
    assert arch["linear_attention_layers"] == ([0, 1, 2] if moe else [0, 2])
    assert (arch["linear_num_key_heads"], arch["linear_num_value_heads"]) == (2, 4)
    if moe:
        assert (arch["num_experts"], arch["moe_router_topk"], arch["moe_shared_expert_size"],
                arch["moe_shared_expert_gate"]) == (4, 2, 40, True)
    vocab = expected.shape[-1]
    layouts = [(1, 1, None), (2, 1, None)] + ([(1, 2, None), (2, 2, 1)] if moe else [])
    for tp, ep, etp in layouts:
        shards = pool.run(case_logits, save_dir, tokens, tp, ep_size=ep, etp_size=etp)
        full = torch.cat(shards[:tp], dim=-1)[..., :vocab]
        torch.testing.assert_close(full, expected, atol=ATOL_DELTANET, rtol=0,
                                   msg=lambda m, tp=tp, ep=ep: f"TP{tp} EP{ep}: {m}")
        if tp == 1:
            torch.testing.assert_close(shards[1], shards[0], atol=0, rtol=0)
    # the in-memory TP split of the DeltaNet's fused parts equals the checkpoint's reshard
    direct = pool.run(case_logits, save_dir, tokens, 2, direct_from=hf_path)
    torch.testing.assert_close(torch.cat(direct, dim=-1)[..., :vocab], expected,
                               atol=ATOL_DELTANET, rtol=0)


def case_param_count(ctx, save_dir):
    """Parameters of the imported model at TP 1 (vocabulary padding rows left out)."""
    from megatron.core import parallel_state

    from megatron_kd.integration import checkpoint, gpt

    parallel_state.initialize_model_parallel(1, 1)
    try:
        arch = checkpoint.read_checkpoint_arch(save_dir)
        model = gpt.build_gpt_model(arch, seed=1)
        total = sum(p.numel() for p in model.parameters())
        padding = (arch.padded_vocab_size - arch.vocab_size) * arch.hidden_size
        return total - padding * (1 if arch.tie_embeddings else 2)
    finally:
        parallel_state.destroy_model_parallel()


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen3_moe", "gpt_oss", "qwen35",
                                    "qwen35_moe"])
def test_planner_counts_the_imported_parameters(tmp_path, dist_pool_factory, family):
    # One config, three counts: the planner's model of it and of the checkpoint imported from it
    # (what `megatron-kd plan` sizes a model with), the tensors transformers saved, and the
    # Megatron-Core model imported.
    from safetensors.torch import load_file

    from megatron_kd.planner.presets import load_model

    make = {"llama": lambda t: tiny_llama(t, tied=False), "qwen3": tiny_qwen3,
            "qwen3_moe": tiny_qwen3_moe, "gpt_oss": tiny_gpt_oss, "qwen35": tiny_qwen35,
            "qwen35_moe": tiny_qwen35_moe}[family]
    hf_path, _, _ = make(tmp_path)
    saved = sum(t.numel() for t in load_file(os.path.join(hf_path, "model.safetensors")).values())
    save_dir = str(tmp_path / "megatron")
    pool = dist_pool_factory(2)
    pool.run(case_import, hf_path, save_dir)
    imported = pool.run(case_param_count, save_dir)[0]
    assert imported == saved
    assert load_model(os.path.join(hf_path, "config.json")).total_params() == saved
    assert load_model(save_dir).total_params() == saved
