"""Fixtures of the end-to-end tier."""

import pytest
from support.train_cases import TEACHER_ARCH, case_make_teacher

from megatron_kd.testing.replicas import Replica


@pytest.fixture(scope="module")
def pool(dist_pool_factory):
    """Two gloo ranks for the module (a module may define its own ``pool``)."""
    return dist_pool_factory(2)


@pytest.fixture(scope="module")
def teacher(pool, tmp_path_factory):
    """The tiny teacher's checkpoint (``support.train_cases.TEACHER_ARCH``), made by ``pool``."""
    d = str(tmp_path_factory.mktemp("teacher") / "ckpt")
    pool.run(case_make_teacher, d, TEACHER_ARCH)
    return d


@pytest.fixture
def replicas(tmp_path):
    """``start(teacher, tp=1, pp=1, count=None, wait=True)``: a teacher replica (``megatron-kd
    teacher serve``) at the directory endpoint ``tmp_path/endpoint``, or a list of ``count`` of
    them started together (their start-ups overlap); with ``wait=False`` it returns at once
    (call ``wait_ready()`` before use). Every one started is stopped after the test."""
    started = []

    def start(teacher, count=None, wait=True, **kw):
        new = [Replica(tmp_path / "endpoint", teacher, wait=False,
                       log=tmp_path / f"replica{len(started) + i}.jsonl", **kw)
               for i in range(count or 1)]
        started.extend(new)
        for replica in new if wait else ():
            replica.wait_ready()
        return new if count is not None else new[0]

    yield start
    for replica in started:
        replica.stop()
