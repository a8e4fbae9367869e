"""Vocab-parallel windowed top-K log-probs on gloo ranks 1..4 against a dense float64 reference:
a vocabulary of 1009 (prime: never divides), padded or unevenly sharded, ids near the top."""


import numpy as np
import pytest
import torch.distributed as dist
from support.topk_cases import VOCAB, reference_topk, topk_problem

from megatron_kd.cache.topk import vocab_parallel_topk_logprobs


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
    hidden, weight = topk_problem(sum(sizes), seed=world)
    start = sum(sizes[:rank])
    shard = weight[start:start + sizes[rank]].clone()
    ids, logprobs = vocab_parallel_topk_logprobs(
        hidden, shard, k, vocab_size=VOCAB, window_size=window_size,
        tp_group=group if world > 1 else None)
    ref_ids, ref_lp = reference_topk(hidden, weight, VOCAB, k)
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
