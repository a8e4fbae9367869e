"""Partition arithmetic: pure Python, no Megatron, no process groups.

* :mod:`~megatron_kd.parallel.layout` -- :class:`ParallelLayout`, how one model is split over
  GPUs (tensor, pipeline with virtual stages, context, expert, data parallelism, sequence
  parallelism, recompute): the one layout type every command builds once from its flags.
* :mod:`~megatron_kd.parallel.vocab` -- the padded vocabulary and each rank's shard of it.
* :mod:`~megatron_kd.parallel.sequence` -- how a sequence splits over context- and
  sequence-parallel ranks, and which positions each rank holds.
* :mod:`~megatron_kd.parallel.windows` -- how the fused loss cuts its rows into windows.
"""

from megatron_kd.parallel.layout import ParallelLayout
from megatron_kd.parallel.vocab import VocabShard, pad_vocab_size, vocab_shard

__all__ = ["ParallelLayout", "VocabShard", "pad_vocab_size", "vocab_shard"]
