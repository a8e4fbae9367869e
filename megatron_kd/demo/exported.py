"""The demo's last step: each trained student exported (``megatron-kd export-hf``), loaded by
transformers, scored on the held-out samples the trainer evaluated, and asked to continue one.

transformers' loss on those samples is the trainer's final validation LM loss (both fp32; the
sums run in another order), so the table shows the exported model is the trained one.
"""

from __future__ import annotations

import os
import shutil

import torch

from megatron_kd.commands.train import parse_args
from megatron_kd.data.datasets import BatchPlan
from megatron_kd.data.tokenizer import HFTokenizer
from megatron_kd.hf.exporter import export_hf
from megatron_kd.training.run_checks import build_datasets
from megatron_kd.training.run_config import RunConfig

__all__ = ["ExportedStudent", "export_and_score", "held_out_microbatches", "lm_loss"]


def held_out_microbatches(argv: list[str]) -> list[dict]:
    """The validation samples each evaluation of ``megatron-kd train argv`` reads (every
    data-parallel rank's share), as microbatches of ``--micro-batch-size``. Builds the run's
    datasets (collective when ``torch.distributed`` is initialised)."""
    config = RunConfig.from_args(parse_args(argv))
    data, mbs = config.data, config.optimizer.micro_batch_size
    if data.mock_data or data.global_batch_size is None:
        raise ValueError("held-out samples: give --data-path and --global-batch-size")
    gbs = data.global_batch_size
    _, valid = build_datasets(data, 0, HFTokenizer(data.tokenizer_model), gbs)
    plan = BatchPlan(gbs, mbs, dp_rank=0, dp_size=1)  # all of each evaluation's samples
    return [mb for i in range(data.eval_iters) for mb in plan.microbatches(valid, i * gbs)]


def lm_loss(model, microbatches: list[dict]) -> tuple[float, int]:
    """``(mean cross-entropy over the loss-masked tokens, their count)`` of a transformers
    causal LM, accumulated in fp64 as the trainer does (a sum and a count)."""
    total = count = 0.0
    with torch.no_grad():
        for mb in microbatches:
            logits = model(mb["tokens"]).logits.float()
            nll = torch.nn.functional.cross_entropy(logits.flatten(0, 1), mb["labels"].flatten(),
                                                    reduction="none")
            mask = mb["loss_mask"].flatten().double()
            total += float((nll.double() * mask).sum())
            count += float(mask.sum())
    return total / count, int(count)


class ExportedStudent(dict):
    """``{"path", "lm_loss", "tokens", "continuation"}`` (a dict: it goes into results.json)."""


def export_and_score(checkpoint: str, out_dir: str, microbatches: list[dict], *,
                     prompt: list[int], new_tokens: int = 16) -> ExportedStudent:
    """Export ``checkpoint`` to ``out_dir`` (replacing it), load it with transformers, score
    ``microbatches`` and continue ``prompt`` greedily by ``new_tokens`` tokens (decoded with the
    tokenizer the export carries)."""
    from transformers import AutoModelForCausalLM  # optional: the demo and test extras
    from transformers.utils import logging as hf_logging  # the same

    if os.path.isdir(out_dir):
        shutil.rmtree(out_dir)
    export_hf(checkpoint, out_dir)
    hf_logging.disable_progress_bar()  # its "Loading weights" bar, in the demo's output
    model = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32).eval()
    loss, tokens = lm_loss(model, microbatches)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False,
                             min_new_tokens=new_tokens, pad_token_id=0)
    tokenizer = HFTokenizer(out_dir)
    return ExportedStudent(path=out_dir, lm_loss=loss, tokens=tokens,
                           continuation=tokenizer.detokenize(out[0, len(prompt):].tolist()))
