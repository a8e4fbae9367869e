"""Planner presets, plans, the ``megatron-kd plan`` command and ``--from-args`` (no torch)."""

import dataclasses
import importlib.util
import json
import pathlib
import re
import subprocess
import sys

import pytest

from megatron_kd.cli import main
from megatron_kd.planner import memory as mem
from megatron_kd.planner.cli import parse_launch_args, to_json
from megatron_kd.planner.memory import LOSS_TERMS, Term
from megatron_kd.planner.options import plan_all
from megatron_kd.planner.plan import Mode, PlanOptions
from megatron_kd.planner.presets import MODEL_PRESETS, get_gpu, get_link, load_model
from megatron_kd.planner.search import (
    evaluate,
    plan_mode,
    student_candidates,
    student_stage_terms,
)
from megatron_kd.planner.traffic import Traffic

# --- presets
# ---------------------------------------------------------------------------------------

# (preset, published total, published active or None, active includes the input embedding,
# tolerance) Tolerance: the published figures are rounded to 2-3 significant digits, hence 2% (5%
# for the Qwen3.5 names, which are the names' own rounding and include a vision tower the text
# presets leave out).
PUBLISHED = [
    ("llama-3.1-8b", 8.03e9, None, False, 0.02),
    ("llama-3.1-70b", 70.6e9, None, False, 0.02),
    ("llama-3.2-3b", 3.21e9, None, False, 0.02),
    ("llama-3.2-1b", 1.24e9, None, False, 0.02),
    ("qwen3-8b", 8.2e9, None, False, 0.02),
    ("qwen3-32b", 32.8e9, None, False, 0.02),
    ("qwen3-30b-a3b", 30.5e9, 3.3e9, True, 0.02),
    ("qwen3-235b-a22b", 235e9, 22e9, True, 0.02),
    ("gpt-oss-20b", 20.9e9, 3.6e9, False, 0.02),
    ("gpt-oss-120b", 116.8e9, 5.1e9, False, 0.02),
    ("qwen3.5-35b-a3b", 35e9, None, True, 0.05),
    ("qwen3.5-9b", 9e9, None, False, 0.05),
]


@pytest.mark.parametrize("name, total, active, with_embedding, tol", PUBLISHED)
def test_preset_param_counts_match_published(name, total, active, with_embedding, tol):
    model = MODEL_PRESETS[name]
    assert model.total_params() == pytest.approx(total, rel=tol)
    if active is not None:
        assert model.active_params(include_input_embedding=with_embedding) == pytest.approx(
            active, rel=tol
        )


def test_every_required_preset_exists():
    assert set(MODEL_PRESETS) == {p[0] for p in PUBLISHED}
    for gpu in ("h100-80g", "h200-141g", "b200"):
        assert get_gpu(gpu).memory_bytes > 0
    for link in ("nvlink", "ib-400g", "ib-800g"):
        assert get_link(link, get_gpu("b200")).bytes_per_s > 0
    # IB 400 Gb/s = 50 GB/s
    assert get_link("ib-400g", get_gpu("h100-80g")).bytes_per_s == 50e9


