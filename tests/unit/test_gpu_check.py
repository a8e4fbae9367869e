"""``tools/gpu_check.py``: its parity step on tiny CPU sizes, ``--device cuda`` on a machine
without CUDA, and a step that raises not stopping the others."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "tools", "gpu_check.py")
HEADER_KEYS = ("date", "git_commit", "torch", "megatron_core", "transformer_engine",
               "liger_kernel", "device")


def _check(tmp_path, *args):
    return subprocess.run([sys.executable, SCRIPT, "--out", str(tmp_path), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


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


def test_parity_on_cpu(tmp_path):
    r = _check(tmp_path, "--device", "cpu", "--steps", "parity", "--parity-size", "tiny")
    assert r.returncode == 0, r.stdout + r.stderr
    report = _report(tmp_path)
    assert all(key in report["header"] for key in HEADER_KEYS)
    assert report["header"]["device"] == "cpu" and report["failed"] == []
    (step,) = report["steps"]
    assert step["step"] == "parity" and step["status"] == "ok"
    assert step["seconds"] > 0 and "--worker parity" in step["commands"][0]
    figures = step["figures"]
    assert figures["complete"] and figures["all_ok"]
    names = " ".join(c["case"] for c in figures["cases"])
    for what in ("forward_kl", "reverse_kl", "jsd", "renormalize", "ghost", "main_grad",
                 "T=2", "fp32", "bf16"):
        assert what in names, what
    for case in figures["cases"]:
        assert case["ok"], case
        for key in ("rel_err_loss", "rel_err_grad_x", "rel_err_grad_w"):
            assert 0 <= case[key] <= case["tolerance"], (case["case"], key)
    assert all(c["grad_added_to_main_grad"] for c in figures["cases"] if "main_grad" in c["case"])
    worst = figures["max_rel_err"]
    assert max(v for k, v in worst.items() if k.startswith("fp32")) <= 1e-5
    assert max(v for k, v in worst.items() if k.startswith("bf16")) <= 2e-2
    md = (tmp_path / "report.md").read_text(encoding="utf-8")
    assert "| parity | ok |" in md and "| forward_kl T=1 fp32 | yes |" in md


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_gpu_skips_every_step(tmp_path):
    r = _check(tmp_path, "--device", "cuda")
    assert r.returncode == 2, r.stdout + r.stderr
    assert "CUDA is not available" in r.stderr and "Traceback" not in r.stderr
    report = _report(tmp_path)
    steps = report["steps"]
    assert [s["step"] for s in steps] == list(_module().STEPS)
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
    assert skipped["status"] == gc.NO_GPU
    teacherless = gc.run_step(ctx, "cache_build")
    assert teacherless["status"].startswith("skipped: no teacher")
    json_path, md_path = gc.write_reports(str(tmp_path), {"device": "cpu"},
                                          [step, skipped, teacherless])
    with open(json_path, encoding="utf-8") as f:
        assert json.load(f)["failed"] == ["parity"]
    with open(md_path, encoding="utf-8") as f:
        assert "| parity | failed |" in f.read()
