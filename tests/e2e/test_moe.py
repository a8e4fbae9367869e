"""Mixture-of-experts teachers and students in every mode, on gloo.

The teacher is a tiny random Qwen3-MoE from transformers (4 experts, top 2, QK norms), imported
with ``megatron-kd import-hf``; the student is Qwen3-shaped (``--qk-layernorm``, a head width
that is not hidden / heads), dense or with experts of its own. Per-step losses:

* colocated, teacher experts over 2 expert-parallel ranks: equal to the dense reference loss at
  EP 1 (so expert parallelism changes nothing but the summation order);
* a mixture-of-experts student at EP 2 (with Megatron-Core's load-balancing loss) learns and
  resumes from its checkpoint exactly (a resume at another EP size is refused by name);
* offline, a K = V cache built by the MoE teacher at TP 2 with its experts over the TP ranks
  (EP 2, expert TP 1): equal to colocated;
* disaggregated, a replica of TP 2 / EP 2 / expert TP 1: equal to colocated;
* a gpt-oss teacher colocated at student TP 2 (fused = dense), offline and disaggregated at
  TP 2 / EP 2 (equal to colocated);
* a Qwen3.5-MoE teacher (Gated DeltaNet hybrid) colocated at student TP 2: fused = dense;
* the same teacher distils into a Qwen3.5-dense-shaped student (Gated DeltaNet and gated
  attention layers from Megatron-LM's flags) in all three modes: colocated with the teacher's
  experts over 2 EP ranks equal to the dense reference; offline (a K = V cache built by the
  teacher at TP 2 / EP 2) and disaggregated (a replica of TP 2 / EP 2) equal to colocated.
"""

import pytest
from support.hf_models import tiny_gpt_oss, tiny_qwen3_moe, tiny_qwen35_moe
from support.train_cases import (
    STUDENT,
    cache_build_argv,
    case_cache_build,
    case_import,
    case_train,
    step_losses,
)

pytestmark = pytest.mark.filterwarnings("ignore")
pytest.importorskip("transformers")

VOCAB, SEQ, ITERS, GBS = 500, 32, 4, 4
BASE = STUDENT + ["--train-iters", str(ITERS), "--eval-interval", "100", "--eval-iters", "0",
                  "--kd-ce-weight", "0.2", "--qk-layernorm", "--kv-channels", "16"]
MOE_STUDENT = ["--num-experts", "4", "--moe-ffn-hidden-size", "16", "--moe-router-topk", "2",
               "--moe-aux-loss-coeff", "0.01"]
TEACHER_EXPERTS_IN_TP = ["--tensor-model-parallel-size", "2", "--expert-model-parallel-size", "2",
                         "--expert-tensor-parallel-size", "1"]
# Qwen3.5-dense-shaped: layer 0 Gated DeltaNet, layer 1 gated attention with partial RoPE
QWEN35_STUDENT = ["--experimental-attention-variant", "gated_delta_net",
                  "--linear-attention-freq", "2", "--linear-num-key-heads", "2",
                  "--linear-num-value-heads", "4", "--linear-key-head-dim", "8",
                  "--linear-value-head-dim", "8", "--attention-output-gate",
                  "--rotary-percent", "0.25"]


def _cache_argv(out, teacher_dir):
    """A K = V fp32 cache built by the teacher at TP 2, its experts over the TP ranks."""
    return cache_build_argv(out, teacher_dir, topk=VOCAB, seq=SEQ, iters=ITERS, global_batch=GBS,
                            tp=2, extra=TEACHER_EXPERTS_IN_TP[2:])


def _import(pool, tmp, make):
    hf_path, _, _ = make(tmp, vocab=VOCAB)
    save_dir = str(tmp / "megatron")
    return save_dir, pool.run(case_import, hf_path, save_dir)[0]


@pytest.fixture(scope="module")
def moe_teacher(pool, tmp_path_factory):
    save_dir, arch = _import(pool, tmp_path_factory.mktemp("moe"), tiny_qwen3_moe)
    assert (arch["num_experts"], arch["moe_router_topk"], arch["qk_layernorm"]) == (4, 2, True)
    return save_dir


@pytest.fixture(scope="module")
def qwen35_teacher(pool, tmp_path_factory):
    """A tiny Qwen3.5-MoE: three Gated DeltaNet layers, then gated attention; 4 experts and a
    gated shared expert."""
    save_dir, arch = _import(pool, tmp_path_factory.mktemp("qwen35_moe"), tiny_qwen35_moe)
    assert arch["linear_attention_layers"] == [0, 1, 2] and arch["moe_shared_expert_gate"]
    return save_dir


@pytest.fixture(scope="module")
def colocated(pool, moe_teacher):
    """The reference: colocated, experts at EP 1, the dense (unfused) KD loss."""
    return step_losses(pool.run(case_train, BASE + ["--kd-teacher-load", moe_teacher], True)[0])


