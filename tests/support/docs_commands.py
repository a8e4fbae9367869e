"""The commands the documents show: every ``megatron-kd`` (or ``python -m megatron_kd``) and
``pretrain_gpt.py`` command in the README, ``docs/``, ``examples/`` and ``patches/`` (fenced
shell blocks and inline code spans of the Markdown files, and the shell scripts themselves),
and what is wrong with one (a command, an action or a flag the CLI does not have).
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import shlex
from dataclasses import dataclass

from megatron_kd.cli import _OPTIONS, SUBCOMMANDS, _load

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHELL_LANGS = {"bash", "sh", "shell", "console", "shell-session"}
FENCE = re.compile(r"^\s*```+\s*([\w-]*)")
INLINE = re.compile(r"`([^`]*(?:megatron-kd|pretrain_gpt\.py)[^`]*)`")
INLINE_MARK = "\0"  # an inline span: a synopsis ("[--a X|--b]"), not a pipeline
FLAG = re.compile(r"(?<![\w-])--[A-Za-z][\w-]*")


@dataclass
class Command:
    file: str
    line: int
    tokens: list[str]

    def where(self) -> str:
        return f"{os.path.relpath(self.file, ROOT)}:{self.line}"


def _documents() -> list[str]:
    patterns = ["README.md", "docs/**/*.md", "examples/**/*.md", "examples/**/*.sh",
                "examples/**/*.sbatch", "patches/*.md"]
    files = set()
    for pattern in patterns:
        files.update(glob.glob(os.path.join(ROOT, pattern), recursive=True))
    return sorted(files)


def _shell_lines(path: str) -> list[tuple[int, str]]:
    """``(first line number, logical line)`` of a script, or of a Markdown file's fenced shell
    blocks and inline code spans naming a command; backslash continuations joined, a console
    prompt dropped."""
    with open(path, encoding="utf-8") as f:
        raw = f.read().splitlines()
    if path.endswith(".md"):
        kept, inside, shell, prose = [], False, False, []
        for i, line in enumerate(raw, 1):
            fence = FENCE.match(line)
            if fence:
                inside, shell = (not inside, fence.group(1).lower() in SHELL_LANGS)
                continue
            if inside and shell:
                kept.append((i, re.sub(r"^\s*\$\s+", "", line)))
            elif not inside:
                prose.append((i, line))
        kept.extend(_inline_spans(prose))
        kept.sort()
    else:
        kept = list(enumerate(raw, 1))
    out: list[tuple[int, str]] = []
    pending, start = "", 0
    for i, line in kept:
        if not pending:
            start = i
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        out.append((start, pending + line))
        pending = ""
    return out


def _inline_spans(prose: list[tuple[int, str]]) -> list[tuple[int, str]]:
    """Inline code spans naming a command, found paragraph by paragraph (a span may wrap)."""
    out, paragraph = [], []
    for i, line in [*prose, (0, "")]:
        if line.strip() and (not paragraph or paragraph[-1][0] == i - 1):
            paragraph.append((i, line))
            continue
        text = "\n".join(t for _, t in paragraph)
        for match in INLINE.finditer(text):
            line_no = paragraph[0][0] + text.count("\n", 0, match.start())
            out.append((line_no, INLINE_MARK + match.group(1).replace("\n", " ")))
        paragraph = [(i, line)] if line.strip() else []
    return out


def _split_commands(text: str) -> list[list[str]]:
    if text.startswith(INLINE_MARK):
        return [text[1:].replace("|", " ").split()]
    lexer = shlex.shlex(text, posix=True, punctuation_chars=";&|")
    lexer.whitespace_split = True
    try:
        tokens = list(lexer)
    except ValueError:  # an unbalanced quote in prose-like text: not a command we can check
        return []
    commands, current = [], []
    for token in tokens:
        if token and set(token) <= set(";&|()"):
            commands.append(current)
            current = []
        else:
            current.append(token)
    commands.append(current)
    return [c for c in commands if c]


def documented_commands() -> tuple[list[Command], list[Command]]:
    """``(megatron-kd commands, pretrain_gpt.py commands)`` as their tokens after the program."""
    ours, megatron_lm = [], []
    for path in _documents():
        for line_no, text in _shell_lines(path):
            for tokens in _split_commands(text):
                for i, token in enumerate(tokens):
                    if os.path.basename(token) == "megatron-kd":
                        ours.append(Command(path, line_no, tokens[i + 1:]))
                        break
                    if token == "-m" and i + 1 < len(tokens) and tokens[i + 1] == "megatron_kd":
                        ours.append(Command(path, line_no, tokens[i + 2:]))
                        break
                    if token.endswith("pretrain_gpt.py"):
                        megatron_lm.append(Command(path, line_no, tokens[i + 1:]))
                        break
    return ours, megatron_lm


def parser_options(parser: argparse.ArgumentParser) -> set[str]:
    return set(parser._option_string_actions)


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                sub.format_help()  # a sub-command may add its flags when first used (cache build)
            return dict(action.choices)
    return {}


def named_flags(tokens: list[str]) -> list[str]:
    """The options a command's tokens name (``--flag=value`` and ``[--flag X]`` included)."""
    return [f for t in tokens for f in FLAG.findall(t.split("=", 1)[0])]


def _is_placeholder(token: str) -> bool:
    return (token in ("...", "…") or token.startswith(("$", "<", "[")) or "{" in token
            or token.isupper())


