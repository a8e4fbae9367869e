"""Vocabulary partitions: Megatron's padding rule and where a rank's shard sits.

A vocab-parallel output layer of ``padded_vocab_size`` rows is split into contiguous shards in
rank order (Megatron-Core splits it evenly; the loss and the top-K build also accept uneven
shards). Rows at or past the true ``vocab_size`` are padding: they exist in the weight but are
not tokens, so every softmax leaves them out. Pure arithmetic: the callers exchange the shard
sizes over their tensor-parallel group and hand them here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["MAKE_VOCAB_SIZE_DIVISIBLE_BY", "VocabShard", "pad_vocab_size", "vocab_shard"]

#: Megatron's ``--make-vocab-size-divisible-by`` default: the vocabulary is padded to a multiple
#: of this times the tensor-parallel size (``megatron-kd train``'s flag and the planner take it
#: from here).
MAKE_VOCAB_SIZE_DIVISIBLE_BY = 128


def pad_vocab_size(vocab_size: int, tp_size: int = 1,
                   multiple: int = MAKE_VOCAB_SIZE_DIVISIBLE_BY) -> int:
    """Smallest multiple of ``multiple * tp_size`` that is ``>= vocab_size`` (Megatron's rule)."""
    if vocab_size < 1 or tp_size < 1 or multiple < 1:
        raise ValueError(f"pad_vocab_size needs positive sizes, got vocab_size={vocab_size}, "
                         f"tp_size={tp_size}, multiple={multiple}")
    step = multiple * tp_size
    return -(-vocab_size // step) * step


@dataclass(frozen=True)
class VocabShard:
    """This rank's rows ``[vocab_start, vocab_end)`` of the global (padded) vocabulary."""

    vocab_start: int
    """Global id of the shard's first row."""

    vocab_end: int
    """One past the global id of the shard's last row."""

    local_valid: int
    """Rows of the shard that are real tokens (below ``vocab_size``); the rest are padding."""

    vocab_size: int
    """The true global vocabulary."""

    padded_vocab_size: int
    """Rows over all shards."""

    @property
    def local_vocab_size(self) -> int:
        """Rows of this shard, padding included."""
        return self.vocab_end - self.vocab_start


def vocab_shard(shard_sizes: Sequence[int], rank: int, vocab_size: int | None = None) -> VocabShard:
    """Where shard ``rank`` of contiguous shards of ``shard_sizes`` rows sits.

    ``vocab_size``: the true vocabulary (``None``: every row is a token); it may not exceed the
    rows of all shards together.
    """
    sizes = [int(n) for n in shard_sizes]
    if not 0 <= rank < len(sizes):
        raise ValueError(f"rank {rank} outside {len(sizes)} shard(s)")
    if any(n < 0 for n in sizes):
        raise ValueError(f"shard sizes must be >= 0, got {sizes}")
    padded = sum(sizes)
    vocab = padded if vocab_size is None else int(vocab_size)
    if vocab > padded:
        raise ValueError(f"vocab_size {vocab} > rows of the output layer over all shards "
                         f"{padded} (shard sizes {sizes})")
    start = sum(sizes[:rank])
    end = start + sizes[rank]
    valid = max(0, min(sizes[rank], vocab - start))
    return VocabShard(vocab_start=start, vocab_end=end, local_valid=valid, vocab_size=vocab,
                      padded_vocab_size=padded)
