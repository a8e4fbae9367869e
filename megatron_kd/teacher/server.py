"""Teacher side of a disaggregated teacher: forward the served students' microbatches and send
each student TP rank its sequence chunk of the final hidden states.

:class:`TeacherServer` knows the routes, the students' batches and the wire; how a microbatch
goes through the teacher model is a function it is given (``run_forward``: Megatron-Core's
forward-only pipeline schedule in :mod:`megatron_kd.training.disaggregated`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from megatron_kd.parallel import DisaggTopology
from megatron_kd.teacher.wire import Header, HiddenSender, token_fingerprint

__all__ = ["TeacherServer"]

# run_forward(microbatches, on_hidden): runs every microbatch through the teacher and, on the
# last pipeline stage, calls on_hidden(m, hidden [s, b, h_t]) for microbatch m in order.
RunForward = Callable[[list, Callable[[int, torch.Tensor], None]], None]


class TeacherServer:
    """Serves every step of the student's run from one teacher rank.

    Args:
        topology: both sides' layouts; rank: this rank in ``world_group``.
        replica: this rank's teacher replica (its data-parallel rank).
        is_last: this rank is on the teacher's last pipeline stage (it sends).
        batch_plans: ``{student DP rank: BatchPlan}`` of the students this replica serves.
        train_ds: the training dataset (the same samples the students read).
        run_forward: see :data:`RunForward`.
    """

    def __init__(self, *, topology: DisaggTopology, world_group, rank: int, replica: int,
                 is_last: bool, batch_plans: dict, train_ds, micro_batch_size: int,
                 global_batch_size: int, timeout: float, run_forward: RunForward) -> None:
        self.topology = topology
        self.rank = rank
        self.students = topology.students_of(replica)
        self.batch_plans = batch_plans
        self.train_ds = train_ds
        self.global_batch_size = global_batch_size
        self.run_forward = run_forward
        self.senders = {}
        if is_last:
            for route in topology.routes_from(rank):
                self.senders[route] = HiddenSender(dst=route.student_rank,
                                                   max_samples=micro_batch_size,
                                                   group=world_group, timeout=timeout)

    @property
    def bytes_sent(self) -> int:
        return sum(s.bytes_sent for s in self.senders.values())

    def serve(self, start: int, stop: int) -> dict:
        """Serve steps ``[start, stop)`` of the student's run; returns a summary."""
        for step in range(start, stop):
            for d in self.students:
                self._serve_student_step(step, d, step * self.global_batch_size)
        for sender in self.senders.values():
            sender.wait()
        return {"side": "teacher", "rank": self.rank, "steps": stop - start,
                "bytes_sent": self.bytes_sent,
                "messages_sent": sum(s.messages_sent for s in self.senders.values())}

    def _serve_student_step(self, step: int, student_dp: int, consumed: int) -> None:
        batch_plan = self.batch_plans[student_dp]
        microbatches = list(batch_plan.microbatches(self.train_ds, consumed))
        routes = [r for r in self.senders if r.student_dp_rank == student_dp]
        n = len(self.train_ds)

        def on_hidden(m: int, hidden: torch.Tensor) -> None:  # hidden: [s, b, h_t]
            ids = tuple(batch_plan.sample_ids(consumed, m, n))
            fingerprint = token_fingerprint(microbatches[m]["tokens"])
            for route in routes:
                size = hidden.shape[0] // route.num_chunks
                chunk = hidden[route.chunk * size:(route.chunk + 1) * size]
                header = Header(step=step, microbatch=m, chunk=route.chunk,
                                num_chunks=route.num_chunks, sample_ids=ids,
                                shape=tuple(chunk.shape), dtype=chunk.dtype,
                                fingerprint=fingerprint)
                self.senders[route].send(header, chunk.detach())

        self.run_forward(microbatches, on_hidden)
