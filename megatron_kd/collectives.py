"""The two gather / scatter collectives the project calls, under the names this torch gives them.

torch 2.13 renamed ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` to
``all_gather_single`` / ``reduce_scatter_single`` (same arguments; the old names warn); the
project supports older torch too (``torch>=2.4``), which has only the old names. Each call looks
the function up in ``torch.distributed`` when it runs, so a wrapper put there (the tests'
simulated accelerator, :mod:`megatron_kd.testing.devices`) sees it. torch only, nothing of the
project.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["all_gather_into", "reduce_scatter_into"]


def all_gather_into(output: torch.Tensor, tensor: torch.Tensor, group=None):
    """Every rank's ``tensor`` of ``group``, concatenated along dim 0 in rank order, into
    ``output``."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(output, tensor, group=group)


def reduce_scatter_into(output: torch.Tensor, tensor: torch.Tensor, group=None):
    """The sum over ``group`` of ``tensor``, this rank's ``1 / size`` slice of it (dim 0), into
    ``output``."""
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return scatter(output, tensor, group=group)