def _read_config(tmp_path, config: dict):
    """The planner's model of a Hugging Face ``config.json`` holding ``config``."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return load_model(str(path))


def test_hf_config_reader_matches_presets(tmp_path):
    # A Qwen3.5-MoE config.json, shaped as published (text_config nested, layer_types listed).
    cfg = {
        "model_type": "qwen3_5_moe",
        "tie_word_embeddings": False,
        "text_config": {
            "model_type": "qwen3_5_moe_text",
            "hidden_size": 2048,
            "num_hidden_layers": 40,
            "num_attention_heads": 16,
            "num_key_value_heads": 2,
            "head_dim": 256,
            "vocab_size": 248320,
            "attn_output_gate": True,
            "full_attention_interval": 4,
            "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 10,
            "linear_num_key_heads": 16,
            "linear_num_value_heads": 32,
            "linear_key_head_dim": 128,
            "linear_value_head_dim": 128,
            "linear_conv_kernel_dim": 4,
            "num_experts": 256,
            "num_experts_per_tok": 8,
            "moe_intermediate_size": 512,
            "shared_expert_intermediate_size": 512,
        },
    }
    model = _read_config(tmp_path, cfg)
    preset = MODEL_PRESETS["qwen3.5-35b-a3b"]
    assert model.total_params() == preset.total_params()
    assert model.active_params() == preset.active_params()
    gpt = {
        "model_type": "gpt_oss",
        "hidden_size": 2880,
        "num_hidden_layers": 36,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "vocab_size": 201088,
        "intermediate_size": 2880,
        "num_local_experts": 128,
        "num_experts_per_tok": 4,
        "sliding_window": 128,
        "attention_bias": True,
        "layer_types": ["sliding_attention", "full_attention"] * 18,
        "tie_word_embeddings": False,
    }
    model = _read_config(tmp_path, gpt)
    assert model.arch.window_layers == list(range(0, 36, 2))  # every other layer, from the first
    assert model.total_params() == MODEL_PRESETS["gpt-oss-120b"].total_params()
    with pytest.raises(ValueError, match="missing key 'hidden_size'"):
        _read_config(tmp_path, {"model_type": "llama", "num_hidden_layers": 2,
                                "num_attention_heads": 2, "vocab_size": 10})


def test_load_model_from_megatron_kd_checkpoint(tmp_path):
    # the model_config.json a megatron_kd checkpoint carries: {"format_version": 1, "arch": {...}}
    arch = {
        "num_layers": 16,
        "hidden_size": 2048,
        "num_attention_heads": 32,
        "num_query_groups": 8,
        "ffn_hidden_size": 8192,
        "vocab_size": 128256,
        "padded_vocab_size": 128256,
        "kv_channels": 64,
        "swiglu": True,
        "tie_embeddings": True,
        "max_position_embeddings": 4096,
    }
    (tmp_path / "model_config.json").write_text(json.dumps({"format_version": 1, "arch": arch}))
    model = load_model(str(tmp_path))
    assert model.total_params() == MODEL_PRESETS["llama-3.2-1b"].total_params()
    launch = parse_launch_args(f"--kd-teacher-load {tmp_path} --kd-window-size 512")
    assert launch.values["teacher"] == str(tmp_path) and launch.values["window_size"] == 512
    # a launch of two teachers is refused, not read as its first
    with pytest.raises(ValueError, match=rf"--from-args with --kd-teacher-load {tmp_path} "
                                         rf"/ckpt/70b: a launch of several teachers is planned "
                                         rf"from --teacher A B"):
        parse_launch_args(f"--kd-mode colocated disaggregated --kd-teacher-load {tmp_path} "
                          f"/ckpt/70b")


def test_load_model_from_file_and_unknown(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(
        json.dumps(
            {
                "model_type": "llama",
                "hidden_size": 64,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "intermediate_size": 128,
                "vocab_size": 100,
                "tie_word_embeddings": True,
            }
        )
    )
    assert load_model(str(path)).num_query_groups == 2
    with pytest.raises(ValueError, match="unknown model 'nope'"):
        load_model("nope")


# --- plans
# -------------------------------------------------------------------------------------------


def _opts(student, teacher, gpu="h200-141g", nodes=1, **kw):
    g = get_gpu(gpu)
    return PlanOptions(
        student=MODEL_PRESETS[student],
        teacher=MODEL_PRESETS[teacher],
        gpu=g,
        inter_node_link=get_link("ib-400g", g),
        nodes=nodes,
        seq_length=8192,
        global_batch_size=64,
        use_distributed_optimizer=True,
        **kw,
    )


def test_mode_terms_differ_only_where_they_should():
    opts = _opts("llama-3.2-1b", "llama-3.1-8b", tp=2, pp=1, recompute="none")
    layout = mem.ParallelLayout(tp=2, dp=4, sequence_parallel=True, use_distributed_optimizer=True)
    teacher_layout = mem.ParallelLayout(tp=2, dp=4, sequence_parallel=True)
    dense = student_stage_terms(opts, Mode.COLOCATED_DENSE, layout, teacher_layout, 0)
    fused = student_stage_terms(opts, Mode.COLOCATED_FUSED, layout, teacher_layout, 0)
    offline = student_stage_terms(opts, Mode.OFFLINE_CACHE, layout, None, 0)
    disagg = student_stage_terms(opts, Mode.DISAGGREGATED, layout, None, 0)
    for terms in (dense, fused, offline, disagg):  # student state is the same in every mode
        assert terms[Term.STUDENT_WEIGHTS] == dense[Term.STUDENT_WEIGHTS]
        assert terms[Term.ACTIVATIONS] == fused[Term.ACTIVATIONS] + (
            # only the dense loss runs the output layer as a layer: its saved input, 2 bytes * 8192
            # tokens * h 2048 / tp 2 (sequence parallel)
            2 * 8192 * 2048 // 2 if terms is dense else 0
        )
    assert Term.TEACHER_WEIGHTS in dense and Term.TEACHER_WEIGHTS in fused
    assert Term.TEACHER_WEIGHTS not in offline and Term.TEACHER_WEIGHTS not in disagg
    assert Term.RING_SLOTS in disagg and Term.CACHE_READER in offline
    # the dense loss: 8192 tokens * 10 bytes * (128256 = 501 * 256 needs no padding, / 2) * 2 models
    assert dense[Term.DENSE_LOGITS] == 8192 * 10 * 64128 * 2
    # the GPU path (the default): 1 GiB of bf16 logits for 2 models is 2^30 // (2 * 64128 * 2)
    # = 4185 rows, so 8192 rows take 2 windows of 4096 (32 whole tiles)
    fused_loss = sum(v for k, v in fused.items() if k in LOSS_TERMS)
    assert fused[Term.LOSS_WINDOW] == 4096 * 64128 * 2 * 2
    assert fused_loss < dense[Term.DENSE_LOGITS] / 5
    # the CPU path: default windows (2^24 / 64128 = 261 rows): bf16 matmul out + 4 fp32 buffers
    cpu = dataclasses.replace(opts, loss_path="cpu")
    cpu_fused = student_stage_terms(cpu, Mode.COLOCATED_FUSED, layout, teacher_layout, 0)
    assert cpu_fused[Term.LOSS_WINDOW] == 261 * 64128 * 18
    assert sum(v for k, v in cpu_fused.items() if k in LOSS_TERMS) < dense[Term.DENSE_LOGITS] / 10


def test_search_prefers_no_recompute_and_reports_oom():
    # plenty of memory: no recompute, no model parallelism
    plan = plan_mode(_opts("llama-3.2-1b", "llama-3.2-3b"), Mode.COLOCATED_FUSED)
    assert (
        plan.fits
        and plan.layout.recompute == "none"
        and plan.layout.tp * plan.layout.pp == 1
    )
    # a 235B teacher on one H100 node cannot be colocated: OOM, with the lowest-peak layout shown
    plan = plan_mode(_opts("qwen3-32b", "qwen3-235b-a22b", gpu="h100-80g"), Mode.COLOCATED_FUSED)
    assert not plan.fits and plan.total_bytes > get_gpu("h100-80g").memory_bytes
    assert any("no layout" in note for note in plan.notes)


def test_search_takes_the_least_recompute_that_fits():
    # the 9B student at 8K on H100s without model parallelism: no recompute needs 111 GiB; full
    # recompute of every layer fits (uniform x1) but the search takes the fewest layers block
    # recompute needs (least compute): N fits, N - 1 does not (no headroom: with 5% only full
    # recompute of every layer fits)
    opts = _opts("qwen3.5-9b", "qwen3.5-35b-a3b", gpu="h100-80g", tp=1, pp=1, headroom=0.0)
    plan = plan_mode(opts, Mode.DISAGGREGATED)
    layout = plan.layout
    assert plan.fits and (layout.recompute, layout.recompute_method) == ("full", "block")
    assert 1 < layout.recompute_num_layers < 32
    fewer = dataclasses.replace(layout, recompute_num_layers=layout.recompute_num_layers - 1)
    assert not evaluate(opts, Mode.DISAGGREGATED, fewer).fits
    # given the method: uniform, in groups of 1 (all groups cost the same compute; x1 is first)
    opts = dataclasses.replace(opts, recompute="full", recompute_method="uniform")
    assert plan_mode(opts, Mode.DISAGGREGATED).layout.recompute_label == "full uniform x1"
    # with no constraint the search prefers tensor parallelism (no recompute, and a comm cost it
    # reports) to recomputing: tp 2 + SP fits the 80 GiB without recompute
    plan = plan_mode(_opts("qwen3.5-9b", "qwen3.5-35b-a3b", gpu="h100-80g"), Mode.DISAGGREGATED)
    assert (plan.layout.tp, plan.layout.pp, plan.layout.sequence_parallel,
            plan.layout.recompute) == (2, 1, True, "none")
    assert plan.wire[Traffic.TP_COLLECTIVE_SECONDS] > 0


def test_search_weighs_bubble_against_p2p_for_virtual_stages():
    # pp=2 on one H200 node, m = 64 / 4 = 16: bubble 1/(16v); the p2p sends 16 * 2v * 8192 *
    # 4096 * 2 bytes = v * 2 GiB per step, v * 2^31 / (450e9 * 0.8) = v * 5.97 ms, against ~8.36 s
    # of compute: bubble + p2p = 1/(16v) + 0.000714v, least at v = 8 of 1, 2, 4, 8, 16
    opts = _opts("qwen3.5-9b", "qwen3.5-35b-a3b", tp=1, pp=2)
    plan = plan_mode(opts, Mode.DISAGGREGATED)
    assert plan.fits and plan.layout.vp == 8 and plan.layout.recompute == "none"
    assert plan.bubble == 1 / 128
    assert plan.wire[Traffic.P2P_BYTES] == 8 * 2**31
    # given as layers per virtual stage: 32 / (2 * 4) = 4 virtual stages
    opts = dataclasses.replace(opts, layers_per_virtual_stage=4)
    assert plan_mode(opts, Mode.DISAGGREGATED).layout.vp == 4


def test_search_takes_context_parallelism_for_long_sequences():
    # Qwen3-30B-A3B at 32K tokens, 4 sequences a step on one H200 node: dp <= 4, so GPUs share
    # each sequence. Context parallelism idles nothing; a two-stage pipeline would have m = 4/4
    # = 1 micro-batch, a bubble (p-1)/m of 100%.
    opts = dataclasses.replace(_opts("qwen3-30b-a3b", "qwen3-235b-a22b"), seq_length=32768,
                               global_batch_size=4)
    plan = plan_mode(opts, Mode.OFFLINE_CACHE)
    layout = plan.layout
    assert plan.fits and (layout.tp, layout.pp) == (1, 1) and layout.cp > 1
    assert layout.cp * layout.dp == 8 and layout.cp_comm_type == "p2p" and plan.bubble == 0
    assert plan.wire[Traffic.CP_EXCHANGE_BYTES] > 0
    # two stages over 8 GPUs: dp 4, one micro-batch each (experts over a stage's 4 ranks)
    pipelined = evaluate(opts, Mode.OFFLINE_CACHE,
                         dataclasses.replace(layout, cp=1, pp=2, dp=4, ep=4))
    assert pipelined.bubble == 1.0
    assert pipelined.student_tokens_per_s < plan.student_tokens_per_s
    # the same layout without context parallelism holds each rank's whole sequence (the expert
    # grid over the fewer ranks a stage then has)
    whole = evaluate(opts, Mode.OFFLINE_CACHE,
                     dataclasses.replace(layout, cp=1, ep=layout.ep // layout.cp))
    assert plan.terms[Term.ACTIVATIONS] == whole.terms[Term.ACTIVATIONS] / layout.cp
    # a Gated DeltaNet student is never split over context-parallel ranks
    qwen = dataclasses.replace(_opts("qwen3.5-9b", "qwen3.5-35b-a3b"), seq_length=32768)
    assert all(c.cp == 1 for c in student_candidates(qwen))


def test_from_args_reads_context_parallelism(capsys):
    launch = parse_launch_args(LAUNCH + " --context-parallel-size 2 --cp-comm-type all_gather")
    assert launch.values["cp"] == 2 and launch.values["cp_comm_type"] == "all_gather"
    assert parse_launch_args(LAUNCH).values["cp"] == 1  # Megatron's default
    out = _run_json(capsys, "--teacher", "llama-3.1-8b", "--from-args",
                    LAUNCH + " --context-parallel-size 2", "--modes", "disaggregated")
    plan = out["plans"]["disaggregated"]
    # tp 2 x cp 2 on 8 GPUs: dp 2; the hidden states of a DP rank's 32 sequences split over
    # its 4 TP x CP ranks
    assert (plan["layout"]["tp"], plan["layout"]["cp"], plan["layout"]["dp"]) == (2, 2, 2)
    assert plan["layout"]["cp_comm_type"] == "p2p"
    assert plan["wire"][Traffic.HIDDEN_BYTES_PER_TP_RANK.label] == 32 * 4096 * 4096 * 2 / 4


def test_published_claims():
    # Qwen3.5-35B-A3B -> 9B on one H200 node: colocated with the fused loss fits; disaggregated is
    # faster.
    result = plan_all(_opts("qwen3.5-9b", "qwen3.5-35b-a3b"))
    plans = result.plans
    assert plans[Mode.COLOCATED_FUSED].fits and plans[Mode.DISAGGREGATED].fits
    assert (
        plans[Mode.DISAGGREGATED].student_tokens_per_s
        > plans[Mode.COLOCATED_FUSED].student_tokens_per_s
    )
    assert plans[Mode.DISAGGREGATED].wire_ok
    assert result.recommendation.startswith("disaggregated")
    # Qwen3-235B-A22B -> Qwen3-32B on one H100 node: colocated OOMs with either loss, disaggregated
    # fits.
    plans = plan_all(_opts("qwen3-32b", "qwen3-235b-a22b", gpu="h100-80g")).plans
    assert not plans[Mode.COLOCATED_DENSE].fits and not plans[Mode.COLOCATED_FUSED].fits
    assert plans[Mode.DISAGGREGATED].fits and plans[Mode.DISAGGREGATED].teacher_nodes >= 1


def test_disaggregated_wire_bytes_are_exact():
    plan = plan_mode(
        _opts("qwen3.5-9b", "qwen3.5-35b-a3b", tp=2, pp=1, recompute="none"), Mode.DISAGGREGATED
    )
    dp = plan.layout.dp
    assert dp == 4
    # 64 sequences / dp 4 = 16 per DP rank * 8192 tokens * h_t 2048 * 2 bytes; 1/2 per TP rank
    assert plan.wire[Traffic.HIDDEN_BYTES_PER_DP_RANK] == 16 * 8192 * 2048 * 2
    assert plan.wire[Traffic.HIDDEN_BYTES_PER_TP_RANK] == 16 * 8192 * 2048
    # and the token ids the other way: 4 bytes a token
    assert plan.wire[Traffic.TOKEN_ID_BYTES] == 16 * 8192 * 4
    fp8 = plan_mode(_opts("qwen3.5-9b", "qwen3.5-35b-a3b", tp=2, pp=1, recompute="none",
                          wire_dtype="fp8"), Mode.DISAGGREGATED)
    assert fp8.wire[Traffic.HIDDEN_BYTES_PER_DP_RANK] == 16 * 8192 * (2048 + 4)


# Hand-derived figures of llama-3.2-1b (student) and llama-3.1-8b (teacher) at s = 8192 from
# traffic.py's FLOP model: a layer's matmuls 2 x its parameters, attention 4 a d (s + 1)/2 a token.
# Student layer: attention 2048*2048 (Q) + 2*2048*512 (K, V) + 2048*2048 (O) + SwiGLU 3*2048*8192
# + 2 norms 2*2048 = 60,821,504 parameters; attention 4*32*64*4096.5 = 33,558,528.
# Forward a token: 16 layers + final norm 2*2048 + output layer 2*128256*2048 = 3,008,565,248;
# training 3x, plus the teacher's output layer the student runs, 2*128256*4096 = 1,050,673,152.
STUDENT_FLOPS_PER_TOKEN = 3 * 3_008_565_248 + 1_050_673_152  # 10,076,368,896
# Teacher layer: 4096*4096 + 2*4096*1024 + 4096*4096 + 3*4096*14336 + 2*4096 = 218,112,000
# parameters; attention 4*32*128*4096.5 = 67,117,056. A replica stops before its output layer:
# 32 layers + final norm 2*4096.
TEACHER_FLOPS_PER_TOKEN = 32 * (2 * 218_112_000 + 67_117_056) + 2 * 4096  # 16,106,921,984
H100_PEAK, MFU = 989e12, 0.40  # the h100-80g preset, the default MFU of both


def test_fewer_teacher_replicas_than_needed_bound_the_student():
    base = _opts("llama-3.2-1b", "llama-3.1-8b", gpu="h100-80g", tp=1, pp=1, cp=1,
                 recompute="none")
    free = plan_mode(base, Mode.DISAGGREGATED)
    # 8 student GPUs (one node, no pipeline: no bubble); one GPU a replica (16 GB of weights)
    student = 8 * H100_PEAK * MFU / STUDENT_FLOPS_PER_TOKEN  # 314,081 tokens/s
    replica = H100_PEAK * MFU / TEACHER_FLOPS_PER_TOKEN  # 24,560 tokens/s
    assert (free.student_gpus, free.teacher_gpus // free.teacher_replicas) == (8, 1)
    assert free.student_tokens_per_s == pytest.approx(student, rel=1e-12)
    assert free.wire[Traffic.REPLICA_TOKENS_PER_S] == pytest.approx(replica, rel=1e-12)
    assert free.teacher_replicas == 13  # ceil(314,081 / 24,560) = ceil(12.79)
    for n in range(1, 15):
        plan = plan_mode(dataclasses.replace(base, teacher_replicas=n), Mode.DISAGGREGATED)
        assert plan.teacher_replicas == n and plan.teacher_gpus == n
        # the student's own rate, or what n replicas serve when that is less
        assert plan.student_tokens_per_s == pytest.approx(min(student, n * replica), rel=1e-12)
        assert any("teacher-bound" in note for note in plan.notes) == (n < 13)
    with pytest.raises(ValueError, match="teacher_replicas must be a positive int"):
        dataclasses.replace(base, teacher_replicas=0)


def test_plan_options_validation():
    with pytest.raises(ValueError, match="tp=16 > gpus_per_node=8"):
        _opts("llama-3.2-1b", "llama-3.1-8b", tp=16)
    with pytest.raises(ValueError, match="mfu must be in"):
        _opts("llama-3.2-1b", "llama-3.1-8b", mfu=1.5)
    with pytest.raises(ValueError, match="loss_path must be 'gpu', 'cpu' or 'dense', got 'tpu'"):
        _opts("llama-3.2-1b", "llama-3.1-8b", loss_path="tpu")
    with pytest.raises(ValueError, match="weight_grad must be one of"):
        _opts("llama-3.2-1b", "llama-3.1-8b", loss_weight_grad="bf16")


# --- the command ---------------------------------------------------------------------------------


def _run_json(capsys, *argv):
    assert main(["plan", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_cli_json_smoke(capsys):
    out = _run_json(
        capsys,
        "--teacher",
        "llama-3.1-8b",
        "--student",
        "llama-3.2-1b",
        "--gpu",
        "h100-80g",
        "--seq-length",
        "2048",
        "--global-batch-size",
        "32",
        "--use-distributed-optimizer",
    )
    assert set(out["plans"]) == {
        "colocated-dense",
        "colocated-fused",
        "offline-cache",
        "disaggregated",
    }
    for plan in out["plans"].values():
        assert plan["fits"] == (plan["total_bytes"] <= out["gpu"]["memory_bytes"])
    assert out["recommendation"]
    assert out["assumptions"]["mfu"] == 0.4


def test_cli_total_counts_the_larger_of_two_exclusive_phases(capsys):
    """Colocated at CP 2: the teacher's forward and the student's context-parallel exchange are
    both present and never live together, so the total is not the sum of the terms. Every
    figure derived by hand (memory.py's notation: n = s*b/cp = 2048 local tokens, V = 128256;
    student llama-3.2-1b h 2048, a 32, g 8, d 64, f 8192, 16 layers, tied embeddings; teacher
    llama-3.1-8b h 4096, a 32, g 8, d 128, f 14336, 32 layers, untied)."""
    out = _run_json(capsys, "--teacher", "llama-3.1-8b", "--student", "llama-3.2-1b", "--gpu",
                    "h100-80g", "--seq-length", "4096", "--micro-batch-size", "1",
                    "--global-batch-size", "8", "--tensor-model-parallel-size", "1",
                    "--pipeline-model-parallel-size", "1", "--context-parallel-size", "2",
                    "--recompute-granularity", "none", "--modes", "colocated-fused",
                    "--no-use-distributed-optimizer")
    plan = out["plans"]["colocated-fused"]
    assert (plan["layout"]["dp"], plan["layout"]["cp_comm_type"]) == (4, "p2p")
    # student parameters: 16 x (4,194,304 Q + 2,097,152 K V + 4,194,304 O + 50,331,648 SwiGLU
    # + 4,096 norms) + 262,668,288 embedding (tied, one copy) + 2,048 final norm = 1,235,814,400;
    # teacher: 32 x 218,112,000 + 2 x 525,336,576 + 4,096 = 8,030,261,248
    want = {
        "student weights": 1_235_814_400 * 2,
        "student grads (main_grad)": 1_235_814_400 * 4,
        "optimizer (Adam)": 1_235_814_400 * 12,  # not distributed
        # 16 layers x n x (R 4h + 4h; S 2ad + 2*2gd + 2ad + 4a flash LSE + 6f) = 75,904 bytes a
        # token, + the final norm's input 2h a token
        "activations": 16 * 2048 * 75_904 + 2048 * 2 * 2048,
        # p2p: four local K/V chunks, 4 x n x 2gd x 2 bytes
        "context-parallel K/V exchange (1 layer)": 4 * 2048 * 2 * 8 * 64 * 2,
        "teacher weights": 8_030_261_248 * 2,
        # one no-grad layer: n x (4h + max(mixer 20,480, MLP 6f 86,016)) bytes, + its own p2p
        # exchange 4 x n x 2gd x 2 = 33,554,432
        "teacher forward (no grad)": 2048 * (4 * 4096 + 6 * 14336) + 4 * 2048 * 2 * 8 * 128 * 2,
        # the GPU path: 1 GiB holds 2^30 // (2 models * V * 2 bytes) = 2093 rows >= n, so one
        # window of n rows, each model's bf16 logits
        "loss: window buffers": 2048 * 128256 * 2 * 2,
        # the hidden gradient in bf16 (TP 1), the output layer's accumulator in fp32
        "loss: grad accumulators": 2 * 2048 * 2048 + 4 * 128256 * 2048,
        "loss: row statistics": 32 * 2048,
        "teacher final hidden": 2048 * 4096 * 2,
        "reserve (context, NCCL, frag.)": 4 << 30,
    }
    assert plan["terms"] == want
    steady = 47_222_337_536  # every term but the two phases
    assert sum(want.values()) == steady + 243_269_632 + 16_777_216
    # the larger phase only: the teacher's forward (243,269,632 > 16,777,216)
    assert plan["total_bytes"] == steady + 243_269_632 == 47_465_607_168


@pytest.mark.parametrize("flag", [None, "--launch-args"])
def test_cli_gpu_loss_settings(capsys, flag):
    """--kd-loss-window-mib and --kd-loss-weight-grad, given to the planner or read from a run's
    flags, change the GPU path's terms and come back in the launch flags."""
    settings = ["--kd-loss-window-mib", "256", "--kd-loss-weight-grad", "input_dtype"]
    given = [flag, " ".join(settings)] if flag else settings
    out = _run_json(capsys, "--teacher", "llama-3.1-8b", "--student", "llama-3.2-1b", "--gpu",
                    "h100-80g", "--seq-length", "4096", "--micro-batch-size", "1",
                    "--global-batch-size", "8", "--tensor-model-parallel-size", "1",
                    "--pipeline-model-parallel-size", "1", "--context-parallel-size", "2",
                    "--recompute-granularity", "none", "--modes", "colocated-fused",
                    "--no-use-distributed-optimizer", *given)
    plan = out["plans"]["colocated-fused"]
    # 256 MiB // (2 models * 128256 * 2 bytes) = 523 rows: n = 2048 tokens in 4 windows of 512
    assert plan["terms"]["loss: window buffers"] == 512 * 128256 * 2 * 2
    # the hidden gradient and the output layer's accumulator both in bf16
    assert plan["terms"]["loss: grad accumulators"] == 2 * 2048 * 2048 + 2 * 128256 * 2048
    assert (out["inputs"]["loss_window_bytes"], out["inputs"]["loss_weight_grad"]) == (
        256 << 20, "input_dtype")
    flags = plan["launch"]["student_flags"]
    at = flags.index("--kd-loss-window-mib")
    assert flags[at:at + 4] == settings
    # the defaults are not spelled out in the launch
    out = _run_json(capsys, "--teacher", "llama-3.1-8b", "--student", "llama-3.2-1b",
                    "--modes", "colocated-fused")
    assert not {"--kd-loss-window-mib", "--kd-loss-weight-grad"} & set(
        out["plans"]["colocated-fused"]["launch"]["student_flags"])
    with pytest.raises(SystemExit):
        main(["plan", "--teacher", "llama-3.1-8b", "--student", "llama-3.2-1b",
              "--kd-loss-window-mib", "0"])
    assert "a size in MiB must be > 0, got '0'" in capsys.readouterr().err


