"""``megatron-kd train``: distillation of a student on Megatron-Core (colocated, disaggregated
or offline teacher).

Student and teacher are Megatron-Core ``GPTModel``s. The student trains with Megatron-Core's
DDP, optimizer and pipeline schedule (``get_forward_backward_func``); the teacher is frozen
(eval mode, ``requires_grad=False``, no optimizer state, no DDP buffers). Neither runs its
output layer: both return their final hidden states (after the final norm), which go with the
output-layer shards into :func:`megatron_kd.loss.vocab_parallel_kd_loss`, so the
``[tokens, vocab]`` logits never exist.

Teacher placement under student pipeline parallelism
----------------------------------------------------
The loss runs on the student's last pipeline stage, so the teacher's final hidden states are
needed there. The teacher is **not pipelined**: every rank of the student's last stage holds the
*whole* teacher (all its layers), tensor-parallel over the same TP group as the student (so the
two output layers share one vocabulary partition), and runs it on the same microbatch inside
the last stage's forward step. Nothing about the teacher crosses a pipeline boundary: no extra
point-to-point traffic, no schedule changes, and the teacher's forward overlaps the pipeline
bubble of the last stage. The price is memory: the last stage holds a full (TP-sharded) teacher.
(Every rank builds and loads the teacher, since loading is collective; ranks that are not on the
last stage free it before training.) For a teacher too large for one stage, a disaggregated
teacher (``--kd-mode disaggregated``) is the answer.

Offline teacher (``--kd-mode offline --kd-topk-cache DIR``)
----------------------------------------------------------
No teacher model is built or loaded. A cache made by ``megatron-kd cache build`` holds the
teacher's top-K ids and log-probs of every training sample; :func:`plan_run` refuses a cache
made for other data, sequence length, vocabulary or tokenizer, and the student's vocabulary is
the cache's. On the last pipeline stage a background thread decodes each rank's microbatches
(by dataset sample index, so any DP / TP / micro-batch layout reads the same cache) ahead of the
step, and the loss takes them as a sparse teacher (``forward_kl`` only). Evaluation reports the
student's cross-entropy only (the cache does not cover the validation samples).

Launch with ``torchrun`` (``RANK``/``WORLD_SIZE``/``MASTER_ADDR`` in the environment), as a single
process, or call :func:`train` in processes that already have ``torch.distributed`` initialised.
On a machine without a GPU the project's CPU shim is installed and gloo is used.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from megatron_kd.integration import (
    KDArgs,
    add_kd_args,
    bypass_output_layer,
    make_kd_loss_func,
    output_layer_weight,
    to_sbh,
)
from megatron_kd.megatron_cpu import device_context, install_cpu_shim, on_cpu
from megatron_kd.models import GPTArchConfig, pad_vocab_size


# ----------------------------------------------------------------------------------------------
# arguments
# ----------------------------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Megatron-LM-spelled student, data, optimisation and logging flags, plus ``--kd-*``."""
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

    p = parser.add_argument_group("parallelism and precision")
    p.add_argument("--tensor-model-parallel-size", type=int, default=1)
    p.add_argument("--pipeline-model-parallel-size", type=int, default=1)
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
    c.add_argument("--exit-after-iters", type=int, default=None,
                   help="stop (saving if --save) after this many iterations of this run; for "
                        "testing resumption")
    add_kd_args(parser)


def parse_args(argv: list[str]) -> argparse.Namespace:
    """Parse ``megatron-kd train`` flags (for in-process use and tests)."""
    parser = argparse.ArgumentParser(prog="megatron-kd train")
    add_arguments(parser)
    return parser.parse_args(argv)


# ----------------------------------------------------------------------------------------------
# validation (all before any model is built or any step runs)
# ----------------------------------------------------------------------------------------------
@dataclass
class Plan:
    """Everything resolved from the flags."""

    kd: KDArgs
    student_arch: GPTArchConfig
    teacher_arch: GPTArchConfig | None
    tokenizer: Any
    tp: int
    pp: int
    dp: int
    global_batch_size: int
    params_dtype: torch.dtype
    notes: list[str] = field(default_factory=list)
    topk_cache: Any = None
    """Offline mode: the opened, checked top-K cache (a ``TopKCacheReader``)."""
    datasets: tuple | None = None
    """Offline mode: ``(train, valid)``, built once by :func:`plan_run` to check the cache."""


def _positive(args, *names):
    for name in names:
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")


