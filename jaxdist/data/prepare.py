"""``python -m jaxdist.data prepare``: text files -> tokenized shards that training reads.

    python -m jaxdist.data prepare --input GLOB [--input GLOB ...] --output DIR
        [--tokenizer FILE] [--format bin|arrayrecord] [--unit file|line]
        [--shard-tokens N] [--workers N] [--overwrite]

Output (the contract the training-side reader relies on), in DIR:

- ``meta.json``: ``version`` (1), ``format`` (bin | arrayrecord), ``dtype`` (uint16 when
  vocab_size <= 65536, else uint32), ``tokenizer`` (``Tokenizer.describe()``),
  ``vocab_size``, ``eod_id``, ``max_token_id`` (the largest id written, EOD included),
  ``documents``, ``tokens`` (EODs included), ``shards``: [{``path`` (relative to DIR),
  ``documents``, ``tokens``}, ...]; also ``unit``, ``input_files``, ``input_bytes``.
- ``bin``: ``tokens-00000.bin``, ...: flat little-endian arrays of ``dtype``, each
  document's ids followed by ``eod_id`` (``np.memmap(path, dtype, mode="r")``).
- ``arrayrecord``: ``docs-00000.array_record``, ...: one record per document, the raw
  little-endian bytes of its ids including the trailing ``eod_id`` (``group_size:1``, so
  records are randomly accessible), and ``docs-00000.lengths.npy`` (int64 tokens per
  record, EOD included); shard entries also name it under ``lengths``.

Documents keep the input order (files sorted, lines in order); training shuffles. A
new shard starts before a document that would take the current one past
``shard_tokens`` (a single larger document gets a shard of its own). Everything is
written into ``DIR.tmp-<pid>`` and renamed to DIR at the end, so an interrupted run
never leaves a DIR that looks complete.
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing
import os
import shutil
import sys
import tempfile
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import numpy as np
from array_record.python.array_record_module import ArrayRecordWriter
from tqdm import tqdm

from jaxdist.data.prepared import FORMATS, META_FILE, VERSION, lengths_file, read_meta  # noqa: F401 - read_meta: the public entry
from jaxdist.data.records import BAD_RECORDS, RecordReading
from jaxdist.data.remote_output import RemoteOutput
from jaxdist.data.text import UNITS, expand_inputs, iter_document_blocks
from jaxdist.data.tokenizers import Tokenizer, load_tokenizer
from jaxdist.errors import JaxdistError
from jaxdist.storage.remote import is_remote, redact, size_of

DEFAULT_SHARD_TOKENS = 2**26
_CHUNK_CHARS = 1 << 20  # documents are tokenized in chunks of about this many characters
_CHUNK_DOCS = 8192
_FLUSH_TOKENS = 1 << 22  # bin writer buffers this many tokens between writes

log = logging.getLogger(__name__)


def token_dtype(vocab_size: int) -> np.dtype:
    """The storage dtype for ids below ``vocab_size``: uint16 up to 65536 ids, else uint32."""
    if vocab_size <= 2**16:
        return np.dtype("<u2")
    if vocab_size <= 2**32:
        return np.dtype("<u4")
    raise JaxdistError(f"vocab_size {vocab_size} does not fit in uint32")


def prepare(
    inputs: str | Sequence[str],
    output: str | os.PathLike,
    tokenizer_path: str | None = None,
    fmt: str = "bin",
    unit: str = "file",
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    workers: int = 0,
    overwrite: bool = False,
    progress: bool = True,
    text_field: str = "text",
    bad_records: str = "stop",
) -> dict:
    """Tokenize ``inputs`` into the prepared-data directory ``output``; returns its meta.
    JSON Lines and Parquet inputs give a document per record, its text in ``text_field``."""
    if fmt not in FORMATS:
        raise JaxdistError(f"unknown format '{fmt}' (expected one of: {', '.join(FORMATS)})")
    if unit not in UNITS:
        raise JaxdistError(f"unknown unit '{unit}' (expected one of: {', '.join(UNITS)})")
    if shard_tokens < 1:
        raise JaxdistError(f"shard_tokens must be >= 1, got {shard_tokens}")
    if workers < 0:
        raise JaxdistError(f"workers must be >= 0, got {workers}")
    records = RecordReading(text_field, bad_records, skip_hint="--bad-records skip")  # prepare's own flag
    tokenizer = load_tokenizer(tokenizer_path)
    dtype = token_dtype(tokenizer.vocab_size)
    remote = is_remote(output)
    out = str(output).rstrip("/") if remote else Path(output).expanduser().absolute()
    files = [f for f in expand_inputs(inputs) if remote or is_remote(f) or out not in f.parents]  # never re-read earlier output
    if not files:
        raise JaxdistError(f"input is empty: every file matching {_describe_inputs(inputs)} is inside the output {out}")
    input_bytes = sum(size_of(f) for f in files)
    if remote:
        if fmt != "bin":
            raise JaxdistError(
                f"prepare --output {redact(out)}: object storage takes the bin format only (ArrayRecord cannot be read there)"
            )
        target = RemoteOutput(out, overwrite)
        tmp = Path(tempfile.mkdtemp(prefix="jaxdist-prepare-"))  # one shard at a time
    else:
        _check_output(out, overwrite)
        tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    try:
        if not remote:
            _make_dir(tmp)
        writer = (_BinWriter if fmt == "bin" else _ArrayRecordWriter)(tmp, dtype, tokenizer.eod_id, shard_tokens)
        if remote:
            writer.on_shard_closed = lambda name: target.shard_closed(tmp, name)
        with _progress_bar(input_bytes, progress) as bar:
            for flat, lengths in _encoded_batches(tokenizer, files, unit, records, workers, bar):
                writer.add(flat, lengths)
        shards = writer.close()
        if records.skipped:
            log.warning(records.summary())
        if not shards:
            raise JaxdistError(f"input is empty: no text in {len(files)} file(s) matching {_describe_inputs(inputs)}")
        meta = {
            "version": VERSION,
            "format": fmt,
            "dtype": dtype.name,
            "tokenizer": tokenizer.describe(),
            "vocab_size": tokenizer.vocab_size,
            "eod_id": tokenizer.eod_id,
            "max_token_id": writer.max_token_id,
            "documents": sum(s["documents"] for s in shards),
            "tokens": sum(s["tokens"] for s in shards),
            "shards": shards,
            "unit": unit,
            "skipped_records": records.skipped,
            "input_files": len(files),
            "input_bytes": input_bytes,
        }
        _write_json(tmp / META_FILE, meta)
        if remote:
            target.commit(tmp)
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            _publish(tmp, out, overwrite)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise JaxdistError(f"cannot write prepared data {redact(str(out))}: {e.strerror or e}") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return meta


# -- writers -------------------------------------------------------------------------------


class _ShardWriter:
    """Counts documents and tokens per shard and decides where a new shard starts."""

    def __init__(self, directory: Path, dtype: np.dtype, eod_id: int, shard_tokens: int):
        self.directory, self.dtype, self.eod_id, self.shard_tokens = directory, dtype, eod_id, shard_tokens
        self.shards: list[dict] = []
        self.on_shard_closed: Callable[[str], None] | None = None  # the shard's file name, once it is complete
        self.max_token_id = -1
        self._open = False

    def add(self, flat: np.ndarray, lengths: np.ndarray) -> None:
        """Documents given as all their ids (``flat``) and each one's length; empty ones are dropped."""
        lengths = lengths[lengths > 0]
        if not len(lengths):
            return
        lo, hi = int(flat.min()), max(int(flat.max()), self.eod_id)
        if lo < 0 or hi > np.iinfo(self.dtype).max:
            raise JaxdistError(f"token id {lo if lo < 0 else hi} does not fit the storage dtype {self.dtype.name}")
        self.max_token_id = max(self.max_token_id, hi)
        sizes = lengths + 1  # each document and its EOD
        starts = np.concatenate([[0], np.cumsum(lengths)])
        i = 0
        while i < len(sizes):
            fill = self.shards[-1]["tokens"] if self._open else 0
            cumulative = np.cumsum(sizes[i:])
            k = int(np.searchsorted(cumulative, self.shard_tokens - fill, side="right"))  # documents that fit
            if k == 0 and self._open:
                self._close_shard()
                continue
            k = max(k, 1)  # a document larger than a shard gets one of its own
            if not self._open:
                self.shards.append({"path": self._open_shard(len(self.shards)), "documents": 0, "tokens": 0})
                self._open = True
            self._write(self._with_eods(flat[starts[i] : starts[i + k]], lengths[i : i + k]), sizes[i : i + k])
            self.shards[-1]["documents"] += k
            self.shards[-1]["tokens"] += int(cumulative[k - 1])
            i += k
            if i < len(sizes):
                self._close_shard()

    def _with_eods(self, flat: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """``flat`` in the storage dtype with ``eod_id`` after each document."""
        out = np.empty(len(flat) + len(lengths), dtype=self.dtype)
        ends = np.cumsum(lengths + 1) - 1
        if len(lengths) * 64 < len(flat):  # few long documents: copy slices
            src = 0
            for start, end in zip((ends - lengths).tolist(), ends.tolist(), strict=True):
                out[start:end] = flat[src : src + end - start]
                src += end - start
        else:
            mask = np.ones(len(out), dtype=bool)
            mask[ends] = False
            out[mask] = flat
        out[ends] = self.eod_id
        return out

    def close(self) -> list[dict]:
        if self._open:
            self._close_shard()
        return self.shards

    def _close_shard(self) -> None:
        self._finish_shard()
        self._open = False
        if self.on_shard_closed is not None:
            self.on_shard_closed(self.shards[-1]["path"])


class _BinWriter(_ShardWriter):
    def _open_shard(self, index: int) -> str:
        name = f"tokens-{index:05d}.bin"
        self._file = open(self.directory / name, "wb")  # noqa: SIM115 (closed in _finish_shard)
        self._buffer: list[np.ndarray] = []
        self._buffered = 0
        return name

    def _write(self, tokens: np.ndarray, sizes: np.ndarray) -> None:
        self._buffer.append(tokens)
        self._buffered += len(tokens)
        if self._buffered >= _FLUSH_TOKENS:
            self._flush()

    def _flush(self) -> None:
        for tokens in self._buffer:
            self._file.write(memoryview(tokens))
        self._buffer, self._buffered = [], 0

    def _finish_shard(self) -> None:
        self._flush()
        self._file.close()


class _ArrayRecordWriter(_ShardWriter):
    def _open_shard(self, index: int) -> str:
        name = f"docs-{index:05d}.array_record"
        self._writer = ArrayRecordWriter(str(self.directory / name), "group_size:1")
        self._lengths: list[np.ndarray] = []
        return name

    def _write(self, tokens: np.ndarray, sizes: np.ndarray) -> None:
        data = tokens.tobytes()
        ends = (np.cumsum(sizes) * tokens.itemsize).tolist()
        write = self._writer.write
        start = 0
        for end in ends:
            write(data[start:end])
            start = end
        self._lengths.append(sizes.astype(np.int64))

    def _finish_shard(self) -> None:
        self._writer.close()
        name = self.shards[-1]["path"]
        self.shards[-1]["lengths"] = lengths_file(name)
        np.save(self.directory / lengths_file(name), np.concatenate(self._lengths).astype(np.int64))


# -- tokenization --------------------------------------------------------------------------


def _encoded_batches(
    tokenizer: Tokenizer, files: list[Path], unit: str, records: RecordReading, workers: int, bar
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """``(ids, lengths)`` for chunks of documents, in input order; ``workers`` > 1 tokenizes in a process pool."""
    chunks = _document_chunks(files, unit, records, bar)
    if workers <= 1 or tokenizer.path is None:  # the byte tokenizer is faster in-process
        for chunk in chunks:
            yield tokenizer.encode_flat(chunk)
        return
    # spawn, not fork: the parent may hold threads (JAX, tokenizer libraries)
    with multiprocessing.get_context("spawn").Pool(workers, initializer=_init_worker, initargs=(tokenizer.path,)) as pool:
        pending: deque = deque()  # a bounded window keeps memory flat and the order intact
        for chunk in chunks:
            pending.append(pool.apply_async(_encode_in_worker, (chunk,)))
            if len(pending) >= 2 * workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


def _document_chunks(files: list[Path], unit: str, records: RecordReading, bar) -> Iterator[list[str]]:
    chunk: list[str] = []
    chars = 0
    for documents, nbytes in iter_document_blocks(files, unit, records):
        bar.update(nbytes)
        for start in range(0, len(documents), _CHUNK_DOCS):
            part = documents[start : start + _CHUNK_DOCS]
            chunk += part
            chars += sum(map(len, part))
            if chars >= _CHUNK_CHARS or len(chunk) >= _CHUNK_DOCS:
                yield chunk
                chunk, chars = [], 0
    if chunk:
        yield chunk


_worker_tokenizer: Tokenizer | None = None


def _init_worker(path: str) -> None:
    global _worker_tokenizer
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per worker process
    _worker_tokenizer = load_tokenizer(path)


def _encode_in_worker(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    assert _worker_tokenizer is not None
    return _worker_tokenizer.encode_flat(texts)


# -- output directory ----------------------------------------------------------------------


def _check_output(out: Path, overwrite: bool) -> None:
    if not out.exists():
        return
    if not out.is_dir():
        raise JaxdistError(f"output {out} exists and is not a directory")
    if not any(out.iterdir()):
        return
    if not overwrite:
        raise JaxdistError(f"output directory {out} is not empty (pass --overwrite to replace prepared data)")
    if not (out / META_FILE).is_file():
        raise JaxdistError(f"output directory {out} is not empty and holds no prepared data ({META_FILE}); not overwriting it")


def _make_dir(path: Path) -> None:
    if path.exists():
        shutil.rmtree(path)  # a leftover of an earlier run with the same pid
    path.mkdir(parents=True)


def _publish(tmp: Path, out: Path, overwrite: bool) -> None:
    _check_output(out, overwrite)  # again: something may have appeared meanwhile
    if out.exists() and any(out.iterdir()):
        old = out.with_name(f"{out.name}.old-{os.getpid()}")
        os.rename(out, old)
        try:
            os.rename(tmp, out)
        except OSError:
            os.rename(old, out)  # put the earlier data back
            raise
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, out)  # an empty DIR is replaced


def _write_json(path: Path, obj: dict) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)
        f.write("\n")


def _describe_inputs(inputs: str | Sequence[str]) -> str:
    return ", ".join(f"'{p}'" for p in ([inputs] if isinstance(inputs, str | os.PathLike) else inputs))


class _NoBar:
    def update(self, n: int) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass


def _progress_bar(total: int, enabled: bool):
    if not enabled:
        return _NoBar()
    # disable=None: only on a terminal; leave=False: the summary line replaces the bar
    return tqdm(total=total, unit="B", unit_scale=True, desc="prepare", file=sys.stderr, dynamic_ncols=True, disable=None, leave=False)


# -- CLI -----------------------------------------------------------------------------------


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got '{text}'") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--input",
        action="append",
        required=True,
        metavar="GLOB",
        help="text files: path, glob (** recurses), directory, or comma-separated list; repeatable",
    )
    parser.add_argument("--output", required=True, metavar="DIR", help="prepared data directory (must not exist or be empty)")
    parser.add_argument("--tokenizer", default=None, metavar="FILE", help="'byte' (default), a tokenizers .json or a SentencePiece .model")
    parser.add_argument(
        "--format", default="bin", choices=FORMATS, help="bin: flat token arrays (default); arrayrecord: a record per document"
    )
    parser.add_argument(
        "--unit",
        default="file",
        choices=UNITS,
        help="a document is a whole file (default) or one line; a record in .jsonl[.gz|.zst] / .parquet",
    )
    parser.add_argument(
        "--text-field", default="text", metavar="NAME", help="the JSON Lines field / Parquet column with the text (default text)"
    )
    parser.add_argument(
        "--bad-records",
        default="stop",
        choices=BAD_RECORDS,
        help="a record without the field, not UTF-8 or cut short: stop (default) or skip and count",
    )
    parser.add_argument(
        "--shard-tokens", type=_positive_int, default=DEFAULT_SHARD_TOKENS, metavar="N", help="tokens per shard (default 2**26)"
    )
    parser.add_argument("--workers", type=int, default=0, metavar="N", help="tokenizer processes (> 1: a process pool; not used for bytes)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing prepared data directory")


def run_cli(args: argparse.Namespace) -> dict:
    """Run ``prepare`` for parsed CLI arguments and print the one-line summary to stdout."""
    start = time.perf_counter()
    meta = prepare(
        args.input,
        args.output,
        tokenizer_path=args.tokenizer,
        fmt=args.format,
        unit=args.unit,
        shard_tokens=args.shard_tokens,
        workers=args.workers,
        overwrite=args.overwrite,
        progress=True,
        text_field=args.text_field,
        bad_records=args.bad_records,
    )
    seconds = time.perf_counter() - start
    mb = meta["input_bytes"] / 1e6
    print(
        f"jaxdist: prepared {meta['documents']} documents, {meta['tokens']} tokens, {len(meta['shards'])} shards "
        f"({meta['format']}, {meta['dtype']}) from {mb:.1f} MB input in {seconds:.2f} s ({mb / max(seconds, 1e-9):.1f} MB/s) "
        f"-> {redact(args.output)}",
        flush=True,
    )
    return meta
