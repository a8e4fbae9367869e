#!/usr/bin/env python
"""Benchmark the offline top-K cache: bytes per token, build and read throughput, loss fidelity.

For each vocabulary size a synthetic teacher (random output layer, per-token sharpness drawn
from a range, ``--logit-std``) is cached twice, with the compact
log-prob encoding and with lossless fp32, through the real build path
(:func:`megatron_kd.cache.build.build_cache`: vocab-parallel top-K, encoding, atomic shard
writes). Then:

* bytes/token: shard bytes (headers and offset tables included) / tokens;
* build tokens/s: the whole build call (projection onto the vocabulary, top-K, log-sum-exp,
  encoding, write), given the teacher's hidden states;
* read tokens/s: ``TopKCacheReader.get`` of every sample, micro-batch by micro-batch;
* loss deviation: |L(compact) - L(fp32)| / L(fp32) of the mean forward KL over all tokens
  between the cached teacher top-K and a student (teacher logits + N(0, sigma) noise), with
  the teacher renormalised over its top-K ("renorm") and with the leftover mass as one extra
  "ghost" bin ("ghost"); the largest per-token relative deviation is reported too.

Two id distributions: "uniform" (no prior over ids: the worst case for the gap coding) and
"zipf" (a log-frequency prior, low ids likelier, as in BPE vocabularies).

    python tools/bench_cache.py --out bench_cache.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time

import numpy as np
import torch

from megatron_kd.cache.build import build_cache
from megatron_kd.cache.codec import LogprobCodec
from megatron_kd.cache.format import CacheSpec, load_manifest
from megatron_kd.cache.reader import TopKCacheReader


def _teacher(vocab_size: int, hidden: int, tokens: int, prior: str, seed: int,
             logit_std: tuple[float, float]):
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(vocab_size, hidden + 1, generator=g) / math.sqrt(hidden)
    weight[:, -1] = 0.0
    if prior == "zipf":
        weight[:, -1] = -torch.log(torch.arange(vocab_size, dtype=torch.float32) + 10.0)
    states = torch.randn(tokens, hidden + 1, generator=g)
    # Per-token sharpness: logit std drawn uniformly from the range.
    states[:, :-1] *= torch.empty(tokens, 1).uniform_(*logit_std, generator=g)
    states[:, -1] = 1.0  # carries the id prior
    return weight, states


def _student_logprobs_at(weight, states, ids, sigma, window, seed):
    """Student log-softmax (teacher logits + noise, full vocabulary) at the cached ids."""
    out = torch.empty(ids.shape, dtype=torch.float64)
    for lo in range(0, states.shape[0], window):
        hi = min(states.shape[0], lo + window)
        g = torch.Generator().manual_seed(seed + lo)
        logits = states[lo:hi] @ weight.t()
        logits += sigma * torch.randn(logits.shape, generator=g)
        out[lo:hi] = torch.log_softmax(logits.double(), -1).gather(-1, ids[lo:hi])
    return out


def _kl(teacher_lp: torch.Tensor, student_lp: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-token forward KL: renormalised top-K, and top-K plus one ghost (leftover) bin."""
    t = teacher_lp.double()
    p = t.exp()
    p_hat = p / p.sum(-1, keepdim=True)
    q_hat_log = torch.log_softmax(student_lp, -1)
    renorm = (p_hat * (p_hat.log() - q_hat_log)).sum(-1)
    p_tail = (1.0 - p.sum(-1)).clamp_min(1e-30)
    q_tail = (1.0 - student_lp.exp().sum(-1)).clamp_min(1e-30)
    ghost = (p * (t - student_lp)).sum(-1) + p_tail * (p_tail.log() - q_tail.log())
    return {"renorm": renorm, "ghost": ghost}


