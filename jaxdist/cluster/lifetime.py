"""Processes that end with the process that started them, however it ends (even SIGKILL).

Two mechanisms, for two kinds of child:

- ``die_with_parent(pid)``, a ``preexec_fn`` for ``subprocess.Popen``: the kernel sends
  the child SIGKILL when its parent *thread* exits (``PR_SET_PDEATHSIG``). Use it only
  from the thread that lives as long as the parent process (the main thread): the
  launcher's trainers and the supervisor's run.
- ``watch_parent(pid)``: a daemon thread in the child that SIGKILLs it once its parent is
  gone (the child is reparented). For processes started from a helper thread, where the
  death signal would fire when that thread ends: Grain starts its workers from a prefetch
  thread (``grain_worker_init``).
"""

from __future__ import annotations

import ctypes
import functools
import os
import signal
import threading
import time

_PR_SET_PDEATHSIG = 1
POLL_S = 0.5  # how often a watched child checks its parent


def die_with_parent(parent_pid: int):
    """A ``preexec_fn`` that makes the child die with ``parent_pid`` (pass ``os.getpid()``)."""

    def preexec() -> None:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent_pid:  # the parent died before the death signal was armed
            os._exit(1)

    return preexec


def watch_parent(parent_pid: int, poll_s: float = POLL_S) -> threading.Thread:
    """SIGKILL this process (from a daemon thread) once ``parent_pid`` is no longer its parent."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(poll_s)
        os.kill(os.getpid(), signal.SIGKILL)

    thread = threading.Thread(target=watch, name="jaxdist-watch-parent", daemon=True)
    thread.start()
    return thread


def _watch_parent_in_worker(parent_pid: int, worker_index: int, worker_count: int) -> None:  # noqa: ARG001 - Grain's signature
    watch_parent(parent_pid)


def grain_worker_init():
    """A ``worker_init_fn`` for Grain's ``mp_prefetch``: each worker dies with this process."""
    return functools.partial(_watch_parent_in_worker, os.getpid())
