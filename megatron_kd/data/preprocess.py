"""``megatron-kd preprocess``: text or JSONL files -> Megatron indexed datasets (``.bin``/``.idx``).

Text files (``*.txt``) are read as UTF-8 and cut into documents (a whole file, blank-line
separated paragraphs, or lines). JSONL files (``*.jsonl``, ``*.json``, either gzipped) hold one
document per line: the string under a key of each line's JSON object (``--json-keys``, spelled and
defaulting to ``text`` as in Megatron-LM's ``tools/preprocess_data.py``). Each document is
tokenized with a Hugging Face ``tokenizers`` tokenizer (``tokenizer.json``) and written with
Megatron-Core's ``IndexedDatasetBuilder``, an end-of-document token appended.

One key writes ``<prefix>.bin/.idx/.json``, the dataset ``--data-path <prefix>`` reads; several
keys write one dataset per key, ``<prefix>_<key>.bin/.idx/.json`` (Megatron-LM names them
``<prefix>_<key>_document``). A sidecar ``.json`` records the tokenizer (sha256, vocabulary size,
eod) so training can refuse a dataset made with another tokenizer.

Tokenization runs in ``--workers`` processes on batches of documents, at most
:data:`BATCHES_IN_FLIGHT_PER_WORKER` batches per worker in flight (memory stays bounded however
long the input); batches are written in input order, so the files are byte-identical for any
number of workers. Files appear under their names only when complete: a run that fails leaves
an earlier dataset at the same prefix as it was.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import multiprocessing
import os
import re
import sys
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from megatron_kd.data.tokenizer import HFTokenizer

SIDECAR_FORMAT_VERSION = 1
DOCUMENT_SPLITS = ("file", "paragraph", "line")
INPUT_FORMATS = ("auto", "text", "jsonl")
#: The key read from each JSONL line when none is named (Megatron-LM's default too).
DEFAULT_JSON_KEY = "text"
#: What a directory given as --input contributes, by format (never *.json: our sidecars).
DIRECTORY_PATTERNS = {"text": ("*.txt",), "jsonl": ("*.jsonl", "*.jsonl.gz")}
#: File names read as JSONL by ``--input-format auto`` (a trailing ``.gz`` is read gzipped).
JSONL_SUFFIXES = (".jsonl", ".json")
#: A batch (one task of a worker) holds at most this many documents ...
BATCH_DOCUMENTS = 256
#: ... and at most this many characters, whichever comes first.
BATCH_CHARACTERS = 1 << 22
#: Batches handed out per worker and not yet written: a hard bound on documents in memory.
BATCHES_IN_FLIGHT_PER_WORKER = 2


@dataclass(kw_only=True, frozen=True)
class PreprocessConfig:
    """How ``megatron-kd preprocess`` reads, cuts and tokenizes its inputs."""

    document_split: str = "paragraph"
    """What one document of a text file is: ``file``, ``paragraph`` (blank-line separated) or
    ``line``. A JSONL line is always one document."""

    input_format: str = "auto"
    """``auto`` (by file name: ``.jsonl``/``.json``, gzipped or not, are JSONL, the rest text),
    ``text`` or ``jsonl`` for every input file."""

    json_keys: tuple[str, ...] | None = None
    """Keys of each JSONL object to tokenize, one dataset per key; None: ``("text",)``, named by
    nobody (so text-only inputs are no mistake)."""

    append_eod: bool = True
    """Append the end-of-document token to each non-empty document."""

    min_document_tokens: int = 1
    """Drop documents with fewer tokens than this (the end-of-document token counted)."""

    workers: int = 1
    """Tokenizer processes; 1 tokenizes in this process."""

    def __post_init__(self) -> None:
        if self.document_split not in DOCUMENT_SPLITS:
            raise ValueError(f"document split must be one of {DOCUMENT_SPLITS}, got "
                             f"{self.document_split!r}")
        if self.input_format not in INPUT_FORMATS:
            raise ValueError(f"--input-format must be one of {INPUT_FORMATS}, got "
                             f"{self.input_format!r}")
        if self.workers < 1:
            raise ValueError(f"--workers must be >= 1, got {self.workers}")
        if self.min_document_tokens < 0:
            raise ValueError(f"--min-document-tokens must be >= 0, got "
                             f"{self.min_document_tokens}")
        if self.json_keys is not None:
            self._check_keys(tuple(self.json_keys))

    @staticmethod
    def _check_keys(keys: tuple[str, ...]) -> None:
        if not keys:
            raise ValueError("--json-keys needs at least one key")
        repeated = sorted({k for k in keys if keys.count(k) > 1})
        if repeated:
            raise ValueError(f"--json-keys names {repeated} more than once: {list(keys)}")
        if len(keys) > 1:  # each key becomes part of a file name
            bad = [k for k in keys if not k or k in (".", "..") or "/" in k
                   or (os.altsep and os.altsep in k)]
            if bad:
                raise ValueError(f"--json-keys {bad} cannot name the file <prefix>_<key>: a key "
                                 f"of several must be non-empty, without '/'")

    @property
    def keys(self) -> tuple[str, ...]:
        return tuple(self.json_keys) if self.json_keys is not None else (DEFAULT_JSON_KEY,)

    def output_prefixes(self, output_prefix: str) -> dict[str, str]:
        """key -> the prefix of its dataset: ``output_prefix`` itself for one key, else
        ``<output_prefix>_<key>`` for each."""
        if len(self.keys) == 1:
            return {self.keys[0]: output_prefix}
        return {key: f"{output_prefix}_{key}" for key in self.keys}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--input", nargs="+", required=True,
                        help="text or JSONL files, directories (every *.txt, *.jsonl and "
                             "*.jsonl.gz inside) or glob patterns")
    parser.add_argument("--tokenizer-model", required=True,
                        help="a Hugging Face tokenizer.json, or a directory holding one")
    parser.add_argument("--output-prefix", required=True,
                        help="write <prefix>.bin, <prefix>.idx and <prefix>.json (several "
                             "--json-keys: <prefix>_<key>.bin/.idx/.json for each key)")
    parser.add_argument("--input-format", choices=INPUT_FORMATS, default="auto",
                        help="auto (default): *.jsonl, *.json (gzipped or not) are JSONL, other "
                             "files text; text or jsonl: every file")
    parser.add_argument("--json-keys", nargs="+", default=None, metavar="KEY",
                        help="keys of each JSONL line's object to tokenize, each a string "
                             "(default: text). One key writes <prefix>.bin/.idx/.json; several "
                             "write one dataset per key, <prefix>_<key>.bin/.idx/.json")
    parser.add_argument("--document-split", choices=DOCUMENT_SPLITS, default="paragraph",
                        help="what one document of a text file is (default: blank-line "
                             "separated paragraphs); a JSONL line is always one document")
    parser.add_argument("--workers", type=int, default=1,
                        help="tokenizer processes (default 1); the output is the same for any "
                             "number")
    parser.add_argument("--eod-token", default=None,
                        help="end-of-document token (default: the tokenizer's eos)")
    parser.add_argument("--no-append-eod", action="store_true",
                        help="do not append the end-of-document token to each document")
    parser.add_argument("--min-document-tokens", type=int, default=1,
                        help="drop documents with fewer tokens than this")


# ----------------------------------------------------------------------------------------------
# Reading
# ----------------------------------------------------------------------------------------------


def file_format(path: str, input_format: str = "auto") -> str:
    """``text`` or ``jsonl``: ``input_format`` itself, or for ``auto`` by the file name."""
    if input_format != "auto":
        return input_format
    name = path[:-3] if path.endswith(".gz") else path
    return "jsonl" if name.endswith(JSONL_SUFFIXES) else "text"


def input_files(patterns: Sequence[str], input_format: str = "auto") -> list[tuple[str, str]]:
    """``(path, format)`` of every file ``patterns`` name, in order; a directory gives its
    files of the format(s) ``input_format`` reads, sorted."""
    formats = ("text", "jsonl") if input_format == "auto" else (input_format,)
    files: list[str] = []
    for pattern in patterns:
        if os.path.isdir(pattern):
            names = [n for f in formats for n in DIRECTORY_PATTERNS[f]]
            found = sorted({path for name in names
                            for path in glob.glob(os.path.join(pattern, "**", name),
                                                  recursive=True)})
        elif os.path.isfile(pattern):
            found = [pattern]
        else:
            found = sorted(glob.glob(pattern, recursive=True))
        if not found:
            raise ValueError(f"--input {pattern!r} matches no file"
                             + (f" (a directory gives its {', '.join(names)})"
                                if os.path.isdir(pattern) else ""))
        files.extend(found)
    return [(path, file_format(path, input_format)) for path in files]


def _open_text(path: str):
    if path.endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8", errors="replace")
    return open(path, encoding="utf-8", errors="replace")


def split_documents(text: str, how: str) -> list[str]:
    """Cut ``text`` into non-empty documents: ``file``, ``paragraph`` or ``line``."""
    if how == "file":
        docs = [text]
    elif how == "paragraph":
        docs = re.split(r"\n\s*\n", text)
    elif how == "line":
        docs = text.splitlines()
    else:
        raise ValueError(f"document split must be one of {DOCUMENT_SPLITS}, got {how!r}")
    return [d.strip() for d in docs if d.strip()]


def _json_type(value) -> str:
    """JSON's name for the type of a decoded value."""
    names = {bool: "boolean", int: "number", float: "number", str: "string", list: "array",
             dict: "object", type(None): "null"}
    return names.get(type(value), type(value).__name__)


