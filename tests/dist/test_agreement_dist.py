"""Evaluation's student-teacher metrics, tier 2: gloo ranks on CPU, the vocabulary (1009 rows)
sharded unevenly (1:2:3:4) over 1..4 ranks.

Every rank's KL sum, top-1 agreement count and token count equal the unsharded dense
reference's (``support.kd_reference.reference_agreement``). The argmax crosses the shards
(:class:`~megatron_kd.loss.combine.ShardArgmax`): a row's maximum tied between shards goes to the
lowest id, as ``torch.argmax`` of the full row gives it.
"""

import pytest
import torch
from support.kd_cases import (
    agreement_dist_case,
    compare_agreement,
    make_inputs,
    shard_sizes,
    spec,
    tied_inputs,
)

from megatron_kd.loss.combine import ARGMAX_NONE, ShardArgmax

WORLD = 4
WORLDS = [1, 2, 3, 4]

CASES = {
    "dense_mask_pad": spec(mask=True, vocab_size=1000),
    "dense_jsd_T2": spec(kind="jsd", temperature=2.0, ce_weight=0.5, labels=True),
    "dense_fp32": spec(dtype=torch.float32),
    "dense_bf16": spec(dtype=torch.bfloat16, mask=True, window_size=64),
    # the last shard (rows 603..1008 at world 3, 605..1008 at world 4) is only padding
    "padding_only_shard": spec(vocab_size=600, mask=True),
    "blocks": spec(window_size=8, block_rows=3, mask=True),
    "topk_ghost": spec(teacher="ghost", topk_tail="ghost", k=9, mask=True, vocab_size=1001),
    "topk_renorm_T2": spec(teacher="renormalize", topk_tail="renormalize", k=11,
                           temperature=2.0),
}


@pytest.fixture(scope="module")
def pool(dist_pool_factory):
    return dist_pool_factory(WORLD)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("name", list(CASES))
def test_parity_with_reference(pool, name, world):
    sp = CASES[name]
    results = pool.run(agreement_dist_case, sp, world)
    assert all(r is None for r in results[world:])
    compare_agreement(sp, make_inputs(sp), results[:world])


@pytest.mark.parametrize("world", [2, 3, 4])
def test_sequence_parallel_inputs(pool, world):
    # s = 12 divides by every world size; hidden states arrive as [s/tp, b, h]
    sp = spec(s=12, b=2, sequence_parallel=True, mask=True)
    compare_agreement(sp, make_inputs(sp), pool.run(agreement_dist_case, sp, world)[:world])


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_ties_across_shards_go_to_the_lowest_id(pool, world, dtype):
    sp = spec(dtype=dtype, h_s=4, s=7, b=5, mask=True)
    inp = tied_inputs(sp)
    # the case has rows whose maximum sits on more than one shard of this world
    z = inp["student_hidden"].double().reshape(-1, 4) @ inp["student_weight"].double().t()
    bounds = torch.tensor(shard_sizes(1009, world)).cumsum(0)
    shard_of_id = torch.bucketize(torch.arange(1009), bounds, right=True)
    at_max = z == z.max(1, keepdim=True).values
    shards_at_max = [len(set(shard_of_id[row].tolist())) for row in at_max]
    if world > 1:
        assert sum(n > 1 for n in shards_at_max) >= 10
    compare_agreement(sp, inp, pool.run(agreement_dist_case, sp, world, True)[:world])


def _argmax_case(ctx, world: int):
    group = ctx.group(world)
    if group is None:
        return None
    rank = ctx.rank
    # three rows: the maximum on one rank only; tied on ranks 1 and world-1 (lowest id wins);
    # tied on every rank. Rank r's shard starts at id 100 * r.
    local_max = torch.tensor([[float(rank == world - 1), float(rank in (1, world - 1)), 5.0]])
    local_id = torch.tensor([[100 * rank + 7, 100 * rank + 3, 100 * rank + 9]])
    before = (local_max.clone(), local_id.clone())
    out = ShardArgmax.apply(local_max, local_id, group, world)
    return out, torch.equal(before[0], local_max) and torch.equal(before[1], local_id)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_shard_argmax_combines_value_then_lowest_id(pool, world):
    results = pool.run(_argmax_case, world)[:world]
    tied = 100 * 1 + 3
    expected = torch.tensor([[100 * (world - 1) + 7, tied, 9]])
    for out, unchanged in results:
        assert torch.equal(out, expected) and unchanged
        assert int(out.max()) < ARGMAX_NONE
