"""Process groups: ``torch.distributed`` start-up and Megatron-Core's ``parallel_state``.

* :func:`init_distributed_from_env` -- the default group from torchrun's environment (or a
  world of one); gloo on CPU, NCCL on GPU.
* :func:`model_parallel` -- Megatron-Core's TP x PP groups over the default group, undone on
  exit.
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
from megatron_kd.parallel import check_parallel_sizes


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
def model_parallel(tp: int = 1, pp: int = 1, ep: int = 1, etp: int | None = None,
                   vp: int | None = None, cp: int = 1):
    """``parallel_state.initialize_model_parallel(tp, pp)`` (experts over ``ep`` x ``etp``
    ranks, ``etp`` defaulting to ``tp``; ``vp`` virtual stages per pipeline rank; ``cp``
    context-parallel ranks) over the default group, undone on exit.

    ``torch.distributed`` must already be initialised. Installs the CPU shim when no GPU is
    present.
    """
    install_cpu_shim()
    check_parallel_sizes(dist.get_world_size(), tp, pp, ep, etp, cp)
    if parallel_state.model_parallel_is_initialized():
        raise RuntimeError("megatron.core.parallel_state is already initialised")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp,
                                             pipeline_model_parallel_size=pp,
                                             virtual_pipeline_model_parallel_size=vp,
                                             context_parallel_size=cp,
                                             expert_model_parallel_size=ep,
                                             expert_tensor_parallel_size=etp)
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


def add_expert_parallel_args(parser) -> None:
    """``--expert-model-parallel-size`` and ``--expert-tensor-parallel-size`` (Megatron-LM's
    names) on an argparse parser or group."""
    parser.add_argument("--expert-model-parallel-size", type=int, default=1,
                        help="ranks the experts of a mixture-of-experts model are split over")
    parser.add_argument("--expert-tensor-parallel-size", type=int, default=None,
                        help="ranks each expert is split over (default: the tensor-parallel "
                             "size)")


def check_expert_biases(arch, tp: int, etp: int | None) -> None:
    """Experts with biases (gpt-oss) need expert tensor-parallel size 1 (a Megatron-Core
    assertion, 0.16.1 and 0.19.2): refused before any model is built, naming the flag."""
    etp = tp if etp is None else etp
    if arch.num_experts and arch.add_bias_linear and etp != 1:
        raise ValueError(f"experts with biases (gpt-oss) need --expert-tensor-parallel-size 1 "
                         f"(Megatron-Core supports MoE biases only then), got {etp}"
                         f"{' (the default: the tensor-parallel size)' if etp == tp else ''}")


def check_experts_within_tensor_parallel(arch, tp: int, ep: int, etp: int | None) -> None:
    """A teacher whose ranks each work alone on their own samples (a replica, a cache build's
    data-parallel ranks) keeps its experts inside one tensor-parallel group: ``ep x etp`` must
    divide ``tp``, so no all-to-all spans ranks that run different numbers of forwards."""
    check_expert_biases(arch, tp, etp)
    etp = tp if etp is None else etp
    if ep > 1 or etp != tp:
        if not arch.num_experts:
            raise ValueError(f"--expert-model-parallel-size {ep} / --expert-tensor-parallel-size "
                             f"{etp} given for a teacher without experts")
        arch.check_expert_parallel(ep)
        if tp % (ep * etp):
            raise ValueError(f"--expert-model-parallel-size {ep} x --expert-tensor-parallel-size "
                             f"{etp} must divide --tensor-model-parallel-size {tp}: a teacher's "
                             f"experts are split within its tensor-parallel group (e.g. "
                             f"--tensor-model-parallel-size 2 --expert-model-parallel-size 2 "
                             f"--expert-tensor-parallel-size 1)")
