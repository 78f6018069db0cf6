"""What the launcher shows of its processes' output: everything, less the lines that native
code and Python print around a death the launcher names in its own line (kept at
``--log-level debug``). ``ChildOutput`` reads one process's lines in order; a line may only
be judged with the ones after it (a Python traceback ends at its exception line), so it
hands back lines as they are decided, each with whether it is noise."""

from __future__ import annotations

import re

from jaxdist.cluster.distributed import GlooChatter
from jaxdist.layout.native_output import is_plugin_noise

# Python's resource tracker in a process whose Grain workers shared memory with a killed peer
# or parent: it frees them and warns, two lines, nothing to act on
LEAKED_AT_A_KILL = re.compile(
    r".*resource_tracker\.py:\d+: UserWarning: resource_tracker: There appear to be \d+ leaked .*|\s+warnings\.warn\('resource_tracker: .*"
)

# A peer's abort when the coordination service's process (rank 0) dies: the preemption
# notifier's and absl's error and fatal lines and gRPC's detail. The launcher names the death
# and restarts in its own line; the abort adds nothing to act on (kept at --log-level debug,
# e.g. for a network fault with every process alive).
_ABSL_AT = r"[WEF]\d{4} [\d:.]+\s+\d+ "
PEERS_ABORT_AT_A_DEATH = re.compile(
    _ABSL_AT + r"coordination_service_agent\.cc:\d+\] Polled an error from coordination service.*"
    r"|" + _ABSL_AT + r"client\.h:\d+\] Terminating process because the JAX distributed service detected fatal errors.*"
    r"|" + _ABSL_AT + r"preemption_sync_manager\.cc:\d+\] Failed to retrieve preemption notice from coordination service: UNAVAILABLE.*"
    r"|" + _ABSL_AT + r"preemption_sync_manager\.cc:\d+\] Failed to cancel preemption barrier: .*PREEMPTION_SYNC_BARRIER.*"
    r"|Additional GRPC error information from remote target coordination_service while calling .*"
    r"|:UNKNOWN:Error received from peer .*grpc_status:14.*"
)
# the stack absl prints under that fatal line
ABORT_STACK = re.compile(r"\*\*\* Check failure stack trace: \*\*\*|\s+@\s+0x[0-9a-f]+\s.*")

TRACEBACK = "Traceback (most recent call last):"
# A Grain worker (multiprocessing's spawn) whose parent was killed while it started: it reads a
# truncated pickle of its task from the parent and dies with this traceback, nothing to act on
ORPHANED_SPAWN_ERROR = re.compile(r"_pickle\.UnpicklingError: .*|EOFError.*")


class ChildOutput:
    """One process's output, line by line: ``feed(line)`` and, at its end, ``close()`` each
    return the lines decided so far as (line, is_noise), in order."""

    def __init__(self):
        self.gloo = GlooChatter()
        self.aborting = False  # the coordination service's loss was printed: absl's stack follows
        self.traceback: list[str] | None = None  # a Python traceback's lines until its exception line

    def feed(self, line: str) -> list[tuple[str, bool]]:
        text = line.rstrip("\n")
        if self.traceback is not None:
            self.traceback.append(line)
            if text[:1].isspace() or not text:  # a frame, its source line, or a caret line
                return []
            return self._end_traceback(text)
        if text == TRACEBACK:
            self.traceback = [line]
            return []
        if PEERS_ABORT_AT_A_DEATH.fullmatch(text):
            self.aborting = True
            return [(line, True)]
        noise = (
            self.gloo(line)
            or is_plugin_noise(line)
            or LEAKED_AT_A_KILL.fullmatch(text) is not None
            or (self.aborting and ABORT_STACK.fullmatch(text) is not None)
        )
        return [(line, bool(noise))]

    def close(self) -> list[tuple[str, bool]]:
        """The end of the output (the process ended, maybe mid-traceback: shown as it is)."""
        lines, self.traceback = self.traceback or [], None
        return [(line, False) for line in lines]

    def _end_traceback(self, exception_line: str) -> list[tuple[str, bool]]:
        lines, self.traceback = self.traceback, None
        orphaned = ORPHANED_SPAWN_ERROR.fullmatch(exception_line) and any("multiprocessing/spawn.py" in x for x in lines)
        return [(line, bool(orphaned)) for line in lines]
