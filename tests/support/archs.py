"""A tiny GPT architecture for the model and checkpoint tests."""

from megatron_kd.arch import GPTArchConfig


def tiny_arch(**overrides) -> GPTArchConfig:
    kw = {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "num_query_groups": 2,
              "ffn_hidden_size": 64, "vocab_size": 500, "padded_vocab_size": 512,
              "max_position_embeddings": 32}
    kw.update(overrides)
    return GPTArchConfig(**kw)
