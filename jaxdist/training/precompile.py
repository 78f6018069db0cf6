"""Steps compiled ahead of time for the meshes an in-process recovery or rejoin can land on.

After the first step on each mesh of a run under ``--recovery in-process``, a background
thread builds the trainer and compiles the train step for each mesh the live processes
would train on next: without one more process (every process but 0, whose death means a
restart, and this one), or with a dead process's replacement back, in the device order
``recovery`` would choose then. ``recover`` and ``grow`` take the held step instead of
compiling: the recompile phase becomes a lookup. Process 0 also writes the programs to the
persistent compilation cache, where on GPUs a replacement (a new process, which must compile)
finds its own; JAX's key for a CPU program differs per process, so there it compiles in full.

What is held is bounded: at most ``MAX_HELD`` layouts (the first processes' deaths); the
rest are said in one line and compiled at recovery as before. A layout whose order is no
longer the one recovery chooses (a process has rejoined since: its device groups changed)
is not used, and the recovery compiles.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import types
from collections.abc import Callable
from typing import Any

import jaxdist
from jaxdist.cluster import recoverable
from jaxdist.training.recovery_mesh import RecoveryImpossible, device_order, mesh_on

log = logging.getLogger(__name__)

MAX_HELD = 8  # compiled steps held in host memory (the code of one small program each; a large model's is tens of MB)
THREAD_NAME = jaxdist.QUIET_THREAD  # its lines (the trainer's notes on that mesh) are held until the mesh is in use


@dataclasses.dataclass
class Held:
    trainer: Any
    compiled: Any
    seconds: float  # what compiling it took (off the training thread)
    records: list[logging.LogRecord]  # what building the trainer said, said when the step is used


class AheadOfTime:
    """The held steps, keyed by (live processes, device order)."""

    def __init__(self) -> None:
        self.held: dict[tuple, Held] = {}
        self.done: dict[tuple, threading.Event] = {}
        self.failed: dict[tuple, str] = {}
        self.generation = 0
        self.thread: threading.Thread | None = None

    def start(self, layouts: list[tuple[tuple, Callable[[], Any]]], batch_size: int) -> None:
        """Compile each ``(key, build_trainer)`` in a background thread, in order; what an
        earlier start holds is dropped and its thread stops after its current compile (its
        layouts assumed the membership before)."""
        if len(layouts) > MAX_HELD:
            log.warning(
                f"in-process recovery: {len(layouts)} meshes a death could leave; the steps of the first {MAX_HELD} are compiled ahead, "
                "the others compile when they are needed"
            )
            layouts = layouts[:MAX_HELD]
        held: dict[tuple, Held] = {}
        failed: dict[tuple, str] = {}
        done = {key: threading.Event() for key, _ in layouts}
        self.held, self.failed, self.done = held, failed, done
        self.generation += 1
        generation = self.generation

        def compile_all() -> None:
            for key, build in layouts:
                if generation != self.generation:
                    break
                start, said = time.perf_counter(), len(jaxdist.HELD_RECORDS)
                try:
                    trainer = build()
                    compiled = trainer.compiled_train_step(trainer.abstract_state(), trainer.abstract_batch(batch_size))
                    held[key] = Held(trainer, compiled, time.perf_counter() - start, jaxdist.HELD_RECORDS[said:])
                except Exception as e:  # said at the recovery that would have used it, which compiles then
                    message = str(e).strip()
                    failed[key] = f"{type(e).__name__}: {message.splitlines()[0][:200] if message else ''}"
                finally:
                    done[key].set()
            for event in done.values():  # a superseded thread releases whoever waits
                event.set()

        self.thread = threading.Thread(target=compile_all, name=THREAD_NAME, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        """Drop what is held and let the thread end after its current compile (waited for: a
        compile still running while JAX shuts its backend down at exit could abort the process)."""
        self.generation += 1
        self.held, self.failed, self.done = {}, {}, {}
        if self.thread is not None:
            self.thread.join()
            self.thread = None

    def take(self, key: tuple) -> Held | None:
        """The step held for ``key`` (waiting while the thread compiles it), or None; one line
        when it was to be compiled ahead and could not be."""
        event = self.done.get(key)
        if event is None:
            return None
        event.wait()
        if key in self.failed:
            log.warning(f"in-process recovery: the step for this mesh could not be compiled ahead ({self.failed[key]}); compiling it now")
        held = self.held.pop(key, None)
        for record in held.records if held else ():
            record.threadName = threading.current_thread().name
            logging.getLogger(record.name).handle(record)
        return held


AHEAD = AheadOfTime()


def layout_key(processes: list[int], order: list) -> tuple:
    return tuple(processes), tuple(d.id for d in order)


def compile_recoveries_ahead(config, all_devices: list, build_trainer) -> None:
    """In the background: the step for each mesh one more death would leave this process on,
    and for each mesh a dead process's replacement would grow the run back to, in the device
    order ``recovery`` would choose (``build_trainer(sizes, devices)``)."""
    import jax

    membership = recoverable.MEMBERSHIP
    processes = membership.live_processes()
    started_with = sorted({d.process_index for d in all_devices})
    changes = [([p for p in processes if p != dead], set()) for dead in processes if dead not in (0, jax.process_index())]
    changes += [(sorted({*processes, gone}), {gone}) for gone in started_with if gone not in processes]  # a replacement rejoins
    layouts = []
    for survivors, joining in changes:
        live = [d for d in all_devices if d.process_index in survivors]
        then = types.SimpleNamespace(groups=membership.groups, rejoined=membership.rejoined | joining)
        try:
            sizes = mesh_on(config, len(live))
            order = device_order(live, sizes, then)
        except RecoveryImpossible:
            continue  # that change restarts the run: nothing to compile
        layouts.append((layout_key(survivors, order), lambda sizes=sizes, order=order: build_trainer(sizes, order)))
    if layouts:
        AHEAD.start(layouts, config.train.global_batch)
