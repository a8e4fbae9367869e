"""The parallel layout and its rules (no process group): :class:`ParallelLayout` and
:func:`megatron_kd.arch.check_layout`, one rule at a time, for each role.

Every expected size is worked out by hand in the comments; the messages are matched on the
flags and values they must name.
"""

import dataclasses

import pytest
from support.archs import tiny_arch

from megatron_kd.arch import Role, check_layout, context_parallel_limit
from megatron_kd.parallel import ParallelLayout, pad_vocab_size
from megatron_kd.parallel.sequence import check_sequence_split, sequence_parts

# tiny_arch: 2 layers, hidden 32, 4 heads, 2 key/value groups, MLP 64, vocabulary 500 in 512 rows
MOE = tiny_arch(num_experts=4, moe_ffn_hidden_size=12)
HYBRID = tiny_arch(linear_attention_layers=[0], linear_num_key_heads=2, linear_num_value_heads=4,
                   linear_key_head_dim=8, linear_value_head_dim=8)


# --- the layout type ------------------------------------------------------------------------------


def test_layout_sizes_and_defaults():
    layout = ParallelLayout(tp=2, pp=2, vp=2, cp=2, dp=3)
    assert layout.world_size == 24 and layout.model_parallel_size == 4
    assert layout.optimizer_shards == 6 and layout.local_tokens(8, 2) == 8.0
    # Megatron's --expert-tensor-parallel-size defaults to the tensor-parallel size
    assert layout.expert_tp == 2 and ParallelLayout(tp=2, etp=1).expert_tp == 1
    assert layout.virtual_stages == 2 and ParallelLayout(pp=2).virtual_stages is None
    # sequence parallelism is off at tp 1, as Megatron-LM turns it off
    assert ParallelLayout(sequence_parallel=True) == ParallelLayout()
    assert ParallelLayout(tp=2, sequence_parallel=True).sequence_parallel


def test_layout_from_the_world_and_of_one_model():
    assert ParallelLayout.from_world(8, tp=2, pp=2).dp == 2
    assert ParallelLayout.from_world(12, tp=2, cp=3).dp == 2
    with pytest.raises(ValueError, match="world size 6 is not divisible by "
                       "tensor-model-parallel-size 4 x pipeline-model-parallel-size 1$"):
        ParallelLayout.from_world(6, tp=4)
    with pytest.raises(ValueError, match="world size 2 is not divisible by "
                       "tensor-model-parallel-size 1 x pipeline-model-parallel-size 1 x "
                       "context-parallel-size 3"):
        ParallelLayout.from_world(2, cp=3)
    # experts over 4 ranks at tp 1, etp 1: 4 data-parallel ranks at the least (4 | 1 * dp)
    assert ParallelLayout.of_model(ep=4, etp=1).dp == 4
    # tp 2 x ep 2 x etp 1: 2 | 2 * dp already at dp 1
    assert ParallelLayout.of_model(tp=2, ep=2, etp=1).dp == 1
    assert ParallelLayout.of_model(tp=2).dp == 1


@pytest.mark.parametrize("sizes, match", [
    ({"tp": 0}, "ParallelLayout.tp must be a positive int, got 0"),
    ({"vp": 2}, "2 virtual pipeline stages per rank need --pipeline-model-parallel-size > 1"),
    ({"recompute": "selective", "recompute_method": "block"}, "apply to full recompute only"),
    ({"recompute": "full", "recompute_method": "chunk"}, "recompute_method='chunk'"),
    ({"recompute": "some"}, "recompute='some'"),
    ({"cp": 2, "cp_comm_type": "ring"}, "cp_comm_type='ring'"),
    # Megatron's expert grid: ep x etp divides each pipeline stage's tp x cp x dp ranks
    ({"tp": 2, "dp": 2, "ep": 3, "etp": 1}, "expert-model-parallel-size 3 x "
                                            "expert-tensor-parallel-size 1 does not divide the 4 "
                                            "ranks of a pipeline stage"),
    ({"cp": 2, "ep": 4, "etp": 1}, "does not divide the 2 ranks"),
])
def test_layout_refuses_what_no_model_runs(sizes, match):
    with pytest.raises(ValueError, match=match):
        ParallelLayout(**sizes)


def test_colocated_layout_keeps_the_groups_without_the_pipeline():
    student = ParallelLayout(tp=2, pp=4, vp=2, cp=2, dp=3, ep=2, etp=1, sequence_parallel=True,
                             use_distributed_optimizer=True, recompute="full",
                             recompute_method="block", recompute_num_layers=1)
    teacher = student.colocated()
    assert (teacher.tp, teacher.pp, teacher.vp, teacher.cp, teacher.dp, teacher.ep,
            teacher.etp) == (2, 1, 1, 2, 3, 2, 1)
    assert teacher.sequence_parallel and not teacher.use_distributed_optimizer
    assert teacher.recompute == "none"


