"""A plan: what it is asked, :class:`PlanOptions` (every input, validated once, and the one place
their defaults are written), and what it answers, :class:`ModePlan` (one :class:`Mode`'s plan,
frozen: memory terms keyed by :class:`~.memory.Term`, traffic by :class:`~.traffic.Traffic`) and
:class:`PlanResult` (every mode's plan and the recommendation among them). How a plan is found:
:mod:`.search`.

Assumptions stated here, used everywhere: the teacher's micro-batch equals the student's; tensor
parallelism stays inside a node; expert-tensor parallelism is 1 unless given; a fixed reserve
(:attr:`PlanOptions.reserve_bytes`: CUDA context ~0.5-1 GiB, NCCL buffers ~1-2 GiB, allocator
fragmentation) is part of every GPU's total.

The module is one piece: the inputs, the answers and the recommendation are the planner's
vocabulary, read together by every other module of it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from enum import Enum
from types import MappingProxyType

from megatron_kd.flags import WIRE_DTYPES, KDSharedFlags, default_of
from megatron_kd.parallel.windows import DEFAULT_WEIGHT_GRAD
from megatron_kd.planner.memory import (
    CP_COMM_TYPES,
    DEFAULT_GPU_WINDOW_BYTES,
    GIB,
    RECOMPUTE_CHOICES,
    RECOMPUTE_METHODS,
    ActivationOptions,
    GpuLoss,
    ParallelLayout,
    Precision,
    Term,
)
from megatron_kd.planner.models import PlannedModel
from megatron_kd.planner.presets import GpuSpec, LinkSpec
from megatron_kd.planner.traffic import Traffic


class Mode(Enum):
    """A way of placing the teacher. The value is the mode's name on the command line and in
    reports."""

    COLOCATED_DENSE = "colocated-dense"
    """Teacher on the student's GPUs (same TP / PP, its experts spread over an expert-parallel
    size of its own), the incumbent dense KD loss (full ``[s, b, V/t]`` logits of both)."""

    COLOCATED_FUSED = "colocated-fused"
    """The same, with megatron_kd's fused loss (windows of ``w`` rows)."""

    OFFLINE_CACHE = "offline-cache"
    """No teacher at training time; the student reads top-K targets from a cache built
    beforehand (its build cost is reported as teacher GPU-hours per billion tokens)."""

    DISAGGREGATED = "disaggregated"
    """Teachers on their own nodes stream final hidden states ``[s, b, h_t]``; the student holds
    only the teacher's output-layer shard and the prefetch ring."""

    @property
    def colocated(self) -> bool:
        """Whether the teacher runs on the student's GPUs."""
        return self in (Mode.COLOCATED_DENSE, Mode.COLOCATED_FUSED)


