"""``megatron-kd train --kd-mode offline``: a top-K cache built by ``megatron-kd cache build``
stands in for the teacher. On 2 gloo ranks:

* K = V (the whole vocabulary): the per-step losses equal colocated training with the dense
  teacher;
* K < V: they equal colocated training against the same teacher truncated to its top K
  (computed here from the full logits, independently of the cache's top-K and codec);
* no teacher model is built or loaded, and only the last pipeline stage reads the cache;
* a cache made for another run (seq length, data, vocabulary) is refused before any step,
  naming both values; flags that cannot work offline are refused before anything is built.

Teacher and student are support.train_cases' tiny models (vocabulary 500 padded to 512, sequence 32).
"""

import dataclasses
import functools

import pytest
import torch
from support.train_cases import (
    STUDENT,
    TEACHER_ARCH,
    cache_build_argv,
    case_cache_build,
    case_make_teacher,
    case_plan_error,
    case_train,
    step_losses,
    student_argv,
)

from megatron_kd.cache.identity import tokenizer_identity

VOCAB = TEACHER_ARCH["vocab_size"]
TRAIN_ITERS, GLOBAL_BATCH, SEQ = 4, 4, 32  # STUDENT's global batch and sequence length
SMALL_K = 20

# Training flags shared by the offline runs and the colocated references.
COMMON = STUDENT + ["--train-iters", str(TRAIN_ITERS), "--eval-interval", "100",
                    "--eval-iters", "0", "--kd-ce-weight", "0.2"]


# --- cases (run on every rank) --------------------------------------------------------------

def _cache_argv(out, teacher_dir, k, data=("--mock-data",)):
    """``megatron-kd cache build`` (run in-process by ``case_cache_build``): one teacher replica
    of TP 2, the run's samples. fp32 log-probs: lossless, so the comparisons below measure the
    training path only (the compact encoding's own deviation is bounded in
    test_cache_offline.py)."""
    return cache_build_argv(out, teacher_dir, topk=k, seq=SEQ, iters=TRAIN_ITERS,
                            global_batch=GLOBAL_BATCH, samples_per_shard=6, tp=2, data=data)


def topk_truncated_kd_loss(student_hidden, student_weight, teacher=None, *, k, tail, config,
                           tp_group=None, **kw):
    """The fused loss against the dense teacher cut down to its top ``k`` log-probs (the tail
    treated as ``tail``).

    The teacher's full logits are gathered over the TP group and log-softmaxed by torch, then
    ``torch.topk`` picks the entries: no code shared with the cache's vocab-parallel top-K.
    """
    from megatron.core.tensor_parallel.mappings import (
        gather_from_tensor_model_parallel_region,
    )

    from megatron_kd.loss import DenseTeacher, TopKTeacher, vocab_parallel_kd_loss

    if teacher is None:
        return vocab_parallel_kd_loss(student_hidden, student_weight, config=config,
                                      tp_group=tp_group, **kw)
    assert isinstance(teacher, DenseTeacher), type(teacher)  # the run's colocated teacher
    with torch.no_grad():
        local = teacher.hidden.float() @ teacher.weight.float().t()  # [s, b, local_vocab]
        logits = gather_from_tensor_model_parallel_region(local, group=tp_group)
        logprobs, ids = torch.log_softmax(logits[..., :config.vocab_size], dim=-1).topk(k, dim=-1)
    return vocab_parallel_kd_loss(student_hidden, student_weight,
                                  TopKTeacher(ids=ids, logprobs=logprobs),
                                  config=dataclasses.replace(config, topk_tail=tail),
                                  tp_group=tp_group, **kw)


def case_train_topk_teacher(ctx, argv, k, tail="renormalize"):
    from megatron_kd.commands.train import parse_args, train

    loss_fn = functools.partial(topk_truncated_kd_loss, k=k, tail=tail)
    return train(parse_args(argv), loss_fn=loss_fn)