def read_jsonl(path: str, keys: Sequence[str]) -> Iterator[tuple[str, ...]]:
    """The strings under ``keys`` of each line's JSON object, one tuple per line (blank lines
    hold no document and are passed over). Anything else raises ValueError naming the file, the
    line and the key."""
    with _open_text(path) as f:
        for line_number, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{line_number}"
            try:
                obj = json.loads(line.rstrip("\n"))  # a column on this line, not the next
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not valid JSON ({e.msg}, column {e.colno}); a JSONL "
                                 f"file holds one JSON object per line") from None
            if not isinstance(obj, dict):
                raise ValueError(f"{where}: a JSON {_json_type(obj)}, not an object with the "
                                 f"key(s) {list(keys)}")
            texts = []
            for key in keys:
                if key not in obj:
                    raise ValueError(f"{where}: no key {key!r} (the object's keys: "
                                     f"{sorted(obj)[:10]}); name the text's key with --json-keys")
                if not isinstance(obj[key], str):
                    raise ValueError(f"{where}: key {key!r} holds a JSON "
                                     f"{_json_type(obj[key])}, not a string")
                texts.append(obj[key])
            yield tuple(texts)


def read_documents(files: Sequence[tuple[str, str]], config: PreprocessConfig
                   ) -> Iterator[tuple[str, ...]]:
    """Every document of ``files`` in order, as one text per key of ``config``."""
    for path, fmt in files:
        if fmt == "jsonl":
            yield from read_jsonl(path, config.keys)
        else:
            with _open_text(path) as f:
                docs = split_documents(f.read(), config.document_split)
            yield from ((doc,) for doc in docs)


