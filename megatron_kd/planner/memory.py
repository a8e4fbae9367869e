"""Per-GPU memory, term by term (pure Python, no torch): the terms distillation adds to a model's
own memory, described and computed here, and the model's own state and activations, re-exported
from :mod:`.model_memory` (its docstring states the notation both use; ``_s`` and ``_t`` mark the
student's and the teacher's sizes). Every memory term is importable from here.

The loss (one micro-batch at a time, on the last stage)
---------------------------------------------------------
* final-norm input ``2h`` (R), every mode; the output layer's saved input ``2h`` (R) only where the
  output layer runs as a layer (the dense loss).
* dense KD loss (the incumbent, ModelOpt ``LogitsKLLoss``): per token and local vocabulary entry,
  student logits bf16 2 + their fp32 copy 4 + the fp32 softmax kept for backward 4, and the same
  for the teacher: ``n * (10*V_s + 10*V_t)/t`` bytes. (The fp32 gradient of the logits in backward
  reuses the freed upcast; the count is the forward peak.)
* fused KD loss (``megatron_kd.loss``, gradients precomputed in forward; source: its code): per
  window of ``w`` rows (default: ``2^24 / (V/t)`` rows, a 64 MiB fp32 buffer) the matmul output in
  bf16 ``2wV/t`` and fp32 buffers: four with a dense teacher (student logits, teacher logits,
  teacher exponentials, the logit gradient's scratch) ``16wV/t``, two with top-K targets
  ``8wV/t`` (on CPU without TP the last two, or the last one, are a cache-sized block's, see
  :func:`fused_loss_bytes`); the fp32
  gradient accumulators ``4nh`` (hidden) and ``4hV/t`` (output layer); with sequence parallelism the
  gathered hidden states ``2n(h + h_t)``; eight fp32 statistics per row ``32n``.
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

A fixed reserve (CUDA context, NCCL buffers, allocator fragmentation) is added to every plan; the
default is stated where it is set (``options.PlanOptions.reserve_bytes``).
"""

from __future__ import annotations

from megatron_kd.planner.model_memory import (
    RECOMPUTE_CHOICES,
    ActivationOptions,
    ParallelLayout,
    Precision,
    attention_score_buffer_bytes,
    in_flight_microbatches,
    layer_activation_bytes,
    model_state_bytes,
    rank_params,
    stage_activation_bytes,
    stage_layers,
    teacher_forward_working_bytes,
    validate_layout,
)
from megatron_kd.planner.models import ModelConfig

__all__ = [
    "DECODED_TOPK_ENTRY_BYTES",
    "DEFAULT_WINDOW_ELEMENTS",
    "RECOMPUTE_CHOICES",
    "ActivationOptions",
    "ParallelLayout",
    "Precision",
    "attention_score_buffer_bytes",
    "cache_reader_bytes",
    "default_window_rows",
    "dense_loss_bytes",
    "fused_loss_bytes",
    "in_flight_microbatches",
    "layer_activation_bytes",
    "model_state_bytes",
    "output_layer_activation_bytes",
    "rank_params",
    "ring_bytes",
    "stage_activation_bytes",
    "stage_layers",
    "teacher_forward_working_bytes",
    "teacher_output_layer_bytes",
    "validate_layout",
    "window_rows",
]

#: The fused loss's default window: rows such that one ``[rows, local_vocab]`` fp32 buffer holds at
#: most 2^24 elements (64 MiB), as ``megatron_kd.loss.KDLossConfig.rows_per_window`` chooses.
DEFAULT_WINDOW_ELEMENTS = 1 << 24


