"""A set of training processes on this machine: start them, forward signals, watch their
progress, stop them (the work of ``python -m jaxdist.launch``; its module doc says what a
run does, step by step, and what each exit code means).

On one machine the set is the whole run: the coordinator listens on 127.0.0.1 only, on a
port held for the whole set (``reserve_port``). On several nodes (``Placement``) it is one
node's share: global process ids from ``first_id``, the coordinator on node 0's address
(that node holds its port). Every trainer dies with the launcher (``die_with_parent``) and
beats once per step into a directory the hang watch reads (``jaxdist.cluster.heartbeat``).
``run_plain`` is one set, started again on another port when the coordinator's was taken;
the elastic loops (``jaxdist.cluster.elastic_launch``, ``jaxdist.cluster.node_launch``) run
generations of ``Launcher``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from jaxdist.cluster.child_output import ChildOutput
from jaxdist.cluster.distributed import (
    ENV_COORDINATOR,
    ENV_COORDINATOR_BIND,
    ENV_NUM_PROCESSES,
    ENV_OUTPUT_FILTERED,
    ENV_PROCESS_ID,
    EXIT_PORT_TAKEN,
)
from jaxdist.cluster.heartbeat import DUMP_SIGNAL, ENV_DIR, ProgressWatch, Stall, beat_path
from jaxdist.cluster.lifetime import die_with_parent
from jaxdist.cluster.recoverable import ENV_PEER_TIMEOUT, ENV_RECOVERY, ENV_REJOIN, open_slot_path
from jaxdist.errors import EXIT_PREEMPTED, JaxdistError
from jaxdist.layout.xla_flags import with_collective_timeouts

LOOPBACK = "127.0.0.1"  # where the coordinator listens: the processes all run on this machine
GRACE_S = 10.0  # after asking the others to stop, how long before they are killed
SAVE_GRACE_S = 120.0  # for the others to finish a save (a membership change's or one that exited 75); a compile may come first
DUMP_WAIT_S = 1.0  # after asking a stalled set for its stacks, before killing it
PORT_ATTEMPTS = 5  # starts in a row whose coordinator port was taken

log = logging.getLogger(__name__)  # the launcher's notes (hidden by --log-level warning) and errors


def free_port(host: str = LOOPBACK) -> int:
    """A port that nothing on ``host`` uses now (bind-probed on that address)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def reserve_port(host: str, port: int | None = None) -> socket.socket:
    """Hold ``host:port`` (a free port when None) for a set of processes: a bound socket
    that never listens, with SO_REUSEPORT, so that the coordinator (gRPC binds with
    SO_REUSEPORT too) can listen there while no other program binds it in the meantime."""
    for _ in range(PORT_ATTEMPTS):
        candidate = port or free_port(host)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        try:
            sock.bind((host, candidate))
            return sock
        except OSError as e:
            sock.close()
            if port is not None or e.errno != errno.EADDRINUSE:
                raise JaxdistError(f"--port {candidate}: cannot use {host}:{candidate} for the coordinator ({e.strerror})") from None
    raise JaxdistError(f"found no free port on {host} for the coordinator in {PORT_ATTEMPTS} tries")


def _pump(rank: int, stream, out) -> None:
    output = ChildOutput()
    show_all = log.isEnabledFor(logging.DEBUG)
    for line in iter(stream.readline, ""):
        _show(rank, output.feed(line), out, show_all)
    _show(rank, output.close(), out, show_all)


def _show(rank: int, lines: list[tuple[str, bool]], out, show_all: bool) -> None:
    for line, noise in lines:
        if noise and not show_all:
            continue
        end = "" if line.endswith("\n") else "\n"  # a killed process's last line may be cut short
        out.write(f"[rank {rank}] {line}{end}")
    if lines:
        out.flush()


def exit_status(code: int) -> int:
    """A child's return code as an exit status: killed by signal S -> 128 + S."""
    return code if code >= 0 else 128 - code


def describe_exit(code: int) -> str:
    if code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"


@dataclasses.dataclass(frozen=True)
class HangLimits:
    """``--hang-timeout`` / ``--first-step-timeout`` in seconds."""

    hang_timeout_s: float
    first_step_timeout_s: float


def collective_timeouts(hang: HangLimits) -> tuple[float, float]:
    """(each collective's, the first one's) timeout in seconds: twice the hang limits and at least
    a minute, so the hang watch names a stalled rank (with every rank's stacks) before a
    collective waiting on it gives up; the collective timeout is the bound where no watch acts."""
    first = hang.first_step_timeout_s or hang.hang_timeout_s
    return max(60.0, 2 * hang.hang_timeout_s), max(60.0, 2 * first)


