"""The recipes (``docs/recipes/``), run: each page's ``megatron-kd`` commands, in the page's
order and with its flags (values shrunk to tiny models, the check below holds the page to these
flags), on tiny transformers models of the recipe's families with a byte-level BPE tokenizer.

Qwen3.5-35B-A3B -> Qwen3.5-9B: a Qwen3.5-MoE teacher and a Qwen3.5 student (Gated DeltaNet
hybrids), imported, planned, the teacher served by a replica and the student trained against it
at TP 2 with sequence parallelism, a top-K cache built and the student trained from it, both
runs reported, the student exported. Llama-3.1-8B -> Llama-3.2-3B: Llama teacher and student
with Llama-3's ``llama3`` RoPE scaling, imported, planned, trained colocated, exported; then
Llama-3.1-8B and 70B -> Llama-3.2-3B: a second (wider) teacher imported, the two planned, the
wider one served at TP 2 with sequence parallelism and the student trained on both, exported. The
single-process commands run ``megatron-kd``'s ``main`` in this process; the multi-rank ones on
each rank of the test's gloo pool, as ``torchrun`` would start them (without ``--bf16`` and
``--use-distributed-optimizer``, which need a GPU). Both exports load with
transformers and are the trained students (their weights moved).
"""

from __future__ import annotations

import json
import os

import pytest
from support.docs_commands import ROOT, documented_commands
from support.hf_models import tiny_llama, tiny_qwen35, tiny_qwen35_moe

from megatron_kd.testing.replicas import Replica

pytestmark = pytest.mark.filterwarnings("ignore")
transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

VOCAB = 300  # the tokenizer_file fixture's
GPU_ONLY = ("--bf16", "--use-distributed-optimizer")  # train's switches the CPU refuses
SEQ = "32"


def _data(tmp, iters="3") -> list[str]:
    return ["--data-path", f"{tmp}/data/corpus", "--split", "98,2,0", "--seq-length", SEQ,
            "--micro-batch-size", "1", "--global-batch-size", "4", "--train-iters", iters]


def _prepare(tmp) -> list[tuple[str, list[str]]]:
    return [
        ("import-hf", ["import-hf", "--hf-path", f"{tmp}/teacher_hf", "--save", f"{tmp}/teacher"]),
        ("import-hf", ["import-hf", "--hf-path", f"{tmp}/student_hf", "--save", f"{tmp}/student"]),
        ("preprocess", ["preprocess", "--input", f"{tmp}/corpus", "--tokenizer-model",
                        f"{tmp}/teacher", "--output-prefix", f"{tmp}/data/corpus"]),
        ("plan", ["plan", "--teacher", f"{tmp}/teacher", "--student", f"{tmp}/student", "--gpu",
                  "h200-141g", "--nodes", "1", "--seq-length", SEQ,
                  "--use-distributed-optimizer"]),
    ]


def qwen35(tmp) -> list[tuple[str, list[str]]]:
    """The Qwen3.5 recipe's commands, values for tiny models."""
    endpoint = f"{tmp}/endpoint"
    student = ["--lr", "1e-2", "--bf16", "--use-distributed-optimizer",
               "--tensor-model-parallel-size", "2", "--sequence-parallel"]
    return _prepare(tmp) + [
        ("teacher serve", ["teacher", "serve", "--kd-teacher-load", f"{tmp}/teacher",
                           "--kd-teacher-endpoint", endpoint, "--kd-teacher-dtype", "bf16",
                           "--max-seq-length", SEQ]),
        ("train", ["train", "--pretrained-checkpoint", f"{tmp}/student", "--kd-teacher-load",
                   f"{tmp}/teacher", "--kd-teacher-dtype", "bf16", "--kd-mode", "disaggregated",
                   "--kd-teacher-endpoint",
                   endpoint, "--kd-wire-dtype", "bf16", *_data(tmp), *student, "--save",
                   f"{tmp}/run", "--load", f"{tmp}/run", "--save-interval", "2", "--log-json",
                   f"{tmp}/run.jsonl"]),
        ("cache build", ["cache", "build", "--kd-teacher-load", f"{tmp}/teacher", "--kd-topk",
                         "16", "--out", f"{tmp}/cache", *_data(tmp)]),
        ("train", ["train", "--pretrained-checkpoint", f"{tmp}/student", "--kd-mode", "offline",
                   "--kd-topk-cache", f"{tmp}/cache", *_data(tmp), *student, "--save",
                   f"{tmp}/run_offline", "--load", f"{tmp}/run_offline", "--save-interval", "2",
                   "--log-json",
                   f"{tmp}/run_offline.jsonl"]),
        ("report", ["report", f"{tmp}/run.jsonl", f"{tmp}/run_offline.jsonl", "--out",
                    f"{tmp}/report"]),
        ("export-hf", ["export-hf", "--load", f"{tmp}/run", "--save", f"{tmp}/distilled",
                       "--dtype", "bfloat16"]),
    ]


