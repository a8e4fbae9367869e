"""``megatron-kd cache build | verify | info`` end to end with a tiny Megatron-Core teacher.

Two gloo ranks: the teacher checkpoint is saved at TP 2, then the cache is built once as one
replica of TP 2 and once as two replicas of TP 1; both must equal a dense reference computed
from the teacher's full logits.
"""

import json

import numpy as np
import pytest
import torch
from support.train_cases import cache_build_argv

from megatron_kd.arch import GPTArchConfig
from megatron_kd.cache.format import load_manifest
from megatron_kd.cache.reader import TopKCacheReader
from megatron_kd.cli import main

SEQ, K, SAMPLES = 16, 20, 6


def _arch():
    return GPTArchConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                         ffn_hidden_size=64, vocab_size=500, padded_vocab_size=512,
                         max_position_embeddings=32)


def _build_argv(out, ckpt, tp):
    # 3 iterations x 2 samples: the cache holds samples [0, 6) of the mock dataset.
    return cache_build_argv(out, ckpt, topk=K, seq=SEQ, iters=3, global_batch=2,
                            samples_per_shard=2, tp=tp, extra=("--window-size", "7", "--seed", "5"))


def case_build(ctx, tmp):
    import torch.distributed as dist

    from megatron_kd.data.datasets import MockGPTDataset, collate
    from megatron_kd.integration.checkpoint import (
        load_model_checkpoint,
        save_model_checkpoint,
    )
    from megatron_kd.integration.cpu_shim import device_context
    from megatron_kd.integration.gpt import build_gpt_model
    from megatron_kd.integration.groups import model_parallel

    arch = _arch()
    ckpt = f"{tmp}/teacher"
    with model_parallel(tp=2):
        save_model_checkpoint(build_gpt_model(arch, seed=3), arch, ckpt)
    assert main(_build_argv(f"{tmp}/tp2", ckpt, tp=2)) == 0
    assert main(_build_argv(f"{tmp}/dp2", ckpt, tp=1)) == 0
    # Reference: the full logits of the same teacher on the same samples (TP 1).
    with model_parallel(tp=1):
        teacher = build_gpt_model(arch, seed=None)
        load_model_checkpoint(teacher, ckpt)
        teacher.eval()
        ds = MockGPTDataset(vocab_size=500, seq_length=SEQ, num_samples=SAMPLES, seed=5)
        batch = collate([ds[i] for i in range(SAMPLES)])
        with torch.no_grad(), device_context():
            logits = teacher(batch["tokens"], batch["position_ids"], None)  # [b, s, 512]
    dist.barrier()
    return torch.log_softmax(logits[..., :500].double(), -1).numpy()


@pytest.fixture(scope="module")
def built(dist_pool_factory, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cache_cli")
    logprobs = dist_pool_factory(2).run(case_build, str(tmp))[0]
    return tmp, logprobs


@pytest.mark.parametrize("layout", ["tp2", "dp2"])
def test_build_matches_dense_teacher(built, layout):
    tmp, full = built
    ids, logprobs = TopKCacheReader(tmp / layout).get(range(SAMPLES))
    assert ids.shape == (SAMPLES, SEQ, K)
    for b in range(SAMPLES):
        for s in range(SEQ):
            want = np.sort(np.argsort(-full[b, s], kind="stable")[:K])  # stored by ascending id
            np.testing.assert_array_equal(ids[b, s], want)
            # Megatron's own forward vs bypassed hidden states x fp32 shard: a few ulps.
            np.testing.assert_allclose(logprobs[b, s], full[b, s, want], rtol=1e-5, atol=2e-5)


def test_layouts_agree_and_manifest_identity(built):
    tmp, _ = built
    a, b = load_manifest(tmp / "tp2"), load_manifest(tmp / "dp2")
    assert a["complete"] and b["complete"]
    for key in ("teacher", "tokenizer", "dataset_hash", "vocab_size", "topk", "seq_length"):
        assert a[key] == b[key], key
    assert a["vocab_size"] == 500 and len(a["teacher"]["weights_hash"]) == 64


def test_verify_and_info_cli(built, capsys, tmp_path):
    tmp, _ = built
    assert main(["cache", "verify", str(tmp / "tp2")]) == 0
    assert "OK" in capsys.readouterr().out
    assert main(["cache", "info", str(tmp / "tp2"), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["shards_built"] == info["shards_total"] == 3 and info["topk"] == K
    # A flipped byte is reported with its shard and sample range; exit code 1.
    import shutil
    copy = tmp_path / "copy"
    shutil.copytree(tmp / "tp2", copy)
    shard = copy / "shard-000000002-000000004.bin"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1
    shard.write_bytes(bytes(data))
    assert main(["cache", "verify", str(copy)]) == 1
    out = capsys.readouterr().out
    assert "shard-000000002-000000004.bin (samples [2, 4)): sha256 mismatch" in out
