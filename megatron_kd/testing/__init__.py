"""Test support that ships with the package: a pool of gloo ranks on CPU (:mod:`.pool`); a
simulated accelerator (:mod:`.devices`, imported by name: it loads torch, the pool must not);
teacher replicas in processes of their own, for tests, tools and benchmarks (:mod:`.replicas`,
imported by name; :mod:`.slow_replica` is what a slow one runs)."""

from megatron_kd.testing.pool import DistPool, RankContext, RankFailure

__all__ = ["DistPool", "RankContext", "RankFailure"]
