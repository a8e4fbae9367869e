"""The project's import rules, checked from source text alone (``ast``: nothing is imported).

:func:`scan` reads every module of a package tree into :class:`Module` records (its imports, where
each sits, its length and its functions' lengths); the ``check_*`` functions return the
violations of one rule each as readable strings (empty: the rule holds). They take the scanned
modules as an argument, so a test can also feed them a made-up tree that breaks a rule.
"""

from __future__ import annotations

import ast
import os
from dataclasses import dataclass, field

PROJECT = "megatron_kd"

#: Third-party imports that may wait inside a function (heavy or optional), with a reason.
DEFERRABLE = ("megatron.training", "transformers", "transformer_engine", "tokenizers",
              "safetensors", "gguf", "matplotlib", "triton", "modelopt", "liger_kernel", "wandb",
              "tensorboard", "torch", "atheris", "torchft")

#: Modules kept at their old path for one release after a move: old name -> new name. Each only
#: warns and re-exports the new module (:func:`check_aliases`); the layout's other rules read the
#: new module and leave the alias out (:func:`without_aliases`).
ALIASES = {"megatron_kd.integration.megatron_lm": "megatron_kd.megatron_lm"}
MAX_ALIAS_LINES = 30

MAX_FILE_LINES = 500
MAX_FUNCTION_LINES = 80
ONE_PIECE_MARK = "one piece"


@dataclass
class Import:
    target: str  # dotted module name as written (``from a.b import c`` gives ``a.b`` and, if
    # ``a.b.c`` is a module of the tree, also ``a.b.c``)
    names: tuple[str, ...]
    line: int
    deferred: bool  # inside a function or method
    reason: bool  # a comment on its line or the line above


@dataclass
class Module:
    name: str  # dotted, e.g. megatron_kd.loss.fused
    path: str
    lines: int
    docstring: str
    imports: list[Import] = field(default_factory=list)
    functions: list[tuple[str, int, int]] = field(default_factory=list)  # (name, line, length)
    mentions_parallel_state: list[int] = field(default_factory=list)  # lines

    @property
    def package(self) -> str:
        """The first-level package (``loss``, ``cache``...), or the module itself at top level."""
        parts = self.name.split(".")
        return parts[1] if len(parts) > 1 else parts[0]


