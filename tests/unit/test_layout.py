"""Rank arithmetic of split student/teacher worlds (pure: no process group)."""

import pytest

from megatron_kd.parallel import DisaggTopology, Layout


@pytest.mark.parametrize("tp,pp,world", [(1, 1, 4), (2, 1, 4), (2, 2, 8), (1, 2, 6), (4, 2, 16)])
def test_layout_matches_megatron_rank_generator(tp, pp, world):
    from megatron.core.parallel_state import RankGenerator

    lay = Layout(world_size=world, tp=tp, pp=pp)
    gen = RankGenerator(tp=tp, ep=1, dp=lay.dp, pp=pp, cp=1, order="tp-cp-ep-dp-pp")
    tp_groups = sorted(gen.get_ranks("tp"))
    pp_groups = sorted(gen.get_ranks("pp"))
    ours_tp = sorted(lay.tp_group_ranks(dp_rank=d, pp_rank=p)
                     for d in range(lay.dp) for p in range(pp))
    ours_pp = sorted(lay.pp_group_ranks(tp_rank=t, dp_rank=d)
                     for t in range(tp) for d in range(lay.dp))
    assert ours_tp == tp_groups and ours_pp == pp_groups
    for r in range(world):
        t, d, p = lay.coords(r)
        assert lay.rank_of(tp_rank=t, dp_rank=d, pp_rank=p) == r


def test_routes_teacher_one_rank_student_tp2():
    topo = DisaggTopology.from_world(world_size=3, teacher_world_size=1, student_tp=2)
    assert [(r.teacher_rank, r.student_rank, r.chunk) for r in topo.routes] == [(2, 0, 0),
                                                                              (2, 1, 1)]
    assert topo.side(0) == "student" and topo.side(2) == "teacher"


def test_routes_teacher_pp2_student_tp2_use_the_last_teacher_stage():
    topo = DisaggTopology.from_world(world_size=4, teacher_world_size=2, student_tp=2,
                                     teacher_pp=2)
    assert {r.teacher_rank for r in topo.routes} == {3}  # teacher stage 1 is global rank 3
    assert [r.student_rank for r in topo.routes] == [0, 1]


def test_one_replica_serves_two_student_dp_ranks():
    topo = DisaggTopology.from_world(world_size=3, teacher_world_size=1)
    assert topo.student.dp == 2 and topo.teacher.dp == 1
    assert topo.students_of(0) == [0, 1]
    assert [(r.teacher_rank, r.student_rank, r.student_dp_rank) for r in topo.routes] == [
        (2, 0, 0), (2, 1, 1)]


def test_replicas_spread_over_student_dp_and_teacher_tp():
    # student tp2 dp2 (ranks 0-3), teacher tp2 dp2 (ranks 4-7)
    topo = DisaggTopology.from_world(world_size=8, teacher_world_size=4, student_tp=2,
                                     teacher_tp=2)
    got = [(r.student_rank, r.teacher_rank, r.chunk) for r in topo.routes]
    assert got == [(0, 4, 0), (1, 5, 1), (2, 6, 0), (3, 7, 1)]


def test_bad_layouts_name_the_sizes():
    with pytest.raises(ValueError, match=r"2 teacher replica\(s\) cannot evenly serve 3"):
        DisaggTopology.from_world(world_size=5, teacher_world_size=2)
    with pytest.raises(ValueError, match=r"world size 3 is not divisible by tp\*pp = 2\*1"):
        DisaggTopology.from_world(world_size=5, teacher_world_size=2, student_tp=2)
    with pytest.raises(ValueError, match=r"teacher world size 4 must be between 1 and"):
        DisaggTopology.from_world(world_size=4, teacher_world_size=4)
