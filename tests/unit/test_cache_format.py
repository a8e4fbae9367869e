"""Offline top-K cache: codec, on-disk format, reader, verify, compatibility checks.

No process group anywhere in this file (numpy and a little torch for the fidelity check).
"""

import json
import math
import subprocess
import sys

import numpy as np
import pytest

from megatron_kd.cache.codec import (
    LogprobCodec,
    decode_ids,
    decode_sample,
    encode_ids,
    encode_sample,
    pack_uint,
    unpack_uint,
    vocab_bits,
)
from megatron_kd.cache.format import (
    CacheFormatError,
    CacheSpec,
    check_compatible,
    load_manifest,
    verify,
)
from megatron_kd.cache.reader import PrefetchingLoader, TopKCacheReader
from megatron_kd.cache.writer import CacheWriter

FP32 = LogprobCodec(name="fp32")
U11 = LogprobCodec(name="log1p-u11")


def _random_topk(rng, n, k, vocab_size, near_top=0):
    """Distinct ids per row (some forced into the top of the range) and sorted log-probs."""
    rows = []
    for _ in range(n):
        ids = np.unique(rng.integers(0, vocab_size, size=3 * k))
        ids = rng.permutation(ids)[:k - near_top]
        top = np.arange(vocab_size - near_top, vocab_size)
        ids = np.concatenate([top, ids[~np.isin(ids, top)]])
        while ids.size < k:  # rare: refill after dropping collisions with the top ids
            extra = rng.integers(0, vocab_size - near_top)
            if extra not in ids:
                ids = np.append(ids, extra)
        rows.append(ids[:k])
    ids = np.stack(rows).astype(np.int64)
    logits = rng.normal(size=(n, k)) * 3
    logprobs = -np.sort(-(logits - np.log(np.exp(logits).sum(1, keepdims=True) * 1.5)), axis=1)
    return ids, logprobs.astype(np.float32)


def _sorted(ids, logprobs):
    # Row by row in Python: ids are distinct, so the order is unique.
    pairs = [sorted(zip(r_ids.tolist(), r_lp.tolist())) for r_ids, r_lp in zip(ids, logprobs)]
    return (np.array([[p[0] for p in row] for row in pairs], dtype=np.int64),
            np.array([[p[1] for p in row] for row in pairs], dtype=np.float32))


# --------------------------------------------------------------------------- codec


@pytest.mark.parametrize("vocab_size, bits", [(1, 1), (2, 1), (3, 2), (1009, 10), (131072, 17),
                                              (131073, 18), (151936, 18), (248320, 18)])
def test_vocab_bits(vocab_size, bits):
    assert vocab_bits(vocab_size) == bits


@pytest.mark.parametrize("width", [1, 3, 7, 8, 11, 17, 18, 31, 33, 56])
def test_pack_unpack_roundtrip(width):
    rng = np.random.default_rng(width)
    values = rng.integers(0, 1 << width, size=1001, dtype=np.uint64)
    values[:2] = [0, (1 << width) - 1]
    buf = pack_uint(values, width)
    assert len(buf) == math.ceil(1001 * width / 8)
    np.testing.assert_array_equal(unpack_uint(buf, 1001, width), values.astype(np.int64))


@pytest.mark.parametrize("vocab_size", [1009, 151936, 248320, 2 ** 31 - 1])
def test_ids_roundtrip_any_vocab(vocab_size):
    rng = np.random.default_rng(vocab_size % 1000)
    ids, _ = _random_topk(rng, 37, 50, vocab_size, near_top=3)
    ids = np.sort(ids, axis=1)
    assert ids.max() == vocab_size - 1
    blob = encode_ids(ids, vocab_size)
    got, used = decode_ids(blob, 37, 50, vocab_size)
    assert used == len(blob)
    np.testing.assert_array_equal(got, ids)


def test_ids_cluster_with_outliers_uses_escapes():
    # A tight cluster then one far id: the far gap is escaped instead of a huge unary run.
    vocab_size = 248320
    ids = np.tile(np.concatenate([np.arange(99), [vocab_size - 1]]), (8, 1))
    blob = encode_ids(ids, vocab_size)
    assert len(blob) < 8 * 100  # ~1 bit per clustered id + one escape per row
    np.testing.assert_array_equal(decode_ids(blob, 8, 100, vocab_size)[0], ids)


def test_full_vocab_ids():
    # K == V: every gap is 0, one bit per id.
    ids = np.tile(np.arange(257), (5, 1))
    blob = encode_ids(ids, 257)
    assert len(blob) < 5 * 257 / 8 + 16
    np.testing.assert_array_equal(decode_ids(blob, 5, 257, 257)[0], ids)


