"""Vocab-parallel, windowed top-K of a teacher's log-probs, without ever forming full logits.

Each tensor-parallel rank holds a contiguous shard ``[vocab_start, vocab_end)`` of the output
layer. For a window of rows, a rank projects the rows onto its shard, takes its local top-K
(lower id wins ties) and its local log-sum-exp pieces; the ranks then exchange only K candidates
per row and one partial sum per row, and every rank merges the same global top-K.

Communication per call: one ``all_gather`` of the local shard sizes; per window, one
``all_gather`` of ``[rows, K]`` candidate (value, id) pairs and one ``all_reduce`` (sum) of
``[rows]`` partial sums. The global max comes from the gathered candidates (each rank's top-1 is
its local max), so no separate max all-reduce is needed. Nothing is differentiated: this is for
building caches (``torch.no_grad`` inside).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_kd.collectives import all_gather_into
from megatron_kd.parallel.vocab import VocabShard, vocab_shard

# A rank whose shard holds fewer than K real columns pads its candidates with this id and -inf.
_PAD_ID = torch.iinfo(torch.int64).max


class TopKHelper:
    """The local and merge maths, no communication (so each piece is testable alone)."""

    @staticmethod
    def local_topk(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-``k`` of each row of ``logits [rows, n]`` with ties broken by lower column.

        Returns ``(values [rows, k], columns [rows, k])`` ordered by (value desc, column asc).
        ``torch.topk`` does not specify which of several equal values it keeps, so the
        threshold (the k-th largest value) is found with it and the selection is then rebuilt:
        every column above the threshold, plus the lowest columns equal to it.
        """
        rows, n = logits.shape
        if k > n:
            raise ValueError(f"k={k} is larger than the {n} columns")
        values, columns = torch.topk(logits, k, dim=1, sorted=True)
        threshold = values[:, -1:]
        # The set is unique unless more than k columns reach the k-th value (a tie across it).
        ambiguous = (logits >= threshold).sum(dim=1) > k
        if bool(ambiguous.any()):
            sub, sub_threshold = logits[ambiguous], threshold[ambiguous]
            above = sub > sub_threshold
            equal = sub == sub_threshold
            need = k - above.sum(dim=1, keepdim=True)
            keep = above | (equal & (torch.cumsum(equal, dim=1) <= need))
            # Exactly k True per row; nonzero walks rows in order and columns ascending.
            fixed = keep.nonzero()[:, 1].view(-1, k)
            columns = columns.clone()
            columns[ambiguous] = fixed
            values = torch.gather(logits, 1, columns)
        return TopKHelper.sort_desc(values, columns)

    @staticmethod
    def sort_desc(values: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Order each row by (value desc, id asc): stable sort by id, then stable by value."""
        by_id = torch.sort(ids, dim=-1, stable=True)
        values = torch.gather(values, -1, by_id.indices)
        by_value = torch.sort(values, dim=-1, descending=True, stable=True)
        return by_value.values, torch.gather(by_id.values, -1, by_value.indices)

    @staticmethod
    def merge(values: torch.Tensor, ids: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Global top-``k`` from candidates ``[rows, m]`` (ties: lower id wins)."""
        values, ids = TopKHelper.sort_desc(values, ids)
        return values[:, :k], ids[:, :k]


def _shard_sizes(local_vocab_size: int, tp_group, device) -> list[int]:
    """Every TP rank's shard size, in rank order (one all-gather on the group's device)."""
    tp_world_size = dist.get_world_size(tp_group) if tp_group is not None else 1
    if tp_world_size == 1:
        return [local_vocab_size]
    mine = torch.tensor([local_vocab_size], dtype=torch.int64, device=device)
    sizes = torch.empty(tp_world_size, dtype=torch.int64, device=device)
    # Shards may differ in size (a vocabulary that does not divide): every rank needs all sizes.
    all_gather_into(sizes, mine, group=tp_group)
    return sizes.tolist()


@torch.no_grad()
def vocab_parallel_topk_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    k: int,
    *,
    vocab_size: int | None = None,
    window_size: int = 1024,
    tp_group=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher top-K global ids and log-probs, vocab-parallel and windowed.

    Args:
        hidden: ``[s, b, h]`` or ``[n, h]`` final hidden states (the same on every TP rank).
        weight: ``[local_vocab_size, h]`` this rank's contiguous shard of the output layer
            (rank ``tp_rank`` holds ``[vocab_start, vocab_end)``; shards may differ in size).
        k: entries per row; ``1 <= k <= vocab_size``.
        vocab_size: the true (global) vocabulary; columns at or above it are padding and
            never selected nor counted in the log-sum-exp. Default: the padded total.
        window_size: at most this many rows are projected at a time (bounds the
            ``[window_size, local_vocab_size]`` logits).
        tp_group: the tensor-parallel group (None: a single rank).

    Returns:
        ``(ids, logprobs)``, each ``[s, b, k]`` or ``[n, k]``: global ids (int64) ordered by
        (log-prob desc, id asc), and ``log_softmax`` over the true vocabulary at temperature 1
        (float32). The leftover mass is ``1 - exp(logprobs).sum(-1)``.

    The projection runs in ``hidden``'s dtype (a bf16 teacher's logits are bf16, as in its
    own forward); everything after it in fp32.
    """
    if hidden.dim() not in (2, 3):
        raise ValueError(f"hidden must be [s, b, h] or [n, h], got shape {tuple(hidden.shape)}")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight must be [local_vocab_size, {hidden.shape[-1]}], "
                         f"got {tuple(weight.shape)}")
    if window_size < 1:
        raise ValueError(f"window_size must be >= 1, got {window_size}")
    lead_shape = hidden.shape[:-1]
    rows = hidden.reshape(-1, hidden.shape[-1])
    n = rows.shape[0]
    shard = _this_shard(weight.shape[0], vocab_size, k, tp_group, hidden.device)
    out_ids = torch.empty(n, k, dtype=torch.int64, device=hidden.device)
    out_logprobs = torch.empty(n, k, dtype=torch.float32, device=hidden.device)
    for lo in range(0, n, window_size):
        hi = min(n, lo + window_size)
        out_ids[lo:hi], out_logprobs[lo:hi] = _window_topk(rows[lo:hi], weight, k, shard,
                                                           tp_group)
    return out_ids.view(*lead_shape, k), out_logprobs.view(*lead_shape, k)


def _this_shard(local_vocab_size: int, vocab_size: int | None, k: int, tp_group,
                device) -> VocabShard:
    """This rank's shard of the vocabulary, ``vocab_size`` and ``k`` checked."""
    sizes = _shard_sizes(local_vocab_size, tp_group, device)
    tp_rank = dist.get_rank(tp_group) if tp_group is not None else 0
    padded_vocab_size = sum(sizes)
    if vocab_size is None:
        vocab_size = padded_vocab_size
    if not 1 <= vocab_size <= padded_vocab_size:
        raise ValueError(f"vocab_size={vocab_size} must lie in [1, {padded_vocab_size}] "
                         f"(the sum of the shards)")
    if not 1 <= k <= vocab_size:
        raise ValueError(f"k={k} must lie in [1, vocab_size={vocab_size}]")
    return vocab_shard(sizes, tp_rank, vocab_size)


