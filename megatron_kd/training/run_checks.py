"""A run's checks: every flag checked against the others, the teacher checkpoint and the data,
before any model is built or any step runs; :class:`CheckedRun` holds what they resolved.

:func:`check_run` (``megatron-kd train``) and the top-K cache build
(:mod:`megatron_kd.commands.cache_build`) share the checks of the teacher checkpoint
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

from megatron_kd.arch import GPTArchConfig, Role, check_layout
from megatron_kd.cache.format import CacheSpec, load_manifest
from megatron_kd.cache.identity import open_cache_for_run
from megatron_kd.data.datasets import (
    MockGPTDataset,
    build_gpt_datasets,
    check_data_prefixes,
    parse_data_path,
)
from megatron_kd.data.tokenizer import HFTokenizer, MockTokenizer, tokenizer_difference
from megatron_kd.integration.checkpoint import (
    has_model_config,
    read_checkpoint_arch,
    read_checkpoint_extra,
    resolve_model_dir,
)
from megatron_kd.integration.cpu_shim import on_cpu
from megatron_kd.integration.gpt import transformer_engine_available
from megatron_kd.integration.teacher import check_teacher
from megatron_kd.modes.args import KDArgs, check_shared_vocabulary, teacher_label
from megatron_kd.parallel import ParallelLayout, pad_vocab_size
from megatron_kd.parallel.layout import microbatches_per_step
from megatron_kd.training.run_config import ArchitectureSection, DataSection, RunConfig
from megatron_kd.training.student_arch import student_arch as build_student_arch

__all__ = ["CheckedRun", "build_datasets", "check_run", "check_run_layout", "resolve_tokenizer"]


@dataclass
class CheckedRun:
    """Everything resolved from the run's configuration and checked."""

    kd: KDArgs
    student_arch: GPTArchConfig
    teacher_arch: GPTArchConfig | None
    tokenizer: Any
    layout: ParallelLayout
    """The run's layout, built once from the flags and checked with the student (and a
    colocated teacher) by :func:`megatron_kd.arch.check_layout`."""
    global_batch_size: int
    params_dtype: torch.dtype
    micro_batch_size: int = 1
    """``--micro-batch-size``."""
    notes: list[str] = field(default_factory=list)
    topk_cache: Any = None
    """Offline mode: the opened, checked top-K cache (a ``TopKCacheReader``)."""
    teacher_archs: tuple = ()
    """Each teacher's architecture (None: a cached one), in ``kd.teachers`` order;
    :attr:`teacher_arch` is the first one that has one."""
    topk_caches: tuple = ()
    """Each teacher's opened cache (None: not an offline one), in ``kd.teachers`` order;
    :attr:`topk_cache` is the first one."""
    datasets: tuple | None = None
    """Offline mode: ``(train, valid)``, built once by :func:`check_run` to check the cache."""
    pretrained: str | None = None
    """``--pretrained-checkpoint``'s model directory, checked against the student."""

    @property
    def num_microbatches(self) -> int:
        """Micro-batches a data-parallel rank runs a step."""
        return microbatches_per_step(self.global_batch_size, self.micro_batch_size,
                                     self.layout.dp)


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


def _check_flags(config: RunConfig) -> None:
    """The flags alone, before any file is read."""
    arch, data, log = config.arch, config.data, config.logging
    mbs = config.optimizer.micro_batch_size
    for name, value in (("num_layers", arch.num_layers), ("hidden_size", arch.hidden_size),
                        ("num_attention_heads", arch.num_attention_heads),
                        ("seq_length", data.seq_length), ("micro_batch_size", mbs),
                        ("train_iters", data.train_iters),
                        ("eval_interval", log.eval_interval),
                        ("log_interval", log.log_interval)):
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if data.eval_iters < 0:
        raise ValueError(f"--eval-iters must be >= 0, got {data.eval_iters}")
    if config.parallel.bf16 and on_cpu():
        raise ValueError("--bf16 needs a GPU: Megatron-Core's mixed-precision optimizer accepts "
                         "only CUDA tensors. On CPU train the student in fp32 (a bf16 teacher "
                         "is fine: --kd-teacher-dtype bf16)")
    if config.parallel.use_distributed_optimizer and on_cpu():
        raise ValueError("--use-distributed-optimizer needs a GPU: Megatron-Core's "
                         "DistributedOptimizer accepts only CUDA parameters (megatron-core "
                         "0.16-0.19). On CPU leave it off")
    if log.save_interval is not None and log.save_interval < 1:
        raise ValueError(f"--save-interval must be >= 1, got {log.save_interval}")
    document_flags = [f for f, on in (("--eod-mask-loss", data.eod_mask_loss),
                                       ("--reset-position-ids", data.reset_position_ids)) if on]
    if document_flags and data.mock_data:
        raise ValueError(f"{' and '.join(document_flags)} act on the end-of-document tokens of "
                         f"--data-path; --mock-data has none (drop the flag or give --data-path)")
    config.kernels.check_transformer_impl(transformer_engine_available())
    config.parallel.ddp_overlap()  # --overlap-param-gather needs the distributed optimizer
    moved = [t.mode for t in config.kd.teachers if t.mode != "colocated"]
    if data.reset_position_ids and moved and config.kd.loss.kd_weight > 0:
        raise ValueError(
            f"--reset-position-ids with --kd-mode {moved[0]}: the teacher (served or "
            f"cached) is given the token ids only and numbers them 0..s-1, so its targets "
            f"would not be those of the student's positions; use --kd-mode colocated (its "
            f"teacher takes the student's position ids), or drop the flag")


