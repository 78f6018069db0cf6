"""A peer's death that in-process recovery cannot take in place: one line and ``EXIT_RECOVERY``.

Recovery works at a step boundary (``training.recovery.StepGuard``): a death while the
processes start, connect, compile, save, evaluate or recover reaches a survivor as a runtime
error from gloo, NCCL or the coordination service instead. Under ``--recovery in-process``
such a survivor says so in one line, keeps the traceback in the run directory (for the day
the cause is not a death), and leaves with ``EXIT_RECOVERY``: the launcher restarts from the
last checkpoint, as the default mode would.
"""

from __future__ import annotations

import logging
import os
import traceback
from pathlib import Path

from jaxdist.cluster import recoverable
from jaxdist.cluster.distributed import ENV_PROCESS_ID
from jaxdist.errors import EXIT_RECOVERY

log = logging.getLogger(__name__)

# Where in the run a survivor was, by the functions on its stack (innermost first wins).
_PHASES = {
    "initialize": "joining the process group",
    "announce": "a replacement's rejoin",
    "grow": "a replacement's rejoin",
    "plan_growth": "a replacement's rejoin",
    "recover": "an in-process recovery",
    "evaluate": "an evaluation",
    "save": "a checkpoint save",
    "save_params": "a checkpoint save",
    "wait": "a checkpoint save",
    "restore": "the restore",
    "step_done": "a straggler window's gather",
    "compile": "the compile",
    "lower": "the compile",
}


def phase_of(error: BaseException) -> str:
    names = [frame.name for frame in traceback.extract_tb(error.__traceback__)]
    for name in reversed(names):
        if name in _PHASES:
            return _PHASES[name]
    return "outside a step"


def leave_for_a_restart(error: BaseException, run_dir: Path | None) -> int:
    """Say in one line that a peer died where this process cannot recover in place, keep the
    traceback in ``RUN_DIR/peer-failure.rank-I.txt``, and exit ``EXIT_RECOVERY`` (past any
    save thread still waiting for the dead process)."""
    from jaxdist.training.recovery import leave_past_abandoned_saves

    kept = _keep_traceback(error, run_dir)
    first = (recoverable.peer_failure_text(error) or type(error).__name__)[:200]
    log.error(
        f"a peer process was lost during {phase_of(error)} ({first}): in-process recovery takes deaths at a step "
        f"boundary only; leaving for the launcher's restart (exit {EXIT_RECOVERY}){kept}",
        extra={"every_process": True},
    )
    recoverable.abandon_jax_shutdown()  # its ShutdownTask would abort this process with a C++ stack
    leave_past_abandoned_saves(EXIT_RECOVERY, always=True)
    return EXIT_RECOVERY


def exit_past_abandoned_saves(exit_code: int) -> None:
    """``errors.BEFORE_ERROR_EXIT``'s hook under in-process recovery: a run that recovered and
    then stopped on an error (a failed save, a NaN) may hold save threads blocked on the dead
    process, which Python's exit would wait for, for good: exit past them."""
    if recoverable.MEMBERSHIP.changed:
        from jaxdist.training.recovery import leave_past_abandoned_saves

        leave_past_abandoned_saves(exit_code)


def _keep_traceback(error: BaseException, run_dir: Path | None) -> str:
    """Append ``error``'s traceback to ``RUN_DIR/peer-failure.rank-I.txt``; "; its traceback is in PATH" or ""."""
    if run_dir is None:
        return ""
    path = Path(run_dir) / f"peer-failure.rank-{int(os.environ.get(ENV_PROCESS_ID, '0') or 0)}.txt"
    try:
        with open(path, "a") as out:
            out.write("".join(traceback.format_exception(error)))
    except OSError:
        return ""
    return f"; its traceback is in {path}"


class _LostPeerTracebacks(logging.Filter):
    """Orbax's background commit thread logs its failure with a traceback (on absl's logger) when
    the processes its barrier waits for are gone: one line instead, the traceback kept with the
    others. Any other record, and a failure whose cause is not a lost peer, passes unchanged."""

    def __init__(self, run_dir: Path | None):
        super().__init__()
        self.run_dir = run_dir

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        text = recoverable.peer_failure_text(error) if error is not None else None
        if text is not None:
            kept = _keep_traceback(error, self.run_dir)
            record.msg, record.args = f"a checkpoint's background commit lost a peer process ({text[:200]}){kept}", ()
            record.exc_info = record.exc_text = None
        return True


def quiet_lost_peer_tracebacks(run_dir: Path | None) -> None:
    """Install ``_LostPeerTracebacks`` on absl's logger (Orbax logs there), once per process."""
    absl = logging.getLogger("absl")
    if not any(isinstance(f, _LostPeerTracebacks) for f in absl.filters):
        absl.addFilter(_LostPeerTracebacks(run_dir))
