"""Shared fixtures: a module-scoped pool of gloo ranks (see megatron_kd.testing), a tokenizer and
a little corpus; the test tiers as markers (see ``pytest.ini``); skips that must fail where what
they wait for is promised (``support.skips.MUST_RUN``).

Helpers that several test modules use live in ``tests/support/`` (importable as ``support``,
also inside gloo worker processes): no test module imports another.
"""

import os

import pytest
from support.skips import must_run
from support.text import TEXT, write_tokenizer
from support.workers import machine_worker_count

from megatron_kd.testing import DistPool

_TIERS = ("unit", "dist", "e2e", "gpu")


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist's (the test extra installs it)
def pytest_xdist_auto_num_workers(config):
    """``-n auto`` (the README's test command): a worker per core, fewer where the memory would
    not hold them (``support.workers``). Most tests start processes that wait on each other
    (ranks, replicas, Slurm), so one module at a time leaves cores idle: on 2 cores two workers
    took the suite from 16.7 to 11.8 min."""
    return machine_worker_count()


def _failed_if_must_run(report) -> None:
    """Turn ``report``, a skip that :func:`must_run` names, into a failure saying why."""
    if not report.skipped or hasattr(report, "wasxfail"):
        return
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    reason = reason.removeprefix("Skipped: ")
    why = must_run(reason)
    if why is not None:
        report.outcome = "failed"
        report.longrepr = f"a skip that must not happen ({why}): {reason}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    _failed_if_must_run(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield  # a module-level importorskip skips the whole module here
    _failed_if_must_run(outcome.get_result())


def pytest_collection_modifyitems(config, items):
    """Mark every test with its tier: the folder it lives in."""
    for item in items:
        parts = os.path.normpath(str(item.fspath)).split(os.sep)
        for tier in _TIERS:
            if tier in parts[-2:-1]:
                item.add_marker(getattr(pytest.mark, tier))


@pytest.fixture(scope="module")
def dist_pool_factory(tmp_path_factory):
    """``dist_pool_factory(n)``: a pool of n gloo ranks, started once per test module."""
    pools: dict[int, DistPool] = {}

    def get(world_size: int) -> DistPool:
        if world_size not in pools:
            pools[world_size] = DistPool(world_size, tmp_path_factory.mktemp(f"dist{world_size}"))
        return pools[world_size]

    yield get
    for pool in pools.values():
        pool.close()


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory):
    """A small BPE ``tokenizer.json`` trained on :data:`support.text.TEXT`."""
    pytest.importorskip("tokenizers")
    return write_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer.json")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A directory of three text files."""
    d = tmp_path_factory.mktemp("text")
    for i in range(3):
        (d / f"part{i}.txt").write_text(TEXT * 8, encoding="utf-8")
    return str(d)
