"""Megatron-LM's model flags and saved arguments -> :class:`~megatron_kd.arch.config.GPTArchConfig`.

A Megatron-LM (or Megatron-Bridge) checkpoint has no ``model_config.json``: its architecture is
what the run that wrote it was launched with, as Megatron-LM flags (``--kd-teacher-args
"--num-layers 32 --hidden-size 4096 ..."``, or a file holding them;
:func:`parse_megatron_lm_flags`) or as the arguments Megatron-LM saved in the checkpoint
(``common.pt``'s ``args``). Flags are read with Megatron-LM's defaults (LayerNorm, learned
absolute positions, biases on, tied embeddings, no SwiGLU unless ``--swiglu``...), so a run's
launch flags can be pasted as they are; :func:`arch_from_megatron_lm_args` turns either into an
architecture, refusing a feature this project does not build (multi-latent attention, partial
rotary, dense layers between expert layers, ...) by naming the flag.

Pure Python; reading the checkpoint itself is :mod:`megatron_kd.integration.megatron_lm_checkpoint`.
"""

from __future__ import annotations

import argparse
import os
import shlex
from typing import Any

from megatron_kd.arch.config import GPTArchConfig
from megatron_kd.parallel import pad_vocab_size

__all__ = ["arch_from_megatron_lm_args", "complete_megatron_lm_flags", "megatron_lm_flags",
           "megatron_lm_flags_text", "parse_megatron_lm_flags", "read_megatron_lm_flags"]

# Flags of a launch line that do not change the weights or the function: accepted, ignored.
_IGNORED_VALUE_FLAGS = ("--seq-length", "--attention-dropout", "--hidden-dropout",
                        "--transformer-impl", "--tensor-model-parallel-size",
                        "--pipeline-model-parallel-size", "--expert-model-parallel-size",
                        "--expert-tensor-parallel-size", "--moe-token-dispatcher-type",
                        "--moe-aux-loss-coeff", "--moe-router-load-balancing-type",
                        "--tokenizer-type", "--tokenizer-model", "--attention-backend")
_IGNORED_SWITCHES = ("--use-mcore-models", "--bf16", "--fp16", "--sequence-parallel",
                     "--use-flash-attn", "--moe-grouped-gemm", "--no-masked-softmax-fusion",
                     "--no-bias-swiglu-fusion", "--no-rope-fusion", "--no-persist-layer-norm",
                     "--no-gradient-accumulation-fusion", "--use-cpu-initialization",
                     "--use-rotary-position-embeddings", "--group-query-attention-off")

# Saved-args attributes (and the value that means "off") this project cannot build.
_UNSUPPORTED = {"multi_latent_attention": False, "rotary_interleaved": False,
                "apply_layernorm_1p": False, "layernorm_zero_centered_gamma": False,
                "moe_shared_expert_intermediate_size": None,
                "window_size": None, "qk_l2_norm": False, "num_experts_per_layer": None,
                "heterogeneous_layers_config_path": None, "hybrid_override_pattern": None}


