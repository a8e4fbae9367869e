"""What a run does when something goes wrong outside the maths: a preemption signal, a teacher
that hands over non-finite values.

* :class:`ExitSignal` -- ``--exit-signal-handler`` (Megatron-LM's flag): Slurm's ``scancel`` and
  time limits send SIGTERM (then SIGKILL after ``KillWait``); the trainer finishes the step it
  is in, saves a checkpoint and exits 0, and ``--load`` continues with the same losses.
* :class:`EarlyExit` -- the two together with ``--exit-duration-in-mins`` (Megatron-LM's flag:
  this process's minutes, from its start): after each step every rank learns whether any rank
  got the signal or passed the duration, in one all-reduce, and stops at the same step.
* :class:`FiniteGuard` -- every teacher output or target of a step (hidden states from the
  colocated teacher or the wire, top-K log-probs from a cache) is checked for NaN and inf on
  its device, with one host synchronisation per step, before the optimizer step: a non-finite
  one raises ``FloatingPointError`` naming the step, the microbatch and the source, and no
  checkpoint holding it is written.
"""

from __future__ import annotations

import signal
import time

import torch
import torch.distributed as dist

__all__ = ["EarlyExit", "ExitSignal", "FiniteGuard"]


class ExitSignal:
    """Records a SIGTERM on this rank (:class:`EarlyExit` tells every rank whether any rank got
    one)."""

    def __init__(self, signum: int = signal.SIGTERM) -> None:
        self.signum = signum
        self.got = False
        self._previous = signal.signal(signum, self._handle)

    def _handle(self, signum, frame) -> None:  # noqa: ARG002 - the signal module's signature
        self.got = True

    def close(self) -> None:
        signal.signal(self.signum, self._previous)


class EarlyExit:
    """Whether a run stops before its last iteration, decided after each step on every rank
    alike: ``signal`` (``--exit-signal-handler`` and a SIGTERM on any rank) or ``duration``
    (``--exit-duration-in-mins`` passed on any rank's clock, counted from ``started``, a
    ``time.monotonic()`` value: the process's start)."""

    def __init__(self, *, signal_handler: bool, duration_mins: float | None,
                 started: float) -> None:
        self.signal = ExitSignal() if signal_handler else None
        self.deadline = None if duration_mins is None else started + 60.0 * duration_mins
        self.duration_mins = duration_mins

    @property
    def active(self) -> bool:
        return self.signal is not None or self.deadline is not None

    def reason(self, device) -> str | None:
        """``"signal"``, ``"duration"`` or None (collective over the default group when
        :attr:`active`: Slurm signals the ranks at slightly different moments, and they must
        stop at one step; the signal wins when both hold)."""
        if not self.active:
            return None
        flags = torch.tensor([1.0 if self.signal is not None and self.signal.got else 0.0,
                              1.0 if self.deadline is not None
                              and time.monotonic() > self.deadline else 0.0], device=device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        got_signal, past = flags.tolist()
        return "signal" if got_signal else "duration" if past else None

    def close(self) -> None:
        if self.signal is not None:
            self.signal.close()


class FiniteGuard:
    """Teacher values of one step, checked for NaN / inf at the end of the step."""

    def __init__(self) -> None:
        self._watched: list[tuple[int, str, torch.Tensor]] = []

    def watch(self, microbatch: int, source: str, tensor: torch.Tensor | None) -> None:
        """Check ``tensor`` (no synchronisation now: a device flag is kept)."""
        if tensor is not None:
            self._watched.append((microbatch, source, torch.isfinite(tensor).all()))

    def check(self, step: int) -> None:
        """Raise ``FloatingPointError`` for the first non-finite value of this step (one host
        synchronisation); forget the step's values either way."""
        watched, self._watched = self._watched, []
        if not watched:
            return
        ok = torch.stack([flag for _, _, flag in watched]).cpu()
        for (microbatch, source, _), good in zip(watched, ok.tolist()):
            if not good:
                raise FloatingPointError(
                    f"non-finite teacher values (NaN or inf) at step {step}, microbatch "
                    f"{microbatch}: {source}; no optimizer step was taken and no checkpoint "
                    f"holds them")

    def diagnose(self, step: int, error: FloatingPointError) -> FloatingPointError:
        """The loss found a non-finite value: name the teacher source if that is where it came
        from, else the error as it is."""
        try:
            self.check(step)
        except FloatingPointError as named:
            return named
        return error