def _layout(config: RunConfig, world_size: int,
            num_layers: int | None) -> tuple[ParallelLayout, int]:
    """``(layout, global_batch_size)``: the run's layout, built once from its flags over
    ``world_size`` ranks for a student of ``num_layers`` layers (None: not known yet)."""
    layout = config.parallel.layout(world_size, num_layers)
    mbs = config.optimizer.micro_batch_size
    gbs = config.data.global_batch_size or mbs * layout.dp
    microbatches_per_step(gbs, mbs, layout.dp)
    return layout, gbs


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


def check_run_layout(layout: ParallelLayout, student_arch: GPTArchConfig, *, kd_mode: str,
                     teacher_arch: GPTArchConfig | None, seq_length: int,
                     num_microbatches: int, transformer_engine: bool) -> None:
    """``megatron-kd train``'s layout check: the student trained in ``layout`` with a colocated
    teacher in its groups, or a served teacher's output layer over its tensor-parallel ranks
    (:func:`megatron_kd.arch.check_layout`); what :func:`check_run` runs before any model is
    built, and what the planner's layouts are held to."""
    colocated = teacher_arch if kd_mode == "colocated" else None
    check_layout(student_arch, layout, role=Role.STUDENT, seq_length=seq_length,
                 num_microbatches=num_microbatches, colocated_teacher=colocated,
                 transformer_engine=transformer_engine)
    if teacher_arch is not None and colocated is None:
        try:
            check_layout(teacher_arch, layout, role=Role.TEACHER_OUTPUT_LAYER)
        except ValueError as e:
            raise ValueError(f"the teacher's output layer: {e}") from None


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


def check_run(config: RunConfig, world_size: int) -> CheckedRun:
    """Check the configuration against itself, the teacher checkpoint and the data; raise
    ``ValueError`` with the offending values. Reads only small files (JSON, tokenizer,
    checkpoint metadata); in offline mode it also builds the datasets to check the cache."""
    kd, data = config.kd, config.data
    _check_flags(config)
    pretrained_dir = pretrained = None
    source = _weights_source(config.logging)
    if source is not None:
        pretrained_dir = _pretrained_dir(*source)
        pretrained = read_checkpoint_arch(pretrained_dir)
    layout, gbs = _layout(config, world_size, config.arch.num_layers
                          or (pretrained.num_layers if pretrained is not None else None))
    checked = [_check_teacher(t, data) for t in kd.teachers]
    kd = kd.with_teachers([t for t, _, _ in checked])
    archs = tuple(arch for _, arch, _ in checked)
    teacher_arch = next((a for a in archs if a is not None), None)
    cache_spec = next((spec for _, _, spec in checked if spec is not None), None)
    loaded = [t.teacher_load for t in kd.teachers if t.teacher_load]
    tokenizer = resolve_tokenizer(data, loaded[0] if loaded else None,
                                  student_dir=pretrained_dir)
    if len(checked) > 1:
        _check_shared_vocabulary(checked, tokenizer, data)
    vocab, padded = _vocabulary(config.arch, teacher_arch, cache_spec, tokenizer, layout.tp,
                                pretrained)
    if tokenizer is None:
        tokenizer = MockTokenizer(vocab)
    student_arch = build_student_arch(config.arch, seq_length=data.seq_length, vocab=vocab,
                                      padded=padded, pretrained=pretrained,
                                      pretrained_dir=pretrained_dir or "")
    run = CheckedRun(kd=kd, student_arch=student_arch, teacher_arch=teacher_arch,
                     tokenizer=tokenizer, layout=layout, global_batch_size=gbs,
                     micro_batch_size=config.optimizer.micro_batch_size,
                     params_dtype=torch.bfloat16 if config.parallel.bf16 else torch.float32,
                     teacher_archs=archs, topk_caches=(None,) * len(archs))
    run.pretrained = pretrained_dir
    if config.parallel.sequence_parallel and layout.tp == 1:
        run.notes.append("--sequence-parallel is off at --tensor-model-parallel-size 1 (as in "
                         "Megatron-LM: there is no sequence to split)")
    for i, (t, arch) in enumerate(zip(kd.teachers, archs)):
        if arch is not None or i == 0:  # the student, with each teacher that has a model
            check_run_layout(layout, student_arch, kd_mode=t.mode, teacher_arch=arch,
                             seq_length=data.seq_length, num_microbatches=run.num_microbatches,
                             transformer_engine=transformer_engine_available())
    caches = tuple(_open_topk_cache(data, run, t.topk_cache) if t.mode == "offline" else None
                   for t in kd.teachers)
    run.topk_caches = caches
    run.topk_cache = next((c for c in caches if c is not None), None)
    return run


