"""``megatron-kd export-hf``: a Megatron-Core checkpoint -> a Hugging Face safetensors model.

Sources: an ``import-hf`` directory, a ``megatron-kd train`` checkpoint (its ``--save`` root,
whose newest complete iteration is taken, or an ``iter_N`` directory) at any tensor, pipeline,
virtual-stage or expert layout, or a Megatron-LM ``torch_dist`` checkpoint (its architecture
from its saved arguments, or Megatron-LM flags). Families: every one ``import-hf`` reads
(:mod:`megatron_kd.arch.hf_config`).

How, and what it holds in memory: one process, no model built, no process group.
:class:`~megatron_kd.hf.checkpoint_reader.CheckpointWeights` reads one *unit* at a time
(the embedding; each layer; the final norm with the output layer) from whatever shards hold it;
:mod:`megatron_kd.hf.export_weights` maps it to Hugging Face names and shapes
(padding cut off); :class:`_ShardWriter` collects units into safetensors files of at most
``max_shard_size`` bytes (a unit is never split; one larger than that gets a file of its own).
A file is written before the next unit is read when that unit would not fit in it. Peak
memory, measured: about 0.4 GB (the process) + ``max_shard_size`` + twice the largest stored
tensor (the embedding, or one layer's experts), never the whole model.

What else is written: ``config.json`` -- the one the checkpoint came from when ``import-hf``
kept it (``hf/config.json`` beside the checkpoint; a training checkpoint: its
``--pretrained-checkpoint``'s, when the checkpoint records it), or one given with
``--hf-config``, else built from the architecture; either way checked to describe the
checkpoint. ``generation_config.json`` and the tokenizer files from the same place (the
checkpoint's own ``tokenizer.json`` when nothing else has one).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
from dataclasses import dataclass, field, replace

import torch

from megatron_kd.arch import GPTArchConfig
from megatron_kd.arch.hf_config import (
    arch_from_hf_config,
    canonical_arch,
    config_for_export,
    text_config,
)
from megatron_kd.hf.checkpoint_reader import CheckpointWeights
from megatron_kd.hf.export_weights import export_embedding, export_final, export_layer
from megatron_kd.hf.importer import HF_FILES_DIR, HF_SIDE_FILES, TOKENIZER_FILE
from megatron_kd.integration.checkpoint import (
    PARTIAL_SUFFIX,
    read_checkpoint_arch,
    read_checkpoint_extra,
    resolve_model_dir,
)
from megatron_kd.integration.megatron_lm_checkpoint import (
    megatron_lm_teacher_arch,
    megatron_lm_teacher_dir,
)

__all__ = ["ExportSummary", "add_arguments", "export_hf", "parse_size", "run"]

_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
_TOP_LEVEL = ("embedding.word_embeddings.weight", "decoder.final_layernorm.weight",
              "output_layer.weight")
SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
#: Where a training checkpoint records the ``--pretrained-checkpoint`` it started from
#: (``model_config.json``'s ``extra``), so its export finds the Hugging Face files kept there.
PRETRAINED_KEY = "pretrained_checkpoint"


def parse_size(text: str | int) -> int:
    """Bytes from ``"5GB"``, ``"500MB"``, ``"2GiB"`` or a plain number (transformers'
    ``max_shard_size`` spelling)."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(?:([KMGT])(i?)B|B)?\s*", str(text),
                     flags=re.IGNORECASE)
    if m is None:
        raise ValueError(f"size {text!r}: expected a number of bytes or e.g. 5GB, 500MB, 2GiB")
    power = "KMGT".index(m.group(2).upper()) + 1 if m.group(2) else 0
    return int(float(m.group(1)) * (1024 if m.group(3) else 1000) ** power)


# ----------------------------------------------------------------------------------------------
# Where the weights and the Hugging Face files come from
# ----------------------------------------------------------------------------------------------


