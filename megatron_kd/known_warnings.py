"""The third-party warnings every ``megatron-kd`` command hides: known, harmless, listed one by one.

Megatron-Core and torch warn about things a user of this project cannot act on: no Apex or
Transformer Engine on a CPU, CUDA stream advice under gloo, deprecations inside their own code.
:data:`KNOWN_WARNINGS` (the ``warnings`` module) and :data:`KNOWN_LOG_RECORDS` (``logging``)
name each one: the start of the exact message, the modules (or logger) it comes from, the
package versions it was seen in and why it is harmless. :func:`install` filters exactly those
and nothing else: a warning not listed here still shows, and so does a listed message coming
from anywhere else.

Nothing is filtered when ``-W`` or ``PYTHONWARNINGS`` chose the warnings (the user's choice
wins), nor after :func:`show_all` (``megatron-kd --verbose``). Standard library only: the
filters must be in place before torch and Megatron-Core are imported (several fire at import),
and ``megatron-kd plan`` never imports torch.

Warnings that *our* code causes are fixed at the cause, never listed here.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import warnings
from dataclasses import dataclass

__all__ = ["KNOWN_LOG_RECORDS", "KNOWN_WARNINGS", "KnownLogRecord", "KnownWarning",
           "gpu_visible", "install", "show_all"]


@dataclass(frozen=True, kw_only=True)
class KnownWarning:
    """One message of the ``warnings`` module."""

    message: str
    """The start of the message, as printed (matched literally, from its first character)."""
    category: type[Warning]
    modules: tuple[str, ...]
    """The modules it is attributed to (the ``__name__`` Python prints it under), in full."""
    seen_in: str
    """The package versions it was seen in."""
    why: str
    """Why it is harmless here."""
    cpu_only: bool = False
    """Harmless only without a GPU (a missing Apex or Transformer Engine, CUDA stream advice):
    shown when a GPU is visible."""

    def __post_init__(self) -> None:
        if not self.message or not self.modules:
            raise ValueError(f"a known warning needs a message and modules, got "
                             f"message={self.message!r}, modules={self.modules!r}")

    @property
    def module_pattern(self) -> str:
        """The ``module`` regex of ``warnings.filterwarnings``: one of :attr:`modules`, whole."""
        return "(?:" + "|".join(re.escape(m) for m in self.modules) + r")\Z"


@dataclass(frozen=True, kw_only=True)
class KnownLogRecord:
    """One message a library logs through ``logging`` (printed without ``Warning:``)."""

    logger: str
    """The logger's name, in full (records of its child loggers are not touched)."""
    message: str
    """The start of the formatted message (matched literally)."""
    seen_in: str
    why: str

    def __post_init__(self) -> None:
        if not self.message or not self.logger:
            raise ValueError(f"a known log record needs a logger and a message, got "
                             f"logger={self.logger!r}, message={self.message!r}")


_MCORE = "megatron-core 0.16.1 and 0.19.2"
_NO_APEX = "Apex and Transformer Engine need a GPU; on CPU Megatron-Core's torch fallbacks are used"

