"""XLA's persistent compilation cache for a run (``train.compile_cache``): a restarted
run finds its compiled programs instead of compiling again. XLA loads and runs the
native code it finds there, so only a private directory is accepted.

On GPUs the step's cuDNN attention is one of JAX's ``custom_partitioning`` ops, whose program
text holds the address of a Python object (jax-ml/jax#21159): every process computed another
key, and a restart or a replacement process compiled again whatever the cache held. The
programs are keyed without that address (``jax_remove_custom_partitioning_ptr_from_cache_key``)
in a folder of the cache per model configuration: the address stood for the attention's static
arguments (scale, mask, window), which the ``model.*`` keys fix, so two programs that differ only
there never share a folder (the mesh is left out: a process that compiles ahead for the mesh a
recovery will land on fills the folder its replacement reads).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from jaxdist.config import Config
from jaxdist.errors import JaxdistError


def compile_cache_dir(config: Config, run_dir: Path | None) -> Path | None:
    """Where XLA's persistent compilation cache goes, checked (nothing is created yet).

    ``train.compile_cache``: ``auto`` (``RUN_DIR/xla_cache``; none without a run dir),
    ``off``, or a directory. The cache holds native code that XLA loads and runs, so a
    directory someone else can write to is refused: it must be this user's, and not
    group- or world-writable.
    """
    choice = config.train.compile_cache
    if choice == "off" or (choice == "auto" and run_dir is None):
        return None
    path = run_dir / "xla_cache" if choice == "auto" else Path(choice)
    _check_private(path)
    return path


def _check_private(path: Path) -> None:
    import stat

    try:
        info = path.stat()
    except (FileNotFoundError, NotADirectoryError):
        return  # created private (0700) by enable_compile_cache (or the run directory cannot be, said later)
    except OSError as e:
        raise JaxdistError(f"train.compile_cache {path}: {e.strerror}") from None
    if not stat.S_ISDIR(info.st_mode):
        raise JaxdistError(f"train.compile_cache {path} is not a directory")
    if info.st_uid != os.getuid():
        raise JaxdistError(
            f"train.compile_cache {path} belongs to another user (uid {info.st_uid}): XLA would run the native code it holds; "
            "use a directory of your own (the default, train.compile_cache=auto, is RUN_DIR/xla_cache)"
        )
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise JaxdistError(
            f"train.compile_cache {path} is writable by others (mode {stat.S_IMODE(info.st_mode):o}): XLA would run whatever native "
            f"code is put there; chmod go-w {path}, or use a private directory"
        )


def enable_compile_cache(config: Config, run_dir: Path | None) -> Path | None:
    """Turn on XLA's persistent compilation cache, so a restarted run does not compile
    again (see ``compile_cache_dir``), in ``program_family``'s folder of it, which is returned.
    The cache is per process: the first run that sets it wins."""
    import jax

    path = compile_cache_dir(config, run_dir)
    if path is None:
        return None
    if jax.config.jax_compilation_cache_dir:
        return Path(jax.config.jax_compilation_cache_dir)
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as e:
        raise JaxdistError(f"train.compile_cache {path}: cannot create it ({e.strerror})") from None
    _check_private(path)
    programs = path / program_family(config)
    try:
        programs.mkdir(mode=0o700, exist_ok=True)
    except OSError as e:
        raise JaxdistError(f"train.compile_cache {programs}: cannot create it ({e.strerror})") from None
    _check_private(programs)
    jax.config.update("jax_compilation_cache_dir", str(programs))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_remove_custom_partitioning_ptr_from_cache_key", True)
    return programs


def program_family(config: Config) -> str:
    """The cache's folder for ``config``'s programs: a digest of its ``model.*`` keys."""
    model = json.dumps(config.to_dict()["model"], sort_keys=True, default=str)
    return "programs-" + hashlib.sha256(model.encode()).hexdigest()[:16]
