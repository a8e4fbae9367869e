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
    in two threads: the source is read under a lock, each item once, in order."""

    def __init__(self, source) -> None:
        self.source = source
        self.current = None
        self._buffer: collections.deque = collections.deque()
        self._fresh: collections.deque = collections.deque()
        self._lock = threading.Lock()

    def _read(self) -> None:
        item = next(self.source)
        self._buffer.append(item)
        self._fresh.append(item)

    def __iter__(self):
        return self

    def __next__(self):
        with self._lock:
            if not self._buffer:
                self._read()
            self.current = self._buffer.popleft()
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