KNOWN_WARNINGS: tuple[KnownWarning, ...] = (
    # --- Apex / Transformer Engine fallbacks, at Megatron-Core's import ----------------------
    KnownWarning(
        message="Transformer Engine and Apex are not installed. Falling back to Torch optimizers.",
        category=UserWarning, modules=("megatron.core.optimizer",),
        seen_in=_MCORE, why=_NO_APEX, cpu_only=True),
    KnownWarning(
        message="Transformer Engine and Apex are not installed. Falling back to local "
                "implementations of multi_tensor_applier and multi_tensor_scale",
        category=UserWarning,
        modules=("megatron.core.optimizer.optimizer",
                 "megatron.core.distributed.fsdp.src.megatron_fsdp.mixed_precision"),
        seen_in=_MCORE, why=_NO_APEX, cpu_only=True),
    KnownWarning(
        message="Transformer Engine and Apex are not installed. Falling back to local "
                "implementations of multi_tensor_applier, multi_tensor_l2norm, and "
                "multi_tensor_scale",
        category=UserWarning, modules=("megatron.core.optimizer.clip_grads",),
        seen_in=_MCORE, why=_NO_APEX, cpu_only=True),
    KnownWarning(
        message="Apex is not installed. Falling back to Torch Norm",
        category=UserWarning,
        modules=("megatron.core.models.backends", "megatron.core.models.gpt.gpt_layer_specs"),
        seen_in=_MCORE, why=_NO_APEX, cpu_only=True),
    # --- CUDA stream advice, at the first forward step -----------------------------------------
    KnownWarning(
        message="When using async grad allreduce it is recommended to set the environment "
                "variable CUDA_DEVICE_MAX_CONNECTIONS to 1",
        category=UserWarning, modules=("megatron.core.tensor_parallel.layers",),
        seen_in=_MCORE, why="a CUDA stream setting: nothing to order under gloo on CPU",
        cpu_only=True),
    KnownWarning(
        message="When using sequence parallelism it is recommended to set the environment "
                "variable CUDA_DEVICE_MAX_CONNECTIONS to 1",
        category=UserWarning, modules=("megatron.core.tensor_parallel.layers",),
        seen_in=_MCORE, why="a CUDA stream setting: nothing to order under gloo on CPU",
        cpu_only=True),
    # --- Megatron-Core's own defaults and internals ----------------------------------------
    KnownWarning(
        message="full scope is deprecated. Use empty cuda_graph_scope to capture the whole layer.",
        category=UserWarning, modules=("megatron.core.transformer.transformer_config",),
        seen_in="megatron-core 0.16.1",
        why="TransformerConfig's own default cuda_graph_scope='full'; CUDA graphs are off"),
    KnownWarning(
        message="full scope is deprecated. Use empty cuda_graph_modules to capture the whole "
                "layer.",
        category=UserWarning, modules=("megatron.core.transformer.transformer_config",),
        seen_in="megatron-core 0.19.2",
        why="TransformerConfig's own default cuda_graph_modules='full'; CUDA graphs are off"),
    KnownWarning(
        message="Could not determine rank from torch.distributed, RANK, or SLURM_PROCID. "
                "Defaulting to rank 0.",
        category=UserWarning, modules=("megatron.core._rank_utils",),
        seen_in="megatron-core 0.19.2",
        why="its rank-0-only logging called in a process with no process group (the demo's "
            "driver reading the held-out samples): that process is rank 0"),
    KnownWarning(
        message="MimoModelConfig is experimental and still under active development.",
        category=UserWarning, modules=("megatron.core.models.mimo.config.base_configs",),
        seen_in="megatron-core 0.19.2",
        why="imported by get_megatron_optimizer; no MIMO model is used"),
    # --- torch.distributed.checkpoint as Megatron-Core's dist_checkpointing calls it ------------
    KnownWarning(
        message="`load_state_dict` is deprecated and will be removed in future versions. "
                "Please use `load` instead.",
        category=FutureWarning, modules=("megatron.core.dist_checkpointing.strategies.torch",),
        seen_in="megatron-core 0.16.1 with torch 2.13.0",
        why="Megatron-Core's torch_dist load strategy calls the old name"),
    KnownWarning(
        message="The argument order of load has been changed. Please check the document to "
                "avoid future breakages.",
        # torch's own logging wrapper around load is what Python names as the caller
        category=UserWarning, modules=("torch.distributed.checkpoint.logger",),
        seen_in="megatron-core 0.19.2 with torch 2.13.0",
        why="Megatron-Core's torch_dist load strategy passes the storage reader by position"),
    KnownWarning(
        message="torch.distributed is disabled, unavailable or uninitialized, assuming the "
                "intent is to load in a single process.",
        category=UserWarning, modules=("torch.distributed.checkpoint.utils",),
        seen_in="megatron-core 0.19.2 with torch 2.13.0",
        why="no_dist=True asked for on purpose: Megatron-Core's dist_checkpointing and our "
            "checkpoint readers load each rank's shards without collectives"),
    KnownWarning(
        message="Please use DTensor instead and we are deprecating ShardedTensor.",
        category=FutureWarning,
        # planner_helpers reads a ShardedTensor's .device; on CPU the shim's TorchFunctionMode
        # passes that call on, so Python names the shim as its caller
        modules=("torch.distributed.checkpoint.planner_helpers",
                 "megatron_kd.integration.cpu_shim"),
        seen_in=f"{_MCORE} with torch 2.13.0",
        why="Megatron-Core's dist_checkpointing hands torch ShardedTensors; we create none"),
    # --- torch 2.13's renamed collectives, called by Megatron-Core -------------------------------
    # Python names torch's own wrapper as the caller, so these would hide ours too:
    # tests/unit/test_known_warnings.py checks that megatron_kd calls neither.
    KnownWarning(
        message="`torch.distributed.all_gather_into_tensor` is deprecated. Please use "
                "`torch.distributed.all_gather_single` instead.",
        category=FutureWarning, modules=("torch.distributed.c10d_logger",),
        seen_in=f"torch 2.13.0, called by {_MCORE} (tensor_parallel: sequence parallelism)",
        why="Megatron-Core's own collectives; the same operation under its new name"),
    KnownWarning(
        message="`torch.distributed.reduce_scatter_tensor` is deprecated. Please use "
                "`torch.distributed.reduce_scatter_single` instead.",
        category=FutureWarning, modules=("torch.distributed.c10d_logger",),
        seen_in=f"torch 2.13.0, called by {_MCORE} (tensor_parallel: sequence parallelism)",
        why="Megatron-Core's own collectives; the same operation under its new name"),
)

