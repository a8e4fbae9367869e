"""The documented commands use flags the CLI has: every ``megatron-kd`` (or ``python -m
megatron_kd``) command in the README, ``docs/`` and ``examples/`` (fenced shell blocks of the
Markdown files, and the shell scripts themselves) names a command that exists and only options
its parser defines, spelled out in full; the ``--kd-*`` flags given to Megatron-LM's
``pretrain_gpt.py`` are ones our hooks add. A renamed flag fails here, naming the file and line.
The README and ``docs/`` also point only at what exists: relative links (and their headings),
repository paths and package modules named in code spans.

What the commands do is run by the tests beside them (``test_user_loop.py`` runs the README's
loop, the Slurm and Megatron-LM tiers run the examples).
"""

from __future__ import annotations

import argparse
import os
import re
import shlex

import pytest
from support import docs_commands
from support.docs_commands import (
    ROOT,
    check_command,
    check_link,
    check_module,
    check_path,
    documented_commands,
    documented_references,
    named_flags,
    parser_options,
)

from megatron_kd.cli import _load

README_MAX_LINES = 250  # a newcomer's five minutes; the depth is in docs/


def _kd_flags() -> set[str]:
    from megatron_kd.megatron_lm import extra_args_provider

    parser = argparse.ArgumentParser()
    extra_args_provider(parser)
    return {o for o in parser_options(parser) if o.startswith("--kd-")}


def test_documents_have_commands():
    ours, megatron_lm = documented_commands()
    files = {os.path.relpath(c.file, ROOT) for c in ours}
    assert "README.md" in files and len(ours) >= 10
    assert megatron_lm  # the Megatron-LM examples


def test_documented_megatron_kd_commands_use_existing_flags():
    ours, _ = documented_commands()
    problems = [p for cmd in ours for p in check_command(cmd)]
    assert not problems, "\n".join(problems)


def test_documented_pretrain_gpt_kd_flags_exist():
    _, megatron_lm = documented_commands()
    kd = _kd_flags()
    problems = [f"{cmd.where()}: our Megatron-LM hooks add no flag {flag!r}"
                for cmd in megatron_lm
                for flag in named_flags(cmd.tokens) if flag.startswith("--kd-") and flag not in kd]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("text, problem", [
    ("megatron-kd import-hf --hf-path a --save b --pad-for-tp 2", "no flag '--pad-for-tp'"),
    ("megatron-kd cache bild --out x", "has no action 'bild'"),
    ("torchrun -m megatron_kd train --kd-teacher-lod t", "no flag '--kd-teacher-lod'"),
    ("megatron-kd exportt --load a", "no command 'exportt'"),
])
def test_a_renamed_flag_is_found(tmp_path, monkeypatch, text, problem):
    doc = tmp_path / "README.md"
    doc.write_text(f"intro\n\n```bash\n{text}\n```\n", encoding="utf-8")
    monkeypatch.setattr(docs_commands, "_documents", lambda: [str(doc)])
    ours, _ = documented_commands()
    assert len(ours) == 1
    (found,) = check_command(ours[0])
    assert problem in found and "README.md:4: " in found


def test_documents_point_at_what_exists():
    links, paths, modules = documented_references()
    assert len(links) >= 20 and len(paths) >= 50 and modules
    problems = ([p for r in links for p in check_link(r)]
                + [p for r in paths for p in check_path(r)]
                + [p for r in modules for p in check_module(r)])
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("text, problem", [
    ("see [the loss](docs/los.md)", "the link 'docs/los.md' goes nowhere"),
    ("see [the loss](README.md#no-such-heading)", "names no heading"),
    ("in `megatron_kd/loss/fusedd.py`", "no 'megatron_kd/loss/fusedd.py' in the repository"),
    ("in `tests/*/test_no_such_*.py`", "no 'tests/*/test_no_such_*.py'"),
    ("call `megatron_kd.loss.no_such_function`", "no 'megatron_kd.loss.no_such_function'"),
    ("call `megatron_kd.no_such_module.f`", "no 'megatron_kd.no_such_module.f'"),
])
def test_a_broken_reference_is_found(tmp_path, monkeypatch, text, problem):
    doc = tmp_path / "README.md"
    doc.write_text(f"# Title\n\n{text}\n", encoding="utf-8")
    monkeypatch.setattr(docs_commands, "_markdown_documents", lambda: [str(doc)])
    monkeypatch.setattr(docs_commands, "ROOT", ROOT)
    links, paths, modules = documented_references()
    found = ([p for r in links for p in check_link(r)] + [p for r in paths for p in check_path(r)]
             + [p for r in modules for p in check_module(r)])
    assert len(found) == 1 and problem in found[0] and "README.md:3: " in found[0], found


