"""``megatron-kd export-hf`` of a checkpoint the real Megatron-LM ``pretrain_gpt.py`` wrote: the
Hugging Face model comes back bit for bit.

A tiny random Llama (transformers' own class, untied embeddings) is imported
(``megatron-kd import-hf``); Megatron-LM's patched ``pretrain_gpt.py`` (KD term off: a plain
LM step) loads those weights at TP 2 (``--finetune``, the import given as a ``release``
checkpoint), takes one step at learning rate 0 (Adam then changes nothing) and saves a
``torch_dist`` checkpoint sharded over its 2 ranks. ``export-hf`` of that checkpoint gives every
tensor of the original model bit for bit, with the original's config (``--hf-config``) or with
one built from the arguments Megatron-LM saved in the checkpoint (the architecture's fields
equal the original's). Runs only with Megatron-LM checkouts, as ``test_megatron_lm_real.py``.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from test_megatron_lm_real import (
    LAUNCHER,
    MEGATRON_LM_ONLY,
    REPO,
    _checkouts,
    _megatron_lm_python,
    _patched_script,
    _torchrun,
)

pytestmark = pytest.mark.filterwarnings("ignore")

VOCAB = 500  # Megatron-LM's NullTokenizer size in MEGATRON_LM_ONLY; padded to 512 by both
# the tiny Llama's shape (tests/support/hf_models.py) in Megatron-LM's flags
LLAMA_FLAGS = ["--num-layers", "2", "--hidden-size", "48", "--num-attention-heads", "6",
               "--group-query-attention", "--num-query-groups", "2", "--ffn-hidden-size", "72",
               "--max-position-embeddings", "64", "--position-embedding-type", "rope",
               "--rotary-base", "5000", "--normalization", "RMSNorm", "--norm-epsilon", "1e-5",
               "--swiglu", "--disable-bias-linear", "--untie-embeddings-and-output-weights"]
# the architecture fields transformers reads that a config built from Megatron-LM's arguments
# must give back (token ids and the like are transformers' defaults there: docs/models.md)
ARCH_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
               "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
               "tie_word_embeddings", "attention_bias", "mlp_bias", "model_type",
               "max_position_embeddings", "rope_theta", "rope_parameters", "rope_scaling")


def _cli(*argv: str) -> None:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    r = subprocess.run([sys.executable, "-m", "megatron_kd", *argv], env=env, timeout=600,
                       capture_output=True, text=True, check=False)
    assert r.returncode == 0, f"megatron-kd {' '.join(argv)}:\n{r.stdout}\n{r.stderr[-4000:]}"


def _weights(how: str, release, imported: str, out) -> list[str]:
    if how == "release":
        return ["--load", str(release), "--finetune", "--no-load-optim", "--no-load-rng"]
    return ["--pretrained-checkpoint", imported, "--load", str(out)]


def _tensors(directory: str) -> dict:
    from safetensors.torch import load_file

    out = {}
    for name in sorted(os.listdir(directory)):
        if name.endswith(".safetensors"):
            out.update(load_file(os.path.join(directory, name)))
    return out


@pytest.mark.parametrize("weights", ["release", "pretrained_checkpoint"])
def test_export_of_a_real_megatron_lm_checkpoint_gives_the_model_back(tmp_path, weights):
    """``weights``: how Megatron-LM gets the imported weights: ``--load`` of a ``release``
    root with ``--finetune`` (Megatron-LM's own way), or ``--pretrained-checkpoint`` naming the
    ``import-hf`` directory itself (through the hooks: ``megatron_lm.pretrained``), with
    ``--load`` the empty ``--save`` directory (a first start; a resume would take its own)."""
    if not _checkouts():
        pytest.skip("MEGATRON_LM_DIR is not set (Megatron-LM checkouts)")
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("tokenizers")
    from support.hf_models import tiny_llama
    from support.text import TEXT, write_tokenizer

    from megatron_kd.arch.megatron_lm_args import parse_megatron_lm_flags
    from megatron_kd.data.preprocess import preprocess
    from megatron_kd.data.tokenizer import HFTokenizer

    python = _megatron_lm_python()
    (tmp_path / "text").mkdir()
    (tmp_path / "text" / "part.txt").write_text(TEXT * 10, encoding="utf-8")
    tok = write_tokenizer(tmp_path / "tokenizer.json")
    assert HFTokenizer(tok).vocab_size <= VOCAB
    preprocess([str(tmp_path / "text")], HFTokenizer(tok), str(tmp_path / "corpus"))
    hf_dir = tiny_llama(tmp_path, tied=False, vocab=VOCAB, name="llama")[0]
    imported = str(tmp_path / "imported")
    _cli("import-hf", "--hf-path", hf_dir, "--save", imported)
    release = tmp_path / "release_root"
    release.mkdir()
    os.symlink(imported, release / "release")
    (release / "latest_checkpointed_iteration.txt").write_text("release")
    original = _tensors(hf_dir)
    config = transformers.AutoConfig.from_pretrained(hf_dir).to_dict()
    # the model flags import-hf wrote are what Megatron-LM builds the student from: the same
    # model as the flags written here by hand from the tiny Llama's config
    written = os.path.join(imported, "megatron_lm_flags.txt")
    with open(written, encoding="utf-8") as f:
        model_flags = " ".join(line for line in f if not line.startswith("#")).split()
    assert vars(parse_megatron_lm_flags(written)) == vars(parse_megatron_lm_flags(
        " ".join(LLAMA_FLAGS)))

    only = MEGATRON_LM_ONLY[MEGATRON_LM_ONLY.index("--tokenizer-type"):
                            MEGATRON_LM_ONLY.index("--save-interval")]
    for root in _checkouts():
        out = tmp_path / f"mlm_{os.path.basename(root)}"
        env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="",
                   CUDA_DEVICE_MAX_CONNECTIONS="1",
                   PYTHONPATH=os.pathsep.join([root, os.path.join(REPO, "tests"), REPO]),
                   PATH=os.pathsep.join([os.path.dirname(python), os.environ["PATH"]]))
        _torchrun(python, 2, [LAUNCHER, _patched_script(root, tmp_path), *model_flags, *only,
                              "--kd-weight", "0", "--kd-ce-weight", "1",
                              "--tensor-model-parallel-size", "2", "--seq-length", "32",
                              "--micro-batch-size", "2", "--global-batch-size", "2",
                              "--train-iters", "1", "--lr", "0.0", "--min-lr", "0.0",
                              "--weight-decay", "0.0", "--clip-grad", "0.0", "--eval-iters", "0",
                              "--eval-interval", "100", "--split", "90,5,5", "--data-path",
                              str(tmp_path / "corpus"), *_weights(weights, release, imported, out),
                              "--save", str(out), "--save-interval", "1"], env)
        assert (out / "latest_checkpointed_iteration.txt").read_text().strip() == "1"
        for with_config in (True, False):
            exported = str(tmp_path / f"hf_{os.path.basename(root)}_{with_config}")
            _cli("export-hf", "--load", str(out), "--save", exported, "--dtype", "float32",
                 *(["--hf-config", hf_dir] if with_config else []))
            got = _tensors(exported)
            assert sorted(got) == sorted(original), (root, with_config)
            unequal = [n for n in original if not (got[n].dtype == original[n].dtype
                                                   and got[n].equal(original[n]))]
            assert not unequal, (root, with_config, unequal)
            back = transformers.AutoConfig.from_pretrained(exported).to_dict()
            if with_config:
                assert back | {"_name_or_path": None} == config | {"_name_or_path": None}
            else:
                assert {k: back.get(k) for k in ARCH_FIELDS} == \
                    {k: config.get(k) for k in ARCH_FIELDS}, root


def test_the_example_script_trains_an_imported_student(tmp_path):
    """``examples/megatron_lm/train_kd_colocated.sh`` as a user runs it, ``STUDENT`` an
    ``import-hf`` directory (its model flags from the ``megatron_lm_flags.txt`` the import
    wrote, its weights by ``--pretrained-checkpoint``) and the same model as the colocated
    teacher, 2 ranks at TP 2, fp32, 2 iterations at learning rate 0 on the real patched
    ``pretrain_gpt.py`` of each checkout (through the test's CPU launcher, ``PRETRAIN_GPT``):
    the run saves iteration 2 and its export is the imported model bit for bit."""
    if not _checkouts():
        pytest.skip("MEGATRON_LM_DIR is not set (Megatron-LM checkouts)")
    pytest.importorskip("transformers")
    from support.hf_models import tiny_llama
    from support.text import TEXT, write_tokenizer

    from megatron_kd.data.preprocess import preprocess
    from megatron_kd.data.tokenizer import HFTokenizer

    python = _megatron_lm_python()
    (tmp_path / "text").mkdir()
    (tmp_path / "text" / "part.txt").write_text(TEXT * 10, encoding="utf-8")
    tok = write_tokenizer(tmp_path / "tokenizer.json")
    preprocess([str(tmp_path / "text")], HFTokenizer(tok), str(tmp_path / "corpus"))
    hf_dir = tiny_llama(tmp_path, tied=False, vocab=VOCAB, name="llama")[0]
    student = str(tmp_path / "student")
    _cli("import-hf", "--hf-path", hf_dir, "--save", student)
    original = _tensors(hf_dir)
    cpu_only = MEGATRON_LM_ONLY[MEGATRON_LM_ONLY.index("--tokenizer-type"):
                                MEGATRON_LM_ONLY.index("--log-interval")]
    script = os.path.join(REPO, "examples", "megatron_lm", "train_kd_colocated.sh")
    bin_dir = tmp_path / "bin"  # the script's `torchrun`: Megatron-LM's interpreter's
    bin_dir.mkdir()
    (bin_dir / "torchrun").write_text(f'#!/bin/sh\nexec {python} -m torch.distributed.run "$@"\n')
    (bin_dir / "torchrun").chmod(0o755)
    for root in _checkouts():
        out = tmp_path / f"run_{os.path.basename(root)}"
        env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="",
                   PYTHONPATH=os.pathsep.join([root, os.path.join(REPO, "tests"), REPO]),
                   PATH=os.pathsep.join([str(bin_dir), os.environ["PATH"]]),
                   STUDENT=student, GPUS_PER_NODE="2", TP="2", MASTER_PORT=str(_free_port()),
                   PRETRAIN_GPT=f"{LAUNCHER} {_patched_script(root, tmp_path)}",
                   SEQ_LENGTH="32", MICRO_BATCH="2", GLOBAL_BATCH="2", TRAIN_ITERS="2",
                   LR="0.0", WARMUP="0", PRECISION="fp32", KD_TEACHER_DTYPE="fp32",
                   KD_CE_WEIGHT="1.0")
        proc = subprocess.run(
            ["bash", script, str(out), str(tmp_path / "tb"), student, str(tmp_path / "corpus"),
             "unused-tokenizer", *cpu_only, "--weight-decay", "0.0", "--clip-grad", "0.0",
             "--eval-iters", "0", "--eval-interval", "100", "--save-interval", "2",
             "--split", "90,5,5",  # the tiny corpus has no 1/1000 test split
             "--log-interval", "1"], env=env, capture_output=True, text=True, timeout=240,
            check=False)
        errors = [line for line in proc.stderr.splitlines() if "Error" in line]
        assert proc.returncode == 0, (proc.stdout[-3000:], errors[-20:])
        assert (out / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
        exported = str(tmp_path / f"hf_{os.path.basename(root)}")
        _cli("export-hf", "--load", str(out), "--save", exported, "--dtype", "float32",
             "--hf-config", hf_dir)
        got = _tensors(exported)
        assert [n for n in original if not got[n].equal(original[n])] == [], root


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
