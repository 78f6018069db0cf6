"""Blocks of remote files kept on local disk (``data.cache_dir``): shared by the processes of a
machine, kept across runs, at most ``data.cache_gb``, the least recently used removed first.

A block's file name is a digest of the object's URL, its version (its ETag, so a rewritten
object is never served stale) and the block, so any process finds what another fetched. Files
are written under a temporary name and renamed, so a reader never sees half a block; a block
removed by another process's eviction is simply fetched again.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import threading
from pathlib import Path

_shared: dict[tuple[str, int], BlockCache] = {}
_shared_lock = threading.Lock()


def block_cache(directory: str | os.PathLike, limit_bytes: int) -> BlockCache:
    """The process's one cache of ``directory``: every shard's blocks count against one limit."""
    key = (str(Path(directory).expanduser().resolve()), int(limit_bytes))
    with _shared_lock:
        if key not in _shared:
            _shared[key] = BlockCache(*key)
        return _shared[key]


class BlockCache:
    def __init__(self, directory: str | os.PathLike, limit_bytes: int):
        self.directory = Path(directory).expanduser()
        self.directory.mkdir(parents=True, exist_ok=True)
        self.limit_bytes = int(limit_bytes)
        self._used: int | None = None  # this process's running estimate; rescanned on eviction
        self._lock = threading.Lock()

    @staticmethod
    def key(url: str, version: str, block_tokens: int, index: int) -> str:
        digest = hashlib.sha256(f"{url}\n{version}\n{block_tokens}".encode()).hexdigest()[:32]
        return f"{digest}-{index}.blk"

    def get(self, key: str) -> bytes | None:
        path = self.directory / key
        try:
            data = path.read_bytes()
            os.utime(path)  # recently used: evicted last
        except FileNotFoundError:
            return None
        return data

    def put(self, key: str, data: bytes) -> None:
        if len(data) > self.limit_bytes:
            return
        tmp = self.directory / f".{key}.{os.getpid()}.{threading.get_ident()}.tmp"
        tmp.write_bytes(data)
        os.replace(tmp, self.directory / key)
        with self._lock:
            self._used = (self._scan() if self._used is None else self._used) + len(data)
            if self._used > self.limit_bytes:
                self._evict()

    def _files(self) -> list[os.DirEntry]:
        return [e for e in os.scandir(self.directory) if e.is_file() and e.name.endswith(".blk")]

    def _scan(self) -> int:
        return sum(e.stat().st_size for e in self._files())

    def _evict(self) -> None:
        """Down to 90% of the limit, oldest first (by last use)."""
        entries = []
        for e in self._files():
            try:
                stat = e.stat()
            except FileNotFoundError:  # another process evicted it meanwhile
                continue
            entries.append((stat.st_mtime, stat.st_size, e.path))
        entries.sort()
        used = sum(size for _, size, _ in entries)
        for _, size, path in entries:
            if used <= 0.9 * self.limit_bytes:
                break
            with contextlib.suppress(FileNotFoundError):  # another process's eviction was first
                os.remove(path)
            used -= size
        self._used = used
