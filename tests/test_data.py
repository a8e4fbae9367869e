"""megatron_kd.data: tokenizer wrapper, ``megatron-kd preprocess``, GPTDataset splits, and a
tiny training run on the preprocessed data."""

import json
import os

import numpy as np
import pytest
import torch

pytest.importorskip("tokenizers")

TEXT = """First Citizen:
Before we proceed any further, hear me speak.

All:
Speak, speak.

First Citizen:
You are all resolved rather to die than to famish?

All:
Resolved. resolved.

First Citizen:
First, you know Caius Marcius is chief enemy to the people.
"""


def write_tokenizer(path, vocab_size=300):
    """A small byte-level BPE tokenizer.json trained on TEXT, with an <|endoftext|> token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([TEXT] * 4, trainer=trainer)
    tok.save(str(path))
    return str(path)


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory):
    return write_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer.json")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("text")
    for i in range(3):
        (d / f"part{i}.txt").write_text(TEXT * 8, encoding="utf-8")
    return str(d)


def test_tokenizer_attributes(tokenizer_file):
    from megatron_kd.data.tokenizer import HFTokenizer

    tok = HFTokenizer(tokenizer_file)
    assert tok.eod == tok._tok.token_to_id("<|endoftext|>")
    assert tok.pad == -1 and tok.vocab_size <= 300
    assert tok.unique_identifiers["sha256"] == tok.sha256
    ids = tok.tokenize("Speak, speak.")
    assert tok.detokenize(ids) == "Speak, speak."
    with pytest.raises(ValueError, match="not in the vocabulary"):
        HFTokenizer(tokenizer_file, eod_token="<nope>")
    with pytest.raises(ValueError, match="tokenizer file not found"):
        HFTokenizer(os.path.dirname(tokenizer_file) + "/missing.json")


def test_split_documents():
    from megatron_kd.data.preprocess import split_documents

    assert split_documents("a\n\n b \n\n\n", "paragraph") == ["a", "b"]
    assert split_documents("a\nb\n", "line") == ["a", "b"]
    assert split_documents("a\n\nb", "file") == ["a\n\nb"]


def test_preprocess_roundtrip(tokenizer_file, corpus, tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from megatron_kd.cli import main
    from megatron_kd.data.tokenizer import HFTokenizer

    prefix = str(tmp_path / "out" / "text")
    assert main(["preprocess", "--input", corpus, "--tokenizer-model", tokenizer_file,
                 "--output-prefix", prefix]) == 0
    tok = HFTokenizer(tokenizer_file)
    ds = IndexedDataset(prefix)
    with open(prefix + ".json") as f:
        info = json.load(f)
    from megatron_kd.data.preprocess import split_documents
    assert len(ds) == info["num_documents"] == 3 * len(split_documents(TEXT * 8, "paragraph"))
    assert ds[0].dtype == np.uint16  # vocabulary < 65536
    first = ds[0].tolist()
    assert first == tok.tokenize("First Citizen:\nBefore we proceed any further, hear me speak.") \
        + [tok.eod]
    assert sum(len(ds[i]) for i in range(len(ds))) == info["num_tokens"]
    assert info["tokenizer_sha256"] == tok.sha256


def test_preprocess_errors(tokenizer_file, tmp_path):
    from megatron_kd.data.preprocess import preprocess
    from megatron_kd.data.tokenizer import HFTokenizer

    with pytest.raises(ValueError, match="matches no file"):
        preprocess([str(tmp_path / "none*.txt")], HFTokenizer(tokenizer_file),
                   str(tmp_path / "x"))


def test_gpt_dataset_splits(tokenizer_file, corpus, tmp_path):
    from megatron_kd.data.datasets import (
        BatchPlan,
        build_gpt_datasets,
        check_data_prefixes,
    )
    from megatron_kd.data.preprocess import preprocess
    from megatron_kd.data.tokenizer import HFTokenizer

    tok = HFTokenizer(tokenizer_file)
    prefix = str(tmp_path / "text")
    preprocess([corpus], tok, prefix)
    train, valid = build_gpt_datasets(data_path=[prefix], split="90,10,0", seq_length=16, seed=1,
                                      tokenizer=tok, train_samples=40, valid_samples=8,
                                      cache_path=str(tmp_path / "cache"))
    assert len(train) >= 40 and len(valid) >= 8
    sample = train[0]
    assert sample["tokens"].shape == (16,) and torch.equal(sample["tokens"][1:],
                                                           sample["labels"][:-1])
    assert sample["loss_mask"].sum() == 16  # no padding inside a long corpus
    plan = BatchPlan(global_batch_size=8, micro_batch_size=2, dp_rank=1, dp_size=2)
    mbs = list(plan.microbatches(train, consumed_samples=8))
    assert len(mbs) == 2 and mbs[0]["tokens"].shape == (2, 16)
    assert torch.equal(mbs[0]["tokens"][0], train[12]["tokens"])  # 8 consumed + rank 1 x 4
    with pytest.raises(ValueError, match="missing"):
        check_data_prefixes([str(tmp_path / "absent")])
    other = write_tokenizer(tmp_path / "other.json", vocab_size=280)
    with pytest.raises(ValueError, match="another tokenizer"):
        check_data_prefixes([prefix], HFTokenizer(other))


def test_mock_dataset_is_deterministic():
    from megatron_kd.data.datasets import MockGPTDataset

    a = MockGPTDataset(vocab_size=50, seq_length=8, num_samples=4, seed=3)
    b = MockGPTDataset(vocab_size=50, seq_length=8, num_samples=4, seed=3)
    assert torch.equal(a[2]["tokens"], b[2]["tokens"])
    assert int(a[2]["tokens"].max()) < 50


def case_train_on_text(ctx, argv):
    from megatron_kd.training.train import parse_args, train

    return train(parse_args(argv))


def test_train_on_preprocessed_text(dist_pool_factory, tokenizer_file, corpus, tmp_path):
    """CE-only training on real preprocessed text over TP=2, with evaluation."""
    from megatron_kd.data.preprocess import preprocess
    from megatron_kd.data.tokenizer import HFTokenizer

    prefix = str(tmp_path / "text")
    preprocess([corpus], HFTokenizer(tokenizer_file), prefix)
    argv = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
            "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "4",
            "--train-iters", "6", "--lr", "1e-2", "--eval-interval", "3", "--eval-iters", "2",
            "--split", "80,20,0", "--kd-weight", "0", "--kd-ce-weight", "1",
            "--tensor-model-parallel-size", "2", "--no-progress"]
    argv += ["--data-path", prefix, "--tokenizer-model", tokenizer_file,
             "--data-cache-path", str(tmp_path / "cache"), "--log-json", str(tmp_path / "l.jsonl")]
    summary = dist_pool_factory(2).run(case_train_on_text, argv)[0]
    assert summary["student_arch"]["vocab_size"] == HFTokenizer(tokenizer_file).vocab_size
    evals = summary["evals"]
    assert [e["step"] for e in evals] == [3, 6]
    assert evals[1]["eval_lm_loss"] < evals[0]["eval_lm_loss"]


def case_save_teacher(ctx, directory, vocab_size, extra):
    from megatron_kd.models import GPTArchConfig, build_gpt_model, save_model_checkpoint
    from megatron_kd.training.parallel import model_parallel

    arch = GPTArchConfig(num_layers=1, hidden_size=32, num_attention_heads=4,
                         num_query_groups=None, ffn_hidden_size=64, vocab_size=vocab_size,
                         padded_vocab_size=512, max_position_embeddings=32)
    with model_parallel(tp=2):
        save_model_checkpoint(build_gpt_model(arch), arch, directory, extra=extra)


def test_teacher_tokenizer_checks(dist_pool_factory, tokenizer_file, corpus, tmp_path):
    """The teacher's recorded tokenizer must be the data's; a too-small teacher vocabulary is
    refused; the teacher directory's tokenizer.json is the default --tokenizer-model."""
    import shutil

    from megatron_kd.data.preprocess import preprocess
    from megatron_kd.data.tokenizer import HFTokenizer
    from megatron_kd.training.train import parse_args, plan_run

    tok = HFTokenizer(tokenizer_file)
    prefix = str(tmp_path / "text")
    preprocess([corpus], tok, prefix)
    pool = dist_pool_factory(2)
    other, small, good = (str(tmp_path / n) for n in ("other", "small", "good"))
    pool.run(case_save_teacher, other, 400, {"tokenizer_sha256": "0" * 64})
    pool.run(case_save_teacher, small, 200, {})
    pool.run(case_save_teacher, good, 400, {"tokenizer_sha256": tok.sha256})
    shutil.copy(tokenizer_file, os.path.join(good, "tokenizer.json"))
    base = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "4",
            "--seq-length", "16", "--micro-batch-size", "1", "--train-iters", "1",
            "--tensor-model-parallel-size", "2"]
    base += ["--data-path", prefix]
    with pytest.raises(ValueError, match="made with another tokenizer"):
        plan_run(parse_args(base + ["--tokenizer-model", tokenizer_file,
                                    "--kd-teacher-load", other]), 2)
    with pytest.raises(ValueError, match=f"tokenizer has {tok.vocab_size} tokens but the "
                                         f"teacher vocabulary is 200"):
        plan_run(parse_args(base + ["--tokenizer-model", tokenizer_file,
                                    "--kd-teacher-load", small]), 2)
    plan = plan_run(parse_args(base + ["--kd-teacher-load", good]), 2)
    assert plan.tokenizer.sha256 == tok.sha256
    # a teacher directory holding its tokenizer.json: another tokenizer is refused by content
    other_tok = write_tokenizer(tmp_path / "other_tok.json", vocab_size=280)
    other_prefix = str(tmp_path / "other_text")
    preprocess([corpus], HFTokenizer(other_tok), other_prefix)
    with pytest.raises(ValueError, match="is not the teacher's tokenizer"):
        plan_run(parse_args(base[:-1] + [other_prefix, "--kd-teacher-load", good,
                                         "--tokenizer-model", other_tok]), 2)
    assert plan.student_arch.vocab_size == 400 and plan.student_arch.padded_vocab_size == 512
