"""Fused KD loss, tier 2: gloo ranks on CPU, vocabulary sharded unevenly over 1..4 ranks.

The vocabulary (1009 rows) does not divide by any world size; shards are in ratio 1:2:3:4.
Each rank's loss, full hidden gradient and weight-shard gradient are compared with the
unsharded reference.
"""

import pytest
import torch
import torch.distributed as dist
from support.kd_cases import compare, dist_case, make_inputs, rel_err, shard_sizes, spec

from megatron_kd.loss.combine import ShardMax, ShardSum, gather_sequence
from megatron_kd.testing import RankFailure

WORLD = 4
WORLDS = [1, 2, 3, 4]

CASES = {
    "fwd_kl_T2_ce_mask": spec(kind="forward_kl", temperature=2.0, ce_weight=0.5, mask=True),
    "rev_kl_T07": spec(kind="reverse_kl", temperature=0.7, mask=True, s=3, b=5),
    "jsd_b03_ce": spec(kind="jsd", beta=0.3, ce_weight=0.3, temperature=1.5),
    "fwd_kl_recompute_pad": spec(kind="forward_kl", backward="recompute", vocab_size=1000,
                                 ce_weight=0.2, mask=True),
    "jsd_recompute": spec(kind="jsd", backward="recompute", ce_weight=0.1),
    "rev_kl_recompute_ce_T3": spec(kind="reverse_kl", backward="recompute", ce_weight=0.4,
                                   temperature=3.0),
    "topk_renorm_T2": spec(teacher="renormalize", topk_tail="renormalize", temperature=2.0,
                           k=11, ce_weight=0.5, mask=True),
    "topk_ghost": spec(teacher="ghost", topk_tail="ghost", k=9, mask=True, vocab_size=1001),
    "topk_ghost_recompute": spec(teacher="ghost", topk_tail="ghost", backward="recompute",
                                 ce_weight=0.3),
    "fp32_huge": spec(dtype=torch.float32, scale=1.0, ce_weight=0.5, window_size=3),
    "bf16": spec(dtype=torch.bfloat16, kind="jsd", ce_weight=0.5, window_size=64),
    # the last shard (rows 603..1008 at world 3, 605..1008 at world 4) is only padding
    "padding_only_shard": spec(vocab_size=600, ce_weight=0.5),
    # CPU row blocks inside a window: per-block collectives, scattered active rows
    "blocks_fwd_kl_T2_ce": spec(kind="forward_kl", temperature=2.0, ce_weight=0.5, mask=True,
                                window_size=8, block_rows=3),
    "blocks_jsd_recompute": spec(kind="jsd", backward="recompute", ce_weight=0.3, mask=True,
                                 window_size=None, block_rows=2),
    "blocks_topk_ghost": spec(teacher="ghost", topk_tail="ghost", k=9, mask=True,
                              window_size=8, block_rows=3),
    # forward KL with elementwise="compiled" (its kernels see [rows, 0] logits on the padding
    # shard, and per-block collectives between its two kernels)
    "compiled_fwd_kl_T2_ce_mask": spec(elementwise="compiled", temperature=2.0, ce_weight=0.5,
                                       mask=True),
    "compiled_recompute_padding_only_shard": spec(elementwise="compiled", backward="recompute",
                                                  vocab_size=600, ce_weight=0.5),
    "compiled_blocks_fp32": spec(elementwise="compiled", dtype=torch.float32, window_size=8,
                                 block_rows=3, ce_weight=0.3, mask=True),
    # the GPU path forced on CPU (its kernels' PyTorch form), windows of a few rows by bytes:
    # the same collectives on [k, rows] tensors, a shard of padding only, bf16 logits
    **{f"gpu_path_{name}": spec(path="gpu", gpu_tuning=dict(kernels="eager",
                                                            window_bytes=60_000), **case)
       for name, case in (
           ("fwd_kl_T2_ce_mask", dict(temperature=2.0, ce_weight=0.5, mask=True)),
           ("jsd_recompute_ce", dict(kind="jsd", beta=0.3, backward="recompute",
                                     ce_weight=0.3)),
           ("rev_kl_T07_mask", dict(kind="reverse_kl", temperature=0.7, mask=True)),
           ("topk_renorm_T2", dict(teacher="renormalize", topk_tail="renormalize",
                                   temperature=2.0, k=11, ce_weight=0.5, mask=True)),
           ("topk_ghost", dict(teacher="ghost", topk_tail="ghost", k=9, mask=True,
                               vocab_size=1001)),
           ("topk_ghost_recompute", dict(teacher="ghost", topk_tail="ghost",
                                         backward="recompute", ce_weight=0.3)),
           ("padding_only_shard", dict(vocab_size=600, ce_weight=0.5)),
           ("bf16_jsd", dict(dtype=torch.bfloat16, kind="jsd", ce_weight=0.5)))},
}


