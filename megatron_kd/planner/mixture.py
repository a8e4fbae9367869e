"""Several teachers at once (pure Python, no torch): the plan of ``megatron-kd train`` with one
``--kd-mode`` per teacher, a weighted mixture of N >= 2 teachers.

Each teacher is planned as a one-teacher run plans it in its mode (:mod:`.search`, with the
:class:`~.plan.PlanOptions` of that teacher alone), on one student layout searched for them all:

* **colocated** (the fused loss's colocated mode): its weights and its no-grad forward's working
  set on the student's last stage, and its final hidden states ``[s, b, h_t]``;
* **disaggregated**: its output-layer shard, the ``D`` receive slots of its prefetch ring and
  the gathered buffer in use on the student's last stage; replicas of its own, as many as the
  student's rate needs, and the hidden-state traffic they send;
* **offline**: its decoded top-K targets on the student's last stage, its cache's size and read
  rate.

How they add up on a student GPU (the loss, ``megatron_kd.loss.mixture``, calls the fused loss
once per teacher, sequentially, in teacher order):

* every teacher's inputs for the micro-batch exist at once: summed;
* the colocated teachers' forwards run one after another, each freed before the next, and never
  with the student's attention backward: the peak counts the largest of them, or the attention
  backward's working set where larger (:data:`~.memory.PHASES`);
* a fused-loss call's working memory (its window buffers, with sequence parallelism the gathered
  hidden states) is freed before the next call: the peak counts the largest call's;
* what a call keeps for the backward (its precomputed gradients ``ctx.grads``: the hidden
  gradient and the output layer's accumulator, and its row statistics) lives until the backward:
  one set per teacher, summed.

Refused (``ValueError`` naming it): fewer than two teachers, a mode per teacher that is not
one of ``colocated``, ``disaggregated``, ``offline``, weights that are not one per teacher
(finite, ``>= 0``, one ``> 0``), teachers of different vocabularies, the dense loss path (the
mixture is the fused loss's), a given teacher layout or replica count (one for all teachers is
not what a run of several teachers sets), and two colocated teachers of which one has experts
(one expert grid of the student's groups for several models is not modelled).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from types import MappingProxyType

from megatron_kd.planner import memory as mem
from megatron_kd.planner import schedule
from megatron_kd.planner import traffic as tr
from megatron_kd.planner.memory import GIB, PHASES, ParallelLayout, Term
from megatron_kd.planner.models import PlannedModel
from megatron_kd.planner.plan import Mode, ModePlan, PlanOptions
from megatron_kd.planner.search import (
    _cache_traffic,
    _cp_traffic,
    _loss_allreduce,
    _loss_terms,
    _pipeline_traffic,
    _search_key,
    _student_model_terms,
    _teacher_input_terms,
    _tp_traffic,
    _with_disaggregated_teacher,
    check_student,
    colocated_teacher_layout,
    first_fit,
    num_microbatches,
    search_teacher,
    student_candidates,
)
from megatron_kd.planner.traffic import Traffic

#: ``megatron-kd train``'s ``--kd-mode`` names, and the planner's mode each is planned as.
TEACHER_MODES = {"colocated": Mode.COLOCATED_FUSED, "disaggregated": Mode.DISAGGREGATED,
                 "offline": Mode.OFFLINE_CACHE}

#: The fused loss's working memory of one call, freed before the next teacher's call.
CALL_WORKING = (Term.LOSS_WINDOW, Term.LOSS_GATHERED)


@dataclass(kw_only=True, frozen=True)
class MixtureOptions:
    """A plan of several teachers: the run's options (:attr:`base`, its ``teacher`` the first
    teacher) and each teacher with its mode and weight."""

    base: PlanOptions
    """Everything but the teachers; its ``teacher`` is ``teachers[0]``."""

    teachers: tuple[PlannedModel, ...]
    """The teachers, in ``--kd-mode`` order."""

    modes: tuple[str, ...]
    """One ``--kd-mode`` name per teacher (:data:`TEACHER_MODES`)."""

    weights: tuple[float, ...] | None = None
    """``--kd-teacher-weights`` as given (None: equal weights)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "teachers", tuple(self.teachers))
        object.__setattr__(self, "modes", tuple(self.modes))
        n = len(self.teachers)
        if n < 2:
            raise ValueError(f"a mixture plans N >= 2 teachers, got {n}")
        if len(self.modes) != n:
            raise ValueError(f"--kd-mode {' '.join(self.modes) or '(not given)'}: "
                             f"{len(self.modes)} mode(s) for {n} teachers: give one mode per "
                             f"--teacher, in the same order")
        bad = [m for m in self.modes if m not in TEACHER_MODES]
        if bad:
            raise ValueError(f"--kd-mode {' '.join(bad)}: choose from {tuple(TEACHER_MODES)}")
        if self.base.teacher != self.teachers[0]:
            raise ValueError("MixtureOptions.base.teacher must be the first teacher")
        if self.weights is not None:
            object.__setattr__(self, "weights", tuple(self.weights))
            _check_weights(self.weights, n)
        vocabs = [t.vocab_size for t in self.teachers]
        if len(set(vocabs)) > 1:
            raise ValueError(f"the teachers' vocabularies differ: {vocabs} (teacher order); a "
                             f"mixture's teachers share one vocabulary")
        given = [flag for flag, value in (
            ("--kd-teacher-tensor-model-parallel-size", self.base.teacher_tp),
            ("--kd-teacher-pipeline-model-parallel-size", self.base.teacher_pp),
            ("--kd-teacher-expert-model-parallel-size", self.base.teacher_ep),
            ("--kd-teacher-replicas", self.base.teacher_replicas)) if value is not None]
        if given:
            raise ValueError(f"{', '.join(given)} with {n} teachers: the planner searches each "
                             f"teacher's layout and replicas (one setting for every teacher is "
                             f"not modelled)")
        if self.base.loss_path == "dense":
            raise ValueError("loss_path='dense' with several teachers: the mixture is planned "
                             "as the fused loss runs it, once per teacher")
        colocated = [t for t, m in zip(self.teachers, self.modes) if m == "colocated"]
        if len(colocated) > 1 and any(t.is_moe for t in colocated):
            raise ValueError(f"colocated teachers {[t.name for t in colocated]}, one with "
                             f"experts: several models' experts in the student's groups are "
                             f"not modelled; serve the mixture-of-experts teacher "
                             f"(disaggregated) or cache it (offline)")

    def teacher_options(self, i: int) -> PlanOptions:
        """The one-teacher options of teacher ``i``."""
        return replace(self.base, teacher=self.teachers[i])

    def mode(self, i: int) -> Mode:
        """The planner's mode of teacher ``i``."""
        return TEACHER_MODES[self.modes[i]]

    @property
    def normalized_weights(self) -> tuple[float, ...]:
        """The weights normalized to sum 1 (equal when not given)."""
        weights = self.weights or (1.0,) * len(self.teachers)
        total = math.fsum(weights)
        return tuple(w / total for w in weights)


