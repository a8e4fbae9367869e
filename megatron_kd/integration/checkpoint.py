"""Model checkpoints: Megatron-Core ``dist_checkpointing`` plus ``model_config.json``.

* :func:`save_model_checkpoint` / :func:`load_model_checkpoint` -- ``dist_checkpointing`` of
  ``model.sharded_state_dict()``; a checkpoint saved at one tensor-parallel size loads at
  another (dist_checkpointing reshards).
* :func:`read_checkpoint_arch` / :func:`check_checkpoint_tensors` -- what a checkpoint holds,
  from its small files only, before any model is built.

A checkpoint directory holds the ``dist_checkpointing`` files and ``model_config.json``::

    {"format_version": 1, "arch": {...GPTArchConfig fields...}, "extra": {...}}
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
from pathlib import Path

import torch
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.mapping import apply_factory_merges
from megatron.core.dist_checkpointing.state_dict_utils import load_preprocess
from megatron.core.dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy
from megatron.core.dist_checkpointing.utils import extract_sharded_base

from megatron_kd.arch import GPTArchConfig
from megatron_kd.integration.cpu_shim import checkpoint_save_strategy
from megatron_kd.integration.gpt import model_arch

__all__ = [
    "CHECKPOINT_FORMAT_VERSION",
    "MODEL_CONFIG_FILE",
    "LATEST_FILE",
    "PARTIAL_SUFFIX",
    "arch_mismatches",
    "complete_iterations",
    "has_model_config",
    "is_complete",
    "iteration_dir",
    "latest_iteration",
    "recorded_iteration",
    "resume_note",
    "resolve_model_dir",
    "check_checkpoint_tensors",
    "checkpoint_hash",
    "load_model_checkpoint",
    "read_checkpoint_arch",
    "read_checkpoint_extra",
    "save_model_checkpoint",
]

MODEL_CONFIG_FILE = "model_config.json"
CHECKPOINT_FORMAT_VERSION = 1
LATEST_FILE = "latest_checkpointed_iteration.txt"
"""Names the newest iteration of a training checkpoint root (``--save``): Megatron's name."""
PARTIAL_SUFFIX = ".partial"
"""A checkpoint directory being written carries this suffix until every rank has finished."""
_ITER_RE = re.compile(r"iter_(\d{7})")


def iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def recorded_iteration(root: str) -> int | None:
    """The iteration ``root``'s :data:`LATEST_FILE` names (None when there is none)."""
    path = os.path.join(root, LATEST_FILE)
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        text = f.read().strip()
    try:
        return int(text)
    except ValueError as e:
        raise ValueError(f"{path}: expected an iteration number, got {text!r}") from e


def has_model_config(directory: str | os.PathLike) -> bool:
    """Whether ``directory`` holds this project's ``model_config.json`` (a Megatron-LM
    checkpoint has none)."""
    return os.path.isfile(os.path.join(os.fspath(directory), MODEL_CONFIG_FILE))


def is_complete(directory: str) -> bool:
    """A checkpoint directory whose writing finished: ``model_config.json`` is written last,
    after every rank's shards, and the directory has its final name."""
    return (not directory.rstrip("/").endswith(PARTIAL_SUFFIX)
            and has_model_config(directory))


def complete_iterations(root: str) -> list[int]:
    """Iterations under ``root`` with a complete checkpoint, ascending."""
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        m = _ITER_RE.fullmatch(name)
        if m and is_complete(os.path.join(root, name)):
            found.append(int(m.group(1)))
    return sorted(found)


def latest_iteration(root: str) -> int | None:
    """The newest iteration under ``root`` whose checkpoint is complete (None: none is).

    That is the one :data:`LATEST_FILE` names, unless its directory is missing or was never
    finished (a save killed half way): then the newest complete one
    (:func:`resume_note` says which was taken and why).
    """
    recorded = recorded_iteration(root)
    if recorded is not None and is_complete(iteration_dir(root, recorded)):
        return recorded
    done = [i for i in complete_iterations(root) if recorded is None or i <= recorded]
    return done[-1] if done else None


