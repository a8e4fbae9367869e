"""Fuzz targets for every decoder that reads bytes another process or a disk wrote.

Each target takes arbitrary bytes and must either decode them into a well-formed value or raise
the project's own error for that input (:data:`EXPECTED`): never another exception (a crash),
a hang, an allocation beyond the input's own scale, or a silently wrong value (each target checks
what it decoded against the format's invariants and fails loudly if one is broken).

* ``manifest`` -- :func:`megatron_kd.cache.format.parse_manifest`;
* ``shard`` -- a whole shard file: its header and offset table
  (:func:`~megatron_kd.cache.format.parse_shard_header`), then every sample in it
  (:func:`~megatron_kd.cache.codec.decode_sample`);
* ``sample`` -- one sample blob, compact or fp32 encoding (the first byte picks);
* ``wire_header`` -- the teacher wire's request and response headers
  (:meth:`megatron_kd.teacher.wire.Request.decode`, ``Response.decode``; the first byte picks);
* ``connection`` -- the connection handshake a replica reads from its store, whoever wrote it
  (:meth:`megatron_kd.teacher.protocol.ConnectionLimits.accept`: the JSON metadata, checked
  against what a replica serves).

:func:`run` drives them with atheris (coverage-guided, libFuzzer underneath) in this process;
``tools/fuzz_decoders.py`` is the command line. :func:`seeds` writes a valid input per target
to start from. Every input that ever broke a target is kept under ``tests/data/fuzz/<target>/``
and replayed by the test suite.
"""

from __future__ import annotations

import hashlib
import os
import sys
from collections.abc import Callable

import numpy as np
import torch

from megatron_kd.cache import codec
from megatron_kd.cache import format as fmt
from megatron_kd.cache.codec import CodecError, LogprobCodec, decode_sample, encode_sample
from megatron_kd.cache.format import (
    CacheFormatError,
    CacheSpec,
    encode_shard,
    parse_manifest,
    parse_shard_header,
)
from megatron_kd.teacher import protocol, wire
from megatron_kd.teacher.protocol import ConnectionLimits, ConnectionMeta, HandshakeError
from megatron_kd.teacher.wire import Request, Response, WireError

__all__ = ["EXPECTED", "TARGETS", "run", "seeds"]

#: Per target, the errors a bad input may raise.
EXPECTED: dict[str, tuple[type[BaseException], ...]] = {
    "manifest": (CacheFormatError,),
    "shard": (CacheFormatError, CodecError),
    "sample": (CodecError,),
    "wire_header": (WireError,),
    "connection": (HandshakeError,),
}

_CODECS = (LogprobCodec(name="log1p-u11"), LogprobCodec(name="fp32"))
_SPEC = CacheSpec(teacher_checkpoint="t", teacher_weights_hash="w", tokenizer="tok",
                  vocab_size=1009, topk=4, seq_length=6, num_samples=3, dataset_hash="d",
                  samples_per_shard=3, logprob_codec=_CODECS[0])
_WIRE_MAX_SAMPLES = 4
_IDENTITY = {"checkpoint": "t", "hidden_size": 16}
_LIMITS = ConnectionLimits(identity=_IDENTITY, max_seq_length=64, max_batch=4, max_samples=4)


def _check_sample(ids: np.ndarray, logprobs: np.ndarray, spec: CacheSpec) -> None:
    """The invariants every decoded sample keeps (a broken one is a silent wrong value)."""
    shape = (spec.seq_length, spec.topk)
    assert ids.shape == shape and logprobs.shape == shape, (ids.shape, logprobs.shape)
    assert ids.dtype == np.int64 and logprobs.dtype == np.float32
    assert int(ids.min()) >= 0 and int(ids.max()) < spec.vocab_size, "id out of range"
    assert bool((np.diff(ids, axis=1) > 0).all()), "ids not strictly ascending in a token"
    assert bool(np.isfinite(logprobs).all()) and float(logprobs.max()) <= 1e-4, "bad log-prob"


def target_manifest(data: bytes) -> None:
    manifest = parse_manifest(data)
    spec = CacheSpec.from_json(manifest)
    assert spec.num_shards >= len(manifest["shards"])


def target_shard(data: bytes) -> None:
    entry = {"sample_start": 0, "sample_end": _SPEC.num_samples, "bytes": len(data),
             "file": _SPEC.shard_file(0), "sha256": hashlib.sha256(data).hexdigest()}
    buf = np.frombuffer(data, dtype=np.uint8)
    offsets = parse_shard_header(buf, entry, _SPEC, "fuzz")
    for i in range(_SPEC.num_samples):
        blob = buf[int(offsets[i]):int(offsets[i + 1])]
        _check_sample(*decode_sample(blob, _SPEC.seq_length, _SPEC.topk, _SPEC.vocab_size,
                                     _SPEC.logprob_codec), _SPEC)


def target_sample(data: bytes) -> None:
    if not data:
        raise CodecError("empty input")
    codec = _CODECS[data[0] % 2]
    _check_sample(*decode_sample(data[1:], _SPEC.seq_length, _SPEC.topk, _SPEC.vocab_size,
                                 codec), _SPEC)


