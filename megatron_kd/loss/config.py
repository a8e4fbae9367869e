"""Configuration of the fused vocab-parallel KD loss."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from megatron_kd.parallel.windows import (
    DEFAULT_GPU_WINDOW_BYTES,
    DEFAULT_WEIGHT_GRAD,
    WEIGHT_GRADS,
    cpu_window_rows,
    gpu_window_rows,
)

KINDS = ("forward_kl", "reverse_kl", "jsd")
TOPK_TAILS = ("renormalize", "ghost")
BACKWARDS = ("precompute", "recompute")
ELEMENTWISE = ("eager", "compiled")
PATHS = ("auto", "cpu", "gpu", "dense")
GPU_KERNELS = ("triton", "compiled", "eager")
# The window rule and its constants are megatron_kd.parallel.windows': the planner counts the
# windows the loss runs from the same module (WEIGHT_GRADS is the --kd-loss-weight-grad choices).


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


@dataclass(frozen=True, kw_only=True)
class GpuTuning:
    """How the GPU path of the fused loss (:mod:`megatron_kd.loss.gpu`) works through a window.

    Speed and memory only: every choice computes the same loss up to rounding. The design and
    its cost account are in docs/loss.md (the GPU path).
    """

    window_bytes: int = DEFAULT_GPU_WINDOW_BYTES
    """Bound on the bytes of one window's logits: the student's and (dense teacher) the
    teacher's ``[rows, V_local]`` buffers together, in the input dtype. Rows per window are at
    most ``window_bytes // (models * V_local * itemsize)`` (and ``KDLossConfig.window_size``),
    balanced over the call's tokens (:meth:`rows_per_window`). 1 GiB at V = 128,256 in bf16
    with a dense teacher: 4 windows of 2,048 rows for 8,192 tokens, so the fp32 weight
    gradient is read and written 4 times, not 63."""

    kernels: str = "triton"
    """How a window's elementwise work runs: ``triton`` (three hand-written kernels, one pass
    over the logits each, fp32 inside, the logit gradient written in place in the input
    dtype); ``compiled`` (the same steps as PyTorch ops through ``torch.compile``: Inductor's
    kernels, a fallback where a Triton kernel fails); ``eager`` (the same steps as plain
    PyTorch ops, for tests and debugging: slow, with ``[rows, V]`` temporaries)."""

    block_v: int = 2048
    """Columns per step of a Triton kernel's loop over the vocabulary (a power of 2)."""

    num_warps: int = 8
    """Warps per program of a Triton kernel (one program per row)."""

    weight_grad: str = DEFAULT_WEIGHT_GRAD
    """How each window's weight gradient ``g^T x_s`` is accumulated. ``fp32_gemm``: one GEMM
    takes the input-dtype operands and reads and writes an fp32 accumulator
    (``torch.addmm(..., out_dtype=torch.float32)``; on CPU, where that op does not exist, the
    product is formed in the input dtype and added), rounded to the weight's dtype once, at
    the end. ``fp32_add``: the window's product in the input dtype (one ``[V_local, h_s]``
    temporary), then added to the fp32 accumulator: for a torch whose ``addmm`` refuses an
    fp32 accumulator with bf16 operands. ``input_dtype``: the accumulator is in the weight's
    dtype (cuBLAS adds each window's product to it, rounding once per window): half the
    memory (0.79 GB less at V = 128,256, h_s = 3072 in bf16), for the memory target; with
    few windows (the byte budget) the roundings are few. With the recomputing backward and
    gradient-accumulation fusion the accumulator is ``main_grad`` itself (no buffer), which
    ``input_dtype`` then adds to as ``fp32_gemm`` does."""

    def __post_init__(self) -> None:
        if isinstance(self.window_bytes, bool) or not isinstance(self.window_bytes, int) \
                or self.window_bytes < 1:
            raise ValueError(f"window_bytes must be an int >= 1, got {self.window_bytes!r}")
        if self.kernels not in GPU_KERNELS:
            raise ValueError(f"kernels must be one of {GPU_KERNELS}, got {self.kernels!r}")
        if (isinstance(self.block_v, bool) or not isinstance(self.block_v, int)
                or self.block_v < 16 or self.block_v & (self.block_v - 1)):
            raise ValueError(f"block_v must be a power of 2 >= 16, got {self.block_v!r}")
        if isinstance(self.num_warps, bool) or self.num_warps not in (1, 2, 4, 8, 16, 32):
            raise ValueError(f"num_warps must be a power of 2 from 1 to 32, got "
                             f"{self.num_warps!r}")
        if self.weight_grad not in WEIGHT_GRADS:
            raise ValueError(f"weight_grad must be one of {WEIGHT_GRADS}, got "
                             f"{self.weight_grad!r}")

    def rows_per_window(self, local_valid: int, models: int, itemsize: int,
                        window_size: int | None, n_rows: int | None = None) -> int:
        """Rows of one window under :attr:`window_bytes`
        (:func:`megatron_kd.parallel.windows.gpu_window_rows`: the byte budget over ``models``
        logit rows of ``local_valid`` columns, at most ``window_size``, balanced over the
        call's ``n_rows`` in whole tiles)."""
        return gpu_window_rows(local_valid, models, itemsize, window_size, n_rows,
                               self.window_bytes)


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

    path: str = "auto"
    """Which implementation runs: ``auto``: the GPU path (:mod:`megatron_kd.loss.gpu`) for
    CUDA inputs, the CPU path otherwise (and where ``elementwise="compiled"``, an option of the
    CPU path's walk, is set); ``gpu`` / ``cpu``: that path on any device (``gpu`` on CPU is how
    the GPU path's maths is tested without a GPU; ``gpu`` with ``elementwise="compiled"`` is
    refused). Both compute the same loss. ``dense``: the reference baseline: the logits written,
    as Megatron-LM + ModelOpt's logits KD does; for benchmarks
    (:func:`~megatron_kd.loss.dense.dense_logits_kd_loss`: the student's and a dense teacher's
    ``[tokens, local_vocab_size]`` logits in fp32 and autograd's softmax temporaries, per call;
    the same loss, any device). It has no windows: ``window_size``, ``backward``,
    ``cpu_tuning`` and ``gpu_tuning`` do not apply to it, and ``elementwise="compiled"`` is
    refused."""

    gpu_tuning: GpuTuning | None = None
    """How the GPU path works through a window (``None``: :class:`GpuTuning`'s defaults). No
    effect on the CPU path."""

    def __post_init__(self) -> None:
        if self.path not in PATHS:
            raise ValueError(f"path must be one of {PATHS}, got {self.path!r}")
        if self.path == "dense" and self.elementwise != "eager":
            raise ValueError(f"path='dense' (the reference baseline: the logits written) has no "
                             f"elementwise={self.elementwise!r}, an option of the fused CPU "
                             f"path; set path='cpu' to run it")
        if self.gpu_tuning is not None and not isinstance(self.gpu_tuning, GpuTuning):
            raise ValueError(f"gpu_tuning must be a GpuTuning or None, got {self.gpu_tuning!r}")
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

    def uses_gpu_path(self, device: torch.device) -> bool:
        """Whether inputs on ``device`` take the GPU path (``auto``: CUDA inputs, unless the
        CPU path's ``elementwise="compiled"`` was asked for)."""
        return self.path == "gpu" or (self.path == "auto" and device.type == "cuda"
                                      and self.elementwise == "eager")

    def rows_per_window(self, local_vocab_size: int) -> int:
        """Rows projected at once for a shard of ``local_vocab_size`` columns."""
        return cpu_window_rows(local_vocab_size, self.window_size)
