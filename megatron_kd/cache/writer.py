"""Writing a top-K cache: shards and manifest, atomically, by any number of builders at once."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Sequence

import numpy as np

from megatron_kd.cache.codec import encode_sample
from megatron_kd.cache.format import (
    MANIFEST_NAME,
    CacheSpec,
    atomic_write,
    encode_shard,
    load_manifest,
    locked,
    manifest_bytes,
    spec_differences,
)

__all__ = ["CacheWriter"]


class CacheWriter:
    """Writes shards of one cache; safe to run from several processes owning different shards."""

    def __init__(self, cache_dir: str | os.PathLike, spec: CacheSpec):
        self.dir = Path(cache_dir)
        self.spec = spec
        self.dir.mkdir(parents=True, exist_ok=True)
        with locked(self.dir):
            for stale in self.dir.glob(f".{MANIFEST_NAME}.tmp.*"):
                stale.unlink(missing_ok=True)  # a killed manifest write (only made under the lock)
            path = self.dir / MANIFEST_NAME
            if path.exists():
                existing = CacheSpec.from_json(load_manifest(self.dir))
                diffs = spec_differences(existing, spec)
                if diffs:
                    raise ValueError(f"{self.dir} already holds a cache of another spec "
                                     f"(existing != requested): {'; '.join(diffs)}")
            else:
                atomic_write(path, manifest_bytes(self._manifest([])))

    def _manifest(self, shards: list[dict]) -> dict:
        shards = sorted(shards, key=lambda s: s["sample_start"])
        return {**self.spec.to_json(), "shards": shards,
                "complete": len(shards) == self.spec.num_shards}

    def completed(self) -> set[int]:
        """Shards listed in the manifest whose file is present with the listed size."""
        done = set()
        for entry in load_manifest(self.dir)["shards"]:
            path = self.dir / entry["file"]
            if path.is_file() and path.stat().st_size == entry["bytes"]:
                done.add(entry["sample_start"] // self.spec.samples_per_shard)
        return done

    def encode(self, ids: np.ndarray, logprobs: np.ndarray) -> bytes:
        """One sample's blob from ``ids, logprobs [seq_length, K]``."""
        expected = (self.spec.seq_length, self.spec.topk)
        if ids.shape != expected or logprobs.shape != expected:
            raise ValueError(f"a sample must be [seq_length, K] = {list(expected)}, got ids "
                             f"{list(ids.shape)} and logprobs {list(logprobs.shape)}")
        return encode_sample(ids, logprobs, self.spec.vocab_size, self.spec.logprob_codec)

    def write_shard(self, index: int, blobs: Sequence[bytes], fingerprints: Sequence[int]) -> dict:
        """Write shard ``index`` (its samples' blobs and token fingerprints, see
        :func:`~megatron_kd.cache.format.token_fingerprint`) atomically, then record it in the
        manifest (atomically)."""
        data = encode_shard(self.spec, index, blobs, fingerprints)
        name = self.spec.shard_file(index)
        for stale in self.dir.glob(f".{name}.tmp.*"):
            stale.unlink(missing_ok=True)  # left by a killed build of this shard
        atomic_write(self.dir / name, data)
        start, end = self.spec.shard_range(index)
        entry = {"file": name, "sample_start": start, "sample_end": end, "bytes": len(data),
                 "sha256": hashlib.sha256(data).hexdigest()}
        with locked(self.dir):
            shards = [s for s in load_manifest(self.dir)["shards"] if s["file"] != name]
            atomic_write(self.dir / MANIFEST_NAME, manifest_bytes(self._manifest(shards + [entry])))
        return entry