def test_encode_rejects_bad_ids():
    with pytest.raises(ValueError, match=r"\[0, 100\)"):
        encode_sample(np.array([[1, 100]]), np.zeros((1, 2)), 100, FP32)
    with pytest.raises(ValueError, match="ascending"):
        encode_sample(np.array([[3, 3]]), np.zeros((1, 2)), 100, FP32)


def test_logprob_codec_validation():
    with pytest.raises(ValueError, match="log1p-u"):
        LogprobCodec(name="int8")
    with pytest.raises(ValueError, match="bits <= 24"):
        LogprobCodec(name="log1p-u40")


def test_sample_roundtrip_fp32_exact_and_u11_bounded():
    rng = np.random.default_rng(0)
    ids, logprobs = _random_topk(rng, 64, 100, 248320, near_top=2)
    sid, slp = _sorted(ids, logprobs)
    got_ids, got_lp = decode_sample(encode_sample(ids, logprobs, 248320, FP32), 64, 100, 248320,
                                    FP32)
    np.testing.assert_array_equal(got_ids, sid)
    np.testing.assert_array_equal(got_lp, slp)
    got_ids, got_lp = decode_sample(encode_sample(ids, logprobs, 248320, U11), 64, 100, 248320,
                                    U11)
    np.testing.assert_array_equal(got_ids, sid)
    # Half a companding step, z0 * log1p(z_max/z0) / (2^11 - 1) * (1 + z/z0) / 2 nats at
    # z = -logprob, plus the token's shift to its stored mass: at most the entries' rounding
    # weighted by probability, plus the mass logit's half step (40 / 65535 relative).
    z = -slp.astype(np.float64)
    half_step = U11.z0 * math.log1p(U11.z_max / U11.z0) / 2047 * (1 + z / U11.z0) / 2
    p = np.exp(-z)
    shift = (p * half_step).sum(1, keepdims=True) / p.sum(1, keepdims=True) + 40 / 65535
    assert np.all(np.abs(got_lp - slp) <= (half_step + shift) * 1.01 + 1e-6)


@pytest.mark.parametrize("logit_std", [(1, 8), (6, 20)])
def test_compact_keeps_topk_and_tail_mass(logit_std):
    # Rounding the entries alone can miss a confident teacher's tail (< 1e-3) by more than
    # the tail itself; the stored mass keeps M and 1 - M to ~1e-3 relative (logit step 1.2e-3).
    rng = np.random.default_rng(3)
    logits = rng.normal(size=(400, 1000)) * rng.uniform(*logit_std, size=(400, 1))
    full = logits - logits.max(1, keepdims=True)
    full -= np.log(np.exp(full).sum(1, keepdims=True))
    logprobs = -np.sort(-full, axis=1)[:, :100].astype(np.float32)
    mass = np.exp(logprobs.astype(np.float64)).sum(1)
    got = np.exp(U11.roundtrip(logprobs).astype(np.float64)).sum(1)
    # (+1e-6: the decoded log-probs are float32, their mass is good to ~1e-7.)
    assert np.all(np.abs(got - mass) <= 1e-3 * np.minimum(mass, 1 - mass) + 1e-6)


def test_compact_bytes_per_token_at_248k():
    # Worst case for the id coding: uniformly random ids (a real teacher's cluster lower).
    rng = np.random.default_rng(1)
    ids, logprobs = _random_topk(rng, 256, 100, 248320)
    blob = encode_sample(ids, logprobs, 248320, U11)
    assert len(blob) / 256 <= 300, len(blob) / 256


def test_compact_loss_fidelity():
    """The forward KL from u11 log-probs is within 1e-3 relative of fp32 top-K values."""
    torch = pytest.importorskip("torch")
    g = torch.Generator().manual_seed(0)
    n, vocab_size, k = 256, 32768, 100
    teacher = torch.randn(n, vocab_size, generator=g) * torch.empty(n, 1).uniform_(1, 6,
                                                                                  generator=g)
    student = teacher + torch.randn(n, vocab_size, generator=g)
    t_lp, ids = torch.log_softmax(teacher, -1).topk(k, -1)
    s_lp = torch.log_softmax(student, -1).gather(-1, ids).double()

    def kl(lp):  # teacher top-K renormalised, student renormalised over the same ids
        p = torch.softmax(lp.double(), -1)
        return (p * (torch.log(p) - torch.log_softmax(s_lp, -1))).sum(-1).mean()

    ref = kl(t_lp)
    got = kl(torch.from_numpy(U11.roundtrip(t_lp.numpy())))
    assert abs(got - ref) / ref < 1e-3, (float(got), float(ref))


