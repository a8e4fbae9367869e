"""The ``--kd-*`` flags: :func:`add_kd_args` adds them to any argparse parser (Megatron-LM's
own included: pass it as ``extra_args_provider``); :class:`KDArgs` reads them back, validated.

Each flag is a field: of :class:`KDArgs`, or, for the loss flags (``--kd-loss``,
``--kd-temperature``, ``--kd-beta``, ``--kd-weight``, ``--kd-ce-weight``, ``--kd-window-size``,
``--kd-topk-tail``, ``--kd-loss-elementwise``, ``--kd-loss-path``), of
:class:`~megatron_kd.loss.KDLossConfig` (:data:`LOSS_FLAGS`) and its
:class:`~megatron_kd.loss.GpuTuning` (``--kd-loss-gpu-kernels``, ``--kd-loss-window-mib``,
``--kd-loss-weight-grad``: :data:`GPU_LOSS_FLAGS`), validated there once; :class:`KDArgs`
checks only what the loss cannot know (modes, teacher placement, caches). Each default is the
field's (:mod:`megatron_kd.flags`). A new flag: a new field.

Several teachers (a weighted mixture, :mod:`megatron_kd.loss.mixture`): the per-teacher flags
(:data:`PER_TEACHER`) take a list, Megatron-style. ``--kd-mode`` names one mode per teacher (N
values, N teachers); ``--kd-teacher-load`` one checkpoint per teacher that loads one (colocated
and disaggregated, in order), ``--kd-teacher-endpoint`` one per disaggregated teacher,
``--kd-topk-cache`` one per offline teacher, ``--kd-teacher-args`` none or one per loaded
teacher, ``--kd-teacher-dtype`` one for all or one per loaded teacher; ``--kd-teacher-weights``
one weight per teacher (default: equal). One value is stored as it always was (the namespace of
a one-teacher run does not change); :class:`KDArgs` then holds the first teacher, the others in
:attr:`KDArgs.extra_teachers` (each a one-teacher :class:`KDArgs`, the shared flags alike).
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from megatron_kd.flags import (
    WIRE_DTYPES,
    Flag,
    KDSharedFlags,
    add_flags,
    default_of,
    flag,
    flag_spec,
    from_flags,
    shared_flag,
)
from megatron_kd.loss import GpuTuning, KDLossConfig, mixture_weights
from megatron_kd.loss.config import ELEMENTWISE, GPU_KERNELS, PATHS, TOPK_TAILS, WEIGHT_GRADS
from megatron_kd.loss.config import KINDS as KD_LOSSES
from megatron_kd.loss.mixture import check_mixture_kind

__all__ = ["KD_MODES", "LOSS_FLAGS", "PER_TEACHER", "TEACHER_DTYPES", "WIRE_DTYPES", "KDArgs",
           "add_kd_args", "add_teacher_flags", "check_shared_vocabulary", "teacher_label",
           "teacher_torch_dtype"]

KD_MODES = ("colocated", "disaggregated", "offline")
TEACHER_DTYPES = ("fp32", "bf16")
_TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}

_KD = "knowledge distillation"
_DISAGGREGATED = "knowledge distillation: disaggregated teacher"
_OFFLINE = "knowledge distillation: offline top-K teacher cache"

#: The loss flags: :class:`~megatron_kd.loss.KDLossConfig` fields (whose defaults they take).
LOSS_FLAGS = {
    "kind": Flag(name="--kd-loss", choices=KD_LOSSES, group=_KD,
                 help="divergence between teacher and student distributions"),
    "temperature": Flag(name="--kd-temperature", type=float, group=_KD,
                        help="softmax temperature of the KD term (the term is scaled by T^2)"),
    "beta": Flag(name="--kd-beta", type=float, group=_KD,
                 help="teacher weight in the JSD mixture (0 < beta < 1)"),
    "kd_weight": Flag(name="--kd-weight", type=float, group=_KD,
                      help="weight of the KD term in the loss"),
    "ce_weight": Flag(name="--kd-ce-weight", type=float, group=_KD,
                      help="weight of the student's cross-entropy on the labels"),
    "window_size": Flag(name="--kd-window-size", type=int, group=_KD,
                        help="hard upper bound on tokens projected onto the vocabulary at once "
                             "(default: on the GPU path as many as --kd-loss-window-mib "
                             "holds, on the CPU path a 64 MiB fp32 window)"),
    "elementwise": Flag(name="--kd-loss-elementwise", choices=ELEMENTWISE, group=_KD,
                        help="the fused loss's per-block elementwise work: 'eager' PyTorch ops, "
                             "or 'compiled' torch.compile kernels (forward KL with a dense "
                             "teacher only; compiled on the first step)"),
    "path": Flag(name="--kd-loss-path", choices=PATHS, group=_KD,
                 help="the loss's implementation: 'auto' (the fused loss's GPU path for CUDA "
                      "tensors, its CPU path otherwise), 'gpu' / 'cpu' (that path on any "
                      "device), or 'dense': the reference baseline that writes the fp32 "
                      "logits, as Megatron-LM + ModelOpt's logits KD does (for benchmarks, "
                      "not training)"),
    "topk_tail": Flag(name="--kd-topk-tail", choices=TOPK_TAILS, group=_OFFLINE,
                      help="offline: 'renormalize' (the teacher distribution is the softmax of "
                           "the K log-probs) or 'ghost' (the K probabilities plus one bucket for "
                           "the teacher's leftover mass; temperature 1 only)"),
}


def _mib(value: str) -> int:
    """A size in MiB (a flag's string) in bytes."""
    mib = float(value)
    if not mib > 0:
        raise argparse.ArgumentTypeError(f"a size in MiB must be > 0, got {value!r}")
    return int(mib * (1 << 20))


#: The GPU path's flags: :class:`~megatron_kd.loss.GpuTuning` fields (whose defaults they take).
GPU_LOSS_FLAGS = {
    "kernels": Flag(name="--kd-loss-gpu-kernels", choices=GPU_KERNELS, group=_KD,
                    help="the GPU path's per-window elementwise work: 'triton' kernels, "
                         "'compiled' (torch.compile) or 'eager' PyTorch ops (tests, debugging)"),
    "window_bytes": Flag(name="--kd-loss-window-mib", type=_mib, group=_KD, metavar="MIB",
                         help="the GPU path's bound on one window's logits, in MiB (default "
                              "1024: 4 windows of 8K tokens at V = 128K in bf16)"),
    "weight_grad": Flag(name="--kd-loss-weight-grad", choices=WEIGHT_GRADS, group=_KD,
                        help="the GPU path's output-layer weight-gradient accumulator: "
                             "'fp32_gemm' (fp32, rounded once), 'fp32_add' (for a torch whose "
                             "addmm refuses an fp32 output), 'input_dtype' (the weight's "
                             "dtype: half the memory, rounded once a window, as Liger-Kernel's "
                             "chunks are)"),
}

#: The flags of a command that loads a teacher checkpoint (``cache build``, ``teacher serve``).
TEACHER_FLAGS = ("teacher_load", "teacher_args", "teacher_dtype")

#: The :class:`KDArgs` fields whose flag takes one value per teacher (module docstring).
PER_TEACHER = ("mode", "teacher_load", "teacher_args", "teacher_dtype", "teacher_endpoint",
               "topk_cache")


class _PerTeacher(argparse.Action):
    """``nargs="+"``, a single value stored as it is (a one-teacher run's namespace is what it
    always was), several as a list."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values[0] if len(values) == 1 else list(values))


def add_kd_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``--kd-*`` flags to ``parser`` (an argparse parser, e.g. Megatron-LM's)."""
    groups: dict = {}
    lists = dict.fromkeys(PER_TEACHER, _PerTeacher)
    first = ("mode", "teacher_load", "teacher_args")
    add_flags(parser, KDArgs, only=first, groups=groups, lists=lists)
    add_flags(parser, KDLossConfig, specs=LOSS_FLAGS, exclude=("topk_tail",), groups=groups)
    add_flags(parser, GpuTuning, specs=GPU_LOSS_FLAGS, groups=groups)
    add_flags(parser, KDArgs, exclude=first, groups=groups, lists=lists)
    add_flags(parser, KDLossConfig, specs=LOSS_FLAGS, only=("topk_tail",), groups=groups)
    return parser


def add_teacher_flags(parser, *, help: dict[str, str] | None = None,
                      only: tuple[str, ...] = TEACHER_FLAGS,
                      required: tuple[str, ...] = ("teacher_load",)) -> None:
    """The teacher-checkpoint flags (``--kd-teacher-load`` required) on a command's parser;
    ``only``: some of :class:`KDArgs`' flags (its defaults, its help unless ``help`` says
    otherwise)."""
    add_flags(parser, KDArgs, only=only, required=required, help=help, use_groups=False)


@dataclass(kw_only=True)
class KDArgs:
    """The ``--kd-*`` flags, validated."""

    mode: str = flag("colocated", choices=KD_MODES, group=_KD, name="--kd-mode",
                     help="where the teacher runs: 'colocated' (same ranks as the student), "
                          "'disaggregated' (its own ranks) or 'offline' (a top-K cache)")
    """``colocated``, ``disaggregated`` or ``offline``."""

    teacher_load: str | None = flag(
        None, name="--kd-teacher-load", metavar="DIR", group=_KD,
        help="teacher checkpoint: megatron_kd's (dist_checkpointing + model_config.json, its "
             "architecture inside), or a Megatron-LM / Megatron-Bridge torch_dist checkpoint "
             "(--save root or iteration directory)")
    """Teacher checkpoint directory; required when ``weight > 0`` in colocated and
    disaggregated mode, refused in offline mode (the cache stands in for the teacher)."""

    teacher_args: str | None = flag(
        None, name="--kd-teacher-args", metavar="FLAGS_OR_FILE", group=_KD,
        help="a Megatron-LM teacher checkpoint's architecture as Megatron-LM flags "
             "('--num-layers 32 --hidden-size 4096 ...', Megatron-LM's defaults), or a file "
             "holding them; default: the arguments saved in the checkpoint")
    """A Megatron-LM teacher checkpoint's architecture as Megatron-LM flags (or a file of
    them); None reads the checkpoint's saved arguments."""

    loss: KDLossConfig = field(default_factory=KDLossConfig)
    """The loss flags (:data:`LOSS_FLAGS`), validated by :class:`~megatron_kd.loss.KDLossConfig`
    (``vocab_size`` is set per run by :meth:`loss_config`)."""

    teacher_dtype: str = flag("fp32", name="--kd-teacher-dtype", choices=TEACHER_DTYPES,
                              group=_KD, help="parameter dtype of the frozen teacher (the loss "
                                              "computes in fp32 either way)")
    """Parameter dtype of the teacher: ``fp32`` or ``bf16``."""

    teacher_endpoint: str | None = flag(
        None, name="--kd-teacher-endpoint", metavar="DIR_OR_HOST:PORT", group=_DISAGGREGATED,
        help="disaggregated: where the teacher replicas (`megatron-kd teacher serve`) "
             "register: a shared directory or a registry's host:port")
    """Disaggregated: where the teacher replicas register (a directory or ``host:port``)."""

    wire_dtype: str | None = shared_flag(KDSharedFlags, "wire_dtype")
    """Disaggregated: the hidden states' element type on the wire (None: the teacher dtype's)."""

    prefetch_depth: int = shared_flag(KDSharedFlags, "prefetch_depth")
    """Disaggregated: requests in flight (and receive slots). Offline: microbatches decoded
    ahead of the one training."""

    teacher_timeout: float = flag(
        600.0, name="--kd-teacher-timeout", metavar="SECONDS", group=_DISAGGREGATED,
        help="disaggregated: a replica silent this long is dropped and the requests go to "
             "another; with none live for this long, TeacherUnavailableError")
    """Disaggregated: seconds a replica may be silent before the requests move to another (and
    with none live, ``TeacherUnavailableError``)."""

    topk_cache: str | None = flag(
        None, name="--kd-topk-cache", metavar="DIR", group=_OFFLINE,
        help="offline: a cache made by `megatron-kd cache build` for this run's data, seq "
             "length and tokenizer (K comes from its manifest); no teacher is built or loaded")
    """Offline: the top-K cache directory (required in offline mode, refused in the others)."""

    teacher_weights: tuple[float, ...] | None = flag(
        None, name="--kd-teacher-weights", type=float, nargs="+", metavar="W", group=_KD,
        help="several teachers: one weight per --kd-mode teacher (normalized to sum 1; the KD "
             "term is the weighted mixture's forward KL); default: equal weights")
    """One weight per teacher (None: equal), normalized by :attr:`weights`."""

    extra_teachers: tuple[KDArgs, ...] = ()
    """The teachers after the first (this object's own fields), each a one-teacher
    :class:`KDArgs` with the same loss and shared flags (no flag: :meth:`from_args` makes them
    from the per-teacher flags' lists)."""

    def __post_init__(self) -> None:
        self.extra_teachers = tuple(self.extra_teachers)
        if self.teacher_weights is not None:
            self.teacher_weights = tuple(self.teacher_weights)
        n = 1 + len(self.extra_teachers)
        for i, other in enumerate(self.extra_teachers, 1):
            if other.extra_teachers or other.loss != self.loss:
                raise ValueError(f"teacher {i}: an extra teacher is a one-teacher KDArgs with "
                                 f"the run's loss")
        if self.teacher_weights is not None:
            try:
                mixture_weights(self.teacher_weights, n)
            except ValueError as e:
                raise ValueError(f"--kd-teacher-weights {_words(self.teacher_weights)} for "
                                 f"{n} teacher(s): {e}") from None
        try:
            check_mixture_kind(self.loss, n)
        except ValueError as e:
            raise ValueError(str(e).replace(f"kind={self.loss.kind!r}",
                                            f"--kd-loss {self.loss.kind}")
                             .replace("kind='forward_kl'", "--kd-loss forward_kl")) from None
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
    def teachers(self) -> tuple[KDArgs, ...]:
        """Each teacher as a one-teacher :class:`KDArgs` (this object alone with one)."""
        if not self.extra_teachers:
            return (self,)
        return (dataclasses.replace(self, extra_teachers=(), teacher_weights=None),
                *self.extra_teachers)

    def with_teachers(self, teachers: Sequence[KDArgs]) -> KDArgs:
        """These flags with their teachers replaced by ``teachers`` (one-teacher
        :class:`KDArgs` in the same order, e.g. with their directories resolved), the weights
        kept."""
        first, *others = teachers
        if not others:
            return first
        return dataclasses.replace(first, extra_teachers=tuple(others),
                                   teacher_weights=self.teacher_weights)

    @property
    def weights(self) -> tuple[float, ...]:
        """The teachers' weights, normalized to sum 1."""
        n = 1 + len(self.extra_teachers)
        return mixture_weights(self.teacher_weights or (1.0,) * n, n)

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
        """Read the flags added by :func:`add_kd_args`; the loss's ``ValueError`` names the
        flags instead of the fields."""
        try:
            loss = from_flags(KDLossConfig, args, specs=LOSS_FLAGS,
                              gpu_tuning=from_flags(GpuTuning, args, specs=GPU_LOSS_FLAGS))
        except ValueError as e:
            fields = {name: spec.option(name)
                      for name, spec in (*LOSS_FLAGS.items(), *GPU_LOSS_FLAGS.items())}
            message = re.sub(r"\b(" + "|".join(fields) + r")\b",
                             lambda m: fields[m.group(1)], str(e))
            raise ValueError(message) from None
        given = {name: getattr(args, flag_spec(cls, name).dest(name), default_of(cls, name))
                 for name in PER_TEACHER}
        per_teacher = _per_teacher(given)
        if per_teacher is None:
            return from_flags(cls, args, loss=loss)
        first, *others = (from_flags(cls, args, loss=loss, teacher_weights=None, **values)
                          for values in per_teacher)
        weights = getattr(args, flag_spec(cls, "teacher_weights").dest("teacher_weights"), None)
        return dataclasses.replace(first, extra_teachers=tuple(others), teacher_weights=weights)

    def loss_config(self, vocab_size: int | None = None, **overrides: Any) -> KDLossConfig:
        """The run's :class:`~megatron_kd.loss.KDLossConfig`: the flags' one with the true
        vocabulary ``vocab_size`` (columns at or past it are padding) and ``overrides``."""
        return dataclasses.replace(self.loss, vocab_size=vocab_size, **overrides)


def teacher_torch_dtype(name: str) -> torch.dtype:
    """A ``--kd-teacher-dtype`` value as a torch dtype (the one mapping of it)."""
    if name not in _TORCH_DTYPES:
        raise ValueError(f"--kd-teacher-dtype must be one of {TEACHER_DTYPES}, got {name!r}")
    return _TORCH_DTYPES[name]


def _words(values) -> str:
    return " ".join(str(v) for v in values)


def _per_teacher(given: dict[str, Any]) -> list[dict[str, Any]] | None:
    """The per-teacher flags' values (:data:`PER_TEACHER`, as parsed: one value, or a list)
    dealt to the teachers ``--kd-mode`` names: one dict of :class:`KDArgs` fields per teacher;
    None for one teacher (the values as they are). ``ValueError`` names a flag whose count does
    not match the teachers it is for."""
    modes = given["mode"] if isinstance(given["mode"], list) else [given["mode"]]
    if len(modes) == 1:
        for name in PER_TEACHER:
            if isinstance(given[name], list):
                raise ValueError(f"{flag_spec(KDArgs, name).option(name)} "
                                 f"{_words(given[name])}: {len(given[name])} values for one "
                                 f"teacher (--kd-mode {modes[0]}); several teachers take one "
                                 f"--kd-mode each")
        return None
    loaded = [i for i, m in enumerate(modes) if m in ("colocated", "disaggregated")]
    kinds = {"teacher_load": (loaded, "colocated or disaggregated", False),
             "teacher_args": (loaded, "colocated or disaggregated", True),
             "teacher_dtype": (loaded, "colocated or disaggregated", True),
             "teacher_endpoint": ([i for i, m in enumerate(modes) if m == "disaggregated"],
                                  "disaggregated", False),
             "topk_cache": ([i for i, m in enumerate(modes) if m == "offline"], "offline", False)}
    out = [{**{name: default_of(KDArgs, name) for name in PER_TEACHER}, "mode": m}
           for m in modes]
    for name, (who, what, one_for_all) in kinds.items():
        value = given[name]
        values = [] if value is None else value if isinstance(value, list) else [value]
        if name == "teacher_dtype" and not isinstance(value, list):
            values = [value] * len(who)  # one dtype for every loaded teacher
        elif one_for_all and not values:
            continue  # none given: each teacher's default
        if len(values) != len(who):
            option = flag_spec(KDArgs, name).option(name)
            raise ValueError(
                f"{option} {_words(values) or '(not given)'}: {len(values)} value(s) for the "
                f"{len(who)} {what} teacher(s) of --kd-mode {_words(modes)}: give one per "
                f"{what} teacher, in the order --kd-mode names them")
        for i, v in zip(who, values):
            out[i][name] = v
    return out


def teacher_label(i: int, kd: KDArgs) -> str:
    """Teacher ``i`` as an error names it: its mode and its checkpoint or cache."""
    where = kd.topk_cache if kd.mode == "offline" else kd.teacher_load
    return f"teacher {i} (--kd-mode {kd.mode} {where})"


def check_shared_vocabulary(teachers: Sequence[KDArgs], sizes: Sequence[int],
                            tokenizers: Sequence[str] | None = None) -> None:
    """Several teachers' true vocabulary sizes (``sizes``, teacher order) are one: else
    ``ValueError`` naming each teacher, its size and (``tokenizers``) its tokenizer."""
    if len(set(sizes)) <= 1:
        return
    listed = "; ".join(
        f"{teacher_label(i, kd)}: {size} tokens" + (f", {tokenizers[i]}" if tokenizers else "")
        for i, (kd, size) in enumerate(zip(teachers, sizes)))
    raise ValueError(f"the teachers' vocabularies differ ({listed}): a mixture's teachers must "
                     f"share the student's tokenizer")
