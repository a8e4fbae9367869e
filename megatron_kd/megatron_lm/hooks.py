"""Distillation inside Megatron-LM's ``pretrain_gpt.py``: the pieces its patch plugs in, kept
in one piece because they are one contract (the patch's entry points, in the order Megatron-LM
calls them, sharing one :class:`KDState`).

Megatron-LM keeps its own training loop, data pipeline, checkpoints and logging; the patches in
``patches/`` change three arguments of its ``pretrain(...)`` call and nothing else (older trees,
up to the pinned commit, which hand ``pretrain()`` a model provider; for Megatron-LM main, whose
model builder takes no provider, :func:`add_kd_hooks` appends :func:`pre_wrap_hook` to the model
config instead of wrapping the provider):

* ``extra_args_provider=with_kd_args(<its own provider>)`` -- the ``--kd-*`` flags
  (:func:`megatron_kd.modes.args.add_kd_args`, the same flags ``megatron-kd train`` accepts).
* ``partial(model_provider, <its own model provider>)`` -- :func:`model_provider` builds the
  student exactly as Megatron-LM would (by calling Megatron-LM's provider), makes it return its
  final hidden states instead of logits
  (:func:`~megatron_kd.integration.output_layer.bypass_output_layer`) and, in colocated mode,
  builds and loads the frozen teacher next to it.
* ``partial(forward_step, <its own forward step>)`` -- :func:`forward_step` runs Megatron-LM's
  forward step (its ``get_batch``: TP broadcast, context-parallel slicing, packed sequences) with
  a stand-in model that records the inputs, runs the student without labels (hidden states out)
  and the teacher on the same inputs, and returns the student's hidden states with
  ``partial(loss_func, loss_mask, ...)``.

:func:`loss_func` follows Megatron-LM's ``loss_func(loss_mask, output_tensor)`` contract: it
returns ``(loss_sum, num_tokens, report)``, the loss *summed* over this microbatch's tokens, the
token count as an int tensor, and ``report`` mapping names to ``[sum, tokens]`` pairs, which
Megatron-LM sums over microbatches and data-parallel ranks and divides (its per-token
reporting). Reported: ``"lm loss"`` (the student's cross-entropy on the labels, Megatron-LM's
own meaning of the name), ``"kd loss"`` (the divergence, ``T^2`` included), ``"total loss"``
(what is trained on: ``kd_weight * kd + ce_weight * lm``) and, in evaluation,
``"teacher lm loss"``.

Colocated (``--kd-mode colocated``), the teacher is placed as in ``megatron-kd train`` (see
:mod:`megatron_kd.training.trainer`): not pipelined; every rank of the student's last pipeline
stage holds the whole teacher, tensor-parallel over the student's TP group, so both output
layers share one vocabulary partition. Every rank builds and loads it (the load is collective);
other stages drop it. On the last of several stages Megatron-LM's ``get_batch`` calls the model
without tokens; the teacher takes them from the data iterator's item (TP rank 0 reads it and
broadcasts them over the TP group).

Disaggregated (``--kd-mode disaggregated --kd-teacher-endpoint E``), the world holds only the
student: its ranks load just the teacher's output-layer shard, and on the last stage each
data-parallel rank's TP rank 0 sends the token ids of its microbatches ``--kd-prefetch-depth``
ahead (read ahead from Megatron-LM's data iterator, see
:class:`~megatron_kd.teacher.lookahead.Lookahead`) to a replica of ``megatron-kd teacher
serve`` registered at ``E``; the hidden states come back chunked over the TP group and survive
the loss of a replica (:class:`~megatron_kd.teacher.client.TeacherClient`). Evaluation reports
the student's cross-entropy only (its data iterator is not read ahead).

Layouts: tensor, pipeline, data and expert parallelism as Megatron-LM sets them up;
``--sequence-parallel`` (the student returns its ``[b, s/tp, h]`` slice and the loss gathers
the sequence inside); virtual pipeline stages (the KD state sits on the chunk with the output
layer and reads that chunk's iterator); ``--context-parallel-size`` (the teacher, colocated or
served, answers this rank's load-balanced chunks, and :func:`loss_func` sums over this rank's
tokens, reduced by Megatron-LM over data x context parallelism as for its own loss).

Megatron-LM's checks of the loss stay on: :func:`loss_func` hands its loss to Megatron-Core's
rerun state machine exactly as Megatron-LM's own ``pretrain_gpt.loss_func`` does
(``--check-for-nan-in-loss-and-grad``, ``--check-for-spiky-loss``; see
:func:`~megatron_kd.megatron_lm.checks.validate_loss`).

Offline (``--kd-mode offline --kd-topk-cache DIR``), the world holds only the student; the cache
(:func:`~megatron_kd.megatron_lm.checks.open_topk_cache`) records each sample's token
fingerprint, and the last stage finds each microbatch's rows by its tokens (the data
iterator's, broadcast over TP; this CP rank's positions kept): any layout or sample order, and
a sample the cache does not hold is a ``ValueError`` in its forward step naming it and the cache
(:class:`~megatron_kd.cache.lookup.TokenLookup`).

Several teachers (``--kd-mode`` once per teacher, ``--kd-teacher-weights``): each is checked
and built as one alone is, in ``--kd-mode`` order, and joined in a
:class:`~megatron_kd.modes.mixture.Mixture` (:func:`~megatron_kd.modes.build.build_run_source`,
as ``megatron-kd train`` builds it); the loss is the weighted mixture's, and each teacher's own
KD loss is reported as ``"kd loss teacher <i>"`` (:func:`report_name`), its statistics as
``kd/teacher-<i>/...``. At most one teacher may be disaggregated: the data iterator's
look-ahead feeds one teacher's requests
(:func:`~megatron_kd.megatron_lm.checks.check_megatron_teachers` refuses two).

What is not supported here (a sequence the context-parallel split does not divide,
multi-token prediction, another distillation, ...) is refused with ``ValueError`` before
anything is built: :func:`~megatron_kd.megatron_lm.checks.check_megatron_args`.

Nothing here imports Megatron-LM (``megatron.training``) at import time (only megatron-core):
:func:`model_provider` reads Megatron-LM's ``get_args()`` when it is called, and the model
provider and forward step it wraps are arguments.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from megatron.core import parallel_state as ps

from megatron_kd import known_warnings
from megatron_kd.integration.loss_func import make_kd_loss_func
from megatron_kd.integration.output_layer import (
    bypass_output_layer,
    output_layer_weight,
    unwrap_model,
)
from megatron_kd.megatron_lm.checks import (
    LossChecks,
    check_megatron_teachers,
    open_topk_cache,
    teacher_attention,
    validate_loss,
)
from megatron_kd.megatron_lm.teacher_side import (
    lookahead,
    megatron_lm_args,
    microbatches_per_step,
    run_again,
    start_source,
    teacher_inputs,
    write_teacher_scalars,
)
from megatron_kd.modes.args import KDArgs, add_kd_args
from megatron_kd.modes.build import build_run_source
from megatron_kd.modes.source import NoTeacher, SourceConfig, StudentPlace, Teacher, TeacherSource

# Megatron-LM imports this module before it builds a model: from here on the known third-party
# warnings are hidden (megatron_kd/known_warnings.py; PYTHONWARNINGS=default shows them)
known_warnings.install()

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
    "report_name",
    "with_kd_args",
]

PINNED_MEGATRON_LM_COMMIT = "f88b85f8c60aa89f5cf38b33a09657a4977af6cd"
"""The Megatron-LM commit whose ``pretrain_gpt.py`` the model-provider patch in ``patches/`` is
made for (the last one that hands ``pretrain()`` a model provider)."""

MEGATRON_LM_MAIN_COMMIT = "d98e8a64ddf34856e74b24714e3bedb2f5a39553"
"""The Megatron-LM main commit the model-builder patch is tested at."""

MODEL_BUILDER_PATCH_FROM = "e97ac83603e4bd79a1fe27f015b176510c0a3e1d"
"""The first Megatron-LM commit whose ``pretrain_gpt.py`` the model-builder patch applies to
(``GPTModelConfig.pre_wrap_hooks``, no model provider)."""

PATCHES = {"model_provider": "megatron_lm_f88b85f_pretrain_gpt.patch",
           "model_builder": "megatron_lm_main_pretrain_gpt.patch"}
"""The two patches in ``patches/``, by how ``pretrain_gpt.py`` builds its model."""

REPORT_NAMES = {"loss": "total loss", "kd_loss": "kd loss", "lm_loss": "lm loss",
                "teacher_lm_loss": "teacher lm loss"}
"""Report keys of :func:`megatron_kd.integration.make_kd_loss_func` -> Megatron-LM log names;
with several teachers each one's ``kd_loss_<i>`` is ``kd loss teacher <i>``
(:func:`report_name`)."""


def report_name(key: str) -> str:
    """The Megatron-LM log name of a report key of
    :func:`megatron_kd.integration.make_kd_loss_func` (:data:`REPORT_NAMES`; teacher ``i``'s
    own KD loss ``kd_loss_<i>``: ``kd loss teacher <i>``)."""
    if key in REPORT_NAMES:
        return REPORT_NAMES[key]
    teacher = key.removeprefix("kd_loss_")
    if teacher != key and teacher.isdigit():
        return f"kd loss teacher {int(teacher)}"
    raise KeyError(f"no Megatron-LM log name for the loss report {key!r}")


# ----------------------------------------------------------------------------------------------
# arguments
# ----------------------------------------------------------------------------------------------
def extra_args_provider(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Megatron-LM's ``extra_args_provider``: adds the ``--kd-*`` flags."""
    return add_kd_args(parser)


