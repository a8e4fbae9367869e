"""``megatron-kd preprocess``: text files -> a Megatron indexed dataset (``.bin`` / ``.idx``).

Each input file is read as UTF-8 and cut into documents (a whole file, blank-line separated
paragraphs, or lines), each document tokenized with a Hugging Face ``tokenizers`` tokenizer
(``tokenizer.json``) and written with Megatron-Core's ``IndexedDatasetBuilder``, an end-of-document
token appended. A sidecar ``<prefix>.json`` records the tokenizer (sha256, vocabulary size, eod)
so training can refuse a dataset made with another tokenizer.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import sys

import numpy as np
from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

from megatron_kd.data.tokenizer import HFTokenizer

SIDECAR_FORMAT_VERSION = 1
DOCUMENT_SPLITS = ("file", "paragraph", "line")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--input", nargs="+", required=True,
                        help="text files, directories (every *.txt inside) or glob patterns")
    parser.add_argument("--tokenizer-model", required=True,
                        help="a Hugging Face tokenizer.json, or a directory holding one")
    parser.add_argument("--output-prefix", required=True,
                        help="write <prefix>.bin, <prefix>.idx and <prefix>.json")
    parser.add_argument("--document-split", choices=DOCUMENT_SPLITS, default="paragraph",
                        help="what one document is (default: blank-line separated paragraphs)")
    parser.add_argument("--eod-token", default=None,
                        help="end-of-document token (default: the tokenizer's eos)")
    parser.add_argument("--no-append-eod", action="store_true",
                        help="do not append the end-of-document token to each document")
    parser.add_argument("--min-document-tokens", type=int, default=1,
                        help="drop documents with fewer tokens than this")


def _input_files(patterns: list[str]) -> list[str]:
    files: list[str] = []
    for pattern in patterns:
        if os.path.isdir(pattern):
            found = sorted(glob.glob(os.path.join(pattern, "**", "*.txt"), recursive=True))
        elif os.path.isfile(pattern):
            found = [pattern]
        else:
            found = sorted(glob.glob(pattern, recursive=True))
        if not found:
            raise ValueError(f"--input {pattern!r} matches no file")
        files.extend(found)
    return files


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


def token_dtype(vocab_size: int):
    """Smallest numpy dtype holding every token id (Megatron reads it back from the .idx)."""
    return np.uint16 if vocab_size <= np.iinfo(np.uint16).max + 1 else np.int32


def preprocess(inputs: list[str], tokenizer, output_prefix: str, *, document_split="paragraph",
               append_eod: bool = True, min_document_tokens: int = 1) -> dict:
    """Tokenize ``inputs`` into ``output_prefix.{bin,idx,json}``; returns the sidecar dict."""

    files = _input_files(inputs)
    out_dir = os.path.dirname(os.path.abspath(output_prefix))
    os.makedirs(out_dir, exist_ok=True)
    builder = IndexedDatasetBuilder(output_prefix + ".bin", dtype=token_dtype(tokenizer.vocab_size))
    n_docs = n_tokens = n_dropped = 0
    for path in files:
        with open(path, encoding="utf-8", errors="replace") as f:
            docs = split_documents(f.read(), document_split)
        for ids in tokenizer.tokenize_batch(docs) if docs else []:
            if append_eod:
                ids = ids + [tokenizer.eod]
            if len(ids) < min_document_tokens:
                n_dropped += 1
                continue
            builder.add_document(ids, [len(ids)])
            n_docs += 1
            n_tokens += len(ids)
    if n_docs == 0:
        raise ValueError(f"no document with >= {min_document_tokens} tokens in {files}")
    builder.finalize(output_prefix + ".idx")
    sidecar = {
        "format_version": SIDECAR_FORMAT_VERSION,
        "tokenizer_sha256": getattr(tokenizer, "sha256", None),
        "tokenizer_vocab_size": tokenizer.vocab_size,
        "eod": tokenizer.eod,
        "num_documents": n_docs,
        "num_tokens": n_tokens,
        "dropped_documents": n_dropped,
        "inputs": [os.path.abspath(p) for p in files],
    }
    with open(output_prefix + ".json", "w", encoding="utf-8") as f:
        json.dump(sidecar, f, indent=2)
    return sidecar


def run(args: argparse.Namespace) -> int:

    tokenizer = HFTokenizer(args.tokenizer_model, eod_token=args.eod_token)
    info = preprocess(args.input, tokenizer, args.output_prefix,
                      document_split=args.document_split, append_eod=not args.no_append_eod,
                      min_document_tokens=args.min_document_tokens)
    print(f"wrote {args.output_prefix}.bin/.idx: {info['num_documents']} documents, "
          f"{info['num_tokens']} tokens (vocabulary {info['tokenizer_vocab_size']})",
          file=sys.stderr)
    return 0
