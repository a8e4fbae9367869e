"""The teacher protocol's pieces without a process group: connection metadata round-trips
through its JSON form and refuses bad JSON naming the field; the store keys, the replica's load
and the link device."""

import json

import pytest
import torch

from megatron_kd.teacher.protocol import (
    ACCEPTED,
    CLOSED_COUNTER_KEY,
    CONN_COUNTER_KEY,
    PENDING_KEY,
    ConnectionLimits,
    ConnectionMeta,
    HandshakeError,
    Tag,
    announce_connection,
    link_device,
    meta_key,
    publish_identity,
    read_identity,
    replica_load,
    request_prefix,
    response_prefix,
)

META = dict(run=12345678901, dp_rank=3, tp=2, micro_batch_size=4, seq_length=256,
            max_samples=4, wire_dtype="bf16", device="cpu")


class _Store:
    """The part of a ``TCPStore`` the protocol uses, in a dict."""

    def __init__(self):
        self.d = {}

    def add(self, key, n):
        self.d[key] = int(self.d.get(key, 0)) + n
        return self.d[key]

    def set(self, key, value):
        self.d[key] = value.encode() if isinstance(value, str) else value

    def get(self, key):
        return self.d[key]

    def check(self, keys):
        return all(k in self.d for k in keys)


def test_meta_round_trips():
    meta = ConnectionMeta(**META)
    assert ConnectionMeta.from_json(meta.to_json()) == meta
    assert ConnectionMeta.from_json(meta.to_json().encode()) == meta  # as a store returns it
    assert json.loads(meta.to_json()) == META


def test_meta_of_a_context_parallel_student():
    meta = ConnectionMeta(**META, cp=2)
    assert json.loads(meta.to_json()) == {**META, "cp": 2}
    assert ConnectionMeta.from_json(meta.to_json()) == meta and meta.members == 2 * META["tp"]
    with pytest.raises(ValueError, match="cp must be an integer in \\[1, 2\\*\\*62\\), got 0"):
        ConnectionMeta.from_json(json.dumps({**META, "cp": 0}))


@pytest.mark.parametrize("text, field", [
    ("{not json", "not JSON"),
    ("[1, 2]", "JSON object"),
    (json.dumps({k: v for k, v in META.items() if k != "tp"}), "missing fields ['tp']"),
    (json.dumps({**META, "extra": 1}), "unknown fields ['extra']"),
    (json.dumps({**META, "tp": 0}), "tp must be an integer in [1, 2**62), got 0"),
    (json.dumps({**META, "seq_length": "256"}),
     "seq_length must be an integer in [1, 2**62), got '256'"),
    (json.dumps({**META, "dp_rank": True}), "dp_rank must be an integer in [0, 2**62), got True"),
    (json.dumps({**META, "run": -1}), "run must be an integer in [0, 2**62), got -1"),
    (json.dumps({**META, "wire_dtype": "fp16"}), "wire_dtype must be one of"),
    (json.dumps({**META, "device": ""}), "device must be a device type"),
    (json.dumps({**META, "run": 2 ** 63}), "run must be an integer in [0, 2**62)"),
    (json.dumps({**META, "wire_dtype": ["fp32"]}), "wire_dtype must be one of"),  # unhashable
    (json.dumps({**META, "identity": [1]}), "identity must be a JSON object"),
    pytest.param("[" * 10_000, "not JSON", id="nested"),  # past Python's recursion limit
    pytest.param(b"\xff\xfe{", "not JSON", id="not-utf8"),
    pytest.param("{" + " " * 20_000 + "}", "more than the 16384 a replica reads", id="long"),
])
def test_meta_refuses_bad_json_naming_the_field(text, field):
    with pytest.raises(HandshakeError, match="connection metadata") as e:
        ConnectionMeta.from_json(text)
    assert field in str(e.value)


IDENTITY = {"checkpoint": "abc", "hidden_size": 8}
LIMITS = ConnectionLimits(identity=IDENTITY, max_seq_length=256, max_batch=4, max_samples=4)


