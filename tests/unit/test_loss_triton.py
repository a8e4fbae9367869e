"""Fused KD loss, tier 1: the GPU path's Triton kernels on CPU, through Triton's interpreter.

Triton reads ``TRITON_INTERPRET`` when it defines a kernel, so the checks run in one child
process with it set (tests/support/kd_triton_cases.py): each kernel against an fp64 formula,
and the whole loss with ``kernels="triton"`` against the fp64 reference (value and both
gradients) in fp64, fp32 and bf16. Skipped where Triton cannot be imported (the CPU-only torch
build has none); the same maths runs in its PyTorch form in tests/unit/test_loss_gpu_path.py.
"""

import importlib.util
import json
import os
import subprocess
import sys

import pytest
from support.kd_triton_cases import CASES, DTYPES

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="triton is not installed (CPU-only torch build)")

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
    # 2 x 4 row_stats values, 1 jsd_sums, 4 kinds x 2 logit_grad_ variants
    assert len(kernels) == 17, sorted(kernels)
    assert not {k: v for k, v in kernels.items() if v}, kernels


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("name", list(CASES))
def test_loss_with_triton_kernels_against_the_reference(results, name, dtype):
    key = f"loss:{dtype}:{name}"
    if dtype == "bf16" and "kind" not in CASES[name]:
        assert key not in results
        pytest.skip("bf16 runs the dense kinds only")
    assert key in results, sorted(results)
    assert results[key] is None, results[key]