KNOWN_LOG_RECORDS: tuple[KnownLogRecord, ...] = (
    KnownLogRecord(
        logger="megatron.core.models.gpt.gpt_model",
        message="GPTModel IS DEPRECATED. GPTModel is only accepting critical bug fixes",
        seen_in="megatron-core 0.19.2",
        why="logged for every GPTModel built; docs/testing.md (CI legs) says why we still "
            "build it"),
    KnownLogRecord(
        logger="megatron.core.dist_checkpointing.strategies.common",
        message="load_common is deprecated and will be removed in a future release.",
        seen_in="megatron-core 0.19.2, reading a checkpoint that 0.16.1 wrote (its common.pt)",
        why="0.19.2 still reads it; a checkpoint saved under 0.19 has no common.pt"),
    KnownLogRecord(
        logger="torch.utils.cpp_extension",
        message="No CUDA runtime is found, using CUDA_HOME=",
        seen_in="torch 2.13.0 (a CUDA build) on a machine without a GPU",
        why="Megatron-Core imports torch's extension builder; nothing is compiled"),
)


class _DropKnown(logging.Filter):
    """Drops one logger's records whose message starts with a known text."""

    def __init__(self, known: KnownLogRecord) -> None:
        super().__init__()
        self.known = known

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.known.message)


def gpu_visible() -> bool:
    """Whether this process may see a GPU, decided without importing torch (the demo hides the
    GPUs before torch first looks): none when ``CUDA_VISIBLE_DEVICES`` (or ROCm's
    ``HIP_VISIBLE_DEVICES``) is empty or -1, else whether an NVIDIA or AMD kernel driver's
    device file exists. A wrong "yes" only shows more warnings."""
    for name in ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES"):
        if os.environ.get(name, "unset").strip() in ("", "-1"):
            return False
    return os.path.exists("/dev/nvidiactl") or os.path.exists("/dev/kfd")


def _user_chose() -> bool:
    # -W options, PYTHONWARNINGS at start-up, or PYTHONWARNINGS set since (by show_all)
    return bool(sys.warnoptions or os.environ.get("PYTHONWARNINGS"))


def install() -> bool:
    """Filter every known warning and log record (those marked ``cpu_only`` only when no GPU
    is visible); nothing when ``-W`` / ``PYTHONWARNINGS`` are given or after :func:`show_all`.
    Installing again is the same as once (call it again once the GPUs are hidden). Returns
    whether the filters are in place."""
    if _user_chose():
        return False
    cpu = not gpu_visible()
    for known in KNOWN_WARNINGS:
        if cpu or not known.cpu_only:
            # filterwarnings drops an identical earlier entry first: installing twice is once
            warnings.filterwarnings("ignore", message=re.escape(known.message),
                                    category=known.category, module=known.module_pattern)
    for known in KNOWN_LOG_RECORDS:
        logger = logging.getLogger(known.logger)
        if not any(isinstance(f, _DropKnown) and f.known == known for f in logger.filters):
            logger.addFilter(_DropKnown(known))
    return True


def show_all() -> None:
    """``megatron-kd --verbose``: every warning once per place, deprecations included, in this
    process and in the processes it starts (they inherit ``PYTHONWARNINGS=default``, which also
    keeps :func:`install` off there). Does nothing when ``-W`` / ``PYTHONWARNINGS`` already
    chose."""
    if _user_chose():
        return
    os.environ["PYTHONWARNINGS"] = "default"
    warnings.simplefilter("default")  # ahead of any filter install() added before
    for known in KNOWN_LOG_RECORDS:  # and the log records again, if install() ran before
        logger = logging.getLogger(known.logger)
        logger.filters[:] = [f for f in logger.filters if not isinstance(f, _DropKnown)]
