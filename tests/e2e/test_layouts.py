"""Pretraining-scale layouts through ``megatron-kd train``: sequence parallelism, interleaved
pipelines and activation recompute give the losses of the same run at TP 1 / PP 1.

The students are tiny models of transformers' own classes (Qwen3, Qwen3-MoE, Qwen3.5), imported
with ``megatron-kd import-hf`` and started from there (``--pretrained-checkpoint``, with no
architecture flags: the architecture is the checkpoint's), so every layout starts from the same
weights. The teacher is the tier's tiny teacher. 6 steps, fp32, no dropout; each layout's
per-step losses equal the TP 1 / PP 1 run's within 2e-5 relative (sums of the same products in
another order: fp32 rounding, ~1e-7 a step, compounding over the optimizer's steps). Two
teachers (a weighted mixture, both colocated) hold to the same rule in each layout.
"""

import pytest
from support.hf_models import tiny_qwen3, tiny_qwen3_moe, tiny_qwen35
from support.train_cases import (
    TEACHER_ARCH,
    cache_build_argv,
    case_cache_build,
    case_make_teacher,
    case_train,
    check_flags,
    import_hf_model,
    step_losses,
)

pytestmark = pytest.mark.filterwarnings("ignore")
pytest.importorskip("transformers")

VOCAB, SEQ, ITERS, GBS = 500, 32, 6, 4
REL = 2e-5  # fp32 sums in another order, over 6 optimizer steps (see the module docstring)
RUN = ["--seq-length", str(SEQ), "--micro-batch-size", "1", "--global-batch-size", str(GBS),
       "--train-iters", str(ITERS), "--mock-data", "--no-progress", "--lr", "1e-2",
       "--lr-warmup-iters", "1", "--eval-iters", "0", "--kd-ce-weight", "0.2"]
TP2_SP = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
PP2_VP2 = ["--pipeline-model-parallel-size", "2", "--virtual-pipeline-model-parallel-size", "2"]


def _import(pool, tmp, make, **kw):
    return import_hf_model(pool, tmp, make, VOCAB, **kw)


@pytest.fixture(scope="module")
def dense(pool, tmp_path_factory):
    """A 4-layer Qwen3 (QK norms: their gradients are TP-summed too)."""
    return _import(pool, tmp_path_factory.mktemp("qwen3"), tiny_qwen3, layers=4)


@pytest.fixture(scope="module")
def moe(pool, tmp_path_factory):
    """A 2-layer Qwen3-MoE: 4 experts, top 2."""
    return _import(pool, tmp_path_factory.mktemp("qwen3_moe"), tiny_qwen3_moe)


@pytest.fixture(scope="module")
def hybrid(pool, tmp_path_factory):
    """A Qwen3.5-shaped student: DeltaNet, attention, DeltaNet, attention."""
    return _import(pool, tmp_path_factory.mktemp("qwen35"), tiny_qwen35)


@pytest.fixture(scope="module")
def argv(teacher, dense):
    def make(student=None, *flags, teacher_load=True):
        extra = ["--kd-teacher-load", teacher] if teacher_load else []
        return RUN + ["--pretrained-checkpoint", student or dense, *extra, *flags]
    return make


@pytest.fixture(scope="module")
def reference(pool, argv):
    """The dense student at TP 1 / PP 1 (data-parallel over the pool's 2 ranks)."""
    return step_losses(pool.run(case_train, argv())[0])


def _losses(pool, argv):
    return step_losses(pool.run(case_train, argv)[0])


def test_dense_student_at_tp2_with_sequence_parallelism(pool, argv, reference):
    assert _losses(pool, argv(None, *TP2_SP)) == pytest.approx(reference, rel=REL)
    recomputed = argv(None, *TP2_SP, "--recompute-granularity", "full", "--recompute-method",
                      "uniform", "--recompute-num-layers", "1")
    assert _losses(pool, recomputed) == pytest.approx(reference, rel=REL)


def test_virtual_stages_colocated(pool, argv, reference):
    vp = argv(None, *PP2_VP2, "--recompute-granularity", "full", "--recompute-method", "block",
              "--recompute-num-layers", "1")
    assert _losses(pool, vp) == pytest.approx(reference, rel=REL)


def test_virtual_stages_offline(pool, argv, teacher, tmp_path):
    cache = str(tmp_path / "cache")
    pool.run(case_cache_build, cache_build_argv(cache, teacher, topk=VOCAB, seq=SEQ,
                                                iters=ITERS, global_batch=GBS))
    offline = ["--kd-mode", "offline", "--kd-topk-cache", cache]
    flat = _losses(pool, argv(None, *offline, teacher_load=False))
    assert _losses(pool, argv(None, *offline, *PP2_VP2, teacher_load=False)) == \
        pytest.approx(flat, rel=REL)


