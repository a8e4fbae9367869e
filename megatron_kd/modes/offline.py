"""``--kd-mode offline``: top-K teacher ids and log-probs decoded from a cache made by
``megatron-kd cache build`` (:mod:`megatron_kd.cache`): no teacher in memory.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

import torch

from megatron_kd.cache.loader import TopKPrefetcher
from megatron_kd.cache.lookup import TokenLookup
from megatron_kd.integration.groups import collective_device
from megatron_kd.loss import TopKTeacher
from megatron_kd.modes.source import (
    Microbatch,
    SourceConfig,
    StudentPlace,
    TeacherInputs,
    TeacherSource,
)
from megatron_kd.modes.stats import CacheStepStats

__all__ = ["Cached"]


class Cached(TeacherSource):
    """Top-K teacher ids and log-probs from a cache made by ``megatron-kd cache build``, read
    by dataset sample index (so any DP / TP / micro-batch layout reads the same cache),
    decoded ahead of training on a background thread of each active rank. With
    :attr:`SourceConfig.rows_by_tokens` (Megatron-LM's ``pretrain_gpt.py``, whose data iterator
    gives no sample indices): each
    microbatch's rows are found by its tokens' fingerprints and read in step
    (:class:`~megatron_kd.cache.lookup.TokenLookup`). Evaluation microbatches have no teacher
    (the cache holds the training samples only)."""

    timer = "teacher-wait"

    def __init__(self, reader, *, directory: str, depth: int, tail: str,
                 place: StudentPlace, config: SourceConfig,
                 device: torch.device | None) -> None:
        self.reader, self.directory, self.depth, self.tail = reader, directory, depth, tail
        self.place, self.config, self.device = place, config, device
        self.prefetcher: TopKPrefetcher | None = None
        self.lookup: TokenLookup | None = None
        self._waited = 0.0
        self.vocab_size = reader.spec.vocab_size if reader is not None else None  # its teacher's

    def start(self, schedule: Iterable[Microbatch]) -> None:
        if not self.place.active:
            return
        if self.config.rows_by_tokens:
            self.lookup = TokenLookup(self.reader, self.directory)
            return
        # Decoding threads compete with the CPU's own compute; on a GPU they are spare.
        threads = 1 if self.device is None else min(4, self.config.micro_batch_size)
        self.prefetcher = TopKPrefetcher(self.reader, (mb.sample_ids for mb in schedule),
                                         depth=self.depth, threads=threads, device=self.device)

    def _targets(self, mb: Microbatch) -> tuple[list[int], torch.Tensor, torch.Tensor]:
        """``(sample indices, ids [s, b, K], logprobs [s, b, K])`` of ``mb``."""
        if self.lookup is None:
            return list(mb.sample_ids), *self.prefetcher.next(mb.sample_ids)
        rows = self.lookup.rows(mb.token_ids(), lambda b: (
            f"sample {b} of microbatch {mb.index} of step {mb.step + 1} (counted from the "
            f"run's start) on data-parallel rank {self.place.dp_rank}"))
        return [index for index, _ in rows], *self.lookup.read(rows, self.device)

    def inputs(self, mb: Microbatch, *, training: bool) -> TeacherInputs:
        if not training:
            return TeacherInputs()
        try:
            samples, ids, logprobs = self._targets(mb)
        except FloatingPointError as e:  # decoded NaN / inf: named with the step here
            raise FloatingPointError(f"non-finite teacher values (NaN or inf) at step "
                                     f"{mb.step + 1}, microbatch {mb.index}: {e}; no optimizer "
                                     f"step was taken") from e
        if mb.positions is not None:  # a cache is per sequence: this rank's positions of it
            rows = mb.positions.to(ids.device)
            ids, logprobs = ids.index_select(0, rows), logprobs.index_select(0, rows)
        return TeacherInputs(teacher=TopKTeacher(ids=ids, logprobs=logprobs),
                             what=f"top-K log-probs of samples {samples} read from "
                                  f"the cache {self.directory}")

    def step_stats(self, group: Any) -> CacheStepStats:
        """This step's seconds waiting for decoded targets (mean over the ranks that read the
        cache) and the decoder's rate so far (tokens decoded over decoding seconds, over those
        ranks: it decodes ahead, so a step may decode nothing); one all-reduce over ``group``."""
        p = self.prefetcher if self.prefetcher is not None else self.lookup
        wait_s, tokens, decode_s = p.rates() if p is not None else (0.0, 0, 0.0)
        stats = CacheStepStats(wait_s=wait_s - self._waited, tokens=tokens, decode_s=decode_s,
                               readers=int(p is not None))
        self._waited = wait_s
        return stats.over_ranks(group, collective_device(group)) if group is not None else stats

    def summary(self) -> dict[str, Any]:
        return {**super().summary(),
                "topk_wait_s": self.prefetcher.wait_s if self.prefetcher is not None else None}

    def announcement(self) -> str:
        spec = self.reader.spec
        return (f"megatron-kd: offline teacher: top-{spec.topk} cache {self.directory} (teacher "
                f"{spec.teacher_checkpoint}, tail {self.tail})")

    def checkpoint_record(self) -> dict[str, Any]:
        # the cache's teacher, and the cache itself
        return {"teacher": self.reader.spec.teacher_checkpoint,
                "topk_cache": os.path.abspath(self.directory)}

    def close(self) -> None:
        if self.prefetcher is not None:
            self.prefetcher.close()