def test_the_readme_is_short_and_links_every_docs_page():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        text = f.read()
    assert text.count("\n") <= README_MAX_LINES
    pages = sorted(os.listdir(os.path.join(ROOT, "docs")))
    unlinked = [p for p in pages if p.endswith(".md") and f"](docs/{p})" not in text]
    assert not unlinked, f"docs pages the README does not link: {unlinked}"


# ---- the documented `sbatch examples/slurm/...` lines set what their script requires ----------

#: ``${NAME:?message}`` in a script: a variable the script stops without.
REQUIRED = re.compile(r"\$\{([A-Z][A-Z0-9_]*):\?([^}]*)\}")
#: What ``disaggregated.sbatch`` stops without besides (its ``kd_log "set KD_TEACHER_ENDPOINT
#: ... or KD_TEACHER_NODES / KD_TEACHER_TASKS"``, not a ``:?``): one of these.
ONE_OF = {"disaggregated.sbatch": ("KD_TEACHER_ENDPOINT", "KD_TEACHER_NODES",
                                   "KD_TEACHER_TASKS")}
SBATCH_SCRIPT = re.compile(r"(?:^|/)examples/slurm/(\w+\.sbatch)$")


def script_requirements(script: str) -> tuple[set[str], set[str]]:
    """``(always, without_args_file)``: the variables ``examples/slurm/SCRIPT`` stops without,
    read from its ``${NAME:?set NAME ...}`` lines: those whose message offers ``KD_ARGS_FILE``
    instead are needed only without one; a message that does not start with "set" is a
    condition of another setting (``KD_TEACHER_TASKS``: a one-job run on one node) and not
    counted."""
    with open(os.path.join(ROOT, "examples", "slurm", script), encoding="utf-8") as f:
        text = f.read()
    always, without = set(), set()
    for name, message in REQUIRED.findall(text):
        if not message.startswith(f"set {name}"):
            continue
        (without if "KD_ARGS_FILE" in message else always).add(name)
    return always, without


def _sbatch_lines(path: str) -> list[tuple[int, str]]:
    """``(line, text)`` of each ``sbatch`` command of a Markdown page: fenced shell blocks (a
    console prompt dropped, continuations joined, output lines included: a plan prints its
    ``sbatch`` lines) and inline code spans, which may wrap."""
    with open(path, encoding="utf-8") as f:
        raw = f.read().splitlines()
    out, inside, shell, prose = [], False, False, []
    pending, start = "", 0
    for i, line in enumerate(raw, 1):
        fence = re.match(r"^\s*```+\s*([\w-]*)", line)
        if fence:
            inside, shell = not inside, fence.group(1).lower() in docs_commands.SHELL_LANGS
            continue
        if not inside:
            prose.append((i, line))
            continue
        if not shell:
            continue
        text = re.sub(r"^\s*\$\s+", "", line).strip()
        if not pending:
            start = i
        if text.endswith("\\"):
            pending += text[:-1] + " "
            continue
        out.append((start, pending + text))
        pending = ""
    paragraph_text = "\n".join(f"{i}\0{line}" for i, line in prose)
    for match in re.finditer(r"`([^`]*\bsbatch\b[^`]*)`", paragraph_text):
        first = paragraph_text[:match.start()].rsplit("\n", 1)[-1].split("\0")[0]
        span = re.sub(r"\n\d+\0\s*", " ", match.group(1))
        out.append((int(first), span))
    return [(i, t) for i, t in out if re.search(r"\bsbatch\b", t)]


def sbatch_problems(path: str, line: int, text: str) -> list[str]:
    """What a documented ``[NAME=value ...] sbatch [options] examples/slurm/X.sbatch`` line
    leaves unset that X stops without."""
    try:
        words = shlex.split(text, comments=True)
    except ValueError:
        return []
    if "sbatch" not in words:
        return []
    at = words.index("sbatch")
    scripts = [SBATCH_SCRIPT.search(w) for w in words[at + 1:]]
    scripts = [m.group(1) for m in scripts if m]
    if not scripts:
        return []  # `sbatch --array ...` in prose, a script of the user's own
    given = {w.split("=", 1)[0] for w in words[:at] if re.match(r"^[A-Z][A-Z0-9_]*=", w)}
    always, without = script_requirements(scripts[0])
    needed = always | (set() if "KD_ARGS_FILE" in given else without)
    where = f"{os.path.relpath(path, ROOT)}:{line}"
    problems = [f"{where}: {scripts[0]} stops without {name} (set it"
                + (", or KD_ARGS_FILE" if name in without else "") + f"): {text}"
                for name in sorted(needed - given)]
    one_of = ONE_OF.get(scripts[0], ())
    if one_of and not given & set(one_of):
        problems.append(f"{where}: {scripts[0]} stops without one of {', '.join(one_of)}: "
                        f"{text}")
    return problems