def resume_note(root: str) -> str | None:
    """Why :func:`latest_iteration` is not the newest checkpoint written under ``root``, if it
    is not: the torn or missing ones it skipped (None when nothing was skipped)."""
    taken = latest_iteration(root)
    recorded = recorded_iteration(root)
    partial = sorted(n for n in os.listdir(root) if n.endswith(PARTIAL_SUFFIX)) \
        if os.path.isdir(root) else []
    skipped = []
    if recorded is not None and recorded != taken:
        state = "incomplete" if os.path.isdir(iteration_dir(root, recorded)) else "missing"
        skipped.append(f"iteration {recorded} named by {LATEST_FILE} is {state}")
    skipped += [f"{name} was never finished" for name in partial]
    if not skipped:
        return None
    where = f"iteration {taken}" if taken is not None else "no checkpoint (iteration 0)"
    return f"resuming from {where} of {root}: " + "; ".join(skipped)


def resolve_model_dir(path: str) -> str:
    """``path`` when it is a model checkpoint (has ``model_config.json``); the newest iteration
    when it is a training checkpoint root (``--save`` directory); else ValueError."""
    if has_model_config(path):
        return path
    iteration = latest_iteration(path) if os.path.isdir(path) else None
    if iteration is not None:
        return iteration_dir(path, iteration)
    raise ValueError(f"{path!r} is neither a model checkpoint (no {MODEL_CONFIG_FILE}) nor a "
                     f"training checkpoint directory (no {LATEST_FILE})")



# Fields that do not change the weights or the function the model computes.
_NON_STRUCTURAL_FIELDS = ("init_method_std",)


def _unwrap(model):
    while hasattr(model, "module") and (not hasattr(model, "sharded_state_dict")
                                        or hasattr(model, "ddp_config")):
        model = model.module
    return model


def _is_rank0() -> bool:
    return not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0


def _barrier() -> None:
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


