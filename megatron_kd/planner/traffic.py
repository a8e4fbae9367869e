"""Compute time, network traffic and teacher replicas (pure Python, no torch).

FLOPs (source: Kaplan et al. 2020 / Narayanan et al. 2021, "Efficient Large-Scale Language Model
Training on GPU Clusters Using Megatron-LM", eq. 3, adapted per token)
--------------------------------------------------------------------------------------------------
* forward matmuls: ``2 * N_active`` per token, with ``N_active`` the parameters a token multiplies
  (``k`` routed experts of ``E``; output layer included, input-embedding lookup excluded).
* causal softmax attention, per full-attention layer and token, forward: ``4 * a * d * keys`` with
  ``keys`` the mean number of keys a query sees: ``(s+1)/2`` causal, ``w - w(w-1)/(2s)`` for a
  window ``w < s``.
* Gated DeltaNet layer (approximation): ``6 * nv * dk * dv`` per token forward (the state update and
  read-out against a ``dk x dv`` state per head); the chunked kernels' intra-chunk terms are
  ignored.
* training = forward + backward = 3 x forward; full recompute adds one forward (4 x); selective adds
  the attention forward again.
* a teacher runs forward only (1 x). In the disaggregated mode the student projects the teacher's
  hidden states with the teacher's output layer (``2 * V_t * h_t`` per token, forward only: the
  teacher is frozen, and the fused loss computes its gradients in forward); the teacher nodes stop
  before their output layer.

Time: ``flops / (gpus * peak_bf16 * MFU)`` times the 1F1B bubble ``1 + (p-1)/m``. The MFU
(model FLOP utilisation) is an assumption, stated in every plan (default 0.40 for training and
0.40 for the teacher's forward, typical of Megatron-Core bf16 runs at these sizes).

Traffic per optimizer step (the quantities a run can count)
------------------------------------------------------------
* teacher -> student hidden states (disaggregated; crosses the inter-node link: teachers live on
  their own nodes): every token a student data-parallel rank trains on arrives once, as ``h_t``
  elements of the wire's type (``--kd-wire-dtype``: fp32 4 bytes, bf16 2, fp8 1 plus one fp32
  scale per token): exactly ``(G / dp) * s * wire_bytes_per_token`` bytes per student DP rank,
  each of its ``t`` last-stage TP ranks receiving ``1/t`` of it.
* student -> teacher token ids: 4 bytes (int32) per token, ``(G / dp) * s * 4`` per student DP
  rank, sent by its last-stage TP rank 0.
* intra-node all-gather of the received shards inside the student TP group: each TP rank receives
  ``(t-1)/t`` of every micro-batch's ``[s, b, h_t]``: ``m * (t-1)/t * s*b*h_t*elem_bytes``.
* TP all-reduces of the fused loss: ``loss_stats`` fp32 values per row and window (running maxima,
  sums of exponentials, the cross term), none in backward; a ring all-reduce moves
  ``2 (t-1)/t`` of the payload per rank: ``m * s*b * loss_stats * 4 * 2(t-1)/t`` bytes.
* offline cache reads from storage: ``(G/dp) * s * (K*entry_bytes + 4)`` bytes per student DP rank.

"The wire never stalls the student" when the bytes a receiving GPU needs per step arrive within the
step: ``bytes_per_step / step_time <= link_bytes_per_s * link_efficiency``; the prefetch ring (depth
``D``) absorbs jitter, not a sustained deficit. ``link_efficiency`` (default 0.8) is an assumption.

Teacher replicas: ``ceil(student_tokens_per_s / replica_tokens_per_s)``, a replica's rate being
``replica_gpus * peak * teacher_MFU / teacher_forward_flops_per_token``.
"""

from __future__ import annotations

import math
from enum import Enum

from megatron_kd.planner.models import ModelConfig

#: Bytes per element of each ``--kd-wire-dtype``, and per token on top (fp8's fp32 scale): what
#: ``megatron_kd.teacher.wire.encode_hidden`` sends (``tests/unit/test_wire.py`` compares them).
WIRE_ELEMENT_BYTES = {"fp32": 4, "bf16": 2, "fp8": 1}
WIRE_TOKEN_EXTRA_BYTES = {"fp32": 0, "bf16": 0, "fp8": 4}

