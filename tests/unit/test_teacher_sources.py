"""The teacher sources' pieces that need no process group: microbatch records, the inputs they
hand the loss, their step statistics' records and the JSON keys and ``kd/`` scalars both
trainers name them by."""

from types import SimpleNamespace

import pytest
import torch

from megatron_kd.loss import DenseTeacher, TopKTeacher
from megatron_kd.modes.colocated import Colocated
from megatron_kd.modes.disaggregated import Remote
from megatron_kd.modes.offline import Cached
from megatron_kd.modes.source import (
    Microbatch,
    NoTeacher,
    SourceConfig,
    StudentPlace,
    TeacherInputs,
)
from megatron_kd.modes.stats import (
    CacheStepStats,
    RemoteStepStats,
    SourceStepStats,
    replica_rates,
)
from megatron_kd.teacher.step_stats import ClientStepStats


def test_microbatch_reads_tokens_only_when_asked():
    reads = []

    def tokens():
        reads.append(1)
        return torch.arange(6).view(2, 3)

    mb = Microbatch(step=1, index=0, sample_ids=(4, 5), tokens=tokens)
    assert reads == []
    assert mb.token_ids().tolist() == [[0, 1, 2], [3, 4, 5]] and reads == [1]
    with pytest.raises(RuntimeError, match="no token ids for microbatch 2 of step 0"):
        Microbatch(step=0, index=2).token_ids()
    call = Microbatch(step=0, index=0, model_inputs=lambda: ((1, 2), {"k": 3}))
    assert call.model_call() == ((1, 2), {"k": 3})


def test_inputs_hold_the_record_the_loss_takes():
    none = NoTeacher().inputs(Microbatch(step=0, index=0), training=True)
    assert not none.present and none.watched is None and none.teacher is None
    lp = torch.zeros(2, 1, 3)
    record = TopKTeacher(ids=torch.zeros(2, 1, 3, dtype=torch.long), logprobs=lp)
    sparse = TeacherInputs(teacher=record, what="a cache")
    assert sparse.present and sparse.watched is lp and sparse.teacher is record
    hidden = torch.zeros(2, 1, 4)
    dense = TeacherInputs(teacher=DenseTeacher(hidden=hidden, weight=torch.zeros(5, 4)))
    assert dense.present and dense.watched is hidden


#: One active rank of one, a run of one-sequence microbatches of 4 tokens.
PLACE = StudentPlace(active=True, dp_rank=0, dp_size=1)
CONFIG = SourceConfig(micro_batch_size=1, seq_length=4)


def test_cached_source_gives_nothing_in_evaluation():
    source = Cached(None, directory="c", depth=2, tail="renormalize", place=PLACE,
                    config=CONFIG, device=None)
    assert not source.inputs(Microbatch(step=0, index=0), training=False).present
    assert source.summary() == {"teacher_in_memory": False, "topk_wait_s": None}
    stats = source.step_stats(None)
    assert stats == CacheStepStats()  # a record, named only when logged
    assert stats.log_fields() == {"kd_cache_wait_s": 0.0, "kd_cache_read_tokens_per_s": None}


def test_step_stats_are_named_alike_for_both_trainers():
    failover = {"event": "failover", "replica_lost": "r"}
    stats = RemoteStepStats(client=ClientStepStats(
        bytes_received=10, bytes_sent=4, wait_s=0.5, live_replicas=2,
        tokens_by_replica={"a": 30}, failovers=[failover]), dp_size=2)
    # a Megatron-LM step: rates from the tokens and the step's time
    scalars = stats.scalars(step_time_s=2.0)
    assert scalars == {"kd/wire-bytes": 10.0, "kd/wire-bytes-out": 4.0,
                       "kd/teacher-wait-s": 0.5, "kd/live-replicas": 2.0, "kd/failovers": 1.0,
                       "kd/replica-a/tokens-per-s": 15.0}
    # megatron-kd train's JSON step record: the keys the docs and `megatron-kd report` read
    assert stats.log_fields(2.0) == {
        "kd_wire_bytes": 10, "kd_wire_bytes_per_dp_rank": 5, "kd_wire_bytes_to_teacher": 4,
        "failovers": 1, "kd_teacher_wait_s": 0.5, "kd_ring_occupancy": None,
        "kd_live_replicas": 2, "kd_replica_tokens": {"a": 30},
        "kd_replica_tokens_per_s": replica_rates({"a": 30}, 2.0)}
    assert stats.events == [failover]
    assert replica_rates({"a": 30}, None) == {}
    assert "kd/replica-a/tokens-per-s" not in stats.scalars()  # no time, no rate
    # an offline teacher's, summed over two reading ranks
    cache = CacheStepStats(wait_s=1.0, tokens=200, decode_s=4.0, readers=2)
    assert cache.log_fields() == {"kd_cache_wait_s": 0.5, "kd_cache_read_tokens_per_s": 50.0}
    assert cache.scalars() == {"kd/cache-wait-s": 0.5, "kd/cache-read-tokens-per-s": 50.0}
    assert CacheStepStats().scalars() == {"kd/cache-wait-s": 0.0}  # no rate decoded: none
    # no teacher, or a colocated one: nothing to log
    none = NoTeacher().step_stats(None)
    assert none == SourceStepStats() and none.log_fields(1.0) == {} and none.scalars(1.0) == {}
    assert none.events == []
    with pytest.raises(ValueError, match=r"dp_size must be an integer >= 1, got 0"):
        RemoteStepStats(dp_size=0)