def save_model_checkpoint(model, arch: GPTArchConfig, directory: str | os.PathLike, *,
                          extra: dict | None = None) -> None:
    """Save ``model`` (this rank's shard; collective over all ranks) to ``directory``.

    Writes Megatron-Core ``dist_checkpointing`` files of ``model.sharded_state_dict()`` and
    ``model_config.json`` with ``arch`` and the JSON-serialisable ``extra``.
    """
    directory = os.fspath(directory)
    if _is_rank0():
        os.makedirs(directory, exist_ok=True)
    _barrier()
    dist_checkpointing.save(_unwrap(model).sharded_state_dict(), directory,
                            sharded_strategy=checkpoint_save_strategy())
    if _is_rank0():
        payload = {"format_version": CHECKPOINT_FORMAT_VERSION, "arch": arch.to_dict(),
                   "extra": extra or {}}
        tmp = os.path.join(directory, MODEL_CONFIG_FILE + ".tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(payload, f, indent=2, sort_keys=True)
        os.replace(tmp, os.path.join(directory, MODEL_CONFIG_FILE))
    _barrier()


def _read_model_config(directory: str | os.PathLike) -> dict:
    path = os.path.join(os.fspath(directory), MODEL_CONFIG_FILE)
    if not os.path.isfile(path):
        raise ValueError(f"{os.fspath(directory)!r} is not a megatron_kd model checkpoint: "
                         f"no {MODEL_CONFIG_FILE}")
    with open(path, encoding="utf-8") as f:
        payload = json.load(f)
    version = payload.get("format_version")
    if version != CHECKPOINT_FORMAT_VERSION:
        raise ValueError(f"{path}: format_version {version!r} is not supported "
                         f"(this megatron_kd reads {CHECKPOINT_FORMAT_VERSION})")
    return payload


def read_checkpoint_arch(directory: str | os.PathLike) -> GPTArchConfig:
    """The :class:`GPTArchConfig` stored in a checkpoint directory's ``model_config.json``."""
    return GPTArchConfig.from_dict(_read_model_config(directory)["arch"])


def read_checkpoint_extra(directory: str | os.PathLike) -> dict:
    """The ``extra`` dict given to :func:`save_model_checkpoint`."""
    return dict(_read_model_config(directory).get("extra") or {})


def arch_mismatches(expected: GPTArchConfig, found: GPTArchConfig) -> list[str]:
    """``"field: expected X, checkpoint has Y"`` for every structural field that differs."""
    out = []
    for f in dataclasses.fields(GPTArchConfig):
        if f.name in _NON_STRUCTURAL_FIELDS:
            continue
        a, b = getattr(expected, f.name), getattr(found, f.name)
        if a != b:
            out.append(f"{f.name}: model has {a!r}, checkpoint has {b!r}")
    return out


def expected_tensor_shapes(arch: GPTArchConfig) -> dict[str, tuple[int, ...]]:
    """Global shapes of a few tensors every checkpoint of ``arch`` holds (for validation)."""
    shapes = {
        "embedding.word_embeddings.weight": (arch.padded_vocab_size, arch.hidden_size),
        "decoder.final_layernorm.weight": (arch.hidden_size,),
    }
    if not arch.tie_embeddings:
        shapes["output_layer.weight"] = (arch.padded_vocab_size, arch.hidden_size)
    return shapes


def check_checkpoint_tensors(directory: str | os.PathLike,
                             arch: GPTArchConfig | None = None) -> GPTArchConfig:
    """Check that the tensors stored in a checkpoint have the shapes its ``model_config.json``
    (or ``arch``) implies; ``ValueError`` naming hidden size / vocabulary otherwise.

    Reads only the checkpoint's metadata, never the tensors. Returns the architecture checked.
    """
    directory = os.fspath(directory)
    arch = arch or read_checkpoint_arch(directory)
    stored = dist_checkpointing.load_tensors_metadata(directory)
    problems = []
    for key, shape in expected_tensor_shapes(arch).items():
        if key not in stored:
            problems.append(f"{key} is missing")
            continue
        found = tuple(stored[key].global_shape)
        if found != shape:
            what = ("vocabulary rows x hidden size" if len(shape) == 2 else "hidden size")
            problems.append(f"{key} has shape {found}, expected {shape} ({what} of "
                            f"hidden_size={arch.hidden_size}, "
                            f"padded_vocab_size={arch.padded_vocab_size})")
    if problems:
        raise ValueError(f"checkpoint {directory!r} does not match its model_config.json: "
                         + "; ".join(problems))
    return arch


def load_model_checkpoint(model, directory: str | os.PathLike, *, arch: GPTArchConfig | None = None,
                          validate_access_integrity: bool = True) -> GPTArchConfig:
    """Load a checkpoint saved by :func:`save_model_checkpoint` into ``model`` (collective).

    ``model``: one model, or a list of this rank's model chunks (an interleaved pipeline's),
    loaded in one call (so every tensor of the checkpoint is read by some rank).
    The checkpoint's architecture must match the model's (every field except
    ``init_method_std``), else ``ValueError`` names each mismatching field. Returns the
    checkpoint's architecture. ``arch`` stands in for a checkpoint without ``model_config.json``
    (a Megatron-LM one). ``validate_access_integrity=False`` lets ranks that Megatron's
    groups would call replicas of each other (e.g. a teacher replicated on every pipeline stage)
    all load the same shard.
    """
    directory = os.fspath(directory)
    models = [_unwrap(m) for m in (model if isinstance(model, list) else [model])]
    foreign = not has_model_config(directory)
    ckpt_arch = arch if arch is not None and foreign else read_checkpoint_arch(directory)
    mismatches = arch_mismatches(model_arch(models[0]), ckpt_arch)
    if mismatches:
        raise ValueError(f"checkpoint {directory!r} does not fit the model: "
                         + "; ".join(mismatches))
    check_checkpoint_tensors(directory, ckpt_arch)
    request = {f"model{i}": m.sharded_state_dict() for i, m in enumerate(models)}
    if foreign:
        loaded = load_sharded_weights(request, directory)
    else:
        loaded = dist_checkpointing.load(request, directory,
                                         validate_access_integrity=validate_access_integrity)
    for i, m in enumerate(models):
        # A training checkpoint also holds optimizer / iteration state: keep the model's.
        m.load_state_dict({k: v for k, v in loaded[f"model{i}"].items()
                           if k in request[f"model{i}"]}, strict=True)
    return ckpt_arch


def load_sharded_weights(sharded_state_dict, directory: str) -> dict:
    """``dist_checkpointing.load`` of the sharded entries only: a Megatron-LM checkpoint's
    common state is a pickle of its run's arguments, which megatron-core reads with
    ``weights_only=True`` and which names classes another Megatron version may not have. The
    weights do not need it. Collective like ``dist_checkpointing.load``."""
    sharded, _, factories = load_preprocess(sharded_state_dict)
    sharded, _ = extract_sharded_base(sharded)
    loaded = TorchDistLoadShardedStrategy().load(sharded, directory)
    return apply_factory_merges(loaded, factories)


def checkpoint_hash(directory: str) -> str:
    """sha256 over a checkpoint directory's files (relative names and contents, sorted).

    Independent of the parallel layout the teacher is loaded with.
    """
    digest = hashlib.sha256()
    root = Path(directory)
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        digest.update(f"{path.relative_to(root).as_posix()}\0{path.stat().st_size}\0".encode())
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 22), b""):
                digest.update(chunk)
    return digest.hexdigest()
