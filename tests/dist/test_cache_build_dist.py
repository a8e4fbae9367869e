"""Building a cache on 4 gloo ranks as 2 replicas x 2 TP ranks: the same cache as one process."""


import numpy as np
import torch.distributed as dist
from support.cache_cases import TinyTeacher, cache_files, cache_spec

from megatron_kd.cache.build import build_cache
from megatron_kd.cache.format import verify
from megatron_kd.cache.reader import TopKCacheReader


def _tp_dp_groups(ctx):
    if "tp_dp" not in ctx.state:
        # new_group is collective over the world: every rank creates both, in the same order.
        groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        ctx.state["tp_dp"] = groups
    return ctx.state["tp_dp"][ctx.rank // 2]


def _case_build_tp_dp(ctx, cache_dir, spec):
    tp_group = _tp_dp_groups(ctx)
    tp_rank = dist.get_rank(tp_group)
    # Padded to a multiple of TP 2: shards of 505 columns, the last one with 1 padding column.
    teacher = TinyTeacher(vocab_size=1009, padded_vocab=1010, seq_length=6)
    shard = teacher.output[505 * tp_rank:505 * (tp_rank + 1)]
    stats = build_cache(cache_dir, spec, teacher_forward_fn=teacher,
                sample_tokens_fn=teacher.sample_tokens, output_weight=shard,
                        micro_batch_size=2, window_size=4, tp_group=tp_group,
                        dp_rank=ctx.rank // 2, dp_world_size=2)
    dist.barrier()
    return stats.shards_written


def test_tp2_dp2_build_matches_single_process(dist_pool_factory, tmp_path):
    teacher = TinyTeacher(vocab_size=1009, padded_vocab=1010, seq_length=6)
    spec = cache_spec(teacher, num_samples=9, topk=30, samples_per_shard=2)
    build_cache(str(tmp_path / "one"), spec, teacher_forward_fn=teacher,
                sample_tokens_fn=teacher.sample_tokens,
                output_weight=teacher.output)
    pool = dist_pool_factory(4)
    written = pool.run(_case_build_tp_dp, str(tmp_path / "tp_dp"), spec)
    assert written == [[0, 2, 4], [0, 2, 4], [1, 3], [1, 3]]
    assert verify(tmp_path / "tp_dp") == []
    one, tp_dp = TopKCacheReader(tmp_path / "one"), TopKCacheReader(tmp_path / "tp_dp")
    ids1, lp1 = one.get(range(9))
    ids2, lp2 = tp_dp.get(range(9))
    np.testing.assert_array_equal(ids2, ids1)
    # Sharded vs whole-matrix fp32 projections and log-sum-exp: a few ulps of |logprob| <= 30.
    np.testing.assert_allclose(lp2, lp1, rtol=2e-6, atol=1e-5)
    # And a second distributed build is byte-identical to the first.
    pool.run(_case_build_tp_dp, str(tmp_path / "tp_dp2"), spec)
    assert cache_files(tmp_path / "tp_dp2") == cache_files(tmp_path / "tp_dp")
