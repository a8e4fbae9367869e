"""``megatron-kd report RUN.jsonl [RUN2.jsonl ...] --out DIR``: plots and a summary of runs.

Reads the JSON logs ``megatron-kd train --log-json`` writes (one object per step, evaluations
with ``"eval": true``, failover events) and writes, several runs overlaid (a KD run against its
CE-only twin, colocated against disaggregated):

* ``loss.png``: LM and KD loss against steps and against tokens, evaluation points marked
  (and the teacher's validation LM loss where a run measured it);
* ``throughput.png``: tokens/s per step;
* ``teacher.png``: seconds per step the student waited for its teacher (wire or cache) and
  the prefetch ring's fill when a response was asked for (disaggregated runs);
* ``memory.png``: peak memory per step;
* ``summary.md``: one row per run (steps, tokens, final losses, last evaluation, median tokens/s
  and wait, failovers).

Needs matplotlib (``pip install matplotlib``, in the ``demo`` and ``metrics`` extras); no torch.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

__all__ = ["RunLog", "add_arguments", "read_run", "run", "summary_table", "write_report"]


class RunLog:
    """One run's JSON log, split into steps, evaluations and events."""

    def __init__(self, path: str, label: str | None = None) -> None:
        self.path = path
        self.label = label or os.path.splitext(os.path.basename(path))[0]
        self.steps: list[dict] = []
        self.evals: list[dict] = []
        self.events: list[dict] = []
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{n}: not a JSON line ({e})") from e
                if record.get("eval"):
                    self.evals.append(record)
                elif record.get("event"):
                    self.events.append(record)
                elif "step_time_s" in record:
                    self.steps.append(record)
        if not self.steps:
            raise ValueError(f"{path}: no step records (is it a `megatron-kd train --log-json` "
                             f"file?)")

    def series(self, key: str, records: list[dict] | None = None) -> tuple[list, list]:
        rows = [r for r in (self.steps if records is None else records) if r.get(key) is not None]
        return [r["step"] for r in rows], [r[key] for r in rows]

    def tokens_at(self, step: int) -> float:
        """Tokens trained on up to ``step`` (from the steps' tokens/s and times)."""
        return sum(r["tokens_per_s"] * r["step_time_s"] for r in self.steps if r["step"] <= step)


def read_run(spec: str) -> RunLog:
    """``PATH`` or ``LABEL=PATH``."""
    label, sep, path = spec.partition("=")
    return RunLog(path, label) if sep and not os.path.exists(spec) else RunLog(spec)


def summary_table(runs: list[RunLog]) -> str:
    lines = ["| run | steps | tokens | final LM loss | final KD loss | last eval LM loss | "
             "teacher eval LM loss | median tokens/s | median teacher wait s/step | "
             "failovers |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in runs:
        last = r.steps[-1]
        ev = r.evals[-1] if r.evals else {}
        waits = [s.get("kd_teacher_wait_s", s.get("kd_cache_wait_s")) for s in r.steps]
        waits = [w for w in waits if w is not None]

        def fmt(v, spec=".4f"):
            return "" if v is None else format(v, spec)

        lines.append(
            f"| {r.label} | {last['step']} | {r.tokens_at(last['step']):,.0f} | "
            f"{fmt(last.get('lm_loss'))} | {fmt(last.get('kd_loss'))} | "
            f"{fmt(ev.get('eval_lm_loss'))} | {fmt(ev.get('eval_teacher_lm_loss'))} | "
            f"{statistics.median(s['tokens_per_s'] for s in r.steps):,.0f} | "
            f"{fmt(statistics.median(waits) if waits else None)} | "
            f"{sum(1 for e in r.events if e.get('event') == 'failover')} |")
    return "\n".join(lines)


def _pyplot():
    try:
        import matplotlib  # optional: only the plots need it
    except ImportError as e:
        raise ImportError("megatron-kd report needs matplotlib (pip install matplotlib)") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # only after the backend is chosen

    return plt


def _smooth(values: list[float], half: int = 5) -> list[float]:
    """A centred moving average (no lag), the window shrinking at both ends."""
    return [sum(values[max(0, i - half): i + half + 1]) / len(values[max(0, i - half): i + half + 1])
            for i in range(len(values))]


def _loss_figure(plt, runs: list[RunLog], title: str | None):
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8), dpi=110)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, r in enumerate(runs):
        c = colors[i % len(colors)]
        for ax, x_of in ((axes[0], lambda s: s), (axes[1], r.tokens_at)):
            steps, lm = r.series("lm_loss")
            x = [x_of(s) for s in steps]
            ax.plot(x, lm, color=c, alpha=0.2, lw=0.8)
            ax.plot(x, _smooth(lm), color=c, lw=1.5, label=f"{r.label}: train LM loss")
            steps, kd = r.series("kd_loss")
            if kd and any(v for v in kd):
                ax.plot([x_of(s) for s in steps], _smooth(kd), color=c, lw=1.2, ls="-.",
                        label=f"{r.label}: train KD loss")
            steps, ev = r.series("eval_lm_loss", r.evals)
            if ev:
                ax.plot([x_of(s) for s in steps], ev, "o--", color=c, ms=5,
                        label=f"{r.label}: validation LM loss")
    teacher = next((r.series("eval_teacher_lm_loss", r.evals)[1] for r in runs
                    if r.series("eval_teacher_lm_loss", r.evals)[1]), None)
    if teacher:
        for ax in axes:
            ax.axhline(teacher[-1], color="gray", ls=":", label="teacher: validation LM loss")
    axes[0].set(xlabel="step", ylabel="loss (nats/token)")
    axes[1].set(xlabel="tokens", ylabel="loss (nats/token)")
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(title or "loss")
    fig.tight_layout()
    return fig