def test_virtual_stages_disaggregated(pool, argv, reference, teacher, replicas):
    replica = replicas(teacher)
    remote = argv(None, *PP2_VP2, "--kd-mode", "disaggregated", "--kd-teacher-endpoint",
                  str(replica.endpoint), "--kd-wire-dtype", "fp32")
    assert _losses(pool, remote) == pytest.approx(reference, rel=REL)


def test_replica_and_cache_built_at_tp2_with_sequence_parallelism(pool, argv, reference,
                                                                   teacher, replicas, tmp_path):
    """A replica at TP 2 + SP serves a student at TP 2 + SP (each student TP rank takes its own
    chunk of the sequence, no all-gather) the colocated TP 1 losses; a cache built at TP 2 + SP
    holds what one built at TP 1 holds."""
    replica = replicas(teacher, tp=2, extra=("--sequence-parallel",))
    remote = argv(None, *TP2_SP, "--kd-mode", "disaggregated", "--kd-teacher-endpoint",
                  str(replica.endpoint), "--kd-wire-dtype", "fp32")
    assert _losses(pool, remote) == pytest.approx(reference, rel=REL)
    from megatron_kd.cache.reader import TopKCacheReader

    caches = {}
    for name, extra in (("tp1", {}), ("tp2-sp", {"tp": 2, "extra": ("--sequence-parallel",)})):
        caches[name] = str(tmp_path / name)
        pool.run(case_cache_build, cache_build_argv(caches[name], teacher, topk=16, seq=SEQ,
                                                    iters=ITERS, global_batch=GBS, **extra))
    ids1, lp1 = TopKCacheReader(caches["tp1"]).get(range(ITERS * GBS))
    ids2, lp2 = TopKCacheReader(caches["tp2-sp"]).get(range(ITERS * GBS))
    assert (ids1 == ids2).all()
    # fp32 log-probs of the same hidden states, the vocabulary sums split another way
    assert abs(lp1 - lp2).max() < 1e-5


@pytest.mark.parametrize("experts", [["--expert-model-parallel-size", "2",
                                      "--expert-tensor-parallel-size", "1"],
                                     ["--expert-tensor-parallel-size", "2"]],
                         ids=["ep2-etp1", "etp2"])
def test_moe_student_at_tp2_with_sequence_parallelism(pool, argv, moe, experts):
    flat = _losses(pool, argv(moe))
    assert _losses(pool, argv(moe, *TP2_SP, *experts)) == pytest.approx(flat, rel=REL)


def test_deltanet_hybrid_at_tp2_with_sequence_parallelism_and_at_pp2(pool, argv, hybrid):
    """The Qwen3.5-shaped student: its DeltaNet output norm's gradient summed over the TP
    ranks (tests/dist/test_sequence_parallel.py checks it directly), its layer pattern split
    over pipeline stages. Learning rate 1e-3: at 1e-2 the DeltaNet's decays amplify fp32
    rounding to 2.4e-5 at step 5 (the norm gradients themselves agree to 1e-5)."""
    slow = ["--lr", "1e-3"]
    flat = _losses(pool, argv(hybrid, *slow))
    assert _losses(pool, argv(hybrid, *TP2_SP, *slow)) == pytest.approx(flat, rel=REL)
    assert _losses(pool, argv(hybrid, "--pipeline-model-parallel-size", "2", *slow)) == \
        pytest.approx(flat, rel=REL)


@pytest.mark.parametrize("layout", [TP2_SP, PP2_VP2], ids=["tp2-sp", "pp2-vp2"])
def test_resume_gives_the_uninterrupted_losses(pool, argv, tmp_path, layout):
    straight = _losses(pool, argv(None, *layout))
    ckpt = str(tmp_path / "ckpt")
    flags = argv(None, *layout, "--save", ckpt, "--load", ckpt)
    first = _losses(pool, flags + ["--exit-after-iters", "3"])
    second = pool.run(case_train, flags)[0]
    assert second["start_iteration"] == 3
    assert first + step_losses(second) == straight  # bit for bit


