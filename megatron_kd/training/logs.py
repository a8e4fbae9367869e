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

__all__ = ["JsonLog", "Progress", "RunRecord", "peak_memory", "peak_reserved_memory",
           "reduce_reports", "static_memory"]


def peak_memory() -> tuple[int, str]:
    """``(bytes, kind)``: peak CUDA allocation on a GPU, else the process's peak RSS
    (``resource.getrusage(RUSAGE_SELF).ru_maxrss`` x 1024 on Linux)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return int(torch.cuda.max_memory_allocated()), "cuda_max_allocated"
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024, "cpu_max_rss"


def peak_reserved_memory() -> int | None:
    """Peak bytes the CUDA caching allocator reserved (None off a GPU)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return int(torch.cuda.max_memory_reserved())
    return None


def _tensor_bytes(tensors, seen: set[int]) -> int:
    """Bytes of ``tensors``' storages, each storage counted once (``seen``: data pointers)."""
    total = 0
    for t in tensors:
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            continue
        storage = t.untyped_storage()
        if storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        total += storage.nbytes()
    return total


def _torch_optimizers(optimizer) -> list:
    """The ``torch.optim`` optimizers inside a Megatron optimizer (chained or not)."""
    chained = getattr(optimizer, "chained_optimizers", None)
    if chained is not None:
        return [o for c in chained for o in _torch_optimizers(c)]
    inner = getattr(optimizer, "optimizer", None)
    return [inner] if inner is not None else []


def static_memory(chunks, optimizer, teacher) -> dict[str, int]:
    """What a rank holds before its first step, in the planner's terms (bytes): the student's
    weights (its parameters' storages), gradients (DDP's ``main_grad`` buffers), the optimizer
    (its state and the fp32 master copies a mixed-precision optimizer keeps beside the
    parameters) and the teacher's weights and buffers (``teacher``: its model, or None). Each
    storage is counted once, so a parameter that is a view of a contiguous buffer counts the
    buffer."""
    seen: set[int] = set()
    params = [p for c in chunks for p in c.parameters()]
    out = {"student_weights": _tensor_bytes(params, seen),
           "student_grads": _tensor_bytes([getattr(p, "main_grad", None) for p in params], seen)}
    state = []
    for opt in _torch_optimizers(optimizer):
        for group in opt.param_groups:
            state.extend(group["params"])  # master copies (the model's own are already seen)
        for per_param in opt.state.values():
            state.extend(v for v in per_param.values() if isinstance(v, torch.Tensor))
    out["optimizer"] = _tensor_bytes(state, seen)
    if teacher is not None:
        out["teacher_weights"] = _tensor_bytes([*teacher.parameters(), *teacher.buffers()], seen)
    return out


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
    exit_reason: str | None = None
    """``"signal"`` or ``"duration"`` when the run stopped before its stop iteration."""

    @property
    def exit_signal(self) -> bool:
        """Whether a SIGTERM stopped the run (``--exit-signal-handler``)."""
        return self.exit_reason == "signal"


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
