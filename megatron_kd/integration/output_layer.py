"""Final hidden states instead of logits: a ``GPTModel`` whose output layer never runs.

* :func:`bypass_output_layer` makes a Megatron-Core ``GPTModel`` return its final hidden states
  (after the final norm) instead of logits, so the ``[tokens, vocab]`` logits never exist;
* :func:`output_layer_weight` is this rank's ``[local_vocab_size, h]`` output shard, which goes
  with the hidden states into the fused loss.
"""

from __future__ import annotations

import contextlib

import torch

__all__ = ["bypass_output_layer", "output_layer_bypassed", "output_layer_weight", "to_sbh",
           "unwrap_model"]


def unwrap_model(model):
    """The ``GPTModel`` inside DDP / Float16Module wrappers."""
    while hasattr(model, "module"):
        model = model.module
    return model


def _bypass_forward(input_, weight=None, runtime_gather_output=None):
    # Stands in for ColumnParallelLinear.forward: the hidden states pass through unchanged.
    return input_, None


def bypass_output_layer(model):
    """Make ``model`` (a ``GPTModel``, possibly wrapped) skip its output layer, for good.

    On the last pipeline stage the model then returns the final hidden states (after the final
    norm) as ``[b, s, h]`` where it would have returned ``[b, s, V/tp]`` logits; the output-layer
    weight still exists (and trains) through the loss. With sequence parallelism the hidden
    states stay this TP rank's slice of the sequence, ``[b, s/tp, h]`` (the output layer's
    all-gather of the sequence never runs): the fused loss takes them so
    (``KDLossConfig.sequence_parallel``) and gathers inside. Idempotent.
    """
    inner = unwrap_model(model)
    layer = getattr(inner, "output_layer", None)
    if layer is None:
        return model  # not the last pipeline stage
    if getattr(inner.config, "mtp_num_layers", None):
        raise ValueError("bypass_output_layer does not support multi-token prediction")
    layer.forward = _bypass_forward
    return model


@contextlib.contextmanager
def output_layer_bypassed(model):
    """Context manager form of :func:`bypass_output_layer` (restores the output layer)."""
    layer = getattr(unwrap_model(model), "output_layer", None)
    had = layer is not None and "forward" in vars(layer)
    old = vars(layer).get("forward") if layer is not None else None
    bypass_output_layer(model)
    try:
        yield model
    finally:
        if layer is not None:
            if had:
                layer.forward = old
            else:
                del layer.forward


def output_layer_weight(model) -> torch.Tensor:
    """This rank's ``[local_vocab_size, h]`` output-layer shard (the embedding when tied)."""
    inner = unwrap_model(model)
    if not getattr(inner, "post_process", True):
        raise ValueError("output_layer_weight: this pipeline stage has no output layer")
    if inner.share_embeddings_and_output_weights:
        return inner.shared_embedding_or_output_weight()
    return inner.output_layer.weight


def to_sbh(hidden: torch.Tensor) -> torch.Tensor:
    """``[b, s, h]`` (what a bypassed GPTModel returns) -> ``[s, b, h]`` (a view)."""
    return hidden.transpose(0, 1)

