"""Which parallel layouts a model can run with: every layout rule, written once. Pure Python.

:func:`check_layout` holds the rules; ``megatron-kd train`` (its student and a colocated teacher),
``teacher serve`` (a replica), ``cache build``, the Megatron-LM hooks, ``import-hf`` and the
planner's search all call it with the :class:`~megatron_kd.parallel.ParallelLayout` they built
from their flags (the planner: with each layout it considers), so the planner proposes exactly
what the commands accept. Each rule raises ``ValueError`` naming the flags and values:

* tensor parallelism: ``tp`` divides the (padded) vocabulary, the heads, the key/value groups,
  the MLP width, the shared expert, the Gated DeltaNet key heads; ``etp`` divides an expert's
  width;
* pipeline parallelism: ``pp * vp`` divides the layers (every stage, and every virtual stage,
  holds the same number of layers); the interleaved schedule takes the micro-batches in groups
  of ``pp``;
* experts: ``ep`` divides the experts; experts with biases only at ``etp = 1``; ``ep > 1`` only
  where a model of the groups has experts;
* context parallelism: no Gated DeltaNet recurrence splits over context-parallel ranks; the
  sequence splits into ``2 cp`` chunks (and ``tp`` slices of them with sequence parallelism);
  with Transformer Engine's attention, its ``cp_comm_type`` rules;
* training (:attr:`Role.STUDENT`): a mixture-of-experts or Gated DeltaNet model at ``tp > 1``
  needs sequence parallelism; experts with biases do not train; the recompute settings fit the
  model chunks;
* a role's own rules: a teacher replica is one model's ranks (no data parallelism), a cache
  build runs no pipeline, and both keep their experts inside the tensor-parallel group.
"""

from __future__ import annotations

from enum import Enum

from megatron_kd.arch.config import GPTArchConfig
from megatron_kd.parallel.layout import ParallelLayout
from megatron_kd.parallel.sequence import check_sequence_split

__all__ = ["Role", "check_layout", "context_parallel_limit"]


class Role(Enum):
    """What a model does in its layout: the rules beyond the model's own split."""

    STUDENT = "student"
    """Trained (``megatron-kd train``, Megatron-LM's ``pretrain_gpt.py``): the training rules."""

    COLOCATED_TEACHER = "colocated teacher"
    """Frozen, whole on the student's last pipeline stage, in the student's tensor, context,
    data and expert groups (:meth:`ParallelLayout.colocated`)."""

    TEACHER_REPLICA = "teacher replica"
    """``megatron-kd teacher serve``: a world of its own (no data parallelism: each replica can
    fail alone), its experts inside its tensor-parallel group."""

    CACHE_TEACHER = "cache-building teacher"
    """``megatron-kd cache build``: data-parallel copies of a ``tp x cp`` teacher, no pipeline,
    its experts inside its tensor-parallel group (the copies run different numbers of
    forwards)."""

    TEACHER_OUTPUT_LAYER = "teacher's output layer"
    """A served teacher's output layer, held by the student's ranks (``--kd-mode
    disaggregated``): its vocabulary split over the student's tensor-parallel ranks, nothing
    else of the teacher."""

    FROZEN = "model"
    """A frozen model built in a layout of its own choosing (``import-hf`` writing a sharded
    checkpoint, a model built by hand): the model's own split only."""


#: What each role's command offers instead of context parallelism for a Gated DeltaNet model.
_CP_ADVICE = {
    Role.STUDENT: "use --context-parallel-size 1",
    Role.COLOCATED_TEACHER: "serve it (--kd-mode disaggregated) or cache it (--kd-mode offline)",
    Role.TEACHER_REPLICA: "serve it at --context-parallel-size 1",
    Role.CACHE_TEACHER: "build the cache at --context-parallel-size 1",
    Role.FROZEN: "use --context-parallel-size 1",
}


