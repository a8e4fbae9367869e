"""Megatron-LM's flags with ``--kd-*``: what is refused before anything is built, and the checks
of the loss its flags ask for.

* :func:`check_megatron_args` (:func:`check_megatron_teachers`: one teacher or several)
  validates the ``--kd-*`` flags against Megatron-LM's other flags and each teacher's
  checkpoint (``ValueError`` naming the flag and value), and
  :func:`open_topk_cache` an offline run's cache against them: the layouts the
  integration (:mod:`megatron_kd.megatron_lm`) cannot run, and the Megatron-LM
  features of :data:`CONFLICTING_FLAGS` that would distil another way or build the model
  twice.
* :class:`LossChecks` / :func:`validate_loss`: Megatron-LM's own ``pretrain_gpt.py``
  ``loss_func`` hands each microbatch's loss to Megatron-Core's rerun state machine
  (``--check-for-nan-in-loss-and-grad``, ``--check-for-spiky-loss``); the ``--kd-*`` loss
  function replaces that one, so it makes the same calls.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from functools import partial

import torch
from megatron.core.rerun_state_machine import get_rerun_state_machine

from megatron_kd.arch import Role, check_layout
from megatron_kd.cache.format import CacheFormatError
from megatron_kd.cache.reader import TopKCacheReader
from megatron_kd.integration.teacher import check_teacher
from megatron_kd.megatron_lm.pretrained import use_pretrained_checkpoint
from megatron_kd.modes.args import KDArgs, check_shared_vocabulary
from megatron_kd.parallel import ParallelLayout
from megatron_kd.parallel.sequence import check_sequence_split

__all__ = ["CONFLICTING_FLAGS", "SPIKY_LOSS_FACTOR", "ConflictingFlag", "LossChecks",
           "check_megatron_args", "check_megatron_teachers", "megatron_lm_layout",
           "open_topk_cache", "teacher_attention", "validate_loss"]

SPIKY_LOSS_FACTOR = 10
"""A loss more than this many times the largest seen is spiky (Megatron-LM's
``pretrain_gpt.SPIKY_LOSS_FACTOR``, the same in both patched trees)."""

@dataclass(frozen=True)
class ConflictingFlag:
    """A Megatron-LM flag refused with ``--kd-*``."""

    attribute: str
    """Its ``args`` attribute."""

    flag: str
    """As the user wrote it."""

    why: str
    """What would go wrong."""


CONFLICTING_FLAGS = (
    # ModelOpt's flag (megatron/post_training/arguments.py): an attribute only where
    # nvidia-modelopt is installed
    ConflictingFlag("export_kd_teacher_load", "--export-kd-teacher-load",
                    "it turns on ModelOpt's own distillation: a second teacher and a second KD "
                    "loss beside the --kd-* ones, and the reported losses would be neither"),
    # Megatron-LM's offline logits distillation: only in trees from 277c4f8 (2026-06-12) on
    ConflictingFlag("logits_load_dir", "--logits-load-dir",
                    "Megatron-LM's cached-logits loss hooks the output layer that --kd-* "
                    "bypasses, and the --kd-* loss function replaces its; for a top-K cache use "
                    "`megatron-kd train --kd-mode offline`"),
    # the same feature's writer: only in trees from 277c4f8 (2026-06-12) on
    ConflictingFlag("logits_save_dir", "--logits-save-dir",
                    "its logits saver hooks the output layer that --kd-* bypasses (it would save "
                    "nothing true); write teacher top-K targets with `megatron-kd cache build`"),
    # runtime upcycling: only in trees from 6c3ada7 (2024-09-06) on
    ConflictingFlag("moe_use_upcycling", "--moe-use-upcycling",
                    "it builds the model twice (dense, then with experts), and so would build "
                    "and load the teacher twice; upcycle first, then distil from the upcycled "
                    "checkpoint"),
)
"""The Megatron-LM flags refused with ``--kd-*``. Each exists only in some Megatron-LM trees or
setups, so :func:`check_megatron_args` reads them with ``getattr(args, attribute, None)``
(absent: not given), and nothing else reads them."""


def check_megatron_args(args: argparse.Namespace):
    """Validate the ``--kd-*`` flags against Megatron-LM's other flags and the teacher
    checkpoint; ``ValueError`` with the offending values. Reads only small files.

    Returns ``(kd, teacher_arch)``: the :class:`~megatron_kd.modes.args.KDArgs` (with the
    teacher directory resolved) and the first teacher's architecture (None without a loaded
    teacher); several teachers: :func:`check_megatron_teachers` gives each one's.
    """
    kd, archs = check_megatron_teachers(args)
    return kd, archs[0]


def check_megatron_teachers(args: argparse.Namespace):
    """:func:`check_megatron_args` for one teacher or several (``--kd-mode`` once per
    teacher): each loaded teacher (colocated, disaggregated) checked as one is, each offline
    cache opened (:func:`open_topk_cache`); several teachers' vocabularies must agree, and at
    most one may be disaggregated.

    Returns ``(kd, teacher_archs)``: the :class:`~megatron_kd.modes.args.KDArgs` (each
    teacher's directory resolved) and one architecture per teacher (``kd.teachers`` order;
    None for an offline teacher, or without a teacher).
    """
    kd = KDArgs.from_args(args)
    teachers = kd.teachers
    if kd.extra_teachers:
        _check_one_look_ahead(teachers)
    for conflict in CONFLICTING_FLAGS:
        # absent from some trees (see CONFLICTING_FLAGS): absent is not given
        value = getattr(args, conflict.attribute, None)
        if value:
            given = conflict.flag if value is True else f"{conflict.flag} {value!r}"
            raise ValueError(f"{given} cannot be combined with --kd-*: {conflict.why}")
    layout = megatron_lm_layout(args)
    _check_sequence_split(args, layout)
    if kd.loss.kd_weight > 0:
        _check_whole_sequences(args)
    if args.init_model_with_meta_device:
        raise ValueError("--init-model-with-meta-device is not supported with --kd-*: the "
                         "teacher must be built with real weights to load its checkpoint")
    if args.mtp_num_layers:
        raise ValueError(f"--mtp-num-layers {args.mtp_num_layers} is not supported with --kd-*")
    # before Megatron-LM loads it (after the model is built): this project's checkpoints
    use_pretrained_checkpoint(args)
    checked = [_check_one_teacher(t, args, layout) for t in teachers]
    resolved = [t for t, _, _ in checked]
    if len(checked) > 1:
        check_shared_vocabulary(resolved, [vocab for _, _, vocab in checked])
    return kd.with_teachers(resolved), tuple(arch for _, arch, _ in checked)


def _check_one_look_ahead(teachers) -> None:
    """Megatron-LM's data iterator is read ahead once (:class:`~megatron_kd.teacher.lookahead.
    Lookahead`): its :meth:`ahead` hands each item to one reader, so a second disaggregated
    teacher's requests would take microbatches from the first's. Refused."""
    served = [i for i, t in enumerate(teachers) if t.mode == "disaggregated"]
    if len(served) > 1:
        modes = " ".join(t.mode for t in teachers)
        raise ValueError(f"--kd-mode {modes}: Megatron-LM's pretrain_gpt.py takes at most one "
                         f"disaggregated teacher (teachers {served} are): its data iterator is "
                         f"read ahead once, for one teacher's requests; serve one of them, or "
                         f"cache it (`megatron-kd cache build`, --kd-mode offline), or train "
                         f"with `megatron-kd train`")


def _check_one_teacher(kd: KDArgs, args: argparse.Namespace, layout: ParallelLayout):
    """``(kd, arch, vocab)`` of one teacher: its directory resolved and its architecture
    checked against the layout and the student's vocabulary (None: offline, its cache opened
    and checked, or no teacher), and its true vocabulary size (None without a teacher)."""
    if kd.mode == "offline":
        return kd, None, open_topk_cache(kd, args).spec.vocab_size
    if not kd.teacher_load:
        return kd, None, None
    teacher_dir, arch = check_teacher(kd.teacher_load, seq_length=args.seq_length or 1,
                                      teacher_args=kd.teacher_args)
    kd = dataclasses.replace(kd, teacher_load=teacher_dir)
    # colocated: the whole teacher in the student's groups; served: its output layer over the
    # student's tensor-parallel ranks
    role = Role.COLOCATED_TEACHER if kd.mode == "colocated" else Role.TEACHER_OUTPUT_LAYER
    teacher_layout = layout.colocated() if kd.mode == "colocated" else layout
    try:
        check_layout(arch, teacher_layout, role=role,
                     transformer_engine=getattr(args, "transformer_impl", None)
                     == "transformer_engine")
    except ValueError as e:
        raise ValueError(f"teacher {teacher_dir!r}: {e}") from None
    padded = args.padded_vocab_size
    if padded is not None and padded != arch.padded_vocab_size:
        raise ValueError(
            f"the student's padded vocabulary {padded} (Megatron-LM: tokenizer vocabulary padded "
            f"to --make-vocab-size-divisible-by x TP) != the teacher's {arch.padded_vocab_size} "
            f"(true vocabulary {arch.vocab_size}): both output layers must have the same rows; "
            f"use the teacher's tokenizer and a --make-vocab-size-divisible-by that gives "
            f"{arch.padded_vocab_size}")
    return kd, arch, arch.vocab_size


def open_topk_cache(kd: KDArgs, args: argparse.Namespace) -> TopKCacheReader | None:
    """Offline: the ``--kd-topk-cache`` reader, checked against Megatron-LM's flags
    (``ValueError`` naming both values); None without a cache (the other modes). Reads the
    manifest only. The cache's dataset identity is not compared (Megatron-LM builds its own
    dataset, maybe with another Megatron-Core): each microbatch's tokens are, against the
    cache's fingerprints."""
    if not kd.topk_cache:
        return None
    try:
        reader = TopKCacheReader(kd.topk_cache)
    except CacheFormatError as e:
        raise ValueError(f"--kd-topk-cache {kd.topk_cache!r}: {e}") from None
    spec = reader.spec
    if spec.seq_length != args.seq_length:
        raise ValueError(f"--kd-topk-cache {kd.topk_cache!r} was built for --seq-length "
                         f"{spec.seq_length}, this run has --seq-length {args.seq_length}")
    padded = args.padded_vocab_size
    if padded is not None and spec.vocab_size > padded:
        raise ValueError(f"--kd-topk-cache {kd.topk_cache!r} holds a teacher vocabulary of "
                         f"{spec.vocab_size}, more than the student's padded vocabulary "
                         f"{padded} (Megatron-LM: tokenizer vocabulary padded to "
                         f"--make-vocab-size-divisible-by x TP)")
    return reader


def megatron_lm_layout(args: argparse.Namespace) -> ParallelLayout:
    """The student's :class:`~megatron_kd.parallel.ParallelLayout` as Megatron-LM's parsed
    arguments give it (Megatron-LM has validated them; absent ones, in a tree without the flag,
    take Megatron-LM's defaults)."""
    sizes = dict(
        tp=args.tensor_model_parallel_size or 1,
        pp=getattr(args, "pipeline_model_parallel_size", None) or 1,
        vp=getattr(args, "virtual_pipeline_model_parallel_size", None) or 1,
        cp=args.context_parallel_size or 1,
        ep=getattr(args, "expert_model_parallel_size", None) or 1,
        etp=getattr(args, "expert_tensor_parallel_size", None),
        # Megatron-LM's validate_args turns --sequence-parallel off at TP 1 itself
        sequence_parallel=bool(getattr(args, "sequence_parallel", False)),
        cp_comm_type=_one_comm_type(getattr(args, "cp_comm_type", None)))
    dp = getattr(args, "data_parallel_size", None)  # set by validate_args
    return ParallelLayout(**sizes, dp=dp) if dp else ParallelLayout.of_model(**sizes)


def _one_comm_type(value) -> str:
    """Megatron-LM's ``--cp-comm-type`` (one value, or one per layer: the first stands for the
    layout's rules, which a per-layer mix would apply layer by layer)."""
    if isinstance(value, (list, tuple)):
        value = value[0] if value else None
    return value if value in ("p2p", "all_gather", "a2a") else "p2p"


def _check_sequence_split(args: argparse.Namespace, layout: ParallelLayout) -> None:
    """Each sequence split over ``2 x cp`` context-parallel chunks and, with sequence
    parallelism, ``tp`` slices of those: refused where the split is not even (the same rule and
    words as ``megatron-kd train``), and the context-parallel splits the teacher is not given
    (Megatron-LM's own ``validate_args`` has asserted ``--seq-length`` divisible by
    ``2 x cp`` already; this names both flags, and sequence parallelism)."""
    cp = layout.cp
    check_sequence_split(args.seq_length or 0, tp=layout.tp, cp=cp,
                         sequence_parallel=layout.sequence_parallel)
    if cp == 1:
        return
    # both flags exist in both patched trees; getattr: absent elsewhere is not given
    if getattr(args, "hybrid_context_parallel", False):
        raise ValueError(f"--hybrid-context-parallel cannot be combined with --kd-*: it gives "
                         f"each packed sequence its own context-parallel group and split, while "
                         f"the teacher is given the load-balanced split of the "
                         f"--context-parallel-size {cp} group")
    if getattr(args, "sft", False):
        raise ValueError(f"--sft with --context-parallel-size {cp} cannot be combined with "
                         f"--kd-*: Megatron-LM splits each packed document over the "
                         f"context-parallel ranks, while the teacher is given the load-balanced "
                         f"split of the whole sequence")


DOCUMENT_MASKING_FLAGS = (
    ("--reset-attention-mask", "reset_attention_mask"),
    ("--reset-position-ids", "reset_position_ids"),
    ("--dataloader-inter-document-masking", "dataloader_inter_document_masking"),
    ("--sft", "sft"),
)
"""Megatron-LM flags with which ``get_batch`` hands the student per-document attention masks,
positions or packed-sequence boundaries: the teacher (colocated, served or cached) is given the
token ids only and attends over the whole sequence, so its targets would not be the ones of the
student's documents. Each exists only in some trees: read with ``getattr``."""


def _check_whole_sequences(args: argparse.Namespace) -> None:
    """Refuse the flags of :data:`DOCUMENT_MASKING_FLAGS` when the loss has a KD term (with
    ``--kd-weight 0`` the teacher is not asked and cross-entropy alone follows the student's
    masks)."""
    given = [flag for flag, attribute in DOCUMENT_MASKING_FLAGS if getattr(args, attribute, False)]
    if given:
        raise ValueError(f"{' and '.join(given)} cannot be combined with --kd-weight > 0: the "
                         f"student would attend within each document while the teacher sees "
                         f"the whole sequence (its token ids only), so the KD targets would not "
                         f"be the student's documents' (use --kd-weight 0, or drop the flag)")


@dataclass(frozen=True, kw_only=True)
class LossChecks:
    """Megatron-LM's checks of each microbatch's loss, made as its own ``pretrain_gpt.py``
    ``loss_func`` makes them (:func:`validate_loss`), which the ``--kd-*`` loss replaces."""

    nan: bool = False
    """``--check-for-nan-in-loss-and-grad`` (Megatron-LM's default): a NaN or inf loss is
    fatal."""

    spiky: bool = False
    """``--check-for-spiky-loss``: a loss over :data:`SPIKY_LOSS_FACTOR` times the largest seen
    is reported (not fatal)."""

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> LossChecks:
        """The checks Megatron-LM's flags ask for (both flags are in both patched trees)."""
        return cls(nan=bool(args.check_for_nan_in_loss_and_grad),
                   spiky=bool(args.check_for_spiky_loss))


def validate_loss(loss: torch.Tensor, checks: LossChecks) -> None:
    """Hand this rank's microbatch loss to Megatron-Core's rerun state machine, before the
    data-parallel reduction, with the calls, messages, tolerances and fatality of Megatron-LM's
    own ``pretrain_gpt.loss_func`` (the same at ``f88b85f`` and main ``d98e8a6``): NaN and inf
    fatal, a spike not. What a rejected result does (raise, re-run the step, report) is the
    machine's ``--rerun-mode``."""
    if not (checks.nan or checks.spiky):
        return
    machine = get_rerun_state_machine()  # process-wide: the one Megatron-LM's loop drives
    if checks.nan:
        machine.validate_result(result=loss, rejection_func=torch.isnan,
                                message="found NaN in local forward loss calculation",
                                tolerance=0.0,  # forward pass calculations are deterministic
                                fatal=True)
        machine.validate_result(result=loss, rejection_func=torch.isinf,
                                message="found Inf in local forward loss calculation",
                                tolerance=0.0,  # forward pass calculations are deterministic
                                fatal=True)
    if checks.spiky:
        machine.validate_result(
            result=loss, rejection_func=partial(machine.is_unexpectedly_large,
                                                threshold=SPIKY_LOSS_FACTOR, context="loss"),
            message="Spiky loss",
            tolerance=0.0,  # forward pass calculations are deterministic
            fatal=False)


#: Megatron-LM's ``--attention-backend`` (the name of its ``AttnBackend``) -> the core attention
#: a colocated teacher is built with (:func:`~megatron_kd.integration.gpt.build_gpt_model`'s
#: ``attention``): the backends that form the ``[s, s]`` scores (``local``: Megatron-Core's
#: ``DotProductAttention``; ``unfused``: Transformer Engine's) keep the teacher on
#: ``DotProductAttention`` too; the fused ones and ``auto`` (Megatron-LM's default) give it
#: ``auto`` (SDPA on a GPU; a dense or MoE teacher takes Transformer Engine's spec where it is
#: installed, whatever this says).
_TEACHER_ATTENTION = {"local": "unfused", "unfused": "unfused", "flash": "auto", "fused": "auto",
                      "auto": "auto"}


def teacher_attention(args: argparse.Namespace) -> str:
    """The colocated teacher's core attention, from Megatron-LM's own ``--attention-backend``
    (an ``AttnBackend``, or its name; a tree without the flag: ``auto``), as the student's
    attention is chosen; ``ValueError`` naming a backend this project does not know."""
    value = getattr(args, "attention_backend", None)  # absent from trees before the flag
    name = "auto" if value is None else str(getattr(value, "name", value))
    if name not in _TEACHER_ATTENTION:
        raise ValueError(f"--attention-backend {name!r}: the teacher's attention is known for "
                         f"{', '.join(_TEACHER_ATTENTION)}")
    return _TEACHER_ATTENTION[name]
