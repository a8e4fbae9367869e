"""A run's checks: every flag checked against the others, the teacher checkpoint and the data,
before any model is built or any step runs; :class:`CheckedRun` holds what they resolved.

:func:`check_run` (``megatron-kd train``) and the top-K cache build
(:mod:`megatron_kd.training.cache_build`) share the checks of the teacher checkpoint
(:func:`megatron_kd.integration.teacher.check_teacher`, which Megatron-LM's entry points use
too), of the data and its tokenizer (:func:`resolve_tokenizer`) and the
datasets they build from the run's :class:`~megatron_kd.training.run_config.DataSection`
(:func:`build_datasets`): a cache is built over exactly the samples the student will read.
Everything raises ``ValueError`` naming the offending values, and reads only small files (JSON,
tokenizer, checkpoint metadata).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from megatron_kd.cache.format import CacheSpec, load_manifest
from megatron_kd.cache.identity import open_cache_for_run
from megatron_kd.data.datasets import (
    MockGPTDataset,
    build_gpt_datasets,
    check_data_prefixes,
    parse_data_path,
)
from megatron_kd.data.tokenizer import HFTokenizer, MockTokenizer, tokenizer_difference
from megatron_kd.arch import GPTArchConfig, check_sequence_split
from megatron_kd.integration.args import KDArgs
from megatron_kd.integration.checkpoint import (
    has_model_config,
    read_checkpoint_arch,
    read_checkpoint_extra,
    resolve_model_dir,
)
from megatron_kd.integration.cpu_shim import on_cpu
from megatron_kd.integration.groups import check_expert_biases
from megatron_kd.integration.teacher import check_teacher
from megatron_kd.parallel import check_parallel_sizes, pad_vocab_size
from megatron_kd.training.run_config import ArchitectureSection, DataSection, RunConfig
from megatron_kd.training.student_arch import student_arch as build_student_arch

__all__ = ["CheckedRun", "build_datasets", "check_run", "resolve_tokenizer"]


@dataclass
class CheckedRun:
    """Everything resolved from the run's configuration and checked."""

    kd: KDArgs
    student_arch: GPTArchConfig
    teacher_arch: GPTArchConfig | None
    tokenizer: Any
    tp: int
    pp: int
    dp: int
    global_batch_size: int
    params_dtype: torch.dtype
    ep: int = 1
    """Expert-parallel size (the experts of a mixture-of-experts student or colocated
    teacher)."""
    etp: int | None = None
    """Expert tensor-parallel size (None: the tensor-parallel size)."""
    notes: list[str] = field(default_factory=list)
    topk_cache: Any = None
    """Offline mode: the opened, checked top-K cache (a ``TopKCacheReader``)."""
    datasets: tuple | None = None
    """Offline mode: ``(train, valid)``, built once by :func:`check_run` to check the cache."""
    sequence_parallel: bool = False
    """Sequence parallelism (``--sequence-parallel`` at a tensor-parallel size above 1)."""
    cp: int = 1
    """Context-parallel size."""
    vp: int | None = None
    """Model chunks per pipeline rank (interleaved schedule); None: one."""
    pretrained: str | None = None
    """``--pretrained-checkpoint``'s model directory, checked against the student."""
    model_overrides: dict = field(default_factory=dict)
    """The student's ``TransformerConfig`` settings of the layout: sequence parallelism,
    virtual stages, activation recompute."""


def _positive(**values: int | None) -> None:
    for name, value in values.items():
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")


