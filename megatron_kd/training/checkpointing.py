"""Training checkpoints of the student: Megatron-Core ``dist_checkpointing``.

``<save>/iter_<N:07d>/`` holds the model (loadable on its own with
:func:`megatron_kd.integration.checkpoint.load_model_checkpoint`, at any tensor-parallel size), the optimizer,
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

from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

from megatron_kd.integration.arch import GPTArchConfig
from megatron_kd.integration.checkpoint import (
    CHECKPOINT_FORMAT_VERSION,
    LATEST_FILE,
    MODEL_CONFIG_FILE,
    arch_mismatches,
    iteration_dir,
    latest_iteration,
    read_checkpoint_arch,
)
from megatron_kd.integration.cpu_shim import checkpoint_save_strategy
from megatron_kd.integration.output_layer import unwrap_model

def _rng_state() -> dict:
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "tracker": get_cuda_rng_tracker().get_states(),
    }


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    get_cuda_rng_tracker().set_states(state["tracker"])


def _rng_sharded_object(state):
    # One object per global rank: RNG streams are rank-specific and are not resharded.
    return ShardedObject("rng_state", state, (dist.get_world_size(),), (dist.get_rank(),),
                         replica_id=0)


def save_training_checkpoint(root: str, *, iteration: int, consumed_samples: int, model,
                             optimizer, scheduler, arch: GPTArchConfig, extra: dict) -> str:
    """Save everything needed to resume at ``iteration`` (collective over all ranks)."""
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


def run_schedule_bounds(args) -> tuple[int, int]:
    """``(first_iteration, stop_iteration)`` of this run, as the student will compute them.

    Both sides of a disaggregated run read the resume point from the same ``--load``
    directory, so the teacher starts where the student does without any message from it.
    """
    start = 0
    if args.load:
        start = latest_iteration(args.load) or 0
    return start, stop_iteration(args, start)


def stop_iteration(args, start: int) -> int:
    """The iteration a run started at ``start`` stops after (``--train-iters``,
    ``--exit-after-iters``)."""
    stop = args.train_iters
    if args.exit_after_iters is not None:
        stop = min(stop, start + args.exit_after_iters)
    return stop
