"""Windowed top-K log-probs on a GPU against the dense float64 reference (skipped without one)."""


import numpy as np
from support.topk_cases import VOCAB, reference_topk, topk_problem

from megatron_kd.cache.topk import vocab_parallel_topk_logprobs


def test_single_rank_cuda_matches_dense():
    hidden, weight = topk_problem(VOCAB + 7)
    ids, logprobs = vocab_parallel_topk_logprobs(hidden.cuda(), weight.cuda(), 13,
                                                 vocab_size=VOCAB, window_size=4)
    ref_ids, ref_lp = reference_topk(hidden, weight, VOCAB, 13)
    np.testing.assert_array_equal(ids.reshape(-1, 13).cpu().numpy(), ref_ids)
    # cuBLAS fp32 (TF32 off by default) sums in another order than the float64 reference.
    np.testing.assert_allclose(logprobs.reshape(-1, 13).cpu().numpy(), ref_lp, rtol=0,
                               atol=1e-4)
