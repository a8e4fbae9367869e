"""How every distributed ``megatron-kd`` command starts and ends (``train``, ``teacher serve``,
``cache build``), written once.

:func:`started`: on a machine without a GPU the CPU shim is installed (and denormal floats
flushed: their softmax tails make CPU matmuls about 50x slower); ``torch.distributed`` starts
from torchrun's environment (or as a world of one) unless it runs already; the process group is
destroyed on the way out when this made it. :func:`in_layout`: Megatron-Core's groups of the
command's :class:`~megatron_kd.parallel.ParallelLayout`, with the device context its models run
in.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist

from megatron_kd.integration.cpu_shim import device_context, install_cpu_shim, on_cpu
from megatron_kd.integration.groups import init_distributed_from_env, model_parallel
from megatron_kd.parallel import ParallelLayout

__all__ = ["in_layout", "started"]


@contextlib.contextmanager
def started() -> Iterator[None]:
    """A command's process, started (see the module docstring) and torn down on exit."""
    install_cpu_shim()
    if on_cpu():
        torch.set_flush_denormal(True)  # denormal softmax tails make CPU matmuls ~50x slower
    created = init_distributed_from_env()
    try:
        yield
    finally:
        if created:
            dist.destroy_process_group()


@contextlib.contextmanager
def in_layout(layout: ParallelLayout) -> Iterator[None]:
    """Megatron-Core's groups of ``layout`` over the world and the device context of its models,
    undone on exit."""
    with model_parallel(layout), device_context():
        yield
