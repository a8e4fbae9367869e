"""The teacher sources' pieces that need no process group: microbatch records, the inputs they
hand the loss, the ``kd/`` scalars both trainers write."""

from types import SimpleNamespace

import pytest
import torch

from megatron_kd.integration.teacher_sources import (
    Cached,
    Colocated,
    Microbatch,
    NoTeacher,
    Remote,
    StepStats,
    TeacherInputs,
    kd_scalars,
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


def test_inputs_name_what_the_loss_takes():
    none = NoTeacher().inputs(Microbatch(step=0, index=0), training=True)
    assert not none.present and none.watched is None
    assert set(none.loss_kwargs()) == {"teacher_hidden", "teacher_weight", "teacher_topk_ids",
                                       "teacher_topk_logprobs"}
    lp = torch.zeros(2, 1, 3)
    sparse = TeacherInputs(topk_ids=torch.zeros(2, 1, 3, dtype=torch.long), topk_logprobs=lp)
    assert sparse.present and sparse.watched is lp


def test_cached_source_gives_nothing_in_evaluation():
    source = Cached(None, directory="c", depth=2, active=True, micro_batch_size=1, device=None)
    assert not source.inputs(Microbatch(step=0, index=0), training=False).present
    assert source.summary() == {"teacher_in_memory": False, "topk_wait_s": None}
    assert source.step_stats(None) == StepStats(scalars={"kd_cache_wait_s": 0.0,
                                                         "kd_cache_read_tokens_per_s": None})


def test_kd_scalars_are_named_alike_for_both_trainers():
    record = {"kd_wire_bytes": 10, "kd_wire_bytes_to_teacher": 4, "kd_teacher_wait_s": 0.5,
              "kd_ring_occupancy": None, "kd_live_replicas": 2, "failovers": 0,
              "kd_replica_tokens": {"a": 30}, "loss": 1.0}
    # a Megatron-LM step: rates from the tokens and the step's time
    scalars = kd_scalars(record, step_time_s=2.0)
    assert scalars == {"kd/wire-bytes": 10.0, "kd/wire-bytes-out": 4.0,
                       "kd/teacher-wait-s": 0.5, "kd/live-replicas": 2.0, "kd/failovers": 0.0,
                       "kd/replica-a/tokens-per-s": 15.0}
    # megatron-kd train's record carries the rates it logged: the same scalars
    logged = {**record, "kd_replica_tokens_per_s": replica_rates({"a": 30}, 2.0)}
    assert kd_scalars(logged) == scalars
    assert replica_rates({"a": 30}, None) == {}


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
    remote = Remote(None, SimpleNamespace(vocab_size=1009), weight=None, run=0, tp_group=None,
                    dp_rank=0, dp_size=1, micro_batch_size=1, seq_length=4, max_samples=1,
                    active=False, log=None)
    assert remote.vocab_size == 1009
    reader = SimpleNamespace(spec=SimpleNamespace(vocab_size=500))
    cached = Cached(reader, directory="c", depth=2, active=True, micro_batch_size=1, device=None)
    assert cached.vocab_size == 500