def batches(records: Iterable[tuple[str, ...]], max_documents: int | None = None,
            max_characters: int | None = None) -> Iterator[list[tuple[str, ...]]]:
    """``records`` in order, in lists of at most ``max_documents`` records and (unless one
    record alone is longer) ``max_characters`` characters (None: :data:`BATCH_DOCUMENTS`,
    :data:`BATCH_CHARACTERS`)."""
    max_documents = BATCH_DOCUMENTS if max_documents is None else max_documents
    max_characters = BATCH_CHARACTERS if max_characters is None else max_characters
    batch: list[tuple[str, ...]] = []
    size = 0
    for record in records:
        length = sum(len(text) for text in record)
        if batch and (len(batch) == max_documents or size + length > max_characters):
            yield batch
            batch, size = [], 0
        batch.append(record)
        size += length
    if batch:
        yield batch


# ----------------------------------------------------------------------------------------------
# Tokenizing
# ----------------------------------------------------------------------------------------------


def token_dtype(vocab_size: int):
    """Smallest numpy dtype holding every token id (Megatron reads it back from the .idx)."""
    return np.uint16 if vocab_size <= np.iinfo(np.uint16).max + 1 else np.int32


def encode_batch(tokenizer, append_eod: bool, batch: Sequence[tuple[str, ...]]
                 ) -> list[tuple[np.ndarray, ...]]:
    """Token ids of each text of ``batch`` (same shape), the end-of-document token appended to
    each non-empty one, in :func:`token_dtype`."""
    dtype = token_dtype(tokenizer.vocab_size)
    by_key = [tokenizer.tokenize_batch([record[k] for record in batch])
              for k in range(len(batch[0]))]
    eod = [tokenizer.eod] if append_eod else []
    return [tuple(np.asarray(ids[i] + eod if ids[i] else ids[i], dtype=dtype) for ids in by_key)
            for i in range(len(batch))]


