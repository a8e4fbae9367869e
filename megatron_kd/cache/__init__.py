"""Offline top-K teacher cache: build it once, train with no teacher in memory.

* :mod:`megatron_kd.cache.topk` -- vocab-parallel windowed top-K log-probs (torch).
* :mod:`megatron_kd.cache.codec` -- compact per-sample encoding (numpy).
* :mod:`megatron_kd.cache.format` -- manifest, shards, atomic writer, reader, verify (numpy).
* :mod:`megatron_kd.cache.build` -- ``build_cache`` from any teacher's hidden states (torch).
* :mod:`megatron_kd.cache.cli` -- ``megatron-kd cache build | verify | info``.

The reading side imports no torch, so this package's ``__init__`` imports nothing heavy.
"""

from megatron_kd.cache.codec import LogprobCodec
from megatron_kd.cache.format import (
    FORMAT_VERSION,
    CacheFormatError,
    CacheSpec,
    CacheWriter,
    PrefetchingLoader,
    TopKCacheReader,
    check_compatible,
    load_manifest,
    verify,
)

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
