"""The KD loss of a weighted mixture of teachers, by the fused loss once per teacher.

With the weights ``w_i`` normalized to sum 1, the teachers' distributions ``p_i`` at temperature
T and the student's ``q``, the mixture is ``m = sum_i w_i p_i``, and for forward KL

    sum_i w_i KL(p_i || q) = KL(m || q) + JS_w,    JS_w = H(m) - sum_i w_i H(p_i) >= 0

(``H`` the entropy; ``JS_w`` the teachers' weighted Jensen-Shannon divergence, which does not
depend on the student). So the weighted sum of the per-teacher losses, which
:func:`~megatron_kd.loss.vocab_parallel_kd_loss` computes one teacher at a time, has the
gradient of the KL to the mixture, and its value is that KL plus ``JS_w`` (times ``T^2``,
``kd_weight`` and the loss mask, as every KD term). Reverse KL and JSD of a mixture are not
weighted sums of per-teacher terms: they are refused for two teachers or more (docs/loss.md, "A
mixture of teachers", says what they would mean).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_kd.loss.config import KDLossConfig
from megatron_kd.loss.fused import vocab_parallel_kd_loss
from megatron_kd.loss.teacher import DenseTeacher, Teacher, TopKTeacher

__all__ = ["TeacherMixture", "check_mixture_kind", "mixture_kd_loss", "mixture_weights"]

# Why the weighted sum of per-teacher terms is not the divergence to the mixture, per kind.
_NOT_A_MIXTURE = {
    "reverse_kl": "sum_i w_i KL(p_s || p_i) is, up to a constant, KL(p_s || g) to the normalized "
                  "geometric mean g ~ prod_i p_i^w_i, not KL(p_s || m) to the mixture "
                  "m = sum_i w_i p_i (whose log m needs every teacher's probabilities at once)",
    "jsd": "each per-teacher term mixes the student with one teacher (beta p_i + (1 - beta) p_s) "
           "inside a log, so their weighted sum is neither the JSD to the mixture "
           "m = sum_i w_i p_i nor a constant away from it",
}


@dataclass(frozen=True)
class TeacherMixture:
    """A run's N >= 2 teachers of one microbatch, as a trainer hands them to the loss: each
    teacher's record (:class:`~megatron_kd.loss.DenseTeacher` or
    :class:`~megatron_kd.loss.TopKTeacher`) and its weight (as given: :func:`mixture_kd_loss`
    normalizes them)."""

    teachers: tuple[Teacher, ...]
    weights: tuple[float, ...]

    def __post_init__(self) -> None:
        mixture_weights(self.weights, len(self.teachers))


def mixture_weights(weights: Sequence[float], n_teachers: int) -> tuple[float, ...]:
    """The teachers' weights, checked (one per teacher, finite, ``>= 0``, at least one ``> 0``)
    and normalized to sum 1: ``w_i / sum_j w_j``; ``(2, 1)`` is ``(2/3, 1/3)``, and a weight of 0
    stays exactly 0."""
    if isinstance(weights, (str, bytes)) or not isinstance(weights, Sequence):
        raise ValueError(f"weights must be a sequence of numbers, one per teacher, got "
                         f"{weights!r}")
    if len(weights) != n_teachers:
        raise ValueError(f"{len(weights)} weights {list(weights)} for {n_teachers} teachers: "
                         f"one weight per teacher")
    for i, w in enumerate(weights):
        if isinstance(w, bool) or not isinstance(w, numbers.Real):
            raise ValueError(f"weight {i} must be a real number, got {w!r}")
        if not (math.isfinite(w) and w >= 0):
            raise ValueError(f"weight {i} of teacher {i} must be finite and >= 0, got {w} "
                             f"(weights {list(weights)})")
    total = math.fsum(float(w) for w in weights)
    if total <= 0:
        raise ValueError(f"the teachers' weights {list(weights)} are all 0: at least one must "
                         f"be > 0")
    return tuple(float(w) / total for w in weights)


def check_mixture_kind(config: KDLossConfig, n_teachers: int) -> None:
    """Refuse a divergence that a mixture of ``n_teachers`` cannot be trained on here: reverse
    KL and JSD with two teachers or more (their weighted sums are not the divergence to the
    mixture; the reason is in the message)."""
    if n_teachers >= 2 and config.kind != "forward_kl":
        raise ValueError(
            f"kind={config.kind!r} with {n_teachers} teachers: a mixture of teachers is trained "
            f"on forward KL only. The weighted sum of per-teacher forward KLs has the gradient "
            f"of KL(m || p_s) to the mixture m = sum_i w_i p_i, but for {config.kind} "
            f"{_NOT_A_MIXTURE[config.kind]}. Use kind='forward_kl', or one teacher")


def mixture_kd_loss(
    student_hidden: torch.Tensor,
    student_weight: torch.Tensor,
    teachers: Sequence[Teacher],
    weights: Sequence[float],
    *,
    labels: torch.Tensor | None = None,
    loss_mask: torch.Tensor | None = None,
    config: KDLossConfig | None = None,
    tp_group: dist.ProcessGroup | None = None,
    terms_out: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """KD (+ CE) loss of a student against a weighted mixture of N >= 1 dense or top-K teachers.

    The loss is ``sum_i w_i * L_i`` with ``L_i`` the fused loss's KD term against teacher ``i``
    (:func:`~megatron_kd.loss.vocab_parallel_kd_loss`, one call per teacher, each projecting the
    student again), plus the CE term once. For forward KL its gradient is that of
    ``kd_weight * T^2 * KL(m || q)`` to the mixture ``m = sum_i w_i p_i``, and its value exceeds
    that by the teachers' weighted Jensen-Shannon divergence (the module docstring). Reverse KL
    and JSD are refused for N >= 2 (``ValueError`` saying why).

    Args:
        student_hidden, student_weight, labels, loss_mask, config, tp_group: as
            :func:`~megatron_kd.loss.vocab_parallel_kd_loss` takes them.
        teachers: the N teacher records (:class:`~megatron_kd.loss.DenseTeacher`,
            :class:`~megatron_kd.loss.TopKTeacher`, mixed as wished), each as the one-teacher
            loss takes it; a dense teacher's output layer must have the student's vocabulary
            shards (a ``ValueError`` names the teacher's index and both sizes).
        weights: one per teacher, finite, ``>= 0``, at least one ``> 0``, **normalized to sum
            1** here (:func:`mixture_weights`). A teacher of weight 0 does not touch the loss or
            its gradients (bit for bit the run without it): its term is computed for
            ``terms_out`` only, without gradient (nor a finite check).
        terms_out: optional dict receiving, detached: ``teacher_kd_sums``, a tuple of each
            teacher's unweighted ``sum(loss_mask * KD_i)``; ``kd_sum``, their weighted sum
            ``sum_i w_i * kd_i``; and ``ce_sum`` (as the one-teacher loss gives them).

    Returns:
        ``(loss_sum, num_tokens)``, as :func:`~megatron_kd.loss.vocab_parallel_kd_loss`. With
        one teacher the call *is* that function's (any kind; the same result bit for bit).

    Collectives (``tp_group``): those of each teacher's call (``vocab_parallel_kd_loss`` lists
    them; a weight-0 teacher's call too). Each call's exchange of sizes carries its dense
    teacher's vocabulary shard rows, so a teacher whose vocabulary differs stops every rank
    with the same error, naming the teacher's index and both vocabularies.
    """
    config = config or KDLossConfig()
    teachers = tuple(teachers)
    shares = mixture_weights(weights, len(teachers))
    for i, teacher in enumerate(teachers):
        if not isinstance(teacher, (DenseTeacher, TopKTeacher)):
            raise ValueError(f"teacher {i} must be a DenseTeacher or a TopKTeacher, got "
                             f"{type(teacher).__name__}")
    check_mixture_kind(config, len(teachers))
    if len(teachers) == 1:  # exactly the one-teacher loss
        loss, num_tokens = vocab_parallel_kd_loss(
            student_hidden, student_weight, teachers[0], labels=labels, loss_mask=loss_mask,
            config=config, tp_group=tp_group, terms_out=terms_out)
        if terms_out is not None:
            terms_out["teacher_kd_sums"] = (terms_out["kd_sum"],)
        return loss, num_tokens
    return _weighted_sum(student_hidden, student_weight, teachers, shares, labels, loss_mask,
                         config, tp_group, terms_out)


def _weighted_sum(student_hidden: torch.Tensor, student_weight: torch.Tensor,
                  teachers: tuple[Teacher, ...], shares: tuple[float, ...],
                  labels: torch.Tensor | None, loss_mask: torch.Tensor | None,
                  config: KDLossConfig, tp_group: dist.ProcessGroup | None,
                  terms_out: dict | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``sum_i share_i * KD_i`` (+ CE with the first teacher of weight > 0), one fused call per
    teacher, in the teachers' order; ``terms_out`` as :func:`mixture_kd_loss` fills it."""
    ce_teacher = next(i for i, share in enumerate(shares) if share > 0)  # CE counted once
    loss, num_tokens, ce_sum, kd_sums = None, None, None, []
    for i, (teacher, share) in enumerate(zip(teachers, shares)):
        terms: dict = {}
        part = _teacher_term(i, len(teachers), student_hidden, student_weight, teacher, share,
                             i == ce_teacher, labels, loss_mask, config, tp_group, terms)
        if part is not None:  # in the loss: the first term as it is, the others added
            loss = part[0] if loss is None else loss + part[0]
            num_tokens = part[1] if num_tokens is None else num_tokens
        if i == ce_teacher:
            ce_sum = terms["ce_sum"]
        kd_sums.append(terms["kd_sum"])
    if terms_out is not None:
        terms_out["teacher_kd_sums"] = tuple(kd_sums)
        terms_out["kd_sum"] = sum(share * kd for share, kd in zip(shares, kd_sums) if share > 0)
        terms_out["ce_sum"] = ce_sum
    return loss, num_tokens


def _teacher_term(i: int, n: int, student_hidden: torch.Tensor, student_weight: torch.Tensor,
                  teacher: Teacher, share: float, with_ce: bool, labels: torch.Tensor | None,
                  loss_mask: torch.Tensor | None, config: KDLossConfig,
                  tp_group: dist.ProcessGroup | None,
                  terms: dict) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Teacher ``i``'s call of the fused loss, its KD term weighted by ``share`` (and CE when
    ``with_ce``): ``(loss_sum, num_tokens)``; or, where that term is 0 (weight 0, or
    ``kd_weight`` 0 without CE), its unweighted KD for ``terms`` alone, without gradient, and
    None. A ``ValueError`` or ``FloatingPointError`` of the call is raised again naming the
    teacher."""
    kd_weight = config.kd_weight * share
    ce_weight = config.ce_weight if with_ce else 0.0
    trained = kd_weight > 0 or ce_weight > 0
    try:
        if trained:
            part_config = dataclasses.replace(config, kd_weight=kd_weight, ce_weight=ce_weight)
            return vocab_parallel_kd_loss(
                student_hidden, student_weight, teacher, labels=labels if with_ce else None,
                loss_mask=loss_mask, config=part_config, tp_group=tp_group, terms_out=terms)
        # for the log only: no gradient, no finite check (a NaN is logged, not trained on)
        log_config = dataclasses.replace(config, kd_weight=1.0, ce_weight=0.0,
                                         check_finite=False, gradient_accumulation_fusion=False)
        with torch.no_grad():
            vocab_parallel_kd_loss(student_hidden.detach(), student_weight.detach(), teacher,
                                   loss_mask=loss_mask, config=log_config, tp_group=tp_group,
                                   terms_out=terms)
        return None
    except (ValueError, FloatingPointError) as e:  # the same kind, naming the teacher
        raise type(e)(f"in the loss of teacher {i} of {n} ({type(teacher).__name__}, "
                      f"weight {share:g}): {e}") from e
