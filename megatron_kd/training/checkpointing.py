"""Training checkpoints of the student: Megatron-Core ``dist_checkpointing``.

``<save>/iter_<N:07d>/`` holds the model (loadable on its own with
:func:`megatron_kd.integration.checkpoint.load_model_checkpoint`, at any tensor-parallel size),
the optimizer, the learning-rate scheduler, the iteration, the samples consumed (the data
position) and every rank's RNG state; ``<save>/latest_checkpointed_iteration.txt`` names the
newest. RNG states are per global rank: a run resumed on a different number of ranks
restarts them from the seed and says so.
"""

from __future__ import annotations

import errno
import json
import os
import random
import shutil
import sys

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core import parallel_state as ps
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
from torch.distributed.checkpoint.api import CheckpointException

from megatron_kd.arch import GPTArchConfig
from megatron_kd.integration.checkpoint import (
    CHECKPOINT_FORMAT_VERSION,
    LATEST_FILE,
    MODEL_CONFIG_FILE,
    PARTIAL_SUFFIX,
    arch_mismatches,
    iteration_dir,
    latest_iteration,
    read_checkpoint_arch,
    resume_note,
)
from megatron_kd.integration.cpu_shim import checkpoint_save_strategy
from megatron_kd.integration.groups import collective_device
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


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (a full disk, say); names the directory and the bytes
    it needs. The previous complete checkpoint is untouched and ``--load`` resumes from it."""


def _model_states(chunks: list) -> dict:
    """The sharded state dicts of a rank's model chunks, as Megatron-LM names them: ``model``
    for one chunk, ``model0``, ``model1``, ... for the chunks of an interleaved schedule (every
    tensor's key is the model's own, global layer numbers included, so a checkpoint loads at
    another pipeline or virtual-stage layout)."""
    if len(chunks) == 1:
        return {"model": unwrap_model(chunks[0]).sharded_state_dict()}
    return {f"model{i}": unwrap_model(chunk).sharded_state_dict()
            for i, chunk in enumerate(chunks)}


def save_training_checkpoint(root: str, *, iteration: int, consumed_samples: int, model,
                             optimizer, scheduler, arch: GPTArchConfig, extra: dict,
                             tokenizer_file: str | None = None) -> str:
    """Save everything needed to resume at ``iteration`` (collective over all ranks); ``model``:
    this rank's model chunks (a list), or one model. ``tokenizer_file``: the run's
    ``tokenizer.json``, copied in beside the weights (what ``export-hf`` writes out with them).

    Written into ``iter_N.partial`` and renamed to ``iter_N`` only once every rank's shards and
    ``model_config.json`` are on disk, then :data:`LATEST_FILE` is replaced: a save killed or
    failing at any point leaves the previous checkpoint complete and named by it.
    """
    directory = iteration_dir(root, iteration)
    partial = directory + PARTIAL_SUFFIX
    _on_rank0(lambda: (shutil.rmtree(partial, ignore_errors=True),
                       os.makedirs(partial, exist_ok=True)), "prepare", partial, 0)
    models = _model_states(model if isinstance(model, list) else [model])
    state = {
        **models,
        "optimizer": optimizer.sharded_state_dict(models),
        "opt_param_scheduler": scheduler.state_dict(),
        "iteration": iteration,
        "consumed_samples": consumed_samples,
        "world_size": dist.get_world_size(),
        "expert_model_parallel_size": ps.get_expert_model_parallel_world_size(),
        "rng_state": _rng_sharded_object(_rng_state()),
    }
    needed = _state_bytes(state)
    try:
        dist_checkpointing.save(state, partial, sharded_strategy=checkpoint_save_strategy())
    except (Exception, CheckpointException) as e:
        # (torch's CheckpointException is a BaseException, gathering every rank's failure)
        raise CheckpointWriteError(_write_failure(partial, needed, e)) from e
    payload = {"format_version": CHECKPOINT_FORMAT_VERSION, "arch": arch.to_dict(),
               "extra": {**extra, "iteration": iteration, "consumed_samples": consumed_samples}}
    _on_rank0(lambda: _publish(root, partial, directory, iteration, payload, tokenizer_file),
              "finish", partial, needed)
    return directory


def _publish(root: str, partial: str, directory: str, iteration: int, payload: dict,
             tokenizer_file: str | None) -> None:
    """Rank 0, after every rank wrote its shards: the config (and tokenizer), then the
    renames."""
    if tokenizer_file is not None:
        shutil.copyfile(tokenizer_file, os.path.join(partial, "tokenizer.json"))
    _write_synced(os.path.join(partial, MODEL_CONFIG_FILE),
                  json.dumps(payload, indent=2, sort_keys=True))
    old = directory + ".old"
    if os.path.isdir(directory):  # saved again at the same iteration
        os.rename(directory, old)
    os.rename(partial, directory)
    shutil.rmtree(old, ignore_errors=True)
    _write_synced(os.path.join(root, LATEST_FILE), str(iteration))


def _write_synced(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(os.path.dirname(path) or ".", os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _on_rank0(fn, what: str, partial: str, needed: int) -> None:
    """Run ``fn`` on rank 0; every rank raises its failure (no rank is left in a barrier)."""
    error = [None]
    if dist.get_rank() == 0:
        try:
            fn()
        except OSError as e:
            error[0] = _write_failure(partial, needed, e)
    dist.broadcast_object_list(error, src=0)
    if error[0] is not None:
        raise CheckpointWriteError(f"{what}: {error[0]}")


def _state_bytes(state) -> int:
    """Bytes of the tensors of this rank's share of a sharded state dict, summed over ranks."""
    total = 0
    stack = [state]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
        else:
            data = getattr(item, "data", item)
            if isinstance(data, torch.Tensor):
                total += data.numel() * data.element_size()
    summed = torch.tensor([float(total)], dtype=torch.float64, device=collective_device())
    dist.all_reduce(summed)
    return int(summed.item())