@dataclass(kw_only=True, frozen=True)
class PlanOptions:
    """Everything a plan depends on. The defaults written here are the only ones: ``megatron-kd
    plan`` leaves out what its command line does not give."""

    student: PlannedModel
    """The model being trained."""

    teacher: PlannedModel
    """The frozen teacher."""

    gpu: GpuSpec
    """GPU of every node (students and teachers)."""

    inter_node_link: LinkSpec
    """Per-GPU link between nodes (teacher -> student hidden states cross it)."""

    gpus_per_node: int = 8
    """GPUs per node; tensor parallelism stays inside a node."""

    nodes: int = 1
    """Nodes of the student (all modes); disaggregated teachers come on top, as computed."""

    seq_length: int = 4096
    """Tokens per sequence ``s``."""

    micro_batch_size: int = 1
    """Sequences per micro-batch ``b``."""

    global_batch_size: int = 128
    """Sequences per optimizer step ``G``."""

    tp: int | None = None
    """Student tensor-parallel size; None = search."""

    pp: int | None = None
    """Student pipeline-parallel size; None = search."""

    ep: int | None = None
    """Student expert-parallel size (MoE students); None = search."""

    etp: int = 1
    """Student expert-tensor-parallel size."""

    cp: int | None = None
    """Student context-parallel size (each sequence split over ``cp`` ranks); None = search:
    context parallelism only where no layout without it fits without full recompute (see
    :mod:`.search`)."""

    cp_comm_type: str | None = None
    """Context parallelism's K/V exchange: ``p2p``, ``all_gather`` or ``a2a`` (Megatron's
    ``--cp-comm-type``); None = Megatron-Core's default ``p2p``, or ``a2a`` where Transformer
    Engine runs nothing else (attention sinks, sliding windows)."""

    vp: int | None = None
    """Student virtual pipeline stages per pipeline rank (interleaved 1F1B when > 1); None =
    search (with ``pp > 1``: every ``v`` whose virtual stages hold whole, equal numbers of layers),
    unless :attr:`layers_per_virtual_stage` says."""

    layers_per_virtual_stage: int | None = None
    """Megatron-LM's ``--num-layers-per-virtual-pipeline-stage``: ``v = L / (p * this)``; None =
    as :attr:`vp` says."""

    recompute: str | None = None
    """``none`` / ``selective`` / ``full``; None = search (least that fits)."""

    recompute_method: str | None = None
    """Full recompute's ``uniform`` / ``block``; None = search (with :attr:`recompute` ``full`` or
    searched)."""

    recompute_num_layers: int | None = None
    """Full recompute's ``--recompute-num-layers``; None = search."""

    sequence_parallel: bool | None = None
    """None = on whenever ``tp > 1``."""

    use_distributed_optimizer: bool | None = None
    """Shard optimizer state over data parallel (Megatron ``--use-distributed-optimizer``); None
    = on wherever ``dp > 1``: the reduce-scatter and all-gather it runs move the bytes of the
    all-reduce it replaces, and the fp32 state shrinks ``dp``-fold."""

    teacher_tp: int | None = None
    """Disaggregated teacher tensor-parallel size; None = search."""

    teacher_pp: int | None = None
    """Disaggregated teacher pipeline-parallel size; None = search."""

    teacher_ep: int | None = None
    """Teacher expert-parallel size (both colocated and disaggregated); None = search."""

    window_size: int | None = None
    """Fused-loss rows per window ``w`` (an upper bound on rows in flight, ``--kd-window-size``);
    None = the loss's default: on its GPU path the byte budget :attr:`loss_window_bytes`, on
    its CPU path a 64 MiB fp32 ``[w, V/t]`` buffer."""

    loss_path: str = "gpu"
    """The fused loss's path the run takes: ``gpu`` (what CUDA inputs take: windows of
    :attr:`loss_window_bytes` of input-dtype logits, the :attr:`loss_weight_grad`
    accumulator), ``cpu`` (cache-sized fp32 windows: the CPU runs
    ``megatron_kd.commands.plan_adapter`` plans, which validate the planner) or ``dense`` (the
    reference baseline, ``--kd-loss-path dense``: the logits written, in any mode)."""

    loss_window_bytes: int = DEFAULT_GPU_WINDOW_BYTES
    """The GPU path's bound on one window's logits (``--kd-loss-window-mib``, 1 GiB)."""

    loss_weight_grad: str = DEFAULT_WEIGHT_GRAD
    """The GPU path's output-layer accumulator (``--kd-loss-weight-grad``): ``fp32_gemm``,
    ``fp32_add`` or ``input_dtype``."""

    prefetch_depth: int = default_of(KDSharedFlags, "prefetch_depth")
    """Receive slots ``D`` of the disaggregated ring, and micro-batches the cache reader decodes
    ahead (into host memory); the default is ``--kd-prefetch-depth``'s."""

    topk: int = default_of(KDSharedFlags, "topk")
    """Entries per token in the offline cache; the default is ``--kd-topk``'s (``cache
    build``'s)."""

    cache_entry_bytes: float | None = None
    """Bytes per cached entry on storage, a token's share included (``--kd-cache-entry-bytes``):
    the cache's size and read rate. None: what ``cache build``'s default encoding takes for the
    teacher's vocabulary (:func:`~megatron_kd.planner.traffic.cache_bytes_per_token`, about 2.9
    bytes an entry at K = 100). Decoded in memory an entry takes 12 bytes
    (``memory.cache_reader_bytes``)."""

    loss_block_elements: int | None = None
    """Elements per block of the fused loss's elementwise work: None on a GPU and with TP > 1 (a
    block is the window); on CPU runs without TP
    ``megatron_kd.loss.config.CpuTuning.block_elements`` (``2^21``)."""

    cache_resident_microbatches: int = 1
    """Micro-batches of decoded top-K targets in the student's device memory: 1 on a GPU (the
    one in use; the prefetched ones wait in host memory); ``prefetch_depth + 2`` where host memory
    is the device memory (CPU runs: ``D`` queued, one being decoded, one in use)."""

    hidden_elem_bytes: int = 2
    """Bytes per element of the teacher's hidden states once received (its dtype, bf16): the
    all-gather over the student's TP group and the gathered buffer."""

    teacher_replicas: int | None = None
    """Disaggregated: the number of teacher replicas to plan with (None: as many as the
    student's rate needs). With fewer, the student waits for its teacher: its step is the
    replicas' time for the step's tokens."""

    wire_dtype: str = "bf16"
    """``--kd-wire-dtype``: the hidden states' element type on the wire (fp32, bf16, or fp8
    with one fp32 scale per token); the default is the flag's, the teacher's dtype, which the
    plan takes as bf16."""

    loss_stats: int = 5
    """fp32 per-row values the fused loss all-reduces over TP per window: forward KL needs the
    student and teacher maxima (one MAX all-reduce) and three sums (one SUM all-reduce); CE adds
    one, JSD a third all-reduce of two."""

    mfu: float = 0.40
    """Assumed model FLOP utilisation of student training."""

    teacher_mfu: float = 0.40
    """Assumed model FLOP utilisation of the teacher's forward."""

    link_efficiency: float = 0.8
    """Fraction of a link's line rate that transfers achieve."""

    reserve_bytes: int = 4 * GIB
    """Per-GPU reserve: CUDA context, NCCL buffers, allocator fragmentation."""

    headroom: float = 0.05
    """Fraction of each GPU's memory a plan leaves free on top of the reserve (the model's
    estimates are not exact): a layout fits when its peak is at most ``(1 - headroom)`` of the
    GPU's memory."""

    precision: Precision = field(default_factory=Precision)
    """Bytes per element of weights, gradients, optimizer state and activations."""

    activation: ActivationOptions = field(default_factory=ActivationOptions)
    """Kernel choices (flash attention, dropout)."""

    def __post_init__(self) -> None:
        for name in (
            "gpus_per_node",
            "nodes",
            "seq_length",
            "micro_batch_size",
            "global_batch_size",
            "topk",
            "cache_resident_microbatches",
            "hidden_elem_bytes",
            "loss_stats",
            "etp",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"PlanOptions.{name} must be a positive int, got {value!r}")
        if self.cache_entry_bytes is not None and (
                isinstance(self.cache_entry_bytes, bool)
                or not isinstance(self.cache_entry_bytes, int | float)
                or not self.cache_entry_bytes > 0):
            raise ValueError(f"PlanOptions.cache_entry_bytes must be a positive number or None, "
                             f"got {self.cache_entry_bytes!r}")
        if self.teacher_replicas is not None and (
                not isinstance(self.teacher_replicas, int) or self.teacher_replicas <= 0):
            raise ValueError(f"PlanOptions.teacher_replicas must be a positive int or None, got "
                             f"{self.teacher_replicas!r}")
        if self.wire_dtype not in WIRE_DTYPES:
            raise ValueError(f"PlanOptions.wire_dtype must be one of {WIRE_DTYPES}, got "
                             f"{self.wire_dtype!r}")
        if self.loss_path not in ("gpu", "cpu", "dense"):
            raise ValueError(f"PlanOptions.loss_path must be 'gpu', 'cpu' or 'dense', got "
                             f"{self.loss_path!r}")
        self.gpu_loss  # noqa: B018 - validates the GPU path's settings
        for name in ("window_size", "loss_block_elements"):
            value = getattr(self, name)
            if value is not None and (
                not isinstance(value, int) or isinstance(value, bool) or value <= 0
            ):
                raise ValueError(
                    f"PlanOptions.{name} must be a positive int or None, got {value!r}"
                )
        if self.cp is not None and (
                not isinstance(self.cp, int) or isinstance(self.cp, bool) or self.cp <= 0):
            raise ValueError(f"PlanOptions.cp must be a positive int or None, got {self.cp!r}")
        if self.cp_comm_type is not None and self.cp_comm_type not in CP_COMM_TYPES:
            raise ValueError(f"PlanOptions.cp_comm_type={self.cp_comm_type!r}; choose from "
                             f"{list(CP_COMM_TYPES)}")
        if self.prefetch_depth < 1:
            raise ValueError(f"prefetch_depth must be >= 1, got {self.prefetch_depth}")
        if self.global_batch_size % self.micro_batch_size:
            raise ValueError(
                f"global_batch_size={self.global_batch_size} is not a multiple of "
                f"micro_batch_size={self.micro_batch_size}"
            )
        for name in ("mfu", "teacher_mfu", "link_efficiency"):
            value = getattr(self, name)
            if not 0 < value <= 1:
                raise ValueError(f"PlanOptions.{name} must be in (0, 1], got {value}")
        if self.recompute is not None and self.recompute not in RECOMPUTE_CHOICES:
            raise ValueError(f"recompute={self.recompute!r}; choose from {list(RECOMPUTE_CHOICES)}")
        self._check_recompute_and_vp()
        for name in ("tp", "teacher_tp"):
            value = getattr(self, name)
            if value is not None and value > self.gpus_per_node:
                raise ValueError(
                    f"{name}={value} > gpus_per_node={self.gpus_per_node}: tensor "
                    f"parallelism must stay inside a node"
                )
        if self.reserve_bytes < 0:
            raise ValueError(f"reserve_bytes must be >= 0, got {self.reserve_bytes}")
        if not 0 <= self.headroom < 1:
            raise ValueError(f"PlanOptions.headroom must be in [0, 1), got {self.headroom}")

    def dense_loss(self, mode: Mode) -> bool:
        """Whether ``mode``'s loss writes the logits: the colocated-dense mode (ModelOpt's), or
        any mode on the dense path."""
        return mode is Mode.COLOCATED_DENSE or self.loss_path == "dense"

    @property
    def gpu_loss(self) -> GpuLoss | None:
        """The fused loss's GPU path as planned (None: its CPU path)."""
        if self.loss_path != "gpu":
            return None
        return GpuLoss(window_bytes=self.loss_window_bytes, weight_grad=self.loss_weight_grad)

    def _check_recompute_and_vp(self) -> None:
        if self.recompute_method is not None and self.recompute_method not in RECOMPUTE_METHODS:
            raise ValueError(f"recompute_method={self.recompute_method!r}; choose from "
                             f"{list(RECOMPUTE_METHODS)}")
        if (self.recompute_method is not None or self.recompute_num_layers is not None) and \
                self.recompute != "full":
            raise ValueError(
                f"recompute_method={self.recompute_method!r} / recompute_num_layers="
                f"{self.recompute_num_layers!r} need recompute='full' (Megatron's "
                f"--recompute-granularity full), got recompute={self.recompute!r}"
            )
        for name in ("vp", "layers_per_virtual_stage", "recompute_num_layers"):
            value = getattr(self, name)
            if value is not None and (
                not isinstance(value, int) or isinstance(value, bool) or value <= 0
            ):
                raise ValueError(f"PlanOptions.{name} must be a positive int or None, got "
                                 f"{value!r}")
        if self.vp is not None and self.layers_per_virtual_stage is not None:
            raise ValueError(
                f"vp={self.vp} and layers_per_virtual_stage={self.layers_per_virtual_stage}: "
                f"give one of them"
            )

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def usable_bytes(self) -> float:
        """What a GPU's peak may reach: its memory less :attr:`headroom`."""
        return self.gpu.memory_bytes * (1 - self.headroom)



