"""Naive dense reference of the KD loss, written independently of megatron_kd.loss.

Full logits, ``log_softmax`` and textbook formulas, in whatever dtype the inputs have (tests
pass fp64); gradients come from autograd. Only for tests: memory is O(tokens x vocab).
"""

import math

import torch
import torch.nn.functional as F


def reference_kd_loss(student_hidden, student_weight, teacher_hidden=None, teacher_weight=None,
                      topk_ids=None, topk_logprobs=None, labels=None, loss_mask=None, *,
                      kind="forward_kl", temperature=1.0, beta=0.5, kd_weight=1.0, ce_weight=0.0,
                      topk_tail="renormalize", vocab_size=None, ignore_index=-100):
    """Sum over tokens of ``loss_mask * (kd_weight * KD + ce_weight * CE)``; full weights."""
    h = student_hidden.shape[-1]
    x = student_hidden.reshape(-1, h)
    n = x.shape[0]
    v = student_weight.shape[0] if vocab_size is None else vocab_size
    z_s = (x @ student_weight.t())[:, :v]
    t = temperature
    logp_s = F.log_softmax(z_s / t, dim=-1)
    p_s = logp_s.exp()
    mask = torch.ones(n, dtype=x.dtype) if loss_mask is None else loss_mask.reshape(n).to(x.dtype)

    kd = torch.zeros(n, dtype=x.dtype)
    if teacher_hidden is not None:
        xt = teacher_hidden.reshape(n, -1)
        z_t = (xt @ teacher_weight.t())[:, :v]
        logp_t = F.log_softmax(z_t / t, dim=-1)
        p_t = logp_t.exp()
        if kind == "forward_kl":
            kd = (p_t * (logp_t - logp_s)).sum(-1)
        elif kind == "reverse_kl":
            kd = (p_s * (logp_s - logp_t)).sum(-1)
        elif kind == "jsd":
            # log m = log(beta p_t + (1 - beta) p_s), in log space so tiny p do not underflow
            log_m = torch.logsumexp(torch.stack([logp_t + math.log(beta),
                                                 logp_s + math.log(1 - beta)]), dim=0)
            # 0 * log 0 = 0: probabilities that underflow contribute nothing
            kd = beta * torch.where(p_t > 0, p_t * (logp_t - log_m), 0.0).sum(-1) + (
                1 - beta) * torch.where(p_s > 0, p_s * (logp_s - log_m), 0.0).sum(-1)
        else:
            raise ValueError(kind)
        kd = kd * t * t
    elif topk_ids is not None:
        ids = topk_ids.reshape(n, -1)
        lp = topk_logprobs.reshape(n, -1).to(x.dtype)
        logp_s_k = logp_s.gather(1, ids)
        if topk_tail == "renormalize":
            log_q = F.log_softmax(lp / t, dim=-1)
            kd = (log_q.exp() * (log_q - logp_s_k)).sum(-1) * t * t
        else:
            q = lp.exp()
            q_tail = (1 - q.sum(-1)).clamp(min=0)
            in_k = torch.zeros_like(p_s, dtype=torch.bool).scatter(1, ids, True)
            p_tail = torch.where(in_k, 0.0, p_s).sum(-1)
            head = torch.where(q > 0, q * (lp - logp_s_k), 0.0).sum(-1)
            tail = torch.where(q_tail > 0, q_tail * (q_tail.log() - p_tail.log()), 0.0)
            kd = head + tail
    loss = mask * kd_weight * kd
    if ce_weight > 0:
        lab = labels.reshape(n)
        ce = F.cross_entropy(z_s, lab, ignore_index=ignore_index, reduction="none")
        loss = loss + mask * ce_weight * ce
    return loss.sum()


def reference_agreement(student_hidden, student_weight, teacher_hidden=None, teacher_weight=None,
                        topk_ids=None, topk_logprobs=None, loss_mask=None, *, vocab_size=None,
                        logit_dtype=None):
    """``(sum of mask * KL(p_t || p_s) at T = 1, sum of mask * [argmax z_s == argmax z_t],
    sum of mask)`` from the full logits; full weights.

    Dense teacher: the textbook KL over the true vocabulary and ``torch.argmax`` of the full
    rows (its first maximal index: the lowest id among ties). Top-K teacher: the KL of the
    K + 1 buckets (the K ids, then everything else), and the teacher's argmax the lowest id
    among its largest log-probabilities. ``logit_dtype``: the logits rounded to it first (as an
    output layer in that dtype writes them: a bf16 layer's rounding makes ties of its own).
    """
    h = student_hidden.shape[-1]
    x = student_hidden.reshape(-1, h)
    n = x.shape[0]
    v = student_weight.shape[0] if vocab_size is None else vocab_size

    def rounded(z):
        return z if logit_dtype is None else z.to(logit_dtype).to(z.dtype)

    z_s = rounded(x @ student_weight.t())[:, :v]
    logp_s = F.log_softmax(z_s, dim=-1)
    top_s = torch.argmax(z_s, dim=-1)
    mask = torch.ones(n, dtype=x.dtype) if loss_mask is None else loss_mask.reshape(n).to(x.dtype)
    if teacher_hidden is not None:
        z_t = rounded(teacher_hidden.reshape(n, -1) @ teacher_weight.t())[:, :v]
        return reference_agreement_of_logits(z_s, z_t, mask)
    else:
        ids = topk_ids.reshape(n, -1)
        lp = topk_logprobs.reshape(n, -1).to(x.dtype)
        # the K + 1 buckets of each distribution: the K ids, then the rest
        q = torch.cat([lp.exp(), (1 - lp.exp().sum(-1, keepdim=True)).clamp(min=0)], dim=1)
        p_k = logp_s.exp().gather(1, ids)
        p = torch.cat([p_k, (1 - p_k.sum(-1, keepdim=True)).clamp(min=0)], dim=1)
        kl = torch.where(q > 0, q * (q.log() - p.log()), 0.0).sum(-1)
        # the lowest id among the row's largest log-probabilities, one row at a time
        top_t = torch.tensor([min(int(i) for i, lpi in zip(row_ids, row_lp)
                                  if lpi == row_lp.max()) for row_ids, row_lp in zip(ids, lp)])
    agree = (top_s == top_t).to(x.dtype)
    return (mask * kl).sum(), (mask * agree).sum(), mask.sum()


