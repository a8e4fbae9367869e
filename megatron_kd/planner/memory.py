"""Per-GPU memory, term by term (pure Python, no torch): how a model is split over GPUs, its
weights, gradients and optimizer state, the activations its layers save (a trained student's, a
frozen teacher's forward), and what distillation adds on top (the loss, the cache reader, the
prefetch ring, the teacher's output layer). :class:`Term` names each term a plan reports.

The module is one piece: every term a plan adds up is counted here, in one notation and with its
source, so that each term can be read against the others; split in two, the notation and the
assumptions they share would be written twice.

Notation: ``s`` sequence length, ``b`` micro-batch size, ``n = s*b`` tokens of a micro-batch,
``h`` hidden size, ``a`` query heads, ``g`` key/value heads, ``d`` head dim, ``f`` MLP width,
``V`` vocabulary padded as Megatron pads it (a multiple of ``make_vocab_size_divisible_by * tp``),
``t`` tensor-parallel size, ``p`` pipeline-parallel size, ``dp`` data-parallel size, ``e`` expert-
parallel size, ``et`` expert-tensor-parallel size, ``m`` micro-batches per step; ``_s`` and ``_t``
mark the student's and the teacher's sizes.

Model state (Megatron mixed precision; source: Megatron-LM ``theoretical_memory_usage.py`` and the
distributed-optimizer docs, "6 + 12/d bytes per parameter")
---------------------------------------------------------------------------------------------------
* weights: 2 bytes per parameter held by the rank (bf16).
* gradients: 4 bytes per parameter: Megatron's DDP accumulates and reduces ``main_grad`` in fp32
  (``accumulate_allreduce_grads_in_fp32``, the default for bf16); 2 with ``grad_reduce_in_bf16``.
* optimizer: Adam with fp32 master weights, first and second moments = 12 bytes per parameter,
  divided by the data-parallel size with the distributed optimizer (dense parameters over ``dp``,
  expert parameters over the expert-data-parallel size ``t*dp/(e*et)``).
* the parameters a rank holds: each layer's mixer and MLP / shared expert divided by ``t``, norms
  and router replicated, ``E/e`` experts each divided by ``et``; the input embedding ``V*h/t`` on
  the first stage; the output layer ``V*h/t`` and the final norm on the last stage (a tied output
  layer still has its own copy on the last stage when ``p > 1``, as in Megatron).
* a frozen teacher holds weights only (no gradients, no optimizer state).

Activations (source: Korthikanti et al., "Reducing Activation Recomputation in Large Transformer
Models", MLSys 2023, section 4; adapted below)
---------------------------------------------------------------------------------------------------
The paper's per-layer count for GPT (MHA, GeLU MLP with ``f = 4h``, dropout) is
``s*b*h*(34 + 5*a*s/h)`` bytes, or ``s*b*h/t*(34 + 5*a*s/h)`` with tensor and sequence parallelism.
The planner recounts the same saved tensors for the architectures of the presets, bytes per token
(all activations in 16 bit, masks 1 byte, softmax statistics fp32). Terms marked R are replicated
across the tensor-parallel group unless sequence parallelism shards them (then divided by ``t``);
terms marked S are always divided by ``t``:

* attention: norm input ``2h`` (R), QKV-linear input ``2h`` (R); Q ``2ad``, K and V ``2gd`` each,
  core-attention output = output-projection input ``2ad``, flash-attention log-sum-exp ``4a`` (S);
  QK-norm inputs ``2(a+g)d`` (S); the Qwen3.5 output gate ``4ad`` (S: its sigmoid and the ungated
  output); without flash attention the ``a*s`` softmax terms of the paper: ``2as`` (S), ``5as`` with
  attention dropout; with hidden dropout a ``h`` mask (R).
* Gated DeltaNet (approximation: the tensors a chunked delta-rule layer saves, with its per-chunk
  states recomputed in backward as the public kernels do): norm input ``2h``, input-projection input
  ``2h`` (R); projection output ``2(2kd + 2vd + 2nv)``, convolution output ``2(2kd + vd)``, kernel
  output ``2vd``, gated-norm output ``2vd`` (S).
* dense MLP: norm input ``2h``, first-linear input ``2h`` (R); SwiGLU ``2*2f`` (both halves) +
  ``2f`` (the second-linear input) = ``6f`` (S); GeLU ``4f``; hidden dropout mask ``h`` (R). For the
  paper's GPT (``f = 4h``, dropout, no flash, MHA, ``d = h/a``) these terms add to exactly ``34h +
  5as``.
* MoE MLP (Megatron all-to-all dispatcher; perfectly balanced routing, no dropped tokens): norm
  input ``2h`` and router input ``2h`` (R), router logits and probabilities in fp32 ``8E`` (R), then
  for each of the ``k`` routed copies of a token, on the ``et/t`` share of tokens a rank computes:
  expert input ``2h`` and output ``2h`` (kept for the routing-weight gradient), first-linear output
  ``4f_e/et`` and second-linear input ``2f_e/et``; a shared expert adds ``6f_s`` (S). Megatron
  requires sequence parallelism for MoE with ``t > 1``.
* selective recompute (Megatron ``--recompute-granularity selective``, core attention): drops the
  ``a*s`` softmax terms and the log-sum-exp.
* full recompute (``--recompute-granularity full``), as Megatron-Core 0.16.1's
  ``TransformerBlock._checkpointed_forward`` runs it over the ``k`` layers of one model chunk (a
  pipeline stage, or one virtual stage of it): a checkpointed group of layers keeps only its input
  ``2h`` (R; ``tensor_parallel.checkpoint`` saves its arguments) and runs its forward again in
  backward, where all its layers' activations are live at once.

  - ``--recompute-method uniform --recompute-num-layers N``: the chunk's layers in groups of ``N``
    (``N`` must divide ``k``: the last group would index past the chunk), each group checkpointed:
    ``k/N`` inputs kept; the largest group's full activations are added once per rank (one
    micro-batch is in backward at a time).
  - ``--recompute-method block --recompute-num-layers N``: the first ``min(N, k)`` layers of each
    chunk checkpointed one by one (an input each), the other ``k - N`` keep their full
    activations; the largest checkpointed layer's full activations are added once per rank (an
    upper bound when ``N < k``: they are recomputed after the backward freed the stored layers of
    the same micro-batch).
* unfused kernels (Megatron's local layer spec without Transformer Engine or Apex, e.g. on CPU;
  source: what PyTorch autograd saves for the decomposed ops): each norm also keeps its normalised
  output ``+2h`` (R), SwiGLU keeps ``silu(a)`` ``+2f`` (S), and unfused attention keeps one
  persistent ``[b, a/t, s, s]`` score buffer per rank (Megatron's global memory buffer).
  The local attention also keeps, per layer, the keys and values repeated to every query head
  (``repeat_interleave`` before the batched matmuls, which save them): ``2ad`` each instead of
  ``2gd``; with the torch softmax (no fused kernels) the boolean mask it applies in place,
  ``s_q * s_k`` bytes a micro-batch (the causal mask Megatron-Core's torch softmax builds each
  forward, or the context-parallel one); and in one layer's backward two more score-sized tensors
  live at once (the gradient of the probabilities, then of the scores: ``torch.bmm`` and
  ``_softmax_backward_data``), :attr:`Term.ATTENTION_BACKWARD`.
* fp32 activations (CPU runs without ``--bf16``): every count above times ``activation_bytes / 2``.
* which core attention the count assumes is :attr:`ActivationOptions.flash_attention`, spelled out
  in :attr:`ActivationOptions.attention` (a plan's JSON, ``assumptions.activation``): fused
  (Transformer Engine's attention, or megatron_kd's ``scaled_dot_product_attention`` module that
  the local spec runs on a GPU without Transformer Engine, hybrids' attention layers included):
  no ``s x s`` term; unfused (Megatron-Core's local ``DotProductAttention``, the CPU default, and
  on a GPU without Transformer Engine the layers with attention sinks, which SDPA cannot run): the
  score terms above.

Context parallelism (``cp`` ranks share each sequence; Megatron-Core 0.16.1 with Transformer Engine
on a GPU)
---------------------------------------------------------------------------------------------------
Sources: ``megatron/core/utils.py`` ``get_batch_on_this_cp_rank`` (each sequence cut in ``2 cp``
chunks, rank ``r`` keeps chunks ``r`` and ``2cp-1-r``: ``s/cp`` tokens); ``megatron/core/
extensions/transformer_engine.py`` ``TEDotProductAttention`` (``cp_group``, ``cp_stream`` and
``cp_comm_type``, ``"p2p"`` when none is given); ``transformer_config.py`` ``cp_comm_type``
(``p2p``: K/V chunks passed around a ring, overlapped with attention; ``all_gather``: K/V all-
gathered before attention; ``a2a``: heads scattered, the sequence gathered, DeepSpeed-Ulysses
style); Transformer Engine ``pytorch/attention/dot_product_attention/context_parallel.py``
(``AttnFuncWithCPAndKVP2P``, ``AttnFuncWithCPAndKVAllGather``, ``AttnFuncWithCPAndQKVOA2A``);
its ``tests/pytorch/attention/test_attention_with_cp.py`` (sliding windows are not supported with
``p2p``, non-vanilla softmax such as attention sinks only with ``a2a``, ``a2a`` needs heads and
groups divisible by ``cp``); ``megatron/core/optimizer/__init__.py`` and
``distributed/distributed_data_parallel.py`` (gradients reduced and the distributed optimizer
sharded over the data-parallel x context-parallel group ``dp_cp``).

* every per-token count above is taken over the rank's ``s*b/cp`` tokens: activations, the
  output layer's input, the loss's rows (the fused loss's ``n``, its statistics, its hidden-state
  gradient), a colocated teacher's working set and final hidden states (it runs in the student's
  groups), and a disaggregated student's receive slots and gathered buffer (a replica answers each
  context-parallel rank its positions only). Attention keeps no ``s x s`` tensor with flash
  attention; unfused, its scores are ``[b, a/t, s/cp, s]`` (local queries against every key).
* what a layer saves for backward is the non-CP count over the local tokens: ``p2p`` saves the
  local queries, output and softmax statistics and the last K/V chunk it received (a chunk is the
  size of the local K/V); ``all_gather`` saves the local K/V and gathers again in backward; ``a2a``
  saves the whole sequence's Q, K, V and output for ``a/(t*cp)`` heads, the same bytes.
* the exchange's working set, one layer at a time (:func:`cp_exchange_bytes`): ``p2p``: the
  backward's two send/receive buffers of K/V and dK/dV, four local K/V chunks ``4 * 2(s/cp)b(g/t)d``
  bytes; ``all_gather``: the gathered K and V and their gradients, ``4 * 2 s b (g/t) d``; ``a2a``:
  the sequence-gathered Q, K, V ``2 s b (a+2g)/(t cp) d``.
* on the CPU (no Transformer Engine) megatron_kd's ``ContextParallelAttention`` all-gathers K and
  V and runs Megatron-Core's local attention on them: the repeated keys and values it saves are
  the whole sequence's (``cp`` times the local count per token), its mask is ``[s/cp, s]``.
  On a GPU without Transformer Engine its SDPA form (``ContextParallelSdpaAttention``) gathers
  the same way and forms no scores or mask; the plan counts such a GPU as it counts Transformer
  Engine's (fused attention, the chosen ``cp_comm_type``'s exchange).
* model state: weights and gradients are replicated over ``cp``; the distributed optimizer shards
  over ``dp * cp`` ranks; experts over the expert-data-parallel size ``t*cp*dp/(e*et)``.
* refused: Gated DeltaNet layers (Megatron-Core 0.16.1's ``ssm/gated_delta_net.py`` has no context
  parallelism: its import of ``GatedDeltaNetContextParallel`` is commented out), a sequence that
  does not split in ``2 cp`` chunks (``s/cp`` a multiple of ``t`` with sequence parallelism), and
  the comm types Transformer Engine does not run for the model: rules of
  :func:`megatron_kd.arch.check_layout`, which every command and the search check.

Pipeline (same paper, section 4.2.3): which layers a rank holds and how many micro-batches of
them it keeps, for 1F1B and for the interleaved schedule with ``v`` virtual stages per rank, are
:mod:`.schedule`'s (the first 1F1B stage holds ``p`` micro-batches of ``L/p`` layers, ``L`` layers'
worth; interleaved, ``L(1 + (p-1)/(p*v))``).

The loss (one micro-batch at a time, on the last stage)
---------------------------------------------------------
* final-norm input ``2h`` (R), every mode; the output layer's saved input ``2h`` (R) only where the
  output layer runs as a layer (the dense loss).
* dense KD loss (the incumbent, ModelOpt ``LogitsKLLoss``): per token and local vocabulary entry,
  student logits bf16 2 + their fp32 copy 4 + the fp32 softmax kept for backward 4, and the same
  for the teacher: ``n * (10*V_s + 10*V_t)/t`` bytes. (The fp32 gradient of the logits in backward
  reuses the freed upcast; the count is the forward peak.)
* fused KD loss (``megatron_kd.loss``, gradients precomputed in forward; source: its code). Its
  GPU path (what CUDA runs, ``PlanOptions.loss_path="gpu"``): windows of at most
  ``--kd-loss-window-mib`` (1 GiB) of logits in the input dtype, ``2wV/t`` a model, the rows
  balanced over the call's tokens in whole 128-row tiles; the hidden gradient ``2nh`` at TP 1
  (the returned one), ``4nh`` (fp32) with TP; the output-layer accumulator ``4hV/t`` (fp32,
  ``--kd-loss-weight-grad fp32_gemm``), plus a ``2hV/t`` product with ``fp32_add``, or ``2hV/t``
  (``input_dtype``). Its CPU path (``loss_path="cpu"``, the CPU runs the planner is validated
  on): per window of ``w`` rows (default: ``2^24 / (V/t)`` rows, a 64 MiB fp32 buffer) the
  matmul output in bf16 ``2wV/t`` and fp32 buffers: four with a dense teacher (student logits,
  teacher logits, teacher exponentials, the logit gradient's scratch) ``16wV/t``, two with top-K
  targets ``8wV/t`` (on CPU without TP the last two, or the last one, are a cache-sized block's,
  see :func:`fused_loss_bytes`); the fp32 gradient accumulators ``4nh`` (hidden) and ``4hV/t``
  (output layer). Both paths: with sequence parallelism the gathered hidden states
  ``2n(h + h_t)``; eight fp32 statistics per row ``32n``.
* offline top-K cache: the fused loss with top-K targets, plus the decoded targets of the
  micro-batch in use: ``n * K * 12`` bytes, an int64 id and an fp32 log-prob per entry (what
  ``megatron_kd.cache`` decodes and ``megatron-kd train`` moves to the device; no leftover-mass
  value is stored). The prefetcher decodes its ``D`` micro-batches ahead into host memory, so on a
  GPU one micro-batch is resident; where host memory is the device memory (CPU runs) ``D + 2``
  are: ``D`` queued, one being decoded, one in use (``PlanOptions.cache_resident_microbatches``).
* disaggregated: the fused loss, plus the frozen teacher output-layer shard ``2*V_t*h_t/t``, the
  ``D`` receive slots of the prefetch ring ``D * 2*n*h_t/t`` (each TP rank receives ``1/t`` of the
  sequence) and the one gathered buffer in use ``2*n*h_t``.
* colocated teacher: with the dense loss (ModelOpt), the teacher's layers are split over the same
  ``p`` stages; with the fused loss (``megatron-kd train``), the whole teacher sits on the last
  stage (tensor-parallel ``t``, not pipelined). Either way: its weights (experts over ``e_t``), the
  working set of one no-grad teacher layer (nothing is saved for backward), and on the last stage
  its final hidden states ``2*n*h_t`` (fused) or its logits (counted in the dense loss).

Phases: a colocated teacher's forward working set and the student's attention backward working
set (unfused gradients of the scores, Transformer Engine's context-parallel exchange buffers) are
never live together (the teacher runs after the student's forward and is freed before its
backward); a GPU's total counts the larger of the two (:data:`PHASES`, :func:`total_bytes`).
Every other term is added as if live at once (the loss's window buffers too, though they are
freed before the backward: an overestimate of a window's size).

A fixed reserve (CUDA context, NCCL buffers, allocator fragmentation) is added to every plan; the
default is stated where it is set (``plan.PlanOptions.reserve_bytes``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from functools import lru_cache

from megatron_kd.parallel.layout import (
    CP_COMM_TYPES,
    RECOMPUTE_CHOICES,
    RECOMPUTE_METHODS,
    ParallelLayout,
)
from megatron_kd.parallel.windows import (
    DEFAULT_GPU_WINDOW_BYTES,
    DEFAULT_WEIGHT_GRAD,
    WEIGHT_GRADS,
    cpu_window_rows,
    gpu_window_rows,
)
from megatron_kd.planner import schedule
from megatron_kd.planner.models import PlannedModel

__all__ = ["CP_COMM_TYPES", "DEFAULT_GPU_WINDOW_BYTES", "GIB", "RECOMPUTE_CHOICES",
           "RECOMPUTE_METHODS", "WEIGHT_GRADS", "ActivationOptions", "GpuLoss", "ParallelLayout",
           "Precision", "Term"]

#: Bytes in a GiB: the unit of the reports.
GIB = 1 << 30


class Term(Enum):
    """One memory term of a student or teacher GPU. A plan's terms are keyed by these; the value
    is the term's label, used only when a plan is printed (tables, JSON)."""

    STUDENT_WEIGHTS = "student weights"
    STUDENT_GRADS = "student grads (main_grad)"
    OPTIMIZER = "optimizer (Adam)"
    ACTIVATIONS = "activations"
    ATTENTION_BACKWARD = "attention backward (unfused, 1 layer)"
    CP_EXCHANGE = "context-parallel K/V exchange (1 layer)"
    TEACHER_WEIGHTS = "teacher weights"
    TEACHER_FORWARD = "teacher forward (no grad)"
    DENSE_LOGITS = "loss: dense logits"
    LOSS_WINDOW = "loss: window buffers"
    LOSS_GRADIENTS = "loss: grad accumulators"
    LOSS_GATHERED = "loss: gathered hidden (SP)"
    LOSS_ROW_STATISTICS = "loss: row statistics"
    TEACHER_FINAL_HIDDEN = "teacher final hidden"
    CACHE_READER = "cache reader"
    TEACHER_OUTPUT_SHARD = "teacher output-layer shard"
    RING_SLOTS = "ring slots (D x 1/t seq)"
    GATHERED_HIDDEN = "gathered hidden [s,b,h_t]"
    REPLICA_WEIGHTS = "teacher weights (no output layer)"
    REPLICA_OUTPUT_LAYER = "teacher output layer (loaded, not run)"
    SEND_SLOTS = "send slots (D x 1/t seq)"
    RESERVE = "reserve (context, NCCL, frag.)"

    @property
    def label(self) -> str:
        """What a report prints for the term."""
        return self.value


