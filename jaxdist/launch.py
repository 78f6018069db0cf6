"""``python -m jaxdist.launch``: N training processes on this machine, as one run.

    python -m jaxdist.launch --nproc 2 [--devices-per-proc 4] -- --mesh data=2,fsdp=4 --steps 20

Each process joins through a coordinator that listens on 127.0.0.1 only, on a free port
the launcher holds for the run (gloo collectives on CPU fake devices); every output line
is prefixed with its rank; SIGINT / SIGTERM are forwarded; when one process fails the
others are stopped and the launcher exits with the first failure's code. A process that
exits 75 has saved its part of a checkpoint: nobody is signalled, the others get 120 s
to finish theirs, then the launcher exits 75. When process 0 finds the
coordinator's port taken (exit 76, nothing ran) the set starts again on another port,
not counted as a failure. Every process the run starts (trainers, their Grain workers)
dies within a second of the launcher, even when it is killed with SIGKILL.

Hangs: each process beats once per step (``jaxdist.heartbeat``); when one makes no
progress for ``--hang-timeout`` seconds (default 1800; 0 turns the watch off), or the
first step has not finished after ``--first-step-timeout`` (default 3600: start-up,
restore, the compiles), the launcher prints every process's Python stacks
(faulthandler, SIGUSR1), kills the set and treats it as a failure (exit 137; elastic: a
restart, ``reason`` hang).

Elastic (any of ``--min-nproc``, ``--nproc-file``, ``--max-restarts``; ``--min-nproc``
and ``--devices-per-proc`` are then required):

    python -m jaxdist.launch --nproc 4 --min-nproc 2 --devices-per-proc 2 [--max-restarts 3] \\
        [--nproc-file F] -- --mesh data=-1,tensor=2 train.global_batch=8 ...

The run keeps one run directory (``--run-dir``, else ``runs/NAME-TIME`` chosen here) and
every start after the first is ``--resume auto`` on a fresh coordinator port. A process
count is *usable* when the mesh (one axis may be -1; not ``auto``), the global batch (microbatches
adapt on resume) and the model fit that many processes x ``--devices-per-proc`` devices,
as ``jaxdist.train`` checks them (``jaxdist.elastic``). ``--nproc`` must be usable; it is
also the largest count the run takes.

- Shrink: a process dies (non-zero exit or a signal) -> the others are killed at once,
  that slot is lost (capacity = count - 1), and the largest usable count from
  ``--min-nproc`` to the capacity starts again from the last checkpoint. Failures count
  against ``--max-restarts`` (default 3); membership changes asked for by the file do not.
- ``--nproc-file F``: one integer, the processes available now, polled every 0.5 s. Each
  rewrite (even of the same number) sets the capacity to its value (capped at
  ``--nproc``); when the largest usable count then differs from the current one the
  launcher asks the run to save (SIGTERM: the processes agree on a step, save it and exit
  75) and restarts with that count, up or down. A value below ``--min-nproc`` saves and
  stops. An unreadable or malformed file is a warning; the count stays. The file's value
  at launch caps the first start.
- Each change prints ``elastic: 4 -> 2 processes, resuming at step N`` (N: the newest
  checkpoint) and appends a JSON line to ``RUN_DIR/elastic.jsonl``: ``time``, ``from``,
  ``to``, ``reason`` (start | failure | hang | grow | shrink; the first start has ``from`` null),
  ``step``, ``failed_rank``, ``exit_code``, ``mesh``, ``restarts``.

Exit codes: 0 the run finished; 2 bad input (nothing started); 137 a hang (plain launch);
76 the coordinator's port was taken 5 times in a row; a process's own exit code when it
is one relaunching cannot fix (2 bad input, 3 non-finite loss, 4 checkpoint not
written, 75 preempted from outside) or after a user's SIGINT / SIGTERM (forwarded; no
relaunch; 75 once the run saved); the failure's code (128 + signal when killed) when a
failure leaves no usable count >= ``--min-nproc`` or ``--max-restarts`` is used up; 75
when the ``--nproc-file`` drops below ``--min-nproc``. Stopping never deletes a
checkpoint: rerun the same command to resume.
"""

