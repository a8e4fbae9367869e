"""The parallel layout: how one model is split over GPUs, as one pure-Python record.

:class:`ParallelLayout` is built once from a command's flags (``megatron-kd train``'s, ``teacher
serve``'s, ``cache build``'s, Megatron-LM's, or a plan's search) and passed whole: to the rules
(:func:`megatron_kd.arch.layout.check_layout`), to the process groups
(:func:`megatron_kd.integration.groups.model_parallel`), to the planner's memory and traffic
models. Megatron-Core's rank order (``tp-cp-ep-dp-pp``: TP fastest, PP slowest) is the one the
groups are made in.

What a layout can be without looking at a model is checked here (positive sizes, known choices,
the expert grid folding into ``tp x cp x dp``); what a model allows is
:func:`~megatron_kd.arch.layout.check_layout`'s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

__all__ = ["CP_COMM_TYPES", "RECOMPUTE_CHOICES", "RECOMPUTE_METHODS", "ParallelLayout",
           "microbatches_per_step", "virtual_stages_of"]

#: Activation recompute: none, the core attention only, or whole layers.
RECOMPUTE_CHOICES = ("none", "selective", "full")
#: ``--recompute-method`` of full recompute (Megatron-Core's ``recompute_method``).
RECOMPUTE_METHODS = ("uniform", "block")
#: How context-parallel attention exchanges keys and values (Megatron-Core's ``cp_comm_type``).
CP_COMM_TYPES = ("p2p", "all_gather", "a2a")

_SIZES = ("tp", "pp", "vp", "dp", "cp", "ep", "etp", "recompute_num_layers")


@dataclass(kw_only=True, frozen=True)
class ParallelLayout:
    """How one model is split over ``tp * pp * cp * dp`` GPUs (and what each keeps)."""

    tp: int = 1
    """Tensor-parallel size ``t``."""

    pp: int = 1
    """Pipeline-parallel size ``p``."""

    vp: int = 1
    """Virtual pipeline stages (model chunks) per pipeline rank ``v``: Megatron-Core's
    interleaved 1F1B schedule when > 1; 1 is no interleaving."""

    dp: int = 1
    """Data-parallel size (replicas of the model)."""

    cp: int = 1
    """Context-parallel size: each sequence is split over ``cp`` ranks (Megatron's
    load-balanced ``2 cp`` chunks), each holding ``s/cp`` of its tokens."""

    ep: int = 1
    """Expert-parallel size ``e``: the experts of a mixture-of-experts model (of any model
    built in these groups) are split over ``e`` ranks."""

    etp: int | None = None
    """Expert-tensor-parallel size ``et`` as given: ranks each expert is split over; None is the
    tensor-parallel size, as Megatron's ``--expert-tensor-parallel-size`` defaults (the size
    itself: :attr:`expert_tp`)."""

    sequence_parallel: bool = False
    """Megatron sequence parallelism: the activations outside attention and the MLP split along
    the sequence over the tensor-parallel ranks (off at ``tp = 1``, as Megatron-LM turns it
    off)."""

    cp_comm_type: str = "p2p"
    """How Transformer Engine's attention exchanges keys and values over the context-parallel
    ranks (``p2p``, ``all_gather`` or ``a2a``; Megatron-Core's ``cp_comm_type``); the default
    ``p2p`` at ``cp = 1``, where there is no exchange."""

    use_distributed_optimizer: bool = False
    """The optimizer state sharded over the ``dp * cp`` ranks (Megatron's distributed
    optimizer)."""

    recompute: str = "none"
    """Activation recompute: ``none``, ``selective`` (core attention) or ``full`` (whole layers,
    as :attr:`recompute_method` and :attr:`recompute_num_layers` say)."""

    recompute_method: str = "uniform"
    """Full recompute only: ``uniform`` (every layer, in checkpointed groups of
    :attr:`recompute_num_layers`) or ``block`` (the first :attr:`recompute_num_layers` layers of
    each model chunk)."""

    recompute_num_layers: int = 1
    """Full recompute only: ``--recompute-num-layers``."""

    def __post_init__(self) -> None:
        for name in _SIZES:
            value = getattr(self, name)
            if name == "etp" and value is None:
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"ParallelLayout.{name} must be a positive int, got {value!r}")
        if self.sequence_parallel and self.tp == 1:
            object.__setattr__(self, "sequence_parallel", False)  # nothing to split
        if self.cp == 1 and self.cp_comm_type in CP_COMM_TYPES:
            object.__setattr__(self, "cp_comm_type", "p2p")  # no exchange: the default
        if self.recompute not in RECOMPUTE_CHOICES:
            raise ValueError(f"recompute={self.recompute!r}; choose from {RECOMPUTE_CHOICES}")
        if self.cp_comm_type not in CP_COMM_TYPES:
            raise ValueError(f"cp_comm_type={self.cp_comm_type!r}; choose from {CP_COMM_TYPES}")
        if self.recompute_method not in RECOMPUTE_METHODS:
            raise ValueError(
                f"recompute_method={self.recompute_method!r}; choose from {RECOMPUTE_METHODS}")
        if self.recompute != "full" and (self.recompute_method, self.recompute_num_layers) != (
                "uniform", 1):
            raise ValueError(
                f"recompute_method={self.recompute_method!r}, recompute_num_layers="
                f"{self.recompute_num_layers} apply to full recompute only (recompute="
                f"{self.recompute!r})")
        if self.vp > 1 and self.pp == 1:
            raise ValueError(f"{self.vp} virtual pipeline stages per rank need "
                             f"--pipeline-model-parallel-size > 1 (interleaving splits "
                             f"pipeline stages)")
        if (self.tp * self.cp * self.dp) % (self.ep * self.expert_tp):
            raise ValueError(
                f"expert-model-parallel-size {self.ep} x expert-tensor-parallel-size "
                f"{self.expert_tp} does not divide the {self.tp * self.cp * self.dp} ranks of a "
                f"pipeline stage (tensor {self.tp} x context {self.cp} x data {self.dp}: "
                f"Megatron's expert grid folds expert parallelism into them)")

    @classmethod
    def from_world(cls, world_size: int, **sizes) -> ParallelLayout:
        """The layout of ``world_size`` ranks with ``sizes`` (every field but ``dp``): the
        data-parallel size is what the model-parallel ranks leave; ``ValueError`` when they do
        not divide the world."""
        if "dp" in sizes:
            raise ValueError("from_world derives dp from the world size; do not give it")
        model = cls(**{**sizes, "ep": 1, "etp": 1})  # the sizes checked, before the grid
        ranks = model.tp * model.pp * model.cp
        if world_size < 1 or world_size % ranks:
            raise ValueError(
                f"world size {world_size} is not divisible by tensor-model-parallel-size "
                f"{model.tp} x pipeline-model-parallel-size {model.pp}"
                + (f" x context-parallel-size {model.cp}" if model.cp > 1 else ""))
        return cls(**sizes, dp=world_size // ranks)

    @classmethod
    def of_model(cls, **sizes) -> ParallelLayout:
        """The layout of one copy of a model split ``sizes`` ways (every field but ``dp``),
        with the fewest data-parallel ranks its expert grid needs (``ep * etp`` dividing ``tp *
        cp * dp``): what a checkpoint saved at those sizes is loaded with at the least."""
        if "dp" in sizes:
            raise ValueError("of_model derives dp from the expert grid; do not give it")
        model = cls(**{**sizes, "ep": 1, "etp": 1})  # the sizes checked, before the grid
        grid = sizes.get("ep", 1) * (sizes.get("etp") or model.tp)
        return cls(**sizes, dp=max(1, grid // math.gcd(grid, model.tp * model.cp)))

    @property
    def expert_tp(self) -> int:
        """Expert-tensor-parallel size: :attr:`etp`, else the tensor-parallel size."""
        return self.tp if self.etp is None else self.etp

    @property
    def world_size(self) -> int:
        """Ranks of the layout: ``tp * pp * cp * dp``."""
        return self.tp * self.pp * self.cp * self.dp

    @property
    def model_parallel_size(self) -> int:
        """Ranks one copy of the weights is split over: ``tp * pp``."""
        return self.tp * self.pp

    @property
    def expert_data_parallel_size(self) -> int:
        """Copies of each expert: a pipeline stage's ``tp * cp * dp`` ranks over ``ep * etp``."""
        return self.tp * self.cp * self.dp // (self.ep * self.expert_tp)

    @property
    def optimizer_shards(self) -> int:
        """Ranks the distributed optimizer shards dense parameters over: Megatron-Core's
        data-parallel group with context parallelism (``dp_cp``)."""
        return self.dp * self.cp

    @property
    def virtual_stages(self) -> int | None:
        """Model chunks per pipeline rank as Megatron-Core takes them: None without
        interleaving."""
        return self.vp if self.vp > 1 else None

    @property
    def recompute_label(self) -> str:
        """The recompute setting as reports print it: ``none``, ``selective``, ``full uniform
        x1``, ``full block x8``."""
        if self.recompute != "full":
            return self.recompute
        return f"full {self.recompute_method} x{self.recompute_num_layers}"

    def local_tokens(self, seq_length: int, micro_batch_size: int) -> float:
        """Tokens of one micro-batch on one rank: ``s*b/cp``."""
        return seq_length * micro_batch_size / self.cp

    def colocated(self) -> ParallelLayout:
        """The layout of a frozen model run in this one's groups on its last pipeline stage,
        whole (a colocated teacher): the same tensor, context, data and expert groups (each
        pipeline stage's) and sequence parallelism, no pipeline, nothing recomputed, no
        optimizer."""
        return replace(self, pp=1, vp=1, recompute="none",
                       recompute_method="uniform", recompute_num_layers=1,
                       use_distributed_optimizer=False)


def virtual_stages_of(num_layers: int, pp: int, layers_per_stage: int) -> int:
    """Model chunks per pipeline rank that ``--num-layers-per-virtual-pipeline-stage``
    ``layers_per_stage`` gives ``num_layers`` layers over ``pp`` stages; ``ValueError`` naming
    the flags where they do not split into whole virtual stages."""
    if layers_per_stage < 1 or num_layers % (layers_per_stage * pp):
        raise ValueError(f"--num-layers-per-virtual-pipeline-stage {layers_per_stage} x "
                         f"--pipeline-model-parallel-size {pp} does not divide --num-layers "
                         f"{num_layers}")
    return num_layers // (layers_per_stage * pp)


def microbatches_per_step(global_batch_size: int, micro_batch_size: int, dp: int) -> int:
    """Micro-batches each of ``dp`` data-parallel ranks runs a step; ``ValueError`` naming the
    flags where the global batch does not split into them."""
    if global_batch_size % (micro_batch_size * dp):
        raise ValueError(f"--global-batch-size {global_batch_size} is not divisible by "
                         f"--micro-batch-size {micro_batch_size} x data-parallel size {dp}")
    return global_batch_size // (micro_batch_size * dp)
