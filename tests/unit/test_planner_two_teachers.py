"""``megatron-kd plan`` with two teachers (a mixture, one ``--kd-mode`` each) against a
hand-derived account.

Every expected byte count is worked out below from the presets' published configs (the
models' Hugging Face ``config.json``), never read from the planner: Llama-3.2-3B student
(L=28, h=3072, a=24, g=8, d=128, f=8192, V=128,256, tied), Llama-3.1-8B (L=32, h=4096, a=32,
g=8, d=128, f=14,336, untied) and Llama-3.1-70B (L=80, h=8192, a=64, g=8, d=128, f=28,672,
untied). The run: one node of 8 H100s, s=4096, b=1, G=8 (dp=8: one micro-batch a step), TP 1,
no pipeline, no context parallelism, no recompute, the distributed optimizer, bf16.
"""

import json
import math
import shlex

import pytest

from megatron_kd.cli import main

GIB = 1 << 30
S = 4096  # tokens of a micro-batch (b = 1): the loss's rows n
V = 128256
RESERVE = 4 * GIB

RUN = ("--student llama-3.2-3b --gpu h100-80g --nodes 1 --seq-length 4096 "
       "--global-batch-size 8 --tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 "
       "--context-parallel-size 1 --recompute-granularity none --use-distributed-optimizer")


