"""The offline path at the loss level: the fused loss fed from a cache equals the loss fed from
the teacher itself (K = V: the dense teacher; K < V: the in-memory top-K teacher), the compact
encoding stays within 1e-3 relative, and a cache that does not match the run is refused.

No process group (the TP parity of the top-K itself is in test_cache_topk.py).
"""

import numpy as np
import pytest
import torch

from megatron_kd.cache.build import build_cache
from megatron_kd.cache.codec import LogprobCodec
from megatron_kd.cache.format import CacheSpec
from megatron_kd.cache.identity import (
    dataset_identity,
    open_cache_for_run,
    tokenizer_identity,
)
from megatron_kd.cache.loader import topk_batch
from megatron_kd.cache.reader import TopKCacheReader
from megatron_kd.cache.topk import vocab_parallel_topk_logprobs
from megatron_kd.cache.writer import CacheWriter
from megatron_kd.data.datasets import MockGPTDataset
from megatron_kd.data.tokenizer import MockTokenizer
from megatron_kd.loss import DenseTeacher, KDLossConfig, TopKTeacher, vocab_parallel_kd_loss
from megatron_kd.planner import memory

VOCAB, PADDED, SEQ, SAMPLES, H_T, H_S = 257, 264, 10, 4, 24, 16


def _setup(seed=0):
    g = torch.Generator().manual_seed(seed)
    teacher_hidden = torch.randn(SEQ, SAMPLES, H_T, generator=g) * 2.0  # [s, b, h]
    teacher_weight = torch.randn(PADDED, H_T, generator=g)
    student_hidden = torch.randn(SEQ, SAMPLES, H_S, generator=g)
    student_weight = torch.randn(PADDED, H_S, generator=g) * 0.5
    return teacher_hidden, teacher_weight, student_hidden, student_weight


def _build(tmp_path, name, k, codec, teacher_hidden, teacher_weight):
    dataset = MockGPTDataset(vocab_size=VOCAB, seq_length=SEQ, num_samples=SAMPLES, seed=1)
    spec = CacheSpec(teacher_checkpoint="t", teacher_weights_hash="h",
                     tokenizer=tokenizer_identity(MockTokenizer(VOCAB)), vocab_size=VOCAB,
                     topk=k, seq_length=SEQ, num_samples=SAMPLES,
                     dataset_hash=dataset_identity(dataset), samples_per_shard=3,
                     logprob_codec=LogprobCodec(name=codec))
    build_cache(str(tmp_path / name), spec,
                teacher_forward_fn=lambda idx: teacher_hidden[:, idx[0]:idx[-1] + 1],
                sample_tokens_fn=lambda idx: torch.stack(
                    [torch.as_tensor(dataset[i]["tokens"]) for i in idx]),
                output_weight=teacher_weight, micro_batch_size=2, window_size=7)
    return open_cache_for_run(tmp_path / name, dataset=dataset, tokenizer=MockTokenizer(VOCAB),
                              seq_length=SEQ, vocab_size=VOCAB, num_samples=SAMPLES, topk=k)


def _loss(student_hidden, student_weight, teacher, tail="renormalize"):
    hidden = student_hidden.clone().requires_grad_(True)
    weight = student_weight.clone().requires_grad_(True)
    config = KDLossConfig(vocab_size=VOCAB, topk_tail=tail, window_size=9)
    loss, _ = vocab_parallel_kd_loss(hidden, weight, teacher, config=config)
    loss.backward()
    return loss.detach(), hidden.grad, weight.grad


def test_full_vocab_cache_equals_dense_teacher(tmp_path):
    t_h, t_w, s_h, s_w = _setup()
    reader = _build(tmp_path, "full", VOCAB, "fp32", t_h, t_w)
    ids, logprobs = topk_batch(reader, range(SAMPLES))
    assert ids.shape == (SEQ, SAMPLES, VOCAB)
    offline = _loss(s_h, s_w, TopKTeacher(ids=ids, logprobs=logprobs))
    dense = _loss(s_h, s_w, DenseTeacher(hidden=t_h, weight=t_w))
    # fp32 throughout; the same distribution summed in another order (K = V entries), and the
    # cached log-probs sum to 1 only to fp32 rounding, which the renormalisation carries into
    # the gradients (entries of order 1: 1e-5 absolute).
    for got, want in zip(offline, dense):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tail", ["renormalize", "ghost"])