from __future__ import annotations

import argparse
import dataclasses
import errno
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from jaxdist import elastic
from jaxdist.checkpoint import CheckpointError
from jaxdist.cli import config_from_args
from jaxdist.cli import parse_args as parse_train_args
from jaxdist.config import Config
from jaxdist.distributed import ENV_COORDINATOR, ENV_COORDINATOR_BIND, ENV_NUM_PROCESSES, ENV_PROCESS_ID, EXIT_PORT_TAKEN
from jaxdist.errors import EXIT_BAD_INPUT, EXIT_NONFINITE, JaxdistError, OneLineArgumentParser
from jaxdist.heartbeat import DUMP_SIGNAL, ENV_DIR, ProgressWatch, Stall
from jaxdist.lifetime import die_with_parent
from jaxdist.mesh import format_mesh
from jaxdist.preemption import EXIT_PREEMPTED
from jaxdist.run import default_run_dir
from jaxdist.supervise import child_argv
from jaxdist.train import build_arg_parser

LOOPBACK = "127.0.0.1"  # where the coordinator listens: the processes all run on this machine
GRACE_S = 10.0  # after asking the others to stop, how long before they are killed
SAVE_GRACE_S = 120.0  # for the others to finish a save (a membership change's or one that exited 75); a compile may come first
POLL_S = 0.5  # how often the --nproc-file is read
DUMP_WAIT_S = 1.0  # after asking a stalled set for its stacks, before killing it
PORT_ATTEMPTS = 5  # starts in a row whose coordinator port was taken
DEFAULT_MAX_RESTARTS = 3
DEFAULT_HANG_TIMEOUT_S = 1800.0
DEFAULT_FIRST_STEP_TIMEOUT_S = 3600.0
# Exit codes a relaunch would not fix: they end an elastic run.
FINAL_CODES = {EXIT_BAD_INPUT, EXIT_NONFINITE, CheckpointError.exit_code, EXIT_PREEMPTED}


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
    for line in iter(stream.readline, ""):
        out.write(f"[rank {rank}] {line}")
        out.flush()


def _shell_code(code: int) -> int:
    """A child's return code as an exit status: killed by signal S -> 128 + S."""
    return code if code >= 0 else 128 - code


def _describe(code: int) -> str:
    if code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"


@dataclasses.dataclass(frozen=True)
class HangLimits:
    """``--hang-timeout`` / ``--first-step-timeout`` in seconds."""

    hang_timeout_s: float
    first_step_timeout_s: float


@dataclasses.dataclass
class Ended:
    """How one set of processes ended."""

    kind: str  # done | saved (every process exited 0 or 75) | final | interrupted | failure | hang | port
    code: int  # an exit status (0 done)
    rank: int | None = None  # the failed rank
    raw_code: int | None = None  # its return code as Popen gives it (negative: a signal)
    failed: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # failure: every failed (rank, return code)
    cause: str | None = None  # hang: what the watch saw

    def describe(self) -> str:
        return self.cause or f"rank {self.rank} {_describe(self.raw_code)}"


