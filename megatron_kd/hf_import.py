"""``megatron-kd import-hf``: a Hugging Face Llama-architecture checkpoint -> Megatron-Core.

Sources: a directory with ``config.json`` and ``*.safetensors`` (read without instantiating a
``transformers`` model), or a GGUF file read through ``transformers``
(``AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)``, which dequantises the tensors and
undoes llama.cpp's q/k row permutation). The result is written with
:func:`megatron_kd.models.save_model_checkpoint` (Megatron-Core ``dist_checkpointing``), so it
loads at any tensor-parallel size that divides the heads, query groups, MLP width and padded
vocabulary; the tokenizer, when the source has one, is written next to it as ``tokenizer.json``.

Weight layout, Hugging Face ``LlamaForCausalLM`` -> Megatron-Core ``GPTModel`` (local spec):

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

Tokenizers: a teacher and a student must share one tokenizer (same token -> id map); their
embedding matrices may be padded differently. :func:`check_tokenizer_compatible` refuses
tokenizers that truly differ.
"""

from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import tempfile
from collections.abc import Mapping
from typing import Any

import torch

__all__ = [
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
    "run",
    "shard_megatron_state_dict",
]

TOKENIZER_FILE = "tokenizer.json"

# Hugging Face model types whose weights have exactly the Llama structure this converter maps.
_SUPPORTED_MODEL_TYPES = ("llama",)


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
                 source: str) -> None:
        self.config = config
        self.state_dict = state_dict
        self.tokenizer = tokenizer
        self.source = source


