"""jaxdist: JAX-native distributed training (data, FSDP/ZeRO, tensor, pipeline, context and
expert parallelism on one mesh).

Importing the package does not import JAX, so a command line can choose the platform and set
XLA flags (fake CPU devices) before the backend starts.

Messages go through one logger, ``logging.getLogger("jaxdist")`` (modules take children of it
with ``logging.getLogger(__name__)``), to stderr as one line each: ``jaxdist: TEXT`` for info,
``jaxdist: warning: TEXT``, ``jaxdist: error: TEXT``. In a multi-process run only process 0
speaks (``set_process_index``), unless a record is logged with ``extra={"every_process": True}``.
The commands' ``--log-level`` sets the level (``set_level``).
"""

from __future__ import annotations

import logging
import sys

__version__ = "0.1.0"

LEVELS = ("debug", "info", "warning", "error")


class _Stderr(logging.StreamHandler):
    """stderr as it is when a record is written (a redirect, a test's capture), not at import."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:  # StreamHandler.__init__ sets it; the property always reads sys.stderr
        pass


class _OneLine(logging.Formatter):
    PREFIX = {logging.DEBUG: "jaxdist: debug: ", logging.WARNING: "jaxdist: warning: ", logging.ERROR: "jaxdist: error: "}

    def format(self, record: logging.LogRecord) -> str:
        return self.PREFIX.get(record.levelno, "jaxdist: ") + record.getMessage()


QUIET_THREAD = "jaxdist-ahead-of-time"  # compiles steps in the background for a mesh not in use yet
HELD_RECORDS: list[logging.LogRecord] = []  # what that thread said: said when its step is used (``training.precompile``)


class _ProcessZero(logging.Filter):
    """Only process 0 of a multi-process run speaks (each process would say the same); the
    background compiles' lines are held until their mesh is in use."""

    process_index = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if record.threadName == QUIET_THREAD:
            HELD_RECORDS.append(record)
            return False
        return self.process_index == 0 or getattr(record, "every_process", False)


_PROCESS_FILTER = _ProcessZero()
logger = logging.getLogger("jaxdist")
if not logger.handlers:
    _handler = _Stderr()
    _handler.setFormatter(_OneLine())
    _handler.addFilter(_PROCESS_FILTER)
    logger.addHandler(_handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False  # one line per message, whatever the host program's root logger does


def set_level(name: str) -> None:
    """``--log-level``: debug | info | warning | error."""
    logger.setLevel(getattr(logging, name.upper()))


def set_process_index(index: int) -> None:
    """This process's rank once the process group is joined (only 0 speaks)."""
    _PROCESS_FILTER.process_index = index
