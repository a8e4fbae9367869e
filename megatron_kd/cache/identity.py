"""What ties a top-K cache to a training run: the dataset's and the tokenizer's identities.

The build records :func:`dataset_identity` and :func:`tokenizer_identity`; a run calls
:func:`open_cache_for_run`, which refuses a cache made for other data, sequence length,
vocabulary, tokenizer or K (``ValueError`` naming both values; never a silent fallback to an
LM-only loss). The cache is keyed by dataset sample index: a run reads the indices it trains
on, whatever its micro-batch, data-parallel or tensor-parallel sizes.
"""

from __future__ import annotations

import hashlib
import json
import os

from megatron_kd.cache.format import check_compatible
from megatron_kd.cache.reader import TopKCacheReader

__all__ = ["dataset_identity", "open_cache_for_run", "tokenizer_identity"]


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
