"""Every benchmark under ``tools/`` runs end to end at a tiny size through its own command line,
writes the JSON fields ``docs/benchmarks.md`` reads and leaves no temporary files, so a renamed
function or a removed method fails here rather than in a user's hands. Figures are not checked
(tiny models on a shared CPU): only that each tool finishes and reports what its table needs.

``tools/gpu_check.py --device cpu`` runs every one of its steps (tiny sizes on the CPU); its
parity errors are the exception: judged here, against this test's own tolerances, not by the
tool's verdict.
"""

import argparse
import getpass
import importlib.util
import json
import math
import os
import subprocess
import sys
import tempfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


GPU_CHECK_STEPS = ("make_teacher", "parity", "bench_loss", "profile_loss", "train_step_bf16_te",
                   "train_step_tp2_sp", "train_step_cp2_te", "train_step_1b", "cache_build")


#: What may stay in a tool's temporary directory: torch's, not the tool's: torchrun's per-run
#: folders (its launcher leaves them) and Inductor's precompiled headers (kept under the default
#: temporary directory whatever ``TORCHINDUCTOR_CACHE_DIR`` says).
_TEMP_KEPT = ("torchelastic_", "torchinductor_")


def _tool(tmp_path, name, *args, timeout=240):
    """``python tools/<name> ARGS`` in ``tmp_path`` (its default outputs land there), with a
    temporary directory of its own that it must leave empty (but for :data:`_TEMP_KEPT`)."""
    temp = tmp_path / "tmpdir"
    temp.mkdir()
    # Inductor's kernel cache where it would be without TMPDIR: compiled once per machine
    inductor = os.environ.get("TORCHINDUCTOR_CACHE_DIR") or os.path.join(
        tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}")
    pythonpath = os.pathsep.join(
        [ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
    env = dict(os.environ, TMPDIR=str(temp), TORCHINDUCTOR_CACHE_DIR=inductor,
               PYTHONPATH=pythonpath)
    r = subprocess.run([sys.executable, os.path.join(ROOT, "tools", name), *args],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout,
                       check=False)
    assert r.returncode == 0, f"{name} exited {r.returncode}\n{r.stdout[-3000:]}\n" \
                              f"{r.stderr[-5000:]}"
    left = sorted(f for f in os.listdir(temp) if not f.startswith(_TEMP_KEPT))
    assert not left, f"{name} left temporary files behind: {left}"
    return r


def _json(path):
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _number(x):
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def test_bench_disagg(tmp_path):
    """The step section: T from the colocated run's step-log timer, S the rest of its step,
    the disaggregated run's wait from its step log and its connect around the public
    ``TeacherSource.start``."""
    out = tmp_path / "disagg.json"
    _tool(tmp_path, "bench_disagg.py", "--smoke", "--sections", "step", "--out", str(out),
          "--plot", "")
    report = _json(out)
    step = report["results"]["step"]
    summary = step["summary"]
    for key in ("teacher_forward_s", "student_step_s", "max_teacher_student_s"):
        assert _number(summary[key]) and summary[key] > 0, (key, summary)
    assert isinstance(summary["target_met"], bool)
    colocated, *disaggregated = step["points"]
    assert colocated["kind"] == "colocated" and disaggregated
    assert colocated["teacher_forward_s"] < colocated["step_time_s"]
    for p in step["points"]:
        for key in ("step_time_s", "x_max_teacher_student", "on_cpu_s", "run_queue_s",
                    "tokens_per_s"):
            assert _number(p[key]), (p["name"], key)
    for p in disaggregated:
        assert p["depth"] >= 1 and _number(p["wire_wait_s"]) and p["connect_s"] > 0
        assert _number(p["teacher_forward_per_step_s"])
        assert p["bytes_back_per_token"] > 0 and p["bytes_out_per_token"] == 4
    assert "| teacher forward alone (T) |" in step["table"]
    assert report["machine_check"]["slowdown_2_processes"] > 0


def test_bench_cache(tmp_path):
    out = tmp_path / "cache.json"
    _tool(tmp_path, "bench_cache.py", "--vocab-sizes", "1024", "--priors", "uniform", "zipf",
          "--topk", "8", "--samples", "2", "--seq-length", "32", "--samples-per-shard", "1",
          "--micro-batch-size", "1", "--hidden", "16", "--window-size", "16", "--out", str(out))
    rows = _json(out)["rows"]
    assert [r["id_prior"] for r in rows] == ["uniform", "zipf"]
    for r in rows:
        for key in ("bytes_per_token", "bytes_per_token_fp32", "mean_topk_mass",
                    "rel_dev_renorm", "rel_dev_ghost", "build_tokens_per_cpu_s",
                    "read_tokens_per_cpu_s"):
            assert _number(r[key]), key
        # the compact encoding is smaller than fp32, and close to it (tolerance of the
        # benchmark's own target: 1e-3 relative)
        assert r["bytes_per_token"] < r["bytes_per_token_fp32"]
        assert r["rel_dev_renorm"] < 1e-3 and r["rel_dev_ghost"] < 1e-3


def test_bench_long_context(tmp_path):
    out = tmp_path / "long.json"
    _tool(tmp_path, "bench_long_context.py", "--seq-lengths", "128", "--base-seq-length", "64",
          "--layers", "1", "--hidden", "32", "--vocab", "256", "--steps", "2", "--modes",
          "colocated", "--out", str(out), "--plot", "")
    report = _json(out)
    points = [p for p in report["points"] if p["seq_length"] == 128]
    assert sorted(p["cp"] for p in points) == [1, 2]
    for p in points:
        for key in ("peak_rss_bytes", "activation_peak_bytes", "step_time_s"):
            assert _number(p[key]), key
    assert {row["variant"] for row in report["loss"]} == {"fused_fkl", "dense_fkl"}
    assert report["table_markdown"].startswith("|") and report["loss_table_markdown"]


def test_bench_loss(tmp_path):
    out = tmp_path / "loss.json"
    _tool(tmp_path, "bench_loss.py", "--tokens", "64", "--tp", "1", "--variants", "floor",
          "fused_fkl", "fusedmg_fkl", "fusedmgrc_fkl", "--vocab", "512", "--h-s", "16",
          "--h-t", "32", "--repeats", "1", "--device", "cpu", "--out", str(out), "--plot", "")
    report = _json(out)
    by = {p["variant"]: p for p in report["points"]}
    assert set(by) == {"floor", "fused_fkl", "fusedmg_fkl", "fusedmgrc_fkl"}
    for p in by.values():
        assert p["status"] == "ok" and _number(p["time_s"]) and p["tokens"] == 64
    # standalone and into main_grad (as training runs it), each with its working memory
    for variant in ("fused_fkl", "fusedmg_fkl", "fusedmgrc_fkl"):
        assert _number(by[variant]["extra_peak_bytes"]), variant
        assert f"| {variant} |" in report["table_markdown"], variant
    assert "fused_fkl" in report["table_markdown"]
    # the tunings the workers ran with, beside the timings
    assert report["config"]["cpu_tuning"]["block_elements"] > 0
    assert report["config"]["gpu_tuning"]["kernels"] == "triton"
    # what a run filed under docs/gpu_runs/ records (docs/gpu_runs/README.md)
    run = report["run"]
    assert run["git_commit"] and run["device"] not in (None, "", "cpu")
    assert run["command"].startswith("python tools/bench_loss.py --tokens 64")
    assert run["versions"]["torch"] != "not installed"
    assert " MiB |" in report["table_markdown"] and " MB |" not in report["table_markdown"]


def test_bench_step(tmp_path):
    """Every row of the whole-step benchmark at the tiny size, as its docs run it: each a
    ``megatron-kd train`` that ran its steps, its peak beside the planner's prediction for its
    exact flags (the same as the prediction from the sizes alone, which the seed-size account
    uses), the measured static terms equal to the planner's, the table, JSON and plot."""
    out = tmp_path / "bench_step"
    r = _tool(tmp_path, "bench_step.py", "--device", "cpu", "--out", str(out), timeout=900)
    report = _json(out / "bench_step.json")
    rows = {row["row"]: row for row in report["rows"]}
    assert list(rows) == ["online_fused", "offline_fused", "online_dense", "offline_dense",
                          "student_ce"]
    assert report["pieces"]["make_teacher"]["rc"] == 0
    assert report["pieces"]["cache_build"]["rc"] == 0
    assert (out / "bench_step.png").stat().st_size > 0
    bs = _bench_step_module()
    size = bs.SIZES["tiny"]
    from_sizes = bs.predict_rows(argparse.Namespace(
        device="cpu", seq=size["seq"], global_batch=size["global_batch"], topk=size["topk"],
        teacher_dtype="fp32", rows=list(rows)), size["student"](), size["teacher"]())
    for name, row in rows.items():
        assert "error" not in row and "predicted_error" not in row, row
        assert len(row["losses"]) == report["iters"] and row["step_s"] > 0
        assert all(_number(x) for x in row["losses"])
        assert row["predicted_terms_bytes"] == from_sizes[name], name
        assert _number(row["measured_over_predicted"]) and row["measured_over_predicted"] > 0
        for term, pair in row["static_vs_planner"].items():
            # the optimizer's step counters (a few bytes a tensor) are not a planner term
            assert pair["measured"] == pytest.approx(pair["predicted"], rel=1e-3, abs=4096), \
                (name, term)
        assert ("teacher_weights" in row["static_bytes"]) == (row["mode"] == "colocated")
        assert row["flops"]["teacher"] > 0 if row["mode"] == "colocated" else \
            row["flops"]["teacher"] == 0
        assert f"| {name} |" in r.stdout
    assert rows["online_dense"]["loss_path"] == "dense" and "--kd-loss-path" in \
        rows["online_dense"]["train_argv"]


def _bench_step_module():
    if "bench_step" not in sys.modules:
        sys.path.insert(0, os.path.join(ROOT, "tools"))
        spec = importlib.util.spec_from_file_location(
            "bench_step", os.path.join(ROOT, "tools", "bench_step.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules["bench_step"] = module
        spec.loader.exec_module(module)
    return sys.modules["bench_step"]


def test_bench_wire_precision(tmp_path):
    out = tmp_path / "wire.json"
    _tool(tmp_path, "bench_wire_precision.py", "--smoke", "--in-process", "--out", str(out),
          "--plot", "")
    report = _json(out)
    assert set(report["runs"]) == {"fp32", "bf16", "fp8"}
    assert all(len(rows) == 2 for rows in report["runs"].values())
    summary = report["summary"]
    # the wire's bytes: bf16 half of fp32, fp8 one byte an element plus its 4-byte scale
    b = summary["bytes_per_step"]
    assert b["bf16"] * 2 == b["fp32"] and b["fp8"] < b["bf16"]
    for key in ("fp8_vs_bf16", "bf16_vs_fp32", "fp8_vs_fp32"):
        assert _number(summary[key]["first_step_kd_loss"]), key
    assert report["table_markdown"].startswith("| step |")


def test_fuzz_decoders(tmp_path):
    """Every target a few inputs, each in a process of its own (atheris where installed)."""
    pytest.importorskip("atheris")
    r = _tool(tmp_path, "fuzz_decoders.py", "--runs", "20", "--corpus", str(tmp_path / "corpus"))
    lines = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    from megatron_kd.testing.fuzz import TARGETS

    assert {x["target"] for x in lines} == set(TARGETS) >= {"manifest", "shard", "wire_header"}
    assert all(x["exit_code"] == 0 and x["crashes"] == [] and x["runs"] == 20 for x in lines)


def test_soak_service_short(tmp_path):
    """The teacher service's soak, short: two runs (one rank, TP 2) against two replicas while
    a replica's rank is SIGKILLed and restarted and garbage connections and bytes come in;
    nothing lost, no loss changed, nothing left running."""
    out = tmp_path / "soak.json"
    r = _tool(tmp_path, "soak_service.py", "--short", "--same-process", "--seed", "38", "--out",
              str(out), "--plot", "", timeout=400)
    report = _json(out)
    t = report["totals"]
    assert report["ok"] and report["problems"] == [], r.stdout[-3000:]
    assert [run["steps_done"] for run in report["runs"]] == [report["config"]["steps"]] * 2
    assert t["lost_steps"] == 0 and t["changed_steps"] == 0
    assert t["kills"] >= 1 and t["restarts_ready"] >= 1
    assert t["connection"]["refused"] >= 1 and t["connection"]["accepted"] == 0
    assert t["connection"]["no_verdict"] == 0 and t["refused_logged"] >= 1
    assert t["bytes"]["connections"] >= 1
    assert t["unexpected_deaths"] == 0 and t["unexplained_failovers"] == 0
    assert t["leftover_processes"] == []
    assert "| kill | at s |" in report["table"]


# The parity step's numbers, judged here rather than by the tool's verdict (its ``ok`` and its
# own tolerances). Each is normwise relative: max |ours - fp64 reference| / max |reference|, on
# the tool's tiny CPU size (s 8, b 2, h 16 / 24, vocabulary 1009, K 7).
#: fp32: fp32 accumulation over ~1e3 vocabulary terms and 16- / 24-long dot products; measured
#: <= 9e-7 (grad_x); 1e-5 leaves 10x, and a wrong term is O(1).
PARITY_FP32_TOL = 1e-5
#: bf16, the loss: an fp32 sum over tokens of terms whose logits come from bf16 operands (each
#: rounded by at most 2^-9 relative; the rounding errors partly cancel over the tokens);
#: measured <= 1.2e-3 (forward_kl T=2); one bf16 ulp, 2^-8 = 3.9e-3, leaves 3x.
PARITY_BF16_LOSS_TOL = 2.0 ** -8
#: bf16, the gradients: on top of the logits' rounding, the softmax difference p_s - p_t they
#: are made of cancels (its relative error grows where student and teacher agree) and they are
#: returned rounded to bf16 (2^-9 relative each); measured <= 1.5e-2 (grad_w, forward_kl T=2),
#: <= 8e-3 for grad_x. 2e-2 (5 ulps) still fails a wrong term, a missing T^2 or a gradient
#: scaled by the upstream 0.75 twice (each >= 25% relative).
PARITY_BF16_GRAD_TOL = 2e-2


def _assert_parity_numbers(cases: list[dict]) -> None:
    """Every parity case's reported errors within this test's tolerances; the loss's error
    computed here from the two losses the tool reports; main_grad cases accumulated into
    ``main_grad``."""
    assert len(cases) >= 24, len(cases)  # the kinds and tails at fp32 and bf16, main_grad, ...
    seen = set()
    for c in cases:
        assert "error" not in c, c
        assert c["num_tokens_ok"], c
        dtype = c["dtype"]
        seen.add((dtype, "main_grad" in c["case"]))
        loss_err = abs(c["loss"] - c["reference_loss"]) / abs(c["reference_loss"])
        grad_errs = {key: c[f"rel_err_{key}"] for key in ("grad_x", "grad_w")}
        assert all(math.isfinite(e) for e in (loss_err, *grad_errs.values())), c
        loss_tol = PARITY_FP32_TOL if dtype == "fp32" else PARITY_BF16_LOSS_TOL
        grad_tol = PARITY_FP32_TOL if dtype == "fp32" else PARITY_BF16_GRAD_TOL
        assert loss_err <= loss_tol, (c["case"], loss_err, loss_tol)
        assert c["rel_err_loss"] == pytest.approx(loss_err, rel=1e-3, abs=1e-9), c  # same error
        for key, err in grad_errs.items():
            assert err <= grad_tol, (c["case"], key, err, grad_tol)
        if "main_grad" in c["case"]:
            # the weight gradient went into the fp32 main_grad (Megatron's gradient-
            # accumulation fusion), and that main_grad is what grad_w measured
            assert c["grad_added_to_main_grad"] is True, c
    assert seen == {("fp32", False), ("fp32", True), ("bf16", False), ("bf16", True)}, seen


#: The profile step's one legitimate skip (``tools/gpu_check.py``'s words for it).
PROFILE_SKIP = "skipped: tools/bench_loss.py has no --profile in this checkout"


def _bench_loss_help() -> subprocess.CompletedProcess:
    """``tools/bench_loss.py --help`` run here, apart from the tool."""
    pythonpath = os.pathsep.join(
        [ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
    return subprocess.run([sys.executable, os.path.join(ROOT, "tools", "bench_loss.py"),
                           "--help"], cwd=ROOT, env=dict(os.environ, PYTHONPATH=pythonpath),
                          capture_output=True, text=True, timeout=120, check=False)


def _assert_profile_ran_or_skipped_for_its_reason(step: dict,
                                                  help_run: subprocess.CompletedProcess) -> None:
    """The profile step ran and wrote a profile, or was skipped because this checkout's
    ``bench_loss.py`` really has no ``--profile``. The tool looks for the flag in
    ``bench_loss.py --help`` without looking at how that ended: a ``bench_loss.py`` that
    crashes on ``--help`` (a ``%`` in a help text, an import error) prints no flags and reads
    as the skip. So the help is asked for here too: it must end well, and name no ``--profile``
    for the skip to stand."""
    assert help_run.returncode == 0, f"bench_loss.py --help crashed:\n{help_run.stderr[-3000:]}"
    assert "--variants" in help_run.stdout, help_run.stdout  # a help, not an empty page
    if "--profile" in help_run.stdout:
        assert step["status"] == "ok", step
        profiles = step["figures"]["profile"]["profiles"]
        assert profiles and profiles[0]["top"], step["figures"]["profile"]
    else:
        assert step["status"] == PROFILE_SKIP, step


def test_gpu_check_every_step_on_cpu(tmp_path):
    """Every step of the hardware check on the CPU, end to end; what each reports."""
    out = tmp_path / "check"
    r = _tool(tmp_path, "gpu_check.py", "--device", "cpu", "--shared-processes", "--out", str(out),
              timeout=600)
    report = _json(out / "report.json")
    steps = {s["step"]: s for s in report["steps"]}
    assert list(steps) == list(GPU_CHECK_STEPS), r.stdout
    assert report["failed"] == []
    ran = {name for name, s in steps.items() if s["status"] == "ok"}
    # the profile step needs bench_loss's --profile (skipped, and said so, where it lacks it)
    assert ran >= set(GPU_CHECK_STEPS) - {"profile_loss"}, {n: s["status"]
                                                             for n, s in steps.items()}
    _assert_profile_ran_or_skipped_for_its_reason(steps["profile_loss"], _bench_loss_help())
    head = report["header"]
    for key in ("date", "git_commit", "torch", "megatron_core", "transformer_engine",
                "liger_kernel", "nvidia_modelopt", "device", "peers_not_measured"):
        assert key in head, key
    assert head["device"] == "cpu"

    parity = steps["parity"]["figures"]
    assert parity["complete"] and parity["all_ok"]
    names = " ".join(c["case"] for c in parity["cases"])
    for what in ("forward_kl", "reverse_kl", "jsd", "renormalize", "ghost", "main_grad",
                 "compiled", "T=2", "fp32", "bf16"):
        assert what in names, what
    assert max(v for k, v in parity["max_rel_err"].items() if k.startswith("fp32")) <= 1e-5
    _assert_parity_numbers(parity["cases"])

    assert steps["make_teacher"]["figures"]["param_device"] == "cpu"
    for name in ("train_step_bf16_te", "train_step_tp2_sp", "train_step_cp2_te",
                 "train_step_1b"):
        f = steps[name]["figures"]
        assert f["student_param_device"] == "cpu" and f["teacher_param_device"] == "cpu", name
        assert f["student_attention"] and f["teacher_attention"], name
        assert f["precision"] == "fp32" and len(f["loss_lines"]) >= 3, name
    assert steps["train_step_tp2_sp"]["figures"]["summary"]["tp"] == 2
    assert steps["train_step_tp2_sp"]["figures"]["summary"]["sequence_parallel"]
    assert steps["train_step_cp2_te"]["figures"]["summary"]["cp"] == 2
    one_b = steps["train_step_1b"]["figures"]
    assert one_b["teacher_parameters"] > one_b["student_parameters"]
    assert one_b["step_flops"]["total"] > 0 and one_b["tokens_per_s"] > 0
    assert one_b["mfu"] is None  # no peak on the CPU

    assert steps["cache_build"]["figures"]["verify_ok"]
    bench = steps["bench_loss"]["figures"]
    points = {p["variant"]: p for d in bench["shapes"].values() for p in d["points"]}
    assert all(points[v]["status"] == "ok" for v in ("floor", "fused_fkl", "dense_fkl"))
    # a peer that is not installed is reported, not measured
    for variant, module_name in (("liger_fkl", "liger_kernel"), ("modelopt_fkl", "modelopt")):
        if importlib.util.find_spec(module_name) is None:
            assert points[variant]["status"] == "n/a", points[variant]
    md = (out / "report.md").read_text(encoding="utf-8")
    assert "| train_step_1b | ok |" in md and "student on cpu, teacher on cpu" in md
