"""The loss of a weighted mixture of teachers, tier 1: one process, no process group.

Against the independent fp64 dense reference of the mixture (``support.kd_reference.
reference_mixture_kd_loss``: ``m = sum_i w_i p_i`` built from full logits): the gradients of
student hidden states and weight equal those of ``KL(m || q)``; the value equals it plus the
teachers' weighted Jensen-Shannon divergence ``H(m) - sum_i w_i H(p_i)``. Then the identities
that hold bit for bit, and the refusals.
"""

import math

import pytest
import torch
from support.kd_cases import config_of, make_inputs, spec
from support.mixture_cases import (
    compare,
    exact_checks,
    make_mixture_inputs,
    mixture_spec,
    records,
    run_mixture,
    run_single,
)

from megatron_kd.loss import (
    DenseTeacher,
    KDLossConfig,
    TopKTeacher,
    mixture_kd_loss,
    mixture_weights,
)

PAIRS = {"dense+dense": ("dense", "dense"), "dense+topk": ("dense", "renormalize"),
         "topk+topk": ("renormalize", "renormalize")}


def single_mixture(case: dict) -> dict:
    inp, teachers = make_mixture_inputs(case)
    ours = run_mixture(case, inp, teachers, [case["padded_vocab"]], 0, None)
    compare(case, inp, teachers, [ours])
    return ours


@pytest.mark.parametrize("pair", list(PAIRS))
@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_parity_with_the_mixture_reference(pair, temperature):
    single_mixture(mixture_spec(teachers=PAIRS[pair], temperature=temperature))


@pytest.mark.parametrize("pair", list(PAIRS))
@pytest.mark.parametrize("backward", ["precompute", "recompute"])
def test_parity_with_mask_ce_and_padding(pair, backward):
    # a fractional mask, CE counted once (not once per teacher), padding rows past vocab_size
    single_mixture(mixture_spec(teachers=PAIRS[pair], weights=(2.0, 1.0), temperature=2.0,
                                mask=True, ce_weight=0.6, kd_weight=0.8, vocab_size=1000,
                                backward=backward))


def test_three_teachers_unnormalized_weights():
    # weights normalized here: (1, 3, 4) is (1/8, 3/8, 1/2)
    single_mixture(mixture_spec(teachers=("dense", "renormalize", "dense"), weights=(1, 3, 4),
                                temperature=1.5, mask=True, ce_weight=0.3))


@pytest.mark.parametrize("teachers", [("dense", "ghost"), ("ghost", "ghost")])
def test_parity_with_ghost_tails(teachers):
    # the ghost tail (T = 1): a teacher's distribution in the mixture is its K probabilities and
    # its leftover mass spread over the other ids as the student's own (the reference's "ghost")
    single_mixture(mixture_spec(teachers=teachers, topk_tail="ghost", mask=True, ce_weight=0.5,
                                vocab_size=1001))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_parity_in_low_precision(dtype):
    # the dtype's tolerance (support.kd_cases.TOLERANCE); in bf16 each teacher's gradient is
    # rounded to bf16 before the two are added, two roundings of 2^-9 well inside 2e-2
    single_mixture(mixture_spec(dtype=dtype, ce_weight=0.4, mask=True, window_size=64))


@pytest.mark.parametrize("path", ["gpu", "dense"])
def test_parity_on_the_other_paths(path):
    # the GPU path's maths on CPU (eager kernels, windows of a few rows by bytes) and the
    # dense-logits baseline: the mixture goes through whichever path the config names
    gpu_tuning = dict(kernels="eager", window_bytes=60_000) if path == "gpu" else None
    single_mixture(mixture_spec(path=path, gpu_tuning=gpu_tuning, temperature=2.0, mask=True,
                                ce_weight=0.5))


@pytest.mark.parametrize("pair", list(PAIRS))
def test_weight_zero_and_one_teacher_are_bit_for_bit(pair):
    # (1, 0), (0, 1): the one-teacher loss of the weighted teacher (value and both gradients);
    # one teacher of any weight: vocab_parallel_kd_loss itself; (a, b, 0) equals (a, b)
    case = mixture_spec(teachers=(*PAIRS[pair], "dense"), temperature=2.0, mask=True,
                        ce_weight=0.5)
    inp, teachers = make_mixture_inputs(case)
    assert exact_checks(case, inp, teachers, [case["padded_vocab"]], 0, None) == {
        "1,0": True, "0,1": True, "n=1": True, "a,b,0": True}


