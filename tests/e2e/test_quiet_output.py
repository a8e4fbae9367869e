"""The real ``megatron-kd`` commands print no warning the filters do not list
(``megatron_kd/known_warnings.py``): ``--help``, ``train --help`` and a two-step colocated run at
TP 2 under ``torchrun``, each in fresh processes with Python's default warning settings; an
unlisted warning still shows, ``--verbose`` shows the listed ones too, and ``--version`` answers.

About 30 s on 2 cores (the run: ~15 s; ``train --help`` imports Megatron-Core).
"""

import os
import re
import subprocess
import sys
from importlib import metadata

import pytest
from support.train_cases import STUDENT

from megatron_kd import known_warnings

# what a warning looks like on stderr: the warnings module's "file:line: SomeWarning: message",
# a glog-style log line (torch's own logging: "W1203 16:36:15.435 ..."), a deprecation notice
# logged without either ("GPTModel IS DEPRECATED ...")
_WARNING_LINE = re.compile(r"Warning: |^[WE]\d{4} \d\d:\d\d:\d\d|(?i:deprecat)")


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}  # Python's defaults
    env.update(OMP_NUM_THREADS="1", **extra)  # 1 thread a rank; torchrun's notice is off too
    return env


def _run(argv: list[str], timeout: float = 300, **env) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, *argv], capture_output=True, text=True,
                          env=_env(**env), timeout=timeout, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def _warning_lines(proc: subprocess.CompletedProcess) -> list[str]:
    # warnings and log records go to stderr (stdout holds the help text, which mentions them)
    return [line for line in proc.stderr.splitlines() if _WARNING_LINE.search(line)]


@pytest.mark.parametrize("argv", [["--help"], ["train", "--help"]], ids=["help", "train-help"])
def test_help_prints_no_warning(argv):
    assert _warning_lines(_run(["-m", "megatron_kd", *argv])) == []


def test_colocated_run_prints_no_warning(teacher, tmp_path):
    # every rank is a `python -m megatron_kd` process, so each installs the filters itself
    argv = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            "-m", "megatron_kd", "train", *STUDENT, "--tensor-model-parallel-size", "2",
            "--train-iters", "2", "--eval-interval", "2", "--eval-iters", "1",
            "--kd-teacher-load", teacher, "--kd-ce-weight", "0.5",
            "--save", str(tmp_path / "ckpt"), "--save-interval", "2"]
    proc = _run(argv)
    assert '"iterations": 2' in proc.stdout + proc.stderr  # it did run
    assert _warning_lines(proc) == []


# The CLI installs the filters and runs --help; then one listed and one unlisted warning, each
# from a module the listed one names.
_INJECT = """
import sys, warnings
from megatron_kd import cli, known_warnings
cli.main(sys.argv[1:])
known = known_warnings.KNOWN_WARNINGS[-1]  # not CPU-only: filtered on any machine
for message in (known.message, "an unlisted warning"):
    warnings.warn_explicit(message, known.category, "x.py", 1, module=known.modules[0])
"""


def test_an_unlisted_warning_still_shows_and_verbose_shows_all():
    known = known_warnings.KNOWN_WARNINGS[-1]
    assert not known.cpu_only
    quiet = _warning_lines(_run(["-c", _INJECT, "--help"]))
    assert len(quiet) == 1 and "an unlisted warning" in quiet[0]
    verbose = _warning_lines(_run(["-c", _INJECT, "--verbose", "--help"]))
    assert len(verbose) == 2 and known.message in verbose[0]
    # PYTHONWARNINGS is the user's choice: no filters either
    assert len(_warning_lines(_run(["-c", _INJECT, "--help"], PYTHONWARNINGS="default"))) == 2


def test_version_names_what_a_bug_report_needs():
    proc = _run(["-m", "megatron_kd", "--version"])
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("megatron_kd ")
    assert any(line.startswith("python ") for line in lines)
    assert any(line.startswith("torch ") for line in lines)
    assert f"megatron-core {metadata.version('megatron-core')}" in lines
    assert any(line.startswith("transformer-engine: ") for line in lines)
    assert _warning_lines(proc) == []


def test_verbose_goes_before_the_command():
    proc = subprocess.run([sys.executable, "-m", "megatron_kd", "plan", "--verbose"],
                          capture_output=True, text=True, env=_env(), timeout=60, check=False)
    assert proc.returncode == 2
    assert "--verbose goes before the command: megatron-kd --verbose plan" in proc.stderr