def case_train_watched(ctx, argv):
    """Train, recording checkpoint loads and what the trainer held."""
    # the one place a teacher checkpoint is loaded (the frozen-teacher builder)
    from megatron_kd.commands import train as train_mod
    from megatron_kd.integration import teacher as models

    loads, seen = [], {}
    load, fit = models.load_model_checkpoint, train_mod.Trainer.fit

    def load_spy(*args, **kwargs):
        loads.append(1)
        return load(*args, **kwargs)

    def fit_spy(self):
        # the run's teacher source: a cache reader, never a model or a replica client
        seen.update(teacher=self.teacher.model, remote=self.teacher.client,
                    is_last=self.is_last,
                    topk_built=lambda: getattr(self.teacher, "prefetcher", None) is not None)
        return fit(self)

    models.load_model_checkpoint, train_mod.Trainer.fit = load_spy, fit_spy
    try:
        summary = train_mod.train(train_mod.parse_args(argv))
    finally:
        models.load_model_checkpoint, train_mod.Trainer.fit = load, fit
    return {"summary": summary, "checkpoint_loads": len(loads),
            "teacher_is_none": seen["teacher"] is None and seen["remote"] is None,
            "is_last": seen["is_last"], "reads_cache": seen["topk_built"]()}


# --- fixtures ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def setup(pool, tmp_path_factory):
    """The teacher checkpoint and two caches of it: K = V and K = SMALL_K."""
    tmp = tmp_path_factory.mktemp("offline")
    teacher = str(tmp / "teacher")
    pool.run(case_make_teacher, teacher, TEACHER_ARCH)
    caches = {}
    for k in (VOCAB, SMALL_K):
        caches[k] = str(tmp / f"cache_k{k}")
        pool.run(case_cache_build, _cache_argv(caches[k], teacher, k))
    return teacher, caches


def _offline(cache, *flags):
    return COMMON + ["--kd-mode", "offline", "--kd-topk-cache", cache, *flags]


# --- parity with colocated training ----------------------------------------------------------

def test_full_vocab_cache_equals_dense_teacher(pool, setup):
    teacher, caches = setup
    flags = ["--tensor-model-parallel-size", "2", "--kd-temperature", "1.5"]
    colocated = pool.run(case_train, COMMON + ["--kd-teacher-load", teacher] + flags)[0]
    offline = pool.run(case_train, _offline(caches[VOCAB], *flags, "--eval-interval",
                                            str(TRAIN_ITERS), "--eval-iters", "1"))
    assert step_losses(offline[0]) == step_losses(offline[1])
    # fp32 throughout. With K = V and the renormalising tail the cached teacher is the dense
    # one (softmax(log p / T) = softmax(z / T)); the two differ by summation order only (the
    # cache's windowed log-sum-exp vs the fused loss's online softmax). Measured: <= 9e-8
    # relative over the 4 steps; 2e-6 leaves headroom for other BLAS builds, while a
    # misaligned or truncated teacher moves them by > 1e-3 (top-19 vs top-20 alone: 6e-3).
    assert step_losses(offline[0]) == pytest.approx(step_losses(colocated), rel=2e-6)
    kd = [r["kd_loss"] for r in offline[0]["steps"]]
    assert kd == pytest.approx([r["kd_loss"] for r in colocated["steps"]], rel=2e-6)
    assert all(v > 0.1 for v in kd)  # a real KD term, not a CE-only run
    # Offline evaluation: the student's CE only (the cache holds no validation samples).
    ev = offline[0]["evals"][0]
    assert ev["eval_lm_loss"] > 0 and ev["eval_loss"] == pytest.approx(ev["eval_lm_loss"])
    assert ev["eval_kd_loss"] is None and ev["eval_teacher_lm_loss"] is None
    assert ev["eval_kd_kl"] is None and ev["eval_top1_agreement"] is None