# --- the rules ------------------------------------------------------------------------------------


def test_tensor_rule_names_every_width_it_does_not_divide():
    check_layout(tiny_arch(), ParallelLayout(tp=2))
    with pytest.raises(ValueError, match="tensor-parallel size 4 does not divide "
                                         "num_query_groups=2$"):
        check_layout(tiny_arch(), ParallelLayout(tp=4))
    with pytest.raises(ValueError, match="tensor-parallel size 3 does not divide "
                                         "num_attention_heads=4, num_query_groups=2, "
                                         "ffn_hidden_size=64$"):
        check_layout(tiny_arch(padded_vocab_size=513), ParallelLayout.of_model(tp=3),
                     role=Role.FROZEN)
    # the vocabulary rows first: every role holds the output layer's shard
    with pytest.raises(ValueError, match="tensor-parallel size 3 does not divide "
                                         "padded_vocab_size=512"):
        check_layout(tiny_arch(), ParallelLayout(tp=3))
    # experts split over the expert-tensor size: 12 / 8 is not whole
    with pytest.raises(ValueError, match="expert-tensor-parallel size 8 does not divide "
                                         "moe_ffn_hidden_size=12"):
        check_layout(dataclasses.replace(MOE, num_attention_heads=8, num_query_groups=8,
                                         hidden_size=64),
                     ParallelLayout(tp=8, sequence_parallel=True), role=Role.FROZEN)
    assert pad_vocab_size(500, 2) == 512 and pad_vocab_size(49152, 2) == 49152


def test_output_layer_role_checks_the_vocabulary_only():
    # a served teacher's heads need not divide the student's tp: the student holds only its
    # output layer (512 rows over 4 ranks)
    check_layout(tiny_arch(num_attention_heads=2, num_query_groups=1), ParallelLayout(tp=4),
                 role=Role.TEACHER_OUTPUT_LAYER)
    with pytest.raises(ValueError, match="tensor-parallel size 3 does not divide "
                                         "padded_vocab_size=512"):
        check_layout(tiny_arch(), ParallelLayout(tp=3), role=Role.TEACHER_OUTPUT_LAYER)


def test_pipeline_rule_every_stage_the_same_layers():
    check_layout(tiny_arch(num_layers=8), ParallelLayout(pp=2, vp=2), num_microbatches=4)
    with pytest.raises(ValueError, match="pipeline-parallel size 3 does not divide "
                                         "num_layers=4"):
        check_layout(tiny_arch(num_layers=4), ParallelLayout(pp=3))
    with pytest.raises(ValueError, match="pipeline-parallel size 2 x 3 virtual stages does not "
                                         "divide num_layers=8"):
        check_layout(tiny_arch(num_layers=8), ParallelLayout(pp=2, vp=3))
    # the interleaved schedule takes the micro-batches in groups of pp: 3 is not a multiple of
    # 2, and 1 is fewer than a group
    for m in (3, 1):
        with pytest.raises(ValueError, match=f"{m} microbatches a step .* is not a multiple"):
            check_layout(tiny_arch(num_layers=8), ParallelLayout(pp=2, vp=2),
                         num_microbatches=m)
    check_layout(tiny_arch(num_layers=8), ParallelLayout(pp=2), num_microbatches=3)  # 1F1B


def test_expert_rules():
    check_layout(MOE, ParallelLayout(dp=2, ep=2, etp=1))
    with pytest.raises(ValueError, match="expert-parallel size 4 does not divide num_experts=6"):
        check_layout(dataclasses.replace(MOE, num_experts=6), ParallelLayout(dp=4, ep=4, etp=1))
    with pytest.raises(ValueError, match="--expert-model-parallel-size 2 needs a "
                                         "mixture-of-experts model: neither the student nor a "
                                         "colocated teacher has experts"):
        check_layout(tiny_arch(), ParallelLayout(dp=2, ep=2, etp=1))
    # a dense student beside a colocated mixture-of-experts teacher: the run's experts are its;
    # a dense teacher beside a mixture-of-experts student takes the student's expert groups
    check_layout(tiny_arch(), ParallelLayout(dp=2, ep=2, etp=1), colocated_teacher=MOE)
    check_layout(MOE, ParallelLayout(dp=2, ep=2, etp=1), colocated_teacher=tiny_arch())
    with pytest.raises(ValueError, match="the teacher replica has no experts"):
        check_layout(tiny_arch(), ParallelLayout(tp=2, ep=2, etp=1),
                     role=Role.TEACHER_REPLICA)
    # experts with biases only at expert-tensor size 1 (every role: a Megatron-Core assertion)
    biased = dataclasses.replace(MOE, add_bias_linear=True)
    with pytest.raises(ValueError, match="need --expert-tensor-parallel-size 1 .*got 2 \\(the "
                                         "default is the tensor-parallel size\\)"):
        check_layout(biased, ParallelLayout(tp=2), role=Role.FROZEN)
    check_layout(biased, ParallelLayout(tp=2, etp=1), role=Role.FROZEN)


