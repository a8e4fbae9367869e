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

import sys

import torch
import torch.distributed as dist

from megatron_kd.data.datasets import BatchPlan, collate
from megatron_kd.integration.groups import collective_device, shared_random_id
from megatron_kd.integration.teacher import connect_teacher, load_output_layer_shard
from megatron_kd.planner.traffic import TOKEN_ID_BYTES
from megatron_kd.teacher.client import TeacherClient

__all__ = ["log_event", "run_id", "start_teacher_client", "step_teacher_stats",
           "training_schedule"]


def run_id() -> int:
    """A random id for this run, the same on every rank (collective over the default group)."""
    return shared_random_id()


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


def start_teacher_client(trainer, start: int, stop: int) -> TeacherClient:
    """The started client of one last-stage student rank for steps ``[start, stop)``."""
    plan, args = trainer.plan, trainer.args
    schedule = training_schedule(trainer.train_ds, trainer.batches, plan.global_batch_size,
                                 start, stop)
    return connect_teacher(
        plan.kd, plan.teacher_arch, run=trainer.run_id, dp_rank=trainer.dp_rank,
        tp_group=trainer.tp_group if plan.tp > 1 else None,
        micro_batch_size=args.micro_batch_size, seq_length=args.seq_length, schedule=schedule,
        device=collective_device(), max_samples=args.micro_batch_size, log=log_event)


def step_teacher_stats(trainer, num_microbatches: int) -> dict:
    """This step's teacher traffic and waits, over the student's ranks (one all-reduce):
    bytes of hidden states received and of token ids sent (``TOKEN_ID_BYTES`` a token, from
    each TP group's rank 0), seconds a receiving rank waited (mean over them), the prefetch
    ring's fill when a response was asked for (mean over the TP ranks 0, which send), live
    replicas (as DP rank 0's TP rank 0 sees them), failovers (each also one JSON line) and
    tokens answered by each replica (one object gather)."""
    remote = trainer.remote
    stats = remote.take_step_stats() if remote is not None else {
        "bytes": 0, "wait_s": 0.0, "occupancy": None}
    head = remote is not None and trainer.tp_rank == 0
    sent = (num_microbatches * trainer.args.micro_batch_size * trainer.args.seq_length
            * TOKEN_ID_BYTES) if head else 0
    events = []
    if head:
        events, trainer._events_seen = (remote.failovers[trainer._events_seen:],
                                        len(remote.failovers))
    live = remote.live_replicas() if head and trainer.dp_rank == 0 else 0
    occupancy = stats["occupancy"]
    vec = torch.tensor([stats["bytes"], sent, len(events), stats["wait_s"], remote is not None,
                        occupancy or 0.0, occupancy is not None, live],
                       dtype=torch.float64, device=collective_device())
    dist.all_reduce(vec)
    got, sent, failovers, wait_s, receivers, fill, senders, live = vec.tolist()
    # tokens each replica answered (TP rank 0 of each DP rank counts), and, in a step with
    # failovers, every event as one JSON line each (rank 0): one object gather
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (stats.get("tokens_by_replica", {}), events))
    by_replica: dict[str, int] = {}
    for tokens, rank_events in gathered:
        for replica, n in tokens.items():
            by_replica[replica] = by_replica.get(replica, 0) + n
        for event in rank_events:
            trainer._json_log.write({"step": trainer._step, **event})
    return {"kd_wire_bytes": int(got), "kd_wire_bytes_per_dp_rank": int(got) // trainer.plan.dp,
            "kd_wire_bytes_to_teacher": int(sent), "failovers": int(failovers),
            "kd_teacher_wait_s": round(wait_s / receivers, 6) if receivers else 0.0,
            "kd_ring_occupancy": round(fill / senders, 4) if senders else None,
            "kd_live_replicas": int(live), "kd_replica_tokens": by_replica}


def log_event(line: str) -> None:
    """A failover or rebalance event of a teacher client, on stderr."""
    print(f"megatron-kd[rank {dist.get_rank()}]: {line}", file=sys.stderr, flush=True)
