"""Megatron-Core GPT models for teacher and student: architecture config, build, checkpoints.

* :class:`GPTArchConfig` -- the architecture of a decoder-only GPT (Llama family by default:
  RMSNorm, SwiGLU, RoPE, GQA, optional tied embeddings), validated, serialisable to JSON.
* :func:`build_gpt_model` -- a Megatron-Core ``GPTModel`` for this rank (the local layer spec on
  CPU, Transformer Engine's spec when it is importable and a GPU is present).
* :func:`save_model_checkpoint` / :func:`load_model_checkpoint` -- Megatron-Core
  ``dist_checkpointing`` of ``model.sharded_state_dict()`` plus ``model_config.json``; a
  checkpoint saved at one tensor-parallel size loads at another (dist_checkpointing reshards).

A checkpoint directory holds the ``dist_checkpointing`` files and ``model_config.json``::

    {"format_version": 1, "arch": {...GPTArchConfig fields...}, "extra": {...}}
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Any

import torch

from megatron_kd.megatron_cpu import checkpoint_save_strategy, install_cpu_shim, on_cpu

__all__ = [
    "CHECKPOINT_FORMAT_VERSION",
    "MODEL_CONFIG_FILE",
    "GPTArchConfig",
    "build_gpt_model",
    "check_checkpoint_tensors",
    "load_model_checkpoint",
    "model_arch",
    "pad_vocab_size",
    "read_checkpoint_arch",
    "read_checkpoint_extra",
    "save_model_checkpoint",
]

MODEL_CONFIG_FILE = "model_config.json"
CHECKPOINT_FORMAT_VERSION = 1

_NORMALIZATIONS = ("RMSNorm", "LayerNorm")
_POSITION_EMBEDDINGS = ("rope", "learned_absolute", "none")


def pad_vocab_size(vocab_size: int, tp_size: int = 1, multiple: int = 128) -> int:
    """Smallest multiple of ``multiple * tp_size`` that is ``>= vocab_size`` (Megatron's rule)."""
    if vocab_size < 1 or tp_size < 1 or multiple < 1:
        raise ValueError(f"pad_vocab_size needs positive sizes, got vocab_size={vocab_size}, "
                         f"tp_size={tp_size}, multiple={multiple}")
    step = multiple * tp_size
    return -(-vocab_size // step) * step


@dataclass(kw_only=True)
class GPTArchConfig:
    """Architecture of a decoder-only Megatron-Core GPT model (not the training recipe)."""

    num_layers: int
    """Number of transformer layers."""

    hidden_size: int
    """Model width ``h``."""

    num_attention_heads: int
    """Number of query heads."""

    num_query_groups: int | None
    """Number of key/value heads (grouped-query attention); None means one per query head."""

    ffn_hidden_size: int
    """Width of the MLP's hidden layer (per branch with SwiGLU)."""

    vocab_size: int
    """The true vocabulary: the tokenizer's number of tokens. Columns at or above it are padding
    and are excluded from the loss."""

    padded_vocab_size: int
    """Rows of the embedding and output layer (``>= vocab_size``); divisible by the
    tensor-parallel size the model is built with."""

    max_position_embeddings: int
    """Longest sequence the model is built for (size of learned position embeddings)."""

    rotary_base: float = 10000.0
    """RoPE base ``theta``."""

    norm_epsilon: float = 1e-5
    """Epsilon of every normalisation layer."""

    normalization: str = "RMSNorm"
    """``"RMSNorm"`` or ``"LayerNorm"``."""

    swiglu: bool = True
    """Gated SiLU MLP (Llama); False gives a GeLU MLP."""

    tie_embeddings: bool = False
    """The output layer reuses the input embedding matrix."""

    add_bias_linear: bool = False
    """Biases in the attention and MLP linear layers."""

    position_embedding_type: str = "rope"
    """``"rope"``, ``"learned_absolute"`` or ``"none"``."""

    init_method_std: float = 0.02
    """Standard deviation of the normal weight init (Megatron's; keeps tied softmaxes sane)."""

    kv_channels: int | None = None
    """Per-head width; None means ``hidden_size // num_attention_heads``."""

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
                     "vocab_size", "padded_vocab_size", "max_position_embeddings"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"GPTArchConfig.{name} must be a positive int, got {value!r}")
        if self.padded_vocab_size < self.vocab_size:
            raise ValueError(
                f"GPTArchConfig.padded_vocab_size ({self.padded_vocab_size}) must be >= "
                f"vocab_size ({self.vocab_size})")
        groups = self.num_query_groups
        if groups is not None:
            if isinstance(groups, bool) or not isinstance(groups, int) or groups < 1:
                raise ValueError(f"GPTArchConfig.num_query_groups must be a positive int or None, "
                                 f"got {groups!r}")
            if self.num_attention_heads % groups != 0:
                raise ValueError(
                    f"GPTArchConfig.num_attention_heads ({self.num_attention_heads}) must be "
                    f"divisible by num_query_groups ({groups})")
        if self.kv_channels is None and self.hidden_size % self.num_attention_heads != 0:
            raise ValueError(
                f"GPTArchConfig.hidden_size ({self.hidden_size}) must be divisible by "
                f"num_attention_heads ({self.num_attention_heads}) unless kv_channels is given")
        if self.kv_channels is not None and (not isinstance(self.kv_channels, int)
                                             or self.kv_channels < 1):
            raise ValueError(f"GPTArchConfig.kv_channels must be a positive int or None, "
                             f"got {self.kv_channels!r}")
        if self.normalization not in _NORMALIZATIONS:
            raise ValueError(f"GPTArchConfig.normalization must be one of {_NORMALIZATIONS}, "
                             f"got {self.normalization!r}")
        if self.position_embedding_type not in _POSITION_EMBEDDINGS:
            raise ValueError(
                f"GPTArchConfig.position_embedding_type must be one of {_POSITION_EMBEDDINGS}, "
                f"got {self.position_embedding_type!r}")
        if not self.rotary_base > 0:
            raise ValueError(f"GPTArchConfig.rotary_base must be > 0, got {self.rotary_base}")
        if not self.norm_epsilon > 0:
            raise ValueError(f"GPTArchConfig.norm_epsilon must be > 0, got {self.norm_epsilon}")
        if not self.init_method_std > 0:
            raise ValueError(f"GPTArchConfig.init_method_std must be > 0, "
                             f"got {self.init_method_std}")

    @property
    def query_groups(self) -> int:
        """Number of key/value heads, resolved."""
        return self.num_query_groups or self.num_attention_heads

    def to_dict(self) -> dict:
        """A JSON-serialisable dict of every field."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> GPTArchConfig:
        """Inverse of :meth:`to_dict`; unknown keys raise ``ValueError``."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"unknown GPTArchConfig fields {unknown}")
        return cls(**d)

    def check_tensor_parallel(self, tp_size: int) -> None:
        """Raise ``ValueError`` when this architecture cannot be split ``tp_size`` ways."""
        problems = []
        if self.num_attention_heads % tp_size:
            problems.append(f"num_attention_heads={self.num_attention_heads}")
        if self.query_groups % tp_size:
            problems.append(f"num_query_groups={self.query_groups}")
        if self.ffn_hidden_size % tp_size:
            problems.append(f"ffn_hidden_size={self.ffn_hidden_size}")
        if self.padded_vocab_size % tp_size:
            problems.append(f"padded_vocab_size={self.padded_vocab_size}")
        if problems:
            raise ValueError(f"tensor-parallel size {tp_size} does not divide "
                             f"{', '.join(problems)}")

    def check_pipeline_parallel(self, pp_size: int) -> None:
        """Raise ``ValueError`` when the layers cannot be split evenly over ``pp_size`` stages."""
        if self.num_layers % pp_size:
            raise ValueError(f"pipeline-parallel size {pp_size} does not divide "
                             f"num_layers={self.num_layers}")


# Fields that do not change the weights or the function the model computes.
_NON_STRUCTURAL_FIELDS = ("init_method_std",)


def _transformer_config(arch: GPTArchConfig, *, tp_size: int, pp_size: int,
                        params_dtype: torch.dtype, **overrides: Any):
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    kwargs = {
        "num_layers": arch.num_layers,
        "hidden_size": arch.hidden_size,
        "num_attention_heads": arch.num_attention_heads,
        "num_query_groups": arch.num_query_groups,
        "ffn_hidden_size": arch.ffn_hidden_size,
        "kv_channels": arch.kv_channels,
        "layernorm_epsilon": arch.norm_epsilon,
        "normalization": arch.normalization,
        "gated_linear_unit": arch.swiglu,
        "activation_func": F.silu if arch.swiglu else F.gelu,
        "add_bias_linear": arch.add_bias_linear,
        "init_method_std": arch.init_method_std,
        "tensor_model_parallel_size": tp_size,
        "pipeline_model_parallel_size": pp_size,
        "params_dtype": params_dtype,
        "pipeline_dtype": params_dtype,
        "bf16": params_dtype == torch.bfloat16,
        "fp16": params_dtype == torch.float16,
        "use_cpu_initialization": on_cpu(),
        "perform_initialization": True,
        "hidden_dropout": 0.0,
        "attention_dropout": 0.0,
        "bias_dropout_fusion": False,
        "apply_rope_fusion": False,
        "masked_softmax_fusion": False,
        "gradient_accumulation_fusion": False,
        "persist_layer_norm": False,
    }
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def _layer_spec(arch: GPTArchConfig):
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )

    if not on_cpu():
        try:
            import transformer_engine  # noqa: F401
        except ImportError:
            pass
        else:
            return get_gpt_layer_with_transformer_engine_spec()
    return get_gpt_layer_local_spec(normalization=arch.normalization)