def _check_teacher(kd: KDArgs, data: DataSection) -> tuple[KDArgs, Any, Any]:
    """``(kd, architecture, cache manifest)`` of one teacher: its checkpoint checked (and its
    directory resolved in ``kd``), or its cache's manifest read."""
    teacher_arch = cache_spec = None
    if kd.teacher_load:
        # the student's ranks hold the teacher's output layer in the student's partition (a
        # disaggregated teacher's own layout is its replicas' business: `teacher serve` checks it)
        teacher_dir, teacher_arch = check_teacher(kd.teacher_load, seq_length=data.seq_length,
                                                  teacher_args=kd.teacher_args)
        kd = dataclasses.replace(kd, teacher_load=teacher_dir)
    if kd.mode == "offline":
        if not os.path.isdir(kd.topk_cache):
            raise ValueError(f"--kd-topk-cache {kd.topk_cache!r} is not a directory")
        # Only the manifest here (the student's vocabulary); the full check follows below.
        cache_spec = CacheSpec.from_json(load_manifest(kd.topk_cache))
    return kd, teacher_arch, cache_spec


def _check_shared_vocabulary(checked: list, tokenizer, data: DataSection) -> None:
    """Several teachers share the student's tokenizer: their vocabularies are one size (else
    ``ValueError`` with each size and tokenizer), and each loaded teacher's ``tokenizer.json``
    and recorded tokenizer are the run's (``tokenizer``, None with ``--mock-data``)."""
    sizes, names = [], []
    for kd, arch, spec in checked:
        sizes.append(arch.vocab_size if arch is not None else spec.vocab_size)
        if arch is not None:
            tok_file = os.path.join(kd.teacher_load, "tokenizer.json")
            names.append(tok_file if os.path.isfile(tok_file) else "no tokenizer.json")
        else:
            names.append(f"the cache's tokenizer {spec.tokenizer}")
    check_shared_vocabulary([kd for kd, _, _ in checked], sizes, names)
    if tokenizer is None:
        return
    data = dataclasses.replace(data, tokenizer_model=tokenizer.path)
    for i, (kd, arch, _) in enumerate(checked):
        if arch is None:  # a cache checks its tokenizer when it is opened
            continue
        try:  # the one-teacher checks: its tokenizer.json and its recorded tokenizer
            resolve_tokenizer(data, kd.teacher_load)
        except ValueError as e:
            raise ValueError(f"{teacher_label(i, kd)}: {e}; a mixture's teachers must share "
                             f"the student's tokenizer") from None


def _open_topk_cache(data: DataSection, run: CheckedRun, directory: str):
    """Offline: build the run's datasets (once) and open the top-K cache ``directory``,
    refusing one made for other data, sequence length, vocabulary or tokenizer (no fallback to
    an LM-only loss)."""
    if run.datasets is None:
        run.datasets = build_datasets(data, run.student_arch.vocab_size, run.tokenizer,
                                      run.global_batch_size)
    try:
        return open_cache_for_run(
            directory, dataset=run.datasets[0], tokenizer=run.tokenizer,
            seq_length=data.seq_length, vocab_size=run.student_arch.vocab_size,
            num_samples=data.num_samples(run.global_batch_size)[0])
    except ValueError as e:
        raise ValueError(f"--kd-topk-cache {directory!r}: {e}") from None


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
        cache_path=data.data_cache_path, eod_mask_loss=data.eod_mask_loss,
        reset_position_ids=data.reset_position_ids)
