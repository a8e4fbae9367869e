"""Fixtures of the end-to-end tier."""

import pytest
from support.service import Replica


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