#: Bytes per token id a student sends its teacher: the int32 ids of a request (a copy, compared
#: with what ``megatron_kd.teacher.client`` sends by ``tests/unit/test_planner_copies.py``).
TOKEN_ID_BYTES = 4


class Traffic(Enum):
    """One figure of a plan's traffic (and of the offline cache's cost, and a teacher replica's
    rate). A plan's figures are keyed by these; the value is the figure's label, used only when
    a plan is printed (tables, JSON)."""

    LOSS_ALLREDUCE_BYTES = "loss all-reduce bytes/step/rank"
    LOSS_ALLREDUCE_CALLS = "loss all-reduce calls/step"
    LOSS_ALLREDUCE_RATE = "loss all-reduce GB/s needed (NVLink)"
    CACHE_BYTES = "cache bytes/step/DP rank"
    CACHE_READ_RATE = "cache read GB/s per DP rank"
    CACHE_SIZE = "cache size GB per 1B tokens"
    CACHE_BUILD_GPU_HOURS = "cache build teacher GPU-hours per 1B tokens"
    TOKEN_ID_BYTES = "token id bytes/step/student DP rank (to teacher)"
    HIDDEN_BYTES_PER_DP_RANK = "hidden bytes/step/student DP rank"
    HIDDEN_BYTES_PER_TP_RANK = "hidden bytes/step/student TP rank"
    HIDDEN_RATE_STUDENT = "hidden GB/s needed per student GPU"
    LINK_RATE = "inter-node link GB/s (x efficiency)"
    HIDDEN_RATE_TEACHER = "hidden GB/s needed per teacher sending GPU"
    ALLGATHER_BYTES = "all-gather bytes/step/rank (NVLink)"
    ALLGATHER_RATE = "all-gather GB/s needed (NVLink)"
    NVLINK_RATE = "NVLink GB/s (x efficiency)"
    REPLICA_TOKENS_PER_S = "teacher replica tokens/s"

    @property
    def label(self) -> str:
        """What a report prints for the figure."""
        return self.value


def wire_bytes_per_token(hidden_size: int, wire_dtype: str) -> int:
    """Teacher -> student bytes of one token's final hidden state on the wire."""
    if wire_dtype not in WIRE_ELEMENT_BYTES:
        raise ValueError(f"wire dtype must be one of {sorted(WIRE_ELEMENT_BYTES)}, "
                         f"got {wire_dtype!r}")
    return hidden_size * WIRE_ELEMENT_BYTES[wire_dtype] + WIRE_TOKEN_EXTRA_BYTES[wire_dtype]


def attention_keys_mean(seq_length: int, window: int) -> float:
    """Mean number of keys a causal query attends to, with a window ``window`` (``>= s`` = none)."""
    if window >= seq_length:
        return (seq_length + 1) / 2
    return window - window * (window - 1) / (2 * seq_length)


def forward_flops_per_token(
    model: ModelConfig, seq_length: int, include_output_layer: bool = True
) -> float:
    """Forward FLOPs per token: matmuls ``2 N_active`` + attention + linear-attention state."""
    n_active = model.active_params()
    if not include_output_layer:
        n_active -= model.embedding_params()
    flops = 2.0 * n_active
    a, d = model.num_attention_heads, model.head_dim
    for layer in range(model.num_layers):
        if model.is_full_attention(layer):
            keys = attention_keys_mean(seq_length, model.attention_window(layer, seq_length))
            flops += 4.0 * a * d * keys
        else:
            flops += (
                6.0
                * model.linear_num_value_heads
                * model.linear_key_head_dim
                * model.linear_value_head_dim
            )
    return flops


def attention_forward_flops_per_token(model: ModelConfig, seq_length: int) -> float:
    """The softmax-attention share of the forward (what selective recompute runs again)."""
    a, d = model.num_attention_heads, model.head_dim
    return sum(
        4.0 * a * d * attention_keys_mean(seq_length, model.attention_window(i, seq_length))
        for i in range(model.num_layers)
        if model.is_full_attention(i)
    )


