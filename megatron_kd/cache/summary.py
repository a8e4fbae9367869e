"""What ``megatron-kd cache verify`` and ``cache info`` print (numpy only)."""

from __future__ import annotations

import json
import sys

from megatron_kd.cache.format import CacheFormatError, CacheSpec, load_manifest, verify

__all__ = ["cache_info", "print_info", "print_verify"]


def print_verify(cache_dir: str) -> int:
    """``megatron-kd cache verify``: print every problem (or OK); exit status 1 on any."""
    try:
        problems = verify(cache_dir)
    except CacheFormatError as e:
        problems = [str(e)]
    for p in problems:
        print(f"FAIL {p}")
    if problems:
        print(f"{cache_dir}: {len(problems)} problem(s)", file=sys.stderr)
        return 1
    print(f"{cache_dir}: OK")
    return 0


def cache_info(cache_dir: str) -> dict:
    """Summary of a cache: its spec, shards built, bytes and bytes per token."""
    manifest = load_manifest(cache_dir)
    spec = CacheSpec.from_json(manifest)
    samples = sum(s["sample_end"] - s["sample_start"] for s in manifest["shards"])
    nbytes = sum(s["bytes"] for s in manifest["shards"])
    tokens = samples * spec.seq_length
    return {
        "format_version": manifest["format_version"],
        "teacher": manifest["teacher"],
        "tokenizer": spec.tokenizer,
        "dataset_hash": spec.dataset_hash,
        "vocab_size": spec.vocab_size,
        "topk": spec.topk,
        "seq_length": spec.seq_length,
        "logprob_encoding": spec.logprob_codec.name,
        "shards_built": len(manifest["shards"]),
        "shards_total": spec.num_shards,
        "samples_built": samples,
        "num_samples": spec.num_samples,
        "bytes": nbytes,
        "bytes_per_token": nbytes / tokens if tokens else None,
        "complete": manifest["complete"],
    }


def print_info(cache_dir: str, as_json: bool) -> int:
    """``megatron-kd cache info``: the summary, as text or JSON."""
    info = cache_info(cache_dir)
    if as_json:
        print(json.dumps(info, indent=2, sort_keys=True))
        return 0
    for key, value in info.items():
        if key == "bytes_per_token" and value is not None:
            value = f"{value:.1f}"
        print(f"{key:>18}: {value}")
    return 0
