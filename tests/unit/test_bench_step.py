"""``tools/bench_step.py``'s numbers that need no run: the planner's prediction for each row at
the seed's sizes against an account of the same run derived by hand, and the FLOP count. The
benchmark itself runs end to end on the CPU in ``tests/e2e/test_tools_smoke.py``."""

import argparse
import importlib.util
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOLS = os.path.join(ROOT, "tools")
GIB = 2**30

# --- the seed's models, counted by hand -----------------------------------------------------
# Llama-3.2-3B: 28 layers, h 3072, 24 heads of 128, 8 key/value groups, FFN 8192, V 128,256,
# tied embeddings. A layer: q and o 3072 x 3072 each, k and v 3072 x 1024 each, the SwiGLU MLP
# 3 x 3072 x 8192, two RMSNorm weights of 3072.
V, S = 128_256, 8192
H_S, L_S = 3072, 28
LAYER_S = 2 * H_S * H_S + 2 * H_S * 1024 + 3 * H_S * 8192 + 2 * H_S  # 100,669,440
N_S = V * H_S + L_S * LAYER_S + H_S  # embedding (= output layer) + layers + final norm
# Llama-3.1-8B: 32 layers, h 4096, 32 heads of 128, 8 groups, FFN 14,336, untied.
H_T, L_T = 4096, 32
LAYER_T = 2 * H_T * H_T + 2 * H_T * 1024 + 3 * H_T * 14_336 + 2 * H_T  # 218,112,000
N_T = 2 * V * H_T + L_T * LAYER_T + H_T
# Activations saved a token a layer, bf16, flash attention, no recompute or dropout: the two
# norms' inputs and outputs (4 x 2h), q (2h), k and v (2 x 2 x 1024), the attention output
# (2h, the output projection's input), the MLP's fc1 output (2 x 2 x 8192, SwiGLU's input) and
# SwiGLU's output (2 x 8192, fc2's input).
ACT_TOKEN_LAYER = 4 * 2 * H_S + 2 * H_S + 2 * 2 * 1024 + 2 * H_S + 2 * 2 * 8192 + 2 * 8192


