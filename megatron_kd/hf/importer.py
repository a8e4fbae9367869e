"""``megatron-kd import-hf``: a Hugging Face checkpoint -> Megatron-Core (Llama, Qwen3,
Qwen3-MoE, gpt-oss, Qwen3.5, Qwen3.5-MoE; :mod:`megatron_kd.arch.hf_config` says what
each adds and refuses).

Sources: a directory with ``config.json`` and ``*.safetensors`` (read without instantiating a
``transformers`` model), or a GGUF file read through ``transformers``
(``AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)``, which dequantises the tensors and
undoes llama.cpp's q/k row permutation). The result is written with
:func:`megatron_kd.integration.checkpoint.save_model_checkpoint` (Megatron-Core
``dist_checkpointing``), so it loads at any tensor-parallel size that divides the heads, query
groups, MLP width and padded vocabulary; the tokenizer, when the source has one, is written
next to it as ``tokenizer.json``, and the source's ``config.json``, ``generation_config.json``
and tokenizer files are kept in ``hf/`` (:data:`HF_FILES_DIR`: what ``megatron-kd export-hf``
writes back out).

Weight layout, Hugging Face ``LlamaForCausalLM`` -> Megatron-Core ``GPTModel`` (local spec;
the other families' extra tensors are mapped in :mod:`megatron_kd.hf.import_weights`:
QK norms, experts numbered globally and split per expert-parallel rank, gpt-oss's interleaved
fused experts, biases and sinks):

* ``q_proj [nh*d, h]``, ``k_proj [ng*d, h]``, ``v_proj [ng*d, h]`` -> ``linear_qkv
  [ng*(nh/ng + 2)*d, h]``, interleaved per query group: ``q_1 .. q_{nh/ng}, k, v`` for group 0,
  then group 1, ... (``SelfAttention.get_query_key_value_tensors`` views the output as
  ``[s, b, ng, (nh/ng + 2)*d]``). HF's ``repeat_kv`` gives query head ``i`` the key/value head
  ``i // (nh/ng)``, the same grouping.
* ``gate_proj``, ``up_proj [f, h]`` -> ``linear_fc1 [2f, h] = [gate; up]`` (Megatron's
  ``glu``: ``silu(first half) * second half``).
* RoPE: both use the non-interleaved "rotate half" convention and ``inv_freq = base^(-2i/d)``, so
  q and k need no permutation for safetensors checkpoints.
* ``input_layernorm`` -> ``input_layernorm``, ``post_attention_layernorm`` -> ``pre_mlp_layernorm``,
  ``norm`` -> ``decoder.final_layernorm``; ``embed_tokens`` / ``lm_head`` padded with zero rows to
  ``padded_vocab_size`` (a multiple of ``--make-vocab-size-divisible-by``); the true vocabulary is
  recorded in the architecture as ``vocab_size`` and the loss ignores the padding.

Heads, groups or an MLP width that do not divide by a tensor-parallel size (SmolLM2-135M has 9
heads in 3 groups) are padded with exactly-neutral zeros on request
(``--pad-for-tensor-parallel N``, :func:`pad_for_tensor_parallel`).

Qwen3.5 (:mod:`megatron_kd.hf.import_weights`): ``linear_attn`` (``in_proj_qkv``,
``in_proj_z``, ``in_proj_b``, ``in_proj_a``) -> one ``GatedDeltaNet.in_proj = [q; k; v; z; b;
a]``; ``q_proj`` (per head ``[q, gate]``) -> ``linear_qkv`` per query group ``[q heads, gate
heads, k, v]``; the ``x * (1 + w)`` RMSNorm weights get 1 added (not the DeltaNet's gated norm).

Tokenizers: a teacher and a student must share one tokenizer (same token -> id map); their
embedding matrices may be padded differently. :func:`check_tokenizer_compatible` refuses
tokenizers that truly differ.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
from typing import Any

import torch
import torch.distributed as dist

from megatron_kd.arch.hf_config import text_config
from megatron_kd.arch.megatron_lm_args import megatron_lm_flags, megatron_lm_flags_text
from megatron_kd.data.tokenizer import tokenizer_difference
from megatron_kd.hf.import_weights import (
    arch_from_hf_config,
    convert_hf_state_dict,
    load_converted_into_model,
    pad_for_tensor_parallel,
    shard_megatron_state_dict,
    strip_prefix,
)
from megatron_kd.integration.checkpoint import save_model_checkpoint
from megatron_kd.integration.gpt import build_gpt_model
from megatron_kd.integration.groups import unsharded_model_parallel

__all__ = [
    "HF_FILES_DIR",
    "HF_SIDE_FILES",
    "MEGATRON_LM_FLAGS_FILE",
    "TOKENIZER_FILE",
    "HFCheckpoint",
    "TokenizerMismatchError",
    "add_arguments",
    "arch_from_hf_config",
    "check_tokenizer_compatible",
    "convert_hf_state_dict",
    "import_hf",
    "load_converted_into_model",
    "load_hf_checkpoint",
    "load_tokenizer",
    "pad_for_tensor_parallel",
    "source_dtype",
    "write_megatron_lm_flags",
    "run",
    "shard_megatron_state_dict",
]

TOKENIZER_FILE = "tokenizer.json"
#: The Megatron-LM model flags of an imported checkpoint (:func:`write_megatron_lm_flags`).
MEGATRON_LM_FLAGS_FILE = "megatron_lm_flags.txt"
HF_FILES_DIR = "hf"
"""The subdirectory of an imported checkpoint that keeps the source's own files
(:data:`HF_SIDE_FILES`)."""
HF_SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json",
                 "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                 "chat_template.jinja", "chat_template.json", "tokenizer.model", "vocab.json",
                 "merges.txt")
"""A Hugging Face model directory's files besides the weights that a text model carries."""