def module_name(root: str, path: str) -> str:
    rel = os.path.relpath(path, os.path.dirname(root))
    parts = rel[:-3].split(os.sep)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def parse_module(name: str, path: str, source: str) -> Module:
    tree = ast.parse(source)
    lines = source.splitlines()
    mod = Module(name=name, path=path, lines=len(lines), docstring=ast.get_docstring(tree) or "")

    def has_reason(lineno: int) -> bool:
        # a comment on the line, or above the block of import lines this one belongs to
        if "#" in lines[lineno - 1]:
            return True
        i = lineno - 2
        while i >= 0 and lines[i].strip().startswith(("import ", "from ")):
            i -= 1
        return i >= 0 and lines[i].strip().startswith("#")

    def visit(node, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                mod.functions.append((child.name, child.lineno,
                                      child.end_lineno - child.lineno + 1))
                visit(child, True)
            elif isinstance(child, ast.Import):
                for alias in child.names:
                    mod.imports.append(Import(alias.name, (), child.lineno, in_function,
                                              has_reason(child.lineno)))
                visit(child, in_function)
            elif isinstance(child, ast.ImportFrom):
                if child.level:  # relative: resolve against this module's package
                    package = name.split(".")
                    if not path.endswith("__init__.py"):
                        package = package[:-1]
                    base = package[:len(package) - child.level + 1]
                    target = ".".join(base + ([child.module] if child.module else []))
                else:
                    target = child.module or ""
                mod.imports.append(Import(target, tuple(a.name for a in child.names),
                                          child.lineno, in_function, has_reason(child.lineno)))
            else:
                if isinstance(child, (ast.Name, ast.Attribute)):
                    ident = child.id if isinstance(child, ast.Name) else child.attr
                    if ident == "parallel_state":
                        mod.mentions_parallel_state.append(child.lineno)
                visit(child, in_function)

    visit(tree, False)
    for imp in mod.imports:
        if imp.target.endswith("parallel_state") or "parallel_state" in imp.names:
            mod.mentions_parallel_state.append(imp.line)
    return mod


def scan(root: str) -> dict[str, Module]:
    """Every ``.py`` module under the package directory ``root``, by dotted name."""
    modules = {}
    for directory, _, files in os.walk(root):
        for file in sorted(files):
            if file.endswith(".py"):
                path = os.path.join(directory, file)
                name = module_name(root, path)
                with open(path, encoding="utf-8") as f:
                    modules[name] = parse_module(name, path, f.read())
    return modules


def without_aliases(modules: dict[str, Module],
                    aliases: dict[str, str] | None = None) -> dict[str, Module]:
    """``modules`` less the deprecated aliases (:data:`ALIASES` by default)."""
    aliases = ALIASES if aliases is None else aliases
    return {name: mod for name, mod in modules.items() if name not in aliases}


def check_aliases(modules: dict[str, Module], aliases: dict[str, str] | None = None) -> list[str]:
    """Each alias exists, imports its new module and nothing else of the project or beyond
    (``warnings`` for its warning), at module level, and stays under :data:`MAX_ALIAS_LINES`."""
    aliases = ALIASES if aliases is None else aliases
    problems = []
    for old, new in sorted(aliases.items()):
        mod = modules.get(old)
        if mod is None:
            problems.append(f"{old}: an alias of {new} that does not exist")
            continue
        targets = {imp.target for imp in mod.imports}
        if new not in targets:
            problems.append(f"{mod.path}: an alias of {new} that does not import it")
        for imp in mod.imports:
            if imp.target not in (new, "warnings", "__future__") or imp.deferred:
                problems.append(f"{mod.path}:{imp.line}: an alias of {new} imports "
                                f"{imp.target}" + (" inside a function" if imp.deferred else ""))
        if mod.lines > MAX_ALIAS_LINES:
            problems.append(f"{mod.path}: an alias of {new} has {mod.lines} lines "
                            f"(> {MAX_ALIAS_LINES}): it only re-exports")
    return problems


def project_edges(modules: dict[str, Module]) -> dict[str, set[str]]:
    """module -> the project modules it imports (at any depth: deferred imports count too)."""
    edges: dict[str, set[str]] = {name: set() for name in modules}
    for name, mod in modules.items():
        for imp in mod.imports:
            if not (imp.target == PROJECT or imp.target.startswith(PROJECT + ".")):
                continue
            subs = [f"{imp.target}.{n}" for n in imp.names if f"{imp.target}.{n}" in modules]
            if subs:
                edges[name].update(subs)
                rest = [n for n in imp.names if f"{imp.target}.{n}" not in modules]
                if rest and imp.target in modules:
                    edges[name].add(imp.target)
            elif imp.target in modules:
                edges[name].add(imp.target)
        edges[name].discard(name)
    return edges


def find_cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one node (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def strong(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            strong(v)
    return out


def check_cycles(modules: dict[str, Module]) -> list[str]:
    """No import cycle between modules, nor between the first-level packages."""
    problems = [f"import cycle between modules: {' <-> '.join(c)}"
                for c in find_cycles(project_edges(modules))]
    packages: dict[str, set[str]] = {}
    for src, targets in project_edges(modules).items():
        a = modules[src].package
        packages.setdefault(a, set())
        for t in targets:
            b = modules[t].package
            if a != b and len(t.split(".")) > 1 and len(src.split(".")) > 1:
                packages[a].add(b)
    problems += [f"import cycle between packages: {' <-> '.join(c)}"
                 for c in find_cycles(packages)]
    return problems


def _project_targets(mod: Module, modules: dict[str, Module]) -> set[str]:
    return project_edges({mod.name: mod, **modules})[mod.name]


def check_allowed_imports(modules: dict[str, Module], package: str, allowed_project: set[str],
                          forbidden_external: tuple[str, ...] = ()) -> list[str]:
    """Modules of ``package`` import only ``allowed_project`` packages of the project (their
    own always) and none of ``forbidden_external`` (prefixes, e.g. ``torch``)."""
    problems = []
    for name, mod in sorted(modules.items()):
        if mod.package != package or "." not in name:
            continue
        for target in sorted(_project_targets(mod, modules)):
            other = modules[target].package
            if other != package and other not in allowed_project:
                problems.append(f"{mod.path}: {package}/ imports {target} ({other}/ is not "
                                f"allowed here)")
        for imp in mod.imports:
            for bad in forbidden_external:
                if imp.target == bad or imp.target.startswith(bad + "."):
                    problems.append(f"{mod.path}:{imp.line}: {package}/ imports {imp.target}")
    return problems


def check_layers(modules: dict[str, Module], floors: dict[str, int]) -> list[str]:
    """Each first-level package imports only packages on lower floors (``floors``: package ->
    floor, 0 the ground); every package of the tree has a floor."""
    problems = [f"{pkg}/ has no floor" for pkg in sorted({m.package for m in modules.values()})
                if pkg not in floors]
    for name, mod in sorted(modules.items()):
        for target in sorted(project_edges({name: mod, **modules})[name]):
            other = modules[target].package
            if other != mod.package and floors.get(other, -1) >= floors.get(mod.package, -1):
                problems.append(f"{mod.path}: {mod.package}/ (floor {floors.get(mod.package)}) "
                                f"imports {target} ({other}/, floor {floors.get(other)}): not "
                                f"a lower floor")
    return problems


def check_imports_external(modules: dict[str, Module], package: str, external: str,
                           exempt: dict[str, str]) -> list[str]:
    """Every module of ``package`` imports ``external`` (a prefix, e.g. ``megatron.core``),
    but those of ``exempt`` (module -> why it belongs there all the same) and a package face
    (an ``__init__``)."""
    problems = []
    for name, mod in sorted(modules.items()):
        if mod.package != package or "." not in name or name in exempt or \
                mod.path.endswith("__init__.py"):
            continue
        if not any(imp.target == external or imp.target.startswith(external + ".")
                   for imp in mod.imports):
            problems.append(f"{mod.path}: {package}/ holds a module that does not import "
                            f"{external}")
    return problems


def check_not_imported(modules: dict[str, Module], package: str) -> list[str]:
    """No module outside ``package`` imports it (at any depth: deferred imports count too)."""
    return [f"{mod.path}: imports {target} (nothing outside {package}/ may)"
            for name, mod in sorted(modules.items()) if mod.package != package
            for target in sorted(_project_targets(mod, modules))
            if modules[target].package == package]


def check_parallel_state(modules: dict[str, Module], allowed: tuple[str, ...]) -> list[str]:
    """Only the ``allowed`` packages name Megatron-Core's ``parallel_state``."""
    return [f"{mod.path}:{line}: parallel_state outside {'/, '.join(allowed)}/"
            for mod in modules.values() if mod.package not in allowed
            for line in sorted(set(mod.mentions_parallel_state))]


def check_deferred_imports(modules: dict[str, Module]) -> list[str]:
    """Imports sit at module level, except heavy or optional ones that must wait, each with a
    one-line reason (a comment on its line or the line above). A project module never waits."""
    problems = []
    for mod in modules.values():
        for imp in mod.imports:
            if not imp.deferred:
                continue
            top = imp.target.split(".")[0]
            if imp.target.startswith(PROJECT) and not imp.reason:
                problems.append(f"{mod.path}:{imp.line}: project import {imp.target} inside a "
                                f"function without a reason comment")
            elif not imp.target.startswith(PROJECT) and not any(
                    imp.target == d or imp.target.startswith(d + ".") for d in DEFERRABLE):
                if top not in ("__future__",) and not imp.reason:
                    problems.append(f"{mod.path}:{imp.line}: {imp.target} imported inside a "
                                    f"function (move it to the top of the module)")
            elif not imp.reason:
                problems.append(f"{mod.path}:{imp.line}: {imp.target} imported inside a function "
                                f"without a one-line reason comment")
    return problems


def check_sizes(modules: dict[str, Module]) -> list[str]:
    """No file over :data:`MAX_FILE_LINES` without a sentence at its top saying why it is one
    piece; no function over :data:`MAX_FUNCTION_LINES`."""
    problems = []
    for mod in modules.values():
        if mod.lines > MAX_FILE_LINES and ONE_PIECE_MARK not in mod.docstring.lower():
            problems.append(f"{mod.path}: {mod.lines} lines and no sentence at its top saying "
                            f"why it is {ONE_PIECE_MARK}")
        for fn, line, length in mod.functions:
            if length > MAX_FUNCTION_LINES:
                problems.append(f"{mod.path}:{line}: function {fn} has {length} lines "
                                f"(> {MAX_FUNCTION_LINES})")
    return problems
