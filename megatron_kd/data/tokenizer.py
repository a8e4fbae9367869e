"""A Hugging Face ``tokenizers`` tokenizer shaped for Megatron-Core's datasets."""

from __future__ import annotations

import hashlib
import json
import os
from collections import OrderedDict

#: End-of-document tokens tried in order when none is named.
EOD_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|im_end|>", "<|eot_id|>")

#: Megatron's "no pad token": -1 never occurs in data, so nothing real is masked as padding.
NO_PAD = -1


def resolve_tokenizer_file(path: str | os.PathLike) -> str:
    """``path`` itself when it is a file, else ``path/tokenizer.json``; ValueError if absent."""
    path = os.fspath(path)
    if os.path.isdir(path):
        path = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(path):
        raise ValueError(f"tokenizer file not found: {path!r} (give a tokenizer.json or a "
                         f"directory holding one)")
    return path


class HFTokenizer:
    """``tokenizers.Tokenizer`` from a ``tokenizer.json`` with Megatron's tokenizer attributes.

    ``vocab_size`` counts added tokens; ``eod`` is the end-of-document id (``eod_token``, or the
    ``eos_token`` of a ``tokenizer_config.json`` next to the file, or the first of
    :data:`EOD_CANDIDATES` the vocabulary has); ``pad`` is -1 (no pad token: GPTDataset then masks
    only its own padding).
    """

    def __init__(self, path: str | os.PathLike, eod_token: str | None = None) -> None:
        from tokenizers import Tokenizer  # optional (the test and demo extras)

        self.path = resolve_tokenizer_file(path)
        self._tok = Tokenizer.from_file(self.path)
        with open(self.path, "rb") as f:
            self.sha256 = hashlib.sha256(f.read()).hexdigest()
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.eod_token = eod_token or self._config_eos() or self._first_known(EOD_CANDIDATES)
        if self.eod_token is None:
            raise ValueError(f"{self.path}: no end-of-document token found among "
                             f"{EOD_CANDIDATES}; name one with --eod-token")
        eod = self._tok.token_to_id(self.eod_token)
        if eod is None:
            raise ValueError(f"{self.path}: end-of-document token {self.eod_token!r} is not in "
                             f"the vocabulary")
        self.eod = eod
        self.pad = NO_PAD
        self.unique_identifiers = OrderedDict(
            [("class", type(self).__name__), ("sha256", self.sha256), ("eod", self.eod)])

    def _config_eos(self) -> str | None:
        cfg = os.path.join(os.path.dirname(self.path), "tokenizer_config.json")
        if not os.path.isfile(cfg):
            return None
        with open(cfg, encoding="utf-8") as f:
            eos = json.load(f).get("eos_token")
        if isinstance(eos, dict):
            eos = eos.get("content")
        return eos if isinstance(eos, str) and self._tok.token_to_id(eos) is not None else None

    def _first_known(self, names) -> str | None:
        for name in names:
            if self._tok.token_to_id(name) is not None:
                return name
        return None

    @property
    def eos(self) -> int:
        return self.eod

    def tokenize(self, text: str) -> list[int]:
        """Token ids of ``text`` without special tokens."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def detokenize(self, ids) -> str:
        return self._tok.decode(list(ids))

    def vocab(self) -> dict[str, int]:
        """token -> id, added tokens included."""
        return self._tok.get_vocab(with_added_tokens=True)


def _backend(tok):
    """The ``tokenizers.Tokenizer`` behind an :class:`HFTokenizer`, a ``transformers`` fast
    tokenizer or a ``tokenizers.Tokenizer`` itself."""
    if isinstance(tok, HFTokenizer):
        return tok._tok
    return getattr(tok, "backend_tokenizer", tok)


def _bpe_merges(tok) -> list | None:
    return json.loads(tok.to_str()).get("model", {}).get("merges")


def tokenizer_difference(a, b, names: tuple[str, str] = ("teacher", "student")) -> str | None:
    """None when ``a`` and ``b`` encode text the same way, else what differs, naming them.

    Compared: the token -> id map (added tokens included) and, for BPE models, the merges (one
    vocabulary with other merges splits text differently). Takes :class:`HFTokenizer`,
    ``tokenizers.Tokenizer`` or ``transformers`` fast tokenizer objects.
    """
    if isinstance(a, HFTokenizer) and isinstance(b, HFTokenizer) and a.sha256 == b.sha256:
        return None
    ta, tb = _backend(a), _backend(b)
    va, vb = ta.get_vocab(with_added_tokens=True), tb.get_vocab(with_added_tokens=True)
    if va != vb:
        only_a = sorted(set(va) - set(vb))[:5]
        only_b = sorted(set(vb) - set(va))[:5]
        moved = sorted(k for k in set(va) & set(vb) if va[k] != vb[k])[:5]
        return (f"{names[0]} has {len(va)} tokens, {names[1]} {len(vb)}; only in {names[0]} "
                f"{only_a}, only in {names[1]} {only_b}, different ids "
                f"{[(k, va[k], vb[k]) for k in moved]}")
    if _bpe_merges(ta) != _bpe_merges(tb):
        return "same vocabulary but different BPE merges: they split text differently"
    return None


class MockTokenizer:
    """Tokenizer attributes for ``--mock-data`` runs (no text, a vocabulary size only)."""

    def __init__(self, vocab_size: int) -> None:
        if vocab_size < 2:
            raise ValueError(f"mock tokenizer needs vocab_size >= 2, got {vocab_size}")
        self.vocab_size = vocab_size
        self.eod = vocab_size - 1
        self.pad = NO_PAD
        self.path = None  # no tokenizer file: checkpoints of a mock run carry none
        self.unique_identifiers = OrderedDict([("class", "MockTokenizer"),
                                               ("vocab_size", vocab_size)])

    @property
    def eos(self) -> int:
        return self.eod
