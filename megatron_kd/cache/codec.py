"""Compact per-sample encoding of top-K teacher entries (numpy only, vectorised).

One sample is ``seq_length`` tokens with ``K`` entries each: global token ids and their
log-probs (log-softmax over the full vocabulary at temperature 1). A sample is encoded as one
self-delimiting blob:

* **ids** are sorted ascending within each token and stored as gaps (``id_0``,
  ``id_j - id_{j-1} - 1``), Rice-coded with one parameter ``r`` per sample: the quotients
  ``gap >> r`` go to a unary stream, the low ``r`` bits to a fixed-width stream. A quotient of
  :data:`RICE_ESCAPE` or more is written as the escape code and the whole gap goes to an
  escape stream of ``ceil(log2(vocab_size))`` bits, so a cluster of ids followed by one far
  id costs a few dozen bits, not thousands. Lossless for any vocabulary size.
* **log-probs** (in the same id order) are either raw little-endian fp32 (``"fp32"``,
  lossless) or quantised to ``b`` bits with a logarithmic companding of ``z = -logprob``
  (``"log1p-u<b>"``): ``y = log1p(z / z0) / log1p(z_max / z0)``, ``q = rint(y * (2^b - 1))``.
  The step is ``z0 * log1p(z_max / z0) / (2^b - 1)`` nats near ``p = 1`` and grows with ``z``,
  so the precision sits where a KL term's sensitivity ``p * d(logprob)`` is large. Log-probs
  below ``-z_max`` are clamped (their probability is below ``exp(-z_max)``). Each token's
  top-K mass is stored too (16 bits, as a logit) and the decoded log-probs are shifted to it,
  so the leftover (ghost-tail) mass is right even when it is tiny (see
  :meth:`LogprobCodec.quantise`).

The leftover ("ghost tail") mass is ``1 - sum(exp(logprobs))`` of the decoded values, as for
the exact ones: nothing else is returned.

All functions here are pure: same input, same bytes (a resumed build is byte-identical).
Decoding checks what it decodes: any blob that is not a well-formed sample of the given shape
raises :class:`CodecError` (a ``ValueError``) naming what is wrong, never a crash, an
allocation beyond the blob's own size, or ids and log-probs outside their ranges.
"""

from __future__ import annotations

import math
import re
import struct
from dataclasses import dataclass

import numpy as np

#: A Rice quotient at or above this is escaped (the gap is stored in full).
RICE_ESCAPE = 16
#: A token's stored top-K mass ``M`` is ``logit(M)`` clamped to this range.
_MASS_LOGIT_MAX = 40.0

# Per-sample blob header: rice parameter r, 3 reserved bytes, unary stream bytes, escapes.
_SAMPLE_HEADER = struct.Struct("<B3xII")

_LOG1P_RE = re.compile(r"^log1p-u(\d+)$")


class CodecError(ValueError):
    """A blob that does not decode to a well-formed sample (names what is wrong)."""


class NonFiniteLogprobsError(CodecError, FloatingPointError):
    """Decoded log-probs that are NaN or inf: a bad teacher target, refused as such."""


def vocab_bits(vocab_size: int) -> int:
    """Bits an id in ``[0, vocab_size)`` needs: ``ceil(log2(vocab_size))``, at least 1."""
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    return max(1, int(vocab_size - 1).bit_length())


# --------------------------------------------------------------------------- bit packing


def pack_uint(values: np.ndarray, width: int) -> bytes:
    """Pack non-negative integers, ``width`` bits each, MSB first, into bytes (zero padded)."""
    values = np.asarray(values, dtype=np.uint64).reshape(-1)
    if width == 0 or values.size == 0:
        return b""
    if width > 56:
        raise ValueError(f"width must be <= 56 bits, got {width}")
    shifts = np.arange(width - 1, -1, -1, dtype=np.uint64)
    bits = ((values[:, None] >> shifts) & np.uint64(1)).astype(np.uint8)
    return np.packbits(bits.reshape(-1)).tobytes()


