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
* training = forward + backward = 3 x forward; full recompute adds the forward of every layer it
  checkpoints (uniform: all of them; block: the first ``N`` of each model chunk; the output layer
  is outside the checkpointed block and never runs again); selective adds the attention forward
  again.
* a teacher runs forward only (1 x). In the disaggregated mode the student projects the teacher's
  hidden states with the teacher's output layer (``2 * V_t * h_t`` per token, forward only: the
  teacher is frozen, and the fused loss computes its gradients in forward); the teacher nodes stop
  before their output layer.

Time: ``flops / (gpus * peak_bf16 * MFU)`` times ``1 +`` the pipeline bubble, ``(p-1)/m`` for
1F1B and ``(p-1)/(v*m)`` for the interleaved schedule with ``v`` virtual stages per rank
(:func:`.schedule.bubble_fraction`). The MFU (model FLOP utilisation) is an assumption, stated in
every plan (default 0.40 for training and 0.40 for the teacher's forward, typical of Megatron-Core
bf16 runs at these sizes). Tensor-parallel collectives and the pipeline's point-to-point sends
are reported, not added to the step time (Megatron-Core overlaps part of the first,
``--tp-comm-overlap``, and the second, ``overlap_p2p_comm``); the search weighs the
point-to-point time against the bubble when it picks the number of virtual stages.

Traffic per optimizer step (the quantities a run can count)
------------------------------------------------------------
* teacher -> student hidden states (disaggregated; crosses the inter-node link: teachers live on
  their own nodes): every token a student data-parallel rank trains on arrives once, as ``h_t``
  elements of the wire's type (``--kd-wire-dtype``: fp32 4 bytes, bf16 2, fp8 1 plus one fp32
  scale per token): exactly ``(G / dp) * s * wire_bytes_per_token`` bytes per student DP rank,
  each of its ``t * cp`` last-stage TP x CP ranks receiving ``1/(t*cp)`` of it (a context-parallel
  rank only its positions).
* student -> teacher token ids: 4 bytes (int32) per token, ``(G / dp) * s * 4`` per student DP
  rank, sent by its last-stage TP rank 0.
* intra-node all-gather of the received shards inside the student TP group: each TP rank receives
  ``(t-1)/t`` of every micro-batch's ``[s/cp, b, h_t]``: ``m * (t-1)/t * (s/cp)*b*h_t*elem_bytes``.
* tensor-parallel collectives of the student's layers (Korthikanti et al. 2023, section 4.2.2;
  Megatron-Core's ``LinearWithGradAccumulationAndAsyncCommunication``): every tensor-parallel
  sub-layer (a token mixer; a dense MLP or a shared expert: a routed-expert MLP with expert-tensor
  parallelism 1 keeps its tokens on their rank and talks all-to-all over expert parallelism, not
  counted) moves, per micro-batch, ``(t-1)/t * (s/cp)*b*h*2`` bytes per rank in each all-gather or
  reduce-scatter: with sequence parallelism two in forward and three in backward (the input is
  gathered again for the weight gradient), without it one all-reduce (two of them) each way; full
  recompute runs the forward's two again for the layers it recomputes.
* pipeline point-to-point (Megatron-Core ``p2p_communication``, tensor shape ``[s/(cp t), b, h]``
  with sequence parallelism, ``[s/cp, b, h]`` without): a rank sends each micro-batch's
  activations on at the end of each of its ``v`` chunks and its gradients back at the start of
  each: ``2v`` sends of ``(s/cp)*b*h*2`` bytes (``/t`` with sequence parallelism) per micro-batch
  (one fewer on the first and the last rank; a middle rank's count).
* context parallelism's K/V exchange (Transformer Engine; sources in :mod:`.memory`'s docstring),
  per full-attention layer and micro-batch, bytes one rank sends, with a local K/V chunk of
  ``c = 2 (s/cp) b (g/t) d`` elements: ``p2p`` forward passes ``cp-1`` chunks around the ring,
  backward ``cp-1`` K/V chunks and ``cp-1`` dK/dV chunks (``AttnFuncWithCPAndKVP2P.backward``):
  ``3(cp-1) c``; ``all_gather`` receives the same (an all-gather forward, an all-gather and a
  reduce-scatter backward); ``a2a`` sends ``(cp-1)/cp`` of its Q, K, V and output forward and of
  their gradients backward: ``2 (cp-1)/cp (s/cp) b (2a + 2g)/t d``. Full recompute runs the
  forward's share again. Reported, not added to the step time (``p2p`` overlaps attention
  compute, on its own CUDA stream); at NVLink speed when ``t*cp`` GPUs fit a node (Megatron's rank
  order puts ``cp`` next to ``tp``), else at the inter-node link's.
