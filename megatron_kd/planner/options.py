"""What a plan is asked and what it answers: :class:`PlanOptions` (every input of a plan, validated
once) and :class:`ModePlan` (one mode's plan), with the names of the modes and the constants both
use. The modes, the search order and the assumptions are described in :mod:`.plan`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from megatron_kd.planner.memory import ActivationOptions, Precision
from megatron_kd.planner.models import ModelConfig
from megatron_kd.planner.presets import GpuSpec, LinkSpec

MODES = ("colocated-dense", "colocated-fused", "offline-cache", "disaggregated")
#: Recompute settings, least first: the order the layout search prefers them in.
RECOMPUTE_ORDER = {"none": 0, "selective": 1, "full": 2}
GIB = 1 << 30


@dataclass(kw_only=True)
class PlanOptions:
    """Everything a plan depends on."""

    student: ModelConfig
    """The model being trained."""

    teacher: ModelConfig
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

    recompute: str | None = None
    """``none`` / ``selective`` / ``full``; None = search (least that fits)."""

    sequence_parallel: bool | None = None
    """None = on whenever ``tp > 1``."""

    use_distributed_optimizer: bool = False
    """Shard optimizer state over data parallel (Megatron ``--use-distributed-optimizer``)."""

    teacher_tp: int | None = None
    """Disaggregated teacher tensor-parallel size; None = search."""

    teacher_pp: int | None = None
    """Disaggregated teacher pipeline-parallel size; None = search."""

    teacher_ep: int | None = None
    """Teacher expert-parallel size (both colocated and disaggregated); None = search."""

    window_size: int | None = None
    """Fused-loss rows per window ``w`` (an upper bound on rows in flight); None = the loss's
    default, a 64 MiB fp32 ``[w, V/t]`` buffer."""

    prefetch_depth: int = 2
    """Receive slots ``D`` of the disaggregated ring, and micro-batches the cache reader decodes
    ahead (into host memory)."""

    topk: int = 64
    """Entries per token in the offline cache."""

    cache_entry_bytes: int = 6
    """Bytes per cached entry on storage (a 4-byte token id and a 2-byte value): the cache's size
    and read rate. Decoded in memory an entry takes 12 bytes (``memory.cache_reader_bytes``)."""

    loss_block_elements: int | None = None
    """Elements per block of the fused loss's elementwise work: None on a GPU and with TP > 1 (a
    block is the window); on CPU runs without TP ``megatron_kd.loss.window.CPU_BLOCK_ELEMENTS``
    (``2^21``)."""

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
    with one fp32 scale per token)."""

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
            "cache_entry_bytes",
            "cache_resident_microbatches",
            "hidden_elem_bytes",
            "loss_stats",
            "etp",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"PlanOptions.{name} must be a positive int, got {value!r}")
        if self.teacher_replicas is not None and (
                not isinstance(self.teacher_replicas, int) or self.teacher_replicas <= 0):
            raise ValueError(f"PlanOptions.teacher_replicas must be a positive int or None, got "
                             f"{self.teacher_replicas!r}")
        if self.wire_dtype not in ("fp32", "bf16", "fp8"):
            raise ValueError(f"PlanOptions.wire_dtype must be fp32, bf16 or fp8, got "
                             f"{self.wire_dtype!r}")
        for name in ("window_size", "loss_block_elements"):
            value = getattr(self, name)
            if value is not None and (
                not isinstance(value, int) or isinstance(value, bool) or value <= 0
            ):
                raise ValueError(
                    f"PlanOptions.{name} must be a positive int or None, got {value!r}"
                )
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
        if self.recompute is not None and self.recompute not in RECOMPUTE_ORDER:
            raise ValueError(f"recompute={self.recompute!r}; choose from {list(RECOMPUTE_ORDER)}")
        for name in ("tp", "teacher_tp"):
            value = getattr(self, name)
            if value is not None and value > self.gpus_per_node:
                raise ValueError(
                    f"{name}={value} > gpus_per_node={self.gpus_per_node}: tensor "
                    f"parallelism must stay inside a node"
                )
        if self.reserve_bytes < 0:
            raise ValueError(f"reserve_bytes must be >= 0, got {self.reserve_bytes}")

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node


@dataclass(kw_only=True)
class ModePlan:
    """The plan of one mode."""

    mode: str
    fits: bool
    layout: dict | None
    teacher_layout: dict | None = None
    worst_stage: int = 0
    terms: dict[str, float] = field(default_factory=dict)
    teacher_terms: dict[str, float] = field(default_factory=dict)
    total_bytes: float = 0.0
    capacity_bytes: int = 0
    step_time_s: float = 0.0
    student_tokens_per_s: float = 0.0
    tokens_per_s_per_gpu: float = 0.0
    student_gpus: int = 0
    teacher_gpus: int = 0
    teacher_nodes: int = 0
    teacher_replicas: int = 0
    wire: dict[str, float] = field(default_factory=dict)
    wire_ok: bool = True
    notes: list[str] = field(default_factory=list)
    verdict: str = ""

    def to_dict(self) -> dict:
        return asdict(self)