def test_limits_accept_what_the_replica_serves():
    text = json.dumps({**META, "identity": IDENTITY})
    assert LIMITS.accept(text) == ConnectionMeta(**META, identity=IDENTITY)
    assert LIMITS.accept(json.dumps({**META, "identity": IDENTITY, "device": "cuda", "cp": 2,
                                     "tp": 4}))


@pytest.mark.parametrize("changes, reason", [
    ({"identity": None}, "names no teacher identity"),
    ({"identity": {**IDENTITY, "hidden_size": 16}},
     "expects another teacher: hidden_size: teacher has 8, this run expects 16"),
    ({"seq_length": 10 ** 9}, "seq_length 1000000000 exceeds this replica's --max-seq-length 256"),
    ({"micro_batch_size": 5}, "micro_batch_size 5 exceeds this replica's --max-batch-size 4"),
    ({"max_samples": 10 ** 6}, "max_samples 1000000 exceeds this replica's 4"),
    ({"device": "xpu"}, "device 'xpu': this replica makes links to students on ['cpu', 'cuda']"),
    ({"tp": 2048}, "tp 2048 x cp 1: a connection answers at most 1024 student ranks"),
    ({"tp": 3}, "seq_length 256 must divide into 3 parts"),
    ({"tp": 2, "cp": 2, "seq_length": 12}, "seq_length 12 must divide into 8 parts"),
])
def test_limits_refuse_naming_the_value_and_the_limit(changes, reason):
    meta = {**META, "identity": IDENTITY, **changes}
    if meta["identity"] is None:
        del meta["identity"]
    with pytest.raises(HandshakeError) as e:
        LIMITS.accept(json.dumps(meta))
    assert reason in str(e.value)


def test_verdicts_read_by_the_student():
    from megatron_kd.teacher.protocol import TeacherRefusedError, await_verdict, refusal, status_key

    class _Waiting(_Store):
        def wait(self, keys, timeout):
            if not self.check(keys):
                raise RuntimeError("Socket Timeout")

    store = _Waiting()
    store.set(status_key(0), ACCEPTED)
    store.set(status_key(1), refusal("micro_batch_size 5 exceeds ..."))
    await_verdict(store, 0, 1.0, "replica r")
    with pytest.raises(TeacherRefusedError, match="replica r refused this student's connection "
                                                  "1: micro_batch_size 5 exceeds"):
        await_verdict(store, 1, 1.0, "replica r")
    with pytest.raises(TimeoutError, match="replica r gave no verdict on connection 2"):
        await_verdict(store, 2, 0.1, "replica r")


def test_keys_identity_and_load():
    store = _Store()
    assert replica_load(store) == 0  # a replica that has written nothing yet
    publish_identity(store, {"hidden_size": 8, "checkpoint": "abc"})
    assert read_identity(store) == {"checkpoint": "abc", "hidden_size": 8}
    meta = ConnectionMeta(**META)
    assert [announce_connection(store, meta) for _ in range(3)] == [0, 1, 2]
    assert ConnectionMeta.from_json(store.get(meta_key(2))) == meta
    store.add(CLOSED_COUNTER_KEY, 1)
    store.set(PENDING_KEY, "5")
    assert store.add(CONN_COUNTER_KEY, 0) == 3
    assert replica_load(store) == 3 - 1 + 5  # open connections + requests held
    # distinct keys per connection and chunk
    keys = {meta_key(0), request_prefix(0), response_prefix(0, 0), response_prefix(0, 1),
            meta_key(1), request_prefix(1), response_prefix(1, 0)}
    assert len(keys) == 7


def test_tags_are_distinct_ints_and_host_links_without_two_gpus():
    assert sorted(int(t) for t in Tag) == [1, 2, 3, 4]
    assert link_device("cpu", "cpu") == torch.device("cpu")
    assert link_device("cuda", "cpu") == torch.device("cpu")
    assert link_device("cpu", "cuda") == torch.device("cpu")
