"""Building a cache from a tiny torch teacher: reference parity, TP x DP builds, kill and resume.

Tiers: one process; 4 gloo ranks as 2 replicas x 2 TP ranks; a build subprocess killed with
SIGKILL mid-build and started again.
"""

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from megatron_kd.cache.build import build_cache, weights_hash
from megatron_kd.cache.codec import LogprobCodec
from megatron_kd.cache.format import CacheSpec, TopKCacheReader, load_manifest, verify
from megatron_kd.cache.topk import vocab_parallel_topk_logprobs

HIDDEN = 16


class TinyTeacher:
    """Deterministic: sample i's tokens come from a generator seeded with i."""

    def __init__(self, vocab_size, padded_vocab, seq_length, seed=0, delay=0.0):
        g = torch.Generator().manual_seed(seed)
        self.vocab_size, self.seq_length, self.delay = vocab_size, seq_length, delay
        self.embedding = torch.randn(vocab_size, HIDDEN, generator=g)
        self.mix = torch.randn(HIDDEN, HIDDEN, generator=g) / HIDDEN ** 0.5
        self.output = torch.randn(padded_vocab, HIDDEN, generator=g)
        self.output[vocab_size - 10:vocab_size] *= 2.0  # ids near the top of the range
        self.output[vocab_size:] *= 10.0  # padding columns must never be selected

    def tokens(self, i):
        return torch.randint(self.vocab_size, (self.seq_length,),
                             generator=torch.Generator().manual_seed(10_000 + i))

    def __call__(self, sample_indices):
        if self.delay:
            time.sleep(self.delay)
        tokens = torch.stack([self.tokens(i) for i in sample_indices], dim=1)  # [s, b]
        return torch.tanh(self.embedding[tokens] @ self.mix) * 3.0  # [s, b, h]


def _spec(teacher, num_samples, topk, samples_per_shard, codec="fp32"):
    return CacheSpec(teacher_checkpoint="tiny", tokenizer="tiny-tok",
                     teacher_weights_hash=weights_hash([("output", teacher.output)]),
                     vocab_size=teacher.vocab_size, topk=topk, seq_length=teacher.seq_length,
                     num_samples=num_samples, dataset_hash="tiny-data",
                     samples_per_shard=samples_per_shard,
                     logprob_codec=LogprobCodec(name=codec))


def _files(path):
    return {p.name: p.read_bytes() for p in sorted(Path(path).iterdir()) if p.is_file()}


def test_build_matches_reference_large_vocab(tmp_path):
    # Above Megatron's 131,072 limit; the reader returns each token's entries by ascending id.
    teacher = TinyTeacher(vocab_size=150_001, padded_vocab=150_016, seq_length=8)
    spec = _spec(teacher, num_samples=5, topk=20, samples_per_shard=2)
    stats = build_cache(str(tmp_path), spec, teacher_forward_fn=teacher,
                        output_weight=teacher.output, micro_batch_size=2, window_size=5)
    assert stats.shards_written == [0, 1, 2] and stats.tokens == 40
    assert verify(tmp_path) == []
    reader = TopKCacheReader(tmp_path)
    ids, logprobs = reader.get(range(5))
    ref_ids, ref_lp = vocab_parallel_topk_logprobs(
        teacher(list(range(5))), teacher.output, 20, vocab_size=150_001)
    ref_ids, ref_lp = ref_ids.transpose(0, 1).numpy(), ref_lp.transpose(0, 1).numpy()  # [b, s, K]
    order = np.argsort(ref_ids, axis=-1)
    np.testing.assert_array_equal(ids, np.take_along_axis(ref_ids, order, -1))
    # Other window and batch shapes than the reference's matmul: a few ulps of |logprob| <= 30.
    np.testing.assert_allclose(logprobs, np.take_along_axis(ref_lp, order, -1), rtol=2e-6,
                               atol=1e-5)
    assert ids.max() >= 150_001 - 10
    # Resume of a complete cache: nothing to do.
    again = build_cache(str(tmp_path), spec, teacher_forward_fn=teacher,
                        output_weight=teacher.output)
    assert again.shards_written == [] and again.shards_skipped == [0, 1, 2]


def test_resume_after_torn_writes_is_byte_identical(tmp_path):
    """The states a kill can leave: a partial temp file, a renamed shard not yet in the manifest."""
    teacher = TinyTeacher(vocab_size=1009, padded_vocab=1009, seq_length=6)
    spec = _spec(teacher, num_samples=7, topk=11, samples_per_shard=2, codec="log1p-u11")
    build_cache(str(tmp_path / "ref"), spec, teacher_forward_fn=teacher,
                output_weight=teacher.output)
    ref = _files(tmp_path / "ref")

    torn = tmp_path / "torn"
    build_cache(str(torn), spec, teacher_forward_fn=lambda idx: teacher(idx),
                output_weight=teacher.output, dp_rank=0, dp_world_size=2)  # shards 0 and 2
    (torn / f".{spec.shard_file(1)}.tmp.999").write_bytes(b"partial")
    (torn / ".manifest.json.tmp.999").write_bytes(b"{partial")
    (torn / spec.shard_file(3)).write_bytes(ref[spec.shard_file(3)])  # renamed, not recorded
    assert len(load_manifest(torn)["shards"]) == 2
    build_cache(str(torn), spec, teacher_forward_fn=teacher, output_weight=teacher.output)
    assert _files(torn) == ref


