"""A GPT's architecture, its readers and its layout rules, pure Python (no torch, no Megatron):
the planner, the run checks, the trainer and the converters read the same description of a
model and hold it to the same rules.

* :mod:`~megatron_kd.arch.config` -- :class:`GPTArchConfig`, a decoder-only GPT independent of
  any parallel layout (JSON in checkpoints).
* :mod:`~megatron_kd.arch.layout` -- :func:`check_layout`: every rule of which
  :class:`~megatron_kd.parallel.ParallelLayout` a model can run with, by :class:`Role`.
* :mod:`~megatron_kd.arch.hf_config` -- Hugging Face ``config.json`` <-> ``GPTArchConfig``, one
  class per model family, import and export together.
* :mod:`~megatron_kd.arch.megatron_lm_args` -- Megatron-LM's model flags, or the arguments a
  Megatron-LM checkpoint saved -> ``GPTArchConfig``.
"""

from megatron_kd.arch.config import GPTArchConfig
from megatron_kd.arch.layout import Role, check_layout, context_parallel_limit

__all__ = ["GPTArchConfig", "Role", "check_layout", "context_parallel_limit"]
