"""Training and validation data: Megatron-Core ``GPTDataset`` splits, or synthetic tokens.

The batch order is a pure function of the number of samples consumed so far, so a run resumed
from a checkpoint (which stores that number) sees exactly the batches the uninterrupted run saw.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.blended_megatron_dataset_config import (
    convert_split_vector_to_split_matrix,
    parse_and_normalize_split,
)
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
from megatron.core.datasets.indexed_dataset import IndexedDataset

from megatron_kd.parallel.layout import microbatches_per_step

SPLIT_NAMES = ("training", "validation", "test")


def parse_data_path(data_path: list[str]) -> tuple[list[str], list[float] | None]:
    """Megatron's ``--data-path``: ``PREFIX ...`` or ``W1 PREFIX1 W2 PREFIX2 ...``."""
    if not data_path:
        raise ValueError("--data-path is empty")
    if len(data_path) == 1:
        return [data_path[0]], None
    try:
        weights = [float(w) for w in data_path[0::2]]
    except ValueError:
        return list(data_path), None
    if len(data_path) % 2:
        raise ValueError(f"--data-path with weights needs WEIGHT PREFIX pairs, got {data_path}")
    return list(data_path[1::2]), weights


def check_data_prefixes(prefixes: list[str], tokenizer=None) -> None:
    """ValueError when a prefix lacks its ``.bin``/``.idx`` or was made with another tokenizer."""
    for prefix in prefixes:
        missing = [ext for ext in (".bin", ".idx") if not os.path.isfile(prefix + ext)]
        if missing:
            files = " and ".join(prefix + e for e in missing)
            raise ValueError(f"--data-path {prefix!r}: missing {files} "
                             f"(make them with `megatron-kd preprocess`)")
        sidecar = prefix + ".json"
        if tokenizer is not None and os.path.isfile(sidecar):
            with open(sidecar, encoding="utf-8") as f:
                info = json.load(f)
            sha = getattr(tokenizer, "sha256", None)
            if sha and info.get("tokenizer_sha256") and info["tokenizer_sha256"] != sha:
                raise ValueError(f"--data-path {prefix!r} was tokenized with another tokenizer "
                                 f"(sha256 {info['tokenizer_sha256'][:12]}... vs "
                                 f"{sha[:12]}... of --tokenizer-model)")


def check_split_sizes(prefixes: list[str], split: str) -> None:
    """ValueError when ``--split`` gives a split of nonzero weight no document of a prefix.
    Megatron-Core cuts each prefix's documents at ``round(edge * documents)``, as here, and its
    ``GPTDataset`` then loops forever on the empty split (it adds epochs of zero tokens until
    they hold one token: megatron-core 0.16.1 and 0.19.2 ``_get_num_epochs``), the test split
    included, which no run reads."""
    matrix = convert_split_vector_to_split_matrix(parse_and_normalize_split(split))
    for prefix in prefixes:
        documents = len(IndexedDataset(prefix))
        for name, edges in zip(SPLIT_NAMES, matrix):
            if edges is not None and (int(round(edges[1] * documents))
                                      == int(round(edges[0] * documents))):
                raise ValueError(
                    f"--split {split!r} gives the {name} split none of the {documents} "
                    f"documents of {prefix!r} (Megatron-Core's dataset would never finish "
                    f"building it): give that split weight 0 or more documents")


def build_gpt_datasets(*, data_path: list[str], split: str, seq_length: int, seed: int,
                       tokenizer, train_samples: int, valid_samples: int,
                       cache_path: str | None = None, eod_mask_loss: bool = False,
                       reset_position_ids: bool = False):
    """``(train, valid)`` ``GPTDataset``s through ``BlendedMegatronDatasetBuilder`` (collective).
    ``eod_mask_loss``, ``reset_position_ids``: Megatron-LM's flags, as its ``GPTDataset`` makes
    them (a zero loss mask on end-of-document tokens; positions restarting after each)."""
    prefixes, weights = parse_data_path(data_path)
    check_data_prefixes(prefixes, tokenizer)
    check_split_sizes(prefixes, split)
    config = GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq_length,
        blend=(prefixes, weights),
        split=split,
        path_to_cache=cache_path,
        tokenizer=tokenizer,
        reset_position_ids=reset_position_ids,
        reset_attention_mask=False,
        eod_mask_loss=eod_mask_loss,
        create_attention_mask=False,
    )
    train, valid, _ = BlendedMegatronDatasetBuilder(
        GPTDataset, [train_samples, valid_samples, 0], lambda: True, config).build()
    if train is None:
        raise ValueError(f"--split {split!r} leaves no training data")
    return train, valid


class MockGPTDataset(torch.utils.data.Dataset):
    """Synthetic, learnable token sequences (``--mock-data``): no files, no tokenizer.

    Sample ``i`` is an arithmetic progression ``(a + k * d) % vocab_size`` with ``a`` and
    ``d in {1, 2, 3}`` drawn from ``(seed, i)``: a model can learn it, so losses fall.
    """

    def __init__(self, *, vocab_size: int, seq_length: int, num_samples: int, seed: int) -> None:
        self.vocab_size, self.seq_length = vocab_size, seq_length
        self.num_samples, self.seed = num_samples, seed

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, idx: int) -> dict:
        rng = np.random.default_rng([self.seed, int(idx)])
        a = int(rng.integers(self.vocab_size))
        d = int(rng.integers(1, 4))
        text = (a + d * np.arange(self.seq_length + 1)) % self.vocab_size
        text = torch.from_numpy(text).long()
        return {"tokens": text[:-1], "labels": text[1:],
                "loss_mask": torch.ones(self.seq_length, dtype=torch.float32),
                "position_ids": torch.arange(self.seq_length)}


def collate(samples: list[dict]) -> dict:
    keys = ("tokens", "labels", "loss_mask", "position_ids")
    return {k: torch.stack([torch.as_tensor(s[k]) for s in samples]) for k in keys}


@dataclass
class BatchPlan:
    """Which samples a data-parallel rank reads: ``global_batch_size`` per step, in order."""

    global_batch_size: int
    micro_batch_size: int
    dp_rank: int
    dp_size: int

    def __post_init__(self) -> None:
        microbatches_per_step(self.global_batch_size, self.micro_batch_size, self.dp_size)

    @property
    def num_microbatches(self) -> int:
        return microbatches_per_step(self.global_batch_size, self.micro_batch_size,
                                     self.dp_size)

    def sample_ids(self, consumed_samples: int, microbatch: int, num_samples: int) -> list[int]:
        """Dataset indices of one of this rank's microbatches (a dataset of ``num_samples``)."""
        local = self.global_batch_size // self.dp_size
        first = consumed_samples + self.dp_rank * local + microbatch * self.micro_batch_size
        return [(first + j) % num_samples for j in range(self.micro_batch_size)]

    def microbatches(self, dataset, consumed_samples: int) -> Iterator[dict]:
        """This rank's microbatches of the global batch starting at ``consumed_samples``."""
        n = len(dataset)
        for m in range(self.num_microbatches):
            yield collate([dataset[i] for i in self.sample_ids(consumed_samples, m, n)])
