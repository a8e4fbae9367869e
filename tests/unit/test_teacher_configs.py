"""The teacher client's and service's typed configs (:mod:`megatron_kd.teacher.config`) and a
replica's layout record (:class:`~megatron_kd.teacher.endpoint.ReplicaLayout`): each refuses a
bad value naming it, and the endpoint record's JSON stays what replicas and students of earlier
versions write and read (no process group)."""

import json
import re

import pytest
import torch

from megatron_kd.teacher.client import TeacherClient
from megatron_kd.teacher.config import ClientConfig, ClientPlace, ServiceConfig
from megatron_kd.teacher.endpoint import DirectoryEndpoint, ReplicaLayout, ReplicaRecord
from megatron_kd.teacher.service import TeacherService

CLIENT = dict(micro_batch_size=2, seq_length=8, hidden_size=4, dtype=torch.float32,
              wire_dtype="bf16", depth=2, timeout_s=5.0)
SERVICE = dict(host="127.0.0.1", max_batch=4, max_seq_length=64, timeout_s=5.0)


def test_configs_keep_what_they_are_given():
    config = ClientConfig(**CLIENT, max_samples=3, rebalance_every=0, sequence_parallel=True,
                          cp_size=2)
    assert (config.micro_batch_size, config.seq_length, config.hidden_size, config.dtype,
            config.wire_dtype, config.depth, config.timeout_s, config.max_samples,
            config.rebalance_every, config.sequence_parallel, config.cp_size) == (
        2, 8, 4, torch.float32, "bf16", 2, 5.0, 3, 0, True, 2)
    # the defaults: what the client took before it had a config
    plain = ClientConfig(**CLIENT)
    assert (plain.max_samples, plain.rebalance_every, plain.sequence_parallel,
            plain.cp_size) == (64, 8, False, 1)
    place = ClientPlace(run=7, dp_rank=1)
    assert (place.member, place.members, place.member_group, place.gather_group) == (
        0, 1, None, None)
    service = ServiceConfig(**SERVICE)
    assert (service.port, service.max_samples, service.stats_interval_s) == (0, 64, 10.0)
    with pytest.raises(AttributeError):
        service.port = 1  # type: ignore[misc]  # frozen