def default_window_rows(local_vocab_size: int) -> int:
    """The fused loss's rows per window when ``--kd-window-size`` is not given."""
    return max(1, DEFAULT_WINDOW_ELEMENTS // max(1, local_vocab_size))


def window_rows(student: ModelConfig, layout: ParallelLayout, window_size: int | None) -> int:
    """Rows per window: ``window_size`` or the loss's default for this vocabulary shard."""
    if window_size is None:
        return default_window_rows(layout.padded_vocab(student.vocab_size) // layout.tp)
    if window_size <= 0:
        raise ValueError(f"window_size must be > 0 or None, got {window_size}")
    return window_size


def output_layer_activation_bytes(
    model: ModelConfig,
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
    return seq_length * micro_batch_size * per_token / r_div * activation_bytes / 2


def dense_loss_bytes(
    student: ModelConfig,
    teacher: ModelConfig,
    layout: ParallelLayout,
    seq_length: int,
    micro_batch_size: int,
) -> float:
    """Dense KD loss: bf16 logits + fp32 copy + fp32 softmax, student and teacher: ``10`` bytes per
    local logit each."""
    n = seq_length * micro_batch_size
    v_s = layout.padded_vocab(student.vocab_size) // layout.tp
    v_t = layout.padded_vocab(teacher.vocab_size) // layout.tp
    return n * (10 * v_s + 10 * v_t)


def fused_loss_bytes(
    student: ModelConfig,
    layout: ParallelLayout,
    seq_length: int,
    micro_batch_size: int,
    window_size: int | None,
    dense_teacher: bool,
    teacher_hidden_size: int = 0,
    activation_bytes: int = 2,
    block_elements: int | None = None,
) -> dict[str, float]:
    """The fused loss (``megatron_kd.loss``, ``backward="precompute"``), by part.

    * ``window``: per window of ``w`` rows and ``v = V/t`` local columns, the matmul output in the
      input dtype (``2wv``; none in fp32, where the cast is a no-op) and fp32 buffers: the logits
      of the window (student and teacher ``8wv``; top-K targets: the student's ``4wv``) and the
      elementwise temporaries of a block of ``r`` rows (teacher exponentials and the logit
      gradient's scratch ``8rv``; top-K ``4rv``). A block is the window (``r = w``: ``16wv`` and
      ``8wv``) except on CPU without TP, where the loss works through a window in blocks of
      ``block_elements / v`` rows that fit the last-level cache
      (``megatron_kd.loss.window.CPU_BLOCK_ELEMENTS``).
    * ``gradients``: the fp32 accumulators filled in forward: hidden ``4*n*h_s`` and output layer
      ``4*v*h_s``.
    * ``gathered``: with sequence parallelism, the all-gathered student (and teacher) hidden states
      ``n*(h_s + h_t)`` in the activation dtype.
    * ``row statistics``: eight fp32 values per row, ``32n``.
    """
    n = seq_length * micro_batch_size
    w = min(window_rows(student, layout, window_size), n)
    v = layout.padded_vocab(student.vocab_size) // layout.tp
    h = student.hidden_size
    if block_elements is not None and block_elements <= 0:
        raise ValueError(f"block_elements must be > 0 or None, got {block_elements}")
    r = w if block_elements is None else min(w, max(1, block_elements // v))
    # the matmul output is a separate bf16 buffer before its fp32 cast; in fp32 it is the buffer
    matmul_out = 0 if activation_bytes == 4 else activation_bytes
    per_row = 8 if dense_teacher else 4  # fp32 logits, or fp32 temporaries, per local column
    out = {
        "window": w * v * (matmul_out + per_row) + r * v * per_row,
        "gradients": 4 * n * h + 4 * v * h,
        "gathered": 0.0,
        "row statistics": 32 * n,
    }
    if layout.sequence_parallel and layout.tp > 1:
        out["gathered"] = n * (h + (teacher_hidden_size if dense_teacher else 0)) * activation_bytes
    return out


#: Bytes of one decoded top-K entry: an int64 token id and an fp32 log-prob (the dtypes
#: ``megatron_kd.cache.format.TopKCacheReader`` returns and the trainer hands to the loss).
DECODED_TOPK_ENTRY_BYTES = 12


def cache_reader_bytes(
    seq_length: int, micro_batch_size: int, topk: int, resident_microbatches: int = 1
) -> float:
    """Decoded top-K targets in device memory: ``resident_microbatches * n * K * 12`` (one
    micro-batch on a GPU; see the module docstring for CPU runs)."""
    if topk <= 0 or resident_microbatches <= 0:
        raise ValueError(
            f"topk={topk} and resident_microbatches={resident_microbatches} must be > 0"
        )
    return resident_microbatches * seq_length * micro_batch_size * topk * DECODED_TOPK_ENTRY_BYTES


def ring_bytes(
    teacher: ModelConfig,
    layout: ParallelLayout,
    seq_length: int,
    micro_batch_size: int,
    prefetch_depth: int,
    hidden_bytes: int = 2,
    wire_bytes_per_token: int | None = None,
) -> dict[str, float]:
    """Disaggregated receive side on one student TP rank: ``D`` slots of ``1/t`` of the sequence
    (``wire_bytes_per_token`` each token, default ``h_t * hidden_bytes``) and the one gathered
    ``[s, b, h_t]`` buffer in use."""
    if prefetch_depth <= 0:
        raise ValueError(
            f"prefetch_depth must be >= 1 for the disaggregated ring, got {prefetch_depth}"
        )
    n = seq_length * micro_batch_size
    per_token = (teacher.hidden_size * hidden_bytes if wire_bytes_per_token is None
                 else wire_bytes_per_token)
    slot = n * per_token / layout.tp
    return {
        "ring_slots": prefetch_depth * slot,
        "gathered_hidden": n * teacher.hidden_size * hidden_bytes,
    }


def teacher_output_layer_bytes(
    teacher: ModelConfig, layout: ParallelLayout, param_bytes: int = 2
) -> int:
    """The frozen teacher output-layer shard a student TP rank holds: ``V_t/t * h_t``."""
    return layout.padded_vocab(teacher.vocab_size) // layout.tp * teacher.hidden_size * param_bytes
