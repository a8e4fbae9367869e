"""Every tensor handed to a ``torch.distributed`` op lives on its process group's device.

On NCCL a host tensor in a collective is refused at run time, which no gloo test sees. Here two
gloo ranks run under :func:`megatron_kd.testing.devices.simulated_accelerator`: inputs are
"moved to the GPU" (tagged, the data stays on the host), the backend answers ``nccl``, and a
collective given an untagged (host) tensor raises, naming the caller's ``file:line``. The loss,
the top-K extraction of the cache build and the training loop's step reductions run through
their real functions with small inputs; the numbers are checked too (the simulation changes
where tensors claim to live, never what is computed).
"""

import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.distributed as dist
from support.cache_cases import TinyTeacher, cache_files, cache_spec
from support.kd_cases import compare, make_inputs, run_ours, shard_sizes, spec
from support.topk_cases import VOCAB, reference_topk, topk_problem

from megatron_kd.cache.build import build_cache
from megatron_kd.cache.reader import TopKCacheReader
from megatron_kd.cache.topk import vocab_parallel_topk_logprobs
from megatron_kd.integration.groups import collective_device
from megatron_kd.megatron_lm.teacher_side import _microbatch_tokens
from megatron_kd.modes.disaggregated import Remote
from megatron_kd.modes.offline import Cached
from megatron_kd.modes.source import SourceConfig, StudentPlace
from megatron_kd.testing.devices import on_accelerator, simulated_accelerator
from megatron_kd.training.checkpointing import _state_bytes
from megatron_kd.training.faults import EarlyExit
from megatron_kd.training.logs import reduce_reports
from megatron_kd.training.metrics import StepTimers

WORLD = 2
THIS_FILE = os.path.basename(__file__)


@pytest.fixture(scope="module")
def pool(dist_pool_factory):
    return dist_pool_factory(WORLD)


def _host(value):
    """Results back to plain host values for the parent (``.cpu()`` of tagged tensors)."""
    if isinstance(value, torch.Tensor):
        return value.cpu()
    if isinstance(value, dict):
        return {k: _host(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_host(v) for v in value)
    return value


# --- the checker itself --------------------------------------------------------------------------

def _case_checker(ctx):
    group, rank = ctx.group(WORLD), ctx.rank
    peer = 1 - rank
    with simulated_accelerator():
        x = torch.full((3,), float(rank + 1)).cuda()
        assert x.device == torch.device("cuda", 0) and on_accelerator(x)
        assert not on_accelerator(torch.zeros(2)) and torch.zeros(2).device.type == "cpu"
        assert on_accelerator(torch.zeros(2, device=x.device)) and on_accelerator(x.new_empty(1))
        assert not on_accelerator(x.cpu()) and x.cpu().device.type == "cpu"
        assert dist.get_backend(group) == "nccl" and torch.cuda.current_device() == 0
        dist.all_reduce(x, group=group)  # passes; the sum lands in the tagged tensor
        assert x.tolist() == [3.0, 3.0, 3.0]
        send = torch.full((2,), float(rank)).cuda()
        recv = torch.empty(2, device=torch.cuda.current_device())
        ops = [dist.P2POp(dist.isend, send, peer, group), dist.P2POp(dist.irecv, recv, peer, group)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        assert recv.tolist() == [float(peer)] * 2
        with pytest.raises(AssertionError) as err:
            dist.all_reduce(torch.zeros(3), group=group)  # a host tensor: refused
        with pytest.raises(AssertionError, match="batch_isend_irecv"):
            dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.zeros(2), peer, group)])
        with pytest.raises(AssertionError, match="all_gather .*shape \\(3,\\)"):
            dist.all_gather([torch.empty(3, device=x.device), torch.empty(3)], x, group=group)
    # everything is restored on exit
    assert dist.get_backend(group) == "gloo"
    assert dist.all_reduce is dist.distributed_c10d.all_reduce
    assert dist.P2POp is dist.distributed_c10d.P2POp
    assert isinstance(vars(torch.autograd.Function)["apply"], classmethod)
    plain = torch.zeros(3)
    dist.all_reduce(plain, group=group)
    return str(err.value)


def test_checker_refuses_host_tensors_and_passes_device_ones(pool):
    for message in pool.run(_case_checker):
        assert message.startswith("torch.distributed.all_reduce called from "), message
        assert f"{THIS_FILE}:" in message and "shape (3,), dtype torch.float32" in message


# --- the fused loss ----------------------------------------------------------------------------