def llama(tmp) -> list[tuple[str, list[str]]]:
    """The Llama recipe's commands, values for tiny models."""
    return _prepare(tmp) + [
        ("train", ["train", "--pretrained-checkpoint", f"{tmp}/student", "--kd-teacher-load",
                   f"{tmp}/teacher", "--kd-teacher-dtype", "bf16", *_data(tmp), "--lr", "1e-2",
                   "--bf16", "--use-distributed-optimizer", "--save", f"{tmp}/run", "--load",
                   f"{tmp}/run", "--save-interval", "2", "--log-json", f"{tmp}/run.jsonl"]),
        ("export-hf", ["export-hf", "--load", f"{tmp}/run", "--save", f"{tmp}/distilled",
                       "--dtype", "bfloat16"]),
    ]


def llama_two(tmp) -> list[tuple[str, list[str]]]:
    """The two-teacher Llama recipe's commands, values for tiny models."""
    endpoint = f"{tmp}/endpoint"
    prepare = _prepare(tmp)
    plan = prepare[3][1]
    return prepare[:1] + [
        ("import-hf", ["import-hf", "--hf-path", f"{tmp}/teacher70_hf", "--save",
                       f"{tmp}/teacher-70b"]),
        *prepare[1:3],
        ("plan", [*plan[:3], f"{tmp}/teacher-70b", "--kd-mode", "colocated", "disaggregated",
                  "--kd-teacher-weights", "1", "1", *plan[3:]]),
        ("teacher serve", ["teacher", "serve", "--kd-teacher-load", f"{tmp}/teacher-70b",
                           "--kd-teacher-endpoint", endpoint, "--tensor-model-parallel-size",
                           "2", "--sequence-parallel", "--max-seq-length", SEQ,
                           "--kd-teacher-dtype", "bf16"]),
        ("train", ["train", "--pretrained-checkpoint", f"{tmp}/student", "--kd-mode",
                   "colocated", "disaggregated", "--kd-teacher-load", f"{tmp}/teacher",
                   f"{tmp}/teacher-70b", "--kd-teacher-dtype", "bf16", "--kd-teacher-endpoint",
                   endpoint, "--kd-wire-dtype", "bf16", "--kd-teacher-weights", "1", "1",
                   *_data(tmp), "--lr", "1e-2", "--bf16", "--use-distributed-optimizer",
                   "--save", f"{tmp}/run2", "--load", f"{tmp}/run2", "--save-interval", "2",
                   "--log-json", f"{tmp}/run2.jsonl"]),
        ("export-hf", ["export-hf", "--load", f"{tmp}/run2", "--save", f"{tmp}/distilled2",
                       "--dtype", "bfloat16"]),
    ]


RECIPES = {"qwen35": ("docs/recipes/qwen3.5-35b-a3b-to-9b.md", qwen35),
           "llama": ("docs/recipes/llama-3.1-8b-to-3.2-3b.md", llama),
           "llama-two": ("docs/recipes/llama-3.1-8b-and-70b-to-3.2-3b.md", llama_two)}


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_the_page_shows_these_commands(name):
    """The page's marked block: the same commands, in order, with the same flags."""
    page, commands = RECIPES[name]
    path = os.path.join(ROOT, page)
    with open(path, encoding="utf-8") as f:
        text = f.read()
    mark = f"<!-- recipe {name}: tests/e2e/test_recipes.py -->"
    assert mark in text, f"{page} marks its commands for this test"
    start = text.index(mark)
    first = text.count("\n", 0, start) + 1
    last = text.count("\n", 0, text.index("```\n", text.index("```bash", start) + 7)) + 1
    shown = [c for c in documented_commands()[0] if c.file == path and first < c.line < last]
    expected = commands("T")
    assert len(shown) == len(expected), [c.tokens for c in shown]
    for cmd, (label, argv) in zip(shown, expected, strict=True):
        words = [t for t in cmd.tokens if not t.startswith("-")][:len(label.split())]
        assert " ".join(words) == label, cmd.where()
        assert sorted(t for t in cmd.tokens if t.startswith("--")) == \
            sorted(t for t in argv if t.startswith("--")), cmd.where()