def test_client_step_stats_combine_over_ranks_by_field():
    sender = ClientStepStats(bytes_received=10, bytes_sent=4, bytes_resent=1,
                             header_bytes_sent=2, live_replicas=3, wait_s=0.5, occupancy=0.25,
                             tokens_by_replica={"a": 5}, failovers=[{"event": "failover"}])
    receiver = ClientStepStats(bytes_received=6, wait_s=1.5, tokens_by_replica={"a": 1, "b": 2})
    no_client = ClientStepStats()
    ranks = [sender, receiver, no_client]
    # as an all-reduce (sum) and an object gather would combine them
    vector = [sum(v) for v in zip(*(r.to_vector() for r in ranks))]
    total = ClientStepStats.combine(vector, [r.gathered() for r in ranks])
    assert total == ClientStepStats(
        bytes_received=16, bytes_sent=4, bytes_resent=1, header_bytes_sent=2, live_replicas=3,
        wait_s=1.0,  # the mean over the two ranks with a client
        occupancy=0.25,  # over the one rank that measured it
        tokens_by_replica={"a": 6, "b": 2}, failovers=[{"event": "failover"}])
    # one rank alone combines to itself; no client anywhere: no wait, no occupancy
    assert ClientStepStats.combine(sender.to_vector(), [sender.gathered()]) == sender
    assert ClientStepStats.combine(no_client.to_vector(), [no_client.gathered()]) == no_client


def test_each_source_names_its_teacher_vocabulary():
    # what both trainers give the loss as vocab_size, without asking the mode
    assert NoTeacher().vocab_size is None
    assert Colocated(None, load_dir="t", vocab_size=1009).vocab_size == 1009
    remote = Remote(None, SimpleNamespace(vocab_size=1009), weight=None, run=0, place=PLACE,
                    config=CONFIG)
    assert remote.vocab_size == 1009
    reader = SimpleNamespace(spec=SimpleNamespace(vocab_size=500))
    cached = Cached(reader, directory="c", depth=2, tail="renormalize", place=PLACE,
                    config=CONFIG, device=None)
    assert cached.vocab_size == 500


def test_a_rank_and_a_run_of_a_source_are_checked_records():
    with pytest.raises(ValueError, match="data-parallel rank 2 of 2 does not exist"):
        StudentPlace(active=True, dp_rank=2, dp_size=2)
    with pytest.raises(ValueError, match="SourceConfig.seq_length must be >= 1, got 0"):
        SourceConfig(micro_batch_size=1, seq_length=0)
    with pytest.raises(ValueError, match="SourceConfig.max_samples must be >= 1 or None"):
        SourceConfig(micro_batch_size=1, seq_length=4, max_samples=0)
    # a connection's members: CP rank x TP size + TP rank (0 sends)
    group = SimpleNamespace(size=lambda: 2, rank=lambda: 1)
    cp = SimpleNamespace(size=lambda: 2, rank=lambda: 1)
    place = StudentPlace(active=True, dp_rank=0, dp_size=1, tp_group=group, cp_group=cp)
    assert place.tp_size == 2 and place.member == 3 and PLACE.member == 0
