"""A tiny random Llama saved as safetensors, with transformers' own logits on fixed tokens: the
independent reference of the import tests."""

from __future__ import annotations

import os

import torch

SEQ = 13  # odd, not a power of two
BATCH = 2


def tiny_llama(tmp_path, *, tied: bool, vocab: int = 203, name: str = "hf", groups: int = 2,
                ffn: int = 72):
    """A randomly initialised tiny Llama (GQA: 6 heads in ``groups`` groups) as safetensors."""
    from transformers import LlamaConfig, LlamaForCausalLM  # the tests skip without it

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


def bpe_tokenizer(vocab: dict[str, int], merges: list[tuple[str, str]]):
    """A ``tokenizers`` BPE tokenizer from a vocabulary and merges."""
    from tokenizers import Tokenizer, models  # the tests skip without it

    return Tokenizer(models.BPE(vocab=vocab, merges=merges))
