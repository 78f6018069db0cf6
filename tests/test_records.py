"""Corpora as JSON Lines (plain, gzip, zstd) and Parquet: a record is a document, its text in
``data.text_field``. Each format gives exactly the token stream of the same documents written
as one text file each; Parquet is read by row group; bad records stop the read with one line
naming the file and the record, or are skipped and counted (``data.bad_records``)."""

from __future__ import annotations

import codecs
import gzip
import json
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from jaxdist.config import load_config
from jaxdist.data.prepare import prepare
from jaxdist.data.sources import open_corpus
from jaxdist.errors import JaxdistError

from helpers import subprocess_env

DOCUMENTS = [f"document {i}: " + "naïve café " * (i % 7) + "∑ end" for i in range(300)]


def _jsonl(documents, field="text") -> bytes:
    return b"".join(json.dumps({field: d, "id": i}).encode() + b"\n" for i, d in enumerate(documents))


def _write(path, documents, field="text"):
    name = path.name
    if name.endswith(".parquet"):
        pq.write_table(pa.table({"id": list(range(len(documents))), field: documents}), path, row_group_size=64)
    elif name.endswith(".gz"):
        path.write_bytes(gzip.compress(_jsonl(documents, field)))
    elif name.endswith(".zst"):  # three frames, as streaming compressors write long files
        cuts = [0, len(documents) // 3, 2 * len(documents) // 3, len(documents)]
        thirds = [documents[a:b] for a, b in zip(cuts, cuts[1:], strict=False)]
        path.write_bytes(b"".join(zstandard.ZstdCompressor().compress(_jsonl(part, field)) for part in thirds))
    else:
        path.write_bytes(_jsonl(documents, field))
    return path


def _stream(path, *overrides) -> np.ndarray:
    config = load_config(None, ["data.source=text", f"data.path={path}", *overrides])
    corpus = open_corpus(config)
    return corpus.stream.read(0, corpus.stream.n_tokens)


@pytest.fixture(scope="module")
def as_text_files(tmp_path_factory):
    """The same documents as one text file each: the plain-text path's token stream."""
    folder = tmp_path_factory.mktemp("text_files")
    for i, document in enumerate(DOCUMENTS):
        (folder / f"doc_{i:04d}.txt").write_text(document, encoding="utf-8")
    return _stream(folder)


@pytest.mark.parametrize("name", ["corpus.jsonl", "corpus.jsonl.gz", "corpus.jsonl.zst", "corpus.parquet"])
def test_every_format_gives_the_text_files_token_stream(tmp_path, name, as_text_files):
    path = _write(tmp_path / name, DOCUMENTS)
    np.testing.assert_array_equal(_stream(path), as_text_files)
    meta = prepare(str(path), tmp_path / "prepared", progress=False)
    shard = np.fromfile(tmp_path / "prepared" / meta["shards"][0]["path"], dtype=meta["dtype"])
    np.testing.assert_array_equal(shard, as_text_files)
    assert meta["documents"] == len(DOCUMENTS) and meta["skipped_records"] == 0


def test_another_field_name_and_a_glob_over_formats(tmp_path, as_text_files):
    _write(tmp_path / "a.jsonl.gz", DOCUMENTS[:100], field="content")
    _write(tmp_path / "b.parquet", DOCUMENTS[100:], field="content")
    np.testing.assert_array_equal(_stream(tmp_path / "*", "data.text_field=content"), as_text_files)


@pytest.mark.parametrize("name", ["bom.jsonl", "bom.jsonl.gz"])
def test_a_byte_order_mark_is_not_part_of_the_first_record(tmp_path, name, as_text_files):
    """Windows tools start UTF-8 files with a BOM: every document is read, none counted bad."""
    data = codecs.BOM_UTF8 + _jsonl(DOCUMENTS)
    path = tmp_path / name
    path.write_bytes(gzip.compress(data) if name.endswith(".gz") else data)
    np.testing.assert_array_equal(_stream(path), as_text_files)
    meta = prepare(str(path), tmp_path / "prepared", progress=False, bad_records="skip")
    assert meta["documents"] == len(DOCUMENTS) and meta["skipped_records"] == 0


def test_parquet_is_read_one_row_group_at_a_time(tmp_path, monkeypatch, as_text_files):
    path = _write(tmp_path / "corpus.parquet", DOCUMENTS)
    assert pq.ParquetFile(path).num_row_groups == 5
    groups = []
    read_row_group = pq.ParquetFile.read_row_group

    def counted(self, i, columns=None, **kw):
        groups.append((i, tuple(columns or ())))
        return read_row_group(self, i, columns=columns, **kw)

    def whole_file(*args, **kwargs):
        raise AssertionError("read the whole file")

    monkeypatch.setattr(pq.ParquetFile, "read_row_group", counted)
    monkeypatch.setattr(pq.ParquetFile, "read", whole_file)
    monkeypatch.setattr(pq, "read_table", whole_file)
    prepare(str(path), tmp_path / "prepared", progress=False)
    assert groups == [(i, ("text",)) for i in range(5)]  # the text column only


def _bad_jsonl(tmp_path):
    """Records 3 (no field), 5 (not UTF-8), 7 (not JSON) and 9 (text is a number) are bad."""
    lines = [json.dumps({"text": d}).encode() for d in DOCUMENTS[:10]]
    lines[2] = json.dumps({"body": "x"}).encode()
    lines[4] = b'{"text": "caf\xe9"}'
    lines[6] = b'{"text": '
    lines[8] = json.dumps({"text": 7}).encode()
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


def test_a_bad_record_stops_the_read_naming_the_file_and_record(tmp_path):
    path = _bad_jsonl(tmp_path)
    with pytest.raises(JaxdistError, match=r"bad.jsonl: record 3: no field 'text' \(data.bad_records=skip") as error:
        _stream(path)
    assert "\n" not in str(error.value)
    assert not (tmp_path / "prepared").exists()
    with pytest.raises(JaxdistError, match="record 3"):
        prepare(str(path), tmp_path / "prepared", progress=False)
    assert not (tmp_path / "prepared").exists() and not list(tmp_path.glob("prepared.tmp-*"))


def test_skipped_records_are_counted_and_said_in_one_line(tmp_path, capsys):
    path = _bad_jsonl(tmp_path)
    good = [d for i, d in enumerate(DOCUMENTS[:10]) if i not in (2, 4, 6, 8)]
    meta = prepare(str(path), tmp_path / "prepared", progress=False, bad_records="skip")
    assert meta["documents"] == len(good) and meta["skipped_records"] == 4
    (line,) = [x for x in capsys.readouterr().err.splitlines() if "skipped" in x]
    assert "skipped 4 bad record(s)" in line and "record 3: no field 'text'" in line
    reasons = []
    for record in (5, 7, 9):
        lines = path.read_bytes().split(b"\n")
        single = tmp_path / f"only_{record}.jsonl"
        single.write_bytes(lines[record - 1] + b"\n")
        with pytest.raises(JaxdistError) as error:
            _stream(single)
        reasons.append(str(error.value))
    assert "record 1: not UTF-8" in reasons[0] and "record 1: not JSON" in reasons[1] and "is int, not a string" in reasons[2]


@pytest.mark.parametrize("name", ["cut.jsonl.gz", "cut.jsonl.zst"])
def test_a_truncated_compressed_file_is_a_bad_record_not_a_short_corpus(tmp_path, name):
    whole = _write(tmp_path / ("whole" + name.removeprefix("cut")), DOCUMENTS).read_bytes()
    path = tmp_path / name
    path.write_bytes(whole[: len(whole) * 2 // 3])
    with pytest.raises(JaxdistError, match=rf"{name}: record \d+: the compressed file ends early"):
        _stream(path)
    config = ["data.bad_records=skip"]
    kept = _stream(path, *config)
    assert 0 < kept.size < _stream(tmp_path / ("whole" + name.removeprefix("cut"))).size


def test_parquet_without_the_column_or_with_another_type_is_one_line(tmp_path):
    pq.write_table(pa.table({"body": ["a", "b"]}), tmp_path / "other.parquet")
    with pytest.raises(JaxdistError, match=r"other.parquet: no column 'text' \(columns: body\); set data.text_field"):
        _stream(tmp_path / "other.parquet")
    pq.write_table(pa.table({"text": [1, 2]}), tmp_path / "numbers.parquet")
    with pytest.raises(JaxdistError, match="column 'text' holds int64, not text"):
        _stream(tmp_path / "numbers.parquet")
    pq.write_table(pa.table({"text": ["a", None, "c"]}), tmp_path / "nulls.parquet")
    with pytest.raises(JaxdistError, match="nulls.parquet: record 2: field 'text' is null"):
        _stream(tmp_path / "nulls.parquet")
    assert _stream(tmp_path / "nulls.parquet", "data.bad_records=skip").size == 4  # a, EOD, c, EOD


def test_prepare_cli_reads_records_and_a_bad_one_is_one_line_exit_2(tmp_path):
    (tmp_path / "in").mkdir()
    good = _write(tmp_path / "in" / "corpus.jsonl.gz", DOCUMENTS, field="content")
    cli = [sys.executable, "-m", "jaxdist.data", "prepare", "--output"]
    ok = subprocess.run(
        [*cli, str(tmp_path / "out"), "--input", str(good), "--text-field", "content"],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ok.returncode == 0, ok.stderr
    assert f"prepared {len(DOCUMENTS)} documents" in ok.stdout
    bad = subprocess.run(
        [*cli, str(tmp_path / "bad"), "--input", str(good)], env=subprocess_env(), capture_output=True, text=True, timeout=120
    )
    assert bad.returncode == 2
    lines = [line for line in bad.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "corpus.jsonl.gz: record 1: no field 'text' (--bad-records skip skips" in lines[0], bad.stderr
    assert not (tmp_path / "bad").exists()
