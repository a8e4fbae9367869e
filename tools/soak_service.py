#!/usr/bin/env python
"""Soak test of the teacher service (not a test itself: ``--short`` runs in CI): teacher replicas
and several student runs at once, while a seeded chaos loop SIGKILLs replicas' ranks (and
restarts them), announces malformed connections and sends garbage bytes to replicas' ports.
Every run must finish every step with the losses of an undisturbed run.

What runs, all on this machine (gloo, CPU, loopback, one thread a process):

* a tiny teacher made by ``megatron-kd train --save`` (2 layers, h 64, a peaked init so the KD
  term is far from zero);
* ``--replicas`` (2) ``megatron-kd teacher serve`` replicas at one directory endpoint;
* the student runs of ``--runs`` (``dp1``: one rank; ``dp2``: two data-parallel ranks; ``tp2``:
  two tensor-parallel ranks; each a ``megatron-kd train`` of ``--steps`` steps under torchrun,
  each with its own seed) connected with ``--kd-mode disaggregated``;
* first, the same runs undisturbed (``--reference colocated``: the teacher in the student's
  processes, while the replicas start; ``disaggregated``: against the replicas, before any
  fault) for the reference losses. Each run and its reference are processes of their own;
  with ``--same-process`` a run's processes (torchrun's ranks) train its reference, wait until
  every reference is done, then train the run itself (one interpreter and Megatron-Core
  start-up a rank less; each ``megatron-kd train`` still starts and ends as a command does,
  in the world the processes keep for both).

The chaos loop (its own ``random.Random(--seed)``) waits a random gap (paced so that at least
``--faults`` faults fall while the runs train, within ``[--min-gap, --max-gap]``), then does one
of:

* ``kill``: SIGKILL one rank of a replica that served a run's last step, with every other
  replica registered (so a student always has one to fail over to); the replica's remaining
  processes are ended and a new replica is started at the endpoint (a "restart"). Kills wait
  for the previous restart to be ready.
* ``connection``: a connection announced in a replica's store (as a student does) with
  malformed metadata (not JSON, ``tp 0`` with a 10^9-token sequence, a microbatch past the
  replica's, another teacher, over 16 KiB, not UTF-8, announced and never described, ...):
  it must be refused with its reason (read where the student reads it) while the replica
  serves on.
* ``bytes``: random bytes to the replica's listening TCP ports (its store's and gloo's),
  on connections opened and closed at once or held open a moment.

Reported (table on stdout, JSON in ``--out``, a PNG in ``--plot`` when matplotlib is there):
steps done per run, failovers and re-sent requests (the runs' failover events), seconds lost
per kill (the client's ``seconds_lost`` and the step-time excess of the step it happened in),
restart times, connections refused, bytes sent. The soak fails (exit 1) when a step is lost, a
loss differs from the reference beyond 1e-5 relative (the tolerance of the failover tests:
another batching of the requests, same maths), a replica dies without being killed, a run fails
over from a replica that was not killed, a garbage connection is accepted or gets no verdict, a
replica stopped with SIGTERM does not exit 0, fewer than ``--faults`` faults were done, or a
process is left behind.

Only public seams: the commands (``megatron-kd train``, ``teacher serve``), their JSON logs,
the endpoint's records, the connection protocol's own functions
(:mod:`megatron_kd.teacher.protocol`) and :class:`megatron_kd.testing.replicas.Replica`. Every
wait has a deadline (``--duration`` bounds the whole soak); every process started (torchrun's
workers, which live in sessions of their own, included) is SIGKILLed when the tool ends,
Ctrl-C and SIGTERM included. (Were the tool itself SIGKILLed, its replicas leave with their
launcher and the students fail within ``--teacher-timeout`` of them.)

    python tools/soak_service.py                # the full soak (about 6 minutes on 2 cores)
    python tools/soak_service.py --short        # about two minutes: 2 runs, one kill
    python tools/soak_service.py --short --same-process   # the same, fewer processes (CI)
    python tools/soak_service.py --steps 600 --faults 40 --seed 7 --out soak.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field

from megatron_kd.teacher.endpoint import DirectoryEndpoint
from megatron_kd.teacher.protocol import (
    CONN_COUNTER_KEY,
    TeacherRefusedError,
    await_verdict,
    meta_key,
    read_identity,
    replica_store,
)
from megatron_kd.testing.replicas import Replica, command, process_alive

#: the runs a soak may take: name -> (ranks, tensor-parallel size); data-parallel = ranks / TP
RUNS = {"dp1": (1, 1), "dp2": (2, 1), "tp2": (2, 2)}
VOCAB, SEQ, MICRO_BATCH, MICROBATCHES = 256, 32, 2, 2
#: loss tolerance against the reference (that of tests/e2e/test_teacher_failover.py): fp32,
#: the same maths in another batching of the requests agree to ~1e-7; a misaligned sample or a
#: lost microbatch moves a loss by far more
REL_TOL = 1e-5
#: seconds after a kill in which the runs' steps are counted as its cost
KILL_WINDOW_S = 10.0
#: --short: about two minutes on 2 cores (most of it start-up), still one kill and restart and
#: garbage of both kinds
SHORT = dict(runs=["dp1", "tp2"], steps=40, faults=4, kills=1, duration=240.0, min_gap=0.5,
             max_gap=6.0)
FAULT_KINDS = ("kill", "connection", "bytes")
#: An environment variable every process of one soak inherits (how its processes are found)
MARKER = "MEGATRON_KD_SOAK"
SCRIPT = os.path.abspath(__file__)


# ---------------------------------------------------------------------------------------------
# processes
# ---------------------------------------------------------------------------------------------
def _stat(pid: int) -> tuple[int, int] | None:
    """``(parent pid, start time)`` of a live process (None: gone, or a zombie)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] == "Z" else (int(fields[1]), int(fields[19]))


