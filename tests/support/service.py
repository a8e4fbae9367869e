"""Teacher replicas for tests: ``megatron-kd teacher serve`` in processes of their own (torchrun
for a replica of several ranks), registered at a directory endpoint, stopped with SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

#: Starting Python, torch and Megatron-Core in each rank on a busy 2-core machine.
START_TIMEOUT_S = 180


class Replica:
    """One running replica (a process, or a torchrun of several)."""

    def __init__(self, endpoint: Path, teacher: str, *, tp: int = 1, pp: int = 1,
                 log: Path, extra: tuple[str, ...] = (), sleep_per_token: float = 0.0,
                 wait: bool = True) -> None:
        """Start the replica; with ``wait`` (else call :meth:`wait_ready`) wait until it has
        registered at ``endpoint``."""
        self.endpoint, self.log = endpoint, log
        world = tp * pp
        module = (["megatron_kd.testing.slow_replica", str(sleep_per_token), "--"]
                  if sleep_per_token else ["megatron_kd"])
        launch = ([sys.executable, "-m", *module] if world == 1 else
                  [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   f"--nproc-per-node={world}", "-m", *module])
        argv = [*launch, *([] if sleep_per_token else ["teacher", "serve"]),
                "--kd-teacher-load", teacher,
                "--kd-teacher-endpoint", str(endpoint), "--host", "127.0.0.1",
                "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size",
                str(pp), "--log-json", str(log), "--stats-interval", "1", *extra]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(key, None)
        self.proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL,
                                     stderr=open(str(log) + ".stderr", "w"),
                                     start_new_session=True)
        if wait:
            self.wait_ready()

    def wait_ready(self) -> None:
        """Wait until the replica has published its record (its log's ``ready`` event names
        it, so replicas started together at one endpoint are told apart)."""
        deadline = time.monotonic() + START_TIMEOUT_S
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
        self.stop()
        raise RuntimeError(f"teacher replica did not register at {self.endpoint}:\n"
                           + Path(str(self.log) + ".stderr").read_text()[-3000:])

    @property
    def pids(self) -> list[int]:
        """The replica's processes (torchrun's workers too)."""
        out = subprocess.run(["pgrep", "-s", str(self.proc.pid)], capture_output=True,
                             text=True).stdout.split()
        return [int(p) for p in out] or [self.proc.pid]

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to every process of the replica."""
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def events(self, event: str | None = None) -> list[dict]:
        if not self.log.exists():
            return []
        text = self.log.read_text()
        complete = text[:text.rfind("\n") + 1]  # not a line still being written
        lines = [json.loads(line) for line in complete.splitlines() if line.strip()]
        return [e for e in lines if event is None or e.get("event") == event]

    def requests_served(self) -> int:
        stats = self.events("stats") + self.events("stopped")
        return max((e["requests"] for e in stats), default=0)

    def stop(self, timeout_s: float = 60.0) -> None:
        if self.proc.poll() is None:
            self.kill(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.kill(signal.SIGKILL)
                self.proc.wait(timeout=30)
        self.kill(signal.SIGKILL)  # any worker left behind
