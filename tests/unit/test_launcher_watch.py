"""A replica rank's watch on its launcher (:mod:`megatron_kd.teacher.launcher_watch`), in plain
processes: a launcher starts a "rank" in a session of its own (as torchrun does) and is
SIGKILLed; the rank must stop and release within the grace period, whether it stops in order
(its ``stop`` ends it) or is stuck (``release`` then ``os._exit``). Its record is a file. Which
of the two ended it is read from its exit status: the launcher's parent is the orphaned rank's
subreaper (it adopts the rank, as init would, and reaps it)."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from megatron_kd.teacher.launcher_watch import EXIT_CODE, LauncherWatch
from megatron_kd.testing.replicas import process_alive as _alive

POLL_S, GRACE_S = 0.1, 1.0
#: A rank must be gone this long after its launcher's death (poll + grace + start-up slack on
#: a loaded 2-core machine); the issue asks for 10 s.
GONE_WITHIN_S = 8.0
#: The in-order rank's grace: long enough that its own stop always ends it first, however
#: slowly a loaded machine runs it (its leaving is a few thread switches), and short enough
#: that a watch that never stops it still ends it (``EXIT_CODE``) within GONE_WITHIN_S, so
#: that the exit status, not a timeout, says which path ended it.
IN_ORDER_GRACE_S = 4.0

RANK = textwrap.dedent("""
    import os, sys, threading, time
    from megatron_kd.teacher.launcher_watch import LauncherWatch
    record, stuck, grace = sys.argv[1], sys.argv[2] == "stuck", float(sys.argv[3])
    stopped = threading.Event()

    def release():
        os.remove(record)

    open(record, "w").close()
    watch = LauncherWatch(stopped.set, release, poll_s={poll}, grace_s=grace).start()
    open(record + ".watching", "w").close()
    while not stopped.wait(0.05) or stuck:  # stuck: never leaves on its own
        time.sleep(0.05)
    watch.close()  # leaving in order, as teacher serve does: no forced exit now
    os.remove(record)  # withdraw, then exit 0
""").format(poll=POLL_S)

LAUNCHER = textwrap.dedent("""
    import subprocess, sys, time
    rank = subprocess.Popen([sys.executable, "-c", sys.argv[1], *sys.argv[2:]],
                            start_new_session=True)
    print(rank.pid, flush=True)
    time.sleep(600)
""")

#: The launcher's parent: a child subreaper (Linux), so the rank, orphaned by its launcher's
#: SIGKILL, is adopted here (its parent id changes as under init) and its exit status read:
#: prints the launcher's and the rank's pids, then, once both are gone, the rank's exit code.
REAPER = textwrap.dedent("""
    import ctypes, os, subprocess, sys
    PR_SET_CHILD_SUBREAPER = 36
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")
    launcher = subprocess.Popen([sys.executable, "-c", *sys.argv[1:]], stdout=subprocess.PIPE,
                                text=True)
    rank = int(launcher.stdout.readline())
    print(launcher.pid, rank, flush=True)
    launcher.wait()  # SIGKILLed by the test
    _, status = os.waitpid(rank, 0)  # the rank, adopted once its launcher died
    print(os.waitstatus_to_exitcode(status), flush=True)
""")


def _wait(predicate, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("how", ["in_order", "stuck"])
def test_rank_leaves_within_the_grace_once_its_launcher_is_killed(tmp_path, how):
    record = tmp_path / "replica-x.json"
    grace = IN_ORDER_GRACE_S if how == "in_order" else GRACE_S
    reaper = subprocess.Popen([sys.executable, "-c", REAPER, LAUNCHER, RANK, str(record), how,
                               str(grace)], stdout=subprocess.PIPE, text=True)
    launcher, rank = map(int, reaper.stdout.readline().split())
    try:
        assert _wait(lambda: os.path.exists(f"{record}.watching"), 60), "the rank never started"
        assert _alive(rank) and record.exists()
        time.sleep(3 * POLL_S)
        assert _alive(rank)  # a live launcher: the rank serves on
        os.kill(launcher, signal.SIGKILL)
        t0 = time.monotonic()
        assert _wait(lambda: not _alive(rank), GONE_WITHIN_S), \
            f"rank {rank} still running {GONE_WITHIN_S} s after its launcher's SIGKILL"
        took = time.monotonic() - t0
        exit_code = int(reaper.communicate(timeout=60)[0])
        assert not record.exists()  # its record released either way
        if how == "in_order":  # stop() ended it, its own way out: exit 0, not the grace's exit
            assert exit_code == 0
        else:  # waited the grace out, released, then the watch's forced exit
            assert exit_code == EXIT_CODE
            assert took >= GRACE_S - 0.1
    finally:
        for pid in (rank, launcher, reaper.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        reaper.wait()


def test_exit_code_and_arguments():
    assert EXIT_CODE not in (0, 1, 2)  # told apart from a clean stop, an error, a usage error
    with pytest.raises(ValueError, match="poll_s must be > 0 and grace_s >= 0, got 0 and 1"):
        LauncherWatch(lambda: None, poll_s=0, grace_s=1)
    watch = LauncherWatch(lambda: None).start()  # this test's parent lives: nothing happens
    assert watch.watching and not watch.gone.is_set()
    watch.close()


STOPPING = textwrap.dedent("""
    import os, sys, time
    from megatron_kd.teacher.launcher_watch import stop_on_signals
    record, stuck = sys.argv[1], sys.argv[2] == "stuck"

    def release():
        os.remove(record)

    open(record, "w").close()
    stop = stop_on_signals({grace}, release)
    open(record + ".ready", "w").close()
    while not stop.wait(0.05) or stuck:  # stuck: the loop never sees the stop
        time.sleep(0.05)
    stop.ended()
    os.remove(record)  # in order
    time.sleep({grace} * 3)  # ended: the overdue exit is called off, this exit is its own
""").format(grace=GRACE_S)


@pytest.mark.parametrize("how", ["in_order", "stuck"])
def test_a_stop_signal_ends_the_process_within_the_grace(tmp_path, how):
    """SIGTERM: a loop that sees it leaves in order (0, no stacks written); one stuck past
    ``grace_s`` writes its threads' stacks, releases and exits STOP_OVERDUE_EXIT."""
    from megatron_kd.teacher.launcher_watch import STOP_OVERDUE_EXIT

    record = tmp_path / "replica-x.json"
    proc = subprocess.Popen([sys.executable, "-c", STOPPING, str(record), how],
                            stderr=subprocess.PIPE, text=True)
    try:
        assert _wait(lambda: os.path.exists(f"{record}.ready"), 60), "never started"
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=GONE_WITHIN_S + 3 * GRACE_S)
        took = time.monotonic() - t0
    finally:
        proc.kill()
    assert not record.exists()  # released either way
    if how == "in_order":
        assert proc.returncode == 0 and "still running" not in err, err
    else:
        assert proc.returncode == STOP_OVERDUE_EXIT, err
        assert GRACE_S - 0.1 <= took < GONE_WITHIN_S
        assert "still running 1 s after the stop signal" in err
        assert "most recent call first" in err  # faulthandler's stacks: where it was stuck