def case_cli(ctx, argv):
    """``megatron-kd ARGV`` on every rank (``torchrun -m megatron_kd ARGV``), on the CPU:
    without :data:`GPU_ONLY` (Megatron-Core's mixed-precision and distributed optimizers take
    CUDA tensors only; the run refuses them on CPU, naming why)."""
    from megatron_kd.cli import main

    assert main([a for a in argv if a not in GPU_ONLY]) == 0


def _main(argv) -> None:
    from megatron_kd.cli import main

    assert main(list(argv)) == 0, argv


def _models(tmp_path, tokenizer_file, corpus, teacher, student) -> None:
    """The two Hugging Face models at ``teacher_hf`` and ``student_hf`` with the tokenizer, and
    the text at ``corpus``."""
    for path, name in ((teacher, "teacher_hf"), (student, "student_hf")):
        path = os.rename(path, tmp_path / name) or tmp_path / name
        with open(tokenizer_file, "rb") as src, \
                open(os.path.join(path, "tokenizer.json"), "wb") as f:
            f.write(src.read())
    os.symlink(corpus, tmp_path / "corpus")


def _assert_trained_export(tmp, capsys_out: str) -> None:
    assert "colocated" in capsys_out and "fits" in capsys_out  # the plan was printed
    model = transformers.AutoModelForCausalLM.from_pretrained(f"{tmp}/distilled",
                                                              dtype=torch.float32)
    original = transformers.AutoModelForCausalLM.from_pretrained(f"{tmp}/student_hf",
                                                                 dtype=torch.float32)
    assert model.config.to_dict()["model_type"] == original.config.to_dict()["model_type"]
    state = original.state_dict()
    moved = [n for n, p in model.state_dict().items() if not torch.equal(p, state[n])]
    assert any("layers.0" in n for n in moved)  # trained, not the import


def test_qwen35_recipe(dist_pool_factory, tmp_path, tokenizer_file, corpus, capsys):
    tmp = str(tmp_path)
    _models(tmp_path, tokenizer_file, corpus,
            tiny_qwen35_moe(tmp_path, vocab=VOCAB, name="teacher")[0],
            tiny_qwen35(tmp_path, vocab=VOCAB, name="student")[0])
    steps = qwen35(tmp)
    for _, argv in steps[:4]:  # import both, the data, the plan
        _main(argv)
    plan_out = capsys.readouterr().out
    assert "context" not in plan_out.split("== colocated-fused")[1].split("\n")[1]  # no CP
    pool = dist_pool_factory(2)
    serve = steps[4][1]
    replica = Replica(serve[serve.index("--kd-teacher-endpoint") + 1], f"{tmp}/teacher",
                      log=tmp_path / "replica.jsonl",
                      extra=serve[serve.index("--kd-teacher-dtype"):])
    # one request a training microbatch, none for evaluation (the replicas stream training
    # microbatches only): 3 steps (--train-iters) x 4 microbatches of 1 sample (global batch 4,
    # micro batch 1, data-parallel 1: 2 ranks at TP 2)
    train_microbatches = 3 * 4 // (1 * 1)
    try:
        pool.run(case_cli, steps[5][1] + ["--no-progress"])
        # a stats record written during the run can lag what was served, never lead it
        assert replica.requests_served() <= train_microbatches
    finally:
        replica.stop()
    # the student was served by the replica: every microbatch once, nothing asked twice
    assert replica.final_stats()["requests"] == train_microbatches
    pool.run(case_cli, steps[6][1])
    pool.run(case_cli, steps[7][1] + ["--no-progress"])
    _main(steps[8][1])
    assert os.path.isfile(f"{tmp}/report/summary.md")
    _main(steps[9][1])
    for log in ("run.jsonl", "run_offline.jsonl"):
        with open(f"{tmp}/{log}", encoding="utf-8") as f:
            records = [json.loads(line) for line in f]
        assert [r["step"] for r in records if not r.get("eval") and "step" in r][-1] == 3
    _assert_trained_export(tmp, plan_out)


