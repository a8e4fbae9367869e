"""Inputs, shardings and comparisons shared by the loss tests (single process and gloo)."""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from megatron_kd.loss import (
    CpuTuning,
    DenseTeacher,
    GpuTuning,
    KDLossConfig,
    TopKTeacher,
    vocab_parallel_kd_loss,
)
from support.kd_reference import reference_kd_loss

IGNORE = -100

# Relative (normwise) tolerances by input dtype, for loss and every gradient:
# fp64: both sides compute in fp64; differences are summation order only.
# fp32: fp32 accumulation over ~1e3 vocabulary terms and h-long dot products, ~1e-6 observed.
# bf16: the reference is fp64 maths on the *same* bf16 values; ours multiplies in bf16 (so the
#   logits carry bf16 rounding, relative 2^-9 = 2e-3 of |z|, with |z| ~ 3 here) and returns
#   gradients rounded to bf16 (2^-9 relative each). 2e-2 covers those two roundings with margin
#   and still fails on any real error (a wrong term is O(1) relative).
TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-5, torch.bfloat16: 2e-2}


def spec(**kw) -> dict:
    base = dict(kind="forward_kl", temperature=1.0, beta=0.5, kd_weight=1.0, ce_weight=0.0,
                teacher="dense", topk_tail="renormalize", k=7, s=5, b=3, h_s=16, h_t=24,
                padded_vocab=1009, vocab_size=None, mask=False, dtype=torch.float64,
                backward="precompute", window_size=4, scale=1.0, sequence_parallel=False,
                seed=0, labels=False, block_rows=None, elementwise="eager", cpu_tuning=None,
                path="auto", gpu_tuning=None)
    base.update(kw)
    return base


def make_inputs(sp: dict) -> dict:
    """Full (unsharded) inputs of a case, deterministic in its seed."""
    g = torch.Generator().manual_seed(sp["seed"])
    s, b, hs, ht, vp = sp["s"], sp["b"], sp["h_s"], sp["h_t"], sp["padded_vocab"]
    v = sp["vocab_size"] or vp
    dt = sp["dtype"]

    def randn(*shape, std=1.0):
        return (torch.randn(*shape, generator=g, dtype=torch.float64) * std).to(dt)

    out = {
        "student_hidden": randn(s, b, hs),
        # logits of order `scale * 3`: scale 300 overflows a naive exp in fp32 and fp64
        "student_weight": randn(vp, hs, std=3.0 * sp["scale"] / hs ** 0.5),
    }
    if sp["teacher"] == "dense":
        out["teacher_hidden"] = randn(s, b, ht)
        out["teacher_weight"] = randn(vp, ht, std=3.0 * sp["scale"] / ht ** 0.5)
    elif sp["teacher"] in ("renormalize", "ghost"):
        k = sp["k"]
        ids = torch.stack([torch.randperm(v, generator=g)[:k] for _ in range(s * b)])
        # ids at both ends of the vocabulary (shard edges) in the first row
        ids[0, 0], ids[0, 1] = 0, v - 1
        ids[0, 2:] = torch.randperm(v - 2, generator=g)[: k - 2] + 1
        teacher_logits = torch.randn(s * b, v, generator=g, dtype=torch.float64) * 2.0
        logp = torch.log_softmax(teacher_logits, dim=-1).gather(1, ids)
        out["teacher_topk_ids"] = ids.view(s, b, k)
        out["teacher_topk_logprobs"] = logp.view(s, b, k).to(torch.float32 if dt != torch.float64
                                                                else dt)
    if sp["ce_weight"] > 0 or sp["labels"]:
        labels = torch.randint(0, v, (s, b), generator=g)
        labels[0, 0] = v - 1
        labels[-1, -1] = IGNORE
        out["labels"] = labels
    if sp["mask"]:
        m = (torch.rand(s, b, generator=g) > 0.3).to(torch.float32)
        m[0, 0] = 0.5  # fractional weights are allowed
        out["loss_mask"] = m
    return out


def config_of(sp: dict, cpu_tuning: CpuTuning | None = None) -> KDLossConfig:
    """The case's loss config; ``cpu_tuning`` None: this machine's."""
    return KDLossConfig(kind=sp["kind"], temperature=sp["temperature"], beta=sp["beta"],
                        kd_weight=sp["kd_weight"], ce_weight=sp["ce_weight"],
                        topk_tail=sp["topk_tail"], window_size=sp["window_size"],
                        vocab_size=sp["vocab_size"], ignore_index=IGNORE,
                        backward=sp["backward"], sequence_parallel=sp["sequence_parallel"],
                        elementwise=sp["elementwise"], cpu_tuning=cpu_tuning, path=sp["path"],
                        gpu_tuning=None if sp["gpu_tuning"] is None
                        else GpuTuning(**sp["gpu_tuning"]))