def build_gpt_model(
    arch: GPTArchConfig,
    *,
    pre_process: bool = True,
    post_process: bool = True,
    params_dtype: torch.dtype = torch.float32,
    pg_collection=None,
    seed: int | None = 1234,
    **config_overrides: Any,
):
    """Build this rank's Megatron-Core ``GPTModel`` for ``arch``.

    ``megatron.core.parallel_state`` must be initialised, or ``pg_collection`` (a
    ``ProcessGroupCollection``) given. With ``seed`` not None, Megatron's model-parallel RNG is
    seeded first (``model_parallel_cuda_manual_seed``; on CPU the CPU generator stands in for
    the CUDA one), so the same seed gives the same weights at any tensor-parallel size.
    ``config_overrides`` go to ``TransformerConfig`` (e.g. ``hidden_dropout=0.1``). The model
    carries its architecture as ``model.kd_arch``.
    """
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    install_cpu_shim()
    if pg_collection is not None:
        tp_size, pp_size = pg_collection.tp.size(), pg_collection.pp.size()
        tp_rank = pg_collection.tp.rank()
    else:
        if not parallel_state.model_parallel_is_initialized():
            raise RuntimeError("build_gpt_model needs megatron.core.parallel_state initialised "
                               "(initialize_model_parallel) or an explicit pg_collection")
        tp_size = parallel_state.get_tensor_model_parallel_world_size()
        pp_size = parallel_state.get_pipeline_model_parallel_world_size()
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
    arch.check_tensor_parallel(tp_size)
    arch.check_pipeline_parallel(pp_size)
    if seed is not None:
        model_parallel_cuda_manual_seed(seed, tp_rank=tp_rank, ep_rank=0, etp_rank=0)
    config = _transformer_config(arch, tp_size=tp_size, pp_size=pp_size,
                                 params_dtype=params_dtype, **config_overrides)
    kwargs = {}
    if pg_collection is not None:
        kwargs["pg_collection"] = pg_collection
    model = GPTModel(
        config=config,
        transformer_layer_spec=_layer_spec(arch),
        vocab_size=arch.padded_vocab_size,
        max_sequence_length=arch.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=arch.tie_embeddings,
        position_embedding_type=arch.position_embedding_type,
        rotary_base=arch.rotary_base,
        **kwargs,
    )
    model.kd_arch = arch
    return model


