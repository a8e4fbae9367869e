"""Evaluation's student-teacher KL and top-1 agreement (``eval_kd_kl``,
``eval_top1_agreement``) in a colocated ``megatron-kd train`` run on 2 gloo ranks.

* at TP 2 (sequence-parallel), PP 2 and CP 2, the JSON log's values equal an independent
  reference: the saved student's and the
  teacher's full logits on the run's validation samples (a plain model forward at TP 1,
  ``log_softmax`` and ``torch.argmax``);
* a student started from the teacher's own checkpoint, not updated (learning rate 0), scores
  KL 0 and agreement 1 at every evaluation;
* the summary's evaluation records carry them too, the same on every rank;
* a disaggregated run's evaluation has no teacher: both are None there (offline's are checked
  in test_offline_train).
"""

import json

import pytest
from support.kd_reference import reference_agreement_of_logits
from support.train_cases import STUDENT, case_checkpoint_logits, case_train, student_argv

from megatron_kd.data.datasets import MockGPTDataset, collate

SEQ, GBS, EVAL_ITERS, SEED = 32, 4, 2, 5


def _evals(log):
    with open(log, encoding="utf-8") as f:
        return [r for r in map(json.loads, f) if r.get("eval")]


# the vocabulary over TP ranks (with sequence parallelism: the hidden states gathered), the
# tokens over pipeline's last stage, data-parallel or context-parallel ranks
@pytest.mark.parametrize("layout", [
    "--tensor-model-parallel-size 2 --sequence-parallel", "--pipeline-model-parallel-size 2",
    "--context-parallel-size 2"])
def test_colocated_eval_equals_the_reference_of_its_checkpoints(pool, teacher, tmp_path,
                                                                layout):
    log, run = tmp_path / "log.jsonl", str(tmp_path / "run")
    argv = STUDENT + ["--train-iters", "3", "--eval-interval", "3", "--eval-iters",
                      str(EVAL_ITERS), "--seed", str(SEED), "--kd-teacher-load", teacher,
                      "--kd-loss", "jsd", "--kd-temperature", "2", "--kd-ce-weight", "0.2",
                      "--save", run, "--log-json", str(log), *layout.split()]
    s0, s1 = pool.run(case_train, argv)
    [ev] = _evals(log)
    assert s0["evals"] == s1["evals"] == [ev]  # every rank reports the same reduced values
    # the run's validation samples: --mock-data's held-out set (seed + 1), from index 0
    held_out = MockGPTDataset(vocab_size=500, seq_length=SEQ, num_samples=EVAL_ITERS * GBS,
                              seed=SEED + 1)
    batch = collate([held_out[i] for i in range(EVAL_ITERS * GBS)])
    student = pool.run(case_checkpoint_logits, run, batch["tokens"])[0].double()
    teacher_logits = pool.run(case_checkpoint_logits, teacher, batch["tokens"])[0].double()
    kl, top1, tokens = reference_agreement_of_logits(student, teacher_logits,
                                                     batch["loss_mask"])
    # fp32 models and loss against the fp64 softmax of the reference's fp32 logits: rounding
    # of ~1e-6 relative; the KL here is O(1) (a 3-step student of a peaked random teacher)
    assert ev["eval_kd_kl"] == pytest.approx(float(kl / tokens), rel=1e-4)
    assert ev["eval_top1_agreement"] == float(top1 / tokens)
    assert 0.5 < ev["eval_kd_kl"] and 0.0 < ev["eval_top1_agreement"] < 1.0


def test_the_teacher_as_its_own_student_scores_kl_0_and_agreement_1(pool, teacher, tmp_path):
    log = tmp_path / "log.jsonl"
    arch = {name: None for name in ("num_layers", "hidden_size", "num_attention_heads",
                                    "num_query_groups", "ffn_hidden_size")}
    argv = student_argv(lr=0.0, **arch) + [
        "--pretrained-checkpoint", teacher, "--kd-teacher-load", teacher, "--train-iters", "2",
        "--eval-interval", "1", "--eval-iters", "1", "--log-json", str(log)]
    pool.run(case_train, argv)
    evals = _evals(log)
    assert [e["step"] for e in evals] == [1, 2]
    for e in evals:
        assert abs(e["eval_kd_kl"]) < 1e-6  # the same fp32 logits on both sides
        assert e["eval_top1_agreement"] == 1.0
        assert e["eval_kd_loss"] == pytest.approx(e["eval_kd_kl"], abs=1e-6)


def test_disaggregated_eval_reports_no_student_teacher_metrics(pool, teacher, replicas,
                                                               tmp_path):
    """The replicas stream training microbatches only: evaluation has no teacher, so the KD
    metrics are None (absent, not 0) beside the student's CE (docs/training.md)."""
    replica = replicas(teacher)
    argv = STUDENT + ["--train-iters", "2", "--eval-interval", "2", "--eval-iters", "1",
                      "--kd-teacher-load", teacher, "--kd-mode", "disaggregated",
                      "--kd-teacher-endpoint", str(replica.endpoint)]
    [ev] = pool.run(case_train, argv)[0]["evals"]
    assert ev["eval_lm_loss"] > 0 and ev["eval_loss"] == pytest.approx(ev["eval_lm_loss"])
    for key in ("eval_kd_loss", "eval_teacher_lm_loss", "eval_kd_kl", "eval_top1_agreement"):
        assert ev[key] is None, key