def shard_sizes(padded_vocab: int, world: int, seed: int = 0) -> list[int]:
    """An uneven contiguous partition (sizes in ratio 1 : 2 : 3 : ... plus a remainder)."""
    weights = list(range(1, world + 1))
    sizes = [padded_vocab * w // sum(weights) for w in weights]
    sizes[-1] += padded_vocab - sum(sizes)
    return sizes


def reference(sp: dict, inp: dict):
    """fp64 loss and gradients of the reference on the same (possibly bf16) values."""
    d = {k: (v.double().requires_grad_(k in ("student_hidden", "student_weight"))
             if v.is_floating_point() and k != "loss_mask" else v) for k, v in inp.items()}
    loss = reference_kd_loss(
        d["student_hidden"], d["student_weight"], d.get("teacher_hidden"),
        d.get("teacher_weight"), d.get("teacher_topk_ids"), d.get("teacher_topk_logprobs"),
        d.get("labels"), d.get("loss_mask"), kind=sp["kind"], temperature=sp["temperature"],
        beta=sp["beta"], kd_weight=sp["kd_weight"], ce_weight=sp["ce_weight"],
        topk_tail=sp["topk_tail"], vocab_size=sp["vocab_size"], ignore_index=IGNORE)
    loss.backward()
    return loss.detach(), d["student_hidden"].grad, d["student_weight"].grad


def cpu_tuning_of(sp: dict, local_vocab_size: int) -> CpuTuning | None:
    """The case's CPU tuning on a shard of ``local_vocab_size`` rows: this machine's with the
    fields of ``sp["cpu_tuning"]`` (a dict) replaced, and with ``sp["block_rows"]`` CPU row
    blocks of that many rows with per-block all-reduces; None (this machine's, resolved by the
    loss) when the case sets neither."""
    if sp["cpu_tuning"] is None and sp["block_rows"] is None:
        return None
    fields = dict(sp["cpu_tuning"] or {})
    if sp["block_rows"] is not None:  # CPU row blocks smaller than a window
        fields.update(block_elements=sp["block_rows"] * local_vocab_size, blocks_with_tp=True)
    return dataclasses.replace(CpuTuning.for_this_machine(), **fields)


def teacher_of(inp: dict, hidden: torch.Tensor | None = None,
               weight: torch.Tensor | None = None) -> DenseTeacher | TopKTeacher | None:
    """The loss's teacher record of a case's inputs (``make_inputs``): dense, with ``hidden``
    and ``weight`` where given (this rank's slice and shard), else the full ones; top-K; or
    None."""
    if "teacher_hidden" in inp:
        return DenseTeacher(hidden=inp["teacher_hidden"] if hidden is None else hidden,
                            weight=inp["teacher_weight"] if weight is None else weight)
    if "teacher_topk_ids" in inp:
        return TopKTeacher(ids=inp["teacher_topk_ids"], logprobs=inp["teacher_topk_logprobs"])
    return None


def run_ours(sp: dict, inp: dict, sizes: list[int], rank: int, group,
             device: str | None = None) -> dict:
    """Our loss on rank ``rank`` of ``group`` with shard ``sizes``, its inputs moved to
    ``device`` (None: where they are); results for comparison, on the host when moved."""
    start = sum(sizes[:rank])
    stop = start + sizes[rank]
    world = len(sizes)
    host = inp
    if device is not None:
        inp = {k: v.to(device) for k, v in inp.items()}
    hidden = inp["student_hidden"]
    t_hidden = inp.get("teacher_hidden")
    if sp["sequence_parallel"] and world > 1:
        chunk = hidden.shape[0] // world
        hidden = hidden[rank * chunk:(rank + 1) * chunk]
        if t_hidden is not None:
            t_hidden = t_hidden[rank * chunk:(rank + 1) * chunk]
    hidden = hidden.clone().requires_grad_(True)
    weight = inp["student_weight"][start:stop].clone().requires_grad_(True)
    t_weight = inp.get("teacher_weight")
    if t_weight is not None:
        t_weight = t_weight[start:stop]
    before = {k: v.clone() for k, v in inp.items()}
    loss, n_tokens = vocab_parallel_kd_loss(
        hidden, weight, teacher_of(inp, t_hidden, t_weight), labels=inp.get("labels"),
        loss_mask=inp.get("loss_mask"),
        config=config_of(sp, cpu_tuning_of(sp, stop - start)), tp_group=group)
    (loss * 0.75).backward()  # a non-unit upstream gradient must scale every gradient
    unchanged = all(torch.equal(before[k], inp[k]) and torch.equal(host[k].cpu(), inp[k].cpu())
                    for k in inp)
    back = (lambda t: t) if device is None else (lambda t: t.cpu())  # results: where found
    return {"loss": back(loss.detach()), "num_tokens": back(n_tokens),
            "grad_x": back(hidden.grad) / 0.75,
            "grad_w": back(weight.grad) / 0.75, "start": start, "stop": stop,
            "inputs_unchanged": unchanged, "loss_dtype": loss.dtype,
            "grad_dtype": hidden.grad.dtype}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    scale = b.abs().max().clamp(min=1e-30)
    return float((a - b).abs().max() / scale)


def compare(sp: dict, inp: dict, ours: list[dict], world: int, tol: float | None = None) -> None:
    """Assert our per-rank results equal the reference within the dtype's tolerance."""
    ref_loss, ref_gx, ref_gw = reference(sp, inp)
    tol = TOLERANCE[sp["dtype"]] if tol is None else tol
    chunk = ref_gx.shape[0] // world
    for rank, r in enumerate(ours):
        where = f"rank {rank}/{world} spec={ {k: v for k, v in sp.items()} }"
        assert r["inputs_unchanged"], f"an input was written in place ({where})"
        assert r["grad_dtype"] == sp["dtype"], where
        assert rel_err(r["loss"], ref_loss) <= tol, (float(r["loss"]), float(ref_loss), where)
        gx = ref_gx
        if sp["sequence_parallel"] and world > 1:
            gx = ref_gx[rank * chunk:(rank + 1) * chunk]
        assert rel_err(r["grad_x"], gx) <= tol, (rel_err(r["grad_x"], gx), "grad_x", where)
        gw = ref_gw[r["start"]:r["stop"]]
        padded_rows = sp["vocab_size"] is not None
        if gw.abs().max() == 0 and padded_rows:
            assert float(r["grad_w"].abs().max()) == 0.0, where  # a shard of padding rows only
        else:
            # rows past the true vocabulary get exactly zero gradient
            assert rel_err(r["grad_w"], gw) <= tol, (rel_err(r["grad_w"], gw), "grad_w", where)
        expected_tokens = (inp["loss_mask"].sum() if "loss_mask" in inp
                           else torch.tensor(float(sp["s"] * sp["b"])))
        assert abs(float(r["num_tokens"]) - float(expected_tokens)) < 1e-6, where


def single_case(sp: dict, tol: float | None = None) -> dict:
    """The case ``sp`` on one rank (no process group) against the reference; our results."""
    inp = make_inputs(sp)
    ours = run_ours(sp, inp, [sp["padded_vocab"]], 0, None)
    compare(sp, inp, [ours], 1, tol)
    return ours


def dist_case(ctx, sp: dict, world: int) -> dict | None:
    """Gloo worker: run the case on the prefix group of ``world`` ranks."""
    torch.manual_seed(0)
    group = ctx.group(world)
    if group is None:
        return None
    inp = make_inputs(sp)
    sizes = shard_sizes(sp["padded_vocab"], world, sp["seed"])
    return run_ours(sp, inp, sizes, dist.get_rank(group), group)


# --- the student-teacher metrics of evaluation (megatron_kd.loss.agreement) ------------------

def tied_inputs(sp: dict) -> dict:
    """A dense case whose logits are small integers (exact in every dtype and summation order),
    so most rows' maxima are tied, many across vocab shards: hidden states and weights drawn
    from {-2, ..., 2} (625 distinct weight rows for 1009 ids). The teacher is the student's
    weights with a few rows changed, so some rows agree and some do not."""
    g = torch.Generator().manual_seed(sp["seed"])
    s, b, h, vp = sp["s"], sp["b"], sp["h_s"], sp["padded_vocab"]

    def ints(*shape):
        return torch.randint(-2, 3, shape, generator=g).to(sp["dtype"])

    weight = ints(vp, h)
    t_weight = weight.clone()
    t_weight[torch.randperm(vp, generator=g)[: vp // 3]] = ints(vp // 3, h)
    hidden = ints(s, b, h)
    return {"student_hidden": hidden, "student_weight": weight,
            "teacher_hidden": hidden.clone(), "teacher_weight": t_weight,
            **({"loss_mask": (torch.rand(s, b, generator=g) > 0.3).float()} if sp["mask"]
               else {})}


def run_agreement(sp: dict, inp: dict, sizes: list[int], rank: int, group) -> dict:
    """:func:`~megatron_kd.loss.agreement.vocab_parallel_agreement` on rank ``rank`` of
    ``group`` with shard ``sizes``, under the case's loss configuration (which must not change
    the metrics); its sums and whether the inputs were left unwritten."""
    from megatron_kd.loss.agreement import vocab_parallel_agreement

    start = sum(sizes[:rank])
    stop = start + sizes[rank]
    world = len(sizes)
    hidden, t_hidden = inp["student_hidden"], inp.get("teacher_hidden")
    if sp["sequence_parallel"] and world > 1:
        chunk = hidden.shape[0] // world
        hidden = hidden[rank * chunk:(rank + 1) * chunk]
        if t_hidden is not None:
            t_hidden = t_hidden[rank * chunk:(rank + 1) * chunk]
    t_weight = inp.get("teacher_weight")
    before = {k: v.clone() for k, v in inp.items()}
    sums = vocab_parallel_agreement(
        hidden, inp["student_weight"][start:stop],
        teacher_of(inp, t_hidden, None if t_weight is None else t_weight[start:stop]),
        loss_mask=inp.get("loss_mask"), config=config_of(sp, cpu_tuning_of(sp, stop - start)),
        tp_group=group)
    return {"kl": sums.kl_sum, "top1": sums.top1_sum, "tokens": sums.num_tokens,
            "inputs_unchanged": all(torch.equal(before[k], inp[k]) for k in inp)}


# KL tolerance (relative to the reference's sum) by input dtype: fp64 / fp32 as the loss's
# (TOLERANCE); bf16: the logits are bf16 products here and exact products of the same bf16 values
# in the reference, 2^-9 relative of |z| ~ 3 per logit, and a KL is a difference of such terms
# (~0.5 per token here): 5e-2 of the sum, where a wrong term is O(1).
AGREEMENT_KL_TOLERANCE = {**TOLERANCE, torch.bfloat16: 5e-2}


def compare_agreement(sp: dict, inp: dict, ours: list[dict]) -> None:
    """Every rank's sums equal the dense reference's: the KL within the dtype's tolerance, the
    agreement count and the token count exactly (bf16: the reference's logits rounded to bf16,
    as the output layers write them, so both see the same ties)."""
    from support.kd_reference import reference_agreement

    d = {k: v.double() if v.is_floating_point() and k != "teacher_topk_logprobs" else v
         for k, v in inp.items()}
    ref_kl, ref_top1, ref_tokens = reference_agreement(
        d["student_hidden"], d["student_weight"], d.get("teacher_hidden"),
        d.get("teacher_weight"), d.get("teacher_topk_ids"), d.get("teacher_topk_logprobs"),
        d.get("loss_mask"), vocab_size=sp["vocab_size"],
        logit_dtype=torch.bfloat16 if sp["dtype"] == torch.bfloat16 else None)
    tol = AGREEMENT_KL_TOLERANCE[sp["dtype"]]
    for rank, r in enumerate(ours):
        where = f"rank {rank}/{len(ours)} spec={sp}"
        assert r["inputs_unchanged"], f"an input was written in place ({where})"
        assert abs(float(r["kl"]) - float(ref_kl)) <= tol * max(abs(float(ref_kl)), 1e-12), (
            float(r["kl"]), float(ref_kl), where)
        assert float(r["top1"]) == float(ref_top1), (float(r["top1"]), float(ref_top1), where)
        assert float(r["tokens"]) == float(ref_tokens), where


def agreement_dist_case(ctx, sp: dict, world: int, tied: bool = False) -> dict | None:
    """Gloo worker: the metrics of the case on the prefix group of ``world`` ranks (``tied``:
    on :func:`tied_inputs`)."""
    group = ctx.group(world)
    if group is None:
        return None
    inp = tied_inputs(sp) if tied else make_inputs(sp)
    sizes = shard_sizes(sp["padded_vocab"], world, sp["seed"])
    return run_agreement(sp, inp, sizes, dist.get_rank(group), group)
