"""What a plain ``pip install megatron_kd`` installs is enough for the commands a user runs first:
``import-hf``, ``export-hf`` and ``preprocess`` (each with the project modules it imports, at any
depth, and the CLI that starts them). Read from the source (``ast``): nothing is imported, so a
module missing from this environment is found too.

Every third-party module those modules import, at the top or inside a function (a command runs
its functions), is a distribution in ``setup.py``'s ``install_requires``, or is one of
:data:`OPTIONAL`, each with why it is optional and an extra that installs it.
"""

import ast
import os
import re
import sys

from support import import_rules as rules

from megatron_kd.cli import SUBCOMMANDS

ROOT = os.path.normpath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir))
COMMANDS = ("import-hf", "export-hf", "preprocess")

#: Import names whose distribution is spelled otherwise; any other is its own distribution.
DISTRIBUTIONS = {"megatron": "megatron-core", "transformer_engine": "transformer-engine"}

#: Third-party modules the commands import only on a path that needs an extra, with why.
OPTIONAL = {
    # import-hf --gguf-file: transformers dequantises GGUF tensors (safetensors sources need none)
    "transformers": "demo",
    # probed (transformer_engine_available) and used only when it loads on a GPU
    "transformer_engine": "te",
    # the fused loss's GPU kernels: CUDA builds of torch ship Triton, the CPU build has none
    # (the test extra installs it to run the kernels through Triton's interpreter)
    "triton": "test",
}


def _normalized(name: str) -> str:
    """PEP 503's normal form of a distribution name."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirement_name(requirement: str) -> str:
    return _normalized(re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement).group(1))


def setup_requirements(path: str) -> tuple[set[str], dict[str, set[str]]]:
    """``install_requires`` and ``extras_require`` of the ``setup(...)`` call in ``path``, as
    normalized distribution names."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    calls = [node for node in ast.walk(tree) if isinstance(node, ast.Call)
             and getattr(node.func, "id", None) == "setup"]
    assert len(calls) == 1, f"{path}: {len(calls)} setup(...) calls"
    keywords = {k.arg: ast.literal_eval(k.value) for k in calls[0].keywords
                if k.arg in ("install_requires", "extras_require")}
    install = {_requirement_name(r) for r in keywords["install_requires"]}
    extras = {name: {_requirement_name(r) for r in reqs}
              for name, reqs in keywords.get("extras_require", {}).items()}
    return install, extras


def closure(modules: dict, roots: list[str]) -> set[str]:
    """``roots``, every project module they import at any depth, and the packages above each
    (a package's ``__init__`` runs before its modules)."""
    edges = rules.project_edges(modules)
    seen: set[str] = set()
    stack = list(roots)
    while stack:
        name = stack.pop()
        if name in seen or name not in modules:
            continue
        seen.add(name)
        stack.extend(edges[name])
        parts = name.split(".")
        stack.extend(".".join(parts[:i]) for i in range(1, len(parts)))
    return seen


def third_party_imports(modules: dict, names: set[str]) -> dict[str, list[str]]:
    """Top-level third-party module -> ``path:line`` of each import of it in ``names``."""
    found: dict[str, list[str]] = {}
    for name in sorted(names):
        mod = modules[name]
        for imp in mod.imports:
            top = imp.target.split(".")[0]
            if top in (rules.PROJECT, "__future__", "") or top in sys.stdlib_module_names:
                continue
            found.setdefault(top, []).append(f"{os.path.relpath(mod.path, ROOT)}:{imp.line}")
    return found


def missing_requirements(imports: dict[str, list[str]], install: set[str],
                         extras: dict[str, set[str]]) -> list[str]:
    """What a plain install lacks (or an optional module no extra installs), readably."""
    problems = []
    for top, where in sorted(imports.items()):
        distribution = _normalized(DISTRIBUTIONS.get(top, top))
        if top in OPTIONAL:
            if distribution not in extras.get(OPTIONAL[top], set()):
                problems.append(f"{top} (optional) is not in the {OPTIONAL[top]!r} extra")
        elif distribution not in install:
            problems.append(f"{top} (distribution {distribution}) is imported at "
                            f"{', '.join(where[:3])} but is not in install_requires")
    return problems


def _command_imports() -> dict[str, list[str]]:
    modules = rules.without_aliases(rules.scan(os.path.join(ROOT, rules.PROJECT)))
    roots = ["megatron_kd.cli", "megatron_kd.__main__"] + [SUBCOMMANDS[c][0] for c in COMMANDS]
    names = closure(modules, roots)
    assert {"megatron_kd.data.tokenizer", "megatron_kd.hf.importer", "megatron_kd.integration.gpt",
            "megatron_kd.hf"} <= names  # the walk reaches deep and the packages above
    return third_party_imports(modules, names)


def test_the_commands_need_only_install_requires():
    install, extras = setup_requirements(os.path.join(ROOT, "setup.py"))
    imports = _command_imports()
    # what these commands are known to import, so that the check cannot pass by finding nothing
    assert {"torch", "megatron", "numpy", "tokenizers", "safetensors"} <= set(imports)
    assert missing_requirements(imports, install, extras) == []


def test_a_missing_requirement_is_found():
    imports = _command_imports()
    install = {"torch", "megatron-core", "numpy"}  # setup.py before tokenizers and safetensors
    extras = {"test": {"tokenizers", "safetensors", "transformers"}, "demo": {"tokenizers"}}
    problems = missing_requirements(imports, install, extras)
    assert any(p.startswith("tokenizers (distribution tokenizers) is imported at "
                            "megatron_kd/data/tokenizer.py:") for p in problems), problems
    assert any(p.startswith("safetensors (distribution safetensors) is imported at "
                            "megatron_kd/hf/") for p in problems), problems
    assert "transformers (optional) is not in the 'demo' extra" in problems
    assert "transformer_engine (optional) is not in the 'te' extra" in problems
    assert "triton (optional) is not in the 'test' extra" in problems
    assert len(problems) == 5, problems


def test_setup_requirements_reads_setup_py(tmp_path):
    path = tmp_path / "setup.py"
    path.write_text('from setuptools import setup\nsetup(name="x", install_requires=['
                    '"Torch>=2.4", "megatron_core>=0.16", "safe.tensors ; python_version>\'3\'"]'
                    ', extras_require={"te": ["transformer-engine[pytorch]"]})\n')
    assert setup_requirements(str(path)) == (
        {"torch", "megatron-core", "safe-tensors"}, {"te": {"transformer-engine"}})