def _parser(*, with_ignored: bool = True) -> argparse.ArgumentParser:
    """The model flags (and, ``with_ignored``, the launch flags accepted and ignored)."""
    p = argparse.ArgumentParser(prog="--kd-teacher-args", add_help=False, allow_abbrev=False)
    for flag in ("--num-layers", "--hidden-size", "--num-attention-heads", "--ffn-hidden-size",
                 "--kv-channels", "--max-position-embeddings", "--num-query-groups",
                 "--num-experts", "--moe-ffn-hidden-size", "--vocab-size",
                 "--moe-shared-expert-intermediate-size"):
        p.add_argument(flag, type=int, default=None)
    p.add_argument("--moe-router-topk", type=int, default=2)
    p.add_argument("--moe-layer-freq", default=1)
    p.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    p.add_argument("--group-query-attention", action="store_true")
    p.add_argument("--position-embedding-type", default="learned_absolute",
                   choices=("learned_absolute", "rope", "none"))
    p.add_argument("--rotary-base", type=float, default=10000.0)
    p.add_argument("--rotary-percent", type=float, default=1.0)
    p.add_argument("--use-rope-scaling", action="store_true")
    p.add_argument("--rope-scaling-factor", type=float, default=8.0)
    p.add_argument("--normalization", default="LayerNorm")
    # Megatron-LM's own destination names (its saved args use them)
    p.add_argument("--norm-epsilon", dest="layernorm_epsilon", type=float, default=1e-5)
    p.add_argument("--init-method-std", type=float, default=0.02)
    for flag in ("--swiglu", "--untie-embeddings-and-output-weights", "--add-qkv-bias",
                 "--qk-layernorm", "--moe-router-pre-softmax", "--apply-layernorm-1p",
                 "--multi-latent-attention", "--rotary-interleaved"):
        p.add_argument(flag, action="store_true")
    p.add_argument("--disable-bias-linear", dest="add_bias_linear", action="store_false")
    if not with_ignored:
        return p
    for flag in _IGNORED_VALUE_FLAGS:
        p.add_argument(flag, dest="_ignored_" + flag[2:].replace("-", "_"))
    for flag in _IGNORED_SWITCHES:
        p.add_argument(flag, dest="_ignored_" + flag[2:].replace("-", "_"), action="store_true")
    return p


def parse_megatron_lm_flags(value: str, *, what: str = "--kd-teacher-args") -> argparse.Namespace:
    """The architecture in Megatron-LM flags (a string, or the path of a file holding them),
    completed by :func:`complete_megatron_lm_flags`. Unknown flags raise ``ValueError`` naming
    them; ``what``: the option the flags came from, for messages."""
    text = value
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            text = " ".join(line.split("#", 1)[0] for line in f)
    args, unknown = _parser().parse_known_args(shlex.split(text.replace("\\\n", " ")))
    if unknown:
        raise ValueError(f"{what}: flags not known as a model architecture: {unknown} (give "
                         f"the model flags only)")
    return complete_megatron_lm_flags(args, what=what)


