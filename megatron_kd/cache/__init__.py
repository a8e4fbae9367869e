"""Offline top-K teacher cache: build it once, train with no teacher in memory.

* :mod:`~megatron_kd.cache.topk` -- vocab-parallel windowed top-K log-probs (torch).
* :mod:`~megatron_kd.cache.codec` -- compact per-sample encoding (numpy).
* :mod:`~megatron_kd.cache.format` -- manifest, shard layout, atomic writes, verify (numpy).
* :mod:`~megatron_kd.cache.writer` / :mod:`~megatron_kd.cache.reader` -- writing and
  memory-mapped reading of shards (numpy).
* :mod:`~megatron_kd.cache.build` -- ``build_cache`` from any teacher's hidden states (torch).
* :mod:`~megatron_kd.cache.identity` -- what ties a cache to a run (dataset, tokenizer).
* :mod:`~megatron_kd.cache.loader` -- a run's micro-batches as ``[s, b, K]`` torch tensors,
  decoded ahead.
* :mod:`~megatron_kd.cache.lookup` -- a microbatch's rows found by its tokens' fingerprints
  (a run that knows no sample indices: Megatron-LM's ``pretrain_gpt.py``).

The ``megatron-kd cache`` command lives with the trainer
(:mod:`megatron_kd.commands.cache`; its build in
:mod:`megatron_kd.commands.cache_build`): building runs the teacher through Megatron-Core.
This package's ``__init__`` imports only the numpy side.
"""

from megatron_kd.cache.codec import LogprobCodec
from megatron_kd.cache.format import (
    FORMAT_VERSION,
    CacheFormatError,
    CacheSpec,
    check_compatible,
    load_manifest,
    verify,
)
from megatron_kd.cache.reader import PrefetchingLoader, TopKCacheReader
from megatron_kd.cache.writer import CacheWriter

__all__ = [
    "FORMAT_VERSION",
    "CacheFormatError",
    "CacheSpec",
    "CacheWriter",
    "LogprobCodec",
    "PrefetchingLoader",
    "TopKCacheReader",
    "check_compatible",
    "load_manifest",
    "verify",
]
