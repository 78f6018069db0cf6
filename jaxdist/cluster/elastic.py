"""Membership decisions of the elastic launcher, in pure Python (no JAX).

Which process counts a run can use (its mesh, global batch and model fit that many
devices, exactly as ``jaxdist.train`` will check), what the ``--nproc-file`` says, where
the run would resume, and the ``RUN_DIR/elastic.jsonl`` record of every change.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import time
from pathlib import Path

from jaxdist.config import Config
from jaxdist.errors import JaxdistError
from jaxdist.layout.mesh import format_mesh, mesh_device_count, parse_mesh, resolve_mesh, split_across_hosts
from jaxdist.layout.validate import batch_shards, check_config_on_mesh, fitting_microbatches
from jaxdist.training.checkpoint import checkpoint_steps

log = logging.getLogger(__name__)


def mesh_for(config: Config, nproc: int, devices_per_proc: int) -> dict[str, int]:
    """The mesh ``nproc`` processes would build; raises ``JaxdistError`` if it does not fit."""
    sizes = parse_mesh(config.parallel.mesh)
    if sizes is None:
        raise JaxdistError("--mesh auto cannot be sized ahead: give an elastic run a mesh, e.g. --mesh data=-1")
    n_devices = nproc * devices_per_proc
    sizes = resolve_mesh(sizes, n_devices)
    if mesh_device_count(sizes) != n_devices:  # every process must own part of the mesh
        raise JaxdistError(f"mesh {format_mesh(sizes)} uses {mesh_device_count(sizes)} devices, not {n_devices}")
    if nproc > 1:
        dcn = parse_mesh(config.parallel.dcn_mesh) if config.parallel.dcn_mesh else None
        split_across_hosts(sizes, nproc, dcn)
    return sizes


def check_fits(config: Config, nproc: int, devices_per_proc: int, resuming: bool) -> None:
    """Raise ``JaxdistError`` (one line) unless ``nproc`` processes can run ``config``.

    ``resuming``: the run restarts from a checkpoint, so the microbatches adapt to the mesh.
    ``model.vocab_size=0`` is not resolved here (that reads the tokenizer); it becomes a
    multiple of 128, which the tensor check in ``jaxdist.train`` then sees.
    """
    sizes = mesh_for(config, nproc, devices_per_proc)
    if resuming:
        t = config.train
        shards = batch_shards(sizes)
        fitting = fitting_microbatches(config, sizes)
        if fitting is None:
            raise JaxdistError(f"train.global_batch ({t.global_batch}) does not split over replica x data x fsdp x expert ({shards})")
        config = copy.deepcopy(config)
        config.train.microbatches = fitting
    check_config_on_mesh(config, sizes)


def fit_problem(config: Config, nproc: int, devices_per_proc: int, resuming: bool) -> str | None:
    """Why ``nproc`` processes cannot run ``config``; None when they can."""
    try:
        check_fits(config, nproc, devices_per_proc, resuming)
    except JaxdistError as e:
        return str(e)
    return None


def largest_usable(config: Config, devices_per_proc: int, low: int, high: int, resuming: bool) -> int | None:
    """The largest count in [low, high] the run can use, or None."""
    return next((n for n in range(high, low - 1, -1) if fit_problem(config, n, devices_per_proc, resuming) is None), None)


def latest_step(run_dir: Path) -> int | None:
    steps = checkpoint_steps(run_dir / "checkpoints")
    return steps[-1] if steps else None


def finished_step(config: Config, run_dir: Path, resume: str) -> int | None:
    """The step a finished run would resume at: its checkpoint at or past the end
    (``train.steps``, or ``train.stop_after_step`` when that comes first, as the loop stops).
    None when there is training left, and when only the processes can tell (``--resume`` a
    path or a weights-only checkpoint; ``never`` is theirs to refuse)."""
    t = config.train
    end = min(t.steps, t.stop_after_step or t.steps)
    if resume == "auto":
        step = latest_step(run_dir)
    elif resume.isdigit() and int(resume) in checkpoint_steps(run_dir / "checkpoints"):
        step = int(resume)  # an older step is not finished: the run continues from it
    else:
        return None
    return step if step is not None and step >= end else None


def finished_line(config: Config, step: int) -> str:
    """What a rerun of a finished run says instead of starting anything."""
    t = config.train
    why = f"train.stop_after_step={t.stop_after_step}" if 0 < t.stop_after_step < t.steps else f"train.steps={t.steps}"
    return f"already at step {step} ({why}): nothing to train"


@dataclasses.dataclass
class NprocFile:
    """The ``--nproc-file``: one integer, the processes available now, written by a
    scheduler or a person. ``changed()`` reports a new value once per rewrite (a rewrite
    of the same number counts: it says "that many again")."""

    path: Path
    _seen: object = "never read"  # the file's (mtime, size, inode) when last read; None: missing
    _warned: str | None = None

    def read(self) -> int | None:
        """The value, or None (with one warning per distinct problem) if unusable."""
        try:
            with open(self.path, "rb") as f:
                raw = f.read(4096)  # a count is a few bytes; a huge or binary file is still one warning
        except OSError as e:
            return self._warn(f"cannot read --nproc-file {self.path} ({e.strerror})")
        text = raw.decode("utf-8", errors="replace").strip()
        if not (text.isascii() and text.isdigit() and int(text) >= 1):  # plain digits: int() also takes "1_0" and "٣"
            return self._warn(f"--nproc-file {self.path} holds {text[:40]!r}, not a positive integer")
        value = int(text)
        self._warned = None
        return value

    def changed(self) -> int | None:
        """The value if the file was rewritten since the last call (or is new), else None."""
        try:
            stat = self.path.stat()
            signature = (stat.st_mtime_ns, stat.st_size, stat.st_ino)
        except OSError:
            signature = None
        if signature == self._seen:
            return None
        self._seen = signature
        return self.read()

    def _warn(self, message: str) -> None:
        if message != self._warned:
            log.warning(f"{message}; keeping the current process count")
            self._warned = message
        return None


def record(run_dir: Path, **fields) -> None:
    """Append one membership change to ``RUN_DIR/elastic.jsonl``."""
    line = json.dumps({"time": round(time.time(), 3), **fields})
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        with open(run_dir / "elastic.jsonl", "a") as out:
            out.write(line + "\n")
    except OSError as e:
        raise JaxdistError(f"cannot write run directory {run_dir}: {e.strerror}") from None


def read_records(run_dir: Path) -> list[dict]:
    """``RUN_DIR/elastic.jsonl``'s records, oldest first ([] before the first; a torn last line is left out)."""
    try:
        text = (Path(run_dir) / "elastic.jsonl").read_text()
    except OSError:
        return []
    records = []
    for line in text.splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:  # a line being written
            continue
    return records


def persistent_straggler(named: list[dict], window: int) -> tuple[int, int, int] | None:
    """(process, first step, last step) of the latest process named a straggler at the end of
    two windows in a row (records ``window`` steps apart, any kind), among ``named``; else None."""
    ends: dict[int, set[int]] = {}
    found = None
    for r in sorted(named, key=lambda r: r["step"]):
        steps = ends.setdefault(r["process"], set())
        if r["step"] - window in steps:
            found = (r["process"], r["step"] - 2 * window + 1, r["step"])
        steps.add(r["step"])
    return found
