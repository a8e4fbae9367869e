"""``--kd-mode disaggregated``: the teacher on ranks of its own, streaming hidden states.

One ``torch.distributed`` world: the student's ranks first (``0 .. S-1``), then the teacher's
(``S .. S+N-1``), each side with its own TP / PP / DP layout (:mod:`megatron_kd.parallel`), and
Megatron-Core's ``parallel_state`` describing only the process's own side
(:func:`megatron_kd.integration.groups.initialize_model_parallel_split`).

* The **teacher** builds the teacher ``GPTModel`` with its own layout, derives the same samples
  as each student data-parallel rank it serves (same dataset, seed and order: no token data
  flows student -> teacher), runs its pipeline forward (Megatron-Core's schedule, forward only)
  and, on its last stage, sends each student TP rank its sequence chunk of the final hidden
  states ``[s / tp_s, b, h_t]`` (:class:`~megatron_kd.teacher.TeacherServer`).
* The **student** trains as in colocated mode with a
  :class:`~megatron_kd.teacher.RemoteTeacher` in place of the teacher model: it holds only the
  teacher's output-layer shard of its vocabulary partition.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.pipeline_parallel import get_forward_backward_func

from megatron_kd.data.datasets import BatchPlan
from megatron_kd.integration.args import KDArgs
from megatron_kd.integration.cpu_shim import device_context
from megatron_kd.integration.groups import default_group, initialize_model_parallel_split
from megatron_kd.integration.output_layer import to_sbh
from megatron_kd.integration.teacher import build_frozen_teacher, load_output_layer_shard
from megatron_kd.parallel import DisaggTopology
from megatron_kd.teacher import RemoteTeacher, TeacherServer
from megatron_kd.training.checkpointing import run_schedule_bounds
from megatron_kd.training.plan import Plan, build_datasets, plan_run
from megatron_kd.training.trainer import Trainer

__all__ = ["train_disaggregated"]


def _remote_teacher(args: argparse.Namespace, plan: Plan, topology: DisaggTopology,
                    world_group) -> RemoteTeacher:
    """The student side; loads the teacher's output-layer shard (collective with the
    teacher's load of its layers: the same checkpoint, one load over the whole world)."""
    tp = ps.get_tensor_model_parallel_world_size()
    dtype = plan.kd.teacher_torch_dtype
    weight = load_output_layer_shard(plan.kd.teacher_load, plan.teacher_arch, dtype, tp)
    return RemoteTeacher(
        route=topology.route_to(dist.get_rank(group=world_group)), world_group=world_group,
        tp_group=ps.get_tensor_model_parallel_group(), tp_size=tp, weight=weight,
        seq_length=args.seq_length, micro_batch_size=args.micro_batch_size,
        num_microbatches=plan.global_batch_size // (args.micro_batch_size * plan.dp),
        dtype=dtype, prefetch_depth=plan.kd.prefetch_depth, timeout=plan.kd.teacher_timeout)


def _teacher_server(args: argparse.Namespace, plan: Plan, topology: DisaggTopology,
                    world_group) -> TeacherServer:
    """The teacher side: its model (own TP / PP) and a forward-only pipeline schedule."""
    is_first, is_last = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
    model = build_frozen_teacher(plan.teacher_arch, plan.kd.teacher_load,
                                 dtype=plan.kd.teacher_torch_dtype, pre_process=is_first,
                                 post_process=is_last, seed=args.seed, replicated=True)
    replica = ps.get_data_parallel_rank()
    students = topology.students_of(replica)
    batch_plans = {d: BatchPlan(plan.global_batch_size, args.micro_batch_size, d, plan.dp)
                   for d in students}
    train_ds, _ = build_datasets(args, plan.student_arch.vocab_size, plan.tokenizer,
                                 plan.global_batch_size, need_valid=False)
    forward_backward = get_forward_backward_func()

    def run_forward(microbatches: list, on_hidden) -> None:
        counter = iter(range(len(microbatches)))

        def forward_step(data_iterator, model):
            batch = next(data_iterator)
            m = next(counter)
            if torch.cuda.is_available():
                batch = {k: v.cuda(non_blocking=True) for k, v in batch.items()}
            with torch.no_grad():
                output = model(batch["tokens"], batch["position_ids"], None)

            def send(output_tensor):
                on_hidden(m, to_sbh(output_tensor))  # [s, b, h_t]
                return torch.zeros((), device=output_tensor.device), {}

            return output, send

        with device_context(), torch.no_grad():
            forward_backward(forward_step_func=forward_step, data_iterator=iter(microbatches),
                             model=[model], num_microbatches=len(microbatches),
                             seq_length=args.seq_length, micro_batch_size=args.micro_batch_size,
                             forward_only=True)

    return TeacherServer(topology=topology, world_group=world_group,
                         rank=dist.get_rank(group=world_group), replica=replica,
                         is_last=is_last, batch_plans=batch_plans, train_ds=train_ds,
                         micro_batch_size=args.micro_batch_size,
                         global_batch_size=plan.global_batch_size,
                         timeout=plan.kd.teacher_timeout, run_forward=run_forward)


def world_size_note(topology: DisaggTopology) -> str:
    s, t = topology.student, topology.teacher
    return (f"disaggregated: student ranks 0-{s.world_size - 1} (tp {s.tp} pp {s.pp} dp {s.dp}), "
            f"teacher ranks {t.offset}-{t.offset + t.world_size - 1} (tp {t.tp} pp {t.pp}, "
            f"{t.dp} replica(s), {topology.students_per_replica} student DP rank(s) each); "
            f"pid {os.getpid()}")


def train_disaggregated(args: argparse.Namespace, *, loss_fn=None) -> dict:
    """Student ranks train, teacher ranks serve hidden states; returns this rank's summary."""
    kd = KDArgs.from_args(args)
    world = dist.get_world_size()
    topology = DisaggTopology.from_world(
        world_size=world, teacher_world_size=kd.teacher_world_size,
        student_tp=args.tensor_model_parallel_size, student_pp=args.pipeline_model_parallel_size,
        teacher_tp=kd.teacher_tp, teacher_pp=kd.teacher_pp)
    plan = plan_run(args, world)  # every check before any model is built
    world_group = dist.group.WORLD
    # Every rank creates both sides' groups, in one order (new_group is collective).
    student_group = dist.new_group(list(topology.student.ranks))
    side = initialize_model_parallel_split(topology)
    try:
        if dist.get_rank() == 0 and not args.no_progress:
            print(f"megatron-kd: {world_size_note(topology)}", file=sys.stderr, flush=True)
        # Both sides read the teacher checkpoint in one collective load over the whole world:
        # the teacher its layers, the student only its output-layer shard.
        if side == "teacher":
            with device_context():
                server = _teacher_server(args, plan, topology, world_group)
                return server.serve(*run_schedule_bounds(args))
        remote = _remote_teacher(args, plan, topology, world_group)
        # The student's own collectives (reports, checkpoints, barriers) stay among its ranks.
        with default_group(student_group), device_context():
            trainer = Trainer(args, plan, loss_fn=loss_fn, remote=remote)
            try:
                summary = trainer.fit()
            finally:
                trainer.close()
        summary["side"] = "student"
        return summary
    finally:
        ps.destroy_model_parallel()
