"""What travels between a student and a teacher replica: self-describing messages.

A **request** (student -> teacher) is an ``int64`` header and the microbatch's token ids
``[b, s]`` as ``int32`` (4 bytes a token). A **response** (teacher -> one student TP rank) is an
``int64`` header and that rank's sequence chunk of the teacher's final hidden states
``[s / tp_s, b, h_t]`` in the wire's element type: fp32, bf16, or fp8 (e4m3) with one fp32
scale per token (:func:`encode_hidden`). Every header carries the run, connection and request
ids, the step and microbatch, the global sample ids, the shape, the element type and a
fingerprint of the tokens; the student compares a response's header with the request it sent
and raises :class:`HeaderMismatchError` naming both values on any difference, so a teacher that
computed other tokens (or a stalled one that wakes up late) never feeds a wrong target.

Headers decode only if they are well formed (:class:`WireError` otherwise): the decoders are
fuzzed (:mod:`megatron_kd.testing.fuzz`).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from megatron_kd.parallel.sequence import route_name

__all__ = ["HeaderMismatchError", "Request", "Response", "TeacherUnavailableError",
           "WIRE_DTYPES", "WireError", "decode_hidden", "encode_hidden", "header_size",
           "payload_shapes", "token_fingerprint", "wire_bytes_per_token"]

MAGIC = 0x4B44_5357  # "KDSW"
VERSION = 2
KIND_REQUEST, KIND_RESPONSE = 1, 2
#: The wire's element types, by name: (code, payload dtype on the wire, bytes per element).
WIRE_DTYPES = {"fp32": 1, "bf16": 2, "fp8": 3}
_WIRE_NAME = {v: k for k, v in WIRE_DTYPES.items()}
_FP8_MAX = 448.0  # largest finite float8 e4m3fn
#: Header words before the sample ids.
_FIXED = 17
_MAX_DIM = 1 << 31


class WireError(ValueError):
    """Bytes that are not a well-formed wire message header (names what is wrong)."""


class HeaderMismatchError(WireError):
    """A response's header differs from the request it answers (names both values)."""


class TeacherUnavailableError(RuntimeError):
    """No teacher replica answered in time: names the endpoint, the replicas tried and why."""

    def __init__(self, endpoint: str, replicas: list[str], reason: str):
        self.endpoint, self.replicas, self.reason = endpoint, list(replicas), reason
        tried = ", ".join(self.replicas) if self.replicas else "none registered"
        super().__init__(f"no teacher at {endpoint} (replicas tried: {tried}): {reason}")

    def __reduce__(self):  # travels between the ranks of a TP group (pickled)
        return type(self), (self.endpoint, self.replicas, self.reason)


def token_fingerprint(tokens: torch.Tensor) -> int:
    """A 56-bit hash of a microbatch's token ids (any integer dtype, any device)."""
    data = tokens.detach().to("cpu", torch.int64).contiguous().numpy().tobytes()
    return int(hashlib.blake2b(data, digest_size=7).hexdigest(), 16)


def header_size(max_samples: int) -> int:
    """Words of a header that lists at most ``max_samples`` sample ids."""
    return _FIXED + max_samples


@dataclass(frozen=True, kw_only=True)
class _Message:
    run: int
    """The student run (a random 62-bit id per run)."""
    conn: int
    """The connection (one student data-parallel rank's TP group) at the replica."""
    request: int
    """The request's number on its connection, from 0."""
    step: int
    microbatch: int
    sample_ids: tuple[int, ...] = ()
    fingerprint: int = 0
    """Of the request's token ids (:func:`token_fingerprint`)."""

    KIND = 0

    def _words(self) -> list[int]:
        raise NotImplementedError

    def encode(self, max_samples: int) -> torch.Tensor:
        """The header as ``int64`` words (sample ids padded with -1)."""
        if len(self.sample_ids) > max_samples:
            raise ValueError(f"{len(self.sample_ids)} sample ids > max {max_samples}")
        fixed = [MAGIC, VERSION, self.KIND, self.run, self.conn, self.request, self.step,
                 self.microbatch, len(self.sample_ids), self.fingerprint, *self._words()]
        words = fixed + [0] * (_FIXED - len(fixed)) + list(self.sample_ids)
        words += [-1] * (header_size(max_samples) - len(words))
        return torch.tensor(words, dtype=torch.int64)

    @classmethod
    def decode(cls, t: torch.Tensor, max_samples: int):
        """A header from its words; :class:`WireError` for anything that is not one."""
        v = t.tolist()
        if len(v) != header_size(max_samples):
            raise WireError(f"a wire header has {header_size(max_samples)} words, got {len(v)}")
        if v[0] != MAGIC or v[1] != VERSION:
            raise WireError(f"not a megatron_kd wire header (magic {v[0]:#x}, version {v[1]}; "
                            f"expected {MAGIC:#x}, {VERSION})")
        if v[2] != cls.KIND:
            raise WireError(f"header of kind {v[2]}, expected {cls.KIND} ({cls.__name__})")
        n = v[8]
        if not 0 <= n <= max_samples:
            raise WireError(f"header lists {n} sample ids, at most {max_samples} fit")
        if min(v[3:8]) < 0:
            raise WireError(f"negative ids in header {v[3:8]}")
        common = dict(run=v[3], conn=v[4], request=v[5], step=v[6], microbatch=v[7],
                      sample_ids=tuple(v[_FIXED:_FIXED + n]), fingerprint=v[9])
        return cls._from_words(v[10:_FIXED], common)


