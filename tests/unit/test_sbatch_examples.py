"""The built-in example flags of each ``examples/slurm/*.sbatch`` script (what runs when no
``KD_ARGS_FILE`` is given), expanded by bash as the script expands them and parsed by the real
command's parser: every flag is one the command takes. (The Slurm tests always pass an args
file, so they never reach these lines: ``cache_build.sbatch`` once passed ``--bf16``, which
``cache build`` refuses.)"""

from __future__ import annotations

import argparse
import re
import subprocess
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "examples" / "slurm"

# script -> (sub-command, its leading arguments besides the script's flags)
COMMANDS = {
    "colocated.sbatch": ("train", []),
    "disaggregated.sbatch": ("train", ["--kd-mode", "disaggregated", "--kd-teacher-endpoint",
                                       "/shared/ep"]),
    "cache_build.sbatch": ("cache", ["build", "--out", "/shared/cache"]),
    "teacher.sbatch": ("teacher", ["serve", "--kd-teacher-endpoint", "/shared/ep"]),
}
ENV = {"KD_TEACHER_LOAD": "/ckpt/teacher", "KD_DATA_PATH": "/data/corpus",
       "KD_TOKENIZER": "/data/tokenizer.json", "SLURM_SUBMIT_DIR": "/work",
       "SLURM_JOB_NAME": "job", "RANKS_PER_NODE": "8", "REPLICA_NODES": "1", "PATH": "/usr/bin:/bin"}


def builtin_args(script: str) -> list[str]:
    """The script's built-in ``ARGS=( ... )`` array, expanded by bash."""
    text = (SCRIPTS / script).read_text()
    found = re.search(r"^( *)ARGS=\(\n(.*?)^\1\)", text, flags=re.M | re.S)
    assert found, f"{script}: no built-in ARGS=( ... ) example"
    program = f"ARGS=(\n{found.group(2)})\nprintf '%s\\n' \"${{ARGS[@]}}\"\n"
    proc = subprocess.run(["bash", "-c", program], env=ENV, capture_output=True, text=True,
                          check=False)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.splitlines()


@pytest.mark.parametrize("script", sorted(COMMANDS))
def test_builtin_example_flags_parse(script):
    from megatron_kd import cli

    name, lead = COMMANDS[script]
    argv = lead + builtin_args(script)
    parser = argparse.ArgumentParser(prog=f"megatron-kd {name}")
    module = cli._load(name)
    module.add_arguments(parser)
    args, unknown = parser.parse_known_args(argv)
    assert unknown == [], f"{script}: megatron-kd {name} does not take {unknown}"
    if name == "train":  # its sections' own checks of the values too
        from megatron_kd.training.run_config import RunConfig

        config = RunConfig.from_args(args)
        assert config.logging.save_interval, f"{script}: the example saves periodically"
        assert config.logging.load == config.logging.save


def test_every_script_with_an_example_is_checked():
    with_examples = {p.name for p in SCRIPTS.glob("*.sbatch")
                     if re.search(r"^ *ARGS=\($", p.read_text(), flags=re.M)}
    assert with_examples == set(COMMANDS)
