"""The dense float64 top-K reference and random problems for the top-K tests."""

import numpy as np
import torch

VOCAB = 1009
HIDDEN = 24


def reference_topk(hidden, weight, vocab_size, k):
    """Dense top-K: float64 logits over the true vocabulary, ties to the lower id (numpy)."""
    logits = hidden.reshape(-1, hidden.shape[-1]).double() @ weight[:vocab_size].double().t()
    logprobs = torch.log_softmax(logits, dim=-1).numpy()
    ids = np.empty((logprobs.shape[0], k), dtype=np.int64)
    for row in range(logprobs.shape[0]):
        # lexsort: last key is primary -> by log-prob descending, then id ascending.
        order = np.lexsort((np.arange(vocab_size), -logprobs[row]))[:k]
        ids[row] = order
    return ids, np.take_along_axis(logprobs, ids, 1)


def topk_problem(padded_vocab, seed=0, rows=(7, 3)):
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(padded_vocab, HIDDEN, generator=g)
    weight[VOCAB - 30:VOCAB] *= 2.5  # ids near the top of the range win often
    weight[VOCAB:] *= 20.0  # padding columns would dominate if they were not excluded
    hidden = torch.randn(*rows, HIDDEN, generator=g)
    hidden[2, 1] = 0.0  # all logits equal: ids 0..k-1 by the tie rule, log-prob -log(V)
    return hidden, weight
