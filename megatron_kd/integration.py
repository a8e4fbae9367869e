"""The pieces a Megatron training loop needs to distil with the fused KD loss.

* :func:`add_kd_args` -- the ``--kd-*`` flags, callable on Megatron-LM's own parser too (pass it
  as ``extra_args_provider``), and :class:`KDArgs` / :func:`kd_loss_config_from_args` turning
  them into a validated :class:`~megatron_kd.loss.KDLossConfig`.
* :func:`bypass_output_layer` -- makes a Megatron-Core ``GPTModel`` return its final hidden
  states (after the final norm) instead of logits: the output layer never runs, the logits never
  exist; :func:`output_layer_weight` is this rank's ``[local_vocab_size, h]`` output shard.
* :func:`make_kd_loss_func` -- a Megatron-style ``loss_func(output_tensor)`` for
  ``get_forward_backward_func`` schedules (``calculate_per_token_loss`` contract: it returns
  ``(loss_sum, num_tokens, report)``).

Later issues add flags: append them in :func:`add_kd_args` and a field in :class:`KDArgs`.
"""

from __future__ import annotations

import argparse
import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

KD_MODES = ("colocated", "disaggregated", "offline")
KD_LOSSES = ("forward_kl", "reverse_kl", "jsd")
TEACHER_DTYPES = ("fp32", "bf16")
TOPK_TAILS = ("renormalize", "ghost")