def unpack_uint(buf, count: int, width: int, bit_offset: int = 0) -> np.ndarray:
    """Inverse of :func:`pack_uint`: ``count`` values of ``width`` bits -> int64 array.

    Each value is read as a big-endian 64-bit window starting at its first byte, then shifted
    and masked (one gather, no per-bit arrays).
    """
    if width == 0 or count == 0:
        return np.zeros(count, dtype=np.int64)
    if width > 56:
        raise ValueError(f"width must be <= 56 bits, got {width}")
    raw = np.frombuffer(buf, dtype=np.uint8)
    padded = np.concatenate([raw, np.zeros(8, dtype=np.uint8)])
    starts = bit_offset + np.arange(count, dtype=np.int64) * width
    first = starts >> 3
    windows = padded[first[:, None] + np.arange(8)]
    words = np.ascontiguousarray(windows).view(">u8").reshape(-1).astype(np.uint64)
    shift = (64 - (starts & 7) - width).astype(np.uint64)
    mask = np.uint64((1 << width) - 1)
    return ((words >> shift) & mask).astype(np.int64)


# --------------------------------------------------------------------------- ids: Rice gaps


def _rice_cost(gaps: np.ndarray, r: int, vbits: int) -> int:
    q = gaps >> r
    escaped = q >= RICE_ESCAPE
    unary = int(np.minimum(q, RICE_ESCAPE).sum()) + gaps.size
    return unary + gaps.size * r + int(escaped.sum()) * vbits


