"""The decoders under fuzzing: every input that ever broke one (kept in tests/data/fuzz) gives
its project error now, the valid seeds decode to the values they were made from (and encode
back to their bytes), and a short coverage-guided run per target finds nothing (the long runs:
tools/fuzz_decoders.py)."""

import hashlib
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from megatron_kd.cache.codec import LogprobCodec, decode_sample, encode_sample
from megatron_kd.cache.format import (
    CacheSpec,
    encode_shard,
    fingerprint_table,
    manifest_bytes,
    parse_manifest,
    parse_shard_header,
)
from megatron_kd.teacher.protocol import ConnectionMeta
from megatron_kd.teacher.wire import Request, Response
from megatron_kd.testing.fuzz import EXPECTED, TARGETS, seeds

CORPUS = os.path.join(os.path.dirname(__file__), os.pardir, "data", "fuzz")
TOOL = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "tools", "fuzz_decoders.py")


def _regressions():
    for target in sorted(TARGETS):
        directory = os.path.join(CORPUS, target)
        for name in sorted(os.listdir(directory)):
            yield pytest.param(target, os.path.join(directory, name), id=f"{target}-{name}")


@pytest.mark.parametrize("target, path", list(_regressions()))
def test_regression_inputs_raise_the_project_error(target, path):
    with open(path, "rb") as f:
        data = f.read()
    with pytest.raises(EXPECTED[target]):
        TARGETS[target](data)


# What megatron_kd.testing.fuzz.seeds() encodes, written out here: a decoded seed must give these
# values back (and encoding them again, the seed's bytes).
SPEC = CacheSpec(teacher_checkpoint="t", teacher_weights_hash="w", tokenizer="tok",
                 vocab_size=1009, topk=4, seq_length=6, num_samples=3, dataset_hash="d",
                 samples_per_shard=3, logprob_codec=LogprobCodec(name="log1p-u11"))
FP32 = LogprobCodec(name="fp32")
REQUEST = Request(run=7, conn=1, request=3, step=3, microbatch=1, sample_ids=(5, 9),
                  fingerprint=12345, batch=2, seq_length=16)
RESPONSE = Response(run=7, conn=1, request=3, step=3, microbatch=1, sample_ids=(5, 9),
                    fingerprint=12345, chunk=0, num_chunks=2, shape=(8, 2, 16), wire_dtype="fp8")
CONNECTIONS = [ConnectionMeta(run=7, dp_rank=1, tp=2, cp=1, micro_batch_size=2, seq_length=16,
                              max_samples=2, wire_dtype="bf16", device="cpu",
                              identity={"checkpoint": "t", "hidden_size": 16}),
               ConnectionMeta(run=7, dp_rank=1, tp=2, cp=2, micro_batch_size=2, seq_length=16,
                              max_samples=2, wire_dtype="fp8", device="cuda",
                              identity={"checkpoint": "t", "hidden_size": 16})]


def _sample_values(seed):
    """Sample ``seed`` as the seeds make it: 4 distinct ids of 1009 a token, log-probs of
    normal logits holding 1/1.3 of the mass; entries by ascending id, as a sample stores them."""
    rng = np.random.default_rng(seed)
    ids = np.stack([rng.choice(1009, 4, replace=False) for _ in range(6)]).astype(np.int64)
    logits = rng.normal(size=ids.shape)
    logprobs = (logits - np.log(np.exp(logits).sum(1, keepdims=True) * 1.3)).astype(np.float32)
    order = np.argsort(ids, axis=1)
    return np.take_along_axis(ids, order, 1), np.take_along_axis(logprobs, order, 1)


def _assert_sample(blob, seed, codec):
    ids, logprobs = decode_sample(blob, 6, 4, 1009, codec)
    want_ids, want_logprobs = _sample_values(seed)
    np.testing.assert_array_equal(ids, want_ids)
    if codec.name == "fp32":  # lossless: the same values, and encoded again the same bytes
        np.testing.assert_array_equal(logprobs, want_logprobs)
        assert encode_sample(ids, logprobs, 1009, codec) == bytes(blob)
    else:  # within one 11-bit companding step at z = -logprob: (z0 + z) log1p(z_max / z0) / 2047
        step = (0.1 - want_logprobs) * np.log1p(64.0 / 0.1) / 2047
        assert (np.abs(logprobs - want_logprobs) <= step).all()


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_seeds_decode(target):
    for data in seeds()[target]:
        TARGETS[target](data)  # valid inputs: no error


def test_seeds_decode_to_what_they_encoded():
    made = seeds()
    (manifest_seed,), (shard,) = made["manifest"], made["shard"]
    manifest = parse_manifest(manifest_seed)
    assert CacheSpec.from_json(manifest) == SPEC and manifest["complete"] is True
    entry = {"file": SPEC.shard_file(0), "sample_start": 0, "sample_end": 3,
             "bytes": len(shard), "sha256": hashlib.sha256(shard).hexdigest()}
    assert manifest["shards"] == [entry]
    assert manifest_bytes(manifest) == manifest_seed
    buf = np.frombuffer(shard, dtype=np.uint8)
    offsets = parse_shard_header(buf, entry, SPEC, "seed")
    assert fingerprint_table(buf, 3).tolist() == [0, 1, 2]
    blobs = [shard[int(offsets[i]):int(offsets[i + 1])] for i in range(3)]
    for i, blob in enumerate(blobs):
        _assert_sample(blob, i, SPEC.logprob_codec)
    assert encode_shard(SPEC, 0, blobs, [0, 1, 2]) == shard
    # the sample target's seeds: the first byte picks the codec
    assert made["sample"][0] == bytes([0]) + blobs[0]
    assert made["sample"][1][0] == 1
    _assert_sample(made["sample"][1][1:], 7, FP32)
    for seed, header in zip(made["wire_header"], (REQUEST, RESPONSE), strict=True):
        words = torch.from_numpy(np.frombuffer(seed[1:], dtype="<i8").copy())
        assert type(header).decode(words, 4) == header
        assert header.encode(4).numpy().astype("<i8").tobytes() == seed[1:]
    for seed, meta in zip(made["connection"], CONNECTIONS, strict=True):
        assert ConnectionMeta.from_json(seed) == meta
        assert meta.to_json().encode() == seed


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_short_fuzz_run_finds_nothing(target, tmp_path):
    pytest.importorskip("atheris")
    proc = subprocess.run([sys.executable, TOOL, "--target", target, "--runs", "3000",
                           "--corpus", str(tmp_path)], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["runs"] == 3000 and result["crashes"] == []