def read_megatron_lm_flags(tokens: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """The model flags among a whole launch line's ``tokens`` (Megatron-LM's defaults for those
    left out; not completed), and the other tokens, in their order."""
    try:
        return _parser(with_ignored=False).parse_known_args(tokens)
    except SystemExit as exc:  # argparse's way of saying a value was malformed
        raise ValueError(f"cannot read the model flags of {' '.join(tokens)!r}") from exc


def complete_megatron_lm_flags(args: argparse.Namespace, *,
                               what: str = "--kd-teacher-args") -> argparse.Namespace:
    """``args`` (model flags) with Megatron-LM's derived values: ``ffn_hidden_size`` 4h, or
    with SwiGLU ``int(8h/3 / 64) * 64``; ``kv_channels`` h / heads; one query group per head
    without ``--group-query-attention``. ``ValueError`` without the model's shape flags."""
    given = vars(args)
    for name in ("num_layers", "hidden_size", "num_attention_heads"):
        if given[name] is None:
            raise ValueError(f"{what} needs --{name.replace('_', '-')}")
    h = args.hidden_size
    if args.ffn_hidden_size is None:
        args.ffn_hidden_size = int(4 * h * 2 / 3 / 64) * 64 if args.swiglu else 4 * h
    if args.kv_channels is None:
        args.kv_channels = h // args.num_attention_heads
    if not args.group_query_attention:
        args.num_query_groups = args.num_attention_heads
    elif args.num_query_groups is None:
        args.num_query_groups = 1
    return args


def _refuse_unsupported(saved: dict) -> None:
    found = [f"{name}={saved[name]!r}" for name, off in _UNSUPPORTED.items()
             if saved.get(name, off) not in (off, False, None)]
    if saved.get("rotary_percent", 1.0) != 1.0:
        found.append(f"rotary_percent={saved['rotary_percent']}")
    if str(saved.get("moe_layer_freq", 1)) != "1":
        found.append(f"moe_layer_freq={saved['moe_layer_freq']!r}")
    if saved.get("add_qkv_bias", False) and not saved.get("add_bias_linear", True):
        found.append("add_qkv_bias without add_bias_linear")
    if found:
        raise ValueError(f"Megatron-LM architecture not supported: {', '.join(found)}")


def arch_from_megatron_lm_args(args: Any, *, embedding_rows: int | None = None,
                               vocab_size: int | None = None) -> GPTArchConfig:
    """:class:`GPTArchConfig` of Megatron-LM arguments (parsed flags or the saved ``args``).

    ``embedding_rows``: the checkpoint's embedding rows (its padded vocabulary); without a
    checkpoint, the vocabulary padded to ``--make-vocab-size-divisible-by`` (at TP 1). The true
    vocabulary is ``vocab_size``, else the arguments' ``--vocab-size``, else every row. Saved
    arguments are data from whichever Megatron-LM release wrote the checkpoint: a field that
    release did not have reads as Megatron-LM's default for it.
    """
    saved = vars(args)
    _refuse_unsupported(saved)
    vocab = vocab_size or saved.get("vocab_size") or embedding_rows
    if vocab is None:
        raise ValueError("the Megatron-LM arguments give no vocabulary (--vocab-size) and there "
                         "is no checkpoint embedding to count")
    if embedding_rows is None:
        embedding_rows = pad_vocab_size(int(vocab), 1,
                                        int(saved.get("make_vocab_size_divisible_by") or 128))
    heads = args.num_attention_heads
    groups = args.num_query_groups if saved.get("group_query_attention", False) else heads
    kv = args.kv_channels
    experts = saved.get("num_experts")
    return GPTArchConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=heads,
        num_query_groups=groups, ffn_hidden_size=args.ffn_hidden_size,
        kv_channels=None if kv is None or kv * heads == args.hidden_size else kv,
        vocab_size=int(vocab), padded_vocab_size=int(embedding_rows),
        max_position_embeddings=args.max_position_embeddings or saved.get("seq_length", 0),
        rotary_base=float(args.rotary_base), norm_epsilon=float(args.layernorm_epsilon),
        normalization=args.normalization, swiglu=bool(args.swiglu),
        tie_embeddings=not args.untie_embeddings_and_output_weights,
        add_bias_linear=bool(args.add_bias_linear),
        position_embedding_type=args.position_embedding_type,
        init_method_std=float(args.init_method_std),
        qk_layernorm=bool(saved.get("qk_layernorm", False)),
        num_experts=experts,
        moe_ffn_hidden_size=saved.get("moe_ffn_hidden_size") if experts else None,
        moe_router_topk=int(saved.get("moe_router_topk", 2) or 2),
        moe_router_pre_softmax=bool(saved.get("moe_router_pre_softmax", False)),
        rope_scaling_factor=(float(saved.get("rope_scaling_factor", 8.0))
                             if saved.get("use_rope_scaling", False) else None))


def _not_expressible(arch: GPTArchConfig) -> list[str]:
    """The features of ``arch`` that Megatron-LM's GPT flags (as this module reads them)
    cannot say."""
    found = []
    checks = (("Gated DeltaNet layers", arch.linear_attention_layers),
              ("an attention output gate", arch.attention_output_gate),
              ("shared experts", arch.moe_shared_expert_size),
              ("sliding-window attention", arch.window_size),
              ("attention sinks", arch.attention_sinks),
              ("YaRN RoPE", arch.yarn_factor),
              (f"gated activation {arch.gated_activation!r}", arch.gated_activation != "silu"),
              ("a GLU linear offset", arch.glu_linear_offset),
              ("an activation clamp", arch.activation_clamp),
              (f"partial RoPE ({arch.rotary_percent})", arch.rotary_percent != 1.0),
              ("QKV bias without linear bias", arch.add_qkv_bias and not arch.add_bias_linear))
    for name, present in checks:
        if present:
            found.append(name)
    return found