* TP all-reduces of the fused loss: ``loss_stats`` fp32 values per row and window (running maxima,
  sums of exponentials, the cross term), none in backward; a ring all-reduce moves
  ``2 (t-1)/t`` of the payload per rank: ``m * (s/cp)*b * loss_stats * 4 * 2(t-1)/t`` bytes.
* offline cache reads from storage: ``(G/dp) * s * B`` bytes per student DP rank, ``B`` a token's
  bytes in the cache (:func:`cache_bytes_per_token`, the codec of ``megatron_kd/cache/codec.py``).

"The wire never stalls the student" when the bytes a receiving GPU needs per step arrive within the
step: ``bytes_per_step / step_time <= link_bytes_per_s * link_efficiency``; the prefetch ring (depth
``D``) absorbs jitter, not a sustained deficit. ``link_efficiency`` (default 0.8) is an assumption.

Teacher replicas: ``ceil(student_tokens_per_s / replica_tokens_per_s)``, a replica's rate being
``replica_gpus * peak * teacher_MFU / teacher_forward_flops_per_token``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from enum import Enum
from functools import lru_cache

from megatron_kd.planner import schedule
from megatron_kd.planner.models import PlannedModel

#: Bytes per element of each ``--kd-wire-dtype``, and per token on top (fp8's fp32 scale): what
#: ``megatron_kd.teacher.wire.encode_hidden`` sends (``tests/unit/test_wire.py`` compares them).
WIRE_ELEMENT_BYTES = {"fp32": 4, "bf16": 2, "fp8": 1}
WIRE_TOKEN_EXTRA_BYTES = {"fp32": 0, "bf16": 0, "fp8": 4}

#: The offline cache's encoding as ``cache build`` writes it by default
#: (``megatron_kd/cache/codec.py``; ``tests/unit/test_cache_size.py`` holds these to the codec and
#: the command's default): ids as Rice-coded gaps, a quotient of this or more escaped with the
#: id's full width; log-probs in ``--logprob-encoding log1p-u11``'s 11 bits each; 16 bits a token
#: of its top-K mass.
CACHE_RICE_ESCAPE = 16
CACHE_LOGPROB_BITS = 11
CACHE_MASS_BITS = 16

#: Bytes per token id a student sends its teacher: the int32 ids of a request (what
#: ``megatron_kd.teacher.client`` sends, measured against it by ``tests/unit/test_wire.py``).
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
    HIDDEN_BYTES_PER_TP_RANK = "hidden bytes/step/student TP x CP rank"
    TP_COLLECTIVE_BYTES = "TP collective bytes/step/rank (NVLink)"
    TP_COLLECTIVE_SECONDS = "TP collective s/step at NVLink (not in step)"
    P2P_BYTES = "pipeline p2p bytes/step/rank"
    P2P_SECONDS = "pipeline p2p s/step at link speed (not in step)"
    CP_EXCHANGE_BYTES = "CP K/V exchange bytes/step/rank"
    CP_EXCHANGE_SECONDS = "CP K/V exchange s/step at link speed (not in step)"
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


def cache_bytes_per_token(vocab_size: int, topk: int, *,
                          logprob_bits: int = CACHE_LOGPROB_BITS,
                          mass_bits: int = CACHE_MASS_BITS) -> float:
    """Bytes one token's top-``topk`` entries take in the offline cache (the codec's layout; a
    sample's 12-byte header and a shard's tables are left out: under 0.01 byte a token).

    The ids of a token, sorted, are stored as gaps Rice-coded with one parameter ``r`` per sample
    (the codec picks the cheapest): a gap costs ``r`` low bits, its quotient ``gap >> r`` in
    unary plus a terminator, and a quotient of :data:`CACHE_RICE_ESCAPE` or more the id's full
    ``ceil(log2 V)`` bits beside. Ids spread at random over the vocabulary have gaps close to
    geometric with ``p = K/V``, so with ``a = (1 - p)^(2^r)``: ``P(quotient >= j) = a^j``, a gap's
    expected bits are ``1 + r + sum_{j=1..16} a^j + a^16 ceil(log2 V)``, least over ``r``. A
    real teacher's top-K ids cluster (frequent tokens), so its cache is at most about this
    size. Each log-prob takes ``logprob_bits``, each token ``mass_bits`` more. A ``topk`` beyond
    the vocabulary is the whole vocabulary."""
    if topk < 1 or vocab_size < 1:
        raise ValueError(f"top-K and the vocabulary must be >= 1, got topk={topk}, "
                         f"vocab_size={vocab_size}")
    topk = min(topk, vocab_size)
    id_bits = max(1, (vocab_size - 1).bit_length())

    def gap_bits(r: int) -> float:
        a = (1.0 - topk / vocab_size) ** (1 << r)
        quotient = sum(a ** j for j in range(1, CACHE_RICE_ESCAPE + 1))
        return 1 + r + quotient + a ** CACHE_RICE_ESCAPE * id_bits

    ids = topk * min(gap_bits(r) for r in range(id_bits + 1))
    return (ids + topk * logprob_bits + mass_bits) / 8


