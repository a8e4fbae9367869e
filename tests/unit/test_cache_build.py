"""Building a cache from a tiny torch teacher in one process: reference parity at a large
vocabulary, and resumption after torn writes."""


import numpy as np
from support.cache_cases import TinyTeacher, cache_files, cache_spec
from support.topk_cases import reference_topk

from megatron_kd.cache.build import build_cache
from megatron_kd.cache.format import load_manifest, verify
from megatron_kd.cache.reader import TopKCacheReader


def test_build_matches_reference_large_vocab(tmp_path):
    # Above Megatron's 131,072 limit; the reader returns each token's entries by ascending id.
    teacher = TinyTeacher(vocab_size=150_001, padded_vocab=150_016, seq_length=8)
    spec = cache_spec(teacher, num_samples=5, topk=20, samples_per_shard=2)
    stats = build_cache(str(tmp_path), spec, teacher_forward_fn=teacher,
                sample_tokens_fn=teacher.sample_tokens,
                        output_weight=teacher.output, micro_batch_size=2, window_size=5)
    assert stats.shards_written == [0, 1, 2] and stats.tokens == 40
    assert verify(tmp_path) == []
    reader = TopKCacheReader(tmp_path)
    ids, logprobs = reader.get(range(5))
    # the independent float64 dense reference (not the top-K function the build calls)
    hidden = teacher(list(range(5))).transpose(0, 1)  # [b, s, h]
    ref_ids, ref_lp = reference_topk(hidden, teacher.output, 150_001, 20)
    ref_ids, ref_lp = ref_ids.reshape(5, 8, 20), ref_lp.reshape(5, 8, 20)
    order = np.argsort(ref_ids, axis=-1)
    np.testing.assert_array_equal(ids, np.take_along_axis(ref_ids, order, -1))
    # fp32 logits and log-sum-exp over 150,001 columns against float64: a few ulps of
    # |logprob| <= 30.
    np.testing.assert_allclose(logprobs, np.take_along_axis(ref_lp, order, -1), rtol=2e-6,
                               atol=1e-5)
    assert ids.max() >= 150_001 - 10
    # Resume of a complete cache: nothing to do.
    again = build_cache(str(tmp_path), spec, teacher_forward_fn=teacher,
                sample_tokens_fn=teacher.sample_tokens,
                        output_weight=teacher.output)
    assert again.shards_written == [] and again.shards_skipped == [0, 1, 2]


def test_resume_after_torn_writes_is_byte_identical(tmp_path):
    """The states a kill can leave: a partial temp file, a renamed shard not yet in the manifest."""
    teacher = TinyTeacher(vocab_size=1009, padded_vocab=1009, seq_length=6)
    spec = cache_spec(teacher, num_samples=7, topk=11, samples_per_shard=2, codec="log1p-u11")
    build_cache(str(tmp_path / "ref"), spec, teacher_forward_fn=teacher,
                sample_tokens_fn=teacher.sample_tokens,
                output_weight=teacher.output)
    ref = cache_files(tmp_path / "ref")

    torn = tmp_path / "torn"
    build_cache(str(torn), spec, teacher_forward_fn=lambda idx: teacher(idx),
                sample_tokens_fn=teacher.sample_tokens,
                output_weight=teacher.output, dp_rank=0, dp_world_size=2)  # shards 0 and 2
    (torn / f".{spec.shard_file(1)}.tmp.999").write_bytes(b"partial")
    (torn / ".manifest.json.tmp.999").write_bytes(b"{partial")
    (torn / spec.shard_file(3)).write_bytes(ref[spec.shard_file(3)])  # renamed, not recorded
    assert len(load_manifest(torn)["shards"]) == 2
    build_cache(str(torn), spec, teacher_forward_fn=teacher,
                sample_tokens_fn=teacher.sample_tokens, output_weight=teacher.output)
    assert cache_files(torn) == ref
