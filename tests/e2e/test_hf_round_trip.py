"""``megatron-kd export-hf``: the round trip Hugging Face -> ``import-hf`` -> ``megatron-kd
train`` -> ``export-hf`` gives back the Hugging Face model.

For every family ``import-hf`` reads, a tiny random model of transformers' own class is imported,
trained 2 steps at learning rate 0 from that import (``--pretrained-checkpoint``) in a parallel
layout, and its last checkpoint exported: every tensor equals the original's bit for bit, the
config equals the original's as transformers reads it, and ``from_pretrained`` of the export
gives the original's logits exactly. gpt-oss, whose training Megatron-Core cannot do (biased
experts fail in backward), is exported from its import written again at TP 2 x EP 2. A
Megatron-LM layout (one key per layer, per expert and per ``linear_fc1`` half:
``singleton_local_shards``) is exported with the config built from its saved arguments.

The tiny models' weights are rounded to bf16 values first, as released checkpoints' are:
Qwen3.5 stores its ``x * (1 + w)`` norms as ``1 + w`` in fp32, exact for such a ``w`` (for an
arbitrary fp32 ``w`` the import rounds off its last bit: ``tests/unit/test_hf_export.py``).
"""

import dataclasses
import glob
import json
import os
from collections.abc import Callable

import pytest
import torch
from support.hf_models import (
    BATCH,
    SEQ,
    bpe_tokenizer,
    tiny_gpt_oss,
    tiny_llama,
    tiny_qwen3,
    tiny_qwen3_moe,
    tiny_qwen35,
    tiny_qwen35_moe,
)
from support.train_cases import case_import, case_train

from megatron_kd.arch.megatron_lm_args import arch_from_megatron_lm_args, parse_megatron_lm_flags
from megatron_kd.cli import main
from megatron_kd.hf.importer import load_hf_checkpoint, source_dtype
from megatron_kd.integration.checkpoint import read_checkpoint_arch

pytestmark = pytest.mark.filterwarnings("ignore")
transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

TRAIN = ["--seq-length", "16", "--micro-batch-size", "1", "--global-batch-size", "4",
         "--train-iters", "2", "--lr", "0", "--mock-data", "--kd-weight", "0",
         "--kd-ce-weight", "1", "--eval-iters", "0", "--no-progress"]