#: The tokenizer of a worker process, set by :func:`_init_worker` in pool workers only.
_worker_state: tuple | None = None


def _init_worker(tokenizer, append_eod: bool) -> None:
    global _worker_state
    # the workers are the parallelism: a Rust thread pool per worker would oversubscribe cores
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _worker_state = (tokenizer, append_eod)


def _encode_in_worker(batch: list[tuple[str, ...]]) -> list[tuple[np.ndarray, ...]]:
    tokenizer, append_eod = _worker_state
    return encode_batch(tokenizer, append_eod, batch)


def encoded_batches(tokenizer, config: PreprocessConfig,
                    documents: Iterable[list[tuple[str, ...]]]
                    ) -> Iterator[list[tuple[np.ndarray, ...]]]:
    """:func:`encode_batch` of each batch of ``documents``, in order, in ``config.workers``
    processes; at most ``workers * BATCHES_IN_FLIGHT_PER_WORKER`` batches are handed out and
    not yet returned (``Pool.imap`` would read the whole input ahead)."""
    if config.workers == 1:
        for batch in documents:
            yield encode_batch(tokenizer, config.append_eod, batch)
        return
    # spawn: no fork of a process holding threads (torch, the Rust tokenizer's pool)
    context = multiprocessing.get_context("spawn")
    with context.Pool(config.workers, initializer=_init_worker,
                      initargs=(tokenizer, config.append_eod)) as pool:
        in_flight: collections.deque = collections.deque()
        for batch in documents:
            in_flight.append(pool.apply_async(_encode_in_worker, (batch,)))
            if len(in_flight) >= config.workers * BATCHES_IN_FLIGHT_PER_WORKER:
                yield in_flight.popleft().get()
        while in_flight:
            yield in_flight.popleft().get()


# ----------------------------------------------------------------------------------------------
# Writing
# ----------------------------------------------------------------------------------------------


class _DatasetWriter:
    """One ``<prefix>.bin/.idx/.json``, written under ``.partial`` names and moved into place by
    :meth:`commit`; :meth:`discard` removes what a failed run wrote."""

    SUFFIXES = (".bin", ".idx", ".json")

    def __init__(self, prefix: str, dtype) -> None:
        # heavy (torch): imported here so that the tokenizer workers never import it
        from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

        self.prefix = prefix
        self._partial = {s: f"{prefix}{s}.partial" for s in self.SUFFIXES}
        self._builder = IndexedDatasetBuilder(self._partial[".bin"], dtype=dtype)
        self.documents = self.tokens = self.dropped = 0

    def add(self, ids: np.ndarray, min_tokens: int) -> None:
        if len(ids) < min_tokens:
            self.dropped += 1
            return
        self._builder.add_document(ids, [len(ids)])
        self.documents += 1
        self.tokens += len(ids)

    def finalize(self, tokenizer_info: dict, inputs: list[str]) -> dict:
        """Write the index and the sidecar (still under their ``.partial`` names)."""
        self._builder.finalize(self._partial[".idx"])
        sidecar = {**tokenizer_info, "num_documents": self.documents, "num_tokens": self.tokens,
                   "dropped_documents": self.dropped, "inputs": inputs}
        with open(self._partial[".json"], "w", encoding="utf-8") as f:
            json.dump(sidecar, f, indent=2)
        return sidecar

    def commit(self) -> None:
        for suffix, partial in self._partial.items():
            os.replace(partial, self.prefix + suffix)

    def discard(self) -> None:
        self._builder.data_file.close()
        for partial in self._partial.values():
            if os.path.exists(partial):
                os.remove(partial)