def resolve_tokenizer(data: DataSection, teacher_dir: str | None, *,
                      student_dir: str | None = None):
    """The run's tokenizer (None with ``--mock-data``), with its data prefixes checked.

    ``--tokenizer-model`` defaults to the teacher's own ``tokenizer.json``, else (no teacher
    in this process: offline, or a served teacher) to the one the student's
    ``--pretrained-checkpoint`` / ``--load`` directory ``student_dir`` carries; a tokenizer that
    is not the teacher's (vocabulary, merges or the teacher's recorded sha256) is refused (an
    offline run's cache checks it against its own record).
    """
    tokenizer_model = data.tokenizer_model
    teacher_tok_file = os.path.join(teacher_dir, "tokenizer.json") if teacher_dir else None
    student_tok_file = os.path.join(student_dir, "tokenizer.json") if student_dir else None
    if tokenizer_model is None and teacher_tok_file and os.path.isfile(teacher_tok_file):
        tokenizer_model = teacher_tok_file  # the teacher's own
    elif tokenizer_model is None and student_tok_file and os.path.isfile(student_tok_file):
        tokenizer_model = student_tok_file  # the one the student's weights came with
    if data.mock_data:
        return None
    if not data.data_path:
        raise ValueError("no training data: give --data-path PREFIX (made by "
                         "`megatron-kd preprocess`) or --mock-data")
    if not tokenizer_model:
        raise ValueError("--data-path needs --tokenizer-model (the tokenizer.json used by "
                         "`megatron-kd preprocess`): neither the teacher's nor the student's "
                         "checkpoint directory holds a tokenizer.json")
    tokenizer = HFTokenizer(tokenizer_model, eod_token=data.eod_token)
    check_data_prefixes(parse_data_path(data.data_path)[0], tokenizer)
    if teacher_dir is None:
        return tokenizer
    if (os.path.isfile(teacher_tok_file)
            and os.path.abspath(tokenizer.path) != os.path.abspath(teacher_tok_file)):
        diff = tokenizer_difference(tokenizer, HFTokenizer(teacher_tok_file))
        if diff:
            raise ValueError(f"--tokenizer-model {tokenizer.path!r} is not the teacher's "
                             f"tokenizer ({teacher_tok_file}): {diff}")
    # a Megatron-LM checkpoint has no model_config.json, so no recorded tokenizer to compare
    extra = read_checkpoint_extra(teacher_dir) if has_model_config(teacher_dir) else {}
    teacher_tok = extra.get("tokenizer_sha256")
    if teacher_tok and teacher_tok != tokenizer.sha256:
        raise ValueError(f"the teacher {teacher_dir!r} was made with another tokenizer "
                         f"(sha256 {teacher_tok[:12]}...) than --tokenizer-model "
                         f"{tokenizer.path!r} ({tokenizer.sha256[:12]}...): student and "
                         f"teacher must tokenize alike")
    return tokenizer


def _check_flags(config: RunConfig, world_size: int) -> tuple[int, int, int, int]:
    """``(tp, pp, dp, global_batch_size)`` from the flags alone."""
    arch, par, data, log = config.arch, config.parallel, config.data, config.logging
    mbs = config.optimizer.micro_batch_size
    _positive(num_layers=arch.num_layers, hidden_size=arch.hidden_size,
              num_attention_heads=arch.num_attention_heads, seq_length=data.seq_length,
              micro_batch_size=mbs, train_iters=data.train_iters,
              tensor_model_parallel_size=par.tensor_model_parallel_size,
              pipeline_model_parallel_size=par.pipeline_model_parallel_size,
              eval_interval=log.eval_interval, log_interval=log.log_interval)
    if data.eval_iters < 0:
        raise ValueError(f"--eval-iters must be >= 0, got {data.eval_iters}")
    tp, pp = par.tensor_model_parallel_size, par.pipeline_model_parallel_size
    dp = check_parallel_sizes(world_size, tp, pp, par.expert_model_parallel_size,
                              par.expert_tensor_parallel_size, par.context_parallel_size)
    gbs = data.global_batch_size or mbs * dp
    if gbs % (mbs * dp):
        raise ValueError(f"--global-batch-size {gbs} is not divisible by --micro-batch-size "
                         f"{mbs} x data-parallel size {dp}")
    if par.bf16 and on_cpu():
        raise ValueError("--bf16 needs a GPU: Megatron-Core's mixed-precision optimizer accepts "
                         "only CUDA tensors. On CPU train the student in fp32 (a bf16 teacher "
                         "is fine: --kd-teacher-dtype bf16)")
    if par.use_distributed_optimizer and on_cpu():
        raise ValueError("--use-distributed-optimizer needs a GPU: Megatron-Core's "
                         "DistributedOptimizer accepts only CUDA parameters (megatron-core "
                         "0.16-0.19). On CPU leave it off")
    if log.save_interval is not None and log.save_interval < 1:
        raise ValueError(f"--save-interval must be >= 1, got {log.save_interval}")
    return tp, pp, dp, gbs


