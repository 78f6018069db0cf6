"""``python -m jaxdist.data prepare``: tokenizers, input expansion, the prepared-data format, errors."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from jaxdist.data import prepare as prepare_module
from jaxdist.data import text as text_module
from jaxdist.data.prepare import prepare, read_meta, token_dtype
from jaxdist.data.text import expand_inputs, iter_documents
from jaxdist.data.tokenizers import ByteTokenizer, load_tokenizer
from jaxdist.errors import JaxdistError

# file name -> content: blank lines, CRLF, non-ASCII, an undecodable byte, a whitespace-only file
CORPUS = {
    "a.txt": b"first line of a\n\nsecond line of a\n",
    "b.txt": "caf\u00e9 \u20ac line one\r\nline two without newline".encode(),
    "sub/c.txt": b"c: the only line\n   \n",
    "sub/deeper/d.md": b"bad byte \xff here\nlast\n",
    "blank.txt": b" \n\t\n",
}
SENTENCES = [
    "the quick brown fox jumps over the lazy dog",
    "a lazy dog sleeps in the sun",
    "the fox and the dog are friends",
    "quick quick brown brown fox fox",
]


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    root = tmp_path / "corpus"
    for name, content in CORPUS.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(content)
    return root


def expected_documents(root: Path, unit: str) -> list[str]:
    """The documents of CORPUS in prepare's order, computed without jaxdist."""
    docs = []
    for name in sorted(CORPUS, key=lambda n: str(root / n)):
        text = CORPUS[name].decode("utf-8", errors="replace")
        parts = [text] if unit == "file" else [line.rstrip("\r") for line in text.split("\n")]
        docs += [p for p in parts if p.strip()]
    return docs


def read_documents(directory: Path) -> list[np.ndarray]:
    """Every document (ids + EOD) of a prepared directory, in order, read with numpy / array_record only."""
    meta = json.loads((directory / "meta.json").read_text())
    docs = []
    for shard in meta["shards"]:
        path = directory / shard["path"]
        if meta["format"] == "bin":
            stream = np.memmap(path, dtype=meta["dtype"], mode="r")
            assert len(stream) == shard["tokens"]
            ends = np.flatnonzero(stream == meta["eod_id"]) + 1  # byte-level: EOD only ends documents
            assert ends[-1] == len(stream)
            shard_docs = [np.array(d) for d in np.split(stream, ends[:-1])]
        else:
            from array_record.python.array_record_module import ArrayRecordReader

            reader = ArrayRecordReader(str(path))
            shard_docs = [np.frombuffer(r, dtype=meta["dtype"]) for r in reader.read_all()]
            reader.close()
            lengths = np.load(directory / path.name.replace(".array_record", ".lengths.npy"))
            assert lengths.dtype == np.int64 and lengths.tolist() == [len(r) for r in shard_docs]
        assert len(shard_docs) == shard["documents"] and sum(map(len, shard_docs)) == shard["tokens"]
        docs += shard_docs
    return docs


# -- tokenizers ----------------------------------------------------------------------------


def test_byte_tokenizer_round_trip():
    tok = load_tokenizer(None)
    assert isinstance(tok, ByteTokenizer) and isinstance(load_tokenizer("byte"), ByteTokenizer)
    text = "h\u00e9llo \u20ac \U0001f600\n"
    ids = tok.encode(text)
    assert ids.tolist() == list(text.encode("utf-8"))
    assert np.issubdtype(ids.dtype, np.integer)
    assert (tok.eod_id, tok.vocab_size) == (256, 257)
    assert tok.describe() == {"kind": "byte", "name": "byte", "path": None, "sha256": None, "vocab_size": 257, "eod_id": 256}


def _train_hf_tokenizer(path: Path, specials: list[str]) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.train_from_iterator(SENTENCES, trainers.WordLevelTrainer(special_tokens=specials))
    tok.save(str(path))


