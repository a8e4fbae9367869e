"""``megatron-kd preprocess`` on JSONL input (``--json-keys``) and with ``--workers``: the same
documents give the same bytes whatever the input format or the number of tokenizer processes."""

import gzip
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("tokenizers")

from support.text import TEXT

from megatron_kd.data import preprocess as pp
from megatron_kd.data.tokenizer import HFTokenizer

#: One document a line; JSON has to escape some of them (quotes, backslash, non-ASCII, tab).
LINES = [line.strip() for line in (TEXT * 6).splitlines() if line.strip()] + [
    'He said "speak" \\ and\tleft.', "Caius Marcius — “chief enemy”, naïve café."]


def _files(prefix):
    out = {}
    for suffix in (".bin", ".idx"):
        with open(str(prefix) + suffix, "rb") as f:
            out[suffix] = f.read()
    with open(str(prefix) + ".json", encoding="utf-8") as f:
        out[".json"] = json.load(f)
    return out


def _without_inputs(sidecar):
    return {k: v for k, v in sidecar.items() if k != "inputs"}


def _write_jsonl(path, rows):
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "wt", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def tokenizer(tokenizer_file):
    return HFTokenizer(tokenizer_file)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """The same documents as a text file (a line each) and as JSONL, plain and gzipped (with an
    extra key, so that the key is really chosen)."""
    d = tmp_path_factory.mktemp("inputs")
    (d / "corpus.txt").write_text("\n".join(LINES) + "\n", encoding="utf-8")
    rows = [{"id": i, "title": f"doc {i}", "text": line} for i, line in enumerate(LINES)]
    return {"txt": str(d / "corpus.txt"), "jsonl": _write_jsonl(d / "corpus.jsonl", rows),
            "gz": _write_jsonl(d / "corpus.jsonl.gz", rows)}


@pytest.fixture(scope="module")
def text_dataset(tokenizer, inputs, tmp_path_factory):
    """The reference: the text file, a line a document, one process."""
    prefix = str(tmp_path_factory.mktemp("ref") / "corpus")
    pp.preprocess([inputs["txt"]], tokenizer, prefix, document_split="line")
    return _files(prefix)