def bench_one(vocab_size: int, prior: str, args, encoding: str) -> dict:
    tokens = args.samples * args.seq_length
    weight, states = _teacher(vocab_size, args.hidden, tokens, prior, args.seed,
                              tuple(args.logit_std))
    hidden_sbh = states.view(args.samples, args.seq_length, -1).transpose(0, 1)  # [s, b, h]

    def forward(indices):
        return hidden_sbh[:, indices[0]:indices[-1] + 1]

    def sample_tokens(indices):
        # the synthetic teacher has no input: each sample's stand-in token ids, fixed by its
        # index (the shard fingerprints them)
        return torch.stack([torch.randint(vocab_size, (args.seq_length,),
                                          generator=torch.Generator().manual_seed(args.seed + i))
                            for i in indices])

    results = {}
    with tempfile.TemporaryDirectory(prefix="bench_cache_") as tmp:
        for name in (encoding, "fp32"):
            spec = CacheSpec(teacher_checkpoint="synthetic", teacher_weights_hash=str(args.seed),
                             tokenizer="synthetic", vocab_size=vocab_size, topk=args.topk,
                             seq_length=args.seq_length, num_samples=args.samples,
                             dataset_hash=prior, samples_per_shard=args.samples_per_shard,
                             logprob_codec=LogprobCodec(name=name))
            out = os.path.join(tmp, name)
            t0, c0 = time.perf_counter(), time.process_time()
            build_cache(out, spec, teacher_forward_fn=forward, sample_tokens_fn=sample_tokens,
                        output_weight=weight,
                        micro_batch_size=args.micro_batch_size, window_size=args.window_size)
            build_s, build_cpu = time.perf_counter() - t0, time.process_time() - c0
            nbytes = sum(s["bytes"] for s in load_manifest(out)["shards"])
            reader = TopKCacheReader(out)
            t0, c0 = time.perf_counter(), time.process_time()
            parts = [reader.get(range(lo, min(args.samples, lo + args.micro_batch_size)))
                     for lo in range(0, args.samples, args.micro_batch_size)]
            read_s, read_cpu = time.perf_counter() - t0, time.process_time() - c0
            ids = np.concatenate([p[0] for p in parts]).reshape(tokens, args.topk)
            lp = np.concatenate([p[1] for p in parts]).reshape(tokens, args.topk)
            results[name] = dict(bytes_per_token=nbytes / tokens, build_tok_s=tokens / build_s,
                                 read_tok_s=tokens / read_s, build_tok_cpu_s=tokens / build_cpu,
                                 read_tok_cpu_s=tokens / read_cpu, ids=ids, logprobs=lp)
    compact, exact = results[encoding], results["fp32"]
    assert np.array_equal(compact["ids"], exact["ids"])
    ids = torch.from_numpy(exact["ids"])
    student = _student_logprobs_at(weight, states, ids, args.student_sigma, args.window_size,
                                   args.seed + 1)
    ref = _kl(torch.from_numpy(exact["logprobs"]), student)
    got = _kl(torch.from_numpy(compact["logprobs"]), student)
    p_exact = torch.from_numpy(exact["logprobs"]).double().exp()
    row = {
        "vocab_size": vocab_size, "id_prior": prior, "topk": args.topk, "tokens": tokens,
        "encoding": encoding,
        "bytes_per_token": compact["bytes_per_token"],
        "bytes_per_token_fp32": exact["bytes_per_token"],
        "build_tokens_per_s": compact["build_tok_s"],
        "read_tokens_per_s": compact["read_tok_s"],
        # Per CPU-second of this process (robust to other load on a shared machine).
        "build_tokens_per_cpu_s": compact["build_tok_cpu_s"],
        "read_tokens_per_cpu_s": compact["read_tok_cpu_s"],
        "mean_topk_mass": float(p_exact.sum(-1).mean()),
        "mean_top1_prob": float(p_exact.max(-1).values.mean()),
        "logit_std": list(args.logit_std),
    }
    for kind in ("renorm", "ghost"):
        row[f"kl_{kind}_fp32"] = float(ref[kind].mean())
        row[f"rel_dev_{kind}"] = float(abs(got[kind].mean() - ref[kind].mean())
                                       / ref[kind].mean())
        row[f"max_token_rel_dev_{kind}"] = float(((got[kind] - ref[kind]).abs()
                                                  / ref[kind].abs().clamp_min(1e-12)).max())
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vocab-sizes", type=int, nargs="+", default=[151936, 248320])
    p.add_argument("--priors", nargs="+", default=["uniform", "zipf"],
                   choices=["uniform", "zipf"])
    p.add_argument("--topk", type=int, default=100)
    p.add_argument("--encoding", default="log1p-u11")
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--seq-length", type=int, default=256)
    p.add_argument("--samples-per-shard", type=int, default=4)
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64, help="synthetic teacher width")
    p.add_argument("--window-size", type=int, default=256)
    p.add_argument("--logit-std", type=float, nargs=2, default=[1.0, 8.0], metavar=("LO", "HI"),
                   help="per-token teacher logit std range (sharpness)")
    p.add_argument("--student-sigma", type=float, default=1.0,
                   help="student = teacher logits + N(0, sigma) noise")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (1: tokens per CPU-second are per core)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)
    rows = []
    header = (f"{'vocab':>7} {'ids':>7} {'K':>4} {'B/token':>8} {'fp32 B/t':>9}"
              f" {'build tok/cpu-s':>16} {'read tok/cpu-s':>15} {'top-K mass':>10}"
              f" {'dev renorm':>10} {'dev ghost':>10} {'max tok dev':>11}")
    print(header)
    print("-" * len(header))
    for vocab_size in args.vocab_sizes:
        for prior in args.priors:
            row = bench_one(vocab_size, prior, args, args.encoding)
            rows.append(row)
            print(f"{row['vocab_size']:>7} {prior:>7} {row['topk']:>4} "
                  f"{row['bytes_per_token']:>8.1f} {row['bytes_per_token_fp32']:>9.1f} "
                  f"{row['build_tokens_per_cpu_s']:>16.0f} {row['read_tokens_per_cpu_s']:>15.0f} "
                  f"{row['mean_topk_mass']:>10.3f} {row['rel_dev_renorm']:>10.1e} "
                  f"{row['rel_dev_ghost']:>10.1e} {row['max_token_rel_dev_renorm']:>11.1e}",
                  flush=True)
    if args.out:
        meta = {"torch_threads": torch.get_num_threads(), "device": "cpu",
                "args": vars(args), "python": sys.version.split()[0]}
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
