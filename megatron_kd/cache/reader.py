"""Reading a top-K cache: memory-mapped shards, decoded per sample (numpy only, no torch)."""

from __future__ import annotations

import os
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import numpy as np

from megatron_kd.cache.codec import CodecError, NonFiniteLogprobsError, decode_sample
from megatron_kd.cache.format import (
    CacheCorruptionError,
    CacheFormatError,
    CacheSpec,
    fingerprint_table,
    load_manifest,
    parse_shard_header,
    sha256_of,
)

__all__ = ["NonFiniteTargetError", "PrefetchingLoader", "TopKCacheReader"]


class NonFiniteTargetError(CacheFormatError, FloatingPointError):
    """A cached teacher target that is NaN or inf (names the shard file and the sample)."""


class TopKCacheReader:
    """Random access by sample index; shards are memory-mapped on first use.

    ``get(sample_indices) -> (ids [b, s, K] int64, logprobs [b, s, K] float32)``; a token's
    entries are in ascending id order. ``torch.from_numpy`` turns them into tensors without a
    copy (transpose to ``[s, b, K]`` for Megatron's layout).

    Nothing is used before it is checked: the first time a shard is needed, its file must be
    there with the manifest's size and sha256 (:class:`CacheCorruptionError` naming the file,
    its samples and both values otherwise), its header must match the manifest, and every
    sample decodes only if it is well formed. Hashing a shard reads it once (sha256 runs at
    about a GB/s; a 128-sample shard of 4096-token rows at ~300 bytes a token is ~150 MB), a
    few percent of the decode time of the same shard.
    """

    def __init__(self, cache_dir: str | os.PathLike, *, require_complete: bool = True):
        self.dir = Path(cache_dir)
        self.manifest = load_manifest(self.dir)
        self.spec = CacheSpec.from_json(self.manifest)
        if require_complete and not self.manifest["complete"]:
            missing = self.spec.num_shards - len(self.manifest["shards"])
            raise CacheFormatError(f"{self.dir}: cache is incomplete ({missing} of "
                                   f"{self.spec.num_shards} shards not built)")
        self._entries = {s["sample_start"] // self.spec.samples_per_shard: s
                         for s in self.manifest["shards"]}
        self._maps: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return self.spec.num_samples

    def _shard(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        with self._lock:
            if index not in self._maps:
                self._maps[index] = self._open_shard(index)
            return self._maps[index]

    def _open_shard(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        """Map shard ``index`` after checking its size, sha256 and header against the manifest."""
        start, end = self.spec.shard_range(index)
        entry = self._entries.get(index)
        if entry is None:
            raise CacheFormatError(f"{self.dir}: samples [{start}, {end}) are not in the cache")
        path = self.dir / entry["file"]
        where = f"{path} (samples [{start}, {end}))"
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            raise CacheCorruptionError(f"{where}: shard file missing (the manifest lists it "
                                       f"with {entry['bytes']} bytes)") from None
        if size != entry["bytes"]:
            raise CacheCorruptionError(f"{where}: {size} bytes, manifest says {entry['bytes']} "
                                       f"(truncated or torn)")
        data = np.memmap(path, dtype=np.uint8, mode="r")
        digest = sha256_of(data)
        if digest != entry["sha256"]:
            raise CacheCorruptionError(f"{where}: sha256 mismatch (corrupted): manifest "
                                       f"{entry['sha256']}, file {digest}")
        return data, parse_shard_header(data, entry, self.spec, str(path))

    def fingerprint(self, index: int) -> int:
        """The token fingerprint the cache holds for sample ``index`` (its shard checked)."""
        if not 0 <= index < self.spec.num_samples:
            raise IndexError(f"sample {index} outside [0, {self.spec.num_samples})")
        shard = index // self.spec.samples_per_shard
        data, offsets = self._shard(shard)
        return int(fingerprint_table(data, len(offsets) - 1)[index - shard *
                                                             self.spec.samples_per_shard])

    def fingerprints(self) -> np.ndarray:
        """``[num_samples]`` uint64: every sample's token fingerprint, in sample order.

        Reads only each shard's fingerprint table (``8 x samples`` bytes), not its checksum:
        a row found by these is used only after its shard's sha256 is checked and its
        fingerprint read again (:meth:`fingerprint`)."""
        out = np.empty(self.spec.num_samples, dtype=np.uint64)
        for shard in range(self.spec.num_shards):
            start, end = self.spec.shard_range(shard)
            entry = self._entries.get(shard)
            if entry is None:
                raise CacheFormatError(f"{self.dir}: samples [{start}, {end}) are not in the "
                                       f"cache")
            path = self.dir / entry["file"]
            try:
                data = np.memmap(path, dtype=np.uint8, mode="r")
            except (FileNotFoundError, ValueError):
                raise CacheCorruptionError(f"{path} (samples [{start}, {end})): shard file "
                                           f"missing or empty") from None
            out[start:end] = fingerprint_table(data, end - start)
        return out

    def sample(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        """``(ids [s, K] int64, logprobs [s, K] float32)`` of one sample (checked)."""
        if not 0 <= index < self.spec.num_samples:
            raise IndexError(f"sample {index} outside [0, {self.spec.num_samples})")
        shard = index // self.spec.samples_per_shard
        data, offsets = self._shard(shard)
        local = index - shard * self.spec.samples_per_shard
        blob = data[int(offsets[local]):int(offsets[local + 1])]
        try:
            return decode_sample(blob, self.spec.seq_length, self.spec.topk,
                                 self.spec.vocab_size, self.spec.logprob_codec)
        except NonFiniteLogprobsError as e:
            raise NonFiniteTargetError(f"{self.dir / self._entries[shard]['file']}: sample "
                                       f"{index}: {e}") from None
        except CodecError as e:
            raise CacheFormatError(f"{self.dir / self._entries[shard]['file']}: sample {index} "
                                   f"cannot be decoded ({e}); run verify") from None

    def get(self, sample_indices: Iterable[int], executor=None) -> tuple[np.ndarray, np.ndarray]:
        """``(ids [b, s, K] int64, logprobs [b, s, K] float32)`` for these samples.

        ``executor``: a ``concurrent.futures`` executor to decode the samples in parallel
        (numpy releases the GIL in most of the decoding).
        """
        indices = [int(i) for i in sample_indices]
        pairs = list(executor.map(self.sample, indices) if executor is not None
                     else map(self.sample, indices))
        if not pairs:
            shape = (0, self.spec.seq_length, self.spec.topk)
            return np.zeros(shape, np.int64), np.zeros(shape, np.float32)
        return np.stack([p[0] for p in pairs]), np.stack([p[1] for p in pairs])


class PrefetchingLoader:
    """Decodes micro-batches on a background thread, ``depth`` ahead of the consumer.

    Iterating yields ``(ids [b, s, K], logprobs [b, s, K])`` per micro-batch of sample
    indices, in order. An error in the thread is re-raised in the consumer. numpy releases the
    GIL in most of the decoding, so it overlaps with the training step; ``threads > 1``
    decodes the samples of a micro-batch in parallel.
    """

    _DONE = object()

    def __init__(self, reader: TopKCacheReader, batches: Iterable[Sequence[int]], depth: int = 2,
                 threads: int = 1):
        if depth < 1 or threads < 1:
            raise ValueError(f"depth and threads must be >= 1, got depth={depth}, "
                             f"threads={threads}")
        self.reader = reader
        self.decode_s = 0.0  # the thread's seconds decoding (not waiting for queue room)
        self.decoded_tokens = 0
        self._executor = ThreadPoolExecutor(threads) if threads > 1 else None
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._work, args=(iter(batches),), daemon=True,
                                        name="topk-cache-prefetch")
        self._thread.start()

    def _put(self, item) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _work(self, batches: Iterator[Sequence[int]]) -> None:
        try:
            for batch in batches:
                t0 = time.perf_counter()
                item = self.reader.get(batch, self._executor)
                self.decode_s += time.perf_counter() - t0
                self.decoded_tokens += int(np.prod(item[0].shape[:2]))
                if not self._put(item):
                    return
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            self._put(e)
            return
        self._put(self._DONE)

    def __iter__(self):
        return self

    def __next__(self) -> tuple[np.ndarray, np.ndarray]:
        item = self._queue.get()
        if item is self._DONE:
            self._queue.put(self._DONE)  # later calls keep raising StopIteration
            raise StopIteration
        if isinstance(item, BaseException):
            raise item
        return item

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> "PrefetchingLoader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