def attention_keys_mean(seq_length: int, window: int) -> float:
    """Mean number of keys a causal query attends to, with a window ``window`` (``>= s`` = none)."""
    if window >= seq_length:
        return (seq_length + 1) / 2
    return window - window * (window - 1) / (2 * seq_length)


@lru_cache(maxsize=65536)
def layer_forward_flops_per_token(model: PlannedModel, seq_length: int, layer: int) -> float:
    """Forward FLOPs per token of layer ``layer``: its matmuls ``2 N_active`` (``k`` routed experts)
    + attention or the linear-attention state."""
    n_active = model.layer_dense_params(layer)
    if model.is_moe:
        n_active += model.moe_router_topk * model.expert_params()
    flops = 2.0 * n_active
    if model.is_full_attention(layer):
        keys = attention_keys_mean(seq_length, model.attention_window(layer, seq_length))
        return flops + 4.0 * model.num_attention_heads * model.head_dim * keys
    return flops + 6.0 * (
        model.linear_num_value_heads * model.linear_key_head_dim * model.linear_value_head_dim
    )


@lru_cache(maxsize=65536)
def forward_flops_per_token(
    model: PlannedModel, seq_length: int, include_output_layer: bool = True
) -> float:
    """Forward FLOPs per token: every layer's, the final norm and the output layer."""
    flops = sum(layer_forward_flops_per_token(model, seq_length, i)
                for i in range(model.num_layers))
    flops += 2.0 * model.hidden_size  # final norm
    if include_output_layer:
        flops += 2.0 * model.embedding_params()
    return flops


def attention_forward_flops_per_token(model: PlannedModel, seq_length: int) -> float:
    """The softmax-attention share of the forward (what selective recompute runs again)."""
    a, d = model.num_attention_heads, model.head_dim
    return sum(
        4.0 * a * d * attention_keys_mean(seq_length, model.attention_window(i, seq_length))
        for i in range(model.num_layers)
        if model.is_full_attention(i)
    )


def training_flops_per_token(
    model: PlannedModel,
    seq_length: int,
    recompute: str,
    recomputed_layers: Iterable[int] | None = None,
) -> float:
    """Forward + backward (3 x forward), plus what recompute runs again: with ``full``, the
    forward of ``recomputed_layers`` (default every layer: uniform recompute)."""
    fwd = forward_flops_per_token(model, seq_length)
    if recompute == "full":
        layers = range(model.num_layers) if recomputed_layers is None else recomputed_layers
        return 3.0 * fwd + sum(layer_forward_flops_per_token(model, seq_length, i)
                               for i in layers)
    if recompute == "selective":
        return 3.0 * fwd + attention_forward_flops_per_token(model, seq_length)
    if recompute == "none":
        return 3.0 * fwd
    raise ValueError(f"recompute={recompute!r}; choose from none, selective, full")


def step_time_s(
    flops_per_step: float,
    gpus: int,
    peak_flops: float,
    mfu: float,
    pp: int,
    num_microbatches: int,
    vp: int = 1,
) -> float:
    """``flops / (gpus * peak * MFU) * (1 + (p-1)/(v*m))``."""
    if not 0 < mfu <= 1:
        raise ValueError(f"mfu must be in (0, 1], got {mfu}")
    if gpus <= 0 or num_microbatches <= 0:
        raise ValueError(f"gpus={gpus} and num_microbatches={num_microbatches} must be > 0")
    bubble = schedule.bubble_fraction(pp, vp, num_microbatches)
    return flops_per_step / (gpus * peak_flops * mfu) * (1 + bubble)


