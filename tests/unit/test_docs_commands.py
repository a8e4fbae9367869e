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
