"""megatron_kd: knowledge distillation for Megatron-Core.

Sub-packages:

* :mod:`megatron_kd.loss` -- the fused vocab-parallel KD loss (never forms the logits).
* :mod:`megatron_kd.planner` -- closed-form memory and traffic models (no torch needed).
"""

__version__ = "0.1.0"