LOSS_CASES = {
    "forward_kl_ce": spec(kind="forward_kl", temperature=2.0, ce_weight=0.5, mask=True),
    "reverse_kl_ce": spec(kind="reverse_kl", temperature=0.7, ce_weight=0.3),
    "jsd_ce": spec(kind="jsd", beta=0.3, ce_weight=0.3, mask=True),
    "forward_kl_sp": spec(s=12, b=2, sequence_parallel=True, ce_weight=0.5, mask=True),
    "jsd_sp": spec(kind="jsd", s=12, b=2, sequence_parallel=True, labels=True),
    "topk_renormalize": spec(teacher="renormalize", topk_tail="renormalize", temperature=2.0,
                             k=11, ce_weight=0.5, mask=True),
    "topk_ghost_sp": spec(teacher="ghost", topk_tail="ghost", k=9, s=12, b=2,
                          sequence_parallel=True, ce_weight=0.2, vocab_size=1001),
}


def _case_loss(ctx, sp):
    group = ctx.group(WORLD)
    with simulated_accelerator() as calls:
        inp = {k: v.cuda() for k, v in make_inputs(sp).items()}
        out = run_ours(sp, inp, shard_sizes(sp["padded_vocab"], WORLD), dist.get_rank(group),
                       group)
        for key in ("loss", "num_tokens", "grad_x", "grad_w"):
            assert on_accelerator(out[key]), f"{key} left the device"
        return _host(out), _functions(calls)


def _named(old: str, new: str) -> str:
    """The gather / scatter collective as ``"<function> <file>"``: the project calls it from
    ``megatron_kd/collectives.py`` under the name this torch has (2.13 renamed it)."""
    return f"{new if hasattr(dist, new) else old} collectives.py"


GATHER = _named("all_gather_into_tensor", "all_gather_single")
SCATTER = _named("reduce_scatter_tensor", "reduce_scatter_single")


def _functions(calls):
    """``{"<function> <file>", ...}`` of the checked calls (file relative to the package)."""
    return {f"{c.split()[0]} {c.split()[1].rpartition('megatron_kd/')[2].split(':')[0]}"
            for c in calls}


# "CUDA" inputs take the GPU path (its eager kernels here: the data is on the host); the CPU
# path is forced too, as a machine without the GPU path's kernels would run it
PATHS = {"gpu_path": dict(path="auto", gpu_tuning=dict(kernels="eager")),
         "cpu_path": dict(path="cpu")}


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("backward", ["precompute", "recompute"])
@pytest.mark.parametrize("name", list(LOSS_CASES))
def test_loss_collectives_on_device(pool, name, backward, path):
    sp = {**LOSS_CASES[name], "backward": backward, **PATHS[path]}
    results = pool.run(_case_loss, sp)
    compare(sp, make_inputs(sp), [out for out, _ in results], WORLD)
    expected = {"all_reduce loss/combine.py"}  # the per-row combine, at least
    if sp["sequence_parallel"]:
        expected |= {GATHER, SCATTER}
    for _, seen in results:  # the loss's collectives did run under the check
        assert expected <= seen, (expected, seen)


# --- the top-K extraction and the cache build -------------------------------------------------

