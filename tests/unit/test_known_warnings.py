"""The known third-party warnings (``megatron_kd.known_warnings``) in one process: each listed
message is filtered from each of its modules and from nowhere else, an unlisted one still shows,
``-W`` / ``PYTHONWARNINGS`` / ``--verbose`` turn the filters off, and our own code gives no cause
for the filters that would hide it too. The real commands' output: tests/e2e/test_quiet_output.py.
"""

import ast
import logging
import os
import sys
import warnings

import pytest

from megatron_kd import known_warnings as kw

PACKAGE = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "megatron_kd")


@pytest.fixture
def clean(monkeypatch):
    """No -W / PYTHONWARNINGS, no GPU; the warnings filters and the loggers' filters restored
    after the test (install() changes both for the whole process)."""
    monkeypatch.setenv("PYTHONWARNINGS", "")  # so that undo also drops what show_all() sets
    monkeypatch.delenv("PYTHONWARNINGS")
    monkeypatch.setattr(sys, "warnoptions", [])
    monkeypatch.setattr(kw, "gpu_visible", lambda: False)
    loggers = [logging.getLogger(k.logger) for k in kw.KNOWN_LOG_RECORDS]
    before = [list(lg.filters) for lg in loggers]
    for lg in loggers:  # a clean start: an earlier test in this process may have installed them
        lg.filters[:] = [f for f in lg.filters if not isinstance(f, kw._DropKnown)]
    with warnings.catch_warnings():
        yield
    for lg, filters in zip(loggers, before):
        lg.filters[:] = filters


