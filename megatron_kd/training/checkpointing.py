"""Training checkpoints of the student: Megatron-Core ``dist_checkpointing``.

``<save>/iter_<N:07d>/`` holds the model (loadable on its own with
:func:`megatron_kd.models.load_model_checkpoint`, at any tensor-parallel size), the optimizer,
the learning-rate scheduler, the iteration, the samples consumed (the data position) and every
rank's RNG state; ``<save>/latest_checkpointed_iteration.txt`` names the newest. RNG states are
per global rank: a run resumed on a different number of ranks restarts them from the seed and
says so.
"""

from __future__ import annotations

import json
import os
import random
import sys

import numpy as np
import torch
import torch.distributed as dist

from megatron_kd.integration import unwrap_model
from megatron_kd.megatron_cpu import checkpoint_save_strategy
from megatron_kd.models import (
    CHECKPOINT_FORMAT_VERSION,
    MODEL_CONFIG_FILE,
    GPTArchConfig,
)

LATEST_FILE = "latest_checkpointed_iteration.txt"


def iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def latest_iteration(root: str) -> int | None:
    """The newest iteration saved under ``root`` (None when there is none)."""
    path = os.path.join(root, LATEST_FILE)
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        text = f.read().strip()
    try:
        return int(text)
    except ValueError as e:
        raise ValueError(f"{path}: expected an iteration number, got {text!r}") from e


def resolve_model_dir(path: str) -> str:
    """``path`` when it is a model checkpoint (has ``model_config.json``); the newest iteration
    when it is a training checkpoint root (``--save`` directory); else ValueError."""
    if os.path.isfile(os.path.join(path, MODEL_CONFIG_FILE)):
        return path
    iteration = latest_iteration(path) if os.path.isdir(path) else None
    if iteration is not None:
        return iteration_dir(path, iteration)
    raise ValueError(f"{path!r} is neither a model checkpoint (no {MODEL_CONFIG_FILE}) nor a "
                     f"training checkpoint directory (no {LATEST_FILE})")


def _rng_state() -> dict:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "tracker": get_cuda_rng_tracker().get_states(),
    }


def _set_rng_state(state: dict) -> None:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    get_cuda_rng_tracker().set_states(state["tracker"])


def _rng_sharded_object(state):
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    # One object per global rank: RNG streams are rank-specific and are not resharded.
    return ShardedObject("rng_state", state, (dist.get_world_size(),), (dist.get_rank(),),
                         replica_id=0)


def save_training_checkpoint(root: str, *, iteration: int, consumed_samples: int, model,
                             optimizer, scheduler, arch: GPTArchConfig, extra: dict) -> str:
    """Save everything needed to resume at ``iteration`` (collective over all ranks)."""
    from megatron.core import dist_checkpointing

    directory = iteration_dir(root, iteration)
    if dist.get_rank() == 0:
        os.makedirs(directory, exist_ok=True)
    dist.barrier()
    model_sd = unwrap_model(model).sharded_state_dict()
    state = {
        "model": model_sd,
        "optimizer": optimizer.sharded_state_dict(model_sd),
        "opt_param_scheduler": scheduler.state_dict(),
        "iteration": iteration,
        "consumed_samples": consumed_samples,
        "world_size": dist.get_world_size(),
        "rng_state": _rng_sharded_object(_rng_state()),
    }
    dist_checkpointing.save(state, directory, sharded_strategy=checkpoint_save_strategy())
    if dist.get_rank() == 0:
        payload = {"format_version": CHECKPOINT_FORMAT_VERSION, "arch": arch.to_dict(),
                   "extra": {**extra, "iteration": iteration,
                             "consumed_samples": consumed_samples}}
        with open(os.path.join(directory, MODEL_CONFIG_FILE), "w", encoding="utf-8") as f:
            json.dump(payload, f, indent=2, sort_keys=True)
        tmp = os.path.join(root, LATEST_FILE + ".tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(str(iteration))
        os.replace(tmp, os.path.join(root, LATEST_FILE))
    dist.barrier()
    return directory


def load_training_checkpoint(root: str, *, model, optimizer, scheduler,
                             arch: GPTArchConfig) -> tuple[int, int]:
    """Restore the newest checkpoint under ``root``; returns ``(iteration, consumed_samples)``.

    ``(0, 0)`` when ``root`` has none. The checkpoint's architecture must equal ``arch``.
    """
    from megatron.core import dist_checkpointing

    from megatron_kd.models import arch_mismatches, read_checkpoint_arch

    iteration = latest_iteration(root)
    if iteration is None:
        return 0, 0
    directory = iteration_dir(root, iteration)
    mismatches = arch_mismatches(arch, read_checkpoint_arch(directory))
    if mismatches:
        raise ValueError(f"--load {directory!r} does not fit the student: " + "; ".join(mismatches))
    common = dist_checkpointing.load_common_state_dict(directory)
    same_world = common.get("world_size") == dist.get_world_size()
    inner = unwrap_model(model)
    model_sd = inner.sharded_state_dict()
    request = {"model": model_sd,
               "optimizer": optimizer.sharded_state_dict(model_sd, is_loading=True)}
    if same_world:
        request["rng_state"] = _rng_sharded_object(_rng_state())
    state = dist_checkpointing.load(request, directory)
    inner.load_state_dict(state["model"], strict=True)
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["opt_param_scheduler"])
    if same_world:
        _set_rng_state(state["rng_state"])
    elif dist.get_rank() == 0:
        print(f"megatron-kd: checkpoint was saved on {common.get('world_size')} ranks, resuming "
              f"on {dist.get_world_size()}: RNG states restart from the seed", file=sys.stderr)
    return int(state["iteration"]), int(state["consumed_samples"])
