"""Where the teacher's side of the loss comes from: one interface, one class per source.

A :class:`TeacherSource` gives the fused loss its teacher arguments for a microbatch
(:meth:`~TeacherSource.inputs`), is started with the run's microbatches in training order
(:meth:`~TeacherSource.start`), reports its step's statistics (:meth:`~TeacherSource.step_stats`)
and is closed once (:meth:`~TeacherSource.close`). ``megatron-kd train``
(:class:`~megatron_kd.training.trainer.Trainer`) and Megatron-LM's forward step
(:mod:`megatron_kd.megatron_lm`) both use it, and :func:`kd_scalars` names the
statistics alike for both. The mode is read in one place, :func:`build_teacher_source`:

=====================  ==================  =================================================
``--kd-mode``          source              the teacher's outputs
=====================  ==================  =================================================
(no teacher)           :class:`NoTeacher`  none: the student's cross-entropy only
``colocated``          :class:`Colocated`  a frozen ``GPTModel`` on the student's last
                                           pipeline stage, over the student's TP group
``disaggregated``      :class:`Remote`     hidden states from ``megatron-kd teacher serve``
                                           replicas, through a prefetching client
``offline``            :class:`Cached`     top-K ids and log-probs decoded from a cache
=====================  ==================  =================================================

A source is built on every rank (its construction may be collective: a checkpoint load, a run
id); ``active`` says whether this rank is one that computes the loss (the last pipeline stage),
and only active ranks start clients or decoders. A layout (sequence or context parallelism,
virtual stages) changes the sources here, once for both trainers.

The module is one piece: the four sources implement one interface and are read side by side (a
change to the interface changes each of them).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from megatron_kd.arch import GPTArchConfig
from megatron_kd.cache.loader import TopKPrefetcher
from megatron_kd.cache.lookup import TokenLookup
from megatron_kd.integration.args import KDArgs
from megatron_kd.integration.groups import collective_device, shared_random_id
from megatron_kd.integration.output_layer import output_layer_weight, to_sbh
from megatron_kd.integration.teacher import (
    build_frozen_teacher,
    connect_teacher,
    load_output_layer_shard,
    unpipelined_groups,
)
from megatron_kd.placement import compute_device
from megatron_kd.teacher.step_stats import ClientStepStats

__all__ = ["Cached", "Colocated", "Microbatch", "NoTeacher", "Remote", "StepStats",
           "TeacherInputs", "TeacherSource", "build_teacher_source", "kd_scalars",
           "replica_rates"]


@dataclass(frozen=True, kw_only=True)
class Microbatch:
    """One microbatch, as a teacher source needs to know it."""

    step: int
    """The training step it belongs to (0-based)."""

    index: int
    """Its place within the step."""

    sample_ids: tuple[int, ...] = ()
    """The dataset samples it holds (empty where the trainer does not know them:
    Megatron-LM's data iterator)."""

    tokens: torch.Tensor | Callable[[], torch.Tensor] | None = None
    """``[b, s]`` token ids, or a function that reads them (a schedule collates only the
    microbatches a source asks the tokens of)."""

    positions: torch.Tensor | None = None
    """The sequence positions this rank trains on, in its order (context parallelism: its
    load-balanced chunks); None: the whole sequence."""

    model_inputs: tuple[tuple, dict] | Callable[[], tuple[tuple, dict]] | None = None
    """The positional and keyword arguments to call a model with on this microbatch (the
    student's own, where it had them), or a function that makes them (only a colocated
    teacher asks)."""

    def token_ids(self) -> torch.Tensor:
        """``[b, s]`` token ids."""
        if self.tokens is None:
            raise RuntimeError(f"no token ids for microbatch {self.index} of step {self.step}")
        return self.tokens() if callable(self.tokens) else self.tokens

    def model_call(self) -> tuple[tuple, dict]:
        """``(args, kwargs)`` to call a model with on this microbatch."""
        if self.model_inputs is None:
            raise RuntimeError(f"no model inputs for microbatch {self.index} of step "
                               f"{self.step}")
        return self.model_inputs() if callable(self.model_inputs) else self.model_inputs


@dataclass(frozen=True)
class TeacherInputs:
    """The loss's teacher arguments for one microbatch: a dense teacher (hidden states and the
    output-layer shard), a sparse one (top-K ids and log-probs), or none."""

    hidden: torch.Tensor | None = None
    """``[s, b, h_t]`` final hidden states."""

    weight: torch.Tensor | None = None
    """``[local_vocab_size, h_t]`` the teacher's output-layer shard."""

    topk_ids: torch.Tensor | None = None
    """``[s, b, K]`` top-K token ids."""

    topk_logprobs: torch.Tensor | None = None
    """``[s, b, K]`` their log-probabilities."""

    what: str = ""
    """What the values are and where they came from (named when one is not finite)."""

    @property
    def present(self) -> bool:
        return self.hidden is not None or self.topk_ids is not None

    @property
    def watched(self) -> torch.Tensor | None:
        """The tensor a non-finite check watches."""
        return self.hidden if self.hidden is not None else self.topk_logprobs

    def loss_kwargs(self) -> dict[str, torch.Tensor | None]:
        """As :func:`~megatron_kd.integration.loss_func.make_kd_loss_func` takes them."""
        return {"teacher_hidden": self.hidden, "teacher_weight": self.weight,
                "teacher_topk_ids": self.topk_ids, "teacher_topk_logprobs": self.topk_logprobs}


@dataclass
class StepStats:
    """A step's statistics of a source: scalars for the JSON log, and events (failovers), one
    JSON line each."""

    scalars: dict[str, Any] = field(default_factory=dict)
    events: list[dict] = field(default_factory=list)


class TeacherSource:
    """The teacher of a run (see the module docstring); the base class is also "no teacher"."""

    timer: str | None = None
    """The step timer its :meth:`inputs` is timed under (``--timing-log-level``)."""

    holds_model: bool = False
    """Whether this rank holds a teacher model."""

    model = None
    """The teacher model this rank holds (a colocated teacher's last pipeline stage)."""

    client = None
    """The started teacher client (a disaggregated teacher's active ranks)."""

    vocab_size: int | None = None
    """The teacher's true vocabulary (the loss's ``vocab_size``: output-layer rows at or past it
    are padding); None without a teacher."""

    streamed: bool = False
    """Whether each training microbatch's inputs can be taken once only, in the schedule's
    order (a stream of responses): a step run again must be given the inputs kept from its
    first run."""

    def start(self, schedule: Iterable[Microbatch]) -> None:
        """Begin serving the microbatches of ``schedule`` (training order, from the resume step
        to the stop step), ahead of training where the source can."""

    def inputs(self, mb: Microbatch, *, training: bool) -> TeacherInputs:
        """The teacher arguments of ``mb`` (the next microbatch of the schedule when
        ``training``; an evaluation microbatch otherwise)."""
        return TeacherInputs()

    def step_stats(self, group: Any) -> StepStats:
        """This step's statistics, summed over ``group`` (collective on it; None: this rank's
        own, no collective). Every rank of ``group`` calls it, active or not."""
        return StepStats()

    def summary(self) -> dict[str, Any]:
        """What a run's summary says of its teacher on this rank."""
        return {"teacher_in_memory": self.holds_model}

    def announcement(self) -> str | None:
        """A line for the run's start, where the source has something to say."""
        return None

    def checkpoint_record(self) -> dict[str, Any]:
        """What a student checkpoint records of its teacher beyond ``--kd-teacher-load``."""
        return {}

    def close(self) -> None:
        """Stop clients and decoders; free what the source made (idempotent)."""


class NoTeacher(TeacherSource):
    """No teacher: the loss is the student's cross-entropy."""


class Colocated(TeacherSource):
    """A frozen teacher model over the student's TP group, on the student's last pipeline
    stage (every stage builds and loads it: the load is collective; see :func:`colocated`)."""

    timer = "teacher-forward"

    def __init__(self, model, *, load_dir: str, groups: list | None = None,
                 vocab_size: int | None = None) -> None:
        self.model = model
        self.holds_model = model is not None
        self.load_dir = load_dir
        self._groups = list(groups or [])
        self.vocab_size = vocab_size

    def inputs(self, mb: Microbatch, *, training: bool) -> TeacherInputs:
        args, kwargs = mb.model_call()
        with torch.no_grad():
            hidden = to_sbh(self.model(*args, **kwargs))
        return TeacherInputs(hidden=hidden, weight=output_layer_weight(self.model),
                             what=f"hidden states of the colocated teacher {self.load_dir}")

    def close(self) -> None:
        for group in self._groups:
            dist.destroy_process_group(group)
        self._groups = []


def colocated(kd: KDArgs, arch: GPTArchConfig, *, keep: bool, pg_collection=None,
              own_groups: bool = True, sequence_parallel: bool = False) -> Colocated:
    """Build and load the whole (un-pipelined) teacher over the student's TP group, with the
    student's sequence parallelism; collective over the world (every rank loads; only ``keep``
    ranks hold it after). ``own_groups``: the source destroys the one-rank pipeline group it
    made when closed."""
    pgc, single = unpipelined_groups(pg_collection)
    # Replicated on every pipeline stage: several ranks read the same shard.
    model = build_frozen_teacher(arch, kd.teacher_load, dtype=kd.teacher_torch_dtype,
                                 pg_collection=pgc, replicated=True, keep=keep,
                                 sequence_parallel=sequence_parallel)
    return Colocated(model, load_dir=kd.teacher_load, groups=[single] if own_groups else [],
                     vocab_size=arch.vocab_size)


def replica_rates(tokens_by_replica: dict[str, int], seconds: float | None) -> dict[str, float]:
    """Tokens each replica answered, per second of ``seconds``."""
    if not seconds:
        return {}
    return {replica: round(n / seconds, 1) for replica, n in tokens_by_replica.items()}


class Remote(TeacherSource):
    """Hidden states from teacher replicas (``megatron-kd teacher serve``) registered at
    ``--kd-teacher-endpoint``; the student's ranks hold only the teacher's output-layer shard.

    On an active rank :meth:`start` connects a
    :class:`~megatron_kd.teacher.client.TeacherClient`: TP rank 0 of each data-parallel rank
    sends the token ids of the schedule's microbatches ``--kd-prefetch-depth`` ahead, every TP
    rank receives its chunk of the hidden states. Evaluation microbatches have no teacher (the
    replicas stream training microbatches only).
    """

    timer = "teacher-wait"
    streamed = True

    def __init__(self, kd: KDArgs, arch: GPTArchConfig, *, weight: torch.Tensor, run: int,
                 tp_group, dp_rank: int, dp_size: int, micro_batch_size: int, seq_length: int,
                 max_samples: int, active: bool, log: Callable[[str], None] | None,
                 sequence_parallel: bool = False, cp_group=None, tp_cp_group=None) -> None:
        self.kd, self.arch, self.weight, self.run = kd, arch, weight, run
        self.sequence_parallel = sequence_parallel
        self.cp_group, self.tp_cp_group = cp_group, tp_cp_group
        self.tp_group, self.dp_rank, self.dp_size = tp_group, dp_rank, dp_size
        self.micro_batch_size, self.seq_length = micro_batch_size, seq_length
        self.max_samples, self.active, self.log = max_samples, active, log
        self.client = None
        self.vocab_size = arch.vocab_size if arch is not None else None

    @property
    def member(self) -> int:
        """This rank's place among the student ranks a connection answers (0 sends)."""
        tp_rank = self.tp_group.rank() if self.tp_group is not None else 0
        tp = self.tp_group.size() if self.tp_group is not None else 1
        return (self.cp_group.rank() if self.cp_group is not None else 0) * tp + tp_rank

    def start(self, schedule: Iterable[Microbatch]) -> None:
        if not self.active:
            return
        tp_group = self.tp_group if self.tp_group is not None and self.tp_group.size() > 1 \
            else None
        self.client = connect_teacher(
            self.kd, self.arch, run=self.run, dp_rank=self.dp_rank, tp_group=tp_group,
            micro_batch_size=self.micro_batch_size, seq_length=self.seq_length,
            schedule=((mb.step, mb.index, mb.sample_ids, mb.token_ids()) for mb in schedule),
            device=collective_device(), max_samples=self.max_samples, log=self.log,
            sequence_parallel=self.sequence_parallel, cp_group=self.cp_group,
            tp_cp_group=self.tp_cp_group)

    def inputs(self, mb: Microbatch, *, training: bool) -> TeacherInputs:
        if not training:
            return TeacherInputs()
        hidden = self.client.hidden(mb.step, mb.index, mb.sample_ids or None)
        return TeacherInputs(hidden=hidden, weight=self.weight,
                             what=f"teacher hidden states received from {self.client.replica}")

    def step_stats(self, group: Any) -> StepStats:
        """Hidden-state bytes received, token-id bytes sent (counted by the client: the first
        rank of each data-parallel rank's TP x CP group sends), seconds a receiving rank waited
        (mean over them), the prefetch ring's fill when a response was asked for (mean over the
        sending ranks), live replicas (as data-parallel rank 0's sending rank sees them),
        failovers (each also an event) and tokens answered by each replica. Over ``group``:
        one all-reduce and one object gather; with ``group`` None this rank's own (events and
        live replicas as its client saw them)."""
        client = self.client
        head = client is not None and (self.member == 0 or group is None)
        stats = client.take_step_stats(count_live=head and (self.dp_rank == 0 or group is None)) \
            if client is not None else ClientStepStats()
        if not head:  # the other members of a connection fail over with it: one reports
            stats = replace(stats, failovers=[])
        if group is not None:
            t = torch.tensor(stats.to_vector(), dtype=torch.float64,
                             device=collective_device(group))
            dist.all_reduce(t, group=group)
            gathered = [None] * dist.get_world_size(group)
            dist.all_gather_object(gathered, stats.gathered(), group=group)
            stats = ClientStepStats.combine(t.tolist(), gathered)
        return StepStats(scalars={
            "kd_wire_bytes": stats.bytes_received,
            "kd_wire_bytes_per_dp_rank": stats.bytes_received // self.dp_size,
            "kd_wire_bytes_to_teacher": stats.bytes_sent, "failovers": len(stats.failovers),
            "kd_teacher_wait_s": round(stats.wait_s, 6) if stats.wait_s is not None else 0.0,
            "kd_ring_occupancy": round(stats.occupancy, 4) if stats.occupancy is not None
            else None,
            "kd_live_replicas": stats.live_replicas,
            "kd_replica_tokens": dict(stats.tokens_by_replica)}, events=stats.failovers)

    def close(self) -> None:
        if self.client is not None:
            self.client.close()


class _CacheRates(NamedTuple):
    """A cache-reading rank's step (summed over ranks by one all-reduce, field by field)."""

    wait_s: float
    """Seconds waited for decoded targets this step."""
    tokens: float
    """Tokens decoded so far."""
    decode_s: float
    """Seconds spent decoding so far."""
    readers: float
    """1 on a rank that reads the cache, else 0."""


class Cached(TeacherSource):
    """Top-K teacher ids and log-probs from a cache made by ``megatron-kd cache build``, read
    by dataset sample index (so any DP / TP / micro-batch layout reads the same cache),
    decoded ahead of training on a background thread of each active rank. ``by_tokens``
    (Megatron-LM's ``pretrain_gpt.py``, whose data iterator gives no sample indices): each
    microbatch's rows are found by its tokens' fingerprints and read in step
    (:class:`~megatron_kd.cache.lookup.TokenLookup`). Evaluation microbatches have no teacher
    (the cache holds the training samples only)."""

    timer = "teacher-wait"

    def __init__(self, reader, *, directory: str, depth: int, active: bool,
                 micro_batch_size: int, device: torch.device | None,
                 tail: str = "renormalize", by_tokens: bool = False, dp_rank: int = 0) -> None:
        self.reader, self.directory, self.depth, self.active = reader, directory, depth, active
        self.tail, self.by_tokens, self.dp_rank = tail, by_tokens, dp_rank
        self.micro_batch_size, self.device = micro_batch_size, device
        self.prefetcher: TopKPrefetcher | None = None
        self.lookup: TokenLookup | None = None
        self._waited = 0.0
        self.vocab_size = reader.spec.vocab_size if reader is not None else None  # its teacher's

    def start(self, schedule: Iterable[Microbatch]) -> None:
        if not self.active:
            return
        if self.by_tokens:
            self.lookup = TokenLookup(self.reader, self.directory)
            return
        # Decoding threads compete with the CPU's own compute; on a GPU they are spare.
        threads = 1 if self.device is None else min(4, self.micro_batch_size)
        self.prefetcher = TopKPrefetcher(self.reader, (mb.sample_ids for mb in schedule),
                                         depth=self.depth, threads=threads, device=self.device)

    def _targets(self, mb: Microbatch) -> tuple[list[int], torch.Tensor, torch.Tensor]:
        """``(sample indices, ids [s, b, K], logprobs [s, b, K])`` of ``mb``."""
        if self.lookup is None:
            return list(mb.sample_ids), *self.prefetcher.next(mb.sample_ids)
        rows = self.lookup.rows(mb.token_ids(), lambda b: (
            f"sample {b} of microbatch {mb.index} of step {mb.step + 1} (counted from the "
            f"run's start) on data-parallel rank {self.dp_rank}"))
        return [index for index, _ in rows], *self.lookup.read(rows, self.device)

    def inputs(self, mb: Microbatch, *, training: bool) -> TeacherInputs:
        if not training:
            return TeacherInputs()
        try:
            samples, ids, logprobs = self._targets(mb)
        except FloatingPointError as e:  # decoded NaN / inf: named with the step here
            raise FloatingPointError(f"non-finite teacher values (NaN or inf) at step "
                                     f"{mb.step + 1}, microbatch {mb.index}: {e}; no optimizer "
                                     f"step was taken") from e
        if mb.positions is not None:  # a cache is per sequence: this rank's positions of it
            rows = mb.positions.to(ids.device)
            ids, logprobs = ids.index_select(0, rows), logprobs.index_select(0, rows)
        return TeacherInputs(topk_ids=ids, topk_logprobs=logprobs,
                             what=f"top-K log-probs of samples {samples} read from "
                                  f"the cache {self.directory}")

    def step_stats(self, group: Any) -> StepStats:
        """This step's seconds waiting for decoded targets (mean over the ranks that read the
        cache) and the decoder's rate so far (tokens decoded over decoding seconds, over those
        ranks: it decodes ahead, so a step may decode nothing); one all-reduce over ``group``."""
        p = self.prefetcher if self.prefetcher is not None else self.lookup
        wait_s, tokens, decode_s = p.rates() if p is not None else (0.0, 0, 0.0)
        rates = _CacheRates(wait_s=wait_s - self._waited, tokens=tokens, decode_s=decode_s,
                            readers=float(p is not None))
        self._waited = wait_s
        if group is not None:  # every field a sum over the ranks
            t = torch.tensor(rates, dtype=torch.float64, device=collective_device(group))
            dist.all_reduce(t, group=group)
            rates = _CacheRates(*t.tolist())
        return StepStats(scalars={
            "kd_cache_wait_s": round(rates.wait_s / rates.readers, 6) if rates.readers else 0.0,
            "kd_cache_read_tokens_per_s": (round(rates.tokens / rates.decode_s, 1)
                                           if rates.decode_s else None)})

    def summary(self) -> dict[str, Any]:
        return {**super().summary(),
                "topk_wait_s": self.prefetcher.wait_s if self.prefetcher is not None else None}

    def announcement(self) -> str:
        spec = self.reader.spec
        return (f"megatron-kd: offline teacher: top-{spec.topk} cache {self.directory} (teacher "
                f"{spec.teacher_checkpoint}, tail {self.tail})")

    def checkpoint_record(self) -> dict[str, Any]:
        # the cache's teacher, and the cache itself
        return {"teacher": self.reader.spec.teacher_checkpoint,
                "topk_cache": os.path.abspath(self.directory)}

    def close(self) -> None:
        if self.prefetcher is not None:
            self.prefetcher.close()


def build_teacher_source(kd: KDArgs, teacher_arch: GPTArchConfig | None, *, active: bool,
                         tp_group, dp_rank: int, dp_size: int, micro_batch_size: int,
                         seq_length: int, topk_cache=None, pg_collection=None,
                         own_groups: bool = True, max_samples: int | None = None,
                         log: Callable[[str], None] | None = None,
                         sequence_parallel: bool = False, cp_group=None,
                         tp_cp_group=None, rows_by_tokens: bool = False) -> TeacherSource:
    """The run's teacher source (the one place the KD mode is read); collective over the
    world. ``active``: this rank computes the loss (the student's last pipeline stage).
    ``topk_cache``: offline, the opened and checked cache reader. ``max_samples``: sample ids a
    request header holds (default: the micro-batch size). ``sequence_parallel``: the student's
    loss takes this TP rank's slice of the sequence (a dense teacher's hidden states come so:
    a colocated teacher runs sequence-parallel too, a remote one's chunks are not gathered;
    top-K targets cover the whole sequence either way). ``cp_group`` / ``tp_cp_group``: context
    parallelism's group and the TP x CP group (a remote teacher answers each CP rank its
    positions; a colocated one runs in the student's groups, context parallelism included).
    ``rows_by_tokens``: offline, the trainer knows no sample indices; each microbatch's cache
    rows are found by its tokens."""
    if kd.mode == "offline":
        return Cached(topk_cache, directory=kd.topk_cache, depth=kd.prefetch_depth,
                      active=active, micro_batch_size=micro_batch_size,
                      device=compute_device(),
                      tail=kd.loss.topk_tail, by_tokens=rows_by_tokens, dp_rank=dp_rank)
    if teacher_arch is None:
        return NoTeacher()
    if kd.mode == "disaggregated":
        tp = tp_group.size() if tp_group is not None else 1
        # only the teacher's output layer (a collective load) and an id for this run
        weight = load_output_layer_shard(kd.teacher_load, teacher_arch, kd.teacher_torch_dtype,
                                         tp)
        return Remote(kd, teacher_arch, weight=weight, run=shared_random_id(),
                      tp_group=tp_group, dp_rank=dp_rank, dp_size=dp_size,
                      micro_batch_size=micro_batch_size, seq_length=seq_length,
                      max_samples=max_samples or micro_batch_size, active=active,
                      log=log or log_event, sequence_parallel=sequence_parallel,
                      cp_group=cp_group, tp_cp_group=tp_cp_group)
    return colocated(kd, teacher_arch, keep=active, pg_collection=pg_collection,
                     own_groups=own_groups, sequence_parallel=sequence_parallel)


def log_event(line: str) -> None:
    """A failover or rebalance event of a teacher client, on stderr."""
    print(f"megatron-kd[rank {dist.get_rank()}]: {line}", file=sys.stderr, flush=True)


#: Statistics of a step (the JSON log's keys) -> the scalar each is written as.
_KD_SCALARS = {"kd_wire_bytes": "kd/wire-bytes", "kd_wire_bytes_to_teacher": "kd/wire-bytes-out",
               "kd_teacher_wait_s": "kd/teacher-wait-s",
               "kd_ring_occupancy": "kd/ring-occupancy", "kd_live_replicas": "kd/live-replicas",
               "failovers": "kd/failovers", "kd_cache_wait_s": "kd/cache-wait-s",
               "kd_cache_read_tokens_per_s": "kd/cache-read-tokens-per-s"}


def kd_scalars(stats: dict[str, Any], step_time_s: float | None = None) -> dict[str, float]:
    """The ``kd/`` scalars of a step's source statistics (a JSON step record, or
    :attr:`StepStats.scalars`); replicas' token rates from ``kd_replica_tokens_per_s`` or, if
    absent, ``kd_replica_tokens`` over ``step_time_s``."""
    out = {name: stats[key] for key, name in _KD_SCALARS.items()
           if stats.get(key) is not None}
    rates = stats.get("kd_replica_tokens_per_s")
    if rates is None:
        rates = replica_rates(stats.get("kd_replica_tokens") or {}, step_time_s)
    for replica, rate in rates.items():
        out[f"kd/replica-{replica}/tokens-per-s"] = rate
    return {k: float(v) for k, v in out.items()}
