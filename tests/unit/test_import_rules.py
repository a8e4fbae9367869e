"""The layout's rules (see docs/architecture.md), read from the source: no process group,
nothing of the project imported.

Each rule is also shown to fail on a small made-up tree that breaks it, so none of these checks
can pass by checking nothing.
"""

import os

import pytest
from support import import_rules as rules

ROOT = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "megatron_kd")


@pytest.fixture(scope="module")
def scanned():
    found = rules.scan(os.path.normpath(ROOT))
    assert "megatron_kd.loss.fused" in found and "megatron_kd.integration.gpt" in found
    return found


@pytest.fixture(scope="module")
def modules(scanned):
    # the rules read a moved module at its new path; its old one is checked as an alias below
    return rules.without_aliases(scanned)


def test_deprecated_aliases_only_re_export(scanned):
    # megatron_kd.integration.megatron_lm: trees patched before the hooks moved import it
    assert rules.check_aliases(scanned) == []


def test_no_import_cycles(modules):
    assert rules.check_cycles(modules) == []


def test_loss_imports_only_itself_and_parallel(modules):
    # collectives: torch's gather / scatter under this torch's names
    assert rules.check_allowed_imports(modules, "loss", {"parallel", "collectives"},
                                       ("megatron", "transformer_engine")) == []


def test_planner_is_pure_python(modules):
    # arch: the one description of a model and the layout rules (pure Python too); parallel:
    # the layout type, the vocabulary padding and the loss's window rule; flags: the --kd-*
    # flags the planner shares with the other commands (argparse and dataclasses only)
    assert rules.check_allowed_imports(modules, "planner", {"arch", "parallel", "flags"},
                                       ("torch", "megatron", "numpy")) == []


def test_arch_is_pure_python(modules):
    # the planner reads it; parallel: the layout type, the vocabulary padding, the sequence
    # split (pure partition arithmetic)
    assert rules.check_allowed_imports(modules, "arch", {"parallel"},
                                       ("torch", "megatron", "numpy", "transformer_engine")) == []


def test_parallel_has_no_megatron(modules):
    assert rules.check_allowed_imports(modules, "parallel", set(),
                                       ("megatron", "torch", "numpy")) == []


def test_teacher_service_needs_no_megatron(modules):
    # the model and its schedule are handed in: a replica's transport works without Megatron;
    # parallel: the sequence split of a connection's members (pure Python)
    assert rules.check_allowed_imports(modules, "teacher", {"parallel", "collectives"},
                                       ("megatron",)) == []


def test_integration_imports_only_the_layers_below(modules):
    # loss: the sequence gather of a teacher's whole-sequence forward; placement: the compute
    # device. Never the KD modes, hf/ or megatron_lm/: the Megatron-Core layer does not know
    # the teacher sources, the conversions and the Megatron-LM hooks built on it.
    assert rules.check_allowed_imports(modules, "integration",
                                       {"arch", "loss", "parallel", "collectives",
                                        "placement"}) == []


#: Modules of integration/ that import nothing of Megatron-Core yet serve it alone, with why.
MEGATRON_CORE_WITHOUT_IMPORT = {
    "megatron_kd.integration.output_layer": "bypasses a GPTModel's output layer (its attributes)",
    "megatron_kd.integration.loss_func": "the loss as Megatron-Core schedules' loss_func",
}


def test_integration_holds_only_what_touches_megatron_core(modules):
    assert rules.check_imports_external(modules, "integration", "megatron.core",
                                        MEGATRON_CORE_WITHOUT_IMPORT) == []


def test_the_kd_modes_sit_on_the_megatron_core_layer(modules):
    # integration: the teacher model, its output layer, the groups; cache and teacher: the
    # offline and the disaggregated sources' readers and client; flags: the --kd-* flags' fields
    assert rules.check_allowed_imports(modules, "modes",
                                       {"arch", "cache", "flags", "integration", "loss",
                                        "parallel", "placement", "teacher"}) == []


#: The floors of the layout (docs/architecture.md): a package imports only lower ones.
FLOORS = {
    "megatron_kd": 0, "parallel": 0, "flags": 0, "known_warnings": 0, "collectives": 0,
    "placement": 0,
    "arch": 1, "loss": 1, "cache": 1, "data": 1, "teacher": 1,
    "planner": 2, "integration": 2,
    "modes": 3,
    "training": 4, "hf": 4, "megatron_lm": 4,
    "commands": 5,
    "demo": 6, "testing": 6,
    "cli": 1, "__main__": 2,
}


def test_each_package_imports_only_lower_floors(modules):
    assert rules.check_layers(modules, FLOORS) == []


