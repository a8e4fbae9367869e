"""The gloo pool itself: results per rank, collectives, failures re-raised with the rank, and
workers that end with their parent."""

import signal
import subprocess
import sys
import time

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


_ORPHAN_PARENT = """
import sys, time
sys.path[:0] = {path!r}
from megatron_kd.testing import DistPool
pool = DistPool(2, {tmp!r})
print(" ".join(str(p) for p in pool.pids), flush=True)
time.sleep(600)  # killed by the test long before
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"  # a zombie has ended
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGTERM])
def test_workers_end_with_their_parent(tmp_path, how):
    """A test run killed outright leaves no gloo workers behind (they were once left running,
    parented to init)."""
    parent = subprocess.Popen(
        [sys.executable, "-c", _ORPHAN_PARENT.format(path=sys.path, tmp=str(tmp_path))],
        stdout=subprocess.PIPE, text=True)
    try:
        workers = [int(p) for p in parent.stdout.readline().split()]
        assert len(workers) == 2 and all(_alive(p) for p in workers)
        parent.send_signal(how)
        parent.wait(timeout=30)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and any(_alive(p) for p in workers):
            time.sleep(0.1)
        assert not any(_alive(p) for p in workers), workers
    finally:
        parent.kill()
        parent.wait()