def _vocabulary(arch: ArchitectureSection, teacher_arch, cache_spec, tokenizer, tp: int,
                pretrained: GPTArchConfig | None) -> tuple[int, int]:
    """``(vocab_size, padded_vocab_size)``: one partition for student and teacher."""
    if teacher_arch is not None:
        vocab, padded = teacher_arch.vocab_size, teacher_arch.padded_vocab_size
        if arch.vocab_size is not None and arch.vocab_size != vocab:
            raise ValueError(f"--vocab-size {arch.vocab_size} != the teacher's vocabulary "
                             f"{vocab}: student and teacher must share one vocabulary")
    else:
        # Offline: the cache's true vocabulary (a different --vocab-size is refused when the
        # cache is opened, naming both values).
        default_vocab = (cache_spec.vocab_size if cache_spec is not None
                         else pretrained.vocab_size if pretrained is not None
                         else tokenizer.vocab_size if tokenizer is not None else None)
        vocab = arch.vocab_size or default_vocab
        if vocab is None:
            raise ValueError("--mock-data without a teacher needs --vocab-size")
        padded = (pretrained.padded_vocab_size
                  if pretrained is not None and vocab == pretrained.vocab_size
                  else pad_vocab_size(vocab, tp, arch.make_vocab_size_divisible_by))
    if tokenizer is not None and tokenizer.vocab_size > vocab:
        raise ValueError(f"the tokenizer has {tokenizer.vocab_size} tokens but the "
                         f"{'teacher' if teacher_arch else 'student'} vocabulary is {vocab}: "
                         f"the tokenizer does not belong to this model")
    return vocab, padded


def _check_experts(student: GPTArchConfig, teacher: GPTArchConfig | None, tp: int,
                   ep: int, etp: int | None, sp: bool) -> None:
    """Mixture-of-experts layouts this trainer can run; ValueError naming the values if not.
    ``teacher``: a teacher built in the student's groups (colocated), else None."""
    moe = [arch for arch in (student, teacher) if arch is not None and arch.num_experts]
    if ep > 1 and not moe:
        raise ValueError(f"--expert-model-parallel-size {ep} but neither the student nor a "
                         f"colocated teacher has experts (--num-experts)")
    for arch in moe:
        arch.check_expert_parallel(ep)
        check_expert_biases(arch, tp, etp)
    if student.num_experts and student.add_bias_linear:
        raise ValueError("a mixture-of-experts student with --add-bias-linear (gpt-oss-like) "
                         "cannot train: Megatron-Core's expert MLP adds its bias in place on "
                         "a view and fails in backward (megatron-core 0.16.1 and 0.19.2, "
                         "mlp.py); such a model works as a teacher")
    if student.linear_attention_layers and tp > 1 and not sp:
        raise ValueError(f"a Gated DeltaNet student (--experimental-attention-variant, layers "
                         f"{student.linear_attention_layers}) at --tensor-model-parallel-size "
                         f"{tp} needs --sequence-parallel: Megatron-Core's DeltaNet output norm "
                         f"is one weight shared by the heads of every TP rank, and only a "
                         f"sequence-parallel norm has its gradient summed over the TP ranks "
                         f"(without it each rank's copy follows its own heads: megatron-core "
                         f"0.16.1 and 0.19.2)")
    if student.num_experts and tp > 1 and not sp:
        raise ValueError(f"a mixture-of-experts student (--num-experts {student.num_experts}) at "
                         f"--tensor-model-parallel-size {tp} needs --sequence-parallel "
                         f"(Megatron-Core's MoELayer refuses tensor parallelism without it in "
                         f"training)")


