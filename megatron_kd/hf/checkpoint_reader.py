"""A Megatron-Core GPT checkpoint's weights, read a layer at a time: no model, no process group.

A ``torch_dist`` checkpoint (``dist_checkpointing``: this project's ``import-hf`` and
``megatron-kd train`` directories, or a Megatron-LM run's) stores every tensor under a global
key, cut into the chunks the ranks that saved it held. :class:`CheckpointWeights` reads any
region of a stored tensor with ``torch.distributed.checkpoint`` and a planner that asks for that
region only (:class:`_RegionPlanner`), so a layer is read without the others and whatever
tensor-, pipeline- or expert-parallel layout wrote it.

Megatron-Core stores a layer's tensors in one of these layouts (megatron-core 0.16.1 and
0.19.2; the names a ``GPTModel`` of the local or the Transformer Engine spec writes):

* the layers stacked (``decoder.layers.self_attention.linear_qkv.weight`` of shape ``[L, ...]``)
  or one key per layer (``decoder.layers.3.self_attention...``: hybrids, ``moe_layer_freq``,
  ``singleton_local_shards``);
* the experts stacked (``mlp.experts.experts.linear_fc1.weight`` of shape ``[E, ...]`` after
  the layer axis) or one key per expert (``mlp.experts.experts.5.linear_fc1.weight``);
* a gated MLP's ``linear_fc1`` as one tensor ``[gate; up]``, or (``singleton_local_shards``)
  as ``linear_fc1.weight_w`` (gate) and ``linear_fc1.weight_v`` (up);
* a Gated DeltaNet's ``in_proj.weight`` as its parts ``.query .key .value .z .beta .alpha``
  and ``conv1d.weight`` as ``.query .key .value``;
* the norms by Transformer Engine's fused names (``linear_qkv.layer_norm_weight``,
  ``mlp.linear_fc1.layer_norm_weight``) or as ``input_layernorm`` / ``pre_mlp_layernorm``.

:meth:`CheckpointWeights.layer` gives one layer's tensors under the names a local-spec model
built at TP 1 / EP 1 has (``decoder.layers.{i}.self_attention.linear_qkv.weight``,
``decoder.layers.{i}.mlp.experts.local_experts.{e}.linear_fc1.weight``,
``decoder.layers.{i}.input_layernorm.weight``...): the names
:func:`megatron_kd.hf.import_weights.convert_hf_state_dict` writes. Keys of other state
(optimizer moments, RNG states) are ignored; a model key that no method reads is reported by
:meth:`CheckpointWeights.unread`.
"""

from __future__ import annotations

import os
import re
import warnings

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

__all__ = ["CheckpointWeights"]

# The model's own keys: everything else in a training checkpoint is optimizer or run state.
_MODEL_PREFIXES = ("embedding.", "decoder.", "output_layer.", "mtp.")
_LAYER_KEY = re.compile(r"^decoder\.layers\.(?:(\d+)\.)?(.+)$")
_EXPERT_KEY = re.compile(r"^(.*\.experts\.)experts\.(?:(\d+)\.)?(.+)$")
_DELTANET_PARTS = {"in_proj.weight": ("query", "key", "value", "z", "beta", "alpha"),
                   "conv1d.weight": ("query", "key", "value")}
_NORM_NAMES = {"self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
               "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight"}


class _RegionPlanner(dcp.DefaultLoadPlanner):
    """Reads ``regions[key] = (offsets, buffer)``: the part of the stored tensor ``key`` that
    starts at ``offsets`` and has ``buffer``'s shape, from the stored chunks it overlaps only."""

    def __init__(self, regions: dict[str, tuple[tuple[int, ...], torch.Tensor]]) -> None:
        super().__init__()
        self.regions = regions

    def create_local_plan(self) -> LoadPlan:
        items = []
        for key, (offsets, buffer) in self.regions.items():
            lo, hi = offsets, [o + s for o, s in zip(offsets, buffer.shape)]
            for chunk in self.metadata.state_dict_metadata[key].chunks:
                c_lo = chunk.offsets
                o_lo = [max(a, b) for a, b in zip(lo, c_lo)]
                o_hi = [min(a, b + s) for a, b, s in zip(hi, c_lo, chunk.sizes)]
                if any(a >= b for a, b in zip(o_lo, o_hi)):
                    continue
                items.append(ReadItem(
                    type=LoadItemType.TENSOR, dest_index=MetadataIndex(key),
                    dest_offsets=torch.Size(a - b for a, b in zip(o_lo, lo)),
                    storage_index=MetadataIndex(key, chunk.offsets),
                    storage_offsets=torch.Size(a - b for a, b in zip(o_lo, c_lo)),
                    lengths=torch.Size(b - a for a, b in zip(o_lo, o_hi))))
        return LoadPlan(items)


