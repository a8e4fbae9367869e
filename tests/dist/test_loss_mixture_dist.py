"""The loss of a weighted mixture of teachers, tier 2: gloo ranks on CPU, TP 2, 3 and 4.

The vocabulary (1009 rows) is split 1:2:3:4 as in tests/dist/test_loss_dist.py, the same
split for the student's and the dense teachers' output layers; top-K teachers stay whole on
every rank. Each rank's value and gradients are compared with the unsharded fp64 reference of
the mixture (``support.mixture_cases.compare``), and the bit-for-bit identities hold per rank.
"""

import pytest
from support.mixture_cases import compare, make_mixture_inputs, mixture_dist_case, mixture_spec

from megatron_kd.testing import RankFailure

WORLD = 4

CASES = {
    "dense+topk_T2_ce_mask_pad": mixture_spec(teachers=("dense", "renormalize"), temperature=2.0,
                                              ce_weight=0.5, mask=True, vocab_size=1000),
    "dense+dense_recompute": mixture_spec(teachers=("dense", "dense"), weights=(2, 1),
                                          backward="recompute", mask=True),
    "topk+topk_T2_ce": mixture_spec(teachers=("renormalize", "renormalize"), temperature=2.0,
                                    ce_weight=0.4, k=11),
    "dense+ghost_pad": mixture_spec(teachers=("dense", "ghost"), topk_tail="ghost", k=9,
                                    ce_weight=0.3, mask=True, vocab_size=1001),
    "three_mixed_blocks": mixture_spec(teachers=("renormalize", "dense", "dense"),
                                       weights=(1, 3, 4), ce_weight=0.3, mask=True,
                                       window_size=8, block_rows=3),
    # hidden states [s/tp, b, h] of the student and the dense teacher; s = 12 divides by 2, 3, 4
    "sequence_parallel_dense+topk": mixture_spec(teachers=("dense", "renormalize"), s=12, b=2,
                                                 sequence_parallel=True, temperature=2.0,
                                                 ce_weight=0.5, mask=True),
    "sequence_parallel_gpu_path": mixture_spec(teachers=("renormalize", "dense"), s=12, b=2,
                                               sequence_parallel=True, ce_weight=0.5,
                                               path="gpu", gpu_tuning=dict(kernels="eager"),
                                               backward="recompute"),
}


@pytest.fixture(scope="module")
def pool(dist_pool_factory):
    return dist_pool_factory(WORLD)


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("name", list(CASES))
def test_parity_with_the_mixture_reference(pool, name, world):
    case = CASES[name]
    results = pool.run(mixture_dist_case, case, world)
    assert all(r is None for r in results[world:])
    inp, teachers = make_mixture_inputs(case)
    compare(case, inp, teachers, results[:world])


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_weight_zero_and_one_teacher_are_bit_for_bit(pool, world, sequence_parallel):
    # per rank: (1, 0) and (0, 1) are the one-teacher loss, one teacher is that loss itself,
    # a third teacher of weight 0 leaves (a, b) as it was (value and both gradients)
    case = mixture_spec(teachers=("dense", "renormalize", "dense"), s=12, b=2,
                        sequence_parallel=sequence_parallel, temperature=2.0, ce_weight=0.5,
                        mask=True)
    results = pool.run(mixture_dist_case, case, world, exact=True)
    assert results[:world] == [{"1,0": True, "0,1": True, "n=1": True, "a,b,0": True}] * world


def _vocabulary_differs_on_rank_1(ctx):
    import torch

    from megatron_kd.loss import DenseTeacher, TopKTeacher, mixture_kd_loss
    group = ctx.group(2)
    if group is None:
        return None
    torch.manual_seed(0)
    topk = TopKTeacher(ids=torch.arange(12).view(4, 1, 3),
                       logprobs=torch.full((4, 1, 3), -2.0))
    # rank 1's shard of teacher 1 has one row less: 99 rows in all against the student's 100
    dense = DenseTeacher(hidden=torch.randn(4, 1, 6),
                         weight=torch.randn(50 if ctx.rank == 0 else 49, 6))
    mixture_kd_loss(torch.randn(4, 1, 8), torch.randn(50, 8), [topk, dense], [1, 1],
                    tp_group=group)


def test_a_vocabulary_that_differs_on_one_rank_stops_every_rank(pool):
    with pytest.raises(RankFailure) as info:
        pool.run(_vocabulary_differs_on_rank_1, timeout=60)
    text = str(info.value)
    message = ("in the loss of teacher 1 of 2 (DenseTeacher, weight 0.5): the teacher's output "
               "layer has 99 vocabulary rows (shards [50, 49] over the 2 TP rank(s)) but the "
               "student's has 100 (shards [50, 50])")
    assert text.count(message) == 2  # rank 0 and rank 1 alike
    assert "did not finish" not in text