def test_colocated_teacher_experts_over_two_ranks(pool, moe_teacher, colocated):
    run = pool.run(case_train, BASE + ["--kd-teacher-load", moe_teacher,
                                       "--expert-model-parallel-size", "2"])
    assert step_losses(run[0]) == step_losses(run[1])
    # fp32; the fused loss against the dense one and the experts' all-to-all: summation order
    # only. A wrong expert on a rank moves the step-1 KD term by > 1e-2.
    assert step_losses(run[0]) == pytest.approx(colocated, rel=5e-6)
    assert all(r["kd_loss"] > 0.1 for r in run[0]["steps"])


def test_moe_student_at_ep2_trains_and_resumes(pool, moe_teacher, tmp_path):
    argv = BASE + MOE_STUDENT + ["--kd-teacher-load", moe_teacher, "--expert-model-parallel-size",
                                 "2"]
    straight = pool.run(case_train, argv)
    assert step_losses(straight[0]) == step_losses(straight[1])
    losses = step_losses(straight[0])
    assert losses[-1] < losses[0]
    ckpt = str(tmp_path / "ckpt")
    pool.run(case_train, argv + ["--save", ckpt, "--exit-after-iters", "2"])
    resumed = pool.run(case_train, argv + ["--load", ckpt])[0]
    assert resumed["start_iteration"] == 2
    # the experts, their Adam moments and the router come back exactly
    assert step_losses(resumed) == losses[2:]
    # Megatron seeds each expert-parallel rank's experts apart, and its optimizer state does
    # not move between EP 2 and EP 1: refused by name, not a KeyError deep in the loader.
    with pytest.raises(Exception, match="was saved at --expert-model-parallel-size 2"):
        pool.run(case_train, argv[:-2] + ["--load", ckpt])


def test_offline_cache_built_by_the_moe_teacher(pool, moe_teacher, colocated, tmp_path):
    cache = str(tmp_path / "cache")
    pool.run(case_cache_build, _cache_argv(cache, moe_teacher))
    offline = pool.run(case_train, BASE + ["--kd-mode", "offline", "--kd-topk-cache", cache])
    # K = V, fp32 log-probs, renormalising tail: the cached teacher is the dense one.
    assert step_losses(offline[0]) == pytest.approx(colocated, rel=5e-6)


def test_disaggregated_teacher_with_experts_over_its_tp_ranks(pool, moe_teacher, colocated,
                                                              replicas, tmp_path):
    replicas(moe_teacher, tp=2, extra=tuple(TEACHER_EXPERTS_IN_TP[2:]))
    dis = pool.run(case_train, BASE + ["--kd-mode", "disaggregated", "--kd-teacher-endpoint",
                                       str(tmp_path / "endpoint"),
                                       "--kd-teacher-load", moe_teacher])
    assert step_losses(dis[0]) == step_losses(dis[1])
    assert step_losses(dis[0]) == pytest.approx(colocated, rel=1e-5)


def _fused_equals_dense_at_student_tp2(pool, teacher_dir):
    """Colocated at student TP 2, the teacher's experts folded over the TP ranks (expert TP
    1): the fused loss equals the dense reference. Returns the run's flags and losses."""
    argv = BASE + ["--kd-teacher-load", teacher_dir, "--tensor-model-parallel-size", "2",
                   "--expert-tensor-parallel-size", "1"]
    fused = step_losses(pool.run(case_train, argv)[0])
    dense = step_losses(pool.run(case_train, argv, True)[0])
    assert fused == pytest.approx(dense, rel=5e-6)
    assert all(r > 0.1 for r in fused)
    return argv, fused


def test_gpt_oss_teacher_in_every_mode(pool, replicas, tmp_path):
    # sinks, sliding windows, YaRN and biased experts inside the trainer (device context,
    # Megatron's TP mappings), the experts folded over the TP ranks (expert TP 1); then a cache
    # built and a replica serving at TP 2 x EP 2
    save_dir, arch = _import(pool, tmp_path, tiny_gpt_oss)
    assert arch["attention_sinks"] and arch["window_size"] == 4  # window < SEQ: it matters
    argv, colocated = _fused_equals_dense_at_student_tp2(pool, save_dir)
    with pytest.raises(Exception, match="need --expert-tensor-parallel-size 1"):
        pool.run(case_train, argv[:-2])
    cache = str(tmp_path / "cache")
    pool.run(case_cache_build, _cache_argv(cache, save_dir))
    offline = pool.run(case_train, BASE + ["--kd-mode", "offline", "--kd-topk-cache", cache,
                                           "--tensor-model-parallel-size", "2"])
    assert step_losses(offline[0]) == pytest.approx(colocated, rel=5e-6)
    replicas(save_dir, tp=2, extra=tuple(TEACHER_EXPERTS_IN_TP[2:]))
    dis = pool.run(case_train, argv + ["--kd-mode", "disaggregated", "--kd-teacher-endpoint",
                                       str(tmp_path / "endpoint")])
    assert step_losses(dis[0]) == pytest.approx(colocated, rel=1e-5)