class Launcher:
    """One set of processes: start, forward signals, watch their progress, stop."""

    def __init__(self, nproc: int, train_args: list[str], devices_per_proc: int | None, port: int | None, hang: HangLimits | None = None):
        self.nproc, self.train_args, self.devices_per_proc = nproc, train_args, devices_per_proc
        self.host = LOOPBACK
        self.reservation = reserve_port(self.host, port)  # held until close(): nothing else can take the port
        self.port = self.reservation.getsockname()[1]
        self.beats = Path(tempfile.mkdtemp(prefix="jaxdist-beats-"))
        self.watch = ProgressWatch(self.beats, nproc, hang.hang_timeout_s, hang.first_step_timeout_s) if hang else None
        self.procs: list[subprocess.Popen] = []
        self.pumps: list[threading.Thread] = []
        self.forwarded: int | None = None  # a signal forwarded before every process had started
        self.saving_since: float | None = None  # when the first process exited 75

    def _env(self, rank: int) -> dict[str, str]:
        env = dict(os.environ)
        env.update({ENV_COORDINATOR: f"{self.host}:{self.port}", ENV_NUM_PROCESSES: str(self.nproc), ENV_PROCESS_ID: str(rank)})
        env.update({ENV_COORDINATOR_BIND: self.host, ENV_DIR: str(self.beats)})
        env["PYTHONUNBUFFERED"] = "1"
        if self.devices_per_proc:
            flags = " ".join(t for t in env.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in t)
            env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={self.devices_per_proc}".strip()
        return env

    def start(self) -> None:
        if self.watch is not None:
            self.watch.started = time.time()
        for rank in range(self.nproc):
            proc = subprocess.Popen(
                [sys.executable, "-m", "jaxdist.train", *self.train_args],
                env=self._env(rank),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                preexec_fn=die_with_parent(os.getpid()),  # started from the main thread, which lives as long as the launcher
            )
            self.procs.append(proc)
            if self.forwarded is not None:  # the signal came while this one was starting
                proc.send_signal(self.forwarded)
            pump = threading.Thread(target=_pump, args=(rank, proc.stdout, sys.stdout), daemon=True)
            pump.start()
            self.pumps.append(pump)

    def signal_all(self, signum: int) -> None:
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
        self.reservation.close()
        shutil.rmtree(self.beats, ignore_errors=True)

    def codes(self) -> list[int | None]:
        return [p.poll() for p in self.procs]

    def poll(self) -> Ended | None:
        """One look at the set: None while it runs, else how it ended. Processes still
        running after a failure are left to the caller (stopped after a hang)."""
        codes = self.codes()
        if codes[0] == EXIT_PORT_TAKEN:
            return Ended("port", EXIT_PORT_TAKEN, 0, EXIT_PORT_TAKEN)
        failed = [(rank, c) for rank, c in enumerate(codes) if c not in (None, 0, EXIT_PREEMPTED)]
        if failed:
            rank, code = failed[0]
            return Ended("failure", _shell_code(code), rank, code, failed)
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
            saved = ", ".join(str(rank) for rank, c in enumerate(codes) if c == EXIT_PREEMPTED)
            _note(f"rank {saved} saved and exited ({EXIT_PREEMPTED}); waiting up to {SAVE_GRACE_S:.0f}s for the others to finish saving")
        elif now - self.saving_since > SAVE_GRACE_S:
            late = ", ".join(str(rank) for rank, c in enumerate(codes) if c is None)
            _note(f"rank {late} did not finish saving within {SAVE_GRACE_S:.0f}s; stopping it")
            self.stop_all()

    def _stop_stalled(self, stall: Stall) -> Ended:
        if stall.first:
            cause = f"rank {stall.rank} has not finished its first step after {stall.idle_s:.0f}s (--first-step-timeout {stall.limit_s:g})"
        else:
            cause = f"rank {stall.rank} made no progress for {stall.idle_s:.0f}s at step {stall.step} (--hang-timeout {stall.limit_s:g})"
        _note(f"{cause}; every rank's Python stacks follow, then the run is stopped")
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(DUMP_SIGNAL)
        time.sleep(DUMP_WAIT_S)
        self.kill_all()
        return Ended("hang", 128 + signal.SIGKILL, stall.rank, -signal.SIGKILL, cause=cause)

    def wait(self) -> Ended:
        """Until the set ends; after a failure the others are stopped (SIGTERM, then SIGKILL)."""
        while (ended := self.poll()) is None:
            time.sleep(0.1)
        if ended.kind == "failure" and any(c is None for c in self.codes()):
            _note(f"{ended.describe()}; stopping the others")
            self.stop_all()
        elif ended.kind == "port":
            self.kill_all()  # the others wait for a coordinator that will never listen
        return ended