def test_cli_table_and_errors(capsys):
    assert (
        main(["plan", "--teacher", "qwen3-8b", "--student", "qwen3-8b", "--modes", "disaggregated"])
        == 0
    )
    text = capsys.readouterr().out
    assert (
        "== disaggregated" in text
        and "recommendation:" in text
        and "colocated" not in text.split("==")[1]
    )
    assert main(["plan", "--teacher", "qwen3-8b", "--student", "nope"]) == 2
    assert "unknown model 'nope'" in capsys.readouterr().err


LAUNCH = (
    "--num-layers 16 --hidden-size 2048 --ffn-hidden-size 8192 --num-attention-heads 32 "
    "--group-query-attention --num-query-groups 8 --kv-channels 64 --swiglu --vocab-size 128256 "
    "--disable-bias-linear --normalization RMSNorm --position-embedding-type rope "
    "--seq-length 4096 --micro-batch-size 2 --global-batch-size 64 --tensor-model-parallel-size 2 "
    "--sequence-parallel --use-distributed-optimizer --recompute-granularity selective "
    "--hidden-dropout 0 --lr 3e-4 --data-path /x --bf16"
)


def test_from_args_parsing():
    launch = parse_launch_args(LAUNCH)
    # the Llama-3.2-1B shape, tied (Megatron's default without
    # --untie-embeddings-and-output-weights)
    assert launch.student.total_params() == MODEL_PRESETS["llama-3.2-1b"].total_params()
    assert launch.values["tp"] == 2 and launch.values["pp"] == 1 and launch.values["etp"] == 2
    assert launch.values["recompute"] == "selective" and launch.values["sequence_parallel"] is True
    assert launch.values["micro_batch_size"] == 2 and launch.values["hidden_dropout"] is False
    assert launch.ignored == ["--lr", "--data-path"]
    # Megatron defaults: dropout 0.1 (masks saved), GeLU, tied
    plain = parse_launch_args(
        "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --vocab-size 100"
    )
    assert plain.values["hidden_dropout"] is True
    assert not plain.student.gated_linear_unit and plain.student.tie_embeddings
    assert plain.student.ffn_hidden_size == 256


