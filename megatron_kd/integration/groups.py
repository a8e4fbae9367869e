"""Process groups: ``torch.distributed`` start-up and Megatron-Core's ``parallel_state``.

* :func:`init_distributed_from_env` -- the default group from torchrun's environment (or a
  world of one); gloo on CPU, NCCL on GPU.
* :func:`model_parallel` -- Megatron-Core's TP x PP groups over the default group, undone on
  exit.
* :func:`initialize_model_parallel_split` / :func:`default_group` -- a world split into a student
  side and a teacher side (:class:`megatron_kd.parallel.DisaggTopology`), with
  ``parallel_state`` describing each process's own side only.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import tempfile

import torch
import torch.distributed as dist

from megatron.core import parallel_state

from megatron_kd.integration.cpu_shim import install_cpu_shim, on_cpu
from megatron_kd.parallel import DisaggTopology, Layout, check_parallel_sizes


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
        dist.init_process_group(backend, init_method=f"file://{store_dir}/store", rank=0,
                                world_size=1, timeout=timeout)
    return True


@contextlib.contextmanager
def model_parallel(tp: int = 1, pp: int = 1):
    """``parallel_state.initialize_model_parallel(tp, pp)`` over the default group, undone on exit.

    ``torch.distributed`` must already be initialised. Installs the CPU shim when no GPU is
    present.
    """
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


# ---------------------------------------------------------------------------------------------
# parallel_state for one side of a split world
# ---------------------------------------------------------------------------------------------
def _state_names(ps) -> list[str]:
    return [n for n in vars(ps) if n.startswith("_") and n[1:2].isupper() and n.upper() == n]


@contextlib.contextmanager
def _side_view(layout: Layout, global_rank: int):
    """Make the default world look like ``layout`` to Megatron-Core's initialisation.

    ``get_world_size()`` / ``get_rank()`` without a group answer for the side (a rank of the
    other side gets a rank outside every group); ``new_group`` maps side-local ranks to global
    ones. Every rank of the world runs this for both sides, so each ``new_group`` is still called
    by every rank in the same order, as ``torch.distributed`` requires.
    """
    real = dist.get_world_size, dist.get_rank, dist.new_group
    member = layout.contains(global_rank)
    outside = layout.world_size + 1 + global_rank

    def get_world_size(group=None):
        return layout.world_size if group is None else real[0](group)

    def get_rank(group=None):
        if group is not None:
            return real[1](group)
        return global_rank - layout.offset if member else outside

    def new_group(ranks=None, *args, **kwargs):
        if ranks is None:
            ranks = range(layout.world_size)
        return real[2]([layout.offset + r for r in ranks], *args, **kwargs)

    dist.get_world_size, dist.get_rank, dist.new_group = get_world_size, get_rank, new_group
    try:
        yield
    finally:
        dist.get_world_size, dist.get_rank, dist.new_group = real


def _shift(value, offset: int):
    if isinstance(value, list):
        return [_shift(v, offset) for v in value]
    return value + offset if isinstance(value, int) else value


def initialize_model_parallel_split(topology: DisaggTopology, *, order: tuple[str, ...] = (
        "student", "teacher"), **megatron_kwargs) -> str:
    """Initialise Megatron-Core's ``parallel_state`` for this process's own side.

    Every rank of the world must call this (it creates every group of both sides, collectively).
    Afterwards ``parallel_state`` on a student rank describes the student's layout only (its DP
    group has only student ranks, ...), and on a teacher rank the teacher's. Returns the side.
    """
    ps = parallel_state
    if ps.model_parallel_is_initialized():
        raise RuntimeError("Megatron-Core's model parallel state is already initialised")
    rank = dist.get_rank()
    if dist.get_world_size() != topology.world_size:
        raise ValueError(f"torch.distributed world size {dist.get_world_size()} != student "
                         f"{topology.student.world_size} + teacher {topology.teacher.world_size} "
                         f"ranks")
    names = _state_names(ps)
    initial = {n: getattr(ps, n) for n in names}
    mine = None
    for side in order:
        layout = topology.student if side == "student" else topology.teacher
        with _side_view(layout, rank):
            ps.initialize_model_parallel(tensor_model_parallel_size=layout.tp,
                                         pipeline_model_parallel_size=layout.pp,
                                         **megatron_kwargs)
        if layout.contains(rank):
            mine = {n: getattr(ps, n) for n in names}
            for n in names:  # the side-local global-rank lists become real global ranks
                if n.endswith("_GLOBAL_RANKS") or n.endswith("_GLOBAL_RANKS_WITH_CP"):
                    mine[n] = _shift(mine[n], layout.offset)
        for n in names:
            setattr(ps, n, initial[n])
    assert mine is not None, f"rank {rank} belongs to neither side"
    for n, v in mine.items():
        setattr(ps, n, v)
    return topology.side(rank)


@contextlib.contextmanager
def default_group(group):
    """Make ``group`` the default process group of this process for the duration.

    One side of a split world runs code that uses the default group implicitly (Megatron-Core's
    ``dist_checkpointing``, barriers, report all-reduces) as if it were the whole world. The
    student's ranks are ``0 .. S-1``, so its group ranks equal its global ranks and rank-based
    logic stays right. Point-to-point traffic to the other side must name the real world group.
    """
    world = dist.distributed_c10d._world
    previous = world.default_pg
    world.default_pg = group
    try:
        yield
    finally:
        world.default_pg = previous


def collective_device(group=None) -> torch.device:
    """The device tensors given to a collective on ``group`` must live on: the current CUDA
    device for NCCL (which refuses host tensors), the CPU for gloo."""
    backend = dist.get_backend(group)
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