@pytest.mark.parametrize("kind", ["reverse_kl", "jsd"])
def test_one_teacher_takes_every_kind_bit_for_bit(kind):
    case = mixture_spec(kind=kind, teachers=("dense",), weights=(1.0,), ce_weight=0.3)
    inp, teachers = make_mixture_inputs(case)
    ours = run_mixture(case, inp, teachers, [case["padded_vocab"]], 0, None)
    single = run_single(case, inp, teachers[0], [case["padded_vocab"]], 0, None)
    assert all(torch.equal(ours[k], single[k]) for k in ("loss", "grad_x", "grad_w"))


def test_terms_out_logs_each_teacher():
    # each teacher's unweighted KD sum is its own loss's, the weight-0 one's included; kd_sum
    # their weighted sum; ce_sum once
    case = mixture_spec(teachers=("dense", "renormalize", "dense"), weights=(1, 3, 0),
                        temperature=2.0, mask=True, ce_weight=0.5)
    inp, teachers = make_mixture_inputs(case)
    sizes = [case["padded_vocab"]]
    terms = run_mixture(case, inp, teachers, sizes, 0, None)["terms"]
    singles = [run_single(case, inp, t, sizes, 0, None)["terms"] for t in teachers]
    assert len(terms["teacher_kd_sums"]) == 3
    for logged, single in zip(terms["teacher_kd_sums"], singles):
        assert not logged.requires_grad
        assert torch.equal(logged, single["kd_sum"])
    expected = 0.25 * singles[0]["kd_sum"] + 0.75 * singles[1]["kd_sum"]
    assert math.isclose(float(terms["kd_sum"]), float(expected), rel_tol=1e-12)
    assert torch.equal(terms["ce_sum"], singles[0]["ce_sum"])


def test_weight_zero_teacher_is_not_in_the_graph():
    # a teacher of weight 0 whose logits are NaN: no error, the loss finite, the NaN logged
    case = mixture_spec(teachers=("dense", "dense"), weights=(1.0, 0.0))
    inp, teachers = make_mixture_inputs(case)
    teachers[1]["teacher_hidden"] = torch.full_like(teachers[1]["teacher_hidden"], math.nan)
    ours = run_mixture(case, inp, teachers, [case["padded_vocab"]], 0, None)
    assert torch.isfinite(ours["loss"]) and torch.isfinite(ours["grad_x"]).all()
    assert math.isnan(float(ours["terms"]["teacher_kd_sums"][1]))


# --- refusals ---------------------------------------------------------------------------------

def _two(case=None):
    case = case or mixture_spec(teachers=("dense", "renormalize"))
    inp, teachers = make_mixture_inputs(case)
    return case, inp, records(case, teachers, [case["padded_vocab"]], 0)


@pytest.mark.parametrize("kind", ["reverse_kl", "jsd"])
@pytest.mark.parametrize("weights", [(0.5, 0.5), (1.0, 0.0)])
def test_reverse_kl_and_jsd_are_refused_for_two_teachers(kind, weights):
    case, inp, recs = _two(mixture_spec(teachers=("dense", "dense"), kind=kind))
    with pytest.raises(ValueError, match=rf"kind='{kind}' with 2 teachers: a mixture of "
                                         rf"teachers is trained on forward KL only") as info:
        mixture_kd_loss(inp["student_hidden"], inp["student_weight"], recs, weights,
                        config=config_of(case))
    assert ("geometric mean" if kind == "reverse_kl" else "inside a log") in str(info.value)


