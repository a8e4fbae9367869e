"""What a training loop needs to distil from a top-K cache (``--kd-mode offline``).

* :func:`dataset_identity` / :func:`tokenizer_identity` -- the values a cache records at build
  time and a run must match (the build and the trainer call the same functions).
* :func:`open_cache_for_run` -- opens a complete cache and refuses one that does not match the
  run (``ValueError`` naming both values; never a silent fallback to an LM-only loss).
* :func:`topk_batch` -- one micro-batch as torch tensors in Megatron's ``[s, b, K]`` layout,
  ready for ``vocab_parallel_kd_loss(teacher_topk_ids=..., teacher_topk_logprobs=...)``.
* :class:`TopKPrefetcher` -- the same for a whole run's micro-batches, decoded ahead on a
  background thread (what ``megatron-kd train --kd-mode offline`` uses on its last stage).

The cache is keyed by dataset sample index: a run reads the indices it trains on, whatever its
micro-batch, data-parallel or tensor-parallel sizes.
"""

from __future__ import annotations

import collections
import hashlib
import json
import os
import time
from collections.abc import Iterable, Sequence

from megatron_kd.cache.format import (
    PrefetchingLoader,
    TopKCacheReader,
    check_compatible,
)


def dataset_identity(dataset) -> str:
    """A dataset's identity hash: Megatron's ``unique_description_hash`` for a ``GPTDataset``;
    for a synthetic dataset, a hash of its parameters."""
    value = getattr(dataset, "unique_description_hash", None)
    if value is not None:
        return value.hex() if isinstance(value, bytes) else str(value)
    params = {"class": type(dataset).__name__}
    for name in ("vocab_size", "seq_length", "num_samples", "seed"):
        if not hasattr(dataset, name):
            raise ValueError(f"cannot identify dataset {type(dataset).__name__}: no "
                             f"unique_description_hash and no {name!r}")
        params[name] = getattr(dataset, name)
    return hashlib.sha256(json.dumps(params, sort_keys=True).encode()).hexdigest()


def tokenizer_identity(tokenizer) -> str:
    """A tokenizer's identity string: its Megatron ``unique_identifiers`` as JSON."""
    ids = getattr(tokenizer, "unique_identifiers", None)
    if ids is None:
        raise ValueError(f"cannot identify tokenizer {type(tokenizer).__name__}: no "
                         f"unique_identifiers")
    return json.dumps(dict(ids), sort_keys=True)


def open_cache_for_run(cache_dir: str | os.PathLike, *, dataset, tokenizer, seq_length: int,
                       vocab_size: int, num_samples: int | None = None,
                       topk: int | None = None) -> TopKCacheReader:
    """A reader for ``cache_dir`` after checking it belongs to this run.

    ``num_samples``: the samples the run will read (``train_iters x global_batch_size``); the
    cache must hold at least that many. Raises ``ValueError`` naming the cache's value and the
    run's for every mismatch.
    """
    reader = TopKCacheReader(cache_dir)
    check_compatible(reader, dataset_hash=dataset_identity(dataset), seq_length=seq_length,
                     vocab_size=vocab_size, tokenizer=tokenizer_identity(tokenizer), topk=topk)
    if num_samples is not None and reader.spec.num_samples < num_samples:
        raise ValueError(f"top-K cache does not match this run: num_samples: cache has "
                         f"{reader.spec.num_samples}, this run reads {num_samples}")
    return reader


def topk_batch(reader: TopKCacheReader, sample_indices: Sequence[int], device=None):
    """``(ids [s, b, K] int64, logprobs [s, b, K] float32)`` torch tensors for these samples."""
    ids, logprobs = reader.get(sample_indices)
    return as_sbk(ids, logprobs, device)


def as_sbk(ids, logprobs, device=None):
    """numpy ``[b, s, K]`` (what the reader and the prefetching loader give) -> torch
    ``[s, b, K]`` contiguous tensors on ``device``."""
    import torch

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
    A background :class:`~megatron_kd.cache.format.PrefetchingLoader` decodes up to ``depth``
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

    def close(self) -> None:
        """Stop the decoder thread (idempotent)."""
        self._loader.close()