class TokenizerMismatchError(ValueError):
    """Two tokenizers do not map the same tokens to the same ids: distillation is meaningless."""


# ----------------------------------------------------------------------------------------------
# Reading a Hugging Face checkpoint
# ----------------------------------------------------------------------------------------------


class HFCheckpoint:
    """A Hugging Face checkpoint in memory: its ``config`` (dict), full ``state_dict`` (names
    without the ``model.`` prefix, ``lm_head.weight`` absent when tied) and ``tokenizer`` (a
    ``tokenizers.Tokenizer`` or None), plus a short ``source`` description."""

    def __init__(self, config: dict, state_dict: dict[str, torch.Tensor], tokenizer: Any,
                 source: str, dtype: torch.dtype = torch.float32) -> None:
        self.config = config
        self.state_dict = state_dict
        self.tokenizer = tokenizer
        self.source = source
        self.dtype = dtype
        """The floating dtype most of the weights were stored in (the tensors in
        ``state_dict`` are float32 whatever it is)."""


def _split_gguf_path(path: str, gguf_file: str | None) -> tuple[str, str] | None:
    """(directory, file name) when the source is a GGUF file, else None."""
    if gguf_file is not None:
        if os.path.isfile(gguf_file):
            return os.path.dirname(os.path.abspath(gguf_file)), os.path.basename(gguf_file)
        return path, gguf_file
    if os.path.isfile(path) and path.endswith(".gguf"):
        return os.path.dirname(os.path.abspath(path)), os.path.basename(path)
    return None


