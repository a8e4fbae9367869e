"""A teacher client's requests in flight, as records: what each request is and what was sent
for it (:class:`Outstanding`), the receive slot its response lands in (:class:`Slot`, one of the
ring's ``depth``), the buffers of its sends (:class:`SendBuffers`), and the bytes sent for the
requests answered in a step (:class:`SentBytes`). The
:class:`~megatron_kd.teacher.client.TeacherClient` keeps and rewrites them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_kd.teacher.transport import Link

__all__ = ["Outstanding", "SendBuffers", "SentBytes", "Slot"]


@dataclass
class Outstanding:
    """A request sent (or to send) whose response has not been taken yet."""

    request: int
    step: int
    microbatch: int
    sample_ids: tuple[int, ...]
    tokens: torch.Tensor | None  # [b, s] int32 (TP rank 0 only)
    fingerprint: int
    sends: int = 0
    """Times the request was handed to a link (more than once after a failover)."""
    token_bytes: int = 0
    """Bytes of token ids handed to links for it, re-sends included."""
    resent_token_bytes: int = 0
    """The part of :attr:`token_bytes` sent again after a failover."""
    header_bytes: int = 0
    """Bytes of request headers handed to links for it, re-sends included."""


@dataclass
class Slot:
    """One receive slot of the ring: where the response of :attr:`request` lands."""

    request: int
    """The request whose response is posted here."""
    header: torch.Tensor
    """``[header_size(max_samples)]`` int64: the response's header."""
    parts: list[torch.Tensor]
    """The payload's tensors (:func:`~megatron_kd.teacher.wire.payload_shapes`)."""
    works: list | None
    """The receives posted (header, then parts); None when the link was down at posting."""
    link: Link
    """The link they were posted on."""
    conn: int
    """The connection they were posted on (the response's header must name it)."""
    watched: bool = False
    """The request is sent and :attr:`works` were handed to the link's watcher (they are now
    the watched ones): :meth:`arrived` then tells arrival without waiting."""

    def watch(self) -> None:
        """The answer was asked for: let the link's watcher wait on the receives."""
        if self.works is not None and not self.watched:
            self.works = self.link.watch(self.works)
            self.watched = True

    def arrived(self) -> bool:
        """The whole response is here (without waiting; False until watched, under gloo)."""
        return self.works is not None and all(w.is_completed() for w in self.works)


@dataclass
class SendBuffers:
    """A request's sends in flight: their buffers live until its response is taken."""

    works: list
    header: torch.Tensor
    tokens: torch.Tensor


@dataclass
class SentBytes:
    """Bytes TP rank 0 handed to links for the requests answered since the last report."""

    tokens: int = 0
    resent: int = 0
    headers: int = 0

    def add(self, out: Outstanding) -> None:
        self.tokens += out.token_bytes
        self.resent += out.resent_token_bytes
        self.headers += out.header_bytes
