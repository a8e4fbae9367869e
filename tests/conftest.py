"""Shared fixtures: a module-scoped pool of gloo ranks (see megatron_kd.testing)."""

import pytest

from megatron_kd.testing import DistPool


@pytest.fixture(scope="module")
def dist_pool_factory(tmp_path_factory):
    """``dist_pool_factory(n)``: a pool of n gloo ranks, started once per test module."""
    pools: dict[int, DistPool] = {}

    def get(world_size: int) -> DistPool:
        if world_size not in pools:
            pools[world_size] = DistPool(world_size, tmp_path_factory.mktemp(f"dist{world_size}"))
        return pools[world_size]

    yield get
    for pool in pools.values():
        pool.close()