def _case_topk(ctx, k):
    group, rank = ctx.group(WORLD), ctx.rank
    local = -(-VOCAB // WORLD)  # padded to a multiple of TP 2
    hidden, weight = topk_problem(local * WORLD, seed=WORLD)
    with simulated_accelerator() as calls:
        ids, logprobs = vocab_parallel_topk_logprobs(
            hidden.cuda(), weight[rank * local:(rank + 1) * local].cuda(), k, vocab_size=VOCAB,
            window_size=5, tp_group=group)
        assert on_accelerator(ids) and on_accelerator(logprobs)
        ids, logprobs = ids.cpu(), logprobs.cpu()
    assert _functions(calls) == {GATHER, "all_gather cache/topk.py", "all_reduce cache/topk.py"}, \
        calls
    ref_ids, ref_lp = reference_topk(hidden, weight, VOCAB, k)
    np.testing.assert_array_equal(ids.reshape(-1, k).numpy(), ref_ids)
    np.testing.assert_allclose(logprobs.reshape(-1, k).numpy(), ref_lp, rtol=0, atol=2e-5)


@pytest.mark.parametrize("k", [13, 300])
def test_topk_collectives_on_device(pool, k):
    pool.run(_case_topk, k)


def _case_build(ctx, cache_dir, spec_):
    group, rank = ctx.group(WORLD), ctx.rank
    teacher = TinyTeacher(vocab_size=1009, padded_vocab=1010, seq_length=6)
    with simulated_accelerator() as calls:
        shard = teacher.output[505 * rank:505 * (rank + 1)].cuda()
        stats = build_cache(cache_dir, spec_, teacher_forward_fn=lambda b: teacher(b).cuda(),
                sample_tokens_fn=teacher.sample_tokens,
                            output_weight=shard, micro_batch_size=2, window_size=4,
                            tp_group=group)
    assert "all_gather cache/topk.py" in _functions(calls), calls
    return stats.shards_written


def test_cache_build_collectives_on_device(pool, tmp_path):
    teacher = TinyTeacher(vocab_size=1009, padded_vocab=1010, seq_length=6)
    spec_ = cache_spec(teacher, num_samples=5, topk=30, samples_per_shard=2)
    build_cache(str(tmp_path / "one"), spec_, teacher_forward_fn=teacher,
                sample_tokens_fn=teacher.sample_tokens,
                output_weight=teacher.output)
    assert pool.run(_case_build, str(tmp_path / "tp"), spec_) == [[0, 1, 2]] * WORLD
    assert sorted(cache_files(tmp_path / "one")) == sorted(cache_files(tmp_path / "tp"))
    ids1, lp1 = TopKCacheReader(tmp_path / "one").get(range(5))
    ids2, lp2 = TopKCacheReader(tmp_path / "tp").get(range(5))
    np.testing.assert_array_equal(ids2, ids1)
    np.testing.assert_allclose(lp2, lp1, rtol=2e-6, atol=1e-5)  # sharded fp32 sums: a few ulps


# --- the training loop's step reductions ------------------------------------------------------

def _reports(ctx):
    keys = ("loss", "kd_loss", "lm_loss")
    reports = [{"loss": torch.tensor([2.0, 4.0]).cuda(),
                "kd_loss": torch.tensor([1.0, 4.0]).cuda()}]
    out = reduce_reports(reports, keys, contributes=True)
    assert out["lm_loss"] is None
    return out["loss"].tolist(), out["kd_loss"].tolist()


def _cache_stats(ctx):
    source = Cached(None, directory="cache", depth=2, tail="renormalize",
                    place=StudentPlace(active=True, dp_rank=ctx.rank, dp_size=WORLD),
                    config=SourceConfig(micro_batch_size=1, seq_length=4), device=None)
    source.prefetcher = SimpleNamespace(rates=lambda: (0.5, 100, 2.0))
    return source.step_stats(dist.group.WORLD).log_fields()  # as the trainer calls it


def _step_timers(ctx):
    timers = StepTimers(1)
    with timers.time("forward-backward"):
        pass
    return sorted(timers.take(collective_device()))  # as the trainer calls it


def _early_exit(ctx):
    early = EarlyExit(signal_handler=True, duration_mins=None, started=0.0)
    try:
        early.signal.got = ctx.rank == 1
        return early.reason(collective_device())  # as the trainer calls it
    finally:
        early.close()


def _teacher_stats(ctx):
    source = Remote(None, None, weight=None, run=0,
                    place=StudentPlace(active=False, dp_rank=ctx.rank, dp_size=WORLD),
                    config=SourceConfig(micro_batch_size=1, seq_length=4, max_samples=1))
    return source.step_stats(dist.group.WORLD).log_fields()["kd_wire_bytes"]  # as the trainer


def _checkpoint_bytes(ctx):
    state = {"w": torch.zeros(4).cuda(), "opt": [torch.zeros(2, dtype=torch.float64).cuda()]}
    return _state_bytes(state)


def _teacher_tokens(ctx):
    tokens = torch.arange(6).view(2, 3)
    recorder = SimpleNamespace(labels=torch.zeros(2, 3, dtype=torch.int64).cuda())
    state = SimpleNamespace(tp_group=ctx.group(WORLD), cp_group=None)
    current = {"tokens": tokens.cuda()} if ctx.rank == 0 else None
    out = _microbatch_tokens(state, recorder, current)
    assert on_accelerator(out)
    return out.tolist()


# name: (case, its result on every rank or None, the checked call it makes)
HELPERS = {
    "logs.reduce_reports": (_reports, ([4.0, 8.0], [2.0, 8.0]), "all_reduce training/logs.py"),
    "offline.Cached.step_stats": (_cache_stats, {"kd_cache_wait_s": 0.5,
                                                 "kd_cache_read_tokens_per_s": 50.0},
                                  "all_reduce modes/stats.py"),
    "metrics.StepTimers.take": (_step_timers, None, "all_reduce training/metrics.py"),
    "faults.EarlyExit.reason": (_early_exit, "signal", "all_reduce training/faults.py"),
    "disaggregated.Remote.step_stats": (_teacher_stats, 0, "all_reduce teacher/step_stats.py"),
    "checkpointing._state_bytes": (_checkpoint_bytes, 2 * (16 + 16),
                                   "all_reduce training/checkpointing.py"),
    "teacher_side._microbatch_tokens": (_teacher_tokens, [[0, 1, 2], [3, 4, 5]],
                                        "broadcast megatron_lm/teacher_side.py"),
}


def _case_helper(ctx, name):
    with simulated_accelerator() as calls:
        return _host(HELPERS[name][0](ctx)), _functions(calls)


@pytest.mark.parametrize("name", list(HELPERS))
def test_training_reductions_on_device(pool, name):
    _, expected, call = HELPERS[name]
    results = pool.run(_case_helper, name)
    values = [value for value, _ in results]
    if expected is not None:
        assert values == [expected] * WORLD, values
    assert values[0] == values[1]
    for _, seen in results:
        assert seen == {call}, seen
