"""This user's private directories under the temporary directory (mode 0700, checked): where a
GPU target compile keeps files XLA reads back by path (latency profiles, generated kernels).
XLA takes what it finds there as its own, so a directory another user could write to is refused."""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

from jaxdist.errors import JaxdistError


def private_directory(name: str, remedy: str) -> Path:
    """``$TMPDIR/NAME-UID``, created 0700 if missing; ``remedy`` ends the refusal of one that
    is not this user's private directory (what to do instead)."""
    directory = Path(tempfile.gettempdir()) / f"{name}-{os.getuid()}"
    directory.mkdir(mode=0o700, exist_ok=True)
    info = directory.lstat()
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise JaxdistError(f"{directory} is not a private directory of this user: remove it ({remedy})")
    return directory
