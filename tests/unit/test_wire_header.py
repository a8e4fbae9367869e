"""The teacher -> student wire header: round trip and mismatch messages (no process group)."""


import pytest
import torch

from megatron_kd.teacher import (
    Header,
    HeaderMismatchError,
)

SHAPE = (4, 2, 8)


def _header(i, shape=SHAPE, ids=None):
    return Header(step=i // 2, microbatch=i % 2, chunk=0, num_chunks=1,
                  sample_ids=tuple(ids if ids is not None else (10 * i, 10 * i + 1)),
                  shape=shape, dtype=torch.float32)


def test_header_round_trip():
    h = _header(7, ids=(3, 99999999999))
    assert Header.decode(h.encode(4)) == h
    with pytest.raises(HeaderMismatchError, match="not a megatron_kd wire header"):
        Header.decode(torch.zeros(15, dtype=torch.int64))


def test_header_mismatch_names_both_sides():
    with pytest.raises(HeaderMismatchError,
                       match=r"sample_ids: teacher rank 5 sent \(0, 1\), student rank 2 "
                             r"expected \(0, 2\)"):
        _header(0).check_against(_header(0, ids=(0, 2)), teacher_rank=5, student_rank=2)
