"""Every GPU figure in the README and ``docs/`` is a figure of a raw run on file (issue 54).

The convention (written for writers in ``docs/gpu_runs/README.md``), as this module reads it:

* A **unit** of a page is a paragraph, a list item, or a table row. A row's unit also holds its
  table's header and the paragraph just before the table (its caption); a nested list item's,
  its parent items. Fenced code blocks and HTML comments are not read.
* A **figure** is a number with a unit: a time (``0.049 s``, ``2.7 ms``, ``6.5 minutes``), a
  ratio (``0.90x``), memory (``2.62 GiB``, ``356 MiB``, ``2.6 GB``), a share (``29.7%``) or a rate
  (``21,670 tokens/s``, ``293 TFLOP/s``, ``4 TB/s``); both ends of a range (``1.18-1.22x``)
  count, and a bare number in a table takes its column's unit (``s``, ``x floor``). Code spans
  and link targets hold none.
* A figure is a **GPU figure** when its sentence (in a table: its row or the header) or a
  heading above it names a GPU (``H200``, ``H100``, "on a GPU", "the GPU path", ...), or when its
  unit cites a run. "per GPU" (the planner's) and a preset's name (``h200-141g``) name none.
* A unit **cites** a run by linking to ``gpu_runs/<name>.json`` (the raw JSON, not its ``.md``).
  A GPU figure must be in one of the runs its unit cites: a number of the JSON (a value, or a
  number inside one of its strings, such as the benchmark's ``table_markdown``), after the
  unit's conversion (bytes to GiB, seconds to ms, a fraction to %) and rounding to the digits
  the page prints.
* Unless it is **labelled**: its sentence (for a table cell: the cell, its column's header, the
  row's first cell, the caption) says it is a prediction (``predicted``, ``prediction``,
  ``predicts``, ``planned``), an account (``account``) or a quote of another project (``quoted
  from`` and the source's name). A default setting (``default 1 GiB``) needs no label.
* A cited run must exist, and its JSON record the commit, the command, the device and the
  versions (two runs written before that rule are listed below with what they lack); a run on
  file that no page cites fails too.
* A GPU sentence that says a goal is ``met`` or ``not met`` names the goal (``<= 0.8x``, ``at
  most 0.5x``) and a measured figure: ``met`` fails when the figure is over the goal, ``not
  met`` when every figure meets it. The goal's own figure is not looked up.

The checker's own cases (a figure not in the cited run, an uncited GPU figure, a labelled
prediction, a false ``met``) run on synthetic pages below, so a checker that lets everything
through fails here too. Its limit: a figure is looked up among all the numbers of the cited
runs, not in the field it names, so a wrong figure that happens to equal another number of the
run (another repeat's time, at three digits) passes.
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
from dataclasses import dataclass, field

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RUNS = os.path.join(ROOT, "docs", "gpu_runs")


def _pages() -> list[str]:
    """The pages whose figures are checked: the README, ``docs/*.md``, ``docs/recipes/*.md``."""
    pages = ["README.md"]
    for folder in ("docs", os.path.join("docs", "recipes")):
        names = os.listdir(os.path.join(ROOT, folder))
        pages += sorted(os.path.join(folder, n) for n in names if n.endswith(".md"))
    return pages


#: Runs on file from before the rule that a run records its commit, command, device and
#: versions, with what each lacks. ``tools/bench_loss.py`` wrote them; it records all four now.
#: Their pages say what the file does not (benchmarks.md: the commit and the software).
LEGACY_RUNS = {
    "2026-12-04-h200-bench-loss-multiverse.json": {"commit", "device", "versions"},
    "2026-12-04-h200-bench-loss-qwen3.json": {"commit", "device", "versions"},
}

# --- what a page says --------------------------------------------------------------------------

#: A GPU by its model's name, or "on a GPU", "the GPU path" and their like (not "per GPU", the
#: planner's, nor a preset's name such as ``h200-141g``).
GPU = re.compile(r"\b(?:[HAB]100|H200|B200|GB200|MI300X?)\b"
                 r"|\b(?i:(?:on|of|in) (?:a|the|one|two|8|several|more than one) GPUs?"
                 r"|on GPUs|GPU (?:path|runs?|figures?|measurements?|sessions?))\b")
#: What says a figure is not a measurement: a prediction, an account, a quote of a named source.
LABEL = re.compile(r"\b(?:predicted|predictions?|predicts|planned|accounts?)\b(?<!into account)"
                   r"|\bquoted from (?:\[|`)?[A-Z0-9][\w.-]*", re.IGNORECASE)
NUM = r"\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?"
UNITS = ("GiB", "MiB", "KiB", "GB", "MB", "KB", "TB", "TB/s", "GB/s", "ms", "µs", "us", "minutes",
         "min", "s", "%", "tokens/s", "TFLOP/s")
FIGURE = re.compile(
    rf"(?<![\w.,/-])(?:~)?(?P<a>{NUM})(?:\s?(?:-|–|to)\s?(?P<b>{NUM}))?"
    rf"(?:(?P<x>x)(?![\w])|\s?(?P<unit>{'|'.join(re.escape(u) for u in UNITS)})(?![\w/]))")
#: A setting, not a measurement: a figure right after "default" ("default 1 GiB").
SETTING = re.compile(rf"\bdefault:?\s+(?:of\s+)?~?(?:{NUM})")
RUN_LINK = re.compile(r"\]\((?P<path>[^)\s#]*gpu_runs/[^)\s#]+\.json)(?:#[^)]*)?\)")
LINK_TARGET = re.compile(r"\]\([^)]*\)")
CODE_SPAN = re.compile(r"`[^`\n]*`")
SENTENCE_END = re.compile(r"(?<=[.;!?])\s+(?=\S)")
HEADING = re.compile(r"^(#{1,6})\s+(.*)$")
ITEM = re.compile(r"^(\s*)(?:[-*+]|\d+\.)\s+")
FENCE = re.compile(r"^\s*(```|~~~)")
BARE_CELL = re.compile(rf"^~?(?P<a>{NUM})(?:\s?(?:-|–)\s?(?P<b>{NUM}))?$")
COLUMN_UNIT = re.compile(r"(?<![\w/])(x|ms|s|GiB|MiB|GB|MB|%)(?![\w/])")
MET = re.compile(r"(?<![\w-])(?<!has )(?<!have )(?<!had )(not\s+)?met\b", re.IGNORECASE)
GOAL = re.compile(rf"(?:<=|≤|at most|under|within|below)\s*(?P<v>{NUM})\s?(?P<u>x|%|s|ms|GiB)"
                  rf"(?![\w])")


@dataclass(frozen=True)
class Figure:
    text: str  # as printed, for the message
    value: float
    decimals: int
    unit: str  # "x" for a ratio
    at: int = 0  # where in the text (less code spans and link targets)


@dataclass
class Unit:
    """A paragraph, list item or table row, with what the checker reads around it."""
    page: str
    line: int
    text: str
    headings: list[str] = field(default_factory=list)
    caption: str = ""  # a table row's: the paragraph before the table; a nested item's: its parent
    header: list[str] = field(default_factory=list)  # a table row's header cells
    cells: list[str] = field(default_factory=list)  # a table row's cells

    def is_gpu(self, text: str) -> bool:
        """Whether ``text`` of this unit (a sentence, or a cell) speaks of a GPU: it, its row
        and the table's header, or a heading above it names one; or the unit cites a run."""
        own = " ".join([text, *self.cells, *self.header])
        return bool(GPU.search(_prose(own)) or any(GPU.search(_prose(h)) for h in self.headings)
                    or self.cited())

    def cited(self) -> list[str]:
        """The runs this unit cites, as paths from the repository's root."""
        base = os.path.dirname(self.page)
        return [os.path.normpath(os.path.join(base, m.group("path")))
                for m in RUN_LINK.finditer(self.text + " " + self.caption)]

    def scopes(self) -> list[tuple[str, str, str]]:
        """``(text, column header, label scope)``: a prose unit's sentences, each its own scope;
        a row's cells, each with its column's header, the row's first cell and the caption."""
        if not self.cells:
            return [(s, "", s) for s in SENTENCE_END.split(self.text)]
        out = []
        for i, cell in enumerate(self.cells):
            column = self.header[i] if i < len(self.header) else ""
            out.append((cell, column, " ".join([cell, column, self.cells[0], self.caption])))
        return out


def _prose(text: str) -> str:
    """The text less code spans and link targets (a path or a flag is not a figure)."""
    return LINK_TARGET.sub("]", CODE_SPAN.sub(" ", text))


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def units(page: str, text: str) -> list[Unit]:
    """The page's units, in order."""
    lines = text.splitlines()
    out: list[Unit] = []
    headings: list[tuple[int, str]] = []
    para: list[str] = []
    para_line = 0
    last_para = ""
    items: list[tuple[int, str]] = []  # the open list items above this one: (indent, text)
    indent = -1  # this paragraph's, when it is a list item
    in_fence = in_comment = False

    def flush() -> None:
        nonlocal para, last_para, items
        if para:
            text = " ".join(s.strip() for s in para)
            parent = ""
            if indent >= 0:
                items = [(n, t) for n, t in items if n < indent]
                parent = " ".join(t for _, t in items)
                items.append((indent, text))
            out.append(Unit(page, para_line, text, [h for _, h in headings], parent))
            last_para = text
        para = []

    at = 0
    while at < len(lines):
        line = lines[at]
        stripped = line.strip()
        if in_fence:
            in_fence = not FENCE.match(line)
            at += 1
            continue
        if in_comment or stripped.startswith("<!--"):
            in_comment = "-->" not in stripped
            at += 1
            continue
        if FENCE.match(line):
            flush()
            in_fence = True
        elif not stripped:
            flush()
        elif heading := HEADING.match(stripped):
            flush()
            items = []
            level = len(heading.group(1))
            headings = [(n, h) for n, h in headings if n < level] + [(level, heading.group(2))]
            last_para = ""
        elif stripped.startswith("|"):
            flush()
            header = _cells(stripped)
            at += 2  # the header and its |---| line
            while at < len(lines) and lines[at].strip().startswith("|"):
                cells = _cells(lines[at])
                out.append(Unit(page, at + 1, " ".join(cells), [h for _, h in headings],
                                last_para, header, cells))
                at += 1
            continue
        elif item := ITEM.match(line):
            flush()
            para, para_line, indent = [ITEM.sub("", line, count=1)], at + 1, len(item.group(1))
        else:
            if not para:
                para_line, indent = at + 1, -1
                if line[:1] != " ":
                    items = []  # a paragraph of its own ends the list
            para.append(line)
        at += 1
    flush()
    return out


def _figure(number: str, unit: str, at: int) -> Figure:
    digits = number.replace(",", "")
    return Figure(f"{number}{unit if unit in ('x', '%') else ' ' + unit}", float(digits),
                  len(digits.partition(".")[2]), unit, at)


def figures(text: str, column: str = "") -> list[Figure]:
    """The figures of ``text`` (code spans and link targets left out); a table cell that is a
    bare number takes its unit from its column's header (``s``, ``x floor``)."""
    prose = _prose(text)
    bare = BARE_CELL.match(prose.strip())
    if column and bare:
        unit = COLUMN_UNIT.search(_prose(column))
        if unit:
            return [_figure(n, unit.group(1), 0) for n in bare.group("a", "b") if n is not None]
    found = []
    for m in FIGURE.finditer(prose):
        unit = "x" if m.group("x") else m.group("unit")
        found += [_figure(m.group(g), unit, m.start(g)) for g in ("a", "b")
                  if m.group(g) is not None]
    return found


# --- what a run records ------------------------------------------------------------------------

#: A number of a run's JSON, by what its key says it is (a string's numbers by the unit printed
#: after them). ``tools/bench_loss.py`` printed GiB as "GB" and MiB as "MB" until issue 54: the
#: numbers it printed so count as GiB and MiB, never as decimal GB and MB.
STRING_UNIT = {"GB": "GiB", "GiB": "GiB", "MB": "MiB", "MiB": "MiB", "s": "s", "ms": "ms",
               "%": "%", "x": ""}
STRING_NUMBER = re.compile(rf"(?<![\w.])(?P<n>{NUM})(?:\s?(?P<u>GiB|MiB|GB|MB|ms|s|%|x)(?![\w/]))?")


def _key_unit(key: str) -> str:
    key = key.lower()
    if key.endswith("bytes"):
        return "bytes"
    if key.endswith("_us"):
        return "us"
    if key.endswith(("_s", "seconds")) and not key.endswith("_per_s") or key == "s":
        return "s"
    return ""


def _numbers(obj, key: str = ""):
    """``(value, unit)`` of every number in ``obj``: ``bytes``, ``s``, ``us``, a printed unit,
    or ``""`` for a plain number."""
    if isinstance(obj, bool) or obj is None:
        return
    if isinstance(obj, (int, float)):
        if math.isfinite(obj):
            yield float(obj), _key_unit(key)
    elif isinstance(obj, str):
        for m in STRING_NUMBER.finditer(obj):
            yield float(m.group("n").replace(",", "")), STRING_UNIT.get(m.group("u") or "", "")
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _numbers(v, str(k) if not str(k).isdigit() else key)
    elif isinstance(obj, list):
        for v in obj:
            yield from _numbers(v, key)


_G, _M = float(1 << 30), float(1 << 20)
#: For a page's unit: the run's units it may come from, each with the factor to the page's.
CONVERSIONS = {
    "s": {"": 1, "s": 1, "ms": 1e-3, "us": 1e-6},
    "ms": {"": (1, 1e3), "s": 1e3, "ms": 1, "us": 1e-3},
    "us": {"": (1, 1e6), "s": 1e6, "us": 1},
    "µs": {"": (1, 1e6), "s": 1e6, "us": 1},
    "min": {"": 1 / 60, "s": 1 / 60},
    "minutes": {"": 1 / 60, "s": 1 / 60},
    "x": {"": 1},
    "%": {"": (1, 100), "%": 1},
    "GiB": {"bytes": 1 / _G, "GiB": 1},
    "MiB": {"bytes": 1 / _M, "MiB": 1},
    "KiB": {"bytes": 1 / 1024},
    "TB": {"bytes": 1e-12},
    "GB": {"bytes": 1e-9},
    "MB": {"bytes": 1e-6},
    "KB": {"bytes": 1e-3},
    "tokens/s": {"": 1},
    "TFLOP/s": {"": 1},
    "TB/s": {"": 1},
    "GB/s": {"": 1},
}


@dataclass(frozen=True)
class Run:
    path: str  # from the repository's root
    values: dict  # run unit -> sorted values

    def has(self, fig: Figure) -> bool:
        """Whether the run holds ``fig``, rounded as the page prints it."""
        half = 0.5 * 10 ** -fig.decimals
        for unit, factors in CONVERSIONS[fig.unit].items():
            for factor in factors if isinstance(factors, tuple) else (factors,):
                if any(abs(v * factor - fig.value) <= half * (1 + 1e-9) + 1e-12
                       for v in self.values.get(unit, ())):
                    return True
        return False


def run_from_json(path: str, data) -> Run:
    values: dict[str, list[float]] = {}
    for value, unit in _numbers(data):
        values.setdefault(unit, []).append(value)
    return Run(path, {u: sorted(set(v)) for u, v in values.items()})


@functools.cache
def load_run(path: str) -> Run | None:
    full = os.path.join(ROOT, path)
    if not os.path.isfile(full):
        return None
    with open(full, encoding="utf-8") as f:
        return run_from_json(path, json.load(f))


#: Where a run records each thing it must: keys searched at the top and one level down.
RECORD_KEYS = {
    "commit": ("git_commit", "commit"),
    "command": ("command", "commands", "argv", "config"),  # config: the parsed arguments
    "device": ("device_name", "device"),
    "versions": ("torch", "versions"),
}


def missing_records(data: dict) -> set[str]:
    """What of the commit, the command, the device and the versions a run does not record (a
    device of just ``cuda`` or ``cpu`` names no device)."""
    tables = [data] + [v for v in data.values() if isinstance(v, dict)]
    missing = set()
    for what, keys in RECORD_KEYS.items():
        found = [t[k] for t in tables for k in keys if t.get(k) not in (None, "", [], {})]
        if what == "device":
            found = [v for v in found if str(v).lower() not in ("cuda", "cpu")]
        if not found:
            missing.add(what)
    return missing


# --- the check ---------------------------------------------------------------------------------

def _in_goal(fig: Figure, sentence: str) -> bool:
    """Whether ``fig`` is the goal (``<= 0.8x``) of a sentence that says it is met or not, not a
    measured figure."""
    prose = _prose(sentence)
    return bool(MET.search(prose)) and any(g.start() <= fig.at < g.end()
                                           for g in GOAL.finditer(prose))


def _is_setting(fig: Figure, sentence: str) -> bool:
    """Whether ``fig`` is a default setting (``default 1 GiB``), not a measured figure."""
    return any(m.start() <= fig.at < m.end() for m in SETTING.finditer(_prose(sentence)))


def _goal_met(sentence: str) -> str | None:
    """Why a sentence's ``met`` / ``not met`` is wrong, or None."""
    claims = list(MET.finditer(_prose(sentence)))
    if not claims:
        return None
    goals = list(GOAL.finditer(_prose(sentence)))
    if not goals:
        return "claims a target met or not met without naming the goal (<= N, at most N, ...)"
    for claim in claims:
        for goal in goals:
            limit, unit = float(goal.group("v")), goal.group("u")
            measured = [f for f in figures(sentence)
                        if f.unit == unit and not _in_goal(f, sentence)]
            if not measured:
                return f"names the goal {goal.group(0)!r} but no measured figure beside it"
            over = [f.text for f in measured if f.value > limit]
            if claim.group(1) is None and over:
                return f"says met, but {', '.join(over)} is over the goal {goal.group(0)!r}"
            if claim.group(1) is not None and not over:
                return f"says not met, but every figure meets the goal {goal.group(0)!r}"
    return None


def check_unit(unit: Unit, load=load_run) -> list[str]:
    """The problems of one unit, each naming the page, the line and the figure."""
    where = f"{unit.page}:{unit.line}"
    problems, runs = [], []
    for path in unit.cited():
        run = load(path)
        if run is None:
            problems.append(f"{where}: cites {path}, which does not exist")
        else:
            runs.append(run)
    for text, column, scope in unit.scopes():
        if not unit.is_gpu(text):
            continue
        for sentence in SENTENCE_END.split(text) if unit.cells else [text]:
            why = _goal_met(sentence)
            if why:
                problems.append(f"{where}: {why}: {sentence!r}")
        if LABEL.search(_prose(scope)):
            continue
        for fig in figures(text, column):
            if (_in_goal(fig, text) or _is_setting(fig, text)
                    or any(run.has(fig) for run in runs)):
                continue
            if unit.cited():
                problems.append(f"{where}: {fig.text} is in none of the runs it cites "
                                f"({', '.join(unit.cited())})")
            else:
                problems.append(f"{where}: {fig.text} is a GPU figure that cites no run under "
                                f"docs/gpu_runs/ and is not labelled a prediction, an account or "
                                f"a quote")
    return problems


def check_page(page: str, text: str, load=load_run) -> list[str]:
    return [p for unit in units(page, text) for p in check_unit(unit, load)]


# --- the tests ---------------------------------------------------------------------------------

def _read(page: str) -> str:
    with open(os.path.join(ROOT, page), encoding="utf-8") as f:
        return f.read()


@pytest.mark.parametrize("page", _pages())
def test_every_gpu_figure_is_in_the_run_it_cites(page):
    problems = check_page(page, _read(page))
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("name", sorted(n for n in os.listdir(RUNS) if n.endswith(".json")))
def test_every_run_records_commit_command_device_versions(name):
    with open(os.path.join(RUNS, name), encoding="utf-8") as f:
        missing = missing_records(json.load(f))
    assert missing == LEGACY_RUNS.get(name, set()), (
        f"docs/gpu_runs/{name} lacks {sorted(missing)} (docs/gpu_runs/README.md: a run records "
        f"its commit, command, device and versions)" if missing else
        f"docs/gpu_runs/{name} records everything now: drop it from LEGACY_RUNS")


def test_every_run_is_cited():
    """A run on file that no page cites is a figure nobody reads, or a citation gone stale."""
    cited = {path for page in _pages() for unit in units(page, _read(page))
             for path in unit.cited()}
    on_file = {os.path.join("docs", "gpu_runs", n) for n in os.listdir(RUNS) if n.endswith(".json")}
    assert on_file <= cited, f"not cited by any page: {sorted(on_file - cited)}"


# --- the checker catches what it must ----------------------------------------------------------

SYNTHETIC_RUN = {"header": {"git_commit": "abc", "command": "tools/bench_loss.py --device cuda",
                            "device": "NVIDIA H200", "torch": "2.11.0"},
                 "points": [{"variant": "fused_fkl", "time_s": 0.0500162,
                             "extra_peak_bytes": 2814308352,
                             "working_bytes": 1975971840}],
                 "table_markdown": "| fused_fkl | 0.050 | 1.22 | 0.90 | 2.62 GB |"}
SYNTHETIC = "docs/gpu_runs/synthetic.json"


def _check_synthetic(text: str) -> list[str]:
    run = run_from_json(SYNTHETIC, SYNTHETIC_RUN)
    return check_page("docs/page.md", text, load=lambda path: run if path == SYNTHETIC else None)


def test_checker_passes_figures_of_the_cited_run():
    assert missing_records(SYNTHETIC_RUN) == set()
    text = ("On one H200 forward KL took 0.050 s, 1.22x the floor and 0.90x Liger's, with 1.84 GiB "
            "beyond the gradients (2.62 GiB extra peak; 50.0 ms) ([run](gpu_runs/synthetic.json)).")
    assert _check_synthetic(text) == []


def test_checker_fails_a_figure_absent_from_the_cited_run():
    text = "On one H200 forward KL took 0.049 s ([run](gpu_runs/synthetic.json))."
    problems = _check_synthetic(text)
    assert len(problems) == 1 and "0.049 s is in none of the runs" in problems[0]


def test_checker_fails_decimal_gb_for_the_benchmarks_gib():
    # the benchmark printed GiB as "GB": 2.62 of them are 2.81 decimal GB
    text = "On one H200 the extra peak was 2.62 GB ([run](gpu_runs/synthetic.json))."
    assert len(_check_synthetic(text)) == 1
    assert _check_synthetic(text.replace("2.62 GB", "2.81 GB")) == []


def test_checker_fails_an_uncited_gpu_figure():
    problems = _check_synthetic("On one H200 forward KL took 0.050 s, 0.90x Liger's time.")
    assert len(problems) == 2 and all("cites no run" in p for p in problems)


def test_checker_fails_a_missing_run():
    problems = _check_synthetic("On one H200 it took 0.050 s ([run](gpu_runs/gone.json)).")
    assert any("does not exist" in p for p in problems)


def test_checker_passes_a_labelled_prediction_and_a_quote():
    text = ("On one H200 the model predicts 0.045 s, 1.10x the floor.\n\n"
            "- Forward KL on a GPU: predicted about 0.80x Liger's time.\n\n"
            "Multiverse's own H200 run (quoted from Multiverse Computing's report): 58.3 GB.\n")
    assert _check_synthetic(text) == []


def test_checker_labels_only_the_labelled_sentence():
    text = ("On one H200 forward KL took 0.050 s ([run](gpu_runs/synthetic.json)). The next "
            "design is predicted at 0.045 s. JSD took 0.060 s.")
    problems = _check_synthetic(text)
    assert len(problems) == 1 and "0.060 s" in problems[0]


def test_checker_reads_tables_by_row_caption_and_column():
    text = ("On one H200 ([run](gpu_runs/synthetic.json)):\n\n"
            "| variant | s | predicted s |\n|---|---|---|\n"
            "| fused_fkl | 0.050 | 0.045 |\n| fused_jsd | 0.061 | - |\n")
    problems = _check_synthetic(text)
    assert len(problems) == 1 and "0.061 s" in problems[0] and ":6:" in problems[0]


def test_checker_ignores_cpu_figures_and_code():
    text = ("On 2 CPU cores forward KL took 4.42 s.\n\n"
            "```bash\npython tools/bench_loss.py --device cuda  # 0.049 s\n```\n")
    assert _check_synthetic(text) == []


def test_checker_holds_a_met_claim_to_its_goal():
    cite = " ([run](gpu_runs/synthetic.json))"
    assert _check_synthetic("On one H200 the time target is met." + cite)  # no goal named
    assert _check_synthetic("On one H200 the time goal (<= 0.8x Liger's) is met: 0.90x." + cite)
    assert _check_synthetic(
        "On one H200 the time goal (<= 0.8x Liger's) is not met: 0.90x." + cite) == []
    assert _check_synthetic(
        "On one H200 the time goal (<= 1.3x the floor) is met: 1.22x." + cite) == []


def test_checker_reads_a_nested_item_through_its_parent_and_passes_a_default():
    text = ("- On one H200 ([run](gpu_runs/synthetic.json)), where the time goes:\n"
            "  - forward KL: 0.050 s.\n  - JSD: 0.061 s.\n"
            "- The GPU path's windows hold the default 1 GiB of logits.\n")
    problems = _check_synthetic(text)
    assert len(problems) == 1 and "0.061 s" in problems[0] and ":3:" in problems[0]


def test_checker_looks_up_a_bound_that_claims_no_goal():
    # "within" names a goal only beside "met": otherwise its figure is a measurement
    assert _check_synthetic("On one H200 it ran within 0.060 s ([run](gpu_runs/synthetic.json)).")
