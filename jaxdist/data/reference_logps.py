"""The file of ``data.reference_logps``: each preference row's reference log-probability, stored
beside the data (``training.reference_pass`` computes it; ``data.preference`` reads it into the
batches).

A NumPy ``.npz`` of two arrays: ``logps`` (float32, one per row: pair i's chosen answer is row
2i, its rejected one 2i+1) and ``meta``, a JSON string: the format, a digest of the tokenised
pairs (what the data, the tokenizer, the chat template and ``train.seq_len`` made of them) and
what the reference was (``--init-from``'s checkpoint, or the seed and the model's
configuration). Read with ``allow_pickle=False``: a file holding Python objects is refused,
never unpickled.
"""

from __future__ import annotations

import hashlib
import json
import os
import zipfile
from pathlib import Path

import numpy as np

from jaxdist.errors import JaxdistError

FORMAT = 1
KEY = "reference_logps"  # the batch key: each row's reference log-probability


def pairs_digest(tokens: np.ndarray, offsets: np.ndarray, prompt_lengths: np.ndarray, seq_len: int) -> str:
    """A digest of the tokenised pairs: any change to what the rows hold changes it."""
    digest = hashlib.sha256(f"seq_len={seq_len};".encode())
    for array in (tokens, offsets, prompt_lengths):
        digest.update(np.ascontiguousarray(array, np.int64).tobytes())
    return digest.hexdigest()


def read(path: str | Path, digest: str, rows: int) -> tuple[np.ndarray, dict]:
    """(the log-probabilities [rows], the file's meta) of ``path``, checked against the pairs' digest."""
    where = f"data.reference_logps {path}"
    try:
        with np.load(path, allow_pickle=False) as stored:
            logps, meta = np.asarray(stored["logps"]), json.loads(str(stored["meta"]))
    except FileNotFoundError:
        raise
    except (OSError, ValueError, KeyError, zipfile.BadZipFile, json.JSONDecodeError) as e:
        raise JaxdistError(
            f"{where} is not a reference log-probabilities file ({(str(e).splitlines() or [type(e).__name__])[0]})"
        ) from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise JaxdistError(f"{where}: format {meta.get('format') if isinstance(meta, dict) else '?'}, this jaxdist reads {FORMAT}")
    if meta.get("pairs") != digest:
        raise JaxdistError(
            f"{where} was computed for other pairs (the data, tokenizer, chat template or train.seq_len changed): "
            "give a new path to compute them again"
        )
    if logps.dtype != np.float32 or logps.shape != (rows,) or not np.all(np.isfinite(logps)):
        raise JaxdistError(f"{where}: {logps.dtype}{list(logps.shape)} with finite values expected float32[{rows}]")
    return logps, meta


def write(path: str | Path, logps: np.ndarray, digest: str, reference: dict) -> None:
    """``path`` written whole or not at all (a temporary file renamed into place)."""
    path = Path(path)
    meta = json.dumps({"format": FORMAT, "pairs": digest, "reference": reference}, sort_keys=True)
    partial = path.with_name(f".{path.name}.partial-{os.getpid()}")
    try:
        with open(partial, "wb") as out:
            np.savez(out, logps=np.asarray(logps, np.float32), meta=np.asarray(meta))
        os.replace(partial, path)
    except OSError as e:
        partial.unlink(missing_ok=True)
        raise JaxdistError(f"data.reference_logps {path}: cannot write it ({e.strerror})") from None
