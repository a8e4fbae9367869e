"""``tools/gpu_check.py``: ``--device cuda`` on a machine without CUDA, a step that raises not
stopping the others, and the 1B step's FLOP count. Every step run on the CPU end to end:
``tests/e2e/test_tools_smoke.py``."""

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
    assert skipped["status"].startswith("skipped: no teacher")
    teacherless = gc.run_step(ctx, "cache_build")
    assert teacherless["status"].startswith("skipped: no teacher")
    json_path, md_path = gc.write_reports(str(tmp_path), {"device": "cpu"},
                                          [step, skipped, teacherless])
    with open(json_path, encoding="utf-8") as f:
        assert json.load(f)["failed"] == ["parity"]
    with open(md_path, encoding="utf-8") as f:
        assert "| parity | failed |" in f.read()


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