class Processes:
    """Every process the soak started and their descendants, remembered with their start time
    (a pid the kernel hands out again later is not ours): torchrun starts its workers in
    sessions of their own, and a worker whose torchrun died is a child of init, so the tree is
    walked often (:meth:`refresh`), any process whose environment holds this soak's ``marker``
    (:data:`MARKER` set to it, inherited by everything the soak starts) is taken too, and what
    was seen once is killed at the end."""

    def __init__(self, marker: str) -> None:
        self.marker = f"{MARKER}={marker}\0".encode()
        self.known: dict[int, int] = {}  # pid -> start time
        self.lock = threading.Lock()

    def add(self, pid: int) -> None:
        st = _stat(pid)
        if st is not None:
            with self.lock:
                self.known[pid] = st[1]

    def refresh(self) -> None:
        """Add every live descendant of a known process, and every process naming the marker."""
        children: dict[int, list[int]] = {}
        named = []
        for name in os.listdir("/proc"):
            if name.isdigit():
                pid = int(name)
                st = _stat(pid)
                if st is None:
                    continue
                children.setdefault(st[0], []).append(pid)
                if pid not in self.known and pid != os.getpid():
                    try:
                        with open(f"/proc/{pid}/environ", "rb") as f:
                            if self.marker in f.read() + b"\0":
                                named.append((pid, st[1]))
                    except OSError:
                        continue
        with self.lock:
            self.known.update(named)
            todo = [p for p in self.known if self._ours(p)]
            while todo:
                for child in children.get(todo.pop(), ()):
                    if child not in self.known:
                        st = _stat(child)
                        if st is not None:
                            self.known[child] = st[1]
                            todo.append(child)

    def _ours(self, pid: int) -> bool:
        st = _stat(pid)
        return st is not None and st[1] == self.known.get(pid)

    def alive(self) -> list[int]:
        with self.lock:
            return sorted(p for p in self.known if self._ours(p))

    def kill_all(self, rounds: int = 3) -> None:
        """SIGKILL every known process still running (a few rounds: one may fork meanwhile)."""
        for _ in range(rounds):
            self.refresh()
            left = self.alive()
            if not left:
                return
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.2)


def _listening_ports(pids: list[int]) -> list[int]:
    """TCP ports the processes ``pids`` listen on (their sockets in ``/proc/<pid>/net/tcp*``)."""
    ports = set()
    for pid in pids:
        inodes = set()
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                try:
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                except OSError:
                    continue
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
        except OSError:
            continue
        for table in ("tcp", "tcp6"):
            try:
                with open(f"/proc/{pid}/net/{table}", encoding="ascii") as f:
                    rows = f.read().splitlines()[1:]
            except OSError:
                continue
            for row in rows:
                cols = row.split()
                if len(cols) > 9 and cols[3] == "0A" and cols[9] in inodes:  # 0A: LISTEN
                    ports.add(int(cols[1].rsplit(":", 1)[1], 16))
    return sorted(ports)


def _env() -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)  # each run is a world of its own
    return env


def _tail(path: str, chars: int = 2000) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()[-chars:]
    except OSError:
        return "(none)"


# ---------------------------------------------------------------------------------------------
# the runs
# ---------------------------------------------------------------------------------------------
@dataclass
class Run:
    """One ``megatron-kd train`` (a torchrun of ``ranks`` ranks when more than one)."""

    name: str
    ranks: int
    tp: int
    seed: int
    log: str
    proc: subprocess.Popen | None = None
    started: float = 0.0
    ended: float | None = None
    progress: list = field(default_factory=list)  # (seconds since the chaos began, steps)
    #: --same-process, a reference: the file its processes write once it is done (they live on)
    done_file: str | None = None
    _records: list = field(default_factory=list)  # its log's lines read so far
    _offset: int = 0  # bytes of its log read so far

    @property
    def dp(self) -> int:
        return self.ranks // self.tp

    def start(self, argv: list[str], procs: Processes) -> None:
        self._popen(command("megatron_kd", argv, self.ranks), procs)

    def start_with_reference(self, reference: Run, reference_argv: list[str],
                             argv: list[str], go_file: str, deadline: float,
                             procs: Processes) -> None:
        """``--same-process``: processes (a torchrun of ``ranks``) that train ``reference``
        (``reference_argv``), mark it done, wait for ``go_file``, then train this run
        (``argv``); :func:`_pair_main` is what each rank runs."""
        job = self.log + ".job.json"
        reference.done_file = reference.log + ".done"
        with open(job, "w", encoding="utf-8") as f:
            json.dump({"reference": reference_argv, "run": argv, "done": reference.done_file,
                       "go": go_file, "wait_s": max(1.0, deadline - time.monotonic())}, f)
        launch = ([sys.executable, "-m", "torch.distributed.run", "--standalone",
                   f"--nproc-per-node={self.ranks}"] if self.ranks > 1 else [sys.executable])
        self._popen([*launch, SCRIPT, "--_pair", job], procs)
        reference.proc, reference.started = self.proc, self.started

    def _popen(self, cmd: list[str], procs: Processes) -> None:
        with open(self.log + ".stderr", "w", encoding="utf-8") as err:
            self.proc = subprocess.Popen(cmd, env=_env(), stdout=subprocess.DEVNULL, stderr=err,
                                         start_new_session=True)
        self.started = time.monotonic()
        procs.add(self.proc.pid)

    def records(self) -> list[dict]:
        """Its log's complete lines so far (read on from where the last call stopped)."""
        try:
            with open(self.log, "rb") as f:
                f.seek(self._offset)
                chunk = f.read()
        except OSError:
            return self._records
        complete = chunk[:chunk.rfind(b"\n") + 1]
        self._offset += len(complete)
        for line in complete.decode("utf-8", "replace").splitlines():
            try:
                self._records.append(json.loads(line))
            except ValueError:
                continue
        return self._records

    def steps(self) -> list[dict]:
        return [r for r in self.records() if "loss" in r and "event" not in r
                and not r.get("eval")]

    def running(self) -> bool:
        if self.done_file is not None and os.path.exists(self.done_file):
            return False  # a reference done in processes that train its run next
        return self.proc is not None and self.proc.poll() is None


def _pair_main(job_path: str) -> int:
    """One rank of ``--same-process``: ``megatron-kd train`` of the reference, then (once the
    soak's ``go`` file is there) of the run, in one process and one world (torchrun's, or one
    of its own), each as ``python -m megatron_kd train`` runs it."""
    from megatron_kd import known_warnings

    known_warnings.install()  # as the CLI does, before torch and Megatron-Core import
    import torch.distributed as dist

    from megatron_kd.cli import main as cli
    from megatron_kd.commands.startup import started

    with open(job_path, encoding="utf-8") as f:
        job = json.load(f)
    # the world started once for both runs: a command ending its own world of torchrun's
    # would leave the next one to rendezvous again over the same store
    with started():
        code = cli(job["reference"])  # the argv begins with "train"
        if code:
            return code
        dist.barrier()
        if dist.get_rank() == 0:
            with open(job["done"], "w", encoding="utf-8") as f:
                f.write("done\n")
        end = time.monotonic() + job["wait_s"]
        while not os.path.exists(job["go"]):
            if time.monotonic() > end:
                print("--same-process: no go within --duration", file=sys.stderr)
                return 1
            time.sleep(0.05)
        return cli(job["run"])


