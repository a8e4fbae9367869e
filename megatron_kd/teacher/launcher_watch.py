"""A replica's rank exits when the process that launched it goes away (torchrun's agent, srun's
step daemon, or the shell or test that ran ``teacher serve`` directly).

torchrun starts its workers in sessions of their own, so a launcher that is SIGKILLed takes no
worker with it: without this watch, half a replica could go on answering on a node whose
launcher died. :class:`LauncherWatch` is a daemon thread that polls ``os.getppid()`` every
``poll_s``: the parent's id changes (to 1, or to a subreaper) exactly when the parent dies. It
then calls ``stop`` (the replica finishes the batch in flight, withdraws its endpoint record and
exits as on SIGTERM); a rank still alive ``grace_s`` later calls ``release`` (rank 0 withdraws
the record) and leaves with :data:`EXIT_CODE` through ``os._exit``, whatever it was blocked in.

Linux's ``prctl(PR_SET_PDEATHSIG)`` is not used: it fires when the *thread* that forked the
child ends, not its process (a launcher that starts workers from a helper thread would kill
them while alive), it is Linux-only, and a signal arriving in the middle of a collective
releases nothing. Polling costs one system call per ``poll_s`` and works under every launcher.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import threading
from collections.abc import Callable

__all__ = ["EXIT_CODE", "STOP_OVERDUE_EXIT", "LauncherWatch", "StopSignal", "stop_on_signals"]

#: The exit status of a rank that left because its launcher died (after ``grace_s``).
EXIT_CODE = 3
#: The exit status of a rank still running ``grace_s`` after SIGTERM / SIGINT
#: (:func:`stop_on_signals`).
STOP_OVERDUE_EXIT = 4


class LauncherWatch:
    """Watch this process's parent from a daemon thread (see the module docstring).

    Args:
        stop: asked first (from the watch thread) when the parent is gone.
        release: called ``grace_s`` later if the process is still there, just before
            ``os._exit(EXIT_CODE)``; errors in it are reported and ignored.
        poll_s: seconds between two looks at the parent.
        grace_s: seconds ``stop`` has to end the process in order.
        log: where the watch says what it saw (one line), or None.
    """

    def __init__(self, stop: Callable[[], None], release: Callable[[], None] | None = None, *,
                 poll_s: float = 0.5, grace_s: float = 5.0,
                 log: Callable[[str], None] | None = None) -> None:
        if poll_s <= 0 or grace_s < 0:
            raise ValueError(f"poll_s must be > 0 and grace_s >= 0, got {poll_s} and {grace_s}")
        self.stop, self.release, self.poll_s, self.grace_s = stop, release, poll_s, grace_s
        self.log = log
        self.parent = os.getppid()
        self.gone = threading.Event()
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def watching(self) -> bool:
        """False when there is no launcher to watch (this process was already an orphan,
        adopted by init, when the watch was made)."""
        return self.parent != 1

    def start(self) -> "LauncherWatch":
        if self.watching:
            self._thread = threading.Thread(target=self._run, daemon=True,
                                            name="kd-launcher-watch")
            self._thread.start()
        return self

    def close(self) -> None:
        """Stop watching (the process is ending on its own); the watch thread has ended when
        this returns (unless it is the caller)."""
        self._closed.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()

    def _run(self) -> None:
        while not self._closed.wait(self.poll_s):
            if os.getppid() != self.parent:
                break
        else:
            return
        self.gone.set()
        self._say(f"launcher (pid {self.parent}) is gone: stopping, leaving in at most "
                  f"{self.grace_s:g} s")
        self.stop()
        if self._closed.wait(self.grace_s):
            return  # the process ended in order meanwhile
        if self.release is not None:
            try:
                self.release()
            except Exception as e:  # noqa: BLE001 - leaving anyway; say why it was not clean
                self._say(f"releasing before exit failed: {type(e).__name__}: {e}")
        self._say(f"still running {self.grace_s:g} s after its launcher died: exiting "
                  f"({EXIT_CODE})")
        os._exit(EXIT_CODE)

    def _say(self, text: str) -> None:
        if self.log is not None:
            self.log(text)
        else:
            print(f"[pid {os.getpid()}] {text}", file=sys.stderr, flush=True)


class StopSignal(threading.Event):
    """Set by SIGTERM / SIGINT (:func:`stop_on_signals`); :meth:`ended` says the process is
    leaving in order (the overdue exit is called off)."""

    def __init__(self) -> None:
        super().__init__()
        self.done = threading.Event()

    def ended(self) -> None:
        self.done.set()


def stop_on_signals(grace_s: float | None = None,
                    release: Callable[[], None] | None = None) -> StopSignal:
    """A :class:`StopSignal` set by SIGTERM / SIGINT (a serving loop checks it between
    batches). With ``grace_s``: a process that has not called :meth:`StopSignal.ended` that
    long after the first signal writes every thread's stack to stderr (what it was stuck in),
    calls ``release`` and leaves with :data:`STOP_OVERDUE_EXIT`: a stop is never a hang."""
    stop = StopSignal()

    def overdue() -> None:
        if stop.done.wait(grace_s):
            return
        print(f"[pid {os.getpid()}] still running {grace_s:g} s after the stop signal: its "
              f"threads' stacks follow, then it exits ({STOP_OVERDUE_EXIT})", file=sys.stderr,
              flush=True)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        if release is not None:
            try:
                release()
            except Exception as e:  # noqa: BLE001 - leaving anyway; say why it was not clean
                print(f"releasing before exit failed: {type(e).__name__}: {e}", file=sys.stderr,
                      flush=True)
        sys.stderr.flush()
        os._exit(STOP_OVERDUE_EXIT)

    def handler(*_) -> None:
        if grace_s is not None and not stop.is_set():
            threading.Thread(target=overdue, daemon=True, name="kd-stop-deadline").start()
        stop.set()

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, handler)
    return stop
