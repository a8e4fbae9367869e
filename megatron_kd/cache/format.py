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

A shard file is a fixed header (:data:`SHARD_HEADER`), a table of ``n + 1`` little-endian
uint64 byte offsets (absolute, into the file), then one blob per sample
(:func:`megatron_kd.cache.codec.encode_sample`). Files are memory-mapped by the reader.

The writer is :mod:`megatron_kd.cache.writer`, the reader :mod:`megatron_kd.cache.reader`.
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
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from megatron_kd.cache.codec import RICE_ESCAPE, LogprobCodec, vocab_bits

FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
LOCK_NAME = ".manifest.lock"
SHARD_MAGIC = b"MKDTOPK\x00"
# magic, format_version, n_samples, sample_start, seq_length, topk, vocab_size, reserved
SHARD_HEADER = struct.Struct("<8sIIQIIII")


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


def manifest_bytes(manifest: dict) -> bytes:
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
def locked(cache_dir: Path):
    with open(cache_dir / LOCK_NAME, "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def check_compatible(manifest, *, dataset_hash: str | None = None, seq_length: int | None = None,
                     vocab_size: int | None = None, tokenizer: str | None = None,
                     topk: int | None = None) -> None:
    """Raise ``ValueError`` naming both values if the cache does not fit the run.

    ``manifest``: a manifest dict, a :class:`CacheSpec`, a reader (anything with a ``spec``) or
    a cache directory. Checks
    only the arguments given (None: not checked). Never falls back: a wrong cache is an error.
    """
    if isinstance(getattr(manifest, "spec", None), CacheSpec):  # a reader
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
    header = SHARD_HEADER.pack(SHARD_MAGIC, FORMAT_VERSION, len(blobs), start, spec.seq_length,
                                spec.topk, spec.vocab_size, 0)
    table_bytes = 8 * (len(blobs) + 1)
    sizes = np.array([len(b) for b in blobs], dtype=np.uint64)
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype("<u8") + (len(header) + table_bytes)
    return b"".join([header, offsets.tobytes(), *blobs])


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
