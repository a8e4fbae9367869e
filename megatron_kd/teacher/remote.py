"""Student side of a disaggregated teacher: its hidden states for each training microbatch.

Only ranks on the student's last pipeline stage receive. Each holds the teacher's output-layer
shard of its own vocabulary partition (``weight``), receives its ``1/tp`` sequence chunk of the
teacher's final hidden states through a :class:`~megatron_kd.teacher.ring.PrefetchRing`,
all-gathers the sequence inside its TP group (intra-node) and hands the full ``[s, b, h_t]`` to
the fused loss. Logits never cross the network; the inter-node bytes per token are exactly
``h_t`` x the element size.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_kd.parallel import Route
from megatron_kd.teacher.ring import PrefetchRing
from megatron_kd.teacher.wire import Header, token_fingerprint

__all__ = ["RemoteTeacher"]


class RemoteTeacher:
    """The teacher's hidden states for this student rank's microbatches, from the wire.

    Args:
        route: this rank's stream from a teacher rank (None off the last pipeline stage).
        world_group: the group both sides are ranks of (point-to-point traffic).
        tp_group / tp_size: the student's tensor-parallel group and size (the sequence chunks
            of its ranks make the whole microbatch).
        weight: ``[local_vocab_size, h_t]`` the teacher's output-layer shard of this rank.
        seq_length / micro_batch_size / num_microbatches: the student's batch geometry.
        dtype: the wire's element type; prefetch_depth / timeout: the ring's.
    """

    def __init__(self, *, route: Route | None, world_group, tp_group, tp_size: int,
                 weight: torch.Tensor, seq_length: int, micro_batch_size: int,
                 num_microbatches: int, dtype: torch.dtype, prefetch_depth: int,
                 timeout: float) -> None:
        if seq_length % tp_size:
            raise ValueError(f"--seq-length {seq_length} must be divisible by the student's "
                             f"tensor-parallel size {tp_size} (each TP rank receives 1/tp of the "
                             f"sequence)")
        self.route = route
        self.world_group = world_group
        self.tp_group, self.tp = tp_group, tp_size
        self.weight = weight
        self.seq_length = seq_length
        self.micro_batch_size = micro_batch_size
        self.num_microbatches = num_microbatches
        self.h_t = weight.shape[1]
        self.dtype = dtype
        self.prefetch_depth, self.timeout = prefetch_depth, timeout
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
        self.ring = PrefetchRing(src=self.route.teacher_rank, depth=self.prefetch_depth,
                                 shape=self.chunk_shape, dtype=self.dtype,
                                 max_samples=self.micro_batch_size, total_messages=total,
                                 timeout=self.timeout, group=self.world_group,
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
