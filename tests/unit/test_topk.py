"""Windowed top-K log-probs in one process against a dense float64 reference: the local maths,
ties, flat rows, bad input, a bf16 teacher."""

import math

import numpy as np
import pytest
import torch
from support.topk_cases import HIDDEN, VOCAB, reference_topk, topk_problem

from megatron_kd.cache.topk import TopKHelper, vocab_parallel_topk_logprobs


def test_local_topk_ties_lower_column_wins():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0, 3.0],
                           [2.0, 2.0, 2.0, 2.0, 2.0, 2.0]])
    values, columns = TopKHelper.local_topk(logits, 3)
    assert columns.tolist() == [[1, 2, 4], [0, 1, 2]]
    assert values.tolist() == [[3.0, 3.0, 3.0], [2.0, 2.0, 2.0]]
    # Merge: (value desc, id asc), whatever the candidates' order.
    v, i = TopKHelper.merge(torch.tensor([[1.0, 5.0, 5.0, 7.0]]), torch.tensor([[0, 9, 4, 8]]), 3)
    assert i.tolist() == [[8, 4, 9]] and v.tolist() == [[7.0, 5.0, 5.0]]


@pytest.mark.parametrize("window_size", [1, 4, 1000])
@pytest.mark.parametrize("k", [1, 13, VOCAB])
def test_single_rank_matches_dense(window_size, k):
    hidden, weight = topk_problem(VOCAB + 7)
    ids, logprobs = vocab_parallel_topk_logprobs(hidden, weight, k, vocab_size=VOCAB,
                                                 window_size=window_size)
    assert ids.shape == (7, 3, k) and ids.dtype == torch.int64 and logprobs.dtype == torch.float32
    ref_ids, ref_lp = reference_topk(hidden, weight, VOCAB, k)
    np.testing.assert_array_equal(ids.reshape(-1, k).numpy(), ref_ids)
    # fp32 logits and log-sum-exp against float64: a few ulps of |logprob| <= ~20.
    np.testing.assert_allclose(logprobs.reshape(-1, k).numpy(), ref_lp, rtol=0, atol=2e-5)
    assert ids[2, 1].tolist() == list(range(k))
    np.testing.assert_allclose(logprobs[2, 1].numpy(), -math.log(VOCAB), rtol=1e-6)


def test_flat_rows_and_bad_input():
    hidden, weight = topk_problem(VOCAB)
    ids, _ = vocab_parallel_topk_logprobs(hidden.reshape(21, HIDDEN), weight, 5)
    assert ids.shape == (21, 5)
    with pytest.raises(ValueError, match=r"k=1010 must lie in \[1, vocab_size=1009\]"):
        vocab_parallel_topk_logprobs(hidden, weight, VOCAB + 1)
    with pytest.raises(ValueError, match=r"vocab_size=2000 must lie in \[1, 1009\]"):
        vocab_parallel_topk_logprobs(hidden, weight, 5, vocab_size=2000)
    with pytest.raises(ValueError, match=r"weight must be \[local_vocab_size, 24\]"):
        vocab_parallel_topk_logprobs(hidden, weight[:, :5], 5)


def test_teacher_dtype_bf16_runs_projection_in_bf16():
    hidden, weight = topk_problem(VOCAB)
    hidden_bf16, weight_bf16 = hidden.bfloat16(), weight.bfloat16()
    ids, logprobs = vocab_parallel_topk_logprobs(hidden_bf16, weight_bf16, 10, window_size=8)
    assert logprobs.dtype == torch.float32
    # The float64 reference on the same bf16-rounded inputs: the same K ids in every row (near
    # ties may swap places within a row), so the same top-K mass.
    ref_ids, _ = reference_topk(hidden_bf16.float(), weight_bf16.float(), VOCAB, 10)
    ours = ids.reshape(-1, 10).numpy()
    np.testing.assert_array_equal(np.sort(ours, -1), np.sort(ref_ids, -1))
    # Log-probs of the chosen ids against their float64 values: the projection's products are
    # rounded to bf16 (2^-9 relative of logits up to 44: 0.086 each, the log-sum-exp moving
    # with them); measured 0.165, and a wrong id or an off-by-one shard is O(1) off.
    full = torch.log_softmax(hidden_bf16.double().reshape(-1, HIDDEN)
                             @ weight_bf16.double()[:VOCAB].t(), dim=-1).numpy()
    np.testing.assert_allclose(logprobs.reshape(-1, 10).numpy(),
                               np.take_along_axis(full, ours, 1), rtol=0, atol=0.25)
