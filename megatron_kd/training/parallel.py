"""Megatron-Core process-group set-up for the training entry points and the tests.

This is the integration layer: the only place besides :mod:`megatron_kd.training.train` that
touches ``megatron.core.parallel_state``.
"""

from __future__ import annotations

import contextlib
import datetime
import os

import torch
import torch.distributed as dist

from megatron_kd.megatron_cpu import install_cpu_shim, on_cpu


def init_distributed_from_env(timeout_s: float = 600.0) -> bool:
    """Initialise ``torch.distributed`` from torchrun's environment, or as a world of one.

    Returns True when this call created the default group (the caller then destroys it).
    Uses gloo on CPU and NCCL on GPU. A single process without ``RANK``/``WORLD_SIZE`` gets a
    world of one over a ``file://`` store in a temporary directory (no port).
    """
    if dist.is_initialized():
        return False
    backend = "gloo" if on_cpu() else "nccl"
    timeout = datetime.timedelta(seconds=timeout_s)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        if not on_cpu():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend, timeout=timeout)
    else:
        import tempfile

        store_dir = tempfile.mkdtemp(prefix="megatron_kd_store_")
        dist.init_process_group(backend, init_method=f"file://{store_dir}/store", rank=0,
                                world_size=1, timeout=timeout)
    return True


def check_parallel_sizes(world_size: int, tp: int, pp: int) -> int:
    """Data-parallel size for ``tp * pp`` model-parallel ranks; ValueError when it does not fit."""
    if tp < 1 or pp < 1:
        raise ValueError(f"parallel sizes must be >= 1, got tensor-model-parallel-size={tp}, "
                         f"pipeline-model-parallel-size={pp}")
    if world_size % (tp * pp):
        raise ValueError(f"world size {world_size} is not divisible by tensor-model-parallel-size "
                         f"{tp} x pipeline-model-parallel-size {pp}")
    return world_size // (tp * pp)


@contextlib.contextmanager
def model_parallel(tp: int = 1, pp: int = 1):
    """``parallel_state.initialize_model_parallel(tp, pp)`` over the default group, undone on exit.

    ``torch.distributed`` must already be initialised. Installs the CPU shim when no GPU is
    present.
    """
    from megatron.core import parallel_state

    install_cpu_shim()
    check_parallel_sizes(dist.get_world_size(), tp, pp)
    if parallel_state.model_parallel_is_initialized():
        raise RuntimeError("megatron.core.parallel_state is already initialised")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp,
                                             pipeline_model_parallel_size=pp)
    try:
        yield
    finally:
        parallel_state.destroy_model_parallel()