def test_context_parallel_rules():
    check_layout(tiny_arch(), ParallelLayout(cp=4))  # softmax attention splits over any cp
    check_layout(HYBRID, ParallelLayout())
    assert context_parallel_limit(tiny_arch()) is None
    assert "does not split over context-parallel ranks" in context_parallel_limit(HYBRID)
    with pytest.raises(ValueError, match=r"^--context-parallel-size 2 with a Gated DeltaNet "
                                         r"student \(layers \[0\]\): a Gated DeltaNet "
                                         r"recurrence runs .* no context parallelism.*; use "
                                         r"--context-parallel-size 1$"):
        check_layout(HYBRID, ParallelLayout(cp=2))
    # each role says what its command offers instead
    for role, advice in ((Role.TEACHER_REPLICA, "serve it at --context-parallel-size 1"),
                         (Role.CACHE_TEACHER, "build the cache at --context-parallel-size 1")):
        with pytest.raises(ValueError, match=f"Gated DeltaNet teacher .*; {advice}$"):
            check_layout(HYBRID, ParallelLayout(cp=2), role=role)
    with pytest.raises(ValueError, match=r"^the colocated teacher: --context-parallel-size 4 "
                                         r"with a colocated Gated DeltaNet teacher \(layers "
                                         r"\[0\]\): it runs with the student's context "
                                         r"parallelism.*or cache it \(--kd-mode offline\)$"):
        check_layout(tiny_arch(), ParallelLayout(cp=4), colocated_teacher=HYBRID)


def test_transformer_engine_context_parallel_exchange():
    sinks = tiny_arch(attention_sinks=True)
    # megatron_kd's own attention gathers K and V: any exchange
    check_layout(sinks, ParallelLayout(cp=2))
    with pytest.raises(ValueError, match="--cp-comm-type p2p: Transformer Engine runs attention "
                                         "sinks and sliding windows with context parallelism "
                                         "only as a2a"):
        check_layout(sinks, ParallelLayout(cp=2), transformer_engine=True)
    check_layout(sinks, ParallelLayout(cp=2, cp_comm_type="a2a"), transformer_engine=True)
    # a2a scatters heads: 4 heads / tp 2 = 2 per rank, 1 key/value group: not over cp 2
    with pytest.raises(ValueError, match="the 2 heads and 1 key/value groups per "
                                         "tensor-parallel rank must divide by it"):
        check_layout(tiny_arch(), ParallelLayout(tp=2, cp=2, cp_comm_type="a2a"),
                     transformer_engine=True)


@pytest.mark.parametrize("seq, tp, cp, sp, parts, message", [
    (12, 2, 1, False, 1, None),  # without SP the sequence is not split over TP
    (12, 2, 1, True, 2, None),
    (13, 2, 1, True, 2, "--seq-length 13 is not divisible by --tensor-model-parallel-size 2 "
                        "(--sequence-parallel) = 2: each sequence is split over those ranks"),
    (12, 1, 3, False, 6, None),
    (12, 2, 3, True, 12, None),
    (18, 3, 2, False, 4, "--seq-length 18 is not divisible by 2 x --context-parallel-size 2 = 4"),
    (24, 3, 2, True, 12, None),
    (36, 2, 2, True, 8, "--seq-length 36 is not divisible by 2 x --context-parallel-size 2 x "
                        "--tensor-model-parallel-size 2 (--sequence-parallel) = 8"),
])
def test_sequence_split_rule(seq, tp, cp, sp, parts, message):
    assert sequence_parts(tp=tp, cp=cp, sequence_parallel=sp) == parts
    layout = ParallelLayout.of_model(tp=tp, cp=cp, sequence_parallel=sp)
    arch = tiny_arch(num_attention_heads=6, num_query_groups=6, hidden_size=36, ffn_hidden_size=72,
                     padded_vocab_size=504)
    if message is None:
        check_sequence_split(seq, tp=tp, cp=cp, sequence_parallel=sp)
        check_layout(arch, layout, role=Role.FROZEN, seq_length=seq)
        return
    for check in (lambda: check_sequence_split(seq, tp=tp, cp=cp, sequence_parallel=sp),
                  lambda: check_layout(arch, layout, role=Role.FROZEN, seq_length=seq)):
        with pytest.raises(ValueError) as e:
            check()
        assert str(e.value).startswith(message)