@dataclass(frozen=True, kw_only=True)
class Request(_Message):
    """A student's request for the teacher's hidden states of one microbatch."""

    batch: int
    seq_length: int

    KIND = KIND_REQUEST

    def _words(self) -> list[int]:
        return [self.batch, self.seq_length]

    @classmethod
    def _from_words(cls, w: list[int], common: dict) -> "Request":
        if not (1 <= w[0] < _MAX_DIM and 1 <= w[1] < _MAX_DIM):
            raise WireError(f"request of impossible shape [{w[0]}, {w[1]}]")
        return cls(batch=w[0], seq_length=w[1], **common)


@dataclass(frozen=True, kw_only=True)
class Response(_Message):
    """The teacher's answer for one student rank: part ``chunk`` of ``num_chunks``, ``shape =
    [s / num_chunks, b, h]`` in ``wire_dtype``. With context parallelism (``cp_size`` > 1) part
    ``c * tp + t`` (``tp = num_chunks / cp_size``) is for student CP rank ``c``, TP rank ``t``:
    its TP slice of CP rank ``c``'s load-balanced positions
    (:func:`~megatron_kd.parallel.sequence.member_rows`)."""

    chunk: int
    num_chunks: int
    shape: tuple[int, int, int]
    wire_dtype: str
    cp_size: int = 1

    KIND = KIND_RESPONSE

    def _words(self) -> list[int]:
        return [self.chunk, self.num_chunks, *self.shape, WIRE_DTYPES[self.wire_dtype],
                self.cp_size]

    @classmethod
    def _from_words(cls, w: list[int], common: dict) -> "Response":
        if not 0 <= w[0] < w[1] < _MAX_DIM:
            raise WireError(f"response chunk {w[0]} of {w[1]} impossible")
        if not all(1 <= d < _MAX_DIM for d in w[2:5]):
            raise WireError(f"response of impossible shape {tuple(w[2:5])}")
        if w[5] not in _WIRE_NAME:
            raise WireError(f"unknown wire dtype code {w[5]}")
        cp = w[6] or 1  # 0: a sender that predates context parallelism (its one spare word)
        if not 1 <= cp <= w[1] or w[1] % cp:
            raise WireError(f"response of {w[1]} parts for context-parallel size {cp} "
                            f"impossible")
        return cls(chunk=w[0], num_chunks=w[1], shape=(w[2], w[3], w[4]),
                   wire_dtype=_WIRE_NAME[w[5]], cp_size=cp, **common)

    def route(self) -> str:
        """The student rank the response is for, in words."""
        return route_name(self.chunk, self.num_chunks // self.cp_size, self.cp_size)

    def check_against(self, expected: "Response", *, replica: str, student_rank: int) -> None:
        """Raise :class:`HeaderMismatchError` naming both sides if anything differs (the
        student rank's route, its CP rank and chunks with context parallelism, included)."""
        names = ("run", "conn", "request", "step", "microbatch", "chunk", "num_chunks",
                 "cp_size", "sample_ids", "fingerprint", "shape", "wire_dtype")
        diffs = [f"{n}: teacher {replica} sent {getattr(self, n)!r}, student rank "
                 f"{student_rank} expected {getattr(expected, n)!r}"
                 for n in names if getattr(self, n) != getattr(expected, n)]
        if diffs:
            raise HeaderMismatchError(f"teacher response (for {self.route()}) does not answer "
                                      f"the request of student rank {student_rank} "
                                      f"({expected.route()}); " + "; ".join(diffs))


def payload_shapes(shape: tuple[int, int, int], wire_dtype: str):
    """``[(shape, dtype), ...]`` of the tensors one response's payload is made of."""
    if wire_dtype == "fp32":
        return [(shape, torch.float32)]
    if wire_dtype == "bf16":
        return [(shape, torch.bfloat16)]
    # fp8 travels as bytes (collectives have no float8 type) with one fp32 scale per token
    return [(shape, torch.uint8), (shape[:2], torch.float32)]


def wire_bytes_per_token(hidden_size: int, wire_dtype: str) -> int:
    """Response bytes per token (what the planner and the logs count)."""
    return sum(torch.Size(shape[2:] if len(shape) == 3 else ()).numel()
               * torch.empty((), dtype=dtype).element_size()
               for shape, dtype in payload_shapes((1, 1, hidden_size), wire_dtype))


def encode_hidden(hidden: torch.Tensor, wire_dtype: str) -> list[torch.Tensor]:
    """``hidden [s, b, h]`` -> the payload tensors of :func:`payload_shapes` (contiguous)."""
    if wire_dtype == "fp32":
        return [hidden.float().contiguous()]
    if wire_dtype == "bf16":
        return [hidden.to(torch.bfloat16).contiguous()]
    if wire_dtype != "fp8":
        raise ValueError(f"wire dtype must be one of {sorted(WIRE_DTYPES)}, got {wire_dtype!r}")
    x = hidden.float()
    # per token: the largest magnitude maps to e4m3's largest finite value
    scale = (x.abs().amax(dim=-1) / _FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny)
    q = (x / scale[..., None]).to(torch.float8_e4m3fn)
    return [q.view(torch.uint8).contiguous(), scale.contiguous()]


def decode_hidden(parts: list[torch.Tensor], wire_dtype: str, dtype: torch.dtype) -> torch.Tensor:
    """The inverse of :func:`encode_hidden`, in ``dtype`` (the teacher weight's)."""
    if wire_dtype in ("fp32", "bf16"):
        return parts[0].to(dtype)
    q, scale = parts
    return (q.view(torch.float8_e4m3fn).float() * scale[..., None]).to(dtype)
