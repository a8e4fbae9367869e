"""Vocab-parallel windowed top-K log-probs against a dense float64 reference.

Tiers: no process group (the local maths, ties), then gloo ranks 1..4 with a vocabulary of
1009 (prime: never divides), padded or unevenly sharded, ids near the top of the range.
"""

import math

import numpy as np
import pytest
import torch
import torch.distributed as dist

from megatron_kd.cache.topk import TopKHelper, vocab_parallel_topk_logprobs

VOCAB = 1009
HIDDEN = 24


def _reference(hidden, weight, vocab_size, k):
    """Dense top-K: float64 logits over the true vocabulary, ties to the lower id (numpy)."""
    logits = hidden.reshape(-1, hidden.shape[-1]).double() @ weight[:vocab_size].double().t()
    logprobs = torch.log_softmax(logits, dim=-1).numpy()
    ids = np.empty((logprobs.shape[0], k), dtype=np.int64)
    for row in range(logprobs.shape[0]):
        # lexsort: last key is primary -> by log-prob descending, then id ascending.
        order = np.lexsort((np.arange(vocab_size), -logprobs[row]))[:k]
        ids[row] = order
    return ids, np.take_along_axis(logprobs, ids, 1)


def _problem(padded_vocab, seed=0, rows=(7, 3)):
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(padded_vocab, HIDDEN, generator=g)
    weight[VOCAB - 30:VOCAB] *= 2.5  # ids near the top of the range win often
    weight[VOCAB:] *= 20.0  # padding columns would dominate if they were not excluded
    hidden = torch.randn(*rows, HIDDEN, generator=g)
    hidden[2, 1] = 0.0  # all logits equal: ids 0..k-1 by the tie rule, log-prob -log(V)
    return hidden, weight


# --------------------------------------------------------------------------- no process group


def test_local_topk_ties_lower_column_wins():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0, 3.0],
                           [2.0, 2.0, 2.0, 2.0, 2.0, 2.0]])
    values, columns = TopKHelper.local_topk(logits, 3)
    assert columns.tolist() == [[1, 2, 4], [0, 1, 2]]
    assert values.tolist() == [[3.0, 3.0, 3.0], [2.0, 2.0, 2.0]]
    # Merge: (value desc, id asc), whatever the candidates' order.
    v, i = TopKHelper.merge(torch.tensor([[1.0, 5.0, 5.0, 7.0]]), torch.tensor([[0, 9, 4, 8]]), 3)
    assert i.tolist() == [[8, 4, 9]] and v.tolist() == [[7.0, 5.0, 5.0]]


@pytest.mark.parametrize("window_size", [1, 4, 1000])
@pytest.mark.parametrize("k", [1, 13, VOCAB])
def test_single_rank_matches_dense(window_size, k):
    hidden, weight = _problem(VOCAB + 7)
    ids, logprobs = vocab_parallel_topk_logprobs(hidden, weight, k, vocab_size=VOCAB,
                                                 window_size=window_size)
    assert ids.shape == (7, 3, k) and ids.dtype == torch.int64 and logprobs.dtype == torch.float32
    ref_ids, ref_lp = _reference(hidden, weight, VOCAB, k)
    np.testing.assert_array_equal(ids.reshape(-1, k).numpy(), ref_ids)
    # fp32 logits and log-sum-exp against float64: a few ulps of |logprob| <= ~20.
    np.testing.assert_allclose(logprobs.reshape(-1, k).numpy(), ref_lp, rtol=0, atol=2e-5)
    assert ids[2, 1].tolist() == list(range(k))
    np.testing.assert_allclose(logprobs[2, 1].numpy(), -math.log(VOCAB), rtol=1e-6)