def _shown(message: str, category=UserWarning, module: str = "some.module") -> bool:
    """Whether a warning with this message, attributed to ``module``, would print now."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.warn_explicit(message, category, "x.py", 1, module=module, registry={})
    return bool(seen)


def _logged(logger_name: str, message: str) -> bool:
    """Whether a WARNING record with this message on this logger reaches a handler."""
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger(logger_name)
    logger.addHandler(handler)
    try:
        logger.warning(message)
    finally:
        logger.removeHandler(handler)
    return bool(records)


def test_every_known_warning_is_filtered_from_its_modules_only(clean):
    warnings.simplefilter("always")
    assert kw.install()
    for known in kw.KNOWN_WARNINGS:
        printed = known.message + " (the rest of the message)"
        for module in known.modules:
            assert not _shown(printed, known.category, module), (known.message, module)
        # the same text from a module not listed, a parent or a child module, another category
        assert _shown(printed, known.category, "megatron_kd.training.trainer")
        assert _shown(printed, known.category, known.modules[0].rsplit(".", 1)[0] + ".other")
        assert _shown(printed, known.category, known.modules[0] + ".child")
        other = DeprecationWarning if known.category is not DeprecationWarning else UserWarning
        assert _shown(printed, other, known.modules[0])
        # a message that only shares the module
        assert _shown("an unknown warning", known.category, known.modules[0])


def test_every_known_log_record_is_dropped_and_only_it(clean):
    assert kw.install()
    for known in kw.KNOWN_LOG_RECORDS:
        assert not _logged(known.logger, known.message + " and the rest")
        assert _logged(known.logger, "an unknown message")
        assert _logged(known.logger + ".child", known.message)  # another logger's record


def test_installing_twice_is_once(clean):
    kw.install()
    filters, log_filters = list(warnings.filters), [
        len(logging.getLogger(k.logger).filters) for k in kw.KNOWN_LOG_RECORDS]
    kw.install()
    assert warnings.filters == filters
    assert [len(logging.getLogger(k.logger).filters)
            for k in kw.KNOWN_LOG_RECORDS] == log_filters


def test_cpu_only_warnings_show_when_a_gpu_is_visible(clean, monkeypatch):
    monkeypatch.setattr(kw, "gpu_visible", lambda: True)
    warnings.simplefilter("always")
    kw.install()
    assert any(k.cpu_only for k in kw.KNOWN_WARNINGS)
    assert any(not k.cpu_only for k in kw.KNOWN_WARNINGS)
    for known in kw.KNOWN_WARNINGS:
        assert _shown(known.message, known.category, known.modules[0]) == known.cpu_only


@pytest.mark.parametrize("how", ["PYTHONWARNINGS", "-W", "--verbose"])
def test_the_users_choice_turns_the_filters_off(clean, monkeypatch, how):
    if how == "PYTHONWARNINGS":
        monkeypatch.setenv("PYTHONWARNINGS", "default")
    elif how == "-W":
        monkeypatch.setattr(sys, "warnoptions", ["default"])
    else:
        kw.show_all()  # sets PYTHONWARNINGS=default for the processes this one starts
        assert os.environ["PYTHONWARNINGS"] == "default"
    warnings.simplefilter("always")
    assert not kw.install()
    known = kw.KNOWN_WARNINGS[0]
    assert _shown(known.message, known.category, known.modules[0])
    assert _logged(kw.KNOWN_LOG_RECORDS[0].logger, kw.KNOWN_LOG_RECORDS[0].message)


def test_verbose_shows_deprecations_and_leaves_the_users_choice(clean, monkeypatch):
    kw.show_all()
    assert _shown("a deprecation", DeprecationWarning)  # hidden by Python's defaults
    monkeypatch.setenv("PYTHONWARNINGS", "error")
    kw.show_all()
    assert os.environ["PYTHONWARNINGS"] == "error"


@pytest.mark.parametrize("value", ["", "-1", " "])
def test_hidden_gpus_are_no_gpu(monkeypatch, value):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", value)
    assert not kw.gpu_visible()


def test_a_known_warning_needs_a_message_and_modules():
    with pytest.raises(ValueError, match="modules=()"):
        kw.KnownWarning(message="x", category=UserWarning, modules=(), seen_in="v", why="w")
    with pytest.raises(ValueError, match="message=''"):
        kw.KnownLogRecord(logger="a", message="", seen_in="v", why="w")


# Filters that name torch's own wrapper (or our CPU shim) as the module would hide the same
# warning from our code: our code must not be a caller.
_NOT_OURS = {"all_gather_into_tensor", "reduce_scatter_tensor", "ShardedTensor"}


# megatron_kd/collectives.py names the old collectives only for a torch without the new ones
_BRIDGE = "collectives.py"


def _our_uses(names: set[str]) -> list[str]:
    found = []
    for directory, _, files in os.walk(os.path.normpath(PACKAGE)):
        for file in sorted(files):
            if not file.endswith(".py") or file == _BRIDGE:
                continue
            path = os.path.join(directory, file)
            with open(path, encoding="utf-8") as f:
                tree = ast.parse(f.read())
            for node in ast.walk(tree):
                name = (node.attr if isinstance(node, ast.Attribute)
                        else node.id if isinstance(node, ast.Name)
                        else None)
                if name in names:
                    found.append(f"{os.path.relpath(path, PACKAGE)}:{node.lineno}: {name}")
    return found


def test_our_code_calls_nothing_the_torch_wide_filters_hide():
    assert _our_uses(_NOT_OURS) == []


def test_the_source_check_finds_a_use(tmp_path, monkeypatch):
    (tmp_path / "m.py").write_text("import torch.distributed as dist\n"
                                   "dist.all_gather_into_tensor(a, b)\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", str(tmp_path))
    assert _our_uses(_NOT_OURS) == ["m.py:2: all_gather_into_tensor"]


def test_verbose_after_an_earlier_install_shows_the_log_records_again(clean):
    # one process running two commands (the tests do; so may a user's script)
    assert kw.install()
    known = kw.KNOWN_LOG_RECORDS[0]
    assert not _logged(known.logger, known.message)
    kw.show_all()
    assert _logged(known.logger, known.message)
