"""How long this process was kept from running: a thread that sleeps a few milliseconds at a
time and adds up how late it wakes (jHiccup's method).

A process stopped from outside (SIGSTOP, a cgroup's ``cpu.max`` quota spent, a host paging
hard) stops its threads together, so the sleeper wakes late by the whole stop, whichever of
the process's own threads would have been running. A process waiting for its peers inside a
collective is asleep, not stopped: its sleeper wakes on time. So the share of a window's
wall time spent late tells a process slowed as a whole from one that only waits, at any
stop length above a few milliseconds, which a timed computation of fixed length can slip
between (it may finish inside one running stretch).

A CPU quota that throttles a process now and then for a few milliseconds at a time holds it
back without making a sleeping thread much later, so the kernel's own count is read beside it:
the time this process's cgroup was throttled (``cpu.stat``: ``throttled_usec`` under cgroup v2,
``throttled_time`` under v1's cpu controller). A window's stalled share is the larger of the two.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

PERIOD_S = 0.005  # the sleeper's nap: 200 wakes a second cost well under 1% of a core
IGNORED_LATE_S = 0.002  # a wake this late or less is the scheduler's and the GIL's ordinary jitter
CGROUP_ROOT = Path("/sys/fs/cgroup")


class HiccupMeter:
    """A daemon thread measuring how late it wakes; ``take()`` reads and restarts the count.
    It lives as long as the process (a daemon: nothing to join at exit)."""

    def __init__(self, period_s: float = PERIOD_S):
        self.period_s = period_s
        self._lock = threading.Lock()
        self._late_s = 0.0
        self._since = time.monotonic()
        self._throttled = ThrottledTime()
        self._thread = threading.Thread(target=self._run, name="jaxdist-hiccups", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            start = time.monotonic()
            time.sleep(self.period_s)
            late = time.monotonic() - start - self.period_s
            if late > IGNORED_LATE_S:
                with self._lock:
                    self._late_s += late

    def take(self) -> float:
        """The share of wall time since the last ``take()`` (or the start) that this process
        spent late, or its cgroup throttled, whichever is larger, in [0, 1]; the count starts again."""
        now = time.monotonic()
        with self._lock:
            late, self._late_s = self._late_s, 0.0
            since, self._since = self._since, now
        throttled = self._throttled.take()
        return min(1.0, max(late, throttled) / max(now - since, 1e-9))


class ThrottledTime:
    """Seconds this process's cgroup was throttled by its CPU quota, counted between ``take()``
    calls (0 without a cgroup cpu controller, and over a window in which the process moved cgroups)."""

    def __init__(self):
        self._path, self._seen = cpu_stat_path(), None
        self._seen = throttled_s(self._path)

    def take(self) -> float:
        path = cpu_stat_path()
        now = throttled_s(path)
        before = self._seen if path == self._path else None
        self._path, self._seen = path, now
        return 0.0 if now is None or before is None else max(0.0, now - before)


def cpu_stat_path() -> Path | None:
    """This process's cgroup's ``cpu.stat``: v1's cpu controller where it has one, else v2's."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    found = None
    for line in lines:
        _, controllers, group = line.split(":", 2)
        names = controllers.split(",")
        if "cpu" in names:  # v1: mounted as "cpu" or "cpu,cpuacct"
            for mount in (controllers, "cpu"):
                path = CGROUP_ROOT / mount / group.lstrip("/") / "cpu.stat"
                if path.exists():
                    return path
        elif controllers == "" and found is None:  # v2's unified tree
            for root in (CGROUP_ROOT, CGROUP_ROOT / "unified"):
                path = root / group.lstrip("/") / "cpu.stat"
                if path.exists():
                    found = path
                    break
    return found


def throttled_s(path: Path | None) -> float | None:
    """The cumulative throttled seconds in ``cpu.stat`` at ``path``; None where it has no such count."""
    if path is None:
        return None
    try:
        fields = dict(line.split() for line in path.read_text().splitlines() if len(line.split()) == 2)
    except (OSError, ValueError):
        return None
    if "throttled_usec" in fields:  # v2
        return int(fields["throttled_usec"]) / 1e6
    if "throttled_time" in fields:  # v1, nanoseconds
        return int(fields["throttled_time"]) / 1e9
    return None
