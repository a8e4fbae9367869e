"""Megatron-Core's pipeline schedules, as far as memory and time need them (pure Python, no
torch): which layers each pipeline rank (and each of its model chunks) holds, how many micro-
batches' activations a rank keeps at once, and the pipeline bubble.

Notation: ``L`` layers, ``p`` pipeline-parallel size, ``v`` virtual stages (model chunks) per
pipeline rank, ``m`` micro-batches per step and data-parallel rank, ``r`` a pipeline rank
(0-based).

Sources: Megatron-Core 0.16.1 (the version installed with the project), read in
``megatron/core/pipeline_parallel/schedules.py`` (``get_pp_rank_microbatches``,
``get_schedule_table``, ``forward_backward_pipelining_with_interleaving``) and
``megatron/core/transformer/transformer_block.py`` (``get_num_layers_to_build``); Narayanan et
al., "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", SC 2021,
section 2.2 (the bubble); Korthikanti et al., "Reducing Activation Recomputation in Large
Transformer Models", MLSys 2023, section 4.2.3 (the first stage's activations).

Layers
------
* ``v = 1``: stages hold contiguous layers; the planner lets the first ``L mod p`` stages take one
  more (Megatron-Core itself asks ``L`` to divide by ``p`` unless uneven first / last stages are
  given).
* ``v > 1`` (interleaved): ``L`` must divide by ``p * v`` (Megatron-Core asserts that the layers
  per rank divide by ``v``); every chunk holds ``k = L/(p*v)`` layers and chunk ``c`` of rank ``r``
  holds layers ``(c*p + r)*k`` to ``(c*p + r + 1)*k - 1`` (8 layers, ``p = 2``, ``v = 2``: rank 0
  ``[0, 1] [4, 5]``, rank 1 ``[2, 3] [6, 7]``).

Micro-batches in flight (activations kept for backward)
-------------------------------------------------------
* 1F1B (``v = 1``, ``forward_backward_pipelining_without_interleaving``): rank ``r`` runs ``p - r -
  1`` warm-up forwards, then one forward and one backward at a time: it holds ``min(p - r, m)``
  micro-batches of its layers. The first rank holds ``p`` micro-batches of ``L/p`` layers: ``L``
  layers' worth. (A launch that names one virtual stage per rank runs the interleaved schedule
  with one chunk, ``2(p - r - 1) + 1`` micro-batches in flight: the launch reader refuses it.)
* interleaved 1F1B (``v > 1``): the forwards run in Megatron-Core's schedule table, groups of ``p``
  micro-batches (``microbatch_group_size_per_vp_stage``, default ``p``) through chunk 0, then the
  same group through chunk 1, and so on; the backwards run the same table with the chunks
  reversed. Rank ``r`` runs ``W = 2(p - r - 1) + (v - 1)p`` warm-up forwards (capped at ``m*v``),
  then alternates one forward and one backward, so it holds at most ``min(W + 1, m*v)`` chunk-
  micro-batches, each of ``k`` layers. The first rank: ``(p*v + p - 1) * L/(p*v)``, that is
  ``L(1 + (p-1)/(p*v))`` layers' worth, the paper's figure; the last rank ``((v-1)p + 1) * k``
  (more than 1F1B's ``L/p`` when ``v > 1``). Where chunks save different amounts (hybrid
  models), :func:`peak_in_flight` walks the schedule and takes the largest sum. Megatron-Core
  requires ``m >= p`` and ``m`` a multiple of ``p`` (the last group must not be smaller than
  ``p``).

Bubble
------
1F1B idles ``(p - 1)/m`` of the ideal step, the interleaved schedule ``(p - 1)/(v*m)`` (Narayanan et
al.). The interleaved schedule sends ``v`` times as many activations between stages: not in the
step time (Megatron-Core's ``overlap_p2p_comm``, on by default with it, overlaps them), but
reported and weighed against the bubble by the search (:mod:`.traffic`, :mod:`.search`).
"""

from __future__ import annotations

from collections.abc import Sequence


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{name} must be a positive int, got {value!r}")


def stage_layers(num_layers: int, pp: int, stage: int) -> range:
    """Layers of stage ``stage`` without interleaving: contiguous, the first ``num_layers % pp``
    stages take one more."""
    if not 0 <= stage < pp:
        raise ValueError(f"stage={stage} out of range for pp={pp}")
    base, extra = divmod(num_layers, pp)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (1 if stage < extra else 0))


