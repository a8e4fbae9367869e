"""Fixtures of the end-to-end tier."""

import pytest
from support.service import Replica
from support.train_cases import TEACHER_ARCH, case_make_teacher


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
    """``start(teacher, tp=1, pp=1)``: a teacher replica (``megatron-kd teacher serve``) at the
    directory endpoint ``tmp_path/endpoint``; every one started is stopped after the test."""
    started = []

    def start(teacher, **kw):
        replica = Replica(tmp_path / "endpoint", teacher,
                          log=tmp_path / f"replica{len(started)}.jsonl", **kw)
        started.append(replica)
        return replica

    yield start
    for replica in started:
        replica.stop()
