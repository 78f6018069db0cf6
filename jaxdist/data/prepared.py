"""A prepared-data folder as ``prepare`` leaves it: ``meta.json`` and its shards, checked
before a run reads them, on local disk or in object storage."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from jaxdist.errors import JaxdistError
from jaxdist.storage.remote import Folder

VERSION = 1
FORMATS = ("bin", "arrayrecord")
META_FILE = "meta.json"


def read_meta(directory: str | os.PathLike) -> dict:
    """The meta of a prepared-data directory (local or in object storage), after checking that
    its shards are all there, as files of the folder itself (a shard path that leads elsewhere is
    missing), of the sizes meta.json gives."""
    folder = Folder(directory)
    d = str(folder)
    sizes = folder.sizes()
    if META_FILE not in sizes:
        raise JaxdistError(f"{d} is not a prepared data directory (no {META_FILE})")
    try:
        meta = json.loads(folder.read_bytes(META_FILE))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise JaxdistError(f"corrupt prepared data {d}: cannot read {META_FILE} ({e})") from None
    if not isinstance(meta, dict) or meta.get("version") != VERSION:
        version = meta.get("version") if isinstance(meta, dict) else None
        raise JaxdistError(f"unsupported prepared data {d}: version {version!r} (this jaxdist reads version {VERSION})")
    missing = [k for k in ("format", "dtype", "vocab_size", "eod_id", "documents", "tokens", "shards") if k not in meta]
    if missing:
        raise JaxdistError(f"corrupt prepared data {d}: {META_FILE} lacks {', '.join(missing)}")
    if meta["format"] not in FORMATS or meta["dtype"] not in ("uint16", "uint32"):
        raise JaxdistError(f"corrupt prepared data {d}: format {meta['format']!r}, dtype {meta['dtype']!r}")
    if meta["format"] != "bin" and folder.remote:
        raise JaxdistError(f"{d}: ArrayRecord shards cannot be read from object storage; prepare it with --format bin")
    itemsize = np.dtype(meta["dtype"]).itemsize
    for shard in meta["shards"]:
        name = str(shard.get("path", ""))
        if name not in sizes:
            raise JaxdistError(f"corrupt prepared data {d}: shard {name} is missing")
        if meta["format"] == "bin":
            size, expected = sizes[name], shard["tokens"] * itemsize
            if size != expected:
                raise JaxdistError(f"corrupt prepared data {d}: shard {name} has {size} bytes, expected {expected}")
        else:
            lengths_name = shard.get("lengths", lengths_file(name))
            try:
                lengths = np.load(Path(folder.location) / lengths_name) if lengths_name in sizes else None
            except (OSError, ValueError) as e:
                raise JaxdistError(f"corrupt prepared data {d}: cannot read {lengths_name} ({e})") from None
            if lengths is None:
                raise JaxdistError(f"corrupt prepared data {d}: {lengths_name} is missing")
            if len(lengths) != shard["documents"] or int(lengths.sum()) != shard["tokens"]:
                raise JaxdistError(
                    f"corrupt prepared data {d}: {lengths_name} has {len(lengths)} documents / {int(lengths.sum())} tokens, "
                    f"expected {shard['documents']} / {shard['tokens']}"
                )
    if sum(s["tokens"] for s in meta["shards"]) != meta["tokens"]:
        raise JaxdistError(f"corrupt prepared data {d}: shard token counts do not add up to {meta['tokens']}")
    return meta


def lengths_file(record_file: str) -> str:
    """``docs-00000.array_record`` -> ``docs-00000.lengths.npy``."""
    return record_file.removesuffix(".array_record") + ".lengths.npy"
