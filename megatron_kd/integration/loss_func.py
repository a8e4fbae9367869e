"""The fused KD loss as a Megatron-style ``loss_func`` for ``get_forward_backward_func``."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from megatron_kd.integration.output_layer import to_sbh
from megatron_kd.loss import (
    DenseTeacher,
    Teacher,
    TeacherMixture,
    mixture_kd_loss,
    vocab_parallel_agreement,
    vocab_parallel_kd_loss,
)

__all__ = ["make_kd_loss_func"]


def make_kd_loss_func(
    *,
    student_weight: torch.Tensor,
    teacher: Teacher | TeacherMixture | None,
    labels: torch.Tensor,
    loss_mask: torch.Tensor,
    config,
    tp_group=None,
    report_lm_loss: bool = True,
    report_kd_loss: bool = True,
    report_teacher_lm_loss: bool = False,
    report_agreement: bool = False,
    loss_fn: Callable | None = None,
) -> Callable[[torch.Tensor], tuple]:
    """A ``loss_func(output_tensor)`` for a ``get_forward_backward_func`` schedule.

    Args:
        student_weight: ``[local_vocab_size, h_s]`` the student's output-layer shard.
        teacher: the loss's teacher record, as the run's teacher source gave it: a
            :class:`~megatron_kd.loss.DenseTeacher` (``[s, b, h_t]`` final hidden states and the
            ``[local_vocab_size, h_t]`` output-layer shard), a
            :class:`~megatron_kd.loss.TopKTeacher` (``[s, b, K]`` ids and log-probs,
            ``--kd-mode offline``), a :class:`~megatron_kd.loss.TeacherMixture` of several
            (:func:`~megatron_kd.loss.mixture_kd_loss`), or None without a teacher.
        labels: ``[b, s]`` next-token ids (Megatron dataset layout).
        loss_mask: ``[b, s]`` per-token weights.
        config: the :class:`~megatron_kd.loss.KDLossConfig` that is trained on.
        report_lm_loss / report_kd_loss: also report the student's CE / the KD divergence when
            the trained loss does not weight them (the loss computes both in its one pass; a
            KD report without KD training costs the teacher's projection).
        report_teacher_lm_loss: also report the teacher's own CE on the labels
            (``teacher_lm_loss``; for evaluation).
        report_agreement: also report the student-teacher KL at T = 1 (``kd_kl``) and top-1
            agreement (``top1_agreement``) when there is a teacher (for evaluation; always
            :func:`~megatron_kd.loss.vocab_parallel_agreement`, whatever ``loss_fn`` is).
        loss_fn: the loss (default ``vocab_parallel_kd_loss``; tests pass a dense reference).

    The returned function takes the bypassed student output ``[b, s, h_s]`` and returns
    ``(loss_sum, num_tokens, report)`` (Megatron's ``calculate_per_token_loss`` contract), where
    ``report`` maps ``loss``, ``kd_loss``, ``lm_loss`` (and ``teacher_lm_loss``, ``kd_kl``,
    ``top1_agreement``) to detached ``[sum, tokens]`` pairs (``kd_loss`` / ``lm_loss``
    unweighted; ``kd_loss`` includes the ``T^2`` factor; absent when not computed). A mixture's
    ``kd_loss`` is the weighted sum, ``kd_loss_<i>`` each teacher's (no teacher CE, agreement).
    """
    mixture = isinstance(teacher, TeacherMixture)
    if mixture and loss_fn is not None:
        raise ValueError("a mixture of teachers is trained on mixture_kd_loss: loss_fn is for "
                         "one teacher")
    loss_fn = _mixture_loss if mixture else loss_fn or vocab_parallel_kd_loss
    labels_sb = labels.transpose(0, 1)
    mask_sb = loss_mask.transpose(0, 1).float()

    def loss_func(output_tensor: torch.Tensor):
        student_hidden = to_sbh(output_tensor)
        if student_hidden.dtype != student_weight.dtype:
            student_hidden = student_hidden.to(student_weight.dtype)
        terms: dict = {}
        # Labels always go in: the loss reports the unweighted CE at no extra projection. The
        # teacher goes in when it is trained on or its divergence is reported.
        kw = {"labels": labels_sb, "loss_mask": mask_sb, "config": config, "tp_group": tp_group}
        with_teacher = teacher is not None and (config.kd_weight > 0 or report_kd_loss)
        loss_sum, num_tokens = loss_fn(student_hidden, student_weight,
                                       teacher=teacher if with_teacher else None,
                                       terms_out=terms, **kw)
        n = num_tokens.detach().float()
        report = _trained_report(loss_sum, n, terms, kd=with_teacher, each_teacher=mixture,
                                 lm=config.ce_weight > 0 or report_lm_loss)
        with torch.no_grad():
            if report_teacher_lm_loss and isinstance(teacher, DenseTeacher):
                ce_cfg = dataclasses.replace(config, kd_weight=0.0, ce_weight=1.0)
                t_sum, _ = loss_fn(teacher.hidden.detach(), teacher.weight.detach(),
                                   labels=labels_sb, loss_mask=mask_sb, config=ce_cfg,
                                   tp_group=tp_group)
                report["teacher_lm_loss"] = torch.stack([t_sum.float(), n])
            if report_agreement and teacher is not None and not mixture:
                report.update(_agreement_report(student_hidden, student_weight, teacher, mask_sb,
                                                config, tp_group, n))
        return loss_sum, num_tokens.detach().to(torch.int), report

    return loss_func


def _mixture_loss(hidden, weight, *, teacher: TeacherMixture | None, **kw):
    """:func:`~megatron_kd.loss.mixture_kd_loss` of a :class:`~megatron_kd.loss.TeacherMixture`
    with ``vocab_parallel_kd_loss``'s signature (``teacher`` None: the CE alone)."""
    if teacher is None:  # not trained on nor reported
        return vocab_parallel_kd_loss(hidden, weight, None, **kw)
    return mixture_kd_loss(hidden, weight, teacher.teachers, teacher.weights, **kw)


def _agreement_report(student_hidden, student_weight, teacher: Teacher, mask_sb, config,
                      tp_group, n: torch.Tensor) -> dict:
    """``kd_kl`` and ``top1_agreement`` as ``[sum, tokens]`` pairs (evaluation)."""
    agreement = vocab_parallel_agreement(student_hidden.detach(), student_weight.detach(),
                                         teacher, loss_mask=mask_sb, config=config,
                                         tp_group=tp_group)
    return {"kd_kl": torch.stack([agreement.kl_sum.float(), n]),
            "top1_agreement": torch.stack([agreement.top1_sum.float(), n])}


def _trained_report(loss_sum: torch.Tensor, n: torch.Tensor, terms: dict, *, kd: bool,
                    each_teacher: bool, lm: bool) -> dict:
    """``loss`` (and ``kd_loss``, each teacher's ``kd_loss_<i>``, ``lm_loss``) as ``[sum,
    tokens]`` pairs from the loss's ``terms``."""
    report = {"loss": torch.stack([loss_sum.detach().float(), n])}
    if kd:
        report["kd_loss"] = torch.stack([terms["kd_sum"].float(), n])
        for i, kd_sum in enumerate(terms["teacher_kd_sums"] if each_teacher else ()):
            report[f"kd_loss_{i}"] = torch.stack([kd_sum.float(), n])
    if lm:
        report["lm_loss"] = torch.stack([terms["ce_sum"].float(), n])
    return report