def _check_layout(config: RunConfig, run: CheckedRun) -> None:
    """Sequence parallelism, virtual pipeline stages and activation recompute: refused before
    any model is built, naming the flags and values, where Megatron-Core could not run them;
    sets ``run.sequence_parallel``, ``run.vp`` and ``run.model_overrides``."""
    par, seq = config.parallel, config.data.seq_length
    tp, pp = run.tp, run.pp
    run.sequence_parallel = par.sequence_parallel and tp > 1
    if par.sequence_parallel and tp == 1:
        run.notes.append("--sequence-parallel is off at --tensor-model-parallel-size 1 (as in "
                         "Megatron-LM: there is no sequence to split)")
    cp = run.cp = par.context_parallel_size
    check_sequence_split(seq, tp=tp, cp=cp, sequence_parallel=run.sequence_parallel)
    run.student_arch.check_context_parallel(cp, role="student",
                                            advice="use --context-parallel-size 1")
    if run.kd.mode == "colocated" and run.teacher_arch is not None:
        run.teacher_arch.check_context_parallel(
            cp, role="teacher", colocated=True,
            advice="serve it (--kd-mode disaggregated) or cache it (--kd-mode offline)")
    vp = par.virtual_stages(run.student_arch.num_layers)
    if vp is not None:
        if vp < 1:
            raise ValueError(f"--virtual-pipeline-model-parallel-size must be >= 1, got {vp}")
        if pp == 1:
            raise ValueError(f"virtual pipeline stages ({vp} per rank) need "
                             f"--pipeline-model-parallel-size > 1")
        microbatches = run.global_batch_size // (config.optimizer.micro_batch_size * run.dp)
        if microbatches % pp:
            raise ValueError(f"the interleaved schedule ({vp} virtual stages per rank) runs "
                             f"microbatches in groups of --pipeline-model-parallel-size {pp}: "
                             f"{microbatches} microbatches a step (--global-batch-size "
                             f"{run.global_batch_size} / (--micro-batch-size "
                             f"{config.optimizer.micro_batch_size} x data-parallel size "
                             f"{run.dp})) is not a multiple of it")
        run.student_arch.check_pipeline_parallel(pp, vp)
    run.vp = vp if vp != 1 else None
    layers = run.student_arch.num_layers // (pp * (run.vp or 1))
    overrides = {"sequence_parallel": run.sequence_parallel}
    if run.vp is not None:
        overrides["virtual_pipeline_model_parallel_size"] = run.vp
    overrides.update(_recompute(par, layers))
    run.model_overrides = overrides


def _weights_source(logging) -> tuple[str, str] | None:
    """``(directory, flag)`` the student's first weights come from: ``--pretrained-checkpoint``,
    or with ``--finetune`` the checkpoint in ``--load``; None: a random start (or a resume)."""
    if logging.finetune:
        if logging.pretrained_checkpoint:
            raise ValueError(f"--finetune takes the weights of --load {logging.load!r}; "
                             f"--pretrained-checkpoint {logging.pretrained_checkpoint!r} names "
                             f"another source: give one of them")
        if not logging.load:
            raise ValueError("--finetune needs --load DIR (the checkpoint whose weights it "
                             "starts from)")
        return logging.load, "--load (with --finetune)"
    if logging.pretrained_checkpoint:
        return logging.pretrained_checkpoint, "--pretrained-checkpoint"
    return None


def _pretrained_dir(path: str, flag: str = "--pretrained-checkpoint") -> str:
    """The model directory of ``path`` (a training checkpoint root gives its newest
    iteration)."""
    if not os.path.isdir(path):
        raise ValueError(f"{flag} {path!r} is not a directory")
    try:
        return resolve_model_dir(path)
    except ValueError as e:
        raise ValueError(f"{flag}: {e}") from None


def _recompute(par, layers: int) -> dict:
    """The recompute settings of Megatron-Core's ``TransformerConfig``; ``layers``: a model
    chunk's."""
    granularity, method, count = (par.recompute_granularity, par.recompute_method,
                                  par.recompute_num_layers)
    if granularity is None:
        if method is not None or count is not None:
            raise ValueError(f"--recompute-method {method} / --recompute-num-layers {count} "
                             f"need --recompute-granularity full")
        return {}
    if granularity == "selective":
        if method is not None or count is not None:
            raise ValueError(f"--recompute-granularity selective recomputes the core attention "
                             f"of every layer: --recompute-method {method} / "
                             f"--recompute-num-layers {count} do not apply (drop them)")
        return {"recompute_granularity": "selective"}
    if method is None or count is None:
        raise ValueError("--recompute-granularity full needs --recompute-method (uniform or "
                         "block) and --recompute-num-layers")
    if not 1 <= count <= layers:
        raise ValueError(f"--recompute-num-layers {count} must be between 1 and the layers of a "
                         f"model chunk ({layers})")
    return {"recompute_granularity": "full", "recompute_method": method,
            "recompute_num_layers": count}


