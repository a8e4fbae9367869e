"""``--pretrained-checkpoint`` inside Megatron-LM's ``pretrain_gpt.py`` for this project's own
checkpoints: an ``import-hf`` directory, or a ``megatron-kd train`` ``--save`` root or
``iter_N`` directory.

Megatron-LM's own rule stays: the weights of ``--pretrained-checkpoint`` are loaded (finetune
style: iteration 0, no optimizer or RNG state) only when ``--load`` holds no checkpoint, so a
preempted run resumes from its own. Megatron-LM reads a checkpoint root with
``latest_checkpointed_iteration.txt``; an ``import-hf`` directory has none, and a training
root's iteration directory carries optimizer state Megatron-LM need not see. So the model
directory is handed to Megatron-LM as a ``release`` checkpoint: a per-process directory holding
a ``release`` link to it and the tracker file saying ``release`` (the layout Megatron-LM loads
released weights from). A Megatron-LM checkpoint (no ``model_config.json``) is left to
Megatron-LM. The architecture recorded with the weights is checked against Megatron-LM's flags
first, naming both values.
"""

from __future__ import annotations

import argparse
import atexit
import os
import shutil
import tempfile

from megatron_kd.arch import GPTArchConfig
from megatron_kd.integration.checkpoint import (
    LATEST_FILE,
    has_model_config,
    read_checkpoint_arch,
    resolve_model_dir,
)

__all__ = ["use_pretrained_checkpoint"]

_VIEWS: dict[str, str] = {}
"""``{view directory: the model directory it points at}`` made by this process."""


def _ours(path: str) -> bool:
    """An ``import-hf`` / ``iter_N`` directory, or a ``megatron-kd train`` root."""
    if has_model_config(path):
        return True
    try:
        return has_model_config(resolve_model_dir(path))
    except ValueError:
        return False


def _check_arch(args: argparse.Namespace, arch: GPTArchConfig, path: str) -> None:
    """The structural flags Megatron-LM builds the student from, against ``arch``."""
    groups = (args.num_query_groups if getattr(args, "group_query_attention", False)
              else args.num_attention_heads)
    pairs = [("--num-layers", args.num_layers, arch.num_layers),
             ("--hidden-size", args.hidden_size, arch.hidden_size),
             ("--num-attention-heads", args.num_attention_heads, arch.num_attention_heads),
             ("--num-query-groups", groups, arch.query_groups),
             ("--ffn-hidden-size", args.ffn_hidden_size, arch.ffn_hidden_size),
             ("--num-experts", getattr(args, "num_experts", None) or None,
              arch.num_experts or None),
             ("--use-rope-scaling / --rope-scaling-factor",
              (args.rope_scaling_factor if getattr(args, "use_rope_scaling", False) else None)
              if hasattr(args, "use_rope_scaling") else None, arch.rope_scaling_factor),
             ("padded vocabulary (--vocab-size / tokenizer, --make-vocab-size-divisible-by)",
              args.padded_vocab_size, arch.padded_vocab_size)]
    for flag, given, recorded in pairs:
        if given is not None and given != recorded:
            raise ValueError(f"--pretrained-checkpoint {path!r} holds a model with {flag} "
                             f"{recorded}, but this run builds {given}: give the checkpoint's "
                             f"architecture flags")


def use_pretrained_checkpoint(args: argparse.Namespace) -> str | None:
    """Point ``args.pretrained_checkpoint`` at a ``release`` view of this project's checkpoint
    it names (see the module docstring); returns the model directory, or None when there is
    nothing to do (no flag, or a Megatron-LM checkpoint). Idempotent (the hooks call it once
    per model chunk)."""
    path = getattr(args, "pretrained_checkpoint", None)
    if not path:
        return None
    if path in _VIEWS:
        return _VIEWS[path]
    if not os.path.isdir(path):
        raise ValueError(f"--pretrained-checkpoint {path!r} is not a directory")
    if not _ours(path):
        return None  # Megatron-LM's own format: its own loader
    model_dir = os.path.abspath(resolve_model_dir(path))
    _check_arch(args, read_checkpoint_arch(model_dir), path)
    view = tempfile.mkdtemp(prefix="kd_pretrained_")
    atexit.register(shutil.rmtree, view, ignore_errors=True)  # a link and a file; the model stays
    os.symlink(model_dir, os.path.join(view, "release"))
    with open(os.path.join(view, LATEST_FILE), "w", encoding="utf-8") as f:
        f.write("release")
    _VIEWS[view] = model_dir
    args.pretrained_checkpoint = view
    return model_dir