TP2_SP = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
EP2 = ["--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "1"]
PP2_VP2 = ["--pipeline-model-parallel-size", "2", "--virtual-pipeline-model-parallel-size", "2"]


@dataclasses.dataclass
class Case:
    make: Callable
    """tmp -> a Hugging Face model directory (``support.hf_models``)."""
    train: list[str] | None
    """``megatron-kd train``'s layout flags; None: written again at TP 2 x EP 2 instead."""
    pad_for_tp: int = 1
    export: tuple[str, ...] = ()
    """Further ``export-hf`` flags."""


def _llama_with_tokenizer(tmp):
    # 6 heads in 3 groups and an MLP of 75 do not split 2 ways: imported with dummy heads and
    # units, which the export cuts off; a tokenizer of 150 tokens for 203 embedding rows
    path = tiny_llama(tmp, tied=True, groups=3, ffn=75, name="llama")[0]
    bpe_tokenizer({f"t{i}": i for i in range(150)}, []).save(
        os.path.join(path, "tokenizer.json"))
    return path


CASES = {
    "llama": Case(_llama_with_tokenizer, ["--tensor-model-parallel-size", "2"], pad_for_tp=2),
    "qwen3": Case(lambda t: tiny_qwen3(t, tied=False, layers=4)[0], PP2_VP2),
    "qwen3_moe": Case(lambda t: tiny_qwen3_moe(t)[0], TP2_SP + EP2,
                      export=("--max-shard-size", "40KB")),
    "gpt_oss": Case(lambda t: tiny_gpt_oss(t)[0], None),
    "qwen35": Case(lambda t: tiny_qwen35(t)[0], TP2_SP),
    "qwen35_moe": Case(lambda t: tiny_qwen35_moe(t)[0], TP2_SP + EP2),
}


def _bf16_valued(path):
    """The model's weights rounded to bf16 values (kept in fp32)."""
    file = os.path.join(path, "model.safetensors")
    weights = safetensors_torch.load_file(file)
    safetensors_torch.save_file({k: v.to(torch.bfloat16).to(v.dtype) for k, v in weights.items()},
                                file, metadata={"format": "pt"})


def case_rewrite(ctx, src, dst, megatron_lm_flags=None):
    """``src`` loaded at TP 2 x EP 2 (expert TP 1) and written again: as this project writes a
    checkpoint, or (``megatron_lm_flags``) as Megatron-LM lays out a run with
    ``singleton_local_shards`` and its arguments saved."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    from megatron_kd.arch.megatron_lm_args import parse_megatron_lm_flags
    from megatron_kd.integration.checkpoint import (
        load_model_checkpoint,
        read_checkpoint_arch,
        read_checkpoint_extra,
        save_model_checkpoint,
    )
    from megatron_kd.integration.cpu_shim import checkpoint_save_strategy
    from megatron_kd.integration.gpt import build_gpt_model
    from megatron_kd.integration.groups import model_parallel

    with model_parallel(tp=2, ep=2, etp=1):
        arch = read_checkpoint_arch(src)
        model = build_gpt_model(arch, seed=1)
        load_model_checkpoint(model, src)
        if megatron_lm_flags is None:
            save_model_checkpoint(model, arch, dst, extra=read_checkpoint_extra(src))
            return
        directory = os.path.join(dst, "iter_0000003")
        if ctx.rank == 0:
            os.makedirs(directory)
        dist.barrier()
        state = {"model": model.sharded_state_dict(metadata={"singleton_local_shards": True}),
                 "args": parse_megatron_lm_flags(megatron_lm_flags),
                 "checkpoint_version": 3.0, "iteration": 3}
        dist_checkpointing.save(state, directory, sharded_strategy=checkpoint_save_strategy())
        if ctx.rank == 0:
            with open(os.path.join(dst, "latest_checkpointed_iteration.txt"), "w") as f:
                f.write("3")
        dist.barrier()


def _weights(path):
    out = {}
    for file in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
        out.update(safetensors_torch.load_file(file))
    return out


def _config_as_read(path):
    config = transformers.AutoConfig.from_pretrained(path).to_dict()
    return {k: v for k, v in config.items() if k not in ("_name_or_path", "transformers_version")}


def _logits(path, tokens):
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(tokens).logits


def _assert_same_model(original, exported):
    expected, got = _weights(original), _weights(exported)
    assert sorted(got) == sorted(expected)
    unequal = [k for k in expected if not torch.equal(got[k], expected[k])]
    assert not unequal, f"tensors not bit-for-bit equal: {unequal}"
    assert _config_as_read(exported) == _config_as_read(original)
    tokens = torch.randint(0, 150, (BATCH, SEQ), generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(_logits(exported, tokens), _logits(original, tokens), atol=0,
                               rtol=0)


@pytest.mark.parametrize("family", sorted(CASES))
def test_round_trip_gives_back_the_hugging_face_model(pool, tmp_path, family):
    case = CASES[family]
    hf_path = case.make(tmp_path)
    _bf16_valued(hf_path)
    imported = str(tmp_path / "imported")
    pool.run(case_import, hf_path, imported, pad_for_tp=case.pad_for_tp)
    assert os.path.isfile(os.path.join(imported, "hf", "config.json"))  # kept by import-hf
    if case.train is None:
        source = str(tmp_path / "tp2_ep2")
        pool.run(case_rewrite, imported, source)
    else:
        source = str(tmp_path / "run")
        pool.run(case_train, TRAIN + ["--pretrained-checkpoint", imported, "--save", source,
                                      *case.train])
    out = str(tmp_path / "exported")
    # a training checkpoint records its --pretrained-checkpoint: export follows it to the HF
    # files import-hf kept
    assert main(["export-hf", "--load", source, "--save", out, *case.export]) == 0
    _assert_same_model(hf_path, out)
    tokenizer = os.path.join(hf_path, "tokenizer.json")
    if os.path.isfile(tokenizer):
        with open(tokenizer, "rb") as a, open(os.path.join(out, "tokenizer.json"), "rb") as b:
            assert a.read() == b.read()
    if family == "qwen3_moe":  # 40 KB files: several, with transformers' index
        with open(os.path.join(out, "model.safetensors.index.json"), encoding="utf-8") as f:
            index = json.load(f)
        assert len(set(index["weight_map"].values())) > 2
    if family == "llama":  # bf16 on request; the import's own directory exports alike
        bf16 = str(tmp_path / "bf16")
        assert main(["export-hf", "--load", imported, "--save", bf16, "--dtype", "bfloat16"]) == 0
        got, expected = _weights(bf16), _weights(hf_path)
        assert all(torch.equal(got[k], v.to(torch.bfloat16)) for k, v in expected.items())
        assert transformers.AutoConfig.from_pretrained(bf16).dtype == torch.bfloat16


# The tiny Qwen3-MoE in Megatron-LM's flags (as its launch script would give them).
QWEN3_MOE_FLAGS = ("--num-layers 2 --hidden-size 48 --num-attention-heads 4 "
                   "--group-query-attention --num-query-groups 2 --kv-channels 16 "
                   "--ffn-hidden-size 72 --num-experts 4 --moe-ffn-hidden-size 24 "
                   "--moe-router-topk 2 --qk-layernorm --max-position-embeddings 64 "
                   "--position-embedding-type rope --rotary-base 1000000 "
                   "--normalization RMSNorm --norm-epsilon 1e-6 --swiglu --disable-bias-linear "
                   "--untie-embeddings-and-output-weights --vocab-size 203")


def test_megatron_lm_checkpoint_exports_with_a_config_built_from_its_arguments(pool, tmp_path):
    hf_path = tiny_qwen3_moe(tmp_path)[0]
    imported, run = str(tmp_path / "imported"), str(tmp_path / "megatron_lm_run")
    pool.run(case_import, hf_path, imported)
    pool.run(case_rewrite, imported, run, QWEN3_MOE_FLAGS)
    assert glob.glob(os.path.join(run, "iter_0000003", "*.distcp"))
    out = str(tmp_path / "exported")
    assert main(["export-hf", "--load", run, "--save", out]) == 0
    # no Hugging Face config anywhere: built from the saved arguments, equal field for field
    _assert_same_model(hf_path, out)


def test_refusals_before_anything_is_written(pool, tmp_path):
    hf_path = tiny_qwen3(tmp_path)[0]
    imported = str(tmp_path / "imported")
    pool.run(case_import, hf_path, imported)
    other = tiny_llama(tmp_path, tied=False)[0]
    out = str(tmp_path / "out")
    with pytest.raises(ValueError, match="does not describe"):
        main(["export-hf", "--load", imported, "--save", out, "--hf-config", other])
    with pytest.raises(ValueError, match="megatron-lm-args is for Megatron-LM"):
        main(["export-hf", "--load", imported, "--save", out,
              "--megatron-lm-args=--num-layers 2"])
    assert not os.path.exists(out) and not os.path.exists(out + ".partial")
    os.makedirs(out)
    open(os.path.join(out, "x"), "w").close()
    with pytest.raises(ValueError, match="not empty"):
        main(["export-hf", "--load", imported, "--save", out])


def test_trained_student_exports_with_the_trainers_evaluation_loss(dist_pool_factory, teacher,
                                                                   tmp_path):
    """A Qwen3 student distilled 20 steps at TP 2 / PP 2 (vocabulary 500 padded to 512), then
    exported: transformers' language-model loss on the held-out samples the trainer evaluated
    equals the trainer's final ``eval_lm_loss`` (fp32, 1e-5 relative)."""
    from support.train_cases import import_hf_model

    from megatron_kd.data.datasets import MockGPTDataset, collate

    pool4 = dist_pool_factory(4)
    seq, gbs, eval_iters = 32, 4, 3
    imported = import_hf_model(pool4, tmp_path, tiny_qwen3, 500, layers=4)
    run = str(tmp_path / "run")
    summary = pool4.run(case_train, [
        "--seq-length", str(seq), "--micro-batch-size", "1", "--global-batch-size", str(gbs),
        "--train-iters", "20", "--lr", "3e-3", "--lr-warmup-iters", "2", "--mock-data",
        "--seed", "5", "--eval-iters", str(eval_iters), "--eval-interval", "20",
        "--no-progress", "--kd-teacher-load", teacher, "--kd-ce-weight", "0.2",
        "--pretrained-checkpoint", imported, "--save", run,
        "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"])[0]
    trainer_loss = summary["final_eval_lm_loss"]
    out = str(tmp_path / "exported")
    assert main(["export-hf", "--load", run, "--save", out]) == 0
    # the trainer's validation samples: --mock-data's held-out set (seed + 1), from index 0
    held_out = MockGPTDataset(vocab_size=500, seq_length=seq, num_samples=eval_iters * gbs,
                              seed=6)
    batch = collate([held_out[i] for i in range(eval_iters * gbs)])

    def lm_loss(path):
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        assert model.config.vocab_size == 500
        with torch.no_grad():
            logits = model.eval()(batch["tokens"]).logits
        return torch.nn.functional.cross_entropy(logits.reshape(-1, 500),
                                                 batch["labels"].reshape(-1)).item()

    assert lm_loss(out) == pytest.approx(trainer_loss, rel=1e-5)
    # the student learned: the original's loss is not the trained one's
    assert abs(lm_loss(str(tmp_path / "qwen3")) - trainer_loss) > 0.05


def _stored_dtypes(directory) -> set:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    [meta] = glob.glob(os.path.join(directory, "**", ".metadata"), recursive=True)
    stored = FileSystemReader(os.path.dirname(meta)).read_metadata().state_dict_metadata
    return {m.properties.dtype for k, m in stored.items()
            if isinstance(m, TensorStorageMetadata) and "weight" in k}


@pytest.mark.parametrize("published", [torch.bfloat16, torch.float32])
def test_import_hf_keeps_the_sources_dtype_by_default(tmp_path, published):
    """``import-hf`` without ``--params-dtype`` writes the dtype the model was published in
    (a 35B bf16 teacher stays ~70 GB, not 140 GB of fp32); ``--params-dtype`` overrides it."""
    from safetensors.torch import load_file, save_file

    path = tiny_llama(tmp_path, tied=False)[0]
    [weights] = glob.glob(os.path.join(path, "*.safetensors"))
    save_file({k: v.to(published) for k, v in load_file(weights).items()}, weights,
              metadata={"format": "pt"})
    assert source_dtype(load_hf_checkpoint(path)) == published
    assert main(["import-hf", "--hf-path", path, "--save", str(tmp_path / "auto")]) == 0
    assert _stored_dtypes(tmp_path / "auto") == {published}
    # beside the weights: the Megatron-LM model flags that build the same model
    flags = parse_megatron_lm_flags(str(tmp_path / "auto" / "megatron_lm_flags.txt"))
    arch = read_checkpoint_arch(str(tmp_path / "auto"))
    assert arch_from_megatron_lm_args(flags, embedding_rows=arch.padded_vocab_size,
                                      vocab_size=arch.vocab_size) == arch
    assert main(["import-hf", "--hf-path", path, "--save", str(tmp_path / "fp16"),
                 "--params-dtype", "float16"]) == 0
    assert _stored_dtypes(tmp_path / "fp16") == {torch.float16}