def test_finetune_starts_from_the_load_checkpoint_weights(pool, argv, teacher, reference,
                                                         tmp_path):
    """``--load DIR --finetune``: the weights of DIR's newest checkpoint, from iteration 0 with
    a new optimizer, which is what ``--pretrained-checkpoint DIR`` gives (a plain ``--load``
    resumes instead: test_resume_gives_the_uninterrupted_losses)."""
    ckpt = str(tmp_path / "ckpt")
    pool.run(case_train, argv(None, *TP2_SP, "--save", ckpt, "--exit-after-iters", "3"))
    run = RUN + ["--kd-teacher-load", teacher, *TP2_SP]
    finetuned = pool.run(case_train, run + ["--load", ckpt, "--finetune"])[0]
    assert finetuned["start_iteration"] == 0
    assert len(step_losses(finetuned)) == ITERS
    restarted = pool.run(case_train, run + ["--pretrained-checkpoint", ckpt])[0]
    assert step_losses(finetuned) == step_losses(restarted)  # bit for bit
    # the trained weights, not the import's: already lower than the first run's first loss
    assert step_losses(finetuned)[0] < reference[0] * (1 - 1e-3)


def test_finetune_needs_one_weights_source(argv, teacher, tmp_path):
    run = RUN + ["--kd-teacher-load", teacher]
    with pytest.raises(ValueError, match="--finetune needs --load DIR"):
        check_flags(run + ["--finetune"], 2)
    with pytest.raises(ValueError, match="--pretrained-checkpoint .* names another source"):
        check_flags(argv(None, "--load", str(tmp_path), "--finetune"), 2)
    with pytest.raises(ValueError, match="--load \\(with --finetune\\): .*"):
        check_flags(run + ["--load", str(tmp_path), "--finetune"], 2)


# --- refused before any step, naming the flags ------------------------------------------------

@pytest.mark.parametrize("flags, message", [
    (["--seq-length", "33", *TP2_SP], "--seq-length 33 is not divisible by "
                                      "--tensor-model-parallel-size 2"),
    (["--virtual-pipeline-model-parallel-size", "2"], "need --pipeline-model-parallel-size > 1"),
    (["--pipeline-model-parallel-size", "2", "--virtual-pipeline-model-parallel-size", "2",
      "--global-batch-size", "3"], "3 microbatches a step .* is not a multiple of it"),
    (["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1",
      "--virtual-pipeline-model-parallel-size", "2"], "not both"),
    (["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "3"],
     "--num-layers-per-virtual-pipeline-stage 3 x --pipeline-model-parallel-size 2 does not "
     "divide --num-layers 4"),
    (["--recompute-method", "uniform"], "need --recompute-granularity full"),
    (["--recompute-granularity", "full"], "needs --recompute-method"),
    (["--recompute-granularity", "full", "--recompute-method", "block",
      "--recompute-num-layers", "5"], "between 1 and the layers of a model chunk \\(4\\)"),
    (["--recompute-granularity", "selective", "--recompute-num-layers", "1"],
     "do not apply"),
    (["--num-layers", "2"], "--num-layers 2 \\(the checkpoint has 4\\)"),
    (["--vocab-size", "400"], "--vocab-size 400 != the teacher's vocabulary 500"),
])
def test_layouts_refused_before_any_step(argv, flags, message):
    with pytest.raises(ValueError, match=message):
        check_flags(argv(None) + flags, 2)


@pytest.mark.parametrize("student", ["moe", "hybrid"])
def test_moe_and_deltanet_students_need_sequence_parallelism_at_tp2(request, argv, student):
    with pytest.raises(ValueError, match="--tensor-model-parallel-size 2 needs "
                                         "--sequence-parallel"):
        check_flags(argv(request.getfixturevalue(student), "--tensor-model-parallel-size", "2"),
                    2)


@pytest.fixture(scope="module")
def two_teachers(pool, teacher, tmp_path_factory):
    """The flags of a mixture of the tier's teacher and one of other weights (1 : 3)."""
    other = str(tmp_path_factory.mktemp("other_teacher") / "ckpt")
    pool.run(case_make_teacher, other, TEACHER_ARCH, 11)
    return ["--kd-mode", "colocated", "colocated", "--kd-teacher-load", teacher, other,
            "--kd-teacher-weights", "1", "3"]


@pytest.mark.parametrize("student, layouts", [
    ("dense", [TP2_SP, PP2_VP2, ["--context-parallel-size", "2"]]),
    ("moe", [[*TP2_SP, "--expert-model-parallel-size", "2", "--expert-tensor-parallel-size",
              "1"]]),
    ("hybrid", [TP2_SP]),
])
def test_two_teachers_in_each_layout(request, pool, argv, two_teachers, student, layouts):
    model = request.getfixturevalue(student)
    slow = ["--lr", "1e-3"] if student == "hybrid" else []  # see the DeltaNet test above
    flat = _losses(pool, argv(model, *two_teachers, *slow, teacher_load=False))
    for layout in layouts:
        assert _losses(pool, argv(model, *two_teachers, *slow, *layout, teacher_load=False)) \
            == pytest.approx(flat, rel=REL), layout
