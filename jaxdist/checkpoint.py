"""Checkpoints with Orbax: async saves, exact resume, restore onto another mesh.

A checkpoint (``RUN_DIR/checkpoints/STEP``) holds the train state (params, optimizer
state, step), this process's Grain iterator state (one file per process), and the
resolved config. Orbax writes each step into a temporary folder and renames it when
complete, so a process killed mid-save leaves nothing that resume would pick.
Restoring takes abstract arrays carrying the *target* shardings, so a checkpoint
written on one mesh lands directly in the shards of another (never gathered).
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

from jaxdist.errors import JaxdistError


class CheckpointError(Exception):
    """A checkpoint could not be written (the last committed one is intact)."""

    exit_code = 4


class _IteratorState:
    """A snapshot of the data iterator's state, in the shape Grain's Orbax handler wants
    (``get_state() -> bytes``). Taken when the save starts, so an async save records the
    position the step consumed, not where the loader has read ahead to since."""

    def __init__(self, state: bytes = b""):
        self.state = state

    def get_state(self) -> bytes:
        return self.state

    def set_state(self, state: bytes) -> None:
        self.state = state

    def start_prefetch(self) -> None:  # Grain's handler calls this after restoring
        pass


@dataclasses.dataclass
class Restored:
    step: int
    state: Any
    data_state: dict | None  # None: no state for this process layout (resume from the step)
    config: dict
    path: Path


def checkpoint_steps(directory: Path) -> list[int]:
    """Committed checkpoint steps in a directory, oldest first (no JAX needed)."""
    if not directory.is_dir():
        return []
    return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit() and p.is_dir())


def saved_config(step_dir: Path) -> dict | None:
    """The resolved config stored with a checkpoint, read as plain JSON."""
    try:
        return json.loads((step_dir / "config" / "metadata").read_text())
    except (OSError, ValueError):
        return None


class Checkpointer:
    """Saves on a schedule (steps and/or minutes), keeps the last N (and optionally the
    best by eval loss), restores the newest readable checkpoint."""

    def __init__(self, directory: Path, cfg, *, read_only: bool = False):
        import orbax.checkpoint as ocp
        from orbax.checkpoint import checkpoint_managers as cm

        policies = [cm.LatestN(n=cfg.keep)]
        if cfg.keep_best:
            policies.append(
                cm.BestN(get_metric_fn=lambda m: m["eval_loss"], reverse=True, n=cfg.keep_best, keep_checkpoints_without_metrics=False)
            )
        options = ocp.CheckpointManagerOptions(
            enable_async_checkpointing=cfg.async_save,
            preservation_policy=cm.AnyPreservationPolicy(policies),
            read_only=read_only,
            create=not read_only,
        )
        self.directory = Path(directory)
        self.cfg = cfg
        self._ocp = ocp
        self.manager = ocp.CheckpointManager(self.directory.absolute(), options=options)
        self._last_save_time = time.monotonic()
        self.last_saved_step: int | None = self.manager.latest_step()

    # -- saving ---------------------------------------------------------------------

    def due(self, step: int) -> bool:
        every_steps = self.cfg.every_steps > 0 and step % self.cfg.every_steps == 0
        every_minutes = self.cfg.every_minutes > 0 and time.monotonic() - self._last_save_time >= 60 * self.cfg.every_minutes
        return every_steps or every_minutes

    def save(self, step: int, state: Any, data_state: dict, config: dict, metrics: dict | None = None) -> None:
        """Start saving (returns once the arrays are copied off the devices when async)."""
        ocp = self._ocp
        import grain.checkpoint as grain_checkpoint

        if step == self.last_saved_step:
            return
        args = ocp.args.Composite(
            state=ocp.args.StandardSave(state),
            data=grain_checkpoint.CheckpointSave(_IteratorState(json.dumps(data_state).encode())),
            config=ocp.args.JsonSave(config),
        )
        try:
            self.manager.save(step, args=args, metrics=metrics, force=True)
        except Exception as e:  # noqa: BLE001 - any failure to write becomes one clear line
            raise CheckpointError(self._failure(step, e)) from None
        self._last_save_time = time.monotonic()
        self.last_saved_step = step

    def wait(self) -> None:
        """Block until every started save has committed."""
        try:
            self.manager.wait_until_finished()
        except Exception as e:  # noqa: BLE001
            raise CheckpointError(self._failure(self.last_saved_step, e)) from None

    def _failure(self, step: int | None, error: Exception) -> str:
        committed = [s for s in checkpoint_steps(self.directory) if s != step]
        last = f"last good checkpoint: step {committed[-1]}" if committed else "no earlier checkpoint"
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        return f"saving checkpoint at step {step} in {self.directory} failed ({reason}); {last}"

    def close(self) -> None:
        self.manager.close()

    # -- restoring ------------------------------------------------------------------

    def restore(self, step: int, abstract_state: Any) -> Restored:
        """One step, into the shardings of ``abstract_state``; raises if unreadable."""
        import grain.checkpoint as grain_checkpoint

        ocp = self._ocp
        state = self.manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state)))["state"]
        step_dir = self.directory / str(step)
        data_state = None
        try:
            holder = _IteratorState()
            self.manager.restore(step, args=ocp.args.Composite(data=grain_checkpoint.CheckpointRestore(holder)))
            data_state = json.loads(holder.state.decode())
        except Exception:  # noqa: BLE001 - another process count wrote it: resume the data from the step
            data_state = None
        return Restored(step, state, data_state, saved_config(step_dir) or {}, step_dir)

    def restore_latest(self, abstract_state: Any, *, warn=print) -> Restored | None:
        """The newest checkpoint that reads back; a corrupt one is reported and skipped
        (never deleted)."""
        for step in reversed(self.manager.all_steps()):
            try:
                return self.restore(step, abstract_state)
            except Exception as e:  # noqa: BLE001 - a damaged checkpoint: fall back to the previous one
                first_line = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
                warn(f"jaxdist: warning: checkpoint step {step} in {self.directory} is unreadable ({first_line}); trying the previous one")
        return None


def parse_resume(resume: str, checkpoints: Path) -> tuple[str, Path, int | None]:
    """``auto`` | ``never`` | STEP | PATH -> (mode, checkpoint directory, step)."""
    if resume in ("auto", "never"):
        return resume, checkpoints, None
    if resume.isdigit():
        step = int(resume)
        if step not in checkpoint_steps(checkpoints):
            raise JaxdistError(
                f"--resume {step}: no checkpoint at step {step} in {checkpoints} (have {checkpoint_steps(checkpoints) or 'none'})"
            )
        return "step", checkpoints, step
    path = Path(resume)
    if path.name.isdigit() and path.is_dir():
        return "step", path.parent, int(path.name)
    if checkpoint_steps(path):
        return "latest", path, None
    raise JaxdistError(f"--resume {resume!r}: not auto, never, a step, or a checkpoint directory")


def warn(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