def _module():
    if "bench_step" not in sys.modules:
        sys.path.insert(0, TOOLS)
        spec = importlib.util.spec_from_file_location("bench_step",
                                                      os.path.join(TOOLS, "bench_step.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules["bench_step"] = module
        spec.loader.exec_module(module)
    return sys.modules["bench_step"]


@pytest.fixture(scope="module")
def predicted():
    bs = _module()
    size = bs.SIZES["seed"]
    a = argparse.Namespace(device="cuda", seq=size["seq"], global_batch=size["global_batch"],
                           topk=size["topk"], teacher_dtype="bf16", rows=list(bs.ROW_NAMES))
    return bs.predict_rows(a, size["student"](), size["teacher"]())


def test_the_hand_count_is_the_published_size():
    assert LAYER_S == 100_669_440 and N_S == 3_212_749_824  # Llama-3.2-3B: 3.21B
    assert N_T == 8_030_261_248  # Llama-3.1-8B: 8.03B
    assert ACT_TOKEN_LAYER == 90_112


def test_static_terms_equal_the_hand_account(predicted):
    for row, terms in predicted.items():
        # bf16 weights, fp32 main_grad, Megatron's mixed-precision Adam: fp32 master + 2 moments
        assert terms["student weights"] == 2 * N_S, row
        assert terms["student grads (main_grad)"] == 4 * N_S, row
        assert terms["optimizer (Adam)"] == 12 * N_S, row
        assert terms.get("teacher weights", 0) == (2 * N_T if row.startswith("online") else 0)


def test_activations_within_a_percent_of_the_hand_account(predicted):
    hand = L_S * S * ACT_TOKEN_LAYER  # 19.25 GiB
    for row, terms in predicted.items():
        assert terms["activations"] == pytest.approx(hand, rel=0.01), row


def test_loss_terms_equal_the_hand_account(predicted):
    # the dense baseline (--kd-loss-path dense): 28 bytes a token and vocabulary column with a
    # dense teacher (both models' logits, fp32 copies and log-probabilities, the KL's saved
    # products: counted on the implementation in test_dense_loss.py), 12 with the cache's top-K
    # (the student's alone) and the K ids and log-probs (12 bytes an entry)
    assert predicted["online_dense"]["loss: dense logits"] == S * 28 * V  # 27.4 GiB
    assert predicted["offline_dense"]["loss: dense logits"] == S * (12 * V + 12 * 100)
    for row in ("online_fused", "offline_fused", "student_ce"):
        terms = predicted[row]
        # the GPU path: one window of at most 1 GiB of bf16 logits; the weight gradient's fp32
        # V x h accumulator and the hidden states' bf16 gradient
        assert 0.9 * GIB <= terms["loss: window buffers"] <= GIB, row
        assert terms["loss: grad accumulators"] == 4 * V * H_S + 2 * S * H_S, row
        assert "loss: dense logits" not in terms


def test_totals_and_the_issue_s_memory_goal_in_planner_terms(predicted):
    hand_static = 18 * N_S
    for row, terms in predicted.items():
        extra = 2 * N_T if row.startswith("online") else 0
        assert sum(terms.values()) > hand_static + extra + L_S * S * ACT_TOKEN_LAYER, row
    saved = {}
    for mode in ("online", "offline"):
        dense, fused = predicted[f"{mode}_dense"], predicted[f"{mode}_fused"]
        saved[mode] = (sum(dense.values()) - sum(fused.values())) / dense["loss: dense logits"]
    # the goal: the fused peak lower by at least 80% of what the dense loss's logits take. Met
    # online (student and teacher, 27.4 GiB); offline the student's logits alone take 11.7 GiB
    # and the fused loss's own 2.5 GiB (a 1 GiB window, the fp32 V x h weight-gradient
    # accumulator of 1.47 GiB: the lever of the loss's memory issue) leave 79%
    # (docs/benchmarks.md, "Whole training steps")
    assert saved["online"] == pytest.approx(0.908, abs=0.001)
    assert saved["offline"] == pytest.approx(0.792, abs=0.002)
    accumulator = 4 * V * H_S
    fused = predicted["offline_fused"]
    assert (sum(predicted["offline_dense"].values()) - sum(fused.values()) + accumulator) \
        >= 0.8 * predicted["offline_dense"]["loss: dense logits"]


def test_step_flops_are_the_hand_count():
    bs = _module()
    size = bs.SIZES["seed"]
    student, teacher = size["student"](), size["teacher"]()
    n_layers_s = L_S * (LAYER_S - 2 * H_S)  # matmul weights only
    n_layers_t = L_T * (LAYER_T - 2 * H_T)
    attention_s = L_S * 0.5 * 4 * S * S * H_S  # causal half of 4 s^2 (heads x 128) a layer
    attention_t = L_T * 0.5 * 4 * S * S * H_T
    student_hand = 6 * n_layers_s * S + 3 * attention_s + 6 * S * V * H_S
    teacher_hand = 2 * n_layers_t * S + attention_t + 2 * S * V * H_T
    online = bs.step_flops(student, teacher, S, 8)
    assert online["student"] == pytest.approx(8 * student_hand, rel=1e-12)
    assert online["teacher"] == pytest.approx(8 * teacher_hand, rel=1e-12)
    offline = bs.step_flops(student, None, S, 8)
    assert offline["teacher"] == 0 and offline["total"] == online["student"]
    # Multiverse's rows share one FLOP count (s/iteration x TFLOP/s is 6.1 PFLOP in each): the
    # student's, at about 32 sequences of 8K; ours counts the teacher where it runs
    assert 25.9 * 237 == pytest.approx(18.5 * 331, rel=0.01) == pytest.approx(20.2 * 304,
                                                                                rel=0.01)
    assert 6.1e15 / (student_hand) == pytest.approx(32, rel=0.03)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_a_gpu_is_refused_by_name():
    r = subprocess.run([sys.executable, os.path.join(TOOLS, "bench_step.py"), "--device", "cuda",
                        "--out", os.devnull], capture_output=True, text=True, timeout=120,
                       check=False)
    assert r.returncode == 2 and "--device cuda: CUDA is not available" in r.stderr, r.stderr
