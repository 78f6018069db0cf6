"""One node's launcher in an elastic run across nodes (``python -m jaxdist.launch --nnodes
MIN:MAX --nproc-per-node K --rdzv etcd://HOST:PORT --rdzv-id ID``; its module doc gives the
rules and exit codes).

Each launcher registers with the run's etcd rendezvous (``jaxdist.cluster.rendezvous``),
waits for a generation that includes it, runs its K processes of that generation with
``Launcher`` (global ids from node_rank x K, the coordinator on node 0) and watches for the
generation's end: its own processes failing or finishing, a member's lease expiring, a new
node that lets the run grow, its own SIGINT / SIGTERM (it saves and leaves). Every member
follows the end the first reporter wrote: a failure kills the processes at once (the last
checkpoint stands), a grow or a leave saves (SIGTERM), then the next generation starts from
the newest checkpoint. Which node counts fit is ``jaxdist.cluster.elastic``'s check; how a
set is stopped or saved is ``jaxdist.cluster.elastic_launch``'s.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import signal
import socket
import time
from pathlib import Path

from jaxdist.cluster import elastic, goodput
from jaxdist.cluster.elastic_launch import after_failure, drive, save_and_stop, stopped_at
from jaxdist.cluster.etcd import Etcd, EtcdError, EtcdUnavailable
from jaxdist.cluster.launcher import (
    GRACE_S,
    SAVE_GRACE_S,
    Ended,
    HangLimits,
    Launcher,
    Placement,
    describe_exit,
    reserve_port,
)
from jaxdist.cluster.rendezvous import (
    FAILURES,
    FINAL,
    LEASE_TTL_S,
    RETRY_S,
    SAVES,
    Ending,
    Generation,
    Registration,
    Settle,
    State,
    agreed_fingerprint,
    end_generation,
    joiners,
    propose,
    read_state,
)
from jaxdist.config import Config
from jaxdist.errors import EXIT_BAD_INPUT, EXIT_PREEMPTED, JaxdistError
from jaxdist.layout.mesh import format_mesh

POLL_S = 0.5  # how often etcd is read
# Right after etcd was away, a member's key may be missing this long: its lease expired while
# etcd was stopped and its launcher grants a new one. Otherwise a missing key is a lost node.
LOST_GRACE_S = float(LEASE_TTL_S)
STOP_WAIT_S = SAVE_GRACE_S + GRACE_S + 10  # for a node still stopping its last generation's processes

log = logging.getLogger(__name__)


@dataclasses.dataclass
class NodePlan:
    """Everything one node's launcher needs, checked before anything starts."""

    config: Config
    run_dir: Path  # shared by every node
    child_args: list[str]  # train args with --run-dir RUN_DIR --resume auto at the end
    first_resume: str  # the user's --resume, for the run's first generation
    min_nodes: int
    max_nodes: int
    nproc_per_node: int
    devices_per_proc: int
    etcd: Etcd
    run_id: str
    node_id: str
    address: str  # this node's cluster-facing address: its coordinator's, when it is node 0
    rdzv_timeout_s: float
    settle_s: float
    max_restarts: int
    hang: HangLimits | None = None

    def fingerprint(self) -> str:
        """Of what every launcher of the run must agree on."""
        text = json.dumps([self.child_args, self.nproc_per_node, self.devices_per_proc])
        return hashlib.sha256(text.encode()).hexdigest()[:16]


def route_address(host: str, port: int) -> str:
    """The address of this machine's interface that reaches ``host`` (nothing is sent)."""
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as sock:
            sock.connect(sockaddr)
            return sock.getsockname()[0]
    except OSError as e:
        raise JaxdistError(f"--rdzv {host}:{port}: no route to it from this machine ({e.strerror or e}); pass --coordinator-bind") from None


def check_local_address(address: str) -> None:
    try:
        family = socket.getaddrinfo(address, 0, type=socket.SOCK_STREAM)[0][0]
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.bind((address, 0))
    except OSError as e:
        raise JaxdistError(f"--coordinator-bind {address}: not an address of this machine ({e.strerror or e})") from None