def test_hf_builds_on_arch_and_integration(modules):
    # data: the tokenizer comparison; parallel: the vocabulary padding
    assert rules.check_allowed_imports(modules, "hf",
                                       {"arch", "integration", "data", "parallel"}) == []


def test_megatron_lm_hooks_sit_on_the_megatron_core_layer(modules):
    # integration: the models, the loss function; modes: the teacher sources and the --kd-*
    # flags; cache: the offline source's reader; teacher: the look-ahead over Megatron-LM's data
    # iterator; parallel: the layout of Megatron-LM's flags; known_warnings: the hooks install
    # its filters when Megatron-LM imports them
    assert rules.check_allowed_imports(modules, "megatron_lm",
                                       {"arch", "integration", "modes", "cache", "teacher",
                                        "parallel", "known_warnings"}) == []


def test_nothing_imports_the_megatron_lm_hooks(modules):
    # only a patched pretrain_gpt.py does: a `megatron-kd` command never loads them
    assert rules.check_not_imported(modules, "megatron_lm") == []


def test_collectives_import_nothing_of_the_project(modules):
    assert rules.check_allowed_imports(modules, "collectives", set(), ("megatron",)) == []


def test_flags_import_nothing_of_the_project(modules):
    assert rules.check_allowed_imports(modules, "flags", set(), ("torch", "megatron")) == []


def test_known_warnings_import_nothing_of_the_project(modules):
    # its filters go in before torch and Megatron-Core load, and `megatron-kd plan` needs no torch
    assert rules.check_allowed_imports(modules, "known_warnings", set(),
                                       ("torch", "megatron", "transformer_engine")) == []


def test_cache_does_not_import_the_teacher(modules):
    problems = rules.check_allowed_imports(
        modules, "cache", {p.package for p in modules.values()} - {"teacher"})
    assert problems == []


def test_only_the_megatron_layers_and_training_touch_parallel_state(modules):
    # megatron_lm: the hooks read the groups Megatron-LM set up; commands: a command's groups
    assert rules.check_parallel_state(modules, ("integration", "megatron_lm", "training",
                                                "commands")) == []


def test_imports_wait_only_with_a_reason(modules):
    assert rules.check_deferred_imports(modules) == []


def test_file_and_function_sizes(modules):
    assert rules.check_sizes(modules) == []


# --- each rule fails when broken on purpose -----------------------------------------------------

def _tree(files: dict[str, str]) -> dict[str, rules.Module]:
    out = {}
    for rel, source in files.items():
        path = "megatron_kd/" + rel
        name = rules.module_name("megatron_kd", path)
        out[name] = rules.parse_module(name, path, source)
    return out