def add_kd_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``--kd-*`` flags to ``parser`` (an argparse parser, e.g. Megatron-LM's)."""
    group = parser.add_argument_group("knowledge distillation")
    group.add_argument("--kd-mode", choices=KD_MODES, default="colocated",
                       help="where the teacher runs: 'colocated' (same ranks as the student), "
                            "'disaggregated' (its own ranks) or 'offline' (a top-K cache)")
    group.add_argument("--kd-teacher-load", default=None, metavar="DIR",
                       help="teacher checkpoint (megatron_kd format: dist_checkpointing + "
                            "model_config.json); its architecture comes from model_config.json")
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
    group.add_argument("--kd-teacher-dtype", choices=TEACHER_DTYPES, default="fp32",
                       help="parameter dtype of the frozen teacher (the loss computes in fp32 "
                            "either way)")
    d = parser.add_argument_group("knowledge distillation: disaggregated teacher")
    d.add_argument("--kd-teacher-world-size", type=int, default=0, metavar="N",
                   help="disaggregated: the last N ranks of the world run the teacher; the "
                        "first ranks train the student")
    d.add_argument("--kd-teacher-tensor-model-parallel-size", type=int, default=1,
                   help="disaggregated: the teacher's own tensor-parallel size")
    d.add_argument("--kd-teacher-pipeline-model-parallel-size", type=int, default=1,
                   help="disaggregated: the teacher's own pipeline-parallel size")
    d.add_argument("--kd-prefetch-depth", type=int, default=2,
                   help="disaggregated: receive slots per student rank; the teacher runs up to "
                        "this many microbatches ahead. Offline: microbatches of top-K values "
                        "decoded ahead of training")
    d.add_argument("--kd-teacher-timeout", type=float, default=600.0, metavar="SECONDS",
                   help="disaggregated: a teacher silent this long is reported unavailable "
                        "(TeacherUnavailableError naming its rank)")
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

    loss: str = "forward_kl"
    """``forward_kl``, ``reverse_kl`` or ``jsd``."""

    temperature: float = 1.0
    """KD softmax temperature."""

    beta: float = 0.5
    """JSD mixture weight of the teacher."""

    weight: float = 1.0
    """Weight of the KD term."""

    ce_weight: float = 0.0
    """Weight of the cross-entropy term."""

    window_size: int | None = None
    """Rows projected at once (None: the loss's default)."""

    teacher_dtype: str = "fp32"
    """Parameter dtype of the teacher: ``fp32`` or ``bf16``."""

    teacher_world_size: int = 0
    """Disaggregated: ranks of the teacher (the last ones of the world)."""

    teacher_tp: int = 1
    """Disaggregated: the teacher's tensor-parallel size."""

    teacher_pp: int = 1
    """Disaggregated: the teacher's pipeline-parallel size."""

    prefetch_depth: int = 2
    """Disaggregated: receive slots per receiving student rank. Offline: microbatches decoded
    ahead of the one training."""

    teacher_timeout: float = 600.0
    """Disaggregated: seconds of teacher silence before ``TeacherUnavailableError``."""

    topk_cache: str | None = None
    """Offline: the top-K cache directory (required in offline mode, refused in the others)."""

    topk_tail: str = "renormalize"
    """Offline: how the teacher's mass outside its K entries is treated (``renormalize`` or
    ``ghost``; see :class:`~megatron_kd.loss.KDLossConfig`)."""

    def __post_init__(self) -> None:
        if self.mode not in KD_MODES:
            raise ValueError(f"--kd-mode must be one of {KD_MODES}, got {self.mode!r}")
        if self.loss not in KD_LOSSES:
            raise ValueError(f"--kd-loss must be one of {KD_LOSSES}, got {self.loss!r}")
        if not (math.isfinite(self.temperature) and self.temperature > 0):
            raise ValueError(f"--kd-temperature must be > 0, got {self.temperature}")
        if self.loss == "jsd" and not 0 < self.beta < 1:
            raise ValueError(f"--kd-beta must be in (0, 1) for jsd, got {self.beta}")
        for flag, value in (("--kd-weight", self.weight), ("--kd-ce-weight", self.ce_weight)):
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{flag} must be >= 0, got {value}")
        if self.weight == 0 and self.ce_weight == 0:
            raise ValueError("--kd-weight and --kd-ce-weight are both 0: nothing to train on")
        if self.window_size is not None and self.window_size < 1:
            raise ValueError(f"--kd-window-size must be >= 1, got {self.window_size}")
        if self.teacher_dtype not in TEACHER_DTYPES:
            raise ValueError(f"--kd-teacher-dtype must be one of {TEACHER_DTYPES}, "
                             f"got {self.teacher_dtype!r}")
        if self.topk_tail not in TOPK_TAILS:
            raise ValueError(f"--kd-topk-tail must be one of {TOPK_TAILS}, got {self.topk_tail!r}")
        if self.mode == "offline":
            if not self.topk_cache:
                raise ValueError("--kd-mode offline needs --kd-topk-cache DIR (made by "
                                 "`megatron-kd cache build`)")
            if self.teacher_load:
                raise ValueError(f"--kd-teacher-load {self.teacher_load!r} is not used with "
                                 f"--kd-mode offline (the teacher's top-K comes from "
                                 f"--kd-topk-cache {self.topk_cache!r}); drop it")
            if self.loss != "forward_kl":
                raise ValueError(f"--kd-loss {self.loss} is not possible with --kd-mode offline: "
                                 f"a top-K cache holds only the teacher's K largest "
                                 f"probabilities, which determine forward_kl only")
            if self.topk_tail == "ghost" and self.temperature != 1.0:
                raise ValueError(f"--kd-topk-tail ghost needs --kd-temperature 1 (the cached "
                                 f"log-probs are at temperature 1), got {self.temperature}")
        elif self.topk_cache:
            raise ValueError(f"--kd-topk-cache {self.topk_cache!r} is only for --kd-mode offline "
                             f"(mode is {self.mode!r})")
        elif self.topk_tail != "renormalize":
            raise ValueError(f"--kd-topk-tail {self.topk_tail} is only for --kd-mode offline "
                             f"(mode is {self.mode!r}: the teacher is dense)")
        if self.mode in ("colocated", "disaggregated") and self.weight > 0 \
                and not self.teacher_load:
            raise ValueError(f"--kd-weight {self.weight} > 0 in {self.mode} mode needs "
                             f"--kd-teacher-load")
        for flag, value in (("--kd-teacher-tensor-model-parallel-size", self.teacher_tp),
                            ("--kd-teacher-pipeline-model-parallel-size", self.teacher_pp),
                            ("--kd-prefetch-depth", self.prefetch_depth)):
            if value < 1:
                raise ValueError(f"{flag} must be >= 1, got {value}")
        if not self.teacher_timeout > 0:
            raise ValueError(f"--kd-teacher-timeout must be > 0, got {self.teacher_timeout}")
        if self.mode == "disaggregated":
            if self.teacher_world_size < 1:
                raise ValueError(f"--kd-mode disaggregated needs --kd-teacher-world-size >= 1, "
                                 f"got {self.teacher_world_size}")
            if not self.teacher_load:
                raise ValueError("--kd-mode disaggregated needs --kd-teacher-load")
        elif self.teacher_world_size:
            raise ValueError(f"--kd-teacher-world-size {self.teacher_world_size} is only for "
                             f"--kd-mode disaggregated (mode is {self.mode!r})")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> KDArgs:
        """Read the flags added by :func:`add_kd_args`."""
        return cls(mode=args.kd_mode, teacher_load=args.kd_teacher_load, loss=args.kd_loss,
                   temperature=args.kd_temperature, beta=args.kd_beta, weight=args.kd_weight,
                   ce_weight=args.kd_ce_weight, window_size=args.kd_window_size,
                   teacher_dtype=getattr(args, "kd_teacher_dtype", "fp32"),
                   teacher_world_size=getattr(args, "kd_teacher_world_size", 0),
                   teacher_tp=getattr(args, "kd_teacher_tensor_model_parallel_size", 1),
                   teacher_pp=getattr(args, "kd_teacher_pipeline_model_parallel_size", 1),
                   prefetch_depth=getattr(args, "kd_prefetch_depth", 2),
                   teacher_timeout=getattr(args, "kd_teacher_timeout", 600.0),
                   topk_cache=getattr(args, "kd_topk_cache", None),
                   topk_tail=getattr(args, "kd_topk_tail", "renormalize"))

    def loss_config(self, vocab_size: int | None = None, **overrides: Any):
        """The :class:`~megatron_kd.loss.KDLossConfig` for these flags.

        ``vocab_size`` is the true vocabulary (columns at or past it are padding).
        """
        from megatron_kd.loss import KDLossConfig

        kw = {"kind": self.loss, "temperature": self.temperature, "beta": self.beta,
              "kd_weight": self.weight, "ce_weight": self.ce_weight,
              "window_size": self.window_size, "vocab_size": vocab_size,
              "topk_tail": self.topk_tail}
        kw.update(overrides)
        return KDLossConfig(**kw)


def kd_loss_config_from_args(args: argparse.Namespace, vocab_size: int | None = None):
    """``KDArgs.from_args(args).loss_config(vocab_size)``."""
    return KDArgs.from_args(args).loss_config(vocab_size)


# ----------------------------------------------------------------------------------------------
# final hidden states instead of logits
# ----------------------------------------------------------------------------------------------
def unwrap_model(model):
    """The ``GPTModel`` inside DDP / Float16Module wrappers."""
    while hasattr(model, "module"):
        model = model.module
    return model


def _bypass_forward(input_, weight=None, runtime_gather_output=None):
    # Stands in for ColumnParallelLinear.forward: the hidden states pass through unchanged.
    return input_, None


def bypass_output_layer(model):
    """Make ``model`` (a ``GPTModel``, possibly wrapped) skip its output layer, for good.

    On the last pipeline stage the model then returns the final hidden states (after the final
    norm) as ``[b, s, h]`` where it would have returned ``[b, s, V/tp]`` logits; the output-layer
    weight still exists (and trains) through the loss. Idempotent. Sequence-parallel models are
    refused (the hidden states would stay sharded along the sequence).
    """
    inner = unwrap_model(model)
    layer = getattr(inner, "output_layer", None)
    if layer is None:
        return model  # not the last pipeline stage
    if getattr(layer, "sequence_parallel", False):
        raise ValueError("bypass_output_layer does not support sequence_parallel models")
    if getattr(inner.config, "mtp_num_layers", None):
        raise ValueError("bypass_output_layer does not support multi-token prediction")
    layer.forward = _bypass_forward
    return model


@contextlib.contextmanager
def output_layer_bypassed(model):
    """Context manager form of :func:`bypass_output_layer` (restores the output layer)."""
    layer = getattr(unwrap_model(model), "output_layer", None)
    had = layer is not None and "forward" in vars(layer)
    old = vars(layer).get("forward") if layer is not None else None
    bypass_output_layer(model)
    try:
        yield model
    finally:
        if layer is not None:
            if had:
                layer.forward = old
            else:
                del layer.forward


def output_layer_weight(model) -> torch.Tensor:
    """This rank's ``[local_vocab_size, h]`` output-layer shard (the embedding when tied)."""
    inner = unwrap_model(model)
    if not getattr(inner, "post_process", True):
        raise ValueError("output_layer_weight: this pipeline stage has no output layer")
    if inner.share_embeddings_and_output_weights:
        return inner.shared_embedding_or_output_weight()
    return inner.output_layer.weight


def to_sbh(hidden: torch.Tensor) -> torch.Tensor:
    """``[b, s, h]`` (what a bypassed GPTModel returns) -> ``[s, b, h]`` (a view)."""
    return hidden.transpose(0, 1)


# ----------------------------------------------------------------------------------------------
# Megatron-style loss function
# ----------------------------------------------------------------------------------------------
def make_kd_loss_func(
    *,
    student_weight: torch.Tensor,
    teacher_hidden: torch.Tensor | None,
    teacher_weight: torch.Tensor | None,
    labels: torch.Tensor,
    loss_mask: torch.Tensor,
    config,
    teacher_topk_ids: torch.Tensor | None = None,
    teacher_topk_logprobs: torch.Tensor | None = None,
    tp_group=None,
    report_lm_loss: bool = True,
    report_kd_loss: bool = True,
    report_teacher_lm_loss: bool = False,
    loss_fn: Callable | None = None,
) -> Callable[[torch.Tensor], tuple]:
    """A ``loss_func(output_tensor)`` for a ``get_forward_backward_func`` schedule.

    Args:
        student_weight: ``[local_vocab_size, h_s]`` the student's output-layer shard.
        teacher_hidden: ``[s, b, h_t]`` teacher final hidden states (None without a teacher).
        teacher_weight: ``[local_vocab_size, h_t]`` teacher output-layer shard.
        teacher_topk_ids / teacher_topk_logprobs: ``[s, b, K]`` a sparse (top-K) teacher
            instead of the dense one (``--kd-mode offline``: read from a top-K cache).
        labels: ``[b, s]`` next-token ids (Megatron dataset layout).
        loss_mask: ``[b, s]`` per-token weights.
        config: the :class:`~megatron_kd.loss.KDLossConfig` that is trained on.
        report_lm_loss / report_kd_loss: also report the student's CE / the KD divergence when
            the trained loss does not weight them (the loss computes both in its one pass; a
            KD report without KD training costs the teacher's projection).
        report_teacher_lm_loss: also report the teacher's own CE on the labels
            (``teacher_lm_loss``; for evaluation).
        loss_fn: the loss (default ``vocab_parallel_kd_loss``; tests pass a dense reference).

    The returned function takes the bypassed student output ``[b, s, h_s]`` and returns
    ``(loss_sum, num_tokens, report)`` (Megatron's ``calculate_per_token_loss`` contract), where
    ``report`` maps ``loss``, ``kd_loss``, ``lm_loss`` (and ``teacher_lm_loss``) to detached
    ``[sum, tokens]`` pairs (``kd_loss`` / ``lm_loss`` unweighted; ``kd_loss`` includes the
    ``T^2`` factor; absent when not computed).
    """
    from megatron_kd.loss import vocab_parallel_kd_loss

    loss_fn = loss_fn or vocab_parallel_kd_loss
    labels_sb = labels.transpose(0, 1)
    mask_sb = loss_mask.transpose(0, 1).float()
    if teacher_topk_ids is not None or teacher_topk_logprobs is not None:
        if teacher_hidden is not None:
            raise ValueError("give a dense teacher (teacher_hidden) or a top-K one "
                             "(teacher_topk_ids), not both")
        teacher_kw = {"teacher_topk_ids": teacher_topk_ids,
                      "teacher_topk_logprobs": teacher_topk_logprobs}
        has_teacher = True
    else:
        teacher_kw = {"teacher_hidden": teacher_hidden, "teacher_weight": teacher_weight}
        has_teacher = teacher_hidden is not None

    def loss_func(output_tensor: torch.Tensor):
        student_hidden = to_sbh(output_tensor)
        if student_hidden.dtype != student_weight.dtype:
            student_hidden = student_hidden.to(student_weight.dtype)
        terms: dict = {}
        # Labels always go in: the loss reports the unweighted CE at no extra projection. The
        # teacher goes in when it is trained on or its divergence is reported.
        kw = {"labels": labels_sb, "loss_mask": mask_sb, "config": config, "tp_group": tp_group}
        with_teacher = has_teacher and (config.kd_weight > 0 or report_kd_loss)
        if with_teacher:
            kw.update(teacher_kw)
        loss_sum, num_tokens = loss_fn(student_hidden, student_weight, terms_out=terms, **kw)
        n = num_tokens.detach().float()
        report = {"loss": torch.stack([loss_sum.detach().float(), n])}
        if with_teacher:
            report["kd_loss"] = torch.stack([terms["kd_sum"].float(), n])
        if config.ce_weight > 0 or report_lm_loss:
            report["lm_loss"] = torch.stack([terms["ce_sum"].float(), n])
        with torch.no_grad():
            if report_teacher_lm_loss and teacher_hidden is not None:
                ce_cfg = _replace(config, kd_weight=0.0, ce_weight=1.0)
                t_sum, _ = loss_fn(teacher_hidden.detach(), teacher_weight.detach(),
                                   labels=labels_sb, loss_mask=mask_sb, config=ce_cfg,
                                   tp_group=tp_group)
                report["teacher_lm_loss"] = torch.stack([t_sum.float(), n])
        return loss_sum, num_tokens.detach().to(torch.int), report

    return loss_func


def _replace(config, **changes):
    import dataclasses

    return dataclasses.replace(config, **changes)
