"""Top-K teacher values for a training loop, as torch tensors in Megatron's ``[s, b, K]`` layout.

* :func:`topk_batch` -- one micro-batch's ``(ids, logprobs)``, ready for the loss's teacher
  record: ``vocab_parallel_kd_loss(..., TopKTeacher(ids=ids, logprobs=logprobs))``.
* :class:`TopKPrefetcher` -- a whole run's micro-batches, decoded ahead on a background thread
  (what ``megatron-kd train --kd-mode offline`` uses on its last pipeline stage).
"""

from __future__ import annotations

import collections
import time
from collections.abc import Iterable, Sequence

import torch

from megatron_kd.cache.reader import PrefetchingLoader, TopKCacheReader

__all__ = ["TopKPrefetcher", "as_sbk", "topk_batch"]


def topk_batch(reader: TopKCacheReader, sample_indices: Sequence[int], device=None):
    """``(ids [s, b, K] int64, logprobs [s, b, K] float32)`` torch tensors for these samples."""
    ids, logprobs = reader.get(sample_indices)
    return as_sbk(ids, logprobs, device)


def as_sbk(ids, logprobs, device=None):
    """numpy ``[b, s, K]`` (what the reader and the prefetching loader give) -> torch
    ``[s, b, K]`` contiguous tensors on ``device``."""
    ids_t = torch.from_numpy(ids).transpose(0, 1).contiguous()
    logprobs_t = torch.from_numpy(logprobs).transpose(0, 1).contiguous()
    if device is not None:
        ids_t = ids_t.to(device, non_blocking=True)
        logprobs_t = logprobs_t.to(device, non_blocking=True)
    return ids_t, logprobs_t


class TopKPrefetcher:
    """A run's micro-batches of top-K teacher values, decoded ahead of the trainer.

    ``schedule`` lists, in consumption order, the dataset sample indices of every micro-batch
    this rank will train on (e.g. all its micro-batches from the resume step to the last step).
    A background :class:`~megatron_kd.cache.reader.PrefetchingLoader` decodes up to ``depth``
    micro-batches ahead, so the next micro-batches (those of the next step, at the end of a
    step) are decoded while the current ones train.

    :meth:`next` takes the sample indices the trainer is about to use and raises
    ``RuntimeError`` if they are not the ones decoded next: a misaligned teacher is an error,
    never a silently wrong loss.
    """

    def __init__(self, reader: TopKCacheReader, schedule: Iterable[Sequence[int]], *,
                 depth: int = 2, threads: int = 1, device=None):
        self.device = device
        self.wait_s = 0.0  # seconds next() waited for the decoder (0 when it keeps ahead)
        self._pending: collections.deque = collections.deque()

        def tracked():
            for indices in schedule:
                indices = [int(i) for i in indices]
                self._pending.append(indices)  # before the loader decodes (and queues) them
                yield indices

        self._loader = PrefetchingLoader(reader, tracked(), depth=depth, threads=threads)

    def next(self, sample_indices: Sequence[int]):
        """``(ids [s, b, K] int64, logprobs [s, b, K] float32)`` torch tensors of these samples
        (which must be the next ones of the schedule)."""
        wanted = [int(i) for i in sample_indices]
        t0 = time.perf_counter()
        try:
            ids, logprobs = next(self._loader)
        except StopIteration:
            raise RuntimeError(f"top-K prefetcher: samples {wanted} asked for after the end of "
                               f"its schedule") from None
        self.wait_s += time.perf_counter() - t0
        decoded = self._pending.popleft()
        if decoded != wanted:
            raise RuntimeError(f"top-K prefetcher: the trainer asked for samples {wanted} but "
                               f"the next decoded micro-batch holds samples {decoded}")
        return as_sbk(ids, logprobs, self.device)

    def rates(self) -> tuple[float, int, float]:
        """``(seconds next() waited, tokens decoded, seconds decoding)`` so far."""
        return self.wait_s, self._loader.decoded_tokens, self._loader.decode_s

    def close(self) -> None:
        """Stop the decoder thread (idempotent)."""
        self._loader.close()
