"""Megatron-Core's ``parallel_state`` on each side of a split student/teacher world (gloo)."""

import torch
import torch.distributed as dist

from megatron_kd.integration.groups import initialize_model_parallel_split
from megatron_kd.parallel import DisaggTopology


def _split_state(ctx, world, teacher_world, s_tp, s_pp, t_tp, t_pp):
    from megatron.core import parallel_state as ps

    from megatron_kd.integration.cpu_shim import install_cpu_shim

    install_cpu_shim()
    topo = DisaggTopology.from_world(world_size=world, teacher_world_size=teacher_world,
                                     student_tp=s_tp, student_pp=s_pp, teacher_tp=t_tp,
                                     teacher_pp=t_pp)
    try:
        side = initialize_model_parallel_split(topo)
        r = dist.get_rank()
        t = torch.tensor([float(r)])
        dist.all_reduce(t, group=ps.get_tensor_model_parallel_group())
        d = torch.tensor([1.0])
        dist.all_reduce(d, group=ps.get_data_parallel_group())
        return {"side": side, "tp_sum": t.item(), "dp_count": d.item(),
                "tp": ps.get_tensor_model_parallel_world_size(),
                "pp": ps.get_pipeline_model_parallel_world_size(),
                "pp_ranks": list(ps._PIPELINE_GLOBAL_RANKS),
                "last": ps.is_pipeline_last_stage()}
    finally:
        ps.destroy_model_parallel()


def test_megatron_state_describes_each_side(dist_pool_factory):
    pool = dist_pool_factory(4)
    # student TP2 on ranks 0-1, teacher PP2 on ranks 2-3
    res = pool.run(_split_state, 4, 2, 2, 1, 1, 2)
    assert [r["side"] for r in res] == ["student", "student", "teacher", "teacher"]
    assert [r["tp_sum"] for r in res] == [1.0, 1.0, 2.0, 3.0]
    assert [r["dp_count"] for r in res] == [1.0] * 4
    assert [(r["tp"], r["pp"]) for r in res] == [(2, 1), (2, 1), (1, 2), (1, 2)]
    assert [r["pp_ranks"] for r in res] == [[0], [1], [2, 3], [2, 3]]
    assert [r["last"] for r in res] == [True, True, False, True]
    # student DP2 on ranks 0-1, one teacher rank: DP groups stay within the student
    res = pool.run(_split_state, 4, 1, 1, 1, 1, 1)
    assert [r["dp_count"] for r in res] == [3.0, 3.0, 3.0, 1.0]