@dataclass(kw_only=True, frozen=True)
class ModePlan:
    """The plan of one mode (for the student layout :mod:`.search` chose)."""

    mode: Mode
    fits: bool
    """Every GPU's peak within its memory (the student's worst stage and, disaggregated, a
    teacher replica's)."""
    layout: ParallelLayout
    """The student's."""
    teacher_layout: ParallelLayout | None = None
    """A colocated teacher's on the student's ranks, or one disaggregated replica's."""
    worst_stage: int = 0
    """The student pipeline stage of highest memory, whose terms :attr:`terms` are."""
    terms: Mapping[Term, float] = field(default_factory=dict)
    """Memory of one GPU of :attr:`worst_stage`, bytes, in the order printed."""
    teacher_terms: Mapping[Term, float] = field(default_factory=dict)
    """Memory of one disaggregated teacher GPU (its worst stage), bytes."""
    total_bytes: float = 0.0
    capacity_bytes: int = 0
    usable_bytes: float = 0.0
    """:attr:`capacity_bytes` less the headroom: what :attr:`fits` compares with."""
    step_time_s: float = 0.0
    bubble: float = 0.0
    """The student's pipeline bubble: idle time over ideal time, ``(p-1)/(v*m)``."""
    student_tokens_per_s: float = 0.0
    student_gpus: int = 0
    teacher_gpus: int = 0
    teacher_nodes: int = 0
    teacher_replicas: int = 0
    wire: Mapping[Traffic, float] = field(default_factory=dict)
    """Traffic, the offline cache's cost, a replica's rate; in the order printed."""
    wire_ok: bool = True
    """Whether every link the mode uses keeps up."""
    notes: tuple[str, ...] = ()
    levers: tuple[str, ...] = ()
    """Why each lever of the student layout (tensor, pipeline and context parallelism,
    recompute, the distributed optimizer) is where it is, a line each (:func:`.options.choose`)."""

    def __post_init__(self) -> None:
        # read-only views: the plan is a value
        for name in ("terms", "teacher_terms", "wire"):
            object.__setattr__(self, name, MappingProxyType(dict(getattr(self, name))))
        object.__setattr__(self, "notes", tuple(self.notes))
        object.__setattr__(self, "levers", tuple(self.levers))

    @property
    def tokens_per_s_per_gpu(self) -> float:
        """Student tokens/s per GPU, counting the teacher's GPUs."""
        return self.student_tokens_per_s / (self.student_gpus + self.teacher_gpus)

    @property
    def verdict(self) -> str:
        """The plan in one line."""
        gib = self.total_bytes / GIB
        cap = self.capacity_bytes / GIB
        usable = self.usable_bytes / GIB
        if not self.fits:
            return (f"OOM: {gib:.1f} GiB > {usable:.1f} GiB per GPU ({cap:.1f} less the "
                    f"headroom)")
        text = (f"fits: {gib:.1f} of {usable:.1f} GiB ({cap:.1f} less the headroom), "
                f"{self.student_tokens_per_s:,.0f} tokens/s")
        if self.mode is Mode.DISAGGREGATED:
            text += (
                f", +{self.teacher_gpus} teacher GPU(s) on {self.teacher_nodes} node(s); "
                f"{self.tokens_per_s_per_gpu:,.0f} tokens/s per GPU counting teachers"
            )
            if not self.wire_ok:
                text += ", WIRE-BOUND (link too slow: the student would stall)"
        return text

    def to_dict(self) -> dict:
        """The plan as JSON-ready data: modes, terms and figures by their labels."""
        return {
            "mode": self.mode.value,
            "fits": self.fits,
            "layout": asdict(self.layout),
            "teacher_layout": asdict(self.teacher_layout) if self.teacher_layout else None,
            "worst_stage": self.worst_stage,
            "terms": {t.label: v for t, v in self.terms.items()},
            "teacher_terms": {t.label: v for t, v in self.teacher_terms.items()},
            "total_bytes": self.total_bytes,
            "capacity_bytes": self.capacity_bytes,
            "usable_bytes": self.usable_bytes,
            "step_time_s": self.step_time_s,
            "bubble": self.bubble,
            "student_tokens_per_s": self.student_tokens_per_s,
            "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu,
            "student_gpus": self.student_gpus,
            "teacher_gpus": self.teacher_gpus,
            "teacher_nodes": self.teacher_nodes,
            "teacher_replicas": self.teacher_replicas,
            "wire": {f.label: v for f, v in self.wire.items()},
            "wire_ok": self.wire_ok,
            "notes": list(self.notes),
            "levers": list(self.levers),
            "verdict": self.verdict,
        }