def tp_collective_bytes_per_step_per_rank(
    model: PlannedModel,
    layers: Iterable[int],
    recomputed: Iterable[int],
    num_microbatches: int,
    seq_length: int,
    micro_batch_size: int,
    tp: int,
    sequence_parallel: bool,
    elem_bytes: int = 2,
    cp: int = 1,
) -> float:
    """Bytes one TP rank moves in its layers' tensor-parallel collectives per step (see the module
    docstring): per sub-layer and micro-batch 5 (sequence parallel) or 4 all-gather / reduce-
    scatter volumes of ``(t-1)/t * (s/cp)*b*h*elem_bytes``, 2 more where full recompute runs it
    again."""
    if tp == 1:
        return 0.0
    per_volume = ((tp - 1) / tp * seq_length / cp * micro_batch_size * model.hidden_size
                  * elem_bytes)
    # the mixer, and a dense MLP or a shared expert (a routed-expert MLP stays on its rank)
    sub_layers = 1 + (not model.is_moe or model.moe_shared_expert_ffn_hidden_size > 0)
    again = set(recomputed)
    volumes = sum(sub_layers * ((5 if sequence_parallel else 4) + (2 if i in again else 0))
                  for i in layers)
    return num_microbatches * volumes * per_volume


def p2p_bytes_per_step_per_rank(
    num_microbatches: int,
    seq_length: int,
    micro_batch_size: int,
    hidden_size: int,
    tp: int,
    sequence_parallel: bool,
    pp: int,
    vp: int,
    elem_bytes: int = 2,
    cp: int = 1,
) -> float:
    """Bytes a middle pipeline rank sends per step: ``m * 2v`` activations and gradients of
    ``(s/cp)*b*h*elem_bytes`` (``/t`` with sequence parallelism); none without a pipeline."""
    if pp == 1:
        return 0.0
    per_send = seq_length / cp * micro_batch_size * hidden_size * elem_bytes
    if sequence_parallel:
        per_send /= tp
    return num_microbatches * 2 * vp * per_send


def cp_exchange_bytes_per_step_per_rank(
    model: PlannedModel,
    layers: Iterable[int],
    recomputed: Iterable[int],
    num_microbatches: int,
    seq_length: int,
    micro_batch_size: int,
    tp: int,
    cp: int,
    cp_comm_type: str,
    elem_bytes: int = 2,
) -> float:
    """Bytes one rank sends in context parallelism's K/V exchange per step over its full-
    attention ``layers`` (see the module docstring), forward again for the ``recomputed`` ones;
    0 without context parallelism."""
    if cp == 1:
        return 0.0
    local = seq_length / cp * micro_batch_size
    groups = max(1, model.num_query_groups // tp)
    heads = model.num_attention_heads // tp
    d = model.head_dim
    if cp_comm_type in ("p2p", "all_gather"):
        chunk = local * 2 * groups * d * elem_bytes
        forward, backward = (cp - 1) * chunk, 2 * (cp - 1) * chunk
    elif cp_comm_type == "a2a":
        forward = backward = (cp - 1) / cp * local * (2 * heads + 2 * groups) * d * elem_bytes
    else:
        raise ValueError(f"cp_comm_type={cp_comm_type!r}; choose from p2p, all_gather, a2a")
    again = set(recomputed)
    total = sum(forward + backward + (forward if i in again else 0.0)
                for i in layers if model.is_full_attention(i))
    return num_microbatches * total


def tokens_per_step_per_dp_rank(global_batch_size: int, dp: int, seq_length: int) -> int:
    if global_batch_size % dp:
        raise ValueError(f"global_batch_size={global_batch_size} is not a multiple of dp={dp}")
    return global_batch_size // dp * seq_length


def hidden_bytes_per_step_per_dp_rank(
    teacher: PlannedModel, global_batch_size: int, dp: int, seq_length: int,
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
    teacher: PlannedModel,
    num_microbatches: int,
    seq_length: int,
    micro_batch_size: int,
    tp: int,
    elem_bytes: int = 2,
    cp: int = 1,
) -> float:
    """Bytes one TP rank receives from its peers in the intra-node all-gathers of a step (its
    ``s/cp`` positions)."""
    return (
        num_microbatches
        * (tp - 1)
        / tp
        * seq_length
        / cp
        * micro_batch_size
        * teacher.hidden_size
        * elem_bytes
    )


def loss_allreduce_bytes_per_step_per_rank(
    num_microbatches: int, seq_length: int, micro_batch_size: int, tp: int, loss_stats: int,
    cp: int = 1,
) -> float:
    """Ring all-reduce bytes per TP rank for the fused loss's per-row fp32 statistics (the rank's
    ``s*b/cp`` rows)."""
    return (num_microbatches * seq_length / cp * micro_batch_size * loss_stats * 4 * 2
            * (tp - 1) / tp)


def loss_allreduce_count_per_step(
    num_microbatches: int, seq_length: int, micro_batch_size: int, window_size: int,
    rounds: int = 2, cp: int = 1,
) -> int:
    """All-reduce calls per step: ``rounds`` (maxima, then sums) per window."""
    rows = seq_length * micro_batch_size // cp
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