def encode_ids(sorted_ids: np.ndarray, vocab_size: int) -> bytes:
    """Rice-code ids ``[n, K]`` (ascending in each row, distinct) as one blob."""
    ids = np.asarray(sorted_ids, dtype=np.int64)
    vbits = vocab_bits(vocab_size)
    gaps = np.diff(ids, axis=1, prepend=-1).reshape(-1) - 1
    if gaps.size and int(gaps.min()) < 0:
        raise ValueError("ids must be strictly ascending within each token")
    gaps = gaps.astype(np.int64)
    # Near-optimal r for a geometric distribution is log2(mean * ln 2); outliers (escaped
    # anyway) inflate the mean, so guesses from the mean and the median are both tried.
    candidates = {0}
    for centre in ((float(gaps.mean()), float(np.median(gaps))) if gaps.size else ()):
        guess = int(math.floor(math.log2(centre * math.log(2) + 1.0)))
        candidates.update(range(max(0, guess - 2), min(vbits, guess + 2) + 1))
    r = min(sorted(candidates), key=lambda c: (_rice_cost(gaps, c, vbits), c))
    q = gaps >> r
    escaped = q >= RICE_ESCAPE
    q_code = np.minimum(q, RICE_ESCAPE)
    # Unary stream: q ones then a zero per gap; trailing pad bits are ones (never a terminator).
    zeros = np.cumsum(q_code + 1) - 1
    total = int(zeros[-1]) + 1 if zeros.size else 0
    bits = np.ones((total + 7) // 8 * 8, dtype=np.uint8)
    bits[zeros] = 0
    unary = np.packbits(bits).tobytes()
    remainders = pack_uint(gaps & ((1 << r) - 1), r)
    escapes = pack_uint(gaps[escaped], vbits)
    header = _SAMPLE_HEADER.pack(r, len(unary), int(escaped.sum()))
    return header + unary + remainders + escapes


def decode_ids(blob, n_rows: int, k: int, vocab_size: int) -> tuple[np.ndarray, int]:
    """Inverse of :func:`encode_ids`: ``(ids [n_rows, k] int64, bytes consumed)``.

    Raises :class:`CodecError` for a malformed stream (short, wrong counts, ids outside
    ``[0, vocab_size)``).
    """
    vbits = vocab_bits(vocab_size)
    n = n_rows * k
    mv = memoryview(blob)
    if len(mv) < _SAMPLE_HEADER.size:
        raise CodecError(f"sample blob of {len(mv)} bytes is shorter than its header")
    r, unary_len, n_escape = _SAMPLE_HEADER.unpack_from(mv, 0)
    if r > min(vbits, 56):
        raise CodecError(f"corrupt id stream: Rice parameter {r} > {min(vbits, 56)} bits")
    if n_escape > n:
        raise CodecError(f"corrupt id stream: {n_escape} escapes for {n} ids")
    pos = _SAMPLE_HEADER.size
    rem_len = (n * r + 7) // 8
    esc_len = (n_escape * vbits + 7) // 8
    if pos + unary_len + rem_len + esc_len > len(mv):
        raise CodecError(f"corrupt id stream: streams of {unary_len} + {rem_len} + {esc_len} "
                         f"bytes do not fit a blob of {len(mv)}")
    bits = np.unpackbits(np.frombuffer(mv[pos:pos + unary_len], dtype=np.uint8))
    pos += unary_len
    zeros = np.flatnonzero(bits == 0)[:n]
    if zeros.size != n:
        raise CodecError(f"corrupt id stream: {zeros.size} gaps decoded, expected {n}")
    q = np.diff(zeros, prepend=-1) - 1
    if q.size and int(q.max()) > RICE_ESCAPE:
        raise CodecError(f"corrupt id stream: unary quotient {int(q.max())} > escape code "
                         f"{RICE_ESCAPE}")
    rem = unpack_uint(mv[pos:pos + rem_len], n, r)
    pos += rem_len
    gaps = (q << r) | rem
    where = np.flatnonzero(q >= RICE_ESCAPE)
    if where.size != n_escape:
        raise CodecError(f"corrupt id stream: {where.size} escapes, header says {n_escape}")
    if n_escape:
        gaps[where] = unpack_uint(mv[pos:pos + esc_len], n_escape, vbits)
        pos += esc_len
    ids = np.cumsum(gaps.reshape(n_rows, k) + 1, axis=1) - 1
    if ids.size and int(ids[:, -1].max()) >= vocab_size:
        raise CodecError(f"corrupt id stream: id {int(ids[:, -1].max())} outside "
                         f"[0, {vocab_size})")
    return ids, pos


# --------------------------------------------------------------------------- log-probs


@dataclass(frozen=True, kw_only=True)
class LogprobCodec:
    """How log-probs are stored: ``"fp32"`` (lossless) or ``"log1p-u<bits>"`` (companded)."""

    name: str
    """``"fp32"`` or ``"log1p-u<bits>"`` with 2 <= bits <= 24."""
    z0: float = 0.1
    """Companding knee in nats: the step is nearly uniform for ``-logprob`` below ``z0`` and
    nearly proportional to ``-logprob`` above (with 11 bits: 3.2e-4 nats at p = 1, 9.8e-3 at
    p = 0.05). Chosen by the loss deviation measured in tools/bench_cache.py."""
    z_max: float = 64.0
    """Log-probs below ``-z_max`` are clamped to ``-z_max``."""
    mass_bits: int = 16
    """Bits of each token's stored top-K mass (as a logit; see :meth:`quantise`)."""

    def __post_init__(self) -> None:
        if self.name != "fp32":
            m = _LOG1P_RE.match(self.name)
            if not m or not 2 <= int(m.group(1)) <= 24:
                raise ValueError(
                    f"logprob encoding must be 'fp32' or 'log1p-u<bits>' with 2 <= bits <= 24, "
                    f"got {self.name!r}")
        if not (0 < self.z0 < math.inf and 0 < self.z_max < math.inf):
            raise ValueError(f"z0 and z_max must be > 0, got z0={self.z0}, z_max={self.z_max}")
        if not 8 <= self.mass_bits <= 32:
            raise ValueError(f"mass_bits must lie in [8, 32], got {self.mass_bits}")

    @property
    def bits(self) -> int:
        return 32 if self.name == "fp32" else int(_LOG1P_RE.match(self.name).group(1))

    def nbytes(self, n_rows: int, k: int) -> int:
        """Bytes of ``n_rows`` tokens' log-probs (K each)."""
        if self.name == "fp32":
            return 4 * n_rows * k
        return (n_rows * k * self.bits + 7) // 8 + (n_rows * self.mass_bits + 7) // 8

    def to_json(self) -> dict:
        return {"name": self.name, "z0": self.z0, "z_max": self.z_max,
                "mass_bits": self.mass_bits, "mass_logit_max": _MASS_LOGIT_MAX}

    @classmethod
    def from_json(cls, d: dict) -> "LogprobCodec":
        if d.get("mass_logit_max", _MASS_LOGIT_MAX) != _MASS_LOGIT_MAX:
            raise ValueError(f"logprob encoding with mass_logit_max={d['mass_logit_max']} is not "
                             f"supported (this reader: {_MASS_LOGIT_MAX})")
        return cls(name=d["name"], z0=float(d["z0"]), z_max=float(d["z_max"]),
                   mass_bits=int(d["mass_bits"]))

    # -- the companded scheme ----------------------------------------------------------------

    def _levels(self) -> int:
        return (1 << self.bits) - 1

    def _to_code_scale(self, logprobs: np.ndarray) -> np.ndarray:
        """``-logprob`` companded onto ``[0, levels]`` (float64, continuous)."""
        z = np.clip(-logprobs.astype(np.float64), 0.0, self.z_max)
        return np.log1p(z / self.z0) / math.log1p(self.z_max / self.z0) * self._levels()

    def _from_code_scale(self, y: np.ndarray) -> np.ndarray:
        """Inverse of :meth:`_to_code_scale`: log-probs (float64)."""
        return -self.z0 * np.expm1(y / self._levels() * math.log1p(self.z_max / self.z0))

    def quantise(self, logprobs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Log-probs ``[n, K]`` -> ``(codes [n, K], mass codes [n])`` (companded scheme only).

        Codes are rounded to the nearest level. The token's top-K mass ``M = sum(exp(lp))`` is
        stored on its own as ``logit(M) = log(M / (1 - M))`` in ``mass_bits`` bits over
        ``[-40, 40]``: relative precision ~1e-3 for ``M`` and for ``1 - M`` alike, so the
        leftover (ghost-tail) mass stays right even for a confident teacher whose tail is
        below 1e-3 (rounding the K entries alone can miss it by more than that).
        """
        lp = np.asarray(logprobs, dtype=np.float64)
        codes = np.rint(self._to_code_scale(lp)).astype(np.int64)
        mass = np.exp(lp).sum(axis=1)
        with np.errstate(divide="ignore"):
            logit = np.log(mass) - np.log1p(-np.minimum(mass, 1.0))
        levels = (1 << self.mass_bits) - 1
        unit = np.clip((logit + _MASS_LOGIT_MAX) / (2 * _MASS_LOGIT_MAX), 0.0, 1.0)
        return codes, np.rint(unit * levels).astype(np.int64)

    def dequantise(self, codes: np.ndarray, mass_codes: np.ndarray) -> np.ndarray:
        """Codes -> log-probs, all shifted by one constant per token so that their mass is the
        stored mass (a common shift leaves a renormalised top-K distribution unchanged)."""
        lp = self._from_code_scale(codes.astype(np.float64))
        levels = (1 << self.mass_bits) - 1
        logit = mass_codes / levels * (2 * _MASS_LOGIT_MAX) - _MASS_LOGIT_MAX
        log_mass = -np.logaddexp(0.0, -logit)  # log(sigmoid(logit))
        top = lp.max(axis=1, keepdims=True)
        lse = top[:, 0] + np.log(np.exp(lp - top).sum(axis=1))
        return (lp + (log_mass - lse)[:, None]).astype(np.float32)

    # -- bytes -------------------------------------------------------------------------------

    def encode(self, logprobs: np.ndarray) -> bytes:
        """``[n, K]`` log-probs -> bytes."""
        if self.name == "fp32":
            return np.ascontiguousarray(logprobs, dtype="<f4").tobytes()
        codes, mass_codes = self.quantise(logprobs)
        return pack_uint(codes, self.bits) + pack_uint(mass_codes, self.mass_bits)

    def decode(self, buf, n_rows: int, k: int) -> np.ndarray:
        """Inverse of :meth:`encode`: ``[n_rows, k]`` float32 (``buf`` exactly
        :meth:`nbytes` long)."""
        if len(memoryview(buf)) != self.nbytes(n_rows, k):
            raise CodecError(f"log-prob stream of {len(memoryview(buf))} bytes, expected "
                             f"{self.nbytes(n_rows, k)} for [{n_rows}, {k}] ({self.name})")
        if self.name == "fp32":
            lp = np.frombuffer(buf, dtype="<f4", count=n_rows * k).astype(np.float32).reshape(
                n_rows, k)
            if lp.size and not np.isfinite(lp).all():
                raise NonFiniteLogprobsError("non-finite log-probs (NaN or inf) in the stream")
            if lp.size and float(lp.max()) > 1e-4:
                raise CodecError(f"corrupt log-prob stream: log-prob {float(lp.max())} > 0")
            return lp
        code_bytes = (n_rows * k * self.bits + 7) // 8
        mv = memoryview(buf)
        codes = unpack_uint(mv[:code_bytes], n_rows * k, self.bits).reshape(n_rows, k)
        mass_codes = unpack_uint(mv[code_bytes:], n_rows, self.mass_bits)
        return self.dequantise(codes, mass_codes)

    def roundtrip(self, logprobs: np.ndarray) -> np.ndarray:
        """What a reader will see for these log-probs ``[..., K]`` (for fidelity checks)."""
        lp = np.asarray(logprobs, dtype=np.float32)
        flat = lp.reshape(-1, lp.shape[-1])
        if self.name == "fp32":
            return flat.copy().reshape(lp.shape)
        return self.dequantise(*self.quantise(flat)).reshape(lp.shape)


# --------------------------------------------------------------------------- one sample


def sort_by_id(ids: np.ndarray, logprobs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Reorder each token's entries by ascending id (the stored order)."""
    order = np.argsort(ids, axis=-1, kind="stable")
    return np.take_along_axis(ids, order, -1), np.take_along_axis(logprobs, order, -1)


def encode_sample(ids: np.ndarray, logprobs: np.ndarray, vocab_size: int,
                  codec: LogprobCodec) -> bytes:
    """One sample ``ids, logprobs [s, K]`` -> blob (entries reordered by ascending id)."""
    ids = np.asarray(ids, dtype=np.int64)
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        raise ValueError(f"ids must lie in [0, {vocab_size}), got range "
                         f"[{int(ids.min())}, {int(ids.max())}]")
    ids, logprobs = sort_by_id(ids, np.asarray(logprobs, dtype=np.float32))
    return encode_ids(ids, vocab_size) + codec.encode(logprobs)


def decode_sample(blob, seq_length: int, k: int, vocab_size: int,
                  codec: LogprobCodec) -> tuple[np.ndarray, np.ndarray]:
    """Inverse of :func:`encode_sample`: ``(ids [s, K] int64, logprobs [s, K] float32)``.

    The blob must be exactly one sample of this shape; anything else raises
    :class:`CodecError`.
    """
    ids, pos = decode_ids(blob, seq_length, k, vocab_size)
    size = len(memoryview(blob))
    if pos + codec.nbytes(seq_length, k) != size:
        raise CodecError(f"sample blob of {size} bytes: ids take {pos}, log-probs "
                         f"{codec.nbytes(seq_length, k)} ({codec.name})")
    logprobs = codec.decode(memoryview(blob)[pos:], seq_length, k)
    return ids, logprobs
