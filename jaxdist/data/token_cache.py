"""Tokenized text kept on disk: a process that opens the same local files with the same
tokenizer maps their tokens instead of encoding them again. The default corpus (the
interpreter's standard library, 31 MB of source) took 1 to 3 s of CPU to encode in every
process of a run, at every restart and in every replacement.

An entry is keyed by what its tokens depend on: each file's path, size and modification time,
the tokenizer file's contents (and its library's version), how documents are cut, and the
source of ``jaxdist.data`` (the reading rules live there). Entries are written whole (a
temporary file renamed) in ``$JAXDIST_CACHE/tokens`` (``~/.cache/jaxdist/tokens``), created
private. A damaged entry is said in one line and encoded again; a folder that cannot be written
is said once and the tokens are kept in memory only.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.metadata
import json
import logging
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np

from jaxdist.data.tokenizers import file_sha256
from jaxdist.plan.compile_cache import source_digest

log = logging.getLogger(__name__)

FORMAT = 1  # of an entry: a .npy of the token ids, nothing else


def cache_root() -> Path:
    return Path(os.environ.get("JAXDIST_CACHE", Path.home() / ".cache" / "jaxdist")) / "tokens"


def corpus_key(files: tuple[Path, ...], tokenizer_path: str, how: tuple) -> str | None:
    """The entry's name for ``files`` encoded by ``tokenizer_path`` ("" for bytes) read as ``how``;
    None when a file is not a local file (an object store's is not stat'ed here)."""
    digest = hashlib.sha256(json.dumps([FORMAT, _tokenizer_identity(tokenizer_path), list(how), _reading_rules()]).encode())
    for file in files:
        try:
            info = os.stat(file)
        except (OSError, TypeError, ValueError):
            return None
        digest.update(f"{os.path.abspath(file)}\0{info.st_size}\0{info.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:32]


def cached_tokens(key: str | None, encode: Callable[[], tuple[np.ndarray, bool]]) -> np.ndarray:
    """The entry ``key``'s tokens, else ``encode()``'s (tokens, whether they may be kept), kept."""
    if key is None:
        return encode()[0]
    path = cache_root() / f"{key}.npy"
    try:
        return np.load(path, mmap_mode="r", allow_pickle=False)
    except (FileNotFoundError, NotADirectoryError):
        pass
    except (OSError, ValueError) as e:  # cut short or overwritten from outside: entries are written whole
        log.warning(f"tokenized corpus cache {path} is unreadable ({getattr(e, 'strerror', None) or e}); encoding the corpus again")
        with contextlib.suppress(OSError):
            path.unlink()
    tokens, keep = encode()
    if keep:
        _store(path, tokens)
    return tokens


def _store(path: Path, tokens: np.ndarray) -> None:
    partial = path.with_name(f"{path.stem}.{os.getpid()}.partial.npy")
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        np.save(partial, tokens, allow_pickle=False)
        partial.replace(path)
    except OSError as e:
        with contextlib.suppress(OSError):
            partial.unlink()
        _say_unwritable(str(path.parent), e.strerror or str(e))


@functools.cache
def _say_unwritable(folder: str, why: str) -> None:
    log.info(f"tokenized corpora are not kept in {folder} ({why}): each process encodes its corpus")


def _tokenizer_identity(tokenizer_path: str) -> list[str]:
    if not tokenizer_path:
        return ["byte"]
    library = "tokenizers" if tokenizer_path.endswith(".json") else "sentencepiece"
    try:
        version = importlib.metadata.version(library)
    except importlib.metadata.PackageNotFoundError:
        version = ""
    return [file_sha256(os.path.expanduser(tokenizer_path)), library, version]


@functools.cache
def _reading_rules() -> str:
    return source_digest(Path(__file__).resolve().parent)
