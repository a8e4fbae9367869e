"""What a run shows and writes: the progress line on stderr, the JSON log, peak memory."""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megatron_kd.integration.groups import collective_device

__all__ = ["JsonLog", "Progress", "RunRecord", "peak_memory", "reduce_reports"]


def peak_memory() -> tuple[int, str]:
    """``(bytes, kind)``: peak CUDA allocation on a GPU, else the process's peak RSS
    (``resource.getrusage(RUSAGE_SELF).ru_maxrss`` x 1024 on Linux)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return int(torch.cuda.max_memory_allocated()), "cuda_max_allocated"
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024, "cpu_max_rss"


def _fmt_time(seconds: float) -> str:
    seconds = int(max(0, seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m:02d}:{s:02d}"


class Progress:
    """A one-line progress bar on stderr (rank 0): step, loss, tokens/s, ETA."""

    def __init__(self, total: int, enabled: bool, stream=None) -> None:
        self.total, self.enabled = total, enabled
        self.stream = stream or sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()

    def update(self, step: int, loss: float, tokens_per_s: float, eta_s: float,
               extra: str = "") -> None:
        if not self.enabled:
            return
        width = 24
        filled = int(width * step / max(1, self.total))
        bar = "#" * filled + "-" * (width - filled)
        line = (f"[{bar}] {step}/{self.total} loss {loss:.4f} {tokens_per_s:,.0f} tok/s "
                f"ETA {_fmt_time(eta_s)}{extra}")
        if self.tty:
            self.stream.write("\r" + line)
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def message(self, text: str) -> None:
        if self.enabled:
            self.stream.write(("\n" if self.tty else "") + text + "\n")
            self.stream.flush()

    def close(self) -> None:
        if self.enabled and self.tty:
            self.stream.write("\n")
            self.stream.flush()


class JsonLog:
    """Appends one JSON object per line to ``path`` (rank 0 only; appending, so a resumed run
    continues the same file)."""

    def __init__(self, path: str | None, enabled: bool) -> None:
        self.path = path if (path and enabled) else None
        if self.path:
            os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)

    def write(self, record: dict) -> None:
        if self.path:
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(json.dumps(record) + "\n")

    def close(self) -> None:
        pass


@dataclass
class RunRecord:
    """What :meth:`Trainer.fit` gathers for its summary."""

    start_iteration: int
    steps: list = field(default_factory=list)
    evals: list = field(default_factory=list)
    step_times: list = field(default_factory=list)
    t_start: float = field(default_factory=time.perf_counter)
    exit_signal: bool = False


def reduce_reports(reports: list, keys: tuple, contributes: bool) -> dict:
    """Sum the loss reports' ``[sum, tokens]`` pairs over microbatches and data-parallel ranks,
    onto every rank (one all-reduce over the world; only ranks that ``contribute``, the
    last-stage TP-rank-0 ones, add theirs). A key no rank reported is None."""
    device = collective_device()  # NCCL reduces device tensors only; gloo host tensors
    vec = torch.zeros(2 * len(keys), dtype=torch.float64, device=device)
    present = torch.zeros(len(keys), dtype=torch.float64, device=device)
    if contributes:
        for rep in reports:
            for i, key in enumerate(keys):
                if key in rep:
                    vec[2 * i: 2 * i + 2] += rep[key].double().to(device)
                    present[i] = 1
    both = torch.cat([vec, present])
    dist.all_reduce(both)
    both = both.cpu()
    return {key: both[2 * i: 2 * i + 2] if both[2 * len(keys) + i] > 0 else None
            for i, key in enumerate(keys)}