def chunk_layers(num_layers: int, pp: int, vp: int, stage: int) -> tuple[range, ...]:
    """The layers of each model chunk of pipeline rank ``stage``, chunk 0 first (one chunk, the
    whole stage, when ``vp == 1``)."""
    _check_positive(num_layers=num_layers, pp=pp, vp=vp)
    if vp == 1:
        return (stage_layers(num_layers, pp, stage),)
    if not 0 <= stage < pp:
        raise ValueError(f"stage={stage} out of range for pp={pp}")
    # a layout megatron_kd.arch.check_layout accepted: every chunk the same whole layers
    assert pp > 1 and num_layers % (pp * vp) == 0, (num_layers, pp, vp)
    k = num_layers // (pp * vp)
    return tuple(range((c * pp + stage) * k, (c * pp + stage + 1) * k) for c in range(vp))


def rank_layers(num_layers: int, pp: int, vp: int, stage: int) -> list[int]:
    """Every layer pipeline rank ``stage`` holds, over all its chunks."""
    return [i for chunk in chunk_layers(num_layers, pp, vp, stage) for i in chunk]


def in_flight_microbatches(pp: int, stage: int, num_microbatches: int) -> int:
    """1F1B: stage ``stage`` holds the activations of ``min(pp - stage, m)`` micro-batches."""
    return min(pp - stage, num_microbatches)


def interleaved_warmup(pp: int, vp: int, stage: int, num_microbatches: int) -> int:
    """Warm-up forwards of rank ``stage`` in the interleaved schedule: ``2(p - r - 1) + (v - 1)p``,
    at most all ``m*v`` (Megatron-Core ``get_pp_rank_microbatches``)."""
    _check_positive(pp=pp, vp=vp, num_microbatches=num_microbatches)
    warmup = 2 * (pp - stage - 1) + (vp - 1) * pp
    return min(warmup, num_microbatches * vp)


def interleaved_in_flight_chunks(pp: int, vp: int, stage: int, num_microbatches: int) -> int:
    """Chunk-micro-batches rank ``stage`` holds at most: ``min(W + 1, m*v)``."""
    warmup = interleaved_warmup(pp, vp, stage, num_microbatches)
    return min(warmup + 1, num_microbatches * vp)


def schedule_chunks(pp: int, vp: int, num_microbatches: int) -> list[int]:
    """The model chunk of each forward, in order (Megatron-Core ``get_schedule_table`` with groups
    of ``pp`` micro-batches; the ``k``-th backward runs chunk ``vp - 1 - chunks[k]``)."""
    # a layout megatron_kd.arch.check_layout accepted: whole groups of pp micro-batches
    assert vp == 1 or (num_microbatches >= pp and num_microbatches % pp == 0), (pp, vp,
                                                                                num_microbatches)
    group = pp if vp > 1 else num_microbatches
    out: list[int] = []
    for first in range(0, num_microbatches, group):
        size = min(group, num_microbatches - first)
        for chunk in range(vp):
            out += [chunk] * size
    return out


def peak_in_flight(
    chunk_bytes: Sequence[float], pp: int, stage: int, num_microbatches: int
) -> float:
    """The most bytes rank ``stage`` keeps for backward, chunk ``c`` saving ``chunk_bytes[c]`` per
    micro-batch. 1F1B (one chunk): ``min(p - r, m)`` micro-batches. Interleaved: the warm-up
    forwards, then after each steady-state forward (memory only grows at a forward) what the
    earlier backwards left."""
    vp = len(chunk_bytes)
    if vp == 1:
        return in_flight_microbatches(pp, stage, num_microbatches) * chunk_bytes[0]
    chunks = schedule_chunks(pp, vp, num_microbatches)
    warmup = interleaved_warmup(pp, vp, stage, num_microbatches)
    held = sum(chunk_bytes[c] for c in chunks[:warmup])
    peak = held
    for k in range(len(chunks) - warmup):  # steady state: forward W + k, then backward k
        held += chunk_bytes[chunks[warmup + k]]
        peak = max(peak, held)
        held -= chunk_bytes[vp - 1 - chunks[k]]
    return peak


def bubble_fraction(pp: int, vp: int, num_microbatches: int) -> float:
    """Idle time over ideal time: ``(p - 1)/(v*m)`` (``(p - 1)/m`` for 1F1B)."""
    _check_positive(pp=pp, vp=vp, num_microbatches=num_microbatches)
    return (pp - 1) / (vp * num_microbatches)