@pytest.mark.parametrize(
    "bad, match",
    [
        ("--context-parallel-size 2 --cp-comm-type a2a+p2p", "a2a\\+p2p is not modelled"),
        ("--context-parallel-size 2 --cp-comm-type p2p a2a", "one exchange for every layer"),
        ("--pipeline-model-parallel-size 2 --microbatch-group-size-per-virtual-pipeline-stage 3",
         "models Megatron-Core's default group of pipeline-model-parallel-size \\(2\\)"),
        ("--num-layers-per-virtual-pipeline-stage 2 --num-virtual-stages-per-pipeline-rank 4",
         "give the virtual pipeline one way"),
        ("--pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 1",
         "one chunk per rank through its interleaved schedule"),
        ("--recompute-granularity full --recompute-method block",
         "needs --recompute-method \\(uniform or block\\) and --recompute-num-layers"),
        ("--recompute-granularity full --recompute-num-layers 2",
         "got method=None, num-layers=2"),
        ("--recompute-granularity full --recompute-method chunk --recompute-num-layers 1",
         "--recompute-method='chunk': expected uniform or block"),
        ("--recompute-granularity full --recompute-method block --recompute-num-layers 0",
         "--recompute-num-layers=0: expected >= 1"),
        ("--recompute-granularity selective --recompute-num-layers 2",
         "refuses a layer count with selective recompute"),
        ("--recompute-granularity everything", "expected full or selective"),
        ("--fp16 --bf16", "--fp16 and --bf16 both given"),
        ("--tensor-model-parallel-size two", "cannot parse"),
        ("--num-layers 2 --hidden-size 64", "lacks --num-attention-heads, --vocab-size"),
    ],
)
def test_from_args_refuses_what_is_not_modelled(bad, match):
    with pytest.raises(ValueError, match=match):
        parse_launch_args(bad)