def test_jsonl_gives_the_text_files_bytes(tokenizer, inputs, text_dataset, tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    for name in ("jsonl", "gz"):
        prefix = str(tmp_path / name)
        info = pp.preprocess([inputs[name]], tokenizer, prefix)
        got = _files(prefix)
        assert got[".bin"] == text_dataset[".bin"] and got[".idx"] == text_dataset[".idx"], name
        assert _without_inputs(got[".json"]) == _without_inputs(text_dataset[".json"]), name
        assert got[".json"]["inputs"] == [os.path.abspath(inputs[name])] and info == got[".json"]
    # and the bytes are the documents: each line's tokens, then the end-of-document token
    ds = IndexedDataset(str(tmp_path / "jsonl"))
    assert len(ds) == len(LINES) == text_dataset[".json"]["num_documents"]
    for i in (0, len(LINES) - 2, len(LINES) - 1):
        assert ds[i].tolist() == tokenizer.tokenize(LINES[i]) + [tokenizer.eod]
    assert tokenizer.detokenize(ds[len(LINES) - 1][:-1]) == LINES[-1]


def test_workers_give_the_same_files(tokenizer, inputs, text_dataset, tmp_path, monkeypatch):
    # small batches: many tasks, more than the in-flight window of 3 workers holds
    monkeypatch.setattr(pp, "BATCH_DOCUMENTS", 5)
    assert len(LINES) > 5 * 3 * pp.BATCHES_IN_FLIGHT_PER_WORKER
    for source in ("txt", "jsonl"):
        prefix = str(tmp_path / source)
        pp.preprocess([inputs[source]], tokenizer, prefix, document_split="line", workers=3)
        got = _files(prefix)
        assert got[".bin"] == text_dataset[".bin"] and got[".idx"] == text_dataset[".idx"]
        assert _without_inputs(got[".json"]) == _without_inputs(text_dataset[".json"])


def test_workers_hold_a_bounded_window(tokenizer):
    """The reader runs at most ``workers * BATCHES_IN_FLIGHT_PER_WORKER`` batches ahead of the
    writer (``Pool.imap`` would read the whole input into its queue)."""
    workers, n_batches = 2, 20
    pulled = []

    def documents():
        for i in range(n_batches):
            pulled.append(i)
            yield [(f"batch {i} line {j}",) for j in range(3)]

    config = pp.PreprocessConfig(workers=workers)
    window = workers * pp.BATCHES_IN_FLIGHT_PER_WORKER
    for done, encoded in enumerate(pp.encoded_batches(tokenizer, config, documents())):
        assert len(pulled) - done <= window, (len(pulled), done)
        assert encoded[1][0].tolist() == tokenizer.tokenize(f"batch {done} line 1") + [
            tokenizer.eod]
    assert done == n_batches - 1


def test_cli_as_documented(tokenizer_file, tokenizer, inputs, text_dataset, tmp_path):
    prefix = str(tmp_path / "data" / "corpus")
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_kd", "preprocess", "--input", inputs["jsonl"],
         "--json-keys", "text", "--tokenizer-model", tokenizer_file, "--output-prefix", prefix,
         "--workers", "2"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"wrote {prefix}.bin/.idx: {len(LINES)} documents" in proc.stderr
    got = _files(prefix)
    assert got[".bin"] == text_dataset[".bin"] and got[".idx"] == text_dataset[".idx"]
    assert got[".json"]["tokenizer_sha256"] == tokenizer.sha256
    assert sorted(os.listdir(tmp_path / "data")) == ["corpus.bin", "corpus.idx", "corpus.json"]


def test_several_keys_write_a_dataset_each(tokenizer, inputs, text_dataset, tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    prefix = str(tmp_path / "corpus")
    config = pp.PreprocessConfig(json_keys=("text", "title"))
    infos = pp.preprocess_datasets([inputs["jsonl"]], tokenizer, prefix, config)
    assert sorted(infos) == [prefix + "_text", prefix + "_title"]
    assert sorted(os.listdir(tmp_path)) == sorted(
        f"corpus_{key}{suffix}" for key in ("text", "title") for suffix in (".bin", ".idx",
                                                                            ".json"))
    got = _files(prefix + "_text")
    assert got[".bin"] == text_dataset[".bin"] and got[".idx"] == text_dataset[".idx"]
    titles = IndexedDataset(prefix + "_title")
    assert len(titles) == len(LINES) == infos[prefix + "_title"]["num_documents"]
    assert titles[7].tolist() == tokenizer.tokenize("doc 7") + [tokenizer.eod]
    with pytest.raises(ValueError, match=r"--json-keys names 2 keys \['text', 'title'\] but "
                                         r".*corpus\.txt'\] are text files"):
        pp.preprocess_datasets([inputs["jsonl"], inputs["txt"]], tokenizer,
                               str(tmp_path / "mixed"), config)


@pytest.mark.parametrize("line, problem", [
    ('{"text": "ok"', r"not valid JSON \(Expecting ',' delimiter, column 14\)"),
    ('{"content": "a document"}', r"no key 'text' \(the object's keys: \['content'\]\)"),
    ('{"text": 42}', r"key 'text' holds a JSON number, not a string"),
    ('{"text": ["a", "b"]}', r"key 'text' holds a JSON array, not a string"),
    ('{"text": null}', r"key 'text' holds a JSON null, not a string"),
    ('{"text": {"en": "a"}}', r"key 'text' holds a JSON object, not a string"),
    ('["text"]', r"a JSON array, not an object with the key\(s\) \['text'\]"),
])
def test_a_bad_line_is_named_and_changes_nothing(tokenizer, inputs, tmp_path, line, problem):
    prefix = str(tmp_path / "corpus")
    before = pp.preprocess([inputs["jsonl"]], tokenizer, prefix)
    bad = tmp_path / "bad.jsonl"
    # line 3 is bad, after a blank line 2 (no document: passed over)
    bad.write_text('{"text": "First."}\n\n' + line + '\n{"text": "Last."}\n', encoding="utf-8")
    for workers in (1, 2):
        with pytest.raises(ValueError, match=f"^{bad}:3: {problem}"):
            pp.preprocess([str(bad)], tokenizer, prefix, workers=workers)
    # the dataset at that prefix is the one before, whole; no partial file is left
    assert _files(prefix)[".json"] == before
    assert sorted(os.listdir(tmp_path)) == ["bad.jsonl", "corpus.bin", "corpus.idx",
                                            "corpus.json"]


def test_inputs_and_formats(tokenizer, tmp_path):
    d = tmp_path / "corpus"
    (d / "sub").mkdir(parents=True)
    (d / "a.txt").write_text("Speak, speak.\n\nResolved.\n", encoding="utf-8")
    _write_jsonl(d / "sub" / "b.jsonl", [{"text": "First Citizen"}, {"text": ""}])
    _write_jsonl(d / "c.jsonl.gz", [{"text": "All"}])
    (d / "old.json").write_text("{}", encoding="utf-8")  # a sidecar: never an input of a dir
    assert pp.input_files([str(d)]) == [(str(d / "a.txt"), "text"),
                                        (str(d / "c.jsonl.gz"), "jsonl"),
                                        (str(d / "sub" / "b.jsonl"), "jsonl")]
    assert pp.input_files([str(d)], "jsonl") == [(str(d / "c.jsonl.gz"), "jsonl"),
                                                 (str(d / "sub" / "b.jsonl"), "jsonl")]
    assert pp.input_files([str(d / "old.json"), str(d / "a.txt")], "auto") == [
        (str(d / "old.json"), "jsonl"), (str(d / "a.txt"), "text")]
    info = pp.preprocess([str(d)], tokenizer, str(tmp_path / "out" / "all"))
    # 2 paragraphs + "All" + "First Citizen"; the empty string is no document
    assert (info["num_documents"], info["dropped_documents"]) == (4, 1)
    with pytest.raises(ValueError, match=r"--input '.*empty' matches no file \(a directory "
                                         r"gives its \*\.jsonl, \*\.jsonl\.gz\)"):
        (tmp_path / "empty").mkdir()
        pp.input_files([str(tmp_path / "empty")], "jsonl")
    # --json-keys on text alone is a mistake (a JSONL file named .txt): refused, not ignored
    with pytest.raises(ValueError, match=r"--json-keys \['text'\] given but no input is JSONL "
                                         r"\(\[.*a\.txt'\] are read as text; --input-format "
                                         r"jsonl"):
        pp.preprocess([str(d / "a.txt")], tokenizer, str(tmp_path / "x"), json_key="text")


@pytest.mark.parametrize("kwargs, problem", [
    ({"workers": 0}, r"--workers must be >= 1, got 0"),
    ({"input_format": "csv"}, r"--input-format must be one of .*, got 'csv'"),
    ({"json_keys": ("text", "title", "text")}, r"--json-keys names \['text'\] more than once"),
    ({"json_keys": ("text", "a/b")}, r"--json-keys \['a/b'\] cannot name the file"),
    ({"json_keys": ()}, r"--json-keys needs at least one key"),
    ({"min_document_tokens": -1}, r"--min-document-tokens must be >= 0, got -1"),
])
def test_config_refuses(kwargs, problem):
    with pytest.raises(ValueError, match=problem):
        pp.PreprocessConfig(**kwargs)


def test_output_names():
    assert pp.PreprocessConfig().output_prefixes("d/c") == {"text": "d/c"}
    assert pp.PreprocessConfig(json_keys=("body",)).output_prefixes("d/c") == {"body": "d/c"}
    assert pp.PreprocessConfig(json_keys=("a", "b")).output_prefixes("d/c") == {
        "a": "d/c_a", "b": "d/c_b"}
