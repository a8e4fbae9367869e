"""Fused KD loss, tier 1: one process, no process group (tp_group=None).

Every case is compared with the independent dense reference (tests/kd_reference.py) on the
forward value and the gradients of student_hidden and student_weight.
"""

from dataclasses import replace

import pytest
import torch
from support.kd_cases import make_inputs, run_ours, single_case, spec, teacher_of
from support.kd_reference import reference_kd_loss

from megatron_kd.loss import (
    DenseTeacher,
    KDLossConfig,
    TopKTeacher,
    vocab_parallel_kd_loss,
    window,
)

KINDS = ["forward_kl", "reverse_kl", "jsd"]


@pytest.mark.parametrize("backward", ["precompute", "recompute"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("temperature,ce_weight", [(1.0, 0.0), (2.5, 0.0), (1.0, 0.7), (0.6, 0.3)])
def test_dense_kinds_fp64(kind, temperature, ce_weight, backward):
    single_case(spec(kind=kind, temperature=temperature, ce_weight=ce_weight, backward=backward,
                 mask=True, vocab_size=1000))


@pytest.mark.parametrize("backward", ["precompute", "recompute"])
@pytest.mark.parametrize("tail,temperature", [("renormalize", 1.0), ("renormalize", 2.0),
                                              ("ghost", 1.0)])
@pytest.mark.parametrize("ce_weight", [0.0, 0.5])
def test_sparse_teacher_fp64(tail, temperature, ce_weight, backward):
    single_case(spec(teacher=tail, topk_tail=tail, temperature=temperature, ce_weight=ce_weight,
                 backward=backward, mask=True, vocab_size=1003))


@pytest.mark.parametrize("kind", KINDS)
def test_fp32_within_1e5(kind):
    single_case(spec(kind=kind, dtype=torch.float32, ce_weight=0.4, temperature=1.5,
                     window_size=64))


@pytest.mark.parametrize("kind", KINDS)
def test_bf16_against_fp64_of_same_values(kind):
    single_case(spec(kind=kind, dtype=torch.bfloat16, ce_weight=0.4, window_size=64))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_huge_logits_do_not_overflow(kind, dtype):
    # logits around +-1000: exp overflows in both fp32 and fp64 without the max shift
    sp = spec(kind=kind, dtype=dtype, scale=300.0, ce_weight=0.2)
    inp = make_inputs(sp)
    z = inp["student_hidden"].double().reshape(-1, 16) @ inp["student_weight"].double().t()
    z_max = float(z.abs().max())
    assert z_max > 750  # the case really overflows a naive exp
    # Rounding a logit of size |z| to the input dtype moves exp(z) by |z| * eps relative, so
    # probabilities and gradients carry that error whatever the algorithm (reference: fp64 on
    # the same values); 8x covers the h=16-term GEMM accumulation.
    eps = torch.finfo(dtype).eps
    single_case(sp, tol=max(8 * z_max * eps, 1e-9))


def test_huge_logits_sparse_ghost():
    # same bound as above: 8 * |z|max * eps32 with |z| ~ 1000
    single_case(spec(teacher="ghost", topk_tail="ghost", scale=300.0, dtype=torch.float32),
            tol=8 * 1200 * torch.finfo(torch.float32).eps)


@pytest.mark.parametrize("window_size", [1, 2, 7, 15, None])
def test_window_sizes_give_the_same_result(window_size):
    single_case(spec(window_size=window_size, ce_weight=0.5, mask=True))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("chunk,max_rows", [(7, 384), (1024, 384), (7, 0)])
def test_cpu_projection_in_vocab_slabs(monkeypatch, kind, chunk, max_rows):
    # 7-row slabs of a 1009-row shard (the last one 1 row), one slab of the whole shard, and
    # the one-GEMM path (max_rows 0): the same loss and gradients, in fp32 and fp64
    slab_calls, projections = [], []
    real, real_logits = window.WindowWalker._chunked_projection, window.WindowWalker.logits

    def spy(self, x, w, out):
        slab_calls.append((x.shape[0], w.shape[0]))
        return real(self, x, w, out)

    def logits_spy(self, x, w, name):
        projections.append((x.shape[0], w.shape[0]))
        return real_logits(self, x, w, name)

    monkeypatch.setattr(window.WindowWalker, "_chunked_projection", spy)
    monkeypatch.setattr(window.WindowWalker, "logits", logits_spy)
    tuning = dict(projection_chunk=chunk, chunked_projection_rows=max_rows)
    for dtype in (torch.float64, torch.float32):
        single_case(spec(kind=kind, dtype=dtype, ce_weight=0.3, mask=True, window_size=6,
                     cpu_tuning=tuning))
    assert projections and all(v == 1009 for _, v in projections)
    # every projection of the walk in slabs, or none of them
    assert slab_calls == ([] if max_rows == 0 else projections)


BLOCK_CASES = {
    "fwd_kl_T2_ce": dict(kind="forward_kl", temperature=2.0, ce_weight=0.5),
    "rev_kl_T07_ce": dict(kind="reverse_kl", temperature=0.7, ce_weight=0.3),
    "jsd_ce": dict(kind="jsd", beta=0.3, ce_weight=0.4),
    "topk_renorm_T2": dict(teacher="renormalize", topk_tail="renormalize", temperature=2.0,
                           ce_weight=0.5),
    "topk_ghost": dict(teacher="ghost", topk_tail="ghost", ce_weight=0.2, vocab_size=1001),
    "ce_only": dict(teacher=None, kd_weight=0.0, ce_weight=1.0),
}


@pytest.mark.parametrize("window_size", [8, None])
@pytest.mark.parametrize("backward", ["precompute", "recompute"])
@pytest.mark.parametrize("name", list(BLOCK_CASES))
def test_cpu_row_blocks_inside_windows(monkeypatch, name, backward, window_size):
    # 3-row blocks: 8-row windows split 3+3+2, the one 15-row window (None) into 5 blocks;
    # the mask skips tokens, so blocks index scattered active rows
    blocks, projections = [], []
    walk_blocks, logits = window.WindowWalker._blocks, window.WindowWalker.logits

    def blocks_spy(self, *args):
        for block in walk_blocks(self, *args):
            blocks.append(block[2].shape[0])  # the block's rows of student logits
            yield block

    def logits_spy(self, x, w, name):
        projections.append(x.shape[0])
        return logits(self, x, w, name)

    monkeypatch.setattr(window.WindowWalker, "_blocks", blocks_spy)
    monkeypatch.setattr(window.WindowWalker, "logits", logits_spy)
    single_case(spec(block_rows=3, window_size=window_size, backward=backward, mask=True,
                 **BLOCK_CASES[name]))
    assert max(blocks) <= 3 < max(projections)  # blocks inside windows, projections whole
    projected_models = 2 if BLOCK_CASES[name].get("teacher", "dense") == "dense" else 1
    assert sum(blocks) * projected_models == sum(projections)  # every row in one block


@pytest.mark.parametrize("temperature", [1.0, 2.0])
@pytest.mark.parametrize("backward", ["precompute", "recompute"])
def test_labels_with_zero_ce_weight_do_not_change_the_gradient(temperature, backward):
    # labels are given for logging only: loss and gradients are the KD ones
    single_case(spec(labels=True, ce_weight=0.0, temperature=temperature, backward=backward))


def test_ce_only_without_teacher():
    single_case(spec(teacher=None, kd_weight=0.0, ce_weight=1.0))


def test_window_bounds_rows_in_flight(monkeypatch):
    """No projection ever covers more than window_size rows (so no [tokens, V] tensor)."""
    seen = []
    real = window.WindowWalker.logits

    def spy(self, x, w, name):
        out = real(self, x, w, name)
        seen.append(tuple(out.shape))
        return out

    monkeypatch.setattr(window.WindowWalker, "logits", spy)
    single_case(spec(window_size=4, s=7, b=3))
    assert seen and max(r for r, _ in seen) <= 4
    assert sum(r for r, _ in seen) == 2 * 21  # student + teacher projection of every row, once


def test_recompute_saves_no_window_tensors(monkeypatch):
    """The recomputing strategy keeps per-row statistics only between forward and backward."""
    sp = spec(backward="recompute", s=6, b=2)
    inp = make_inputs(sp)
    hidden = inp["student_hidden"].clone().requires_grad_(True)
    weight = inp["student_weight"].clone().requires_grad_(True)
    loss, _ = vocab_parallel_kd_loss(hidden, weight, teacher_of(inp),
                                     config=KDLossConfig(window_size=4, backward="recompute"))
    stats = loss.grad_fn.saved_stats
    assert all(t.dim() == 1 and t.numel() <= 4 for s in stats for t in s.values())


# Projections as one GEMM whatever the CPU: the slabs' own buffer ("projection_slab", on AMD
# CPUs) is the walk's, not a kind's block temporary.
ONE_GEMM = dict(chunked_projection_rows=0)


def _scratch_names(monkeypatch) -> set[str]:
    """The names the walk asks :class:`window.Scratch` for, from now on."""
    names = set()
    take = window.Scratch.take

    def spy(self, name, like, shape=None):
        names.add(name)
        return take(self, name, like, shape)

    monkeypatch.setattr(window.Scratch, "take", spy)
    return names


@pytest.mark.parametrize("backward", ["precompute", "recompute"])
@pytest.mark.parametrize("kind,temporaries", [("forward_kl", {"e_t"}),
                                              ("reverse_kl", {"e_s", "dot"}),
                                              ("jsd", {"e_s", "e_t", "log_m"})])
def test_block_temporaries_per_kind(monkeypatch, kind, temporaries, backward):
    """Each kind's ``[rows, V]`` temporaries beside the two logit buffers: each one costs a
    block (CPU) or a window (TP > 1) of memory, so a new one must be a decision (JSD's log
    ratios reuse the logits' buffers)."""
    names = _scratch_names(monkeypatch)
    single_case(spec(kind=kind, backward=backward, block_rows=3, mask=True, cpu_tuning=ONE_GEMM))
    assert names == {"z_s", "z_t"} | temporaries


def test_all_masked_gives_zero_and_zero_grads():
    sp = spec(ce_weight=0.5)
    inp = make_inputs(sp)
    hidden = inp["student_hidden"].clone().requires_grad_(True)
    weight = inp["student_weight"].clone().requires_grad_(True)
    loss, n = vocab_parallel_kd_loss(
        hidden, weight, teacher_of(inp), labels=inp["labels"],
        loss_mask=torch.zeros(5, 3), config=KDLossConfig(ce_weight=0.5))
    loss.backward()
    assert float(loss.detach()) == 0.0 and float(n) == 0.0
    assert torch.count_nonzero(hidden.grad) == 0 and torch.count_nonzero(weight.grad) == 0


def test_returns_fp32_loss_and_input_dtype_grads_for_bf16():
    r = single_case(spec(dtype=torch.bfloat16, window_size=64))
    assert r["loss_dtype"] == torch.float32 and r["grad_dtype"] == torch.bfloat16


def test_terms_out_reports_unweighted_kd_and_ce_sums():
    sp = spec(ce_weight=0.5, mask=True)
    inp = make_inputs(sp)

    def call(kd_weight, ce_weight):
        terms = {}
        loss, _ = vocab_parallel_kd_loss(
            inp["student_hidden"], inp["student_weight"], teacher_of(inp),
            labels=inp["labels"], loss_mask=inp["loss_mask"],
            config=KDLossConfig(kd_weight=kd_weight, ce_weight=ce_weight, ignore_index=-100),
            terms_out=terms)
        return loss.detach(), terms

    loss, terms = call(0.3, 0.5)
    assert torch.allclose(0.3 * terms["kd_sum"] + 0.5 * terms["ce_sum"], loss)
    kd_only, terms_kd = call(1.0, 0.0)  # CE still reported, KD-only loss
    assert torch.allclose(kd_only, terms["kd_sum"]) and torch.allclose(terms_kd["ce_sum"],
                                                                       terms["ce_sum"])
    ce_only, _ = call(0.0, 1.0)
    assert torch.allclose(ce_only, terms["ce_sum"])
    # against the reference's separate terms
    ref_kd = reference_kd_loss(*(inp[k].double() for k in ("student_hidden", "student_weight",
                                                            "teacher_hidden", "teacher_weight")),
                               loss_mask=inp["loss_mask"])
    ref_ce = reference_kd_loss(inp["student_hidden"].double(), inp["student_weight"].double(),
                               labels=inp["labels"], loss_mask=inp["loss_mask"], kd_weight=0.0,
                               ce_weight=1.0)
    assert abs(float(terms["kd_sum"] - ref_kd)) < 1e-9 * abs(float(ref_kd))
    assert abs(float(terms["ce_sum"] - ref_ce)) < 1e-9 * abs(float(ref_ce))


# --- bad input --------------------------------------------------------------------------------
def _dense(**over):
    sp = spec(ce_weight=0.5)
    inp = make_inputs(sp)
    args = dict(student_hidden=inp["student_hidden"], student_weight=inp["student_weight"],
                teacher=teacher_of(inp), labels=inp["labels"],
                config=KDLossConfig(ce_weight=0.5))
    args.update(over)
    return args


def _sparse(**over):
    sp = spec(teacher="renormalize")
    inp = make_inputs(sp)
    args = dict(student_hidden=inp["student_hidden"], student_weight=inp["student_weight"],
                teacher=teacher_of(inp), config=KDLossConfig())
    args.update(over)
    return args


def test_error_hidden_weight_mismatch():
    args = _dense()
    args["student_weight"] = args["student_weight"][:, :15]
    with pytest.raises(ValueError, match=r"student hidden size 16 != student_weight columns 15"):
        vocab_parallel_kd_loss(**args)


def test_error_teacher_hidden_mismatch():
    args = _dense()
    args["teacher"] = replace(args["teacher"], weight=args["teacher"].weight[:, :20])
    with pytest.raises(ValueError, match=r"teacher hidden size 24"):
        vocab_parallel_kd_loss(**args)


def test_error_teacher_and_student_shards_differ():
    args = _dense()
    args["teacher"] = replace(args["teacher"], weight=args["teacher"].weight[:1000])
    with pytest.raises(ValueError, match=r"the teacher's output layer has 1000 vocabulary rows "
                                         r"\(shards \[1000\] over the 1 TP rank\(s\)\) but "
                                         r"the student's has 1009 \(shards \[1009\]\)"):
        vocab_parallel_kd_loss(**args)


def test_error_dtype_mismatch():
    args = _dense()
    args["student_weight"] = args["student_weight"].float()
    with pytest.raises(ValueError, match=r"dtype torch.float64 != student_weight dtype "
                                         r"torch.float32"):
        vocab_parallel_kd_loss(**args)


def test_error_ids_out_of_range():
    args = _sparse()
    ids = args["teacher"].ids.clone()
    ids[1, 1, 3] = 1009
    args["teacher"] = replace(args["teacher"], ids=ids)
    with pytest.raises(ValueError, match=r"teacher\.ids value 1009 out of range \[0, 1009\)"):
        vocab_parallel_kd_loss(**args)


def test_error_ids_past_true_vocab():
    args = _sparse(config=KDLossConfig(vocab_size=1000))
    ids = args["teacher"].ids.clone()
    ids[0, 0, 0] = 1004
    args["teacher"] = replace(args["teacher"], ids=ids)
    with pytest.raises(ValueError, match=r"value 1004 out of range \[0, 1000\)"):
        vocab_parallel_kd_loss(**args)


def test_error_duplicate_ids():
    args = _sparse()
    ids = args["teacher"].ids.clone()
    ids[2, 1, 4] = ids[2, 1, 2]
    args["teacher"] = replace(args["teacher"], ids=ids)
    with pytest.raises(ValueError, match=rf"id {int(ids[2, 1, 2])} twice in token row 7"):
        vocab_parallel_kd_loss(**args)


@pytest.mark.parametrize("kind", ["reverse_kl", "jsd"])
def test_error_sparse_teacher_needs_forward_kl(kind):
    with pytest.raises(ValueError, match=rf"forward_kl' only, got '{kind}'"):
        vocab_parallel_kd_loss(**_sparse(config=KDLossConfig(kind=kind)))


def test_error_ghost_needs_t1():
    with pytest.raises(ValueError, match=r"ghost' needs temperature 1, got 2.0"):
        vocab_parallel_kd_loss(**_sparse(config=KDLossConfig(topk_tail="ghost", temperature=2.0)))


def test_error_ghost_mass_above_one():
    args = _sparse(config=KDLossConfig(topk_tail="ghost"))
    args["teacher"] = replace(args["teacher"],
                              logprobs=torch.full_like(args["teacher"].logprobs, -0.1))
    with pytest.raises(ValueError, match=r"sum to 6\.33\d* > 1"):
        vocab_parallel_kd_loss(**args)


def test_error_teacher_is_not_a_record():
    # A dense and a top-K teacher at once cannot be written (one record or the other); a
    # record lacks no field; a tensor where the record goes is refused, naming what came.
    args = _dense()
    hidden = args["teacher"].hidden
    with pytest.raises(ValueError, match=r"DenseTeacher\.weight must be a torch\.Tensor, got "
                                         r"NoneType"):
        DenseTeacher(hidden=hidden, weight=None)
    with pytest.raises(ValueError, match=r"TopKTeacher\.logprobs must be a torch\.Tensor, got "
                                         r"NoneType"):
        TopKTeacher(ids=torch.zeros(5, 3, 2, dtype=torch.long), logprobs=None)
    args["teacher"] = hidden
    with pytest.raises(ValueError, match=r"teacher must be a DenseTeacher, a TopKTeacher or "
                                         r"None, got Tensor"):
        vocab_parallel_kd_loss(**args)


def test_error_no_teacher_with_kd_weight():
    args = _dense(teacher=None)
    with pytest.raises(ValueError, match=r"kd_weight=1.0 > 0 but no teacher"):
        vocab_parallel_kd_loss(**args)


def test_error_label_out_of_range():
    args = _dense()
    labels = args["labels"].clone()
    labels[1, 1] = 5000
    args["labels"] = labels
    with pytest.raises(ValueError, match=r"label 5000 out of range \[0, 1009\)"):
        vocab_parallel_kd_loss(**args)


def test_error_vocab_size_larger_than_layer():
    with pytest.raises(ValueError, match=r"vocab_size 2000 > rows of the output layer"):
        vocab_parallel_kd_loss(**_dense(config=KDLossConfig(vocab_size=2000, ce_weight=0.5)))


def test_error_mask_shape():
    with pytest.raises(ValueError, match=r"loss_mask shape \(3, 5\) != token shape \(5, 3\)"):
        vocab_parallel_kd_loss(**_dense(loss_mask=torch.ones(3, 5)))


@pytest.mark.parametrize("kind", KINDS)
def test_nan_raises_floating_point_error_naming_the_term(kind):
    args = _dense(config=KDLossConfig(kind=kind, ce_weight=0.5))
    hidden = args["teacher"].hidden.clone()
    hidden[2, 1, 0] = float("nan")
    args["teacher"] = replace(args["teacher"], hidden=hidden)
    with pytest.raises(FloatingPointError, match=rf"non-finite KD \({kind}\) loss"):
        vocab_parallel_kd_loss(**args)


def test_nan_in_ce_only_names_ce():
    args = _dense(teacher=None, config=KDLossConfig(kd_weight=0.0, ce_weight=1.0))
    w = args["student_weight"].clone()
    w[3, 0] = float("inf")
    args["student_weight"] = w
    with pytest.raises(FloatingPointError, match=r"non-finite CE loss"):
        vocab_parallel_kd_loss(**args)


@pytest.mark.parametrize("bad", [dict(kind="kl"), dict(beta=1.0, kind="jsd"),
                                 dict(temperature=0.0), dict(kd_weight=-1.0),
                                 dict(window_size=0), dict(kd_weight=0.0, ce_weight=0.0),
                                 dict(topk_tail="drop"), dict(backward="lazy"),
                                 dict(elementwise="triton"),
                                 dict(elementwise="compiled", kind="jsd")])
def test_config_validation(bad):
    with pytest.raises(ValueError):
        KDLossConfig(**bad)


# The compiled elementwise path (torch.compile: Inductor's C++ kernels here, Triton on a GPU)
# against the independent reference, as the eager kinds are: both backward strategies, CE
# shared with the KD softmax (T = 1) and on its own shift (T != 1), masks, padding columns,
# windows of 1 and of several blocks, fp64 and fp32 (the fp32 bound is the eager one's).
COMPILED_CASES = {
    "T1": dict(),
    "T1_ce_mask_padding": dict(ce_weight=0.7, mask=True, vocab_size=1000),
    "T2_ce_own_shift": dict(temperature=2.0, ce_weight=0.4, mask=True),
    "window1": dict(window_size=1, ce_weight=0.3),
    "blocks": dict(window_size=7, block_rows=3, ce_weight=0.5),
}


@pytest.mark.parametrize("backward", ["precompute", "recompute"])
@pytest.mark.parametrize("case", sorted(COMPILED_CASES))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_compiled_forward_kl(case, backward, dtype):
    single_case(spec(elementwise="compiled", backward=backward, dtype=dtype,
                 **COMPILED_CASES[case]))


def test_compiled_forward_kl_runs_its_kernels_and_keeps_no_block_temporaries(monkeypatch):
    """The compiled kind does run (its two kernels, every block) and asks for no ``[rows, V]``
    scratch beyond the two logit buffers (the eager forward KL takes ``e_t``)."""
    from megatron_kd.loss import compiled

    calls = []
    for name in ("forward_kl_sums", "forward_kl_grad_"):
        real = getattr(compiled, name)
        monkeypatch.setattr(compiled, name,
                            lambda *a, _r=real, _n=name: calls.append(_n) or _r(*a))
    names = _scratch_names(monkeypatch)
    single_case(spec(elementwise="compiled", window_size=4, s=5, b=3,  # 15 rows: 4 windows
                 cpu_tuning=ONE_GEMM))
    assert calls.count("forward_kl_sums") == 4 and calls.count("forward_kl_grad_") == 4
    assert names == {"z_s", "z_t"}


@pytest.mark.parametrize("teacher", ["renormalize", None])
def test_compiled_needs_a_dense_teacher(teacher):
    sp = spec(elementwise="compiled", teacher=teacher or "none", ce_weight=0.5,
              kd_weight=1.0 if teacher else 0.0)
    inp = make_inputs(sp)
    with pytest.raises(ValueError, match="elementwise='compiled' needs a dense teacher"):
        run_ours(sp, inp, [sp["padded_vocab"]], 0, None)
