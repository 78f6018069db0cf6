"""The elastic launch: generations of ``Launcher`` that shrink on a failure and follow the
``--nproc-file`` (save, then more or fewer processes), all in one run directory, each
start after the first resuming from the newest checkpoint. ``python -m jaxdist.launch``'s
module doc describes the rules and exit codes; ``jaxdist.cluster.elastic`` decides which
process counts fit.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import time
from pathlib import Path

from jaxdist.cluster import elastic, goodput
from jaxdist.cluster.distributed import EXIT_PORT_TAKEN
from jaxdist.cluster.heartbeat import beat_step
from jaxdist.cluster.launcher import PORT_ATTEMPTS, SAVE_GRACE_S, Ended, HangLimits, Launcher, describe_exit, exit_status
from jaxdist.cluster.recoverable import recovering_path
from jaxdist.config import Config
from jaxdist.errors import EXIT_BAD_INPUT, EXIT_CHECKPOINT, EXIT_NONFINITE, EXIT_PREEMPTED, EXIT_RECOVERY, JaxdistError
from jaxdist.layout.mesh import format_mesh

POLL_S = 0.5  # how often the --nproc-file is read
# After a death under --recovery in-process, a survivor reaches the recovery (or a later step)
# within --peer-timeout, once its step's collective gives up; one that does neither within
# twice that plus this is stuck off a step boundary (an Orbax save waiting for the dead process
# in a barrier that no death interrupts): the set restarts.
RECOVERY_START_GRACE_S = 60.0
# Exit codes a relaunch would not fix: they end an elastic run.
FINAL_CODES = {EXIT_BAD_INPUT, EXIT_NONFINITE, EXIT_CHECKPOINT, EXIT_PREEMPTED}

log = logging.getLogger(__name__)


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
    recovery: str = "restart"  # or in-process: the survivors of a death go on (training.recovery)
    peer_timeout_s: float = 10.0
    drop_stragglers: bool = False  # a persistent straggler is left out at the next membership change


class Elastic:
    """Generations of ``Launcher``: relaunch on failure (smaller) or when the
    ``--nproc-file`` changes (save, then larger or smaller); see the module doc."""

    def __init__(self, plan: ElasticPlan):
        self.plan = plan
        self.nproc_file = elastic.NprocFile(plan.nproc_file) if plan.nproc_file else None
        self.capacity = plan.max_nproc
        self.offered = plan.max_nproc  # what --nproc / the --nproc-file allows, before any slot is lost
        self.set_size = plan.max_nproc  # the running set's process count when it started
        self.restarts = 0
        self.interrupted: int | None = None
        self.gen: Launcher | None = None
        self.records_seen = 0  # elastic.jsonl's length when this set started: its straggler records come after
        self.dropped: int | None = None  # the straggler left out at this change (said in its record)
        # --recovery in-process: the furthest step any process had started when the survivors were
        # told to recover (None: no recovery in this set); a survivor's death before any process
        # starts a later step is that recovery failing, not a machine lost
        self.recovery_step: int | None = None
        self.failed_recovery = False
        self.recovered_death: tuple[int, int, int] | None = None  # (rank, raw exit, how many died) of the last in-process recovery
        self.recovery_deadline: float | None = None  # monotonic: the survivors of the last death show progress by then
        self.recovery_began = 0.0  # wall time of that death (the survivors' recovering-R files are newer)

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
            self.capacity = self.offered = min(value, p.max_nproc)
        n = self._largest_usable(p.first_resume)
        if n is None:
            log.error(f"--nproc-file says {_processes(value)}, {self._no_usable_count()}; nothing started")
        return n

    def run(self) -> int:
        finished = elastic.finished_step(self.plan.config, self.plan.run_dir, self.plan.first_resume)
        if finished is not None:  # nothing to start, and no start record
            log.info(elastic.finished_line(self.plan.config, finished))
            return 0
        n = self.first_count()
        if n is None:
            return EXIT_PREEMPTED  # "try again later"
        resume, port, port_taken = self.plan.first_resume, self.plan.port, 0
        first = True
        while True:
            # child_args ends with "--resume auto": the first start keeps the user's --resume.
            in_process = self.plan.peer_timeout_s if self.plan.recovery == "in-process" else None
            self.gen = Launcher(
                n, [*self.plan.child_args[:-1], resume], self.plan.devices_per_proc, port, self.plan.hang, peer_timeout_s=in_process
            )
            if first:  # after the port is held (a taken --port is bad input: nothing written)
                self._change(None, n, "start")
                first = False
            if self.interrupted is not None:  # before this set started: nothing to forward to
                self.gen.close()
                return 128 + self.interrupted
            self.records_seen = len(elastic.read_records(self.plan.run_dir))
            self.set_size = n
            self.recovery_step, self.failed_recovery, self.recovered_death = None, False, None
            self.recovery_deadline = None
            self.gen.start()
            ended = self._watch(self.gen, n)
            self.gen.close()
            n -= len(self.gen.lost)  # recovered in-process: the set went on without them
            port = None  # later sets: a fresh port
            if ended.kind == "port":  # nothing ran: start the same set again, not a failure
                port_taken += 1
                if port_taken >= PORT_ATTEMPTS:
                    log.error(f"the coordinator's port was taken {port_taken} times in a row; {self._stopped_at()}")
                    return EXIT_PORT_TAKEN
                log.info(f"the coordinator's port {self.gen.port} was taken before it could listen; starting again on another port")
                continue
            resume, port_taken = "auto", 0  # later sets: the newest checkpoint
            if ended.kind in ("done", "final", "interrupted"):
                return ended.code
            target = self._next_count(ended, n)
            if target is None:
                return ended.code if ended.kind in ("failure", "hang") else EXIT_PREEMPTED
            reason = ended.kind if ended.kind in ("failure", "hang") else ("grow" if target > n else "shrink")
            if self.failed_recovery and self.recovered_death is not None:  # the death the recovery was for restarts the set
                rank, code, died = self.recovered_death
                self._change(n + died, target, reason, rank, code)
            else:
                self._change(n, target, reason, ended.rank, ended.raw_code)
            n = target

    def _next_count(self, ended: Ended, n: int) -> int | None:
        """The count to relaunch with after a failure or a save; None (said why) to stop."""
        failure = ended.kind in ("failure", "hang")
        if failure:
            if not self.failed_recovery:  # a failed recovery and its restart are one failure: the recovery counted it
                self.restarts += 1
            if self.plan.recovery == "in-process":
                # a dead process is replaced in its slot (as it would have rejoined a recovery):
                # the restart keeps the set's slots, so a restart is never weaker than a recovery
                self.capacity = min(max(self.capacity, self.set_size), self.offered)
            else:
                # that slot is lost (a hung process's machine is as suspect as a dead one's)
                self.capacity = n if ended.raw_code == EXIT_RECOVERY else n - 1
            if self.restarts > self.plan.max_restarts:
                used = f"--max-restarts {self.plan.max_restarts} are used up"
                log.error(f"{ended.describe()} and {used}; {self._stopped_at()}")
                return None
        if self.plan.drop_stragglers:
            self._drop_straggler(ended.rank if failure else None)
        target = self._largest_usable()
        if target is None:
            left = f"{_processes(self.capacity)} left" if failure else f"--nproc-file allows {_processes(self.capacity)}"
            log.error(f"{left}, {self._no_usable_count()}; {self._stopped_at()}")
        return target

    def _drop_straggler(self, failed_rank: int | None) -> None:
        """--drop-stragglers, at a membership change: a process of this set named a straggler at
        the end of two windows in a row (by process 0, in elastic.jsonl) is left out of the next
        set: one slot fewer (said in one line and in the change's record)."""
        window = self.plan.config.train.straggler_window
        named = [r for r in elastic.read_records(self.plan.run_dir)[self.records_seen :] if r.get("reason") == "straggler"]
        persistent = elastic.persistent_straggler(named, window)
        if persistent is None or persistent[0] == failed_rank:  # the failed one's slot is lost already
            return
        process, first, last = persistent
        self.capacity -= 1
        self.dropped = process
        log.info(
            f"process {process} was named a straggler at the end of two windows in a row (steps {first}-{last}); "
            "its slot is left out of the next set (--drop-stragglers)"
        )

    def _watch(self, gen: Launcher, n: int) -> Ended:
        """Until the set ends: done, a failure, a hang, a user's signal, or a membership change."""
        next_poll = time.monotonic() + POLL_S
        while True:
            if self.interrupted is not None:
                return Ended("interrupted", gen.wait().code)
            for rank in gen.opened_slots():  # --recovery in-process: the live processes are ready for a replacement
                self.capacity = min(self.capacity + 1, self.plan.max_nproc)
                log.info(f"starting a replacement for rank {rank}; it rejoins the live processes at their next step")
                gen.replace(rank)
            self._stop_late_replacements(gen)
            ended = gen.poll()
            if ended is not None and ended.kind == "failure" and self._recovers_in_process(gen, ended, n):
                continue
            if ended is None and self._recovery_stuck(gen):
                return self._restart_stuck_recovery(gen)
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
                    self.capacity = self.offered = min(value, self.plan.max_nproc)
                    target = self._largest_usable()
                    if target != n:
                        return self._save(gen, value, target)
            time.sleep(0.1)

    def _recovers_in_process(self, gen: Launcher, ended: Ended, n: int) -> bool:
        """--recovery in-process: whether the survivors of ``ended``'s deaths go on by themselves
        (said in one line); False sends the set down the restart path."""
        if self.plan.recovery != "in-process":
            return False
        if self.recovery_step is not None and self._furthest_step(gen) <= self.recovery_step:
            # the survivors died before taking a step past the recovery (it came while they started,
            # compiled or joined): a restart, and their slots are not lost
            self.failed_recovery = True
            log.info(f"the in-process recovery did not get under way (rank {ended.rank} {describe_exit(ended.raw_code)}): restarting")
            return False
        dead = [rank for rank, code in ended.failed if code not in FINAL_CODES and code != EXIT_RECOVERY]
        live_ranks = [r for r in range(gen.first_id, gen.first_id + gen.nproc) if r not in gen.lost and r not in dead]
        rejoining = sorted(r for r in gen.replaced if beat_step(gen.beats, r) is None)
        if len(dead) != len(ended.failed):  # a survivor gave up (EXIT_RECOVERY says why) or a final error
            if 0 in dead and not rejoining and all(beat_step(gen.beats, r) is not None for r in live_ranks):
                # rank 0's death in a step took the coordination service: the survivors' own exits, seen in the
                # same poll, follow from it (which the launcher sees first depends on the load)
                log.info(
                    f"rank 0 {describe_exit(dict(ended.failed)[0])}: it holds the coordination service, so the run restarts from its last checkpoint"
                )
            return False
        if rejoining:  # the live processes wait for it in the grow, which no death interrupts
            log.info(
                f"rank {', '.join(map(str, dead))} {describe_exit(ended.raw_code)} while rank {', '.join(map(str, rejoining))}'s "
                "replacement was rejoining: the run restarts from its last checkpoint"
            )
            return False
        if any(beat_step(gen.beats, r) is None for r in live_ranks):  # recovery runs inside a step's live_devices
            log.info(
                f"rank {', '.join(map(str, dead))} {describe_exit(ended.raw_code)} before every process had started its first step: "
                "the run restarts (in-process recovery begins at the first step)"
            )
            return False
        if 0 in dead:
            log.info(
                f"rank 0 {describe_exit(dict(ended.failed)[0])}: it holds the coordination service, so the run restarts from its last checkpoint"
            )
            return False
        live = n - len(gen.lost) - len(dead)
        if live < self.plan.min_nproc:
            return False
        if live == 1:
            log.info(
                f"rank {', '.join(map(str, dead))} {describe_exit(ended.raw_code)}: one process would be left, and Orbax cannot save "
                "a mesh of one process's devices while JAX runs several, so the run restarts from its last checkpoint"
            )
            return False
        gen.lost.update(dead)
        self.restarts += 1  # a recovery spends one of --max-restarts, as a restart would
        if self.restarts > self.plan.max_restarts:
            return False
        self.capacity = live
        self.recovery_step = self._furthest_step(gen)
        self.recovery_began = time.time()
        self.recovery_deadline = time.monotonic() + self._recovery_wait_s()
        self.recovered_death = (dead[0], ended.raw_code, len(dead))
        log.info(
            f"rank {', '.join(map(str, dead))} {describe_exit(ended.raw_code)}; the other {live} recover in-process (--recovery in-process)"
        )
        return True

    def _recovery_wait_s(self) -> float:
        return 2 * self.plan.peer_timeout_s + RECOVERY_START_GRACE_S

    def _recovery_stuck(self, gen: Launcher) -> bool:
        """Whether the survivors of the last death have shown no progress by the deadline: none
        entered the recovery (its recovering-R file) nor started a step past the death's."""
        if self.recovery_deadline is None:
            return False
        live = [r for r in range(gen.first_id, gen.first_id + gen.nproc) if r not in gen.lost and r not in gen.replaced]
        for rank in live:
            step = beat_step(gen.beats, rank)
            try:
                entered = os.path.getmtime(recovering_path(gen.beats, rank)) >= self.recovery_began
            except OSError:
                entered = False
            if entered or (step is not None and step > self.recovery_step):
                self.recovery_deadline = None  # under way: a failure from here is the recovery's own
                return False
        return time.monotonic() > self.recovery_deadline

    def _restart_stuck_recovery(self, gen: Launcher) -> Ended:
        rank, code, _ = self.recovered_death
        log.info(
            f"the survivors of rank {rank}'s death reached no step boundary in {self._recovery_wait_s():.0f}s (a checkpoint save waiting for "
            "the dead process): the run restarts from its last checkpoint"
        )
        self.failed_recovery = True
        gen.kill_all()
        return Ended("failure", exit_status(code), rank, code, failed=[(rank, code)])

    @staticmethod
    def _furthest_step(gen: Launcher) -> int:
        """The furthest step any process of the set has started (-1: none has)."""
        steps = [beat_step(gen.beats, rank) for rank in range(gen.first_id, gen.first_id + gen.nproc)]
        return max((s for s in steps if s is not None), default=-1)

    def _stop_late_replacements(self, gen: Launcher) -> None:
        """Every other process finished the run: a replacement still starting (or failed since)
        connected too late to join; it is stopped, and the run is done, not failed."""
        codes = gen.codes()
        others = [c for rank, c in enumerate(codes, gen.first_id) if rank not in gen.replaced and rank not in gen.lost]
        if not gen.replaced or not others or any(c != 0 for c in others):
            return
        for rank in sorted(gen.replaced):
            proc = gen.procs[rank - gen.first_id]
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            elif proc.returncode == 0:
                continue
            log.info(f"rank {rank}'s replacement did not join before the run ended; the run is done")
            gen.lost.add(rank)
        gen.replaced.clear()

    def _on_failure(self, gen: Launcher, failed: list[tuple[int, int]]) -> Ended:
        return after_failure(gen, failed)

    def _save(self, gen: Launcher, value: int, target: int | None) -> Ended:
        """Ask the run to save (SIGTERM: every process saves the same step and exits 75)."""
        then = f"restarting with {target}" if target else f"stopping (--min-nproc {self.plan.min_nproc})"
        log.info(f"--nproc-file says {value}: asking the run to save, then {then}")
        return save_and_stop(gen, lambda: self.interrupted is not None)

    def _stopped_at(self) -> str:
        return stopped_at(self.plan.run_dir)

    def _change(self, old: int | None, new: int, reason: str, rank: int | None = None, code: int | None = None) -> None:
        step = elastic.latest_step(self.plan.run_dir) or 0
        if old is not None:
            log.info(f"elastic: {old} -> {new} processes, resuming at step {step}")
        fields = {"from": old, "to": new, "reason": reason, "step": step, "failed_rank": rank, "exit_code": code}
        if self.dropped is not None:
            fields["dropped_straggler"], self.dropped = self.dropped, None
        mesh = format_mesh(elastic.mesh_for(self.plan.config, new, self.plan.devices_per_proc))
        elastic.record(self.plan.run_dir, **fields, mesh=mesh, restarts=self.restarts)


def after_failure(gen: Launcher, failed: list[tuple[int, int]]) -> Ended:
    """A set in which processes failed: kill the others at once (with a dead peer they cannot
    save consistently; the last checkpoint stands), or, when every failure is one that a
    relaunch would not fix (bad input, a NaN loss), stop them and make it final."""
    lost = [(rank, c) for rank, c in failed if c not in FINAL_CODES]
    if not lost:  # e.g. bad input or a NaN loss: it would recur on any count
        rank, code = failed[0]
        log.info(f"rank {rank} {describe_exit(code)}; stopping the others")
        gen.stop_all()
        return Ended("final", exit_status(code), rank, code)
    rank, code = lost[0]  # in the launcher's blame order
    log.info(f"rank {rank} {describe_exit(code)}; killing the others")
    gen.kill_all()
    return Ended("failure", exit_status(code), rank, code)


def save_and_stop(gen: Launcher, interrupted) -> Ended:
    """SIGTERM the set (a jaxdist run agrees on a step, saves it and exits 75), wait up to
    ``SAVE_GRACE_S``, kill what is left; how it ended: saved, done (it finished first),
    final (a code a relaunch would not fix) or interrupted (``interrupted()``: a user's signal)."""
    gen.signal_all(signal.SIGTERM)
    deadline = time.monotonic() + SAVE_GRACE_S
    while any(c is None for c in gen.codes()) and time.monotonic() < deadline:
        if any(c not in (None, 0, EXIT_PREEMPTED) for c in gen.codes()):
            break  # one died (e.g. the signal came before it set up JAX): the others cannot save
        time.sleep(0.1)
    gen.kill_all()
    codes = gen.codes()
    if interrupted():
        return Ended("interrupted", next((exit_status(c) for c in codes if c), 0))
    if all(c == 0 for c in codes):  # it finished before the save
        return Ended("done", 0)
    final = [c for c in codes if c in FINAL_CODES - {EXIT_PREEMPTED}]
    if final:
        return Ended("final", final[0])
    unsaved = [c for c in codes if c != EXIT_PREEMPTED]  # killed after the grace, or crashed while saving
    code = unsaved[0] if unsaved else EXIT_PREEMPTED
    return Ended("saved", exit_status(code), raw_code=code)


def stopped_at(run_dir: Path) -> str:
    """Where a stopped run can be resumed from, for its last line."""
    step = elastic.latest_step(run_dir)
    if step is None:
        return "the run stopped before its first checkpoint: rerun to start it again"
    return f"the run stopped at its last checkpoint (step {step}): rerun to resume"


def _processes(n: int) -> str:
    return f"{n} process" if n == 1 else f"{n} processes"


def run_elastic(plan: ElasticPlan) -> int:
    """The elastic run ``plan`` describes, until it ends; the exit status. SIGINT / SIGTERM
    are forwarded to the running set (no relaunch after them). However it ends, once its
    processes are gone, ``RUN_DIR/goodput.json`` accounts the run's wall time from its first
    start (``cluster.goodput``)."""
    try:
        return drive(Elastic(plan))
    finally:
        started = goodput.run_started(plan.run_dir)
        if started is not None:
            goodput.write(plan.run_dir, started, time.time())


def drive(loop) -> int:
    """Run an elastic loop (``run()``, ``on_signal``, its current set ``gen``) with SIGINT /
    SIGTERM forwarded to it; whatever way it ends, its set is stopped and closed. A
    ``JaxdistError`` (the first start does not fit, an unwritable run dir, an etcd that
    does not answer at start) goes on to the command (``errors.command``: one line, exit 2)."""
    forwarded = {s: signal.signal(s, loop.on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        return loop.run()
    finally:
        for s, handler in forwarded.items():
            signal.signal(s, handler)
        if loop.gen is not None and any(p.poll() is None for p in loop.gen.procs):
            loop.gen.stop_all()
        if loop.gen is not None:
            loop.gen.close()