@pytest.mark.parametrize("tail", ["renormalize", "ghost"])
def test_topk_cache_equals_truncated_teacher(pool, setup, tail):
    teacher, caches = setup
    colocated = pool.run(case_train_topk_teacher, COMMON + [
        "--kd-teacher-load", teacher, "--tensor-model-parallel-size", "2"], SMALL_K, tail)[0]
    offline = pool.run(case_train, _offline(caches[SMALL_K], "--tensor-model-parallel-size",
                                            "2", "--kd-topk-tail", tail))[0]
    # fp32, lossless log-probs: both sides feed the fused loss the same 20 (id, log-prob)
    # pairs per token, up to the order of the pairs and a few ulps in the log-probs (windowed
    # vocab-parallel log-sum-exp vs torch's log_softmax). Measured: <= 6e-8 relative over the
    # 4 steps; 2e-6 leaves headroom, while truncating to K = 19 instead of 20 moves the losses
    # by 6e-3 (ghost) to 1e-2 (renormalize).
    assert step_losses(offline) == pytest.approx(step_losses(colocated), rel=2e-6)
    assert offline["steps"][0]["kd_loss"] > 0.1


def test_preprocessed_text(pool, tmp_path):
    """Real text through Megatron's GPTDataset (shuffled sample index): the cache is keyed by
    the same dataset identity and sample indices; another tokenizer is refused."""
    pytest.importorskip("tokenizers")
    from support.text import TEXT, write_tokenizer

    from megatron_kd.data.preprocess import preprocess
    from megatron_kd.data.tokenizer import HFTokenizer

    (tmp_path / "text").mkdir()
    (tmp_path / "text" / "part.txt").write_text(TEXT * 24, encoding="utf-8")
    tok_file = write_tokenizer(tmp_path / "tokenizer.json")
    tok = HFTokenizer(tok_file)
    prefix = str(tmp_path / "data")
    preprocess([str(tmp_path / "text")], tok, prefix)
    data = ["--data-path", prefix, "--tokenizer-model", tok_file, "--split", "80,20,0",
            "--data-cache-path", str(tmp_path / "index"), "--eval-iters", "1"]
    teacher = str(tmp_path / "teacher")
    pool.run(case_make_teacher, teacher,
             dict(TEACHER_ARCH, vocab_size=tok.vocab_size, padded_vocab_size=512))
    cache = str(tmp_path / "cache")
    pool.run(case_cache_build, _cache_argv(cache, teacher, SMALL_K, data))

    argv = student_argv(mock_data=None) + [
        "--train-iters", str(TRAIN_ITERS), "--eval-interval", str(TRAIN_ITERS),
        "--kd-ce-weight", "0.2", "--tensor-model-parallel-size", "2", *data]
    colocated = pool.run(case_train_topk_teacher, argv + ["--kd-teacher-load", teacher],
                         SMALL_K)[0]
    offline = pool.run(case_train, argv + ["--kd-mode", "offline", "--kd-topk-cache", cache])[0]
    assert offline["student_arch"]["vocab_size"] == tok.vocab_size
    # As in test_topk_cache_equals_truncated_teacher (measured: 6e-8 relative).
    assert step_losses(offline) == pytest.approx(step_losses(colocated), rel=2e-6)
    assert offline["evals"][0]["eval_lm_loss"] > 0

    # The same text tokenized by another tokenizer: refused, naming both tokenizers.
    other_file = write_tokenizer(tmp_path / "other.json", vocab_size=280)
    other = HFTokenizer(other_file)
    preprocess([str(tmp_path / "text")], other, str(tmp_path / "other_data"))
    other_argv = argv + ["--kd-mode", "offline", "--kd-topk-cache", cache, "--data-path",
                         str(tmp_path / "other_data"), "--tokenizer-model", other_file]
    for msg, steps in pool.run(case_plan_error, other_argv):
        assert steps == 0
        assert (f"tokenizer: cache has {tokenizer_identity(tok)!r}, this run has "
                f"{tokenizer_identity(other)!r}") in msg, msg


# --- no teacher in memory; the cache is read on the last stage only ----------------------------

