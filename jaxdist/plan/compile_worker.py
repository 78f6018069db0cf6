"""The planner's compiles, run in a child process that may die without taking the search along.

XLA ends its process on a failed internal check (``Check failed: ...``, SIGABRT): a compiler bug
on one layout of a search that compiles dozens. ``CompileWorker`` hands each layout to one child
process (``python -m jaxdist.plan.compile_worker``: JAX and jaxdist imported once per search) over
a pair of pipes: the child answers with the compiled program's summary or the error's first line;
when it dies instead, that layout is reported as not compiling, with the compiler's own check
line and the signal, and the next layout starts a fresh child. What crosses the pipes is the
planner's own config and target going in and a summary (plain data) coming back, between two
processes of the same run.

The child's stderr goes to a private file: after each layout what JAX printed there is passed on
(the CUDA plugin's driver lines dropped, as ``layout.native_output`` drops them in-process), and
after a death its last words give the reason.

``JAXDIST_FAULT_COMPILER_ABORT="MESH mb=K remat=R"`` (any of the three words) is a fault-injection
hook for tests: asked to compile a layout they all describe, the child prints a check line and
aborts, as XLA does.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import subprocess
import sys
import tempfile
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from jaxdist.layout.native_output import is_plugin_noise

ENV_ABORT = "JAXDIST_FAULT_COMPILER_ABORT"  # test-only fault injection: "MESH mb=K remat=R", any of them
DEATH_WAIT_S = 10.0  # for a child whose pipe closed to be reaped (its exit code read)
CLOSE_WAIT_S = 5.0
CHECK_LINE = re.compile(r"Check failed|Check failure|RET_CHECK|\bFATAL\b|^F\d{4} ")


class CompileFailed(RuntimeError):
    """The layout did not compile; the message is one line (the compiler's, or how its process died)."""


class CompileWorker:
    """``compile(config, target)`` in a child process (``search.compile_program`` there).
    ``cpu_only``: the child keeps the CUDA plugin unloaded (a plan compiled against fake CPU devices)."""

    def __init__(self, cpu_only: bool):
        self.cpu_only = cpu_only
        self._process: subprocess.Popen | None = None
        self._to_child = self._from_child = None
        fd, name = tempfile.mkstemp(prefix="jaxdist-plan-compiler-", suffix=".stderr")
        os.close(fd)
        self._stderr = Path(name)

    def __enter__(self) -> CompileWorker:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def compile(self, config: Any, target: Any) -> dict[str, Any]:
        if self._process is None:
            self._start()
        start = self._stderr.stat().st_size
        try:
            self._to_child.send((config, target))
            status, payload = self._from_child.recv()
        except (EOFError, OSError):
            raise CompileFailed(self._death(start)) from None
        self._relay(start)
        if status != "ok":
            raise CompileFailed(payload)
        return payload

    def close(self) -> None:
        if self._process is not None:
            with contextlib.suppress(OSError, ValueError):
                self._to_child.send(None)
            self._reap(CLOSE_WAIT_S)
        self._stderr.unlink(missing_ok=True)

    def _start(self) -> None:
        child_reads, parent_writes = os.pipe()
        parent_reads, child_writes = os.pipe()
        level = logging.getLogger("jaxdist").getEffectiveLevel()
        command = [sys.executable, "-m", __name__, str(child_reads), str(child_writes), "cpu" if self.cpu_only else "gpu", str(level)]
        with open(self._stderr, "ab") as stderr:
            self._process = subprocess.Popen(
                command, pass_fds=(child_reads, child_writes), stdin=subprocess.DEVNULL, stdout=stderr, stderr=stderr
            )
        os.close(child_reads)
        os.close(child_writes)
        self._to_child = Connection(parent_writes, readable=False)
        self._from_child = Connection(parent_reads, writable=False)

    def _reap(self, wait_s: float) -> int | None:
        """The child's exit code once it has ended (killed if it has not within ``wait_s``)."""
        try:
            code = self._process.wait(wait_s)
        except subprocess.TimeoutExpired:
            self._process.kill()
            code = self._process.wait()
        for conn in (self._to_child, self._from_child):
            conn.close()
        self._process = self._to_child = self._from_child = None
        return code

    def _death(self, start: int) -> str:
        """The one-line reason the child died while compiling (the next layout starts another)."""
        code = self._reap(DEATH_WAIT_S)
        if code is not None and code < 0:
            how = signal.Signals(-code).name if -code in signal.Signals._value2member_map_ else f"signal {-code}"
        else:
            how = f"exit {code}"
        last_words = [line.strip() for line in self._read(start).splitlines() if line.strip() and not is_plugin_noise(line)]
        checks = [line for line in last_words if CHECK_LINE.search(line)]
        said = (checks or last_words[-1:] or [""])[0][:300]
        return f"the compiler process died ({how})" + (f": {said}" if said else "")

    def _read(self, start: int) -> str:
        try:
            with open(self._stderr, "rb") as f:
                f.seek(start)
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def _relay(self, start: int) -> None:
        """What JAX printed while compiling this layout, as the in-process compile printed it."""
        for line in self._read(start).splitlines(keepends=True):
            if not is_plugin_noise(line):
                sys.stderr.write(line)


def serve(requests: Connection, replies: Connection, cpu_only: bool) -> None:
    """The child: compile each (config, target) it is sent until it is sent None or the pipe closes."""
    if cpu_only:
        from jaxdist.layout import devices

        devices.run_on_cpu_unless_gpu()
    from jaxdist.plan.search import compile_program  # imports JAX: after the platform is settled

    while True:
        try:
            request = requests.recv()
        except (EOFError, OSError):
            return
        if request is None:
            return
        config, target = request
        if _fault_aborts(config):
            print(f"Check failed: fault injection ({ENV_ABORT}={os.environ[ENV_ABORT]})", file=sys.stderr, flush=True)
            os.abort()
        try:
            reply = ("ok", compile_program(config, target))
        except Exception as e:  # noqa: BLE001 - any failure is this layout's, said in one line
            reply = ("error", (str(e).strip().splitlines() or [type(e).__name__])[0][:300])
        sys.stderr.flush()
        replies.send(reply)


def _fault_aborts(config: Any) -> bool:
    """``JAXDIST_FAULT_COMPILER_ABORT`` names this layout: its words (a mesh, ``mb=K``, ``remat=R``) are all the layout's."""
    words = os.environ.get(ENV_ABORT, "").split()
    layout = {config.parallel.mesh, f"mb={config.train.microbatches}", f"remat={config.model.remat}"}
    return bool(words) and set(words) <= layout


if __name__ == "__main__":
    reads, writes, platform, level = sys.argv[1:5]
    logging.getLogger("jaxdist").setLevel(int(level))
    serve(Connection(int(reads), writable=False), Connection(int(writes), readable=False), cpu_only=platform == "cpu")
