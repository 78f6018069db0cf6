"""Errors that reach the user as one line on stderr, and the exit codes.

``JaxdistError`` (bad input) exits 2; a ``RunStopped`` (a non-finite loss, a save that
failed, a preemption) says why in one line and exits with its own code. ``command`` wraps
every CLI's ``main`` so that each of these is said once, the same way.
"""

from __future__ import annotations

import argparse
import functools
import gc
import logging
from collections.abc import Callable

EXIT_OK = 0
EXIT_BAD_INPUT = 2
EXIT_NONFINITE = 3  # the loss went NaN/inf and the run stopped
EXIT_CHECKPOINT = 4  # a checkpoint could not be written (the last committed one is intact)
EXIT_PREEMPTED = 75  # EX_TEMPFAIL: "try again"; the state was saved
EXIT_RECOVERY = 78  # --recovery in-process could not go on here (said why): the launcher restarts from the last checkpoint


class JaxdistError(Exception):
    """Bad input from the user: a config, mesh, path or shape that cannot work."""


class ConfigError(JaxdistError):
    """A config file, key or value is wrong."""


class MeshError(JaxdistError):
    """A mesh spec is malformed or does not fit the devices or the model."""


class RunStopped(Exception):  # noqa: N818 - a stop the user acts on, not a programming error
    """A run that stopped for a reason the user acts on: one line, and ``exit_code``."""

    exit_code = 1


class NonFiniteLoss(RunStopped):
    """The loss became NaN or inf; the run stops (the last checkpoint is intact)."""

    exit_code = EXIT_NONFINITE


# Called with a stopped command's exit code once its line is said: in-process recovery adds
# one that exits past save threads still waiting for a dead peer (Python's exit would join them)
BEFORE_ERROR_EXIT: list[Callable[[int], None]] = []


def command(main: Callable[..., int]) -> Callable[..., int]:
    """A CLI's ``main``: bad input is one ``jaxdist: error:`` line and exit 2, a stopped run
    its line and its exit code (a preemption, whose state was saved, is not an error); never
    a traceback for either."""

    @functools.wraps(main)
    def wrapped(*args, **kwargs) -> int:
        # A command traces a model and compiles it: JAX makes millions of short-lived objects, and
        # with Python's default (a pass over the young ones every 700) the collector took 0.73 s
        # of a tiny 2-step run's 7.5 s of CPU; 0.24 s at 20,000.
        gc.set_threshold(20_000, 20, 20)
        log = logging.getLogger("jaxdist")
        every = {"every_process": True}  # each process says why it stopped: the cause may be its own
        try:
            return main(*args, **kwargs)
        except JaxdistError as e:
            log.error(str(e), extra=every)
            code = getattr(e, "exit_code", EXIT_BAD_INPUT)
        except RunStopped as e:
            (log.info if e.exit_code == EXIT_PREEMPTED else log.error)(str(e), extra=every)
            code = e.exit_code
        for hook in BEFORE_ERROR_EXIT:
            hook(code)
        return code

    return wrapped


# "jaxdist " once the one command (``jaxdist COMMAND``) chose the CLI: usage lines then name
# the command the user typed, not ``python -m jaxdist.COMMAND``
ONE_COMMAND_PREFIX: str | None = None


class OneLineArgumentParser(argparse.ArgumentParser):
    """argparse whose usage errors become a JaxdistError: one line and exit 2, like every other bad input."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if ONE_COMMAND_PREFIX and self.prog.startswith("python -m jaxdist."):
            self.prog = ONE_COMMAND_PREFIX + self.prog.removeprefix("python -m jaxdist.")

    def error(self, message: str) -> None:
        raise JaxdistError(message)
