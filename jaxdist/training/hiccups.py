"""How long this process was kept from running: a thread that sleeps a few milliseconds at a
time and adds up how late it wakes (jHiccup's method).

A process stopped from outside (SIGSTOP, a cgroup's ``cpu.max`` quota spent, a host paging
hard) stops its threads together, so the sleeper wakes late by the whole stop, whichever of
the process's own threads would have been running. A process waiting for its peers inside a
collective is asleep, not stopped: its sleeper wakes on time. So the share of a window's
wall time spent late tells a process slowed as a whole from one that only waits, at any
stop length above a few milliseconds, which a timed computation of fixed length can slip
between (it may finish inside one running stretch).
"""

from __future__ import annotations

import threading
import time

PERIOD_S = 0.005  # the sleeper's nap: 200 wakes a second cost well under 1% of a core
IGNORED_LATE_S = 0.002  # a wake this late or less is the scheduler's and the GIL's ordinary jitter


class HiccupMeter:
    """A daemon thread measuring how late it wakes; ``take()`` reads and restarts the count.
    It lives as long as the process (a daemon: nothing to join at exit)."""

    def __init__(self, period_s: float = PERIOD_S):
        self.period_s = period_s
        self._lock = threading.Lock()
        self._late_s = 0.0
        self._since = time.monotonic()
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
        spent late, in [0, 1]; the count starts again."""
        now = time.monotonic()
        with self._lock:
            late, self._late_s = self._late_s, 0.0
            since, self._since = self._since, now
        return min(1.0, late / max(now - since, 1e-9))