def test_from_args_reads_sp_virtual_stages_and_recompute():
    launch = parse_launch_args(
        "--tensor-model-parallel-size 2 --sequence-parallel --pipeline-model-parallel-size 2 "
        "--num-layers-per-virtual-pipeline-stage 4 --recompute-granularity full "
        "--recompute-method block --recompute-num-layers 2"
    )
    assert launch.values["sequence_parallel"] is True
    assert launch.values["layers_per_virtual_stage"] == 4 and "vp" not in launch.values
    assert (launch.values["recompute"], launch.values["recompute_method"],
            launch.values["recompute_num_layers"]) == ("full", "block", 2)
    assert launch.ignored == []
    # the number of chunks directly, in Megatron-LM's current spelling and in the older one
    assert parse_launch_args("--num-virtual-stages-per-pipeline-rank 4").values["vp"] == 4
    assert parse_launch_args("--virtual-pipeline-model-parallel-size 2").values["vp"] == 2
    # the default group size is accepted
    parse_launch_args("--pipeline-model-parallel-size 2 "
                      "--microbatch-group-size-per-virtual-pipeline-stage 2")
    # Megatron-Core reads a method only with a granularity (and a method with selective not at
    # all): listed back as ignored, not dropped silently
    plain = parse_launch_args("--recompute-method uniform --recompute-num-layers 2")
    assert plain.values["recompute"] == "none"
    assert plain.ignored == ["--recompute-method", "--recompute-num-layers"]
    selective = parse_launch_args("--recompute-granularity selective --recompute-method block")
    assert selective.values["recompute"] == "selective"
    assert selective.ignored == ["--recompute-method"]


