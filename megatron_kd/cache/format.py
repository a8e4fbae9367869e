"""On-disk format of the offline top-K teacher cache (numpy only: no torch needed to read it).

A cache is a directory::

    manifest.json                       format_version, teacher / tokenizer / dataset identity,
                                        K, seq length, encodings, dtypes, one entry per shard
    shard-000000000-000000128.bin       samples [0, 128)
    shard-000000128-000000256.bin       ...

Samples (not positions in a run) are the key: shard ``i`` holds samples
``[i * samples_per_shard, min((i + 1) * samples_per_shard, num_samples))`` of the dataset, so
any number of builders can each own some shards, and a reader with any micro-batch, DP or TP
size asks for the sample indices it trains on.

A shard file is a fixed header (:data:`_SHARD_HEADER`), a table of ``n + 1`` little-endian
uint64 byte offsets (absolute, into the file), then one blob per sample
(:func:`megatron_kd.cache.codec.encode_sample`). Files are memory-mapped by the reader.

Writes are atomic: a shard goes to a temporary file, is fsynced and renamed into place, then
the manifest is rewritten the same way (under an ``flock`` so concurrent builders do not lose
each other's entries). The manifest holds no timestamps or host names: two builds of the same
spec, interrupted or not, give byte-identical directories.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import os
import queue
import struct
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import numpy as np

from megatron_kd.cache.codec import (
    RICE_ESCAPE,
    LogprobCodec,
    decode_sample,
    encode_sample,
    vocab_bits,
)

FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
_LOCK_NAME = ".manifest.lock"
_SHARD_MAGIC = b"MKDTOPK\x00"
# magic, format_version, n_samples, sample_start, seq_length, topk, vocab_size, reserved
_SHARD_HEADER = struct.Struct("<8sIIQIIII")


class CacheFormatError(ValueError):
    """A cache directory that cannot be read as this format (names the file and the problem)."""


@dataclass(frozen=True, kw_only=True)
class CacheSpec:
    """Everything that determines a cache's bytes (two builds with equal specs are identical)."""

    teacher_checkpoint: str
    """Path (or name) of the teacher checkpoint the cache was built from."""
    teacher_weights_hash: str
    """A hash of the teacher's weights (so a cache is tied to the weights, not just a path)."""
    tokenizer: str
    """Tokenizer identity (name or path); the student must use the same one."""
    vocab_size: int
    """The true vocabulary size (no padding columns); ids lie in ``[0, vocab_size)``."""
    topk: int
    """Entries stored per token (K)."""
    seq_length: int
    """Tokens per sample."""
    num_samples: int
    """Samples in the cache: indices ``[0, num_samples)`` of the dataset."""
    dataset_hash: str
    """The dataset's identity hash (Megatron's ``unique_description_hash`` of the sample index)."""
    samples_per_shard: int = 128
    """Samples per shard file (the unit of atomic writes, resume and ownership)."""
    logprob_codec: LogprobCodec = LogprobCodec(name="log1p-u11")
    """How log-probs are stored (``fp32`` lossless, or companded ``log1p-u<bits>``)."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "topk", "seq_length", "num_samples", "samples_per_shard"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.topk > self.vocab_size:
            raise ValueError(f"topk={self.topk} exceeds vocab_size={self.vocab_size}")
        if self.vocab_size >= 2 ** 32:
            raise ValueError(f"vocab_size={self.vocab_size} does not fit the shard header")

    @property
    def num_shards(self) -> int:
        return -(-self.num_samples // self.samples_per_shard)

    def shard_range(self, index: int) -> tuple[int, int]:
        """Half-open sample range ``[start, end)`` of shard ``index``."""
        if not 0 <= index < self.num_shards:
            raise ValueError(f"shard index {index} outside [0, {self.num_shards})")
        start = index * self.samples_per_shard
        return start, min(self.num_samples, start + self.samples_per_shard)

    def shard_file(self, index: int) -> str:
        start, end = self.shard_range(index)
        return f"shard-{start:09d}-{end:09d}.bin"

    def to_json(self) -> dict:
        return {
            "format_version": FORMAT_VERSION,
            "teacher": {"checkpoint": self.teacher_checkpoint,
                        "weights_hash": self.teacher_weights_hash},
            "tokenizer": self.tokenizer,
            "vocab_size": self.vocab_size,
            "topk": self.topk,
            "seq_length": self.seq_length,
            "num_samples": self.num_samples,
            "dataset_hash": self.dataset_hash,
            "samples_per_shard": self.samples_per_shard,
            "encoding": {
                "ids": {"name": "rice-gaps", "order": "ascending id within a token",
                        "escape_quotient": RICE_ESCAPE, "escape_bits": vocab_bits(self.vocab_size)},
                "logprobs": self.logprob_codec.to_json(),
            },
            # What the reader returns.
            "dtypes": {"ids": "int64", "logprobs": "float32"},
        }

    @classmethod
    def from_json(cls, d: dict) -> "CacheSpec":
        version = d.get("format_version")
        if version != FORMAT_VERSION:
            raise CacheFormatError(
                f"cache format_version {version!r} is not supported (this reader: {FORMAT_VERSION})")
        return cls(
            teacher_checkpoint=d["teacher"]["checkpoint"],
            teacher_weights_hash=d["teacher"]["weights_hash"],
            tokenizer=d["tokenizer"],
            vocab_size=int(d["vocab_size"]),
            topk=int(d["topk"]),
            seq_length=int(d["seq_length"]),
            num_samples=int(d["num_samples"]),
            dataset_hash=d["dataset_hash"],
            samples_per_shard=int(d["samples_per_shard"]),
            logprob_codec=LogprobCodec.from_json(d["encoding"]["logprobs"]),
        )


def spec_differences(a: CacheSpec, b: CacheSpec) -> list[str]:
    """``"field: a != b"`` for every field that differs."""
    return [f"{f.name}: {getattr(a, f.name)!r} != {getattr(b, f.name)!r}"
            for f in dataclasses.fields(CacheSpec) if getattr(a, f.name) != getattr(b, f.name)]


# --------------------------------------------------------------------------- manifest I/O


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically: temp file, fsync, rename, fsync the directory."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _manifest_bytes(manifest: dict) -> bytes:
    return (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode()


def load_manifest(cache_dir: str | os.PathLike) -> dict:
    path = Path(cache_dir) / MANIFEST_NAME
    if not path.is_file():
        raise CacheFormatError(f"{path}: no manifest (not a top-K cache directory)")
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CacheFormatError(f"{path}: unreadable manifest: {e}") from None
    CacheSpec.from_json(manifest)  # checks format_version and the fields
    return manifest


@contextlib.contextmanager
def _locked(cache_dir: Path):
    with open(cache_dir / _LOCK_NAME, "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def check_compatible(manifest, *, dataset_hash: str | None = None, seq_length: int | None = None,
                     vocab_size: int | None = None, tokenizer: str | None = None,
                     topk: int | None = None) -> None:
    """Raise ``ValueError`` naming both values if the cache does not fit the run.

    ``manifest``: a manifest dict, a :class:`CacheSpec`, a reader or a cache directory. Checks
    only the arguments given (None: not checked). Never falls back: a wrong cache is an error.
    """
    if isinstance(manifest, TopKCacheReader):
        spec = manifest.spec
    elif isinstance(manifest, CacheSpec):
        spec = manifest
    elif isinstance(manifest, dict):
        spec = CacheSpec.from_json(manifest)
    else:
        spec = CacheSpec.from_json(load_manifest(manifest))
    wanted = {"dataset_hash": dataset_hash, "seq_length": seq_length, "vocab_size": vocab_size,
              "tokenizer": tokenizer, "topk": topk}
    problems = [f"{name}: cache has {getattr(spec, name)!r}, this run has {value!r}"
                for name, value in wanted.items()
                if value is not None and getattr(spec, name) != value]
    if problems:
        raise ValueError("top-K cache does not match this run: " + "; ".join(problems))


# --------------------------------------------------------------------------- shards


def encode_shard(spec: CacheSpec, index: int, blobs: Sequence[bytes]) -> bytes:
    """A shard file's bytes from its per-sample blobs."""
    start, end = spec.shard_range(index)
    if len(blobs) != end - start:
        raise ValueError(f"shard {index} holds samples [{start}, {end}): expected "
                         f"{end - start} blobs, got {len(blobs)}")
    header = _SHARD_HEADER.pack(_SHARD_MAGIC, FORMAT_VERSION, len(blobs), start, spec.seq_length,
                                spec.topk, spec.vocab_size, 0)
    table_bytes = 8 * (len(blobs) + 1)
    sizes = np.array([len(b) for b in blobs], dtype=np.uint64)
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype("<u8") + (len(header) + table_bytes)
    return b"".join([header, offsets.tobytes(), *blobs])


