"""Colocated distillation training on Megatron-Core (``megatron-kd train``)."""
