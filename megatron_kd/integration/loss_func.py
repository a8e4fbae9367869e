"""The fused KD loss as a Megatron-style ``loss_func`` for ``get_forward_backward_func``."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from megatron_kd.integration.output_layer import to_sbh
from megatron_kd.loss import (
    DenseTeacher,
    Teacher,
    vocab_parallel_agreement,
    vocab_parallel_kd_loss,
)

__all__ = ["make_kd_loss_func"]


def make_kd_loss_func(
    *,
    student_weight: torch.Tensor,
    teacher: Teacher | None,
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
            ``--kd-mode offline``: read from a top-K cache), or None without a teacher.
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
    unweighted; ``kd_loss`` includes the ``T^2`` factor; absent when not computed).
    """
    loss_fn = loss_fn or vocab_parallel_kd_loss
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
        report = {"loss": torch.stack([loss_sum.detach().float(), n])}
        if with_teacher:
            report["kd_loss"] = torch.stack([terms["kd_sum"].float(), n])
        if config.ce_weight > 0 or report_lm_loss:
            report["lm_loss"] = torch.stack([terms["ce_sum"].float(), n])
        with torch.no_grad():
            if report_teacher_lm_loss and isinstance(teacher, DenseTeacher):
                ce_cfg = dataclasses.replace(config, kd_weight=0.0, ce_weight=1.0)
                t_sum, _ = loss_fn(teacher.hidden.detach(), teacher.weight.detach(),
                                   labels=labels_sb, loss_mask=mask_sb, config=ce_cfg,
                                   tp_group=tp_group)
                report["teacher_lm_loss"] = torch.stack([t_sum.float(), n])
            if report_agreement and teacher is not None:
                agreement = vocab_parallel_agreement(
                    student_hidden.detach(), student_weight.detach(), teacher,
                    loss_mask=mask_sb, config=config, tp_group=tp_group)
                report["kd_kl"] = torch.stack([agreement.kl_sum.float(), n])
                report["top1_agreement"] = torch.stack([agreement.top1_sum.float(), n])
        return loss_sum, num_tokens.detach().to(torch.int), report

    return loss_func