@pytest.mark.parametrize("weights,message", [
    ((1.0,), r"1 weights \[1.0\] for 2 teachers: one weight per teacher"),
    ((1.0, 0.5, 0.5), r"3 weights .* for 2 teachers"),
    ((1.0, -0.1), r"weight 1 of teacher 1 must be finite and >= 0, got -0.1"),
    ((math.nan, 1.0), r"weight 0 of teacher 0 must be finite and >= 0, got nan"),
    ((math.inf, 1.0), r"weight 0 of teacher 0 must be finite and >= 0, got inf"),
    ((0.0, 0.0), r"weights \[0.0, 0.0\] are all 0: at least one must be > 0"),
    ((True, 1.0), r"weight 0 must be a real number, got True"),
    ("ab", r"weights must be a sequence of numbers"),
])
def test_bad_weights_are_refused(weights, message):
    case, inp, recs = _two()
    with pytest.raises(ValueError, match=message):
        mixture_kd_loss(inp["student_hidden"], inp["student_weight"], recs, weights,
                        config=config_of(case))


def test_weights_are_normalized():
    assert mixture_weights([2, 1, 1], 3) == (0.5, 0.25, 0.25)
    assert mixture_weights([3.0, 0], 2) == (1.0, 0.0)


def test_a_teacher_that_is_not_a_record_is_refused():
    case, inp, recs = _two()
    with pytest.raises(ValueError, match="teacher 1 must be a DenseTeacher or a TopKTeacher, "
                                         "got dict"):
        mixture_kd_loss(inp["student_hidden"], inp["student_weight"], [recs[0], {}], [1, 1],
                        config=config_of(case))


def test_a_dense_teacher_of_another_vocabulary_is_refused_by_index_and_sizes():
    case, inp, recs = _two(mixture_spec(teachers=("renormalize", "dense", "dense")))
    small = DenseTeacher(hidden=recs[2].hidden, weight=recs[2].weight[:1000])
    with pytest.raises(ValueError, match=r"teacher 2 of 3 \(DenseTeacher, weight 0.333333\): "
                                         r"the teacher's output layer has 1000 vocabulary rows "
                                         r"\(shards \[1000\] over the 1 TP rank\(s\)\) but "
                                         r"the student's has 1009 \(shards \[1009\]\)"):
        mixture_kd_loss(inp["student_hidden"], inp["student_weight"], [*recs[:2], small],
                        [1, 1, 1], config=config_of(case))


def test_a_top_k_teacher_past_the_vocabulary_is_refused_by_index():
    case, inp, recs = _two(mixture_spec(teachers=("dense", "renormalize"), vocab_size=1000))
    ids = recs[1].ids.clone()
    ids[0, 0, 0] = 1005  # a padding row: past the true vocabulary
    bad = TopKTeacher(ids=ids, logprobs=recs[1].logprobs)
    with pytest.raises(ValueError, match=r"in the loss of teacher 1 of 2 \(TopKTeacher, weight "
                                         r"0.7\): teacher.ids value 1005 out of range "
                                         r"\[0, 1000\)"):
        mixture_kd_loss(inp["student_hidden"], inp["student_weight"], [recs[0], bad],
                        [0.3, 0.7], config=config_of(case))


def test_shape_errors_name_the_teacher():
    case, inp, recs = _two()
    short = DenseTeacher(hidden=recs[0].hidden[:-1], weight=recs[0].weight)
    with pytest.raises(ValueError, match=r"in the loss of teacher 0 of 2 \(DenseTeacher, "
                                         r"weight 0.5\): teacher.hidden leading shape"):
        mixture_kd_loss(inp["student_hidden"], inp["student_weight"], [short, recs[1]],
                        [1, 1], config=config_of(case))


def test_inputs_of_the_records_are_unchanged_and_config_default():
    # config=None is KDLossConfig() (forward KL), as for the one-teacher loss
    sp = spec()
    inp = make_inputs(sp)
    hidden = inp["student_hidden"].clone().requires_grad_(True)
    teacher = DenseTeacher(hidden=inp["teacher_hidden"], weight=inp["teacher_weight"])
    ours, _ = mixture_kd_loss(hidden, inp["student_weight"], [teacher, teacher], [1, 1])
    mixed_config, _ = mixture_kd_loss(hidden, inp["student_weight"], [teacher, teacher],
                                      [1, 1], config=KDLossConfig())
    assert torch.equal(ours, mixed_config)
