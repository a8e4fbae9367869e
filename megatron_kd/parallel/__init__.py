"""Rank arithmetic and vocabulary partitions: pure Python, no Megatron, no process groups.

* :mod:`~megatron_kd.parallel.layout` -- a model's TP x DP x PP rank layout (Megatron-Core's
  order).
* :mod:`~megatron_kd.parallel.vocab` -- the padded vocabulary and each rank's shard of it.
"""

from megatron_kd.parallel.layout import Layout, check_parallel_sizes
from megatron_kd.parallel.vocab import VocabShard, pad_vocab_size, vocab_shard

__all__ = ["Layout", "VocabShard", "check_parallel_sizes", "pad_vocab_size", "vocab_shard"]