def with_kd_args(base: Callable | None = None) -> Callable:
    """An ``extra_args_provider`` adding ``base``'s flags (e.g. ModelOpt's), then ``--kd-*``."""
    if base is None:
        return extra_args_provider

    def provider(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        parser = base(parser) or parser
        return extra_args_provider(parser)

    return provider


# ----------------------------------------------------------------------------------------------
# model provider
# ----------------------------------------------------------------------------------------------
@dataclass(kw_only=True)
class KDState:
    """What the forward step needs, attached (as ``kd_state``) to the student chunk that holds
    the output layer. A plain object, not a module: the teacher stays out of the student's
    parameters, gradient buffers and checkpoints."""

    kd: KDArgs
    """The validated ``--kd-*`` flags."""

    config: Any
    """The :class:`~megatron_kd.loss.KDLossConfig` trained on."""

    tp_group: Any
    """The tensor-parallel group the vocabulary is sharded over."""

    cp_group: Any = None
    """The context-parallel group (None: none); Megatron-LM's ``get_batch`` hands this rank its
    load-balanced chunks of each sequence."""

    source: TeacherSource = field(default_factory=NoTeacher)
    """The run's teacher (:mod:`megatron_kd.modes`)."""

    teacher_arch: Any = None
    """The (first loaded) teacher's architecture (None without a loaded teacher)."""

    teacher_archs: tuple = ()
    """Each teacher's architecture, in ``--kd-mode`` order (None: offline)."""

    checks: LossChecks = field(default_factory=LossChecks)
    """Megatron-LM's checks of the loss (its flags)."""

    started: bool = False
    """Whether the source was started (at the first training microbatch)."""

    stats_time: float = 0.0
    """When the source's statistics were last taken (``time.perf_counter``)."""

    lookahead: Any = None
    """The training data iterator, read ahead (see :class:`Lookahead`)."""

    microbatches: int = 0
    """Training microbatches seen on this chunk (a step run again counts once)."""

    kept: dict = field(default_factory=dict)
    """``(step, microbatch) -> TeacherInputs`` of the step under way, kept where Megatron-Core's
    rerun state machine may run it again and the source's outputs come once (a disaggregated
    teacher's)."""

    rerun_iteration: int | None = None
    """The rerun state machine's iteration whose first run was seen last."""

    rerun_first: int = 0
    """:attr:`microbatches` at that iteration's first microbatch."""

    rerun_rewound: bool = False
    """Whether that iteration runs again and the count stepped back to its first microbatch."""

    @property
    def teacher(self):
        """The frozen teacher model this rank holds (colocated), else None (several teachers:
        the first colocated one's; each source is in ``source.sources``)."""
        sources = getattr(self.source, "sources", (self.source,))
        return next((s.model for s in sources if s.model is not None), None)

    @property
    def client(self):
        """The teacher client (disaggregated, once started), else None (several teachers: the
        disaggregated one's)."""
        sources = getattr(self.source, "sources", (self.source,))
        return next((s.client for s in sources if s.client is not None), None)


# The teacher source built at the first model_provider call of this process (virtual stage 0)
# of a last-stage rank, waiting for the call that builds the chunk holding the output layer
# (the last virtual stage).
_pending_teacher: dict[str, TeacherSource] = {}


def _on_last_pipeline_stage(pg_collection) -> bool:
    if pg_collection is not None and getattr(pg_collection, "pp", None) is not None:
        pp = pg_collection.pp
        return pp.rank() == pp.size() - 1
    return ps.is_pipeline_last_stage(ignore_virtual=True)


def _tp_group(pg_collection):
    if pg_collection is not None and getattr(pg_collection, "tp", None) is not None:
        return pg_collection.tp
    return ps.get_tensor_model_parallel_group()


def _cp_groups(pg_collection) -> tuple[Any, Any]:
    """``(cp_group, tp_cp_group)``: context parallelism's group and the TP x CP group, or
    ``(None, None)`` at context-parallel size 1."""
    if pg_collection is not None and getattr(pg_collection, "cp", None) is not None:
        cp, tp_cp = pg_collection.cp, getattr(pg_collection, "tp_cp", None)
    else:
        cp = ps.get_context_parallel_group()
        tp_cp = None
    if cp.size() == 1:
        return None, None
    return cp, tp_cp if tp_cp is not None else ps.get_tensor_and_context_parallel_group()


def model_provider(base_model_provider: Callable, pre_process: bool = True,
                   post_process: bool = True, **kwargs: Any):
    """Megatron-LM's model provider, distilling: ``partial(model_provider, <Megatron-LM's>)``.

    Calls ``base_model_provider(pre_process=..., post_process=..., **kwargs)`` (``vp_stage``,
    ``config``, ``pg_collection`` as Megatron-LM passes them) for the student. On the chunk that
    holds the output layer (``post_process``) the output layer is bypassed (the model returns
    ``[b, s, h]`` final hidden states, ``[b, s/tp, h]`` with sequence parallelism) and a
    :class:`KDState` with the teacher is attached. The first call of the process (``vp_stage``
    None or 0) builds and loads the teacher before the student, on every rank (collective);
    ranks off the last pipeline stage drop it at once.
    """
    args = megatron_lm_args()
    kd, teacher_archs = check_megatron_teachers(args)
    pg_collection = kwargs.get("pg_collection")
    if kwargs.get("vp_stage") in (None, 0):
        # Before the student: building a student chunk may be collective too (tied embeddings
        # all-reduce between the first and last stage), and with virtual stages the ranks reach
        # those collectives at different calls; the teacher's load must not sit between them.
        _prepare_teacher(args, kd, teacher_archs, pg_collection)
    model = base_model_provider(pre_process=pre_process, post_process=post_process, **kwargs)
    if post_process:
        _attach_kd_state(model, args, kd, teacher_archs, pg_collection)
    return model


def pre_wrap_hook(chunks: list) -> list:
    """Megatron-LM main's model builder (``GPTModelBuilder``, from commit 223e244 on): the
    model chunks it built, before DDP and mixed-precision wrapping, made to distil. The teacher
    is built and loaded once (collective over the world: every rank reaches this hook after all
    its chunks are built), then the chunk with the output layer is bypassed and given its
    :class:`KDState`, as :func:`model_provider` does. Append it with :func:`add_kd_hooks`."""
    args = megatron_lm_args()
    kd, teacher_archs = check_megatron_teachers(args)
    pg_collection = getattr(unwrap_model(chunks[0]), "pg_collection", None)
    _prepare_teacher(args, kd, teacher_archs, pg_collection)
    for chunk in chunks:
        if getattr(unwrap_model(chunk), "post_process", False):
            _attach_kd_state(unwrap_model(chunk), args, kd, teacher_archs, pg_collection)
    _pending_teacher.clear()  # ranks off the last stage: nothing of the teacher kept
    return chunks


def add_kd_hooks(model_config):
    """``model_config`` (Megatron-LM main's ``GPTModelConfig``) with :func:`pre_wrap_hook`
    appended to its ``pre_wrap_hooks``; returned for chaining."""
    model_config.pre_wrap_hooks.append(pre_wrap_hook)
    return model_config


def _prepare_teacher(args, kd: KDArgs, teacher_archs, pg_collection) -> None:
    """The run's teacher source (several teachers: a :class:`~megatron_kd.modes.mixture.Mixture`
    of one per teacher, built in ``--kd-mode`` order), built on every rank (collective: a
    colocated teacher's load, a disaggregated one's output layer and run id) and kept on the
    last pipeline stage."""
    last = _on_last_pipeline_stage(pg_collection)
    # Context parallelism: a colocated teacher runs in the student's groups (its CP group too)
    # on the CP-sliced inputs; a disaggregated one's look-ahead sends the whole sequence from
    # the TP x CP group's first rank and each rank receives its positions. The data-parallel
    # rank and size leave context parallelism out (its ranks share one data-parallel rank).
    cp_group, tp_cp_group = _cp_groups(pg_collection)
    # Offline: the data iterator gives no sample indices; rows are found by tokens.
    topk_caches = [open_topk_cache(teacher, args) for teacher in kd.teachers]
    place = StudentPlace(active=last, dp_rank=ps.get_data_parallel_rank(),
                         dp_size=ps.get_data_parallel_world_size(),
                         tp_group=_tp_group(pg_collection), cp_group=cp_group,
                         tp_cp_group=tp_cp_group, pg_collection=pg_collection)
    config = SourceConfig(micro_batch_size=args.micro_batch_size, seq_length=args.seq_length,
                          sequence_parallel=bool(args.sequence_parallel),
                          attention=teacher_attention(args), max_samples=1, rows_by_tokens=True,
                          close_groups=False)
    source = build_run_source(kd, teacher_archs, place, config, topk_caches=topk_caches,
                              log=print)
    if last:
        _pending_teacher["source"] = source


def _attach_kd_state(model, args, kd: KDArgs, teacher_archs, pg_collection) -> None:
    """The output layer of ``model`` (the chunk that has it) bypassed, its KD state attached."""
    bypass_output_layer(model)
    source = _pending_teacher.pop("source", None)
    due = any(arch is not None for arch in teacher_archs) or any(
        teacher.topk_cache for teacher in kd.teachers)
    if source is None and due:  # a teacher is due
        raise RuntimeError("the chunk with the output layer was built before the teacher "
                           "(expected virtual stage 0 first)")
    source = source or NoTeacher()
    vocab_size = source.vocab_size or args.vocab_size  # the teacher's, else the student's
    # Megatron-LM's --gradient-accumulation-fusion (on by default on a GPU): the output-layer
    # weight gradient goes into its DDP's main_grad, as Megatron's own output layer does.
    # --sequence-parallel: the student's (and a dense teacher's) hidden states are this TP
    # rank's slice of the sequence; Megatron-LM has turned it off at TP 1 already.
    model.kd_state = KDState(
        kd=kd, config=kd.loss_config(vocab_size=vocab_size,
                                     gradient_accumulation_fusion=args.gradient_accumulation_fusion,
                                     sequence_parallel=bool(args.sequence_parallel)),
        tp_group=_tp_group(pg_collection), cp_group=_cp_groups(pg_collection)[0],
        source=source, teacher_archs=tuple(teacher_archs),
        teacher_arch=next((arch for arch in teacher_archs if arch is not None), None),
        checks=LossChecks.from_args(args))


def kd_state(model) -> KDState | None:
    """The :class:`KDState` of a (wrapped) student chunk; None on chunks without the output
    layer."""
    return getattr(unwrap_model(model), "kd_state", None)


# ----------------------------------------------------------------------------------------------
# forward step
# ----------------------------------------------------------------------------------------------
class _RecordingModel:
    """Stands in for the student inside Megatron-LM's forward step.

    Records the ``labels`` and ``loss_mask`` the forward step passes, runs the student without
    them (so it returns hidden states, and no cross-entropy over logits) and the teacher on the
    same inputs. Attribute lookups go to the wrapped model (``.module`` too, for Megatron's
    ``get_attr_wrapped_model``).
    """

    def __init__(self, model, state: KDState) -> None:
        self.module = model
        self._state = state
        self.called = False
        self.labels = self.loss_mask = self.teacher_hidden = None

    def __getattr__(self, name: str):
        if name == "module":  # not yet set (copy, unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.module, name)

    def __call__(self, *args: Any, **kwargs: Any):
        if self.called:
            raise RuntimeError("the forward step called the model twice in one microbatch")
        self.called = True
        self.labels = kwargs.pop("labels", None)
        self.loss_mask = kwargs.pop("loss_mask", None)
        if self.labels is None or self.loss_mask is None:
            raise ValueError("the wrapped forward step must call the model with labels= and "
                             "loss_mask= (as Megatron-LM's pretrain_gpt.forward_step does)")
        self.inputs = (args, kwargs)
        return self.module(*args, **kwargs)


def forward_step(base_forward_step: Callable, data_iterator, model, *args: Any, **kwargs: Any):
    """Megatron-LM's forward step, distilling: ``partial(forward_step, <Megatron-LM's>)``.

    Returns ``(output_tensor, loss_func)``. On the chunk with the output layer the output is
    the student's final hidden states ``[b, s, h_s]`` (``[b, s/tp, h_s]`` with
    ``--sequence-parallel``; ``s`` this rank's chunks of the sequence with context
    parallelism) and the loss function is ``partial(loss_func, loss_mask, ...)``
    (see :func:`loss_func`); elsewhere both come from ``base_forward_step`` unchanged. With
    virtual stages Megatron-LM hands each chunk its own data iterator: the one seen here is
    the last chunk's, whose microbatches the schedule runs in order.
    """
    if kwargs.get("return_schedule_plan"):
        raise ValueError("--overlap-moe-expert-parallel-comm schedule plans are not supported "
                         "with --kd-*")
    state = kd_state(model)
    if state is None:  # no output layer on this chunk: nothing to distil here
        return base_forward_step(data_iterator, model, *args, **kwargs)
    training = unwrap_model(model).training
    look = None
    if data_iterator is not None:
        data_iterator = look = lookahead(state, data_iterator, training)
    if training and not state.started:
        start_source(state)
        state.started = True
    recorder = _RecordingModel(model, state)
    output, _ = base_forward_step(data_iterator, recorder, *args, **kwargs)
    if not recorder.called:
        raise RuntimeError("the wrapped forward step returned without calling the model")
    again = training and run_again(state)
    inputs = teacher_inputs(state, recorder, training, look, again)
    if training:
        state.microbatches += 1
        if state.microbatches % microbatches_per_step() == 0 and not again:
            write_teacher_scalars(state)
    return output, partial(
        loss_func, recorder.loss_mask, labels=recorder.labels,
        student_weight=output_layer_weight(model), teacher=inputs.teacher,
        config=state.config if inputs.present or training else
        dataclasses.replace(state.config, kd_weight=0.0, ce_weight=1.0),
        tp_group=state.tp_group, report_teacher_lm_loss=not training, checks=state.checks)


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor, *, labels: torch.Tensor,
              student_weight: torch.Tensor, teacher: Teacher | None, config, tp_group=None,
              report_teacher_lm_loss: bool = False, loss_fn: Callable | None = None,
              checks: LossChecks | None = None):
    """Megatron-LM's ``loss_func(loss_mask, output_tensor)`` on the fused KD loss.

    Args:
        loss_mask: ``[b, s]`` per-token weights (Megatron-LM's batch layout; the whole
            sequence, with sequence parallelism too; with context parallelism ``s`` is this
            rank's chunks of it, as ``get_batch`` cut them).
        output_tensor: ``[b, s, h_s]`` the bypassed student's final hidden states
            (``[b, s/tp, h_s]``, this TP rank's slice, with ``config.sequence_parallel``).
        labels: ``[b, s]`` next-token ids.
        student_weight: ``[local_vocab_size, h_s]`` the student's output-layer shard.
        teacher: the run's source's record for this microbatch (None: no teacher): a
            :class:`~megatron_kd.loss.DenseTeacher` (``[s, b, h_t]`` final hidden states,
            ``[s/tp, b, h_t]`` with ``config.sequence_parallel``, and the
            ``[local_vocab_size, h_t]`` output-layer shard) or a
            :class:`~megatron_kd.loss.TopKTeacher` (``[s, b, K]`` ids and log-probs).
        config: the :class:`~megatron_kd.loss.KDLossConfig`.
        tp_group: the tensor-parallel group of the vocabulary shards.
        report_teacher_lm_loss: also report the teacher's cross-entropy (evaluation).
        loss_fn: replaces ``vocab_parallel_kd_loss`` (same signature; for tests).
        checks: Megatron-LM's NaN / spiky-loss checks of the summed loss
            (:func:`~megatron_kd.megatron_lm.checks.validate_loss`).

    Returns:
        ``(loss_sum, num_tokens, report)`` over this rank's tokens, as Megatron-LM's own
        ``loss_func`` (which it reduces over data x context parallelism):
        ``sum(loss_mask * (kd_weight*KD + ce_weight*CE))``
        with gradients, ``loss_mask.sum()`` as an int tensor, and ``report`` mapping
        ``"total loss"``, ``"kd loss"``, ``"lm loss"`` (and ``"teacher lm loss"``) to detached
        ``[sum, num_tokens]`` pairs.
    """
    kw = {} if loss_fn is None else {"loss_fn": loss_fn}
    inner = make_kd_loss_func(student_weight=student_weight, teacher=teacher, labels=labels,
                              loss_mask=loss_mask, config=config, tp_group=tp_group,
                              report_teacher_lm_loss=report_teacher_lm_loss, **kw)
    loss_sum, num_tokens, report = inner(output_tensor)
    if checks is not None:
        validate_loss(loss_sum, checks)
    return loss_sum, num_tokens, {report_name(key): pair for key, pair in report.items()}