def test_hf_tokenizer_eod_is_end_of_sequence_token(tmp_path):
    from tokenizers import Tokenizer

    path = tmp_path / "tok.json"
    _train_hf_tokenizer(path, ["<unk>", "<pad>", "</s>"])
    reference = Tokenizer.from_file(str(path))
    tok = load_tokenizer(str(path))
    assert tok.eod_id == reference.token_to_id("</s>") == 2
    assert tok.vocab_size == reference.get_vocab_size() == 3 + len({w for s in SENTENCES for w in s.split()})
    ids = tok.encode("the lazy fox")
    assert ids.tolist() == reference.encode("the lazy fox", add_special_tokens=False).ids
    assert len(ids) == 3 and tok.eod_id not in ids.tolist()
    info = tok.describe()
    assert info["kind"] == "huggingface" and info["path"] == str(path) and info["eod_id"] == 2
    assert info["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()


def test_hf_tokenizer_without_eod_token_gets_a_new_id(tmp_path):
    path = tmp_path / "tok.json"
    _train_hf_tokenizer(path, ["<unk>"])
    tok = load_tokenizer(path)
    n = 1 + len({w for s in SENTENCES for w in s.split()})
    assert (tok.eod_id, tok.vocab_size) == (n, n + 1)


def _train_sentencepiece(tmp_path: Path, name: str, vocab_size: int, **options) -> Path:
    import sentencepiece as spm

    text = tmp_path / "sp.txt"
    text.write_text("\n".join(f"{s} {i}" for i in range(50) for s in SENTENCES))
    spm.SentencePieceTrainer.train(input=str(text), model_prefix=str(tmp_path / name), vocab_size=vocab_size, minloglevel=2, **options)
    return tmp_path / f"{name}.model"


def test_sentencepiece_tokenizer(tmp_path):
    import sentencepiece as spm

    path = _train_sentencepiece(tmp_path, "bpe", 60, model_type="bpe")
    reference = spm.SentencePieceProcessor(model_file=str(path))
    tok = load_tokenizer(str(path))
    assert tok.eod_id == reference.eos_id() == 2 and tok.vocab_size == 60
    assert tok.encode("the quick dog").tolist() == reference.encode("the quick dog", out_type=int)
    assert tok.describe()["kind"] == "sentencepiece"

    no_eos = load_tokenizer(_train_sentencepiece(tmp_path, "uni", 40, model_type="unigram", eos_id=-1))
    assert (no_eos.eod_id, no_eos.vocab_size) == (40, 41)


@pytest.mark.parametrize("name", ["garbage.json", "garbage.model", "tokenizer.txt", "missing.json", "missing.model"])
def test_invalid_tokenizer_file(tmp_path, name):
    path = tmp_path / name
    if not name.startswith("missing"):
        path.write_bytes(b"\x00\xffnot a tokenizer{{{" * 10)
    with pytest.raises(JaxdistError, match="invalid tokenizer file") as info:
        load_tokenizer(str(path))
    assert str(path) in str(info.value) and "\n" not in str(info.value)


# -- inputs --------------------------------------------------------------------------------


def test_expand_inputs_globs_dirs_commas(corpus, tmp_path):
    everything = sorted(str(corpus / n) for n in CORPUS)
    (corpus / ".hidden.txt").write_text("hidden")
    assert [str(p) for p in expand_inputs(str(corpus))] == everything  # a directory: all files below, hidden ones skipped
    assert [str(p) for p in expand_inputs(f"{corpus}/**/*.txt")] == sorted(str(corpus / n) for n in CORPUS if n.endswith(".txt"))
    both = expand_inputs([f"{corpus}/a.txt,{corpus}/sub/deeper/*.md", str(corpus / "a.txt"), f"{corpus}/../corpus/a.txt"])
    assert [str(p) for p in both] == [str(corpus / "a.txt"), str(corpus / "sub/deeper/d.md")]


def test_iter_documents_units(corpus):
    files = expand_inputs(str(corpus))
    assert list(iter_documents(files, "file")) == expected_documents(corpus, "file")
    lines = list(iter_documents(files, "line"))
    assert lines == expected_documents(corpus, "line")
    assert "bad byte \ufffd here" in lines and "line two without newline" in lines


def test_lines_longer_than_a_read_block(tmp_path, monkeypatch):
    monkeypatch.setattr(text_module, "_BLOCK_BYTES", 7)  # lines span blocks; a block may hold no newline
    path = tmp_path / "lines.txt"
    lines = ["short", "", "a much longer line \u00e9\u20ac with multi-byte characters", "  ", "x", "tail without newline"]
    path.write_bytes("\r\n".join(lines).encode())
    assert list(iter_documents([path], "line")) == [line for line in lines if line.strip()]
    assert sum(n for _, n in text_module.iter_document_blocks([path], "line")) == path.stat().st_size


def test_encode_flat_matches_encode(tmp_path):
    path = tmp_path / "tok.json"
    _train_hf_tokenizer(path, ["<unk>", "</s>"])
    texts = ["the fox", "", "caf\u00e9 \u20ac dog", "lazy"]
    for tok in (load_tokenizer(None), load_tokenizer(path)):
        flat, lengths = tok.encode_flat(texts)
        expected = [tok.encode(t).tolist() for t in texts]
        assert lengths.tolist() == [len(e) for e in expected] and flat.tolist() == [i for e in expected for i in e]


def test_input_errors(corpus, tmp_path):
    with pytest.raises(JaxdistError, match="no input files match '.*nothing-here/\\*.txt'"):
        expand_inputs([str(corpus / "a.txt"), str(tmp_path / "nothing-here/*.txt")])
    with pytest.raises(JaxdistError, match="no input files match"):
        prepare(str(tmp_path / "missing.txt"), tmp_path / "out", progress=False)
    (tmp_path / "empty").mkdir()
    for name in ("e1.txt", "e2.txt"):
        (tmp_path / "empty" / name).write_bytes(b"")
    with pytest.raises(JaxdistError, match="input is empty"):
        expand_inputs(str(tmp_path / "empty"))
    with pytest.raises(JaxdistError, match="input is empty"):  # only whitespace
        prepare(str(corpus / "blank.txt"), tmp_path / "out", progress=False)
    (tmp_path / "adir.txt").mkdir()
    with pytest.raises(JaxdistError, match=f"cannot read input file {tmp_path / 'adir.txt'}: Is a directory"):
        list(iter_documents([tmp_path / "adir.txt"]))
    (tmp_path / "link.txt").symlink_to(tmp_path / "gone.txt")  # unreadable even for root
    with pytest.raises(JaxdistError, match=f"cannot read input file {tmp_path / 'link.txt'}"):
        prepare([str(corpus / "a.txt"), str(tmp_path / "link.txt")], tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()
    assert list(tmp_path.glob("out.tmp-*")) == []


# -- prepared data -------------------------------------------------------------------------


@pytest.mark.parametrize("unit", ["file", "line"])
@pytest.mark.parametrize("fmt", ["bin", "arrayrecord"])
def test_prepare_round_trip(corpus, tmp_path, fmt, unit):
    out = tmp_path / "prepared"
    meta = prepare(str(corpus), out, fmt=fmt, unit=unit, progress=False)
    docs = expected_documents(corpus, unit)
    total = sum(len(d.encode()) + 1 for d in docs)
    assert meta == read_meta(out) == json.loads((out / "meta.json").read_text())
    assert meta["version"] == 1 and meta["format"] == fmt and meta["dtype"] == "uint16"
    assert (meta["vocab_size"], meta["eod_id"], meta["max_token_id"]) == (257, 256, 256)
    assert meta["tokenizer"]["kind"] == "byte"
    assert (meta["documents"], meta["tokens"]) == (len(docs), total)
    assert meta["shards"][0]["path"] == ("tokens-00000.bin" if fmt == "bin" else "docs-00000.array_record")
    assert len(meta["shards"]) == 1 and meta["shards"][0]["documents"] == len(docs)
    got = read_documents(out)
    assert [d.tolist() for d in got] == [[*d.encode(), 256] for d in docs]
    assert sorted(os.listdir(tmp_path)) == ["corpus", "prepared"]  # no temporary directory left


@pytest.mark.parametrize("fmt", ["bin", "arrayrecord"])
def test_shards_roll_over_at_document_boundaries(corpus, tmp_path, fmt):
    whole = prepare(str(corpus), tmp_path / "whole", fmt=fmt, unit="line", progress=False)
    meta = prepare(str(corpus), tmp_path / "sharded", fmt=fmt, unit="line", shard_tokens=40, progress=False)
    assert len(meta["shards"]) >= 3
    assert [s["path"] for s in meta["shards"]][:2] == (
        ["tokens-00000.bin", "tokens-00001.bin"] if fmt == "bin" else ["docs-00000.array_record", "docs-00001.array_record"]
    )
    assert all(s["tokens"] <= 40 or s["documents"] == 1 for s in meta["shards"])
    assert (meta["documents"], meta["tokens"]) == (whole["documents"], whole["tokens"])
    assert [d.tolist() for d in read_documents(tmp_path / "sharded")] == [d.tolist() for d in read_documents(tmp_path / "whole")]
    if fmt == "bin":
        concatenated = b"".join((tmp_path / "sharded" / s["path"]).read_bytes() for s in meta["shards"])
        assert concatenated == (tmp_path / "whole" / "tokens-00000.bin").read_bytes()


@pytest.mark.parametrize("fmt", ["bin", "arrayrecord"])
def test_long_documents_and_small_shards(tmp_path, fmt):
    rng = np.random.default_rng(0)
    sizes = [3000, 5, 700, 2500, 90, 1200, 1, 400, 400, 400]
    docs = ["".join(rng.choice(list("abc \u00e9xyz\t"), size=n)).strip() or "z" for n in sizes]
    for i, doc in enumerate(docs):
        (tmp_path / f"in/{i:02d}.txt").parent.mkdir(exist_ok=True)
        (tmp_path / f"in/{i:02d}.txt").write_text(doc)
    meta = prepare(str(tmp_path / "in"), tmp_path / "out", fmt=fmt, shard_tokens=1000, progress=False)
    assert [d.tolist() for d in read_documents(tmp_path / "out")] == [[*d.encode(), 256] for d in docs]
    assert all(s["tokens"] <= 1000 or s["documents"] == 1 for s in meta["shards"])
    assert sum(s["tokens"] > 1000 for s in meta["shards"]) == 3  # the 3 documents larger than a shard
    # greedy: a shard closes only when the next document does not fit
    for shard, following in zip(meta["shards"], meta["shards"][1:], strict=False):
        assert shard["tokens"] + len(read_documents_of(tmp_path / "out", following)[0]) > 1000


def test_exact_fit_and_out_of_range_ids(tmp_path, monkeypatch):
    (tmp_path / "in").mkdir()
    (tmp_path / "in/x.txt").write_text("ab\ncd\nef\n")
    meta = prepare(str(tmp_path / "in"), tmp_path / "exact", unit="line", shard_tokens=6, progress=False)
    assert [(s["documents"], s["tokens"]) for s in meta["shards"]] == [(2, 6), (1, 3)]

    monkeypatch.setattr(ByteTokenizer, "encode_flat", lambda self, texts: (np.full(4, 2**16), np.array([2, 2])))
    with pytest.raises(JaxdistError, match="token id 65536 does not fit the storage dtype uint16"):
        prepare(str(tmp_path / "in"), tmp_path / "bad", unit="line", progress=False)
    assert not (tmp_path / "bad").exists()


def read_documents_of(directory: Path, shard: dict) -> list[np.ndarray]:
    docs, i = read_documents(directory), 0
    meta = read_meta(directory)
    for s in meta["shards"]:
        if s["path"] == shard["path"]:
            return docs[i : i + s["documents"]]
        i += s["documents"]
    raise AssertionError(shard)


def test_prepare_with_hf_tokenizer_and_worker_pool(corpus, tmp_path, monkeypatch):
    pools = []
    get_context = prepare_module.multiprocessing.get_context
    monkeypatch.setattr(prepare_module.multiprocessing, "get_context", lambda method: pools.append(method) or get_context(method))
    monkeypatch.setattr(prepare_module, "_CHUNK_DOCS", 1)  # many chunks in flight, results must stay in order
    path = tmp_path / "tok.json"
    _train_hf_tokenizer(path, ["<unk>", "</s>"])
    tok = load_tokenizer(path)
    serial = prepare(str(corpus), tmp_path / "serial", tokenizer_path=str(path), unit="line", progress=False)
    pooled = prepare(str(corpus), tmp_path / "pooled", tokenizer_path=str(path), unit="line", workers=2, progress=False)
    assert pools == ["spawn"]  # only workers=2 used a pool
    assert serial == pooled and serial["eod_id"] == tok.eod_id == 1 and serial["tokenizer"]["sha256"]
    assert (tmp_path / "serial/tokens-00000.bin").read_bytes() == (tmp_path / "pooled/tokens-00000.bin").read_bytes()
    stream = np.memmap(tmp_path / "pooled/tokens-00000.bin", dtype="uint16", mode="r")
    expected = [t for d in expected_documents(corpus, "line") for t in [*tok.encode(d).tolist(), tok.eod_id]]
    assert stream.tolist() == expected and serial["max_token_id"] == max(expected)


def test_dtype_choice():
    assert token_dtype(257) == np.uint16 and token_dtype(2**16) == np.uint16
    assert token_dtype(2**16 + 1) == np.uint32 and token_dtype(128_256) == np.uint32
    assert token_dtype(2**16).byteorder in "<=|" and token_dtype(2**20).itemsize == 4


def test_existing_output_is_never_overwritten_by_accident(corpus, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    with pytest.raises(JaxdistError, match="not empty"):
        prepare(str(corpus), out, progress=False)
    with pytest.raises(JaxdistError, match="holds no prepared data"):  # --overwrite only replaces prepared data
        prepare(str(corpus), out, overwrite=True, progress=False)
    assert (out / "keep.txt").read_text() == "precious"

    first = prepare(str(corpus), tmp_path / "data", unit="file", progress=False)
    second = prepare(str(corpus), tmp_path / "data", unit="line", overwrite=True, progress=False)
    assert first["documents"] != second["documents"] == read_meta(tmp_path / "data")["documents"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus", "data", "out"]


def test_interrupted_prepare_leaves_nothing(corpus, tmp_path, monkeypatch):
    previous = prepare(str(corpus), tmp_path / "old", progress=False)
    calls = []

    encode_flat = ByteTokenizer.encode_flat

    def failing_encode(self, texts):
        calls.append(texts)
        if len(calls) == 3:
            raise RuntimeError("interrupted")
        return encode_flat(self, texts)

    monkeypatch.setattr(ByteTokenizer, "encode_flat", failing_encode)
    monkeypatch.setattr(prepare_module, "_CHUNK_DOCS", 1)  # documents reach the writer before the failure
    with pytest.raises(RuntimeError, match="interrupted"):
        prepare(str(corpus), tmp_path / "new", unit="line", progress=False)
    assert len(calls) == 3 and not (tmp_path / "new").exists()
    calls.clear()
    with pytest.raises(RuntimeError, match="interrupted"):
        prepare(str(corpus), tmp_path / "old", unit="line", overwrite=True, progress=False)
    assert read_meta(tmp_path / "old") == previous  # the earlier data survives a failed overwrite
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus", "old"]


def test_read_meta_rejects_incomplete_directories(corpus, tmp_path):
    with pytest.raises(JaxdistError, match="is not a prepared data directory \\(no meta.json\\)"):
        read_meta(corpus)
    meta = prepare(str(corpus), tmp_path / "bin", progress=False)
    shard = tmp_path / "bin" / meta["shards"][0]["path"]
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size - 2)
    expected = meta["tokens"] * 2
    with pytest.raises(JaxdistError, match=f"shard tokens-00000.bin has {expected - 2} bytes, expected {expected}"):
        read_meta(tmp_path / "bin")

    meta = prepare(str(corpus), tmp_path / "ar", fmt="arrayrecord", progress=False)
    np.save(tmp_path / "ar" / meta["shards"][0]["lengths"], np.array([1, 2], dtype=np.int64))
    with pytest.raises(JaxdistError, match="corrupt prepared data"):
        read_meta(tmp_path / "ar")
    (tmp_path / "ar" / "meta.json").write_text("{not json")
    with pytest.raises(JaxdistError, match="corrupt prepared data"):
        read_meta(tmp_path / "ar")


# -- CLI -----------------------------------------------------------------------------------


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "jaxdist.data", *args], capture_output=True, text=True, timeout=60)


def test_cli_prepare_and_bad_input(corpus, tmp_path):
    out = tmp_path / "cli"
    ok = _cli("prepare", "--input", f"{corpus}/*.txt", "--input", str(corpus / "sub"), "--output", str(out), "--format", "arrayrecord")
    assert ok.returncode == 0, ok.stderr
    summary = ok.stdout.strip().splitlines()
    assert len(summary) == 1 and summary[0].startswith("jaxdist: prepared 4 documents,") and "MB/s" in summary[0]
    assert read_meta(out)["format"] == "arrayrecord"

    bad = _cli("prepare", "--input", str(tmp_path / "nope/*.txt"), "--output", str(tmp_path / "bad"))
    assert bad.returncode == 2
    lines = bad.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("jaxdist: error: no input files match"), bad.stderr
    assert not (tmp_path / "bad").exists()

    usage = _cli("prepare", "--input", str(corpus), "--output", str(tmp_path / "bad"), "--shard-tokens", "0")
    assert usage.returncode == 2 and usage.stderr.strip().splitlines() == ["jaxdist: error: argument --shard-tokens: must be >= 1, got 0"]
