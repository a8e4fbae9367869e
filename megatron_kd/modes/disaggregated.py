"""``--kd-mode disaggregated``: the teacher's hidden states from ``megatron-kd teacher serve``
replicas on GPUs of their own, through a prefetching client (:mod:`megatron_kd.teacher`); the
student's ranks hold only the teacher's output-layer shard.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist

from megatron_kd.arch import GPTArchConfig
from megatron_kd.integration.groups import collective_device, shared_random_id
from megatron_kd.integration.teacher import load_output_layer_shard, teacher_identity
from megatron_kd.loss import DenseTeacher
from megatron_kd.modes.args import KDArgs
from megatron_kd.modes.source import (
    Microbatch,
    SourceConfig,
    StudentPlace,
    TeacherInputs,
    TeacherSource,
)
from megatron_kd.modes.stats import RemoteStepStats
from megatron_kd.teacher.client import TeacherClient
from megatron_kd.teacher.config import ClientConfig, ClientPlace
from megatron_kd.teacher.endpoint import parse_endpoint
from megatron_kd.teacher.step_stats import ClientStepStats

__all__ = ["Remote", "log_event", "remote"]


class Remote(TeacherSource):
    """Hidden states from teacher replicas (``megatron-kd teacher serve``) registered at
    ``--kd-teacher-endpoint``; the student's ranks hold only the teacher's output-layer shard.

    On an active rank :meth:`start` connects a
    :class:`~megatron_kd.teacher.client.TeacherClient`: TP rank 0 of each data-parallel rank
    sends the token ids of the schedule's microbatches ``--kd-prefetch-depth`` ahead, every TP
    rank receives its chunk of the hidden states. Evaluation microbatches have no teacher (the
    replicas stream training microbatches only).
    """

    timer = "teacher-wait"
    streamed = True

    def __init__(self, kd: KDArgs, arch: GPTArchConfig, *, weight: torch.Tensor, run: int,
                 place: StudentPlace, config: SourceConfig,
                 log: Callable[[str], None] | None = None) -> None:
        self.kd, self.arch, self.weight, self.run = kd, arch, weight, run
        self.place, self.config, self.log = place, config, log
        self.client = None
        self.vocab_size = arch.vocab_size if arch is not None else None

    def start(self, schedule: Iterable[Microbatch]) -> None:
        if not self.place.active:
            return
        self.client = self._connect(
            (mb.step, mb.index, mb.sample_ids, mb.token_ids()) for mb in schedule)

    def _connect(self, schedule) -> TeacherClient:
        """The started client of this rank, for the replicas at ``--kd-teacher-endpoint``.
        The first rank of a data-parallel rank's TP (x CP) group sends the requests of
        ``schedule`` (``(step, microbatch, sample_ids, tokens)``, the whole sequence); every
        rank receives its part of the hidden states (its TP slice of its CP rank's positions)
        and, unless the loss is sequence-parallel, all-gathers its CP rank's positions over
        its TP group."""
        kd, place, config = self.kd, self.place, self.config
        tp_group = place.tp_group if place.tp_size > 1 else None
        tp = place.tp_size
        cp = place.cp_group.size() if place.cp_group is not None else 1
        member = place.member
        group = place.tp_cp_group if cp > 1 else tp_group
        client_config = ClientConfig(
            micro_batch_size=config.micro_batch_size, seq_length=config.seq_length,
            hidden_size=self.arch.hidden_size, dtype=kd.teacher_torch_dtype,
            wire_dtype=kd.wire, depth=kd.prefetch_depth, timeout_s=kd.teacher_timeout,
            max_samples=config.max_samples or config.micro_batch_size,
            sequence_parallel=config.sequence_parallel, cp_size=cp)
        client_place = ClientPlace(run=self.run, dp_rank=place.dp_rank, member=member,
                                   members=tp * cp,
                                   member_group=group if tp * cp > 1 else None,
                                   gather_group=tp_group)
        client = TeacherClient(
            endpoint=parse_endpoint(kd.teacher_endpoint),
            expected=teacher_identity(kd.teacher_load, self.arch, kd.teacher_dtype),
            config=client_config, place=client_place, device=collective_device(),
            schedule=schedule if member == 0 else None, log=self.log if member == 0 else None)
        client.start()
        return client

    def inputs(self, mb: Microbatch, *, training: bool) -> TeacherInputs:
        if not training:
            return TeacherInputs()
        hidden = self.client.hidden(mb.step, mb.index, mb.sample_ids or None)
        return TeacherInputs(teacher=DenseTeacher(hidden=hidden, weight=self.weight),
                             what=f"teacher hidden states received from {self.client.replica}")

    def step_stats(self, group: Any) -> RemoteStepStats:
        """Hidden-state bytes received, token-id bytes sent (counted by the client: the first
        rank of each data-parallel rank's TP x CP group sends), seconds a receiving rank waited
        (mean over them), the prefetch ring's fill when a response was asked for (mean over the
        sending ranks), live replicas (as data-parallel rank 0's sending rank sees them),
        failovers (each also an event) and tokens answered by each replica. Over ``group``:
        one all-reduce and one object gather; with ``group`` None this rank's own (events and
        live replicas as its client saw them)."""
        client, place = self.client, self.place
        head = client is not None and (place.member == 0 or group is None)
        stats = client.take_step_stats(count_live=head and (place.dp_rank == 0 or group is None)) \
            if client is not None else ClientStepStats()
        if not head:  # the other members of a connection fail over with it: one reports
            stats = replace(stats, failovers=[])
        if group is not None:
            stats = stats.over_ranks(group, collective_device(group))
        return RemoteStepStats(client=stats, dp_size=place.dp_size)

    def close(self) -> None:
        if self.client is not None:
            self.client.close()


def remote(kd: KDArgs, arch: GPTArchConfig, place: StudentPlace, config: SourceConfig, *,
           log: Callable[[str], None] | None = None) -> Remote:
    """The disaggregated source of a student rank: the teacher's output-layer shard (a
    collective load over the world) and an id for this run (collective too)."""
    weight = load_output_layer_shard(kd.teacher_load, arch, kd.teacher_torch_dtype,
                                     place.tp_size)
    return Remote(kd, arch, weight=weight, run=shared_random_id(), place=place, config=config,
                  log=log or log_event)


def log_event(line: str) -> None:
    """A failover or rebalance event of a teacher client, on stderr."""
    print(f"megatron-kd[rank {dist.get_rank()}]: {line}", file=sys.stderr, flush=True)