def reference_agreement_of_logits(z_s, z_t, loss_mask=None):
    """:func:`reference_agreement` of full ``[..., V]`` student and teacher logits (a dense
    teacher): the textbook KL at T = 1 and ``torch.argmax`` of each row."""
    v = z_s.shape[-1]
    z_s, z_t = z_s.reshape(-1, v), z_t.reshape(-1, v)
    n = z_s.shape[0]
    mask = (torch.ones(n, dtype=z_s.dtype) if loss_mask is None
            else loss_mask.reshape(n).to(z_s.dtype))
    logp_s = F.log_softmax(z_s, dim=-1)
    logp_t = F.log_softmax(z_t, dim=-1)
    kl = (logp_t.exp() * (logp_t - logp_s)).sum(-1)
    agree = (torch.argmax(z_s, dim=-1) == torch.argmax(z_t, dim=-1)).to(z_s.dtype)
    return (mask * kl).sum(), (mask * agree).sum(), mask.sum()


def reference_mixture_kd_loss(student_hidden, student_weight, teachers, weights, labels=None,
                              loss_mask=None, *, temperature=1.0, kd_weight=1.0, ce_weight=0.0,
                              vocab_size=None, ignore_index=-100):
    """``(loss, constant)`` of a student against the weighted mixture of ``teachers``, from
    full logits: ``loss = sum over tokens of mask * (kd_weight * T^2 * KL(m || q) + ce_weight *
    CE)`` with the mixture ``m = sum_i w_i p_i`` built explicitly (``w`` normalized to sum 1,
    ``q = softmax(z_s / T)``); ``constant = sum of mask * kd_weight * T^2 * (H(m) - sum_i w_i
    H(p_i))``, the teachers' weighted Jensen-Shannon divergence, from the teachers alone (no
    gradient: it does not depend on the student).

    ``teachers``: ``("dense", hidden [s, b, h_t], weight [V, h_t])`` (``p = softmax(z_t / T)``)
    or ``("topk", ids [s, b, K], logprobs [s, b, K])`` (``p`` is ``softmax(logprobs / T)`` on
    the K ids, 0 elsewhere: the renormalized tail), or ``("ghost", ids, logprobs)`` (T = 1: the
    K probabilities, and the leftover mass ``1 - sum`` spread over the other ids in proportion
    to the student's own probabilities, held fixed. Its KL to ``q`` is the ghost tail's K + 1
    bucket KL, and its gradient with ``p`` held fixed the bucket KL's; ``constant`` then
    depends on the student, but still has no gradient).
    """
    h = student_hidden.shape[-1]
    x = student_hidden.reshape(-1, h)
    n = x.shape[0]
    v = student_weight.shape[0] if vocab_size is None else vocab_size
    t = temperature
    z_s = (x @ student_weight.t())[:, :v]
    logq = F.log_softmax(z_s / t, dim=-1)
    total = float(sum(weights))
    with torch.no_grad():
        probs = []
        for kind, a, b in teachers:
            if kind == "dense":
                probs.append(F.softmax((a.reshape(n, -1) @ b.t())[:, :v] / t, dim=-1))
            elif kind == "topk":
                p = torch.zeros(n, v, dtype=x.dtype)
                p.scatter_(1, a.reshape(n, -1), F.softmax(b.reshape(n, -1).to(x.dtype) / t, -1))
                probs.append(p)
            else:
                ids, q = a.reshape(n, -1), b.reshape(n, -1).to(x.dtype).exp()
                in_k = torch.zeros(n, v, dtype=torch.bool).scatter(1, ids, True)
                q_s = torch.where(in_k, 0.0, logq.detach().exp())  # the student's tail
                tail = (1 - q.sum(-1, keepdim=True)).clamp(min=0) / q_s.sum(-1, keepdim=True)
                probs.append((q_s * tail).scatter(1, ids, q))

        def entropy(p):  # 0 log 0 = 0
            return -torch.where(p > 0, p * p.log(), 0.0).sum(-1)

        m = sum((w / total) * p for w, p in zip(weights, probs))
        js = entropy(m) - sum((w / total) * entropy(p) for w, p in zip(weights, probs))
    mask = torch.ones(n, dtype=x.dtype) if loss_mask is None else loss_mask.reshape(n).to(x.dtype)
    kl = torch.where(m > 0, m * (m.clamp(min=1e-300).log() - logq), 0.0).sum(-1)
    loss = (mask * kd_weight * t * t * kl).sum()
    if ce_weight > 0:
        ce = F.cross_entropy(z_s, labels.reshape(n), ignore_index=ignore_index, reduction="none")
        loss = loss + (mask * ce_weight * ce).sum()
    return loss, (mask * kd_weight * t * t * js).sum()
