"""The ``--kd-*`` flags: :func:`add_kd_args` adds them to any argparse parser (Megatron-LM's
own included: pass it as ``extra_args_provider``); :class:`KDArgs` reads them back, validated.

The loss flags (``--kd-loss``, ``--kd-temperature``, ``--kd-beta``, ``--kd-weight``,
``--kd-ce-weight``, ``--kd-window-size``, ``--kd-topk-tail``) become one
:class:`~megatron_kd.loss.KDLossConfig`, validated there once; :class:`KDArgs` checks only what
the loss cannot know (modes, teacher placement, caches). A new flag: add it in
:func:`add_kd_args` and a field in :class:`KDArgs` (or in ``KDLossConfig`` for a loss flag).
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any

import torch

from megatron_kd.loss import KDLossConfig
from megatron_kd.loss.config import ELEMENTWISE, TOPK_TAILS
from megatron_kd.loss.config import KINDS as KD_LOSSES

KD_MODES = ("colocated", "disaggregated", "offline")
TEACHER_DTYPES = ("fp32", "bf16")
WIRE_DTYPES = ("fp32", "bf16", "fp8")
_TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}

# KDLossConfig field -> the flag that sets it (so the loss's own errors name the flag).
_LOSS_FLAGS = {"kind": "--kd-loss", "temperature": "--kd-temperature", "beta": "--kd-beta",
               "kd_weight": "--kd-weight", "ce_weight": "--kd-ce-weight",
               "window_size": "--kd-window-size", "topk_tail": "--kd-topk-tail",
               "elementwise": "--kd-loss-elementwise"}


def add_teacher_args_flag(parser) -> None:
    """``--kd-teacher-args`` on a parser or group (every command that loads a teacher)."""
    parser.add_argument("--kd-teacher-args", default=None, metavar="FLAGS_OR_FILE",
                        help="a Megatron-LM teacher checkpoint's architecture as Megatron-LM "
                             "flags ('--num-layers 32 --hidden-size 4096 ...', Megatron-LM's "
                             "defaults), or a file holding them; default: the arguments saved "
                             "in the checkpoint")


def add_kd_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``--kd-*`` flags to ``parser`` (an argparse parser, e.g. Megatron-LM's)."""
    group = parser.add_argument_group("knowledge distillation")
    group.add_argument("--kd-mode", choices=KD_MODES, default="colocated",
                       help="where the teacher runs: 'colocated' (same ranks as the student), "
                            "'disaggregated' (its own ranks) or 'offline' (a top-K cache)")
    group.add_argument("--kd-teacher-load", default=None, metavar="DIR",
                       help="teacher checkpoint: megatron_kd's (dist_checkpointing + "
                            "model_config.json, its architecture inside), or a Megatron-LM / "
                            "Megatron-Bridge torch_dist checkpoint (--save root or iteration "
                            "directory)")
    add_teacher_args_flag(group)
    group.add_argument("--kd-loss", choices=KD_LOSSES, default="forward_kl",
                       help="divergence between teacher and student distributions")
    group.add_argument("--kd-temperature", type=float, default=1.0,
                       help="softmax temperature of the KD term (the term is scaled by T^2)")
    group.add_argument("--kd-beta", type=float, default=0.5,
                       help="teacher weight in the JSD mixture (0 < beta < 1)")
    group.add_argument("--kd-weight", type=float, default=1.0,
                       help="weight of the KD term in the loss")
    group.add_argument("--kd-ce-weight", type=float, default=0.0,
                       help="weight of the student's cross-entropy on the labels")
    group.add_argument("--kd-window-size", type=int, default=None,
                       help="hard upper bound on tokens projected onto the vocabulary at once "
                            "(default: a 64 MiB fp32 window)")
    group.add_argument("--kd-loss-elementwise", choices=ELEMENTWISE, default="eager",
                       help="the fused loss's per-block elementwise work: 'eager' PyTorch ops, "
                            "or 'compiled' torch.compile kernels (forward KL with a dense "
                            "teacher only; compiled on the first step)")
    group.add_argument("--kd-teacher-dtype", choices=TEACHER_DTYPES, default="fp32",
                       help="parameter dtype of the frozen teacher (the loss computes in fp32 "
                            "either way)")
    d = parser.add_argument_group("knowledge distillation: disaggregated teacher")
    d.add_argument("--kd-teacher-endpoint", default=None, metavar="DIR_OR_HOST:PORT",
                   help="disaggregated: where the teacher replicas (`megatron-kd teacher "
                        "serve`) register: a shared directory or a registry's host:port")
    d.add_argument("--kd-wire-dtype", choices=WIRE_DTYPES, default=None,
                   help="disaggregated: element type of the hidden states on the wire: fp32, "
                        "bf16, or fp8 (e4m3, one fp32 scale per token); default: "
                        "--kd-teacher-dtype")
    d.add_argument("--kd-prefetch-depth", type=int, default=2,
                   help="disaggregated: requests in flight (token ids sent this many "
                        "microbatches ahead, as many receive slots). Offline: microbatches of "
                        "top-K values decoded ahead of training")
    d.add_argument("--kd-teacher-timeout", type=float, default=600.0, metavar="SECONDS",
                   help="disaggregated: a replica silent this long is dropped and the requests "
                        "go to another; with none live for this long, TeacherUnavailableError")
    o = parser.add_argument_group("knowledge distillation: offline top-K teacher cache")
    o.add_argument("--kd-topk-cache", default=None, metavar="DIR",
                   help="offline: a cache made by `megatron-kd cache build` for this run's data, "
                        "seq length and tokenizer (K comes from its manifest); no teacher is "
                        "built or loaded")
    o.add_argument("--kd-topk-tail", choices=TOPK_TAILS, default="renormalize",
                   help="offline: 'renormalize' (the teacher distribution is the softmax of the "
                        "K log-probs) or 'ghost' (the K probabilities plus one bucket for the "
                        "teacher's leftover mass; temperature 1 only)")
    return parser


