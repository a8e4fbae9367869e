"""A top-K cache's rows found by their samples' tokens, for a run that does not know its sample
indices (Megatron-LM's ``pretrain_gpt.py``: its data iterator gives token ids, not indices).

Every sample of a cache carries the fingerprint of the token ids its teacher values were
computed on (:func:`~megatron_kd.cache.format.token_fingerprint`, format version 2). A
:class:`TokenLookup` maps fingerprints to sample indices once, then finds each microbatch's rows
by fingerprinting its tokens: whatever the run's data-parallel, context-parallel or pipeline
layout, micro-batch size or sample order, a row is used only if its tokens are the
microbatch's. A sample the cache does not hold is a ``ValueError`` naming the sample and the
cache (never a silent fallback to the student's cross-entropy).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import torch

from megatron_kd.cache.format import CacheCorruptionError, token_fingerprint
from megatron_kd.cache.loader import topk_batch
from megatron_kd.cache.reader import TopKCacheReader

__all__ = ["TokenLookup"]

_PREVIEW = 8
"""Token ids a refusal quotes."""


class TokenLookup:
    """Rows of ``reader`` by token fingerprint: every shard's fingerprint table read once
    (``8 x samples`` bytes), sorted (``16`` bytes of memory a sample), searched per row.
    Samples with equal tokens are one entry, the first (their teacher values are the same
    function of the same tokens)."""

    def __init__(self, reader: TopKCacheReader, directory: str) -> None:
        self.reader, self.directory = reader, directory
        fingerprints = reader.fingerprints()
        self._order = np.argsort(fingerprints, kind="stable")  # equal ones: the first index
        self._sorted = fingerprints[self._order]
        self.wait_s = 0.0  # seconds spent reading and decoding rows
        self.decoded_tokens = 0

    def rows(self, tokens: torch.Tensor, describe: Callable[[int], str]) -> list[tuple[int, int]]:
        """``[(sample index, fingerprint)]`` of each row of ``tokens [b, s]`` (whole
        sequences). ``describe(b)`` names row ``b`` of the run's microbatch in a refusal."""
        spec = self.reader.spec
        host = tokens.detach().to("cpu", torch.int64).numpy()
        if host.ndim != 2 or host.shape[1] != spec.seq_length:
            raise ValueError(f"{describe(0)}: tokens {list(host.shape)} are not [b, "
                             f"{spec.seq_length}] (the top-K cache {self.directory}'s "
                             f"sequence length)")
        found = []
        for b, row in enumerate(host):
            fingerprint = token_fingerprint(row)
            index = self._find(fingerprint)
            if index is None:
                preview = ", ".join(map(str, row[:_PREVIEW].tolist()))
                raise ValueError(
                    f"{describe(b)}: the top-K cache {self.directory} holds no sample with its "
                    f"tokens [{preview}, ...] (fingerprint {fingerprint:016x}): the cache was "
                    f"built for other data (its dataset {spec.dataset_hash}, "
                    f"{spec.num_samples} samples); build it with `megatron-kd cache build` and "
                    f"this run's data flags (--data-path or --mock-data, --split, --seq-length, "
                    f"--seed, --train-iters, --global-batch-size). No optimizer step was taken "
                    f"with this microbatch")
            found.append((index, fingerprint))
        return found

    def _find(self, fingerprint: int) -> int | None:
        """The first sample index holding ``fingerprint``, or None."""
        at = int(np.searchsorted(self._sorted, np.uint64(fingerprint)))
        if at < len(self._sorted) and int(self._sorted[at]) == fingerprint:
            return int(self._order[at])
        return None

    def read(self, rows: list[tuple[int, int]], device=None):
        """``(ids [s, b, K] int64, logprobs [s, b, K] float32)`` of ``rows``; each row's
        fingerprint read again from its checked shard (the lookup read the tables unchecked)."""
        t0 = time.perf_counter()
        for index, fingerprint in rows:
            held = self.reader.fingerprint(index)  # after the shard's sha256 check
            if held != fingerprint:
                raise CacheCorruptionError(
                    f"{self.directory}: sample {index}'s fingerprint changed from "
                    f"{fingerprint:016x} to {held:016x} once its shard was checked (the shard "
                    f"file changed); run "
                    f"`megatron-kd cache verify {self.directory}`")
        ids, logprobs = topk_batch(self.reader, [index for index, _ in rows], device)
        self.wait_s += time.perf_counter() - t0
        self.decoded_tokens += int(np.prod(ids.shape[:2]))
        return ids, logprobs

    def rates(self) -> tuple[float, int, float]:
        """``(seconds waited, tokens decoded, seconds decoding)``: read in step, so the wait is
        the decoding."""
        return self.wait_s, self.decoded_tokens, self.wait_s
