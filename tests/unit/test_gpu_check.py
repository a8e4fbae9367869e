"""``tools/gpu_check.py``: ``--device cuda`` on a machine without CUDA, a step that raises not
stopping the others, steps run ``--jobs`` at a time, SIGTERM, and the 1B step's FLOP count.
Every step run on the CPU end to end: ``tests/e2e/test_tools_smoke.py``."""

import importlib.util
import json
import os
import subprocess
import sys
import threading
import time

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "tools", "gpu_check.py")
HEADER_KEYS = ("date", "git_commit", "torch", "megatron_core", "transformer_engine",
               "liger_kernel", "device")


def _check(tmp_path, *args):
    return subprocess.run([sys.executable, SCRIPT, "--out", str(tmp_path), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, check=False)


def _report(tmp_path):
    with open(tmp_path / "report.json", encoding="utf-8") as f:
        return json.load(f)


def _module():
    if "gpu_check" not in sys.modules:
        spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
        module = importlib.util.module_from_spec(spec)
        sys.modules["gpu_check"] = module  # dataclasses look their module up there
        spec.loader.exec_module(module)
    return sys.modules["gpu_check"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_gpu_skips_every_step(tmp_path):
    r = _check(tmp_path, "--device", "cuda")
    assert r.returncode == 2, r.stdout + r.stderr
    assert "CUDA is not available" in r.stderr and "Traceback" not in r.stderr
    report = _report(tmp_path)
    steps = report["steps"]
    gc = _module()
    assert [s["step"] for s in steps] == [n for n in gc.STEPS if n not in gc.ON_REQUEST]
    assert all(s["status"].startswith("skipped: no GPU") for s in steps), steps
    assert report["header"]["device"] == "cpu" and report["failed"] == []


def test_a_step_that_raises_is_failed_and_reported(tmp_path, monkeypatch):
    gc = _module()

    def broken(ctx, step):
        raise RuntimeError("boom")

    monkeypatch.setitem(gc.STEP_FUNCS, "parity", broken)
    a = gc.parse_args(["--device", "cpu"])
    ctx = gc.Ctx(args=a, device="cpu", out=str(tmp_path), env=gc._env("cpu"),
                 deadline=gc.time.monotonic() + 60, limits=gc._limits(a, "cpu"))
    step = gc.run_step(ctx, "parity")
    assert step["status"] == "failed" and "boom" in step["output_tail"]
    skipped = gc.run_step(ctx, "train_step_bf16_te")
    assert skipped["status"].startswith("skipped: no teacher")
    teacherless = gc.run_step(ctx, "cache_build")
    assert teacherless["status"].startswith("skipped: no teacher")
    json_path, md_path = gc.write_reports(str(tmp_path), {"device": "cpu"},
                                          [step, skipped, teacherless])
    with open(json_path, encoding="utf-8") as f:
        assert json.load(f)["failed"] == ["parity"]
    with open(md_path, encoding="utf-8") as f:
        assert "| parity | failed |" in f.read()


def _fake_steps(gc, monkeypatch, together=()):
    """Every step replaced by one that records its name; the steps in ``together`` each wait
    for the others at a barrier (they fail unless they all run at once)."""
    order = []
    barrier = threading.Barrier(len(together), timeout=60) if together else None

    def fake(name):
        def run(ctx, step):
            order.append(name)
            if name == "make_teacher":
                ctx.teacher_ok = True
            if name in together:
                barrier.wait()
        return run

    for name in gc.STEPS:
        monkeypatch.setitem(gc.STEP_FUNCS, name, fake(name))
    monkeypatch.setattr(gc.signal, "signal", lambda *_: None)  # pytest keeps its handler
    return order


def test_steps_after_the_teacher_run_jobs_at_a_time(tmp_path, monkeypatch):
    gc = _module()
    # the first two steps after make_teacher meet at a barrier: they ran at the same time
    first_two = tuple(gc.RUN_ORDER[1:3])
    order = _fake_steps(gc, monkeypatch, together=first_two)
    assert gc.main(["--device", "cpu", "--out", str(tmp_path), "--jobs", "2"]) == 0
    report = _report(tmp_path)
    assert report["header"]["jobs"] == 2
    default = [n for n in gc.STEPS if n not in gc.ON_REQUEST]  # bench_step: named only
    assert [s["status"] for s in report["steps"]] == ["ok"] * len(default), report["steps"]
    assert order[0] == "make_teacher" and sorted(order) == sorted(default)
    assert set(order[1:3]) == set(first_two)


def test_one_job_runs_the_steps_in_order(tmp_path, monkeypatch):
    gc = _module()
    order = _fake_steps(gc, monkeypatch)
    assert gc.main(["--device", "cpu", "--out", str(tmp_path), "--jobs", "1"]) == 0
    assert order == [n for n in gc.RUN_ORDER if n not in gc.ON_REQUEST]
    assert _report(tmp_path)["header"]["jobs"] == 1
    order.clear()  # a step run on request only, when named
    assert gc.main(["--device", "cpu", "--out", str(tmp_path), "--steps", "bench_step"]) == 0
    assert order == ["bench_step"]
    r = _check(tmp_path, "--device", "cpu", "--jobs", "0")
    assert r.returncode == 2 and "--jobs 0: must be at least 1" in r.stderr


def test_sigterm_kills_the_running_commands_and_starts_no_more(tmp_path, monkeypatch):
    gc = _module()
    monkeypatch.setattr(gc, "_STOPPING", threading.Event())
    monkeypatch.setattr(gc, "_SESSIONS", set())
    a = gc.parse_args(["--device", "cpu"])
    ctx = gc.Ctx(args=a, device="cpu", out=str(tmp_path), env=gc._env("cpu"),
                 deadline=gc.time.monotonic() + 600, limits=gc._limits(a, "cpu"))
    log = str(tmp_path / "sleep.log")
    sleeper = [sys.executable, "-c", "import time; time.sleep(300)"]
    result = {}
    thread = threading.Thread(target=lambda: result.update(gc.run_cmd(sleeper, ctx, log, 600)))
    thread.start()
    deadline = time.monotonic() + 60
    while not gc._SESSIONS and time.monotonic() < deadline:
        time.sleep(0.05)
    assert gc._SESSIONS, "the command never started"
    with pytest.raises(SystemExit) as stopped:
        gc._stop()
    assert stopped.value.code == 143
    thread.join(60)
    assert not thread.is_alive() and result["rc"] == -9 and not result["timed_out"]
    assert gc._SESSIONS == set()
    with pytest.raises(RuntimeError, match="stopping"):
        gc.run_cmd(sleeper, ctx, log, 600)


def test_one_b_step_flops():
    """The 1B step's FLOPs against a count written out by hand for Llama-3.2-1B's shape (N:
    16 layers of q, k, v, o and a SwiGLU MLP, no embedding, no output layer)."""
    gc = _module()
    one_b = gc.ONE_B["cuda"]
    h, kv, ffn, layers, s, vocab = 2048, 8 * 64, 8192, 16, 4096, 128256
    n_student = layers * (2 * h * h + 2 * h * kv + 3 * h * ffn)
    assert gc._matmul_params(one_b["student"]) == n_student
    assert round(n_student / 1e6) == 973  # 1.24B with the 263M tied embedding
    ht, kvt, layers_t = 3072, 8 * 128, 20
    n_teacher = layers_t * (2 * ht * ht + 2 * ht * kvt + 3 * ht * ffn)
    flops = gc.step_flops(one_b)
    assert flops["student_layers"] == 6 * n_student * s + 3 * layers * 2 * s * s * h
    assert flops["teacher_layers"] == 2 * n_teacher * s + layers_t * 2 * s * s * ht
    assert flops["loss_gemms"] == 2 * s * vocab * (3 * h + ht)
    assert flops["total"] == sum(v for k, v in flops.items() if k != "total")
    # the teacher is about twice the student, embeddings included
    total_s, total_t = n_student + vocab * h, n_teacher + vocab * ht
    assert 1.8 < total_t / total_s < 2.1