def _per_step_figure(plt, runs: list[RunLog], panels: list[tuple[str, str, str]], title: str):
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.4), dpi=110,
                             squeeze=False)
    for ax, (key, ylabel, ptitle) in zip(axes[0], panels):
        drawn = False
        for r in runs:
            steps, values = r.series(key)
            if values:
                ax.plot(steps, values, marker="o", ms=2.5, lw=1, label=r.label)
                drawn = True
        ax.set(xlabel="step", ylabel=ylabel, title=ptitle)
        ax.grid(alpha=0.3)
        if drawn:
            ax.legend(fontsize=8)
        else:
            ax.text(0.5, 0.5, "not logged by these runs", ha="center", va="center",
                    transform=ax.transAxes, color="gray")
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def write_report(runs: list[RunLog], out: str, title: str | None = None) -> dict[str, str]:
    """Write the plots and ``summary.md`` into ``out``; returns what was written."""
    plt = _pyplot()
    os.makedirs(out, exist_ok=True)
    written = {}
    figures = {
        "loss.png": _loss_figure(plt, runs, title),
        "throughput.png": _per_step_figure(
            plt, runs, [("tokens_per_s", "tokens/s", "throughput")], "throughput"),
        "teacher.png": _per_step_figure(
            plt, runs, [("kd_teacher_wait_s", "s per step", "student waiting for the teacher"),
                        ("kd_ring_occupancy", "fraction of prefetched arrived", "prefetch ring fill"),
                        ("kd_cache_wait_s", "s per step", "waiting for the top-K cache")],
            "teacher"),
        "memory.png": _per_step_figure(
            plt, runs, [("peak_mem_bytes", "bytes", "peak memory")], "memory"),
    }
    for name, fig in figures.items():
        path = os.path.join(out, name)
        fig.savefig(path)
        plt.close(fig)
        written[name] = path
    path = os.path.join(out, "summary.md")
    with open(path, "w", encoding="utf-8") as f:
        f.write(f"# {title or 'runs'}\n\n{summary_table(runs)}\n")
    written["summary.md"] = path
    return written


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("runs", nargs="+", metavar="[LABEL=]RUN.jsonl",
                        help="`megatron-kd train --log-json` files (label: the file's name)")
    parser.add_argument("--out", required=True, help="directory for the plots and summary.md")
    parser.add_argument("--title", default=None)


def run(args: argparse.Namespace) -> int:
    runs = [read_run(spec) for spec in args.runs]
    for name, path in write_report(runs, args.out, args.title).items():
        print(f"wrote {path}")
    print(summary_table(runs))
    return 0