def test_offline_builds_no_teacher(pool, setup):
    _, caches = setup
    # Pipeline-parallel: rank 0 is the first stage, rank 1 the last. No --kd-teacher-load.
    argv = _offline(caches[SMALL_K], "--pipeline-model-parallel-size", "2",
                    "--exit-after-iters", "2")
    first, last = pool.run(case_train_watched, argv)
    for r in (first, last):
        assert r["checkpoint_loads"] == 0 and r["teacher_is_none"]
        assert r["summary"]["teacher_arch"] is None
        assert r["summary"]["teacher_in_memory"] is False
        assert r["summary"]["student_arch"]["vocab_size"] == VOCAB  # from the cache manifest
        assert r["summary"]["student_arch"]["padded_vocab_size"] == 512  # padded to 128
    assert (first["is_last"], first["reads_cache"]) == (False, False)
    assert (last["is_last"], last["reads_cache"]) == (True, True)
    assert step_losses(first["summary"]) == step_losses(last["summary"])
    assert len(step_losses(last["summary"])) == 2
    assert all(r["kd_loss"] > 0.1 for r in last["summary"]["steps"])


def test_resume_reads_the_cache_from_the_checkpointed_step(pool, setup, tmp_path):
    _, caches = setup
    argv = _offline(caches[SMALL_K], "--tensor-model-parallel-size", "2")
    straight = step_losses(pool.run(case_train, argv)[0])
    ckpt = str(tmp_path / "ckpt")
    first = pool.run(case_train, argv + ["--save", ckpt, "--exit-after-iters", "2"])[0]
    second = pool.run(case_train, argv + ["--load", ckpt, "--save", ckpt])[0]
    assert second["start_iteration"] == 2
    # The resumed run decodes from sample 2 x global batch on: bit-identical on CPU.
    assert step_losses(first) + step_losses(second) == straight


def test_prefetcher_checks_alignment(setup):
    from megatron_kd.cache.loader import TopKPrefetcher, topk_batch
    from megatron_kd.cache.reader import TopKCacheReader

    _, caches = setup
    reader = TopKCacheReader(caches[SMALL_K])
    prefetcher = TopKPrefetcher(reader, [[0, 1], [2, 3], [4, 5]], depth=2)
    try:
        ids, logprobs = prefetcher.next([0, 1])
        want_ids, want_logprobs = topk_batch(reader, [0, 1])
        assert ids.shape == (SEQ, 2, SMALL_K)  # [s, b, K]
        assert torch.equal(ids, want_ids) and torch.equal(logprobs, want_logprobs)
        with pytest.raises(RuntimeError, match=_literal("asked for samples [3, 2] but the next "
                                                        "decoded micro-batch holds samples "
                                                        "[2, 3]")):
            prefetcher.next([3, 2])
        prefetcher.next([4, 5])
        with pytest.raises(RuntimeError, match="after the end of its schedule"):
            prefetcher.next([6, 7])
    finally:
        prefetcher.close()


# --- a cache of another run: refused before any step, naming both values -----------------------

def _with_other_tokenizer(cache, out):
    """A copy of ``cache`` whose manifest names another tokenizer (as if built on real text)."""
    import json
    import shutil

    shutil.copytree(cache, out)
    path = f"{out}/manifest.json"
    with open(path) as f:
        manifest = json.load(f)
    manifest["tokenizer"] = json.dumps({"class": "HFTokenizer", "eod": 0, "sha256": "ab" * 32},
                                       sort_keys=True)
    with open(path, "w") as f:
        json.dump(manifest, f)
    return out, manifest["tokenizer"]


def test_mismatching_cache_is_refused(pool, setup, tmp_path):
    from megatron_kd.cache.identity import dataset_identity, tokenizer_identity
    from megatron_kd.data.datasets import MockGPTDataset
    from megatron_kd.data.tokenizer import MockTokenizer

    _, caches = setup
    cache = caches[SMALL_K]

    def mock_hash(seed):
        return dataset_identity(MockGPTDataset(vocab_size=VOCAB, seq_length=SEQ,
                                               num_samples=TRAIN_ITERS * GLOBAL_BATCH,
                                               seed=seed))

    cases = {
        "--seq-length 16": "seq_length: cache has 32, this run has 16",
        "--seed 7": (f"dataset_hash: cache has '{mock_hash(1234)}', this run has "
                     f"'{mock_hash(7)}'"),
        "--vocab-size 600": "vocab_size: cache has 500, this run has 600",
    }
    runs = [(cache, flags, expected) for flags, expected in cases.items()]
    other_tok, other_id = _with_other_tokenizer(cache, str(tmp_path / "other_tokenizer"))
    expected = (f"tokenizer: cache has {other_id!r}, this run has "
                f"{tokenizer_identity(MockTokenizer(VOCAB))!r}")
    runs.append((other_tok, "", expected))
    for directory, flags, expected in runs:
        for msg, steps in pool.run(case_plan_error, _offline(directory, *flags.split())):
            assert steps == 0, flags
            assert msg is not None and f"--kd-topk-cache {directory!r}" in msg, (flags, msg)
            assert expected in msg, (flags, msg)


