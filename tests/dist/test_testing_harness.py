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
from megatron_kd.testing import DistPool, pool as pool_module
pool_module.PRELOAD = ("torch",)  # the fork server as by default, less to import
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


def _group_count_after_making(ctx, keep):
    from torch.distributed import distributed_c10d as c10d

    made = [dist.new_group([0, 1]), dist.new_group([0, 1])]
    if keep:
        ctx.state["kept"] = made[:1]
    t = torch.ones(1)
    dist.all_reduce(t, group=made[-1])
    return len(c10d._world.pg_map), t.item()


def _groups_now(ctx):
    from torch.distributed import distributed_c10d as c10d

    kept = ctx.state.get("kept", [])
    if kept:  # a group kept in ctx.state still works
        t = torch.ones(1)
        dist.all_reduce(t, group=kept[0])
        assert t.item() == 2.0
    return len(c10d._world.pg_map)


def test_groups_a_case_leaves_are_destroyed_unless_kept_in_state(dist_pool_factory):
    # Megatron-Core's destroy_model_parallel leaves its gloo groups (threads, sockets) alive;
    # a long-lived worker once piled up 3,900 threads that way.
    pool = dist_pool_factory(2)
    base = pool.run(_groups_now)  # per rank (a rank outside a prefix group holds none)
    counts = pool.run(_group_count_after_making, False)
    assert counts == [(b + 2, 2.0) for b in base]  # both existed inside the case
    assert pool.run(_groups_now) == base
    pool.run(_group_count_after_making, True)
    assert pool.run(_groups_now) == [b + 1 for b in base]
    # a group of rank 0 alone: rank 1 holds no handle to it, and both go on to the next case
    pool.run(_make_group_of_rank_zero)
    assert pool.run(_sum_of_ranks, 1.0, timeout=60) == [1.0, 1.0]
    assert pool.run(_groups_now) == [b + 1 for b in base]


def _make_group_of_rank_zero(ctx):
    dist.new_group([0])


def _env_var(ctx, name):
    import os

    return os.environ.get(name)


@pytest.mark.parametrize("start_method", ["forkserver", "spawn"])
def test_workers_get_the_runners_environment_at_pool_start(tmp_path, monkeypatch, start_method):
    # A forked worker starts from the fork server's environment: the runner's is handed over.
    from megatron_kd.testing import DistPool

    monkeypatch.setenv("KD_POOL_PROBE", "before")
    with DistPool(2, tmp_path, start_method=start_method, env={"KD_POOL_EXTRA": "x"}) as pool:
        monkeypatch.setenv("KD_POOL_PROBE", "after")
        assert pool.run(_env_var, "KD_POOL_PROBE") == ["before", "before"]
        assert pool.run(_env_var, "KD_POOL_EXTRA") == ["x", "x"]
        assert pool.run(_env_var, "OMP_NUM_THREADS") == ["1", "1"]
