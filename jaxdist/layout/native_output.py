"""Lines native code writes straight to a file descriptor, kept out of what a user sees.

JAX's CUDA plugin, gloo and the coordination service print from C++ (absl logging,
std::cout) with no switch that turns them off: the CUDA plugin says "Could not find cuda
drivers" each time it is loaded on a machine without a GPU (compiling for a GPU target, four
to eight lines around a one-line refusal), and the coordination service warns that the
recoverable-task feature (``launch --recovery in-process``) is experimental. Python cannot
intercept them, so ``filter_descriptor`` turns the descriptor into a pipe that a thread
copies line by line, dropping what a filter names. At ``--log-level debug`` they stay.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import re
import sys
import threading
from collections.abc import Callable

# absl's notice before its first message, once per library that logs before absl is set up
ABSL_PREAMBLE = "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR"
# absl's prefix: severity and date, time, thread id, file:line]
_ABSL = r"[IWE]\d{4} [\d:.]+\s+\d+ "
NO_CUDA_DRIVER = re.compile(_ABSL + r"cudart_stub\.cc:\d+\] Could not find cuda drivers on your machine, GPU will not be used\.\s*")
RECOVERABLE_TASKS = re.compile(_ABSL + r"coordination_service\.cc:\d+\] .*recoverable.*", re.IGNORECASE)


def is_plugin_noise(line: str) -> bool:
    """A line of the CUDA plugin's or the coordination service's that says nothing to act on."""
    line = line.rstrip("\r\n")
    return line == ABSL_PREAMBLE or bool(NO_CUDA_DRIVER.fullmatch(line) or RECOVERABLE_TASKS.fullmatch(line))


def filter_descriptor(fd: int, make_filter: Callable[[], Callable[[str], bool]]) -> None:
    """From now on, lines written to ``fd`` (1 or 2, by Python or native code) for which the
    filter ``make_filter()`` returns True are dropped; the rest reach where ``fd`` pointed.
    At exit what is left in the pipe is copied (up to a second) and ``fd`` restored."""
    stream = sys.stdout if fd == 1 else sys.stderr
    try:
        stream.flush()
        real, saved = os.dup(fd), os.dup(fd)  # the thread writes to one; the other is put back at exit
    except (OSError, ValueError):  # no such descriptor: nothing to keep clean
        return
    read, write = os.pipe()
    os.dup2(write, fd)
    os.close(write)

    def copy() -> None:
        drop = make_filter()
        with os.fdopen(read, "rb") as pipe, os.fdopen(real, "wb", buffering=0) as out:
            for line in pipe:
                if not drop(line.decode(errors="replace")):
                    out.write(line)

    thread = threading.Thread(target=copy, name=f"jaxdist-fd{fd}-filter", daemon=True)
    thread.start()

    def restore() -> None:
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
        os.dup2(saved, fd)  # the pipe's last writer here closes: the thread reads to its end
        os.close(saved)
        thread.join(timeout=1.0)  # longer only when a child process still holds the pipe

    atexit.register(restore)


_hidden = False


def hide_plugin_noise(debug: bool) -> None:
    """Before the CUDA plugin loads: keep its lines off stderr (once per process; not at debug)."""
    global _hidden
    if debug or _hidden:
        return
    _hidden = True
    filter_descriptor(2, lambda: is_plugin_noise)