def _note(message: str) -> None:
    print(f"jaxdist.launch: {message}", file=sys.stderr, flush=True)


@dataclasses.dataclass
class ElasticPlan:
    """Everything the elastic loop needs, checked before anything starts."""

    config: Config
    run_dir: Path
    child_args: list[str]  # train args with --run-dir RUN_DIR --resume auto at the end
    first_resume: str  # the user's --resume, for the first start only
    max_nproc: int
    min_nproc: int
    devices_per_proc: int
    max_restarts: int
    nproc_file: Path | None
    port: int | None
    hang: HangLimits | None = None


class Elastic:
    """Generations of ``Launcher``: relaunch on failure (smaller) or when the
    ``--nproc-file`` changes (save, then larger or smaller); see the module doc."""

    def __init__(self, plan: ElasticPlan):
        self.plan = plan
        self.nproc_file = elastic.NprocFile(plan.nproc_file) if plan.nproc_file else None
        self.capacity = plan.max_nproc
        self.restarts = 0
        self.interrupted: int | None = None
        self.gen: Launcher | None = None

    def on_signal(self, signum: int, frame=None) -> None:
        self.interrupted = signum
        if self.gen is not None:
            self.gen.signal_all(signum)

    def _resuming(self, resume: str) -> bool:
        """Whether the next start restores a checkpoint (then its microbatches adapt)."""
        return resume != "never" and elastic.latest_step(self.plan.run_dir) is not None

    def _largest_usable(self, resume: str = "auto") -> int | None:
        p = self.plan
        return elastic.largest_usable(p.config, p.devices_per_proc, p.min_nproc, self.capacity, self._resuming(resume))

    def _no_usable_count(self) -> str:
        if self.capacity < self.plan.min_nproc:
            return f"--min-nproc {self.plan.min_nproc} cannot be met"
        return f"no process count from --min-nproc {self.plan.min_nproc} to {self.capacity} can run this training"

    def first_count(self) -> int | None:
        """The first start's process count: --nproc, or fewer if the --nproc-file says so.
        Raises JaxdistError when --nproc itself cannot run the training."""
        p = self.plan
        problem = elastic.fit_problem(p.config, p.max_nproc, p.devices_per_proc, self._resuming(p.first_resume))
        if problem:
            raise JaxdistError(f"--nproc {p.max_nproc} cannot run this training: {problem}")
        value = self.nproc_file.changed() if self.nproc_file else None
        if value is not None:
            self.capacity = min(value, p.max_nproc)
        n = self._largest_usable(p.first_resume)
        if n is None:
            _error(f"--nproc-file says {_processes(value)}, {self._no_usable_count()}; nothing started")
        return n

    def run(self) -> int:
        n = self.first_count()
        if n is None:
            return EXIT_PREEMPTED  # "try again later"
        resume, port, port_taken = self.plan.first_resume, self.plan.port, 0
        first = True
        while True:
            # child_args ends with "--resume auto": the first start keeps the user's --resume.
            self.gen = Launcher(n, [*self.plan.child_args[:-1], resume], self.plan.devices_per_proc, port, self.plan.hang)
            if first:  # after the port is held (a taken --port is bad input: nothing written)
                self._change(None, n, "start")
                first = False
            if self.interrupted is not None:  # before this set started: nothing to forward to
                self.gen.close()
                return 128 + self.interrupted
            self.gen.start()
            ended = self._watch(self.gen, n)
            self.gen.close()
            port = None  # later sets: a fresh port
            if ended.kind == "port":  # nothing ran: start the same set again, not a failure
                port_taken += 1
                if port_taken >= PORT_ATTEMPTS:
                    _error(f"the coordinator's port was taken {port_taken} times in a row; {self._stopped_at()}")
                    return EXIT_PORT_TAKEN
                _note(f"the coordinator's port {self.gen.port} was taken before it could listen; starting again on another port")
                continue
            resume, port_taken = "auto", 0  # later sets: the newest checkpoint
            if ended.kind in ("done", "final", "interrupted"):
                return ended.code
            target = self._next_count(ended, n)
            if target is None:
                return ended.code if ended.kind in ("failure", "hang") else EXIT_PREEMPTED
            reason = ended.kind if ended.kind in ("failure", "hang") else ("grow" if target > n else "shrink")
            self._change(n, target, reason, ended.rank, ended.raw_code)
            n = target

    def _next_count(self, ended: Ended, n: int) -> int | None:
        """The count to relaunch with after a failure or a save; None (said why) to stop."""
        failure = ended.kind in ("failure", "hang")
        if failure:
            self.restarts += 1
            self.capacity = n - 1  # that slot is lost (a hung process's machine is as suspect as a dead one's)
            if self.restarts > self.plan.max_restarts:
                used = f"--max-restarts {self.plan.max_restarts} are used up"
                _error(f"{ended.describe()} and {used}; {self._stopped_at()}")
                return None
        target = self._largest_usable()
        if target is None:
            left = f"{_processes(self.capacity)} left" if failure else f"--nproc-file allows {_processes(self.capacity)}"
            _error(f"{left}, {self._no_usable_count()}; {self._stopped_at()}")
        return target

    def _watch(self, gen: Launcher, n: int) -> Ended:
        """Until the set ends: done, a failure, a hang, a user's signal, or a membership change."""
        next_poll = time.monotonic() + POLL_S
        while True:
            if self.interrupted is not None:
                return Ended("interrupted", gen.wait().code)
            ended = gen.poll()
            if ended is not None and ended.kind == "failure":
                return self._on_failure(gen, ended.failed)
            if ended is not None and ended.kind == "saved":  # preempted from outside: every process saved
                return Ended("final", EXIT_PREEMPTED)
            if ended is not None:  # done, hang (already stopped), port (the others wait for nothing)
                gen.kill_all()
                return ended
            if self.nproc_file is not None and time.monotonic() >= next_poll:
                next_poll = time.monotonic() + POLL_S
                value = self.nproc_file.changed()
                if value is not None:
                    self.capacity = min(value, self.plan.max_nproc)
                    target = self._largest_usable()
                    if target != n:
                        return self._save(gen, value, target)
            time.sleep(0.1)

    def _on_failure(self, gen: Launcher, failed: list[tuple[int, int]]) -> Ended:
        lost = [(rank, c) for rank, c in failed if c not in FINAL_CODES]
        if not lost:  # e.g. bad input or a NaN loss: it would recur on any count
            rank, code = failed[0]
            _note(f"rank {rank} {_describe(code)}; stopping the others")
            gen.stop_all()
            return Ended("final", _shell_code(code), rank, code)
        # Peers of a dead process fail soon after it: blame one killed by a signal first.
        rank, code = min(lost, key=lambda rc: (rc[1] >= 0, rc[0]))
        _note(f"rank {rank} {_describe(code)}; killing the others")
        gen.kill_all()  # with a dead peer they cannot save consistently; the last checkpoint stands
        return Ended("failure", _shell_code(code), rank, code)

    def _save(self, gen: Launcher, value: int, target: int | None) -> Ended:
        """Ask the run to save (SIGTERM: every process saves the same step and exits 75)."""
        then = f"restarting with {target}" if target else f"stopping (--min-nproc {self.plan.min_nproc})"
        print(f"jaxdist.launch: --nproc-file says {value}: asking the run to save, then {then}", file=sys.stderr, flush=True)
        gen.signal_all(signal.SIGTERM)
        deadline = time.monotonic() + SAVE_GRACE_S
        while any(c is None for c in gen.codes()) and time.monotonic() < deadline:
            if any(c not in (None, 0, EXIT_PREEMPTED) for c in gen.codes()):
                break  # one died (e.g. the signal came before it set up JAX): the others cannot save
            time.sleep(0.1)
        gen.kill_all()
        codes = gen.codes()
        if self.interrupted is not None:
            return Ended("interrupted", next((_shell_code(c) for c in codes if c), 0))
        if all(c == 0 for c in codes):  # it finished before the save
            return Ended("done", 0)
        final = [c for c in codes if c in FINAL_CODES - {EXIT_PREEMPTED}]
        if final:
            return Ended("final", final[0])
        unsaved = [c for c in codes if c != EXIT_PREEMPTED]  # killed after the grace, or crashed while saving
        code = unsaved[0] if unsaved else EXIT_PREEMPTED
        return Ended("saved", _shell_code(code), raw_code=code)

    def _stopped_at(self) -> str:
        step = elastic.latest_step(self.plan.run_dir)
        if step is None:
            return "the run stopped before its first checkpoint: rerun to start it again"
        return f"the run stopped at its last checkpoint (step {step}): rerun to resume"

    def _change(self, old: int | None, new: int, reason: str, rank: int | None = None, code: int | None = None) -> None:
        step = elastic.latest_step(self.plan.run_dir) or 0
        if old is not None:
            print(f"jaxdist.launch: elastic: {old} -> {new} processes, resuming at step {step}", file=sys.stderr, flush=True)
        fields = {"from": old, "to": new, "reason": reason, "step": step, "failed_rank": rank, "exit_code": code}
        mesh = format_mesh(elastic.mesh_for(self.plan.config, new, self.plan.devices_per_proc))
        elastic.record(self.plan.run_dir, **fields, mesh=mesh, restarts=self.restarts)


