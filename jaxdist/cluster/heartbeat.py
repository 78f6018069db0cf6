"""Progress beats for the launcher's hang watch (``jaxdist.launch --hang-timeout``).

JAX's own heartbeat notices a dead process, not a deadlocked one. Under the launcher
(``JAXDIST_HEARTBEAT_DIR`` set) each process writes the step it starts to
``DIR/rank-I`` and the first step it started ("STEP FIRST": one small write per step;
the file's mtime is the time of its last progress; the first step is written so that the
watch knows a process is past it without having seen its first beat), and dumps every thread's Python stack to stderr on SIGUSR1 (faulthandler),
which the launcher sends before it stops a stalled run. ``ProgressWatch`` is the
launcher's side. Without the variable the beats are no-ops.

``JAXDIST_FAULT_STALL_AT=RANK:STEP`` is a fault-injection hook for tests: that rank
sleeps for good when it reaches that step, as a deadlocked process would;
``JAXDIST_FAULT_KILL_AT=RANK:STEP`` SIGKILLs that rank there (a machine that dies mid-run), and
``RANK:STEP:PHASE`` in a phase of that step (``FAULT_PHASES``; STEP 0 for the phases before the
first step); several, comma-separated, kill in turn (with ``JAXDIST_FAULT_KILL_ONCE=FILE`` each
at most once: entry i creates ``FILE.i``, so a restarted set goes on to the next).
"""

from __future__ import annotations

import dataclasses
import faulthandler
import logging
import os
import signal
import time
from pathlib import Path

from jaxdist.errors import JaxdistError

ENV_DIR = "JAXDIST_HEARTBEAT_DIR"
ENV_STALL = "JAXDIST_FAULT_STALL_AT"  # test-only fault injection: "RANK:STEP"
ENV_KILL = "JAXDIST_FAULT_KILL_AT"  # test-only fault injection: "RANK:STEP[:PHASE]", comma-separated
ENV_KILL_ONCE = "JAXDIST_FAULT_KILL_ONCE"  # test-only: files the kills create first; an entry whose file exists kills no more
ENV_RANK = "JAXDIST_PROCESS_ID"  # set by jaxdist.launch (jaxdist.cluster.distributed.ENV_PROCESS_ID)
DUMP_SIGNAL = signal.SIGUSR1
EVERY_PROCESS = {"every_process": True}  # this rank's own lines: said whatever its process index

log = logging.getLogger(__name__)


def beat_path(directory: Path, rank: int) -> Path:
    return Path(directory) / f"rank-{rank}"


def beat_step(directory: Path, rank: int) -> int | None:
    """The step ``rank`` last started (its beat file's first field); None before its first beat."""
    try:
        fields = beat_path(directory, rank).read_text().split()
    except OSError:
        return None
    return int(fields[0]) if fields and fields[0].isascii() and fields[0].isdigit() else None