def _strip_prefix(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for name, tensor in state_dict.items():
        name = name.removeprefix("model.")
        out[name] = tensor
    return out


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
    from safetensors.torch import load_file

    state_dict: dict[str, torch.Tensor] = {}
    for file in files:
        for name, tensor in load_file(file).items():
            state_dict[name] = tensor.float()
    tokenizer = None
    tok_path = os.path.join(path, TOKENIZER_FILE)
    if os.path.isfile(tok_path):
        tokenizer = load_tokenizer(tok_path)
    return HFCheckpoint(config, _strip_prefix(state_dict), tokenizer, source=path)


def _load_gguf(directory: str, file_name: str) -> HFCheckpoint:
    try:
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
    return HFCheckpoint(config, _strip_prefix(state_dict), tokenizer,
                        source=os.path.join(directory, file_name))


# ----------------------------------------------------------------------------------------------
# Architecture
# ----------------------------------------------------------------------------------------------


def _rope_theta(config: Mapping[str, Any]) -> float:
    """RoPE base from a config; refuses RoPE scaling this converter does not map."""
    params = config.get("rope_parameters") or {}
    scaling = config.get("rope_scaling") or {}
    rope_type = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type")
    if rope_type not in (None, "default"):
        raise ValueError(f"RoPE type {rope_type!r} (rope scaling) is not supported; "
                         f"only the default RoPE is")
    theta = params.get("rope_theta", config.get("rope_theta", 10000.0))
    return float(theta)


def arch_from_hf_config(config: Mapping[str, Any], *, make_vocab_size_divisible_by: int = 128,
                        vocab_size: int | None = None):
    """The :class:`~megatron_kd.models.GPTArchConfig` of a Hugging Face Llama config dict.

    ``vocab_size`` is the true vocabulary (the tokenizer's size); it defaults to the config's
    embedding rows. The embedding is padded to a multiple of ``make_vocab_size_divisible_by``
    (independent of the tensor-parallel size, so the checkpoint loads at any TP that divides
    that multiple).
    """
    from megatron_kd.models import GPTArchConfig, pad_vocab_size

    model_type = config.get("model_type")
    if model_type not in _SUPPORTED_MODEL_TYPES:
        raise ValueError(f"model_type {model_type!r} is not supported; this converter maps "
                         f"{_SUPPORTED_MODEL_TYPES} (Llama architecture)")
    act = config.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act {act!r} is not supported (Llama uses silu / SwiGLU)")
    for flag in ("attention_bias", "mlp_bias"):
        if config.get(flag):
            raise ValueError(f"{flag}=True is not supported (no biases in the Llama layout)")
    hidden = int(config["hidden_size"])
    heads = int(config["num_attention_heads"])
    groups = int(config.get("num_key_value_heads") or heads)
    head_dim = config.get("head_dim")
    kv_channels = None
    if head_dim is not None and int(head_dim) * heads != hidden:
        kv_channels = int(head_dim)
    embedding_rows = int(config["vocab_size"])
    true_vocab = embedding_rows if vocab_size is None else int(vocab_size)
    if true_vocab > embedding_rows:
        raise ValueError(f"vocab_size {true_vocab} exceeds the checkpoint's {embedding_rows} "
                         f"embedding rows")
    if make_vocab_size_divisible_by < 1:
        raise ValueError(f"make_vocab_size_divisible_by must be >= 1, "
                         f"got {make_vocab_size_divisible_by}")
    return GPTArchConfig(
        num_layers=int(config["num_hidden_layers"]),
        hidden_size=hidden,
        num_attention_heads=heads,
        num_query_groups=groups,
        ffn_hidden_size=int(config["intermediate_size"]),
        vocab_size=true_vocab,
        padded_vocab_size=pad_vocab_size(embedding_rows, 1, make_vocab_size_divisible_by),
        max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
        rotary_base=_rope_theta(config),
        norm_epsilon=float(config.get("rms_norm_eps", 1e-6)),
        normalization="RMSNorm",
        swiglu=True,
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        add_bias_linear=False,
        position_embedding_type="rope",
        init_method_std=float(config.get("initializer_range", 0.02)),
        kv_channels=kv_channels,
    )


# ----------------------------------------------------------------------------------------------
# Weights
# ----------------------------------------------------------------------------------------------


def _head_dim(arch) -> int:
    return arch.kv_channels or arch.hidden_size // arch.num_attention_heads


def _pad_rows(weight: torch.Tensor, rows: int) -> torch.Tensor:
    if weight.shape[0] > rows:
        raise ValueError(f"embedding has {weight.shape[0]} rows, more than padded_vocab_size "
                         f"{rows}")
    if weight.shape[0] == rows:
        return weight
    return torch.cat([weight, weight.new_zeros(rows - weight.shape[0], weight.shape[1])], dim=0)


def _take(state_dict: dict[str, torch.Tensor], name: str, shape: tuple[int, ...]) -> torch.Tensor:
    if name not in state_dict:
        raise ValueError(f"Hugging Face checkpoint has no tensor {name!r}")
    t = state_dict.pop(name)
    if tuple(t.shape) != shape:
        raise ValueError(f"Hugging Face tensor {name!r} has shape {tuple(t.shape)}, "
                         f"the config implies {shape}")
    return t


def convert_hf_state_dict(hf_state_dict: Mapping[str, torch.Tensor], arch,
                          dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Full (unsharded, TP=1) Megatron-Core local-spec state dict from a HF Llama state dict.

    ``hf_state_dict`` names may carry the ``model.`` prefix or not. Every HF tensor must be
    used (``rotary_emb.inv_freq`` buffers aside), else ``ValueError`` lists the leftovers.
    """
    sd = _strip_prefix(hf_state_dict)
    sd = {k: v for k, v in sd.items() if not k.endswith("rotary_emb.inv_freq")}
    h, f = arch.hidden_size, arch.ffn_hidden_size
    nh, ng, d = arch.num_attention_heads, arch.query_groups, _head_dim(arch)
    vocab_rows = None
    out: dict[str, torch.Tensor] = {}

    emb = sd.pop("embed_tokens.weight", None)
    if emb is None:
        raise ValueError("Hugging Face checkpoint has no tensor 'embed_tokens.weight'")
    vocab_rows = emb.shape[0]
    out["embedding.word_embeddings.weight"] = _pad_rows(emb, arch.padded_vocab_size)
    for i in range(arch.num_layers):
        src, dst = f"layers.{i}.", f"decoder.layers.{i}."
        q = _take(sd, src + "self_attn.q_proj.weight", (nh * d, h))
        k = _take(sd, src + "self_attn.k_proj.weight", (ng * d, h))
        v = _take(sd, src + "self_attn.v_proj.weight", (ng * d, h))
        # Per query group: its nh/ng query heads, then its key head, then its value head.
        qkv = torch.cat([q.reshape(ng, nh // ng * d, h), k.reshape(ng, d, h),
                         v.reshape(ng, d, h)], dim=1)
        out[dst + "self_attention.linear_qkv.weight"] = qkv.reshape(ng * (nh // ng + 2) * d, h)
        out[dst + "self_attention.linear_proj.weight"] = _take(
            sd, src + "self_attn.o_proj.weight", (h, nh * d))
        gate = _take(sd, src + "mlp.gate_proj.weight", (f, h))
        up = _take(sd, src + "mlp.up_proj.weight", (f, h))
        out[dst + "mlp.linear_fc1.weight"] = torch.cat([gate, up], dim=0)
        out[dst + "mlp.linear_fc2.weight"] = _take(sd, src + "mlp.down_proj.weight", (h, f))
        out[dst + "input_layernorm.weight"] = _take(sd, src + "input_layernorm.weight", (h,))
        out[dst + "pre_mlp_layernorm.weight"] = _take(
            sd, src + "post_attention_layernorm.weight", (h,))
    out["decoder.final_layernorm.weight"] = _take(sd, "norm.weight", (h,))
    lm_head = sd.pop("lm_head.weight", None)
    if arch.tie_embeddings:
        if lm_head is not None and not torch.equal(lm_head, emb):
            raise ValueError("config says tie_word_embeddings=True but lm_head.weight differs "
                             "from embed_tokens.weight")
    else:
        if lm_head is None:
            raise ValueError("untied checkpoint (tie_word_embeddings=False) has no lm_head.weight")
        if lm_head.shape != (vocab_rows, h):
            raise ValueError(f"lm_head.weight has shape {tuple(lm_head.shape)}, "
                             f"expected {(vocab_rows, h)}")
        out["output_layer.weight"] = _pad_rows(lm_head, arch.padded_vocab_size)
    if sd:
        raise ValueError(f"Hugging Face tensors not mapped (not a plain Llama checkpoint?): "
                         f"{sorted(sd)[:8]}{' ...' if len(sd) > 8 else ''}")
    return {k: v.to(dtype).contiguous() for k, v in out.items()}


def shard_megatron_state_dict(full: Mapping[str, torch.Tensor], arch, tp_rank: int,
                              tp_size: int) -> dict[str, torch.Tensor]:
    """This tensor-parallel rank's shard of a full local-spec state dict.

    Column-parallel (dim 0): ``linear_qkv`` (whole query groups per rank), the embedding and
    output layer (vocabulary rows), and ``linear_fc1`` with its gate and up halves split
    separately (a rank holds ``[gate_r; up_r]``). Row-parallel (dim 1): ``linear_proj``,
    ``linear_fc2``. Norms are replicated.
    """
    arch.check_tensor_parallel(tp_size)
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank {tp_rank} out of range for tp_size {tp_size}")

    def chunk(t: torch.Tensor, dim: int) -> torch.Tensor:
        return t.chunk(tp_size, dim=dim)[tp_rank].contiguous()

    out = {}
    for name, t in full.items():
        if name.endswith(("linear_qkv.weight", "word_embeddings.weight", "output_layer.weight")):
            out[name] = chunk(t, 0)
        elif name.endswith("linear_fc1.weight"):
            gate, up = t.chunk(2, dim=0)
            out[name] = torch.cat([chunk(gate, 0), chunk(up, 0)], dim=0)
        elif name.endswith(("linear_proj.weight", "linear_fc2.weight")):
            out[name] = chunk(t, 1)
        else:
            out[name] = t
    return out


def pad_for_tensor_parallel(full: Mapping[str, torch.Tensor], arch, tp_size: int,
                            make_vocab_size_divisible_by: int = 128):
    """Pad a converted model so that it splits ``tp_size`` ways, computing the same function.

    Returns ``(full', arch')``. Query groups are padded to a multiple of ``tp_size`` with dummy
    groups (``nh/ng`` query heads each) whose q, k, v rows are zero and whose ``linear_proj``
    input columns are zero: a dummy head attends uniformly to zero values and its output is
    multiplied by zero, so it adds exactly nothing. The MLP width is padded to a multiple of
    ``tp_size`` with zero gate/up rows and zero ``linear_fc2`` columns (``silu(0) * 0 = 0``).
    The embedding rows are padded to a multiple of ``make_vocab_size_divisible_by * tp_size``.
    ``kv_channels`` is made explicit (the head width no longer equals ``h / heads``). E.g.
    SmolLM2-135M (9 heads, 3 groups) becomes 12 heads in 4 groups at ``tp_size=2``.
    """
    import dataclasses

    from megatron_kd.models import pad_vocab_size

    if tp_size < 1:
        raise ValueError(f"tp_size must be >= 1, got {tp_size}")
    h, d = arch.hidden_size, _head_dim(arch)
    ng, nh = arch.query_groups, arch.num_attention_heads
    per_group = nh // ng
    new_ng = -(-ng // tp_size) * tp_size
    new_nh = new_ng * per_group
    f, new_f = arch.ffn_hidden_size, -(-arch.ffn_hidden_size // tp_size) * tp_size
    new_vocab = max(arch.padded_vocab_size,
                    pad_vocab_size(arch.padded_vocab_size, tp_size, make_vocab_size_divisible_by))
    out = {}
    for name, t in full.items():
        if name.endswith("linear_qkv.weight") and new_ng != ng:
            t = torch.cat([t, t.new_zeros((new_ng - ng) * (per_group + 2) * d, h)], dim=0)
        elif name.endswith("linear_proj.weight") and new_ng != ng:
            t = torch.cat([t, t.new_zeros(h, (new_nh - nh) * d)], dim=1)
        elif name.endswith("linear_fc1.weight") and new_f != f:
            gate, up = t.chunk(2, dim=0)
            zeros = t.new_zeros(new_f - f, h)
            t = torch.cat([gate, zeros, up, zeros], dim=0)
        elif name.endswith("linear_fc2.weight") and new_f != f:
            t = torch.cat([t, t.new_zeros(h, new_f - f)], dim=1)
        elif name.endswith(("word_embeddings.weight", "output_layer.weight")):
            t = _pad_rows(t, new_vocab)
        out[name] = t
    new_arch = dataclasses.replace(
        arch, num_attention_heads=new_nh, num_query_groups=new_ng, ffn_hidden_size=new_f,
        padded_vocab_size=new_vocab, kv_channels=d if new_nh != nh else arch.kv_channels)
    new_arch.check_tensor_parallel(tp_size)
    return out, new_arch


# Transformer Engine's spec fuses the pre-attention / pre-MLP norms into the next linear layer.
_TE_NORM_NAMES = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
}


def _to_model_names(local: dict[str, torch.Tensor],
                    model_keys: set[str]) -> dict[str, torch.Tensor]:
    out = {}
    for name, t in local.items():
        if name not in model_keys:
            for local_suffix, te_suffix in _TE_NORM_NAMES.items():
                if name.endswith(local_suffix):
                    te_name = name[: -len(local_suffix)] + te_suffix
                    if te_name in model_keys:
                        name = te_name
                    break
        out[name] = t
    return out


def load_converted_into_model(model, full_state_dict: Mapping[str, torch.Tensor], arch,
                              tp_rank: int = 0, tp_size: int = 1) -> None:
    """Copy a full converted state dict into this rank's ``GPTModel`` (no pipeline split).

    Every weight of the model must be covered and every converted tensor used, else
    ``ValueError``; ``_extra_state`` entries are left as they are.
    """
    local = shard_megatron_state_dict(full_state_dict, arch, tp_rank, tp_size)
    own = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    local = _to_model_names(local, set(own))
    missing = sorted(set(own) - set(local))
    unexpected = sorted(set(local) - set(own))
    if missing or unexpected:
        raise ValueError(f"converted weights do not fit the model: missing {missing[:6]}, "
                         f"unexpected {unexpected[:6]}")
    with torch.no_grad():
        for name, target in own.items():
            src = local[name]
            if tuple(src.shape) != tuple(target.shape):
                raise ValueError(f"{name}: converted shape {tuple(src.shape)} != model shape "
                                 f"{tuple(target.shape)}")
            target.copy_(src)


# ----------------------------------------------------------------------------------------------
# Tokenizers
# ----------------------------------------------------------------------------------------------


def load_tokenizer(path: str | os.PathLike):
    """A ``tokenizers.Tokenizer`` from a ``tokenizer.json`` file or a directory holding one."""
    from tokenizers import Tokenizer

    path = os.fspath(path)
    if os.path.isdir(path):
        path = os.path.join(path, TOKENIZER_FILE)
    if not os.path.isfile(path):
        raise ValueError(f"no tokenizer file at {path!r}")
    return Tokenizer.from_file(path)


def _as_tokenizer(tok):
    if isinstance(tok, (str, os.PathLike)):
        return load_tokenizer(tok)
    # A transformers fast tokenizer wraps a tokenizers.Tokenizer.
    return getattr(tok, "backend_tokenizer", tok)


def _model_merges(tok) -> list | None:
    model = json.loads(tok.to_str()).get("model", {})
    return model.get("merges")


def check_tokenizer_compatible(teacher_tokenizer, student_tokenizer) -> int:
    """Raise :class:`TokenizerMismatchError` unless both tokenizers encode text the same way.

    Arguments are ``tokenizers.Tokenizer`` objects, ``transformers`` fast tokenizers, or paths
    to a ``tokenizer.json`` (or a directory holding one). Compared: the token -> id map
    (added tokens included) and, for BPE models, the merges. Returns the shared vocabulary size
    (the largest id + 1): the ``vocab_size`` the KD loss uses, whatever padding either model's
    embedding has.
    """
    t, s = _as_tokenizer(teacher_tokenizer), _as_tokenizer(student_tokenizer)
    t_vocab = t.get_vocab(with_added_tokens=True)
    s_vocab = s.get_vocab(with_added_tokens=True)
    if t_vocab != s_vocab:
        only_t = sorted(set(t_vocab) - set(s_vocab))[:5]
        only_s = sorted(set(s_vocab) - set(t_vocab))[:5]
        moved = sorted(k for k in set(t_vocab) & set(s_vocab) if t_vocab[k] != s_vocab[k])[:5]
        raise TokenizerMismatchError(
            f"teacher and student tokenizers differ: teacher has {len(t_vocab)} tokens, student "
            f"{len(s_vocab)}; only in teacher {only_t}, only in student {only_s}, different ids "
            f"{[(k, t_vocab[k], s_vocab[k]) for k in moved]}. Distillation needs one tokenizer "
            f"(padding the embedding differently is fine).")
    if _model_merges(t) != _model_merges(s):
        raise TokenizerMismatchError("teacher and student tokenizers have the same vocabulary "
                                     "but different BPE merges: they split text differently")
    return max(t_vocab.values()) + 1


# ----------------------------------------------------------------------------------------------
# The import itself
# ----------------------------------------------------------------------------------------------


def _ensure_distributed() -> tuple[bool, tempfile.TemporaryDirectory | None]:
    """Initialise a 1-rank gloo group (file store, no port) when none exists."""
    import torch.distributed as dist

    if dist.is_initialized():
        return False, None
    tmp = tempfile.TemporaryDirectory(prefix="megatron_kd_import_")
    dist.init_process_group("gloo", init_method=f"file://{tmp.name}/store", rank=0, world_size=1,
                            timeout=datetime.timedelta(minutes=30))
    return True, tmp


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
    :class:`~megatron_kd.models.GPTArchConfig` written.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_kd.models import build_gpt_model, save_model_checkpoint

    ckpt = checkpoint if checkpoint is not None else load_hf_checkpoint(path, gguf_file=gguf_file)
    if vocab_size is None and ckpt.tokenizer is not None:
        vocab_size = ckpt.tokenizer.get_vocab_size(with_added_tokens=True)
    arch = arch_from_hf_config(ckpt.config, vocab_size=vocab_size,
                               make_vocab_size_divisible_by=make_vocab_size_divisible_by)
    hf_arch = arch
    full = convert_hf_state_dict(ckpt.state_dict, arch, dtype=params_dtype)
    if pad_for_tp > 1:
        full, arch = pad_for_tensor_parallel(full, arch, pad_for_tp, make_vocab_size_divisible_by)

    own_pg, tmp = _ensure_distributed()
    own_mpu = not parallel_state.model_parallel_is_initialized()
    if own_mpu:
        parallel_state.initialize_model_parallel(1, 1)
    try:
        tp = parallel_state.get_tensor_model_parallel_world_size()
        pp = parallel_state.get_pipeline_model_parallel_world_size()
        if (tp, pp) != (1, 1):
            raise ValueError(f"import_hf builds the model unsharded: initialise parallel_state "
                             f"with tensor and pipeline size 1 (got {tp} and {pp}); the saved "
                             f"checkpoint loads at any size")
        model = build_gpt_model(arch, params_dtype=params_dtype, seed=None,
                                perform_initialization=False)
        load_converted_into_model(model, full, arch, 0, 1)
        del full
        save_dir = os.fspath(save_dir)
        extra = {"hf_source": os.path.abspath(ckpt.source) if os.path.exists(ckpt.source)
                 else ckpt.source,
                 "hf_model_type": ckpt.config.get("model_type"),
                 "hf_vocab_rows": int(ckpt.config["vocab_size"]),
                 "make_vocab_size_divisible_by": make_vocab_size_divisible_by,
                 "padded_for_tp": pad_for_tp,
                 "hf_arch": hf_arch.to_dict(),
                 "tokenizer": TOKENIZER_FILE if ckpt.tokenizer is not None else None}
        save_model_checkpoint(model, arch, save_dir, extra=extra)
        if ckpt.tokenizer is not None and (not dist.is_initialized() or dist.get_rank() == 0):
            ckpt.tokenizer.save(os.path.join(save_dir, TOKENIZER_FILE))
        if dist.is_initialized():
            dist.barrier()
    finally:
        if own_mpu:
            parallel_state.destroy_model_parallel()
        if own_pg:
            dist.destroy_process_group()
            tmp.cleanup()
    return arch


# ----------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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
    parser.add_argument("--params-dtype", choices=sorted(_DTYPES), default="float32",
                        help="dtype of the saved weights (default float32)")


def run(args: argparse.Namespace) -> int:
    if os.path.isdir(args.save) and os.listdir(args.save):
        raise ValueError(f"--save directory {args.save!r} is not empty")
    arch = import_hf(args.hf_path, args.save, gguf_file=args.gguf_file,
                     make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
                     vocab_size=args.vocab_size, params_dtype=_DTYPES[args.params_dtype],
                     pad_for_tp=args.pad_for_tensor_parallel)
    print(f"saved Megatron-Core checkpoint to {args.save}: {arch.num_layers} layers, "
          f"hidden {arch.hidden_size}, heads {arch.num_attention_heads}/{arch.query_groups}, "
          f"vocab {arch.vocab_size} (padded {arch.padded_vocab_size}), "
          f"tied embeddings {arch.tie_embeddings}")
    return 0
