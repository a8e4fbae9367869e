"""The planner's offline-cache size (``megatron_kd.planner.traffic.cache_bytes_per_token``, a
closed form: the planner imports no numpy) against the codec itself: ``cache build``'s encoding
of top-K ids spread at random over the vocabulary, at the vocabularies of the recipes' pairs.
And the figure the README quotes is the planner's."""

from __future__ import annotations

import os
import re

import numpy as np
import pytest

from megatron_kd.cache import codec
from megatron_kd.commands.cache import CacheBuildSection
from megatron_kd.planner import traffic

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _codec_bytes_per_token(vocab_size: int, topk: int, tokens: int, seed: int) -> float:
    """One sample of ``tokens`` tokens as the codec stores it (ids and log-probs, the sample's
    header included), per token: ids drawn at random without repeats within a token."""
    rng = np.random.default_rng(seed)
    ids = np.sort(np.stack([rng.choice(vocab_size, topk, replace=False) for _ in range(tokens)]),
                  axis=1)
    logprobs = np.log(rng.dirichlet(np.ones(topk), tokens) * 0.9).astype(np.float32)
    log1p = codec.LogprobCodec(name=CacheBuildSection.__dataclass_fields__[
        "logprob_encoding"].default)
    return (len(codec.encode_ids(ids, vocab_size)) + len(log1p.encode(logprobs))) / tokens


def test_the_planner_uses_the_codec_and_the_commands_defaults():
    assert traffic.CACHE_RICE_ESCAPE == codec.RICE_ESCAPE
    assert traffic.CACHE_MASS_BITS == codec.LogprobCodec(name="fp32").mass_bits
    default = CacheBuildSection.__dataclass_fields__["logprob_encoding"].default
    assert f"log1p-u{traffic.CACHE_LOGPROB_BITS}" == default


# Qwen3 / Qwen2.5 (151,936), Llama-3 (128,256), Qwen3.5 (248,320); K of cache build's examples
@pytest.mark.parametrize("vocab_size", [128_256, 151_936, 248_320])
@pytest.mark.parametrize("topk", [64, 100])
def test_the_planned_size_is_the_codecs(vocab_size, topk):
    planned = traffic.cache_bytes_per_token(vocab_size, topk)
    measured = _codec_bytes_per_token(vocab_size, topk, tokens=1024, seed=vocab_size + topk)
    # an expectation against one random sample of 1,024 tokens: its Rice quotients' spread
    # and the sample's 12-byte header keep the two within 0.5%
    assert measured == pytest.approx(planned, rel=5e-3)


def test_clustered_ids_take_less():
    """A teacher's top-K is not random: ids packed together take fewer bits than planned."""
    vocab, topk, tokens = 151_936, 100, 256
    ids = np.tile(np.arange(topk), (tokens, 1))
    stored = len(codec.encode_ids(ids, vocab)) / tokens + (topk * 11 + 16) / 8
    assert stored < traffic.cache_bytes_per_token(vocab, topk)


def test_the_readme_quotes_the_planned_size():
    """The README's "about N bytes a token at K = 100" for its vocabulary is the planner's."""
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        text = " ".join(f.read().split())
    found = re.search(r"about (\d+) bytes a token at K = 100, V = ([\d,]+)", text)
    assert found, "README.md quotes the cache's bytes a token"
    planned = traffic.cache_bytes_per_token(int(found.group(2).replace(",", "")), 100)
    assert int(found.group(1)) == round(planned)


def test_bad_sizes_are_refused_and_a_k_beyond_the_vocabulary_is_all_of_it():
    with pytest.raises(ValueError, match="topk=0, vocab_size=10"):
        traffic.cache_bytes_per_token(10, 0)
    # every id: gaps of 0, one unary terminator a gap at r = 0
    assert traffic.cache_bytes_per_token(64, 100) == traffic.cache_bytes_per_token(64, 64) == (
        64 * 1 + 64 * 11 + 16) / 8
