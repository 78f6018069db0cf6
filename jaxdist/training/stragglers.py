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
(less is this machine's noise, or costs nothing worth a line), at the end of two windows in a
row: one warning line, and a ``straggler`` record in metrics.jsonl.

The step's own device time is not told apart from its waits for peers inside one program, so
a process slowed as a whole (its device throttled, its CPU share cut from outside) is seen
another way: at each window's end every process times one fixed computation on its first
device (``ComputeProbe``, 50-100 ms here; on CPU in turn, while the others wait at a barrier,
so no process's probe competes with another's for the cores), and process 0 names one whose time is
over ``train.straggler_factor`` times the others' median (and ``MIN_PROBE_EXCESS_S``) at the
end of two windows in a row (one probe is noisier than a window of steps): a ``compute`` record
beside the ``host`` one. A slow host loop leaves the probe alone, and a
slowed device leaves the host loop alone, so the two kinds tell the causes apart.

A process stopped from outside part of the time (SIGSTOP, a cgroup's CPU quota) may run the
probe inside one of its running stretches, so a third measure covers it: the share of the
window's wall time its ``HiccupMeter`` woke late (``training.hiccups``). One over the factor
times the others' median and at least ``MIN_STALLED_SHARE`` above it is named at the end of
that window: a ``stalled`` record (a whole window's share is steadier than one probe).

``JAXDIST_FAULT_SLOW=RANK:SECONDS[:FROM_STEP[:TO_STEP]]`` is a fault-injection hook for tests:
that rank sleeps so long in each step's host work (in those steps), as a process with a slow loader would.
``JAXDIST_FAULT_SLOW_SHRUNK=PROCESSES:SECONDS`` slows every process of a run started with fewer than
PROCESSES processes alike: a run that shrank trains slowly, so that a test's joining node arrives before its end.
"""

from __future__ import annotations

import logging
import os
import socket
import statistics
import threading
import time

from jaxdist.cluster import recoverable
from jaxdist.cluster.heartbeat import fault_point
from jaxdist.errors import JaxdistError
from jaxdist.training.hiccups import HiccupMeter

log = logging.getLogger(__name__)
ENV_SLOW = "JAXDIST_FAULT_SLOW"  # test-only fault injection: "RANK:SECONDS"
ENV_SLOW_SHRUNK = "JAXDIST_FAULT_SLOW_SHRUNK"  # test-only fault injection: "PROCESSES:SECONDS"
MIN_SHARE = 0.05  # an excess below this share of the step time is not named,
MIN_EXCESS_S = 0.010  # nor one under 10 ms (process 0, which writes the metrics, runs a few ms over the others)
MIN_PROBE_EXCESS_S = 0.010  # a probe under 10 ms over the others' is timer noise
MIN_STALLED_SHARE = 0.2  # stopped a fifth of the window more than the others: a second job's load stays well under
HOST_BYTES = 64
PROBE = {"cpu": (256, 120), "gpu": (4096, 10)}  # (matrix size, matmuls in a row): 50-100 ms here (2 CPU cores), ~25 ms on an H100


class ComputeProbe:
    """A fixed chain of matmuls on this process's first device, compiled once, timed on demand."""

    def __init__(self, device):
        import jax
        import jax.numpy as jnp

        self.platform = device.platform
        size, repeats = PROBE.get(device.platform, PROBE["gpu"])
        self.x = jax.device_put(jnp.full((size, size), 1.0 / size, jnp.float32), device)
        self.fn = jax.jit(lambda x: jax.lax.fori_loop(0, repeats, lambda _, y: jnp.tanh(y @ x), x))
        jax.block_until_ready(self.fn(self.x))  # compiled and warm: the first window's time is the work's

    def seconds(self, runs: int = 3) -> float:
        """The fastest of ``runs``: a burst of another thread's or process's work (a loader's
        read-ahead, another job on a shared host) is left out unless it lasts through all of
        them (with two, a loaded 2-core host once named a process twice in a row), while a process
        stopped part of every period cannot run the whole chain in one of its running stretches
        unless they are longer than the chain."""
        import jax

        best = float("inf")
        for _ in range(runs):
            start = time.perf_counter()
            jax.block_until_ready(self.fn(self.x))
            best = min(best, time.perf_counter() - start)
        return best


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
        self.slow_s, self.slow_from, self.slow_to = _slow_seconds(self.rank)
        self.shrunk_s = _slow_shrunk_seconds(jax.process_count())
        self.probe = ComputeProbe(jax.local_devices()[0]) if self.enabled else None
        self.hiccups = HiccupMeter() if self.enabled else None
        self.slow_probe: int | None = None  # process 0: whose probe was over the factor in the last window
        self.slow_host: int | None = None  # process 0: whose own time was over the factor in the last window
        self.measures: dict | None = None  # process 0: the last compared window's measures (``take_measures``)

    def host_work(self, seconds: float) -> None:
        """``seconds`` of this step's own host work (not waiting for devices)."""
        if not self.enabled:  # one process, or the watch is off: nothing is compared
            return
        self.own += seconds
        queued = runqueue_wait_s()  # waiting for a CPU since the last step: slowed from outside
        self.per_step.append(self.own + queued - self.queued)
        self.own, self.queued = 0.0, queued

    def injected_delay(self, step: int) -> None:
        if self.slow_s and step >= self.slow_from and (self.slow_to is None or step <= self.slow_to):
            time.sleep(self.slow_s)
        if self.shrunk_s:
            time.sleep(self.shrunk_s)

    def step_done(self, step: int, state=None) -> list[dict]:
        """Called by every process after each step (``state``: the step's result): at the end of a
        window, process 0's straggler records (a ``host`` and a ``compute`` one at most), else []."""
        if not self.enabled:
            return []
        now = time.perf_counter()
        if self.window_start is not None:  # the first step's time (from the compile) is no one's
            self.step_times.append(now - self.window_start)
        self.window_start = now
        if step % self.window:  # windows end at the same steps on every process, one that rejoined included
            return []
        import jax
        import numpy as np

        steps, step_s = self.window, statistics.median(self.step_times or [0.0])  # a step's median: saves and evals left out
        live = recoverable.MEMBERSHIP.live_processes()  # all of them, unless an in-process recovery left some out
        fault_point("gather", step)
        if self.hosts is None or len(self.hosts) != len(live):
            name = socket.gethostname().encode()[:HOST_BYTES].ljust(HOST_BYTES, b"\0")
            gathered = recoverable.process_allgather(np.frombuffer(name, np.uint8), "straggler-hosts")
            self.hosts = [bytes(row).rstrip(b"\0").decode(errors="replace") for row in np.asarray(gathered).reshape(-1, HOST_BYTES)]
        if state is not None:
            jax.block_until_ready(state)  # the step still running would be in the probe's time
        stalled = self.hiccups.take()  # before the probes: the others' turns are waits
        probe_s = self._probe_in_turn(live)
        # the median step: a pause of the machine's in one step is not a straggler
        mine = np.array([statistics.median(self.per_step or [0.0]), probe_s, stalled], np.float32)
        own = np.asarray(recoverable.process_allgather(mine, "straggler-own")).reshape(-1, 3)
        self.window_start, self.per_step, self.step_times = time.perf_counter(), [], []
        self.windows += 1
        if jax.process_index() != 0 or self.windows == 1:  # the first window warms up (start-up noise): compared from the second
            return []
        steps_range = (step - steps + 1, step)
        # every process's three measures, for a reader asking why someone was (not) named
        self.measures = {
            "processes": live,
            "own_ms_per_step": [round(1e3 * float(x), 3) for x in own[:, 0]],
            "probe_ms": [round(1e3 * float(x), 3) for x in own[:, 1]],
            "stalled_share": [round(float(x), 3) for x in own[:, 2]],
            "steps": list(steps_range),
        }
        host = straggler(own[:, 0].tolist(), step_s, self.factor, self.hosts, steps_range)
        host_before, self.slow_host = self.slow_host, None if host is None else live[host["process"]]
        # two windows in a row, as the probe: process 0's extra work (metrics, logs) after the warm-up
        # window once put its own time over the factor for one window under a second job's load
        records = [dict(host, steps=[step - 2 * steps + 1, step]) if host is not None and host_before == self.slow_host else None]
        records.append(stalled_from_outside(own[:, 2].tolist(), self.factor, self.hosts, steps_range))
        compute = slow_compute(own[:, 1].tolist(), self.factor, self.hosts, (step - 2 * steps + 1, step))
        named_before, self.slow_probe = self.slow_probe, None if compute is None else live[compute["process"]]
        if compute is not None and named_before == self.slow_probe:  # one probe is noisier than a window of steps: two in a row
            records.append(compute)
        records = [r for r in records if r is not None]
        for record in records:
            record["process"] = live[record["process"]]  # a row of the gather -> the process's own index
        return records

    def take_measures(self) -> dict | None:
        """The measures of the window compared at the last ``step_done`` (process 0), once."""
        measures, self.measures = self.measures, None
        return measures

    def _probe_in_turn(self, live: list[int]) -> float:
        """This process's probe time. CPU devices share the host's cores, so there the processes
        take turns (the others wait at a barrier); GPUs are each their own, so they probe at once."""
        import jax

        if self.probe.platform != "cpu":
            recoverable.MEMBERSHIP.sync("straggler-probe")
            return self.probe.seconds()
        mine = 0.0
        for process in live:
            recoverable.MEMBERSHIP.sync("straggler-probe")
            if process == jax.process_index():
                mine = self.probe.seconds()
        return mine


def furthest_over(values: list[float], factor: float, floor: float) -> tuple[int, float] | None:
    """(the index, the others' median) of the value furthest over ``factor`` times the others'
    median and at least ``floor`` above it; None when none is."""
    worst = None
    for rank, value in enumerate(values):
        others = statistics.median(values[:rank] + values[rank + 1 :])
        if value > factor * others and value - others >= floor and (worst is None or value - others > worst[2]):
            worst = (rank, others, value - others)
    return None if worst is None else worst[:2]


def straggler(own_s: list[float], step_s: float, factor: float, hosts: list[str], steps: tuple[int, int]) -> dict | None:
    """The process furthest over ``factor`` times the others' median own time per step (and over
    the floors), as a ``host`` record; None when nobody is."""
    worst = furthest_over(own_s, factor, max(MIN_SHARE * step_s, MIN_EXCESS_S))
    if worst is None:
        return None
    rank, others = worst
    return _record("host", rank, hosts, steps, own_ms_per_step=own_s[rank], others_median_ms=others, step_ms=step_s)


def slow_compute(probe_s: list[float], factor: float, hosts: list[str], steps: tuple[int, int]) -> dict | None:
    """The process whose probe took longest over ``factor`` times the others' median (and over
    ``MIN_PROBE_EXCESS_S``), as a ``compute`` record; None when nobody's did."""
    worst = furthest_over(probe_s, factor, MIN_PROBE_EXCESS_S)
    if worst is None:
        return None
    rank, others = worst
    return _record("compute", rank, hosts, steps, probe_ms=probe_s[rank], others_probe_ms=others)


def stalled_from_outside(shares: list[float], factor: float, hosts: list[str], steps: tuple[int, int]) -> dict | None:
    """The process that woke late for the largest share of the window over ``factor`` times the
    others' median (and ``MIN_STALLED_SHARE`` above it), as a ``stalled`` record; None when none did."""
    worst = furthest_over(shares, factor, MIN_STALLED_SHARE)
    if worst is None:
        return None
    rank, others = worst
    return {
        "process": rank,
        "kind": "stalled",
        "host": hosts[rank],
        "stalled_share": round(shares[rank], 3),
        "others_stalled_share": round(others, 3),
        "steps": list(steps),
    }


def _record(kind: str, rank: int, hosts: list[str], steps: tuple[int, int], **seconds: float) -> dict:
    """A straggler record: ``seconds`` written in milliseconds."""
    return {"process": rank, "kind": kind, "host": hosts[rank], **{k: round(1e3 * v, 3) for k, v in seconds.items()}, "steps": list(steps)}


def straggler_line(record: dict, factor: float) -> str:
    if record.get("kind") == "stalled":
        first, last = record["steps"]
        return (
            f"straggler: process {record['process']} on {record['host']} was kept from running for "
            f"{100 * record['stalled_share']:.0f}% of steps {first}-{last}'s wall time (its threads woke that late), the others' "
            f"median {100 * record['others_stalled_share']:.0f}%: stopped or throttled from outside (a CPU quota, SIGSTOP, "
            f"a host short of memory) (train.straggler_factor {factor:g})"
        )
    if record.get("kind") == "compute":
        ratio = record["probe_ms"] / max(record["others_probe_ms"], 1e-9)
        first, last = record["steps"]
        return (
            f"straggler: process {record['process']} on {record['host']} took {record['probe_ms']:.1f} ms for the fixed computation "
            f"every process times, at the end of two windows in a row (steps {first}-{last}), {ratio:.1f}x the others' median "
            f"{record['others_probe_ms']:.1f} ms: "
            f"slowed as a whole (its device, or its share of the CPU) (train.straggler_factor {factor:g})"
        )
    ratio = record["own_ms_per_step"] / max(record["others_median_ms"], 1e-9)
    first, last = record["steps"]
    return (
        f"straggler: process {record['process']} on {record['host']} spent {record['own_ms_per_step']:.1f} ms per step of its own "
        f"work, over the factor at the end of two windows in a row (steps {first}-{last}), {ratio:.1f}x the others' median "
        f"{record['others_median_ms']:.1f} ms in the last (step {record['step_ms']:.1f} ms; train.straggler_factor {factor:g})"
    )


def _slow_seconds(rank: int) -> tuple[float, int, int | None]:
    spec = os.environ.get(ENV_SLOW)
    if not spec:
        return 0.0, 0, None
    parts = spec.split(":")
    try:
        slow_rank, seconds = int(parts[0]), float(parts[1])
        from_step, to_step = int(parts[2]) if len(parts) > 2 else 0, int(parts[3]) if len(parts) > 3 else None
    except (ValueError, IndexError):
        raise JaxdistError(f"{ENV_SLOW}={spec!r}: expected RANK:SECONDS[:FROM_STEP[:TO_STEP]] (a fault-injection hook for tests)") from None
    return (seconds, from_step, to_step) if slow_rank == rank else (0.0, 0, None)


def _slow_shrunk_seconds(processes: int) -> float:
    spec = os.environ.get(ENV_SLOW_SHRUNK)
    if not spec:
        return 0.0
    try:
        below, seconds = spec.split(":")
        return float(seconds) if processes < int(below) else 0.0
    except ValueError:
        raise JaxdistError(f"{ENV_SLOW_SHRUNK}={spec!r}: expected PROCESSES:SECONDS (a fault-injection hook for tests)") from None


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
