"""The Megatron-Core layer: what touches Megatron-Core (its models, groups, checkpoints, attention
modules, schedules' loss-function contract), and nothing that does not need to.

* :mod:`~megatron_kd.integration.gpt` -- the one place Megatron-Core models are built.
* :mod:`~megatron_kd.integration.checkpoint` -- model checkpoints (``dist_checkpointing``);
  :mod:`~megatron_kd.integration.megatron_lm_checkpoint` -- a Megatron-LM ``torch_dist`` one.
* :mod:`~megatron_kd.integration.teacher` -- the frozen-teacher builder and its whole-sequence
  forward.
* :mod:`~megatron_kd.integration.output_layer` -- a ``GPTModel``'s final hidden states instead
  of its logits.
* :mod:`~megatron_kd.integration.loss_func` -- the fused loss as a Megatron-Core schedule's
  ``loss_func``.
* :mod:`~megatron_kd.integration.groups` -- ``torch.distributed`` and ``parallel_state`` of a
  :class:`~megatron_kd.parallel.ParallelLayout`.
* :mod:`~megatron_kd.integration.cpu_shim`, :mod:`~megatron_kd.integration.sdpa_attention`,
  :mod:`~megatron_kd.integration.context_parallel` -- Megatron-Core without a GPU, the SDPA core
  attention, the context-parallel attention.
* ``megatron_lm`` -- deprecated (one release): the old path of :mod:`megatron_kd.megatron_lm`.

This ``__init__`` re-exports what a Megatron-LM user calls; it imports Megatron-Core only
through the modules named.
"""

from megatron_kd.integration.loss_func import make_kd_loss_func
from megatron_kd.integration.output_layer import bypass_output_layer, output_layer_weight

__all__ = ["bypass_output_layer", "make_kd_loss_func", "output_layer_weight"]