def plan_run(args: argparse.Namespace, world_size: int) -> Plan:
    """Validate the flags against each other, the teacher checkpoint and the data; raise
    ``ValueError`` with the offending values. Reads only small files (JSON, tokenizer,
    checkpoint metadata)."""
    from megatron_kd.data.datasets import check_data_prefixes, parse_data_path
    from megatron_kd.data.tokenizer import (
        HFTokenizer,
        MockTokenizer,
        tokenizer_difference,
    )
    from megatron_kd.models import (
        check_checkpoint_tensors,
        read_checkpoint_arch,
        read_checkpoint_extra,
    )
    from megatron_kd.training.checkpointing import resolve_model_dir
    from megatron_kd.training.parallel import check_parallel_sizes

    kd = KDArgs.from_args(args)
    _positive(args, "num_layers", "hidden_size", "num_attention_heads", "seq_length",
              "micro_batch_size", "train_iters", "tensor_model_parallel_size",
              "pipeline_model_parallel_size", "eval_interval", "log_interval")
    if args.eval_iters < 0:
        raise ValueError(f"--eval-iters must be >= 0, got {args.eval_iters}")
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    if kd.mode == "disaggregated":  # the student's ranks are the world less the teacher's
        if world_size <= kd.teacher_world_size:
            raise ValueError(f"--kd-teacher-world-size {kd.teacher_world_size} leaves no student "
                             f"ranks in a world of {world_size}")
        world_size -= kd.teacher_world_size
    dp = check_parallel_sizes(world_size, tp, pp)
    gbs = args.global_batch_size or args.micro_batch_size * dp
    if gbs % (args.micro_batch_size * dp):
        raise ValueError(f"--global-batch-size {gbs} is not divisible by --micro-batch-size "
                         f"{args.micro_batch_size} x data-parallel size {dp}")
    if args.bf16 and on_cpu():
        raise ValueError("--bf16 needs a GPU: Megatron-Core's mixed-precision optimizer accepts "
                         "only CUDA tensors. On CPU train the student in fp32 (a bf16 teacher "
                         "is fine: --kd-teacher-dtype bf16)")
    if args.save_interval is not None and args.save_interval < 1:
        raise ValueError(f"--save-interval must be >= 1, got {args.save_interval}")

    if kd.teacher_load:
        if not os.path.isdir(kd.teacher_load):
            raise ValueError(f"--kd-teacher-load {kd.teacher_load!r} is not a directory")
        kd = dataclasses.replace(kd, teacher_load=resolve_model_dir(kd.teacher_load))
    cache_spec = None
    if kd.mode == "offline":
        from megatron_kd.cache.format import CacheSpec, load_manifest

        if not os.path.isdir(kd.topk_cache):
            raise ValueError(f"--kd-topk-cache {kd.topk_cache!r} is not a directory")
        # Only the manifest here (the student's vocabulary); the full check follows below.
        cache_spec = CacheSpec.from_json(load_manifest(kd.topk_cache))

    # data and tokenizer
    tokenizer_model = args.tokenizer_model
    if (tokenizer_model is None and kd.teacher_load
            and os.path.isfile(os.path.join(kd.teacher_load, "tokenizer.json"))):
        tokenizer_model = os.path.join(kd.teacher_load, "tokenizer.json")  # the teacher's own
    if args.mock_data:
        tokenizer = None
    else:
        if not args.data_path:
            raise ValueError("no training data: give --data-path PREFIX (made by "
                             "`megatron-kd preprocess`) or --mock-data")
        if not tokenizer_model:
            raise ValueError("--data-path needs --tokenizer-model (the tokenizer.json used by "
                             "`megatron-kd preprocess`)")
        tokenizer = HFTokenizer(tokenizer_model, eod_token=args.eod_token)
        check_data_prefixes(parse_data_path(args.data_path)[0], tokenizer)

    # teacher
    teacher_arch = None
    if kd.teacher_load:
        teacher_arch = read_checkpoint_arch(kd.teacher_load)
        check_checkpoint_tensors(kd.teacher_load, teacher_arch)
        try:
            # the student's ranks hold the teacher's output layer in the student's partition
            teacher_arch.check_tensor_parallel(tp)
            if kd.mode == "disaggregated":
                teacher_arch.check_tensor_parallel(kd.teacher_tp)
                teacher_arch.check_pipeline_parallel(kd.teacher_pp)
        except ValueError as e:
            raise ValueError(f"teacher {kd.teacher_load!r}: {e}") from None
        teacher_tok_file = os.path.join(kd.teacher_load, "tokenizer.json")
        if (tokenizer is not None and os.path.isfile(teacher_tok_file)
                and os.path.abspath(tokenizer.path) != os.path.abspath(teacher_tok_file)):
            diff = tokenizer_difference(tokenizer, HFTokenizer(teacher_tok_file))
            if diff:
                raise ValueError(f"--tokenizer-model {tokenizer.path!r} is not the teacher's "
                                 f"tokenizer ({teacher_tok_file}): {diff}")
        teacher_tok = read_checkpoint_extra(kd.teacher_load).get("tokenizer_sha256")
        if tokenizer is not None and teacher_tok and teacher_tok != tokenizer.sha256:
            raise ValueError(f"the teacher {kd.teacher_load!r} was made with another tokenizer "
                             f"(sha256 {teacher_tok[:12]}...) than --tokenizer-model "
                             f"{tokenizer.path!r} ({tokenizer.sha256[:12]}...): student and "
                             f"teacher must tokenize alike")
        if teacher_arch.max_position_embeddings < args.seq_length:
            raise ValueError(f"teacher max_position_embeddings "
                             f"{teacher_arch.max_position_embeddings} < --seq-length "
                             f"{args.seq_length}")

    # vocabulary: one partition for student and teacher
    if teacher_arch is not None:
        vocab, padded = teacher_arch.vocab_size, teacher_arch.padded_vocab_size
        if args.vocab_size is not None and args.vocab_size != vocab:
            raise ValueError(f"--vocab-size {args.vocab_size} != the teacher's vocabulary "
                             f"{vocab}: student and teacher must share one vocabulary")
    else:
        # Offline: the cache's true vocabulary (a different --vocab-size is refused below,
        # naming both values).
        default_vocab = (cache_spec.vocab_size if cache_spec is not None
                         else tokenizer.vocab_size if tokenizer is not None else None)
        vocab = args.vocab_size or default_vocab
        if vocab is None:
            raise ValueError("--mock-data without a teacher needs --vocab-size")
        padded = pad_vocab_size(vocab, tp, args.make_vocab_size_divisible_by)
    if tokenizer is not None and tokenizer.vocab_size > vocab:
        raise ValueError(f"the tokenizer has {tokenizer.vocab_size} tokens but the "
                         f"{'teacher' if teacher_arch else 'student'} vocabulary is {vocab}: "
                         f"the tokenizer does not belong to this model")
    if tokenizer is None:
        tokenizer = MockTokenizer(vocab)

    heads = args.num_attention_heads
    student_arch = GPTArchConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=heads,
        num_query_groups=args.num_query_groups,
        ffn_hidden_size=args.ffn_hidden_size or 4 * args.hidden_size,
        kv_channels=args.kv_channels,
        vocab_size=vocab, padded_vocab_size=padded,
        max_position_embeddings=args.max_position_embeddings or args.seq_length,
        rotary_base=args.rotary_base, norm_epsilon=args.norm_epsilon,
        normalization=args.normalization, swiglu=not args.disable_swiglu,
        tie_embeddings=not args.untie_embeddings_and_output_weights,
        add_bias_linear=args.add_bias_linear,
        position_embedding_type=args.position_embedding_type,
        init_method_std=args.init_method_std)
    if student_arch.max_position_embeddings < args.seq_length:
        raise ValueError(f"--max-position-embeddings {student_arch.max_position_embeddings} < "
                         f"--seq-length {args.seq_length}")
    student_arch.check_tensor_parallel(tp)
    student_arch.check_pipeline_parallel(pp)
    plan = Plan(kd=kd, student_arch=student_arch, teacher_arch=teacher_arch, tokenizer=tokenizer,
                tp=tp, pp=pp, dp=dp, global_batch_size=gbs,
                params_dtype=torch.bfloat16 if args.bf16 else torch.float32)
    if kd.mode == "offline":
        _open_topk_cache(args, plan)
    return plan


