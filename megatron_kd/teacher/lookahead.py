"""A data iterator read ahead, for requests that go out before the step that uses them."""

from __future__ import annotations

import collections
import threading

__all__ = ["Lookahead"]


class Lookahead:
    """A data iterator read ahead: ``next()`` returns its items in order (the last one returned
    is :attr:`current`), while :meth:`ahead` yields each item as soon as it is read, so that a
    teacher's requests can go out ``depth`` microbatches before the step that uses them. On the
    last pipeline stage Megatron-LM's ``get_batch`` drops the tokens; the iterator's items still
    carry them, and the teacher takes them from here (``next()`` hands out a copy of a dict
    item, so what the consumer rewrites in it stays out of :attr:`current`).

    ``next()`` (the training loop) and :meth:`ahead` (a teacher client's sender thread) may run
    in two threads: the source is read under a lock, each item once, in order.

    A step run again (``replayable``): Megatron-Core's rerun state machine replays a step
    (``--rerun-mode`` other than ``disabled``) by calling ``rewind()`` on the
    ``RerunDataIterator`` it was given, which then hands out again the items it read during the
    step. Read ahead, those are later steps' items, so the source's ``rewind`` and ``advance``
    (the machine calls ``advance`` as each step begins) are taken over: ``advance`` also starts
    this step's record, and ``rewind`` makes ``next()`` hand out this step's items again, in
    order (:attr:`replayed` tells), while :meth:`ahead` reads on. The iterator's own replay is
    not used. Not covered: the machine's restart from a checkpoint after a reproduced fault,
    whose data iterator state is the ``RerunDataIterator``'s own."""

    def __init__(self, source, *, replayable: bool = False) -> None:
        self.source = source
        self.current = None
        self.replayed = False
        """Whether :attr:`current` is an item handed out again (a step run again)."""
        self._buffer: collections.deque = collections.deque()
        self._fresh: collections.deque = collections.deque()
        self._step: list = []  # handed out since the step began
        self._replay: collections.deque = collections.deque()
        self._lock = threading.Lock()
        self.replayable = replayable  # without it no step boundary comes: nothing is kept
        if replayable:
            rewind, advance = getattr(source, "rewind", None), getattr(source, "advance", None)
            if not (callable(rewind) and callable(advance)):
                raise TypeError(f"a replayable data iterator needs rewind() and advance() "
                                f"(Megatron-Core's RerunDataIterator); got {type(source)}")

            def advance_and_begin() -> None:
                advance()
                self.advance()
            source.rewind, source.advance = self.rewind, advance_and_begin

    def advance(self) -> None:
        """A step begins: the record of the items handed out starts again."""
        with self._lock:
            if self._replay:
                raise RuntimeError(f"data iterator: a step began with {len(self._replay)} "
                                   f"item(s) of the step run again not handed out")
            self._step = []

    def rewind(self) -> None:
        """The step runs again: ``next()`` hands out this step's items again, in order."""
        with self._lock:
            self._replay = collections.deque(self._step)
            self._step = []

    def _read(self) -> None:
        item = next(self.source)
        self._buffer.append(item)
        self._fresh.append(item)

    def __iter__(self):
        return self

    def __next__(self):
        with self._lock:
            self.replayed = bool(self._replay)
            if self.replayed:
                self.current = self._replay.popleft()
            else:
                if not self._buffer:
                    self._read()
                self.current = self._buffer.popleft()
            if self.replayable:
                self._step.append(self.current)
        # A dict item is handed out as a shallow copy: Megatron-LM's get_batch rewrites the
        # entries of what it gets in place (moved to the GPU, None off the first stage), and
        # the teacher reads the tokens from ``current`` after it.
        return dict(self.current) if isinstance(self.current, dict) else self.current

    def ahead(self):
        while True:
            with self._lock:
                if not self._fresh:
                    try:
                        self._read()
                    except StopIteration:
                        return
                item = self._fresh.popleft()
            yield item