class _Beat:
    """This process's beat file, kept open: a beat is one pwrite (steps only grow, so a
    shorter number never leaves digits behind)."""

    def __init__(self):
        directory = os.environ.get(ENV_DIR)
        self.rank = int(os.environ.get(ENV_RANK, "0") or 0)
        self.stall_step = _fault_step(ENV_STALL, self.rank)
        self.first_step: int | None = None
        self.fd = None
        if directory:
            try:
                self.fd = os.open(beat_path(Path(directory), self.rank), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            except OSError as e:
                log.warning(
                    f"cannot write the launcher's heartbeat in {directory} ({e.strerror}); a hang will not be noticed", extra=EVERY_PROCESS
                )

    def __call__(self, step: int) -> None:
        _kill_if(step, None)
        if step == self.stall_step:
            log.info(f"fault injection ({ENV_STALL}): rank {self.rank} stalls at step {step}", extra=EVERY_PROCESS)
            while True:
                time.sleep(3600)
        if self.first_step is None:
            self.first_step = step
        if self.fd is not None:  # steps only grow after the first, so the text never shrinks
            os.pwrite(self.fd, b"%d %d\n" % (step, self.first_step), 0)


# Where a kill can land besides a step's start: the process's start, after joining the
# process group, as the first step compiles, while a step runs, a save, an evaluation, a
# straggler window's gather, an in-process recovery and a replacement's rejoin under way.
FAULT_PHASES = ("start", "init", "compile", "step", "save", "eval", "gather", "recovery", "rejoin")


_kills: list[tuple[int, int | None, str | None]] | None = None  # this rank's (entry, step, phase), read once


def _kill_if(step: int, phase: str | None) -> None:
    global _kills
    if _kills is None:
        _kills = _fault_points(ENV_KILL, int(os.environ.get(ENV_RANK, "0") or 0))
    if any(s in (step, None) and p == phase and _first_kill(entry) for entry, s, p in _kills):
        where = f"step {step}" if phase is None else f"the {phase} of step {step}" if step else f"its {phase} (before its first step)"
        log.info(f"fault injection ({ENV_KILL}): rank {os.environ.get(ENV_RANK, '0')} is killed at {where}", extra=EVERY_PROCESS)
        os.kill(os.getpid(), signal.SIGKILL)


def _first_kill(entry: int) -> bool:
    """No ``JAXDIST_FAULT_KILL_ONCE`` file, or this call created entry's: the kill happens."""
    once = os.environ.get(ENV_KILL_ONCE)
    if not once:
        return True
    try:
        os.close(os.open(f"{once}.{entry}", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    except FileExistsError:
        return False
    return True


def _fault_step(variable: str, rank: int) -> int | None:
    step, phase = _fault_point(variable, rank)
    if phase is not None:
        raise JaxdistError(f"{variable}: expected RANK:STEP (a fault-injection hook for tests)")
    return step


def _fault_point(variable: str, rank: int) -> tuple[int | None, str | None]:
    """(step, phase) of ``variable``'s first "RANK:STEP[:PHASE]" for ``rank``, else (None, None)."""
    points = _fault_points(variable, rank)
    return points[0][1:] if points else (None, None)


def _fault_points(variable: str, rank: int) -> list[tuple[int, int | None, str | None]]:
    """(entry, step, phase) of each of ``variable``'s comma-separated "RANK:STEP[:PHASE]" for ``rank``."""
    spec = os.environ.get(variable)
    points = []
    for entry, point in enumerate(spec.split(",") if spec else ()):
        fault_rank, step, *phase = point.split(":")
        any_step = step == "*" and bool(phase)  # e.g. a rejoin, at whichever step the replacement connects
        if not (fault_rank.isdigit() and (step.isdigit() or any_step)) or len(phase) > 1 or (phase and phase[0] not in FAULT_PHASES):
            raise JaxdistError(
                f"{variable}={spec!r}: expected RANK:STEP or RANK:STEP:PHASE (comma-separated; STEP * with a PHASE: any step), PHASE one of "
                f"{', '.join(FAULT_PHASES)} (a fault-injection hook for tests)"
            )
        if int(fault_rank) == rank:
            points.append((entry, None if any_step else int(step), phase[0] if phase else None))
    return points


_beat: _Beat | None = None


def beat(step: int) -> None:
    """This process starts ``step`` (the training loop calls it once per step)."""
    global _beat
    if _beat is None:
        _beat = _Beat()
    _beat(step)


def fault_point(phase: str, step: int = 0) -> None:
    """The process enters ``phase`` (one of FAULT_PHASES) of ``step``: where a test's
    ``JAXDIST_FAULT_KILL_AT=RANK:STEP:PHASE`` kills it (without the variable: nothing)."""
    if os.environ.get(ENV_KILL):
        _kill_if(step, phase)


def install_stack_dump() -> None:
    """Under the launcher: SIGUSR1 prints every thread's Python stack to stderr (from the
    C signal handler, so also while a thread is stuck inside a C call), and the process goes on."""
    if os.environ.get(ENV_DIR):
        faulthandler.register(DUMP_SIGNAL, all_threads=True)


@dataclasses.dataclass(frozen=True)
class Stall:
    rank: int
    idle_s: float  # seconds since its last beat (since the start, in the first step)
    step: int | None  # the last step it started; None: it never started one
    limit_s: float
    first: bool = False  # it has not finished its first step


class ProgressWatch:
    """The launcher's side: which of its processes has made no progress for too long.

    Until every process has finished its first step (start-up, restore, the compile, and
    the first step itself, which compiles and connects more) the allowance is
    ``first_step_timeout_s`` from the start; then ``hang_timeout_s`` between two beats of each.
    """

    def __init__(self, directory: Path, nproc: int, hang_timeout_s: float, first_step_timeout_s: float, first_rank: int = 0):
        self.directory, self.nproc, self.first_rank = Path(directory), nproc, first_rank  # ranks first_rank .. + nproc - 1
        self.hang_timeout_s, self.first_step_timeout_s = hang_timeout_s, first_step_timeout_s
        self.started = time.time()
        self.first_step: dict[int, int] = {}  # the step each process beat first

    def restarted(self, rank: int) -> None:
        """``rank`` was started again (a replacement): everyone waits for its first step."""
        self.first_step.pop(rank, None)
        self.started = time.time()

    def _read(self, rank: int) -> tuple[float, int | None] | None:
        path = beat_path(self.directory, rank)
        try:
            mtime = path.stat().st_mtime
            fields = path.read_text().split()
        except OSError:
            return None
        if not fields or not all(f.isascii() and f.isdigit() for f in fields):
            return mtime, None
        if len(fields) > 1:  # "STEP FIRST": the process's own first step
            self.first_step[rank] = int(fields[1])
        return mtime, int(fields[0])

    def _past_first_step(self, rank: int, beat: tuple[float, int | None] | None) -> bool:
        if beat is None or beat[1] is None:
            return False
        # A beat without its first step: the first one this watch saw (a poll may miss it).
        first = self.first_step.setdefault(rank, beat[1])
        return beat[1] > first

    def stalled(self, running: list[bool]) -> Stall | None:
        """The stalled process to blame (the one furthest behind), or None. While one is
        still in its first step the others wait for it, so only the first-step allowance
        counts then."""
        now = time.time()
        beats = {self.first_rank + i: self._read(self.first_rank + i) for i in range(self.nproc) if running[i]}
        starting = [rank for rank, beat in beats.items() if not self._past_first_step(rank, beat)]
        if starting:
            idle = now - self.started
            if idle <= self.first_step_timeout_s:
                return None
            rank = starting[0]
            return Stall(rank, idle, beats[rank][1] if beats[rank] else None, self.first_step_timeout_s, first=True)
        stalls = [Stall(rank, now - mtime, step, self.hang_timeout_s) for rank, (mtime, step) in beats.items()]
        stalls = [s for s in stalls if s.idle_s > s.limit_s]
        return min(stalls, key=lambda s: (s.step, -s.idle_s)) if stalls else None