def _open_topk_cache(args: argparse.Namespace, plan: Plan) -> None:
    """Offline mode: build the run's datasets and open the top-K cache, refusing one made for
    other data, sequence length, vocabulary or tokenizer (no fallback to an LM-only loss)."""
    from megatron_kd.cache.offline import open_cache_for_run

    plan.datasets = build_datasets(args, plan)
    try:
        plan.topk_cache = open_cache_for_run(
            plan.kd.topk_cache, dataset=plan.datasets[0], tokenizer=plan.tokenizer,
            seq_length=args.seq_length, vocab_size=plan.student_arch.vocab_size,
            num_samples=args.train_iters * plan.global_batch_size)
    except ValueError as e:
        raise ValueError(f"--kd-topk-cache {plan.kd.topk_cache!r}: {e}") from None


# ----------------------------------------------------------------------------------------------
# logging
# ----------------------------------------------------------------------------------------------
def peak_memory() -> tuple[int, str]:
    """``(bytes, kind)``: peak CUDA allocation on a GPU, else the process's peak RSS
    (``resource.getrusage(RUSAGE_SELF).ru_maxrss`` x 1024 on Linux)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return int(torch.cuda.max_memory_allocated()), "cuda_max_allocated"
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024, "cpu_max_rss"


def _fmt_time(seconds: float) -> str:
    seconds = int(max(0, seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m:02d}:{s:02d}"


class Progress:
    """A one-line progress bar on stderr (rank 0): step, loss, tokens/s, ETA."""

    def __init__(self, total: int, enabled: bool, stream=None) -> None:
        self.total, self.enabled = total, enabled
        self.stream = stream or sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()

    def update(self, step: int, loss: float, tokens_per_s: float, eta_s: float,
               extra: str = "") -> None:
        if not self.enabled:
            return
        width = 24
        filled = int(width * step / max(1, self.total))
        bar = "#" * filled + "-" * (width - filled)
        line = (f"[{bar}] {step}/{self.total} loss {loss:.4f} {tokens_per_s:,.0f} tok/s "
                f"ETA {_fmt_time(eta_s)}{extra}")
        if self.tty:
            self.stream.write("\r" + line)
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def message(self, text: str) -> None:
        if self.enabled:
            self.stream.write(("\n" if self.tty else "") + text + "\n")
            self.stream.flush()

    def close(self) -> None:
        if self.enabled and self.tty:
            self.stream.write("\n")
            self.stream.flush()


class JsonLog:
    """Appends one JSON object per line to ``path`` (rank 0 only; appending, so a resumed run
    continues the same file)."""

    def __init__(self, path: str | None, enabled: bool) -> None:
        self.path = path if (path and enabled) else None
        if self.path:
            os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)

    def write(self, record: dict) -> None:
        if self.path:
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(json.dumps(record) + "\n")

    def close(self) -> None:
        pass


# ----------------------------------------------------------------------------------------------
# the trainer
# ----------------------------------------------------------------------------------------------
def _mean(pair: torch.Tensor | None) -> float | None:
    if pair is None or pair[1] <= 0:
        return None
    return float(pair[0] / pair[1])


def build_datasets(args: argparse.Namespace, plan: Plan, *, need_valid: bool = True):
    """``(train, valid)`` datasets of a run: the same samples on every rank that asks (the
    disaggregated teacher derives the student's samples from these)."""
    from megatron_kd.data.datasets import MockGPTDataset, build_gpt_datasets

    train_samples = args.train_iters * plan.global_batch_size
    valid_samples = max(1, args.eval_iters) * plan.global_batch_size
    if args.mock_data:
        train = MockGPTDataset(vocab_size=plan.student_arch.vocab_size,
                               seq_length=args.seq_length, num_samples=train_samples,
                               seed=args.seed)
        valid = (MockGPTDataset(vocab_size=plan.student_arch.vocab_size,
                                seq_length=args.seq_length, num_samples=valid_samples,
                                seed=args.seed + 1) if need_valid else None)
        return train, valid
    return build_gpt_datasets(
        data_path=args.data_path, split=args.split, seq_length=args.seq_length, seed=args.seed,
        tokenizer=plan.tokenizer, train_samples=train_samples, valid_samples=valid_samples,
        cache_path=args.data_cache_path)


class Trainer:
    """One distillation run; ``parallel_state`` must be initialised (TP x PP).

    The teacher is local (colocated), remote (``remote``: disaggregated) or a top-K cache
    (``plan.topk_cache``: offline; no teacher model exists, ``self.teacher`` is None).
    """

    REPORT_KEYS = ("loss", "kd_loss", "lm_loss", "teacher_lm_loss")

    def __init__(self, args: argparse.Namespace, plan: Plan, *, loss_fn=None,
                 remote=None) -> None:
        from megatron.core import parallel_state as ps

        self.args, self.plan = args, plan
        self.remote = remote  # disaggregated: a RemoteTeacher instead of a local teacher
        self.topk = None  # offline, last stage: a TopKPrefetcher (started by fit)
        self._expected: list = []
        self.loss_fn = loss_fn  # None: the fused loss; tests pass a dense reference
        self.rank = dist.get_rank()
        self.is_first = ps.is_pipeline_first_stage()
        self.is_last = ps.is_pipeline_last_stage()
        self.tp_group = ps.get_tensor_model_parallel_group()
        self.tp_rank = ps.get_tensor_model_parallel_rank()
        self.dp_rank = ps.get_data_parallel_rank()
        self.pp_rank = ps.get_pipeline_model_parallel_rank()
        self.log_rank = self.rank == 0
        self.loss_config = plan.kd.loss_config(vocab_size=plan.student_arch.vocab_size)
        # Evaluation without teacher outputs (offline: the cache holds training samples only;
        # disaggregated: the teacher streams training microbatches only): the student's CE.
        self.ce_config = dataclasses.replace(self.loss_config, kd_weight=0.0, ce_weight=1.0)
        self._evaluating = False
        self._subgroups: list = []
        self._build_student()
        self._build_teacher()
        self._build_data()

    # -- models -----------------------------------------------------------------------------
    def _build_student(self) -> None:
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
            finalize_model_grads,
        )
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        from megatron_kd.models import build_gpt_model

        args, plan = self.args, self.plan
        model = build_gpt_model(
            plan.student_arch, pre_process=self.is_first, post_process=self.is_last,
            # Megatron-LM's rule: each pipeline stage its own seed (else stages' layers would
            # start identical).
            params_dtype=plan.params_dtype, seed=args.seed + 100 * self.pp_rank,
            hidden_dropout=args.hidden_dropout, attention_dropout=args.attention_dropout,
            calculate_per_token_loss=True)
        bypass_output_layer(model)
        config = model.config
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=False,
            average_in_collective=False)
        self.model = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)
        config.finalize_model_grads_func = finalize_model_grads
        config.no_sync_func = self.model.no_sync
        self.config = config
        opt_config = OptimizerConfig(
            optimizer="adam", lr=args.lr, min_lr=args.min_lr, weight_decay=args.weight_decay,
            adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2, adam_eps=args.adam_eps,
            clip_grad=args.clip_grad, bf16=plan.params_dtype == torch.bfloat16,
            params_dtype=plan.params_dtype, use_distributed_optimizer=False)
        self.optimizer = get_megatron_optimizer(opt_config, [self.model])
        decay_iters = args.lr_decay_iters or args.train_iters
        self.scheduler = OptimizerParamScheduler(
            self.optimizer, init_lr=0.0, max_lr=args.lr, min_lr=args.min_lr,
            lr_warmup_steps=args.lr_warmup_iters,
            lr_decay_steps=max(decay_iters, args.lr_warmup_iters + 1),
            lr_decay_style=args.lr_decay_style, start_wd=args.weight_decay,
            end_wd=args.weight_decay, wd_incr_steps=max(1, args.train_iters),
            wd_incr_style="constant")
        self.num_params = sum(p.numel() for p in model.parameters())

    def _build_teacher(self) -> None:
        """Every rank builds and loads the full (un-pipelined) teacher; only the last stage
        keeps it (see the module docstring)."""
        self.teacher = None
        plan = self.plan
        if plan.teacher_arch is None or self.remote is not None:
            return
        from megatron.core.process_groups_config import ProcessGroupCollection

        from megatron_kd.models import build_gpt_model, load_model_checkpoint

        pgc = ProcessGroupCollection.use_mpu_process_groups()
        # A pipeline "group" of one rank: the teacher has every layer on every stage it is on.
        single, _ = dist.new_subgroups(group_size=1)
        self._subgroups = [single]
        pgc.pp = single
        teacher_dtype = torch.bfloat16 if plan.kd.teacher_dtype == "bf16" else torch.float32
        teacher = build_gpt_model(plan.teacher_arch, pg_collection=pgc,
                                  params_dtype=teacher_dtype, seed=None,
                                  perform_initialization=False)
        # Replicated on every pipeline stage: several ranks read the same shard.
        load_model_checkpoint(teacher, plan.kd.teacher_load, validate_access_integrity=False)
        if not self.is_last:
            del teacher
            return
        bypass_output_layer(teacher)
        teacher.eval()
        for p in teacher.parameters():
            p.requires_grad_(False)
        self.teacher = teacher

    # -- data -------------------------------------------------------------------------------
    def _build_data(self) -> None:
        from megatron_kd.data.datasets import BatchPlan

        if self.plan.datasets is not None:  # offline: already built to check the cache
            self.train_ds, self.valid_ds = self.plan.datasets
        else:
            self.train_ds, self.valid_ds = build_datasets(self.args, self.plan)
        self.batches = BatchPlan(self.plan.global_batch_size, self.args.micro_batch_size,
                                 self.dp_rank, self.plan.dp)

    # -- one step ---------------------------------------------------------------------------
    def _forward_step(self, data_iterator, model):
        batch = next(data_iterator)
        if not on_cpu():
            device = torch.cuda.current_device()
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        tokens, position_ids = batch["tokens"], batch["position_ids"]
        output = model(tokens, position_ids, None)
        if not self.is_last:
            return output, _never_called
        teacher_hidden = teacher_weight = topk_ids = topk_logprobs = None
        if self.remote is not None and not self._evaluating:
            step, m, ids = self._expected.pop(0)
            teacher_hidden = self.remote.hidden(step, m, ids, tokens)
            teacher_weight = self.remote.weight
        elif self.topk is not None and not self._evaluating:
            step, m, ids = self._expected.pop(0)
            topk_ids, topk_logprobs = self.topk.next(ids)  # [s, b, K] each
        elif self.teacher is not None:
            with torch.no_grad():
                teacher_hidden = to_sbh(self.teacher(tokens, position_ids, None))
            teacher_weight = output_layer_weight(self.teacher)
        has_teacher = teacher_hidden is not None or topk_ids is not None
        kw = {} if self.loss_fn is None else {"loss_fn": self.loss_fn}
        loss_func = make_kd_loss_func(
            student_weight=output_layer_weight(model), teacher_hidden=teacher_hidden,
            teacher_weight=teacher_weight, teacher_topk_ids=topk_ids,
            teacher_topk_logprobs=topk_logprobs, labels=batch["labels"],
            loss_mask=batch["loss_mask"],
            config=self.loss_config if has_teacher or not self._evaluating else self.ce_config,
            tp_group=self.tp_group, report_teacher_lm_loss=self._evaluating, **kw)
        return output, loss_func

    def _run_schedule(self, microbatches: list, forward_only: bool) -> list:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        forward_backward = get_forward_backward_func()
        with device_context():
            return forward_backward(
                forward_step_func=self._forward_step, data_iterator=iter(microbatches),
                model=[self.model], num_microbatches=len(microbatches),
                seq_length=self.args.seq_length, micro_batch_size=self.args.micro_batch_size,
                forward_only=forward_only)

    def _reduce_reports(self, reports: list) -> dict[str, torch.Tensor | None]:
        """Sum ``[sum, tokens]`` pairs over microbatches and data-parallel ranks, onto every
        rank (one all-reduce over the world; only last-stage TP-rank-0 ranks contribute)."""
        # NCCL reduces device tensors only; gloo host tensors.
        device = "cpu" if on_cpu() else torch.cuda.current_device()
        vec = torch.zeros(2 * len(self.REPORT_KEYS), dtype=torch.float64, device=device)
        present = torch.zeros(len(self.REPORT_KEYS), dtype=torch.float64, device=device)
        if self.is_last and self.tp_rank == 0:
            for rep in reports:
                for i, key in enumerate(self.REPORT_KEYS):
                    if key in rep:
                        vec[2 * i: 2 * i + 2] += rep[key].double().to(device)
                        present[i] = 1
        both = torch.cat([vec, present])
        dist.all_reduce(both)
        both = both.cpu()
        out = {}
        for i, key in enumerate(self.REPORT_KEYS):
            out[key] = both[2 * i: 2 * i + 2] if both[2 * len(self.REPORT_KEYS) + i] > 0 else None
        return out

    def train_step(self, consumed_samples: int) -> dict:
        self.model.train()
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        microbatches = list(self.batches.microbatches(self.train_ds, consumed_samples))
        if (self.remote is not None or self.topk is not None) and self.is_last:
            step = consumed_samples // self.plan.global_batch_size
            n = len(self.train_ds)
            self._expected = [(step, m, self.batches.sample_ids(consumed_samples, m, n))
                              for m in range(len(microbatches))]
        reports = self._run_schedule(microbatches, forward_only=False)
        with device_context():
            update_ok, grad_norm, _ = self.optimizer.step()
        if not update_ok:
            raise FloatingPointError("optimizer step skipped (non-finite gradients)")
        lr = self.optimizer.param_groups[0]["lr"]
        self.scheduler.step(increment=1)
        red = self._reduce_reports(reports)
        record = {"loss": _mean(red["loss"]), "kd_loss": _mean(red["kd_loss"]),
                  "lm_loss": _mean(red["lm_loss"]), "lr": lr,
                  "grad_norm": None if grad_norm is None else float(grad_norm)}
        if self.remote is not None:
            # teacher -> student bytes of this step, summed over the student's ranks
            wire = torch.tensor([float(self.remote.take_step_bytes())], dtype=torch.float64)
            dist.all_reduce(wire)
            record["kd_wire_bytes"] = int(wire.item())
            record["kd_wire_bytes_per_dp_rank"] = int(wire.item()) // self.plan.dp
        return record

    def evaluate(self) -> dict:
        if self.valid_ds is None or self.args.eval_iters == 0:
            return {}
        self.model.eval()
        self._evaluating = True
        reports = []
        with torch.no_grad():
            for i in range(self.args.eval_iters):
                mbs = list(self.batches.microbatches(self.valid_ds,
                                                     i * self.plan.global_batch_size))
                reports.extend(self._run_schedule(mbs, forward_only=True))
        self.model.train()
        self._evaluating = False
        red = self._reduce_reports(reports)
        return {"eval_loss": _mean(red["loss"]), "eval_kd_loss": _mean(red["kd_loss"]),
                "eval_lm_loss": _mean(red["lm_loss"]),
                "eval_teacher_lm_loss": _mean(red["teacher_lm_loss"])}

    def _start_topk(self, consumed: int, steps: int) -> None:
        """Offline, last stage: decode this rank's microbatches of the next ``steps`` steps from
        ``consumed`` samples on, ahead of training (``--kd-prefetch-depth`` microbatches)."""
        from megatron_kd.cache.offline import TopKPrefetcher

        n, gbs = len(self.train_ds), self.plan.global_batch_size
        schedule = (self.batches.sample_ids(consumed + k * gbs, m, n)
                    for k in range(steps) for m in range(self.batches.num_microbatches))
        # Decoding threads compete with the CPU shim's own compute; on a GPU they are spare.
        threads = 1 if on_cpu() else min(4, self.args.micro_batch_size)
        device = None if on_cpu() else torch.cuda.current_device()
        self.topk = TopKPrefetcher(self.plan.topk_cache, schedule,
                                   depth=self.plan.kd.prefetch_depth, threads=threads,
                                   device=device)

    def close(self) -> None:
        """Stop the top-K decoder; free this rank's one-rank pipeline group of the teacher."""
        if self.topk is not None:
            self.topk.close()
        for group in self._subgroups:
            dist.destroy_process_group(group)
        self._subgroups = []

    # -- the loop ---------------------------------------------------------------------------
    def fit(self) -> dict:
        from megatron_kd.training.checkpointing import (
            load_training_checkpoint,
            save_training_checkpoint,
        )

        args, plan = self.args, self.plan
        start_iter, consumed = 0, 0
        if args.load:
            start_iter, consumed = load_training_checkpoint(
                args.load, model=self.model, optimizer=self.optimizer, scheduler=self.scheduler,
                arch=plan.student_arch)
        if self.remote is not None:
            from megatron_kd.disagg.runtime import run_schedule_bounds

            first, stop = run_schedule_bounds(args)
            if first != start_iter:
                raise RuntimeError(f"resume point {start_iter} != {first} read from --load")
            self.remote.start(first, stop)
        stop_at = args.train_iters
        if args.exit_after_iters is not None:
            stop_at = min(stop_at, start_iter + args.exit_after_iters)
        if plan.topk_cache is not None and self.is_last:
            self._start_topk(consumed, max(0, stop_at - start_iter))
        progress = Progress(args.train_iters, self.log_rank and not args.no_progress)
        log = JsonLog(args.log_json, self.log_rank)
        if plan.topk_cache is not None and self.log_rank:
            spec = plan.topk_cache.spec
            progress.message(f"megatron-kd: offline teacher: top-{spec.topk} cache "
                             f"{plan.kd.topk_cache} (teacher {spec.teacher_checkpoint}, "
                             f"tail {plan.kd.topk_tail})")
        if args.load and self.log_rank:
            progress.message(f"megatron-kd: resumed from iteration {start_iter}" if start_iter
                             else f"megatron-kd: no checkpoint in --load {args.load!r}; "
                                  f"starting from iteration 0")
        tokens_per_step = plan.global_batch_size * args.seq_length
        extra_ckpt = {"kind": "student", "teacher": plan.kd.teacher_load}
        if plan.topk_cache is not None:
            extra_ckpt.update(teacher=plan.topk_cache.spec.teacher_checkpoint,
                              topk_cache=os.path.abspath(plan.kd.topk_cache))

        def save(iteration: int) -> None:
            if args.save:
                save_training_checkpoint(args.save, iteration=iteration, consumed_samples=consumed,
                                         model=self.model, optimizer=self.optimizer,
                                         scheduler=self.scheduler, arch=plan.student_arch,
                                         extra=extra_ckpt)

        steps, evals = [], []
        t_start = time.perf_counter()
        iteration = start_iter
        step_times = []
        try:
            while iteration < stop_at:
                t0 = time.perf_counter()
                record = self.train_step(consumed)
                dt = time.perf_counter() - t0
                iteration += 1
                consumed += plan.global_batch_size
                step_times.append(dt)
                peak, kind = peak_memory()
                record = {"step": iteration, **record, "tokens_per_s": tokens_per_step / dt,
                          "step_time_s": dt, "peak_mem_bytes": peak, "peak_mem_kind": kind}
                steps.append(record)
                log.write(record)
                recent = step_times[-10:]
                eta = (args.train_iters - iteration) * sum(recent) / len(recent)
                if iteration % args.log_interval == 0 or iteration == stop_at:
                    progress.update(iteration, record["loss"], record["tokens_per_s"], eta)
                if iteration % args.eval_interval == 0 or iteration == args.train_iters:
                    ev = self.evaluate()
                    if ev:
                        ev = {"step": iteration, "eval": True, **ev}
                        evals.append(ev)
                        log.write(ev)
                        progress.message(f"eval @ {iteration}: lm loss {ev['eval_lm_loss']:.4f}"
                                         + (f", kd loss {ev['eval_kd_loss']:.4f}"
                                            if ev.get("eval_kd_loss") is not None else ""))
                if args.save_interval and iteration % args.save_interval == 0:
                    save(iteration)
            if args.save and not (args.save_interval and iteration % args.save_interval == 0) \
                    and iteration > start_iter:
                save(iteration)
        finally:
            progress.close()
            log.close()
            if self.topk is not None:
                self.topk.close()
        if self.remote is not None:
            self.remote.close()
        wall = time.perf_counter() - t_start
        total_steps = len(steps)
        return {
            "start_iteration": start_iter,
            "iterations": iteration,
            "steps": steps,
            "evals": evals,
            "final_loss": steps[-1]["loss"] if steps else None,
            "final_eval_lm_loss": evals[-1]["eval_lm_loss"] if evals else None,
            "tokens_per_s": (total_steps * tokens_per_step / sum(step_times)) if step_times
            else None,
            "wall_s": wall,
            "student_params_per_rank": self.num_params,
            "student_arch": plan.student_arch.to_dict(),
            "teacher_arch": plan.teacher_arch.to_dict() if plan.teacher_arch else None,
            "world_size": dist.get_world_size(),
            "rank": self.rank,
            "kd_mode": plan.kd.mode,
            "teacher_in_memory": self.teacher is not None,
            "topk_wait_s": self.topk.wait_s if self.topk is not None else None,
            "tp": plan.tp, "pp": plan.pp, "dp": plan.dp,
        }


