"""``megatron-kd report`` on synthetic JSON logs: parsing, errors, the summary table, plots."""

import json

import pytest

from megatron_kd.commands.report import RunLog, read_run, summary_table, write_report


def _log(path, steps, *, wait=None, evals=(), events=()):
    with open(path, "w") as f:
        for s in range(1, steps + 1):
            rec = {"step": s, "loss": 3.0 - 0.1 * s, "kd_loss": 1.0, "lm_loss": 4.0 - 0.1 * s,
                   "lr": 1e-3, "tokens_per_s": 100.0 * s, "step_time_s": 2.0,
                   "peak_mem_bytes": 1 << 20}
            if wait is not None:
                rec.update(kd_teacher_wait_s=wait, kd_ring_occupancy=0.5)
            f.write(json.dumps(rec) + "\n")
        for e in evals:
            f.write(json.dumps({"step": e, "eval": True, "eval_lm_loss": 3.5,
                                "eval_teacher_lm_loss": 2.0}) + "\n")
        for e in events:
            f.write(json.dumps({"step": 2, "event": e}) + "\n")
    return path


def test_parse_and_table(tmp_path):
    a = RunLog(_log(tmp_path / "kd.jsonl", 4, wait=0.25, evals=(2, 4),
                    events=("failover", "rebalance")))
    b = read_run(f"CE only={_log(tmp_path / 'ce.jsonl', 3)}")
    assert a.label == "kd" and b.label == "CE only"
    assert len(a.steps) == 4 and len(a.evals) == 2 and len(a.events) == 2
    assert a.tokens_at(2) == pytest.approx(100 * 2 + 200 * 2)  # tokens/s x seconds, summed
    rows = summary_table([a, b]).splitlines()
    kd = [c.strip() for c in rows[2].split("|")]
    assert kd[1:4] == ["kd", "4", "2,000"]
    assert kd[6] == "3.5000" and kd[7] == "2.0000"  # last evaluation, the teacher's
    assert kd[9] == "0.2500" and kd[10] == "1"  # median wait, one failover (not the rebalance)
    ce = [c.strip() for c in rows[3].split("|")]
    assert ce[1] == "CE only" and ce[9] == "" and ce[10] == "0"


def test_bad_logs_are_named(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"step": 1, "step_time_s": 1, "tokens_per_s": 1}\nnot json\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not a JSON line"):
        RunLog(str(bad))
    empty = tmp_path / "empty.jsonl"
    empty.write_text('{"step": 1, "eval": true, "eval_lm_loss": 2}\n')
    with pytest.raises(ValueError, match="empty.jsonl: no step records"):
        RunLog(str(empty))


def test_plots_are_written(tmp_path):
    pytest.importorskip("matplotlib")
    runs = [RunLog(_log(tmp_path / "a.jsonl", 5, wait=0.1, evals=(5,))),
            RunLog(_log(tmp_path / "b.jsonl", 5))]
    written = write_report(runs, str(tmp_path / "out"), "t")
    assert set(written) == {"loss.png", "throughput.png", "teacher.png", "memory.png",
                            "summary.md"}
    for name, path in written.items():
        assert (tmp_path / "out" / name).stat().st_size > (1000 if name.endswith("png") else 50)
