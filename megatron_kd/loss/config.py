"""Configuration of the fused vocab-parallel KD loss."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

KINDS = ("forward_kl", "reverse_kl", "jsd")
TOPK_TAILS = ("renormalize", "ghost")
BACKWARDS = ("precompute", "recompute")
ELEMENTWISE = ("eager", "compiled")

#: Default bound on the elements of one ``[rows, local_vocab]`` fp32 window buffer (64 MiB).
DEFAULT_WINDOW_ELEMENTS = 1 << 24


@functools.cache
def _cpu_vendor() -> str:
    """This machine's CPU ``vendor_id`` from ``/proc/cpuinfo`` ("" where there is none), read
    on the first call and kept: a fact of the machine, the same for every call of a process."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


@dataclass(frozen=True, kw_only=True)
class CpuTuning:
    """How the fused loss works through a window on CPU; no effect on other devices.

    Speed and memory only: every choice computes the same loss up to rounding (the order of
    sums). The measurements behind the values are in docs/benchmarks.md (the loss).
    :meth:`for_this_machine` gives the values for the CPU it runs on; a field set by hand
    overrides them (tests, experiments).
    """

    chunked_projection_rows: int
    """A CPU projection of at most this many rows runs in vocabulary slabs of
    ``projection_chunk`` rows (:meth:`~megatron_kd.loss.window.WindowWalker.logits`); larger
    ones are one GEMM; 0: always one GEMM. It depends on the CPU, so it has no default (see
    :meth:`for_cpu_vendor`)."""

    projection_chunk: int = 1024
    """Vocabulary rows per slab of a chunked CPU projection: a ``[chunk, rows]`` fp32 slab of a
    110-row window is 440 KiB, inside a core's L2 cache."""

    block_elements: int = 1 << 21
    """Elements of one ``[rows, V_local]`` fp32 block of a window's elementwise work (8 MiB, 13
    rows at V = 151,936): a block's two or three live buffers fit a 32 MiB last-level cache.
    The projections stay window-sized (a GEMM of a few rows would re-read the whole weight
    shard per block)."""

    blocks_with_tp: bool = False
    """Whether windows are split into blocks when the per-row statistics need all-reduces
    (TP > 1), which then run per block: not by default, since per-block all-reduces over gloo
    cost more than the cache saves. Without TP a CPU window always runs in blocks."""

    def __post_init__(self) -> None:
        for name, least in (("chunked_projection_rows", 0), ("projection_chunk", 1),
                            ("block_elements", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"{name} must be an int >= {least}, got {value!r}")
        if not isinstance(self.blocks_with_tp, bool):
            raise ValueError(f"blocks_with_tp must be a bool, got {self.blocks_with_tp!r}")

    @classmethod
    def for_cpu_vendor(cls, vendor: str) -> CpuTuning:
        """The tuning for a CPU of ``vendor`` (``/proc/cpuinfo``'s ``vendor_id``). Slabs only on
        AMD CPUs: for 110 rows at V = 151,936 they ran 1.2-1.5x the one GEMM's rate on an AMD
        EPYC (AVX2), but 0.55-0.65x on an Intel Xeon (AVX-512, where the one GEMM runs at 80% of
        the rate of 2048 rows). A fact of the machine, never of a timing, so every process of a
        run projects alike (bit-identical losses on resume)."""
        return cls(chunked_projection_rows=384 if vendor == "AuthenticAMD" else 0)

    @classmethod
    def for_this_machine(cls) -> CpuTuning:
        """:meth:`for_cpu_vendor` of this machine's CPU (read once per process, so every call
        of a process agrees): what :func:`~megatron_kd.loss.vocab_parallel_kd_loss` uses when
        :attr:`KDLossConfig.cpu_tuning` is None."""
        return cls.for_cpu_vendor(_cpu_vendor())


@dataclass(kw_only=True)
class KDLossConfig:
    """What the fused KD loss computes and how.

    The loss of one token is ``kd_weight * KD + ce_weight * CE``, multiplied by its loss-mask
    weight. With ``p = softmax(z / T)`` over the true vocabulary:

    * ``forward_kl``: ``T^2 * KL(p_t || p_s)``
    * ``reverse_kl``: ``T^2 * KL(p_s || p_t)``
    * ``jsd``: ``T^2 * [beta * KL(p_t || m) + (1 - beta) * KL(p_s || m)]``,
      ``m = beta * p_t + (1 - beta) * p_s``
    * CE: the student's cross-entropy at temperature 1 against the labels.
    """

    kind: str = "forward_kl"
    """Divergence: ``forward_kl``, ``reverse_kl`` or ``jsd``. A sparse (top-K) teacher supports
    ``forward_kl`` only."""

    temperature: float = 1.0
    """Softmax temperature T applied to both teacher and student logits of the KD term (the KD
    term is multiplied by T^2 so its gradient scale does not depend on T). CE always uses T = 1."""

    beta: float = 0.5
    """Mixing weight of the teacher in the JSD mixture ``m``; strictly between 0 and 1."""

    kd_weight: float = 1.0
    """Weight of the KD term."""

    ce_weight: float = 0.0
    """Weight of the student's cross-entropy against ``labels`` (0 disables it; then labels may be
    omitted)."""

    topk_tail: str = "renormalize"
    """Sparse teacher only. ``renormalize``: the teacher distribution is the softmax of the K
    log-probs divided by T. ``ghost`` (T = 1 only): the K probabilities as given plus one tail
    bucket with the teacher's leftover mass ``1 - sum(q)``, compared with the student's mass
    outside those K ids."""

    window_size: int | None = None
    """Hard upper bound on the rows (tokens) projected at once. ``None``: rows such that one
    ``[rows, local_vocab_size]`` fp32 buffer holds at most 2^24 elements (64 MiB)."""

    vocab_size: int | None = None
    """The true (global) vocabulary size. Output-layer rows at or past it are padding and are
    excluded from every softmax. ``None``: every row of the output layer is a real token."""

    ignore_index: int = -100
    """Label value whose tokens get no CE term (their KD term still counts)."""

    backward: str = "precompute"
    """``precompute``: gradients are computed during the forward pass (no second projection,
    backward only scales; keeps one ``[tokens, h]`` gradient and the weight gradient alive).
    ``recompute``: forward keeps only per-row statistics, backward projects again (least memory,
    about 1.5x the GEMMs)."""

    sequence_parallel: bool = False
    """Hidden states arrive sharded along the sequence across the TP group (``[s/tp, b, h]``):
    they are all-gathered in forward and their gradient is reduce-scattered. Labels, masks and a
    sparse teacher stay full ``[s, b]``."""

    elementwise: str = "eager"
    """How a block's elementwise work runs. ``eager``: a dozen PyTorch ops per block, each a
    pass over the ``[rows, local_vocab_size]`` logits. ``compiled`` (dense-teacher forward KL
    only): two ``torch.compile``d kernels per block (Inductor: C++/OpenMP on CPU, Triton on a
    GPU), one for the per-row sums and one for the logit gradient, which exponentiates the
    logits again against the combined log-sum-exp instead of keeping the exponentials. Fewer
    passes and no block temporaries; the first call of a process compiles (seconds, cached on
    disk by Inductor), and Inductor needs a C++ compiler on CPU."""

    check_finite: bool = True
    """Raise ``FloatingPointError`` naming the term when a token's loss is not finite. The
    forward pass tracks the first such token on the device; the loss reads it once, after its
    autograd Function returns (one host read per call, none inside forward or backward)."""

    gradient_accumulation_fusion: bool = False
    """Megatron's gradient-accumulation fusion: the output-layer weight gradient is added to
    ``student_weight.main_grad`` (fp32) in backward instead of being returned, and Megatron's
    DDP is told so through ``grad_added_to_main_grad``. With ``backward="recompute"`` no
    ``[local_vocab_size, h_s]`` gradient buffer exists at all; with ``"precompute"`` the
    forward pass's buffer is added to ``main_grad`` in backward (scaled by the incoming
    gradient). The weight must have a ``main_grad`` attribute."""

    cpu_tuning: CpuTuning | None = None
    """How a window is worked through on CPU (speed and memory, not the maths; no effect on
    other devices). ``None``: this machine's (:meth:`CpuTuning.for_this_machine`), resolved by
    :func:`~megatron_kd.loss.vocab_parallel_kd_loss` once per call."""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")
        if self.topk_tail not in TOPK_TAILS:
            raise ValueError(f"topk_tail must be one of {TOPK_TAILS}, got {self.topk_tail!r}")
        if self.backward not in BACKWARDS:
            raise ValueError(f"backward must be one of {BACKWARDS}, got {self.backward!r}")
        if not (math.isfinite(self.temperature) and self.temperature > 0):
            raise ValueError(f"temperature must be finite and > 0, got {self.temperature}")
        if self.elementwise not in ELEMENTWISE:
            raise ValueError(f"elementwise must be one of {ELEMENTWISE}, got "
                             f"{self.elementwise!r}")
        if self.elementwise == "compiled" and self.kind != "forward_kl":
            raise ValueError(f"elementwise='compiled' is for kind='forward_kl' only, got "
                             f"kind={self.kind!r}")
        if self.kind == "jsd" and not 0.0 < self.beta < 1.0:
            raise ValueError(f"jsd needs 0 < beta < 1, got beta={self.beta}")
        for name in ("kd_weight", "ce_weight"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be finite and >= 0, got {value}")
        if self.kd_weight == 0 and self.ce_weight == 0:
            raise ValueError("kd_weight and ce_weight are both 0: the loss would be identically 0")
        if self.window_size is not None and self.window_size < 1:
            raise ValueError(f"window_size must be >= 1 or None, got {self.window_size}")
        if self.vocab_size is not None and self.vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1 or None, got {self.vocab_size}")
        if self.cpu_tuning is not None and not isinstance(self.cpu_tuning, CpuTuning):
            raise ValueError(f"cpu_tuning must be a CpuTuning or None, got {self.cpu_tuning!r}")

    def rows_per_window(self, local_vocab_size: int) -> int:
        """Rows projected at once for a shard of ``local_vocab_size`` columns."""
        if self.window_size is not None:
            return self.window_size
        return max(1, DEFAULT_WINDOW_ELEMENTS // max(1, local_vocab_size))