def _never_called(output_tensor):  # loss function of non-last pipeline stages
    raise AssertionError("loss function called on a pipeline stage that is not the last")


# ----------------------------------------------------------------------------------------------
# entry points
# ----------------------------------------------------------------------------------------------
def train(args: argparse.Namespace, *, loss_fn=None) -> dict:
    """Run a distillation (any ``--kd-mode``); returns a summary dict (per-step records
    included).

    Initialises ``torch.distributed`` from the environment if it is not already (torchrun, or a
    world of one), sets up Megatron's TP x PP groups for the run and tears them down after.
    ``loss_fn`` replaces the fused loss (same signature; for tests).
    """
    from megatron_kd.training.parallel import init_distributed_from_env, model_parallel

    install_cpu_shim()
    if on_cpu():
        torch.set_flush_denormal(True)  # denormal softmax tails make CPU matmuls ~50x slower
    created = init_distributed_from_env()
    try:
        if KDArgs.from_args(args).mode == "disaggregated":
            return _train_disaggregated(args, loss_fn=loss_fn)
        plan = plan_run(args, dist.get_world_size())  # every check before any model is built
        with model_parallel(plan.tp, plan.pp), device_context():
            trainer = Trainer(args, plan, loss_fn=loss_fn)
            try:
                return trainer.fit()
            finally:
                trainer.close()
    finally:
        if created:
            dist.destroy_process_group()


