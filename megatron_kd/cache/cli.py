"""``megatron-kd cache``: build, verify and describe offline top-K teacher caches.

::

    megatron-kd cache build --out DIR --kd-teacher-load CKPT --kd-topk 100 \\
        --seq-length 4096 --micro-batch-size 4 --train-iters 1000 --global-batch-size 256 \\
        --data-path PREFIX --tokenizer-model tokenizer.json [--tensor-model-parallel-size 8]
    megatron-kd cache verify DIR        # every checksum; exit 1 naming shard + sample range
    megatron-kd cache info DIR          # spec, progress, bytes per token

``build`` takes the training run's data flags (``--data-path --split --seed --seq-length
--train-iters --global-batch-size --eval-iters``, or ``--mock-data``) so it builds the very
``GPTDataset`` the student will read, and caches samples ``[0, train_iters x
global_batch_size)``. Launch it with ``torchrun``: the world splits into teacher replicas of
``--tensor-model-parallel-size`` ranks; replicas share the shards. Run it again after a crash
to resume. The teacher is not pipelined.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    v = sub.add_parser("verify", help="check every shard's checksum")
    v.add_argument("dir")
    i = sub.add_parser("info", help="print the manifest summary")
    i.add_argument("dir")
    i.add_argument("--json", action="store_true", help="machine-readable output")

    b = sub.add_parser("build", help="run the teacher over the training samples, store top-K")
    b.add_argument("--out", required=True, metavar="DIR", help="cache directory (resumed)")
    b.add_argument("--kd-teacher-load", required=True, metavar="DIR",
                   help="teacher checkpoint (megatron_kd format)")
    b.add_argument("--kd-topk", type=int, default=100, help="entries per token (K)")
    b.add_argument("--logprob-encoding", default="log1p-u11",
                   help="'log1p-u<bits>' (compact, default 11 bits) or 'fp32' (lossless)")
    b.add_argument("--samples-per-shard", type=int, default=128)
    b.add_argument("--window-size", type=int, default=1024,
                   help="rows projected onto the vocabulary at once")
    b.add_argument("--tensor-model-parallel-size", type=int, default=1)
    b.add_argument("--kd-teacher-dtype", choices=("fp32", "bf16"), default="fp32",
                   help="parameter dtype of the teacher (the top-K maths runs in fp32 either "
                        "way)")
    b.add_argument("--seq-length", type=int, required=True)
    b.add_argument("--micro-batch-size", type=int, default=1, help="samples per teacher call")
    b.add_argument("--train-iters", type=int, required=True)
    b.add_argument("--global-batch-size", type=int, required=True)
    b.add_argument("--eval-iters", type=int, default=10,
                   help="as in training (it sizes the dataset split and so its identity)")
    b.add_argument("--seed", type=int, default=1234)
    b.add_argument("--data-path", nargs="+", default=None)
    b.add_argument("--split", default="969,30,1")
    b.add_argument("--tokenizer-model", default=None)
    b.add_argument("--eod-token", default=None)
    b.add_argument("--data-cache-path", default=None)
    b.add_argument("--mock-data", action="store_true")


def run(args: argparse.Namespace) -> int:
    if args.action == "verify":
        return _verify(args.dir)
    if args.action == "info":
        return _info(args.dir, as_json=args.json)
    return _build(args)


def _verify(cache_dir: str) -> int:
    from megatron_kd.cache.format import CacheFormatError, verify

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
    from megatron_kd.cache.format import CacheSpec, load_manifest

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


def _info(cache_dir: str, as_json: bool) -> int:
    info = cache_info(cache_dir)
    if as_json:
        print(json.dumps(info, indent=2, sort_keys=True))
        return 0
    for key, value in info.items():
        if key == "bytes_per_token" and value is not None:
            value = f"{value:.1f}"
        print(f"{key:>18}: {value}")
    return 0


# --------------------------------------------------------------------------- build


def checkpoint_hash(directory: str) -> str:
    """sha256 over a checkpoint directory's files (relative names and contents, sorted).

    Independent of the parallel layout the teacher is loaded with.
    """
    digest = hashlib.sha256()
    root = Path(directory)
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        digest.update(f"{path.relative_to(root).as_posix()}\0{path.stat().st_size}\0".encode())
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 22), b""):
                digest.update(chunk)
    return digest.hexdigest()


def _build(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

    from megatron_kd.cache.build import build_cache
    from megatron_kd.cache.codec import LogprobCodec
    from megatron_kd.cache.format import CacheSpec
    from megatron_kd.megatron_cpu import device_context, install_cpu_shim, on_cpu
    from megatron_kd.training.parallel import init_distributed_from_env, model_parallel

    for name in ("kd_topk", "samples_per_shard", "window_size", "seq_length", "micro_batch_size",
                 "train_iters", "global_batch_size", "tensor_model_parallel_size"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    codec = LogprobCodec(name=args.logprob_encoding)
    install_cpu_shim()
    if on_cpu():
        torch.set_flush_denormal(True)
    created = init_distributed_from_env()
    try:
        with model_parallel(args.tensor_model_parallel_size, 1), device_context():
            stats = _build_in_model_parallel(args, codec, CacheSpec, build_cache)
        if dist.get_rank() == 0:
            print(json.dumps({"shards_written": len(stats.shards_written),
                              "shards_skipped": len(stats.shards_skipped),
                              "tokens": stats.tokens, "seconds": round(stats.seconds, 3)}))
        dist.barrier()
        return 0
    finally:
        if created:
            dist.destroy_process_group()


def _build_in_model_parallel(args, codec, CacheSpec, build_cache):
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_kd.cache.offline import dataset_identity, tokenizer_identity
    from megatron_kd.data.datasets import MockGPTDataset, build_gpt_datasets, collate
    from megatron_kd.data.tokenizer import HFTokenizer, MockTokenizer
    from megatron_kd.integration import bypass_output_layer, output_layer_weight, to_sbh
    from megatron_kd.models import (
        build_gpt_model,
        check_checkpoint_tensors,
        load_model_checkpoint,
        read_checkpoint_arch,
    )

    arch = read_checkpoint_arch(args.kd_teacher_load)
    check_checkpoint_tensors(args.kd_teacher_load, arch)
    if arch.max_position_embeddings < args.seq_length:
        raise ValueError(f"teacher max_position_embeddings {arch.max_position_embeddings} < "
                         f"--seq-length {args.seq_length}")
    dp = ps.get_data_parallel_world_size()
    gbs = args.global_batch_size
    train_samples = args.train_iters * gbs
    valid_samples = max(1, args.eval_iters) * gbs
    if args.mock_data:
        tokenizer = MockTokenizer(arch.vocab_size)
        dataset = MockGPTDataset(vocab_size=arch.vocab_size, seq_length=args.seq_length,
                                 num_samples=train_samples, seed=args.seed)
    else:
        if not args.data_path or not args.tokenizer_model:
            raise ValueError("give --data-path and --tokenizer-model (as for training), "
                             "or --mock-data")
        tokenizer = HFTokenizer(args.tokenizer_model, eod_token=args.eod_token)
        if tokenizer.vocab_size > arch.vocab_size:
            raise ValueError(f"the tokenizer has {tokenizer.vocab_size} tokens but the teacher "
                             f"vocabulary is {arch.vocab_size}")
        dataset, _ = build_gpt_datasets(
            data_path=args.data_path, split=args.split, seq_length=args.seq_length,
            seed=args.seed, tokenizer=tokenizer, train_samples=train_samples,
            valid_samples=valid_samples, cache_path=args.data_cache_path)

    params_dtype = torch.bfloat16 if args.kd_teacher_dtype == "bf16" else torch.float32
    # seeded only so Megatron's model-parallel RNG exists; the weights are loaded next
    teacher = build_gpt_model(arch, params_dtype=params_dtype, seed=args.seed,
                              perform_initialization=False)
    load_model_checkpoint(teacher, args.kd_teacher_load)
    bypass_output_layer(teacher)
    teacher.eval()
    for p in teacher.parameters():
        p.requires_grad_(False)
    weight = output_layer_weight(teacher)

    # One hash of the checkpoint files, computed once and shared (same on every rank).
    ckpt_hash = [checkpoint_hash(args.kd_teacher_load) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(ckpt_hash, src=0)
    spec = CacheSpec(
        teacher_checkpoint=os.path.abspath(args.kd_teacher_load),
        teacher_weights_hash=ckpt_hash[0], tokenizer=tokenizer_identity(tokenizer),
        vocab_size=arch.vocab_size, topk=args.kd_topk, seq_length=args.seq_length,
        num_samples=train_samples, dataset_hash=dataset_identity(dataset),
        samples_per_shard=args.samples_per_shard, logprob_codec=codec)

    @torch.no_grad()
    def teacher_forward(indices):
        batch = collate([dataset[i] for i in indices])
        tokens = batch["tokens"].to(weight.device)
        position_ids = batch["position_ids"].to(weight.device)
        return to_sbh(teacher(tokens, position_ids, None))  # [s, b, h]

    log = print if ps.get_tensor_model_parallel_rank() == 0 else None
    return build_cache(args.out, spec, teacher_forward_fn=teacher_forward, output_weight=weight,
                       micro_batch_size=args.micro_batch_size, window_size=args.window_size,
                       tp_group=ps.get_tensor_model_parallel_group(),
                       dp_rank=ps.get_data_parallel_rank(), dp_world_size=dp, log=log)
