"""The figures the docs quote from ``megatron-kd plan`` are its output, regenerated here.

Three kinds, each found by its form in the page:

* **a plan's output**: a fenced ``console`` block whose first line is ``$ megatron-kd plan ...``
  (backslash continuations allowed; optionally piped to one ``grep -E 'PATTERN'``), the rest the
  output as printed. The command runs here (the CLI's ``main``, in-process: the planner is pure
  Python) and its lines, filtered as the pipe says, must be the block's exactly; a line ``...``
  stands for any lines (the page leaves them out).
* **a table of ``tools/plan_examples.py``**: the table after a line
  ``<!-- tools/plan_examples.py: NAME -->`` is the script's table ``NAME``, regenerated.
* **a figure in the prose** of the recipes and docs/planner.md: every ``N GiB`` and ``N%`` is one
  of the page's regenerated figures (as printed, or rounded to fewer decimals; the sign of a
  difference dropped). A page's figure that no block or table of the page prints fails here.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import io
import os
import re
import shlex
import sys
from dataclasses import dataclass

import pytest

from megatron_kd.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
#: Pages that quote the planner, and those of them whose prose figures are all the planner's.
PAGES = ["README.md", "docs/planner.md", "docs/recipes/qwen3.5-35b-a3b-to-9b.md",
         "docs/recipes/llama-3.1-8b-to-3.2-3b.md",
         "docs/recipes/llama-3.1-8b-and-70b-to-3.2-3b.md"]
PROSE_CHECKED = PAGES[1:]
FENCE = re.compile(r"^```+\s*([\w-]*)\s*$")
TABLE_MARK = re.compile(r"^<!-- tools/plan_examples\.py: (\w+) -->$")
ELISION = "..."


@dataclass(frozen=True)
class PlanBlock:
    page: str
    line: int
    argv: tuple[str, ...]
    pattern: str | None
    expected: tuple[str, ...]

    def __str__(self) -> str:
        return f"{self.page}:{self.line}"


def _read(page: str) -> list[str]:
    with open(os.path.join(ROOT, page), encoding="utf-8") as f:
        return f.read().splitlines()


def _fenced_blocks(lines: list[str]):
    """``(line number of the first line inside, language, lines)`` of each fenced block, its
    lines less the fence's indent (a block inside a list item)."""
    at = 0
    while at < len(lines):
        fence = FENCE.match(lines[at].strip())
        if not fence:
            at += 1
            continue
        indent = len(lines[at]) - len(lines[at].lstrip())
        end = next(i for i in range(at + 1, len(lines)) if lines[i].strip().startswith("```"))
        yield at + 2, fence.group(1), [line[indent:] if line[:indent].isspace() else line
                                       for line in lines[at + 1:end]]
        at = end + 1


def _command(text: str) -> tuple[tuple[str, ...], str | None]:
    """The plan's flags and the ``grep -E`` pattern of ``megatron-kd plan FLAGS [| grep -E P]``."""
    command, _, pipe = text.partition(" | ")
    words = shlex.split(command)
    assert words[:2] == ["megatron-kd", "plan"], text
    if not pipe:
        return tuple(words[2:]), None
    grep = shlex.split(pipe)
    assert grep[:2] == ["grep", "-E"] and len(grep) == 3, f"one `grep -E 'P'` only: {pipe!r}"
    return tuple(words[2:]), grep[2]


def plan_blocks(page: str) -> list[PlanBlock]:
    out = []
    for first, language, body in _fenced_blocks(_read(page)):
        if not body or not body[0].startswith("$ megatron-kd plan"):
            continue
        assert language == "console", f"{page}:{first}: a plan's output is a console block"
        text, i = body[0][2:], 0
        while text.endswith("\\"):
            i += 1
            text = text[:-1] + " " + body[i].strip()
        argv, pattern = _command(text)
        out.append(PlanBlock(page, first, argv, pattern, tuple(body[i + 1:])))
    return out


@functools.lru_cache(maxsize=None)
def plan_output(argv: tuple[str, ...]) -> list[str]:
    """``megatron-kd plan ARGV``'s lines (each plan once: blocks and figures share them)."""
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(["plan", *argv]) == 0, argv
    return buf.getvalue().splitlines()


def _filtered(block: PlanBlock) -> list[str]:
    lines = plan_output(block.argv)
    if block.pattern is None:
        return lines
    return [line for line in lines if re.search(block.pattern, line)]


def matches(expected: list[str] | tuple[str, ...], actual: list[str]) -> bool:
    """Whether ``actual`` is ``expected`` with each ``...`` line standing for any lines."""
    if not expected:
        return not actual
    head, rest = expected[0], expected[1:]
    if head.strip() == ELISION:
        return any(matches(rest, actual[i:]) for i in range(len(actual) + 1))
    return bool(actual) and actual[0] == head and matches(rest, actual[1:])


