"""Evaluation's student-teacher metrics (``megatron_kd.loss.agreement``), tier 1: one process.

Every case is compared with the independent dense reference (``support.kd_reference.
reference_agreement``: full logits, ``log_softmax``, ``torch.argmax``): the KL sum within the
dtype's tolerance, the top-1 agreement count and the token count exactly. The metrics are fixed
(forward KL at T = 1): the case's loss configuration (kind, temperature, top-K tail) must not
change them.
"""

import pytest
import torch
from support.kd_cases import (
    compare_agreement,
    make_inputs,
    run_agreement,
    spec,
    teacher_of,
    tied_inputs,
)

from megatron_kd.loss import DenseTeacher, KDLossConfig, TopKTeacher
from megatron_kd.loss.agreement import vocab_parallel_agreement

CASES = {
    "dense_fp64": spec(mask=True),
    "dense_padding_rows": spec(vocab_size=1000, mask=True),
    # the trained loss's choices do not reach the metric
    "dense_jsd_T2_ce": spec(kind="jsd", temperature=2.0, ce_weight=0.5, labels=True),
    "dense_reverse_kl_window1": spec(kind="reverse_kl", window_size=1),
    "dense_blocks": spec(window_size=8, block_rows=3, mask=True),
    "dense_fp32": spec(dtype=torch.float32, window_size=64),
    "dense_bf16": spec(dtype=torch.bfloat16, window_size=64, mask=True),
    "dense_huge_logits": spec(scale=300.0),
    "topk_ghost": spec(teacher="ghost", topk_tail="ghost", k=9, mask=True, vocab_size=1003),
    # the top-K loss's renormalised tail and its temperature do not reach the metric either
    "topk_renorm_T2": spec(teacher="renormalize", topk_tail="renormalize", temperature=2.0,
                           k=11),
    "topk_blocks": spec(teacher="ghost", topk_tail="ghost", k=9, window_size=8, block_rows=3),
}


@pytest.mark.parametrize("name", list(CASES))
def test_parity_with_reference(name):
    sp = CASES[name]
    inp = make_inputs(sp)
    compare_agreement(sp, inp, [run_agreement(sp, inp, [sp["padded_vocab"]], 0, None)])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_ties_go_to_the_lowest_id(dtype):
    sp = spec(dtype=dtype, h_s=4, s=7, b=5, mask=True)
    inp = tied_inputs(sp)
    z = inp["student_hidden"].double().reshape(-1, 4) @ inp["student_weight"].double().t()
    tied_rows = int(((z == z.max(1, keepdim=True).values).sum(1) > 1).sum())
    assert tied_rows > z.shape[0] // 2  # the case is mostly ties
    ours = run_agreement(sp, inp, [sp["padded_vocab"]], 0, None)
    compare_agreement(sp, inp, [ours])
    assert 0 < float(ours["top1"]) < float(ours["tokens"])  # some agree, some do not


@pytest.mark.parametrize("teacher", ["dense", "ghost"])
def test_the_teacher_itself_scores_kl_0_and_agreement_1(teacher):
    sp = spec(teacher=teacher, topk_tail="ghost", mask=True)
    inp = make_inputs(sp)
    h, w = inp["student_hidden"], inp["student_weight"]
    if teacher == "dense":
        same = DenseTeacher(hidden=h, weight=w)
    else:  # the student's own top 50 ids and log-probabilities, as a cache holds them
        logp = torch.log_softmax(h.reshape(-1, 16) @ w.t(), dim=-1)
        lp, ids = logp.topk(50, dim=-1)
        same = TopKTeacher(ids=ids.view(5, 3, 50), logprobs=lp.view(5, 3, 50))
    sums = vocab_parallel_agreement(h, w, same, loss_mask=inp["loss_mask"])
    assert abs(float(sums.kl_sum)) < 1e-12  # fp64: rounding only
    assert float(sums.top1_sum) == float(sums.num_tokens) == float(inp["loss_mask"].sum())


def test_kl_is_nonnegative_and_agreement_a_fraction():
    for seed in range(5):
        sp = spec(seed=seed, mask=True)
        r = run_agreement(sp, make_inputs(sp), [1009], 0, None)
        assert float(r["kl"]) > 0
        assert 0 <= float(r["top1"]) <= float(r["tokens"])


def test_no_teacher_is_refused():
    sp = spec()
    inp = make_inputs(sp)
    with pytest.raises(ValueError, match="DenseTeacher or a TopKTeacher"):
        vocab_parallel_agreement(inp["student_hidden"], inp["student_weight"], None)


def test_bad_shapes_are_refused():
    sp = spec()
    inp = make_inputs(sp)
    teacher = teacher_of(inp, weight=inp["teacher_weight"][:-1])
    with pytest.raises(ValueError, match=r"the teacher's output layer has 1008 vocabulary rows "
                                         r"\(shards \[1008\] .*but the student's has 1009"):
        vocab_parallel_agreement(inp["student_hidden"], inp["student_weight"], teacher)


def test_non_finite_kl_raises():
    sp = spec()
    inp = make_inputs(sp)
    hidden = inp["teacher_hidden"].clone()
    hidden[1, 2, 0] = float("nan")
    with pytest.raises(FloatingPointError, match="non-finite student-teacher KL"):
        vocab_parallel_agreement(inp["student_hidden"], inp["student_weight"],
                                 DenseTeacher(hidden=hidden, weight=inp["teacher_weight"]))
    # a NaN on a token of weight 0 is not counted
    mask = torch.ones(5, 3)
    mask[1, 2] = 0
    sums = vocab_parallel_agreement(inp["student_hidden"], inp["student_weight"],
                                    DenseTeacher(hidden=hidden, weight=inp["teacher_weight"]),
                                    loss_mask=mask)
    assert torch.isfinite(sums.kl_sum) and float(sums.num_tokens) == 14


def test_no_gradient_and_the_run_config_untouched():
    sp = spec()
    inp = make_inputs(sp)
    h = inp["student_hidden"].clone().requires_grad_(True)
    config = KDLossConfig(kind="jsd", temperature=3.0, ce_weight=0.5)
    sums = vocab_parallel_agreement(h, inp["student_weight"], teacher_of(inp), config=config)
    assert not sums.kl_sum.requires_grad and not sums.top1_sum.requires_grad
    assert (config.kind, config.temperature, config.ce_weight) == ("jsd", 3.0, 0.5)