def _check_inputs(files: Sequence[tuple[str, str]], config: PreprocessConfig) -> None:
    text_files = [path for path, fmt in files if fmt == "text"]
    if len(config.keys) > 1 and text_files:
        raise ValueError(f"--json-keys names {len(config.keys)} keys {list(config.keys)} but "
                         f"{text_files[:3]} are text files, which have no keys: give JSONL "
                         f"files only, or one key")
    if config.json_keys is not None and len(text_files) == len(files):
        raise ValueError(f"--json-keys {list(config.keys)} given but no input is JSONL "
                         f"({text_files[:3]} are read as text; --input-format jsonl reads them "
                         f"as JSONL)")


def preprocess_datasets(inputs: Sequence[str], tokenizer, output_prefix: str,
                        config: PreprocessConfig) -> dict[str, dict]:
    """Tokenize ``inputs`` into one dataset per key (:meth:`PreprocessConfig.output_prefixes`);
    returns each dataset's prefix -> its sidecar dict."""
    files = input_files(inputs, config.input_format)
    _check_inputs(files, config)
    prefixes = list(config.output_prefixes(output_prefix).values())
    os.makedirs(os.path.dirname(os.path.abspath(output_prefix)), exist_ok=True)
    writers: list[_DatasetWriter] = []
    try:
        for prefix in prefixes:
            writers.append(_DatasetWriter(prefix, token_dtype(tokenizer.vocab_size)))
        for encoded in encoded_batches(tokenizer, config,
                                       batches(read_documents(files, config))):
            for record in encoded:
                for writer, ids in zip(writers, record):
                    writer.add(ids, config.min_document_tokens)
        for key, writer in zip(config.keys, writers):
            if writer.documents == 0:
                raise ValueError(f"no document with >= {config.min_document_tokens} tokens"
                                 + (f" under key {key!r}" if len(writers) > 1 else "")
                                 + f" in {[path for path, _ in files]}")
        tokenizer_info = {
            "format_version": SIDECAR_FORMAT_VERSION,
            "tokenizer_sha256": getattr(tokenizer, "sha256", None),
            "tokenizer_vocab_size": tokenizer.vocab_size,
            "eod": tokenizer.eod,
        }
        inputs_read = [os.path.abspath(path) for path, _ in files]
        infos = {w.prefix: w.finalize(tokenizer_info, inputs_read) for w in writers}
    except BaseException:
        for writer in writers:
            writer.discard()
        raise
    for writer in writers:
        writer.commit()
    return infos


def preprocess(inputs: Sequence[str], tokenizer, output_prefix: str, *,
               document_split: str = "paragraph", input_format: str = "auto",
               json_key: str | None = None, append_eod: bool = True,
               min_document_tokens: int = 1, workers: int = 1) -> dict:
    """Tokenize ``inputs`` into ``output_prefix.{bin,idx,json}`` (JSONL lines: the string under
    ``json_key``, ``text`` when None); returns the sidecar dict."""
    config = PreprocessConfig(document_split=document_split, input_format=input_format,
                              json_keys=None if json_key is None else (json_key,),
                              append_eod=append_eod, min_document_tokens=min_document_tokens,
                              workers=workers)
    return preprocess_datasets(inputs, tokenizer, output_prefix, config)[output_prefix]


def run(args: argparse.Namespace) -> int:
    config = PreprocessConfig(
        document_split=args.document_split, input_format=args.input_format,
        json_keys=None if args.json_keys is None else tuple(args.json_keys),
        append_eod=not args.no_append_eod, min_document_tokens=args.min_document_tokens,
        workers=args.workers)
    tokenizer = HFTokenizer(args.tokenizer_model, eod_token=args.eod_token)
    for prefix, info in preprocess_datasets(args.input, tokenizer, args.output_prefix,
                                            config).items():
        print(f"wrote {prefix}.bin/.idx: {info['num_documents']} documents, "
              f"{info['num_tokens']} tokens (vocabulary {info['tokenizer_vocab_size']})",
              file=sys.stderr)
    return 0
