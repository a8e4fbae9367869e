"""Where teacher replicas register and students find them: ``--kd-teacher-endpoint``.

Two kinds, one interface (:class:`Endpoint`: ``publish`` / ``withdraw`` / ``replicas``):

* **a directory** on storage every node sees (the natural choice under Slurm): each replica
  writes ``replica-<id>.json`` atomically (temporary file, rename) once it is ready to serve, and
  removes it when it stops. It survives any process dying, replicas and students alike (a
  replica killed without removing its file leaves a record that students find unreachable and
  skip); it needs the shared file system to be up.
* **``host:port``** of a small registry, a ``TCPStore`` kept by ``megatron-kd teacher registry``
  (no shared storage needed). It survives replicas and students dying; it does not survive the
  registry process itself: connections already made go on, new ones cannot be made until a
  registry is started again at that address and the replicas register anew.

A record holds the replica's rendezvous address (the ``TCPStore`` its rank 0 serves), its
identity (the teacher checkpoint, vocabulary, hidden size, dtype, tokenizer) and its layout.
"""

from __future__ import annotations

import datetime
import json
import os
import re
from dataclasses import dataclass, field

import torch.distributed as dist

__all__ = ["DirectoryEndpoint", "Endpoint", "RegistryEndpoint", "ReplicaLayout",
           "ReplicaRecord", "parse_endpoint"]

_HOST_PORT = re.compile(r"^(?P<host>[A-Za-z0-9_.\-\[\]:]+):(?P<port>\d{1,5})$")


#: The layout fields a record may leave out (a replica started without them, as the tests' are).
_OPTIONAL_LAYOUT = ("world_size", "tp", "pp", "cp", "ep", "pid", "started")


@dataclass(frozen=True, kw_only=True)
class ReplicaLayout:
    """A replica's layout as its endpoint record carries it (the record's ``layout`` object:
    the JSON keys are the field names, those of :data:`_OPTIONAL_LAYOUT` only when known).
    ``megatron-kd teacher serve`` gives every field; the service fills in the device."""

    last_stage_ranks: tuple[int, ...] = ()
    """The replica's ranks on its last pipeline stage, in TP order (they send the answers)."""

    device: str = "cpu"
    """The replica's device type (``cpu``, ``cuda``): where a student's link to it lives
    (:func:`~megatron_kd.teacher.protocol.link_device`)."""

    world_size: int | None = None
    """Ranks of the replica's own world (its TP x PP x CP)."""

    tp: int | None = None
    """Its tensor-parallel size."""

    pp: int | None = None
    """Its pipeline-parallel size."""

    cp: int | None = None
    """Its context-parallel size."""

    ep: int | None = None
    """Its expert-parallel size."""

    pid: int | None = None
    """Rank 0's process id (to find the process on its host)."""

    started: float | None = None
    """When it started (seconds since the epoch)."""

    def __post_init__(self) -> None:
        if not isinstance(self.device, str) or not self.device:
            raise ValueError(f"replica layout: device must be a device type such as 'cpu' or "
                             f"'cuda', got {self.device!r}")
        ranks = self.last_stage_ranks
        if not isinstance(ranks, tuple) or not all(
                isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in ranks):
            raise ValueError(f"replica layout: last_stage_ranks must be a tuple of ranks >= 0, "
                             f"got {ranks!r}")
        for name in ("world_size", "tp", "pp", "cp", "ep", "pid"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 1):
                raise ValueError(f"replica layout: {name} must be an integer >= 1, got "
                                 f"{value!r}")
        if self.started is not None and (isinstance(self.started, bool) or not isinstance(
                self.started, (int, float)) or self.started < 0):
            raise ValueError(f"replica layout: started must be seconds >= 0, got "
                             f"{self.started!r}")

    def to_dict(self) -> dict:
        """The record's ``layout`` object (what replicas and students of every version read)."""
        out = {name: getattr(self, name) for name in _OPTIONAL_LAYOUT
               if getattr(self, name) is not None}
        return {**out, "last_stage_ranks": list(self.last_stage_ranks), "device": self.device}

    @classmethod
    def from_dict(cls, d: dict) -> ReplicaLayout:
        """A record's ``layout`` object, of any version (keys it does not know are left out;
        a record without a device is a CPU replica's, as before the device was recorded)."""
        if not isinstance(d, dict):
            raise ValueError(f"a replica layout is a JSON object, got {d!r}")
        known = {name: d[name] for name in _OPTIONAL_LAYOUT if d.get(name) is not None}
        return cls(last_stage_ranks=tuple(d.get("last_stage_ranks") or ()),
                   device=d.get("device", "cpu"), **known)


