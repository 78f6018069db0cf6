"""Documents from record files: JSON Lines (``.jsonl``, ``.jsonl.gz``, ``.jsonl.zst``) and
Parquet (``.parquet``), one document per record, its text in one field (``data.text_field``).

These are the formats corpora ship in (FineWeb, Dolma, SlimPajama, The Stack). Files are read
as streams: JSON Lines line by line through the decompressor, Parquet one row group at a time
and only the text column, so no file is ever held whole in memory.

A bad record (no such field or not a string, a line that is not UTF-8 or not JSON, a
compressed file cut short) either stops the read with one line naming the file and the record
(``bad_records="stop"``, the default: a corpus with holes is usually a mistake) or is skipped
and counted (``"skip"``), the count said in one line at the end by the caller.
"""

from __future__ import annotations

import codecs
import contextlib
import dataclasses
import gzip
import io
import json
from collections.abc import Iterator
from pathlib import Path

from jaxdist.errors import JaxdistError
from jaxdist.storage.remote import open_binary, size_of

JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst")
PARQUET_SUFFIXES = (".parquet",)
BAD_RECORDS = ("stop", "skip")
_BLOCK_RECORDS = 4096  # documents per block handed on (JSON Lines; Parquet: a row group)


def is_record_file(path: str | Path) -> bool:
    name = str(path).lower()
    return name.endswith(JSONL_SUFFIXES + PARQUET_SUFFIXES)


@dataclasses.dataclass
class RecordReading:
    """How record files are read, and what was skipped (filled in as files are read)."""

    field: str = "text"
    bad_records: str = "stop"
    skipped: int = 0
    first_skipped: str = ""  # "FILE: record N: why" of the first one
    skip_hint: str = "data.bad_records=skip"  # how the caller's user asks to skip (a config key, or prepare's flag)

    def __post_init__(self):
        if self.bad_records not in BAD_RECORDS:
            raise JaxdistError(f"unknown bad_records '{self.bad_records}' (expected one of: {', '.join(BAD_RECORDS)})")
        if not self.field:
            raise JaxdistError("the text field of JSON Lines / Parquet records must not be empty")

    def bad(self, path: Path | str, record: int, why: str) -> None:
        where = f"{path}: record {record}: {why}"
        if self.bad_records == "stop":
            raise JaxdistError(f"{where} ({self.skip_hint} skips such records and counts them)")
        self.skipped += 1
        self.first_skipped = self.first_skipped or where

    def summary(self) -> str | None:
        """One line on what was skipped; None when nothing was."""
        if not self.skipped:
            return None
        return f"skipped {self.skipped} bad record(s) ({self.skip_hint}); the first: {self.first_skipped}"


def record_blocks(path: Path | str, reading: RecordReading) -> Iterator[tuple[list[str], int]]:
    """``(documents, input bytes)`` blocks of one record file (a path or a URL); the byte counts
    add up to its size."""
    size = size_of(path)
    blocks = _parquet_blocks(path, reading) if str(path).lower().endswith(PARQUET_SUFFIXES) else _jsonl_blocks(path, reading)
    for documents in blocks:
        yield documents, 0
    yield [], size


@contextlib.contextmanager
def open_jsonl(path: Path | str):
    """A binary stream with ``readline`` over the decompressed lines of a JSON Lines file (a
    path or a URL); reading a ``.gz`` / ``.zst`` file cut short raises ``EOFError``."""
    with open_binary(path) as raw, _decompressed(raw, path) as lines:
        yield lines


def _decompressed(raw, path: Path | str):
    """A binary file object with ``readline`` over the decompressed lines of ``raw``."""
    name = str(path).lower()
    if name.endswith(".gz"):
        return gzip.GzipFile(fileobj=raw, mode="rb")
    if name.endswith(".zst"):
        return io.BufferedReader(_ZstdFrames(raw, path))
    return raw


