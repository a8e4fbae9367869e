"""The decoders under fuzzing: every input that ever broke one (kept in tests/data/fuzz) gives
its project error now, the valid seeds decode, and a short coverage-guided run per target finds
nothing (the long runs: tools/fuzz_decoders.py)."""

import json
import os
import subprocess
import sys

import pytest

from megatron_kd.testing.fuzz import EXPECTED, TARGETS, seeds

CORPUS = os.path.join(os.path.dirname(__file__), os.pardir, "data", "fuzz")
TOOL = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "tools", "fuzz_decoders.py")


def _regressions():
    for target in sorted(TARGETS):
        directory = os.path.join(CORPUS, target)
        for name in sorted(os.listdir(directory)):
            yield pytest.param(target, os.path.join(directory, name), id=f"{target}-{name}")


@pytest.mark.parametrize("target, path", list(_regressions()))
def test_regression_inputs_raise_the_project_error(target, path):
    with open(path, "rb") as f:
        data = f.read()
    with pytest.raises(EXPECTED[target]):
        TARGETS[target](data)


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_seeds_decode(target):
    for data in seeds()[target]:
        TARGETS[target](data)  # valid inputs: no error


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_short_fuzz_run_finds_nothing(target, tmp_path):
    pytest.importorskip("atheris")
    proc = subprocess.run([sys.executable, TOOL, "--target", target, "--runs", "3000",
                           "--corpus", str(tmp_path)], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["runs"] == 3000 and result["crashes"] == []