@dataclass(kw_only=True)
class _Source:
    """A checkpoint to export: its ``torch_dist`` directory, stored architecture, the Hugging
    Face architecture (without import-hf's TP padding) and where its Hugging Face files are."""

    directory: str
    """The ``torch_dist`` directory read."""

    arch: GPTArchConfig
    """The architecture of the stored tensors."""

    extra: dict = field(default_factory=dict)
    """``model_config.json``'s ``extra`` (empty for a Megatron-LM checkpoint)."""

    hf_dir: str | None = None
    """A directory with the source's ``config.json`` (and maybe tokenizer files), or None."""


def _hf_files_dir(path: str) -> str:
    """``--hf-config``'s directory: a Hugging Face model directory, a ``config.json`` file, or
    an ``import-hf`` directory (its ``hf/``)."""
    if os.path.isfile(path):
        return os.path.dirname(os.path.abspath(path))
    for candidate in (path, os.path.join(path, HF_FILES_DIR)):
        if os.path.isfile(os.path.join(candidate, "config.json")):
            return candidate
    raise ValueError(f"--hf-config {path!r}: no config.json there (nor in {HF_FILES_DIR}/)")


def _kept_hf_dir(model_dir: str, extra: dict) -> str | None:
    """The Hugging Face files kept beside an imported checkpoint, or beside the checkpoint a
    training checkpoint records it started from (followed back to the import)."""
    seen = set()
    directory: str | None = model_dir
    while directory and directory not in seen:
        seen.add(directory)
        if os.path.isfile(os.path.join(directory, HF_FILES_DIR, "config.json")):
            return os.path.join(directory, HF_FILES_DIR)
        directory = extra.get(PRETRAINED_KEY)
        if directory and os.path.isdir(directory):
            directory = resolve_model_dir(directory)
            extra = read_checkpoint_extra(directory)
    return None


def _resolve_source(load: str, *, hf_config: str | None,
                    megatron_lm_args: str | None) -> _Source:
    if not os.path.isdir(load):
        raise ValueError(f"--load {load!r} is not a directory")
    try:
        directory = resolve_model_dir(load)
    except ValueError as ours:
        mlm = megatron_lm_teacher_dir(load)
        if mlm is None:
            raise ValueError(f"--load: {ours}, nor a Megatron-LM torch_dist checkpoint") from None
        source = _Source(directory=mlm, arch=megatron_lm_teacher_arch(mlm, megatron_lm_args))
    else:
        if megatron_lm_args:
            raise ValueError(f"--megatron-lm-args is for Megatron-LM checkpoints; {load!r} is "
                             f"this project's (its model_config.json has the architecture)")
        extra = read_checkpoint_extra(directory)
        source = _Source(directory=directory, arch=read_checkpoint_arch(directory), extra=extra,
                         hf_dir=_kept_hf_dir(directory, extra))
    if hf_config is not None:
        source.hf_dir = _hf_files_dir(hf_config)
    return source


def _read_json(path: str) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _target_arch(source: _Source, stored_config: dict | None) -> GPTArchConfig:
    """The Hugging Face model's architecture: import-hf's record, else the config's, else the
    stored one; checked to differ from the stored one by TP padding only."""
    arch = source.arch
    if "hf_arch" in source.extra:
        target = GPTArchConfig.from_dict(source.extra["hf_arch"])
    elif stored_config is not None:
        target = replace(arch_from_hf_config(stored_config, vocab_size=arch.vocab_size,
                                             make_vocab_size_divisible_by=1),
                         padded_vocab_size=arch.padded_vocab_size,
                         init_method_std=arch.init_method_std)
    else:
        return arch
    padding = ("num_attention_heads", "num_query_groups", "ffn_hidden_size", "kv_channels",
               "padded_vocab_size", "init_method_std")
    a, t = canonical_arch(arch), canonical_arch(target)
    wrong = [f"{k}: Hugging Face {t[k]!r}, checkpoint {a[k]!r}" for k in a
             if k not in padding and a[k] != t[k]]
    # import-hf's padding adds whole query groups of as many heads, and MLP units
    if (a["kv_channels"] != t["kv_channels"]
            or arch.num_attention_heads // arch.query_groups
            != target.num_attention_heads // target.query_groups
            or target.query_groups > arch.query_groups
            or target.ffn_hidden_size > arch.ffn_hidden_size):
        wrong.append(f"heads {target.num_attention_heads}/{target.query_groups} of width "
                     f"{t['kv_channels']} and MLP {target.ffn_hidden_size} are not the "
                     f"checkpoint's {arch.num_attention_heads}/{arch.query_groups} of width "
                     f"{a['kv_channels']} and MLP {arch.ffn_hidden_size} less padding")
    if wrong:
        raise ValueError(f"the Hugging Face config does not describe checkpoint "
                         f"{source.directory!r}: {'; '.join(wrong)}")
    return target


