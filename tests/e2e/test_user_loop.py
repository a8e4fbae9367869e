"""The README's loop in five commands, run: import the teacher, import the student, build the
teacher's top-K cache, train, export, with the flags the README shows (values shrunk to tiny
models: the check below holds the README's commands to these flags).

A tiny Qwen3-MoE teacher and a tiny dense Qwen3 student, both transformers' own classes with a
byte-level BPE tokenizer; the data is text tokenized with ``megatron-kd preprocess`` (the step
before the loop). The single-process commands run as a user runs them, ``python -m
megatron_kd ...``; the multi-rank ones (``cache build``, ``train``) run ``megatron-kd``'s own
``main`` on each rank of the test's gloo pool, as ``torchrun`` would start it. The exported
model loads with transformers, carries the teacher's tokenizer, and is the trained student (its
weights moved; its config is the student's).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from support.docs_commands import ROOT, documented_commands
from support.hf_models import tiny_qwen3, tiny_qwen3_moe

pytestmark = pytest.mark.filterwarnings("ignore")
transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

VOCAB = 300  # the tokenizer_file fixture's
README_MARK = "<!-- the loop: tests/e2e/test_user_loop.py -->"


def loop(tmp) -> list[tuple[str, list[str]]]:
    """The five commands (their ``megatron-kd`` arguments), values for tiny models."""
    data = ["--data-path", f"{tmp}/data/corpus", "--split", "98,2,0", "--seq-length", "32",
            "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "6"]
    return [
        ("import-hf", ["import-hf", "--hf-path", f"{tmp}/teacher_hf", "--save", f"{tmp}/teacher"]),
        ("import-hf", ["import-hf", "--hf-path", f"{tmp}/student_hf", "--save", f"{tmp}/student"]),
        ("cache build", ["cache", "build", "--kd-teacher-load", f"{tmp}/teacher", "--kd-topk",
                         "16", "--out", f"{tmp}/cache", *data]),
        ("train", ["train", "--pretrained-checkpoint", f"{tmp}/student", "--kd-mode", "offline",
                   "--kd-topk-cache", f"{tmp}/cache", *data, "--lr", "1e-2",
                   "--tensor-model-parallel-size", "2", "--save", f"{tmp}/run"]),
        ("export-hf", ["export-hf", "--load", f"{tmp}/run", "--save", f"{tmp}/distilled"]),
    ]


def _flag_names(argv: list[str]) -> list[str]:
    return sorted(a for a in argv if a.startswith("--"))


def _cli(*argv: str) -> None:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    r = subprocess.run([sys.executable, "-m", "megatron_kd", *argv], env=env, timeout=600,
                       capture_output=True, text=True, check=False)
    assert r.returncode == 0, f"megatron-kd {' '.join(argv)}:\n{r.stdout}\n{r.stderr}"


def case_cli(ctx, argv):
    """``megatron-kd ARGV`` on every rank (``torchrun -m megatron_kd ARGV``)."""
    from megatron_kd.cli import main

    assert main(list(argv)) == 0


def _with_tokenizer(path: str, tokenizer_file: str) -> str:
    with open(tokenizer_file, "rb") as src, open(os.path.join(path, "tokenizer.json"), "wb") as f:
        f.write(src.read())
    return path


def test_the_readme_shows_these_commands():
    """The README's loop: the same five commands, in order, with the same flags."""
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        text = f.read()
    assert README_MARK in text, "the README's loop is marked for this test"
    start = text.index(README_MARK)
    line = text.count("\n", 0, start) + 1
    block_end = text.index("```\n", text.index("```bash", start) + 7)
    end_line = text.count("\n", 0, block_end) + 1
    shown = [c for c in documented_commands()[0]
             if os.path.relpath(c.file, ROOT) == "README.md" and line < c.line < end_line]
    expected = loop("T")
    assert len(shown) == len(expected), [c.tokens for c in shown]
    for cmd, (label, argv) in zip(shown, expected, strict=True):
        words = [t for t in cmd.tokens if not t.startswith("-")][:len(label.split())]
        assert " ".join(words) == label, cmd.where()
        readme_flags = [t.split("=", 1)[0] for t in cmd.tokens if t.startswith("--")]
        assert sorted(readme_flags) == _flag_names(argv), cmd.where()


def test_the_loop_from_hugging_face_to_hugging_face(dist_pool_factory, tmp_path, tokenizer_file,
                                                    corpus):
    tmp = str(tmp_path)
    _with_tokenizer(tiny_qwen3_moe(tmp_path, vocab=VOCAB, name="teacher_hf")[0], tokenizer_file)
    _with_tokenizer(tiny_qwen3(tmp_path, vocab=VOCAB, name="student_hf", layers=2)[0],
                    tokenizer_file)
    # the step before the loop: the data, with the teacher's tokenizer
    (_, teacher), (_, student), (_, cache), (_, train), (_, export) = loop(tmp)
    _cli(*teacher)
    _cli(*student)
    _cli("preprocess", "--input", corpus, "--tokenizer-model", f"{tmp}/teacher",
         "--output-prefix", f"{tmp}/data/corpus")
    pool = dist_pool_factory(2)
    pool.run(case_cli, cache)
    pool.run(case_cli, train + ["--no-progress", "--eval-iters", "1"])
    _cli(*export)

    out = f"{tmp}/distilled"
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    original = transformers.AutoModelForCausalLM.from_pretrained(f"{tmp}/student_hf",
                                                                 dtype=torch.float32)
    assert model.config.to_dict() | {"_name_or_path": None} == \
        original.config.to_dict() | {"_name_or_path": None}
    moved = [n for n, p in model.state_dict().items()
             if not torch.equal(p, original.state_dict()[n])]
    assert "model.layers.0.self_attn.q_proj.weight" in moved  # trained, not the import
    with open(tokenizer_file, "rb") as a, open(os.path.join(out, "tokenizer.json"), "rb") as b:
        assert a.read() == b.read()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_file=os.path.join(out,
                                                                                 "tokenizer.json"))
    ids = tokenizer("the distilled student", return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model.eval()(ids).logits
    assert logits.shape == (1, ids.shape[1], VOCAB) and torch.isfinite(logits).all()
