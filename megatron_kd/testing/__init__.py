"""Test support that ships with the package: a pool of gloo ranks on CPU (:mod:`.pool`); a
simulated accelerator (:mod:`.devices`, imported by name: it loads torch, the pool must not)."""

from megatron_kd.testing.pool import DistPool, RankContext, RankFailure

__all__ = ["DistPool", "RankContext", "RankFailure"]