def _check_weights(weights: tuple[float, ...], n: int) -> None:
    """``--kd-teacher-weights``' rule (``megatron_kd.loss.mixture_weights``, which imports
    torch): one per teacher, finite, ``>= 0``, one ``> 0``."""
    words = " ".join(f"{w:g}" for w in weights)
    if len(weights) != n:
        raise ValueError(f"--kd-teacher-weights {words}: {len(weights)} weight(s) for {n} "
                         f"teachers: give one per teacher")
    if not all(isinstance(w, int | float) and math.isfinite(w) and w >= 0 for w in weights):
        raise ValueError(f"--kd-teacher-weights {words}: each weight must be finite and >= 0")
    if not any(w > 0 for w in weights):
        raise ValueError(f"--kd-teacher-weights {words}: at least one weight must be > 0")


@dataclass(kw_only=True, frozen=True)
class TeacherPlan:
    """One teacher of a mixture's plan."""

    index: int
    name: str
    mode: str
    """Its ``--kd-mode``."""
    weight: float
    """Normalized."""
    terms: Mapping[Term, float] = field(default_factory=dict)
    """Its bytes on one GPU of the student's worst stage (its inputs, a colocated teacher's
    weights and forward, what its loss call keeps for the backward); empty where that stage is
    not the last."""
    teacher_layout: ParallelLayout | None = None
    """A served teacher's replica."""
    teacher_terms: Mapping[Term, float] = field(default_factory=dict)
    """A served teacher's replica GPU (its worst stage)."""
    replicas: int = 0
    gpus: int = 0
    nodes: int = 0
    wire: Mapping[Traffic, float] = field(default_factory=dict)
    """Its traffic (hidden states, the cache's reads and size, its loss call's all-reduces)."""
    wire_ok: bool = True
    fits: bool = True
    """A served teacher's replica fits its GPU."""
    notes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name in ("terms", "teacher_terms", "wire"):
            object.__setattr__(self, name, MappingProxyType(dict(getattr(self, name))))
        object.__setattr__(self, "notes", tuple(self.notes))

    @property
    def student_bytes(self) -> float:
        """Its bytes on the student GPU, its forward's working set included."""
        return sum(self.terms.values())

    def to_dict(self) -> dict:
        return {
            "index": self.index, "teacher": self.name, "mode": self.mode, "weight": self.weight,
            "terms": {t.label: v for t, v in self.terms.items()},
            "student_bytes": self.student_bytes,
            "teacher_layout": asdict(self.teacher_layout) if self.teacher_layout else None,
            "teacher_terms": {t.label: v for t, v in self.teacher_terms.items()},
            "teacher_total_bytes": (mem.total_bytes(self.teacher_terms)
                                    if self.teacher_terms else 0.0),
            "replicas": self.replicas, "teacher_gpus": self.gpus, "teacher_nodes": self.nodes,
            "wire": {f.label: v for f, v in self.wire.items()}, "wire_ok": self.wire_ok,
            "fits": self.fits, "notes": list(self.notes),
        }