def load_hf_checkpoint(path: str | os.PathLike, *, gguf_file: str | None = None) -> HFCheckpoint:
    """Read a Hugging Face checkpoint: a safetensors directory or a GGUF file.

    ``path`` is a directory holding ``config.json`` and ``*.safetensors`` (and optionally
    ``tokenizer.json``), a ``.gguf`` file, or a directory with ``gguf_file`` naming the file in
    it. Tensors come back in fp32.
    """
    path = os.fspath(path)
    gguf = _split_gguf_path(path, gguf_file)
    if gguf is not None:
        return _load_gguf(*gguf)
    if not os.path.isdir(path):
        raise ValueError(f"Hugging Face checkpoint {path!r} is neither a directory nor a "
                         f".gguf file")
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise ValueError(f"{path!r} has no config.json (a GGUF source needs --gguf-file)")
    with open(config_path, encoding="utf-8") as f:
        config = json.load(f)
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ValueError(f"{path!r} has no *.safetensors files (PyTorch .bin checkpoints are "
                         f"not read: convert them with transformers' save_pretrained first)")
    from safetensors.torch import load_file  # optional: only for safetensors sources

    state_dict: dict[str, torch.Tensor] = {}
    stored: dict[torch.dtype, int] = {}  # elements by stored floating dtype
    for file in files:
        for name, tensor in load_file(file).items():
            if tensor.is_floating_point():
                stored[tensor.dtype] = stored.get(tensor.dtype, 0) + tensor.numel()
            state_dict[name] = tensor.float()
    tokenizer = None
    tok_path = os.path.join(path, TOKENIZER_FILE)
    if os.path.isfile(tok_path):
        tokenizer = load_tokenizer(tok_path)
    return HFCheckpoint(config, strip_prefix(state_dict), tokenizer, source=path,
                        dtype=max(stored, key=stored.get) if stored else torch.float32)


def _load_gguf(directory: str, file_name: str) -> HFCheckpoint:
    try:
        # optional (the demo extra): only GGUF sources load through transformers
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError("reading a GGUF file needs transformers, gguf and accelerate: "
                          "pip install transformers gguf accelerate") from exc
    if not os.path.isfile(os.path.join(directory, file_name)):
        raise ValueError(f"GGUF file {os.path.join(directory, file_name)!r} does not exist")
    # transformers dequantises the GGUF tensors and undoes llama.cpp's q/k permutation.
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=file_name,
                                                 dtype=torch.float32)
    config = model.config.to_dict()
    # No copy: the tensors outlive the module that held them.
    state_dict = {k: v.detach().float() for k, v in model.state_dict().items()}
    if config.get("tie_word_embeddings"):
        state_dict.pop("lm_head.weight", None)
    del model
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=file_name).backend_tokenizer
    return HFCheckpoint(config, strip_prefix(state_dict), tokenizer,
                        source=os.path.join(directory, file_name))


# ----------------------------------------------------------------------------------------------
# Architecture
# ----------------------------------------------------------------------------------------------


# ----------------------------------------------------------------------------------------------
# Tokenizers
# ----------------------------------------------------------------------------------------------


def load_tokenizer(path: str | os.PathLike):
    """A ``tokenizers.Tokenizer`` from a ``tokenizer.json`` file or a directory holding one."""
    from tokenizers import Tokenizer  # optional: only imports that carry a tokenizer

    path = os.fspath(path)
    if os.path.isdir(path):
        path = os.path.join(path, TOKENIZER_FILE)
    if not os.path.isfile(path):
        raise ValueError(f"no tokenizer file at {path!r}")
    return Tokenizer.from_file(path)


def _as_tokenizer(tok):
    return load_tokenizer(tok) if isinstance(tok, (str, os.PathLike)) else tok


def check_tokenizer_compatible(teacher_tokenizer, student_tokenizer) -> int:
    """Raise :class:`TokenizerMismatchError` unless both tokenizers encode text the same way.

    Arguments are ``tokenizers.Tokenizer`` objects, ``transformers`` fast tokenizers, or paths
    to a ``tokenizer.json`` (or a directory holding one). Compared as in
    :func:`megatron_kd.data.tokenizer.tokenizer_difference` (token -> id map with added tokens,
    BPE merges). Returns the shared vocabulary size (the largest id + 1): the ``vocab_size``
    the KD loss uses, whatever padding either model's embedding has.
    """
    t, s = _as_tokenizer(teacher_tokenizer), _as_tokenizer(student_tokenizer)
    diff = tokenizer_difference(t, s)
    if diff:
        raise TokenizerMismatchError(f"teacher and student tokenizers differ: {diff}. "
                                     f"Distillation needs one tokenizer (padding the embedding "
                                     f"differently is fine).")
    vocab = getattr(t, "backend_tokenizer", t).get_vocab(with_added_tokens=True)
    return max(vocab.values()) + 1