def _sbatch_pages() -> list[str]:
    return [p for p in docs_commands._markdown_documents()
            if p.endswith(".md") and os.path.relpath(p, ROOT).split(os.sep)[0]
            in ("README.md", "docs")]


def test_the_scripts_requirements_are_read():
    assert script_requirements("disaggregated.sbatch") == (
        set(), {"KD_DATA_PATH", "KD_TOKENIZER", "KD_TEACHER_LOAD"})
    assert script_requirements("teacher.sbatch") == (set(), {"KD_TEACHER_LOAD"})
    assert script_requirements("megatron_lm.sbatch")[0] == {"MEGATRON_LM_DIR",
                                                            "KD_MEGATRON_LM_ARGS"}


def test_documented_sbatch_lines_set_what_the_script_requires():
    """Every ``sbatch examples/slurm/...`` of the README and ``docs/`` runs as written: it sets
    the variables its script stops without (``KD_ARGS_FILE``, or the ones it replaces)."""
    lines = [(p, i, t) for p in _sbatch_pages() for i, t in _sbatch_lines(p)]
    scripts = {m.group(1) for _, _, t in lines for w in t.split()
               if (m := SBATCH_SCRIPT.search(w))}
    assert {"colocated.sbatch", "teacher.sbatch", "disaggregated.sbatch"} <= scripts, scripts
    problems = [p for path, i, text in lines for p in sbatch_problems(path, i, text)]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("text, problem", [
    ("KD_TEACHER_ENDPOINT=/ep sbatch --nodes=2 examples/slurm/disaggregated.sbatch",
     "stops without KD_DATA_PATH (set it, or KD_ARGS_FILE)"),
    ("KD_ARGS_FILE=a sbatch --nodes=2 examples/slurm/disaggregated.sbatch",
     "stops without one of KD_TEACHER_ENDPOINT"),
    ("sbatch examples/slurm/megatron_lm.sbatch", "stops without KD_MEGATRON_LM_ARGS (set it)"),
    ("KD_TEACHER_ENDPOINT=/ep sbatch examples/slurm/teacher.sbatch",
     "stops without KD_TEACHER_LOAD"),
])
def test_an_incomplete_sbatch_line_is_found(tmp_path, text, problem):
    doc = tmp_path / "page.md"
    doc.write_text(f"# t\n\n```bash\n{text}\n```\n\nOr `{text}`.\n", encoding="utf-8")
    found = [p for i, t in _sbatch_lines(str(doc)) for p in sbatch_problems(str(doc), i, t)]
    # the fenced line (4) and the inline span (7), each naming what it misses
    for line in ("4", "7"):
        assert any(f"page.md:{line}: " in p and problem in p for p in found), found
    complete = {"disaggregated": "KD_ARGS_FILE=a KD_TEACHER_ENDPOINT=/ep",
                "megatron_lm": "MEGATRON_LM_DIR=m KD_MEGATRON_LM_ARGS='a b c d e'",
                "teacher": "KD_ARGS_FILE=a KD_TEACHER_ENDPOINT=/ep"}
    script = re.search(r"slurm/(\w+)\.sbatch", text).group(1)
    fixed = f"{complete[script]} sbatch examples/slurm/{script}.sbatch"
    assert sbatch_problems(str(doc), 1, fixed) == []


def test_the_docs_give_import_hfs_default_dtype():
    """What the docs say ``import-hf`` saves by default is its parser's default: the source's
    own dtype (``auto``), never fp32."""
    parser = argparse.ArgumentParser()
    _load("import-hf").add_arguments(parser)
    default = parser.get_default("params_dtype")
    assert default == "auto"
    stated, wrong = [], []
    for path in _sbatch_pages():
        with open(path, encoding="utf-8") as f:
            text = " ".join(f.read().split())
        where = os.path.relpath(path, ROOT)
        stated += [(where, m) for m in re.findall(r"`--params-dtype (\w+)`, the default", text)]
        # a sentence naming import-hf and its default: it names no fp32 as that default
        for sentence in re.split(r"(?<=[.;])\s", text):
            if "import-hf" in sentence and "default" in sentence and re.search(
                    r"\b(fp32|float32)\b[^()]*\bby default|\bdefault\w*\W+(fp32|float32)\b",
                    sentence):
                wrong.append(f"{where}: {sentence}")
    assert stated and all(m == default for _, m in stated), stated
    assert not wrong, "\n".join(wrong)