def student_argv(a, run: Run, teacher: str, endpoint: str | None) -> list[str]:
    """A tiny student (1 layer, h 32) on mock data; ``endpoint``: disaggregated."""
    argv = ["train", "--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2",
            "--ffn-hidden-size", "64", "--seq-length", str(SEQ), "--vocab-size", str(VOCAB),
            "--micro-batch-size", str(MICRO_BATCH),
            "--global-batch-size", str(MICRO_BATCH * MICROBATCHES * run.dp),
            "--tensor-model-parallel-size", str(run.tp), "--train-iters", str(a.steps),
            "--lr", "1e-3", "--lr-warmup-iters", "1", "--mock-data", "--no-progress",
            "--eval-iters", "0", "--eval-interval", "1000000", "--seed", str(run.seed),
            "--kd-teacher-load", teacher, "--kd-ce-weight", "0.2", "--log-json", run.log]
    if endpoint is not None:
        argv += ["--kd-mode", "disaggregated", "--kd-teacher-endpoint", endpoint,
                 "--kd-teacher-timeout", f"{a.teacher_timeout:g}", "--kd-prefetch-depth", "2"]
    return argv


def make_teacher(directory: str, procs: Processes, deadline: float) -> None:
    """The teacher checkpoint: one step of ``megatron-kd train`` without a teacher, saved."""
    argv = ["train", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
            "--ffn-hidden-size", "128", "--seq-length", str(SEQ), "--vocab-size", str(VOCAB),
            "--max-position-embeddings", str(SEQ), "--micro-batch-size", "2",
            "--global-batch-size", "2", "--train-iters", "1", "--lr", "1e-3", "--mock-data",
            "--no-progress", "--eval-iters", "0", "--eval-interval", "1000000",
            "--init-method-std", "0.25", "--kd-weight", "0", "--kd-ce-weight", "1",
            "--save", directory, "--save-interval", "1"]
    err = directory + ".stderr"
    with open(err, "w", encoding="utf-8") as f:
        proc = subprocess.Popen(command("megatron_kd", argv), env=_env(),
                                stdout=subprocess.DEVNULL, stderr=f, start_new_session=True)
    procs.add(proc.pid)
    try:
        code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"making the teacher outlasted --duration; stderr:\n{_tail(err)}")
    if code != 0:
        raise RuntimeError(f"making the teacher exited {code}; stderr:\n{_tail(err)}")


def _wait_runs(runs: list[Run], deadline: float, tick=None) -> None:
    """Until every run has exited (``tick()`` between polls) or ``deadline``."""
    while any(r.running() for r in runs) and time.monotonic() < deadline:
        if tick is not None:
            tick()
        time.sleep(0.2)
    for r in runs:
        if r.ended is None and not r.running():
            r.ended = time.monotonic()


# ---------------------------------------------------------------------------------------------
# garbage
# ---------------------------------------------------------------------------------------------
def garbage_connections(identity: dict, rng: random.Random) -> list[tuple[str, object, str]]:
    """``(name, metadata written, a piece of the refusal expected)``; metadata None: announced
    and never described. Every one is something a replica must refuse."""
    good = {"run": rng.randrange(2 ** 40), "dp_rank": 0, "tp": 1,
            "micro_batch_size": MICRO_BATCH, "seq_length": SEQ, "max_samples": MICRO_BATCH,
            "wire_dtype": "fp32", "device": "cpu", "identity": identity}

    def bad(**changes) -> str:
        return json.dumps({k: v for k, v in {**good, **changes}.items() if v is not ...})

    return [
        ("not JSON", '{"run": 7, "dp_rank": 0, "tp": ', "not JSON"),
        ("tp 0 and a 10^9-token sequence", bad(tp=0, seq_length=10 ** 9),
         "tp must be an integer in [1, 2**62), got 0"),
        ("a 10^9-token sequence", bad(seq_length=10 ** 9), "exceeds this replica's "
                                                           "--max-seq-length"),
        ("a microbatch of 10^6", bad(micro_batch_size=10 ** 6, max_samples=10 ** 6),
         "exceeds this replica's --max-batch-size"),
        ("another teacher", bad(identity={**identity, "hidden_size": 1}),
         "expects another teacher"),
        ("no identity", bad(identity=...), "names no teacher identity"),
        ("a string for an integer", bad(run="seven"), "run must be an integer"),
        ("true for an integer", bad(tp=True), "tp must be an integer"),
        ("2**70", bad(micro_batch_size=2 ** 70), "micro_batch_size must be an integer"),
        ("NaN", bad(dp_rank=float("nan")), "dp_rank must be an integer"),
        ("a JSON list", json.dumps([good]), "must be a JSON object"),
        ("an unknown field", bad(shell="rm -rf /"), "unknown fields ['shell']"),
        ("a missing field", bad(seq_length=...), "missing fields ['seq_length']"),
        ("wire dtype fp4", bad(wire_dtype="fp4"), "wire_dtype must be one of"),
        ("device tpu", bad(device="tpu"), "makes links to students on"),
        ("seq 32 over tp 3", bad(tp=3), "must divide into 3 parts"),
        ("over 16 KiB", bad(pad="x" * 20000), "more than the 16384"),
        ("nested 10^4 deep", "[" * 10000, "not JSON"),
        ("not UTF-8", b"\xff\xfe\x00" + rng.randbytes(61), "not JSON"),
        ("random bytes", rng.randbytes(rng.randrange(1, 2048)), ""),
        ("never described", None, "no connection metadata within"),
    ]


