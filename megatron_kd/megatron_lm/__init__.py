"""Distillation inside an existing Megatron-LM ``pretrain_gpt.py``: what the patches in
``patches/`` plug in (``import megatron_kd.megatron_lm as kd_lm``). Nothing else in the package
imports it.

* :mod:`~megatron_kd.megatron_lm.hooks` -- the entry points the patch names (``with_kd_args``,
  ``model_provider`` or ``add_kd_hooks``, ``forward_step``) and the loss function; re-exported
  here, the path a patched tree imports.
* :mod:`~megatron_kd.megatron_lm.teacher_side` -- the teacher's inputs from Megatron-LM's data
  iterator, and its statistics in Megatron-LM's writers.
* :mod:`~megatron_kd.megatron_lm.checks` -- Megatron-LM's flags checked or refused with
  ``--kd-*``, and Megatron-LM's NaN / spiky-loss checks on the KD loss.
* :mod:`~megatron_kd.megatron_lm.pretrained` -- ``--pretrained-checkpoint`` for this project's
  checkpoints.
"""

from megatron_kd.megatron_lm.hooks import (
    MEGATRON_LM_MAIN_COMMIT,
    MODEL_BUILDER_PATCH_FROM,
    PATCHES,
    PINNED_MEGATRON_LM_COMMIT,
    REPORT_NAMES,
    KDState,
    add_kd_hooks,
    extra_args_provider,
    forward_step,
    loss_func,
    model_provider,
    pre_wrap_hook,
    with_kd_args,
)

__all__ = [
    "MEGATRON_LM_MAIN_COMMIT",
    "MODEL_BUILDER_PATCH_FROM",
    "PATCHES",
    "PINNED_MEGATRON_LM_COMMIT",
    "REPORT_NAMES",
    "KDState",
    "add_kd_hooks",
    "extra_args_provider",
    "forward_step",
    "loss_func",
    "model_provider",
    "pre_wrap_hook",
    "with_kd_args",
]