def check_command(cmd: Command) -> list[str]:
    """What is wrong with one documented ``megatron-kd`` command (empty: nothing)."""
    tokens = list(cmd.tokens)
    while tokens and tokens[0].startswith("-"):
        if tokens[0] not in _OPTIONS:
            return [f"{cmd.where()}: megatron-kd has no option {tokens[0]!r} before the command"]
        tokens.pop(0)
    if not tokens or _is_placeholder(tokens[0]):
        return []
    name = tokens.pop(0)
    if name not in SUBCOMMANDS:
        return [f"{cmd.where()}: no command {name!r} (commands: {', '.join(SUBCOMMANDS)})"]
    parser = argparse.ArgumentParser(prog=f"megatron-kd {name}")
    _load(name).add_arguments(parser)
    parsers = {name: parser}
    children = _subparsers(parser)
    if children and tokens and not tokens[0].startswith("-") and not _is_placeholder(tokens[0]):
        actions = tokens.pop(0).split("/")  # "cache build/verify/info": each of them
        unknown = [a for a in actions if a not in children]
        if unknown:
            return [f"{cmd.where()}: megatron-kd {name} has no action {unknown[0]!r} "
                    f"({', '.join(children)})"]
        parsers = {f"{name} {a}": children[a] for a in actions}
    flags = named_flags(tokens)
    return [f"{cmd.where()}: megatron-kd {label} has no flag {flag!r}"
            for label, p in parsers.items() for flag in flags if flag not in parser_options(p)]




# Where the documents point: relative links, and code spans naming a file of this repository
# (``megatron_kd/loss/fused.py``, ``tests/unit/test_loss.py::test_x``, ``tests/*/test_cache_*.py``)
# or a module of the package (``megatron_kd.loss.vocab_parallel_kd_loss``).
LINK = re.compile(r"\]\(([^)\s]+)\)")
CODE_SPAN = re.compile(r"`([^`\n]+)`")
REPO_PATH = re.compile(r"^(?:megatron_kd|tests|tools|examples|patches|docs|\.ci)/[\w./*-]*$")
MODULE = re.compile(r"^megatron_kd(?:\.\w+)+$")


@dataclass
class Reference:
    file: str
    line: int
    target: str

    def where(self) -> str:
        return f"{os.path.relpath(self.file, ROOT)}:{self.line}"


def _markdown_documents() -> list[str]:
    return [p for p in _documents() if p.endswith(".md")
            and os.path.relpath(p, ROOT).split(os.sep)[0] in ("README.md", "docs")]


def documented_references() -> tuple[list[Reference], list[Reference], list[Reference]]:
    """``(relative links, repository paths, package modules)`` the README and ``docs/`` name,
    outside fenced blocks."""
    links, paths, modules = [], [], []
    for path in _markdown_documents():
        with open(path, encoding="utf-8") as f:
            raw = f.read().splitlines()
        inside = False
        for i, line in enumerate(raw, 1):
            if FENCE.match(line):
                inside = not inside
                continue
            if inside:
                continue
            for target in LINK.findall(line):
                if not re.match(r"^[a-z]+:", target):
                    links.append(Reference(path, i, target))
            for span in CODE_SPAN.findall(line):
                span = span.strip()
                if REPO_PATH.match(span.split("::")[0]):
                    paths.append(Reference(path, i, span.split("::")[0]))
                elif MODULE.match(span):
                    modules.append(Reference(path, i, span))
    return links, paths, modules


def anchors(path: str) -> set[str]:
    """The anchors GitHub makes of a Markdown file's headings: lower case, punctuation (code
    marks included) dropped, spaces as hyphens."""
    with open(path, encoding="utf-8") as f:
        lines = f.read().splitlines()
    out, inside = set(), False
    for line in lines:
        if FENCE.match(line):
            inside = not inside
        elif not inside and line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            out.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return out


def check_link(ref: Reference) -> list[str]:
    """A relative link names a file that exists and, after ``#``, one of its headings."""
    target, _, anchor = ref.target.partition("#")
    full = os.path.normpath(os.path.join(os.path.dirname(ref.file), target)) if target \
        else ref.file
    if not os.path.exists(full):
        return [f"{ref.where()}: the link {ref.target!r} goes nowhere"]
    if anchor and (not full.endswith(".md") or anchor not in anchors(full)):
        return [f"{ref.where()}: the link {ref.target!r} names no heading of "
                f"{target or 'this file'}"]
    return []


def check_path(ref: Reference) -> list[str]:
    pattern = os.path.join(ROOT, ref.target.rstrip("/"))
    found = glob.glob(pattern) if "*" in pattern else os.path.exists(pattern)
    return [] if found else [f"{ref.where()}: no {ref.target!r} in the repository"]


def check_module(ref: Reference) -> list[str]:
    """A dotted name: packages and modules down to a module; past a package, a name its
    ``__init__.py`` defines or imports; past a module, an attribute it mentions."""
    parts = ref.target.split(".")
    here = ROOT
    for k, part in enumerate(parts):
        package, module = os.path.join(here, part), os.path.join(here, part + ".py")
        if os.path.isdir(package) and os.path.exists(os.path.join(package, "__init__.py")):
            here = package
            continue
        source = module if os.path.exists(module) else os.path.join(here, "__init__.py")
        names = parts[k + 1:] if source == module else parts[k:]
        if source != module and k == 0:
            break
        with open(source, encoding="utf-8") as f:
            text = f.read()
        if not names or re.search(rf"\b{re.escape(names[0])}\b", text):
            return []
        break
    else:
        return []
    return [f"{ref.where()}: no {ref.target!r} in the package"]