def _processes(n: int) -> str:
    return f"{n} process" if n == 1 else f"{n} processes"


def _error(message: str) -> None:
    print(f"jaxdist.launch: error: {message}", file=sys.stderr, flush=True)


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = OneLineArgumentParser(prog="python -m jaxdist.launch", description="Run N training processes on this machine.")
    parser.add_argument("--nproc", type=int, required=True, help="number of processes (elastic: the first and largest count)")
    parser.add_argument("--devices-per-proc", type=int, default=None, help="fake CPU devices per process (default: mesh size / nproc)")
    parser.add_argument(
        "--port", type=int, default=None, help="coordinator port on 127.0.0.1 (default: a free one; elastic: the first start)"
    )
    parser.add_argument("--min-nproc", type=int, default=None, help="elastic: the fewest processes the run may continue with")
    parser.add_argument(
        "--max-restarts", type=int, default=None, help=f"elastic: relaunches after failures (default {DEFAULT_MAX_RESTARTS})"
    )
    parser.add_argument("--nproc-file", default=None, help="elastic: a file holding the processes available now (polled)")
    parser.add_argument(
        "--hang-timeout",
        type=float,
        default=DEFAULT_HANG_TIMEOUT_S,
        metavar="S",
        help=f"stop the run (stacks printed) when a process makes no step for S seconds (default {DEFAULT_HANG_TIMEOUT_S:g}; 0: off)",
    )
    parser.add_argument(
        "--first-step-timeout",
        type=float,
        default=DEFAULT_FIRST_STEP_TIMEOUT_S,
        metavar="S",
        help=f"the same until every process finished its first step: start-up, restore, compile (default {DEFAULT_FIRST_STEP_TIMEOUT_S:g})",
    )
    parser.add_argument("train_args", nargs=argparse.REMAINDER, help="-- then the arguments of python -m jaxdist.train")
    args = parser.parse_args(argv)
    if args.train_args[:1] == ["--"]:
        args.train_args = args.train_args[1:]
    if args.nproc < 1:
        raise JaxdistError(f"--nproc must be >= 1, got {args.nproc}")
    if args.hang_timeout < 0 or args.first_step_timeout <= 0:
        raise JaxdistError("--hang-timeout must be >= 0 (0: no hang watch) and --first-step-timeout > 0")
    args.hang = HangLimits(args.hang_timeout, args.first_step_timeout) if args.hang_timeout > 0 else None
    args.elastic = any(getattr(args, k) is not None for k in ("min_nproc", "max_restarts", "nproc_file"))
    if args.elastic:
        _check_elastic_args(args)
    return args