# --- flags that cannot work offline: refused before anything is built --------------------------

@pytest.mark.parametrize("flags, message", [
    ("--kd-mode offline", "--kd-mode offline needs --kd-topk-cache DIR"),
    ("--kd-topk-cache {cache}", "--kd-topk-cache '{cache}' is only for --kd-mode offline"),
    ("--kd-mode offline --kd-topk-cache {cache} --kd-loss reverse_kl",
     "--kd-loss reverse_kl is not possible with --kd-mode offline"),
    ("--kd-mode offline --kd-topk-cache {cache} --kd-loss jsd",
     "--kd-loss jsd is not possible with --kd-mode offline"),
    ("--kd-mode offline --kd-topk-cache {cache} --kd-topk-tail ghost --kd-temperature 2",
     "--kd-topk-tail ghost needs --kd-temperature 1"),
    ("--kd-topk-tail ghost", "--kd-topk-tail ghost is only for --kd-mode offline"),
    ("--kd-mode offline --kd-topk-cache {cache} --kd-loss-elementwise compiled",
     "--kd-loss-elementwise compiled needs a dense teacher"),
    ("--kd-loss jsd --kd-loss-elementwise compiled",
     ("--kd-loss-elementwise='compiled' is for --kd-loss='forward_kl' only, got "
      "--kd-loss='jsd'")),
    ("--kd-mode offline --kd-topk-cache {cache} --kd-teacher-load {cache}",
     "--kd-teacher-load '{cache}' is not used with --kd-mode offline"),
    ("--kd-mode offline --kd-topk-cache {missing}",
     "--kd-topk-cache '{missing}' is not a directory"),
])
def test_offline_flags_are_checked(tmp_path, flags, message):
    from support.train_cases import check_flags

    names = {"cache": str(tmp_path), "missing": str(tmp_path / "missing")}
    argv = COMMON + flags.format(**names).split()
    with pytest.raises(ValueError, match=_literal(message.format(**names))):
        check_flags(argv, 2)


def test_not_a_cache_directory(tmp_path):
    from support.train_cases import check_flags

    with pytest.raises(ValueError, match="no manifest"):
        check_flags(_offline(str(tmp_path)), 2)


def _literal(text):
    import re

    return re.escape(text)


# --- what an offline run reports --------------------------------------------------------------

def test_cache_wait_and_read_rate_in_tensorboard(pool, setup, tmp_path):
    """The step's wait for decoded top-K targets and the decoder's rate, in the JSON log and
    (equal) in TensorBoard."""
    pytest.importorskip("tensorboard")
    from support.scalars import records, tensorboard_scalars

    _, caches = setup
    log, tb = tmp_path / "run.jsonl", tmp_path / "tb"
    pool.run(case_train, _offline(caches[SMALL_K], "--log-json", str(log), "--tensorboard-dir",
                                  str(tb)))
    steps = [r for r in records(log) if "step_time_s" in r]
    assert len(steps) == TRAIN_ITERS
    scalars = tensorboard_scalars(tb)
    for r in steps:
        assert r["kd_cache_wait_s"] >= 0 and r["kd_cache_read_tokens_per_s"] > 0
        assert scalars["kd/cache-wait-s"][r["step"]] == pytest.approx(r["kd_cache_wait_s"],
                                                                      rel=1e-5, abs=1e-7)
        assert scalars["kd/cache-read-tokens-per-s"][r["step"]] == pytest.approx(
            r["kd_cache_read_tokens_per_s"], rel=1e-6)