@pytest.mark.parametrize("changes, message", [
    ({"micro_batch_size": 0}, "teacher client: micro_batch_size must be an integer >= 1, got 0"),
    ({"seq_length": -3}, "teacher client: seq_length must be an integer >= 1, got -3"),
    ({"hidden_size": 2.5}, "teacher client: hidden_size must be an integer >= 1, got 2.5"),
    ({"depth": True}, "teacher client: depth must be an integer >= 1, got True"),
    ({"max_samples": 0}, "teacher client: max_samples must be an integer >= 1, got 0"),
    ({"rebalance_every": -1}, "teacher client: rebalance_every must be an integer >= 0, got -1"),
    ({"cp_size": 0}, "teacher client: cp_size must be an integer >= 1, got 0"),
    ({"wire_dtype": "fp16"}, "teacher client: wire_dtype must be one of ['bf16', 'fp32', "
                             "'fp8'], got 'fp16'"),
    ({"dtype": torch.int32}, "teacher client: dtype must be a floating-point torch.dtype, got "
                             "torch.int32"),
    ({"timeout_s": 0.0}, "teacher client: timeout_s must be > 0, got 0.0"),
])
def test_client_config_refuses_bad_values(changes, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        ClientConfig(**{**CLIENT, **changes})


@pytest.mark.parametrize("kw, message", [
    ({"run": -1, "dp_rank": 0}, "teacher client: run must be an integer >= 0, got -1"),
    ({"run": 1, "dp_rank": -2}, "teacher client: dp_rank must be an integer >= 0, got -2"),
    ({"run": 1, "dp_rank": 0, "members": 0},
     "teacher client: members must be an integer >= 1, got 0"),
    ({"run": 1, "dp_rank": 0, "member": 2, "members": 2, "member_group": object()},
     "teacher client: member 2 is not in [0, members 2)"),
    ({"run": 1, "dp_rank": 0, "member": 1, "members": 2},
     "teacher client: 2 members need their member_group"),
])
def test_client_place_refuses_bad_values(kw, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        ClientPlace(**kw)


def test_client_refuses_members_that_context_parallelism_does_not_divide(tmp_path):
    with pytest.raises(ValueError, match=re.escape(
            "teacher client: 3 members are not a multiple of cp_size 2")):
        TeacherClient(endpoint=DirectoryEndpoint(str(tmp_path)), expected={},
                      config=ClientConfig(**CLIENT, cp_size=2),
                      place=ClientPlace(run=0, dp_rank=0, members=3, member_group=object()),
                      device=torch.device("cpu"))


@pytest.mark.parametrize("changes, message", [
    ({"host": ""}, "teacher service: host must be an address, got ''"),
    ({"port": 70000}, "teacher service: port must be in [0, 65535], got 70000"),
    ({"port": -1}, "teacher service: port must be in [0, 65535], got -1"),
    ({"max_batch": 0}, "teacher service: max_batch must be an integer >= 1, got 0"),
    ({"max_seq_length": 0}, "teacher service: max_seq_length must be an integer >= 1, got 0"),
    ({"max_samples": 0}, "teacher service: max_samples must be an integer >= 1, got 0"),
    ({"timeout_s": -1.0}, "teacher service: timeout_s must be > 0, got -1.0"),
    ({"stats_interval_s": -0.5}, "teacher service: stats_interval_s must be >= 0, got -0.5"),
])
def test_service_config_refuses_bad_values(changes, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        ServiceConfig(**{**SERVICE, **changes})


def test_service_needs_the_ranks_that_send_the_answers(tmp_path):
    with pytest.raises(ValueError, match="the layout names no last-stage ranks"):
        TeacherService(identity={}, endpoint=DirectoryEndpoint(str(tmp_path)),
                       forward=lambda tokens: None, device=torch.device("cpu"),
                       config=ServiceConfig(**SERVICE), layout=ReplicaLayout())


@pytest.mark.parametrize("kw, message", [
    ({"device": ""}, "replica layout: device must be a device type such as 'cpu' or 'cuda', "
                     "got ''"),
    ({"last_stage_ranks": [0]}, "replica layout: last_stage_ranks must be a tuple of ranks >= 0, "
                                "got [0]"),
    ({"last_stage_ranks": (0, -1)}, "replica layout: last_stage_ranks must be a tuple of ranks "
                                    ">= 0, got (0, -1)"),
    ({"tp": 0}, "replica layout: tp must be an integer >= 1, got 0"),
    ({"world_size": 1.5}, "replica layout: world_size must be an integer >= 1, got 1.5"),
    ({"pid": -4}, "replica layout: pid must be an integer >= 1, got -4"),
    ({"started": -1.0}, "replica layout: started must be seconds >= 0, got -1.0"),
])
def test_replica_layout_refuses_bad_values(kw, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        ReplicaLayout(**kw)


# What `teacher serve` published before the layout was typed: the service's dict, merged
# (world size to start time from the command; last-stage ranks and device from the service),
# dumped by `json.dumps(asdict(record), sort_keys=True)`.
OLD_SERVE_LAYOUT = {"world_size": 4, "tp": 2, "pp": 2, "cp": 1, "ep": 1, "pid": 4242,
                    "started": 1700000000.125, "last_stage_ranks": [2, 3], "device": "cuda"}
# ... and what a service built without the command's part published (the tests' replicas).
OLD_BARE_LAYOUT = {"last_stage_ranks": [0], "device": "cpu"}


def _old_json(layout: dict) -> str:
    return json.dumps({"replica": "r1", "host": "h", "port": 1234, "identity": {"a": 1},
                       "layout": layout}, sort_keys=True)


@pytest.mark.parametrize("old", [OLD_SERVE_LAYOUT, OLD_BARE_LAYOUT], ids=["serve", "bare"])
def test_replica_record_json_is_what_every_version_reads(old):
    text = _old_json(old)
    record = ReplicaRecord.from_json(text)
    assert record.to_json() == text  # byte for byte: older students read it as before
    assert record.layout.to_dict() == old
    typed = ReplicaLayout(**{k: tuple(v) if k == "last_stage_ranks" else v
                             for k, v in old.items()})
    assert record.layout == typed
    assert ReplicaRecord(replica="r1", host="h", port=1234, identity={"a": 1},
                         layout=typed).to_json() == text


def test_replica_record_reads_records_of_other_versions():
    # no layout at all (a record written by hand, or by a version before layouts): a CPU
    # replica whose last stage is unknown, as the client read it before
    bare = ReplicaRecord.from_json(json.dumps({"replica": "r", "host": "h", "port": 1}))
    assert bare.layout == ReplicaLayout() and bare.layout.device == "cpu"
    # keys this version does not know are left out (a later replica's), the known ones kept
    later = dict(OLD_SERVE_LAYOUT, numa_node=3)
    record = ReplicaRecord.from_json(_old_json(later))
    assert record.layout.to_dict() == OLD_SERVE_LAYOUT
    # a layout that is not an object is refused (an endpoint skips such a record)
    with pytest.raises(ValueError, match="a replica layout is a JSON object"):
        ReplicaRecord.from_json(_old_json([1, 2]))  # type: ignore[arg-type]


def test_a_directory_endpoint_lists_typed_records(tmp_path):
    endpoint = DirectoryEndpoint(str(tmp_path))
    layout = ReplicaLayout(last_stage_ranks=(0, 1), device="cpu", world_size=2, tp=2, pp=1,
                           cp=1, ep=1, pid=7, started=12.5)
    endpoint.publish(ReplicaRecord(replica="x", host="h", port=5, layout=layout))
    (found,) = endpoint.replicas()
    assert found.layout == layout
    assert json.loads((tmp_path / "replica-x.json").read_text())["layout"] == {
        "world_size": 2, "tp": 2, "pp": 1, "cp": 1, "ep": 1, "pid": 7, "started": 12.5,
        "last_stage_ranks": [0, 1], "device": "cpu"}