def send_garbage_bytes(ports: list[int], rng: random.Random) -> dict:
    """Random bytes to each port of ``ports`` (127.0.0.1): a connection closed at once after
    them, or held open a moment. What was sent and what failed (a refused or reset connection
    is not a failure of the replica)."""
    sent, connections, errors = 0, 0, []
    for port in ports:
        data = rng.randbytes(rng.choice([1, 8, 24, 64, 512, 4096, 65536]))
        hold = rng.random() < 0.3
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=2.0) as conn:
                connections += 1
                conn.sendall(data)
                sent += len(data)
                if hold:
                    time.sleep(0.3)
        except OSError as e:
            errors.append(f"{port}: {type(e).__name__}: {e}")
    return {"ports": ports, "connections": connections, "bytes": sent, "errors": errors}


# ---------------------------------------------------------------------------------------------
# the chaos loop
# ---------------------------------------------------------------------------------------------
@dataclass
class Slot:
    """One of the replicas: the process serving in its place now (a restart replaces it)."""

    index: int
    replica: Replica
    killed: bool = False  # the chaos loop killed the current one
    starting_since: float | None = None  # a restart not ready yet (since the kill)
    stop_exit: int | None = None  # its exit status on SIGTERM at the end


class Soak:
    """The replicas, the runs and the chaos loop of one soak."""

    def __init__(self, a, workdir: str, procs: Processes) -> None:
        self.a, self.workdir, self.procs = a, workdir, procs
        self.rng = random.Random(a.seed)
        self.endpoint = os.path.join(workdir, "endpoint")
        self.teacher = os.path.join(workdir, "teacher")
        self.slots: list[Slot] = []
        self.all_replicas: list[Replica] = []
        self.faults: list[dict] = []
        self.kills: list[dict] = []
        self.deaths: list[dict] = []  # replicas gone without being killed
        self.threads: list[threading.Thread] = []
        self.t0 = time.monotonic()  # the chaos's clock (reset when it begins)
        self.deadline = time.monotonic() + a.duration
        self.next_fault = None
        self.last_refresh = 0.0
        self.plan = self._plan()
        self.cases: list = []  # garbage connections not yet sent (a shuffled deck)

    def _plan(self) -> list[str]:
        """The first ``--faults`` faults' kinds: ``--kills`` kills, one at a random place in
        each of as many equal stretches (a kill waits for the last restart), and garbage of
        both kinds around them."""
        a = self.a
        count = max(a.faults, a.kills + 2)
        kills = {self.rng.randrange(k * count // a.kills, (k + 1) * count // a.kills)
                 for k in range(a.kills)}
        garbage = [self.rng.choice(FAULT_KINDS[1:]) for _ in range(count - len(kills))]
        garbage[:2] = self.rng.sample(FAULT_KINDS[1:], 2)  # one of each kind at least
        self.rng.shuffle(garbage)
        return ["kill" if i in kills else garbage.pop() for i in range(count)]

    def now(self) -> float:
        return round(time.monotonic() - self.t0, 3)

    # -- replicas -------------------------------------------------------------------------------
    def _start_replica(self, index: int) -> Replica:
        n = len(self.all_replicas)
        timeout = f"{self.a.teacher_timeout:g}"
        replica = Replica(self.endpoint, self.teacher, tp=self.a.replica_tp,
                          log=os.path.join(self.workdir, f"replica{n}_slot{index}.jsonl"),
                          extra=("--kd-teacher-timeout", timeout), wait=False,
                          start_timeout_s=max(1.0, self.deadline - time.monotonic()))
        self.procs.add(replica.proc.pid)
        self.all_replicas.append(replica)
        return replica

    def start_replicas(self) -> None:
        self.slots = [Slot(i, self._start_replica(i)) for i in range(self.a.replicas)]

    def wait_replicas(self) -> None:
        for slot in self.slots:
            slot.replica.wait_ready()

    def _check_replicas(self) -> None:
        """Restarts that became ready; replicas gone without being killed (a failure: recorded,
        and a new one started so that later kills still leave one to fail over to)."""
        for slot in self.slots:
            replica = slot.replica
            if slot.starting_since is not None and replica.events("ready"):
                replica.wait_ready()  # returns at once: names the replica
                for kill in self.kills:
                    if kill["slot"] == slot.index and kill["restart_ready_s"] is None:
                        kill["restart_ready_s"] = round(time.monotonic() - slot.starting_since, 3)
                        kill["restarted_as"] = replica.replica
                slot.starting_since = None
            elif replica.proc.poll() is not None and not slot.killed:
                self.deaths.append({
                    "t": self.now(), "exit": replica.proc.returncode,
                    "replica": getattr(replica, "replica", None) or "(a restart, never ready)",
                    "after_fault": self.faults[-1] if self.faults else None,
                    "stderr": _tail(str(replica.stderr_path))})
                self._restart(slot)
                slot.starting_since = time.monotonic()

    def _restart(self, slot: Slot) -> None:
        slot.replica.kill(signal.SIGKILL)  # what is left of it
        slot.replica.proc.wait(timeout=30)
        slot.replica = self._start_replica(slot.index)
        slot.killed, slot.starting_since = False, time.monotonic()

    # -- faults ---------------------------------------------------------------------------------
    def _serving(self, runs: list[Run]) -> set[str]:
        """Replicas that answered the last step of a run still training."""
        out: set[str] = set()
        for run in runs:
            if run.running():
                steps = run.steps()
                if steps:
                    out |= set(steps[-1].get("kd_replica_tokens") or {})
        return out

    def _kill_allowed(self, runs: list[Run]) -> bool:
        live = [r for r in runs if r.running()]
        return (any(r.steps() for r in live)  # mid-run (a run may still be connecting)
                and all(s.starting_since is None and s.replica.proc.poll() is None
                        for s in self.slots))

    def _kill(self, runs: list[Run]) -> dict:
        serving = self._serving(runs)
        slots = [s for s in self.slots if s.replica.replica in serving] or self.slots
        slot = self.rng.choice(slots)
        replica = slot.replica
        pids = replica.pids
        launcher = replica.proc.pid  # one rank: the rank itself; else torchrun's workers
        ranks = [p for p in pids if (_stat(p) or (0, 0))[0] == launcher] \
            if self.a.replica_tp > 1 else [launcher]
        rank = self.rng.choice(sorted(ranks) or [launcher])
        steps = {r.name: len(r.steps()) for r in runs}
        os.kill(rank, signal.SIGKILL)
        t_kill, at = time.monotonic(), self.now()
        slot.killed = True
        # the rest of the replica (a torchrun's other ranks) goes with it; what does not is killed
        end = time.monotonic() + 30
        while any(process_alive(p) for p in pids) and time.monotonic() < end:
            time.sleep(0.1)
        kill = {"t": at, "slot": slot.index, "replica": replica.replica, "rank_pid": rank,
                "was_serving": replica.replica in serving, "steps_done": steps,
                "replica_gone_s": round(time.monotonic() - t_kill, 3),
                "restart_ready_s": None, "restarted_as": None}
        self._restart(slot)
        slot.starting_since = t_kill
        self.kills.append(kill)
        return {"kind": "kill", "replica": replica.replica, "rank_pid": rank}

    def _live_slot(self) -> Slot | None:
        live = [s for s in self.slots if s.starting_since is None and s.replica.proc.poll() is None]
        return self.rng.choice(live) if live else None

    def _garbage_connection(self) -> dict | None:
        slot = self._live_slot()
        if slot is None:
            return None
        replica = slot.replica
        records = [r for r in DirectoryEndpoint(self.endpoint).replicas()
                   if r.replica == replica.replica]
        if not records:
            return None
        if not self.cases:
            self.cases = list(range(len(garbage_connections({}, random.Random(0)))))
            self.rng.shuffle(self.cases)
        case = self.cases.pop()
        fault = {"kind": "connection", "replica": replica.replica, "outcome": "pending"}
        seed = self.rng.randrange(2 ** 32)
        timeout = self.a.teacher_timeout + 15  # the replica's, for an announcement never described

        def announce() -> None:
            try:
                store = replica_store(records[0], 10.0)
                name, payload, expected = garbage_connections(read_identity(store),
                                                              random.Random(seed))[case]
                fault.update(case=name, expected=expected)
                conn = store.add(CONN_COUNTER_KEY, 1) - 1
                if payload is not None:
                    store.set(meta_key(conn), payload)
                await_verdict(store, conn, timeout, str(records[0]))
                fault["outcome"] = "accepted"
            except TeacherRefusedError as e:
                fault.update(outcome="refused", reason=str(e)[-300:],
                             reason_as_expected=fault.get("expected", "") in str(e))
            except Exception as e:  # noqa: BLE001 - no verdict, for whatever reason: reported
                fault.update(outcome="no verdict", error=f"{type(e).__name__}: {e}"[:300])
            fault["done_t"] = self.now()

        thread = threading.Thread(target=announce, daemon=True, name=f"soak-conn-{case}")
        thread.start()
        self.threads.append(thread)
        return fault

    def _garbage_bytes(self) -> dict | None:
        slot = self._live_slot()
        if slot is None:
            return None
        replica = slot.replica
        ports = _listening_ports(replica.pids)
        records = [r for r in DirectoryEndpoint(self.endpoint).replicas()
                   if r.replica == replica.replica]
        store_port = [records[0].port] if records else []
        others = [p for p in ports if p not in store_port]
        chosen = store_port + self.rng.sample(others, min(len(others), self.a.ports_per_fault))
        result = send_garbage_bytes(chosen, random.Random(self.rng.randrange(2 ** 32)))
        return {"kind": "bytes", "replica": replica.replica, "listening_ports": len(ports),
                **result}

    def _gap(self, runs: list[Run]) -> float:
        """Seconds to the next fault: the time the runs have left over the faults still due
        (so that --faults fall while they train), times a random factor, within bounds."""
        a = self.a
        left = []
        for run in runs:
            stepping = [p for p in run.progress if p[1] > 0]  # its start-up left out
            if run.running() and len(stepping) >= 2:
                (t1, s1), (t2, s2) = stepping[0], stepping[-1]
                if s2 > s1 and t2 > t1:
                    left.append((a.steps - s2) * (t2 - t1) / (s2 - s1))
        due = max(a.faults - len(self.faults), 1)
        base = min(left) / (due + 1) if left else a.min_gap
        return min(max(base * self.rng.uniform(0.5, 1.5), a.min_gap), a.max_gap)

    def tick(self, runs: list[Run]) -> None:
        """One turn of the chaos loop: progress, replicas' health, and a fault when one is due."""
        now = self.now()
        for run in runs:
            if run.running():
                n = len(run.steps())
                if not run.progress or run.progress[-1][1] != n:
                    run.progress.append((now, n))
        if now - self.last_refresh > 1.0:
            self.procs.refresh()
            self.last_refresh = now
        self._check_replicas()
        if not any(run.progress[-1][1] for run in runs if run.progress):
            return  # the faults begin with the first step (a run is training)
        if self.next_fault is None:
            self.next_fault = now + self._gap(runs)
        if now < self.next_fault or not any(r.running() for r in runs):
            return
        kind = self._next_kind(runs)
        if kind is None:
            return  # a kill is due and not allowed yet: the next turn
        fault = {"kill": self._kill, "connection": lambda _: self._garbage_connection(),
                 "bytes": lambda _: self._garbage_bytes()}[kind](runs)
        if fault is not None:  # the same dict: a connection's thread fills in its verdict
            fault.update(t=now, index=len(self.faults))
            self.faults.append(fault)
            print(f"  {now:7.1f} s  fault {len(self.faults)}: {kind} "
                  f"{fault.get('replica', '')}", flush=True)
        self.next_fault = self.now() + self._gap(runs)

    def _next_kind(self, runs: list[Run]) -> str | None:
        allowed = self._kill_allowed(runs)
        if self.plan:
            for i, kind in enumerate(self.plan):
                if kind != "kill" or allowed:
                    return self.plan.pop(i)
            return None
        kinds = FAULT_KINDS if allowed else FAULT_KINDS[1:]
        return self.rng.choice(kinds)

    def finish(self) -> None:
        """Wait for the garbage connections' verdicts (bounded), then stop every replica with
        SIGTERM (one serving must exit 0; a restart still starting is only stopped)."""
        end = time.monotonic() + self.a.teacher_timeout + 20
        for thread in self.threads:
            thread.join(max(0.0, end - time.monotonic()))
        # a restart still starting: until it is ready (its time is measured) or --duration
        while any(s.starting_since is not None for s in self.slots) \
                and time.monotonic() < self.deadline:
            self._check_replicas()
            time.sleep(0.2)
        self._check_replicas()
        for slot in self.slots:
            serving = slot.starting_since is None and not slot.killed
            code = slot.replica.stop()
            slot.stop_exit = code if serving else None


# ---------------------------------------------------------------------------------------------
# results
# ---------------------------------------------------------------------------------------------
def compare(losses: dict[int, float], reference: dict[int, float]) -> dict:
    """Step by step (losses by step number) against the reference: changed steps (beyond
    :data:`REL_TOL`), the largest relative difference, steps exactly equal."""
    changed, worst, exact = [], 0.0, 0
    for step in sorted(set(losses) & set(reference)):
        x, ref = losses[step], reference[step]
        diff = abs(x - ref)
        worst = max(worst, diff / abs(ref) if ref else diff)
        exact += x == ref
        if not diff <= REL_TOL * abs(ref) + 1e-12:  # pytest.approx(rel=1e-5)'s test; NaN fails
            changed.append(step)
    return {"changed_steps": changed, "max_rel_diff": worst, "exact_steps": exact}


def run_result(a, run: Run, reference: Run, kills: list[dict]) -> dict:
    steps = run.steps()
    events = [r for r in run.records() if r.get("event") == "failover"]
    times = [r["step_time_s"] for r in steps if "step_time_s" in r]
    median = statistics.median(times) if times else None
    killed = {k["replica"] for k in kills}
    unexplained = [e for e in events
                   if not any(f"replica {k} " in e.get("replica_lost", "") for k in killed)]
    ref = {r["step"]: r["loss"] for r in reference.steps()}
    cmp = compare({r["step"]: r["loss"] for r in steps}, ref)
    return {"name": run.name, "ranks": run.ranks, "dp": run.dp, "tp": run.tp, "seed": run.seed,
            "steps_asked": a.steps, "steps_done": len(steps), "reference_steps": len(ref),
            "lost_steps": a.steps - len(steps),
            "exit_code": run.proc.returncode if run.proc else None,
            "failovers": len(events),
            "requests_resent": sum(e.get("requests_resent", 0) for e in events),
            "seconds_lost": [e.get("seconds_lost") for e in events],
            "median_step_s": median, "events": events, "unexplained_failovers": unexplained,
            "wall_s": round((run.ended or time.monotonic()) - run.started, 1),
            "stderr_tail": None if run.proc and run.proc.returncode == 0 else
            _tail(run.log + ".stderr"), **cmp}


def kill_result(kill: dict, runs: list[Run], results: list[dict]) -> dict:
    """A kill's cost: the failovers naming the killed replica, their re-sent requests and the
    client's seconds lost (the wait that found it dead and the reconnect), and the worst
    excess over its run's median step of any step of any run ended within
    :data:`KILL_WINDOW_S` of the kill (what the runs lost in all: the failover, the re-sent
    requests computed again, a student probing the dead replica's record, the restart's
    start-up taking the cores)."""
    mark = f"replica {kill['replica']} "
    caused = [e for r in results for e in r["events"] if mark in e.get("replica_lost", "")]
    excess = []
    for run, result in zip(runs, results):
        median = result["median_step_s"]
        for step in run.steps():
            ended = next((t for t, n in run.progress if n >= step.get("step", 0)), None)
            if ended is not None and median is not None and \
                    kill["t"] <= ended <= kill["t"] + KILL_WINDOW_S:
                excess.append(step["step_time_s"] - median)
    return {**kill, "failovers": len(caused),
            "requests_resent": sum(e.get("requests_resent", 0) for e in caused),
            "seconds_lost_max": max((e.get("seconds_lost", 0) for e in caused), default=None),
            "step_excess_s_max": max(excess, default=None)}


def _fmt(x, digits: int = 3) -> str:
    return "-" if x is None else f"{x:.{digits}f}" if isinstance(x, float) else str(x)


def tables(report: dict) -> str:
    t = report["totals"]
    lines = ["| run | ranks (DP x TP) | steps done | failovers | re-sent requests | seconds "
             "lost (client, worst) | losses = reference (1e-5 rel.) | largest rel. difference "
             "| steps bit-equal |", "|---|---|---|---|---|---|---|---|---|"]
    for r in report["runs"]:
        same = "yes" if not r["changed_steps"] else f"NO: steps {r['changed_steps'][:8]}"
        lines.append(f"| {r['name']} | {r['ranks']} ({r['dp']} x {r['tp']}) | "
                     f"{r['steps_done']} of {r['steps_asked']} | {r['failovers']} | "
                     f"{r['requests_resent']} | {_fmt(max(r['seconds_lost'], default=None))} | "
                     f"{same} | "
                     f"{r['max_rel_diff']:.1e} | {r['exact_steps']} |")
    lines += ["", "| kill | at s | replica's rank SIGKILLed | serving a run | failovers | "
              "re-sent requests | seconds lost (client) | worst step - median s (any run, "
              f"{KILL_WINDOW_S:g} s after) | restart ready after s |",
              "|---|---|---|---|---|---|---|---|---|"]
    for i, k in enumerate(report["kills"], 1):
        lines.append(f"| {i} | {k['t']:.1f} | pid {k['rank_pid']} | "
                     f"{'yes' if k['was_serving'] else 'no'} | {k['failovers']} | "
                     f"{k['requests_resent']} | {_fmt(k['seconds_lost_max'])} | "
                     f"{_fmt(k['step_excess_s_max'])} | {_fmt(k['restart_ready_s'], 1)} |")
    conn, byt = t["connection"], t["bytes"]
    lines += ["", "| fault | count | outcome |", "|---|---|---|",
              f"| SIGKILL of a replica's rank, then a restart | {t['kills']} | "
              f"{t['restarts_ready']} restarts ready, {t['failovers']} failovers, "
              f"{t['requests_resent']} requests re-sent |",
              f"| malformed connection metadata | {conn['count']} | {conn['refused']} refused "
              f"({conn['reason_as_expected']} with the reason expected), {conn['accepted']} "
              f"accepted, {conn['no_verdict']} without a verdict, {conn['replica_killed']} on a "
              f"replica killed first; replicas' logs: {t['refused_logged']} refused |",
              f"| garbage bytes to a replica's ports | {byt['count']} | {byt['connections']} "
              f"connections, {byt['bytes']} bytes, {byt['errors']} refused or reset by the "
              f"system |",
              "", f"faults {t['faults']} (at least {report['config']['faults']} asked), "
              f"lost steps {t['lost_steps']}, changed losses {t['changed_steps']}, replicas "
              f"dead without a kill {t['unexpected_deaths']}, failovers from a replica not "
              f"killed {t['unexplained_failovers']}, replicas not exiting 0 on SIGTERM "
              f"{t['bad_stops']}, processes left behind {len(t['leftover_processes'])}"]
    return "\n".join(lines)


def summarize(a, soak: Soak, runs: list[Run], references: list[Run], leftovers: list[int],
              wall_s: float) -> dict:
    results = [run_result(a, run, ref, soak.kills) for run, ref in zip(runs, references)]
    kills = [kill_result(k, runs, results) for k in soak.kills]
    conns = [f for f in soak.faults if f["kind"] == "connection"]
    killed_at = {k["replica"]: k["t"] for k in soak.kills}

    def killed_first(f: dict) -> bool:  # no verdict: the replica was killed while it waited
        return f["outcome"] == "no verdict" and f["t"] <= killed_at.get(f["replica"], -1.0)

    byts = [f for f in soak.faults if f["kind"] == "bytes"]
    totals = {
        "faults": len(soak.faults), "kills": len(soak.kills),
        "restarts_ready": sum(k["restart_ready_s"] is not None for k in soak.kills),
        "failovers": sum(r["failovers"] for r in results),
        "requests_resent": sum(r["requests_resent"] for r in results),
        "lost_steps": sum(r["lost_steps"] for r in results),
        "changed_steps": sum(len(r["changed_steps"]) for r in results),
        "unexplained_failovers": sum(len(r["unexplained_failovers"]) for r in results),
        "unexpected_deaths": len(soak.deaths),
        "bad_stops": sum(1 for s in soak.slots if getattr(s, "stop_exit", None) not in (0, None)),
        "refused_logged": sum(len(r.events("refused")) for r in soak.all_replicas),
        "connection": {"count": len(conns),
                       "refused": sum(f["outcome"] == "refused" for f in conns),
                       "reason_as_expected": sum(bool(f.get("reason_as_expected"))
                                                 for f in conns),
                       "accepted": sum(f["outcome"] == "accepted" for f in conns),
                       "no_verdict": sum(f["outcome"] in ("no verdict", "pending")
                                         and not killed_first(f) for f in conns),
                       "replica_killed": sum(killed_first(f) for f in conns)},
        "bytes": {"count": len(byts), "connections": sum(f["connections"] for f in byts),
                  "bytes": sum(f["bytes"] for f in byts),
                  "errors": sum(len(f["errors"]) for f in byts)},
        "leftover_processes": leftovers,
    }
    problems = []
    for r in results:
        if r["lost_steps"] or r["exit_code"] != 0:
            problems.append(f"run {r['name']}: {r['steps_done']} of {r['steps_asked']} steps, "
                            f"exit {r['exit_code']}")
        if r["changed_steps"]:
            problems.append(f"run {r['name']}: losses differ from the reference at steps "
                            f"{r['changed_steps'][:10]} (largest {r['max_rel_diff']:.2e})")
        if r["reference_steps"] != a.steps:
            problems.append(f"reference run {r['name']}: {r['reference_steps']} steps")
        if r["unexplained_failovers"]:
            problems.append(f"run {r['name']}: failed over from a replica not killed: "
                            f"{r['unexplained_failovers'][:3]}")
    for d in soak.deaths:
        problems.append(f"replica {d['replica']} died without a kill at {d['t']} s (exit "
                        f"{d['exit']}) after {d.get('after_fault')}")
    c = totals["connection"]
    if c["accepted"] or c["no_verdict"]:
        problems.append(f"garbage connections: {c['accepted']} accepted, {c['no_verdict']} "
                        f"without a verdict")
    if totals["bad_stops"]:
        problems.append(f"{totals['bad_stops']} replicas did not exit 0 on SIGTERM")
    if totals["faults"] < a.faults:
        problems.append(f"only {totals['faults']} faults while the runs trained (--faults "
                        f"{a.faults}): raise --steps")
    if totals["kills"] < a.kills or totals["restarts_ready"] < min(totals["kills"], 1):
        problems.append(f"{totals['kills']} kills ({a.kills} asked), "
                        f"{totals['restarts_ready']} restarts ready")
    if leftovers:
        problems.append(f"processes left behind: {leftovers}")
    report = {"config": {k: v for k, v in vars(a).items()}, "machine": machine(),
              "runs": results, "kills": kills, "faults": soak.faults, "deaths": soak.deaths,
              "totals": totals, "problems": problems, "ok": not problems,
              "wall_s": round(wall_s, 1),
              "progress": {r.name: r.progress for r in runs}}
    report["table"] = tables(report)
    return report


def machine() -> dict:
    model = ""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        model = next((ln.split(":", 1)[1].strip() for ln in out.splitlines()
                      if ln.startswith("Model name")), "")
    except (OSError, subprocess.SubprocessError):
        pass
    return {"date": datetime.date.today().isoformat(), "nproc": os.cpu_count(),
            "cpu": model or platform.processor(), "python": platform.python_version()}


def plot(report: dict, path: str) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)")
        return False
    fig, ax = plt.subplots(figsize=(9, 4.2))
    for name, points in report["progress"].items():
        if points:
            ax.step([p[0] for p in points], [p[1] for p in points], where="post", label=name)
    styles = {"kill": ("tab:red", "-", 1.2), "connection": ("tab:orange", ":", 0.8),
              "bytes": ("tab:gray", ":", 0.8)}
    seen = set()
    for f in report["faults"]:
        color, ls, lw = styles[f["kind"]]
        ax.axvline(f["t"], color=color, ls=ls, lw=lw,
                   label=None if f["kind"] in seen else {"kill": "SIGKILL + restart",
                                                         "connection": "bad connection",
                                                         "bytes": "garbage bytes"}[f["kind"]])
        seen.add(f["kind"])
    ax.set(xlabel="seconds since the runs started", ylabel="steps done",
           title=f"soak: {report['totals']['faults']} faults, "
                 f"{report['totals']['lost_steps']} steps lost, "
                 f"{report['totals']['changed_steps']} losses changed")
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


