"""``python -m jaxdist.launch``: N training processes on this machine, as one run.

    python -m jaxdist.launch --nproc 2 [--devices-per-proc 4] -- --mesh data=2,fsdp=4 --steps 20

Each process joins through a coordinator on a free loopback port (gloo collectives on
CPU fake devices); every output line is prefixed with its rank; SIGINT / SIGTERM are
forwarded; when one process fails the others are stopped and the launcher exits with
the first failure's code. Children die with the launcher, so none is ever orphaned.

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
  ``to``, ``reason`` (start | failure | grow | shrink; the first start has ``from`` null),
  ``step``, ``failed_rank``, ``exit_code``, ``mesh``, ``restarts``.

Exit codes: 0 the run finished; 2 bad input (nothing started); a process's own exit code
when it is one relaunching cannot fix (2 bad input, 3 non-finite loss, 4 checkpoint not
written, 75 preempted from outside) or after a user's SIGINT / SIGTERM (forwarded; no
relaunch; 75 once the run saved); the failure's code (128 + signal when killed) when a
failure leaves no usable count >= ``--min-nproc`` or ``--max-restarts`` is used up; 75
when the ``--nproc-file`` drops below ``--min-nproc``. Stopping never deletes a
checkpoint: rerun the same command to resume.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from jaxdist import elastic
from jaxdist.checkpoint import CheckpointError
from jaxdist.cli import config_from_args
from jaxdist.cli import parse_args as parse_train_args
from jaxdist.config import Config
from jaxdist.distributed import ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID
from jaxdist.errors import EXIT_BAD_INPUT, EXIT_NONFINITE, JaxdistError, OneLineArgumentParser
from jaxdist.mesh import format_mesh
from jaxdist.preemption import EXIT_PREEMPTED
from jaxdist.run import default_run_dir
from jaxdist.supervise import child_argv
from jaxdist.train import build_arg_parser

GRACE_S = 10.0  # after asking the others to stop, how long before they are killed
SAVE_GRACE_S = 120.0  # after asking the run to save for a membership change (a compile may come first)
POLL_S = 0.5  # how often the --nproc-file is read
DEFAULT_MAX_RESTARTS = 3
# Exit codes a relaunch would not fix: they end an elastic run.
FINAL_CODES = {EXIT_BAD_INPUT, EXIT_NONFINITE, CheckpointError.exit_code, EXIT_PREEMPTED}
_PR_SET_PDEATHSIG = 1


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _die_with_parent() -> None:
    """In the child, before exec: the kernel kills it if the launcher dies (even SIGKILL)."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


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


