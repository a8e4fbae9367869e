"""``megatron-kd train`` flags: Megatron-LM's spelling for the student, data, optimisation and
logging, plus the ``--kd-*`` flags of :func:`megatron_kd.integration.args.add_kd_args`."""

from __future__ import annotations

import argparse

from megatron_kd.integration.args import add_kd_args
from megatron_kd.integration.groups import add_expert_parallel_args
from megatron_kd.training.hybrid_args import add_hybrid_args
from megatron_kd.training.metrics import add_metric_args

__all__ = ["add_arguments", "parse_args"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Megatron-LM-spelled student, data, optimisation and logging flags, plus ``--kd-*``."""
    _add_model_args(parser)
    _add_training_args(parser)
    _add_data_args(parser)
    _add_logging_args(parser)
    add_metric_args(parser)
    add_kd_args(parser)


def parse_args(argv: list[str]) -> argparse.Namespace:
    """Parse ``megatron-kd train`` flags (for in-process use and tests)."""
    parser = argparse.ArgumentParser(prog="megatron-kd train")
    add_arguments(parser)
    return parser.parse_args(argv)


def _add_model_args(parser: argparse.ArgumentParser) -> None:
    m = parser.add_argument_group("student model")
    m.add_argument("--num-layers", type=int, required=True)
    m.add_argument("--hidden-size", type=int, required=True)
    m.add_argument("--num-attention-heads", type=int, required=True)
    m.add_argument("--num-query-groups", type=int, default=None,
                   help="key/value heads (grouped-query attention); default: one per head")
    m.add_argument("--ffn-hidden-size", type=int, default=None, help="default: 4 x hidden size")
    m.add_argument("--kv-channels", type=int, default=None)
    m.add_argument("--seq-length", type=int, required=True)
    m.add_argument("--max-position-embeddings", type=int, default=None,
                   help="default: --seq-length")
    m.add_argument("--normalization", choices=("RMSNorm", "LayerNorm"), default="RMSNorm")
    m.add_argument("--norm-epsilon", type=float, default=1e-5)
    m.add_argument("--disable-swiglu", action="store_true", help="GeLU MLP instead of SwiGLU")
    m.add_argument("--position-embedding-type", choices=("rope", "learned_absolute", "none"),
                   default="rope")
    m.add_argument("--rotary-base", type=float, default=10000.0)
    m.add_argument("--untie-embeddings-and-output-weights", action="store_true",
                   help="separate output layer (default: tied to the input embedding)")
    m.add_argument("--add-bias-linear", action="store_true")
    m.add_argument("--init-method-std", type=float, default=0.02)
    m.add_argument("--hidden-dropout", type=float, default=0.0)
    m.add_argument("--attention-dropout", type=float, default=0.0)
    m.add_argument("--vocab-size", type=int, default=None,
                   help="true vocabulary (default: the teacher's, else the tokenizer's)")
    m.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    m.add_argument("--qk-layernorm", action="store_true",
                   help="normalise each query and key head before RoPE (Qwen3)")
    e = parser.add_argument_group("student model: mixture of experts")
    e.add_argument("--num-experts", type=int, default=None,
                   help="experts of every layer's MLP (default: a dense MLP)")
    e.add_argument("--moe-ffn-hidden-size", type=int, default=None,
                   help="hidden width of one expert (default: --ffn-hidden-size)")
    e.add_argument("--moe-router-topk", type=int, default=2, help="experts per token")
    e.add_argument("--moe-router-pre-softmax", action="store_true",
                   help="softmax over all experts before the top k (not renormalised)")
    e.add_argument("--moe-aux-loss-coeff", type=float, default=0.0,
                   help="weight of Megatron-Core's load-balancing auxiliary loss (0: none)")
    add_hybrid_args(parser)



def _add_training_args(parser: argparse.ArgumentParser) -> None:
    p = parser.add_argument_group("parallelism and precision")
    p.add_argument("--tensor-model-parallel-size", type=int, default=1)
    p.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    add_expert_parallel_args(p)
    p.add_argument("--use-distributed-optimizer", action="store_true",
                   help="Megatron-Core's distributed optimizer: optimizer state and fp32 main "
                        "weights sharded over the data-parallel ranks")
    p.add_argument("--bf16", action="store_true",
                   help="bf16 student parameters, fp32 main weights (GPU only: Megatron-Core's "
                        "mixed-precision optimizer requires CUDA tensors)")

    o = parser.add_argument_group("optimisation")
    o.add_argument("--micro-batch-size", type=int, required=True)
    o.add_argument("--global-batch-size", type=int, default=None,
                   help="default: micro batch x data-parallel size")
    o.add_argument("--train-iters", type=int, required=True)
    o.add_argument("--lr", type=float, default=3e-4)
    o.add_argument("--min-lr", type=float, default=0.0)
    o.add_argument("--lr-warmup-iters", type=int, default=0)
    o.add_argument("--lr-decay-iters", type=int, default=None, help="default: --train-iters")
    o.add_argument("--lr-decay-style", choices=("constant", "linear", "cosine",
                                                "inverse-square-root"), default="cosine")
    o.add_argument("--weight-decay", type=float, default=0.01)
    o.add_argument("--adam-beta1", type=float, default=0.9)
    o.add_argument("--adam-beta2", type=float, default=0.95)
    o.add_argument("--adam-eps", type=float, default=1e-8)
    o.add_argument("--clip-grad", type=float, default=1.0,
                   help="global gradient-norm clip (0 disables)")
    o.add_argument("--seed", type=int, default=1234)



def _add_data_args(parser: argparse.ArgumentParser) -> None:
    d = parser.add_argument_group("data")
    d.add_argument("--data-path", nargs="+", default=None,
                   help="indexed dataset prefix(es), optionally weighted: [W1] P1 [W2 P2 ...]")
    d.add_argument("--split", default="969,30,1", help="train,valid,test proportions")
    d.add_argument("--tokenizer-model", default=None,
                   help="Hugging Face tokenizer.json (or a directory holding one); default: "
                        "tokenizer.json in the --kd-teacher-load directory, if there is one")
    d.add_argument("--eod-token", default=None)
    d.add_argument("--data-cache-path", default=None)
    d.add_argument("--mock-data", action="store_true",
                   help="synthetic, learnable token sequences instead of --data-path")



def _add_logging_args(parser: argparse.ArgumentParser) -> None:
    c = parser.add_argument_group("checkpoints, evaluation, logging")
    c.add_argument("--save", default=None, help="checkpoint directory")
    c.add_argument("--load", default=None, help="resume from the newest checkpoint here")
    c.add_argument("--save-interval", type=int, default=None,
                   help="save every N iterations (and at the end) when --save is given")
    c.add_argument("--eval-interval", type=int, default=1000)
    c.add_argument("--eval-iters", type=int, default=10)
    c.add_argument("--log-json", default=None, help="one JSON line per step / evaluation")
    c.add_argument("--log-interval", type=int, default=1, help="progress-line refresh interval")
    c.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    c.add_argument("--exit-signal-handler", action="store_true",
                   help="on SIGTERM (Slurm's scancel and time limits) finish the current step, "
                        "save a checkpoint (with --save) and exit 0 (Megatron-LM's flag)")
    c.add_argument("--exit-after-iters", type=int, default=None,
                   help="stop (saving if --save) after this many iterations of this run; for "
                        "testing resumption")
