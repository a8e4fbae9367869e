"""A run's configuration: typed sections built once from the ``megatron-kd train`` flags.

Each section is a frozen dataclass whose fields are the flags (Megatron-LM's spelling), with the
one default each flag has (:mod:`megatron_kd.flags` makes the parser from the fields):
:class:`ArchitectureSection` (the student model), :class:`ParallelSection`,
:class:`KernelSection` (the attention kernels: shared with ``teacher serve`` and ``cache
build``), :class:`OptimizerSection`, :class:`DataSection` (the samples a run reads: shared with
``megatron-kd cache build``, so a cache and a run agree by construction),
:class:`LoggingSection`, :class:`~megatron_kd.training.metrics.MetricsSection` and the ``--kd-*``
flags' :class:`~megatron_kd.modes.args.KDArgs`. :class:`RunConfig` holds them; it is made
once, from the parsed flags, and nothing past it reads argparse.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass

from megatron_kd.flags import add_flags, flag, from_flags
from megatron_kd.modes.args import KDArgs, add_kd_args
from megatron_kd.parallel import ParallelLayout
from megatron_kd.parallel.layout import CP_COMM_TYPES, virtual_stages_of
from megatron_kd.parallel.vocab import MAKE_VOCAB_SIZE_DIVISIBLE_BY
from megatron_kd.training.hybrid_args import LINEAR_DEFAULTS, VARIANTS, layer_pattern
from megatron_kd.training.kernels import KernelSection
from megatron_kd.training.metrics import MetricsSection

__all__ = ["ArchitectureSection", "DataSection", "KernelSection", "LoggingSection",
           "OptimizerSection", "ParallelSection", "RunConfig", "add_arguments", "parse_args"]

_MODEL = "student model"
_MOE = "student model: mixture of experts"
_HYBRID = "student model: hybrid linear attention (Qwen3.5)"
_PARALLEL = "parallelism and precision"
_OPTIMISATION = "optimisation"
_DATA = "data"
_LOGGING = "checkpoints, evaluation, logging"
_RECOMPUTE = "activation recompute (Megatron-LM's flags)"


def _linear(name: str, what: str):
    return flag(None, f"Gated DeltaNet {what} (default {LINEAR_DEFAULTS[name]})", type=int,
                group=_HYBRID)


#: The architecture flags' values when neither the flag nor a pretrained checkpoint gives one
#: (Megatron-LM's defaults); the fields are None when not given, so that a given flag can be
#: told apart and checked against ``--pretrained-checkpoint``'s architecture.
ARCH_DEFAULTS = {"normalization": "RMSNorm", "norm_epsilon": 1e-5, "position_embedding_type":
                 "rope", "rotary_base": 10000.0, "init_method_std": 0.02, "moe_router_topk": 2,
                 "rotary_percent": 1.0}


def _defaulted(name: str, help: str = "", **spec):
    default = ARCH_DEFAULTS[name]
    return flag(None, f"{help}{'; ' if help else ''}default {default} (or the pretrained "
                      f"checkpoint's)", type=type(default), **spec)


_GIVES_ARCH = "required unless --pretrained-checkpoint gives the architecture"


@dataclass(frozen=True, kw_only=True)
class ArchitectureSection:
    """The student model (Megatron-LM's architecture flags). A field is None (a switch False)
    when its flag is not given: the model is then ``--pretrained-checkpoint``'s, or built from
    :data:`ARCH_DEFAULTS`."""

    num_layers: int | None = flag(None, _GIVES_ARCH, type=int, group=_MODEL)
    hidden_size: int | None = flag(None, _GIVES_ARCH, type=int, group=_MODEL)
    num_attention_heads: int | None = flag(None, _GIVES_ARCH, type=int, group=_MODEL)
    num_query_groups: int | None = flag(
        None, "key/value heads (grouped-query attention); default: one per head", type=int,
        group=_MODEL)
    ffn_hidden_size: int | None = flag(None, "default: 4 x hidden size", type=int, group=_MODEL)
    kv_channels: int | None = flag(None, type=int, group=_MODEL)
    max_position_embeddings: int | None = flag(None, "default: --seq-length", type=int,
                                               group=_MODEL)
    normalization: str | None = _defaulted("normalization", choices=("RMSNorm", "LayerNorm"),
                                           group=_MODEL)
    norm_epsilon: float | None = _defaulted("norm_epsilon", group=_MODEL)
    disable_swiglu: bool = flag(False, "GeLU MLP instead of SwiGLU", group=_MODEL)
    position_embedding_type: str | None = _defaulted(
        "position_embedding_type", choices=("rope", "learned_absolute", "none"), group=_MODEL)
    rotary_base: float | None = _defaulted("rotary_base", group=_MODEL)
    use_rope_scaling: bool = flag(False, "Llama 3.1-style RoPE frequency scaling",
                                  group=_MODEL)
    rope_scaling_factor: float | None = flag(
        None, "with --use-rope-scaling (Llama-3.1: 8, Llama-3.2: 32); default 8", type=float,
        group=_MODEL)
    untie_embeddings_and_output_weights: bool = flag(
        False, "separate output layer (default: tied to the input embedding)", group=_MODEL)
    add_bias_linear: bool = flag(False, group=_MODEL)
    init_method_std: float | None = _defaulted("init_method_std", group=_MODEL)
    hidden_dropout: float = flag(0.0, group=_MODEL)
    attention_dropout: float = flag(0.0, group=_MODEL)
    vocab_size: int | None = flag(
        None, "true vocabulary (default: the teacher's, else the tokenizer's)", type=int,
        group=_MODEL)
    make_vocab_size_divisible_by: int = flag(MAKE_VOCAB_SIZE_DIVISIBLE_BY, group=_MODEL)
    qk_layernorm: bool = flag(False, "normalise each query and key head before RoPE (Qwen3)",
                              group=_MODEL)

    num_experts: int | None = flag(
        None, "experts of every layer's MLP (default: a dense MLP)", type=int, group=_MOE)
    moe_ffn_hidden_size: int | None = flag(
        None, "hidden width of one expert (default: --ffn-hidden-size)", type=int, group=_MOE)
    moe_router_topk: int | None = _defaulted("moe_router_topk", "experts per token",
                                             group=_MOE)
    moe_router_pre_softmax: bool = flag(
        False, "softmax over all experts before the top k (not renormalised)", group=_MOE)
    moe_aux_loss_coeff: float = flag(
        0.0, "weight of Megatron-Core's load-balancing auxiliary loss (0: none)", group=_MOE)

    experimental_attention_variant: str | None = flag(
        None, "gated_delta_net (or gdn): the layers --linear-attention-freq marks are Gated "
              "DeltaNet linear attention", choices=VARIANTS, group=_HYBRID)
    linear_attention_freq: int | list[int] | None = flag(
        None, "N: one softmax-attention layer every N (the rest linear); or a list expression "
              "of 0 / 1 per layer, 1 linear, e.g. \"([1]*3+[0])*2\"", type=layer_pattern,
        group=_HYBRID)
    linear_conv_kernel_dim: int | None = _linear("linear_conv_kernel_dim",
                                                 "causal convolution width")
    linear_key_head_dim: int | None = _linear("linear_key_head_dim", "query / key head width")
    linear_value_head_dim: int | None = _linear("linear_value_head_dim", "value head width")
    linear_num_key_heads: int | None = _linear("linear_num_key_heads", "query / key heads")
    linear_num_value_heads: int | None = _linear("linear_num_value_heads", "value heads")
    attention_output_gate: bool = flag(
        False, "softmax attention's output times sigmoid of a second query projection",
        group=_HYBRID)
    rotary_percent: float | None = _defaulted(
        "rotary_percent", "fraction of each head's width RoPE rotates (Qwen3.5: 0.25)",
        group=_HYBRID)
    moe_shared_expert_intermediate_size: int | None = flag(
        None, "width of a shared expert beside the routed ones (needs --num-experts)", type=int,
        group=_HYBRID)
    moe_shared_expert_gate: bool = flag(
        False, "the shared expert's output times sigmoid(w . x) per token", group=_HYBRID)

    def resolved(self, name: str):
        """Field ``name``, or its :data:`ARCH_DEFAULTS` value when not given."""
        value = getattr(self, name)
        return ARCH_DEFAULTS[name] if value is None and name in ARCH_DEFAULTS else value

    def given(self) -> dict:
        """The architecture flags given (dropout, vocabulary and padding, the auxiliary-loss
        weight are settings of the run, not of the model's weights)."""
        runs = {"hidden_dropout", "attention_dropout", "vocab_size",
                "make_vocab_size_divisible_by", "moe_aux_loss_coeff"}
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name not in runs and getattr(self, f.name) not in (None, False)}


@dataclass(frozen=True, kw_only=True)
class ParallelSection:
    """How the ranks split the model, and its precision."""

    tensor_model_parallel_size: int = flag(1, group=_PARALLEL)
    pipeline_model_parallel_size: int = flag(1, group=_PARALLEL)
    expert_model_parallel_size: int = flag(
        1, "ranks the experts of a mixture-of-experts model are split over", group=_PARALLEL)
    expert_tensor_parallel_size: int | None = flag(
        None, "ranks each expert is split over (default: the tensor-parallel size)", type=int,
        group=_PARALLEL)
    use_distributed_optimizer: bool = flag(
        False, "Megatron-Core's distributed optimizer: optimizer state and fp32 main weights "
               "sharded over the data-parallel ranks", group=_PARALLEL)
    bf16: bool = flag(
        False, "bf16 student parameters, fp32 main weights (GPU only: Megatron-Core's "
               "mixed-precision optimizer requires CUDA tensors)", group=_PARALLEL)
    context_parallel_size: int = flag(
        1, "context parallelism: each sequence split over this many ranks (Megatron's "
           "load-balanced 2 x cp chunks), for long sequences", group=_PARALLEL)
    sequence_parallel: bool = flag(
        False, "sequence parallelism: the activations outside attention and the MLP (norms, "
               "dropout, the hidden states the loss takes) split along the sequence over the "
               "tensor-parallel ranks (Megatron-LM's flag; off at tensor-parallel size 1)",
        group=_PARALLEL)
    num_layers_per_virtual_pipeline_stage: int | None = flag(
        None, "layers of one virtual pipeline stage: an interleaved pipeline schedule with "
              "num-layers / (pipeline size x this) model chunks per rank", type=int,
        group=_PARALLEL)
    virtual_pipeline_model_parallel_size: int | None = flag(
        None, "model chunks per pipeline rank (interleaved schedule); or give "
              "--num-layers-per-virtual-pipeline-stage", type=int, group=_PARALLEL)
    recompute_granularity: str | None = flag(
        None, "activation recompute: 'full' (whole layers, see --recompute-method) or "
              "'selective' (the core attention only)", choices=("full", "selective"),
        group=_RECOMPUTE)
    recompute_method: str | None = flag(
        None, "with full recompute: 'uniform' (the layers of each chunk in groups of "
              "--recompute-num-layers, the input of each group kept) or 'block' (the first "
              "--recompute-num-layers layers of each chunk recomputed, the rest stored)",
        choices=("uniform", "block"), group=_RECOMPUTE)
    recompute_num_layers: int | None = flag(
        None, "layers per recomputed group (uniform) or recomputed layers per chunk (block)",
        type=int, group=_RECOMPUTE)
    overlap_grad_reduce: bool = flag(
        False, "reduce each gradient bucket over the data-parallel ranks as soon as its "
               "gradients are ready, overlapping the backward pass (Megatron-Core's DDP; "
               "Megatron-LM's flag)", group=_PARALLEL)
    overlap_param_gather: bool = flag(
        False, "with --use-distributed-optimizer: all-gather the updated parameters bucket by "
               "bucket during the next forward pass (Megatron-Core's DDP; Megatron-LM's flag)",
        group=_PARALLEL)
    recompute_activations: bool = flag(
        False, "selective recompute: the same as --recompute-granularity selective "
               "(Megatron-LM's flag)", group=_RECOMPUTE)
    cp_comm_type: str = flag(
        "p2p", "with context parallelism, how Transformer Engine's attention exchanges keys "
               "and values: p2p (a ring), all_gather or a2a (heads scattered; what it runs "
               "attention sinks and sliding windows with); megatron_kd's own attention (no "
               "Transformer Engine) gathers them whatever this says", choices=CP_COMM_TYPES,
        group=_PARALLEL)

    def layout(self, world_size: int, num_layers: int | None) -> ParallelLayout:
        """The run's :class:`~megatron_kd.parallel.ParallelLayout` over ``world_size`` ranks
        for a model of ``num_layers`` layers (None: not known, which only
        ``--num-layers-per-virtual-pipeline-stage`` needs), built once from these flags (what
        the flags say together, named by flag; what the model allows is
        :func:`megatron_kd.arch.check_layout`'s)."""
        for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                     "context_parallel_size", "expert_model_parallel_size",
                     "expert_tensor_parallel_size", "virtual_pipeline_model_parallel_size"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
        return ParallelLayout.from_world(
            world_size, tp=self.tensor_model_parallel_size,
            pp=self.pipeline_model_parallel_size, vp=self.virtual_stages(num_layers) or 1,
            cp=self.context_parallel_size, ep=self.expert_model_parallel_size,
            etp=self.expert_tensor_parallel_size, sequence_parallel=self.sequence_parallel,
            cp_comm_type=self.cp_comm_type,
            use_distributed_optimizer=self.use_distributed_optimizer, **self._recompute())

    def virtual_stages(self, num_layers: int | None) -> int | None:
        """Model chunks per pipeline rank (None: no interleaving), from either flag."""
        if self.num_layers_per_virtual_pipeline_stage is not None:
            if self.virtual_pipeline_model_parallel_size is not None:
                raise ValueError("give --num-layers-per-virtual-pipeline-stage or "
                                 "--virtual-pipeline-model-parallel-size, not both")
            if num_layers is None:
                raise ValueError("--num-layers-per-virtual-pipeline-stage needs the model's "
                                 "layers: --num-layers, or --pretrained-checkpoint")
            return virtual_stages_of(num_layers, self.pipeline_model_parallel_size,
                                     self.num_layers_per_virtual_pipeline_stage)
        return self.virtual_pipeline_model_parallel_size

    def _recompute(self) -> dict:
        """The layout's recompute fields of the recompute flags, which Megatron-LM spells in
        three (the method and count only with full recompute)."""
        granularity, method, count = (self.recompute_granularity, self.recompute_method,
                                      self.recompute_num_layers)
        if self.recompute_activations:  # Megatron-LM's spelling of selective recompute
            if granularity == "full":
                raise ValueError("--recompute-activations is selective recompute; "
                                 "--recompute-granularity full asks for full recompute: give "
                                 "one of them")
            granularity = "selective"
        if granularity is None:
            if method is not None or count is not None:
                raise ValueError(f"--recompute-method {method} / --recompute-num-layers {count} "
                                 f"need --recompute-granularity full")
            return {}
        if granularity == "selective":
            if method is not None or count is not None:
                raise ValueError(f"--recompute-granularity selective recomputes the core "
                                 f"attention of every layer: --recompute-method {method} / "
                                 f"--recompute-num-layers {count} do not apply (drop them)")
            return {"recompute": "selective"}
        if method is None or count is None:
            raise ValueError("--recompute-granularity full needs --recompute-method (uniform or "
                             "block) and --recompute-num-layers")
        if count < 1:
            raise ValueError(f"--recompute-num-layers must be >= 1, got {count}")
        return {"recompute": "full", "recompute_method": method, "recompute_num_layers": count}

    def ddp_overlap(self) -> dict:
        """The overlap fields of Megatron-Core's ``DistributedDataParallelConfig`` these flags
        ask for (Megatron-LM's rule: the parameter gather overlaps only the distributed
        optimizer's)."""
        if self.overlap_param_gather and not self.use_distributed_optimizer:
            raise ValueError("--overlap-param-gather needs --use-distributed-optimizer (the "
                             "parameters it gathers are the distributed optimizer's shards)")
        return {"overlap_grad_reduce": self.overlap_grad_reduce,
                "overlap_param_gather": self.overlap_param_gather}


@dataclass(frozen=True, kw_only=True)
class OptimizerSection:
    """The optimizer and its learning-rate schedule (Adam, Megatron-Core's)."""

    micro_batch_size: int = flag(type=int, group=_OPTIMISATION)
    lr: float = flag(3e-4, group=_OPTIMISATION)
    min_lr: float = flag(0.0, group=_OPTIMISATION)
    lr_warmup_iters: int = flag(0, group=_OPTIMISATION)
    lr_decay_iters: int | None = flag(None, "default: --train-iters", type=int,
                                      group=_OPTIMISATION)
    lr_decay_style: str = flag("cosine", choices=("constant", "linear", "cosine",
                                                  "inverse-square-root"), group=_OPTIMISATION)
    weight_decay: float = flag(0.01, group=_OPTIMISATION)
    adam_beta1: float = flag(0.9, group=_OPTIMISATION)
    adam_beta2: float = flag(0.95, group=_OPTIMISATION)
    adam_eps: float = flag(1e-8, group=_OPTIMISATION)
    clip_grad: float = flag(1.0, "global gradient-norm clip (0 disables)", group=_OPTIMISATION)


@dataclass(frozen=True, kw_only=True)
class DataSection:
    """The samples a run reads: the same section in ``megatron-kd train`` and ``megatron-kd
    cache build``, so a cache covers exactly the student's samples (the datasets are built from
    this section alone: :func:`~megatron_kd.training.run_checks.build_datasets`)."""

    seq_length: int = flag(type=int, group=_MODEL)
    train_iters: int = flag(type=int, group=_OPTIMISATION)
    global_batch_size: int | None = flag(
        None, "default: micro batch x data-parallel size", type=int, group=_OPTIMISATION)
    seed: int = flag(1234, group=_OPTIMISATION)
    data_path: list[str] | None = flag(
        None, "indexed dataset prefix(es), optionally weighted: [W1] P1 [W2 P2 ...]",
        nargs="+", group=_DATA)
    split: str = flag("969,30,1", "train,valid,test proportions", group=_DATA)
    tokenizer_model: str | None = flag(
        None, "Hugging Face tokenizer.json (or a directory holding one); default: "
              "tokenizer.json in the --kd-teacher-load directory, if there is one", group=_DATA)
    eod_token: str | None = flag(None, group=_DATA)
    eod_mask_loss: bool = flag(
        False, "no loss on end-of-document tokens (Megatron-LM's flag: the KD and the "
               "cross-entropy terms both skip them)", group=_DATA)
    reset_position_ids: bool = flag(
        False, "position ids restart after each end-of-document token (Megatron-LM's flag; "
               "the colocated teacher is given the same positions, so with a KD term only "
               "--kd-mode colocated takes it)", group=_DATA)
    data_cache_path: str | None = flag(None, group=_DATA)
    mock_data: bool = flag(False, "synthetic, learnable token sequences instead of --data-path",
                           group=_DATA)
    eval_iters: int = flag(10, group=_LOGGING)

    def num_samples(self, global_batch_size: int) -> tuple[int, int]:
        """``(train, valid)`` samples of a run at ``global_batch_size``."""
        return (self.train_iters * global_batch_size,
                max(1, self.eval_iters) * global_batch_size)


@dataclass(frozen=True, kw_only=True)
class LoggingSection:
    """Checkpoints, evaluation and what a run prints and writes."""

    save: str | None = flag(None, "checkpoint directory", group=_LOGGING)
    load: str | None = flag(None, "resume from the newest checkpoint here", group=_LOGGING)
    pretrained_checkpoint: str | None = flag(
        None, "initial student weights (model only: an `import-hf` directory, a `megatron-kd "
              "train` checkpoint), at any TP / PP / EP of this run; used only when --load holds "
              "no checkpoint, so a resumed run takes its own", metavar="DIR", group=_LOGGING)
    finetune: bool = flag(
        False, "with --load: its newest checkpoint's model weights only, from iteration 0 with "
               "a new optimizer and learning-rate schedule (Megatron-LM's flag; drop it to "
               "resume the fine-tuning run itself)", group=_LOGGING)
    save_interval: int | None = flag(
        None, "save every N iterations (and at the end) when --save is given", type=int,
        group=_LOGGING)
    eval_interval: int = flag(1000, group=_LOGGING)
    log_json: str | None = flag(None, "one JSON line per step / evaluation", group=_LOGGING)
    log_interval: int = flag(1, "progress-line refresh interval", group=_LOGGING)
    no_progress: bool = flag(False, "no progress bar on stderr", group=_LOGGING)
    exit_signal_handler: bool = flag(
        False, "on SIGTERM (Slurm's scancel and time limits) finish the current step, save a "
               "checkpoint (with --save) and exit 0 (Megatron-LM's flag)", group=_LOGGING)
    exit_duration_in_mins: float | None = flag(
        None, "stop after this many minutes of this process (checked after every step, the "
              "same decision on every rank), saving a checkpoint with --save: set it below the "
              "job's time limit (Megatron-LM's flag; minutes may be fractional here)",
        type=float, group=_LOGGING)
    exit_after_iters: int | None = flag(
        None, "stop (saving if --save) after this many iterations of this run; for testing "
              "resumption", type=int, group=_LOGGING)
    no_load_optim: bool = flag(
        False, "resume from --load without its optimizer state (a new Adam state; the "
               "iteration, samples consumed and learning-rate schedule are the checkpoint's: "
               "Megatron-LM's flag)", group=_LOGGING)
    no_load_rng: bool = flag(
        False, "resume from --load without its RNG states (Megatron-LM's flag)",
        group=_LOGGING)
    ckpt_format: str = flag(
        "torch_dist", "checkpoint format: torch_dist (Megatron-Core's dist_checkpointing, "
                      "loadable at other TP / PP / EP; the only one megatron-kd train writes)",
        group=_LOGGING)

    def __post_init__(self) -> None:
        if self.ckpt_format != "torch_dist":
            raise ValueError(
                f"--ckpt-format {self.ckpt_format!r}: megatron-kd train writes and reads "
                f"torch_dist (Megatron-Core's dist_checkpointing) only; for another format run "
                f"the distillation inside Megatron-LM's pretrain_gpt.py with the --kd-* flags "
                f"(docs/megatron_lm.md)")
        if self.exit_duration_in_mins is not None and not self.exit_duration_in_mins > 0:
            raise ValueError(f"--exit-duration-in-mins must be > 0, got "
                             f"{self.exit_duration_in_mins}")


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """Everything ``megatron-kd train`` was asked for, as typed sections."""

    arch: ArchitectureSection
    parallel: ParallelSection
    optimizer: OptimizerSection
    data: DataSection
    logging: LoggingSection
    metrics: MetricsSection
    kd: KDArgs
    kernels: KernelSection = dataclasses.field(default_factory=KernelSection)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> RunConfig:
        """The sections of the flags :func:`add_arguments` added (``KDArgs`` validates the
        ``--kd-*`` ones)."""
        return cls(arch=from_flags(ArchitectureSection, args),
                   parallel=from_flags(ParallelSection, args),
                   optimizer=from_flags(OptimizerSection, args),
                   data=from_flags(DataSection, args), logging=from_flags(LoggingSection, args),
                   metrics=from_flags(MetricsSection, args), kd=KDArgs.from_args(args),
                   kernels=from_flags(KernelSection, args))

    def flat(self) -> dict:
        """Every flag's value by its field name (W&B's run config)."""
        out: dict = {}
        for section in dataclasses.fields(self):
            out.update(dataclasses.asdict(getattr(self, section.name)))
        return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Megatron-LM-spelled student, data, optimisation and logging flags, plus ``--kd-*``."""
    groups: dict = {}
    for section in (ArchitectureSection, ParallelSection, KernelSection, OptimizerSection,
                    DataSection, LoggingSection):
        add_flags(parser, section, groups=groups)
    add_flags(parser, MetricsSection, title="TensorBoard, Weights & Biases, timers "
                                            "(Megatron-LM's flags)")
    add_kd_args(parser)


def parse_args(argv: list[str]) -> argparse.Namespace:
    """Parse ``megatron-kd train`` flags (for in-process use and tests); make the
    :class:`RunConfig` with :meth:`RunConfig.from_args`."""
    parser = argparse.ArgumentParser(prog="megatron-kd train")
    add_arguments(parser)
    return parser.parse_args(argv)