@dataclass(kw_only=True, frozen=True)
class PlanResult:
    """Every planned mode's plan, and which to use."""

    plans: Mapping[Mode, ModePlan]
    """By mode, in :class:`Mode` order."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "plans", MappingProxyType(dict(self.plans)))

    @property
    def recommended_mode(self) -> Mode | None:
        """The mode :attr:`recommendation` names: the fastest online mode that fits with a working
        wire, else the offline cache where it fits, else None."""
        ok = self._online_fitting()
        if ok:
            return max(ok.items(), key=lambda kv: kv[1].student_tokens_per_s)[0]
        offline = self.plans.get(Mode.OFFLINE_CACHE)
        return Mode.OFFLINE_CACHE if offline is not None and offline.fits else None

    def _online_fitting(self) -> dict[Mode, ModePlan]:
        return {m: p for m, p in self.plans.items()
                if p.fits and p.wire_ok and m is not Mode.OFFLINE_CACHE}

    @property
    def recommendation(self) -> str:
        """One line: the fastest mode that fits (with a working wire), and what it costs."""
        plans = self.plans
        ok = self._online_fitting()
        if not ok:
            offline = plans.get(Mode.OFFLINE_CACHE)
            if offline is not None and offline.fits:
                return ("only the offline cache fits: build a top-K cache, or add nodes / raise "
                        "tp, pp")
            return (
                "nothing fits: add nodes, raise tp / pp, enable the distributed optimizer or "
                "recompute"
            )
        best_mode, best = max(ok.items(), key=lambda kv: kv[1].student_tokens_per_s)
        coloc = [p for m, p in ok.items() if m.colocated]
        if best_mode is Mode.DISAGGREGATED:
            if coloc:
                c = max(coloc, key=lambda p: p.student_tokens_per_s)
                gain = best.student_tokens_per_s / c.student_tokens_per_s - 1
                return (
                    f"disaggregated: {gain:.0%} more student tokens/s than {c.mode.value} (which "
                    f"also fits), for {best.teacher_gpus} teacher GPU(s) on {best.teacher_nodes} "
                    f"extra node(s); per GPU counting teachers {best.tokens_per_s_per_gpu:,.0f} vs "
                    f"{c.tokens_per_s_per_gpu:,.0f} tokens/s"
                )
            return (
                f"disaggregated: the only online mode that fits; needs {best.teacher_nodes} "
                f"teacher node(s)"
            )
        return f"{best_mode.value}: fits and is fastest without extra nodes"


@dataclass(kw_only=True, frozen=True)
class LayoutOption:
    """One alternative to a plan's student layout (one setting changed), and what it costs: a row
    of the "what the options buy" table."""

    label: str
    """What changed, e.g. ``recompute full block x8`` or ``pp=2 vp=4``."""
    layout: ParallelLayout
    fits: bool
    total_bytes: float
    """Peak bytes of the worst student GPU (disaggregated: or a teacher replica's, where it does
    not fit)."""
    step_time_s: float
    bubble: float
    student_tokens_per_s: float
    tp_collective_s: float
    """The student's tensor-parallel collectives per step at NVLink speed (not in the step
    time)."""
    p2p_s: float
    """The pipeline's point-to-point sends per step at link speed (not in the step time)."""
    cp_exchange_s: float = 0.0
    """Context parallelism's K/V exchange per step at link speed (not in the step time)."""

    def to_dict(self) -> dict:
        out = asdict(self)
        out["layout"] = asdict(self.layout)
        return out
