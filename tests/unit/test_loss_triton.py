"""Fused KD loss, tier 1: the GPU path's Triton kernels on CPU, through Triton's interpreter.

Triton reads ``TRITON_INTERPRET`` when it defines a kernel, so the checks run in one child
process with it set (tests/support/kd_triton_cases.py): each kernel against an fp64 formula,
and the whole loss with ``kernels="triton"`` against the fp64 reference (value and both
gradients) in fp64, fp32 and bf16. Triton is in the test extra (the CPU-only torch build ships
none); a skip for want of it fails under CI. The same maths runs in its PyTorch form in
tests/unit/test_loss_gpu_path.py.
"""

import json
import os
import subprocess
import sys

import pytest
from support.kd_triton_cases import CASES, DTYPES

pytest.importorskip("triton")

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOT = os.path.dirname(TESTS)


@pytest.fixture(scope="module")
def results() -> dict:
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join(p for p in (TESTS, ROOT, os.environ.get("PYTHONPATH"))
                                          if p))
    proc = subprocess.run([sys.executable, os.path.join(TESTS, "support", "kd_triton_cases.py")],
                          capture_output=True, text=True, env=env, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def test_each_kernel_against_its_formula(results):
    kernels = {k: v for k, v in results.items() if k.startswith("kernel:")}
    # 2 x 4 row_stats values, 1 jsd_sums, 4 kinds x 2 logit_grad_ variants; extreme rows:
    # 2 row_stats values, 1 jsd_sums, 1 logit_grad_; the scale-and-round
    assert len(kernels) == 22, sorted(kernels)
    assert not {k: v for k, v in kernels.items() if v}, kernels


#: bf16 runs the dense kinds only (the cases with a ``kind``)
_LOSS_CASES = [(name, dtype) for name in CASES for dtype in DTYPES
               if dtype != "bf16" or "kind" in CASES[name]]


@pytest.mark.parametrize("name, dtype", _LOSS_CASES)
def test_loss_with_triton_kernels_against_the_reference(results, name, dtype):
    key = f"loss:{dtype}:{name}"
    assert key in results, sorted(results)
    assert results[key] is None, results[key]


def test_bf16_runs_only_the_dense_kinds(results):
    ran = {key for key in results if key.startswith("loss:bf16:")}
    assert ran == {f"loss:bf16:{name}" for name, dtype in _LOSS_CASES if dtype == "bf16"}