class _ZstdFrames(io.RawIOBase):
    """Zstandard frames, one after another, as a raw stream. zstandard's own stream reader
    returns end-of-file on a file cut inside a frame; this raises ``EOFError`` there, as gzip does."""

    def __init__(self, raw, path: Path | str):
        try:
            import zstandard
        except ImportError:
            raise JaxdistError(f"{path}: reading .zst needs the zstandard package (pip install 'jaxdist[storage]')") from None
        self._new = zstandard.ZstdDecompressor().decompressobj
        self._error = zstandard.ZstdError
        self._file = raw
        self._frame = self._new()
        self._pending, self._offset = b"", 0  # decompressed bytes, and how many were handed out
        self._started = False  # the current frame has consumed input

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while self._offset >= len(self._pending):  # all handed out: decompress the next chunk
            self._pending, self._offset = b"", 0
            chunk = self._file.read(1 << 20)
            if not chunk:
                if self._started and not self._frame.eof:
                    raise EOFError("the zstd stream ended before the end of its frame")
                return 0
            while chunk:
                if self._frame.eof:
                    self._frame, self._started = self._new(), False
                self._started = True
                try:
                    self._pending += self._frame.decompress(chunk)
                except self._error as e:
                    raise EOFError(f"corrupt zstd data ({e})") from None
                chunk = self._frame.unused_data if self._frame.eof else b""
        n = min(len(buffer), len(self._pending) - self._offset)
        buffer[:n] = self._pending[self._offset : self._offset + n]  # an offset, not a shrinking copy
        self._offset += n
        return n


def jsonl_lines(path: Path | str, reading: RecordReading) -> Iterator[tuple[int, bytes]]:
    """``(record number, line)`` for each non-blank line of a JSON Lines file (a path or a URL,
    compressed or not); a compressed file cut short or corrupt is one bad record, and the end."""
    record = 0
    with open_jsonl(path) as lines:
        while True:
            try:
                line = lines.readline()
            except (EOFError, gzip.BadGzipFile) as e:  # cut short or corrupt: the rest of the file is lost
                reading.bad(path, record + 1, f"the compressed file ends early or is corrupt ({e})")
                return
            if not line:
                return
            record += 1
            if record == 1 and line.startswith(codecs.BOM_UTF8):  # written by Windows tools: not part of the first record
                line = line[len(codecs.BOM_UTF8) :]
            if line.strip():
                yield record, line


def _jsonl_blocks(path: Path | str, reading: RecordReading) -> Iterator[list[str]]:
    documents: list[str] = []
    for record, line in jsonl_lines(path, reading):
        text = _text_of_line(line, reading.field)
        if isinstance(text, _Bad):
            reading.bad(path, record, text.why)
        elif text and not text.isspace():
            documents.append(text)
            if len(documents) >= _BLOCK_RECORDS:
                yield documents
                documents = []
    if documents:
        yield documents


@dataclasses.dataclass(frozen=True)
class _Bad:
    why: str


def _text_of_line(line: bytes, field: str) -> str | _Bad:
    try:
        decoded = line.decode("utf-8")
    except UnicodeDecodeError as e:
        return _Bad(f"not UTF-8 (byte {e.start})")
    try:
        value = json.loads(decoded)
    except json.JSONDecodeError as e:
        return _Bad(f"not JSON ({e.msg})")
    if not isinstance(value, dict) or field not in value:
        return _Bad(f"no field '{field}'")
    text = value[field]
    if not isinstance(text, str):
        return _Bad(f"field '{field}' is {type(text).__name__}, not a string")
    return text


def _parquet_blocks(path: Path | str, reading: RecordReading) -> Iterator[list[str]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise JaxdistError(f"{path}: reading Parquet needs the pyarrow package (pip install 'jaxdist[storage]')") from None
    with open_binary(path) as source:
        yield from _row_groups(path, source, pq, reading)


def _row_groups(path: Path | str, source, pq, reading: RecordReading) -> Iterator[list[str]]:
    try:
        parquet = pq.ParquetFile(source)
    except Exception as e:  # noqa: BLE001 - pyarrow raises ArrowInvalid/OSError for a file that is not Parquet
        raise JaxdistError(f"{path}: not a readable Parquet file ({e})") from None
    names = parquet.schema_arrow.names
    if reading.field not in names:
        raise JaxdistError(f"{path}: no column '{reading.field}' (columns: {', '.join(names[:8])}); set data.text_field")
    column_type = parquet.schema_arrow.field(reading.field).type
    if str(column_type) not in ("string", "large_string", "string_view"):
        raise JaxdistError(f"{path}: column '{reading.field}' holds {column_type}, not text")
    record = 0
    for group in range(parquet.num_row_groups):
        values = parquet.read_row_group(group, columns=[reading.field]).column(0).to_pylist()
        documents = []
        for text in values:
            record += 1
            if text is None:
                reading.bad(path, record, f"field '{reading.field}' is null")
            elif text and not text.isspace():
                documents.append(text)
        yield documents
