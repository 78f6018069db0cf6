"""Where tokens come from: a flat, random-access token stream per corpus.

Every corpus becomes one stream of token ids in which each document is followed by the
end-of-document id. Packing then cuts fixed windows out of that stream by offset, which
needs only ``read(start, stop)``: from memory (the standard library, text files), from
memory-mapped ``.bin`` shards, or from ArrayRecord shards indexed by their lengths.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import os
import sysconfig
import threading
from pathlib import Path
from typing import Protocol

import numpy as np
from array_record.python.array_record_module import ArrayRecordReader

from jaxdist.config import Config
from jaxdist.data.prepared import lengths_file, read_meta
from jaxdist.data.records import RecordReading
from jaxdist.data.text import expand_inputs, iter_documents
from jaxdist.data.token_cache import cached_tokens, corpus_key
from jaxdist.data.tokenizers import file_sha256, load_tokenizer
from jaxdist.errors import ConfigError, JaxdistError
from jaxdist.storage.block_cache import BlockCache, block_cache
from jaxdist.storage.remote import Folder, is_remote, redact

log = logging.getLogger(__name__)


class TokenStream(Protocol):
    n_tokens: int

    def read(self, start: int, stop: int) -> np.ndarray: ...


class ArrayStream:
    """A stream held in memory."""

    def __init__(self, tokens: np.ndarray):
        self.tokens = tokens
        self.n_tokens = len(tokens)

    def read(self, start: int, stop: int) -> np.ndarray:
        return self.tokens[start:stop]


class ShardedStream:
    """Several streams back to back (``.bin`` shards, ArrayRecord shards)."""

    def __init__(self, shards: list[TokenStream]):
        self.shards = shards
        self.offsets = np.cumsum([0] + [s.n_tokens for s in shards])
        self.n_tokens = int(self.offsets[-1])
        self.reads_wait = any(getattr(s, "reads_wait", False) for s in shards)  # on a network: Grain's read threads overlap the waits

    def read(self, start: int, stop: int) -> np.ndarray:
        first = int(np.searchsorted(self.offsets, start, side="right")) - 1
        pieces = []
        for i in range(first, len(self.shards)):
            lo = self.offsets[i]
            if lo >= stop:
                break
            pieces.append(self.shards[i].read(max(start - lo, 0), min(stop, self.offsets[i + 1]) - lo))
        return np.concatenate(pieces) if len(pieces) != 1 else pieces[0]


class MemmapShard:
    """A flat ``.bin`` token file, memory-mapped lazily (pickles as its path, not its data)."""

    def __init__(self, path: Path, dtype: str, n_tokens: int):
        self.path, self.dtype, self.n_tokens = Path(path), dtype, n_tokens

    @functools.cached_property
    def _array(self) -> np.ndarray:
        return np.memmap(self.path, dtype=self.dtype, mode="r")

    def read(self, start: int, stop: int) -> np.ndarray:
        return np.asarray(self._array[start:stop])

    def __getstate__(self) -> dict:
        return {"path": self.path, "dtype": self.dtype, "n_tokens": self.n_tokens}


class RemoteShard:
    """A flat ``.bin`` token file in object storage, read by range requests of ``BLOCK_TOKENS``
    tokens, the newest ``CACHE_BLOCKS`` of them kept in memory (a packed window usually lies in
    one block; pickles as its URL, for Grain's worker processes)."""

    BLOCK_TOKENS = 1 << 16
    CACHE_BLOCKS = 64
    reads_wait = True

    def __init__(self, location: str, name: str, dtype: str, n_tokens: int, version: str = "", cache: tuple[str, int] | None = None):
        self.location, self.name, self.dtype, self.n_tokens = location, name, dtype, n_tokens
        self.version, self.cache = version, cache  # cache: (data.cache_dir, its limit in bytes)
        self._blocks: collections.OrderedDict[int, np.ndarray] = collections.OrderedDict()
        self._lock = threading.Lock()

    @functools.cached_property
    def _folder(self) -> Folder:
        return Folder(self.location)

    @functools.cached_property
    def _disk(self) -> BlockCache | None:
        return block_cache(*self.cache) if self.cache else None

    def _fetch(self, index: int, lo: int, hi: int) -> bytes:
        itemsize = np.dtype(self.dtype).itemsize
        key = BlockCache.key(f"{self.location}/{self.name}", self.version, self.BLOCK_TOKENS, index)
        if self._disk is not None and (data := self._disk.get(key)) is not None and len(data) == (hi - lo) * itemsize:
            return data
        data = self._folder.read_bytes(self.name, lo * itemsize, hi * itemsize)
        if self._disk is not None and len(data) == (hi - lo) * itemsize:
            self._disk.put(key, data)
        return data

    def read(self, start: int, stop: int) -> np.ndarray:
        first, last = start // self.BLOCK_TOKENS, (stop - 1) // self.BLOCK_TOKENS
        pieces = [self._block(b) for b in range(first, last + 1)]
        flat = np.concatenate(pieces) if len(pieces) > 1 else pieces[0]
        offset = start - first * self.BLOCK_TOKENS
        return flat[offset : offset + stop - start]

    def _block(self, index: int) -> np.ndarray:
        with self._lock:
            if index in self._blocks:
                self._blocks.move_to_end(index)
                return self._blocks[index]
        itemsize = np.dtype(self.dtype).itemsize
        lo, hi = index * self.BLOCK_TOKENS, min((index + 1) * self.BLOCK_TOKENS, self.n_tokens)
        data = self._fetch(index, lo, hi)
        if len(data) != (hi - lo) * itemsize:
            raise JaxdistError(
                f"prepared data {self._folder}: shard {self.name} is shorter than its metadata says "
                f"({lo * itemsize + len(data)} bytes, expected {self.n_tokens * itemsize})"
            )
        block = np.frombuffer(data, dtype=self.dtype)
        with self._lock:
            self._blocks[index] = block
            while len(self._blocks) > self.CACHE_BLOCKS:
                self._blocks.popitem(last=False)
        return block

    def __getstate__(self) -> dict:
        return {k: getattr(self, k) for k in ("location", "name", "dtype", "n_tokens", "version", "cache")}

    def __setstate__(self, state: dict) -> None:
        self.__init__(**state)


class ArrayRecordShard:
    """One ArrayRecord file of documents (records hold their tokens, EOD included),
    indexed by the per-record lengths that ``prepare`` stores beside it."""

    def __init__(self, path: Path, dtype: str, lengths: np.ndarray):
        self.path, self.dtype = Path(path), dtype
        self.offsets = np.concatenate([[0], np.cumsum(lengths)])
        self.n_tokens = int(self.offsets[-1])

    @functools.cached_property
    def _reader(self):
        return ArrayRecordReader(str(self.path), "readahead_buffer_size:0")

    def read(self, start: int, stop: int) -> np.ndarray:
        first = int(np.searchsorted(self.offsets, start, side="right")) - 1
        last = int(np.searchsorted(self.offsets, stop, side="left"))
        records = self._reader.read(list(range(first, last)))
        tokens = np.concatenate([np.frombuffer(r, dtype=self.dtype) for r in records])
        base = self.offsets[first]
        return tokens[start - base : stop - base]

    def __getstate__(self) -> dict:
        return {"path": self.path, "dtype": self.dtype, "offsets": self.offsets, "n_tokens": self.n_tokens}


@dataclasses.dataclass(frozen=True)
class Corpus:
    name: str
    stream: TokenStream
    vocab_size: int  # ids the model must embed (tokenizer's, EOD included)
    eod_id: int
    max_token_id: int


@functools.cache
def stdlib_files() -> tuple[Path, ...]:
    """The running interpreter's own standard-library sources: present on every machine
    (listed once per process: the walk takes seconds)."""
    found = []
    for folder, subfolders, names in os.walk(sysconfig.get_paths()["stdlib"], followlinks=True):
        subfolders[:] = [d for d in subfolders if d not in ("site-packages", "dist-packages")]  # installed packages: not walked
        found += [Path(folder, name) for name in names if name.endswith(".py")]
    return tuple(sorted(found))


def _encode_documents(documents, tokenizer) -> np.ndarray:
    pieces = []
    eod = np.array([tokenizer.eod_id], dtype=np.int64)
    for text in documents:
        pieces += [np.asarray(tokenizer.encode(text), dtype=np.int64), eod]
    if not pieces:
        raise JaxdistError("input is empty: no documents")
    tokens = np.concatenate(pieces)
    return tokens.astype(np.uint16 if tokenizer.vocab_size <= 65536 else np.uint32)


@functools.cache
def _text_corpus(
    name: str, files: tuple[Path, ...], tokenizer_path: str, unit: str, field: str = "text", bad_records: str = "stop"
) -> Corpus:
    tokenizer = load_tokenizer(tokenizer_path or None)

    def encode() -> tuple[np.ndarray, bool]:
        records = RecordReading(field, bad_records)
        tokens = _encode_documents(iter_documents(list(files), unit, records), tokenizer)
        if records.skipped:
            log.warning(records.summary())
        return tokens, not records.skipped  # a corpus with skipped records is read again, and says so again

    tokens = cached_tokens(corpus_key(files, tokenizer_path, (unit, field, bad_records)), encode)
    return Corpus(name, ArrayStream(tokens), tokenizer.vocab_size, tokenizer.eod_id, int(tokens.max()))


def _prepared_corpus(path: str, tokenizer: str, cache_dir: str = "", cache_gb: float = 0.0) -> Corpus:
    meta = read_meta(path)
    check_prepared_tokenizer(meta, path, tokenizer)
    if is_remote(path):  # read_meta refuses ArrayRecord there
        location = path.rstrip("/")
        versions = {name: version for name, (_, version) in Folder(location).listing().items()}
        cache = (cache_dir, int(cache_gb * 1e9)) if cache_dir else None
        block_bytes = RemoteShard.BLOCK_TOKENS * np.dtype(meta["dtype"]).itemsize
        if cache and cache[1] < block_bytes:  # every block would be over the limit: nothing cached, silently
            raise ConfigError(
                f"data.cache_gb={cache_gb:g} is less than one cached block of {path} ({block_bytes / 1e9:.6f} GB): "
                "nothing would be cached; raise it, or unset data.cache_dir"
            )
        shards = [RemoteShard(location, s["path"], meta["dtype"], s["tokens"], versions.get(s["path"], ""), cache) for s in meta["shards"]]
        return Corpus(f"tokens:{redact(location)}", ShardedStream(shards), meta["vocab_size"], meta["eod_id"], meta["max_token_id"])
    root = Path(path)
    shards: list[TokenStream] = []
    for shard in meta["shards"]:
        file = root / shard["path"]
        if meta["format"] == "bin":
            shards.append(MemmapShard(file, meta["dtype"], shard["tokens"]))
        else:
            lengths = np.load(root / lengths_file(shard["path"]))
            shards.append(ArrayRecordShard(file, meta["dtype"], lengths))
    return Corpus(f"tokens:{root.name}", ShardedStream(shards), meta["vocab_size"], meta["eod_id"], meta["max_token_id"])


def prepared_tokenizer(meta: dict) -> str:
    """The ``data.tokenizer`` value for the tokenizer a prepared folder was made with
    (``prepare`` records it in meta.json): ``byte`` or its file; "" when not recorded."""
    recorded = meta.get("tokenizer")
    if not isinstance(recorded, dict):
        return ""
    if recorded.get("kind") == "byte":
        return "byte"
    return str(recorded.get("path") or "")


def check_prepared_tokenizer(meta: dict, path: str, tokenizer: str) -> None:
    """Raise unless ``data.tokenizer`` is the tokenizer the prepared data was made with
    (the same file contents; bytes for bytes)."""
    recorded = meta.get("tokenizer")
    if not tokenizer or not isinstance(recorded, dict):
        return
    if recorded.get("kind") == "byte" or tokenizer == "byte":
        same = recorded.get("kind") == "byte" and tokenizer == "byte"
    else:
        file = Path(tokenizer).expanduser()
        same = file.is_file() and file_sha256(str(file)) == recorded.get("sha256")
    if not same:
        made_with = "bytes" if recorded.get("kind") == "byte" else f"{recorded.get('path')} (sha256 {str(recorded.get('sha256'))[:12]})"
        raise JaxdistError(f"prepared data {path} was tokenized with {made_with}, but data.tokenizer is {tokenizer}: another tokenizer")


def open_corpus(config: Config) -> Corpus:
    """The token corpus named by ``data.source`` / ``data.path`` (not for ``synthetic``)."""
    d = config.data
    tokenizer = "" if d.tokenizer == "byte" else d.tokenizer  # one cache entry for bytes, however named
    if d.source == "stdlib":
        return _text_corpus("stdlib", stdlib_files(), tokenizer, "file")
    if d.source == "text":
        if not d.path:
            raise JaxdistError("data.source=text needs data.path (files, globs or a directory)")
        return _text_corpus(f"text:{d.path}", tuple(expand_inputs(d.path)), tokenizer, d.text_unit, d.text_field, d.bad_records)
    if d.source == "tokens":
        if not d.path:
            raise JaxdistError("data.source=tokens needs data.path (a directory written by `python -m jaxdist.data prepare`)")
        if d.cache_dir and not is_remote(d.path):
            log.info(f"data.cache_dir has no effect on local shards ({d.path}): they are read in place")
        return _prepared_corpus(d.path, d.tokenizer, d.cache_dir, d.cache_gb)
    raise ValueError(f"no corpus for data.source={d.source!r}")


def record_tokenizer(config: Config) -> None:
    """Make ``data.tokenizer`` name the tokenizer the data is made with, so that a run's
    saved config carries it to ``generate`` and ``eval``: ``data.source=tokens`` takes the
    prepared data's (from its meta.json) when none is given, text and chat are ``byte`` when
    none is given ("" stays for a model whose tokenizer is unknown, e.g. one converted
    without one), and a relative path becomes absolute (a saved config's relative path is
    read against its run directory), ``data.chat_template``'s too. A config that already
    says so is left untouched (a resolved, frozen one included)."""
    d = config.data
    tokenizer = d.tokenizer
    if d.source == "tokens" and not tokenizer and d.path:
        tokenizer = prepared_tokenizer(read_meta(d.path))
        if tokenizer not in ("", "byte") and not Path(tokenizer).is_file():
            raise JaxdistError(
                f"prepared data {d.path} was tokenized with {tokenizer}, which is gone; "
                "pass data.tokenizer=FILE (that same file) so that the run records its tokenizer"
            )
    elif d.source in ("stdlib", "text", "chat", "preference") and not tokenizer:
        tokenizer = "byte"
    if tokenizer and tokenizer != "byte" and not Path(tokenizer).expanduser().is_absolute():
        tokenizer = str(Path(tokenizer).expanduser().absolute())
    if tokenizer != d.tokenizer:
        d.tokenizer = tokenizer
    if d.chat_template and not Path(d.chat_template).expanduser().is_absolute():  # generate and to-hf read it from the saved config
        d.chat_template = str(Path(d.chat_template).expanduser().absolute())


def data_vocab_size(config: Config) -> int:
    """Ids the data needs the model to embed, read without tokenizing the corpus: from the
    tokenizer (a recorded one, for prepared data), so a checkpoint's tools need no data."""
    d = config.data
    if d.source == "synthetic":
        return 256
    if d.source == "tokens" and not d.tokenizer:
        return int(read_meta(d.path)["vocab_size"]) if d.path else 0
    return load_tokenizer(d.tokenizer or None).vocab_size


def pad_vocab(n: int, multiple: int = 128) -> int:
    """Round the embedding up so it splits evenly over tensor-parallel devices."""
    return -(-n // multiple) * multiple


def resolve_vocab(config: Config) -> None:
    """``model.vocab_size=0`` follows the data's tokenizer (padded to a multiple of 128)."""
    if config.model.kind != "llama":
        return
    record_tokenizer(config)  # the run's saved config names the data's tokenizer, for generate and eval
    needed = data_vocab_size(config)
    if config.model.vocab_size == 0:  # a resolved config already has its size
        config.model.vocab_size = pad_vocab(needed)
    elif config.model.vocab_size < needed:
        raise JaxdistError(f"model.vocab_size ({config.model.vocab_size}) is smaller than the tokenizer's {needed} ids")
