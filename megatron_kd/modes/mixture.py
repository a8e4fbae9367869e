"""Several teachers at once (``--kd-mode`` with one mode per teacher): a weighted mixture.

:class:`Mixture` holds one source per teacher (each built as a one-teacher run builds it:
:func:`megatron_kd.modes.build.build_teacher_source`) and their weights; a microbatch's teacher
is a :class:`~megatron_kd.loss.TeacherMixture` of their records, which the loss trains on
(:func:`~megatron_kd.loss.mixture_kd_loss`: forward KL to the mixture, the fused loss once per
teacher). Each source keeps its own clients, decoders, failover and statistics.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from megatron_kd.loss import TeacherMixture
from megatron_kd.modes.source import Microbatch, TeacherInputs, TeacherSource
from megatron_kd.modes.stats import MixtureStepStats

__all__ = ["Mixture"]


class Mixture(TeacherSource):
    """``sources[i]`` is teacher ``i``, of weight ``weights[i]`` (normalized by the loss)."""

    def __init__(self, sources: Sequence[TeacherSource], weights: Sequence[float]) -> None:
        if len(sources) < 2 or len(sources) != len(weights):
            raise ValueError(f"a mixture takes N >= 2 sources and one weight each, got "
                             f"{len(sources)} sources and {len(weights)} weights")
        vocabs = {s.vocab_size for s in sources}
        if len(vocabs) > 1:
            raise ValueError(f"the teachers' vocabularies differ: "
                             f"{[s.vocab_size for s in sources]} (teacher order)")
        self.sources, self.weights = tuple(sources), tuple(weights)
        self.holds_model = any(s.holds_model for s in sources)
        self.vocab_size = sources[0].vocab_size
        self.streamed = any(s.streamed for s in sources)

    def start(self, schedule: Iterable[Microbatch]) -> None:
        """Start each source on ``schedule``, which must be iterable again for each (not an
        iterator)."""
        if iter(schedule) is schedule:
            raise TypeError("Mixture.start needs a schedule each source can iterate (a "
                            "re-iterable, not an iterator)")
        for source in self.sources:
            source.start(schedule)

    def combine(self, parts: Sequence[TeacherInputs]) -> TeacherInputs:
        """The mixture's inputs from each source's (teacher order): present when every
        teacher's is (an evaluation microbatch that some teacher does not stream is the
        student's CE alone, as with that teacher alone)."""
        if not all(part.present for part in parts):
            return TeacherInputs()
        return TeacherInputs(teacher=TeacherMixture(tuple(p.teacher for p in parts),
                                                    self.weights),
                             what="; ".join(f"teacher {i}: {p.what}"
                                            for i, p in enumerate(parts)))

    def inputs(self, mb: Microbatch, *, training: bool) -> TeacherInputs:
        return self.combine([s.inputs(mb, training=training) for s in self.sources])

    def step_stats(self, group: Any) -> MixtureStepStats:
        return MixtureStepStats(parts=tuple(s.step_stats(group) for s in self.sources))

    def summary(self) -> dict[str, Any]:
        parts = [s.summary() for s in self.sources]
        return {"teacher_in_memory": self.holds_model, "teachers": parts,
                "teacher_weights": list(self.weights)}

    def announcement(self) -> str | None:
        lines = [f"teacher {i} (weight {w:g}): {s.announcement()}"
                 for i, (s, w) in enumerate(zip(self.sources, self.weights))
                 if s.announcement()]
        return "\n".join(lines) or None

    def checkpoint_record(self) -> dict[str, Any]:
        return {"teachers": [s.checkpoint_record() for s in self.sources],
                "teacher_weights": list(self.weights)}

    def close(self) -> None:
        errors = []
        for source in self.sources:
            try:
                source.close()
            except Exception as e:  # noqa: BLE001 - close the others, then raise the first
                errors.append(e)
        if errors:
            raise errors[0]