# ---------------------------------------------------------------------------------------------
# the soak
# ---------------------------------------------------------------------------------------------
def soak(a, workdir: str, procs: Processes) -> dict:
    t_start = time.monotonic()
    s = Soak(a, workdir, procs)
    os.makedirs(s.endpoint)
    make_teacher(s.teacher, procs, s.deadline)
    print(f"teacher made ({time.monotonic() - t_start:.0f} s)", flush=True)

    def runs(prefix: str) -> list[Run]:
        return [Run(name, *RUNS[name], seed=a.seed + i,
                    log=os.path.join(workdir, f"{prefix}_{name}.jsonl"))
                for i, name in enumerate(a.runs)]

    references, chaos = runs("reference"), runs("soak")
    go = os.path.join(workdir, "go")  # --same-process: the runs may begin

    def start_references(endpoint: str | None) -> None:
        for r, c in zip(references, chaos):
            if a.same_process:
                c.start_with_reference(r, student_argv(a, r, s.teacher, endpoint),
                                       student_argv(a, c, s.teacher, s.endpoint), go,
                                       s.deadline, procs)
            else:
                r.start(student_argv(a, r, s.teacher, endpoint), procs)

    s.start_replicas()
    if a.reference == "colocated":  # while the replicas start
        start_references(None)
    s.wait_replicas()
    print(f"{a.replicas} replicas ready ({time.monotonic() - t_start:.0f} s)", flush=True)
    if a.reference == "disaggregated":
        start_references(s.endpoint)
    _wait_runs(references, s.deadline, procs.refresh)
    print(f"reference runs done ({time.monotonic() - t_start:.0f} s)", flush=True)
    s.t0 = time.monotonic()
    for r in chaos:
        if a.same_process:
            r.started = s.t0
        else:
            r.start(student_argv(a, r, s.teacher, s.endpoint), procs)
    if a.same_process:
        with open(go, "w", encoding="utf-8") as f:
            f.write("go\n")
    _wait_runs(chaos, s.deadline, lambda: s.tick(chaos))
    print(f"soak runs done ({time.monotonic() - t_start:.0f} s)", flush=True)
    for r in references + chaos:
        if r.running():
            print(f"run {r.name} still running at --duration: killed", flush=True)
    s.finish()
    procs.kill_all()
    time.sleep(0.5)
    leftovers = procs.alive()
    return summarize(a, s, chaos, references, leftovers, time.monotonic() - t_start)