def check_layout(arch: GPTArchConfig, layout: ParallelLayout, *, role: Role = Role.STUDENT,
                 seq_length: int | None = None, num_microbatches: int | None = None,
                 colocated_teacher: GPTArchConfig | None = None,
                 transformer_engine: bool = False) -> None:
    """Raise ``ValueError`` (naming the flags and values) when ``arch`` cannot run as ``role``
    with ``layout``; see the module docstring for the rules.

    Args:
        seq_length: the run's sequence length (its split over context- and sequence-parallel
            ranks is checked; None: not known here, e.g. a replica, which pads each request).
        num_microbatches: micro-batches a data-parallel rank runs a step (the interleaved
            schedule's rule; None: not known).
        colocated_teacher: with :attr:`Role.STUDENT`, the teacher built in the student's groups
            (checked as :attr:`Role.COLOCATED_TEACHER` in :meth:`ParallelLayout.colocated`).
        transformer_engine: the attention is Transformer Engine's (its context-parallel
            exchange rules apply).
    """
    _check_vocabulary(arch, layout)
    if role is Role.TEACHER_OUTPUT_LAYER:
        return  # the student's ranks hold its output layer only
    _check_tensor(arch, layout)
    _check_pipeline(arch, layout, num_microbatches)
    in_groups = [arch] if colocated_teacher is None else [arch, colocated_teacher]
    _check_experts(arch, layout, any(m.num_experts for m in in_groups), role)
    _check_context(arch, layout, role, transformer_engine)
    if seq_length is not None:
        check_sequence_split(seq_length, tp=layout.tp, cp=layout.cp,
                             sequence_parallel=layout.sequence_parallel)
    _ROLE_RULES[role](arch, layout)
    if colocated_teacher is not None:
        if role is not Role.STUDENT:
            raise ValueError(f"a colocated teacher runs beside a student, not a {role.value}")
        try:
            check_layout(colocated_teacher, layout.colocated(),
                         role=Role.COLOCATED_TEACHER, transformer_engine=transformer_engine)
        except ValueError as e:
            raise ValueError(f"the colocated teacher: {e}") from None


def context_parallel_limit(arch: GPTArchConfig) -> str | None:
    """Why ``arch`` cannot run with context parallelism, in one sentence; None when it can."""
    if not arch.linear_attention_layers:
        return None
    return ("a Gated DeltaNet recurrence runs over the whole sequence and does not split over "
            "context-parallel ranks (Megatron-Core's GatedDeltaNet has no context parallelism: "
            "megatron-core 0.16.1 and 0.19.2 local layers)")


# --- the model's own split ---------------------------------------------------------------------


def _check_vocabulary(arch: GPTArchConfig, layout: ParallelLayout) -> None:
    if arch.padded_vocab_size % layout.tp:
        raise ValueError(f"tensor-parallel size {layout.tp} does not divide padded_vocab_size="
                         f"{arch.padded_vocab_size}: the output layer's rows are split over "
                         f"the tensor-parallel ranks")


def _check_tensor(arch: GPTArchConfig, layout: ParallelLayout) -> None:
    tp, problems = layout.tp, []
    if arch.num_attention_heads % tp:
        problems.append(f"num_attention_heads={arch.num_attention_heads}")
    if arch.query_groups % tp:
        problems.append(f"num_query_groups={arch.query_groups}")
    if arch.ffn_hidden_size % tp:
        problems.append(f"ffn_hidden_size={arch.ffn_hidden_size}")
    if arch.linear_attention_layers and arch.linear_num_key_heads % tp:
        problems.append(f"linear_num_key_heads={arch.linear_num_key_heads}")
    if arch.moe_shared_expert_size is not None and arch.moe_shared_expert_size % tp:
        problems.append(f"moe_shared_expert_size={arch.moe_shared_expert_size}")
    if problems:
        raise ValueError(f"tensor-parallel size {tp} does not divide {', '.join(problems)}")
    if arch.num_experts is not None and arch.expert_ffn_hidden_size % layout.expert_tp:
        raise ValueError(f"expert-tensor-parallel size {layout.expert_tp} does not divide "
                         f"moe_ffn_hidden_size={arch.expert_ffn_hidden_size}")