# LAUNCH's 16-layer model, on 8 GPUs: tp 2 x pp 2 x dp 2, 4 layers per virtual stage (v = 16 /
# (2 * 4) = 2), full block recompute of 2 layers per chunk; G=64 / (b=2 * dp=2) = 16 micro-batches
PIPELINED = LAUNCH.replace("--recompute-granularity selective", "") + (
    " --pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 4"
    " --recompute-granularity full --recompute-method block --recompute-num-layers 2"
)


@pytest.mark.parametrize("flag", ["--from-args", "--launch-args"])
def test_cli_launch_args_map_into_the_layout(capsys, flag):
    out = _run_json(capsys, "--teacher", "llama-3.1-8b", flag, PIPELINED,
                    "--modes", "disaggregated")
    layout = out["plans"]["disaggregated"]["layout"]
    assert (layout["tp"], layout["pp"], layout["vp"], layout["dp"]) == (2, 2, 2, 2)
    assert layout["sequence_parallel"] is True
    assert (layout["recompute"], layout["recompute_method"], layout["recompute_num_layers"]) == (
        "full", "block", 2)
    # 1F1B would idle (p-1)/m = 1/16; two virtual stages halve it
    assert out["plans"]["disaggregated"]["bubble"] == 1 / 32
    # the command line wins: selective instead of the launch's full block recompute, and the
    # number of virtual stages instead of layers per virtual stage
    out = _run_json(capsys, "--teacher", "llama-3.1-8b", flag, PIPELINED, "--modes",
                    "disaggregated", "--recompute-granularity", "selective",
                    "--num-virtual-stages-per-pipeline-rank", "4")
    layout = out["plans"]["disaggregated"]["layout"]
    assert (layout["recompute"], layout["recompute_method"], layout["vp"]) == (
        "selective", "uniform", 4)