def _interrupted(signum, _frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--_pair"]:  # one rank of --same-process's processes
        return _pair_main(argv[1])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=1500, help="steps of each student run")
    p.add_argument("--faults", type=int, default=24,
                   help="faults at least (the soak fails with fewer while the runs train)")
    p.add_argument("--kills", type=int, default=5, help="of which SIGKILLs at least")
    p.add_argument("--seed", type=int, default=1234,
                   help="the chaos loop's random choices; run i trains with seed + i")
    p.add_argument("--duration", type=float, default=1800.0,
                   help="seconds the whole soak may take; whatever still runs then is killed "
                        "and the soak fails")
    p.add_argument("--short", action="store_true",
                   help=f"about a minute: {SHORT} (the flags it sets are then ignored)")
    p.add_argument("--runs", nargs="+", choices=sorted(RUNS), default=["dp1", "dp2", "tp2"])
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--replica-tp", type=int, default=1,
                   help="ranks of each replica (a kill SIGKILLs one of them)")
    p.add_argument("--reference", choices=("colocated", "disaggregated"), default="colocated",
                   help="the undisturbed runs: colocated (while the replicas start) or "
                        "against the replicas before any fault")
    p.add_argument("--same-process", action="store_true",
                   help="train each run's reference and then the run in the same processes "
                        "(one start-up a rank less; default: processes of their own)")
    p.add_argument("--teacher-timeout", type=float, default=10.0,
                   help="--kd-teacher-timeout of the students and the replicas")
    p.add_argument("--min-gap", type=float, default=0.5, help="seconds between faults at least")
    p.add_argument("--max-gap", type=float, default=8.0, help="seconds between faults at most")
    p.add_argument("--ports-per-fault", type=int, default=6,
                   help="gloo ports (besides the store's) a garbage-bytes fault writes to")
    p.add_argument("--workdir", default=None,
                   help="logs and checkpoints (default: a temporary directory, removed unless "
                        "the soak fails)")
    p.add_argument("--out", default="bench_out/soak_service.json")
    p.add_argument("--plot", default="bench_out/soak_service.png")
    a = p.parse_args(argv)
    if a.short:
        vars(a).update(SHORT)
    if a.replicas < 2:
        p.error("--replicas must be >= 2: a kill leaves the students one to fail over to")
    if a.steps < 10 or a.faults < 1 or a.kills < 0:
        p.error("need --steps >= 10, --faults >= 1, --kills >= 0")

    signal.signal(signal.SIGTERM, _interrupted)
    workdir = os.path.abspath(a.workdir or tempfile.mkdtemp(prefix="soak_service_"))
    os.makedirs(workdir, exist_ok=True)
    # Every process the soak starts keeps its temporary files in the workdir: a SIGKILLed one
    # cannot remove its own (a one-process world's file store, wandb's folders)
    os.environ["TMPDIR"] = os.path.join(workdir, "tmp")
    os.makedirs(os.environ["TMPDIR"], exist_ok=True)
    marker = f"{os.getpid()}-{time.time_ns()}"
    os.environ[MARKER] = marker  # inherited by every process the soak starts
    procs = Processes(marker)
    print(f"soak: runs {a.runs}, {a.steps} steps, >= {a.faults} faults (>= {a.kills} kills), "
          f"seed {a.seed}, logs in {workdir}", flush=True)
    try:
        report = soak(a, workdir, procs)
    except KeyboardInterrupt:
        print("interrupted: every process of the soak killed", file=sys.stderr)
        return 130
    finally:
        for signum in (signal.SIGINT, signal.SIGTERM):  # a second Ctrl-C cannot stop the cleanup
            signal.signal(signum, signal.SIG_IGN)
        procs.kill_all()
    report["command"] = "python tools/soak_service.py " + " ".join(argv)
    report["workdir"] = workdir
    print("\n" + report["table"])
    for problem in report["problems"]:
        print(f"PROBLEM: {problem}")
    print(f"\n{'OK' if report['ok'] else 'FAILED'}: {report['wall_s']:.0f} s")
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1, default=str)
    print(f"wrote {a.out}")
    if a.plot:
        os.makedirs(os.path.dirname(a.plot) or ".", exist_ok=True)
        if plot(report, a.plot):
            print(f"wrote {a.plot}")
    if report["ok"] and a.workdir is None:
        shutil.rmtree(workdir, ignore_errors=True)
    elif not report["ok"]:
        print(f"logs kept in {workdir}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