#: The KD loss's own buffers: the dense loss's logits, or the fused loss's parts.
LOSS_TERMS = frozenset({Term.DENSE_LOGITS, Term.LOSS_WINDOW, Term.LOSS_GRADIENTS,
                        Term.LOSS_GATHERED, Term.LOSS_ROW_STATISTICS})

#: Working sets of phases of a step that never overlap: a colocated teacher's forward runs after
#: the student's forward and is freed before the student's backward, whose attention working set
#: (unfused scores' gradients, the context-parallel exchange's buffers) exists only then. A GPU's
#: peak counts the larger phase (:func:`total_bytes`); every other term is live throughout.
PHASES = (
    frozenset({Term.TEACHER_FORWARD}),
    frozenset({Term.ATTENTION_BACKWARD, Term.CP_EXCHANGE}),
)


def total_bytes(terms: Mapping[Term, float]) -> float:
    """A GPU's peak from its terms: every term, except that of the :data:`PHASES` only the
    largest phase counts."""
    phased = set().union(*PHASES)
    steady = sum(v for t, v in terms.items() if t not in phased)
    return steady + max(sum(terms.get(t, 0.0) for t in phase) for phase in PHASES)


@dataclass(kw_only=True, frozen=True)
class Precision:
    """Bytes per element of the model state (activations: :class:`ActivationOptions`)."""

    param_bytes: int = 2
    """Weights (bf16)."""

    grad_bytes: int = 4
    """Gradient buffer (fp32 ``main_grad``; 2 with ``--grad-reduce-in-bf16``)."""

    optimizer_bytes: int = 12
    """Adam: fp32 master weights + two fp32 moments (8 when the weights are fp32 themselves: no
    master copy)."""

    def __post_init__(self) -> None:
        for name in ("param_bytes", "grad_bytes", "optimizer_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"Precision.{name} must be a positive int, got {value!r}")


def default_cp_comm_type(model: PlannedModel) -> str:
    """The context-parallel exchange Megatron-Core runs for ``model`` when none is given:
    ``p2p``, or ``a2a`` where Transformer Engine runs nothing else (attention sinks, sliding
    windows: see the module docstring)."""
    return "a2a" if model.attention_sinks or model.sliding_window else "p2p"


# --- parameters per rank ---------------------------------------------------------------------


@lru_cache(maxsize=65536)
def rank_params(model: PlannedModel, layout: ParallelLayout, stage: int) -> tuple[int, int]:
    """Parameters one rank of ``stage`` holds: ``(dense, expert)`` (cached: a search asks for
    the same layout and stage many times, and a layer's counts walk its architecture)."""
    t = layout.tp
    h = model.hidden_size
    dense = 0
    layers = schedule.rank_layers(model.num_layers, layout.pp, layout.vp, stage)
    for layer in layers:
        sharded = model.mixer_params(layer)
        if model.is_moe:
            sharded += model.shared_expert_params()
            dense += model.router_params()
        else:
            sharded += model.mlp_params(model.ffn_hidden_size)
        dense += sharded // t + 2 * h  # two norms, replicated
    vocab = model.padded_vocab(layout.tp)
    if stage == 0:
        dense += vocab * h // t
    if stage == layout.pp - 1:
        dense += h  # final norm
        if not model.tie_embeddings or layout.pp > 1:
            dense += vocab * h // t
    expert = 0
    if model.is_moe:
        per_layer = (model.num_experts // layout.ep) * model.expert_params() // layout.expert_tp
        expert = len(layers) * per_layer
    return dense, expert


@dataclass(kw_only=True, frozen=True)
class ModelState:
    """One rank's model state, bytes (a frozen model holds weights only: the others are 0)."""

    weights: int
    """Parameters in ``Precision.param_bytes``."""

    grads: int = 0
    """The gradient buffer (``main_grad``)."""

    optimizer: int = 0
    """Adam's state, sharded over data parallel with the distributed optimizer."""


def model_state_bytes(
    model: PlannedModel, layout: ParallelLayout, stage: int, precision: Precision, trainable: bool
) -> ModelState:
    """Weights, gradients and optimizer state of one rank of ``stage``."""
    dense, expert = rank_params(model, layout, stage)
    weights = (dense + expert) * precision.param_bytes
    if not trainable:
        return ModelState(weights=weights)
    if layout.use_distributed_optimizer:
        opt = (
            precision.optimizer_bytes * dense / layout.optimizer_shards
            + precision.optimizer_bytes * expert / layout.expert_data_parallel_size
        )
    else:
        opt = precision.optimizer_bytes * (dense + expert)
    return ModelState(weights=weights, grads=(dense + expert) * precision.grad_bytes,
                      optimizer=int(round(opt)))


# --- activations -----------------------------------------------------------------------------

#: The core attention an activation count assumes, by :attr:`ActivationOptions.flash_attention`.
ATTENTION_ASSUMPTIONS = {
    True: "fused (flash / memory-efficient: Transformer Engine, or torch SDPA on a GPU without "
          "it): no s x s term",
    False: "unfused (Megatron-Core's local DotProductAttention, the CPU default): "
           "[b, a/t, s/cp, s] scores counted",
}


@dataclass(kw_only=True, frozen=True)
class ActivationOptions:
    """Kernel choices that change what a layer saves."""

    flash_attention: bool = True
    """Fused attention (flash / memory-efficient / cuDNN, through Transformer Engine or torch's
    ``scaled_dot_product_attention``): no ``s x s`` tensors are saved. False: Megatron-Core's
    local unfused ``DotProductAttention`` and its ``[b, a/t, s/cp, s]`` scores."""

    hidden_dropout: bool = False
    """Hidden dropout on (a 1-byte mask per element); off in Llama / Qwen / gpt-oss training."""

    attention_dropout: bool = False
    """Attention-probability dropout on (only matters without flash attention)."""

    fused_norm: bool = True
    """Fused RMSNorm / LayerNorm kernels (Transformer Engine, Apex) save only their input; the
    unfused PyTorch fallback (Megatron's local spec without TE or Apex, e.g. on CPU) also keeps the
    normalised output: ``+2h`` (R) per norm."""

    fused_swiglu: bool = True
    """Fused SwiGLU keeps only its input; the unfused ``silu(a) * b`` also keeps ``silu(a)``:
    ``+2f`` (S) per gated MLP."""

    fused_softmax: bool = True
    """Without flash attention: Megatron's fused masked-softmax kernels keep only the
    probabilities; the torch fallback (the local spec on CPU) also keeps, per layer, the boolean
    ``[s/cp, s]`` mask it applied (built each forward), ``s_q * s_k`` bytes a micro-batch."""

    activation_bytes: int = 2
    """Bytes of an activation element: 2 (bf16 / fp16); 4 for fp32 runs (CPU). The formulas count
    16-bit activations and are scaled by ``activation_bytes / 2`` (fp32 statistics included: an
    upper bound for fp32 runs)."""

    attention: str = field(init=False)
    """The core attention the count assumes, in words (set from :attr:`flash_attention`, one of
    :data:`ATTENTION_ASSUMPTIONS`): what a plan's JSON shows under ``assumptions.activation``."""

    def __post_init__(self) -> None:
        if self.activation_bytes not in (2, 4):
            raise ValueError(f"activation_bytes must be 2 or 4, got {self.activation_bytes}")
        object.__setattr__(self, "attention", ATTENTION_ASSUMPTIONS[self.flash_attention])


def _mixer_terms(
    model: PlannedModel, full_attention: bool, keys: int, recompute: str, opts: ActivationOptions,
    cp: int = 1,
) -> tuple[float, float]:
    """(R, S) bytes per (local) token of a token mixer (attention seeing ``keys`` keys, or Gated
    DeltaNet), before dividing by ``t``; ``cp``: the context-parallel size (the unfused attention
    keeps the gathered keys and values of the whole sequence)."""
    h = model.hidden_size
    if not full_attention:
        kd = model.linear_num_key_heads * model.linear_key_head_dim
        vd = model.linear_num_value_heads * model.linear_value_head_dim
        nv = model.linear_num_value_heads
        r = 2 * h + 2 * h + (0 if opts.fused_norm else 2 * h)
        s = 2 * (2 * kd + 2 * vd + 2 * nv) + 2 * (2 * kd + vd) + 2 * vd + 2 * vd
        return r, s
    a, g, d = model.num_attention_heads, model.num_query_groups, model.head_dim
    r = 2 * h + 2 * h + (h if opts.hidden_dropout else 0) + (0 if opts.fused_norm else 2 * h)
    unfused = not opts.flash_attention and recompute != "selective"
    # K and V: the local attention saves them repeated to every query head and, with context
    # parallelism, gathered over the whole sequence (cp x the local tokens)
    kv = 2 * 2 * (a * cp if unfused else g) * d
    s = 2 * a * d + kv + 2 * a * d
    if model.qk_layernorm:
        s += 2 * (a + g) * d
    if model.attention_output_gate:
        s += 4 * a * d
    if recompute != "selective":
        if opts.flash_attention:
            s += 4 * a  # fp32 log-sum-exp per head
        else:
            s += (5 if opts.attention_dropout else 2) * a * keys
    return r, s


def _mlp_terms(
    model: PlannedModel, layout: ParallelLayout, opts: ActivationOptions
) -> tuple[float, float]:
    """(R, S) bytes per token of the MLP / MoE block, before dividing by ``t``."""
    h = model.hidden_size
    glu = (6 if opts.fused_swiglu else 8) if model.gated_linear_unit else 4
    norm = 0 if opts.fused_norm else 2 * h
    if not model.is_moe:
        r = 2 * h + 2 * h + (h if opts.hidden_dropout else 0) + norm
        return r, glu * model.ffn_hidden_size
    e, f = model.num_experts, model.moe_ffn_hidden_size
    r = 2 * h + 2 * h + 8 * e + norm
    # routed copies: k per token, a rank computes et/t of the tokens (with SP) at width f/et;
    # expressed per token before the final division by t: k * et * (4h + glu*f/et)
    s = model.moe_router_topk * layout.expert_tp * (4 * h + glu * f / layout.expert_tp)
    s += glu * model.moe_shared_expert_ffn_hidden_size
    return r, s


def layer_activation_bytes(
    model: PlannedModel,
    layout: ParallelLayout,
    layer: int,
    seq_length: int,
    micro_batch_size: int,
    opts: ActivationOptions | None = None,
    recompute: str | None = None,
) -> float:
    """Bytes one rank saves for backward in layer ``layer`` for one micro-batch (16-bit
    activations; scaled by ``opts.activation_bytes / 2`` for others, e.g. fp32 on CPU)."""
    opts = opts or ActivationOptions()
    recompute = layout.recompute if recompute is None else recompute
    # layers of one kind (mixer, window) save the same: compute each kind once
    kind = (model.is_full_attention(layer), model.attention_window(layer, seq_length))
    return _layer_bytes_of_kind(model, layout, kind, seq_length, micro_batch_size, opts, recompute)


@lru_cache(maxsize=4096)
def _layer_bytes_of_kind(
    model: PlannedModel,
    layout: ParallelLayout,
    kind: tuple[bool, int],
    seq_length: int,
    micro_batch_size: int,
    opts: ActivationOptions,
    recompute: str,
) -> float:
    n = layout.local_tokens(seq_length, micro_batch_size)
    t = layout.tp
    r_div = t if layout.sequence_parallel else 1
    if recompute == "full":
        return n * 2 * model.hidden_size / r_div * opts.activation_bytes / 2
    full_attention, window = kind
    # the local (unfused) attention scores every key and masks: its scores see the sequence
    keys = window if opts.flash_attention else seq_length
    r1, s1 = _mixer_terms(model, full_attention, keys, recompute, opts, layout.cp)
    r2, s2 = _mlp_terms(model, layout, opts)
    saved = n * ((r1 + r2) / r_div + (s1 + s2) / t) * opts.activation_bytes / 2
    if (full_attention and not opts.flash_attention and not opts.fused_softmax
            and recompute != "selective"):
        # the boolean [s/cp, s] mask masked_fill_ keeps (one per micro-batch, broadcast over b
        # and the heads)
        saved += seq_length / layout.cp * seq_length
    return saved


def checkpoint_groups(chunk: range, layout: ParallelLayout) -> list[range]:
    """The groups of layers of one model chunk that full recompute checkpoints (each keeps only its
    input and runs its forward again in backward); none without full recompute. Uniform: the chunk
    in groups of ``recompute_num_layers``; block: its first ``recompute_num_layers`` layers, one by
    one (Megatron-Core 0.16.1 ``TransformerBlock._checkpointed_forward``)."""
    if layout.recompute != "full":
        return []
    n = layout.recompute_num_layers
    if layout.recompute_method == "uniform":
        return [chunk[i:i + n] for i in range(0, len(chunk), n)]
    return [chunk[i:i + 1] for i in range(min(n, len(chunk)))]


def recomputed_layers(num_layers: int, layout: ParallelLayout) -> list[int]:
    """Every layer whose forward full recompute runs a second time (once per micro-batch)."""
    return [
        i
        for stage in range(layout.pp)
        for chunk in schedule.chunk_layers(num_layers, layout.pp, layout.vp, stage)
        for group in checkpoint_groups(chunk, layout)
        for i in group
    ]


def _chunk_activation_bytes(
    model: PlannedModel,
    layout: ParallelLayout,
    chunk: range,
    seq_length: int,
    micro_batch_size: int,
    opts: ActivationOptions | None,
) -> tuple[float, float]:
    """``(saved, recomputed)`` bytes of one model chunk: what one micro-batch keeps for backward,
    and what the largest checkpointed group holds live while it is run again (0 without full
    recompute)."""
    groups = checkpoint_groups(chunk, layout)
    if not groups:
        saved = sum(layer_activation_bytes(model, layout, i, seq_length, micro_batch_size, opts)
                    for i in chunk)
        return saved, 0.0

    def full(i: int) -> float:
        return layer_activation_bytes(model, layout, i, seq_length, micro_batch_size, opts,
                                      recompute="none")

    checkpointed = {i for group in groups for i in group}
    # a group keeps its input: layer_activation_bytes' "full" count (2h per token, R)
    group_input = layer_activation_bytes(model, layout, chunk[0], seq_length, micro_batch_size,
                                         opts, recompute="full")
    saved = len(groups) * group_input + sum(full(i) for i in chunk if i not in checkpointed)
    return saved, max(sum(full(i) for i in group) for group in groups)


@lru_cache(maxsize=65536)
def stage_activation_bytes(
    model: PlannedModel,
    layout: ParallelLayout,
    stage: int,
    seq_length: int,
    micro_batch_size: int,
    num_microbatches: int,
    opts: ActivationOptions | None = None,
) -> float:
    """Saved activations of one rank of ``stage`` at its schedule's peak (the micro-batches of each
    chunk in flight, :func:`.schedule.peak_in_flight`), plus the largest group full recompute runs
    again (once: one micro-batch is in backward at a time)."""
    chunks = schedule.chunk_layers(model.num_layers, layout.pp, layout.vp, stage)
    per_chunk = [
        _chunk_activation_bytes(model, layout, c, seq_length, micro_batch_size, opts)
        for c in chunks
    ]
    total = schedule.peak_in_flight([saved for saved, _ in per_chunk], layout.pp, stage,
                                    num_microbatches)
    total += max(recomputed for _, recomputed in per_chunk)
    opts = opts or ActivationOptions()
    if not opts.flash_attention and any(model.is_full_attention(i) for c in chunks for i in c):
        total += attention_score_bytes(model, layout, seq_length, micro_batch_size, opts)
    return total


def attention_score_bytes(
    model: PlannedModel,
    layout: ParallelLayout,
    seq_length: int,
    micro_batch_size: int,
    opts: ActivationOptions,
) -> float:
    """One ``[b * a/t, s/cp, s]`` score tensor of unfused attention: the persistent score buffer
    Megatron's local ``DotProductAttention`` keeps per rank (the global memory buffer ``baddbmm``
    writes into) is one; the backward of one layer holds two more at once
    (:attr:`Term.ATTENTION_BACKWARD`: the gradient of the probabilities, then of the scores)."""
    heads = model.num_attention_heads // layout.tp
    return micro_batch_size * heads * seq_length / layout.cp * seq_length * opts.activation_bytes


def cp_exchange_bytes(
    model: PlannedModel, layout: ParallelLayout, seq_length: int, micro_batch_size: int,
    activation_bytes: int = 2,
) -> float:
    """Transformer Engine's context-parallel exchange buffers of one attention layer (one layer
    runs at a time; 0 without context parallelism): ``p2p``, the backward's K/V and dK/dV send
    and receive buffers, four local K/V chunks; ``all_gather``, the gathered K and V and their
    gradients, four of the whole sequence's; ``a2a``, the sequence-gathered Q, K and V of
    ``1/cp`` of the heads."""
    if layout.cp == 1:
        return 0.0
    n = seq_length * micro_batch_size  # the whole sequence's tokens
    groups = max(1, model.num_query_groups // layout.tp)
    heads = model.num_attention_heads // layout.tp
    d = model.head_dim
    kv_local = n / layout.cp * 2 * groups * d  # one local K/V chunk, elements
    if layout.cp_comm_type == "p2p":
        elements = 4 * kv_local
    elif layout.cp_comm_type == "all_gather":
        elements = 4 * n * 2 * groups * d
    else:  # a2a
        elements = n * (heads + 2 * groups) * d / layout.cp
    return elements * activation_bytes


def teacher_forward_working_bytes(
    model: PlannedModel,
    layout: ParallelLayout,
    seq_length: int,
    micro_batch_size: int,
    activation_bytes: int = 2,
    flash_attention: bool = True,
) -> float:
    """Peak live bytes of one no-grad teacher layer forward (nothing saved): the residual stream and
    the norm output (R), plus the larger of the mixer's and the MLP's intermediates (S), over the
    rank's ``s*b/cp`` tokens; without flash attention, the scores and probabilities
    ``[b, a/t, s/cp, s]`` of one layer as well (with context parallelism, and the gathered keys
    and values repeated to every head); with it and context parallelism, the exchange's buffers
    (:func:`cp_exchange_bytes`)."""
    n = layout.local_tokens(seq_length, micro_batch_size)
    h = model.hidden_size
    t = layout.tp
    r_div = t if layout.sequence_parallel else 1
    a, g, d = model.num_attention_heads, model.num_query_groups, model.head_dim
    mixer = 2 * (2 * a * d + 2 * g * d) * (2 if model.attention_output_gate else 1)
    if model.linear_attention_layers:
        kd = model.linear_num_key_heads * model.linear_key_head_dim
        vd = model.linear_num_value_heads * model.linear_value_head_dim
        mixer = max(mixer, 2 * (2 * kd + 2 * vd) + 2 * (2 * kd + vd))
    if model.is_moe:
        mlp = (
            model.moe_router_topk
            * layout.expert_tp
            * (4 * h + 6 * model.moe_ffn_hidden_size / layout.expert_tp)
        )
        mlp += 6 * model.moe_shared_expert_ffn_hidden_size
    else:
        mlp = 6 * model.ffn_hidden_size
    attention = 0.0
    if not flash_attention:
        attention = (2 * micro_batch_size * (a // t) * seq_length / layout.cp * seq_length
                     * activation_bytes)
        if layout.cp > 1:  # the gathered K and V, repeated to every head
            attention += 2 * seq_length * micro_batch_size * (a // t) * d * activation_bytes
    else:
        attention = cp_exchange_bytes(model, layout, seq_length, micro_batch_size,
                                      activation_bytes)
    return n * (4 * h / r_div + max(mixer, mlp) / t) * activation_bytes / 2 + attention


def window_rows(student: PlannedModel, layout: ParallelLayout, window_size: int | None,
                gpu: GpuLoss | None = None, n_rows: int | None = None, models: int = 2,
                activation_bytes: int = 2) -> int:
    """Rows per window: on the GPU path (``gpu`` given) its byte rule over ``n_rows`` tokens of
    ``models`` logit buffers; else ``window_size`` or the CPU path's default for this
    vocabulary shard."""
    if gpu is not None:
        if n_rows is None:
            raise ValueError("the GPU path's windows need the call's rows (n_rows)")
        v = student.padded_vocab(layout.tp) // layout.tp
        return gpu_window_rows(v, models, activation_bytes, window_size, n_rows,
                               gpu.window_bytes)
    if window_size is not None and window_size <= 0:
        raise ValueError(f"window_size must be > 0 or None, got {window_size}")
    return cpu_window_rows(student.padded_vocab(layout.tp) // layout.tp, window_size)


def output_layer_activation_bytes(
    model: PlannedModel,
    layout: ParallelLayout,
    seq_length: int,
    micro_batch_size: int,
    dense_output_layer: bool,
    activation_bytes: int = 2,
) -> float:
    """Final-norm input ``2h`` (R) and, when the output layer runs as a layer (the dense loss), its
    saved input ``2h`` (R); the fused loss saves nothing of its input (gradients come from
    forward)."""
    r_div = layout.tp if layout.sequence_parallel else 1
    per_token = (4 if dense_output_layer else 2) * model.hidden_size
    n = layout.local_tokens(seq_length, micro_batch_size)
    return n * per_token / r_div * activation_bytes / 2


def dense_loss_bytes(
    student: PlannedModel,
    teacher: PlannedModel,
    layout: ParallelLayout,
    seq_length: int,
    micro_batch_size: int,
) -> float:
    """Dense KD loss (ModelOpt's, the colocated-dense mode): bf16 logits + fp32 copy + fp32
    softmax, student and teacher: ``10`` bytes per local logit each (the rank's ``s*b/cp``
    rows)."""
    n = layout.local_tokens(seq_length, micro_batch_size)
    v_s = student.padded_vocab(layout.tp) // layout.tp
    v_t = teacher.padded_vocab(layout.tp) // layout.tp
    return n * (10 * v_s + 10 * v_t)


#: The dense-logits baseline's (``--kd-loss-path dense``, :mod:`megatron_kd.loss.dense`) peak
#: bytes per token and local vocabulary column, forward KL at T = 1, beyond the returned
#: gradients: with a dense teacher (the student's bf16 logits, their fp32 copy and
#: log-probabilities; the teacher's the same, no grad; the KL's products autograd keeps for
#: backward and the logits' gradient) and with a top-K teacher (the student's alone). Counted on
#: the implementation: the peak of live tensor storages over its forward and backward
#: (``tests/unit/test_dense_loss.py`` holds the two within 10%).
DENSE_PATH_BYTES_PER_LOGIT = {"dense": 28, "topk": 12}


def dense_path_loss_bytes(
    student: PlannedModel,
    layout: ParallelLayout,
    seq_length: int,
    micro_batch_size: int,
    dense_teacher: bool,
    topk: int = 0,
) -> float:
    """The dense-logits baseline's buffers on the last stage (``--kd-loss-path dense``):
    :data:`DENSE_PATH_BYTES_PER_LOGIT` a local logit of the rank's ``s*b/cp`` rows, and with a
    top-K teacher its ``K`` ids and log-probs (12 bytes an entry) a row."""
    n = layout.local_tokens(seq_length, micro_batch_size)
    v_s = student.padded_vocab(layout.tp) // layout.tp
    if dense_teacher:
        return n * DENSE_PATH_BYTES_PER_LOGIT["dense"] * v_s
    return n * (DENSE_PATH_BYTES_PER_LOGIT["topk"] * v_s + 12 * topk)


@dataclass(kw_only=True, frozen=True)
class GpuLoss:
    """The fused loss's GPU path as a run sets it (``--kd-loss-window-mib``,
    ``--kd-loss-weight-grad``)."""

    window_bytes: int = DEFAULT_GPU_WINDOW_BYTES
    weight_grad: str = DEFAULT_WEIGHT_GRAD

    def __post_init__(self) -> None:
        if not isinstance(self.window_bytes, int) or isinstance(self.window_bytes, bool) \
                or self.window_bytes <= 0:
            raise ValueError(f"window_bytes must be a positive int, got {self.window_bytes!r}")
        if self.weight_grad not in WEIGHT_GRADS:
            raise ValueError(f"weight_grad must be one of {WEIGHT_GRADS}, got "
                             f"{self.weight_grad!r}")


@dataclass(kw_only=True, frozen=True)
class FusedLossBytes:
    """The fused loss's buffers on the last stage, by part (see :func:`fused_loss_bytes`)."""

    window: float
    """A window's logits and a block's elementwise temporaries."""

    gradients: float
    """The gradient accumulators (hidden and output layer)."""

    gathered: float
    """With sequence parallelism, the all-gathered hidden states (else 0)."""

    row_statistics: float
    """The per-row fp32 statistics."""


def fused_loss_bytes(
    student: PlannedModel,
    layout: ParallelLayout,
    seq_length: int,
    micro_batch_size: int,
    window_size: int | None,
    dense_teacher: bool,
    teacher_hidden_size: int = 0,
    activation_bytes: int = 2,
    block_elements: int | None = None,
    gpu: GpuLoss | None = None,
) -> FusedLossBytes:
    """The fused loss (``megatron_kd.loss``, ``backward="precompute"``), by part: its GPU path
    when ``gpu`` is given (:func:`_gpu_fused_loss_bytes`), else its CPU path:

    * ``window``: per window of ``w`` rows and ``v = V/t`` local columns, the matmul output in the
      input dtype (``2wv``; none in fp32, where the cast is a no-op) and fp32 buffers: the logits
      of the window (student and teacher ``8wv``; top-K targets: the student's ``4wv``) and the
      elementwise temporaries of a block of ``r`` rows (teacher exponentials and the logit
      gradient's scratch ``8rv``; top-K ``4rv``). A block is the window (``r = w``: ``16wv`` and
      ``8wv``) except on CPU without TP, where the loss works through a window in blocks of
      ``block_elements / v`` rows that fit the last-level cache
      (``megatron_kd.loss.config.CpuTuning.block_elements``).
    * ``gradients``: the fp32 accumulators filled in forward: hidden ``4*n*h_s`` and output layer
      ``4*v*h_s``.
    * ``gathered``: with sequence parallelism, the all-gathered student (and teacher) hidden states
      ``n*(h_s + h_t)`` in the activation dtype.
    * ``row_statistics``: eight fp32 values per row, ``32n``.

    ``n`` is the rank's rows, ``s*b/cp`` with context parallelism.
    """
    n = seq_length * micro_batch_size // layout.cp
    if gpu is not None:
        return _gpu_fused_loss_bytes(student, layout, n, window_size, dense_teacher,
                                     teacher_hidden_size, activation_bytes, gpu)
    w = min(window_rows(student, layout, window_size), n)
    v = student.padded_vocab(layout.tp) // layout.tp
    h = student.hidden_size
    if block_elements is not None and block_elements <= 0:
        raise ValueError(f"block_elements must be > 0 or None, got {block_elements}")
    r = w if block_elements is None else min(w, max(1, block_elements // v))
    # the matmul output is a separate bf16 buffer before its fp32 cast; in fp32 it is the buffer
    matmul_out = 0 if activation_bytes == 4 else activation_bytes
    per_row = 8 if dense_teacher else 4  # fp32 logits, or fp32 temporaries, per local column
    return FusedLossBytes(
        window=w * v * (matmul_out + per_row) + r * v * per_row,
        gradients=4 * n * h + 4 * v * h,
        gathered=_gathered_bytes(layout, n, h, dense_teacher, teacher_hidden_size,
                                 activation_bytes),
        row_statistics=32 * n,
    )


def _gathered_bytes(layout: ParallelLayout, n: int, h: int, dense_teacher: bool,
                    teacher_hidden_size: int, activation_bytes: int) -> float:
    """With sequence parallelism, the all-gathered student (and dense teacher) hidden states."""
    if layout.sequence_parallel and layout.tp > 1:
        return n * (h + (teacher_hidden_size if dense_teacher else 0)) * activation_bytes
    return 0.0


def _gpu_fused_loss_bytes(student: PlannedModel, layout: ParallelLayout, n: int,
                          window_size: int | None, dense_teacher: bool,
                          teacher_hidden_size: int, activation_bytes: int,
                          gpu: GpuLoss) -> FusedLossBytes:
    """The GPU path (``megatron_kd.loss.gpu``, docs/loss.md's account), by part:

    * ``window``: the student's (and a dense teacher's) ``[w, V/t]`` logits in the input dtype,
      ``w`` from the byte budget over the rank's ``n`` rows;
    * ``gradients``: the hidden gradient ``n*h`` in the input dtype at TP 1 (each window's GEMM
      writes its rows), fp32 with TP (summed over the shards first); the output layer's
      accumulator ``V/t * h``: fp32 (``fp32_gemm``), fp32 plus a window's product in the input
      dtype (``fp32_add``), or the input dtype (``input_dtype``);
    * ``gathered`` as the CPU path's; ``row_statistics``: four fp32 values per row kept for the
      backward and the window's seven, ``32n`` as a bound.
    """
    models = 2 if dense_teacher else 1
    v = student.padded_vocab(layout.tp) // layout.tp
    h = student.hidden_size
    w = window_rows(student, layout, window_size, gpu, n, models, activation_bytes)
    hidden = n * h * (activation_bytes if layout.tp == 1 else 4)
    accumulator = {"fp32_gemm": 4, "fp32_add": 4 + activation_bytes,
                   "input_dtype": activation_bytes}[gpu.weight_grad]
    if activation_bytes >= 4:  # fp32 (fp64) inputs: the accumulator is the input dtype
        accumulator = activation_bytes
    return FusedLossBytes(
        window=w * v * models * activation_bytes,
        gradients=hidden + accumulator * v * h,
        gathered=_gathered_bytes(layout, n, h, dense_teacher, teacher_hidden_size,
                                 activation_bytes),
        row_statistics=32 * n,
    )


#: Bytes of one decoded top-K entry: an int64 token id and an fp32 log-prob (the dtypes
#: ``megatron_kd.cache.reader.TopKCacheReader`` returns and the trainer hands to the loss),
#: measured against what the cache decodes by ``tests/unit/test_cache_offline.py``.
DECODED_TOPK_ENTRY_BYTES = 12


def cache_reader_bytes(
    seq_length: int, micro_batch_size: int, topk: int, resident_microbatches: int = 1,
    cp: int = 1,
) -> float:
    """Decoded top-K targets in device memory: ``resident_microbatches * n * K * 12`` (one
    micro-batch on a GPU; see the module docstring for CPU runs), whole sequences (a cache is per
    sequence); with context parallelism also the rank's ``1/cp`` of the one in use, selected."""
    if topk <= 0 or resident_microbatches <= 0:
        raise ValueError(
            f"topk={topk} and resident_microbatches={resident_microbatches} must be > 0"
        )
    per_microbatch = seq_length * micro_batch_size * topk * DECODED_TOPK_ENTRY_BYTES
    selected = per_microbatch / cp if cp > 1 else 0.0
    return resident_microbatches * per_microbatch + selected


@dataclass(kw_only=True, frozen=True)
class RingBytes:
    """The disaggregated receive side of one student TP rank (see :func:`ring_bytes`)."""

    slots: float
    """The ``D`` receive slots of the prefetch ring."""

    gathered_hidden: float
    """The one gathered ``[s, b, h_t]`` buffer in use."""


def ring_bytes(
    teacher: PlannedModel,
    layout: ParallelLayout,
    seq_length: int,
    micro_batch_size: int,
    prefetch_depth: int,
    hidden_bytes: int = 2,
    wire_bytes_per_token: int | None = None,
) -> RingBytes:
    """Disaggregated receive side on one student rank: ``D`` slots of ``1/t`` of its ``s/cp``
    positions (``wire_bytes_per_token`` each token, default ``h_t * hidden_bytes``) and the one
    gathered ``[s/cp, b, h_t]`` buffer in use (a replica answers each context-parallel rank its
    positions)."""
    if prefetch_depth <= 0:
        raise ValueError(
            f"prefetch_depth must be >= 1 for the disaggregated ring, got {prefetch_depth}"
        )
    n = layout.local_tokens(seq_length, micro_batch_size)
    per_token = (teacher.hidden_size * hidden_bytes if wire_bytes_per_token is None
                 else wire_bytes_per_token)
    slot = n * per_token / layout.tp
    return RingBytes(slots=prefetch_depth * slot,
                     gathered_hidden=n * teacher.hidden_size * hidden_bytes)


def teacher_output_layer_bytes(
    teacher: PlannedModel, layout: ParallelLayout, param_bytes: int = 2
) -> int:
    """The frozen teacher output-layer shard a student TP rank holds: ``V_t/t * h_t``."""
    return teacher.padded_vocab(layout.tp) // layout.tp * teacher.hidden_size * param_bytes