def _check_elastic_args(args: argparse.Namespace) -> None:
    if args.min_nproc is None:
        raise JaxdistError("--nproc-file and --max-restarts need --min-nproc M (the fewest processes the run may continue with)")
    if not 1 <= args.min_nproc <= args.nproc:
        raise JaxdistError(f"--min-nproc must be from 1 to --nproc ({args.nproc}), got {args.min_nproc}")
    if args.devices_per_proc is None or args.devices_per_proc < 1:
        raise JaxdistError("an elastic launch (--min-nproc) needs --devices-per-proc K >= 1: the device count of each process count")
    if args.max_restarts is not None and args.max_restarts < 0:
        raise JaxdistError(f"--max-restarts must be >= 0, got {args.max_restarts}")


def elastic_plan(args: argparse.Namespace) -> ElasticPlan:
    """Parse the train args as ``jaxdist.train`` does (no JAX) and fix the run directory."""
    train = parse_train_args(build_arg_parser(), args.train_args)
    if train.profile_steps is not None:
        train.overrides.append(f"train.profile_steps={train.profile_steps}")
    config = config_from_args(train)
    run_dir = Path(train.run_dir) if train.run_dir else default_run_dir(config)
    return ElasticPlan(
        config=config,
        run_dir=run_dir,
        child_args=child_argv(list(args.train_args), run_dir),  # the launcher restarts: no --max-restarts inside
        first_resume=train.resume,
        max_nproc=args.nproc,
        min_nproc=args.min_nproc,
        devices_per_proc=args.devices_per_proc,
        max_restarts=DEFAULT_MAX_RESTARTS if args.max_restarts is None else args.max_restarts,
        nproc_file=Path(args.nproc_file) if args.nproc_file else None,
        port=args.port,
        hang=args.hang,
    )


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = parse_args(sys.argv[1:] if argv is None else argv)
        loop = Elastic(elastic_plan(args)) if args.elastic else None
    except JaxdistError as e:
        print(f"jaxdist: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if loop is not None:
        return _run_elastic(loop)
    return _run_plain(args)


def _run_plain(args: argparse.Namespace) -> int:
    """One set of processes; started again on another port (up to ``PORT_ATTEMPTS`` times)
    when process 0 finds the coordinator's port taken."""
    current: list[Launcher] = []
    received: list[int] = []

    def forward(signum: int, frame) -> None:  # noqa: ARG001
        received.append(signum)
        if current:
            current[-1].signal_all(signum)

    forwarded = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    port = args.port
    try:
        for _ in range(PORT_ATTEMPTS):
            current.append(Launcher(args.nproc, args.train_args, args.devices_per_proc, port, args.hang))
            if received:  # a signal came while no set ran
                current[-1].forwarded = received[-1]
            current[-1].start()
            ended = current[-1].wait()
            current[-1].close()
            if ended.kind != "port" or received:
                return ended.code
            _note(f"the coordinator's port {current[-1].port} was taken before it could listen; starting again on another port")
            port = None
        _error(f"the coordinator's port was taken {PORT_ATTEMPTS} times in a row")
        return EXIT_PORT_TAKEN
    except JaxdistError as e:  # --port cannot be used: nothing started
        print(f"jaxdist: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    finally:
        for s, handler in forwarded.items():
            signal.signal(s, handler)
        if current and any(p.poll() is None for p in current[-1].procs):
            current[-1].stop_all()
        if current:
            current[-1].close()


def _run_elastic(loop: Elastic) -> int:
    forwarded = {s: signal.signal(s, loop.on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        return loop.run()
    except JaxdistError as e:  # the first start does not fit (nothing started), or the run dir is not writable
        print(f"jaxdist: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    finally:
        for s, handler in forwarded.items():
            signal.signal(s, handler)
        if loop.gen is not None and any(p.poll() is None for p in loop.gen.procs):
            loop.gen.stop_all()
        if loop.gen is not None:
            loop.gen.close()


if __name__ == "__main__":
    sys.exit(main())
