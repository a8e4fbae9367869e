"""A pool of gloo worker processes for distributed tests on CPU.

Starting a rank costs 10-20 s of imports (torch and Megatron-Core: about 10 s of CPU each on
2 cores), so a pool is started once (per test module) and reused for many cases, and its
workers are forked from a *fork server* that imported those modules once for the whole test run
(:data:`PRELOAD`): a pool of two started in 12.3 s by spawning, 0.1 s by the fork server. Each
worker still begins as a fresh process with the runner's environment and ``sys.path`` as they
were when the pool started. Ranks rendezvous through a ``file://`` store in a temporary
directory (no ports). Every case runs on every rank::

    pool = DistPool(world_size=4, tmp_dir=tmp_path)
    results = pool.run(my_case, arg1, arg2)   # list, one entry per rank

``my_case(ctx, *args)`` must be importable by name (a module-level function); ``ctx`` is a
:class:`RankContext` with the rank, the world size and cached prefix groups. An exception on any
rank is re-raised in the parent as :class:`RankFailure` with the rank and the child traceback;
a rank that dies or hangs past the timeout fails the case and the pool is restarted.

Workers end with the process that started the pool, however it ends (a killed test run leaves
no ranks behind): each asks the kernel for ``SIGKILL`` when its parent dies (Linux
``PR_SET_PDEATHSIG``; the parent is the fork server, which exits when the runner does) and a
watchdog thread exits once the parent or the runner is gone.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import datetime
import multiprocessing as mp
import multiprocessing.forkserver
import os
import queue
import signal
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable


class RankFailure(RuntimeError):
    """A case failed on at least one rank; the message holds every failing rank's traceback."""


@dataclass
class RankContext:
    """What a case sees on its rank."""

    rank: int
    world_size: int
    tmp_dir: str
    _prefix_groups: dict = field(default_factory=dict)
    #: scratch space that survives between cases on this rank (e.g. cached groups)
    state: dict = field(default_factory=dict)

    def group(self, size: int):
        """The process group of ranks ``0 .. size-1`` (None on ranks outside it)."""
        if size not in self._prefix_groups:
            raise ValueError(f"no prefix group of size {size}; world size is {self.world_size}")
        return self._prefix_groups[size] if self.rank < size else None


_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>

#: What the fork server imports once, before it forks the first worker: torch and what a
#: training case imports (Megatron-Core among them). A module that fails to import is skipped.
PRELOAD = ("torch", "torch.distributed", "megatron_kd.commands.train")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # it exists
    return True


def die_with_parent(runner_pid: int, poll_s: float = 0.5) -> None:
    """End this process when its parent ends, or when ``runner_pid`` (the process that started
    the pool; the parent itself without a fork server) does, however that happens."""
    parent = os.getppid()
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass  # not Linux: the watchdog below does it
    if os.getppid() != parent or not _alive(runner_pid):  # gone before the request took effect
        os._exit(1)

    def watch() -> None:
        while os.getppid() == parent and _alive(runner_pid):
            time.sleep(poll_s)
        os._exit(1)

    threading.Thread(target=watch, name="die-with-parent", daemon=True).start()


@contextlib.contextmanager
def _environment(env: dict[str, str]):
    """``os.environ`` with ``env`` added, then restored (the fork server starts inside it)."""
    saved = dict(os.environ)
    os.environ.update(env)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _worker(rank, world_size, init_file, tmp_dir, tasks, results, sys_path, env, runner_pid):
    die_with_parent(runner_pid)
    sys.path[:] = sys_path
    # the runner's environment when the pool started (a forked worker has the fork server's)
    os.environ.clear()
    os.environ.update(env)
    # torch is used only after the environment (threads) and the parent's sys.path are set
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=120),
    )
    # Every rank creates every prefix group once, in the same order (new_group is collective).
    groups = {n: dist.new_group(list(range(n))) for n in range(1, world_size + 1)}
    ctx = RankContext(rank=rank, world_size=world_size, tmp_dir=tmp_dir, _prefix_groups=groups)
    while True:
        item = tasks.get()
        if item is None:
            break
        case_id, fn, args, kwargs = item
        before = _groups()
        try:
            value = fn(ctx, *args, **kwargs)
        except BaseException:  # noqa: BLE001 - reported to the parent with the rank
            # (the parent restarts the pool: a peer may be blocked in one of the groups)
            results.put((case_id, rank, False, traceback.format_exc()))
            continue
        _destroy_groups_made_since(before, ctx)
        results.put((case_id, rank, True, value))
    dist.destroy_process_group()
    # Every result was read by the parent. Skip the interpreter's teardown of torch and
    # Megatron-Core (seconds per worker, paid at every test module's end).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _groups() -> set:
    """The process groups that exist in this rank."""
    from torch.distributed import distributed_c10d as c10d  # (the worker imports torch late)

    return set(c10d._world.pg_map)


