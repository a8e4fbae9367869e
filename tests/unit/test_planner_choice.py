"""How the planner chooses among layouts it can evaluate: the headroom it keeps, the distributed
optimizer it considers, an alternative better on both axes taken over the search's first choice,
a reason for each lever, and the replica shape of the teacher job (figures derived by hand)."""

from __future__ import annotations

import dataclasses

import pytest

from megatron_kd.planner.launch import teacher_job_shape
from megatron_kd.planner.options import choose, layout_options, plan_all
from megatron_kd.planner.plan import Mode, PlanOptions
from megatron_kd.planner.presets import MODEL_PRESETS, get_gpu, get_link
from megatron_kd.planner.search import evaluate, plan_mode


def _opts(**kw):
    gpu = get_gpu("h200-141g")
    values = dict(student=MODEL_PRESETS["qwen3.5-9b"], teacher=MODEL_PRESETS["qwen3.5-35b-a3b"],
                  gpu=gpu, inter_node_link=get_link("ib-400g", gpu), nodes=2,
                  seq_length=32768, global_batch_size=128)
    values.update(kw)
    return PlanOptions(**values)


def test_headroom_is_kept():
    opts = _opts(headroom=0.10)
    assert opts.usable_bytes == pytest.approx(0.9 * get_gpu("h200-141g").memory_bytes)
    plan = plan_all(opts, (Mode.DISAGGREGATED,)).plans[Mode.DISAGGREGATED]
    assert plan.fits and plan.total_bytes <= opts.usable_bytes
    # the same layout against a headroom it exceeds: does not fit
    tight = _opts(headroom=1 - plan.total_bytes / opts.gpu.memory_bytes + 0.001)
    assert not evaluate(tight, Mode.DISAGGREGATED, plan.layout).fits
    with pytest.raises(ValueError, match="headroom must be in"):
        _opts(headroom=1.0)


def test_distributed_optimizer_on_where_data_parallel():
    plan = plan_mode(_opts(), Mode.DISAGGREGATED)
    assert plan.layout.dp > 1 and plan.layout.use_distributed_optimizer
    off = plan_mode(_opts(use_distributed_optimizer=False), Mode.DISAGGREGATED)
    assert not off.layout.use_distributed_optimizer
    # Adam's 12 bytes a parameter, sharded dp ways when on
    on_state = dict(evaluate(_opts(), Mode.DISAGGREGATED,
                             dataclasses.replace(off.layout, use_distributed_optimizer=True))
                    .terms)
    off_state = dict(off.terms)
    name = next(t for t in off_state if t.label == "optimizer (Adam)")
    assert on_state[name] == pytest.approx(off_state[name] / off.layout.dp, rel=1e-3)


def test_an_alternative_better_on_both_axes_replaces_the_first_choice():
    # without the distributed optimizer or headroom, the search's order (smallest t*p first)
    # picks tp=2 pp=2 vp=2 at 140.0 of 140.4 GiB; its own table shows layouts with less memory
    # and a shorter step
    opts = _opts(use_distributed_optimizer=False, headroom=0.0)
    first = plan_mode(opts, Mode.DISAGGREGATED)
    assert (first.layout.tp, first.layout.pp, first.layout.vp) == (2, 2, 2)
    dominating = [r for r in layout_options(opts, first)[1:]
                  if r.fits and r.total_bytes < first.total_bytes
                  and r.step_time_s < first.step_time_s]
    assert dominating
    chosen = choose(opts, first)
    assert chosen.layout != first.layout
    assert chosen.total_bytes < first.total_bytes and chosen.step_time_s < first.step_time_s
    assert any(note.startswith("took ") for note in chosen.notes)
    # and nothing in the chosen layout's table is better on both
    rows = layout_options(opts, chosen)
    assert not [r for r in rows[1:] if r.fits and r.total_bytes < chosen.total_bytes
                and r.step_time_s < chosen.step_time_s]


def test_a_given_setting_is_not_changed():
    opts = _opts(use_distributed_optimizer=False, headroom=0.0, tp=2, pp=2, vp=2)
    plan = plan_all(opts, (Mode.DISAGGREGATED,)).plans[Mode.DISAGGREGATED]
    assert (plan.layout.tp, plan.layout.pp, plan.layout.vp) == (2, 2, 2)
    assert "tensor parallelism: tp=2 +SP, as given" in plan.levers
    assert "pipeline stages: pp=2 vp=2, as given" in plan.levers
    assert "distributed optimizer: off, as given" in plan.levers


def test_each_lever_has_a_reason():
    plan = plan_all(_opts(), (Mode.DISAGGREGATED,)).plans[Mode.DISAGGREGATED]
    heads = [line.split(":")[0] for line in plan.levers]
    assert heads == ["tensor parallelism", "pipeline stages", "context parallelism",
                     "recompute", "distributed optimizer"]
    cp = plan.levers[2]
    assert "Gated DeltaNet" in cp and "context-parallel ranks" in cp
    # a dense student may split the sequence: the reason is then what cp=2 would cost
    dense = plan_all(_opts(student=MODEL_PRESETS["llama-3.2-3b"],
                           teacher=MODEL_PRESETS["llama-3.1-8b"], nodes=1, seq_length=8192),
                     (Mode.DISAGGREGATED,)).plans[Mode.DISAGGREGATED]
    assert dense.levers[2].startswith("context parallelism: cp=1; not cp=2 (")
    assert "GiB" in dense.levers[2] and "step time" in dense.levers[2]


@pytest.mark.parametrize("replicas, ranks, gpus, want", [
    (3, 1, 8, (3, 1, 3)),     # three one-GPU replicas on one node
    (8, 1, 8, (8, 1, 8)),
    (10, 1, 8, (16, 2, 8)),   # 10 -> two whole nodes of 8
    (3, 4, 8, (4, 2, 8)),     # two 4-GPU replicas a node: 3 -> 4 on 2 nodes
    (2, 16, 8, (2, 4, 8)),    # a replica over 2 nodes: 2 replicas, 4 nodes
    (1, 16, 16, (1, 1, 16)),
])
def test_teacher_job_shape(replicas, ranks, gpus, want):
    assert teacher_job_shape(replicas, ranks, gpus) == want


def test_teacher_job_shape_refuses_a_replica_of_part_nodes():
    with pytest.raises(ValueError, match="12 ranks is not whole nodes of 8"):
        teacher_job_shape(1, 12, 8)
