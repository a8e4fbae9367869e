"""A training run in the background of a test (so the test can kill and start teacher replicas
meanwhile), and what its JSON log says so far."""

import json
import threading
import time


class Background:
    """``pool.run`` on a thread, so the test can kill and start replicas meanwhile."""

    def __init__(self, pool, *args):
        self.result, self.error = None, None
        self.thread = threading.Thread(target=self._run, args=(pool, args), daemon=True)
        self.thread.start()

    def _run(self, pool, args):
        try:
            self.result = pool.run(*args)
        except BaseException as e:  # noqa: BLE001 - re-raised by join
            self.error = e

    def join(self, timeout=600):
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the run did not finish"
        if self.error is not None:
            raise self.error
        return self.result


def log_records(path):
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def wait_for(predicate, timeout_s=300):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    raise AssertionError("timed out waiting")


def steps_done(path):
    return len([r for r in log_records(path) if "loss" in r])
