"""The top-K cache reader checks what it reads: a flipped byte, a truncated or missing shard, a
manifest that does not parse or lies, a malformed sample blob: each is an error naming the file
(and sample range, and both checksums), before any decoded value is handed out.

No process group (numpy only).
"""

import json
import os

import numpy as np
import pytest

from megatron_kd.cache.codec import CodecError, LogprobCodec, decode_sample, encode_sample
from megatron_kd.cache.format import (
    CacheCorruptionError,
    CacheFormatError,
    CacheSpec,
    load_manifest,
    parse_manifest,
)
from megatron_kd.cache.reader import TopKCacheReader
from megatron_kd.cache.writer import CacheWriter

CODECS = {"compact": LogprobCodec(name="log1p-u11"), "fp32": LogprobCodec(name="fp32")}


def _sample(spec, i):
    rng = np.random.default_rng(i)
    ids = np.stack([rng.choice(spec.vocab_size, spec.topk, replace=False)
                    for _ in range(spec.seq_length)])
    logits = rng.normal(size=(spec.seq_length, spec.topk)) * 2
    logprobs = logits - np.log(np.exp(logits).sum(1, keepdims=True) * 1.25)
    return ids.astype(np.int64), logprobs.astype(np.float32)


def _cache(path, codec="compact"):
    spec = CacheSpec(teacher_checkpoint="/t", teacher_weights_hash="w", tokenizer="tok",
                     vocab_size=5003, topk=12, seq_length=24, num_samples=12, dataset_hash="d",
                     samples_per_shard=4, logprob_codec=CODECS[codec])
    writer = CacheWriter(path, spec)
    for index in range(spec.num_shards):
        start, end = spec.shard_range(index)
        writer.write_shard(index, [writer.encode(*_sample(spec, i)) for i in range(start, end)],
                           list(range(start, end)))  # stand-in fingerprints: the indices
    return spec


@pytest.mark.parametrize("codec", sorted(CODECS))
def test_flipped_byte_is_refused_before_any_sample_of_the_shard(tmp_path, codec):
    spec = _cache(tmp_path, codec)
    entry = load_manifest(tmp_path)["shards"][1]
    path = tmp_path / entry["file"]
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x04  # the middle of the shard: inside some sample's blob
    path.write_bytes(bytes(data))
    reader = TopKCacheReader(tmp_path)
    ids, _ = reader.get([0, 3])  # other shards still read
    assert ids.shape == (2, spec.seq_length, spec.topk)
    for i in (4, 5, 7):  # every sample of the corrupted shard
        with pytest.raises(CacheCorruptionError) as err:
            reader.sample(i)
        message = str(err.value)
        assert f"{entry['file']} (samples [4, 8))" in message
        assert "sha256 mismatch" in message and entry["sha256"] in message
        assert len([w for w in message.split() if len(w.strip(",")) == 64]) == 2  # both hashes


def test_truncated_shard_names_both_sizes(tmp_path):
    _cache(tmp_path)
    entry = load_manifest(tmp_path)["shards"][2]
    path = tmp_path / entry["file"]
    with open(path, "r+b") as f:
        f.truncate(entry["bytes"] - 100)
    with pytest.raises(CacheCorruptionError, match=rf"samples \[8, 12\)\): "
                                                   rf"{entry['bytes'] - 100} bytes, manifest "
                                                   rf"says {entry['bytes']}"):
        TopKCacheReader(tmp_path).sample(9)


def test_missing_shard_file(tmp_path):
    _cache(tmp_path)
    entry = load_manifest(tmp_path)["shards"][0]
    os.remove(tmp_path / entry["file"])
    with pytest.raises(CacheCorruptionError, match=rf"{entry['file']} \(samples \[0, 4\)\): "
                                                   rf"shard file missing"):
        TopKCacheReader(tmp_path).sample(0)


@pytest.mark.parametrize("edit, message", [
    (lambda m: "{not json", "unreadable manifest"),
    (lambda m: json.dumps([1, 2]), "a manifest is a JSON object"),
    (lambda m: json.dumps({k: v for k, v in m.items() if k != "topk"}), "missing field 'topk'"),
    (lambda m: json.dumps({**m, "seq_length": "24"}), "seq_length must be an integer"),
    (lambda m: json.dumps({**m, "seq_length": 1 << 30}), "seq_length=1073741824 exceeds"),
    (lambda m: json.dumps({**m, "shards": [{**m["shards"][0], "file": "../../etc/passwd"}]
                           + m["shards"][1:]}), "should be 'shard-000000000-000000004.bin'"),
    (lambda m: json.dumps({**m, "shards": m["shards"][:2]}), "complete=True with 2 of 3"),
    (lambda m: json.dumps({**m, "shards": m["shards"] + m["shards"][:1]}), "listed twice"),
])
def test_malformed_manifest_is_refused_naming_the_file(tmp_path, edit, message):
    _cache(tmp_path)
    path = tmp_path / "manifest.json"
    path.write_text(edit(json.loads(path.read_text())))
    with pytest.raises(CacheFormatError, match=message) as err:
        TopKCacheReader(tmp_path)
    assert str(path) in str(err.value)


@pytest.mark.parametrize("codec", sorted(CODECS))
def test_sample_decoder_checks_its_blob(codec):
    spec_codec = CODECS[codec]
    rng = np.random.default_rng(0)
    ids = np.stack([rng.choice(1000, 5, replace=False) for _ in range(7)]).astype(np.int64)
    lp = np.log(np.full((7, 5), 0.1, dtype=np.float32))
    blob = encode_sample(ids, lp, 1000, spec_codec)
    decode_sample(blob, 7, 5, 1000, spec_codec)
    with pytest.raises(CodecError, match="bytes"):
        decode_sample(blob + b"\0", 7, 5, 1000, spec_codec)  # trailing garbage
    with pytest.raises(CodecError):
        decode_sample(blob[:-3], 7, 5, 1000, spec_codec)  # short
    with pytest.raises(CodecError, match=r"outside \[0, 100\)"):
        decode_sample(blob, 7, 5, 100, spec_codec)  # ids past another vocabulary
    if codec == "fp32":  # a log-prob that is no log-probability
        bad = bytearray(blob)
        bad[-4:] = np.float32(np.nan).tobytes()
        with pytest.raises(CodecError, match="non-finite"):
            decode_sample(bytes(bad), 7, 5, 1000, spec_codec)


def test_parse_manifest_accepts_what_the_writer_wrote(tmp_path):
    _cache(tmp_path)
    data = (tmp_path / "manifest.json").read_bytes()
    assert parse_manifest(data)["complete"] is True