@dataclasses.dataclass
class Placement:
    """Where a set sits in a run that spans nodes."""

    coordinator: str  # HOST:PORT of process 0's coordinator
    world: int  # processes in the run, every node's
    first_id: int  # the global id of this set's first process
    bind: str | None = None  # the set that holds process 0: the address its coordinator listens on
    reservation: socket.socket | None = None  # ... and the port it holds until the set is closed


@dataclasses.dataclass
class Ended:
    """How one set of processes ended."""

    kind: str  # done | saved (every process exited 0 or 75) | final | interrupted | failure | hang | port
    code: int  # an exit status (0 done)
    rank: int | None = None  # the failed rank (global)
    raw_code: int | None = None  # its return code as Popen gives it (negative: a signal)
    failed: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # failure: every failed (rank, return code)
    cause: str | None = None  # hang: what the watch saw

    def describe(self) -> str:
        return self.cause or f"rank {self.rank} {describe_exit(self.raw_code)}"


class Launcher:
    """One set of processes: start, forward signals, watch their progress, stop."""

    def __init__(
        self,
        nproc: int,
        train_args: list[str],
        devices_per_proc: int | None,
        port: int | None = None,
        hang: HangLimits | None = None,
        placement: Placement | None = None,
        module: str = "jaxdist.train",
        peer_timeout_s: float | None = None,
    ):
        self.nproc, self.train_args, self.devices_per_proc, self.module = nproc, train_args, devices_per_proc, module
        if placement is None:  # this machine alone: the coordinator on loopback
            reservation = reserve_port(LOOPBACK, port)  # held until close(): nothing else can take the port
            placement = Placement(f"{LOOPBACK}:{reservation.getsockname()[1]}", nproc, 0, LOOPBACK, reservation)
        self.placement, self.first_id, self.reservation = placement, placement.first_id, placement.reservation
        self.host, port_text = placement.coordinator.rsplit(":", 1)
        self.port = int(port_text)
        self.beats = Path(tempfile.mkdtemp(prefix="jaxdist-beats-"))
        self.hang = hang
        self.watch = ProgressWatch(self.beats, nproc, hang.hang_timeout_s, hang.first_step_timeout_s, self.first_id) if hang else None
        self.procs: list[subprocess.Popen] = []
        self.pumps: list[threading.Thread] = []
        self.forwarded: int | None = None  # a signal forwarded before every process had started
        self.signalled_at: float | None = None  # when the first signal was forwarded
        self.saving_since: float | None = None  # when the first process exited 75
        self.seen_ended: dict[int, int] = {}  # global rank -> the look at which its exit was first seen
        self.looks = 0
        self.peer_timeout_s = peer_timeout_s  # set: --recovery in-process (the survivors of a death go on)
        self.lost: set[int] = set()  # ranks that died while the others recovered in-process: no longer watched
        self.replaced: set[int] = set()  # ranks whose replacement was started (it rejoins in-process)

    def _env(self, rank: int) -> dict[str, str]:
        env = dict(os.environ)
        p = self.placement
        env.update({ENV_COORDINATOR: p.coordinator, ENV_NUM_PROCESSES: str(p.world), ENV_PROCESS_ID: str(rank), ENV_DIR: str(self.beats)})
        env.pop(ENV_COORDINATOR_BIND, None)
        if p.bind is not None:  # the set with process 0, the only one whose coordinator listens
            env[ENV_COORDINATOR_BIND] = p.bind
        env["PYTHONUNBUFFERED"] = "1"
        env[ENV_OUTPUT_FILTERED] = "1"  # this launcher drops gloo's lines (or shows them: --log-level debug)
        if self.devices_per_proc:
            flags = " ".join(t for t in env.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in t)
            env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={self.devices_per_proc}".strip()
        if self.hang is not None or self.peer_timeout_s:  # a collective whose peer is gone fails, not after XLA's 30 minutes
            each, first = collective_timeouts(self.hang) if self.hang is not None else (60.0, 120.0)
            if self.peer_timeout_s:  # in-process recovery: the survivors give up on a dead peer this soon
                env.update({ENV_RECOVERY: "in-process", ENV_PEER_TIMEOUT: f"{self.peer_timeout_s:g}"})
                each = self.peer_timeout_s
            env["XLA_FLAGS"] = with_collective_timeouts(env.get("XLA_FLAGS", ""), each, first)
        return env

    def start(self) -> None:
        if self.watch is not None:
            self.watch.started = time.time()
        for rank in range(self.first_id, self.first_id + self.nproc):
            self.procs.append(self._spawn(rank, self._env(rank)))

    def _spawn(self, rank: int, env: dict[str, str]) -> subprocess.Popen:
        proc = subprocess.Popen(
            [sys.executable, "-m", self.module, *self.train_args],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            preexec_fn=die_with_parent(os.getpid()),  # started from the main thread, which lives as long as the launcher
        )
        if self.forwarded is not None:  # the signal came while this one was starting
            proc.send_signal(self.forwarded)
        pump = threading.Thread(target=_pump, args=(rank, proc.stdout, sys.stdout), daemon=True)
        pump.start()
        self.pumps.append(pump)
        return proc

    def opened_slots(self) -> list[int]:
        """Lost ranks whose replacement the live processes are ready for (``recoverable.open_slot``)."""
        return [rank for rank in sorted(self.lost) if os.path.exists(open_slot_path(self.beats, rank))]

    def replace(self, rank: int) -> None:
        """Start a replacement for the lost ``rank``: it rejoins the live processes in-process."""
        os.unlink(open_slot_path(self.beats, rank))
        with contextlib.suppress(FileNotFoundError):  # no beat until its own first step: it is still rejoining
            os.unlink(beat_path(self.beats, rank))
        self.procs[rank - self.first_id].wait()
        self.procs[rank - self.first_id] = self._spawn(rank, {**self._env(rank), ENV_REJOIN: "1"})
        self.lost.discard(rank)
        self.replaced.add(rank)
        self.seen_ended.pop(rank, None)
        if self.watch is not None:  # the others wait for its first step: the first-step allowance again
            self.watch.restarted(rank)

    def signal_all(self, signum: int) -> None:
        if self.forwarded is None:
            self.signalled_at = time.monotonic()
        self.forwarded = signum
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signum)

    def kill_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
        for proc in self.procs:
            proc.wait()

    def stop_all(self) -> None:
        """SIGTERM (a jaxdist run saves and exits), then SIGKILL after ``GRACE_S``."""
        self.signal_all(signal.SIGTERM)
        deadline = time.monotonic() + GRACE_S
        while any(p.poll() is None for p in self.procs) and time.monotonic() < deadline:
            time.sleep(0.1)
        self.kill_all()

    def close(self) -> None:
        """After the processes ended: print the rest of their output, free the port."""
        deadline = time.monotonic() + 5.0  # a Grain worker holds the output pipe until it notices its parent died
        for pump in self.pumps:
            pump.join(max(0.0, deadline - time.monotonic()))
        if self.reservation is not None:
            self.reservation.close()
        shutil.rmtree(self.beats, ignore_errors=True)

    def codes(self) -> list[int | None]:
        self.looks += 1
        codes = [p.poll() for p in self.procs]
        for rank, code in enumerate(codes, self.first_id):
            if code is not None:
                self.seen_ended.setdefault(rank, self.looks)
        return codes

    def blame_order(self, failed: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """Failures, the likeliest cause first: peers of a dead process abort soon after it
        (SIGABRT from a lost coordination heartbeat), so the exit seen first leads, and
        within one look a SIGKILL from outside before other signals before exit codes."""
        return sorted(failed, key=lambda rc: (self.seen_ended.get(rc[0], self.looks), rc[1] != -signal.SIGKILL, rc[1] >= 0, rc[0]))

    def poll(self) -> Ended | None:
        """One look at the set: None while it runs, else how it ended. Processes still
        running after a failure are left to the caller (stopped after a hang)."""
        codes = [0 if rank in self.lost else c for rank, c in enumerate(self.codes(), self.first_id)]  # the lost count as gone
        if self.first_id == 0 and codes[0] == EXIT_PORT_TAKEN:
            return Ended("port", EXIT_PORT_TAKEN, 0, EXIT_PORT_TAKEN)
        failed = self.blame_order([(rank, c) for rank, c in enumerate(codes, self.first_id) if c not in (None, 0, EXIT_PREEMPTED)])
        if failed:
            rank, code = failed[0]
            return Ended("failure", exit_status(code), rank, code, failed)
        if all(c is not None for c in codes):
            return Ended("saved", EXIT_PREEMPTED) if EXIT_PREEMPTED in codes else Ended("done", 0)
        if EXIT_PREEMPTED in codes:
            self._let_them_save(codes)
        stall = self.watch.stalled([c is None for c in codes]) if self.watch is not None else None
        return self._stop_stalled(stall) if stall is not None else None

    def _let_them_save(self, codes: list[int | None]) -> None:
        """A process exited 75: its part of a checkpoint is saved and the others are saving
        theirs (they agreed on the step); give them ``SAVE_GRACE_S``, never a kill mid-commit."""
        now = time.monotonic()
        if self.saving_since is None:
            self.saving_since = now
            saved = ", ".join(str(rank) for rank, c in enumerate(codes, self.first_id) if c == EXIT_PREEMPTED)
            log.info(f"rank {saved} saved and exited ({EXIT_PREEMPTED}); waiting up to {SAVE_GRACE_S:.0f}s for the others to finish saving")
        elif now - self.saving_since > SAVE_GRACE_S:
            late = ", ".join(str(rank) for rank, c in enumerate(codes, self.first_id) if c is None)
            log.info(f"rank {late} did not finish saving within {SAVE_GRACE_S:.0f}s; stopping it")
            self.stop_all()

    def _stop_stalled(self, stall: Stall) -> Ended:
        if stall.first:
            cause = f"rank {stall.rank} has not finished its first step after {stall.idle_s:.0f}s (--first-step-timeout {stall.limit_s:g})"
        else:
            cause = f"rank {stall.rank} made no progress for {stall.idle_s:.0f}s at step {stall.step} (--hang-timeout {stall.limit_s:g})"
        log.info(f"{cause}; every rank's Python stacks follow, then the run is stopped")
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(DUMP_SIGNAL)
        time.sleep(DUMP_WAIT_S)
        self.kill_all()
        return Ended("hang", 128 + signal.SIGKILL, stall.rank, -signal.SIGKILL, cause=cause)

    def past_save_grace(self) -> bool:
        """Whether a signal was forwarded more than ``SAVE_GRACE_S`` ago (what still runs is stuck)."""
        return self.signalled_at is not None and time.monotonic() - self.signalled_at > SAVE_GRACE_S

    def wait(self) -> Ended:
        """Until the set ends; after a failure the others are stopped (SIGTERM, then SIGKILL).
        Processes still running ``SAVE_GRACE_S`` after a forwarded signal are killed (one line):
        a stuck process must not hold the launcher that was asked to stop."""
        while (ended := self.poll()) is None:
            if self.past_save_grace():
                running = [rank for rank, proc in enumerate(self.procs) if proc.poll() is None]
                log.info(f"rank {', '.join(map(str, running))} still running {SAVE_GRACE_S:.0f}s after the signal; killing them")
                self.kill_all()
            time.sleep(0.1)
        if ended.kind == "failure" and any(c is None for c in self.codes()):
            log.info(f"{ended.describe()}; stopping the others")
            self.stop_all()
        elif ended.kind == "port":
            self.kill_all()  # the others wait for a coordinator that will never listen
        return ended


def run_plain(
    nproc: int,
    train_args: list[str],
    devices_per_proc: int | None,
    port: int | None,
    hang: HangLimits | None,
    module: str = "jaxdist.train",
) -> int:
    """``nproc`` trainers (or ``module``'s processes) as one run until they end; the exit status. Started again on
    another port (up to ``PORT_ATTEMPTS`` times) when process 0 finds the coordinator's
    port taken; SIGINT / SIGTERM are forwarded while it runs."""
    current: list[Launcher] = []
    received: list[int] = []

    def forward(signum: int, frame) -> None:  # noqa: ARG001
        received.append(signum)
        if current:
            current[-1].signal_all(signum)

    forwarded = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        for _ in range(PORT_ATTEMPTS):
            current.append(Launcher(nproc, train_args, devices_per_proc, port, hang, module=module))
            if received:  # a signal came while no set ran
                current[-1].signal_all(received[-1])
            current[-1].start()
            ended = current[-1].wait()
            current[-1].close()
            if ended.kind != "port" or received:
                return ended.code
            log.info(f"the coordinator's port {current[-1].port} was taken before it could listen; starting again on another port")
            port = None
        log.error(f"the coordinator's port was taken {PORT_ATTEMPTS} times in a row")
        return EXIT_PORT_TAKEN
    finally:  # a --port that cannot be used raises JaxdistError before anything started
        for s, handler in forwarded.items():
            signal.signal(s, handler)
        if current and any(p.poll() is None for p in current[-1].procs):
            current[-1].stop_all()
        if current:
            current[-1].close()
