"""Text inputs: which files (``expand_inputs``) and the documents in them (``iter_documents``).

A pattern is a file path, a glob (``**`` recurses) or a directory (every file below it,
hidden files and folders skipped); several patterns may be given as a list and/or
separated by commas. Files come back as absolute paths, sorted and de-duplicated, so
the document order depends only on the set of files.
"""

from __future__ import annotations

import glob
import logging
import os
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

from jaxdist.data.records import RecordReading, is_record_file, record_blocks
from jaxdist.errors import JaxdistError
from jaxdist.storage.remote import expand_remote, is_remote, open_binary, size_of

log = logging.getLogger(__name__)
UNITS = ("file", "line")
_GLOB_CHARS = frozenset("*?[")


def split_patterns(patterns: str | os.PathLike | Sequence[str | os.PathLike]) -> list[str]:
    items = [patterns] if isinstance(patterns, str | os.PathLike) else list(patterns)
    out = [part.strip() for item in items for part in str(item).split(",")]
    return [p for p in out if p]


def expand_inputs(patterns: str | os.PathLike | Sequence[str | os.PathLike]) -> list[Path | str]:
    """Input files for ``patterns``; an error if a pattern matches nothing or every file is empty.
    A URL (``s3://bucket/corpus/*.parquet``) gives URLs, listed through object storage."""
    parts = split_patterns(patterns)
    if not parts:
        raise JaxdistError("no input files given")
    files: set[str] = set()
    for pattern in parts:
        matched = expand_remote(pattern) if is_remote(pattern) else _expand_one(os.path.expanduser(pattern))
        if not matched:
            raise JaxdistError(f"no input files match '{pattern}'")
        files.update(matched)
    paths = [p if is_remote(p) else Path(p) for p in sorted(files)]
    if sum(_size(p) for p in paths) == 0:
        shown = ", ".join(str(p) for p in paths[:3]) + (f", ... ({len(paths)} files)" if len(paths) > 3 else "")
        raise JaxdistError(f"input is empty: {shown}")
    return paths


def _expand_one(pattern: str) -> list[str]:
    if os.path.isdir(pattern):
        return _files_below(pattern)
    if os.path.lexists(pattern) or _GLOB_CHARS.isdisjoint(pattern):
        # a plain path (even one with glob characters in its name); a dangling link is kept
        # so that reading it names the problem
        return [os.path.abspath(pattern)] if os.path.lexists(pattern) else []
    # glob chose files by name; directories it matches are not expanded ('**' recurses)
    return [os.path.abspath(p) for p in glob.glob(pattern, recursive=True) if not os.path.isdir(p)]


def _files_below(directory: str) -> list[str]:
    found = []
    for root, dirs, names in os.walk(directory, onerror=_raise_walk_error):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        found.extend(os.path.abspath(os.path.join(root, n)) for n in names if not n.startswith("."))
    return found


def _raise_walk_error(error: OSError) -> None:
    raise JaxdistError(f"cannot read input directory {error.filename}: {error.strerror}")


def _size(path: Path | str) -> int:
    try:
        return size_of(path)
    except OSError as e:
        raise JaxdistError(f"cannot read input file {path}: {e.strerror}") from None


def iter_documents(files: Iterable[str | os.PathLike], unit: str = "file", records: RecordReading | None = None) -> Iterator[str]:
    """Documents in order: one per file (``unit="file"``) or per line (``"line"``, newline
    removed); in JSON Lines and Parquet files (``data.records``) one per record, whatever the unit.

    UTF-8 (undecodable bytes become U+FFFD; a record's must be UTF-8). Documents with nothing
    but whitespace are skipped.
    """
    for documents, _ in iter_document_blocks(files, unit, records):
        yield from documents


def iter_document_blocks(
    files: Iterable[str | os.PathLike], unit: str = "file", records: RecordReading | None = None
) -> Iterator[tuple[list[str], int]]:
    """``iter_documents`` in blocks: ``(documents, input bytes they came from)``.

    A block is a file (``unit="file"``), the lines of about ``_BLOCK_BYTES`` of one file, or
    a run of records; it may hold no documents. The byte counts add up to the input size.
    ``records`` says how record files are read and collects what was skipped.
    """
    if unit not in UNITS:
        raise JaxdistError(f"unknown unit '{unit}' (expected one of: {', '.join(UNITS)})")
    records = records or RecordReading()
    said = False
    for file in files:
        path = file if is_remote(file) else Path(file)
        try:
            if is_record_file(path):
                if unit == "line" and not said:
                    log.info(
                        f"{path.name}: a record is a document whatever the unit (data.text_unit=line reads only plain text files by line)"
                    )
                    said = True
                yield from record_blocks(path, records)
            elif unit == "file":
                with open_binary(path) as f:
                    data = f.read()
                text = data.decode("utf-8", errors="replace")
                yield ([text] if text and not text.isspace() else []), len(data)
            else:
                yield from _line_blocks(path)
        except OSError as e:
            raise JaxdistError(f"cannot read input file {path}: {e.strerror or e}") from None


_BLOCK_BYTES = 1 << 23


def _line_blocks(path: Path | str) -> Iterator[tuple[list[str], int]]:
    """Lines of ``path`` read in large blocks cut after a newline (a newline byte never sits
    inside a UTF-8 character, so each block decodes on its own)."""
    partial: list[bytes] = []  # the start of a line that continues in the next block
    with open_binary(path) as f:
        while block := f.read(_BLOCK_BYTES):
            cut = block.rfind(b"\n") + 1
            if cut == 0:
                partial.append(block)
                yield [], len(block)
                continue
            head = b"".join([*partial, block[:cut]]) if partial else block[:cut]
            partial = [block[cut:]] if cut < len(block) else []
            yield _lines(head), len(block)
    if partial:
        yield _lines(b"".join(partial)), 0


def _lines(data: bytes) -> list[str]:
    text = data.decode("utf-8", errors="replace")
    lines = text.split("\n")
    if "\r" in text:
        lines = [line.rstrip("\r") for line in lines]
    return [line for line in lines if line and not line.isspace()]