def _write_failure(partial: str, needed: int, error: BaseException) -> str:
    text = str(error)
    full = (isinstance(error, OSError) and error.errno == errno.ENOSPC) or \
        "No space left" in text or "ENOSPC" in text
    free = shutil.disk_usage(os.path.dirname(partial) or ".").free \
        if os.path.exists(os.path.dirname(partial) or ".") else 0
    head = ("no space left on device" if full else f"{type(error).__name__}: "
            f"{text.splitlines()[0] if text else ''}")
    return (f"could not write checkpoint {partial}: {head}; it needs about {needed:,} bytes, "
            f"{free:,} are free there. The previous complete checkpoint is untouched; free "
            f"space and resume with --load")


def _check_expert_layout(arch: GPTArchConfig, saved_ep: int, directory: str) -> None:
    """A mixture-of-experts student resumes at the expert-parallel size it was saved at:
    Megatron-Core's optimizer is one optimizer at EP 1 and a chain of two (dense, experts) at
    EP > 1, and its state does not load across that change (megatron-core 0.16-0.19)."""
    ep = ps.get_expert_model_parallel_world_size()
    if arch.num_experts and (saved_ep > 1) != (ep > 1):
        raise ValueError(f"--load {directory!r} was saved at --expert-model-parallel-size "
                         f"{saved_ep}, this run has {ep}: a mixture-of-experts student's "
                         f"optimizer state does not move between EP 1 and EP > 1 "
                         f"(Megatron-Core keeps one optimizer at EP 1, a chain of two above)")


def load_training_checkpoint(root: str, *, model, optimizer, scheduler,
                             arch: GPTArchConfig, load_optim: bool = True,
                             load_rng: bool = True) -> tuple[int, int]:
    """Restore the newest complete checkpoint under ``root`` into ``model`` (this rank's model
    chunks, or one model); returns ``(iteration, consumed_samples)``. ``load_optim`` False
    (``--no-load-optim``): the optimizer keeps its fresh state (the learning-rate schedule,
    the iteration and the data position are still the checkpoint's); ``load_rng`` False
    (``--no-load-rng``): the RNG states stay as seeded.

    ``(0, 0)`` when ``root`` has none. A torn checkpoint (a save killed half way) is never
    read: the newest complete one is, and rank 0 says which it took. The checkpoint's
    architecture must equal ``arch``.
    """
    iteration = latest_iteration(root)
    note = resume_note(root)
    if note and dist.get_rank() == 0:
        print(f"megatron-kd: {note}", file=sys.stderr, flush=True)
    if iteration is None:
        return 0, 0
    directory = iteration_dir(root, iteration)
    mismatches = arch_mismatches(arch, read_checkpoint_arch(directory))
    if mismatches:
        raise ValueError(f"--load {directory!r} does not fit the student: " + "; ".join(mismatches))
    common = dist_checkpointing.load_common_state_dict(directory)
    _check_expert_layout(arch, common.get("expert_model_parallel_size", 1), directory)
    same_world = common.get("world_size") == dist.get_world_size()
    chunks = model if isinstance(model, list) else [model]
    models = _model_states(chunks)
    request = dict(models)
    if load_optim:
        request["optimizer"] = optimizer.sharded_state_dict(models, is_loading=True)
    if same_world and load_rng:
        request["rng_state"] = _rng_sharded_object(_rng_state())
    state = dist_checkpointing.load(request, directory)
    for chunk, key in zip(chunks, models, strict=True):
        unwrap_model(chunk).load_state_dict(state[key], strict=True)
    if load_optim:
        optimizer.load_state_dict(state["optimizer"])
    else:  # the fp32 main weights (a copy the optimizer keeps) from the loaded model
        optimizer.reload_model_params()
    scheduler.load_state_dict(state["opt_param_scheduler"])
    if same_world and load_rng:
        _set_rng_state(state["rng_state"])
    elif load_rng and dist.get_rank() == 0:
        print(f"megatron-kd: checkpoint was saved on {common.get('world_size')} ranks, resuming "
              f"on {dist.get_world_size()}: RNG states restart from the seed", file=sys.stderr)
    return int(state["iteration"]), int(state["consumed_samples"])


def stop_iteration(train_iters: int, exit_after_iters: int | None, start: int) -> int:
    """The iteration a run started at ``start`` stops after (``--train-iters``,
    ``--exit-after-iters``)."""
    stop = train_iters
    if exit_after_iters is not None:
        stop = min(stop, start + exit_after_iters)
    return stop
