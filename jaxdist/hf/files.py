"""The files of a Hugging Face model folder, and the copies a converted checkpoint keeps.

A folder someone hands over may hold symlinks or an index whose entries point elsewhere
(``chat_template.jinja -> ../secret.txt``, ``"/etc/passwd"`` in the weight map). Every
file read from one is resolved first and must stay inside it; one that leads out is an
error naming it. The one exception is the Hugging Face hub cache, whose snapshot folders
(``models--org--name/snapshots/REV``) link each file into their own repository's
``blobs/``: links from a snapshot may lead into that ``blobs/`` folder, nowhere else.

``from-hf`` keeps the tokenizer files and ``config.json`` of the imported model in
``OUT/hf_source``; ``to-hf`` writes them back and ``generate`` reads its stop ids there.
"""

from __future__ import annotations

import json
from pathlib import Path

from jaxdist.config import Config
from jaxdist.errors import JaxdistError

SOURCE_DIR = "hf_source"  # OUT/hf_source: the tokenizer files and config.json of the imported model
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "chat_template.jinja",
)
DTYPES = ("auto", "float32", "bfloat16", "float16")  # to-hf's --dtype (auto: the imported model's, else float32)


def _allowed_roots(folder: Path) -> list[Path]:
    root = folder.resolve()
    blobs = root.parent.parent / "blobs"
    if root.parent.name == "snapshots" and blobs.is_dir():  # the hub cache: snapshots link into the repository's blobs
        return [root, blobs.resolve()]
    return [root]


def inside(folder: Path, name: str | Path) -> Path:
    """``folder / name`` with every link resolved; raises (one line, naming it) when that
    leads outside ``folder`` (an absolute name, ``..``, or a symlink out)."""
    target = (folder / name).resolve()
    if not any(target.is_relative_to(root) for root in _allowed_roots(folder)):
        raise JaxdistError(f"{folder}: {name} leads outside the folder (to {target}); copy the file in instead of linking to it")
    return target


def optional_file(folder: Path, name: str) -> Path | None:
    """The resolved file ``folder / name``, or None when there is none; a link out of the
    folder, or one that leads to no file, is an error."""
    path = folder / name
    if not (path.exists() or path.is_symlink()):
        return None
    target = inside(folder, name)
    if not target.is_file():
        raise JaxdistError(f"{folder}: {name} is not a file" + (f" (it links to {target})" if path.is_symlink() else ""))
    return target


def read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise JaxdistError(f"{path}: no such file") from None
    except (OSError, ValueError) as e:
        raise JaxdistError(f"{path}: unreadable JSON ({e})") from None
    if not isinstance(data, dict):
        raise JaxdistError(f"{path}: expected a JSON object")
    return data


def source_dir(config: Config, step_dir: Path) -> Path | None:
    """The imported model's ``hf_source`` folder: beside a converted checkpoint, or for a
    run fine-tuned from one, where its tokenizer path points."""
    beside = step_dir.parent.parent / SOURCE_DIR
    if beside.is_dir():
        return beside
    folder = Path(config.data.tokenizer).parent if config.data.tokenizer not in ("", "byte") else None
    return folder if folder is not None and folder.name == SOURCE_DIR and folder.is_dir() else None


def eos_ids(source: Path | None) -> list[int]:
    """The ids Hugging Face's ``generate`` stops at: ``generation_config.json``'s
    ``eos_token_id`` (one id or a list, e.g. Llama 3's ``<|end_of_text|>`` and
    ``<|eot_id|>``), else ``config.json``'s; [] without either."""
    if source is None:
        return []
    for name in ("generation_config.json", "config.json"):
        path = optional_file(source, name)
        if path is None:
            continue
        value = read_json(path).get("eos_token_id")
        if value is None:
            continue
        ids = value if isinstance(value, list) else [value]
        if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
            raise JaxdistError(f"{path}: eos_token_id {value!r} is not a token id or a list of them")
        return list(ids)
    return []
