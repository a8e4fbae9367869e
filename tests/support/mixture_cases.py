"""Inputs, shardings and comparisons of the mixture-of-teachers loss tests (one process and gloo).

A case is a :func:`support.kd_cases.spec` (the student's side, the config) with ``teachers``,
a list of teacher kinds (``"dense"``, ``"renormalize"`` or ``"ghost"``: a top-K teacher, whose
tail is the config's ``topk_tail``, one for all), and ``weights``. The
student, labels and mask come from the case's seed; teacher ``i`` from its own seed (and a
hidden size of its own), so the teachers differ.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_kd.loss import (
    DenseTeacher,
    TopKTeacher,
    mixture_kd_loss,
    vocab_parallel_kd_loss,
)
from support.kd_cases import (
    IGNORE,
    TOLERANCE,
    config_of,
    cpu_tuning_of,
    make_inputs,
    rel_err,
    shard_sizes,
    spec,
)
from support.kd_reference import reference_mixture_kd_loss


def mixture_spec(teachers=("dense", "renormalize"), weights=(0.3, 0.7), **kw) -> dict:
    return dict(spec(**kw), teachers=list(teachers), weights=list(weights))


def make_mixture_inputs(case: dict) -> tuple[dict, list[dict]]:
    """``(student inputs, [teacher i's inputs])``, full (unsharded), deterministic."""
    inp = make_inputs(dict(case, teacher=None))
    teachers = []
    for i, kind in enumerate(case["teachers"]):
        t = make_inputs(dict(case, teacher=kind, seed=case["seed"] + 101 * (i + 1),
                             h_t=case["h_t"] + 4 * i, labels=False, ce_weight=0.0, mask=False))
        teachers.append({k: v for k, v in t.items() if k.startswith("teacher_")})
    return inp, teachers


def records(case: dict, teachers: list[dict], sizes: list[int], rank: int) -> list:
    """This rank's teacher records: dense teachers' weight shards (and sequence slices)."""
    start, stop = sum(sizes[:rank]), sum(sizes[:rank + 1])
    out = []
    for t in teachers:
        if "teacher_hidden" in t:
            hidden = _sequence_slice(case, t["teacher_hidden"], len(sizes), rank)
            out.append(DenseTeacher(hidden=hidden, weight=t["teacher_weight"][start:stop]))
        else:
            out.append(TopKTeacher(ids=t["teacher_topk_ids"],
                                   logprobs=t["teacher_topk_logprobs"]))
    return out


def _sequence_slice(case: dict, hidden: torch.Tensor, world: int, rank: int) -> torch.Tensor:
    if not (case["sequence_parallel"] and world > 1):
        return hidden
    chunk = hidden.shape[0] // world
    return hidden[rank * chunk:(rank + 1) * chunk]


def run_mixture(case: dict, inp: dict, teachers: list[dict], sizes: list[int], rank: int,
                group, weights=None, n_teachers: int | None = None) -> dict:
    """Our mixture loss on rank ``rank`` of ``group``: loss, gradients (of a 0.75-scaled
    loss, divided back), the logged terms, and whether any input was written. ``weights`` /
    ``n_teachers``: the case's, or these (the first ``n_teachers`` teachers)."""
    n = len(teachers) if n_teachers is None else n_teachers
    before = [{k: v.clone() for k, v in d.items()} for d in (inp, *teachers)]
    out = _run_loss(case, inp, sizes, rank, group, lambda *args, **kw: mixture_kd_loss(
        *args, records(case, teachers, sizes, rank)[:n],
        case["weights"][:n] if weights is None else weights, **kw))
    out["inputs_unchanged"] = all(torch.equal(b[k], d[k])
                                  for b, d in zip(before, (inp, *teachers)) for k in d)
    return out


def run_single(case: dict, inp: dict, teacher: dict, sizes: list[int], rank: int, group) -> dict:
    """The one-teacher loss (``vocab_parallel_kd_loss``) of ``teacher`` on this rank, as
    :func:`run_mixture` gives its results."""
    return _run_loss(case, inp, sizes, rank, group, lambda *args, **kw: vocab_parallel_kd_loss(
        *args, records(case, [teacher], sizes, rank)[0], **kw))


def _run_loss(case: dict, inp: dict, sizes: list[int], rank: int, group, loss_fn) -> dict:
    """``loss_fn(hidden, weight, labels=, loss_mask=, config=, tp_group=, terms_out=)`` on this
    rank's sequence slice and weight shard (its teachers bound in): loss, gradients of a
    0.75-scaled loss divided back, their dtype, the shard and the logged terms."""
    start, stop = sum(sizes[:rank]), sum(sizes[:rank + 1])
    hidden = _sequence_slice(case, inp["student_hidden"], len(sizes), rank)
    hidden = hidden.clone().requires_grad_(True)
    weight = inp["student_weight"][start:stop].clone().requires_grad_(True)
    terms: dict = {}
    loss, n_tokens = loss_fn(
        hidden, weight, labels=inp.get("labels"), loss_mask=inp.get("loss_mask"),
        config=config_of(case, cpu_tuning_of(case, stop - start)), tp_group=group,
        terms_out=terms)
    (loss * 0.75).backward()  # a non-unit upstream gradient must scale every gradient
    return {"loss": loss.detach(), "num_tokens": n_tokens, "grad_x": hidden.grad / 0.75,
            "grad_w": weight.grad / 0.75, "start": start, "stop": stop,
            "grad_dtype": hidden.grad.dtype, "terms": terms}


def reference(case: dict, inp: dict, teachers: list[dict]):
    """fp64 ``(loss without the constant, constant, grad_x, grad_w)`` of the dense mixture
    reference on the same (possibly bf16) values."""
    d = {k: v.double().requires_grad_(k in ("student_hidden", "student_weight"))
         if v.is_floating_point() and k != "loss_mask" else v for k, v in inp.items()}
    ref_teachers = [("dense", t["teacher_hidden"].double(), t["teacher_weight"].double())
                    if "teacher_hidden" in t else
                    ("topk" if case["topk_tail"] == "renormalize" else "ghost",
                     t["teacher_topk_ids"], t["teacher_topk_logprobs"].double())
                    for t in teachers]
    loss, constant = reference_mixture_kd_loss(
        d["student_hidden"], d["student_weight"], ref_teachers, case["weights"],
        d.get("labels"), d.get("loss_mask"), temperature=case["temperature"],
        kd_weight=case["kd_weight"], ce_weight=case["ce_weight"], vocab_size=case["vocab_size"],
        ignore_index=IGNORE)
    loss.backward()
    return loss.detach(), constant, d["student_hidden"].grad, d["student_weight"].grad


def compare(case: dict, inp: dict, teachers: list[dict], ours: list[dict]) -> None:
    """Every rank's value equals the reference's KL to the mixture plus the teachers' weighted
    Jensen-Shannon divergence, and its gradients the reference's, within the dtype's
    tolerance (:data:`support.kd_cases.TOLERANCE`); the constant is not negligible."""
    ref_loss, constant, ref_gx, ref_gw = reference(case, inp, teachers)
    tol = TOLERANCE[case["dtype"]]
    world = len(ours)
    # the constant is a real part of the value: leaving it out fails the value check (by more
    # than twice the tolerance)
    assert float(constant) > 2 * tol * abs(float(ref_loss + constant)), float(constant)
    for rank, r in enumerate(ours):
        where = f"rank {rank}/{world} case={case}"
        assert r["inputs_unchanged"], f"an input was written in place ({where})"
        assert r["grad_dtype"] == case["dtype"], where
        assert rel_err(r["loss"], ref_loss + constant) <= tol, (
            float(r["loss"]), float(ref_loss), float(constant), where)
        gx = ref_gx
        if case["sequence_parallel"] and world > 1:
            chunk = ref_gx.shape[0] // world
            gx = ref_gx[rank * chunk:(rank + 1) * chunk]
        assert rel_err(r["grad_x"], gx) <= tol, (rel_err(r["grad_x"], gx), "grad_x", where)
        gw = ref_gw[r["start"]:r["stop"]]
        assert rel_err(r["grad_w"], gw) <= tol, (rel_err(r["grad_w"], gw), "grad_w", where)
        tokens = inp["loss_mask"].sum() if "loss_mask" in inp else case["s"] * case["b"]
        assert abs(float(r["num_tokens"]) - float(tokens)) < 1e-6, where


def same(a: dict, b: dict) -> bool:
    """Loss, token count and both gradients equal bit for bit."""
    return all(torch.equal(a[k], b[k]) for k in ("loss", "num_tokens", "grad_x", "grad_w"))


def exact_checks(case: dict, inp: dict, teachers: list[dict], sizes: list[int], rank: int,
                 group) -> dict:
    """Bit-for-bit identities on this rank: weights (1, 0) and (0, 1) are the one-teacher loss of
    the weighted teacher; one teacher is the one-teacher loss; a third teacher of weight 0
    leaves the two-teacher loss as it was. Needs at least two teachers of kinds the config
    takes."""
    single = [run_single(case, inp, t, sizes, rank, group) for t in teachers[:2]]
    out = {
        "1,0": same(run_mixture(case, inp, teachers, sizes, rank, group, [1.0, 0.0], 2),
                    single[0]),
        "0,1": same(run_mixture(case, inp, teachers, sizes, rank, group, [0.0, 1.0], 2),
                    single[1]),
        "n=1": same(run_mixture(case, inp, teachers, sizes, rank, group, [2.5], 1), single[0]),
    }
    if len(teachers) >= 3:
        pair = run_mixture(case, inp, teachers, sizes, rank, group, [0.3, 0.7], 2)
        out["a,b,0"] = same(run_mixture(case, inp, teachers, sizes, rank, group,
                                        [0.3, 0.7, 0.0], 3), pair)
    return out


def mixture_dist_case(ctx, case: dict, world: int, exact: bool = False) -> dict | None:
    """Gloo worker: the case on the prefix group of ``world`` ranks, shards 1:2:3:...; with
    ``exact``, :func:`exact_checks` instead."""
    torch.manual_seed(0)
    group = ctx.group(world)
    if group is None:
        return None
    inp, teachers = make_mixture_inputs(case)
    sizes = shard_sizes(case["padded_vocab"], world)
    rank = dist.get_rank(group)
    if exact:
        return exact_checks(case, inp, teachers, sizes, rank, group)
    return run_mixture(case, inp, teachers, sizes, rank, group)
