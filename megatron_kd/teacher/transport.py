"""Links between a student process and a teacher process: PyTorch's own process groups, made
outside either side's ``torch.distributed`` world.

A :class:`Link` is a two-rank ``ProcessGroupGloo`` (or ``ProcessGroupNCCL``) over a
``PrefixStore`` of the teacher replica's ``TCPStore``: each student-teacher pair has its own, so
one peer's death closes its pairs only, and a student can drop a link and make a new one to
another replica while both worlds go on (torchrun's worlds end as a whole; these do not belong
to one). No socket protocol is written here: rendezvous, framing and transfers are the process
group's.

Waiting is done on the host, with a deadline (:meth:`Link.wait`):

* gloo: ``Work.wait(timeout)``, which returns when the transfer is done, raises at once when
  the peer's connection closes (a killed process), and raises at the deadline when it is silent
  (a stalled one);
* NCCL: ``Work.is_completed()`` polled until the deadline (``wait`` would only order the CUDA
  stream), then the pair's communicator is aborted so that no kernel is left waiting on a peer
  that will never come.

Either way a dead or silent peer is a :class:`LinkDown` naming it, never a hang or a watchdog
kill, and the link is aborted.

gloo's own abort wakes neither side's blocked receives. A link made with ``release_on_abort``
(a student's end) also lets go of its process group when aborted: once no transfer of it is
still held (a posted receive keeps it), its connections close and a peer blocked in a receive
on it fails at once, as for a dead process. A replica's request reader, which waits for a
student's next request without a deadline, ends this way when the student leaves the
connection (a rebalance, a failover away from a live replica, the end of training). A
replica's own ends keep their groups until they are collected, as before: the student waiting
on one has its deadline.

gloo's receive says it is complete only once ``wait`` has returned, so receives whose arrival
must be seen without blocking (the student's prefetch ring: how many responses are already
there) are handed to :meth:`Link.watch` once their request is sent: the link's watcher thread
waits on them in order, each for at most ``timeout_s`` from when it started on it (never longer
than a caller's own deadline, which starts later), and marks each done; :meth:`Link.wait` then
waits on that mark. Only receives whose answer will come are watched (a thread blocked in gloo
cannot be woken).
"""

from __future__ import annotations

import collections
import datetime
import queue
import threading
import time

import torch
import torch.distributed as dist

__all__ = ["Link", "LinkDown", "link_backend"]


class LinkDown(RuntimeError):
    """The peer of a link died, stalled past the deadline, or the link could not be made."""


def link_backend(device: torch.device) -> str:
    """``nccl`` for CUDA buffers (where NCCL is built in), else ``gloo`` (host buffers)."""
    if device.type == "cuda" and dist.is_nccl_available():
        return "nccl"
    return "gloo"


class _Watched:
    """A gloo receive waited on by its link's watcher thread: :meth:`is_completed` says whether
    it has arrived (gloo's own says so only after ``wait``)."""

    def __init__(self, work) -> None:
        self.work = work
        self.done = threading.Event()
        self.error: BaseException | None = None

    def is_completed(self) -> bool:
        return self.done.is_set()


#: Seconds past its own deadline the watcher thread may take to report (it starts earlier).
_WATCH_GRACE_S = 5.0