def test_qwen35_moe_teacher_colocated_at_student_tp2(pool, qwen35_teacher):
    # Gated DeltaNet layers (their fused in_proj split per TP rank), gated attention with
    # partial RoPE and a gated shared expert inside the trainer (device context, TP mappings)
    _fused_equals_dense_at_student_tp2(pool, qwen35_teacher)


def test_qwen35_moe_teacher_into_a_qwen35_dense_student_in_every_mode(pool, qwen35_teacher,
                                                                      replicas, tmp_path):
    argv = BASE + QWEN35_STUDENT + ["--kd-teacher-load", qwen35_teacher]
    dense = step_losses(pool.run(case_train, argv, True)[0])  # teacher EP 1, dense KD loss
    assert all(r > 0.1 for r in dense)
    colocated = pool.run(case_train, argv + ["--expert-model-parallel-size", "2"])
    assert step_losses(colocated[0]) == step_losses(colocated[1])
    assert step_losses(colocated[0]) == pytest.approx(dense, rel=5e-6)
    cache = str(tmp_path / "cache")
    pool.run(case_cache_build, _cache_argv(cache, qwen35_teacher))
    offline = pool.run(case_train, BASE + QWEN35_STUDENT + ["--kd-mode", "offline",
                                                            "--kd-topk-cache", cache])
    assert step_losses(offline[0]) == pytest.approx(dense, rel=5e-6)
    replicas(qwen35_teacher, tp=2, extra=tuple(TEACHER_EXPERTS_IN_TP[2:]))
    dis = pool.run(case_train, argv + ["--kd-mode", "disaggregated", "--kd-teacher-endpoint",
                                       str(tmp_path / "endpoint")])
    assert step_losses(dis[0]) == step_losses(dis[1])
    assert step_losses(dis[0]) == pytest.approx(step_losses(colocated[0]), rel=1e-5)


def _plan(flags):
    from support.train_cases import check_flags

    return check_flags(STUDENT + ["--train-iters", "1", "--vocab-size", "500",
                                  "--kd-weight", "0", "--kd-ce-weight", "1"] + flags,
                       world_size=2)


@pytest.mark.parametrize("freq, num_layers, linear", [
    ("2", 2, [0]), ("4", 8, [0, 1, 2, 4, 5, 6]), ("([1]*3+[0])*2", 8, [0, 1, 2, 4, 5, 6]),
    ("[0,1]", 2, [1]),
])
def test_qwen35_student_flags_give_the_architecture(freq, num_layers, linear):
    flags = QWEN35_STUDENT + ["--linear-attention-freq", freq, "--num-layers", str(num_layers)]
    arch = _plan(flags).student_arch
    assert arch.linear_attention_layers == linear  # Megatron-LM's 1 = linear attention
    assert (arch.linear_num_key_heads, arch.linear_num_value_heads, arch.linear_key_head_dim,
            arch.linear_value_head_dim, arch.linear_conv_kernel_dim) == (2, 4, 8, 8, 4)
    assert arch.attention_output_gate and arch.rotary_percent == 0.25
    default = _plan(QWEN35_STUDENT[:4]).student_arch  # Megatron-Core's default widths
    assert (default.linear_num_key_heads, default.linear_num_value_heads,
            default.linear_key_head_dim) == (16, 32, 128)


@pytest.mark.parametrize("flags, message", [
    (MOE_STUDENT + ["--tensor-model-parallel-size", "2"], "2 needs --sequence-parallel"),
    (["--expert-model-parallel-size", "2"], "neither the student nor a colocated teacher"),
    (MOE_STUDENT[:2] + ["--expert-model-parallel-size", "3"], "does not divide"),
    (["--num-experts", "4", "--moe-router-topk", "5"], "exceeds num_experts"),
    (MOE_STUDENT + ["--add-bias-linear"], "fails in backward"),
    (QWEN35_STUDENT + ["--tensor-model-parallel-size", "2"],
     "only a sequence-parallel norm has its gradient summed"),
    (QWEN35_STUDENT[:2], "needs --linear-attention-freq"),
    (QWEN35_STUDENT[2:4], "without --experimental-attention-variant"),
    (QWEN35_STUDENT[:4] + ["--linear-num-key-heads", "3"], "must be a multiple of"),
    (QWEN35_STUDENT[:2] + ["--linear-attention-freq", "[1,1,0]"], "gives 3 layers"),
    (["--moe-shared-expert-intermediate-size", "8"], "needs --num-experts"),
])
def test_moe_layouts_refused_before_any_step(flags, message):
    with pytest.raises(ValueError, match=message):
        _plan(flags)
