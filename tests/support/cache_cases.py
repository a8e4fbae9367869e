"""A tiny deterministic torch teacher and the cache spec it builds, for the cache-build tests."""

import time
from pathlib import Path

import torch

from megatron_kd.cache.build import weights_hash
from megatron_kd.cache.codec import LogprobCodec
from megatron_kd.cache.format import CacheSpec

HIDDEN = 16


class TinyTeacher:
    """Deterministic: sample i's tokens come from a generator seeded with i.

    ``hold``: ``(path, sample)``: a forward that includes ``sample`` or a later one first
    writes ``path + ".reached"``, then waits while the file ``path`` exists (how a test parks a
    build at a known sample to kill it there; RuntimeError after 300 s)."""

    def __init__(self, vocab_size, padded_vocab, seq_length, seed=0, delay=0.0, hold=None):
        g = torch.Generator().manual_seed(seed)
        self.vocab_size, self.seq_length, self.delay = vocab_size, seq_length, delay
        self.hold = hold
        self.embedding = torch.randn(vocab_size, HIDDEN, generator=g)
        self.mix = torch.randn(HIDDEN, HIDDEN, generator=g) / HIDDEN ** 0.5
        self.output = torch.randn(padded_vocab, HIDDEN, generator=g)
        self.output[vocab_size - 10:vocab_size] *= 2.0  # ids near the top of the range
        self.output[vocab_size:] *= 10.0  # padding columns must never be selected

    def tokens(self, i):
        return torch.randint(self.vocab_size, (self.seq_length,),
                             generator=torch.Generator().manual_seed(10_000 + i))

    def sample_tokens(self, sample_indices):
        """``[b, s]`` the token ids of these samples (what ``build_cache`` fingerprints)."""
        return torch.stack([self.tokens(i) for i in sample_indices])

    def __call__(self, sample_indices):
        if self.delay:
            time.sleep(self.delay)
        if self.hold is not None and max(sample_indices) >= self.hold[1]:
            path = Path(self.hold[0])
            Path(f"{path}.reached").touch()
            deadline = time.monotonic() + 300
            while path.exists():
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{path} still held after 300 s")
                time.sleep(0.01)
        tokens = torch.stack([self.tokens(i) for i in sample_indices], dim=1)  # [s, b]
        return torch.tanh(self.embedding[tokens] @ self.mix) * 3.0  # [s, b, h]


def cache_spec(teacher, num_samples, topk, samples_per_shard, codec="fp32"):
    return CacheSpec(teacher_checkpoint="tiny", tokenizer="tiny-tok",
                     teacher_weights_hash=weights_hash([("output", teacher.output)]),
                     vocab_size=teacher.vocab_size, topk=topk, seq_length=teacher.seq_length,
                     num_samples=num_samples, dataset_hash="tiny-data",
                     samples_per_shard=samples_per_shard,
                     logprob_codec=LogprobCodec(name=codec))


def cache_files(path):
    return {p.name: p.read_bytes() for p in sorted(Path(path).iterdir()) if p.is_file()}
