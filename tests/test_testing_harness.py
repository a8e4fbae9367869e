"""The gloo pool itself: results per rank, collectives, failures re-raised with the rank."""

import pytest
import torch
import torch.distributed as dist

from megatron_kd.testing import RankFailure


def _sum_of_ranks(ctx, scale):
    t = torch.tensor([float(ctx.rank) * scale])
    dist.all_reduce(t)
    return t.item()


def _fail_on_rank_one(ctx):
    if ctx.rank == 1:
        raise ValueError("boom on purpose")
    return ctx.rank


def _prefix_group_sizes(ctx):
    g = ctx.group(2)
    return None if g is None else dist.get_world_size(g)


def test_pool_runs_collectives(dist_pool_factory):
    pool = dist_pool_factory(3)
    assert pool.run(_sum_of_ranks, 2.0) == [6.0, 6.0, 6.0]


def test_pool_reraises_with_rank_and_recovers(dist_pool_factory):
    pool = dist_pool_factory(3)
    with pytest.raises(RankFailure, match=r"(?s)rank 1.*boom on purpose"):
        pool.run(_fail_on_rank_one)
    # the pool is usable again afterwards
    assert pool.run(_prefix_group_sizes) == [2, 2, None]
