"""Rank arithmetic of a model's TP x DP x PP layout (pure: no process group)."""

import pytest

from megatron_kd.parallel import Layout


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


def test_bad_layouts_name_the_sizes():
    with pytest.raises(ValueError, match=r"world size 3 is not divisible by tp\*pp = 2\*1"):
        Layout(world_size=3, tp=2)
    with pytest.raises(ValueError, match="tp must be >= 1, got 0"):
        Layout(world_size=3, tp=0)
    with pytest.raises(ValueError, match=r"coordinates tp=2 dp=0 pp=0 outside"):
        Layout(world_size=4, tp=2).rank_of(tp_rank=2, dp_rank=0, pp_rank=0)
