"""Read a Megatron-LM launch's own arguments (``--from-args "..."``) into planner inputs.

Only what changes memory, time or traffic is read; every other flag is listed back as ignored (so
nothing is dropped silently). Megatron's own defaults apply to what the launch leaves out, because
that is what the launch would run with: untied embeddings only with
``--untie-embeddings-and-output-weights``, SwiGLU only with ``--swiglu``, hidden dropout 0.1 unless
``--hidden-dropout`` says otherwise, ``--expert-tensor-parallel-size`` defaulting to the
tensor-parallel size, ``--num-query-groups`` equal to the head count without
``--group-query-attention``.

Launch settings the planner does not model are refused with a ``ValueError`` (context parallelism,
interleaved pipelines, recompute other than ``uniform`` x 1 layer or ``selective``), never
approximated."""

from __future__ import annotations

import argparse
import shlex
from dataclasses import dataclass, field

from megatron_kd.planner.models import ModelConfig

_MODEL_FLAGS = ("num_layers", "hidden_size", "num_attention_heads")

#: Launch flags (argparse ``dest``) read into planner inputs of another name.
_RENAMED = {
    "tensor_model_parallel_size": "tp",
    "pipeline_model_parallel_size": "pp",
    "expert_model_parallel_size": "ep",
    "expert_tensor_parallel_size": "etp",
    "kd_teacher_tensor_model_parallel_size": "teacher_tp",
    "kd_teacher_pipeline_model_parallel_size": "teacher_pp",
    "kd_teacher_expert_model_parallel_size": "teacher_ep",
    "kd_window_size": "window_size",
    "kd_prefetch_depth": "prefetch_depth",
    "kd_topk": "topk",
    "kd_wire_dtype": "wire_dtype",
}


@dataclass(kw_only=True)
class LaunchArgs:
    """What a Megatron launch line says, as far as the planner is concerned."""

    student: ModelConfig | None = None
    """The model the launch builds, when its shape flags are present (``--num-layers`` ...)."""

    values: dict = field(default_factory=dict)
    """Planner inputs read from the launch, keyed like the ``megatron-kd plan`` options'
    ``dest``."""

    ignored: list[str] = field(default_factory=list)
    """Flags present in the launch that the planner does not use."""


def _parser() -> argparse.ArgumentParser:
    """The launch flags the planner reads (the others end up in ``LaunchArgs.ignored``)."""
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    for name in (
        "num-layers",
        "hidden-size",
        "ffn-hidden-size",
        "num-attention-heads",
        "num-query-groups",
        "kv-channels",
        "vocab-size",
        "num-experts",
        "moe-router-topk",
        "moe-ffn-hidden-size",
        "moe-shared-expert-intermediate-size",
        "seq-length",
        "micro-batch-size",
        "global-batch-size",
        "tensor-model-parallel-size",
        "pipeline-model-parallel-size",
        "expert-model-parallel-size",
        "expert-tensor-parallel-size",
        "context-parallel-size",
        "num-layers-per-virtual-pipeline-stage",
        "virtual-pipeline-model-parallel-size",
        "recompute-num-layers",
        "make-vocab-size-divisible-by",
        "kd-teacher-tensor-model-parallel-size",
        "kd-teacher-pipeline-model-parallel-size",
        "kd-teacher-expert-model-parallel-size",
        "kd-window-size",
        "kd-prefetch-depth",
        "kd-topk",
    ):
        p.add_argument(f"--{name}", type=int, default=None)
    for name in ("hidden-dropout", "attention-dropout"):
        p.add_argument(f"--{name}", type=float, default=None)
    p.add_argument("--kd-wire-dtype", choices=["fp32", "bf16", "fp8"], default=None)
    for name in ("recompute-granularity", "recompute-method", "kd-teacher-load"):
        p.add_argument(f"--{name}", default=None)
    for name in (
        "group-query-attention",
        "swiglu",
        "untie-embeddings-and-output-weights",
        "qk-layernorm",
        "sequence-parallel",
        "use-distributed-optimizer",
        "grad-reduce-in-bf16",
        "bf16",
        "fp16",
    ):
        p.add_argument(f"--{name}", action="store_true", default=False)
    return p


def parse_launch_args(text: str) -> LaunchArgs:
    """Parse a Megatron launch's argument string (shell quoting allowed).

    Raises ``ValueError`` for settings the planner does not model and for an incomplete model.
    """
    tokens = shlex.split(text)
    try:
        ns, rest = _parser().parse_known_args(tokens)
    except SystemExit as exc:  # argparse's way of saying a value was malformed
        raise ValueError(f"--from-args: cannot parse {text!r}") from exc
    out = LaunchArgs(ignored=[tok for tok in rest if tok.startswith("--")])
    _refuse_unmodelled(ns)
    out.values.update(_planner_values(ns))
    out.values["recompute"] = _recompute(ns)
    out.student = _student_model(ns)
    return out