@dataclass(kw_only=True, frozen=True)
class MixturePlan:
    """The plan of a mixture: the student's layout and worst GPU, and each teacher."""

    fits: bool
    layout: ParallelLayout
    worst_stage: int
    terms: Mapping[Term, float]
    """The student's own terms on its worst GPU, the largest loss call's working memory and the
    reserve."""
    teachers: tuple[TeacherPlan, ...]
    total_bytes: float
    capacity_bytes: int
    usable_bytes: float
    step_time_s: float
    bubble: float
    student_tokens_per_s: float
    student_gpus: int
    wire: Mapping[Traffic, float] = field(default_factory=dict)
    """The student's collectives (tensor, context and pipeline parallel)."""
    notes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name in ("terms", "wire"):
            object.__setattr__(self, name, MappingProxyType(dict(getattr(self, name))))
        object.__setattr__(self, "teachers", tuple(self.teachers))
        object.__setattr__(self, "notes", tuple(self.notes))

    @property
    def teacher_gpus(self) -> int:
        return sum(t.gpus for t in self.teachers)

    @property
    def teacher_nodes(self) -> int:
        return sum(t.nodes for t in self.teachers)

    @property
    def wire_ok(self) -> bool:
        return all(t.wire_ok for t in self.teachers)

    @property
    def verdict(self) -> str:
        """The plan in one line."""
        gib, cap = self.total_bytes / GIB, self.capacity_bytes / GIB
        usable = self.usable_bytes / GIB
        if self.total_bytes > self.usable_bytes:
            return f"OOM: {gib:.1f} GiB > {usable:.1f} GiB per GPU ({cap:.1f} less the headroom)"
        text = (f"fits: {gib:.1f} of {usable:.1f} GiB ({cap:.1f} less the headroom), "
                f"{self.student_tokens_per_s:,.0f} tokens/s")
        if self.teacher_gpus:
            per_gpu = self.student_tokens_per_s / (self.student_gpus + self.teacher_gpus)
            text += (f", +{self.teacher_gpus} teacher GPU(s) on {self.teacher_nodes} node(s); "
                     f"{per_gpu:,.0f} tokens/s per GPU counting teachers")
        if not all(t.fits for t in self.teachers):
            text += ", a TEACHER REPLICA DOES NOT FIT"
        if not self.wire_ok:
            text += ", WIRE-BOUND (link too slow: the student would stall)"
        return text

    def to_dict(self) -> dict:
        return {
            "fits": self.fits, "layout": asdict(self.layout), "worst_stage": self.worst_stage,
            "terms": {t.label: v for t, v in self.terms.items()},
            "teachers": [t.to_dict() for t in self.teachers],
            "total_bytes": self.total_bytes, "capacity_bytes": self.capacity_bytes,
            "usable_bytes": self.usable_bytes, "step_time_s": self.step_time_s,
            "bubble": self.bubble, "student_tokens_per_s": self.student_tokens_per_s,
            "student_gpus": self.student_gpus, "teacher_gpus": self.teacher_gpus,
            "teacher_nodes": self.teacher_nodes,
            "wire": {f.label: v for f, v in self.wire.items()}, "wire_ok": self.wire_ok,
            "notes": list(self.notes), "verdict": self.verdict,
        }


