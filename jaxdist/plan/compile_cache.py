"""Where the planner keeps its compiled programs' summaries, and what a summary depends on
besides the config: JAX's version and jaxdist's own source."""

from __future__ import annotations

import functools
import hashlib
import os
from pathlib import Path


def cache_dir() -> Path:
    root = os.environ.get("JAXDIST_CACHE_DIR")
    return (Path(root) if root else Path.home() / ".cache" / "jaxdist") / "plan"


def source_digest(package: Path) -> str:
    """A digest of the ``.py`` files under ``package`` (names and contents)."""
    digest = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        digest.update(str(path.relative_to(package)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


@functools.cache
def program_source() -> str:
    """jaxdist's own source digest: the compiled program is the code's as much as the config's,
    so an edited or upgraded jaxdist compiles again instead of reading a stale summary."""
    return source_digest(Path(__file__).resolve().parents[1])
