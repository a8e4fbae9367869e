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

import torch.distributed as dist

from megatron_kd.commands.startup import in_layout, started
from megatron_kd.training.run_checks import check_run
from megatron_kd.training.run_config import RunConfig, add_arguments, parse_args
from megatron_kd.training.trainer import Trainer

__all__ = ["add_arguments", "parse_args", "run", "train"]


def train(args: argparse.Namespace | RunConfig, *, loss_fn=None) -> dict:
    """Run a distillation (any ``--kd-mode``) of the parsed flags (or their
    :class:`~megatron_kd.training.run_config.RunConfig`); returns a summary dict (per-step
    records included).

    Starts as every command does (:func:`megatron_kd.commands.startup.started`), sets up
    Megatron's groups of the run's layout and tears them down after.
    ``loss_fn`` replaces the fused loss (same signature; for tests).
    """
    config = args if isinstance(args, RunConfig) else RunConfig.from_args(args)
    with started():
        run = check_run(config, dist.get_world_size())  # every check before any model is built
        with in_layout(run.layout):
            trainer = Trainer(config, run, loss_fn=loss_fn)
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