# --------------------------------------------------------------------------- format


def _spec(**over):
    kw = dict(teacher_checkpoint="/ckpt/teacher", teacher_weights_hash="w0", tokenizer="tok",
              vocab_size=248320, topk=8, seq_length=16, num_samples=10, dataset_hash="d0",
              samples_per_shard=4, logprob_codec=FP32)
    kw.update(over)
    return CacheSpec(**kw)


def _sample_data(spec, i):
    rng = np.random.default_rng(1000 + i)
    return _random_topk(rng, spec.seq_length, spec.topk, spec.vocab_size, near_top=1)


def _write_all(cache_dir, spec, shards=None):
    writer = CacheWriter(cache_dir, spec)
    for index in shards if shards is not None else range(spec.num_shards):
        start, end = spec.shard_range(index)
        blobs = [writer.encode(*_sample_data(spec, i)) for i in range(start, end)]
        # stand-in fingerprints: the indices
        writer.write_shard(index, blobs, list(range(start, end)))
    return writer


def test_spec_validation():
    with pytest.raises(ValueError, match="topk=9 exceeds vocab_size=8"):
        _spec(vocab_size=8, topk=9)
    with pytest.raises(ValueError, match="seq_length must be >= 1, got 0"):
        _spec(seq_length=0)


def test_write_read_roundtrip(tmp_path):
    spec = _spec()
    _write_all(tmp_path, spec)
    manifest = load_manifest(tmp_path)
    assert manifest["complete"] and manifest["format_version"] == 2
    assert [s["sample_start"] for s in manifest["shards"]] == [0, 4, 8]
    assert manifest["shards"][-1]["sample_end"] == 10
    reader = TopKCacheReader(tmp_path)
    order = [9, 0, 5, 5, 3]  # any order, across shards, repeats allowed
    ids, logprobs = reader.get(order)
    assert ids.shape == (5, 16, 8) and ids.dtype == np.int64 and logprobs.dtype == np.float32
    for row, i in enumerate(order):
        want_ids, want_lp = _sorted(*_sample_data(spec, i))
        np.testing.assert_array_equal(ids[row], want_ids)
        np.testing.assert_array_equal(logprobs[row], want_lp)
    assert ids.max() == spec.vocab_size - 1


def test_verify_and_info_import_neither_torch_nor_megatron(tmp_path):
    """``megatron-kd cache verify`` and ``info`` read files: they answer in a fraction of a
    second, without the seconds of importing torch and Megatron-Core (``build`` needs both)."""
    _write_all(tmp_path, _spec())
    code = ("import sys; from megatron_kd.cli import main; d = sys.argv[1]; "
            "assert main(['cache', 'verify', d]) == 0; "
            "assert main(['cache', 'info', d, '--json']) == 0; "
            "heavy = sorted({'torch', 'megatron.core'} & set(sys.modules)); "
            "assert not heavy, f'imported {heavy}'")
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True,
                          text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"{tmp_path}: OK" in proc.stdout and '"complete": true' in proc.stdout


def test_incomplete_cache_refused(tmp_path):
    spec = _spec()
    _write_all(tmp_path, spec, shards=[0, 2])
    with pytest.raises(CacheFormatError, match="1 of 3 shards not built"):
        TopKCacheReader(tmp_path)
    reader = TopKCacheReader(tmp_path, require_complete=False)
    reader.get([0, 9])
    with pytest.raises(CacheFormatError, match=r"samples \[4, 8\) are not in the cache"):
        reader.get([5])
    assert verify(tmp_path) == ["shard-000000004-000000008.bin (samples [4, 8)): not built"]


def test_manifest_is_deterministic_in_any_shard_order(tmp_path):
    spec = _spec()
    _write_all(tmp_path / "a", spec, shards=[0, 1, 2])
    _write_all(tmp_path / "b", spec, shards=[2, 0, 1])
    for name in ["manifest.json"] + [spec.shard_file(i) for i in range(3)]:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()


def test_other_spec_in_same_dir_refused(tmp_path):
    _write_all(tmp_path, _spec(), shards=[0])
    with pytest.raises(ValueError, match="topk: 8 != 9"):
        CacheWriter(tmp_path, _spec(topk=9))


def test_verify_reports_flipped_byte_with_shard_and_range(tmp_path):
    spec = _spec()
    _write_all(tmp_path, spec)
    assert verify(tmp_path) == []
    path = tmp_path / spec.shard_file(1)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))
    problems = verify(tmp_path)
    assert len(problems) == 1
    assert "shard-000000004-000000008.bin (samples [4, 8))" in problems[0]
    assert "sha256 mismatch" in problems[0]


