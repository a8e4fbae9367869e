"""Reading back what a run wrote: its JSON log, TensorBoard event files (TensorBoard's own
reader) and an offline W&B run (W&B's own reader of the ``.wandb`` transaction log)."""

import json
import shutil
import subprocess

import pytest


def records(path):
    """The JSON lines of a ``--log-json`` file."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def tensorboard_scalars(directory):
    """``{tag: {step: value}}`` of the event files under ``directory``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(directory), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def wandb_history(run_dir):
    """``{step: {name: value}}`` of an offline W&B run directory (``wandb leet inspect
    --json``)."""
    exe = shutil.which("wandb")
    if exe is None:
        pytest.skip("the wandb command is not on PATH")
    proc = subprocess.run([exe, "leet", "inspect", "--json", str(run_dir)], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = {}
    for line in proc.stdout.splitlines():
        record = json.loads(line)
        if record.get("type") == "history":
            history = record["history"]
            rows.setdefault(int(history["step"]["num"]), {}).update(history["item"])
    return rows