@pytest.mark.parametrize(
    "argv, match",
    [
        # 32 layers over 3 stages of 2 virtual stages: not whole layers per virtual stage
        (["--pipeline-model-parallel-size", "3", "--num-virtual-stages-per-pipeline-rank", "2",
          "--tensor-model-parallel-size", "1", "--nodes", "3", "--gpus-per-node", "1",
          "--global-batch-size", "3"],
         "pipeline-parallel size 3 x 2 virtual stages does not divide num_layers=32"),
        # tp 2 x pp 4 on 8 GPUs: dp 1, G=6: m=6 micro-batches, not a multiple of pp=4
        (["--pipeline-model-parallel-size", "4", "--tensor-model-parallel-size", "2",
          "--num-virtual-stages-per-pipeline-rank", "2", "--global-batch-size", "6"],
         "6 microbatches a step \\(per data-parallel rank\\) is not a multiple of it"),
        (["--recompute-granularity", "full", "--recompute-method", "uniform",
          "--recompute-num-layers", "3", "--tensor-model-parallel-size", "1",
          "--pipeline-model-parallel-size", "1"],
         "--recompute-num-layers 3 does not divide the layers of a model chunk \\(32\\)"),
        (["--recompute-method", "block"],
         "need recompute='full' \\(Megatron's --recompute-granularity full\\)"),
        # Megatron-Core 0.16.1 splits no Gated DeltaNet layer over context-parallel ranks
        (["--context-parallel-size", "2"], "GatedDeltaNet has no context parallelism"),
        (["--num-virtual-stages-per-pipeline-rank", "2",
          "--num-layers-per-virtual-pipeline-stage", "4"], "give one of them"),
        (["--num-virtual-stages-per-pipeline-rank", "2", "--pipeline-model-parallel-size", "1"],
         "2 virtual pipeline stages per rank need --pipeline-model-parallel-size > 1"),
        # 32 layers, pp=2, 16 layers per virtual stage: one chunk per rank
        (["--num-layers-per-virtual-pipeline-stage", "16", "--pipeline-model-parallel-size", "2"],
         "more than one virtual stage of whole layers per rank"),
    ],
)
def test_cli_refuses_layouts_megatron_core_refuses(capsys, argv, match):
    base = ["plan", "--teacher", "qwen3.5-35b-a3b", "--student", "qwen3.5-9b", "--gpu",
            "h200-141g", "--seq-length", "8192", "--modes", "offline-cache"]
    assert main(base + argv) == 2
    err = capsys.readouterr().err
    assert re.search(match, err), err


DISAGGKD_PAIR = ["plan", "--teacher", "qwen3.5-35b-a3b", "--student", "qwen3.5-9b", "--gpu",
                 "h200-141g", "--nodes", "1", "--seq-length", "8192", "--global-batch-size", "64",
                 "--use-distributed-optimizer"]


#: The columns of the "what the options buy" table: (name, end) after the 3-space indent and the
#: 44-wide label, as ``cli.format_options`` prints them.
_COLUMNS = (("peak", 56), ("delta_gib", 64), ("step", 72), ("delta_step", 80), ("bubble", 88),
            ("tp_s", 95), ("p2p_s", 102), ("cp_s", 109), ("fits", None))


def _options_table(text: str) -> dict[str, dict[str, str]]:
    """The "what the options buy" table of ``megatron-kd plan``'s output, by option label."""
    rows = {}
    for line in text.split("what the options buy", 1)[1].splitlines()[2:]:
        start, cells = 47, {}
        for name, end in _COLUMNS:
            cells[name] = line[start:end].strip()
            start = end
        rows[line[:47].strip()] = cells
    return rows