@dataclass(frozen=True, kw_only=True)
class ReplicaRecord:
    """What a student needs to reach one replica."""

    replica: str
    """The replica's id (unique per start)."""
    host: str
    port: int
    """Address of the replica's rendezvous ``TCPStore``."""
    identity: dict = field(default_factory=dict)
    """What it serves (checked by students at connect)."""
    layout: ReplicaLayout = field(default_factory=ReplicaLayout)
    """Its layout: last-stage ranks, device, world size, TP, PP, CP, EP, pid, start time."""

    def to_json(self) -> str:
        return json.dumps({"replica": self.replica, "host": self.host, "port": self.port,
                           "identity": self.identity, "layout": self.layout.to_dict()},
                          sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> "ReplicaRecord":
        d = json.loads(text)
        if not isinstance(d, dict):
            raise ValueError("a replica record is a JSON object")
        return cls(replica=str(d["replica"]), host=str(d["host"]), port=int(d["port"]),
                   identity=dict(d.get("identity") or {}),
                   layout=ReplicaLayout.from_dict(d.get("layout") or {}))

    def __str__(self) -> str:
        return f"replica {self.replica} ({self.host}:{self.port})"


class Endpoint:
    """The interface of both kinds of endpoint."""

    def publish(self, record: ReplicaRecord) -> None:
        raise NotImplementedError

    def withdraw(self, replica: str) -> None:
        raise NotImplementedError

    def replicas(self) -> list[ReplicaRecord]:
        """The replicas registered now (some may have died since)."""
        raise NotImplementedError


class DirectoryEndpoint(Endpoint):
    """A directory of ``replica-<id>.json`` records."""

    def __init__(self, path: str) -> None:
        self.path = os.path.abspath(path)

    def __str__(self) -> str:
        return self.path

    def _file(self, replica: str) -> str:
        return os.path.join(self.path, f"replica-{replica}.json")

    def publish(self, record: ReplicaRecord) -> None:
        os.makedirs(self.path, exist_ok=True)
        final = self._file(record.replica)
        tmp = f"{final}.tmp.{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(record.to_json())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)  # readers see the whole record or none

    def withdraw(self, replica: str) -> None:
        try:
            os.remove(self._file(replica))
        except FileNotFoundError:
            pass

    def replicas(self) -> list[ReplicaRecord]:
        if not os.path.isdir(self.path):
            return []
        out = []
        for name in sorted(os.listdir(self.path)):
            if name.startswith("replica-") and name.endswith(".json"):
                try:
                    with open(os.path.join(self.path, name), encoding="utf-8") as f:
                        out.append(ReplicaRecord.from_json(f.read()))
                except (OSError, ValueError, KeyError, TypeError):
                    continue  # removed or being replaced just now: not a replica to try
        return out


class RegistryEndpoint(Endpoint):
    """``host:port`` of a ``TCPStore`` registry (``megatron-kd teacher registry``)."""

    def __init__(self, host: str, port: int, timeout_s: float = 30.0) -> None:
        self.host, self.port, self.timeout_s = host, port, timeout_s
        self._store = None

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def store(self):
        if self._store is None:
            try:
                self._store = dist.TCPStore(self.host, self.port, is_master=False,
                                            wait_for_workers=False,
                                            timeout=datetime.timedelta(seconds=self.timeout_s))
            except (RuntimeError, OSError) as e:
                raise ConnectionError(f"teacher registry {self} unreachable: {e}") from e
        return self._store

    def publish(self, record: ReplicaRecord) -> None:
        index = self.store.add("replicas", 1) - 1
        self.store.set(f"replica/{index}", record.to_json())

    def withdraw(self, replica: str) -> None:
        for index, record in self._indexed():
            if record.replica == replica:
                self.store.set(f"replica/{index}", "")  # a tombstone: the index stays

    def _indexed(self) -> list[tuple[int, ReplicaRecord]]:
        count = self.store.add("replicas", 0)
        out = []
        for index in range(count):
            key = f"replica/{index}"
            if not self.store.check([key]):
                continue  # being written
            text = self.store.get(key)
            if text:
                try:
                    out.append((index, ReplicaRecord.from_json(text)))
                except (ValueError, KeyError, TypeError):
                    continue
        return out

    def replicas(self) -> list[ReplicaRecord]:
        return [record for _, record in self._indexed()]


def parse_endpoint(text: str) -> Endpoint:
    """``host:port`` (a registry) or a directory path (anything else)."""
    m = _HOST_PORT.match(text)
    if m and not os.path.isdir(text) and "/" not in text:
        return RegistryEndpoint(m.group("host").strip("[]"), int(m.group("port")))
    return DirectoryEndpoint(text)
