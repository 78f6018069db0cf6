"""Weights & Biases (``log.wandb=true``): every metrics.jsonl line, eval lines included, also
goes to a W&B run, with the same keys at the same step; the resolved config is the run's config.

Only process 0 opens a run (``open_wandb_run`` is None elsewhere). The W&B run's id is kept in
``RUN_DIR/wandb_run_id`` (a top-level file: copied with the checkpoints to a durable tier), so
every process that trains in the same run directory (a launcher's restart, a ``--resume``, a
run continued after ``train.stop_after_step``) continues the same W&B run. wandb's files go to
``RUN_DIR/wandb/`` unless ``WANDB_DIR`` says otherwise; ``WANDB_MODE=offline`` keeps them
there for ``wandb sync``.

Credentials are wandb's own business (``WANDB_API_KEY``, ``wandb login``): nothing here writes
one (a message from wandb is said without it), and the config holds none. wandb is imported only here, and only when
``log.wandb=true``.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import secrets
import string
from pathlib import Path, PurePosixPath
from typing import Any

from jaxdist.config import Config
from jaxdist.errors import EXIT_BAD_INPUT, EXIT_PREEMPTED, JaxdistError
from jaxdist.storage.remote import redact

log = logging.getLogger(__name__)

RUN_ID_FILE = "wandb_run_id"
INSTALL = "pip install 'jaxdist[wandb]'"


def check_wandb(config: Config, run_dir: Path | None, process_index: int) -> None:
    """Before anything is built: ``log.wandb=true`` needs the wandb package (every process
    says so, in one line: the environment is wrong everywhere alike)."""
    if not config.log.wandb:
        return
    if importlib.util.find_spec("wandb") is None:
        raise JaxdistError(f"log.wandb=true needs the wandb package: {INSTALL} (or set log.wandb=false)")
    if run_dir is None and process_index == 0:
        log.warning("log.wandb=true without a run directory: nothing is sent to Weights & Biases (it mirrors metrics.jsonl)")


def open_wandb_run(config: Config, run_dir: Path | None, durable_dir: str | None, process_index: int) -> WandbMirror | None:
    """The W&B run this run's metrics also go to: None unless ``log.wandb=true``, on process 0,
    with a run directory. A W&B that does not start (no credentials online, a server that
    does not answer) is one line, before anything compiles."""
    if not config.log.wandb or process_index != 0 or run_dir is None:
        return None
    run_id = _run_id(run_dir)
    import wandb

    options = config.log
    try:
        run = wandb.init(
            project=options.wandb_project,
            entity=options.wandb_entity or None,
            name=options.wandb_name or _run_name(run_dir, durable_dir),
            id=run_id,
            resume="allow",  # the run's first process creates it, later ones continue it
            dir=None if os.environ.get("WANDB_DIR") else str(run_dir),
        )
        run.config.update(config.to_dict(), allow_val_change=True)  # a resume may change keys (the mesh, train.steps)
    except Exception as e:  # wandb raises its own errors, and others from its service
        raise JaxdistError(
            f"log.wandb: Weights & Biases did not start ({_said(e)}); give credentials in the environment "
            "(WANDB_API_KEY, or `wandb login`), or set WANDB_MODE=offline to log locally and `wandb sync` later"
        ) from None
    return WandbMirror(run)


def _run_name(run_dir: Path, durable_dir: str | None) -> str:
    """The run directory's name (the durable one's, when the run saves to a local tier first)."""
    return PurePosixPath(durable_dir).name if durable_dir else run_dir.absolute().name


def _run_id(run_dir: Path) -> str:
    """The W&B run id of this run directory: the one kept there, else a new one, kept there
    before the run starts (a process killed right after still continues the same run)."""
    path = run_dir / RUN_ID_FILE
    try:
        kept = path.read_text().strip() if path.exists() else ""
        if kept:
            return kept
        run_id = "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))  # W&B's own id style
        path.write_text(run_id + "\n")
    except OSError as e:
        raise JaxdistError(f"cannot write run directory {run_dir}: {e.strerror}") from None
    return run_id


class WandbMirror:
    """Sends metrics.jsonl's lines to a W&B run (``MetricsLogger.mirror``)."""

    def __init__(self, run):
        self.run = run
        # A resumed online run continues after the steps W&B already has; the steps a restart
        # replays from its checkpoint are left out here (W&B would drop each with a warning).
        self._first_step = run.starting_step
        self._said_replayed = False
        self.broken = False  # W&B failed once: nothing more is sent

    def log(self, step: int, record: dict[str, Any]) -> None:
        if step < self._first_step:
            if not self._said_replayed:
                log.info(f"W&B run {self.run.id} already has steps up to {self._first_step - 1}: those replayed here are not sent again")
                self._said_replayed = True
            return
        if self.broken:
            return
        try:
            self.run.log({k: v for k, v in record.items() if k != "step"}, step=step)  # W&B's own step is the step
        except Exception as e:  # W&B's trouble must not stop the training: metrics.jsonl has every line
            self.broken = True
            log.warning(
                f"Weights & Biases stopped taking metrics at step {step} ({_said(e)}); training goes on, metrics.jsonl has them all"
            )

    def close(self, error: BaseException | None = None) -> None:
        """Finish the W&B run: failed with the run's exit code when ``error`` stopped it,
        preempting (to be resumed) when the run was preempted."""
        exit_code = 0 if error is None else getattr(error, "exit_code", EXIT_BAD_INPUT if isinstance(error, JaxdistError) else 1)
        try:
            if exit_code == EXIT_PREEMPTED:
                self.run.mark_preempting()
            self.run.finish(exit_code=exit_code)
        except Exception as e:  # the training is done and saved: a W&B failure here is a warning
            log.warning(f"Weights & Biases did not finish its run ({_said(e)}); metrics.jsonl has every line")


def _said(error: Exception) -> str:
    """wandb's error on one line, without a URL's user part or the API key of the environment."""
    text = redact(" ".join(str(error).split()) or type(error).__name__)
    key = os.environ.get("WANDB_API_KEY", "")
    return text.replace(key, "***") if len(key) >= 4 else text
