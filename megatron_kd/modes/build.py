"""The run's teacher source: the one place the KD mode is read, for ``megatron-kd train`` and
Megatron-LM's hooks alike.

=====================  =====================================  ===================================
``--kd-mode``          source                                 the teacher's outputs
=====================  =====================================  ===================================
(no teacher)           :class:`~.source.NoTeacher`            none: the student's cross-entropy
``colocated``          :class:`~.colocated.Colocated`         a frozen ``GPTModel`` on the
                                                              student's last pipeline stage
``disaggregated``      :class:`~.disaggregated.Remote`        hidden states from ``megatron-kd
                                                              teacher serve`` replicas
``offline``            :class:`~.offline.Cached`              top-K ids and log-probs decoded
                                                              from a cache
=====================  =====================================  ===================================

Several teachers (one ``--kd-mode`` each): :func:`build_run_source` builds each one's source as
above and joins them in a :class:`~.mixture.Mixture`.

A source is built on every rank (its construction may be collective: a checkpoint load, a run
id); :attr:`~.source.StudentPlace.active` says whether this rank computes the loss, and only
active ranks start clients or decoders. A layout (sequence or context parallelism, virtual
stages) changes the sources, once for both trainers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from megatron_kd.arch import GPTArchConfig
from megatron_kd.modes.args import KDArgs
from megatron_kd.modes.colocated import colocated
from megatron_kd.modes.disaggregated import remote
from megatron_kd.modes.mixture import Mixture
from megatron_kd.modes.offline import Cached
from megatron_kd.modes.source import NoTeacher, SourceConfig, StudentPlace, TeacherSource
from megatron_kd.placement import compute_device

__all__ = ["build_run_source", "build_teacher_source"]


def build_teacher_source(kd: KDArgs, teacher_arch: GPTArchConfig | None, place: StudentPlace,
                         config: SourceConfig, *, topk_cache=None,
                         log: Callable[[str], None] | None = None) -> TeacherSource:
    """The run's teacher source for a rank at ``place``; collective over the world.
    ``topk_cache``: offline, the opened and checked cache reader. ``log``: where a
    disaggregated client's failover and rebalance events go (default: stderr)."""
    if kd.mode == "offline":
        return Cached(topk_cache, directory=kd.topk_cache, depth=kd.prefetch_depth,
                      tail=kd.loss.topk_tail, place=place, config=config,
                      device=compute_device())
    if teacher_arch is None:
        return NoTeacher()
    if kd.mode == "disaggregated":
        return remote(kd, teacher_arch, place, config, log=log)
    return colocated(kd, teacher_arch, place, config)


def build_run_source(kd: KDArgs, teacher_archs: Sequence[GPTArchConfig | None],
                     place: StudentPlace, config: SourceConfig, *,
                     topk_caches: Sequence = (None,),
                     log: Callable[[str], None] | None = None) -> TeacherSource:
    """The run's source: :func:`build_teacher_source` of its one teacher, or a
    :class:`~.mixture.Mixture` of one per teacher (``kd.teachers``, ``teacher_archs`` and
    ``topk_caches`` in teacher order), built in that order on every rank (collective)."""
    teachers = kd.teachers
    if not len(teachers) == len(teacher_archs) == len(topk_caches):
        raise ValueError(f"{len(teachers)} teachers, {len(teacher_archs)} architectures and "
                         f"{len(topk_caches)} caches: one each per teacher")
    sources = [build_teacher_source(t, arch, place, config, topk_cache=cache, log=log)
               for t, arch, cache in zip(teachers, teacher_archs, topk_caches)]
    return sources[0] if len(sources) == 1 else Mixture(sources, kd.weights)
