"""Configuration of the fused vocab-parallel KD loss."""

from __future__ import annotations

import math
from dataclasses import dataclass

KINDS = ("forward_kl", "reverse_kl", "jsd")
TOPK_TAILS = ("renormalize", "ghost")
BACKWARDS = ("precompute", "recompute")
ELEMENTWISE = ("eager", "compiled")

#: Default bound on the elements of one ``[rows, local_vocab]`` fp32 window buffer (64 MiB).
DEFAULT_WINDOW_ELEMENTS = 1 << 24


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

    def rows_per_window(self, local_vocab_size: int) -> int:
        """Rows projected at once for a shard of ``local_vocab_size`` columns."""
        if self.window_size is not None:
            return self.window_size
        return max(1, DEFAULT_WINDOW_ELEMENTS // max(1, local_vocab_size))