def test_disaggkd_pair_plan(capsys):
    # docs/planner.md's plan: Qwen3.5-35B-A3B -> Qwen3.5-9B, 8K tokens, one H200 node.
    assert main(DISAGGKD_PAIR) == 0
    text = capsys.readouterr().out
    assert "recommendation: disaggregated" in text
    student = text.split("== disaggregated", 1)[1].splitlines()[1]
    # the 9B student fits on one GPU's share without model parallelism or recompute (111 of 140
    # GiB): tensor parallelism would buy memory it does not need, at the cost of its collectives
    assert "student: tp=1 pp=1 vp=1 dp=8" in student and "recompute=none" in student
    rows = _options_table(text)
    chosen = rows["chosen: tp=1 pp=1 recompute=none"]
    assert chosen["fits"] == "yes" and chosen["bubble"] == "0.0%"
    for label in ("recompute full uniform x1", "pp=2 vp=1", "pp=2 vp=2", "tp=2 +SP"):
        assert float(rows[label]["peak"]) < float(chosen["peak"]), label  # each buys memory ...
    # ... full recompute costs compute (every layer's forward again: over a fifth more) ...
    assert float(rows["recompute full uniform x1"]["step"]) > 1.2 * float(chosen["step"])
    # ... a pipeline its bubble, halved by each doubling of the virtual stages ((p-1)/(v*m),
    # m = 64/4 = 16) ...
    assert [rows[f"pp=2 vp={v}"]["bubble"] for v in (1, 2, 4, 8, 16)] == [
        "6.2%", "3.1%", "1.6%", "0.8%", "0.4%"]
    # ... which cost activation memory on the first stage, L(1 + (p-1)/(p*v)) layers' worth ...
    assert float(rows["pp=2 vp=2"]["peak"]) > float(rows["pp=2 vp=4"]["peak"]) > float(
        rows["pp=2 vp=1"]["peak"])
    # ... and TP + SP costs collectives the step time does not count
    assert rows["tp=2 +SP"]["step"] == chosen["step"] and float(rows["tp=2 +SP"]["tp_s"]) > 0


def test_cli_from_args_precedence(capsys):
    # the command line's --tensor-model-parallel-size wins over the launch's
    out = _run_json(
        capsys,
        "--teacher",
        "llama-3.1-8b",
        "--from-args",
        LAUNCH,
        "--tensor-model-parallel-size",
        "4",
        "--modes",
        "colocated-fused",
    )
    plan = out["plans"]["colocated-fused"]
    assert plan["layout"]["tp"] == 4 and plan["layout"]["recompute"] == "selective"
    assert out["student"]["name"] == "from-args" and out["ignored_launch_flags"] == [
        "--lr",
        "--data-path",
    ]
    assert (
        main(
            [
                "plan",
                "--teacher",
                "llama-3.1-8b",
                "--student",
                "llama-3.2-1b",
                "--from-args",
                LAUNCH,
            ]
        )
        == 2
    )
    assert "give one of them" in capsys.readouterr().err


def test_planner_never_imports_torch():
    code = (
        "import sys; from megatron_kd.cli import main; "
        "main(['plan', '--teacher', 'qwen3-8b', '--student', 'llama-3.2-1b', '--json']); "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


def _plan_examples():
    path = pathlib.Path(__file__).resolve().parents[2] / "tools" / "plan_examples.py"
    spec = importlib.util.spec_from_file_location("plan_examples", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    try:
        spec.loader.exec_module(module)
    finally:
        sys.modules.pop(spec.name, None)
    return module


def test_long_context_examples_are_the_cli_plans(capsys):
    """tools/plan_examples.py's long-context rows: each is its printed `megatron-kd plan`
    command's plan, and the layouts say what docs/planner.md says of them."""
    pe = _plan_examples()
    rows = {}
    for sc in pe.LONG_CONTEXT:
        opts = sc.options()
        rows[(sc.student, sc.seq_length)] = {"command": sc.command(),
                                             "plan": to_json(plan_all(opts), opts, [])}
    assert set(rows) == {("llama-3.2-3b", 8192), ("llama-3.2-3b", 32768),
                         ("qwen3-30b-a3b", 32768), ("qwen3.5-9b", 32768)}
    # the mixture-of-experts row through the CLI itself: the same peak and layout in every mode
    row = rows[("qwen3-30b-a3b", 32768)]
    argv = row["command"].split()[2:]  # after "megatron-kd plan"
    cli = _run_json(capsys, *argv)
    for mode, plan in row["plan"]["plans"].items():
        assert cli["plans"][mode]["total_bytes"] == plan["total_bytes"], mode
        assert cli["plans"][mode]["layout"] == plan["layout"], mode
    plans = row["plan"]["plans"]
    # 4 sequences a step on 8 GPUs: the offline and disaggregated students share each sequence
    # over context-parallel ranks (p2p), and hold their experts over 8 expert-parallel ranks
    for mode in ("offline-cache", "disaggregated"):
        layout = plans[mode]["layout"]
        assert plans[mode]["fits"] and layout["cp"] > 1 and layout["cp_comm_type"] == "p2p", mode
        assert layout["ep"] == 8, mode
    # colocated, the teacher's 4 key/value groups bound the tensor-parallel size of the
    # student's groups to 4: the fused loss fits there only with full recompute, the dense
    # loss not at all
    fused = plans["colocated-fused"]
    assert fused["fits"] and fused["layout"]["tp"] <= 4 and fused["layout"]["recompute"] == "full"
    assert not plans["colocated-dense"]["fits"]
    # one H200 at 32K: the dense loss does not fit the 3B student even with full recompute
    llama = rows[("llama-3.2-3b", 32768)]["plan"]["plans"]
    assert not llama["colocated-dense"]["fits"]
    assert llama["colocated-dense"]["layout"]["recompute"] == "full"
    assert all(p["layout"]["cp"] == 1 for p in llama.values())  # one GPU: nothing to split over
    # a Gated DeltaNet student is never split over context-parallel ranks
    qwen = rows[("qwen3.5-9b", 32768)]["plan"]["plans"]
    assert all(p["layout"]["cp"] == 1 for p in qwen.values())