def model_arch(model) -> GPTArchConfig:
    """The architecture a model was built with (unwrapping DDP / Float16Module wrappers)."""
    while not hasattr(model, "kd_arch") and hasattr(model, "module"):
        model = model.module
    arch = getattr(model, "kd_arch", None)
    if arch is None:
        raise ValueError("model was not built by megatron_kd.models.build_gpt_model "
                         "(no kd_arch attribute)")
    return arch


def _unwrap(model):
    while hasattr(model, "module") and not hasattr(model, "sharded_state_dict"):
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
    from megatron.core import dist_checkpointing

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
    from megatron.core import dist_checkpointing

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


def load_model_checkpoint(model, directory: str | os.PathLike, *,
                          validate_access_integrity: bool = True) -> GPTArchConfig:
    """Load a checkpoint saved by :func:`save_model_checkpoint` into ``model`` (collective).

    The checkpoint's architecture must match the model's (every field except
    ``init_method_std``), else ``ValueError`` names each mismatching field. Returns the
    checkpoint's architecture. ``validate_access_integrity=False`` lets ranks that Megatron's
    groups would call replicas of each other (e.g. a teacher replicated on every pipeline stage)
    all load the same shard.
    """
    from megatron.core import dist_checkpointing

    directory = os.fspath(directory)
    ckpt_arch = read_checkpoint_arch(directory)
    mismatches = arch_mismatches(model_arch(model), ckpt_arch)
    if mismatches:
        raise ValueError(f"checkpoint {directory!r} does not fit the model: "
                         + "; ".join(mismatches))
    check_checkpoint_tensors(directory, ckpt_arch)
    inner = _unwrap(model)
    request = inner.sharded_state_dict()
    loaded = dist_checkpointing.load(request, directory,
                                     validate_access_integrity=validate_access_integrity)
    # A training checkpoint also holds optimizer / iteration state: keep the model's entries.
    inner.load_state_dict({k: v for k, v in loaded.items() if k in request}, strict=True)
    return ckpt_arch
