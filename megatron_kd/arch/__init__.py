"""A GPT's architecture and its readers, pure Python (no torch, no Megatron): the planner, the
run checks, the trainer and the converters read the same description of a model.

* :mod:`~megatron_kd.arch.config` -- :class:`GPTArchConfig`, a decoder-only GPT independent of
  any parallel layout (JSON in checkpoints).
* :mod:`~megatron_kd.arch.hf_config` -- Hugging Face ``config.json`` <-> ``GPTArchConfig``, one
  class per model family, import and export together.
* :mod:`~megatron_kd.arch.layout` -- how a sequence splits over tensor-, sequence- and
  context-parallel ranks (the rule every command checks; the architecture's own rules are
  :class:`GPTArchConfig`'s ``check_*`` methods).
* :mod:`~megatron_kd.arch.megatron_lm_args` -- Megatron-LM's model flags, or the arguments a
  Megatron-LM checkpoint saved -> ``GPTArchConfig``.
"""

from megatron_kd.arch.config import GPTArchConfig
from megatron_kd.arch.layout import check_sequence_split, sequence_parts

__all__ = ["GPTArchConfig", "check_sequence_split", "sequence_parts"]