def test_training_rules():
    # a mixture-of-experts or Gated DeltaNet student at tp > 1 trains with sequence parallelism
    for arch, what in ((MOE, "mixture-of-experts"), (HYBRID, "Gated DeltaNet")):
        with pytest.raises(ValueError, match=f"a {what} student .*--tensor-model-parallel-size "
                                             f"2 needs --sequence-parallel"):
            check_layout(arch, ParallelLayout(tp=2, etp=1))
        check_layout(arch, ParallelLayout(tp=2, etp=1, sequence_parallel=True))
        # frozen, the same model needs none (Megatron-Core refuses it in training only)
        check_layout(arch, ParallelLayout(tp=2, etp=1), role=Role.TEACHER_REPLICA)
    with pytest.raises(ValueError, match="mixture-of-experts student with --add-bias-linear"):
        check_layout(dataclasses.replace(MOE, add_bias_linear=True), ParallelLayout())


def test_recompute_rules_fit_the_model_chunks():
    arch = tiny_arch(num_layers=8)  # chunks of 8 layers at pp 1
    check_layout(arch, ParallelLayout(recompute="full", recompute_method="block",
                                      recompute_num_layers=3))
    check_layout(arch, ParallelLayout(recompute="full", recompute_num_layers=4))
    # uniform groups of 3 do not divide chunks of 8 (Megatron-Core would index past the chunk)
    with pytest.raises(ValueError, match="--recompute-num-layers 3 does not divide the layers "
                                         "of a model chunk \\(8\\)"):
        check_layout(arch, ParallelLayout(recompute="full", recompute_num_layers=3))
    # pp 2 x vp 2: chunks of 2 layers; block recomputes at most a chunk
    with pytest.raises(ValueError, match="between 1 and the layers of a model chunk \\(2\\)"):
        check_layout(arch, ParallelLayout(pp=2, vp=2, recompute="full", recompute_method="block",
                                          recompute_num_layers=3), num_microbatches=2)


def test_role_rules():
    # a replica is one model's ranks: no data parallelism (each replica fails alone)
    check_layout(tiny_arch(), ParallelLayout(tp=2, pp=2), role=Role.TEACHER_REPLICA)
    with pytest.raises(ValueError, match="a teacher replica's world is its TP x PP x CP \\(2 x 1 "
                                         "x 1 = 2\\), got 4 ranks"):
        check_layout(tiny_arch(), ParallelLayout(tp=2, dp=2), role=Role.TEACHER_REPLICA)
    # a cache build runs no pipeline, and keeps its experts inside its tensor-parallel group
    check_layout(MOE, ParallelLayout(tp=2, dp=3, ep=2, etp=1), role=Role.CACHE_TEACHER)
    with pytest.raises(ValueError, match="cache build runs the teacher without a pipeline"):
        check_layout(tiny_arch(), ParallelLayout(pp=2), role=Role.CACHE_TEACHER)
    for role in (Role.TEACHER_REPLICA, Role.CACHE_TEACHER):
        # 2 experts ranks x 1 over tp 1 and dp 2: the grid folds them over data parallelism,
        # which a replica or a cache build's copies cannot share
        layout = ParallelLayout(dp=2, ep=2, etp=1) if role is Role.CACHE_TEACHER else \
            ParallelLayout(tp=1, cp=2, ep=2, etp=1)
        with pytest.raises(ValueError, match="--expert-model-parallel-size 2 x "
                                             "--expert-tensor-parallel-size 1 must divide "
                                             "--tensor-model-parallel-size 1"):
            check_layout(MOE, layout, role=role)
    # a colocated teacher is whole on the last stage
    with pytest.raises(ValueError, match="whole on the student's last pipeline stage"):
        check_layout(tiny_arch(), ParallelLayout(pp=2), role=Role.COLOCATED_TEACHER)
    with pytest.raises(ValueError, match="a colocated teacher runs beside a student"):
        check_layout(tiny_arch(), ParallelLayout(), role=Role.FROZEN,
                     colocated_teacher=tiny_arch())