# ----------------------------------------------------------------------------------------------
# Writing
# ----------------------------------------------------------------------------------------------


class _ShardWriter:
    """Safetensors files of at most ``max_bytes`` each (whole units; a larger unit alone),
    named as transformers names them once their number is known, with the index when there
    is more than one."""

    def __init__(self, directory: str, max_bytes: int) -> None:
        self.directory, self.max_bytes = directory, max_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.storages: set[int] = set()  # of the pending tensors
        self.pending_bytes = 0
        self.files: list[list[str]] = []  # tensor names per file written
        self.total_bytes = 0
        self.total_params = 0

    def make_room(self, nbytes: int) -> None:
        """Write the pending file now if a unit of ``nbytes`` would not fit in it: before
        that unit is read, so the two are never in memory together."""
        if self.pending and self.pending_bytes + nbytes > self.max_bytes:
            self._flush()

    def add(self, unit: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
        size = sum(t.numel() * dtype.itemsize for t in unit.values())
        self.make_room(size)
        for name, t in unit.items():
            t = t.to(dtype)  # the stored tensor itself when it has that dtype
            # safetensors writes contiguous tensors with a storage each: copy only views that
            # need it (a stored [gate; up] gives two views of one storage)
            if not t.is_contiguous():
                t = t.contiguous()
            elif t.untyped_storage().data_ptr() in self.storages:
                t = t.clone()
            self.storages.add(t.untyped_storage().data_ptr())
            self.pending[name] = t
        self.pending_bytes += size
        self.total_bytes += size
        self.total_params += sum(t.numel() for t in unit.values())

    def _flush(self) -> None:
        from safetensors.torch import save_file  # optional: only export and import need it

        save_file(self.pending, os.path.join(self.directory, f"part-{len(self.files)}"),
                  metadata={"format": "pt"})
        self.files.append(list(self.pending))
        self.pending, self.storages, self.pending_bytes = {}, set(), 0

    def close(self) -> list[str]:
        """Write what is pending, name the files, write the index; the file names."""
        if self.pending or not self.files:
            self._flush()
        n = len(self.files)
        names = [SAFE_WEIGHTS_NAME] if n == 1 else [
            f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        for i, name in enumerate(names):
            os.replace(os.path.join(self.directory, f"part-{i}"),
                       os.path.join(self.directory, name))
        if n > 1:
            index = {"metadata": {"total_size": self.total_bytes},
                     "weight_map": {t: names[i] for i, tensors in enumerate(self.files)
                                    for t in sorted(tensors)}}
            index["weight_map"] = dict(sorted(index["weight_map"].items()))
            with open(os.path.join(self.directory, SAFE_WEIGHTS_INDEX_NAME), "w",
                      encoding="utf-8") as f:
                json.dump(index, f, indent=2)
        return names


def _generation_config(config: dict) -> dict:
    """transformers' ``GenerationConfig.from_model_config`` in short: the token ids the
    config has."""
    out: dict = {"_from_model_config": True}
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if config.get(key) is not None:
            out[key] = config[key]
    return out


def _write_side_files(out_dir: str, source: _Source, config: dict) -> list[str]:
    """``config.json``, ``generation_config.json`` and the tokenizer files; their names."""
    with open(os.path.join(out_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    written = ["config.json"]
    for name in HF_SIDE_FILES:
        if name != "config.json" and source.hf_dir is not None \
                and os.path.isfile(os.path.join(source.hf_dir, name)):
            shutil.copyfile(os.path.join(source.hf_dir, name), os.path.join(out_dir, name))
            written.append(name)
    # else the tokenizer import-hf saved beside the weights (a GGUF source keeps none in hf/)
    beside = [source.directory]
    if source.hf_dir is not None and os.path.basename(source.hf_dir) == HF_FILES_DIR:
        beside.append(os.path.dirname(source.hf_dir))
    for directory in beside if TOKENIZER_FILE not in written else ():
        if os.path.isfile(os.path.join(directory, TOKENIZER_FILE)):
            shutil.copyfile(os.path.join(directory, TOKENIZER_FILE),
                            os.path.join(out_dir, TOKENIZER_FILE))
            written.append(TOKENIZER_FILE)
            break
    if "generation_config.json" not in written:
        with open(os.path.join(out_dir, "generation_config.json"), "w", encoding="utf-8") as f:
            json.dump(_generation_config(config), f, indent=2, sort_keys=True)
        written.append("generation_config.json")
    return written


# ----------------------------------------------------------------------------------------------
# The export
# ----------------------------------------------------------------------------------------------


@dataclass(kw_only=True)
class ExportSummary:
    """What :func:`export_hf` wrote."""

    model_type: str
    """The Hugging Face ``model_type`` of ``config.json``."""

    config_from: str
    """Where ``config.json`` came from: a directory, or ``"architecture"``."""

    dtype: str
    """The weights' dtype."""

    params: int
    """Parameters written."""

    bytes: int
    """Bytes of weights written."""

    weight_files: list[str]
    """The safetensors files."""

    other_files: list[str]
    """Config, generation config and tokenizer files."""

    peak_rss_bytes: int
    """This process's peak resident memory at the end (Linux ``ru_maxrss``)."""


def _check_model_keys(reader: CheckpointWeights) -> None:
    """Refuse model tensors no family maps (multi-token prediction, learned positions...)
    before anything is written."""
    other = [k for k in reader.model_keys()
             if not k.startswith("decoder.layers.") and k not in _TOP_LEVEL]
    if other:
        raise ValueError(f"checkpoint {reader.directory!r} holds tensors no Hugging Face family "
                         f"exported here has: {other[:8]}")


def _export_weights(reader: CheckpointWeights, source: _Source, target: GPTArchConfig,
                    vocab_rows: int, writer: _ShardWriter, dtype: torch.dtype) -> None:
    arch = source.arch

    def room_for(stored_bytes: int) -> None:  # the unit's size as exported
        writer.make_room(stored_bytes * dtype.itemsize // reader.dtype(_TOP_LEVEL[0]).itemsize)

    embedding = reader.read("embedding.word_embeddings.weight")
    writer.add(export_embedding(embedding, arch, vocab_rows), dtype)
    if arch.tie_embeddings and reader.has("output_layer.weight") \
            and not torch.equal(reader.read("output_layer.weight"), embedding):
        raise ValueError("tied checkpoint whose stored output_layer.weight differs from its "
                         "embedding")
    del embedding
    for i in range(arch.num_layers):
        room_for(reader.layer_nbytes(i))
        writer.add(export_layer(reader.layer(i), i, arch, target), dtype)
    if not arch.tie_embeddings:
        room_for(reader.nbytes("output_layer.weight"))
    output = None if arch.tie_embeddings else reader.read("output_layer.weight")
    writer.add(export_final(reader.read("decoder.final_layernorm.weight"), output, arch,
                            vocab_rows), dtype)
    left = reader.unread()
    if left:
        raise ValueError(f"checkpoint tensors not exported: {left[:8]}")


def export_hf(load: str | os.PathLike, save: str | os.PathLike, *, dtype: str = "auto",
              hf_config: str | None = None, megatron_lm_args: str | None = None,
              max_shard_size: int | str = "5GB") -> ExportSummary:
    """Export the checkpoint at ``load`` as a Hugging Face model in ``save`` (a new or empty
    directory; written as ``save.partial`` and renamed when complete).

    ``dtype``: ``"auto"`` (the stored weights'), ``"bfloat16"`` or ``"float32"``.
    ``hf_config``: a directory (or ``config.json``) whose config and tokenizer files to write
    instead of the ones kept with the checkpoint. ``megatron_lm_args``: a Megatron-LM
    checkpoint's architecture flags (default: its saved arguments). One process; see the
    module for what it holds in memory.
    """
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ValueError("export-hf runs as one process (not under torchrun): it reads every "
                         "shard itself")
    if dtype != "auto" and dtype not in _DTYPES:
        raise ValueError(f"dtype must be auto, bfloat16 or float32, got {dtype!r}")
    load, save = os.fspath(load), os.fspath(save).rstrip("/")
    if os.path.isdir(save) and os.listdir(save):
        raise ValueError(f"--save directory {save!r} is not empty")
    max_bytes = parse_size(max_shard_size)
    if max_bytes < 1:
        raise ValueError(f"max_shard_size must be positive, got {max_shard_size!r}")
    source = _resolve_source(load, hf_config=hf_config, megatron_lm_args=megatron_lm_args)
    stored = (_read_json(os.path.join(source.hf_dir, "config.json"))
              if source.hf_dir is not None else None)
    target = _target_arch(source, stored)
    reader = CheckpointWeights(source.directory, num_layers=source.arch.num_layers,
                               num_experts=source.arch.num_experts)
    _check_model_keys(reader)
    weights_dtype = (reader.dtype("embedding.word_embeddings.weight") if dtype == "auto"
                     else _DTYPES[dtype])
    dtype_name = str(weights_dtype).removeprefix("torch.")
    vocab_rows = (int(text_config(stored)["vocab_size"]) if stored is not None
                  else int(source.extra.get("hf_vocab_rows") or target.vocab_size))
    config = config_for_export(stored, target, dtype=dtype_name, vocab_rows=vocab_rows)

    partial = save + PARTIAL_SUFFIX
    shutil.rmtree(partial, ignore_errors=True)
    os.makedirs(partial)
    writer = _ShardWriter(partial, max_bytes)
    _export_weights(reader, source, target, vocab_rows, writer, weights_dtype)
    files = writer.close()
    others = _write_side_files(partial, source, config)
    if os.path.isdir(save):
        os.rmdir(save)  # empty (checked above)
    os.replace(partial, save)
    return ExportSummary(model_type=config["model_type"],
                         config_from=source.hf_dir or "architecture", dtype=dtype_name,
                         params=writer.total_params, bytes=writer.total_bytes,
                         weight_files=files, other_files=others,
                         peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)


# ----------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--load", required=True,
                        help="the checkpoint: an import-hf directory, a megatron-kd train "
                             "--save directory (its newest iteration) or iter_N directory, or "
                             "a Megatron-LM torch_dist checkpoint")
    parser.add_argument("--save", required=True,
                        help="output Hugging Face model directory (new or empty)")
    parser.add_argument("--dtype", choices=("auto", *_DTYPES), default="auto",
                        help="dtype of the written weights; auto (default): the checkpoint's")
    parser.add_argument("--hf-config", default=None, metavar="PATH",
                        help="a Hugging Face model directory or config.json (or an import-hf "
                             "directory) whose config.json, generation_config.json and "
                             "tokenizer files to write (default: the ones import-hf kept with "
                             "the checkpoint, else a config built from the architecture)")
    parser.add_argument("--megatron-lm-args", default=None, metavar="FLAGS_OR_FILE",
                        help="a Megatron-LM checkpoint's architecture as Megatron-LM flags (or "
                             "a file of them), as --kd-teacher-args takes them (default: the "
                             "arguments saved in the checkpoint)")
    parser.add_argument("--max-shard-size", default="5GB",
                        help="largest safetensors file (default 5GB; a layer is never split): "
                             "also bounds the memory export holds for the file being filled")


def run(args: argparse.Namespace) -> int:
    summary = export_hf(args.load, args.save, dtype=args.dtype, hf_config=args.hf_config,
                        megatron_lm_args=args.megatron_lm_args,
                        max_shard_size=args.max_shard_size)
    print(f"saved Hugging Face {summary.model_type} model to {args.save}: "
          f"{summary.params:,} parameters in {summary.dtype} ({summary.bytes / 1e9:.2f} GB, "
          f"{len(summary.weight_files)} safetensors file(s)); config from "
          f"{summary.config_from}; {', '.join(summary.other_files)}; peak memory "
          f"{summary.peak_rss_bytes / 2**30:.2f} GiB")
    return 0
