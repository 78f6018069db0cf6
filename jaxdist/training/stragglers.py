"""Live straggler detection for runs of several processes.

In synchronous training every process sees the same step time: the fast ones wait inside the
collectives for the slow one. What differs is the work each does before it waits: its own
time per step: the host loop's share of it (fetching the batch, data loading included, and
dispatching the step; the waits for the devices' results are left out) and the time its
threads were ready to run but got no CPU (Linux's schedstat: a process starved from outside;
one waiting for a peer sleeps instead). Every
``train.straggler_window`` steps (the first window warms up) the processes gather their own
time per step (one small all-gather) and process 0 names one whose time exceeds ``train.straggler_factor`` times the
others' median, when the excess is at least ``MIN_SHARE`` of the step and ``MIN_EXCESS_S``
(less is this machine's noise, or costs nothing worth a line): one warning line, and a ``straggler`` record in metrics.jsonl.

On CPU the devices' compute runs inside the same process and is not told apart from the
waits: a slow loader or a slow host loop is seen, not a slow device. A process starved of CPU
from outside is seen only through its host loop's share (its threads' run-queue waits), which
is small against the step its starved compute stretches: tried here (pinned beside a busy loop
at nice 10), it measured 14 ms against the others' 7 ms in 720 ms steps, under the floors.
On GPUs a slow GPU would likewise show as the others' wait (its kernels' own time would need
CUDA events; not built).

``JAXDIST_FAULT_SLOW=RANK:SECONDS[:FROM_STEP]`` is a fault-injection hook for tests: that rank
sleeps so long in each step's host work (from that step on), as a process with a slow loader would.
"""

from __future__ import annotations

import logging
import os
import socket
import statistics
import threading
import time

from jaxdist.cluster import recoverable
from jaxdist.errors import JaxdistError

log = logging.getLogger(__name__)
ENV_SLOW = "JAXDIST_FAULT_SLOW"  # test-only fault injection: "RANK:SECONDS"
MIN_SHARE = 0.05  # an excess below this share of the step time is not named,
MIN_EXCESS_S = 0.010  # nor one under 10 ms (process 0, which writes the metrics, runs a few ms over the others)
HOST_BYTES = 64


class StragglerWatch:
    """This process's own time per step, compared across processes every ``window`` steps."""

    def __init__(self, factor: float, window: int):
        import jax

        self.factor, self.window = factor, window
        self.enabled = window > 0 and jax.process_count() > 1
        self.rank = jax.process_index()
        self.own = 0.0  # seconds of host work since the window began
        self.window_start: float | None = None
        self.hosts: list[str] | None = None
        self.windows = 0
        self.per_step: list[float] = []  # this window's own seconds, step by step
        self.step_times: list[float] = []  # this window's step times
        self.queued = runqueue_wait_s()
        self.slow_s, self.slow_from = _slow_seconds(self.rank)

    def host_work(self, seconds: float) -> None:
        """``seconds`` of this step's own host work (not waiting for devices)."""
        if not self.enabled:  # one process, or the watch is off: nothing is compared
            return
        self.own += seconds
        queued = runqueue_wait_s()  # waiting for a CPU since the last step: slowed from outside
        self.per_step.append(self.own + queued - self.queued)
        self.own, self.queued = 0.0, queued

    def injected_delay(self, step: int) -> None:
        if self.slow_s and step >= self.slow_from:
            time.sleep(self.slow_s)

    def step_done(self, step: int) -> dict | None:
        """Called by every process after each step: at the end of a window, the straggler record (process 0) or None."""
        if not self.enabled:
            return None
        now = time.perf_counter()
        if self.window_start is not None:  # the first step's time (from the compile) is no one's
            self.step_times.append(now - self.window_start)
        self.window_start = now
        if step % self.window:  # windows end at the same steps on every process, one that rejoined included
            return None
        import jax
        import numpy as np

        steps, step_s = self.window, statistics.median(self.step_times or [0.0])  # a step's median: saves and evals left out
        live = recoverable.MEMBERSHIP.live_processes()  # all of them, unless an in-process recovery left some out
        if self.hosts is None or len(self.hosts) != len(live):
            name = socket.gethostname().encode()[:HOST_BYTES].ljust(HOST_BYTES, b"\0")
            gathered = recoverable.process_allgather(np.frombuffer(name, np.uint8), "straggler-hosts")
            self.hosts = [bytes(row).rstrip(b"\0").decode(errors="replace") for row in np.asarray(gathered).reshape(-1, HOST_BYTES)]
        # the median step: a pause of the machine's in one step is not a straggler
        own = recoverable.process_allgather(np.float32(statistics.median(self.per_step or [0.0])), "straggler-own").reshape(-1)
        self.window_start, self.per_step, self.step_times = time.perf_counter(), [], []
        self.windows += 1
        if jax.process_index() != 0 or self.windows == 1:  # the first window warms up (start-up noise): compared from the second
            return None
        record = straggler(own.tolist(), step_s, self.factor, self.hosts, (step - steps + 1, step))
        if record is not None:
            record["process"] = live[record["process"]]  # a row of the gather -> the process's own index
        return record


def straggler(own_s: list[float], step_s: float, factor: float, hosts: list[str], steps: tuple[int, int]) -> dict | None:
    """The process furthest over ``factor`` times the others' median own time per step (and over
    the floors), as a record; None when nobody is."""
    worst = None
    for rank, own in enumerate(own_s):
        others = statistics.median(own_s[:rank] + own_s[rank + 1 :])
        floor = max(MIN_SHARE * step_s, MIN_EXCESS_S)
        if own > factor * others and own - others >= floor and (worst is None or own - others > worst[2]):
            worst = (rank, others, own - others)
    if worst is None:
        return None
    rank, others, _ = worst
    return {
        "process": rank,
        "host": hosts[rank],
        "own_ms_per_step": round(1e3 * own_s[rank], 3),
        "others_median_ms": round(1e3 * others, 3),
        "step_ms": round(1e3 * step_s, 3),
        "steps": list(steps),
    }


def straggler_line(record: dict, factor: float) -> str:
    ratio = record["own_ms_per_step"] / max(record["others_median_ms"], 1e-9)
    first, last = record["steps"]
    return (
        f"straggler: process {record['process']} on {record['host']} spent {record['own_ms_per_step']:.1f} ms per step of its own "
        f"work over steps {first}-{last}, {ratio:.1f}x the others' median {record['others_median_ms']:.1f} ms "
        f"(step {record['step_ms']:.1f} ms; train.straggler_factor {factor:g})"
    )


def _slow_seconds(rank: int) -> tuple[float, int]:
    spec = os.environ.get(ENV_SLOW)
    if not spec:
        return 0.0, 0
    parts = spec.split(":")
    try:
        slow_rank, seconds, from_step = int(parts[0]), float(parts[1]), int(parts[2]) if len(parts) > 2 else 0
    except (ValueError, IndexError):
        raise JaxdistError(f"{ENV_SLOW}={spec!r}: expected RANK:SECONDS[:FROM_STEP] (a fault-injection hook for tests)") from None
    return (seconds, from_step) if slow_rank == rank else (0.0, 0)


def runqueue_wait_s() -> float:
    """Seconds this process's main thread (the host loop) has waited for a CPU while ready to run
    (Linux's schedstat; 0 elsewhere): a process starved from outside waits here, one that waits
    for a peer sleeps instead. The devices' threads are left out: on CPU they are many, and
    their waits are the machine's noise."""
    try:
        with open(f"/proc/self/task/{threading.get_native_id()}/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0