def test_flat_rows_and_bad_input():
    hidden, weight = _problem(VOCAB)
    ids, _ = vocab_parallel_topk_logprobs(hidden.reshape(21, HIDDEN), weight, 5)
    assert ids.shape == (21, 5)
    with pytest.raises(ValueError, match=r"k=1010 must lie in \[1, vocab_size=1009\]"):
        vocab_parallel_topk_logprobs(hidden, weight, VOCAB + 1)
    with pytest.raises(ValueError, match=r"vocab_size=2000 must lie in \[1, 1009\]"):
        vocab_parallel_topk_logprobs(hidden, weight, 5, vocab_size=2000)
    with pytest.raises(ValueError, match=r"weight must be \[local_vocab_size, 24\]"):
        vocab_parallel_topk_logprobs(hidden, weight[:, :5], 5)


def test_teacher_dtype_bf16_runs_projection_in_bf16():
    hidden, weight = _problem(VOCAB)
    ids, logprobs = vocab_parallel_topk_logprobs(hidden.bfloat16(), weight.bfloat16(), 10,
                                                 window_size=8)
    assert logprobs.dtype == torch.float32
    # Probabilities still sum to <= 1 (bf16 logits, fp32 log-sum-exp).
    assert float(logprobs.exp().sum(-1).max()) <= 1.0 + 1e-5


# --------------------------------------------------------------------------- gloo, 1..4 ranks


def _shard_sizes(world, layout):
    if layout == "padded":  # Megatron: pad to a multiple of the TP size, equal shards
        local = -(-VOCAB // world)
        return [local] * world
    base, extra = divmod(VOCAB, world)  # uneven contiguous shards, no padding
    return [base + (r < extra) for r in range(world)]


def _case_topk(ctx, world, layout, k, window_size):
    group = ctx.group(world)
    if group is None:
        return None
    rank = dist.get_rank(group)
    sizes = _shard_sizes(world, layout)
    hidden, weight = _problem(sum(sizes), seed=world)
    start = sum(sizes[:rank])
    shard = weight[start:start + sizes[rank]].clone()
    ids, logprobs = vocab_parallel_topk_logprobs(
        hidden, shard, k, vocab_size=VOCAB, window_size=window_size,
        tp_group=group if world > 1 else None)
    ref_ids, ref_lp = _reference(hidden, weight, VOCAB, k)
    np.testing.assert_array_equal(ids.reshape(-1, k).numpy(), ref_ids)
    # fp32 against float64, as in the single-rank test.
    np.testing.assert_allclose(logprobs.reshape(-1, k).numpy(), ref_lp, rtol=0, atol=2e-5)
    assert ids[2, 1].tolist() == list(range(k))
    return ids.numpy(), logprobs.numpy()


@pytest.mark.parametrize("layout", ["padded", "uneven"])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_vocab_parallel_matches_dense(dist_pool_factory, world, layout):
    pool = dist_pool_factory(4)
    # k=300 exceeds every shard at 4 ranks (252..253 columns): candidates are padded.
    for k, window_size in [(13, 5), (300, 8)]:
        results = pool.run(_case_topk, world, layout, k, window_size)
        ids0, lp0 = results[0]
        for ids, lp in results[1:world]:  # every rank returns the same bytes
            np.testing.assert_array_equal(ids, ids0)
            np.testing.assert_array_equal(lp, lp0)
        assert int(ids0.max()) >= VOCAB - 30


# --------------------------------------------------------------------------- GPU


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_single_rank_cuda_matches_dense():
    hidden, weight = _problem(VOCAB + 7)
    ids, logprobs = vocab_parallel_topk_logprobs(hidden.cuda(), weight.cuda(), 13,
                                                 vocab_size=VOCAB, window_size=4)
    ref_ids, ref_lp = _reference(hidden, weight, VOCAB, 13)
    np.testing.assert_array_equal(ids.reshape(-1, 13).cpu().numpy(), ref_ids)
    # cuBLAS fp32 (TF32 off by default) sums in another order than the float64 reference.
    np.testing.assert_allclose(logprobs.reshape(-1, 13).cpu().numpy(), ref_lp, rtol=0,
                               atol=1e-4)