# ----------------------------------------------------------------------------------------------
# The import itself
# ----------------------------------------------------------------------------------------------


def import_hf(path: str | os.PathLike, save_dir: str | os.PathLike, *,
              gguf_file: str | None = None,
              make_vocab_size_divisible_by: int = 128, vocab_size: int | None = None,
              params_dtype: torch.dtype = torch.float32, pad_for_tp: int = 1,
              checkpoint: HFCheckpoint | None = None):
    """Convert a Hugging Face checkpoint and save it as a Megatron-Core checkpoint.

    Collective when ``torch.distributed`` is initialised (every rank saves its share;
    ``parallel_state``, if initialised, must have tensor and pipeline size 1); with no process
    group a 1-rank gloo group (and ``parallel_state``) is made for the duration.
    ``vocab_size`` (the true vocabulary) defaults to the tokenizer's size when the source has a
    tokenizer, else to the config's embedding rows. ``pad_for_tp > 1`` pads heads, MLP and
    vocabulary with exactly-neutral zeros so the checkpoint also loads at that tensor-parallel
    size (:func:`pad_for_tensor_parallel`). Returns the
    :class:`~megatron_kd.arch.GPTArchConfig` written.
    """
    ckpt = checkpoint if checkpoint is not None else load_hf_checkpoint(path, gguf_file=gguf_file)
    if vocab_size is None and ckpt.tokenizer is not None:
        vocab_size = ckpt.tokenizer.get_vocab_size(with_added_tokens=True)
    arch = arch_from_hf_config(ckpt.config, vocab_size=vocab_size,
                               make_vocab_size_divisible_by=make_vocab_size_divisible_by)
    hf_arch = arch
    full = convert_hf_state_dict(ckpt.state_dict, arch, dtype=params_dtype)
    if pad_for_tp > 1:
        full, arch = pad_for_tensor_parallel(full, arch, pad_for_tp, make_vocab_size_divisible_by)

    with unsharded_model_parallel("import_hf"):
        model = build_gpt_model(arch, params_dtype=params_dtype, seed=None,
                                perform_initialization=False)
        load_converted_into_model(model, full, arch, 0, 1)
        del full
        save_dir = os.fspath(save_dir)
        extra = {"hf_source": os.path.abspath(ckpt.source) if os.path.exists(ckpt.source)
                 else ckpt.source,
                 "hf_model_type": ckpt.config.get("model_type"),
                 "hf_vocab_rows": int(text_config(ckpt.config)["vocab_size"]),
                 "make_vocab_size_divisible_by": make_vocab_size_divisible_by,
                 "padded_for_tp": pad_for_tp,
                 "hf_arch": hf_arch.to_dict(),
                 "tokenizer": TOKENIZER_FILE if ckpt.tokenizer is not None else None,
                 "hf_files": HF_FILES_DIR}
        save_model_checkpoint(model, arch, save_dir, extra=extra)
        if not dist.is_initialized() or dist.get_rank() == 0:
            if ckpt.tokenizer is not None:
                ckpt.tokenizer.save(os.path.join(save_dir, TOKENIZER_FILE))
            _keep_hf_files(ckpt, os.path.join(save_dir, HF_FILES_DIR))
            write_megatron_lm_flags(arch, save_dir)
        if dist.is_initialized():
            dist.barrier()
    return arch


def write_megatron_lm_flags(arch, directory: str) -> str | None:
    """Write :data:`MEGATRON_LM_FLAGS_FILE` into ``directory``: the Megatron-LM model flags of
    ``arch`` (one per line), what ``pretrain_gpt.py --pretrained-checkpoint DIR`` needs and
    ``--kd-teacher-args`` reads. Returns its path, or None (nothing written) for a model those
    flags cannot express (the reason is the file's absence and :func:`megatron_lm_flags`')."""
    try:
        text = megatron_lm_flags_text(arch, "this checkpoint (written by megatron-kd import-hf)")
    except ValueError:
        return None
    path = os.path.join(directory, MEGATRON_LM_FLAGS_FILE)
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    return path