def mixture_total(student: Mapping[Term, float], teachers: list[Mapping[Term, float]]) -> float:
    """A student GPU's peak: every term summed, except the phases (:data:`~.memory.PHASES`):
    the largest colocated teacher's forward (they run one at a time), or the attention
    backward's working set where larger."""
    merged = dict(student)
    for terms in teachers:
        for term, value in terms.items():
            if term is Term.TEACHER_FORWARD:
                merged[term] = max(merged.get(term, 0.0), value)
            else:
                merged[term] = merged.get(term, 0.0) + value
    phased = set().union(*PHASES)
    steady = sum(v for t, v in merged.items() if t not in phased)
    return steady + max(sum(merged.get(t, 0.0) for t in phase) for phase in PHASES)


def _stage_terms(mopts: MixtureOptions, layout: ParallelLayout, stage: int
                 ) -> tuple[dict[Term, float], list[dict[Term, float]]]:
    """One student GPU of ``stage``: the student's terms (its own, the largest loss call's
    working memory, the reserve) and each teacher's."""
    opts = mopts.base
    student = _student_model_terms(opts, Mode.COLOCATED_FUSED, layout, stage)
    teachers: list[dict[Term, float]] = [{} for _ in mopts.teachers]
    if stage == layout.pp - 1:
        for i, terms in enumerate(teachers):
            topts, mode = mopts.teacher_options(i), mopts.mode(i)
            if mode.colocated:
                tl = colocated_teacher_layout(layout, mode)
                terms[Term.TEACHER_WEIGHTS] = mem.model_state_bytes(
                    topts.teacher, tl, 0, opts.precision, trainable=False).weights
                terms[Term.TEACHER_FORWARD] = mem.teacher_forward_working_bytes(
                    topts.teacher, tl, opts.seq_length, opts.micro_batch_size,
                    opts.activation.activation_bytes, opts.activation.flash_attention)
            terms.update(_teacher_input_terms(topts, mode, layout))
            for term, value in _loss_terms(topts, mode, layout).items():
                if term in CALL_WORKING:  # freed before the next call: the largest counts
                    student[term] = max(student.get(term, 0.0), value)
                else:  # kept for the backward: one per call
                    terms[term] = value
    student[Term.RESERVE] = opts.reserve_bytes
    return student, teachers