class CacheWriter:
    """Writes shards of one cache; safe to run from several processes owning different shards."""

    def __init__(self, cache_dir: str | os.PathLike, spec: CacheSpec):
        self.dir = Path(cache_dir)
        self.spec = spec
        self.dir.mkdir(parents=True, exist_ok=True)
        with _locked(self.dir):
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
                atomic_write(path, _manifest_bytes(self._manifest([])))

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

    def write_shard(self, index: int, blobs: Sequence[bytes]) -> dict:
        """Write shard ``index`` atomically, then record it in the manifest (atomically)."""
        data = encode_shard(self.spec, index, blobs)
        name = self.spec.shard_file(index)
        for stale in self.dir.glob(f".{name}.tmp.*"):
            stale.unlink(missing_ok=True)  # left by a killed build of this shard
        atomic_write(self.dir / name, data)
        start, end = self.spec.shard_range(index)
        entry = {"file": name, "sample_start": start, "sample_end": end, "bytes": len(data),
                 "sha256": hashlib.sha256(data).hexdigest()}
        with _locked(self.dir):
            shards = [s for s in load_manifest(self.dir)["shards"] if s["file"] != name]
            atomic_write(self.dir / MANIFEST_NAME, _manifest_bytes(self._manifest(shards + [entry])))
        return entry


