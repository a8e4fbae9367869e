"""A real, single-host Slurm for the sbatch tests: munged, slurmctld and slurmd on localhost.

Uses Debian's ``slurm-wlm`` and ``munge`` packages (``.ci/slurm_setup.sh`` installs them). All
state, spool, pid, log and socket files live in one temporary directory; the daemons listen on
their own ports and run in the foreground (``-D``) in their own sessions, so nothing touches the
system's Slurm or munge, and :meth:`LocalSlurm.stop` ends exactly the processes it started (by
PID). Each node offers ``cpus`` CPUs (more than the machine may have:
``SlurmdParameters=config_overrides``), enough for a teacher group and a student group side by
side. The first node is named after this host (so that a script's rendezvous host, the first
node of its allocation, resolves); ``nodes > 1`` adds "virtual" nodes ``<host>-n2``... served
by more slurmd processes on this host (Debian's Slurm is built to allow several per host).

Nothing here imports torch or megatron: it only runs programs. ``python tests/slurm_fixture.py``
brings a cluster up and prints the ``SLURM_CONF`` to export, for trying the scripts by hand.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Self

PROGRAMS = ("munged", "mungekey", "slurmctld", "slurmd", "sbatch", "scontrol", "sinfo", "srun",
           "scancel")

# Job states after which a job never runs again.
FINAL_STATES = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL",
                          "PREEMPTED", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"})


class SlurmUnavailable(RuntimeError):
    """The daemons cannot run on this machine (missing packages, refused to start...)."""


def missing_programs() -> list[str]:
    """The Slurm / munge programs not found on ``PATH`` (plus the sbin directories)."""
    path = os.environ.get("PATH", "") + os.pathsep + "/usr/sbin" + os.pathsep + "/sbin"
    return [name for name in PROGRAMS if shutil.which(name, path=path) is None]


def _which(name: str) -> str:
    path = os.environ.get("PATH", "") + os.pathsep + "/usr/sbin" + os.pathsep + "/sbin"
    found = shutil.which(name, path=path)
    if found is None:
        raise SlurmUnavailable(f"{name} is not installed")
    return found


def parse_show_job(line: str) -> dict[str, str]:
    """``scontrol show job -o`` output -> ``{field: value}``.

    One line of ``Key=Value`` pairs separated by spaces; a value may itself contain spaces
    only in fields we do not read, so a token without ``=`` is glued to the previous value.
    """
    fields: dict[str, str] = {}
    last = None
    for token in line.strip().split(" "):
        key, sep, value = token.partition("=")
        if sep and key and key.replace("/", "").replace(":", "").isalnum():
            fields[key] = value
            last = key
        elif last is not None:
            fields[last] += " " + token
    return fields


class LocalSlurm:
    """munged + slurmctld + slurmd under ``root`` (a fresh temporary directory by default).

    ``start()`` raises :class:`SlurmUnavailable` with the reason when the daemons cannot come
    up; ``stop()`` sends SIGTERM (then SIGKILL) to the PIDs it started, nothing else.
    """

    def __init__(self, root: str | os.PathLike | None = None, *, cpus: int = 4, nodes: int = 1,
                 start_timeout_s: float = 30.0) -> None:
        if nodes < 1 or cpus < 1:
            raise ValueError(f"need nodes >= 1 and cpus >= 1, got nodes={nodes}, cpus={cpus}")
        self._owns_root = root is None
        if root is None:
            root = tempfile.mkdtemp(prefix="kd-slurm-")
        self.root = Path(root).resolve()
        self.cpus = cpus
        self.start_timeout_s = start_timeout_s
        self.procs: dict[str, subprocess.Popen] = {}
        host = socket.gethostname().split(".")[0]
        self.host = host
        self.nodes = [host] + [f"{host}-n{i}" for i in range(2, nodes + 1)]
        self.conf = self.root / "etc" / "slurm.conf"
        self.munge_socket = self.root / "munge" / "munge.socket"

    # -- environment --------------------------------------------------------------------------
    def env(self, extra: dict[str, str | None] | None = None) -> dict[str, str]:
        """This process's environment with ``SLURM_CONF`` pointing at our cluster (every client
        command needs it), no inherited ``SLURM_*`` job variables, and ``extra`` on top (a
        None value removes that variable)."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
        env["SLURM_CONF"] = str(self.conf)
        env["PATH"] = env.get("PATH", "") + os.pathsep + "/usr/sbin"
        for key, value in (extra or {}).items():
            if value is None:
                env.pop(key, None)
            else:
                env[key] = value
        return env

    def run(self, *argv: str, timeout_s: float = 30.0, check: bool = True,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        """Run a client command (``sinfo``, ``scontrol``...) against this cluster."""
        proc = subprocess.run(list(argv), env=env or self.env(), capture_output=True, text=True,
                              timeout=timeout_s, check=False)
        if check and proc.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} exited {proc.returncode}: "
                               f"{proc.stderr.strip() or proc.stdout.strip()}")
        return proc

    # -- start / stop ---------------------------------------------------------------------------
    def start(self, attempts: int = 3) -> None:
        missing = missing_programs()
        if missing:
            raise SlurmUnavailable(f"not installed: {', '.join(missing)} (install with "
                                   f".ci/slurm_setup.sh)")
        if os.geteuid() != 0:
            raise SlurmUnavailable("the local Slurm runs its daemons as root (SlurmUser=root); "
                                   "this process is not root")
        try:
            socket.gethostbyname(self.host)
        except OSError as e:
            raise SlurmUnavailable(f"this host's name {self.host!r} does not resolve ({e}): the "
                                   f"scripts use the first node's name as rendezvous host")
        self._prepare_dirs()
        self._start_munge()
        errors = []
        # Ports are drawn at random (no bind-then-close probe); a clash shows up as a daemon
        # that dies at start, and we retry with fresh ports. They stay below 15000: kd_env.sh
        # derives the jobs' rendezvous ports from the job id in 15000-30000, and a daemon there
        # made a job's rank 0 fail with EADDRINUSE (seen in CI: slurmd on the port of job 145138).
        for _ in range(attempts):
            ctld_port = random.randint(10000, 14900)
            self._write_config(ctld_port=ctld_port, slurmd_port=ctld_port + 1)
            try:
                self._start_slurm()
                return
            except SlurmUnavailable as e:
                errors.append(str(e))
                self._stop_procs([f"slurmd:{n}" for n in self.nodes] + ["slurmctld"])
        self.stop()
        raise SlurmUnavailable("; ".join(errors))

    def stop(self) -> None:
        self._stop_procs([f"slurmd:{n}" for n in self.nodes] + ["slurmctld", "munged"])

    def cleanup(self) -> None:
        """``stop()``, then remove the directory if this object made it."""
        self.stop()
        if self._owns_root:
            shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _stop_procs(self, names) -> None:
        for name in names:
            proc = self.procs.pop(name, None)
            if proc is None or proc.poll() is not None:
                continue
            # Each daemon leads its own session (start_new_session): signal only that PID; the
            # daemon ends its own children (slurmd its slurmstepds).
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)

    def _prepare_dirs(self) -> None:
        for sub in ("etc", "munge", "ctld", "spool", "log", "run"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        # munged insists that every directory on its socket's path grants execute to all.
        for d in (self.root, self.root / "munge"):
            d.chmod(0o755)

    def _spawn(self, name: str, argv: list[str], log_name: str) -> subprocess.Popen:
        # The child keeps its own copy of the log's descriptor.
        with open(self.root / "log" / log_name, "ab") as log:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log,
                                    stderr=subprocess.STDOUT, env=self.env(),
                                    start_new_session=True)
        self.procs[name] = proc
        return proc

    def log_tail(self, name: str, lines: int = 20) -> str:
        path = self.root / "log" / name
        if not path.exists():
            return f"(no {name})"
        text = path.read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    def _start_munge(self) -> None:
        key = self.root / "munge" / "munge.key"
        if not key.exists():
            proc = subprocess.run([_which("mungekey"), "--create", f"--keyfile={key}"],
                                  capture_output=True, text=True, timeout=30, check=False)
            if proc.returncode != 0:
                raise SlurmUnavailable(f"mungekey failed: {proc.stderr.strip()}")
        key.chmod(0o600)
        proc = self._spawn("munged", [
            _which("munged"), "--foreground", "--force", f"--socket={self.munge_socket}",
            f"--key-file={key}", f"--pid-file={self.root / 'run' / 'munged.pid'}",
            f"--log-file={self.root / 'log' / 'munged.log'}",
            f"--seed-file={self.root / 'munge' / 'munged.seed'}"], "munged.out")
        self._wait_for(lambda: self.munge_socket.exists(), proc, "munged",
                       ("munged.out", "munged.log"))

    def _start_slurm(self) -> None:
        procs = {"slurmctld": self._spawn("slurmctld", [_which("slurmctld"), "-D", "-f",
                                                        str(self.conf)], "slurmctld.out")}
        for node in self.nodes:
            procs[f"slurmd:{node}"] = self._spawn(
                f"slurmd:{node}", [_which("slurmd"), "-D", "-f", str(self.conf), "-N", node],
                f"slurmd-{node}.out")

        def nodes_idle() -> bool:
            for name, proc in procs.items():
                if proc.poll() is not None:
                    log = name.replace(":", "-")
                    raise SlurmUnavailable(
                        f"{name} exited {proc.returncode} at start:\n"
                        f"{self.log_tail(log + '.log')}\n{self.log_tail(log + '.out')}")
            out = self.run("sinfo", "-h", "-N", "-o", "%T", check=False, timeout_s=10)
            states = [s.rstrip("*") for s in out.stdout.split()]
            return out.returncode == 0 and states == ["idle"] * len(self.nodes)

        self._wait_for(nodes_idle, None, "slurm nodes idle",
                       ["slurmctld.log"] + [f"slurmd-{n}.log" for n in self.nodes])

    def _wait_for(self, ready, proc, what: str, logs) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                break
            if ready():
                return
            time.sleep(0.2)
        tails = "\n".join(f"--- {name}\n{self.log_tail(name)}" for name in logs)
        state = "exited" if proc is not None and proc.poll() is not None else "timed out"
        raise SlurmUnavailable(f"{what}: {state}\n{tails}")

    def _write_config(self, *, ctld_port: int, slurmd_port: int) -> None:
        r = self.root
        lines = [
            "ClusterName=kdlocal",
            f"SlurmctldHost={self.host}(127.0.0.1)",
            f"SlurmctldPort={ctld_port}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.munge_socket}",
            f"StateSaveLocation={r / 'ctld'}",
            f"SlurmdSpoolDir={r / 'spool' / 'slurmd-%n'}",
            f"SlurmctldPidFile={r / 'run' / 'slurmctld.pid'}",
            f"SlurmdPidFile={r / 'run' / 'slurmd-%n.pid'}",
            f"SlurmctldLogFile={r / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={r / 'log' / 'slurmd-%n.log'}",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "SchedulerParameters=batch_sched_delay=0",
            "EnforcePartLimits=ALL",
            "MailProg=/bin/true",
            "ReturnToService=2",
            "MpiDefault=none",
            "SlurmdParameters=config_overrides",
            # Finished jobs stay visible to `scontrol show job` (no accounting database here).
            "MinJobAge=3600",
            # A random first id: scripts derive their rendezvous port from the job id.
            f"FirstJobId={random.randint(1000, 900000)}",
        ]
        for i, node in enumerate(self.nodes):
            lines.append(f"NodeName={node} NodeHostname={self.host} NodeAddr=127.0.0.1 "
                         f"Port={slurmd_port + i} CPUs={self.cpus} RealMemory=1000 State=UNKNOWN")
        lines.append(f"PartitionName=debug Nodes={','.join(self.nodes)} Default=YES MaxTime=60 "
                     "State=UP")
        self.conf.write_text("\n".join(lines) + "\n")

    # -- jobs -----------------------------------------------------------------------------------
    def sbatch(self, script: str | os.PathLike, *options: str, cwd: str | os.PathLike,
               env: dict[str, str | None] | None = None) -> str:
        """Submit ``script`` (``sbatch --parsable OPTIONS script``) with this process's
        environment changed by ``env`` (see :meth:`env`); returns the job id."""
        proc = subprocess.run([_which("sbatch"), "--parsable", *options, str(script)],
                              env=self.env(env), cwd=str(cwd), capture_output=True, text=True,
                              timeout=30, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"sbatch {script} exited {proc.returncode}: {proc.stderr.strip()}")
        return proc.stdout.strip().split(";")[0]

    def show_job(self, job_id: str) -> dict[str, str]:
        out = self.run("scontrol", "show", "job", "-o", job_id)
        return parse_show_job(out.stdout)

    def wait(self, job_id: str, timeout_s: float) -> dict[str, str]:
        """Poll until the job is in a final state; ``scancel`` it and raise TimeoutError after
        ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            info = self.show_job(job_id)
            if info.get("JobState") in FINAL_STATES:
                return info
            if time.monotonic() > deadline:
                self.run("scancel", job_id, check=False)
                raise TimeoutError(f"job {job_id} still {info.get('JobState')} after "
                                   f"{timeout_s:.0f} s")
            time.sleep(0.5)


if __name__ == "__main__":
    cluster = LocalSlurm(nodes=int(sys.argv[1]) if len(sys.argv) > 1 else 1)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        cluster.start()
    except SlurmUnavailable as e:
        print(f"cannot start Slurm: {e}", file=sys.stderr)
        sys.exit(1)
    print(f"export SLURM_CONF={cluster.conf}")
    print(f"# daemons: {', '.join(f'{n}={p.pid}' for n, p in cluster.procs.items())}; "
          f"Ctrl-C stops them")
    try:
        signal.pause()
    except (KeyboardInterrupt, SystemExit):
        pass
    finally:
        cluster.cleanup()
