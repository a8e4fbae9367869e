"""Training on preprocessed text: a tiny run on ``megatron-kd preprocess`` output, and the
teacher's tokenizer checks against the data's."""

import os

import pytest

pytest.importorskip("tokenizers")

from support.text import write_tokenizer


def case_train_on_text(ctx, argv):
    from megatron_kd.commands.train import parse_args, train

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
    from megatron_kd.arch import GPTArchConfig
    from megatron_kd.integration.checkpoint import save_model_checkpoint
    from megatron_kd.integration.gpt import build_gpt_model
    from megatron_kd.integration.groups import model_parallel

    arch = GPTArchConfig(num_layers=1, hidden_size=32, num_attention_heads=4,
                         num_query_groups=None, ffn_hidden_size=64, vocab_size=vocab_size,
                         padded_vocab_size=512, max_position_embeddings=32)
    with model_parallel(tp=2):
        save_model_checkpoint(build_gpt_model(arch), arch, directory, extra=extra)


def test_teacher_tokenizer_checks(dist_pool_factory, tokenizer_file, corpus, tmp_path):
    """The teacher's recorded tokenizer must be the data's; a too-small teacher vocabulary is
    refused; the teacher directory's tokenizer.json is the default --tokenizer-model."""
    import shutil

    from support.train_cases import check_flags

    from megatron_kd.data.preprocess import preprocess
    from megatron_kd.data.tokenizer import HFTokenizer

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
        check_flags(base + ["--tokenizer-model", tokenizer_file,
                                    "--kd-teacher-load", other], 2)
    with pytest.raises(ValueError, match=f"tokenizer has {tok.vocab_size} tokens but the "
                                         f"teacher vocabulary is 200"):
        check_flags(base + ["--tokenizer-model", tokenizer_file,
                                    "--kd-teacher-load", small], 2)
    plan = check_flags(base + ["--kd-teacher-load", good], 2)
    assert plan.tokenizer.sha256 == tok.sha256
    # a teacher directory holding its tokenizer.json: another tokenizer is refused by content
    other_tok = write_tokenizer(tmp_path / "other_tok.json", vocab_size=280)
    other_prefix = str(tmp_path / "other_text")
    preprocess([corpus], HFTokenizer(other_tok), other_prefix)
    with pytest.raises(ValueError, match="is not the teacher's tokenizer"):
        check_flags(base[:-1] + [other_prefix, "--kd-teacher-load", good,
                                         "--tokenizer-model", other_tok], 2)
    assert plan.student_arch.vocab_size == 400 and plan.student_arch.padded_vocab_size == 512
    # two teachers: the second's tokenizer.json, or its recorded tokenizer, is not the run's
    mixed = str(tmp_path / "mixed")
    shutil.copytree(good, mixed)
    shutil.copy(other_tok, os.path.join(mixed, "tokenizer.json"))
    two = base + ["--kd-mode", "colocated", "colocated"]
    with pytest.raises(ValueError, match=r"teacher 1 \(--kd-mode colocated .*mixed\): "
                                         r"--tokenizer-model .* is not the teacher's tokenizer"):
        check_flags(two + ["--kd-teacher-load", good, mixed], 2)
    with pytest.raises(ValueError, match=r"teacher 1 \(--kd-mode colocated .*other\): the "
                                         r"teacher .* was made with another tokenizer"):
        check_flags(two + ["--kd-teacher-load", good, other], 2)
    assert check_flags(two + ["--kd-teacher-load", good, good], 2).tokenizer.sha256 == tok.sha256