def _refuse_unmodelled(ns: argparse.Namespace) -> None:
    """Raise ``ValueError`` for launch settings the planner does not model."""
    if ns.context_parallel_size not in (None, 1):
        raise ValueError(
            f"--context-parallel-size={ns.context_parallel_size}: context parallelism is "
            f"not modelled by the planner"
        )
    if ns.num_layers_per_virtual_pipeline_stage or ns.virtual_pipeline_model_parallel_size not in (
        None,
        1,
    ):
        raise ValueError(
            "interleaved pipeline schedules (virtual pipeline stages) are not modelled"
        )
    if ns.fp16 and ns.bf16:
        raise ValueError("--fp16 and --bf16 both given")


def _planner_values(ns: argparse.Namespace) -> dict:
    """The planner inputs the launch sets, with Megatron's defaults for what it leaves out."""
    v = {}
    for key in (
        "seq_length",
        "micro_batch_size",
        "global_batch_size",
        "make_vocab_size_divisible_by",
    ):
        if getattr(ns, key) is not None:
            v[key] = getattr(ns, key)
    for src, dst in _RENAMED.items():
        if getattr(ns, src) is not None:
            v[dst] = getattr(ns, src)
    # Megatron defaults for what the launch leaves out
    v.setdefault("tp", 1)
    v.setdefault("pp", 1)
    if "etp" not in v:
        # Megatron: expert_tensor_parallel_size defaults to tensor_model_parallel_size
        v["etp"] = v["tp"]
    v["sequence_parallel"] = ns.sequence_parallel
    v["use_distributed_optimizer"] = ns.use_distributed_optimizer
    if ns.grad_reduce_in_bf16:
        v["grad_bytes"] = 2
    hidden_dropout = 0.1 if ns.hidden_dropout is None else ns.hidden_dropout
    v["hidden_dropout"] = hidden_dropout > 0
    if ns.kd_teacher_load is not None:
        # a megatron_kd checkpoint directory (or a preset / config)
        v["teacher"] = ns.kd_teacher_load
    return v


def _recompute(ns: argparse.Namespace) -> str:
    """The planner's recompute setting for the launch's; ``ValueError`` for one not modelled."""
    if ns.recompute_granularity is None:
        return "none"
    if ns.recompute_granularity == "selective":
        return "selective"
    if ns.recompute_granularity == "full":
        method = ns.recompute_method or "uniform"
        layers = ns.recompute_num_layers if ns.recompute_num_layers is not None else 1
        if method != "uniform" or layers != 1:
            raise ValueError(
                f"--recompute-method={method} --recompute-num-layers={layers}: only full "
                f"recompute with method uniform and 1 layer is modelled"
            )
        return "full"
    raise ValueError(
        f"--recompute-granularity={ns.recompute_granularity!r}: expected full or selective"
    )


def _student_model(ns: argparse.Namespace) -> ModelConfig | None:
    """The model the launch builds, or None without shape flags; ``ValueError`` when incomplete."""
    given = [k for k in _MODEL_FLAGS if getattr(ns, k) is not None]
    if not given:
        return None
    missing = [k for k in _MODEL_FLAGS + ("vocab_size",) if getattr(ns, k) is None]
    if missing:
        flags = ", ".join("--" + m.replace("_", "-") for m in missing)
        raise ValueError(f"--from-args describes a model but lacks {flags}")
    heads = ns.num_attention_heads
    groups = ns.num_query_groups if ns.group_query_attention and ns.num_query_groups else heads
    dense_ffn = 0 if ns.num_experts else (ns.ffn_hidden_size or 4 * ns.hidden_size)
    return ModelConfig(
        name="from-args",
        num_layers=ns.num_layers,
        hidden_size=ns.hidden_size,
        num_attention_heads=heads,
        num_query_groups=groups,
        head_dim=ns.kv_channels or ns.hidden_size // heads,
        ffn_hidden_size=dense_ffn,
        vocab_size=ns.vocab_size,
        tie_embeddings=not ns.untie_embeddings_and_output_weights,
        gated_linear_unit=ns.swiglu,
        qk_layernorm=ns.qk_layernorm,
        num_experts=ns.num_experts or 0,
        moe_router_topk=(ns.moe_router_topk or 2) if ns.num_experts else 0,
        moe_ffn_hidden_size=(ns.moe_ffn_hidden_size or ns.ffn_hidden_size or 4 * ns.hidden_size)
        if ns.num_experts
        else 0,
        moe_shared_expert_ffn_hidden_size=ns.moe_shared_expert_intermediate_size or 0,
        source="Megatron launch arguments",
    )