class CheckpointWeights:
    """The model tensors of the ``torch_dist`` checkpoint in ``directory``, read on demand.

    ``num_layers`` and ``num_experts`` (None: dense) say how the stored keys are cut up; every
    read returns fresh CPU tensors in the stored dtype. Not thread-safe; one process.
    """

    def __init__(self, directory: str | os.PathLike, *, num_layers: int,
                 num_experts: int | None) -> None:
        self.directory = os.fspath(directory)
        self.num_layers = num_layers
        self.num_experts = num_experts
        metadata = dcp.FileSystemReader(self.directory).read_metadata()
        self._stored = {k: m for k, m in metadata.state_dict_metadata.items()
                        if isinstance(m, TensorStorageMetadata) and k.startswith(_MODEL_PREFIXES)}
        if not self._stored:
            raise ValueError(f"{self.directory!r} holds no model tensors (not a Megatron-Core "
                             f"GPT checkpoint?)")
        self._read: set[str] = set()

    # -- what is stored -----------------------------------------------------------------------

    def model_keys(self) -> list[str]:
        """The stored model keys."""
        return sorted(self._stored)

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._stored[key].size)

    def dtype(self, key: str) -> torch.dtype:
        return self._stored[key].properties.dtype

    def has(self, key: str) -> bool:
        return key in self._stored

    def nbytes(self, key: str) -> int:
        """Bytes of the stored tensor ``key``."""
        return self._stored[key].size.numel() * self.dtype(key).itemsize

    def layer_nbytes(self, index: int) -> int:
        """Bytes :meth:`layer` reads for layer ``index`` (before reading it)."""
        total = 0
        for key in self._stored:
            m = _LAYER_KEY.match(key)
            if m is not None and m.group(1) is None:
                total += self.nbytes(key) // self.shape(key)[0]
            elif m is not None and int(m.group(1)) == index:
                total += self.nbytes(key)
        return total

    def unread(self) -> list[str]:
        """Stored model keys no read has touched."""
        return sorted(set(self._stored) - self._read)

    # -- reading ------------------------------------------------------------------------------

    def _read_regions(self, requests: list[tuple[str, tuple[int, ...]]]) -> list[torch.Tensor]:
        """``[(key, leading indices)]`` -> each stored tensor ``key`` with its leading axes fixed
        at those indices (one layer of a stacked key), in one ``torch.distributed.checkpoint``
        load that reads the chunks those regions overlap and no others."""
        regions, out = {}, []
        for key, index in requests:
            full = self.shape(key)
            if key in regions:
                raise ValueError(f"{key} requested twice in one read")
            if len(index) > len(full) or any(not 0 <= j < n for j, n in zip(index, full)):
                raise ValueError(f"{key}: index {index} outside the stored shape {full}")
            buffer = torch.empty((1,) * len(index) + full[len(index):], dtype=self.dtype(key))
            regions[key] = (tuple(index) + (0,) * (len(full) - len(index)), buffer)
            out.append(buffer.reshape(full[len(index):]))
        with warnings.catch_warnings():
            # one process on purpose: no process group is needed to read
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load({key: buffer for key, (_, buffer) in regions.items()},
                     storage_reader=dcp.FileSystemReader(self.directory),
                     planner=_RegionPlanner(regions), no_dist=True)
        self._read.update(regions)
        return out

    def read(self, key: str) -> torch.Tensor:
        """A whole stored tensor."""
        if key not in self._stored:
            raise ValueError(f"checkpoint {self.directory!r} has no tensor {key!r}")
        return self._read_regions([(key, ())])[0]

    def layer(self, index: int) -> dict[str, torch.Tensor]:
        """Layer ``index``'s tensors under local-spec TP 1 / EP 1 names (see the module)."""
        if not 0 <= index < self.num_layers:
            raise ValueError(f"layer {index} outside the checkpoint's {self.num_layers} layers")
        requests, names = [], []
        for key in sorted(self._stored):
            m = _LAYER_KEY.match(key)
            if m is None or (m.group(1) is not None and int(m.group(1)) != index):
                continue
            stacked = m.group(1) is None
            if stacked and self.shape(key)[0] != self.num_layers:
                raise ValueError(f"{key} stores {self.shape(key)[0]} layers, the architecture "
                                 f"has {self.num_layers}")
            requests.append((key, (index,) if stacked else ()))
            names.append(m.group(2))
        if not requests:
            raise ValueError(f"checkpoint {self.directory!r} holds no tensors of layer {index}")
        out: dict[str, torch.Tensor] = {}
        for name, tensor in zip(names, self._read_regions(requests)):
            out.update(self._split_experts(name, tensor))
        return _merge_parts(f"decoder.layers.{index}.", out)

    def _split_experts(self, name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        """``name`` (after the layer prefix) -> its local-spec name(s): a stacked experts
        tensor ``[E, ...]`` becomes one tensor per expert (views)."""
        m = _EXPERT_KEY.match(name)
        if m is None:
            return {name: tensor}
        head, expert, tail = m.groups()
        if expert is not None:
            return {f"{head}local_experts.{expert}.{tail}": tensor}
        if self.num_experts is not None and tensor.shape[0] != self.num_experts:
            raise ValueError(f"{name} stores {tensor.shape[0]} experts, the architecture has "
                             f"{self.num_experts}")
        return {f"{head}local_experts.{e}.{tail}": tensor[e] for e in range(tensor.shape[0])}


def _part_order(base: str) -> tuple[str, ...] | None:
    """The stored parts of the tensor ``base``, in its row order (None: not split)."""
    for suffix, parts in _DELTANET_PARTS.items():
        if base.endswith(suffix):
            return parts
    return None


def _merge_parts(prefix: str, named: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Stored pieces -> local-spec tensors: a DeltaNet's named parts and the ``_w`` / ``_v``
    halves of ``linear_fc1`` concatenated along rows, the fused norm names renamed."""
    pieces: dict[str, dict[str, torch.Tensor]] = {}
    out: dict[str, torch.Tensor] = {}
    for name, t in named.items():
        name = _NORM_NAMES.get(name, name)
        base, _, part = name.rpartition(".")
        if part in (_part_order(base) or ()):
            pieces.setdefault(base, {})[part] = t
        elif ".linear_fc1." in name and name.endswith(("_w", "_v")):
            pieces.setdefault(name[:-2], {})[name[-1]] = t
        else:
            out[prefix + name] = t
    for base, parts in pieces.items():
        order = _part_order(base) or ("w", "v")
        if set(parts) != set(order):
            raise ValueError(f"{prefix}{base}: stored parts {sorted(parts)}, expected "
                             f"{list(order)}")
        out[prefix + base] = torch.cat([parts[p] for p in order], dim=0)
    return out