# --------------------------------------------------------------------------- verify


def verify(cache_dir: str | os.PathLike) -> list[str]:
    """Check every shard's presence, size and sha256; return the problems (empty: all good).

    Each problem names the shard file and its sample range.
    """
    cache_dir = Path(cache_dir)
    manifest = load_manifest(cache_dir)
    spec = CacheSpec.from_json(manifest)
    problems = []
    listed = {s["sample_start"] // spec.samples_per_shard for s in manifest["shards"]}
    for index in range(spec.num_shards):
        if index not in listed:
            start, end = spec.shard_range(index)
            problems.append(f"{spec.shard_file(index)} (samples [{start}, {end})): not built")
    for entry in manifest["shards"]:
        where = f"{entry['file']} (samples [{entry['sample_start']}, {entry['sample_end']}))"
        path = cache_dir / entry["file"]
        if not path.is_file():
            problems.append(f"{where}: file missing")
            continue
        size = path.stat().st_size
        if size != entry["bytes"]:
            problems.append(f"{where}: {size} bytes, manifest says {entry['bytes']}")
            continue
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 22), b""):
                digest.update(chunk)
        if digest.hexdigest() != entry["sha256"]:
            problems.append(f"{where}: sha256 mismatch (corrupted), expected {entry['sha256']}, "
                            f"got {digest.hexdigest()}")
    return problems


# --------------------------------------------------------------------------- reader


class TopKCacheReader:
    """Random access by sample index; shards are memory-mapped on first use.

    ``get(sample_indices) -> (ids [b, s, K] int64, logprobs [b, s, K] float32)``; a token's
    entries are in ascending id order. ``torch.from_numpy`` turns them into tensors without a
    copy (transpose to ``[s, b, K]`` for Megatron's layout).
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
            if index in self._maps:
                return self._maps[index]
            entry = self._entries.get(index)
            if entry is None:
                start, end = self.spec.shard_range(index)
                raise CacheFormatError(f"{self.dir}: samples [{start}, {end}) are not in the cache")
            path = self.dir / entry["file"]
            data = np.memmap(path, dtype=np.uint8, mode="r")
            if data.size != entry["bytes"] or data.size < _SHARD_HEADER.size:
                raise CacheFormatError(f"{path}: {data.size} bytes, manifest says {entry['bytes']}")
            magic, version, n, start, seq, k, vocab, _ = _SHARD_HEADER.unpack_from(data, 0)
            got = (magic, version, n, start, seq, k, vocab)
            want = (_SHARD_MAGIC, FORMAT_VERSION, entry["sample_end"] - entry["sample_start"],
                    entry["sample_start"], self.spec.seq_length, self.spec.topk,
                    self.spec.vocab_size)
            if got != want:
                raise CacheFormatError(f"{path}: shard header {got} does not match the manifest "
                                       f"{want}")
            offsets = np.frombuffer(data, dtype="<u8", count=n + 1, offset=_SHARD_HEADER.size)
            self._maps[index] = (data, offsets)
            return self._maps[index]

    def sample(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        """``(ids [s, K] int64, logprobs [s, K] float32)`` of one sample."""
        if not 0 <= index < self.spec.num_samples:
            raise IndexError(f"sample {index} outside [0, {self.spec.num_samples})")
        shard = index // self.spec.samples_per_shard
        data, offsets = self._shard(shard)
        local = index - shard * self.spec.samples_per_shard
        blob = data[int(offsets[local]):int(offsets[local + 1])]
        try:
            return decode_sample(blob, self.spec.seq_length, self.spec.topk,
                                 self.spec.vocab_size, self.spec.logprob_codec)
        except (ValueError, IndexError, struct.error) as e:
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
                if not self._put(self.reader.get(batch, self._executor)):
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