class Launcher:
    """One set of processes: start, forward signals, stop."""

    def __init__(self, nproc: int, train_args: list[str], devices_per_proc: int | None, port: int | None):
        self.nproc, self.train_args = nproc, train_args
        self.devices_per_proc, self.port = devices_per_proc, port or free_port()
        self.procs: list[subprocess.Popen] = []
        self.forwarded: int | None = None  # a signal forwarded before every process had started

    def _env(self, rank: int) -> dict[str, str]:
        env = dict(os.environ)
        env.update({ENV_COORDINATOR: f"127.0.0.1:{self.port}", ENV_NUM_PROCESSES: str(self.nproc), ENV_PROCESS_ID: str(rank)})
        env["PYTHONUNBUFFERED"] = "1"
        if self.devices_per_proc:
            flags = " ".join(t for t in env.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in t)
            env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={self.devices_per_proc}".strip()
        return env

    def start(self) -> None:
        for rank in range(self.nproc):
            proc = subprocess.Popen(
                [sys.executable, "-m", "jaxdist.train", *self.train_args],
                env=self._env(rank),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                preexec_fn=_die_with_parent,
            )
            self.procs.append(proc)
            if self.forwarded is not None:  # the signal came while this one was starting
                proc.send_signal(self.forwarded)
            threading.Thread(target=_pump, args=(rank, proc.stdout, sys.stdout), daemon=True).start()

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

    def codes(self) -> list[int | None]:
        return [p.poll() for p in self.procs]

    def wait(self) -> int:
        """The first non-zero exit code (others are then stopped), else 0."""
        while True:
            codes = self.codes()
            failed = [(rank, c) for rank, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                rank, code = failed[0]
                if any(c is None for c in codes):
                    print(f"jaxdist.launch: rank {rank} exited with code {code}; stopping the others", file=sys.stderr, flush=True)
                    self.stop_all()
                return _shell_code(code)
            if all(c == 0 for c in codes):
                return 0
            time.sleep(0.1)


@dataclasses.dataclass
class Ended:
    """How one set of processes ended."""

    kind: str  # done | final | interrupted | failure | saved
    code: int  # an exit status (0 done)
    rank: int | None = None  # the failed rank
    raw_code: int | None = None  # its return code as Popen gives it (negative: a signal)


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
        self._change(None, n, "start")
        resume, port = self.plan.first_resume, self.plan.port
        while True:
            # child_args ends with "--resume auto": the first start keeps the user's --resume.
            self.gen = Launcher(n, [*self.plan.child_args[:-1], resume], self.plan.devices_per_proc, port)
            if self.interrupted is not None:  # before this set started: nothing to forward to
                return 128 + self.interrupted
            self.gen.start()
            ended = self._watch(self.gen, n)
            resume, port = "auto", None  # later sets: the newest checkpoint, a fresh port
            if ended.kind in ("done", "final", "interrupted"):
                return ended.code
            target = self._next_count(ended, n)
            if target is None:
                return ended.code if ended.kind == "failure" else EXIT_PREEMPTED
            reason = "failure" if ended.kind == "failure" else ("grow" if target > n else "shrink")
            self._change(n, target, reason, ended.rank, ended.raw_code)
            n = target

    def _next_count(self, ended: Ended, n: int) -> int | None:
        """The count to relaunch with after a failure or a save; None (said why) to stop."""
        if ended.kind == "failure":
            self.restarts += 1
            self.capacity = n - 1  # that slot is lost
            if self.restarts > self.plan.max_restarts:
                used = f"--max-restarts {self.plan.max_restarts} are used up"
                _error(f"rank {ended.rank} {_describe(ended.raw_code)} and {used}; {self._stopped_at()}")
                return None
        target = self._largest_usable()
        if target is None:
            left = f"{_processes(self.capacity)} left" if ended.kind == "failure" else f"--nproc-file allows {_processes(self.capacity)}"
            _error(f"{left}, {self._no_usable_count()}; {self._stopped_at()}")
        return target

    def _watch(self, gen: Launcher, n: int) -> Ended:
        """Until the set ends: done, a failure, a user's signal, or a membership change."""
        next_poll = time.monotonic() + POLL_S
        while True:
            if self.interrupted is not None:
                return Ended("interrupted", gen.wait())
            codes = gen.codes()
            failed = [(rank, c) for rank, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                return self._on_failure(gen, failed)
            if all(c == 0 for c in codes):
                return Ended("done", 0)
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
            print(f"jaxdist.launch: rank {rank} {_describe(code)}; stopping the others", file=sys.stderr, flush=True)
            gen.stop_all()
            return Ended("final", _shell_code(code), rank, code)
        # Peers of a dead process fail soon after it: blame one killed by a signal first.
        rank, code = min(lost, key=lambda rc: (rc[1] >= 0, rc[0]))
        print(f"jaxdist.launch: rank {rank} {_describe(code)}; killing the others", file=sys.stderr, flush=True)
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
    parser.add_argument("train_args", nargs=argparse.REMAINDER, help="-- then the arguments of python -m jaxdist.train")
    args = parser.parse_args(argv)
    if args.train_args[:1] == ["--"]:
        args.train_args = args.train_args[1:]
    if args.nproc < 1:
        raise JaxdistError(f"--nproc must be >= 1, got {args.nproc}")
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
    launcher = Launcher(args.nproc, args.train_args, args.devices_per_proc, args.port)
    forwarded = {s: signal.signal(s, lambda signum, frame: launcher.signal_all(signum)) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        launcher.start()
        return launcher.wait()
    finally:
        for s, handler in forwarded.items():
            signal.signal(s, handler)
        if any(p.poll() is None for p in launcher.procs):
            launcher.stop_all()


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


if __name__ == "__main__":
    sys.exit(main())