@pytest.fixture(scope="module")
def pool(dist_pool_factory):
    return dist_pool_factory(WORLD)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("name", list(CASES))
def test_parity_with_reference(pool, name, world):
    sp = CASES[name]
    results = pool.run(dist_case, sp, world)
    ours = results[:world]
    assert all(r is None for r in results[world:])
    compare(sp, make_inputs(sp), ours, world)


@pytest.mark.parametrize("path", ["auto", "gpu"])
@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("backward", ["precompute", "recompute"])
def test_sequence_parallel_inputs(pool, world, backward, path):
    # s = 12 divides by every world size; hidden states arrive as [s/tp, b, h]
    sp = spec(s=12, b=2, sequence_parallel=True, backward=backward, ce_weight=0.5, mask=True,
              path=path, gpu_tuning=dict(kernels="eager") if path == "gpu" else None)
    ours = pool.run(dist_case, sp, world)[:world]
    compare(sp, make_inputs(sp), ours, world)


# The dense-logits baseline (path="dense") at TP 2 (shards 336 : 673): its log-sum-exp's
# backward all-reduce, a shard of padding only (vocab_size 300: rank 1 owns no token, and still
# runs the same backward collectives), a ghost tail counted once, sequence parallelism.
DENSE_CASES = {
    "fwd_kl_T2_ce_mask_pad": spec(path="dense", temperature=2.0, ce_weight=0.5, mask=True,
                                  vocab_size=1000),
    "rev_kl_T07": spec(path="dense", kind="reverse_kl", temperature=0.7, mask=True),
    "jsd_b03_ce_bf16": spec(path="dense", kind="jsd", beta=0.3, ce_weight=0.3,
                            dtype=torch.bfloat16),
    "topk_renorm_T2": spec(path="dense", teacher="renormalize", topk_tail="renormalize",
                           temperature=2.0, k=11, ce_weight=0.5, mask=True),
    "topk_ghost": spec(path="dense", teacher="ghost", topk_tail="ghost", k=9, mask=True,
                       vocab_size=1001),
    "padding_only_shard": spec(path="dense", vocab_size=300, ce_weight=0.5),
    "topk_ghost_padding_only_shard": spec(path="dense", teacher="ghost", topk_tail="ghost",
                                          vocab_size=300, ce_weight=0.5),
    "sequence_parallel": spec(path="dense", s=12, b=2, sequence_parallel=True, ce_weight=0.5,
                              mask=True, temperature=2.0),
    "sequence_parallel_topk": spec(path="dense", s=12, b=2, sequence_parallel=True,
                                   teacher="renormalize", topk_tail="renormalize", k=5,
                                   ce_weight=0.5),
}


@pytest.mark.parametrize("name", list(DENSE_CASES))
def test_dense_baseline_at_tp2(pool, name):
    sp = DENSE_CASES[name]
    ours = pool.run(dist_case, sp, 2)[:2]
    compare(sp, make_inputs(sp), ours, 2)


def test_shards_are_uneven_and_do_not_divide():
    assert shard_sizes(1009, 4) == [100, 201, 302, 406]
    assert all(1009 % w for w in (2, 3, 4))


def _mismatched_shards(ctx):
    from megatron_kd.loss import DenseTeacher, KDLossConfig, vocab_parallel_kd_loss
    group = ctx.group(2)
    if group is None:
        return None
    torch.manual_seed(0)
    h = torch.randn(4, 2, 8)
    w = torch.randn(50, 8)
    th = torch.randn(4, 2, 6)
    tw = torch.randn(50 if ctx.rank == 0 else 49, 6)  # rank 1's teacher shard is wrong
    vocab_parallel_kd_loss(h, w, DenseTeacher(hidden=th, weight=tw), config=KDLossConfig(),
                           tp_group=group)


def _bad_dtype_on_rank_1(ctx):
    from megatron_kd.loss import DenseTeacher, KDLossConfig, vocab_parallel_kd_loss
    group = ctx.group(2)
    if group is None:
        return None
    h = torch.randn(4, 2, 8)
    th = torch.randn(4, 2, 6, dtype=torch.float64 if ctx.rank == 1 else torch.float32)
    vocab_parallel_kd_loss(h, torch.randn(50, 8),
                           DenseTeacher(hidden=th, weight=torch.randn(50, 6)),
                           config=KDLossConfig(), tp_group=group)


def _token_count_disagrees(ctx):
    from megatron_kd.loss import DenseTeacher, KDLossConfig, vocab_parallel_kd_loss
    group = ctx.group(2)
    if group is None:
        return None
    h = torch.randn(4 + ctx.rank, 2, 8)
    teacher = DenseTeacher(hidden=torch.randn(4 + ctx.rank, 2, 6), weight=torch.randn(50, 6))
    vocab_parallel_kd_loss(h, torch.randn(50, 8), teacher, config=KDLossConfig(), tp_group=group)