def _check_pipeline(arch: GPTArchConfig, layout: ParallelLayout,
                    num_microbatches: int | None) -> None:
    pp, vp = layout.pp, layout.vp
    if arch.num_layers % (pp * vp):
        raise ValueError(f"pipeline-parallel size {pp}"
                         + (f" x {vp} virtual stages" if vp > 1 else "")
                         + f" does not divide num_layers={arch.num_layers}: every "
                         + ("virtual " if vp > 1 else "") + "stage holds the same number of "
                         "layers")
    if vp > 1 and num_microbatches is not None and (num_microbatches < pp
                                                    or num_microbatches % pp):
        raise ValueError(f"the interleaved schedule ({vp} virtual stages per rank) runs "
                         f"microbatches in groups of --pipeline-model-parallel-size {pp}: "
                         f"{num_microbatches} microbatches a step (per data-parallel rank) is "
                         f"not a multiple of it")


def _check_experts(arch: GPTArchConfig, layout: ParallelLayout, any_experts: bool,
                   role: Role) -> None:
    ep, etp = layout.ep, layout.expert_tp
    # a colocated teacher takes the student's expert groups, whichever model needs them
    if ep > 1 and not any_experts and role is not Role.COLOCATED_TEACHER:
        whose = ("neither the student nor a colocated teacher has experts"
                 if role is Role.STUDENT else f"the {role.value} has no experts")
        raise ValueError(f"--expert-model-parallel-size {ep} needs a mixture-of-experts model: "
                         f"{whose} (--num-experts)")
    if arch.num_experts is None:
        return
    if arch.num_experts % ep:
        raise ValueError(f"expert-parallel size {ep} does not divide "
                         f"num_experts={arch.num_experts}")
    if arch.add_bias_linear and etp != 1:
        default = " (the default is the tensor-parallel size)" if etp == layout.tp else ""
        raise ValueError(f"experts with biases (gpt-oss) need --expert-tensor-parallel-size 1 "
                         f"(Megatron-Core supports MoE biases only then), got {etp}{default}")


def _check_context(arch: GPTArchConfig, layout: ParallelLayout, role: Role,
                   transformer_engine: bool) -> None:
    cp = layout.cp
    if cp == 1:
        return
    limit = context_parallel_limit(arch)
    if limit is not None:
        colocated = role is Role.COLOCATED_TEACHER
        whose = "a colocated Gated DeltaNet teacher" if colocated else (
            f"a Gated DeltaNet {'student' if role is Role.STUDENT else 'teacher'}")
        why = "it runs with the student's context parallelism, and " if colocated else ""
        raise ValueError(f"--context-parallel-size {cp} with {whose} (layers "
                         f"{arch.linear_attention_layers}): {why}{limit}; {_CP_ADVICE[role]}")
    if not transformer_engine:
        return  # megatron_kd's own context-parallel attention gathers K and V: any model
    comm = layout.cp_comm_type
    if comm != "a2a" and (arch.attention_sinks or arch.window_size is not None):
        raise ValueError(f"--context-parallel-size {cp} with --cp-comm-type {comm}: Transformer "
                         f"Engine runs attention sinks and sliding windows with context "
                         f"parallelism only as a2a")
    if comm == "a2a":
        heads, groups = arch.num_attention_heads // layout.tp, arch.query_groups // layout.tp
        if heads % cp or groups % cp:
            raise ValueError(f"--cp-comm-type a2a scatters heads over --context-parallel-size "
                             f"{cp}: the {heads} heads and {groups} key/value groups per "
                             f"tensor-parallel rank must divide by it")


# --- each role's own rules -----------------------------------------------------------------------


def _training_rules(arch: GPTArchConfig, layout: ParallelLayout) -> None:
    tp = layout.tp
    if arch.num_experts and arch.add_bias_linear:
        raise ValueError("a mixture-of-experts student with --add-bias-linear (gpt-oss-like) "
                         "cannot train: Megatron-Core's expert MLP adds its bias in place on "
                         "a view and fails in backward (megatron-core 0.16.1 and 0.19.2, "
                         "mlp.py); such a model works as a teacher")
    if arch.linear_attention_layers and tp > 1 and not layout.sequence_parallel:
        raise ValueError(f"a Gated DeltaNet student (--experimental-attention-variant, layers "
                         f"{arch.linear_attention_layers}) at --tensor-model-parallel-size "
                         f"{tp} needs --sequence-parallel: Megatron-Core's DeltaNet output norm "
                         f"is one weight shared by the heads of every TP rank, and only a "
                         f"sequence-parallel norm has its gradient summed over the TP ranks "
                         f"(without it each rank's copy follows its own heads: megatron-core "
                         f"0.16.1 and 0.19.2)")
    if arch.num_experts and tp > 1 and not layout.sequence_parallel:
        raise ValueError(f"a mixture-of-experts student (--num-experts {arch.num_experts}) at "
                         f"--tensor-model-parallel-size {tp} needs --sequence-parallel "
                         f"(Megatron-Core's MoELayer refuses tensor parallelism without it in "
                         f"training)")
    _check_recompute(arch, layout)


