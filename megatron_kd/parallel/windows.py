"""How the fused loss cuts its rows into windows: the rule the loss runs and the planner counts,
written once. Pure Python.

A window is the rows (tokens) projected onto a rank's vocabulary shard at once; its size bounds
the loss's working memory. The CPU path bounds a window's fp32 logits by elements
(:data:`DEFAULT_WINDOW_ELEMENTS`); the GPU path by bytes of input-dtype logits
(:data:`DEFAULT_GPU_WINDOW_BYTES`), balanced over the call's rows in whole GEMM tiles.
"""

from __future__ import annotations

__all__ = ["DEFAULT_GPU_WINDOW_BYTES", "DEFAULT_WEIGHT_GRAD", "DEFAULT_WINDOW_ELEMENTS",
           "ROW_TILE", "WEIGHT_GRADS", "cpu_window_rows", "gpu_window_rows"]

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
    cap. At V = 128,256 in bf16 with a dense teacher the 1 GiB cap is 2,093 rows, and 8,192
    tokens take 4 windows of 2,048 (not 3 of 2,093 and one of 1,913); at V = 151,936 the cap
    is 1,766 and 8,192 tokens take 5 windows of 1,664 (13 full tiles each)."""
    cap = max(1, window_bytes // max(1, models * local_valid * itemsize))
    if window_size is not None:
        cap = min(cap, window_size)
    if n_rows is None or n_rows <= cap:
        return cap if n_rows is None else max(1, n_rows)
    windows = -(-n_rows // cap)
    rows = -(-n_rows // windows)
    if rows > ROW_TILE:
        rows = min(cap, -(-rows // ROW_TILE) * ROW_TILE)
    return rows
