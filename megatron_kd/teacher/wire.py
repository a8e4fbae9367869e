"""The teacher -> student wire: self-describing messages (the student's receiving side is the
prefetch ring, :mod:`megatron_kd.teacher.ring`).

A message is a fixed-size ``int64`` header followed by the payload, a sequence chunk of the
teacher's final hidden states ``[s / tp_s, b, h_t]``. The header carries the step, the
microbatch, the chunk, the global sample ids, the shape and the dtype; the student compares it
with what it expects and raises :class:`HeaderMismatchError` naming both sides on any
difference. Headers and payloads travel with their own tags, each in order, between one teacher
rank and one student rank.
"""

from __future__ import annotations

import datetime
import hashlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["Header", "HeaderMismatchError", "TeacherUnavailableError", "HiddenSender",
           "WireError", "header_size", "token_fingerprint"]

MAGIC = 0x4B44_5749  # "KDWI"
VERSION = 1
TAG_HEADER = 101
TAG_PAYLOAD = 102
_DTYPES = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3, torch.float64: 4}
_DTYPE_OF = {v: k for k, v in _DTYPES.items()}
_FIXED = 12  # header fields before the sample ids


class TeacherUnavailableError(RuntimeError):
    """The teacher rank feeding this student rank died or stalled past the timeout."""

    def __init__(self, teacher_rank: int, message_index: int, reason: str):
        self.teacher_rank = teacher_rank
        super().__init__(f"teacher rank {teacher_rank} unavailable while receiving message "
                         f"{message_index}: {reason}")


class WireError(ValueError):
    """Bytes that are not a well-formed wire message header (names what is wrong)."""


class HeaderMismatchError(WireError):
    """A message's header differs from what the student expected (wrong teacher data)."""


def token_fingerprint(tokens: torch.Tensor) -> int:
    """A 56-bit hash of a microbatch's token ids: teacher and student derive their samples
    independently, and this catches a teacher reading other data under the same sample ids
    (another dataset, seed or split) without sending any token data."""
    data = tokens.detach().to("cpu", torch.int64).contiguous().numpy().tobytes()
    return int(hashlib.blake2b(data, digest_size=7).hexdigest(), 16)


def header_size(max_samples: int) -> int:
    return _FIXED + max_samples


@dataclass(frozen=True)
class Header:
    """What one message holds."""

    step: int
    microbatch: int
    chunk: int
    num_chunks: int
    sample_ids: tuple[int, ...]
    shape: tuple[int, int, int]  # [s_chunk, b, h]
    dtype: torch.dtype
    fingerprint: int = 0  # of the microbatch's tokens (see token_fingerprint)

    def encode(self, max_samples: int) -> torch.Tensor:
        if len(self.sample_ids) > max_samples:
            raise ValueError(f"{len(self.sample_ids)} sample ids > max {max_samples}")
        out = torch.full((header_size(max_samples),), -1, dtype=torch.int64)
        fixed = [MAGIC, VERSION, self.step, self.microbatch, self.chunk, self.num_chunks,
                 *self.shape, _DTYPES[self.dtype], len(self.sample_ids), self.fingerprint]
        out[:_FIXED] = torch.tensor(fixed, dtype=torch.int64)
        if self.sample_ids:
            out[_FIXED:_FIXED + len(self.sample_ids)] = torch.tensor(self.sample_ids)
        return out

    @classmethod
    def decode(cls, t: torch.Tensor, max_samples: int | None = None) -> "Header":
        """A header from its ``int64`` words; :class:`WireError` for anything that is not one
        (wrong magic or version, unknown dtype, impossible sizes or counts)."""
        v = t.tolist()
        if max_samples is None:
            max_samples = len(v) - _FIXED
        if len(v) != header_size(max_samples) or max_samples < 0:
            raise WireError(f"a wire header has {header_size(max(0, max_samples))} words, got "
                            f"{len(v)}")
        if v[0] != MAGIC or v[1] != VERSION:
            raise HeaderMismatchError(f"not a megatron_kd wire header (magic {v[0]:#x}, "
                                      f"version {v[1]}; expected {MAGIC:#x}, {VERSION})")
        if v[9] not in _DTYPE_OF:
            raise HeaderMismatchError(f"unknown dtype code {v[9]} in header")
        n = v[10]
        if not 0 <= n <= max_samples:
            raise WireError(f"header lists {n} sample ids, at most {max_samples} fit")
        if not all(1 <= d < 1 << 31 for d in v[6:9]) or not 0 <= v[4] < v[5]:
            raise WireError(f"header shape {tuple(v[6:9])} or chunk {v[4]} of {v[5]} impossible")
        return cls(step=v[2], microbatch=v[3], chunk=v[4], num_chunks=v[5],
                   sample_ids=tuple(v[_FIXED:_FIXED + n]), shape=(v[6], v[7], v[8]),
                   dtype=_DTYPE_OF[v[9]], fingerprint=v[11])

    def check_against(self, expected: "Header", *, teacher_rank: int, student_rank: int) -> None:
        """Raise :class:`HeaderMismatchError` naming both sides if anything differs."""
        diffs = [f"{name}: teacher rank {teacher_rank} sent {getattr(self, name)!r}, student "
                 f"rank {student_rank} expected {getattr(expected, name)!r}"
                 for name in ("step", "microbatch", "chunk", "num_chunks", "sample_ids", "shape",
                              "dtype", "fingerprint")
                 if getattr(self, name) != getattr(expected, name)]
        if diffs:
            raise HeaderMismatchError("teacher message does not match the student's batch; "
                                      + "; ".join(diffs))


class HiddenSender:
    """Teacher side of one stream: sends headers and payloads to one student rank.

    At most one message is in flight per stream: sending message ``i`` first waits until message
    ``i - 1`` was taken by a posted receive, so the teacher holds at most one payload per
    stream while it computes the next one.
    """

    def __init__(self, *, dst: int, max_samples: int, group=None,
                 timeout: float | None = None):
        self.dst = dst
        self.max_samples = max_samples
        self.group = group
        self.timeout = None if timeout is None else datetime.timedelta(seconds=timeout)
        self.bytes_sent = 0
        self.messages_sent = 0
        self._pending: list = []

    def send(self, header: Header, payload: torch.Tensor) -> None:
        if tuple(payload.shape) != tuple(header.shape) or payload.dtype != header.dtype:
            raise ValueError(f"payload {tuple(payload.shape)} {payload.dtype} does not match its "
                             f"header {header.shape} {header.dtype}")
        self.wait()
        payload = payload.contiguous()
        # Header first (small), then the payload; each tag is delivered in order.
        self._pending = [
            dist.isend(header.encode(self.max_samples), dst=self.dst, group=self.group,
                       tag=TAG_HEADER),
            dist.isend(payload, dst=self.dst, group=self.group, tag=TAG_PAYLOAD),
            payload,  # keep the buffer alive until the send completes
        ]
        self.bytes_sent += payload.numel() * payload.element_size()
        self.messages_sent += 1

    def wait(self) -> None:
        for work in self._pending[:2]:
            if self.timeout is None:
                work.wait()
            else:
                work.wait(timeout=self.timeout)
        self._pending = []