def test_topk_cache_equals_in_memory_topk_teacher(tmp_path, tail):
    t_h, t_w, s_h, s_w = _setup(1)
    reader = _build(tmp_path, "k20", 20, "fp32", t_h, t_w)
    ids, logprobs = topk_batch(reader, range(SAMPLES))
    mem_ids, mem_logprobs = vocab_parallel_topk_logprobs(t_h, t_w, 20, vocab_size=VOCAB)
    offline = _loss(s_h, s_w, TopKTeacher(ids=ids, logprobs=logprobs), tail)
    online = _loss(s_h, s_w, TopKTeacher(ids=mem_ids, logprobs=mem_logprobs), tail)
    # Same K entries per token stored by id instead of by value: summation order only (the
    # gradients, of order 1, hold differences of nearly equal probabilities: 1e-5 absolute).
    for got, want in zip(offline, online):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tail", ["renormalize", "ghost"])
def test_compact_encoding_loss_within_1e3(tmp_path, tail):
    t_h, t_w, s_h, s_w = _setup(2)
    exact = topk_batch(_build(tmp_path, "fp32", 100, "fp32", t_h, t_w), range(SAMPLES))
    compact = topk_batch(_build(tmp_path, "u11", 100, "log1p-u11", t_h, t_w), range(SAMPLES))
    torch.testing.assert_close(compact[0], exact[0], rtol=0, atol=0)  # ids are lossless
    want = _loss(s_h, s_w, TopKTeacher(ids=exact[0], logprobs=exact[1]), tail)[0]
    got = _loss(s_h, s_w, TopKTeacher(ids=compact[0], logprobs=compact[1]), tail)[0]
    assert abs(float(got) - float(want)) / float(want) < 1e-3, (float(got), float(want))


def test_mismatched_cache_refused_naming_both_values(tmp_path):
    t_h, t_w, _, _ = _setup()
    _build(tmp_path, "c", 8, "fp32", t_h, t_w)
    dataset = MockGPTDataset(vocab_size=VOCAB, seq_length=SEQ, num_samples=SAMPLES, seed=1)
    good = dict(dataset=dataset, tokenizer=MockTokenizer(VOCAB), seq_length=SEQ,
                vocab_size=VOCAB, num_samples=SAMPLES)
    other_seed = MockGPTDataset(vocab_size=VOCAB, seq_length=SEQ, num_samples=SAMPLES, seed=2)
    cases = [
        (dict(dataset=other_seed), f"dataset_hash: cache has '{dataset_identity(dataset)}', "
                                   f"this run has '{dataset_identity(other_seed)}'"),
        (dict(seq_length=12), "seq_length: cache has 10, this run has 12"),
        (dict(vocab_size=300), "vocab_size: cache has 257, this run has 300"),
        (dict(tokenizer=MockTokenizer(300)), "tokenizer: cache has .*257.*this run has .*300"),
        (dict(num_samples=5), "num_samples: cache has 4, this run reads 5"),
    ]
    for override, message in cases:
        with pytest.raises(ValueError, match=message):
            open_cache_for_run(tmp_path / "c", **{**good, **override})


def test_planner_counts_the_decoded_entries_the_loader_hands_the_trainer(tmp_path):
    # the planner (torch-free) counts a decoded top-K entry's bytes: what topk_batch makes
    # a one-sample cache, read back as the trainer reads it (torch tensors, [s, b, K])
    seq_length, topk, vocab_size = 5, 3, 50
    spec = CacheSpec(teacher_checkpoint="t", teacher_weights_hash="w", tokenizer="tok",
                     vocab_size=vocab_size, topk=topk, seq_length=seq_length, num_samples=1,
                     dataset_hash="d", samples_per_shard=1,
                     logprob_codec=LogprobCodec(name="fp32"))
    writer = CacheWriter(tmp_path, spec)
    ids = np.tile(np.arange(topk), (seq_length, 1))
    logprobs = np.full((seq_length, topk), -np.log(topk), dtype=np.float32)
    writer.write_shard(0, [writer.encode(ids, logprobs)], [0])
    got_ids, got_logprobs = topk_batch(TopKCacheReader(tmp_path), [0])
    entry = got_ids.element_size() + got_logprobs.element_size()
    assert entry == memory.DECODED_TOPK_ENTRY_BYTES
    assert got_ids.nbytes + got_logprobs.nbytes == memory.cache_reader_bytes(seq_length, 1, topk)