def _destroy_groups_made_since(before: set, ctx: RankContext) -> None:
    """Destroy the groups a case made and left (Megatron-Core's ``destroy_model_parallel``
    drops its references, not the groups) unless ``ctx.state`` keeps them for later cases.

    Each gloo group keeps its connections and threads: 15 import-and-compare cases left
    3,900 threads in two workers, with the load at 170 on 2 cores and every later case (and
    the rest of the machine) several times slower. Each rank destroys its own handles with
    no collective (a rank outside a new group holds none, so a barrier here could wait for a
    rank that never comes): its part of every operation on them is already done.
    """
    import torch.distributed as dist  # (the worker imports torch late)

    kept = {id(v) for v in _walk(ctx.state)}
    for group in _groups() - before:
        if id(group) in kept:
            continue
        dist.destroy_process_group(group)


def _walk(value):
    """``value`` and what its dicts, lists, tuples and sets hold."""
    yield value
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple, set)):
        for v in value:
            yield from _walk(v)


class DistPool:
    """``world_size`` gloo ranks on CPU, started once, running many cases."""

    def __init__(self, world_size: int, tmp_dir: str | os.PathLike | None = None,
                 timeout: float = 300.0, env: dict[str, str] | None = None,
                 start_method: str = "forkserver"):
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self.timeout = timeout
        self._own_tmp = None
        if tmp_dir is None:
            self._own_tmp = tempfile.TemporaryDirectory(prefix="megatron_kd_dist_")
            tmp_dir = self._own_tmp.name
        self.tmp_dir = str(tmp_dir)
        self.env = dict(env or {})
        if start_method not in ("forkserver", "spawn"):
            raise ValueError(f"start_method must be 'forkserver' or 'spawn', got {start_method!r}")
        self.start_method = start_method
        self._generation = 0
        self._case = 0
        self._procs: list = []
        self._start()

    def _start(self) -> None:
        ctx = mp.get_context(self.start_method)
        self._generation += 1
        init_file = os.path.join(self.tmp_dir, f"store_{os.getpid()}_{self._generation}")
        self._tasks = [ctx.Queue() for _ in range(self.world_size)]
        self._results = ctx.Queue()
        env = {**os.environ, "OMP_NUM_THREADS": "1", **self.env}
        if self.start_method == "forkserver":
            _start_fork_server(ctx)
        self._procs = [
            ctx.Process(
                target=_worker,
                args=(r, self.world_size, init_file, self.tmp_dir, self._tasks[r], self._results,
                      list(sys.path), env, os.getpid()),
                daemon=True,
            )
            for r in range(self.world_size)
        ]
        for p in self._procs:
            p.start()

    def run(self, fn: Callable[..., Any], *args, timeout: float | None = None, **kwargs) -> list:
        """Run ``fn(ctx, *args, **kwargs)`` on every rank; return the per-rank results."""
        if not self._procs:
            self._start()
        self._case += 1
        case_id = self._case
        for q in self._tasks:
            q.put((case_id, fn, args, kwargs))
        deadline = time.monotonic() + (timeout or self.timeout)
        values: dict[int, Any] = {}
        errors: dict[int, str] = {}
        while len(values) + len(errors) < self.world_size:
            remaining = deadline - time.monotonic()
            if errors:
                # Other ranks may now be blocked in a collective: give them a short grace.
                remaining = min(remaining, 5.0)
            if remaining <= 0:
                break
            try:
                cid, rank, ok, value = self._results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(self._procs) if not p.is_alive()
                        and r not in values and r not in errors]
                for r in dead:
                    errors[r] = f"rank {r} process died (exit code {self._procs[r].exitcode})"
                continue
            if cid != case_id:
                continue  # a late answer from a case that already failed
            (values if ok else errors)[rank] = value
        missing = [r for r in range(self.world_size) if r not in values and r not in errors]
        if errors or missing:
            self._restart()
            parts = [f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items())]
            if missing:
                parts.append(f"ranks {missing} did not finish within the timeout "
                             f"(blocked, probably waiting for a failed peer)")
            raise RankFailure(f"{getattr(fn, '__name__', fn)} failed:\n" + "\n".join(parts))
        return [values[r] for r in range(self.world_size)]

    def _restart(self) -> None:
        self._kill()
        self._start()

    def _kill(self) -> None:
        for p in self._procs:
            if p.is_alive():
                p.kill()
        for p in self._procs:
            p.join(timeout=10)
        self._procs = []

    def close(self) -> None:
        for q, p in zip(self._tasks, self._procs):
            if p.is_alive():
                q.put(None)
        for p in self._procs:
            p.join(timeout=20)
        self._kill()
        if self._own_tmp is not None:
            self._own_tmp.cleanup()

    def __enter__(self) -> "DistPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def pids(self) -> list[int]:
        """The worker processes' ids (for tests of the pool itself)."""
        return [p.pid for p in self._procs]


def _start_fork_server(ctx) -> None:
    """Start the (per-process) fork server once: single-threaded (``OMP_NUM_THREADS=1``, so no
    OpenMP thread pool exists to be forked) and with :data:`PRELOAD` imported."""
    ctx.set_forkserver_preload(list(PRELOAD))
    with _environment({"OMP_NUM_THREADS": "1"}):
        multiprocessing.forkserver.ensure_running()