def test_bad_shard_on_one_rank_raises_on_every_rank_without_hanging(pool):
    with pytest.raises(RankFailure) as info:
        pool.run(_mismatched_shards, timeout=60)
    text = str(info.value)
    message = ("the teacher's output layer has 99 vocabulary rows (shards [50, 49] over the 2 "
               "TP rank(s)) but the student's has 100 (shards [50, 50])")
    assert text.count(message) == 2  # rank 0 raised the same error as well
    assert "did not finish" not in text


def test_a_local_error_on_one_rank_raises_on_every_rank_without_hanging(pool):
    with pytest.raises(RankFailure) as info:
        pool.run(_bad_dtype_on_rank_1, timeout=60)
    text = str(info.value)
    assert "teacher.hidden dtype torch.float64 != teacher.weight dtype torch.float32" in text
    assert "invalid input on tensor-parallel rank(s) [1]" in text  # rank 0 raised as well
    assert "did not finish" not in text


def test_ranks_with_different_token_counts_raise(pool):
    with pytest.raises(RankFailure, match=r"disagree on the number of tokens: \[8, 10\]"):
        pool.run(_token_count_disagrees, timeout=60)


def _combine_case(ctx, world: int) -> dict | None:
    """lse and E_p[a] of every row through ShardMax / ShardSum on this rank's shard, their
    gradient by autograd through the combine, and the unsharded values and gradient."""
    group = ctx.group(world)
    if group is None:
        return None
    rank = dist.get_rank(group)
    g = torch.Generator().manual_seed(0)
    a = torch.randn(6, 1009, generator=g, dtype=torch.float64) * 3.0
    w = torch.rand(6, generator=g, dtype=torch.float64)
    sizes = shard_sizes(1009, world)
    start, stop = sum(sizes[:rank]), sum(sizes[:rank + 1])
    local = a[:, start:stop].clone().requires_grad_(True)
    m = ShardMax.apply(local.amax(1)[None], group, world)[0]  # a shift: no gradient through it
    e = (local - m[:, None]).exp()
    tot = ShardSum.apply(torch.stack([e.sum(1), (e * local).sum(1)]), group, world)
    lse, mean = m + tot[0].log(), tot[1] / tot[0]
    (w * (lse + mean)).sum().backward()
    full = a.clone().requires_grad_(True)
    ref_lse = torch.logsumexp(full, 1)
    ref_mean = (torch.softmax(full, 1) * full).sum(1)
    (w * (ref_lse + ref_mean)).sum().backward()
    return {"lse": lse.detach(), "mean": mean.detach(), "grad": local.grad,
            "ref_lse": ref_lse.detach(), "ref_mean": ref_mean.detach(),
            "ref_grad": full.grad[:, start:stop]}


@pytest.mark.parametrize("world", [1, 2])
def test_shard_combine_backward_is_the_unsharded_gradient(pool, world):
    # Every rank computes the same loss from the replicated sums, so the SUM passes the gradient
    # through and each rank's shard gets its slice of the unsharded gradient; the MAX shift
    # gets none (lse does not depend on it).
    results = pool.run(_combine_case, world)
    assert all(r is None for r in results[world:])
    for rank, r in enumerate(results[:world]):
        # fp64 on both sides: the sums differ only in their order over the vocabulary
        for name in ("lse", "mean", "grad"):
            assert rel_err(r[name], r[f"ref_{name}"]) <= 1e-12, (name, rank, world)


def _gather_case(ctx, world: int) -> dict | None:
    """:func:`gather_sequence` as its two kinds of callers use it: the loss's (group and size),
    the teacher serve / cache build's (the group alone, a transposed view, detached)."""
    group = ctx.group(world)
    if group is None:
        return None
    rank = dist.get_rank(group)
    full = torch.arange(world * 3 * 2 * 5, dtype=torch.float32).view(world * 3, 2, 5)
    mine = full[rank * 3:(rank + 1) * 3]
    as_loss = gather_sequence(mine, group, world)
    as_teacher = gather_sequence(mine.transpose(0, 1).contiguous().transpose(0, 1), group)
    return {"loss": torch.equal(as_loss, full), "teacher": torch.equal(as_teacher, full),
            "new_tensor": as_loss.data_ptr() != mine.data_ptr(),
            "no_grad": not as_loss.requires_grad and as_loss.grad_fn is None}


@pytest.mark.parametrize("world", [2, 3])
def test_gather_sequence_is_the_sequence_in_rank_order(pool, world):
    results = pool.run(_gather_case, world)
    assert results[:world] == [{"loss": True, "teacher": True, "new_tensor": True,
                                "no_grad": True}] * world


def test_gather_sequence_on_one_rank_is_its_input():
    # teacher serve without sequence parallelism passes no group (or a group of one)
    hidden = torch.randn(3, 2, 4)
    assert gather_sequence(hidden, None) is hidden
    assert gather_sequence(hidden, None, 1) is hidden