def evaluate_mixture(mopts: MixtureOptions, layout: ParallelLayout,
                     searches: Mapping[int, tuple] | None = None) -> MixturePlan:
    """The mixture's plan for a given student layout (``searches``: each served teacher's
    :func:`~.search.search_teacher` answer, by index, when already known)."""
    opts = mopts.base
    for i, mode in enumerate(map(mopts.mode, range(len(mopts.teachers)))):
        check_student(mopts.teacher_options(i), layout, mode)
    stages = [_stage_terms(mopts, layout, stage) for stage in range(layout.pp)]
    totals = [mixture_total(s, t) for s, t in stages]
    worst = max(range(layout.pp), key=lambda st: totals[st])
    student_terms, teacher_terms = stages[worst]
    m = num_microbatches(opts, layout)
    tokens = opts.global_batch_size * opts.seq_length
    recomputed = mem.recomputed_layers(opts.student.num_layers, layout)
    flops = tr.training_flops_per_token(opts.student, opts.seq_length, layout.recompute,
                                        recomputed)
    for teacher, mode in zip(mopts.teachers, map(mopts.mode, range(len(mopts.teachers)))):
        if mode.colocated:
            flops += tr.forward_flops_per_token(teacher, opts.seq_length)
        elif mode is Mode.DISAGGREGATED:  # its output layer, on the student's GPUs
            flops += 2.0 * teacher.vocab_size * teacher.hidden_size
    step = tr.step_time_s(tokens * flops, layout.world_size, opts.gpu.bf16_flops, opts.mfu,
                          layout.pp, m, layout.vp)
    view = ModePlan(mode=Mode.DISAGGREGATED, fits=True, layout=layout, step_time_s=step,
                    student_tokens_per_s=tokens / step, student_gpus=layout.world_size)
    weights = mopts.normalized_weights
    teachers = []
    for i, teacher in enumerate(mopts.teachers):
        topts, mode = mopts.teacher_options(i), mopts.mode(i)
        row = TeacherPlan(index=i, name=teacher.name, mode=mopts.modes[i], weight=weights[i],
                          terms=teacher_terms[i])
        if mode is Mode.OFFLINE_CACHE:
            row = replace(row, wire=_cache_traffic(topts, layout, step))
        else:
            row = replace(row, wire=_loss_allreduce(topts, mode, layout, step))
        if mode is Mode.DISAGGREGATED:
            search = (searches or {}).get(i) or search_teacher(topts)
            served = _with_disaggregated_teacher(view, topts, layout, search)
            row = replace(row, teacher_layout=served.teacher_layout,
                          teacher_terms=served.teacher_terms, replicas=served.teacher_replicas,
                          gpus=served.teacher_gpus, nodes=served.teacher_nodes,
                          wire={**row.wire, **{k: v for k, v in served.wire.items()
                                               if k not in view.wire}},
                          wire_ok=served.wire_ok, fits=search[2], notes=served.notes)
        teachers.append(row)
    total = totals[worst]
    notes = []
    if worst != layout.pp - 1:
        last = totals[-1]
        notes.append(f"the worst stage is {worst}: the teachers' terms and the loss are on the "
                     f"last stage ({last / GIB:.2f} GiB there)")
    return MixturePlan(
        fits=total <= opts.usable_bytes and all(t.fits for t in teachers),
        layout=layout, worst_stage=worst, terms=student_terms, teachers=tuple(teachers),
        total_bytes=total, capacity_bytes=opts.gpu.memory_bytes,
        usable_bytes=opts.usable_bytes, step_time_s=step,
        bubble=schedule.bubble_fraction(layout.pp, layout.vp, m),
        student_tokens_per_s=tokens / step, student_gpus=layout.world_size,
        wire={**_tp_traffic(opts, layout), **_cp_traffic(opts, layout),
              **_pipeline_traffic(opts, layout)},
        notes=tuple(notes),
    )


def plan_mixture(mopts: MixtureOptions) -> MixturePlan:
    """Search the student layout as :func:`~.search.plan_mode` does (the same order), each
    layout checked with every colocated teacher in the student's groups; the first that fits,
    else the lowest peak with a note."""
    n = len(mopts.teachers)
    colocated = [i for i in range(n) if mopts.mode(i).colocated]
    first = colocated[0] if colocated else 0
    mode = Mode.COLOCATED_FUSED if colocated else Mode.OFFLINE_CACHE
    opts = mopts.teacher_options(first)
    candidates = sorted(student_candidates(opts, mode),
                        key=lambda layout: _search_key(opts, layout))
    searches = {i: search_teacher(mopts.teacher_options(i)) for i in range(n)
                if mopts.mode(i) is Mode.DISAGGREGATED}
    return first_fit(candidates, lambda layout: evaluate_mixture(mopts, layout, searches),
                     f"no student layout of {opts.student.name} could be evaluated for the "
                     f"teachers {[t.name for t in mopts.teachers]}")
