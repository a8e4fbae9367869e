"""Everything that touches Megatron-Core or Megatron-LM, and nothing that does not need to.

* :mod:`~megatron_kd.integration.args` -- the ``--kd-*`` flags (:func:`add_kd_args`,
  :class:`KDArgs`), for ``megatron-kd train`` and Megatron-LM's parser alike.
* :mod:`~megatron_kd.integration.gpt` -- the one place Megatron-Core models are built.
* :mod:`~megatron_kd.integration.checkpoint` -- model checkpoints (``dist_checkpointing``).
* :mod:`~megatron_kd.integration.teacher` -- the frozen-teacher builder.
* :mod:`~megatron_kd.integration.output_layer` -- final hidden states instead of logits.
* :mod:`~megatron_kd.integration.loss_func` -- the fused loss as Megatron's ``loss_func``.
* :mod:`~megatron_kd.integration.groups` -- ``torch.distributed`` and ``parallel_state`` set-up.
* :mod:`~megatron_kd.integration.cpu_shim` -- Megatron-Core on a machine without a GPU.
* ``megatron_lm`` -- deprecated (one release): the old path of :mod:`megatron_kd.megatron_lm`.

This ``__init__`` re-exports what a Megatron-LM user calls; it imports Megatron-Core only
through the modules named.
"""

from megatron_kd.integration.args import KDArgs, add_kd_args
from megatron_kd.integration.loss_func import make_kd_loss_func
from megatron_kd.integration.output_layer import bypass_output_layer, output_layer_weight

__all__ = ["KDArgs", "add_kd_args", "bypass_output_layer", "make_kd_loss_func",
           "output_layer_weight"]
