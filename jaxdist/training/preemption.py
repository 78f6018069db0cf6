"""Preemption: SIGTERM / SIGINT ask the loop to finish its step, save and exit.

One process: a signal handler sets a flag the loop reads after each step. Several
processes: they must agree on the step to save at, so the loop asks JAX's preemption
sync point (the coordination service notices SIGTERM on any host) instead; SIGINT
(Ctrl-C) is turned into a SIGTERM to this process so that it takes the same path.
"""

from __future__ import annotations

import os
import signal
import sys
from types import FrameType

from jaxdist.errors import EXIT_PREEMPTED, RunStopped


class Preempted(RunStopped):
    """Raised by the loop once the state at ``step`` is saved and committed (``saved``
    False: a run without a run directory stopped there with nothing to save)."""

    exit_code = EXIT_PREEMPTED

    def __init__(self, step: int, reason: str, saved: bool = True):
        where = (
            f"state saved at step {step}; run the same command to resume"
            if saved
            else f"stopped after step {step}; nothing saved (no run directory)"
        )
        super().__init__(f"preempted by {reason}; {where}")
        self.step, self.saved = step, saved


class PreemptionWatcher:
    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, multi_process: bool = False):
        self.multi_process = multi_process
        self.reason: str | None = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> PreemptionWatcher:
        if self.multi_process:  # JAX's own handler reports SIGTERM to the coordination service
            self._previous[signal.SIGINT] = signal.signal(signal.SIGINT, self._handle_interrupt_as_term)
        else:
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.reason is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: stop now
        self.reason = name
        # a signal handler prints rather than logs: it may interrupt the logging machinery itself
        print(f"jaxdist: {name} received; finishing this step, saving, then exiting", file=sys.stderr, flush=True)

    def _handle_interrupt_as_term(self, signum: int, frame: FrameType | None) -> None:
        if self.reason is not None:
            raise KeyboardInterrupt  # a second Ctrl-C: stop now
        self.reason = "SIGINT"
        print("jaxdist: SIGINT received; all processes finish the same step, save, then exit", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGTERM)

    def requested(self, step: int) -> bool:
        if self.multi_process:
            from jax.experimental import multihost_utils

            # Only the sync point decides, so that every process saves at the same step.
            if multihost_utils.reached_preemption_sync_point(step):
                self.reason = self.reason or "the cluster (preemption sync point)"
                return True
            return False
        return self.reason is not None