class Link:
    """This process's end of a two-process group.

    Args:
        store: the rendezvous store (the teacher replica's ``TCPStore``).
        prefix: this link's key prefix in it (one per pair and connection).
        rank: 0 on the teacher side, 1 on the student side.
        device: where the buffers of this link live (``cuda`` -> NCCL, ``cpu`` -> gloo).
        timeout_s: how long making the link and each transfer may take.
        peer: the peer's name, for messages.
        release_on_abort: gloo: :meth:`abort` drops this end's process group, so that the
            peer's blocked receives fail at once (see the module docstring).
    """

    def __init__(self, store, prefix: str, rank: int, *, device: torch.device,
                 timeout_s: float, peer: str, release_on_abort: bool = False) -> None:
        self.peer, self.rank, self.device = peer, rank, torch.device(device)
        self.release_on_abort = release_on_abort
        self.backend = link_backend(self.device)
        self.timeout_s = timeout_s
        self.aborted = False
        self.bytes_sent: collections.Counter[int] = collections.Counter()
        """Bytes handed to :meth:`send` so far, by tag (what left this process)."""
        self._watch: queue.SimpleQueue | None = None  # receives for the watcher thread
        timeout = datetime.timedelta(seconds=timeout_s)
        prefixed = dist.PrefixStore(prefix, store)
        try:
            if self.backend == "nccl":
                opts = dist.ProcessGroupNCCL.Options()
                opts._timeout = timeout
                self.pg = dist.ProcessGroupNCCL(prefixed, rank, 2, opts)
            else:
                # blocks until the peer has joined (gloo connects at construction)
                self.pg = dist.ProcessGroupGloo(prefixed, rank, 2, timeout)
        except RuntimeError as e:
            raise LinkDown(f"could not connect to {peer}: {_first_line(e)}") from e

    def send(self, tensors: list[torch.Tensor], tag: int) -> list:
        """Start sending ``tensors`` in order (each on this link's device); returns the works.
        Their bytes are counted in :attr:`bytes_sent` under ``tag`` once every send started."""
        works = [self._op("send", t, tag) for t in tensors]
        self.bytes_sent[int(tag)] += sum(t.numel() * t.element_size() for t in tensors)
        return works

    def recv(self, tensors: list[torch.Tensor], tag: int) -> list:
        """Start receiving into ``tensors`` in order; returns the works."""
        return [self._op("recv", t, tag) for t in tensors]

    def watch(self, works: list) -> list:
        """``works`` (receives of this link whose answer was asked for), whose
        ``is_completed()`` tells arrival without blocking on gloo too (the watcher thread);
        wait on the returned works, not on ``works``. NCCL's say so already: returned as is."""
        if self.backend != "gloo" or self.aborted:
            return works
        if self._watch is None:
            self._watch = queue.SimpleQueue()
            threading.Thread(target=self._watcher, args=(self._watch,), daemon=True,
                             name=f"kd-link-watch-{self.peer}").start()
        watched = [_Watched(w) for w in works]
        for w in watched:
            self._watch.put(w)
        return watched

    def _watcher(self, todo: queue.SimpleQueue) -> None:
        """Wait on each watched receive in order; after a failure fail the rest at once (the
        link is down)."""
        failed: BaseException | None = None
        while (item := todo.get()) is not None:
            if failed is None:
                try:
                    item.work.wait(datetime.timedelta(seconds=self.timeout_s))
                except RuntimeError as e:
                    failed = e
            item.error = failed
            item.done.set()

    def _op(self, name: str, tensor: torch.Tensor, tag: int):
        if tensor.device.type != self.device.type:
            raise ValueError(f"a {self.backend} link moves {self.device.type} tensors, got one "
                             f"on {tensor.device}")
        if self.aborted:
            raise LinkDown(f"link to {self.peer} was aborted")
        fn = getattr(self.pg, name)
        try:
            # NCCL matches point-to-point messages by order; tags are gloo's
            return fn([tensor], 1 - self.rank, tag if self.backend == "gloo" else 0)
        except RuntimeError as e:
            self.abort()
            raise LinkDown(f"{self.peer}: {_first_line(e)}") from e

    def wait(self, works: list, deadline: float) -> None:
        """Block until every work is done or ``deadline`` (``time.monotonic()``) passes; a
        dead or silent peer aborts the link and raises :class:`LinkDown`."""
        for work in works:
            remaining = deadline - time.monotonic()
            try:
                if isinstance(work, _Watched):
                    if not work.done.wait(max(remaining, 0.0) + _WATCH_GRACE_S):
                        raise TimeoutError(f"no answer within {self.timeout_s:g} s")
                    if work.error is not None:
                        raise RuntimeError(str(work.error)) from work.error
                elif self.backend == "nccl":
                    while not work.is_completed():
                        if time.monotonic() > deadline:
                            raise TimeoutError(f"no answer within {self.timeout_s:g} s")
                        time.sleep(0.0005)
                else:
                    if remaining <= 0:
                        raise TimeoutError(f"no answer within {self.timeout_s:g} s")
                    work.wait(datetime.timedelta(seconds=remaining))
            except (RuntimeError, TimeoutError) as e:
                self.abort()
                detail = _first_line(e)
                if "timed out" in detail.lower() and "no answer" not in detail:
                    detail = f"no answer within {self.timeout_s:g} s ({detail})"
                raise LinkDown(f"{self.peer}: {detail}") from e

    def abort(self) -> None:
        """Drop the link: pending transfers fail, the peer sees it closed. Idempotent."""
        if self.aborted:
            return
        self.aborted = True
        if self._watch is not None:
            self._watch.put(None)  # the watcher ends after the receive it is waiting on
        try:
            (getattr(self.pg, "abort", None) or getattr(self.pg, "_shutdown"))()
        except RuntimeError:
            pass  # already broken: nothing left to stop
        if self.backend == "gloo" and self.release_on_abort:
            # the last reference but those of transfers still held: the group's connections
            # close with it, which is what wakes the peer (see the module docstring)
            self.pg = None


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
