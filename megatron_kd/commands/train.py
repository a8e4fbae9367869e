"""``megatron-kd train``: distil a student on Megatron-Core, with the teacher colocated,
disaggregated (a teacher service) or offline (a top-K cache).

Launch with ``torchrun`` (``RANK``/``WORLD_SIZE``/``MASTER_ADDR`` in the environment), as a single
process, or call :func:`train` in processes that already have ``torch.distributed`` initialised.
On a machine without a GPU the project's CPU shim is installed and gloo is used
(:mod:`megatron_kd.commands.startup`). The flags are
the typed sections of :mod:`megatron_kd.training.run_config`, the checks in
:mod:`megatron_kd.training.run_checks`, the teacher one of
:mod:`megatron_kd.modes`, the loop in :mod:`megatron_kd.training.trainer`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch.distributed as dist

from megatron_kd.commands.startup import in_layout, started
from megatron_kd.training.run_checks import check_run
from megatron_kd.training.run_config import RunConfig, add_arguments, parse_args
from megatron_kd.training.trainer import Trainer

__all__ = ["NOT_TAKEN", "add_arguments", "explain_unknown", "parse_args", "run", "train"]


#: Megatron-LM flags that configs carry and ``megatron-kd train`` does not take, with why and
#: what to give instead (docs/megatron_lm_flags.md lists them beside the ones it takes).
NOT_TAKEN: dict[str, str] = {
    "--async-save": "checkpoints are written synchronously and published only once every "
                    "rank's shards are on disk",
    "--reset-attention-mask": "the student would attend within each document while the "
                              "teacher attends over the whole sequence, so the KD targets "
                              "would not be the student's documents' (pretrain_gpt.py refuses "
                              "it with a KD term too)",
    "--use-mcore-models": "the models are always Megatron-Core's: drop it",
    "--swiglu": "SwiGLU is the default here (--disable-swiglu for GeLU): drop it",
    "--disable-bias-linear": "no linear biases is the default here (--add-bias-linear adds "
                             "them): drop it",
    "--group-query-attention": "grouped-query attention follows from --num-query-groups: drop "
                               "it",
    "--fp16": "fp16 training is not supported: --bf16 (GPU)",
    "--train-samples": "give --train-iters (steps of --global-batch-size samples)",
    "--lr-warmup-fraction": "give --lr-warmup-iters",
    "--tokenizer-type": "the tokenizer is a Hugging Face tokenizer.json: --tokenizer-model",
    "--vocab-file": "the tokenizer is a Hugging Face tokenizer.json: --tokenizer-model",
    "--merge-file": "the tokenizer is a Hugging Face tokenizer.json: --tokenizer-model",
    "--use-flash-attn": "the attention kernel is --attention-backend's (auto: SDPA on a GPU) or "
                        "Transformer Engine's",
    "--fp8-format": "fp8 training is not supported",
    "--distributed-backend": "NCCL on a GPU, gloo on the CPU, chosen by the machine",
    "--num-workers": "the samples are read on the training ranks",
    "--dataloader-type": "the samples are read in Megatron-LM's single order",
    "--train-data-path": "give --data-path and --split",
    "--valid-data-path": "give --data-path and --split",
    "--exit-interval": "give --exit-after-iters (iterations of this run)",
}
"""Megatron-LM flags ``megatron-kd train`` refuses, each with the reason."""

PRETRAIN_GPT_ROUTE = ("a Megatron-LM config's other flags run in Megatron-LM's own "
                      "pretrain_gpt.py with the --kd-* flags (docs/megatron_lm.md); the "
                      "Megatron-LM flags megatron-kd train takes: docs/megatron_lm_flags.md")


def explain_unknown(unknown: list[str]) -> str:
    """The error for flags ``megatron-kd train``'s parser does not know: each named, with why
    where it is a Megatron-LM flag this command does not take, and the ``pretrain_gpt.py``
    route."""
    flags = [a.split("=", 1)[0] for a in unknown if a.startswith("--")]
    lines = [f"{flag}: {NOT_TAKEN[flag]}" for flag in flags if flag in NOT_TAKEN]
    others = [flag for flag in flags if flag not in NOT_TAKEN]
    if others:
        lines.append(f"{', '.join(others)}: not a flag of megatron-kd train")
    if not flags:
        lines.append(f"unrecognized arguments: {' '.join(unknown)}")
    return ("megatron-kd train does not take " + (", ".join(flags) or "these arguments")
            + ":\n  " + "\n  ".join(lines) + "\n" + PRETRAIN_GPT_ROUTE)


def train(args: argparse.Namespace | RunConfig, *, loss_fn=None) -> dict:
    """Run a distillation (any ``--kd-mode``) of the parsed flags (or their
    :class:`~megatron_kd.training.run_config.RunConfig`); returns a summary dict (per-step
    records included).

    Starts as every command does (:func:`megatron_kd.commands.startup.started`), sets up
    Megatron's groups of the run's layout and tears them down after.
    ``loss_fn`` replaces the fused loss (same signature; for tests).
    """
    t0 = time.monotonic()  # --exit-duration-in-mins counts from here
    config = args if isinstance(args, RunConfig) else RunConfig.from_args(args)
    with started():
        run = check_run(config, dist.get_world_size())  # every check before any model is built
        with in_layout(run.layout):
            trainer = Trainer(config, run, loss_fn=loss_fn, started=t0)
            try:
                return trainer.fit()
            finally:
                trainer.close()


def run(args: argparse.Namespace) -> int:
    summary = train(args)
    if summary["rank"] != 0:
        return 0
    last_eval = summary.get("final_eval_lm_loss")
    print(json.dumps({k: summary[k] for k in ("iterations", "final_loss", "tokens_per_s",
                                              "wall_s")}
                     | {"final_eval_lm_loss": last_eval}), file=sys.stderr)
    return 0