def check_run(config: RunConfig, world_size: int) -> CheckedRun:
    """Check the configuration against itself, the teacher checkpoint and the data; raise
    ``ValueError`` with the offending values. Reads only small files (JSON, tokenizer,
    checkpoint metadata); in offline mode it also builds the datasets to check the cache."""
    kd, data = config.kd, config.data
    tp, pp, dp, gbs = _check_flags(config, world_size)
    teacher_arch = None
    if kd.teacher_load:
        # the student's ranks hold the teacher's output layer in the student's partition (a
        # disaggregated teacher's own layout is its replicas' business: `teacher serve` checks it)
        teacher_dir, teacher_arch = check_teacher(kd.teacher_load, seq_length=data.seq_length,
                                                  teacher_args=kd.teacher_args,
                                                  tp_sizes=(tp,))
        kd = dataclasses.replace(kd, teacher_load=teacher_dir)
    cache_spec = None
    if kd.mode == "offline":
        if not os.path.isdir(kd.topk_cache):
            raise ValueError(f"--kd-topk-cache {kd.topk_cache!r} is not a directory")
        # Only the manifest here (the student's vocabulary); the full check follows below.
        cache_spec = CacheSpec.from_json(load_manifest(kd.topk_cache))
    pretrained_dir = pretrained = None
    source = _weights_source(config.logging)
    if source is not None:
        pretrained_dir = _pretrained_dir(*source)
        pretrained = read_checkpoint_arch(pretrained_dir)
    tokenizer = resolve_tokenizer(data, kd.teacher_load, student_dir=pretrained_dir)
    vocab, padded = _vocabulary(config.arch, teacher_arch, cache_spec, tokenizer, tp,
                                pretrained)
    if tokenizer is None:
        tokenizer = MockTokenizer(vocab)
    student_arch = build_student_arch(config.arch, seq_length=data.seq_length, vocab=vocab,
                                      padded=padded, tp=tp, pp=pp, pretrained=pretrained,
                                      pretrained_dir=pretrained_dir or "")
    ep = config.parallel.expert_model_parallel_size
    etp = config.parallel.expert_tensor_parallel_size
    sp = config.parallel.sequence_parallel and tp > 1
    _check_experts(student_arch, teacher_arch if kd.mode == "colocated" else None, tp, ep, etp,
                   sp)
    run = CheckedRun(kd=kd, student_arch=student_arch, teacher_arch=teacher_arch,
                     tokenizer=tokenizer, tp=tp, pp=pp, dp=dp, ep=ep, etp=etp,
                     global_batch_size=gbs,
                     params_dtype=torch.bfloat16 if config.parallel.bf16 else torch.float32)
    run.pretrained = pretrained_dir
    _check_layout(config, run)
    if kd.mode == "offline":
        _open_topk_cache(data, run)
    return run


def _open_topk_cache(data: DataSection, run: CheckedRun) -> None:
    """Offline mode: build the run's datasets and open the top-K cache, refusing one made for
    other data, sequence length, vocabulary or tokenizer (no fallback to an LM-only loss)."""
    run.datasets = build_datasets(data, run.student_arch.vocab_size, run.tokenizer,
                                  run.global_batch_size)
    try:
        run.topk_cache = open_cache_for_run(
            run.kd.topk_cache, dataset=run.datasets[0], tokenizer=run.tokenizer,
            seq_length=data.seq_length, vocab_size=run.student_arch.vocab_size,
            num_samples=data.num_samples(run.global_batch_size)[0])
    except ValueError as e:
        raise ValueError(f"--kd-topk-cache {run.kd.topk_cache!r}: {e}") from None


def build_datasets(data: DataSection, vocab_size: int, tokenizer, global_batch_size: int,
                   *, need_valid: bool = True):
    """``(train, valid)`` datasets of a run: the same samples on every rank that asks (the
    top-K cache build and the trainer build the very same ones, from the same section)."""
    train_samples, valid_samples = data.num_samples(global_batch_size)
    if data.mock_data:
        train = MockGPTDataset(vocab_size=vocab_size, seq_length=data.seq_length,
                               num_samples=train_samples, seed=data.seed)
        valid = (MockGPTDataset(vocab_size=vocab_size, seq_length=data.seq_length,
                                num_samples=valid_samples, seed=data.seed + 1)
                 if need_valid else None)
        return train, valid
    return build_gpt_datasets(
        data_path=data.data_path, split=data.split, seq_length=data.seq_length, seed=data.seed,
        tokenizer=tokenizer, train_samples=train_samples, valid_samples=valid_samples,
        cache_path=data.data_cache_path)