def target_wire_header(data: bytes) -> None:
    if not data:
        raise WireError("empty input")
    kind = (Request, Response)[data[0] % 2]
    body = data[1:]
    words = np.frombuffer(body[: len(body) // 8 * 8], dtype="<i8")
    header = kind.decode(torch.from_numpy(words.copy()), _WIRE_MAX_SAMPLES)
    assert len(header.sample_ids) <= _WIRE_MAX_SAMPLES
    if kind is Response:
        assert all(d >= 1 for d in header.shape) and 0 <= header.chunk < header.num_chunks
        assert header.wire_dtype in wire.WIRE_DTYPES
    else:
        assert header.batch >= 1 and header.seq_length >= 1


def target_connection(data: bytes) -> None:
    meta = _LIMITS.accept(data)
    # what an accepted connection may cost the replica: bounded by what it was started for
    assert 1 <= meta.seq_length <= _LIMITS.max_seq_length
    assert 1 <= meta.micro_batch_size <= _LIMITS.max_batch
    assert 1 <= meta.max_samples <= max(_LIMITS.max_samples, _LIMITS.max_batch)
    assert 1 <= meta.members <= _LIMITS.max_members and meta.seq_length % meta.members == 0
    assert meta.wire_dtype in wire.WIRE_DTYPES and meta.device in _LIMITS.devices
    assert meta.identity == _IDENTITY


# The functions whose branches the fuzzer is to explore.
_DECODERS = (codec.decode_ids, codec.decode_sample, codec.unpack_uint, LogprobCodec.decode,
             LogprobCodec.dequantise, parse_manifest, fmt._check_shard_entries,
             CacheSpec.from_json, CacheSpec._from_fields, LogprobCodec.from_json,
             parse_shard_header, wire._Message.decode, Request._from_words,
             Response._from_words, ConnectionMeta.from_json, ConnectionMeta.__post_init__,
             ConnectionLimits.accept, protocol.identity_differences)

TARGETS: dict[str, Callable[[bytes], None]] = {
    "manifest": target_manifest, "shard": target_shard, "sample": target_sample,
    "wire_header": target_wire_header, "connection": target_connection,
}


def one_input(target: str, data: bytes) -> None:
    """Run ``target`` on ``data``; an error the format expects is a pass."""
    try:
        TARGETS[target](data)
    except EXPECTED[target]:
        pass


def _sample_blob(seed: int, codec: LogprobCodec) -> bytes:
    rng = np.random.default_rng(seed)
    ids = np.stack([rng.choice(_SPEC.vocab_size, _SPEC.topk, replace=False)
                    for _ in range(_SPEC.seq_length)]).astype(np.int64)
    logits = rng.normal(size=ids.shape)
    logprobs = (logits - np.log(np.exp(logits).sum(1, keepdims=True) * 1.3)).astype(np.float32)
    return encode_sample(ids, logprobs, _SPEC.vocab_size, codec)


def seeds() -> dict[str, list[bytes]]:
    """A few valid inputs per target, for the fuzzer to mutate."""
    from megatron_kd.cache.format import manifest_bytes  # only here: seeding needs it

    blobs = [_sample_blob(i, _SPEC.logprob_codec) for i in range(_SPEC.num_samples)]
    shard = encode_shard(_SPEC, 0, blobs, list(range(_SPEC.num_samples)))
    entry = {"file": _SPEC.shard_file(0), "sample_start": 0, "sample_end": _SPEC.num_samples,
             "bytes": len(shard), "sha256": hashlib.sha256(shard).hexdigest()}
    manifest = manifest_bytes({**_SPEC.to_json(), "shards": [entry], "complete": True})
    request = Request(run=7, conn=1, request=3, step=3, microbatch=1, sample_ids=(5, 9),
                      fingerprint=12345, batch=2, seq_length=16)
    response = Response(run=7, conn=1, request=3, step=3, microbatch=1, sample_ids=(5, 9),
                        fingerprint=12345, chunk=0, num_chunks=2, shape=(8, 2, 16),
                        wire_dtype="fp8")
    return {
        "manifest": [manifest],
        "shard": [shard],
        "sample": [bytes([0]) + blobs[0], bytes([1]) + _sample_blob(7, _CODECS[1])],
        "wire_header": [bytes([i]) + h.encode(_WIRE_MAX_SAMPLES).numpy().astype("<i8").tobytes()
                        for i, h in enumerate((request, response))],
        "connection": [ConnectionMeta(run=7, dp_rank=1, tp=2, cp=cp, micro_batch_size=2,
                                      seq_length=16, max_samples=2, wire_dtype=dtype,
                                      device=device, identity=_IDENTITY).to_json().encode()
                       for cp, dtype, device in ((1, "bf16", "cpu"), (2, "fp8", "cuda"))],
    }


def run(target: str, runs: int, corpus_dir: str, extra_args: list[str] = ()) -> None:
    """Fuzz ``target`` for ``runs`` inputs (libFuzzer exits the process at the end: run this in
    a process of its own). Inputs that break it are written under ``corpus_dir``."""
    import atheris  # optional (the test extra): only the fuzzer needs it

    os.makedirs(corpus_dir, exist_ok=True)
    for i, seed in enumerate(seeds()[target]):
        path = os.path.join(corpus_dir, f"seed-{i}")
        if not os.path.exists(path):
            with open(path, "wb") as f:
                f.write(seed)

    def test_one_input(data: bytes) -> None:
        one_input(target, data)

    # Coverage of the decoders' own code guides the mutations (instrumenting everything
    # loaded, torch and numpy included, would make each input a thousand times slower).
    for fn in _DECODERS:
        atheris.instrument_func(fn)
    argv = [sys.argv[0], corpus_dir, f"-runs={runs}", "-rss_limit_mb=2048", "-timeout=20",
            "-use_value_profile=1",
            f"-artifact_prefix={os.path.join(corpus_dir, 'crash-')}", *extra_args]
    atheris.Setup(argv, test_one_input)
    atheris.Fuzz()
