"""A Megatron-LM (or Megatron-Bridge) ``torch_dist`` checkpoint as a teacher, not converted.

Such a checkpoint has no ``model_config.json``: its architecture is what the run that wrote it
was launched with. It comes from Megatron-LM flags (``--kd-teacher-args "--num-layers 32
--hidden-size 4096 ..."``, or ``--kd-teacher-args FILE`` with those flags in the file) or, when
no flags are given, from the arguments Megatron-LM saved in the checkpoint (``common.pt``'s
``args``), both read by :mod:`megatron_kd.arch.megatron_lm_args`. The weights load through
``dist_checkpointing`` with the same keys a Megatron-Core ``GPTModel`` of either layer spec
(local or Transformer Engine) writes.

:func:`megatron_lm_teacher_dir` finds the iteration directory, :func:`megatron_lm_teacher_arch`
the architecture; a feature this project does not build (multi-latent attention, partial
rotary, dense layers between expert layers, ...) is refused naming the flag.
"""

from __future__ import annotations

import io
import os
import pickle
import types
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from megatron.core import dist_checkpointing

from megatron_kd.arch.config import GPTArchConfig
from megatron_kd.arch.megatron_lm_args import arch_from_megatron_lm_args, parse_megatron_lm_flags

__all__ = ["megatron_lm_teacher_arch", "megatron_lm_teacher_dir"]

_TRACKER = "latest_checkpointed_iteration.txt"
_DIST_METADATA = "metadata.json"


def megatron_lm_teacher_dir(path: str) -> str | None:
    """The ``torch_dist`` directory of a Megatron-LM checkpoint at ``path`` (a ``--save`` root
    whose tracker file names an iteration or ``release``, or an iteration directory), else
    None."""
    if os.path.isfile(os.path.join(path, _DIST_METADATA)):
        return path
    tracker = os.path.join(path, _TRACKER)
    if not os.path.isfile(tracker):
        return None
    with open(tracker, encoding="utf-8") as f:
        text = f.read().strip()
    name = "release" if text == "release" else f"iter_{int(text):07d}" if text.isdigit() else None
    if name is None:
        raise ValueError(f"{tracker}: expected an iteration number or 'release', got {text!r}")
    directory = os.path.join(path, name)
    if not os.path.isfile(os.path.join(directory, _DIST_METADATA)):
        raise ValueError(f"{tracker} names {name}, but {directory!r} is not a torch_dist "
                         f"checkpoint (no {_DIST_METADATA}; legacy per-rank .pt checkpoints "
                         f"are not read: convert with Megatron-LM's --ckpt-convert-format "
                         f"torch_dist)")
    return directory


class _Unknown:
    """Stands in for a class of another Megatron version that a saved ``args`` names (an enum
    this megatron-core lacks, say): the architecture fields are plain values either way."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args = args

    def __setstate__(self, state: Any) -> None:
        self.state = state


class _LenientUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        try:
            return super().find_class(module, name)
        except (ImportError, AttributeError):
            return type(name, (_Unknown,), {"__module__": module})


_LENIENT_PICKLE = types.SimpleNamespace(Unpickler=_LenientUnpickler, load=pickle.load,
                                        __name__="pickle")
class _RawBytesPlanner(dcp.DefaultLoadPlanner):
    """Keeps a stored object's bytes (DCP's default planner unpickles them with the stock
    unpickler, which fails on a class this megatron-core lacks)."""

    def __init__(self) -> None:
        super().__init__()
        self.raw: dict[str, bytes] = {}

    def load_bytes(self, read_item, value) -> None:
        self.raw[read_item.dest_index.fqn] = value.read()


_COMMON_PT = "common.pt"
_COMMON_KEY = "common_state/shard_0_1"  # newer Megatron-Core: the common state inside DCP


def _load_common(directory: str) -> dict:
    """The checkpoint's common (non-tensor) state, ``common.pt`` or (newer Megatron-Core) the
    ``common_state`` object inside the DCP files, read whichever megatron-core wrote it.

    It is a pickle that names Megatron-LM classes, so it is read as Megatron-LM reads it
    (not ``weights_only``): only point ``--kd-teacher-load`` at checkpoints you trust."""
    path = os.path.join(directory, _COMMON_PT)
    if os.path.isfile(path):
        return torch.load(path, map_location="cpu", weights_only=False,
                          pickle_module=_LENIENT_PICKLE)
    planner = _RawBytesPlanner()
    dcp.load({_COMMON_KEY: io.BytesIO()}, storage_reader=dcp.FileSystemReader(directory),
             planner=planner, no_dist=True)
    loaded = torch.load(io.BytesIO(planner.raw[_COMMON_KEY]), map_location="cpu",
                        weights_only=False, pickle_module=_LENIENT_PICKLE)
    return loaded[0] if isinstance(loaded, (list, tuple)) else loaded


def _saved_args(directory: str):
    try:
        common = _load_common(directory)
    except Exception as e:
        raise ValueError(f"Megatron-LM checkpoint {directory!r}: its saved arguments cannot be "
                         f"read ({type(e).__name__}: {e}); give the teacher's flags with "
                         f"--kd-teacher-args") from e
    args = common.get("args") if isinstance(common, dict) else None
    if args is None:
        raise ValueError(f"Megatron-LM checkpoint {directory!r} holds no saved arguments: give "
                         f"the teacher's flags with --kd-teacher-args")
    return args


def megatron_lm_teacher_arch(directory: str, teacher_args: str | None) -> GPTArchConfig:
    """The architecture of the Megatron-LM checkpoint in ``directory`` (a ``torch_dist``
    iteration directory): from ``teacher_args`` (flags or a file of them) when given, else from
    the checkpoint's saved arguments. The padded vocabulary is the stored embedding's rows."""
    stored = dist_checkpointing.load_tensors_metadata(directory)
    key = "embedding.word_embeddings.weight"
    if key not in stored:
        raise ValueError(f"Megatron-LM checkpoint {directory!r} has no {key} (not a GPT model "
                         f"checkpoint?)")
    rows = int(stored[key].global_shape[0])
    args = parse_megatron_lm_flags(teacher_args) if teacher_args else _saved_args(directory)
    return arch_from_megatron_lm_args(args, embedding_rows=rows)
