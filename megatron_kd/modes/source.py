"""The teacher's side of the loss, as a run asks for it: one interface for every KD mode.

A :class:`TeacherSource` gives the fused loss its teacher for a microbatch
(:meth:`~TeacherSource.inputs`: the loss's own record, a :class:`~megatron_kd.loss.DenseTeacher`
or a :class:`~megatron_kd.loss.TopKTeacher`, in :class:`TeacherInputs`), is started with the
run's microbatches in training order (:meth:`~TeacherSource.start`), reports its step's
statistics as a record (:meth:`~TeacherSource.step_stats`, named when logged:
:mod:`megatron_kd.modes.stats`) and is closed once (:meth:`~TeacherSource.close`). A source is
made for a rank of the student (:class:`StudentPlace`) and a run (:class:`SourceConfig`);
``megatron-kd train`` and Megatron-LM's forward step both use it. One module per mode:
:mod:`~megatron_kd.modes.colocated`, :mod:`~megatron_kd.modes.disaggregated`,
:mod:`~megatron_kd.modes.offline`; :class:`NoTeacher` here; the mode is read in one place,
:func:`megatron_kd.modes.build.build_teacher_source`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from megatron_kd.loss import DenseTeacher, Teacher, TopKTeacher
from megatron_kd.modes.stats import SourceStepStats

# Teacher: the loss's record type, named here too for the hooks above (megatron_lm/), which
# take it from a source and may not import loss/.
__all__ = ["Microbatch", "NoTeacher", "SourceConfig", "StudentPlace", "Teacher", "TeacherInputs",
           "TeacherSource"]


@dataclass(frozen=True, kw_only=True)
class StudentPlace:
    """Where a rank sits in the student's groups, as its teacher source needs to know it."""

    active: bool
    """Whether this rank computes the loss (the student's last pipeline stage): only active
    ranks start clients or decoders."""

    dp_rank: int
    """The data-parallel rank (context-parallel ranks share one)."""

    dp_size: int
    """The data-parallel size."""

    tp_group: Any = None
    """The student's tensor-parallel group (None: one rank)."""

    cp_group: Any = None
    """Context parallelism's group (None: context-parallel size 1)."""

    tp_cp_group: Any = None
    """The tensor x context-parallel group (None without context parallelism)."""

    pg_collection: Any = None
    """Megatron-Core's groups the student was built with (None: ``parallel_state``'s); a
    colocated teacher is built in them."""

    def __post_init__(self) -> None:
        if not 0 <= self.dp_rank < self.dp_size:
            raise ValueError(f"StudentPlace: data-parallel rank {self.dp_rank} of "
                             f"{self.dp_size} does not exist")

    @property
    def tp_size(self) -> int:
        return self.tp_group.size() if self.tp_group is not None else 1

    @property
    def member(self) -> int:
        """This rank's place among the student ranks a teacher connection answers (CP rank x
        TP size + TP rank; 0 sends)."""
        tp_rank = self.tp_group.rank() if self.tp_group is not None else 0
        return (self.cp_group.rank() if self.cp_group is not None else 0) * self.tp_size + tp_rank