@dataclass(kw_only=True)
class KDArgs:
    """The ``--kd-*`` flags, validated."""

    mode: str = "colocated"
    """``colocated``, ``disaggregated`` or ``offline``."""

    teacher_load: str | None = None
    """Teacher checkpoint directory; required when ``weight > 0`` in colocated and
    disaggregated mode, refused in offline mode (the cache stands in for the teacher)."""

    teacher_args: str | None = None
    """A Megatron-LM teacher checkpoint's architecture as Megatron-LM flags (or a file of
    them); None reads the checkpoint's saved arguments."""

    loss: KDLossConfig = field(default_factory=KDLossConfig)
    """The loss flags, validated by :class:`~megatron_kd.loss.KDLossConfig` (``vocab_size`` is
    set per run by :meth:`loss_config`)."""

    teacher_dtype: str = "fp32"
    """Parameter dtype of the teacher: ``fp32`` or ``bf16``."""

    teacher_endpoint: str | None = None
    """Disaggregated: where the teacher replicas register (a directory or ``host:port``)."""

    wire_dtype: str | None = None
    """Disaggregated: the hidden states' element type on the wire (None: the teacher dtype's)."""

    prefetch_depth: int = 2
    """Disaggregated: requests in flight (and receive slots). Offline: microbatches decoded
    ahead of the one training."""

    teacher_timeout: float = 600.0
    """Disaggregated: seconds a replica may be silent before the requests move to another (and
    with none live, ``TeacherUnavailableError``)."""

    topk_cache: str | None = None
    """Offline: the top-K cache directory (required in offline mode, refused in the others)."""

    def __post_init__(self) -> None:
        if self.mode not in KD_MODES:
            raise ValueError(f"--kd-mode must be one of {KD_MODES}, got {self.mode!r}")
        if self.teacher_dtype not in TEACHER_DTYPES:
            raise ValueError(f"--kd-teacher-dtype must be one of {TEACHER_DTYPES}, "
                             f"got {self.teacher_dtype!r}")
        if self.mode == "offline":
            if not self.topk_cache:
                raise ValueError("--kd-mode offline needs --kd-topk-cache DIR (made by "
                                 "`megatron-kd cache build`)")
            if self.teacher_load:
                raise ValueError(f"--kd-teacher-load {self.teacher_load!r} is not used with "
                                 f"--kd-mode offline (the teacher's top-K comes from "
                                 f"--kd-topk-cache {self.topk_cache!r}); drop it")
            if self.loss.kind != "forward_kl":
                raise ValueError(f"--kd-loss {self.loss.kind} is not possible with --kd-mode "
                                 f"offline: a top-K cache holds only the teacher's K largest "
                                 f"probabilities, which determine forward_kl only")
            if self.loss.elementwise == "compiled":
                raise ValueError("--kd-loss-elementwise compiled needs a dense teacher "
                                 "(--kd-mode colocated or disaggregated); --kd-mode offline's "
                                 "teacher is the cache's top-K")
            if self.loss.topk_tail == "ghost" and self.loss.temperature != 1.0:
                raise ValueError(f"--kd-topk-tail ghost needs --kd-temperature 1 (the cached "
                                 f"log-probs are at temperature 1), got "
                                 f"{self.loss.temperature}")
        elif self.topk_cache:
            raise ValueError(f"--kd-topk-cache {self.topk_cache!r} is only for --kd-mode offline "
                             f"(mode is {self.mode!r})")
        elif self.loss.topk_tail != "renormalize":
            raise ValueError(f"--kd-topk-tail {self.loss.topk_tail} is only for --kd-mode "
                             f"offline (mode is {self.mode!r}: the teacher is dense)")
        if self.mode in ("colocated", "disaggregated") and self.loss.kd_weight > 0 \
                and not self.teacher_load:
            raise ValueError(f"--kd-weight {self.loss.kd_weight} > 0 in {self.mode} mode needs "
                             f"--kd-teacher-load")
        if self.prefetch_depth < 1:
            raise ValueError(f"--kd-prefetch-depth must be >= 1, got {self.prefetch_depth}")
        if self.wire_dtype is not None and self.wire_dtype not in WIRE_DTYPES:
            raise ValueError(f"--kd-wire-dtype must be one of {WIRE_DTYPES}, got "
                             f"{self.wire_dtype!r}")
        if not self.teacher_timeout > 0:
            raise ValueError(f"--kd-teacher-timeout must be > 0, got {self.teacher_timeout}")
        if self.mode == "disaggregated":
            if not self.teacher_endpoint:
                raise ValueError("--kd-mode disaggregated needs --kd-teacher-endpoint (where "
                                 "`megatron-kd teacher serve` replicas register)")
            if not self.teacher_load:
                raise ValueError("--kd-mode disaggregated needs --kd-teacher-load (the student "
                                 "holds the teacher's output layer, and checks the replicas "
                                 "serve that teacher)")
        elif self.teacher_endpoint:
            raise ValueError(f"--kd-teacher-endpoint {self.teacher_endpoint!r} is only for "
                             f"--kd-mode disaggregated (mode is {self.mode!r})")

    @property
    def wire(self) -> str:
        """The wire's element type (``--kd-wire-dtype``, else the teacher's dtype)."""
        return self.wire_dtype or self.teacher_dtype

    @property
    def teacher_torch_dtype(self) -> torch.dtype:
        """``--kd-teacher-dtype`` as a torch dtype."""
        return teacher_torch_dtype(self.teacher_dtype)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> KDArgs:
        """Read the flags added by :func:`add_kd_args`."""
        return cls(mode=args.kd_mode, teacher_load=args.kd_teacher_load,
                   teacher_args=getattr(args, "kd_teacher_args", None),
                   loss=loss_config_from_flags(args),
                   teacher_dtype=getattr(args, "kd_teacher_dtype", "fp32"),
                   teacher_endpoint=getattr(args, "kd_teacher_endpoint", None),
                   wire_dtype=getattr(args, "kd_wire_dtype", None),
                   prefetch_depth=getattr(args, "kd_prefetch_depth", 2),
                   teacher_timeout=getattr(args, "kd_teacher_timeout", 600.0),
                   topk_cache=getattr(args, "kd_topk_cache", None))

    def loss_config(self, vocab_size: int | None = None, **overrides: Any) -> KDLossConfig:
        """The run's :class:`~megatron_kd.loss.KDLossConfig`: the flags' one with the true
        vocabulary ``vocab_size`` (columns at or past it are padding) and ``overrides``."""
        return dataclasses.replace(self.loss, vocab_size=vocab_size, **overrides)


