"""Teacher replicas for tests, tools and benchmarks: ``megatron-kd teacher serve`` in processes of
its own (a torchrun for a replica of several ranks), registered at an endpoint, stopped with
SIGTERM (:class:`Replica`). Also the command line of any ``megatron-kd`` run of one or more ranks
(:func:`command`), optionally with each rank writing its process's peak resident set size at exit
(on CPU, a run's peak memory).

The peak is written by this module run as a program around the real one::

    python -m megatron_kd.testing.replicas --peak-dir DIR MODULE [ARGS...]

runs ``python -m MODULE ARGS...`` in this process and, however it ends, writes
``DIR/rank<RANK>.json`` (``{"peak_rss_bytes": ...}``, ``RANK`` from the environment, 0 without).
"""

from __future__ import annotations

import json
import os
import resource
import runpy
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

__all__ = ["START_TIMEOUT_S", "Replica", "command", "process_alive", "read_rank_peak"]

#: Starting Python, torch and Megatron-Core in each rank on a busy 2-core machine.
START_TIMEOUT_S = 180.0
#: What torchrun sets for its workers: a replica is a world of its own.
_WORLD_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def command(module: str, args: Sequence[str], nproc: int = 1, *,
            peak_dir: str | os.PathLike | None = None) -> list[str]:
    """``python -m MODULE ARGS`` in one process, or a torchrun of ``nproc``; with ``peak_dir``
    each rank writes its peak RSS there at exit (``rank<R>.json``, :func:`read_rank_peak`)."""
    program = [module, *args]
    if peak_dir is not None:
        program = ["megatron_kd.testing.replicas", "--peak-dir", os.fspath(peak_dir), *program]
    if nproc > 1:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone",
                f"--nproc-per-node={nproc}", "-m", *program]
    return [sys.executable, "-m", *program]


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` is running (Linux: a zombie, dead but not yet reaped by a parent
    that is not ours, counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


def read_rank_peak(peak_dir: str | os.PathLike, rank: int) -> int | None:
    """The peak RSS rank ``rank`` wrote at exit (None when it wrote none)."""
    path = os.path.join(peak_dir, f"rank{rank}.json")
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        return int(json.load(f)["peak_rss_bytes"])


class Replica:
    """One running replica (a process, or a torchrun of several), in a session of its own."""

    def __init__(self, endpoint: str | os.PathLike, teacher: str, *, log: str | os.PathLike,
                 tp: int = 1, pp: int = 1, cp: int = 1, extra: Sequence[str] = (),
                 sleep_per_token: float = 0.0, stats_interval: float | None = 1.0,
                 env: Mapping[str, str] | None = None, simulate: bool = False,
                 peak_dir: str | os.PathLike | None = None, wait: bool = True,
                 start_timeout_s: float = START_TIMEOUT_S) -> None:
        """Start the replica of checkpoint ``teacher`` at ``endpoint`` (``tp`` x ``pp`` x ``cp``
        ranks),
        logging to ``log`` (its stderr to ``log`` + ``.stderr``); ``extra``: more serve flags.

        ``sleep_per_token``: its forward also sleeps that long per token
        (:mod:`megatron_kd.testing.slow_replica`). ``stats_interval``: seconds between its
        ``stats`` records (None: serve's default). ``env``: its environment (default: this
        process's, with ``OMP_NUM_THREADS=1``), torchrun's variables left out. ``peak_dir``: each
        rank writes its peak RSS there at exit. ``simulate``: every rank runs inside the
        simulated accelerator (:mod:`megatron_kd.testing.simulated`). With ``wait`` (else call
        :meth:`wait_ready`), wait until it has registered.
        """
        self.endpoint, self.log = Path(endpoint), Path(log)
        self.start_timeout_s = start_timeout_s
        self.stderr_path = Path(str(log) + ".stderr")
        flags = ["--kd-teacher-load", teacher, "--kd-teacher-endpoint", str(endpoint),
                 "--host", "127.0.0.1", "--tensor-model-parallel-size", str(tp),
                 "--pipeline-model-parallel-size", str(pp), "--context-parallel-size", str(cp),
                 "--log-json", str(log)]
        if stats_interval is not None:
            flags += ["--stats-interval", f"{stats_interval:g}"]
        flags += list(extra)
        if sleep_per_token and simulate:
            raise ValueError("a replica is either slow (sleep_per_token) or simulated, not both")
        if sleep_per_token:
            module, args = "megatron_kd.testing.slow_replica", [str(sleep_per_token), "--", *flags]
        elif simulate:
            module, args = "megatron_kd.testing.simulated", ["teacher", "serve", *flags]
        else:
            module, args = "megatron_kd", ["teacher", "serve", *flags]
        env = dict(env) if env is not None else {**os.environ, "OMP_NUM_THREADS": "1"}
        for key in _WORLD_ENV:
            env.pop(key, None)
        with open(self.stderr_path, "w", encoding="utf-8") as stderr:
            self.proc = subprocess.Popen(command(module, args, tp * pp * cp, peak_dir=peak_dir),
                                         env=env, stdout=subprocess.DEVNULL, stderr=stderr,
                                         start_new_session=True)
        if wait:
            self.wait_ready()

    def wait_ready(self) -> None:
        """Wait until the replica has published its record (its log's ``ready`` event names
        it, so replicas started together at one endpoint are told apart)."""
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            ready = self.events("ready")
            if ready:
                self.replica = ready[0]["replica"]
                self.record_file = f"replica-{self.replica}.json"
                assert Path(self.endpoint, self.record_file).is_file(), self.record_file
                return
            if self.proc.poll() is not None:
                break
            time.sleep(0.2)
        exited = self.proc.poll()
        self.stop()
        why = (f"exited with {exited}" if exited is not None
               else f"did not register within {self.start_timeout_s:g} s")
        raise RuntimeError(f"teacher replica {why} at {self.endpoint}; its stderr "
                           f"({self.stderr_path}) ends:\n{self.stderr_tail()}")

    def stderr_tail(self, chars: int = 3000) -> str:
        try:
            return self.stderr_path.read_text(errors="replace")[-chars:]
        except OSError:
            return "(no stderr)"

    @property
    def pids(self) -> list[int]:
        """The replica's processes: its session, and torchrun's workers, which torchrun starts
        in sessions of their own (found as its descendants)."""
        out = subprocess.run(["pgrep", "-s", str(self.proc.pid)], capture_output=True,
                             text=True).stdout.split()
        found = {int(p) for p in out} | {self.proc.pid}
        todo = list(found)
        while todo:
            children = subprocess.run(["pgrep", "-P", str(todo.pop())], capture_output=True,
                                      text=True).stdout.split()
            for child in map(int, children):
                if child not in found:
                    found.add(child)
                    todo.append(child)
        return sorted(found)

    def kill(self, sig: int = signal.SIGKILL, pids: Sequence[int] | None = None) -> list[int]:
        """Send ``sig`` once to every process of the replica (torchrun's workers too, or to
        ``pids``); returns the processes signalled. Once each: torchrun takes a second SIGTERM
        during its shutdown as a reason to leave at once, without waiting for its workers."""
        pids = list(self.pids if pids is None else pids)  # before the launcher goes: its
        for pid in pids:                                   # workers are found through it
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        return pids

    def events(self, event: str | None = None) -> list[dict]:
        """The records of its log (those of ``event`` only, if given)."""
        if not self.log.exists():
            return []
        text = self.log.read_text()
        complete = text[:text.rfind("\n") + 1]  # not a line still being written
        lines = [json.loads(line) for line in complete.splitlines() if line.strip()]
        return [e for e in lines if event is None or e.get("event") == event]

    def requests_served(self) -> int:
        stats = self.events("stats") + self.events("stopped")
        return max((e["requests"] for e in stats), default=0)

    def final_stats(self) -> dict:
        """Its last ``stopped`` record (what it served in all), or ``{}`` if it wrote none."""
        stopped = self.events("stopped")
        return stopped[-1] if stopped else {}

    def stop(self, timeout_s: float = 60.0) -> int | None:
        """SIGTERM to the replica's processes, then wait until every one of them has exited
        (its workers too, whose last records come after the launcher's wait); SIGKILL to those
        left after ``timeout_s`` (no final records or peaks then). Returns its exit status."""
        pids = self.kill(signal.SIGTERM) if self.proc.poll() is None else self.pids
        deadline = time.monotonic() + timeout_s
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pass
        while time.monotonic() < deadline and any(map(process_alive, pids)):
            time.sleep(0.1)
        left = [pid for pid in pids if process_alive(pid)]
        if left:
            print(f"teacher replica {self.proc.pid}: processes {left} still running "
                  f"{timeout_s:.0f} s after SIGTERM, killed; its stderr ends:\n"
                  f"{self.stderr_tail()}", file=sys.stderr)
            self.kill(signal.SIGKILL, left)
        if self.proc.poll() is None:
            self.proc.wait(timeout=30)
        return self.proc.returncode


def _run_recording_peak(argv: list[str]) -> None:
    """``--peak-dir DIR MODULE [ARGS...]``: run ``MODULE`` as ``__main__``, then write this
    rank's peak RSS into ``DIR``."""
    if len(argv) < 3 or argv[0] != "--peak-dir":
        sys.exit("usage: python -m megatron_kd.testing.replicas --peak-dir DIR MODULE [ARGS...]")
    peak_dir, module = argv[1], argv[2]
    sys.argv = [module, *argv[3:]]
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    finally:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        name = f"rank{os.environ.get('RANK', '0')}.json"
        with open(os.path.join(peak_dir, name), "w", encoding="utf-8") as f:
            json.dump({"peak_rss_bytes": peak}, f)


if __name__ == "__main__":
    _run_recording_peak(sys.argv[1:])