@dataclass(frozen=True, kw_only=True)
class SourceConfig:
    """What a run asks of its teacher source beyond the ``--kd-*`` flags."""

    micro_batch_size: int
    """Sequences of one microbatch."""

    seq_length: int
    """Tokens of one sequence."""

    sequence_parallel: bool = False
    """The student's loss takes this TP rank's slice of the sequence: a dense teacher's hidden
    states come so (a colocated teacher runs sequence-parallel too, a remote one's slices are
    not gathered); top-K targets cover the whole sequence either way."""

    attention: str = "auto"
    """A colocated teacher's core attention (the student's ``--attention-backend``)."""

    max_samples: int | None = None
    """Sample ids a disaggregated request header holds (None: the micro-batch size)."""

    rows_by_tokens: bool = False
    """Offline: the trainer knows no sample indices (Megatron-LM's data iterator); each
    microbatch's cache rows are found by its tokens."""

    close_groups: bool = True
    """A colocated source destroys the one-rank pipeline group it made when closed (False:
    the caller's process ends with them)."""

    def __post_init__(self) -> None:
        for name in ("micro_batch_size", "seq_length"):
            if getattr(self, name) < 1:
                raise ValueError(f"SourceConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.max_samples is not None and self.max_samples < 1:
            raise ValueError(f"SourceConfig.max_samples must be >= 1 or None, got "
                             f"{self.max_samples}")


@dataclass(frozen=True, kw_only=True)
class Microbatch:
    """One microbatch, as a teacher source needs to know it."""

    step: int
    """The training step it belongs to (0-based)."""

    index: int
    """Its place within the step."""

    sample_ids: tuple[int, ...] = ()
    """The dataset samples it holds (empty where the trainer does not know them:
    Megatron-LM's data iterator)."""

    tokens: torch.Tensor | Callable[[], torch.Tensor] | None = None
    """``[b, s]`` token ids, or a function that reads them (a schedule collates only the
    microbatches a source asks the tokens of)."""

    positions: torch.Tensor | None = None
    """The sequence positions this rank trains on, in its order (context parallelism: its
    load-balanced chunks); None: the whole sequence."""

    model_inputs: tuple[tuple, dict] | Callable[[], tuple[tuple, dict]] | None = None
    """The positional and keyword arguments to call a model with on this microbatch (the
    student's own, where it had them), or a function that makes them (only a colocated
    teacher asks)."""

    def token_ids(self) -> torch.Tensor:
        """``[b, s]`` token ids."""
        if self.tokens is None:
            raise RuntimeError(f"no token ids for microbatch {self.index} of step {self.step}")
        return self.tokens() if callable(self.tokens) else self.tokens

    def model_call(self) -> tuple[tuple, dict]:
        """``(args, kwargs)`` to call a model with on this microbatch."""
        if self.model_inputs is None:
            raise RuntimeError(f"no model inputs for microbatch {self.index} of step "
                               f"{self.step}")
        return self.model_inputs() if callable(self.model_inputs) else self.model_inputs


@dataclass(frozen=True, kw_only=True)
class TeacherInputs:
    """The teacher's side of one microbatch as a source gives it: the loss's teacher record,
    which reaches the loss as it is, and where its values came from."""

    teacher: Teacher | None = None
    """A :class:`~megatron_kd.loss.DenseTeacher` (``[s, b, h_t]`` final hidden states and the
    ``[local_vocab_size, h_t]`` output-layer shard), a :class:`~megatron_kd.loss.TopKTeacher`
    (``[s, b, K]`` top-K token ids and their log-probabilities), or None: no teacher for this
    microbatch."""

    what: str = ""
    """What the values are and where they came from (named when one is not finite)."""

    @property
    def present(self) -> bool:
        """Whether this microbatch has a teacher."""
        return self.teacher is not None

    @property
    def watched(self) -> torch.Tensor | None:
        """The tensor a non-finite check watches: a dense teacher's hidden states, a top-K
        teacher's log-probabilities."""
        if isinstance(self.teacher, DenseTeacher):
            return self.teacher.hidden
        if isinstance(self.teacher, TopKTeacher):
            return self.teacher.logprobs
        return None


class TeacherSource:
    """The teacher of a run (see the module docstring); the base class is also "no teacher"."""

    timer: str | None = None
    """The step timer its :meth:`inputs` is timed under (``--timing-log-level``)."""

    holds_model: bool = False
    """Whether this rank holds a teacher model."""

    model = None
    """The teacher model this rank holds (a colocated teacher's last pipeline stage)."""

    client = None
    """The started teacher client (a disaggregated teacher's active ranks)."""

    vocab_size: int | None = None
    """The teacher's true vocabulary (the loss's ``vocab_size``: output-layer rows at or past it
    are padding); None without a teacher."""

    streamed: bool = False
    """Whether each training microbatch's inputs can be taken once only, in the schedule's
    order (a stream of responses): a step run again must be given the inputs kept from its
    first run."""

    def start(self, schedule: Iterable[Microbatch]) -> None:
        """Begin serving the microbatches of ``schedule`` (training order, from the resume step
        to the stop step), ahead of training where the source can."""

    def inputs(self, mb: Microbatch, *, training: bool) -> TeacherInputs:
        """The teacher of ``mb`` (the next microbatch of the schedule when ``training``; an
        evaluation microbatch otherwise)."""
        return TeacherInputs()

    def step_stats(self, group: Any) -> SourceStepStats:
        """This step's statistics, combined over ``group`` (collective on it; None: this rank's
        own, no collective), as a record named only when logged. Every rank of ``group`` calls
        it, active or not."""
        return SourceStepStats()

    def summary(self) -> dict[str, Any]:
        """What a run's summary says of its teacher on this rank."""
        return {"teacher_in_memory": self.holds_model}

    def announcement(self) -> str | None:
        """A line for the run's start, where the source has something to say."""
        return None

    def checkpoint_record(self) -> dict[str, Any]:
        """What a student checkpoint records of its teacher beyond ``--kd-teacher-load``."""
        return {}

    def close(self) -> None:
        """Stop clients and decoders; free what the source made (idempotent)."""


class NoTeacher(TeacherSource):
    """No teacher: the loss is the student's cross-entropy."""
