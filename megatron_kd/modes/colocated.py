"""``--kd-mode colocated``: the teacher model on the student's ranks.

The whole (un-pipelined) teacher is built on the student's last pipeline stage, in the student's
tensor, context and expert groups (:meth:`megatron_kd.parallel.ParallelLayout.colocated`), and
run on each microbatch's own model inputs.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_kd.arch import GPTArchConfig
from megatron_kd.integration.output_layer import output_layer_weight, to_sbh
from megatron_kd.integration.teacher import build_frozen_teacher, unpipelined_groups
from megatron_kd.loss import DenseTeacher
from megatron_kd.modes.args import KDArgs
from megatron_kd.modes.source import (
    Microbatch,
    SourceConfig,
    StudentPlace,
    TeacherInputs,
    TeacherSource,
)

__all__ = ["Colocated", "colocated"]


class Colocated(TeacherSource):
    """A frozen teacher model over the student's TP group, on the student's last pipeline
    stage (every stage builds and loads it: the load is collective; see :func:`colocated`)."""

    timer = "teacher-forward"

    def __init__(self, model, *, load_dir: str, groups: list | None = None,
                 vocab_size: int | None = None) -> None:
        self.model = model
        self.holds_model = model is not None
        self.load_dir = load_dir
        self._groups = list(groups or [])
        self.vocab_size = vocab_size

    def inputs(self, mb: Microbatch, *, training: bool) -> TeacherInputs:
        args, kwargs = mb.model_call()
        with torch.no_grad():
            hidden = to_sbh(self.model(*args, **kwargs))
        return TeacherInputs(teacher=DenseTeacher(hidden=hidden,
                                                  weight=output_layer_weight(self.model)),
                             what=f"hidden states of the colocated teacher {self.load_dir}")

    def close(self) -> None:
        for group in self._groups:
            dist.destroy_process_group(group)
        self._groups = []


def colocated(kd: KDArgs, arch: GPTArchConfig, place: StudentPlace,
              config: SourceConfig) -> Colocated:
    """Build and load the whole (un-pipelined) teacher in the student's groups (its TP, CP and
    expert groups, its sequence parallelism and core attention); collective over the world
    (every rank loads; only the active ranks hold it after)."""
    pgc, single = unpipelined_groups(place.pg_collection)
    # Replicated on every pipeline stage: several ranks read the same shard.
    model = build_frozen_teacher(arch, kd.teacher_load, dtype=kd.teacher_torch_dtype,
                                 pg_collection=pgc, replicated=True, keep=place.active,
                                 sequence_parallel=config.sequence_parallel,
                                 attention=config.attention)
    return Colocated(model, load_dir=kd.teacher_load,
                     groups=[single] if config.close_groups else [], vocab_size=arch.vocab_size)