def _window_topk(rows: torch.Tensor, weight: torch.Tensor, k: int, shard: VocabShard,
                 tp_group) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids, logprobs)`` ``[w, k]`` of one window of rows (the collectives of the window)."""
    w, device = rows.shape[0], rows.device
    local_valid = shard.local_valid  # real (non-padding) columns of this shard
    local_k = min(k, local_valid)
    tp_world_size = 1 if tp_group is None else dist.get_world_size(tp_group)
    cand_values = torch.full((w, k), float("-inf"), dtype=torch.float32, device=device)
    cand_ids = torch.full((w, k), _PAD_ID, dtype=torch.int64, device=device)
    if local_valid > 0:
        logits = torch.matmul(rows, weight[:local_valid].t()).float()  # [w, local_valid]
        values, columns = TopKHelper.local_topk(logits, local_k)
        cand_values[:, :local_k] = values
        cand_ids[:, :local_k] = columns + shard.vocab_start
    if tp_world_size > 1:
        # Only K candidates per row cross ranks; ids travel exactly as float64 (< 2**53).
        packed = torch.cat([cand_values.double(), cand_ids.double()], dim=1)
        packed[:, k:][cand_ids == _PAD_ID] = -1.0
        gathered = [torch.empty_like(packed) for _ in range(tp_world_size)]
        dist.all_gather(gathered, packed, group=tp_group)
        all_values = torch.cat([g[:, :k] for g in gathered], dim=1).float()
        all_ids = torch.cat([g[:, k:] for g in gathered], dim=1).long()
        all_ids[all_ids < 0] = _PAD_ID
        top_values, top_ids = TopKHelper.merge(all_values, all_ids, k)
    else:
        top_values, top_ids = cand_values, cand_ids
    # The global max is the best candidate (every rank's local max was among them).
    global_max = top_values[:, 0]
    if local_valid > 0:
        # sum_v exp(x_v - M) over this shard; padding columns were never projected.
        # (In place: these logits are this function's own window buffer.)
        local_sum = logits.sub_(global_max[:, None]).exp_().sum(dim=1)
    else:
        local_sum = torch.zeros(w, dtype=torch.float32, device=device)
    if tp_world_size > 1:
        # The log-sum-exp over the whole vocabulary needs every shard's partial sum.
        dist.all_reduce(local_sum, group=tp_group)
    lse = global_max + torch.log(local_sum)
    return top_ids, top_values - lse[:, None]
