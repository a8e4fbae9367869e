"""The student's prefetch ring: ``depth`` receive slots of teacher hidden states, posted ahead.

The receiving student rank owns a :class:`PrefetchRing` of ``depth`` preallocated slots. Receives
are posted ``depth`` messages ahead; taking message ``i`` re-posts its slot for ``i + depth``.
Receives complete only once the teacher sends, and the teacher's sends complete only once a
receive is posted, so the teacher runs at most ``depth`` messages ahead (backpressure) and
memory stays at ``depth`` slots. A teacher that stalls past ``timeout`` seconds or dies raises
:class:`~megatron_kd.teacher.wire.TeacherUnavailableError` naming its rank.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from megatron_kd.teacher.wire import (
    TAG_HEADER,
    TAG_PAYLOAD,
    Header,
    TeacherUnavailableError,
    header_size,
)

__all__ = ["PrefetchRing"]


class PrefetchRing:
    """Student side of one stream: ``depth`` receive slots posted ahead.

    ``get(i, expected)`` returns the payload of message ``i`` (a view into slot ``i % depth``,
    valid until :meth:`release` of that message) after checking its header.
    """

    def __init__(self, *, src: int, depth: int, shape: tuple[int, int, int], dtype: torch.dtype,
                 max_samples: int, total_messages: int, timeout: float, group=None,
                 student_rank: int | None = None):
        if depth < 1:
            raise ValueError(f"prefetch depth must be >= 1, got {depth}")
        if timeout <= 0:
            raise ValueError(f"teacher timeout must be > 0 seconds, got {timeout}")
        self.src = src
        self.depth = depth
        self.shape = tuple(shape)
        self.dtype = dtype
        self.max_samples = max_samples
        self.total = total_messages
        self.timeout = datetime.timedelta(seconds=timeout)
        self.group = group
        self.student_rank = dist.get_rank() if student_rank is None else student_rank
        self._headers = [torch.empty(header_size(max_samples), dtype=torch.int64)
                         for _ in range(depth)]
        self._payloads = [torch.empty(self.shape, dtype=dtype) for _ in range(depth)]
        self._works: dict[int, tuple] = {}
        self._next_post = 0
        self._taken: int | None = None
        self.bytes_received = 0
        for _ in range(min(depth, total_messages)):
            self._post()

    @property
    def slot_bytes(self) -> int:
        return self._payloads[0].numel() * self._payloads[0].element_size()

    def _post(self) -> None:
        i = self._next_post
        slot = i % self.depth
        try:
            self._works[i] = (
                dist.irecv(self._headers[slot], src=self.src, group=self.group, tag=TAG_HEADER),
                dist.irecv(self._payloads[slot], src=self.src, group=self.group,
                           tag=TAG_PAYLOAD),
            )
        except RuntimeError as e:  # the connection is already gone
            raise TeacherUnavailableError(self.src, i, str(e).splitlines()[0]) from e
        self._next_post += 1

    def get(self, index: int, expected: Header) -> torch.Tensor:
        if self._taken is not None:
            raise RuntimeError(f"message {self._taken} was not released before taking {index}")
        if index not in self._works:
            raise RuntimeError(f"message {index} is not posted (posted up to "
                               f"{self._next_post - 1}, depth {self.depth})")
        slot = index % self.depth
        header_work, payload_work = self._works.pop(index)
        self._wait(header_work, index)
        # The header is checked before the payload is used: a wrong shape (say another hidden
        # size) is reported as such, not as a transport error.
        header = Header.decode(self._headers[slot])
        header.check_against(expected, teacher_rank=self.src, student_rank=self.student_rank)
        self._wait(payload_work, index)
        self._taken = index
        self.bytes_received += self.slot_bytes
        return self._payloads[slot]

    def _wait(self, work, index: int) -> None:
        try:
            work.wait(timeout=self.timeout)
        except RuntimeError as e:
            reason = str(e).splitlines()[0]
            if "timed out" in reason.lower() or "timeout" in reason.lower():
                reason = (f"no data within {self.timeout.total_seconds():g} s "
                          f"(--kd-teacher-timeout): {reason}")
            raise TeacherUnavailableError(self.src, index, reason) from e

    def release(self, index: int) -> None:
        """The slot of message ``index`` is free: post the receive ``depth`` messages ahead."""
        if self._taken != index:
            raise RuntimeError(f"releasing message {index}, but {self._taken} is taken")
        self._taken = None
        if self._next_post < self.total:
            self._post()

    def close(self) -> None:
        """All messages were consumed (pending receives are only those past the end)."""
        if self._works:
            raise RuntimeError(f"ring closed with messages {sorted(self._works)} not received")
