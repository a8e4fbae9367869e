"""``--kd-mode disaggregated`` in ``megatron-kd train``: the student's side of a teacher service.

The student's world holds only student ranks. Every rank reads the teacher's output-layer shard
of its own vocabulary partition from ``--kd-teacher-load`` (one tensor of the checkpoint; a
collective load over the student's world); the ranks of the last pipeline stage each open a
:class:`~megatron_kd.teacher.client.TeacherClient` to the replicas registered at
``--kd-teacher-endpoint``: TP rank 0 of each data-parallel rank sends the token ids of the run's
microbatches ``--kd-prefetch-depth`` ahead (read from the same dataset the student trains on,
by sample index), and the hidden states come back chunked over the TP group.
"""

from __future__ import annotations

import random

import torch
import torch.distributed as dist

from megatron_kd.data.datasets import BatchPlan, collate
from megatron_kd.integration.teacher import load_output_layer_shard, teacher_identity
from megatron_kd.teacher.client import TeacherClient
from megatron_kd.teacher.endpoint import parse_endpoint

__all__ = ["run_id", "teacher_client", "training_schedule"]


def run_id() -> int:
    """A random id for this run, the same on every rank (collective over the default group)."""
    value = [random.SystemRandom().getrandbits(62) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(value, src=0)
    return value[0]


def output_layer_shard(plan, tp: int) -> torch.Tensor:
    """This rank's ``[padded_vocab / tp, h_t]`` teacher output-layer shard (collective)."""
    return load_output_layer_shard(plan.kd.teacher_load, plan.teacher_arch,
                                   plan.kd.teacher_torch_dtype, tp)


def training_schedule(dataset, batches: BatchPlan, global_batch_size: int, start: int,
                      stop: int):
    """The microbatches of steps ``[start, stop)`` in training order, as the teacher client
    sends them: ``(step, microbatch, sample_ids, tokens [b, s])`` (0-based steps)."""
    n = len(dataset)
    for step in range(start, stop):
        consumed = step * global_batch_size
        for m in range(batches.num_microbatches):
            ids = batches.sample_ids(consumed, m, n)
            yield step, m, ids, collate([dataset[i] for i in ids])["tokens"]


def teacher_client(*, plan, args, run: int, dp_rank: int, tp_group, tp_rank: int, tp: int,
                   schedule, device: torch.device, log) -> TeacherClient:
    """The client of one last-stage student rank (not yet started)."""
    arch = plan.teacher_arch
    return TeacherClient(
        endpoint=parse_endpoint(plan.kd.teacher_endpoint),
        expected=teacher_identity(plan.kd.teacher_load, arch, plan.kd.teacher_dtype), run=run,
        dp_rank=dp_rank, tp_group=tp_group if tp > 1 else None, tp_rank=tp_rank, tp_size=tp,
        micro_batch_size=args.micro_batch_size, seq_length=args.seq_length,
        hidden_size=arch.hidden_size, dtype=plan.kd.teacher_torch_dtype, wire_dtype=plan.kd.wire,
        depth=plan.kd.prefetch_depth, timeout_s=plan.kd.teacher_timeout, device=device,
        schedule=schedule if tp_rank == 0 else None, max_samples=args.micro_batch_size, log=log)