def test_rules_catch_broken_trees():
    tree = _tree({
        "__init__.py": "",
        "loss/__init__.py": "",
        "loss/fused.py": "import torch\nfrom megatron_kd.training.train import run\n",
        "training/__init__.py": "",
        "training/train.py": "from megatron_kd.loss.fused import x\n"
                             "from megatron.core import parallel_state\n",
        "planner/__init__.py": "",
        "planner/plan.py": "import torch\n",
        "arch/__init__.py": "",
        "arch/config.py": "import torch\nfrom megatron_kd.loss.fused import x\n",
        "integration/__init__.py": "",
        "integration/gpt.py": "from megatron_kd.hf import importer\n",
        "hf/__init__.py": "",
        "hf/importer.py": "from megatron_kd.integration.gpt import build\n"
                          "from megatron_kd.planner.plan import plan\n",
        "megatron_lm/__init__.py": "",
        "megatron_lm/hooks.py": "from megatron_kd.hf import importer\n",
        "training/run.py": "from megatron_kd.megatron_lm import hooks\n",
        "parallel/__init__.py": "",
        "parallel/layout.py": "from megatron.core import parallel_state as ps\n",
        "cache/__init__.py": "",
        "cache/reader.py": "def f():\n    import numpy\n    from megatron_kd.teacher import wire\n",
        "teacher/__init__.py": "",
        "teacher/wire.py": "def g():\n    # needs a GPU\n    import triton\n",
        "data/__init__.py": "",
        "data/big.py": "def h():\n" + "    x = 1\n" * 90,
    })
    cycles = rules.check_cycles(tree)
    assert any("megatron_kd.loss.fused <-> megatron_kd.training.train" in c for c in cycles)
    assert any("loss <-> training" in c for c in cycles)
    assert rules.check_allowed_imports(tree, "loss", {"parallel"}) == [
        "megatron_kd/loss/fused.py: loss/ imports megatron_kd.training.train "
        "(training/ is not allowed here)"]
    assert rules.check_allowed_imports(tree, "planner", set(), ("torch",)) == [
        "megatron_kd/planner/plan.py:1: planner/ imports torch"]
    assert rules.check_allowed_imports(tree, "arch", {"parallel"}, ("torch",)) == [
        "megatron_kd/arch/config.py: arch/ imports megatron_kd.loss.fused "
        "(loss/ is not allowed here)",
        "megatron_kd/arch/config.py:1: arch/ imports torch"]
    assert rules.check_allowed_imports(tree, "integration", {"arch"}) == [
        "megatron_kd/integration/gpt.py: integration/ imports megatron_kd.hf.importer "
        "(hf/ is not allowed here)"]
    assert rules.check_allowed_imports(tree, "hf", {"arch", "integration"}) == [
        "megatron_kd/hf/importer.py: hf/ imports megatron_kd.planner.plan "
        "(planner/ is not allowed here)"]
    assert any("hf <-> integration" in c for c in cycles)
    assert rules.check_allowed_imports(tree, "megatron_lm", {"integration"}) == [
        "megatron_kd/megatron_lm/hooks.py: megatron_lm/ imports megatron_kd.hf.importer "
        "(hf/ is not allowed here)"]
    assert rules.check_not_imported(tree, "megatron_lm") == [
        "megatron_kd/training/run.py: imports megatron_kd.megatron_lm.hooks (nothing outside "
        "megatron_lm/ may)"]
    assert rules.check_allowed_imports(tree, "parallel", set(), ("megatron",)) == [
        "megatron_kd/parallel/layout.py:1: parallel/ imports megatron.core"]
    cache = rules.check_allowed_imports(tree, "cache", {"parallel"})
    assert cache == ["megatron_kd/cache/reader.py: cache/ imports megatron_kd.teacher.wire "
                     "(teacher/ is not allowed here)"]
    assert rules.check_parallel_state(tree, ("integration", "megatron_lm", "training")) == [
        "megatron_kd/parallel/layout.py:1: parallel_state outside integration/, megatron_lm/, "
        "training/"]
    deferred = rules.check_deferred_imports(tree)
    assert len(deferred) == 2  # numpy (not deferrable) and the project import; triton has a reason
    assert any("numpy imported inside a function" in d for d in deferred)
    assert any("project import megatron_kd.teacher" in d for d in deferred)
    assert rules.check_sizes(tree) == [
        "megatron_kd/data/big.py:1: function h has 91 lines (> 80)"]
    # floors: loss (1) importing training (4) runs up; a package without a floor is named
    layers = rules.check_layers(tree, {"loss": 1, "training": 4, "megatron_kd": 0})
    assert ("megatron_kd/loss/fused.py: loss/ (floor 1) imports megatron_kd.training.train "
            "(training/, floor 4): not a lower floor") in layers
    assert "arch/ has no floor" in layers
    # integration/gpt.py imports no megatron.core: a module that does not belong there
    assert rules.check_imports_external(tree, "integration", "megatron.core", {}) == [
        "megatron_kd/integration/gpt.py: integration/ holds a module that does not import "
        "megatron.core"]
    assert rules.check_imports_external(tree, "integration", "megatron.core",
                                        {"megatron_kd.integration.gpt": "why"}) == []


def test_alias_rules_catch_broken_aliases():
    tree = _tree({
        "__init__.py": "",
        "integration/__init__.py": "",
        "integration/old_hooks.py": "import warnings\nimport torch\n"
                                    "from megatron_kd.megatron_lm.hooks import *\n",
        "integration/old_checks.py": "import warnings\n",
        "megatron_lm/__init__.py": "",
        "megatron_lm/hooks.py": "",
        "megatron_lm/checks.py": "",
    })
    aliases = {"megatron_kd.integration.old_hooks": "megatron_kd.megatron_lm.hooks",
               "megatron_kd.integration.old_checks": "megatron_kd.megatron_lm.checks",
               "megatron_kd.integration.gone": "megatron_kd.megatron_lm"}
    assert rules.check_aliases(tree, aliases) == [
        "megatron_kd.integration.gone: an alias of megatron_kd.megatron_lm that does not exist",
        "megatron_kd/integration/old_checks.py: an alias of megatron_kd.megatron_lm.checks "
        "that does not import it",
        "megatron_kd/integration/old_hooks.py:2: an alias of megatron_kd.megatron_lm.hooks "
        "imports torch"]
    # an alias breaks the layout's rules until it is left out of them
    assert rules.check_allowed_imports(tree, "integration", set()) == [
        "megatron_kd/integration/old_hooks.py: integration/ imports megatron_kd.megatron_lm.hooks "
        "(megatron_lm/ is not allowed here)"]
    assert rules.check_allowed_imports(rules.without_aliases(tree, aliases), "integration",
                                       set()) == []