def _plan_examples():
    if "plan_examples" not in sys.modules:
        path = os.path.join(ROOT, "tools", "plan_examples.py")
        spec = importlib.util.spec_from_file_location("plan_examples", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules["plan_examples"] = module
        spec.loader.exec_module(module)
    return sys.modules["plan_examples"]


_TABLES: dict[str, list[str]] = {}


def example_tables() -> dict[str, list[str]]:
    if not _TABLES:
        _TABLES.update(_plan_examples().tables())
    return _TABLES


def marked_tables(page: str) -> list[tuple[int, str, list[str]]]:
    """``(line, NAME, the table's lines)`` after each ``<!-- tools/plan_examples.py: NAME -->``."""
    lines, out = _read(page), []
    for i, line in enumerate(lines):
        mark = TABLE_MARK.match(line.strip())
        if mark:
            table = []
            for row in lines[i + 1:]:
                if not row.startswith("|"):
                    break
                table.append(row)
            out.append((i + 1, mark.group(1), table))
    return out


ALL_BLOCKS = [b for page in PAGES for b in plan_blocks(page)]
ALL_TABLES = [(page, *t) for page in PAGES for t in marked_tables(page)]


def test_the_pages_quote_the_planner_in_checked_forms():
    pages = {b.page for b in ALL_BLOCKS} | {t[0] for t in ALL_TABLES}
    assert pages == set(PAGES), set(PAGES) - pages
    assert {t[2] for t in ALL_TABLES} == set(example_tables())  # every table is in a page


@pytest.mark.parametrize("block", ALL_BLOCKS, ids=str)
def test_a_plans_output_is_as_quoted(block):
    actual = _filtered(block)
    assert matches(block.expected, actual), (
        f"{block}: the page quotes, then `megatron-kd plan` prints now:\n"
        + "\n".join(block.expected) + "\n----\n" + "\n".join(actual))


@pytest.mark.parametrize("page, line, name, table", ALL_TABLES,
                         ids=[f"{t[0]}:{t[1]}" for t in ALL_TABLES])
def test_a_plan_examples_table_is_as_quoted(page, line, name, table):
    assert name in example_tables(), f"{page}:{line}: tools/plan_examples.py has no {name!r}"
    want = example_tables()[name]
    assert table == want, f"{page}:{line}: regenerate with python tools/plan_examples.py:\n" + \
        "\n".join(want)


# A figure of the prose: a number and its unit (a thousands separator allowed).
PROSE_FIGURE = re.compile(r"(?<![\w.,])(\d{1,3}(?:,\d{3})+|\d+(?:\.\d+)?)\s?(GiB|%)")
NUMBER = re.compile(r"\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?")


def _prose(page: str) -> list[tuple[int, str]]:
    """The page's lines outside fenced blocks, tables and HTML comments."""
    lines, out, inside = _read(page), [], False
    for i, line in enumerate(lines, 1):
        if line.strip().startswith("```"):
            inside = not inside
            continue
        if not inside and not line.startswith("|") and not line.startswith("<!--"):
            out.append((i, line))
    return out


def _printed_numbers(page: str) -> set[float]:
    """Every number the page's regenerated blocks and tables print (signs dropped)."""
    text = [line for b in plan_blocks(page) for line in plan_output(b.argv)]
    text += [row for _, name, _ in marked_tables(page) for row in example_tables()[name]]
    return {float(n.replace(",", "")) for line in text for n in NUMBER.findall(line)}


def _printed(figure: str, numbers: set[float]) -> bool:
    """``figure`` (as the page writes it) is one of ``numbers``, as printed or rounded."""
    decimals = len(figure.partition(".")[2])
    value = float(figure.replace(",", ""))
    return any(abs(round(n, decimals) - value) < 1e-9 for n in numbers)


@pytest.mark.parametrize("page", PROSE_CHECKED)
def test_the_prose_figures_are_the_plans(page):
    numbers = _printed_numbers(page)
    missing = [f"{page}:{i}: {m.group(0)}" for i, line in _prose(page)
               for m in PROSE_FIGURE.finditer(line) if not _printed(m.group(1), numbers)]
    assert not missing, "figures no regenerated block or table of the page prints:\n" + \
        "\n".join(missing)


@pytest.mark.parametrize("expected, actual, ok", [
    (["a", "...", "d"], ["a", "b", "c", "d"], True),
    (["a", "...", "d"], ["a", "d"], True),
    (["a", "d"], ["a", "b", "d"], False),
    (["a", "c"], ["a", "b"], False),
    (["..."], [], True),
])
def test_an_elision_stands_for_any_lines(expected, actual, ok):
    assert matches(expected, actual) is ok


def test_a_changed_figure_is_found(tmp_path, monkeypatch):
    """A page quoting 123.1 GiB where the plan prints 123.7 fails, naming the line."""
    doc = tmp_path / "docs" / "page.md"
    doc.parent.mkdir()
    argv = ("--teacher qwen3.5-35b-a3b --student qwen3.5-9b --gpu h200-141g --nodes 1 "
            "--seq-length 8192 --use-distributed-optimizer --modes colocated-fused")
    doc.write_text(f"# p\n\n```console\n$ megatron-kd plan {argv} | grep -E '^=='\n"
                   "== colocated-fused: fits: 123.1 of 133.4 GiB (140.4 less the headroom), "
                   "56,398 tokens/s\n```\n\nIt needs 123.1 GiB.\n", encoding="utf-8")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", str(tmp_path))
    (block,) = plan_blocks("docs/page.md")
    assert block.line == 4 and block.pattern == "^=="
    assert not matches(block.expected, _filtered(block))
    assert matches([line.replace("123.1", "123.7") for line in block.expected], _filtered(block))
    numbers = _printed_numbers("docs/page.md")
    assert not _printed("123.1", numbers) and _printed("123.7", numbers) and _printed("124",
                                                                                     numbers)