def _check_recompute(arch: GPTArchConfig, layout: ParallelLayout) -> None:
    """Full recompute's groups over a model chunk's ``k`` layers (Megatron-Core 0.16.1's
    ``TransformerBlock._checkpointed_forward``): ``uniform`` checkpoints groups of ``N``, so
    ``N`` divides ``k`` (the last group would index past the chunk); ``block`` recomputes the
    first ``N`` of them, ``1 <= N <= k``."""
    if layout.recompute != "full":
        return
    chunk = arch.num_layers // (layout.pp * layout.vp)
    count = layout.recompute_num_layers
    if layout.recompute_method == "block" and not 1 <= count <= chunk:
        raise ValueError(f"--recompute-num-layers {count} must be between 1 and the layers of "
                         f"a model chunk ({chunk}) with --recompute-method block")
    if layout.recompute_method == "uniform" and chunk % count:
        raise ValueError(f"--recompute-num-layers {count} does not divide the layers of a model "
                         f"chunk ({chunk}): --recompute-method uniform checkpoints the chunk in "
                         f"groups of {count}, and Megatron-Core's last group would index past "
                         f"the chunk")


def _colocated_rules(arch: GPTArchConfig, layout: ParallelLayout) -> None:
    if layout.pp != 1:
        raise ValueError(f"a colocated teacher runs whole on the student's last pipeline "
                         f"stage, not over {layout.pp} stages")


def _experts_within_tensor_parallel(arch: GPTArchConfig, layout: ParallelLayout) -> None:
    """A teacher whose ranks each work alone on their own samples (a replica, a cache build's
    data-parallel copies) keeps its experts inside one tensor-parallel group: no all-to-all
    spans ranks that run different numbers of forwards."""
    tp, ep, etp = layout.tp, layout.ep, layout.expert_tp
    if tp % (ep * etp):
        raise ValueError(f"--expert-model-parallel-size {ep} x --expert-tensor-parallel-size "
                         f"{etp} must divide --tensor-model-parallel-size {tp}: a teacher's "
                         f"experts are split within its tensor-parallel group (e.g. "
                         f"--tensor-model-parallel-size 2 --expert-model-parallel-size 2 "
                         f"--expert-tensor-parallel-size 1)")


def _replica_rules(arch: GPTArchConfig, layout: ParallelLayout) -> None:
    if layout.dp != 1:
        ranks = layout.tp * layout.pp * layout.cp
        raise ValueError(f"a teacher replica's world is its TP x PP x CP ({layout.tp} x "
                         f"{layout.pp} x {layout.cp} = {ranks}), got {layout.world_size} "
                         f"ranks: launch one `teacher serve` per replica (a replica is never a "
                         f"data-parallel rank of another: each must be able to fail alone)")
    _experts_within_tensor_parallel(arch, layout)


def _cache_rules(arch: GPTArchConfig, layout: ParallelLayout) -> None:
    if layout.pp != 1:
        raise ValueError(f"cache build runs the teacher without a pipeline (got "
                         f"{layout.pp} stages): spread it over --tensor-model-parallel-size")
    _experts_within_tensor_parallel(arch, layout)


def _no_rules(arch: GPTArchConfig, layout: ParallelLayout) -> None:
    """A frozen model in a layout of its own: its split alone."""


_ROLE_RULES = {
    Role.STUDENT: _training_rules,
    Role.COLOCATED_TEACHER: _colocated_rules,
    Role.TEACHER_REPLICA: _replica_rules,
    Role.CACHE_TEACHER: _cache_rules,
    Role.FROZEN: _no_rules,
}