def _why_no_flags(arch) -> str:
    try:
        megatron_lm_flags(arch)
    except ValueError as e:
        return str(e)
    return "?"


def _keep_hf_files(ckpt: HFCheckpoint, directory: str) -> None:
    """The source's :data:`HF_SIDE_FILES` copied byte for byte into ``directory`` (a GGUF
    source: its config as transformers read it)."""
    os.makedirs(directory, exist_ok=True)
    source = ckpt.source if os.path.isdir(ckpt.source) else None
    for name in HF_SIDE_FILES:
        if source is not None and os.path.isfile(os.path.join(source, name)):
            shutil.copyfile(os.path.join(source, name), os.path.join(directory, name))
    if source is None:
        with open(os.path.join(directory, "config.json"), "w", encoding="utf-8") as f:
            json.dump(ckpt.config, f, indent=2, sort_keys=True)


# ----------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def source_dtype(ckpt: HFCheckpoint) -> torch.dtype:
    """The dtype the checkpoint's weights were published in (bf16 for today's large models),
    if the import can write it; else float32 (a GGUF source, dequantized, is float32)."""
    return ckpt.dtype if ckpt.dtype in _DTYPES.values() else torch.float32


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--hf-path", required=True,
                        help="Hugging Face checkpoint: a directory with config.json and "
                             "*.safetensors, or a .gguf file")
    parser.add_argument("--gguf-file", default=None,
                        help="GGUF file name inside --hf-path (when --hf-path is a directory)")
    parser.add_argument("--save", required=True, help="output Megatron-Core checkpoint directory")
    parser.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                        help="pad the embedding rows to a multiple of this (the checkpoint then "
                             "loads at any tensor-parallel size dividing it); default 128")
    parser.add_argument("--vocab-size", type=int, default=None,
                        help="true vocabulary size recorded for the loss (default: the "
                             "tokenizer's size if the source has one, else the config's)")
    parser.add_argument("--pad-for-tensor-parallel", type=int, default=1, metavar="N",
                        help="pad attention heads (zero-output dummy query groups), MLP width "
                             "and vocabulary so the checkpoint also splits N ways; the model "
                             "computes exactly the same function (e.g. SmolLM2-135M's 9 heads "
                             "in 3 groups become 12 in 4 for N=2)")
    parser.add_argument("--params-dtype", choices=["auto", *sorted(_DTYPES)], default="auto",
                        help="dtype of the saved weights (default auto: the source's own, "
                             "bfloat16 for a model published in bf16; float32 for GGUF)")


def run(args: argparse.Namespace) -> int:
    if os.path.isdir(args.save) and os.listdir(args.save):
        raise ValueError(f"--save directory {args.save!r} is not empty")
    ckpt = load_hf_checkpoint(args.hf_path, gguf_file=args.gguf_file)
    dtype = source_dtype(ckpt) if args.params_dtype == "auto" else _DTYPES[args.params_dtype]
    arch = import_hf(args.hf_path, args.save, gguf_file=args.gguf_file,
                     make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
                     vocab_size=args.vocab_size, params_dtype=dtype,
                     pad_for_tp=args.pad_for_tensor_parallel, checkpoint=ckpt)
    print(f"saved Megatron-Core checkpoint ({str(dtype).removeprefix('torch.')}) to "
          f"{args.save}: {arch.num_layers} layers, "
          f"hidden {arch.hidden_size}, heads {arch.num_attention_heads}/{arch.query_groups}, "
          f"vocab {arch.vocab_size} (padded {arch.padded_vocab_size}), "
          f"tied embeddings {arch.tie_embeddings}")
    flags = os.path.join(args.save, MEGATRON_LM_FLAGS_FILE)
    print(f"Megatron-LM's model flags for it (pretrain_gpt.py --pretrained-checkpoint): {flags}"
          if os.path.isfile(flags) else "no Megatron-LM flags written: "
          f"{_why_no_flags(arch)}")
    return 0