def test_unknown_format_version_refused(tmp_path):
    _write_all(tmp_path, _spec(), shards=[0])
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    manifest["format_version"] = 99
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CacheFormatError, match="format_version 99 is not supported"):
        TopKCacheReader(tmp_path)


def test_format_version_1_refused_with_rebuild_advice(tmp_path):
    """Version 1 caches hold no token fingerprints: refused, naming the command that rebuilds."""
    _write_all(tmp_path, _spec(), shards=[0])
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    manifest["format_version"] = 1
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CacheFormatError, match=r"format_version 1 is not supported \(this reader: "
                                               r"2\): it holds no token fingerprints.*megatron-kd "
                                               r"cache build"):
        TopKCacheReader(tmp_path)


def test_token_fingerprints_round_trip(tmp_path):
    """Each shard's fingerprint table gives back what was written, by index and by value."""
    import torch

    from megatron_kd.cache.format import token_fingerprint
    from megatron_kd.cache.lookup import TokenLookup

    spec = _spec()
    writer = CacheWriter(tmp_path, spec)
    tokens = {i: np.arange(spec.seq_length) * (i + 3) % 1000 for i in range(spec.num_samples)}
    for index in range(spec.num_shards):
        start, end = spec.shard_range(index)
        blobs = [writer.encode(*_sample_data(spec, i)) for i in range(start, end)]
        writer.write_shard(index, blobs, [token_fingerprint(tokens[i]) for i in range(start, end)])
    reader = TopKCacheReader(tmp_path)
    table = reader.fingerprints()
    lookup = TokenLookup(reader, str(tmp_path))
    for i, row in tokens.items():
        assert reader.fingerprint(i) == token_fingerprint(row) == int(table[i])
        assert lookup.rows(torch.as_tensor(row)[None], str) == [(i, token_fingerprint(row))]
    with pytest.raises(ValueError, match=r"^row 0: the top-K cache .* holds no sample with its "
                                         r"tokens \[1, 2, 3, "):
        lookup.rows(torch.arange(1, spec.seq_length + 1)[None], lambda b: f"row {b}")
    # int64 little-endian bytes, whatever the input's dtype
    assert token_fingerprint(np.array([1, 2, 3], np.int32)) == token_fingerprint([1, 2, 3])
    assert token_fingerprint([1, 2, 3]) != token_fingerprint([1, 2, 4])
    assert verify(tmp_path) == []


@pytest.mark.parametrize("field, value, message", [
    ("dataset_hash", "other", "dataset_hash: cache has 'd0', this run has 'other'"),
    ("seq_length", 32, "seq_length: cache has 16, this run has 32"),
    ("vocab_size", 151936, "vocab_size: cache has 248320, this run has 151936"),
    ("tokenizer", "tok2", "tokenizer: cache has 'tok', this run has 'tok2'"),
    ("topk", 100, "topk: cache has 8, this run has 100"),
])
def test_check_compatible_names_both_values(tmp_path, field, value, message):
    spec = _spec()
    _write_all(tmp_path, spec, shards=[0])
    good = dict(dataset_hash="d0", seq_length=16, vocab_size=248320, tokenizer="tok", topk=8)
    check_compatible(load_manifest(tmp_path), **good)
    check_compatible(tmp_path, **good)
    with pytest.raises(ValueError, match=message):
        check_compatible(load_manifest(tmp_path), **{**good, field: value})


def test_prefetching_loader(tmp_path):
    spec = _spec()
    _write_all(tmp_path, spec)
    reader = TopKCacheReader(tmp_path)
    batches = [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]]
    with PrefetchingLoader(reader, batches, depth=2) as loader:
        got = list(loader)
    with PrefetchingLoader(reader, batches, depth=1, threads=3) as loader:
        for (ids, logprobs), (ids1, logprobs1) in zip(loader, got, strict=True):
            np.testing.assert_array_equal(ids, ids1)
            np.testing.assert_array_equal(logprobs, logprobs1)
    assert len(got) == 5
    for batch, (ids, logprobs) in zip(batches, got):
        want_ids, want_lp = reader.get(batch)
        np.testing.assert_array_equal(ids, want_ids)
        np.testing.assert_array_equal(logprobs, want_lp)
    with PrefetchingLoader(reader, [[0], [10]]) as loader:  # 10 is out of range
        next(loader)
        with pytest.raises(IndexError, match=r"sample 10 outside \[0, 10\)"):
            next(loader)
