"""The ``megatron-kd train`` flags of a Qwen3.5-shaped student: Gated DeltaNet linear attention in a
layer pattern, gated softmax attention, partial RoPE and a (gated) shared expert, spelled as
Megatron-LM spells them (``--experimental-attention-variant gated_delta_net
--linear-attention-freq 4 --attention-output-gate --rotary-percent 0.25 ...``).

:func:`hybrid_arch_fields` turns them into :class:`~megatron_kd.arch.GPTArchConfig`
fields, refusing combinations Megatron-LM would refuse or silently ignore. Pure Python.
"""

from __future__ import annotations

import argparse
import ast
from typing import Any

__all__ = ["LINEAR_DEFAULTS", "VARIANTS", "hybrid_arch_fields", "layer_pattern"]

# Megatron-Core's TransformerConfig defaults of the Gated DeltaNet widths.
LINEAR_DEFAULTS = {"linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
                    "linear_value_head_dim": 128, "linear_num_key_heads": 16,
                    "linear_num_value_heads": 32}
VARIANTS = ("gated_delta_net", "gdn")


def layer_pattern(value: str) -> int | list[int]:
    """``--linear-attention-freq``: an int N (one softmax-attention layer every N, the rest
    linear) or a list expression of 0 / 1 such as ``"([1]*3+[0])*2"`` (1 = linear attention).
    Only list displays, integers, ``+`` and ``*`` are read: nothing is evaluated."""
    text = value.strip()
    if text.lstrip("-").isdigit():
        n = int(text)
        if n < 1:
            raise argparse.ArgumentTypeError(f"--linear-attention-freq {value!r}: must be >= 1")
        return n
    try:
        pattern = _pattern(ast.parse(text, mode="eval").body)
    except (SyntaxError, ValueError) as e:
        raise argparse.ArgumentTypeError(
            f"--linear-attention-freq {value!r}: not an int or a list expression of 0 and 1 "
            f"({e})") from None
    if not isinstance(pattern, list) or not pattern or set(pattern) - {0, 1}:
        raise argparse.ArgumentTypeError(
            f"--linear-attention-freq {value!r}: must give a non-empty list of 0 and 1, "
            f"got {pattern!r}")
    return pattern


def _pattern(node: ast.AST) -> int | list[int]:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, (ast.List, ast.Tuple)):
        items = [_pattern(e) for e in node.elts]
        if any(isinstance(i, list) for i in items):
            raise ValueError("nested lists")
        return items
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
        left, right = _pattern(node.left), _pattern(node.right)
        if isinstance(node.op, ast.Mult) and isinstance(left, int) != isinstance(right, int):
            return left * right
        if isinstance(node.op, ast.Add) and isinstance(left, list) and isinstance(right, list):
            return left + right
    raise ValueError(f"unsupported expression {ast.dump(node)[:60]}")


def hybrid_arch_fields(arch) -> dict[str, Any]:
    """GPTArchConfig fields of the hybrid flags of ``arch`` (an
    :class:`~megatron_kd.training.run_config.ArchitectureSection`); ``ValueError`` naming the
    flags when they do not fit together (no flag is ignored)."""
    fields: dict[str, Any] = {
        "attention_output_gate": arch.attention_output_gate,
        "rotary_percent": arch.resolved("rotary_percent"),
        "moe_shared_expert_size": arch.moe_shared_expert_intermediate_size,
        "moe_shared_expert_gate": arch.moe_shared_expert_gate,
    }
    if arch.moe_shared_expert_intermediate_size is not None and arch.num_experts is None:
        raise ValueError(f"--moe-shared-expert-intermediate-size "
                         f"{arch.moe_shared_expert_intermediate_size} needs --num-experts")
    if arch.moe_shared_expert_gate and arch.moe_shared_expert_intermediate_size is None:
        raise ValueError("--moe-shared-expert-gate needs --moe-shared-expert-intermediate-size")
    freq = arch.linear_attention_freq
    given = [f"--{name.replace('_', '-')}" for name in LINEAR_DEFAULTS
             if getattr(arch, name) is not None]
    if freq is not None:
        given.append("--linear-attention-freq")
    if arch.experimental_attention_variant is None:
        if given:
            raise ValueError(f"{' '.join(given)} without --experimental-attention-variant "
                             f"gated_delta_net")
        return fields
    if freq is None:
        raise ValueError("--experimental-attention-variant gated_delta_net needs "
                         "--linear-attention-freq (which layers are linear attention)")
    n = arch.num_layers
    pattern = freq if isinstance(freq, list) else [int((i + 1) % freq != 0) for i in range(n)]
    if len(pattern) != n:
        raise ValueError(f"--linear-attention-freq gives {len(pattern)} layers, "
                         f"--num-layers is {n}")
    fields["linear_attention_layers"] = [i for i, linear in enumerate(pattern) if linear]
    for name, default in LINEAR_DEFAULTS.items():
        value = getattr(arch, name)
        fields[name] = default if value is None else value
    return fields
