"""Build a top-K teacher cache from any teacher that yields final hidden states.

The teacher is a callable ``teacher_forward_fn(sample_indices) -> hidden [s, b, h]`` (its last
hidden states before the output layer, for those dataset samples) plus this rank's shard of the
output layer ``[local_vocab_size, h]``. That keeps this module independent of how the teacher
is built (a Megatron model, a tiny torch module in tests) and of its parallel layout: the TP
ranks of one replica call this together (same samples), replicas split the shards.

Resuming is the same call again: shards already recorded in the manifest are skipped, the
others are recomputed from scratch, so a build killed at any moment ends byte-identical to an
uninterrupted one (given a deterministic teacher).
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import numpy as np
import torch
import torch.distributed as dist

from megatron_kd.cache.format import CacheSpec, token_fingerprint
from megatron_kd.cache.topk import vocab_parallel_topk_logprobs
from megatron_kd.cache.writer import CacheWriter


@dataclass(kw_only=True)
class BuildStats:
    """What one :func:`build_cache` call did on this rank."""

    shards_written: list[int]
    """Shard indices computed by this call (this replica's)."""
    shards_skipped: list[int]
    """This replica's shards that were already complete."""
    tokens: int
    """Tokens run through the teacher by this call."""
    seconds: float
    """Wall time of this call."""


def weights_hash(named_tensors: Iterable[tuple[str, torch.Tensor]], group=None) -> str:
    """sha256 over names, dtypes, shapes and bytes of the tensors (sorted by name).

    With ``group``, the per-rank hashes (e.g. of TP shards) are gathered and hashed in rank
    order, so every rank returns the same value.
    """
    digest = hashlib.sha256()
    for name, tensor in sorted(named_tensors, key=lambda item: item[0]):
        t = tensor.detach().cpu().contiguous()
        digest.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
        digest.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    local = digest.hexdigest()
    if group is None or dist.get_world_size(group) == 1:
        return local
    parts: list = [None] * dist.get_world_size(group)
    # Each rank hashed only its own shards: every rank needs all the pieces, in rank order.
    dist.all_gather_object(parts, local, group=group)
    return hashlib.sha256("".join(parts).encode()).hexdigest()


def _micro_batches(start: int, end: int, size: int) -> list[list[int]]:
    return [list(range(lo, min(end, lo + size))) for lo in range(start, end, size)]


def _hidden(teacher_forward_fn, batch: Sequence[int], spec: CacheSpec) -> torch.Tensor:
    """The teacher's ``[seq_length, b, h]`` hidden states of ``batch``, their shape checked."""
    hidden = teacher_forward_fn(batch)
    if hidden.dim() != 3 or hidden.shape[0] != spec.seq_length or hidden.shape[1] != len(batch):
        raise ValueError(f"teacher_forward_fn must return [seq_length={spec.seq_length}, "
                         f"b={len(batch)}, h], got {list(hidden.shape)}")
    return hidden


def _fingerprints(tokens, batch: Sequence[int], spec: CacheSpec) -> list[int]:
    """The token fingerprints of ``tokens [b, seq_length]`` (the samples ``batch``)."""
    tokens = tokens.cpu().numpy() if isinstance(tokens, torch.Tensor) else np.asarray(tokens)
    if tokens.shape != (len(batch), spec.seq_length):
        raise ValueError(f"sample_tokens_fn must return [b={len(batch)}, seq_length="
                         f"{spec.seq_length}] token ids, got {list(tokens.shape)}")
    return [token_fingerprint(row) for row in tokens]


def build_cache(
    cache_dir: str,
    spec: CacheSpec,
    *,
    teacher_forward_fn: Callable[[Sequence[int]], torch.Tensor],
    sample_tokens_fn: Callable[[Sequence[int]], torch.Tensor],
    output_weight: torch.Tensor,
    micro_batch_size: int = 1,
    window_size: int = 1024,
    tp_group=None,
    replica_group=None,
    dp_rank: int = 0,
    dp_world_size: int = 1,
    log: Callable[[str], None] | None = None,
) -> BuildStats:
    """Compute and write this replica's missing shards of the cache ``spec`` in ``cache_dir``.

    Args:
        teacher_forward_fn: ``sample_indices -> hidden [seq_length, b, h]`` (called on every
            TP rank of the replica with the same indices).
        sample_tokens_fn: ``sample_indices -> tokens [b, seq_length]`` the teacher was given,
            fingerprinted into the shard (called on the writing rank only).
        output_weight: ``[local_vocab_size, h]`` this TP rank's contiguous output-layer shard.
        micro_batch_size: samples per teacher call.
        window_size: rows projected at a time (bounds the ``[window, local_vocab]`` logits).
        tp_group: the teacher's tensor-parallel group (None: one rank).
        replica_group: all the ranks of one replica, of which rank 0 writes (default
            ``tp_group``; with context parallelism its TP x CP ranks, each holding the whole
            sequence's hidden states).
        dp_rank, dp_world_size: this replica among the replicas building the cache; replica
            ``r`` owns the shards ``i`` with ``i % dp_world_size == r``.
        log: where progress lines go (None: silent).

    TP rank 0 of each replica writes; the others only take part in the top-K collectives.
    """
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
    if not 0 <= dp_rank < dp_world_size:
        raise ValueError(f"dp_rank={dp_rank} must lie in [0, dp_world_size={dp_world_size})")
    t0 = time.perf_counter()
    group = replica_group if replica_group is not None else tp_group
    writer = CacheWriter(cache_dir, spec) if group is None or dist.get_rank(group) == 0 else None
    done = [sorted(writer.completed()) if writer else None]
    if group is not None and dist.get_world_size(group) > 1:
        # All ranks of a replica must run the same shards: its rank 0's view decides.
        dist.broadcast_object_list(done, src=dist.get_global_rank(group, 0), group=group)
    completed = set(done[0])
    owned = [i for i in range(spec.num_shards) if i % dp_world_size == dp_rank]
    stats = BuildStats(shards_written=[], shards_skipped=[i for i in owned if i in completed],
                       tokens=0, seconds=0.0)
    for index in owned:
        if index in completed:
            continue
        start, end = spec.shard_range(index)
        blobs: list[bytes] = []
        fingerprints: list[int] = []
        for batch in _micro_batches(start, end, micro_batch_size):
            ids, logprobs = vocab_parallel_topk_logprobs(
                _hidden(teacher_forward_fn, batch, spec), output_weight, spec.topk,
                vocab_size=spec.vocab_size, window_size=window_size, tp_group=tp_group)
            stats.tokens += spec.seq_length * len(batch)
            if writer is not None:
                ids_np = ids.cpu().numpy()
                logprobs_np = logprobs.cpu().numpy()
                if not np.isfinite(logprobs_np).all():
                    raise FloatingPointError(
                        f"non-finite teacher log-probs (NaN or inf) for samples {batch}: the "
                        f"teacher's hidden states or output layer hold NaN/inf; shard {index} "
                        f"was not written")
                blobs.extend(writer.encode(ids_np[:, b], logprobs_np[:, b])
                             for b in range(len(batch)))
                fingerprints.extend(_fingerprints(sample_tokens_fn(batch), batch, spec))
        if writer is not None:
            entry = writer.write_shard(index, blobs, fingerprints)
            if log:
                log(f"shard {index}: samples [{start}, {end}), {entry['bytes']} bytes, "
                    f"{entry['bytes'] / ((end - start) * spec.seq_length):.1f} B/token")
        stats.shards_written.append(index)
    stats.seconds = time.perf_counter() - t0
    return stats