def training_flops_per_token(model: ModelConfig, seq_length: int, recompute: str) -> float:
    """Forward + backward (3 x forward), plus what recompute runs again."""
    fwd = forward_flops_per_token(model, seq_length)
    if recompute == "full":
        return 4.0 * fwd
    if recompute == "selective":
        return 3.0 * fwd + attention_forward_flops_per_token(model, seq_length)
    if recompute == "none":
        return 3.0 * fwd
    raise ValueError(f"recompute={recompute!r}; choose from none, selective, full")


def step_time_s(
    flops_per_step: float, gpus: int, peak_flops: float, mfu: float, pp: int, num_microbatches: int
) -> float:
    """``flops / (gpus * peak * MFU) * (1 + (p-1)/m)``."""
    if not 0 < mfu <= 1:
        raise ValueError(f"mfu must be in (0, 1], got {mfu}")
    if gpus <= 0 or num_microbatches <= 0:
        raise ValueError(f"gpus={gpus} and num_microbatches={num_microbatches} must be > 0")
    return flops_per_step / (gpus * peak_flops * mfu) * (1 + (pp - 1) / num_microbatches)


def tokens_per_step_per_dp_rank(global_batch_size: int, dp: int, seq_length: int) -> int:
    if global_batch_size % dp:
        raise ValueError(f"global_batch_size={global_batch_size} is not a multiple of dp={dp}")
    return global_batch_size // dp * seq_length


def hidden_bytes_per_step_per_dp_rank(
    teacher: ModelConfig, global_batch_size: int, dp: int, seq_length: int,
    wire_dtype: str = "bf16",
) -> int:
    """Teacher -> student bytes per step for one student data-parallel rank (exact: what a run
    logs as ``kd_wire_bytes_per_dp_rank``)."""
    return tokens_per_step_per_dp_rank(global_batch_size, dp, seq_length) * \
        wire_bytes_per_token(teacher.hidden_size, wire_dtype)


def token_bytes_per_step_per_dp_rank(global_batch_size: int, dp: int, seq_length: int) -> int:
    """Student -> teacher bytes per step for one student data-parallel rank (the token ids)."""
    return tokens_per_step_per_dp_rank(global_batch_size, dp, seq_length) * TOKEN_ID_BYTES


def allgather_bytes_per_step_per_rank(
    teacher: ModelConfig,
    num_microbatches: int,
    seq_length: int,
    micro_batch_size: int,
    tp: int,
    elem_bytes: int = 2,
) -> float:
    """Bytes one TP rank receives from its peers in the intra-node all-gathers of a step."""
    return (
        num_microbatches
        * (tp - 1)
        / tp
        * seq_length
        * micro_batch_size
        * teacher.hidden_size
        * elem_bytes
    )


def loss_allreduce_bytes_per_step_per_rank(
    num_microbatches: int, seq_length: int, micro_batch_size: int, tp: int, loss_stats: int
) -> float:
    """Ring all-reduce bytes per TP rank for the fused loss's per-row fp32 statistics."""
    return num_microbatches * seq_length * micro_batch_size * loss_stats * 4 * 2 * (tp - 1) / tp


def loss_allreduce_count_per_step(
    num_microbatches: int, seq_length: int, micro_batch_size: int, window_size: int, rounds: int = 2
) -> int:
    """All-reduce calls per step: ``rounds`` (maxima, then sums) per window."""
    rows = seq_length * micro_batch_size
    return num_microbatches * math.ceil(rows / min(window_size, rows)) * rounds


def replicas_needed(
    student_tokens_per_s: float,
    replica_gpus: int,
    peak_flops: float,
    mfu: float,
    teacher_flops_per_token: float,
) -> tuple[int, float]:
    """(replicas, tokens/s of one replica) so that teachers keep up with the student."""
    per_replica = replica_gpus * peak_flops * mfu / teacher_flops_per_token
    return max(1, math.ceil(student_tokens_per_s / per_replica - 1e-9)), per_replica


def served_tokens_per_s(student_tokens_per_s: float, replicas: int,
                        replica_tokens_per_s: float) -> float:
    """Student tokens/s with ``replicas`` teacher replicas: the student's own rate, or what the
    replicas serve when that is less (the student then waits for its teachers)."""
    return min(student_tokens_per_s, replicas * replica_tokens_per_s)
