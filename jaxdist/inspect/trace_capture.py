"""Capture for ``--profile-steps A:B``: a ``jax.profiler`` trace of steps A..B plus the
host-side facts the bottleneck report needs (``jaxdist.profile`` reads them).

Each process writes ``RUN_DIR/profile/process_<i>/``: the trace (TensorBoard / XProf /
Perfetto read it) and ``window.json`` (per-step wall time and data wait, mesh, threads).
The host phases of every traced step are named trace annotations: ``train_step`` (a
step marker), ``jaxdist/data``, ``jaxdist/dispatch``, ``jaxdist/log``,
``jaxdist/checkpoint``, ``jaxdist/eval``. Outside the window nothing is annotated.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax
from jax.experimental import multihost_utils


class StepTracer:
    """No trace: every hook is a no-op (the loop calls them unconditionally)."""

    active = False

    def step(self, step: int) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def phase(self, name: str) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def data_waited(self, step: int, seconds: float) -> None:
        pass

    def after_step(self, step: int, state: Any) -> None:
        pass

    def close(self) -> None:
        pass


def trace_options() -> jax.profiler.ProfileOptions:
    """JAX's defaults without its Python tracer. The report reads XLA's ops, the dispatches and
    jaxdist's annotations; the Python tracer adds an event for every Python call of every thread
    (51,000 of a 10-step window's host events on the tiny model, nine in ten) by hooking each
    thread's profile function, and the window's last step starts threads of its own (an
    asynchronous checkpoint's). A two-process suite run once lost process 0 to SIGSEGV at that
    point, its cause not found; without the hooks there is nothing of the kind left to race."""
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0
    return options


class ProfileWindow(StepTracer):
    """Traces steps ``first``..``last``; when the last one is done, writes its files and
    calls ``on_done`` (process 0 summarises all processes' traces there)."""

    def __init__(self, first: int, last: int, out_dir: Path, facts: dict, on_done: Callable[[], None] | None = None):
        self.first, self.last = first, last
        self.process_dir = out_dir / f"process_{jax.process_index()}"
        self.facts, self.on_done = facts, on_done
        self.active = False
        self._step_start: dict[int, float] = {}
        self._data_wait: dict[int, float] = {}
        self._end = 0.0

    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[None]:
        if step == self.first:
            self.process_dir.mkdir(parents=True, exist_ok=True)
            jax.profiler.start_trace(str(self.process_dir), profiler_options=trace_options())
            self.active = True
        if not self.active:
            yield
            return
        self._step_start[step] = time.perf_counter()
        with jax.profiler.StepTraceAnnotation("train_step", step_num=step):
            yield

    def phase(self, name: str) -> contextlib.AbstractContextManager:
        return jax.profiler.TraceAnnotation(f"jaxdist/{name}") if self.active else contextlib.nullcontext()

    def data_waited(self, step: int, seconds: float) -> None:
        if self.active:
            self._data_wait[step] = seconds

    def after_step(self, step: int, state: Any) -> None:
        if not (self.active and step == self.last):
            return
        jax.block_until_ready(state)  # the window ends when the devices have finished its last step
        self._end = time.perf_counter()
        jax.profiler.stop_trace()
        self.active = False
        self._write_window()
        if jax.process_count() > 1:  # every process's trace is on disk before process 0 reads them
            multihost_utils.sync_global_devices("jaxdist_profile_written")
        if self.on_done is not None:
            self.on_done()

    def close(self) -> None:
        """A run that ends inside the window (preemption, an error) still closes the trace."""
        if self.active:
            jax.profiler.stop_trace()
            self.active = False

    def _write_window(self) -> None:
        steps = sorted(self._step_start)
        ends = [self._step_start[s] for s in steps[1:]] + [self._end]
        window = {
            "first_step": self.first,
            "last_step": self.last,
            "process_index": jax.process_index(),
            "process_count": jax.process_count(),
            "local_device_ids": [d.id for d in jax.local_devices()],
            "step_wall_s": {str(s): end - self._step_start[s] for s, end in zip(steps, ends, strict=True)},
            "data_wait_s": {str(s): self._data_wait.get(s, 0.0) for s in steps},
            "threads": {"XLA_FLAGS": os.environ.get("XLA_FLAGS", ""), "cpu_count": os.cpu_count()},
            **self.facts,
        }
        (self.process_dir / "window.json").write_text(json.dumps(window, indent=1))
