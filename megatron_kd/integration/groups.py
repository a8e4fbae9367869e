"""Process groups: ``torch.distributed`` start-up and Megatron-Core's ``parallel_state``.

* :func:`init_distributed_from_env` -- the default group from torchrun's environment (or a
  world of one); gloo on CPU, NCCL on GPU.
* :func:`model_parallel` -- Megatron-Core's groups of a
  :class:`~megatron_kd.parallel.ParallelLayout` over the default group, undone on exit.
* :func:`unsharded_model_parallel` -- tensor and pipeline size 1 for a step that builds the
  whole model (``import-hf``), with a 1-rank group when there is none.
* :func:`collective_device` -- where a collective's tensors must live (NCCL: CUDA).
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import os
import random
import shutil
import tempfile

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_kd.integration.cpu_shim import install_cpu_shim, on_cpu
from megatron_kd.parallel import ParallelLayout


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
        store_dir = tempfile.mkdtemp(prefix="megatron_kd_store_")
        atexit.register(shutil.rmtree, store_dir, ignore_errors=True)  # left behind, it piles up
        dist.init_process_group(backend, init_method=f"file://{store_dir}/store", rank=0,
                                world_size=1, timeout=timeout)
    return True


@contextlib.contextmanager
def model_parallel(layout: ParallelLayout | None = None, **sizes):
    """``parallel_state.initialize_model_parallel`` for ``layout`` over the default group, undone
    on exit. Without a layout, ``sizes`` (:class:`~megatron_kd.parallel.ParallelLayout`'s fields
    but ``dp``) make one over the world: ``model_parallel(tp=2)``.

    ``torch.distributed`` must already be initialised, and the layout's ranks be the world's.
    Installs the CPU shim when no GPU is present.
    """
    install_cpu_shim()
    world = dist.get_world_size()
    if layout is None:
        layout = ParallelLayout.from_world(world, **sizes)
    elif sizes:
        raise ValueError(f"give a layout or its sizes, not both (got {sorted(sizes)})")
    if layout.world_size != world:
        raise ValueError(f"the layout's {layout.world_size} ranks (tensor {layout.tp} x pipeline "
                         f"{layout.pp} x context {layout.cp} x data {layout.dp}) are not the "
                         f"world's {world}")
    if parallel_state.model_parallel_is_initialized():
        raise RuntimeError("megatron.core.parallel_state is already initialised")
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.virtual_stages,
        context_parallel_size=layout.cp, expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.expert_tp)
    try:
        yield
    finally:
        parallel_state.destroy_model_parallel()


@contextlib.contextmanager
def unsharded_model_parallel(what: str):
    """Tensor and pipeline size 1 for the duration, for ``what`` (a step that builds the whole
    model on every rank, e.g. ``import_hf``): a 1-rank gloo group (file store, no port) when
    ``torch.distributed`` has none and ``parallel_state`` at sizes 1 when it is not initialised,
    both undone on exit. An initialised ``parallel_state`` of other sizes raises ``ValueError``.
    """
    own_pg, tmp = _ensure_distributed()
    own_mpu = not parallel_state.model_parallel_is_initialized()
    if own_mpu:
        parallel_state.initialize_model_parallel(1, 1)
    try:
        tp = parallel_state.get_tensor_model_parallel_world_size()
        pp = parallel_state.get_pipeline_model_parallel_world_size()
        if (tp, pp) != (1, 1):
            raise ValueError(f"{what} builds the model unsharded: initialise parallel_state "
                             f"with tensor and pipeline size 1 (got {tp} and {pp}); the saved "
                             f"checkpoint loads at any size")
        yield
    finally:
        if own_mpu:
            parallel_state.destroy_model_parallel()
        if own_pg:
            dist.destroy_process_group()
            tmp.cleanup()


def _ensure_distributed() -> tuple[bool, tempfile.TemporaryDirectory | None]:
    """Initialise a 1-rank gloo group (file store, no port) when none exists."""
    if dist.is_initialized():
        return False, None
    tmp = tempfile.TemporaryDirectory(prefix="megatron_kd_import_")
    dist.init_process_group("gloo", init_method=f"file://{tmp.name}/store", rank=0, world_size=1,
                            timeout=datetime.timedelta(minutes=30))
    return True, tmp


def collective_device(group=None) -> torch.device:
    """The device tensors given to a collective on ``group`` must live on: the current CUDA
    device for NCCL (which refuses host tensors), the CPU for gloo."""
    backend = dist.get_backend(group)
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def shared_random_id(group=None) -> int:
    """A random 62-bit id, the same on every rank of ``group`` (collective: rank 0 draws it)."""
    value = [random.SystemRandom().getrandbits(62) if dist.get_rank(group) == 0 else None]
    dist.broadcast_object_list(value, src=dist.get_global_rank(group, 0) if group else 0,
                               group=group)
    return value[0]
