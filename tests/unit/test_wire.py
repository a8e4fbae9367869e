"""The teacher wire's messages (no process group): headers round-trip, a response that does
not answer its request names both values, and the three wire element types."""

import collections

import pytest
import torch

from megatron_kd.teacher.wire import (
    HeaderMismatchError,
    Request,
    Response,
    WireError,
    decode_hidden,
    encode_hidden,
    wire_bytes_per_token,
)


def _response(**over):
    kw = dict(run=9, conn=2, request=5, step=3, microbatch=1, sample_ids=(10, 11),
              fingerprint=77, chunk=1, num_chunks=2, shape=(4, 2, 8), wire_dtype="bf16")
    kw.update(over)
    return Response(**kw)


def test_headers_round_trip():
    req = Request(run=9, conn=2, request=5, step=3, microbatch=1, sample_ids=(10, 2**40),
                  fingerprint=2**55, batch=2, seq_length=16)
    assert Request.decode(req.encode(4), 4) == req
    assert Response.decode(_response().encode(4), 4) == _response()
    with pytest.raises(WireError, match="not a megatron_kd wire header"):
        Response.decode(torch.zeros(4 + 17, dtype=torch.int64), 4)
    with pytest.raises(WireError, match="header of kind 1, expected 2"):
        Response.decode(req.encode(4), 4)


def test_mismatch_names_both_sides():
    with pytest.raises(HeaderMismatchError,
                       match=r"sample_ids: teacher replica r1 sent \(10, 11\), student rank 3 "
                             r"expected \(10, 12\)"):
        _response().check_against(_response(sample_ids=(10, 12)), replica="replica r1",
                                  student_rank=3)
    with pytest.raises(HeaderMismatchError, match=r"conn: .* sent 2, .* expected 3"):
        _response().check_against(_response(conn=3), replica="replica r1", student_rank=3)


@pytest.mark.parametrize("wire_dtype, bound", [("fp32", 0.0), ("bf16", 2 ** -8),
                                               ("fp8", 2 ** -3)])
def test_wire_dtypes(wire_dtype, bound):
    hidden = torch.randn(6, 3, 64, generator=torch.Generator().manual_seed(0)) * 5
    back = decode_hidden(encode_hidden(hidden, wire_dtype), wire_dtype, torch.float32)
    # relative to each token's largest value: bf16 keeps 8 bits of mantissa, e4m3 3 (+ the
    # per-token scale maps the largest to e4m3's largest); fp32 is exact
    err = ((back - hidden).abs() / hidden.abs().amax(-1, keepdim=True)).max()
    assert float(err) <= bound
    assert wire_bytes_per_token(64, wire_dtype) == {"fp32": 256, "bf16": 128, "fp8": 68}[wire_dtype]


@pytest.mark.parametrize("wire_dtype", ["fp32", "bf16", "fp8"])
def test_planner_counts_the_bytes_the_wire_carries(wire_dtype):
    """``megatron-kd plan``'s bytes per token are the payload the service actually sends."""
    from megatron_kd.planner import traffic

    for hidden in (1, 64, 2880, 4096):
        sent = encode_hidden(torch.zeros(1, 1, hidden), wire_dtype)
        on_wire = sum(p.numel() * p.element_size() for p in sent)
        assert traffic.wire_bytes_per_token(hidden, wire_dtype) == on_wire
        assert wire_bytes_per_token(hidden, wire_dtype) == on_wire


def test_planner_counts_the_token_ids_a_student_sends():
    from megatron_kd.planner import traffic
    from megatron_kd.teacher.client import TeacherClient

    # the client's request for one micro-batch, taken where it would go on the wire
    client = TeacherClient.__new__(TeacherClient)  # nothing connected: only the request is built
    client.member, client.next_request = 0, 0
    client.outstanding = collections.deque()
    tokens = torch.arange(6, dtype=torch.int64).reshape(2, 3)
    client.schedule = iter([(0, 0, (0, 1), tokens)])
    sent = []
    client._transmit = sent.append
    client._send_next()
    (request,) = sent
    assert request.tokens.element_size() == traffic.TOKEN_ID_BYTES
    assert request.tokens.nbytes == traffic.token_bytes_per_step_per_dp_rank(2, 1, 3)