def test_llama_recipes(dist_pool_factory, tmp_path, tokenizer_file, corpus, capsys):
    """The one-teacher Llama recipe, then the two-teacher one in the same directory (the
    commands the two pages share, the same in both, run once)."""
    tmp = str(tmp_path)
    _models(tmp_path, tokenizer_file, corpus,
            tiny_llama(tmp_path, tied=False, vocab=VOCAB, name="teacher",
                       llama3_rope_factor=8.0)[0],
            tiny_llama(tmp_path, tied=True, vocab=VOCAB, name="student",
                       llama3_rope_factor=32.0)[0])
    wider = tiny_llama(tmp_path, tied=False, vocab=VOCAB, name="teacher70", ffn=96,
                       llama3_rope_factor=8.0)[0]  # the 70B's stand-in: other weights
    os.rename(wider, tmp_path / "teacher70_hf")
    steps = llama(tmp)
    for _, argv in steps[:4]:
        _main(argv)
    plan_out = capsys.readouterr().out
    for side, factor in (("teacher", 8.0), ("student", 32.0)):  # the RoPE scaling came in
        with open(f"{tmp}/{side}/megatron_lm_flags.txt", encoding="utf-8") as f:
            assert f"--rope-scaling-factor {factor:g}" in f.read()
    pool = dist_pool_factory(2)
    pool.run(case_cli, steps[4][1] + ["--no-progress"])
    _main(steps[5][1])
    exported = transformers.AutoConfig.from_pretrained(f"{tmp}/distilled").to_dict()
    assert exported["rope_parameters"]["rope_type"] == "llama3"
    assert exported["rope_parameters"]["factor"] == 32.0
    _assert_trained_export(tmp, plan_out)
    _llama_two_teachers(tmp, tmp_path, pool, [argv for _, argv in steps], capsys)


def _llama_two_teachers(tmp, tmp_path, pool, done, capsys) -> None:
    """The two-teacher page's commands not run already (by the one-teacher page)."""
    steps = [(label, argv) for label, argv in llama_two(tmp) if argv not in done]
    assert [label for label, _ in steps] == ["import-hf", "plan", "teacher serve", "train",
                                             "export-hf"]
    _main(steps[0][1])
    _main(steps[1][1])
    plan_out = capsys.readouterr().out
    assert "== mixture of 2 teachers: fits" in plan_out and "[1] " in plan_out
    serve = steps[2][1]
    replica = Replica(serve[serve.index("--kd-teacher-endpoint") + 1], f"{tmp}/teacher-70b",
                      log=tmp_path / "replica70.jsonl", tp=2,
                      extra=serve[serve.index("--sequence-parallel"):])
    try:
        pool.run(case_cli, steps[3][1] + ["--no-progress"])
    finally:
        replica.stop()
    # 3 steps of 4 one-sample microbatches over 2 data-parallel ranks: each asked once
    assert replica.final_stats()["requests"] == 3 * 4
    with open(f"{tmp}/run2.jsonl", encoding="utf-8") as f:
        records = [json.loads(line) for line in f]
    trained = [r for r in records if "teacher_kd_losses" in r]
    assert [r["step"] for r in trained] == [1, 2, 3]
    assert all(len(r["teacher_kd_losses"]) == 2 and len(r["kd_teachers"]) == 2
               and r["kd_teachers"][1]["kd_wire_bytes"] > 0 for r in trained)
    _main(steps[4][1])
    model = transformers.AutoModelForCausalLM.from_pretrained(f"{tmp}/distilled2",
                                                              dtype=torch.float32)
    first = transformers.AutoModelForCausalLM.from_pretrained(f"{tmp}/distilled",
                                                              dtype=torch.float32)
    state = first.state_dict()  # another run than the one-teacher page's: other weights
    assert any(not torch.equal(p, state[n]) for n, p in model.state_dict().items())