def teacher_torch_dtype(name: str) -> torch.dtype:
    """A ``--kd-teacher-dtype`` value as a torch dtype (the one mapping of it)."""
    if name not in _TORCH_DTYPES:
        raise ValueError(f"--kd-teacher-dtype must be one of {TEACHER_DTYPES}, got {name!r}")
    return _TORCH_DTYPES[name]


def loss_config_from_flags(args: argparse.Namespace) -> KDLossConfig:
    """The loss flags as a :class:`~megatron_kd.loss.KDLossConfig`; its ``ValueError`` names
    the flags instead of the fields."""
    try:
        return KDLossConfig(kind=args.kd_loss, temperature=args.kd_temperature,
                            beta=args.kd_beta, kd_weight=args.kd_weight,
                            ce_weight=args.kd_ce_weight, window_size=args.kd_window_size,
                            topk_tail=getattr(args, "kd_topk_tail", "renormalize"),
                            elementwise=getattr(args, "kd_loss_elementwise", "eager"))
    except ValueError as e:
        message = re.sub(r"\b(" + "|".join(_LOSS_FLAGS) + r")\b",
                         lambda m: _LOSS_FLAGS[m.group(1)], str(e))
        raise ValueError(message) from None


def kd_loss_config_from_args(args: argparse.Namespace, vocab_size: int | None = None):
    """``KDArgs.from_args(args).loss_config(vocab_size)``."""
    return KDArgs.from_args(args).loss_config(vocab_size)