class NodeElastic:
    """This node's part of the run: rendezvous, run a generation, follow its end; again."""

    def __init__(self, plan: NodePlan):
        self.plan = plan
        self.me = plan.node_id
        self.fingerprint = plan.fingerprint()
        self.reg = Registration(plan.etcd, plan.run_id, plan.node_id, plan.address, fingerprint=self.fingerprint)
        self.interrupted: int | None = None
        self.leaving = False
        self.gen: Launcher | None = None
        self.reservation: socket.socket | None = None  # node 0's coordinator port, from the proposal to the set's end
        self.ran_process_zero = False  # whether the last generation this node ran had process 0 here (it accounts the run)
        self.unreachable_at = -float("inf")  # when a read of etcd last failed

    def on_signal(self, signum: int, frame=None) -> None:
        self.interrupted = signum  # the loop reports the leave first, then forwards it

    # --- which node counts fit ---

    def usable(self, low: int, high: int, resuming: bool) -> int | None:
        """The largest node count in [low, high] whose processes can run the training."""
        p = self.plan
        for n in range(min(high, p.max_nodes), low - 1, -1):
            if elastic.fit_problem(p.config, n * p.nproc_per_node, p.devices_per_proc, resuming) is None:
                return n
        return None

    def check_start(self) -> None:
        """Bad input before anything is registered: no node count in MIN..MAX fits."""
        p = self.plan
        resuming = p.first_resume != "never" and elastic.latest_step(p.run_dir) is not None
        if self.usable(p.min_nodes, p.max_nodes, resuming) is None:
            problem = elastic.fit_problem(p.config, p.max_nodes * p.nproc_per_node, p.devices_per_proc, resuming)
            raise JaxdistError(f"no node count from --nnodes {p.min_nodes}:{p.max_nodes} can run this training ({problem})")

    # --- the loop ---

    def run(self) -> int:
        p = self.plan
        finished = elastic.finished_step(p.config, p.run_dir, p.first_resume)
        if finished is not None:  # before registering: no generation, no start record
            log.info(elastic.finished_line(p.config, finished))
            return 0
        self.check_start()
        try:
            state = read_state(self.plan.etcd, self.plan.run_id)
            self.refuse_if_other_arguments(state)  # before registering: the running nodes never see this one
            self.reg.join(state.generation.number if state.generation else 0)
        except (EtcdUnavailable, EtcdError) as e:
            raise JaxdistError(f"cannot use the rendezvous --rdzv {self.plan.etcd.describe()}: {e}") from None
        while True:
            gen = self.rendezvous()
            if isinstance(gen, int):
                return gen
            code = self.run_generation(gen)
            if code is not None:
                return code

    def read(self) -> State | None:
        """The run's keys, with only the nodes that have this launcher's arguments (None: etcd
        did not answer). Raises ``JaxdistError`` when the run is another launcher's (see
        ``refuse_if_other_arguments``)."""
        try:
            state = read_state(self.plan.etcd, self.plan.run_id)
        except (EtcdUnavailable, EtcdError):
            self.unreachable_at = time.monotonic()
            return None  # the lease thread says that etcd is away and when it is back
        self.refuse_if_other_arguments(state)
        # One with other arguments that registered at the same moment refuses itself on its next read: never counted.
        state.nodes = [n for n in state.nodes if n.fingerprint == self.fingerprint]
        return state

    def refuse_if_other_arguments(self, state: State) -> None:
        """The run runs (or the nodes that came first wait) with other training arguments,
        --nproc-per-node or --devices-per-proc: this launcher does not join (one line, exit 2)."""
        agreed = agreed_fingerprint(state)
        if agreed is None or agreed == self.fingerprint:
            return
        peers = [n.id for n in state.nodes if n.fingerprint == agreed and n.id != self.me]
        raise JaxdistError(
            f"--rdzv-id {self.plan.run_id} runs with other training arguments, --nproc-per-node or --devices-per-proc "
            f"(node {peers[0] if peers else '?'}: {agreed or 'none'}; this launcher: {self.fingerprint}); it does not join: "
            "start every launcher of a run with the same ones"
        )

    def rendezvous(self) -> Generation | int:
        """Until a generation includes this node (or an exit status: the run is over here)."""
        p = self.plan
        started = time.monotonic()
        settle = Settle()
        while True:
            if self.interrupted is not None:
                return 128 + self.interrupted
            self.reg.flush()
            state = self.read()
            now = time.monotonic()
            if state is None:
                if now - started > p.rdzv_timeout_s:
                    log.error(f"etcd did not answer for {p.rdzv_timeout_s:g}s (--rdzv-timeout); {stopped_at(p.run_dir)}")
                    return EXIT_PREEMPTED
                time.sleep(RETRY_S)
                continue
            gen = state.generation
            if gen is not None and gen.number > self.reg.stopped:  # a generation this node has not seen end
                if gen.stop is not None:
                    log.error(gen.stop["message"])
                    return int(gen.stop["code"])
                if self.me in gen.members:
                    return gen
                log.info(
                    f"generation {gen.number} runs on {len(gen.members)} nodes without this one (--nnodes max or a count that fits); waiting"
                )
                self.reg.set_stopped(gen.number)  # standby: not in it, free for the next one
            ending = state.endings.get(gen.number) if gen is not None else None
            if ending is not None and ending.reason in FINAL and ending.revision > self.reg.joined_revision:
                log.info(f"the run ended ({ending.reason}) while this node waited to join")
                return ending.code if ending.code is not None else 0
            number = (gen.number if gen is not None else 0) + 1
            stable = settle.stable_for(state.node_ids(), now)
            nodes = state.candidates()
            free = [n for n in nodes if n.stopped >= number - 1]
            waiting_for_busy = len(free) < len(nodes) and now - started < STOP_WAIT_S
            resuming = elastic.latest_step(p.run_dir) is not None
            count = self.usable(p.min_nodes, len(free), resuming)
            members = [n.id for n in free[: count or 0]]
            # The settle window gathers nodes that join; the survivors of a generation that ended start at once.
            survivors = ending is not None and ending.reason not in FINAL and set(members) <= set(gen.members)
            settled = stable >= p.settle_s or count == p.max_nodes or survivors
            if free and free[0].id == self.me and not waiting_for_busy and count is not None and settled:
                proposed = self.propose(state, number, members)
                if proposed is not None:
                    return proposed
            if count is None and now - started > p.rdzv_timeout_s:
                have = f"{len(free)} node{'s' if len(free) != 1 else ''}"
                if len(free) < p.min_nodes:
                    why = f"fewer than {p.min_nodes} nodes for {p.rdzv_timeout_s:g}s (--rdzv-timeout; {have} here)"
                else:
                    why = (
                        f"no node count from {p.min_nodes} to {len(free)} can run this training for {p.rdzv_timeout_s:g}s (--rdzv-timeout)"
                    )
                log.error(f"{why}; {stopped_at(p.run_dir)}")
                return EXIT_PREEMPTED
            time.sleep(POLL_S)

    def propose(self, state: State, number: int, members: list[str]) -> Generation | int | None:
        """As the lowest free node: write the next generation (None: someone else did)."""
        p = self.plan
        prev = state.generation
        ending = state.endings.get(prev.number) if prev is not None else None
        reason = ending.reason if ending is not None and ending.reason not in FINAL else "start"
        if reason == "port" and members == list(prev.members):  # process 0's port was taken before anything ran: again, on a new port
            return self._propose(state, dataclasses.replace(prev, number=number, change={**prev.change, "generation": number}))
        if reason == "port":
            reason = "start"  # nothing ran in it and the nodes changed since: a fresh start from the newest checkpoint
        restarts = 0 if reason == "start" else prev.restarts + (reason in FAILURES)
        k = p.nproc_per_node
        change = {
            "generation": number,
            "from": prev.world if reason != "start" else None,
            "to": len(members) * k,
            "from_nodes": len(prev.members) if reason != "start" else None,
            "nodes": len(members),
            "node_ids": members,
            "reason": reason,
            "step": elastic.latest_step(p.run_dir) or 0,
            "left": [m for m in prev.members if m not in members] if reason != "start" else [],  # gone (or waiting: above MAX)
            "joined": [m for m in members if reason == "start" or m not in prev.members],
            "node": ending.node
            if ending is not None and reason != "start"
            else None,  # where the change came from: a failed process, lost, left or joined
            "failed_rank": ending.rank if ending is not None and reason != "start" else None,
            "exit_code": ending.exit_code if ending is not None and reason != "start" else None,
            "mesh": format_mesh(elastic.mesh_for(p.config, len(members) * k, p.devices_per_proc)),
            "restarts": restarts,
        }
        stop = None
        if restarts > p.max_restarts:
            failure = f"rank {ending.rank} {describe_exit(ending.exit_code)}" if ending.rank is not None else f"node {ending.node} was lost"
            stop = {"code": 1, "message": f"{failure} and --max-restarts {p.max_restarts} are used up; {stopped_at(p.run_dir)}"}
            if ending.exit_code is not None:
                stop["code"] = ending.exit_code if ending.exit_code > 0 else 128 - ending.exit_code
        gen = Generation(number, tuple(members) if stop is None else (), "", k, restarts, change, self.fingerprint, stop)
        proposed = self._propose(state, gen)
        if isinstance(proposed, Generation):
            elastic.record(p.run_dir, **change)
        return proposed

    def _propose(self, state: State, gen: Generation) -> Generation | int | None:
        """Hold a coordinator port on this node's address and write ``gen`` with it."""
        p = self.plan
        reservation = reserve_port(p.address) if gen.stop is None else None
        if reservation is not None:
            host = f"[{p.address}]" if ":" in p.address else p.address
            gen = dataclasses.replace(gen, coordinator=f"{host}:{reservation.getsockname()[1]}")
        try:
            won = propose(p.etcd, p.run_id, state, gen)
        except (EtcdUnavailable, EtcdError):
            won = False
        if not won:
            if reservation is not None:
                reservation.close()
            return None
        if gen.stop is not None:
            log.error(gen.stop["message"])
            return int(gen.stop["code"])
        self.reservation = reservation
        return gen

    def run_generation(self, gen: Generation) -> int | None:
        """This node's processes of ``gen`` until it ends everywhere; an exit status when the
        run is over here, None to rendezvous again."""
        p = self.plan
        rank = gen.rank(self.me)
        if gen.nproc_per_node != p.nproc_per_node or gen.fingerprint != self.fingerprint:
            log.error(
                f"the launchers of --rdzv-id {p.run_id} disagree: generation {gen.number} was made by one with other "
                "--nproc-per-node, --devices-per-proc or training arguments; start every launcher with the same ones"
            )
            self.reg.set_stopped(gen.number)
            return EXIT_BAD_INPUT
        node0 = rank == 0
        self.ran_process_zero = node0
        placement = Placement(gen.coordinator, gen.world, rank * p.nproc_per_node, p.address if node0 else None, self.reservation)
        resume = p.first_resume if gen.change.get("reason") == "start" else "auto"
        self._announce(gen, rank)
        self.gen = Launcher(p.nproc_per_node, [*p.child_args[:-1], resume], p.devices_per_proc, hang=p.hang, placement=placement)
        self.reservation = None  # the set holds it now and frees it when closed
        self.gen.start()
        ending, local = self.watch(self.gen, gen)
        self.gen.close()
        self.reg.set_stopped(gen.number)
        if self.leaving:
            return local.code if local is not None else EXIT_PREEMPTED
        if ending.reason in FINAL:
            return ending.code if ending.code is not None else (local.code if local is not None else 0)
        return None

    def _announce(self, gen: Generation, rank: int) -> None:
        """The generation's line, said by every node's launcher."""
        c = gen.change
        where = f"this node is node {rank} of {len(gen.members)} (coordinator {gen.coordinator})"
        if c.get("reason") == "start" or c.get("from") is None:
            line = f"rendezvous {self.plan.run_id}: generation {gen.number}, {len(gen.members)} nodes x {gen.nproc_per_node} processes; {where}"
        else:
            line = (
                f"elastic: {c['from_nodes']} -> {c['nodes']} nodes ({c['from']} -> {c['to']} processes, {c['reason']}), "
                f"resuming at step {c['step']}; {where}"
            )
        log.info(line, extra={"every_process": True})

    # --- one generation ---

    def watch(self, launcher: Launcher, gen: Generation) -> tuple[Ending, Ended | None]:
        """Until ``gen`` ends: (the agreed end, how this node's set ended when it ended first)."""
        absent: dict[str, float] = {}
        settle = Settle()
        next_poll = time.monotonic() + POLL_S
        while True:
            if self.interrupted is not None and not self.leaving:
                self.leaving = True
                self.report(gen, Ending("leave", self.me))  # before the processes hear it: the others save, not stop
                log.info(f"{signal.Signals(self.interrupted).name}: this node's processes save, then it leaves the run")
                launcher.signal_all(self.interrupted)
            # leaving: the processes save and exit; those still running after the save's grace are killed
            local = launcher.wait() if self.leaving and launcher.past_save_grace() else launcher.poll()
            if local is not None:
                if self.leaving:
                    return Ending("leave", self.me), launcher.wait()
                mine = self.local_ending(launcher, local)
                return self.follow(launcher, gen, self.report(gen, mine) or mine), local
            if time.monotonic() >= next_poll:
                state = self.read()
                next_poll = time.monotonic() + POLL_S
                if state is not None:
                    ending = state.endings.get(gen.number) or self.membership_change(state, gen, absent, settle)
                    if ending is not None and not (self.leaving and ending.reason == "leave"):
                        return self.follow(launcher, gen, ending), None
            time.sleep(0.1)

    def report(self, gen: Generation, ending: Ending) -> Ending | None:
        """Write why ``gen`` ended; the end that counts (None: etcd did not answer)."""
        try:
            return end_generation(self.plan.etcd, self.plan.run_id, gen.number, ending)
        except (EtcdUnavailable, EtcdError):
            return None

    def local_ending(self, launcher: Launcher, local: Ended) -> Ending:
        if local.kind == "failure":
            ended = after_failure(launcher, local.failed)
            reason = "final" if ended.kind == "final" else "failure"
            return Ending(reason, self.me, ended.rank, ended.raw_code, ended.code if reason == "final" else None)
        if local.kind == "hang":
            return Ending("hang", self.me, local.rank, local.raw_code)
        if local.kind == "port":
            launcher.kill_all()
            return Ending("port", self.me)
        return Ending("done" if local.kind == "done" else "saved", self.me, code=local.code)

    def membership_change(self, state: State, gen: Generation, absent: dict[str, float], settle: Settle) -> Ending | None:
        """A member lost (its key missing; for ``LOST_GRACE_S`` after etcd was away) or, on node 0, nodes that let
        the run grow (waiting for the settle window); reported, or None."""
        now = time.monotonic()
        live = set(state.node_ids())
        for member in gen.members:
            if member == self.me or member in live:
                absent.pop(member, None)
            else:
                absent.setdefault(member, now)
        outage = self.reg.unreachable is not None or now - self.unreachable_at < LEASE_TTL_S + LOST_GRACE_S
        grace = LOST_GRACE_S if outage else 0.0
        lost = [m for m, since in absent.items() if now - since >= grace]
        if lost:
            return self.report(gen, Ending("lost", lost[0]))
        stable = settle.stable_for(state.node_ids(), now)
        if gen.rank(self.me) != 0 or len(gen.members) >= self.plan.max_nodes:
            return None
        waiting = joiners(state, gen)
        if not waiting or stable < self.plan.settle_s:
            return None
        n = len(gen.members)
        if self.usable(n + 1, n + len(waiting), resuming=True) is None:  # the save makes the next start a resume
            return None
        log.info(f"node {waiting[0].id} is waiting to join: asking the run to save, then to grow")
        return self.report(gen, Ending("grow", waiting[0].id))

    def follow(self, launcher: Launcher, gen: Generation, ending: Ending) -> Ending:
        """Stop this node's processes as the end asks."""
        running = any(c is None for c in launcher.codes())
        by = f"generation {gen.number} ended ({ending.reason}, node {ending.node})"
        if not running:
            return ending
        if ending.reason in FAILURES or ending.reason == "port":
            log.info(f"{by}; killing this node's processes")
            launcher.kill_all()
        elif ending.reason in SAVES:
            log.info(f"{by}; this node's processes save")
            save_and_stop(launcher, lambda: False)
        elif ending.reason in ("done", "saved"):  # they finish (or save) too: give them the time a save gets
            deadline = time.monotonic() + SAVE_GRACE_S
            while any(c is None for c in launcher.codes()) and time.monotonic() < deadline:
                time.sleep(0.1)
            launcher.stop_all()
        else:
            launcher.stop_all()
        return ending


def run_node(plan: NodePlan) -> int:
    """This node's part of the run ``plan`` describes, until it ends here; the exit status.
    The node that ran process 0 last accounts the run's wall time from its first start into
    ``RUN_DIR/goodput.json`` (``cluster.goodput``; the run directory is shared by every node)."""
    loop = NodeElastic(plan)
    try:
        return drive(loop)
    finally:
        if loop.reservation is not None:
            loop.reservation.close()
        loop.reg.leave()
        started = goodput.run_started(plan.run_dir) if loop.ran_process_zero else None
        if started is not None:
            goodput.write(plan.run_dir, started, time.time())
