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
uint64 byte offsets (absolute, into the file), a table of ``n`` little-endian uint64 token
fingerprints (:func:`token_fingerprint` of each sample's token ids: what ties a row to the tokens
the teacher saw, so a run that does not know its sample indices -- Megatron-LM's
``pretrain_gpt.py`` -- finds its rows by its tokens, and a run that does checks them), then one
blob per sample (:func:`megatron_kd.cache.codec.encode_sample`). Files are memory-mapped by the
reader. Format version 1 had no fingerprint table: such caches are refused, to be rebuilt.

The writer is :mod:`megatron_kd.cache.writer`, the reader :mod:`megatron_kd.cache.reader`.
Writes are atomic: a shard goes to a temporary file, is fsynced and renamed into place, then
the manifest is rewritten the same way (under an ``flock`` so concurrent builders do not lose
each other's entries). The manifest holds no timestamps or host names: two builds of the same
spec, interrupted or not, give byte-identical directories.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import hashlib
import json
import os
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from megatron_kd.cache.codec import RICE_ESCAPE, LogprobCodec, vocab_bits

FORMAT_VERSION = 2
"""2: each shard holds its samples' token fingerprints (1: none; refused, rebuild)."""
MANIFEST_NAME = "manifest.json"
LOCK_NAME = ".manifest.lock"
SHARD_MAGIC = b"MKDTOPK\x00"
# magic, format_version, n_samples, sample_start, seq_length, topk, vocab_size, reserved
SHARD_HEADER = struct.Struct("<8sIIQIIII")


#: Upper bounds on a spec's sizes: a manifest asking for more is refused as corrupt before any
#: buffer is sized from it.
MAX_SEQ_LENGTH = 1 << 24
MAX_TOPK = 1 << 16
MAX_SAMPLES = 1 << 40
MAX_SAMPLES_PER_SHARD = 1 << 24


class CacheFormatError(ValueError):
    """A cache directory that cannot be read as this format (names the file and the problem)."""


class CacheCorruptionError(CacheFormatError):
    """A cache file whose bytes are not what the manifest recorded (a flipped bit, a torn or
    truncated write, a missing file): names the file, its sample range and both checksums or
    sizes."""


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
        for name, bound in (("seq_length", MAX_SEQ_LENGTH), ("topk", MAX_TOPK),
                            ("num_samples", MAX_SAMPLES),
                            ("samples_per_shard", MAX_SAMPLES_PER_SHARD)):
            if getattr(self, name) > bound:
                raise ValueError(f"{name}={getattr(self, name)} exceeds {bound}")

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
        """The spec of a manifest dict; :class:`CacheFormatError` for anything malformed."""
        if not isinstance(d, dict):
            raise CacheFormatError(f"a manifest is a JSON object, got {type(d).__name__}")
        version = d.get("format_version")
        if version == 1:
            raise CacheFormatError(
                f"cache format_version 1 is not supported (this reader: {FORMAT_VERSION}): it "
                f"holds no token fingerprints of its samples; build the cache again with "
                f"`megatron-kd cache build` (same flags)")
        if version != FORMAT_VERSION:
            raise CacheFormatError(
                f"cache format_version {version!r} is not supported (this reader: "
                f"{FORMAT_VERSION})")
        try:
            return cls._from_fields(d)
        except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as e:
            if isinstance(e, CacheFormatError):
                raise
            what = f"missing field {e}" if isinstance(e, KeyError) else str(e)
            raise CacheFormatError(f"malformed manifest: {what}") from None

    @classmethod
    def _from_fields(cls, d: dict) -> "CacheSpec":
        for key in ("tokenizer", "dataset_hash"):
            if not isinstance(d[key], str):
                raise TypeError(f"{key} must be a string, got {type(d[key]).__name__}")
        for key in ("vocab_size", "topk", "seq_length", "num_samples", "samples_per_shard"):
            if isinstance(d[key], bool) or not isinstance(d[key], int):
                raise TypeError(f"{key} must be an integer, got {d[key]!r}")
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


class CacheWriteError(OSError):
    """A cache file could not be written (a full disk, say): names the file and the bytes it
    needs. Nothing already written is touched; the build resumes once space is freed."""


def atomic_write(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically: temp file, fsync, rename, fsync the directory.

    A failing write (``ENOSPC``...) removes its temporary file and raises
    :class:`CacheWriteError` naming the path and the bytes needed; ``path`` keeps what it had.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        free = shutil.disk_usage(path.parent).free if path.parent.exists() else 0
        what = "no space left on device" if e.errno == errno.ENOSPC else str(e)
        raise CacheWriteError(e.errno, f"could not write {path}: {what}; it needs {len(data):,} "
                                       f"bytes, {free:,} are free there. Nothing already "
                                       f"written was changed: free space and run the build "
                                       f"again to resume") from e


def manifest_bytes(manifest: dict) -> bytes:
    return (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode()


def load_manifest(cache_dir: str | os.PathLike) -> dict:
    """The manifest of a cache directory, checked: :class:`CacheFormatError` naming the file for
    a missing, unparsable or malformed one (spec fields, shard entries)."""
    path = Path(cache_dir) / MANIFEST_NAME
    if not path.is_file():
        raise CacheFormatError(f"{path}: no manifest (not a top-K cache directory)")
    return parse_manifest(path.read_bytes(), str(path))


def parse_manifest(data: bytes, where: str = MANIFEST_NAME) -> dict:
    """A manifest from its bytes, every field and shard entry checked (see
    :func:`load_manifest`)."""
    try:
        manifest = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise CacheFormatError(f"{where}: unreadable manifest: {e}") from None
    try:
        spec = CacheSpec.from_json(manifest)  # checks format_version and the fields
        _check_shard_entries(manifest, spec)
    except CacheFormatError as e:
        raise CacheFormatError(f"{where}: {e}") from None
    return manifest


def _check_shard_entries(manifest: dict, spec: CacheSpec) -> None:
    shards, complete = manifest.get("shards"), manifest.get("complete")
    if not isinstance(shards, list) or not isinstance(complete, bool):
        raise CacheFormatError("malformed manifest: 'shards' must be a list and 'complete' a "
                               "boolean")
    seen = set()
    for entry in shards:
        ok = (isinstance(entry, dict)
              and all(isinstance(entry.get(k), int) and not isinstance(entry.get(k), bool)
                      for k in ("sample_start", "sample_end", "bytes"))
              and isinstance(entry.get("file"), str) and isinstance(entry.get("sha256"), str))
        if not ok:
            raise CacheFormatError(f"malformed shard entry {str(entry)[:200]}")
        index, rest = divmod(entry["sample_start"], spec.samples_per_shard)
        if rest or not 0 <= index < spec.num_shards or index in seen:
            raise CacheFormatError(f"shard entry with sample_start {entry['sample_start']} is "
                                   f"not a shard of this spec (or listed twice)")
        seen.add(index)
        want = (spec.shard_file(index), spec.shard_range(index)[1])
        if (entry["file"], entry["sample_end"]) != want:
            raise CacheFormatError(f"shard entry {entry['file']!r} [{entry['sample_start']}, "
                                   f"{entry['sample_end']}) should be {want[0]!r} ending at "
                                   f"{want[1]}")
        if entry["bytes"] < SHARD_HEADER.size or len(entry["sha256"]) != 64:
            raise CacheFormatError(f"shard entry {entry['file']!r}: bytes {entry['bytes']} or "
                                   f"sha256 {entry['sha256']!r} malformed")
    if complete != (len(seen) == spec.num_shards):
        raise CacheFormatError(f"manifest says complete={complete} with {len(seen)} of "
                               f"{spec.num_shards} shards")


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


def sha256_of(data) -> str:
    """sha256 of a buffer (a memory map), read in 4 MiB pieces."""
    digest = hashlib.sha256()
    view = memoryview(data)
    for lo in range(0, len(view), 1 << 22):
        digest.update(view[lo:lo + (1 << 22)])
    return digest.hexdigest()


def token_fingerprint(tokens) -> int:
    """A sample's token fingerprint: the first 8 bytes (little-endian) of the BLAKE2b digest of
    its ``[s]`` token ids as little-endian int64 (any integer array or tensor on the host)."""
    ids = np.ascontiguousarray(np.asarray(tokens), dtype="<i8")
    if ids.ndim != 1:
        raise ValueError(f"a sample's tokens are [s], got shape {list(ids.shape)}")
    return int.from_bytes(hashlib.blake2b(ids.tobytes(), digest_size=8).digest(), "little")


def _tables_end(n: int) -> int:
    """Where a shard's blobs begin: past the header, the ``n + 1`` offsets and ``n``
    fingerprints."""
    return SHARD_HEADER.size + 8 * (n + 1) + 8 * n


def fingerprint_table(data, n: int) -> np.ndarray:
    """The ``[n]`` uint64 token fingerprints of a shard of ``n`` samples (its bytes; checked
    only as far as they fit: :func:`parse_shard_header` checks the rest)."""
    if _tables_end(n) > len(data):
        raise CacheFormatError(f"a shard of {n} samples ({len(data)} bytes) cannot hold its "
                               f"fingerprint table")
    return np.frombuffer(data, dtype="<u8", count=n, offset=SHARD_HEADER.size + 8 * (n + 1))


def parse_shard_header(data, entry: dict, spec: CacheSpec, where: str) -> np.ndarray:
    """The offset table of a shard's bytes, after checking its header against the manifest
    ``entry`` and the tables against the file: ``n + 1`` ascending offsets inside it, the first
    just past the fingerprint table, the last at its end. :class:`CacheFormatError`
    otherwise."""
    if len(data) < SHARD_HEADER.size:
        raise CacheFormatError(f"{where}: {len(data)} bytes, shorter than a shard header")
    magic, version, n, start, seq, k, vocab, _ = SHARD_HEADER.unpack_from(data, 0)
    got = (magic, version, n, start, seq, k, vocab)
    want = (SHARD_MAGIC, FORMAT_VERSION, entry["sample_end"] - entry["sample_start"],
            entry["sample_start"], spec.seq_length, spec.topk, spec.vocab_size)
    if got != want:
        raise CacheFormatError(f"{where}: shard header {got} does not match the manifest {want}")
    table_end = _tables_end(n)
    if table_end > len(data):
        raise CacheFormatError(f"{where}: offset and fingerprint tables of {n} samples do not "
                               f"fit {len(data)} bytes")
    offsets = np.frombuffer(data, dtype="<u8", count=n + 1, offset=SHARD_HEADER.size)
    if (int(offsets[0]) != table_end or int(offsets[-1]) != len(data)
            or bool((np.diff(offsets.astype(np.int64)) < 0).any())):
        raise CacheFormatError(f"{where}: offset table is not ascending from {table_end} to "
                               f"{len(data)}")
    return offsets




def encode_shard(spec: CacheSpec, index: int, blobs: Sequence[bytes],
                 fingerprints: Sequence[int]) -> bytes:
    """A shard file's bytes from its per-sample blobs and token fingerprints
    (:func:`token_fingerprint`)."""
    start, end = spec.shard_range(index)
    if len(blobs) != end - start or len(fingerprints) != end - start:
        raise ValueError(f"shard {index} holds samples [{start}, {end}): expected "
                         f"{end - start} blobs and fingerprints, got {len(blobs)} and "
                         f"{len(fingerprints)}")
    header = SHARD_HEADER.pack(SHARD_MAGIC, FORMAT_VERSION, len(blobs), start, spec.seq_length,
                                spec.topk, spec.vocab_size, 0)
    sizes = np.array([len(b) for b in blobs], dtype=np.uint64)
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype("<u8") + _tables_end(len(blobs))
    table = np.array([int(f) for f in fingerprints], dtype="<u8")
    return b"".join([header, offsets.tobytes(), table.tobytes(), *blobs])


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
        data = np.memmap(path, dtype=np.uint8, mode="r") if size else b""
        digest = sha256_of(data)
        if digest != entry["sha256"]:
            problems.append(f"{where}: sha256 mismatch (corrupted), expected {entry['sha256']}, "
                            f"got {digest}")
            continue
        try:
            parse_shard_header(data, entry, spec, str(path))
        except CacheFormatError as e:
            problems.append(f"{where}: {e}")
    return problems