def _plan(capsys, flags: str) -> dict:
    assert main(["plan", *shlex.split(RUN), *shlex.split(flags), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


# --- the hand account ------------------------------------------------------------------------

# Llama-3.2-3B parameters: a layer's q 3072*3072 + k, v 3072*1024 each + o 3072*3072
# = 25,165,824; SwiGLU 3 * 3072 * 8192 = 75,497,472; two norms 6,144: 100,669,440; 28 layers
# 2,818,744,320; the tied embedding 128,256 * 3072 = 394,002,432; the final norm 3,072.
STUDENT_PARAMS = 2_818_744_320 + 394_002_432 + 3_072  # 3,212,749,824
# Activations a token, a layer (flash attention, no dropout, TP 1): attention's norm and QKV
# inputs 2h + 2h, Q 2ad, K and V 2gd each, the core output 2ad, the fp32 log-sum-exp 4a; the
# MLP's norm and first-linear inputs 2h + 2h and SwiGLU 6f:
#   12,288 + 6,144 + 4,096 + 6,144 + 96 + 12,288 + 49,152 = 90,208 bytes; 28 layers, one
# micro-batch in flight, and the final norm's input 2h = 6,144.
STUDENT = {
    "student weights": 2 * STUDENT_PARAMS,  # 6,425,499,648
    "student grads (main_grad)": 4 * STUDENT_PARAMS,  # fp32 main_grad
    "optimizer (Adam)": 12 * STUDENT_PARAMS // 8,  # over dp = 8: 4,819,124,736
    "activations": S * (28 * 90_208 + 6_144),  # 10,370,940,928
}
# The fused loss's GPU path, one call: 1 GiB of bf16 logits. A dense teacher's call holds both
# models' [w, V] logits: at most 2^30 // (2 * 128,256 * 2) = 2,093 rows, so 4,096 rows take two
# windows of 2,048 (16 whole tiles of 128); a top-K teacher's call the student's alone: 4,186 rows
# at most, one window of 4,096. Either way 1,050,673,152 bytes.
WINDOW_DENSE = 2048 * V * 2 * 2
WINDOW_TOPK = 4096 * V * 1 * 2
# What a call keeps for the backward: the hidden gradient n*h in bf16 (TP 1), the output layer's
# fp32 accumulator 4 * V * h, the row statistics 32 n.
KEPT = {"loss: grad accumulators": S * 3072 * 2 + 4 * V * 3072,  # 1,601,175,552
        "loss: row statistics": 32 * S}

# Llama-3.1-8B: a layer's attention 4096*4096*2 + 4096*1024*2 = 41,943,040, SwiGLU
# 3 * 4096 * 14,336 = 176,160,768, norms 8,192: 218,112,000; 32 layers 6,979,584,000; embedding
# and output layer 128,256 * 4096 each; the final norm 4,096.
LLAMA_8B_PARAMS = 6_979_584_000 + 2 * 525_336_576 + 4_096  # 8,030,261,248
# Its no-grad forward's working set, a token (TP 1): the residual and norm output 4h, and the
# larger of attention's 2 * (2ad + 2gd) = 20,480 and SwiGLU's 6f = 86,016.
COLOCATED_8B = {
    "teacher weights": 2 * LLAMA_8B_PARAMS,  # 16,060,522,496
    "teacher forward (no grad)": S * (4 * 4096 + 86_016),  # 419,430,400
    "teacher final hidden": S * 4096 * 2,  # [s, b, h_t] in bf16
    **KEPT,
}
# Llama-3.1-70B served: on the student's GPU its output-layer shard V * h_t in bf16, the ring's
# D = 2 receive slots of [s, b, h_t] (TP 1: the whole sequence), the gathered buffer in use.
SERVED_70B = {
    "teacher output-layer shard": V * 8192 * 2,  # 2,101,346,304
    "ring slots (D x 1/t seq)": 2 * S * 8192 * 2,
    "gathered hidden [s,b,h_t]": S * 8192 * 2,
    **KEPT,
}
# Its replica: 141 GB of bf16 weights fit no single 80 GB GPU; of the two-GPU layouts the search
# takes the one without a pipeline: TP 2 (with sequence parallelism). Per rank, a layer's
# (attention 150,994,944 + SwiGLU 704,643,072) / 2 + norms 16,384 = 427,835,392; 80 layers
# 34,226,831,360; the embedding and the output layer 128,256 * 8192 / 2 = 525,336,576 each; the
# final norm 8,192.
REPLICA_OUTPUT_LAYER = 2 * 525_336_576
REPLICA = {
    "teacher weights (no output layer)": 2 * (34_226_831_360 + 525_336_576 + 8_192),
    "teacher output layer (loaded, not run)": REPLICA_OUTPUT_LAYER,
    # a token: residual and norm output 4h / 2 (SP), SwiGLU 6f / 2 = 86,016
    "teacher forward (no grad)": S * (4 * 8192 // 2 + 6 * 28_672 // 2),
    "send slots (D x 1/t seq)": 2 * S * 8192 * 2 // 2,  # D = 2 slots of 1/t of [s, b, h_t]
    "reserve (context, NCCL, frag.)": RESERVE,
}


def _steady(terms: dict) -> int:
    return sum(v for k, v in terms.items() if k != "teacher forward (no grad)")


def test_colocated_and_served_teachers_against_the_hand_account(capsys):
    out = _plan(capsys, "--teacher llama-3.1-8b llama-3.1-70b --kd-mode colocated disaggregated "
                        "--kd-teacher-weights 3 1")
    plan = out["mixture"]
    assert plan["layout"]["tp"] == 1 and plan["layout"]["dp"] == 8 and plan["worst_stage"] == 0
    assert plan["terms"] == {**STUDENT, "loss: window buffers": WINDOW_DENSE,
                             "reserve (context, NCCL, frag.)": RESERVE}
    colocated, served = plan["teachers"]
    assert (colocated["mode"], served["mode"]) == ("colocated", "disaggregated")
    assert (colocated["weight"], served["weight"]) == (0.75, 0.25)  # 3 : 1
    assert colocated["terms"] == COLOCATED_8B
    assert served["terms"] == SERVED_70B
    # every term once, the window once (the calls run one after another), the colocated
    # teacher's forward in its phase (no attention backward with flash attention, TP 1)
    total = (sum(STUDENT.values()) + WINDOW_DENSE + _steady(COLOCATED_8B) + 419_430_400
             + sum(SERVED_70B.values()) + RESERVE)
    assert plan["total_bytes"] == total
    assert plan["fits"] and total <= 0.95 * 81559 * (1 << 20)
    # the served teacher: its replica, and the hidden states a step: one sequence per DP rank,
    # [s, h_t] in bf16
    assert {k: served["teacher_layout"][k] for k in ("tp", "pp", "dp")} == {"tp": 2, "pp": 1,
                                                                           "dp": 1}
    assert served["teacher_terms"] == REPLICA
    assert served["wire"]["hidden bytes/step/student DP rank"] == S * 8192 * 2
    # as many replicas as the student's rate needs, each of 2 GPUs, packed 8 GPUs a node
    need = math.ceil(plan["student_tokens_per_s"] / served["wire"]["teacher replica tokens/s"])
    assert served["replicas"] == need
    assert (served["teacher_gpus"], served["teacher_nodes"]) == (2 * need, math.ceil(need / 4))
    assert colocated["teacher_gpus"] == 0 and plan["teacher_gpus"] == 2 * need


def test_two_cached_teachers_against_the_hand_account(capsys):
    out = _plan(capsys, "--teacher llama-3.1-8b llama-3.1-70b --kd-mode offline offline "
                        "--kd-topk 100 --kd-cache-entry-bytes 3")
    plan = out["mixture"]
    assert plan["terms"] == {**STUDENT, "loss: window buffers": WINDOW_TOPK,
                             "reserve (context, NCCL, frag.)": RESERVE}
    # each teacher's decoded targets of the micro-batch in use: K = 100 entries a token, an
    # int64 id and an fp32 log-prob each
    cached = {"cache reader": S * 100 * 12, **KEPT}
    for teacher in plan["teachers"]:
        assert teacher["terms"] == cached
        # its cache: one sequence a step per DP rank, 100 entries of 3 bytes a token
        assert teacher["wire"]["cache bytes/step/DP rank"] == S * 100 * 3
        assert teacher["wire"]["cache size GB per 1B tokens"] == 300
        assert teacher["teacher_gpus"] == 0
    assert plan["total_bytes"] == sum(STUDENT.values()) + WINDOW_TOPK + 2 * sum(
        cached.values()) + RESERVE
    launch = plan["launch"]
    flags = launch["student_flags_text"]
    assert '--kd-mode offline offline --kd-topk-cache "$KD_CACHE_DIR_0" "$KD_CACHE_DIR_1"' \
        in flags
    assert "--kd-teacher-load" not in flags and "--kd-teacher-weights" not in flags
    builds = launch["teacher_commands"]
    assert [b["teacher"] for b in builds] == [0, 1]
    assert all(b["command"][:3] == ["megatron-kd", "cache", "build"] for b in builds)
    assert [b["command"][b["command"].index("--out") + 1] for b in builds] == [
        "$KD_CACHE_DIR_0", "$KD_CACHE_DIR_1"]


def test_one_teacher_plan_is_the_one_teacher_account(capsys):
    """One ``--teacher``: the command and its output as before (``plans`` by mode), and the
    colocated teacher's account is the mixture's with that teacher alone."""
    out = _plan(capsys, "--teacher llama-3.1-8b --modes colocated-fused")
    assert "mixture" not in out and out["teacher"]["name"] == "llama-3.1-8b"
    plan = out["plans"]["colocated-fused"]
    assert plan["terms"] == {**STUDENT, "teacher weights": COLOCATED_8B["teacher weights"],
                             "teacher forward (no grad)": 419_430_400,
                             "loss: window buffers": WINDOW_DENSE,
                             **KEPT,
                             "teacher final hidden": COLOCATED_8B["teacher final hidden"],
                             "reserve (context, NCCL, frag.)": RESERVE}
    assert plan["total_bytes"] == (sum(STUDENT.values()) + sum(COLOCATED_8B.values())
                                   + WINDOW_DENSE + RESERVE)
    start = " ".join(plan["launch"]["student_flags"])
    assert "--kd-mode colocated --kd-teacher-load $TEACHER_CKPT " in start


def test_launch_lines_are_what_train_reads(capsys):
    """The printed student flags, read by ``megatron-kd train``'s own ``--kd-*`` parser."""
    import argparse

    from megatron_kd.modes.args import KDArgs, add_kd_args

    out = _plan(capsys, "--teacher llama-3.1-8b llama-3.1-70b --kd-mode colocated disaggregated "
                        "--kd-teacher-weights 1 1")
    launch = out["mixture"]["launch"]
    parser = add_kd_args(argparse.ArgumentParser())
    args, _ = parser.parse_known_args(launch["student_flags"])
    kd = KDArgs.from_args(args)
    assert [(t.mode, t.teacher_load, t.teacher_endpoint) for t in kd.teachers] == [
        ("colocated", "$TEACHER_CKPT_0", None),
        ("disaggregated", "$TEACHER_CKPT_1", "$KD_TEACHER_ENDPOINT_1")]
    assert kd.weights == (0.5, 0.5)
    (serve,) = launch["teacher_commands"]
    assert serve["teacher"] == 1
    assert serve["command_text"].startswith(
        'megatron-kd teacher serve --kd-teacher-load "$TEACHER_CKPT_1" '
        "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 1 --sequence-parallel")


def test_text_report_has_a_row_per_teacher(capsys):
    assert main(["plan", *shlex.split(RUN), "--teacher", "llama-3.1-8b", "llama-3.1-70b",
                 "--kd-mode", "colocated", "disaggregated"]) == 0
    text = capsys.readouterr().out
    assert "== mixture of 2 teachers: fits:" in text
    rows = [line.split() for line in text.splitlines() if line.startswith("   [") and
            ("colocated " in line or "disaggregated " in line)]
    assert [r[:3] for r in rows] == [["[0]", "llama-3.1-8b", "colocated"],
                                     ["[1]", "llama-3.1-70b", "disaggregated"]]
    assert "teacher 1's job:" in text and "megatron-kd teacher serve" in text


@pytest.mark.parametrize("flags, match", [
    ("--teacher llama-3.1-8b llama-3.1-70b", "no --kd-mode"),
    ("--teacher llama-3.1-8b llama-3.1-70b --kd-mode colocated", "1 mode"),
    ("--teacher llama-3.1-8b --kd-mode colocated", "--kd-mode with one teacher"),
    ("--teacher llama-3.1-8b llama-3.1-70b --kd-mode offline offline --modes offline-cache",
     "--modes offline-cache with several teachers"),
    ("--teacher llama-3.1-8b llama-3.1-70b --kd-mode offline offline --kd-teacher-weights 1",
     "1 weight"),
    ("--teacher llama-3.1-8b llama-3.1-70b --kd-mode offline offline --kd-teacher-weights 0 0",
     "at least one weight"),
    ("--teacher llama-3.1-8b llama-3.1-70b --kd-mode offline disaggregated "
     "--kd-teacher-replicas 2", "--kd-teacher-replicas with 2 teachers"),
    ("--teacher llama-3.1-8b qwen3-8b --kd-mode offline offline", "vocabularies differ"),
    ("--student qwen3-8b --teacher qwen3-32b qwen3-30b-a3b --kd-mode colocated colocated",
     "one with experts"),
])
def test_refuses_what_it_does_not_model(capsys, flags, match):
    assert main(["plan", *shlex.split(RUN), *shlex.split(flags)]) == 2
    assert match in capsys.readouterr().err