def _train_disaggregated(args: argparse.Namespace, *, loss_fn=None) -> dict:
    """Student ranks train, teacher ranks serve hidden states (see megatron_kd.disagg)."""
    from megatron.core import parallel_state as ps

    from megatron_kd.disagg.runtime import RemoteTeacher, TeacherServer, world_size_note
    from megatron_kd.parallel import (
        DisaggTopology,
        default_group,
        initialize_model_parallel_split,
    )

    kd = KDArgs.from_args(args)
    world = dist.get_world_size()
    topology = DisaggTopology.from_world(
        world_size=world, teacher_world_size=kd.teacher_world_size,
        student_tp=args.tensor_model_parallel_size, student_pp=args.pipeline_model_parallel_size,
        teacher_tp=kd.teacher_tp, teacher_pp=kd.teacher_pp)
    plan = plan_run(args, world)  # every check before any model is built
    world_group = dist.group.WORLD
    # Every rank creates both sides' groups, in one order (new_group is collective).
    student_group = dist.new_group(list(topology.student.ranks))
    side = initialize_model_parallel_split(topology)
    try:
        if dist.get_rank() == 0 and not args.no_progress:
            print(f"megatron-kd: {world_size_note(topology)}", file=sys.stderr, flush=True)
        # Both sides read the teacher checkpoint in one collective load over the whole world:
        # the teacher its layers, the student only its output-layer shard.
        if side == "teacher":
            with device_context():
                server = TeacherServer(topology=topology, world_group=world_group, args=args,
                                       plan=plan)
                return server.serve()
        remote = RemoteTeacher(topology=topology, world_group=world_group, args=args, plan=plan)
        # The student's own collectives (reports, checkpoints, barriers) stay among its ranks.
        with default_group(student_group), device_context():
            trainer = Trainer(args, plan, loss_fn=loss_fn, remote=remote)
            try:
                summary = trainer.fit()
            finally:
                trainer.close()
        summary["side"] = "student"
        return summary
    finally:
        ps.destroy_model_parallel()


def run(args: argparse.Namespace) -> int:
    summary = train(args)
    if summary.get("side") == "teacher" or summary["rank"] != 0:
        return 0
    last_eval = summary.get("final_eval_lm_loss")
    print(json.dumps({k: summary[k] for k in ("iterations", "final_loss", "tokens_per_s",
                                              "wall_s")}
                     | {"final_eval_lm_loss": last_eval}), file=sys.stderr)
    return 0