# --------------------------------------------------------------------------- 2 replicas x TP 2


def _tp_dp_groups(ctx):
    if "tp_dp" not in ctx.state:
        # new_group is collective over the world: every rank creates both, in the same order.
        groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        ctx.state["tp_dp"] = groups
    return ctx.state["tp_dp"][ctx.rank // 2]


def _case_build_tp_dp(ctx, cache_dir, spec):
    tp_group = _tp_dp_groups(ctx)
    tp_rank = dist.get_rank(tp_group)
    # Padded to a multiple of TP 2: shards of 505 columns, the last one with 1 padding column.
    teacher = TinyTeacher(vocab_size=1009, padded_vocab=1010, seq_length=6)
    shard = teacher.output[505 * tp_rank:505 * (tp_rank + 1)]
    stats = build_cache(cache_dir, spec, teacher_forward_fn=teacher, output_weight=shard,
                        micro_batch_size=2, window_size=4, tp_group=tp_group,
                        dp_rank=ctx.rank // 2, dp_world_size=2)
    dist.barrier()
    return stats.shards_written


def test_tp2_dp2_build_matches_single_process(dist_pool_factory, tmp_path):
    teacher = TinyTeacher(vocab_size=1009, padded_vocab=1010, seq_length=6)
    spec = _spec(teacher, num_samples=9, topk=30, samples_per_shard=2)
    build_cache(str(tmp_path / "one"), spec, teacher_forward_fn=teacher,
                output_weight=teacher.output)
    pool = dist_pool_factory(4)
    written = pool.run(_case_build_tp_dp, str(tmp_path / "tp_dp"), spec)
    assert written == [[0, 2, 4], [0, 2, 4], [1, 3], [1, 3]]
    assert verify(tmp_path / "tp_dp") == []
    one, tp_dp = TopKCacheReader(tmp_path / "one"), TopKCacheReader(tmp_path / "tp_dp")
    ids1, lp1 = one.get(range(9))
    ids2, lp2 = tp_dp.get(range(9))
    np.testing.assert_array_equal(ids2, ids1)
    # Sharded vs whole-matrix fp32 projections and log-sum-exp: a few ulps of |logprob| <= 30.
    np.testing.assert_allclose(lp2, lp1, rtol=2e-6, atol=1e-5)
    # And a second distributed build is byte-identical to the first.
    pool.run(_case_build_tp_dp, str(tmp_path / "tp_dp2"), spec)
    assert _files(tmp_path / "tp_dp2") == _files(tmp_path / "tp_dp")


# --------------------------------------------------------------------------- SIGKILL and resume

_BUILD_SCRIPT = """
import sys
sys.path.insert(0, {tests!r})
from test_cache_build import TinyTeacher, _spec
from megatron_kd.cache.build import build_cache
teacher = TinyTeacher(vocab_size=1009, padded_vocab=1009, seq_length=12, delay={delay})
spec = _spec(teacher, num_samples=16, topk=25, samples_per_shard=2, codec="log1p-u11")
build_cache({out!r}, spec, teacher_forward_fn=teacher, output_weight=teacher.output)
print("done")
"""


def _run_build(out, delay):
    script = _BUILD_SCRIPT.format(tests=str(Path(__file__).parent), out=str(out), delay=delay)
    return subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_sigkill_mid_build_then_resume_is_byte_identical(tmp_path):
    teacher = TinyTeacher(vocab_size=1009, padded_vocab=1009, seq_length=12)
    spec = _spec(teacher, num_samples=16, topk=25, samples_per_shard=2, codec="log1p-u11")
    build_cache(str(tmp_path / "ref"), spec, teacher_forward_fn=teacher,
                output_weight=teacher.output)
    ref = _files(tmp_path / "ref")

    out = tmp_path / "killed"
    proc = _run_build(out, delay=0.25)  # >= 0.5 s per shard of 2 samples: 3 s of margin to kill
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        if (out / "manifest.json").exists() and len(load_manifest(out)["shards"]) >= 2:
            break
        time.sleep(0.01)
    time.sleep(random.Random(0).uniform(0.0, 0.5))  # somewhere inside a later shard
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    partial = len(load_manifest(out)["shards"])
    assert 2 <= partial < spec.num_shards, partial

    proc = _run_build(out, delay=0.0)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr.decode()
    assert _files(out) == ref
    assert not [p for p in out.iterdir() if ".tmp." in p.name]
