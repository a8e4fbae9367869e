"""``--kd-mode disaggregated``: the teacher on ranks of its own, streaming hidden states.

One ``torch.distributed`` world: the student's ranks first (``0 .. S-1``), then the teacher's
(``S .. S+N-1``), each side with its own TP / PP / DP layout (:mod:`megatron_kd.parallel`), and
Megatron-Core's ``parallel_state`` describing only the process's own side.

* The **teacher** (:class:`TeacherServer`) builds the teacher ``GPTModel`` with its own layout,
  derives the same samples as each student data-parallel rank it serves (same dataset, seed and
  order: no token data flows student -> teacher), runs its pipeline forward (Megatron-Core's
  schedule, forward only) and, on its last stage, sends each student TP rank its sequence chunk
  of the final hidden states ``[s / tp_s, b, h_t]`` (after the final norm).
* The **student** (:class:`RemoteTeacher`, used by the trainer on its last pipeline stage) holds
  only the teacher's output-layer shard for its own vocabulary partition, receives its chunk
  through a :class:`~megatron_kd.disagg.wire.PrefetchRing`, all-gathers the sequence inside its
  TP group (intra-node) and hands the full ``[s, b, h_t]`` to the fused loss. Logits never cross
  the network; the inter-node bytes per token are exactly ``h_t`` x the element size.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

from megatron_kd.disagg.wire import Header, HiddenSender, PrefetchRing, token_fingerprint
from megatron_kd.parallel import DisaggTopology

__all__ = ["RemoteTeacher", "TeacherServer", "load_output_layer_shard", "run_schedule_bounds"]


def _teacher_dtype(kd) -> torch.dtype:
    return torch.bfloat16 if kd.teacher_dtype == "bf16" else torch.float32


def run_schedule_bounds(args: argparse.Namespace) -> tuple[int, int]:
    """``(first_iteration, stop_iteration)`` of this run, as the student will compute them.

    Both sides read the resume point from the same ``--load`` directory, so the teacher starts
    where the student does without any message from the student.
    """
    from megatron_kd.training.checkpointing import latest_iteration

    start = 0
    if args.load:
        start = latest_iteration(args.load) or 0
    stop = args.train_iters
    if args.exit_after_iters is not None:
        stop = min(stop, start + args.exit_after_iters)
    return start, stop


def load_output_layer_shard(teacher_dir: str, arch, dtype: torch.dtype) -> torch.Tensor:
    """This TP rank's ``[padded_vocab / tp, h_t]`` shard of the teacher's output layer.

    Reads only that tensor from the teacher's ``dist_checkpointing`` checkpoint (the input
    embedding when the teacher ties it to the output layer). Collective over the default group:
    in a split world the teacher's ranks load their layers from the same checkpoint at once.
    """
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.utils import make_tp_sharded_tensor_for_checkpoint

    tp = parallel_state.get_tensor_model_parallel_world_size()
    key = "embedding.word_embeddings.weight" if arch.tie_embeddings else "output_layer.weight"
    local = torch.empty(arch.padded_vocab_size // tp, arch.hidden_size, dtype=dtype)
    request = {key: make_tp_sharded_tensor_for_checkpoint(local, key)}
    loaded = dist_checkpointing.load(request, teacher_dir, validate_access_integrity=False)
    return loaded[key].to(dtype)


class RemoteTeacher:
    """Student side: the teacher's hidden states for each training microbatch, from the wire.

    Only ranks on the student's last pipeline stage receive; each holds the teacher's
    output-layer shard of its vocabulary partition (``weight``).
    """

    def __init__(self, *, topology: DisaggTopology, world_group, args, plan) -> None:
        from megatron.core import parallel_state as ps

        self.topology = topology
        self.world_group = world_group
        self.kd = plan.kd
        self.seq_length = args.seq_length
        self.micro_batch_size = args.micro_batch_size
        self.num_microbatches = plan.global_batch_size // (args.micro_batch_size * plan.dp)
        self.tp = ps.get_tensor_model_parallel_world_size()
        self.tp_group = ps.get_tensor_model_parallel_group()
        if args.seq_length % self.tp:
            raise ValueError(f"--seq-length {args.seq_length} must be divisible by the student's "
                             f"tensor-parallel size {self.tp} (each TP rank receives 1/tp of the "
                             f"sequence)")
        self.h_t = plan.teacher_arch.hidden_size
        self.dtype = _teacher_dtype(plan.kd)
        self.route = topology.route_to(dist.get_rank(group=world_group))
        self.weight = load_output_layer_shard(self.kd.teacher_load, plan.teacher_arch,
                                              self.dtype)
        self.ring: PrefetchRing | None = None
        self.first_step = 0
        self.bytes_this_step = 0

    @property
    def chunk_shape(self) -> tuple[int, int, int]:
        return (self.seq_length // self.tp, self.micro_batch_size, self.h_t)

    def start(self, first_step: int, stop_step: int) -> None:
        """Post the first receives (after the resume point is known)."""
        self.first_step = first_step
        if self.route is None:
            return  # not on the last pipeline stage: nothing to receive
        total = (stop_step - first_step) * self.num_microbatches
        self.ring = PrefetchRing(src=self.route.teacher_rank, depth=self.kd.prefetch_depth,
                                 shape=self.chunk_shape, dtype=self.dtype,
                                 max_samples=self.micro_batch_size, total_messages=total,
                                 timeout=self.kd.teacher_timeout, group=self.world_group,
                                 student_rank=self.route.student_rank)

    def hidden(self, step: int, microbatch: int, sample_ids: list[int],
               tokens: torch.Tensor) -> torch.Tensor:
        """``[s, b, h_t]`` teacher hidden states of one microbatch (all-gathered over TP)."""
        index = (step - self.first_step) * self.num_microbatches + microbatch
        expected = Header(step=step, microbatch=microbatch, chunk=self.route.chunk,
                          num_chunks=self.route.num_chunks, sample_ids=tuple(sample_ids),
                          shape=self.chunk_shape, dtype=self.dtype,
                          fingerprint=token_fingerprint(tokens))
        chunk = self.ring.get(index, expected)
        self.bytes_this_step += self.ring.slot_bytes
        if self.tp == 1:
            full = chunk.clone()
        else:
            full = chunk.new_empty((self.seq_length, *self.chunk_shape[1:]))
            # The sequence chunks of the TP group's ranks make the whole microbatch (intra-node).
            dist.all_gather_into_tensor(full, chunk, group=self.tp_group)
        self.ring.release(index)
        return full

    def take_step_bytes(self) -> int:
        n, self.bytes_this_step = self.bytes_this_step, 0
        return n

    def close(self) -> None:
        if self.ring is not None:
            self.ring.close()


class TeacherServer:
    """Teacher side: forward the served students' microbatches, send the hidden states."""

    def __init__(self, *, topology: DisaggTopology, world_group, args, plan) -> None:
        from megatron.core import parallel_state as ps

        from megatron_kd.data.datasets import BatchPlan
        from megatron_kd.integration import bypass_output_layer
        from megatron_kd.models import build_gpt_model, load_model_checkpoint
        from megatron_kd.training.train import build_datasets

        self.topology = topology
        self.world_group = world_group
        self.args, self.plan = args, plan
        self.kd = plan.kd
        self.rank = dist.get_rank(group=world_group)
        self.is_first = ps.is_pipeline_first_stage()
        self.is_last = ps.is_pipeline_last_stage()
        self.replica = ps.get_data_parallel_rank()
        self.dtype = _teacher_dtype(plan.kd)
        model = build_gpt_model(plan.teacher_arch, pre_process=self.is_first,
                                post_process=self.is_last, params_dtype=self.dtype,
                                seed=args.seed, perform_initialization=False)
        # collective with the student's load of its output-layer shard (same checkpoint)
        load_model_checkpoint(model, self.kd.teacher_load, validate_access_integrity=False)
        if self.is_last:
            bypass_output_layer(model)
        model.eval()
        for p in model.parameters():
            p.requires_grad_(False)
        self.model = model
        self.train_ds, _ = build_datasets(args, plan, need_valid=False)
        self.students = topology.students_of(self.replica)
        self.batch_plans = {d: BatchPlan(plan.global_batch_size, args.micro_batch_size, d,
                                         plan.dp) for d in self.students}
        self.num_microbatches = self.batch_plans[self.students[0]].num_microbatches
        self.senders = {}
        if self.is_last:
            for route in topology.routes_from(self.rank):
                self.senders[route] = HiddenSender(dst=route.student_rank,
                                                   max_samples=args.micro_batch_size,
                                                   group=world_group,
                                                   timeout=self.kd.teacher_timeout)

    @property
    def bytes_sent(self) -> int:
        return sum(s.bytes_sent for s in self.senders.values())

    def serve(self) -> dict:
        """Run every step of the student's run; returns a summary."""
        start, stop = run_schedule_bounds(self.args)
        gbs = self.plan.global_batch_size
        for step in range(start, stop):
            for d in self.students:
                self._forward_student_step(step, d, step * gbs)
        for sender in self.senders.values():
            sender.wait()
        return {"side": "teacher", "rank": self.rank, "steps": stop - start,
                "bytes_sent": self.bytes_sent,
                "messages_sent": sum(s.messages_sent for s in self.senders.values())}

    def _forward_student_step(self, step: int, student_dp: int, consumed: int) -> None:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        from megatron_kd.integration import to_sbh

        batch_plan = self.batch_plans[student_dp]
        microbatches = list(batch_plan.microbatches(self.train_ds, consumed))
        routes = [r for r in self.senders if r.student_dp_rank == student_dp]
        n = len(self.train_ds)
        counter = iter(range(len(microbatches)))

        def forward_step(data_iterator, model):
            batch = next(data_iterator)
            m = next(counter)
            if not torch.cuda.is_available():
                device_batch = batch
            else:
                device_batch = {k: v.cuda(non_blocking=True) for k, v in batch.items()}
            with torch.no_grad():
                output = model(device_batch["tokens"], device_batch["position_ids"], None)

            def send(output_tensor):
                hidden = to_sbh(output_tensor)  # [s, b, h_t]
                ids = tuple(batch_plan.sample_ids(consumed, m, n))
                fingerprint = token_fingerprint(batch["tokens"])
                for route in routes:
                    size = hidden.shape[0] // route.num_chunks
                    chunk = hidden[route.chunk * size:(route.chunk + 1) * size]
                    header = Header(step=step, microbatch=m, chunk=route.chunk,
                                    num_chunks=route.num_chunks, sample_ids=ids,
                                    shape=tuple(chunk.shape), dtype=chunk.dtype,
                                    fingerprint=fingerprint)
                    self.senders[route].send(header, chunk.detach())
                return torch.zeros((), device=output_tensor.device), {}

            return output, send

        forward_backward = get_forward_backward_func()
        from megatron_kd.megatron_cpu import device_context

        with device_context(), torch.no_grad():
            forward_backward(forward_step_func=forward_step, data_iterator=iter(microbatches),
                             model=[self.model], num_microbatches=len(microbatches),
                             seq_length=self.args.seq_length,
                             micro_batch_size=self.args.micro_batch_size, forward_only=True)


def world_size_note(topology: DisaggTopology) -> str:
    s, t = topology.student, topology.teacher
    return (f"disaggregated: student ranks 0-{s.world_size - 1} (tp {s.tp} pp {s.pp} dp {s.dp}), "
            f"teacher ranks {t.offset}-{t.offset + t.world_size - 1} (tp {t.tp} pp {t.pp}, "
            f"{t.dp} replica(s), {topology.students_per_replica} student DP rank(s) each); "
            f"pid {os.getpid()}")
