"""``megatron-kd cache``: build, verify and describe offline top-K teacher caches.

::

    megatron-kd cache build --out DIR --kd-teacher-load CKPT --kd-topk 100 \\
        --seq-length 4096 --micro-batch-size 4 --train-iters 1000 --global-batch-size 256 \\
        --data-path PREFIX --tokenizer-model tokenizer.json [--tensor-model-parallel-size 8]
    megatron-kd cache verify DIR        # every checksum; exit 1 naming shard + sample range
    megatron-kd cache info DIR          # spec, progress, bytes per token

``build`` takes the training run's data flags (``--data-path --split --seed --seq-length
--train-iters --global-batch-size --eval-iters``, or ``--mock-data``) and checks them, and the
teacher, with the trainer's own checks (:mod:`megatron_kd.training.plan`), so it builds the very
``GPTDataset`` the student will read, and caches samples ``[0, train_iters x
global_batch_size)``. Launch it with ``torchrun``: the world splits into teacher replicas of
``--tensor-model-parallel-size`` ranks; replicas share the shards. Run it again after a crash
to resume. The teacher is not pipelined.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from megatron_kd.cache.build import build_cache
from megatron_kd.cache.codec import LogprobCodec
from megatron_kd.cache.format import CacheSpec
from megatron_kd.cache.identity import dataset_identity, tokenizer_identity
from megatron_kd.cache.summary import print_info, print_verify
from megatron_kd.data.datasets import collate
from megatron_kd.data.tokenizer import MockTokenizer
from megatron_kd.integration.args import (
    TEACHER_DTYPES,
    add_teacher_args_flag,
    teacher_torch_dtype,
)
from megatron_kd.integration.checkpoint import checkpoint_hash
from megatron_kd.integration.cpu_shim import device_context, install_cpu_shim, on_cpu
from megatron_kd.integration.groups import (
    add_expert_parallel_args,
    check_experts_within_tensor_parallel,
    init_distributed_from_env,
    model_parallel,
)
from megatron_kd.integration.output_layer import output_layer_weight, to_sbh
from megatron_kd.integration.teacher import build_frozen_teacher
from megatron_kd.training.plan import build_datasets, check_teacher, resolve_tokenizer

__all__ = ["add_arguments", "run"]


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
    add_expert_parallel_args(b)
    add_teacher_args_flag(b)
    b.add_argument("--kd-teacher-dtype", choices=TEACHER_DTYPES, default="fp32",
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
        return print_verify(args.dir)
    if args.action == "info":
        return print_info(args.dir, as_json=args.json)
    return _build(args)


def _build(args: argparse.Namespace) -> int:
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
        with model_parallel(args.tensor_model_parallel_size, 1, args.expert_model_parallel_size,
                            args.expert_tensor_parallel_size), device_context():
            stats = _build_in_model_parallel(args, codec)
        if dist.get_rank() == 0:
            print(json.dumps({"shards_written": len(stats.shards_written),
                              "shards_skipped": len(stats.shards_skipped),
                              "tokens": stats.tokens, "seconds": round(stats.seconds, 3)}))
        dist.barrier()
        return 0
    finally:
        if created:
            dist.destroy_process_group()


def _build_in_model_parallel(args: argparse.Namespace, codec: LogprobCodec):
    teacher_dir, arch = check_teacher(args.kd_teacher_load, seq_length=args.seq_length,
                                      tp_sizes=(args.tensor_model_parallel_size,),
                                      teacher_args=args.kd_teacher_args)
    check_experts_within_tensor_parallel(arch, args.tensor_model_parallel_size,
                                         args.expert_model_parallel_size,
                                         args.expert_tensor_parallel_size)
    tokenizer = resolve_tokenizer(args, teacher_dir)
    if tokenizer is not None and tokenizer.vocab_size > arch.vocab_size:
        raise ValueError(f"the tokenizer has {tokenizer.vocab_size} tokens but the teacher "
                         f"vocabulary is {arch.vocab_size}")
    tokenizer = tokenizer or MockTokenizer(arch.vocab_size)
    dataset, _ = build_datasets(args, arch.vocab_size, tokenizer, args.global_batch_size,
                                need_valid=False)
    dtype = teacher_torch_dtype(args.kd_teacher_dtype)
    # seeded only so Megatron's model-parallel RNG exists; the weights are loaded next
    teacher = build_frozen_teacher(arch, teacher_dir, dtype=dtype, seed=args.seed)
    weight = output_layer_weight(teacher)

    # One hash of the checkpoint files, computed once and shared (same on every rank).
    ckpt_hash = [checkpoint_hash(teacher_dir) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(ckpt_hash, src=0)
    spec = CacheSpec(
        teacher_checkpoint=os.path.abspath(teacher_dir),
        teacher_weights_hash=ckpt_hash[0], tokenizer=tokenizer_identity(tokenizer),
        vocab_size=arch.vocab_size, topk=args.kd_topk, seq_length=args.seq_length,
        num_samples=args.train_iters * args.global_batch_size,
        dataset_hash=dataset_identity(dataset), samples_per_shard=args.samples_per_shard,
        logprob_codec=codec)

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
                       dp_rank=ps.get_data_parallel_rank(),
                       dp_world_size=ps.get_data_parallel_world_size(), log=log)
