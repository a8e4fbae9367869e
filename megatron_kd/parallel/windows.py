"""How the fused loss cuts its rows into windows: the rule the loss runs and the planner counts,
written once. Pure Python.

A window is the rows (tokens) projected onto a rank's vocabulary shard at once; its size bounds
the loss's working memory. The CPU path bounds a window's fp32 logits by elements
(:data:`DEFAULT_WINDOW_ELEMENTS`); the GPU path by bytes of input-dtype logits
(:data:`DEFAULT_GPU_WINDOW_BYTES`), balanced over the call's rows in whole GEMM tiles.

:func:`gpu_loss_memory` is the GPU path's working memory that follows from those windows: an
account of the buffers its code allocates, term by term (docs/loss.md, the GPU path's cost
account); tests/unit/test_loss_memory_account.py holds the code to it.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DEFAULT_GPU_WINDOW_BYTES", "DEFAULT_WEIGHT_GRAD", "DEFAULT_WINDOW_ELEMENTS",
           "GPU_CALL_RECORD_BYTES", "GPU_ROW_RECORD_BYTES", "GPU_TOKEN_RECORD_BYTES",
           "GPU_TOPK_ENTRY_BYTES", "GpuLossMemory", "ROW_TILE", "WEIGHT_GRADS",
           "cpu_window_rows", "gpu_loss_memory", "gpu_window_rows"]

#: The CPU path's default bound on one window: ``[w, V_local]`` fp32 elements (64 MiB).
DEFAULT_WINDOW_ELEMENTS = 1 << 24

#: The GPU path's default bound on one window's logits, in bytes (``--kd-loss-window-mib`` 1024).
DEFAULT_GPU_WINDOW_BYTES = 1 << 30

#: Rows of one GEMM tile of the GPU path: balanced windows are rounded up to whole tiles.
ROW_TILE = 128

#: The GPU path's output-layer weight-gradient accumulators (``--kd-loss-weight-grad``).
WEIGHT_GRADS = ("fp32_gemm", "fp32_add", "input_dtype")
#: The accumulator a run uses unless told otherwise.
DEFAULT_WEIGHT_GRAD = "fp32_gemm"


def cpu_window_rows(local_vocab_size: int, window_size: int | None = None) -> int:
    """Rows of one CPU-path window: ``window_size`` when given, else as many as
    :data:`DEFAULT_WINDOW_ELEMENTS` fp32 logits of ``local_vocab_size`` columns hold (at least
    one)."""
    if window_size is not None:
        return window_size
    return max(1, DEFAULT_WINDOW_ELEMENTS // max(1, local_vocab_size))


def gpu_window_rows(local_valid: int, models: int, itemsize: int, window_size: int | None,
                    n_rows: int | None = None,
                    window_bytes: int = DEFAULT_GPU_WINDOW_BYTES) -> int:
    """Rows of one GPU-path window: at most ``window_bytes`` over ``models`` logit rows of
    ``local_valid`` columns of ``itemsize`` bytes, and at most ``window_size``.

    Given the call's ``n_rows``, the windows are balanced: as few as the cap allows, of equal
    size, rounded up to whole GEMM tiles (:data:`ROW_TILE` rows) where that stays under the
    cap, else equal windows of partial tiles (never windows of the cap and a short last one).
    At V = 128,256 in bf16 with a dense teacher the 1 GiB cap is 2,093 rows, and 8,192 tokens
    take 4 windows of 2,048 (not 3 of 2,093 and one of 1,913); at V = 151,936 the cap is 1,766
    and 8,192 tokens take 5 windows of 1,664 (13 full tiles each); with 512 MiB the cap is 883
    and they take 10 windows of 820 (not 9 of 883 and one of 245)."""
    cap = max(1, window_bytes // max(1, models * local_valid * itemsize))
    if window_size is not None:
        cap = min(cap, window_size)
    if n_rows is None or n_rows <= cap:
        return cap if n_rows is None else max(1, n_rows)
    windows = -(-n_rows // cap)
    rows = -(-n_rows // windows)
    tiled = -(-rows // ROW_TILE) * ROW_TILE
    # whole tiles where they stay under the cap; else equal windows of partial tiles (never the
    # cap itself and a short last window)
    return tiled if rows > ROW_TILE and tiled <= cap else rows


#: The GPU path's small records, allowances (upper bounds) rather than counts. Per window row:
#: the per-row statistics, the combine's inputs and outputs, the rows' weights and the
#: gradient's coefficients: at most 48 fp32 values a row at once (37 in the CPU count).
GPU_ROW_RECORD_BYTES = 192
#: Per window row and top-K entry: the ids mapped onto the shard (int64) and their mask, the
#: teacher's ``q`` and ``log q`` and the student's logits at the ids (fp32), a product of two.
GPU_TOPK_ENTRY_BYTES = 32
#: Per token of the call: the active rows' int64 indices and the default fp32 loss mask.
GPU_TOKEN_RECORD_BYTES = 12
#: Per call: its scalars (the sums of the terms, the token count, the finite check's state,
#: the incoming gradient).
GPU_CALL_RECORD_BYTES = 256

_TEACHERS = ("dense", "topk", "none")
_BACKWARDS = ("precompute", "recompute")


@dataclass(frozen=True, kw_only=True)
class GpuLossMemory:
    """The GPU path's working memory over one call, forward and backward, in bytes above its
    inputs: an account of what its code allocates (:func:`gpu_loss_memory`), not a
    measurement."""

    rows: int
    """Rows of one window."""

    windows: int
    """Windows of the call."""

    forward: int
    """The peak during forward (the window loop, with the gradient buffers of a precomputing
    backward)."""

    backward: int
    """The peak during backward (the recomputing backward's window loop, or the end where the
    weight gradient is rounded to the weight's dtype)."""

    returned: int
    """The returned gradients: the hidden states' and the weight's (with gradient-accumulation
    fusion, Megatron's placeholder in its place)."""

    records: int
    """Of :attr:`forward` and :attr:`backward`, at most this much is the small records'
    allowance (``GPU_*_RECORD_BYTES``, ``GPU_TOPK_ENTRY_BYTES``): the rest is exact, and
    what the code holds lies between the account less this and the account."""

    @property
    def peak(self) -> int:
        """The call's peak above its inputs."""
        return max(self.forward, self.backward)

    @property
    def beyond_returned(self) -> int:
        """The peak less the returned gradients: the working memory the loss adds to them."""
        return self.peak - self.returned


def gpu_loss_memory(tokens: int, local_valid: int, hidden_size: int, itemsize: int, *,
                    teacher: str = "dense", topk: int = 0, backward: str = "precompute",
                    weight_grad: str = DEFAULT_WEIGHT_GRAD, main_grad_fusion: bool = False,
                    window_bytes: int = DEFAULT_GPU_WINDOW_BYTES,
                    window_size: int | None = None) -> GpuLossMemory:
    """The GPU path's working memory at TP 1 (one vocabulary shard, no sequence parallelism),
    every token active, gradients for the student's hidden states and weight, kernels that
    allocate nothing but their outputs (the Triton form).

    ``tokens`` rows (``n``) of ``hidden_size`` (``h``) against ``local_valid`` (``V``)
    vocabulary rows, inputs of ``itemsize`` (``b``) bytes, computing in ``c`` = 4 (8 for
    fp64); ``teacher`` ``"dense"`` (two logit buffers), ``"topk"`` with ``topk`` entries a
    token, or ``"none"`` (one buffer each); windows of ``r`` rows (:func:`gpu_window_rows`).
    The terms:

    * window logits ``L = models * r * V * b``, from the first window to the end of the pass;
    * weight-gradient accumulator ``A = V * h * a``, ``a`` = ``c``, or ``b`` with
      ``weight_grad="input_dtype"``; with ``"recompute"`` and ``main_grad_fusion`` it is
      ``main_grad`` (fp32, an input: ``A = 0``); ``fp32_add`` adds the window's product
      ``P = V * h * b`` where the accumulator is wider than the inputs;
    * the weight gradient in the weight's dtype, ``W = V * h * b``, returned: rounded from
      ``A`` where ``a != b`` (else ``A`` itself, scaled in place), Megatron's placeholder with
      ``main_grad_fusion``;
    * hidden gradient ``X = n * h * b``, written by each window's GEMM, returned;
    * the recomputing backward's per-row statistics ``S = 4 * n * c``;
    * small records ``R`` (allowances, see :attr:`GpuLossMemory.records`): per window row
      :data:`GPU_ROW_RECORD_BYTES` and :data:`GPU_TOPK_ENTRY_BYTES` a top-K entry, per token
      :data:`GPU_TOKEN_RECORD_BYTES`, per call :data:`GPU_CALL_RECORD_BYTES`.

    ``"precompute"``: forward ``X + A + P + L + R``; backward ``X + A + W`` where ``a != b``,
    ``X + A`` where ``A`` is scaled in place, ``X + max(A, W)`` with fusion (``A`` added to
    ``main_grad`` and freed before the placeholder). ``"recompute"``: forward ``L + S + R``;
    backward the larger of its window loop ``L + S + R + X + A + P`` and its end (the windows
    and statistics freed) ``X + A + W`` where ``a != b``, else ``X + A``; with fusion ``X + W``.
    """
    if teacher not in _TEACHERS:
        raise ValueError(f"teacher must be one of {_TEACHERS}, got {teacher!r}")
    if backward not in _BACKWARDS:
        raise ValueError(f"backward must be one of {_BACKWARDS}, got {backward!r}")
    if weight_grad not in WEIGHT_GRADS:
        raise ValueError(f"weight_grad must be one of {WEIGHT_GRADS}, got {weight_grad!r}")
    if (teacher == "topk") != (topk > 0):
        raise ValueError(f"topk entries ({topk}) are for teacher='topk' only (teacher="
                         f"{teacher!r})")
    for name, value in (("tokens", tokens), ("local_valid", local_valid),
                        ("hidden_size", hidden_size), ("itemsize", itemsize)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    n, v, h, b = tokens, local_valid, hidden_size, itemsize
    c = 8 if b == 8 else 4
    models = 2 if teacher == "dense" else 1
    r = gpu_window_rows(v, models, b, window_size, n, window_bytes)
    logits = models * r * v * b
    a = b if weight_grad == "input_dtype" else c
    into_main_grad = backward == "recompute" and main_grad_fusion
    acc = 0 if into_main_grad else v * h * a
    weight = v * h * b
    product = weight if weight_grad == "fp32_add" and b != c and (a != b or into_main_grad) \
        else 0
    hidden = n * h * b
    call = GPU_CALL_RECORD_BYTES
    tokens_records = GPU_TOKEN_RECORD_BYTES * n + call
    records = r * (GPU_ROW_RECORD_BYTES + topk * GPU_TOPK_ENTRY_BYTES) + tokens_records
    if main_grad_fusion:
        # precompute: the accumulator added to main_grad, freed, then the placeholder
        end = hidden + max(acc, weight)
    else:
        end = hidden + acc + (weight if a != b else 0)
    if backward == "precompute":
        forward = hidden + acc + product + logits + records
        after = end + call
    else:
        stats = 4 * n * c
        forward = logits + stats + records
        after = max(logits + stats + records + hidden + acc + product, end + tokens_records)
    return GpuLossMemory(rows=r, windows=-(-n // r), forward=forward, backward=after,
                         returned=hidden + weight, records=records)