def megatron_lm_flags(arch: GPTArchConfig) -> list[str]:
    """The Megatron-LM model flags that build ``arch`` (the inverse of
    :func:`parse_megatron_lm_flags` + :func:`arch_from_megatron_lm_args`), every value
    explicit: what ``pretrain_gpt.py`` needs to load this checkpoint with
    ``--pretrained-checkpoint``. The vocabulary is the tokenizer's (``--tokenizer-model``) and
    its padding ``--make-vocab-size-divisible-by``: not model flags. ``ValueError`` naming the
    features Megatron-LM's GPT flags cannot express (a Gated DeltaNet hybrid, gpt-oss...)."""
    missing = _not_expressible(arch)
    if missing:
        raise ValueError(f"Megatron-LM's GPT model flags cannot express this model's "
                         f"{', '.join(missing)}: train it with `megatron-kd train` instead")
    flags = ["--num-layers", arch.num_layers, "--hidden-size", arch.hidden_size,
             "--ffn-hidden-size", arch.ffn_hidden_size,
             "--num-attention-heads", arch.num_attention_heads]
    if arch.query_groups != arch.num_attention_heads:
        flags += ["--group-query-attention", "--num-query-groups", arch.query_groups]
    if arch.kv_channels is not None:
        flags += ["--kv-channels", arch.kv_channels]
    flags += ["--max-position-embeddings", arch.max_position_embeddings,
              "--position-embedding-type", arch.position_embedding_type]
    if arch.position_embedding_type == "rope":
        flags += ["--rotary-base", _number(arch.rotary_base)]
        if arch.rope_scaling_factor is not None:
            flags += ["--use-rope-scaling", "--rope-scaling-factor",
                      _number(arch.rope_scaling_factor)]
    flags += ["--normalization", arch.normalization, "--norm-epsilon",
              _number(arch.norm_epsilon)]
    if arch.swiglu:
        flags.append("--swiglu")
    if not arch.tie_embeddings:
        flags.append("--untie-embeddings-and-output-weights")
    if not arch.add_bias_linear:
        flags.append("--disable-bias-linear")
    if arch.add_qkv_bias:
        flags.append("--add-qkv-bias")
    if arch.qk_layernorm:
        flags.append("--qk-layernorm")
    if arch.num_experts:
        flags += ["--num-experts", arch.num_experts,
                  "--moe-ffn-hidden-size", arch.expert_ffn_hidden_size,
                  "--moe-router-topk", arch.moe_router_topk]
        if arch.moe_router_pre_softmax:
            flags.append("--moe-router-pre-softmax")
    flags += ["--init-method-std", _number(arch.init_method_std)]
    return [str(f) for f in flags]


def megatron_lm_flags_text(arch: GPTArchConfig, source: str) -> str:
    """:func:`megatron_lm_flags` as a flags file (a flag and its value a line, ``#`` comments
    naming ``source``): what ``--kd-teacher-args FILE``, :func:`parse_megatron_lm_flags` and
    ``examples/megatron_lm/train_kd_*.sh``'s ``MODEL_ARGS_FILE`` read."""
    flags, lines, i = megatron_lm_flags(arch), [], 0
    while i < len(flags):
        takes_value = i + 1 < len(flags) and not flags[i + 1].startswith("--")
        lines.append(" ".join(flags[i:i + 2]) if takes_value else flags[i])
        i += 2 if takes_value else 1
    return (f"# Megatron-LM's model flags of {source}.\n"
            f"# Vocabulary: --tokenizer-model and --make-vocab-size-divisible-by.\n"
            + "\n".join(lines) + "\n")


def _number(value: float) -> str:
    """A float as Megatron-LM's argparse reads it back exactly (``repr``: the shortest)."""
    return repr(float(value)) if float(value) != int(value) else str(int(value))
