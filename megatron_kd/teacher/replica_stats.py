"""What a teacher replica has served (:class:`ReplicaStats`): requests, samples and tokens, in
all and per student run, and the bytes its links moved, counted where they move (each rank
its own links' threads; the ranks' counts summed when a record is written). The
:class:`~megatron_kd.teacher.service.TeacherService` keeps one per rank and logs its
:meth:`~ReplicaStats.summary`.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from megatron_kd.teacher.protocol import ConnectionMeta
from megatron_kd.teacher.wire import Request

__all__ = ["ReplicaStats"]


@dataclass
class ReplicaStats:
    """What a replica has served, in all and per student run. The byte counts are those its
    links moved: token ids received from each request link (rank 0), hidden states handed to
    each response link (the last pipeline stage's ranks); each rank counts its own
    (:meth:`received`, :meth:`sent`, from the links' threads) and learns the others' when a
    record is written (:meth:`others_link_bytes`)."""

    requests: int = 0
    samples: int = 0
    tokens: int = 0
    forward_s: float = 0.0
    runs: dict = field(default_factory=dict)
    t0: float = field(default_factory=time.monotonic)
    last_log: float = field(default_factory=time.monotonic)
    own: dict = field(default_factory=dict)
    """Student run -> ``[bytes in, bytes out]`` this rank's links moved."""
    others: dict = field(default_factory=dict)
    """The same, summed over the replica's other ranks when last learned."""
    lock: threading.Lock = field(default_factory=threading.Lock)

    def _run(self, run) -> dict:
        return self.runs.setdefault(str(run), {"requests": 0, "tokens": 0, "connections": 0})

    def connected(self, meta: ConnectionMeta) -> None:
        self._run(meta.run)["connections"] += 1

    def served(self, req: Request) -> None:
        tokens = req.batch * req.seq_length
        self.requests += 1
        self.samples += req.batch
        self.tokens += tokens
        run = self.runs.get(str(req.run))
        if run is not None:
            run["requests"] += 1
            run["tokens"] += tokens

    def received(self, run: int, n: int) -> None:
        """``n`` token-id bytes of ``run`` arrived on a request link of this rank."""
        self._count(run, 0, n)

    def sent(self, run: int, n: int) -> None:
        """``n`` hidden-state bytes for ``run`` were handed to a response link of this rank."""
        self._count(run, 1, n)

    def _count(self, run: int, which: int, n: int) -> None:
        with self.lock:
            self.own.setdefault(str(run), [0, 0])[which] += n

    def link_bytes(self) -> dict:
        """This rank's counts (a copy)."""
        with self.lock:
            return {run: list(counts) for run, counts in self.own.items()}

    def others_link_bytes(self, ranks: list[dict]) -> None:
        """The other ranks' :meth:`link_bytes`, summed."""
        summed: dict = {}
        for counts in ranks:
            for run, (n_in, n_out) in counts.items():
                total = summed.setdefault(run, [0, 0])
                total[0] += n_in
                total[1] += n_out
        with self.lock:
            self.others = summed

    def summary(self) -> dict:
        elapsed = max(1e-9, time.monotonic() - self.t0)
        with self.lock:
            moved = {run: [a + b for a, b in zip(self.own.get(run, [0, 0]),
                                                 self.others.get(run, [0, 0]))]
                     for run in {*self.own, *self.others}}
        runs = {run: {"requests": per["requests"], "tokens": per["tokens"],
                      "bytes_in": moved.get(run, [0, 0])[0],
                      "bytes_out": moved.get(run, [0, 0])[1],
                      "connections": per["connections"]} for run, per in self.runs.items()}
        return {"requests": self.requests, "samples": self.samples, "tokens": self.tokens,
                "tokens_per_s": round(self.tokens / elapsed, 1),
                "bytes_in": sum(n_in for n_in, _ in moved.values()),
                "bytes_out": sum(n_out for _, n_out in moved.values()),
                "forward_s": round(self.forward_s, 3), "runs": runs}
