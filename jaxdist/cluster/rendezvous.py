"""The etcd rendezvous of a multi-node elastic run (``python -m jaxdist.launch --nnodes``).

Every node's launcher keeps these keys under ``/jaxdist/RUN_ID/`` (etcd's v3 store; the
only agreement protocol is etcd's: transactions and leases, ``jaxdist.cluster.etcd``):

- ``nodes/NODE``: one per launcher, on a lease of ``LEASE_TTL_S`` that a thread renews
  (``Registration``). A launcher killed even by SIGKILL drops out when its lease expires.
  The key's create revision orders the nodes (join order); its value says the node's
  address, ``stopped``: the last generation whose processes have all ended there, so
  the node is free to join any later one, and ``fingerprint``: a hash of its training
  arguments (and processes and devices per node). Launchers that disagree never share a
  generation: the one that came later refuses to join (``agreed_fingerprint``).
- ``gen``: the current generation (``Generation``): its number, the member nodes in rank
  order, the coordinator's address (node 0's, on a port node 0 holds), the processes per
  node, the restarts so far and the change that made it (the ``elastic.jsonl`` record).
  Only the lowest free node proposes one, and only with a transaction that compares the
  key's mod revision with the one it read, so two proposals can never both win.
- ``end/N``: why generation N ended (``Ending``), created once (a transaction on the key's
  version): the first report wins and every member follows it.

A generation runs without etcd: etcd is only asked about membership changes, so a run
keeps training while it is down (the lease is renewed, or granted again and the node
registered again, once it is back). The decisions here are pure functions of one read of
the keys (``State``); ``jaxdist.cluster.node_launch`` runs the loop.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import re
import threading

from jaxdist.cluster.etcd import Etcd, EtcdError, EtcdUnavailable, KeyValue
from jaxdist.errors import JaxdistError

LEASE_TTL_S = 5  # a dead node's key is gone this long after its launcher's last renewal
RETRY_S = 0.5  # between tries while etcd does not answer
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")  # run and node ids: one etcd key component

# Why a generation ends. After these the next one starts from the last checkpoint (no save
# is possible with a peer gone) and they count as restarts:
FAILURES = ("failure", "hang", "lost")
# The run saves (SIGTERM: every process saves the same step and exits 75) and goes on:
SAVES = ("grow", "leave")
# The run is over (every launcher exits): done (0), saved (75: preempted from outside), final (its code).
FINAL = ("done", "saved", "final")

log = logging.getLogger(__name__)


def check_name(value: str, flag: str) -> str:
    if not NAME.match(value):
        raise JaxdistError(f"{flag} {value!r}: expected 1 to 128 letters, digits, '.', '_' or '-' (it becomes an etcd key)")
    return value


def prefix(run_id: str) -> str:
    return f"/jaxdist/{run_id}/"


@dataclasses.dataclass(frozen=True)
class Node:
    id: str
    address: str
    stopped: int  # the last generation whose processes have all ended on this node
    revision: int  # the key's create revision: the join order
    fingerprint: str = ""  # of its training arguments (NodePlan.fingerprint)


@dataclasses.dataclass(frozen=True)
class Generation:
    number: int
    members: tuple[str, ...]  # node ids, rank order
    coordinator: str  # HOST:PORT of process 0's coordinator (on node 0)
    nproc_per_node: int
    restarts: int
    change: dict  # the elastic.jsonl record of the change that made it
    fingerprint: str  # of the training arguments: every launcher must run the same
    stop: dict | None = None  # a terminal generation: {"code", "message"} and no members

    def rank(self, node_id: str) -> int | None:
        return self.members.index(node_id) if node_id in self.members else None

    @property
    def world(self) -> int:
        return len(self.members) * self.nproc_per_node

    def to_json(self) -> bytes:
        return json.dumps(dataclasses.asdict(self)).encode()


@dataclasses.dataclass(frozen=True)
class Ending:
    reason: str  # FAILURES, SAVES, FINAL or "port" (process 0's port was taken: start again)
    node: str  # the node that reported it (failure, leave) or that is gone (lost)
    rank: int | None = None  # the failed process's global rank
    exit_code: int | None = None  # its return code (negative: a signal)
    code: int | None = None  # final: the exit status every launcher ends with
    revision: int = 0  # when it was written (set on reading)

    def to_json(self) -> bytes:
        fields = dataclasses.asdict(self)
        fields.pop("revision")
        return json.dumps(fields).encode()


@dataclasses.dataclass
class State:
    """One read of the run's keys."""

    revision: int
    nodes: list[Node]  # join order
    generation: Generation | None
    generation_revision: int  # the gen key's mod revision (0: none yet)
    endings: dict[int, Ending]

    def node_ids(self) -> list[str]:
        return [n.id for n in self.nodes]

    def candidates(self) -> list[Node]:
        """The registered nodes a next generation may count on: all but one that reported leaving
        the last generation and is still registered under the key it left with (it deletes the
        key as it exits; counted in between, a generation was once proposed with it, recording a
        "leave" change the run never made). A later registration of that node counts again."""
        ending = self.endings.get(self.generation.number) if self.generation is not None else None
        if ending is None or ending.reason != "leave":
            return list(self.nodes)
        return [n for n in self.nodes if not (n.id == ending.node and n.revision < ending.revision)]


def _json(kv: KeyValue) -> dict | None:
    try:
        value = json.loads(kv.value)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def _generation(value: dict) -> Generation | None:
    try:
        gen = Generation(
            number=int(value["number"]),
            members=tuple(str(m) for m in value["members"]),
            coordinator=str(value["coordinator"]),
            nproc_per_node=int(value["nproc_per_node"]),
            restarts=int(value["restarts"]),
            change=dict(value.get("change") or {}),
            fingerprint=str(value.get("fingerprint", "")),
            stop=dict(value["stop"]) if value.get("stop") else None,
        )
    except (KeyError, TypeError, ValueError):
        return None
    return gen if gen.number >= 1 else None


def _ending(value: dict, revision: int) -> Ending | None:
    try:
        return Ending(
            reason=str(value["reason"]),
            node=str(value.get("node", "")),
            rank=None if value.get("rank") is None else int(value["rank"]),
            exit_code=None if value.get("exit_code") is None else int(value["exit_code"]),
            code=None if value.get("code") is None else int(value["code"]),
            revision=revision,
        )
    except (KeyError, TypeError, ValueError):
        return None


def read_state(etcd: Etcd, run_id: str) -> State:
    """Every key of the run in one range request (raises ``EtcdUnavailable``). A value that
    is not what a launcher writes is ignored (etcd is shared: see the trust note)."""
    base = prefix(run_id)
    revision, kvs = etcd.range(base)
    nodes, generation, gen_revision, endings = [], None, 0, {}
    for kv in kvs:
        name = kv.key[len(base) :]
        value = _json(kv)
        if value is None:
            continue
        if name.startswith("nodes/"):
            try:
                node = Node(name[len("nodes/") :], str(value["address"]), int(value["stopped"]), kv.create_revision)
                nodes.append(dataclasses.replace(node, fingerprint=str(value.get("fingerprint", ""))))
            except (KeyError, TypeError, ValueError):
                continue
        elif name == "gen":
            generation, gen_revision = _generation(value), kv.mod_revision
        elif name.startswith("end/") and name[4:].isdigit() and (ending := _ending(value, kv.create_revision)):
            endings[int(name[4:])] = ending
    nodes.sort(key=lambda n: n.revision)
    return State(revision, nodes, generation, gen_revision, endings)


def propose(etcd: Etcd, run_id: str, state: State, generation: Generation) -> bool:
    """Write the next generation unless someone changed ``gen`` since ``state`` was read."""
    written, _ = etcd.replace(prefix(run_id) + "gen", generation.to_json(), state.generation_revision)
    return written > 0


def end_generation(etcd: Etcd, run_id: str, number: int, ending: Ending) -> Ending:
    """Report why generation ``number`` ended; the report that counts (the first one)."""
    written, current = etcd.create(f"{prefix(run_id)}end/{number}", ending.to_json())
    if written or current is None:
        return dataclasses.replace(ending, revision=written)
    value = _json(current)
    return (_ending(value, current.create_revision) if value else None) or ending


# --- decisions (pure) ---


def agreed_fingerprint(state: State) -> str | None:
    """The training arguments every launcher of the run must have (their fingerprint): those
    of the generation that runs (not ended, a live member still running it), else those of
    the node that registered first; None when no node is there. A launcher with others does
    not join. (A generation left behind by launchers that were all killed does not count: a
    node registered since, even under a member's id, has not run it.)"""
    gen = state.generation
    running = {n.id for n in state.nodes if gen is not None and n.stopped < gen.number}
    if gen is not None and gen.stop is None and gen.number not in state.endings and running & set(gen.members):
        return gen.fingerprint
    return state.nodes[0].fingerprint if state.nodes else None


def busy_nodes(state: State, number: int) -> list[Node]:
    """Live nodes that may still run processes of a generation before ``number``."""
    return [n for n in state.nodes if n.stopped < number - 1]


def lost_members(state: State, generation: Generation) -> list[str]:
    """Members of ``generation`` without a key now (their lease expired, or it was revoked)."""
    live = set(state.node_ids())
    return [m for m in generation.members if m not in live]


def joiners(state: State, generation: Generation) -> list[Node]:
    """Live nodes outside ``generation`` that are free to join the next one (join order)."""
    return [n for n in state.nodes if n.id not in generation.members and n.stopped >= generation.number]


class Settle:
    """How long a set of node ids has stayed the same (the settle window before a change)."""

    def __init__(self):
        self.ids: tuple[str, ...] | None = None
        self.since = 0.0

    def stable_for(self, ids: list[str], now: float) -> float:
        if tuple(ids) != self.ids:
            self.ids, self.since = tuple(ids), now
        return now - self.since


class Registration:
    """This node's key on a lease that a daemon thread renews every third of its TTL.

    While etcd does not answer the thread retries (one line when it goes, one when it is
    back); a lease that expired meanwhile is granted again and the key written again, with
    the same value, so that the other members see the node back before they count it lost.
    """

    def __init__(self, etcd: Etcd, run_id: str, node_id: str, address: str, ttl_s: int = LEASE_TTL_S, fingerprint: str = ""):
        self.etcd, self.key, self.address, self.ttl_s = etcd, f"{prefix(run_id)}nodes/{node_id}", address, ttl_s
        self.fingerprint = fingerprint
        self.lock = threading.Lock()
        self.lease = 0
        self.stopped = 0
        self.joined_revision = 0  # the revision of the first registration: older endings are not ours
        self.pending = False  # a value that could not be written yet
        self.unreachable: str | None = None  # why etcd is not answering, while it is not
        self.done = threading.Event()
        self.thread: threading.Thread | None = None

    def _value(self) -> bytes:
        return json.dumps({"address": self.address, "stopped": self.stopped, "fingerprint": self.fingerprint}).encode()

    def join(self, stopped: int) -> None:
        """Register (raises ``EtcdUnavailable`` / ``EtcdError`` when etcd cannot be used)."""
        self.stopped = stopped
        self.lease = self.etcd.grant(self.ttl_s)
        self.joined_revision = self.etcd.put(self.key, self._value(), self.lease)
        self.thread = threading.Thread(target=self._keep_alive, name="jaxdist-etcd-lease", daemon=True)
        self.thread.start()

    def set_stopped(self, number: int) -> bool:
        """Say that no process of generation ``number`` (or before) runs here; False while
        etcd cannot be written (``flush`` tries again)."""
        self.stopped = max(self.stopped, number)
        self.pending = True
        return self.flush()

    def flush(self) -> bool:
        if not self.pending:
            return True
        with self.lock:
            try:
                self.etcd.put(self.key, self._value(), self.lease)
            except (EtcdUnavailable, EtcdError):
                return False  # the lease thread registers the node again once etcd answers
            self.pending = False
            return True

    def _keep_alive(self) -> None:
        wait = self.ttl_s / 3
        while not self.done.wait(wait):
            with self.lock:
                try:
                    if self.etcd.keepalive(self.lease) <= 0:  # expired while etcd was away: register again
                        self.lease = self.etcd.grant(self.ttl_s)
                        self.etcd.put(self.key, self._value(), self.lease)
                        self.pending = False
                        log.info(f"the etcd lease of this node expired while etcd was away; registered again ({self.key})")
                    if self.unreachable is not None:
                        log.info(f"etcd answers again ({self.etcd.answering()})")
                        self.unreachable = None
                    wait = self.ttl_s / 3
                except (EtcdUnavailable, EtcdError) as e:
                    if self.unreachable is None:
                        log.info(f"etcd does not answer ({e}); the running processes go on, retrying every {RETRY_S:g}s")
                    self.unreachable = str(e)
                    wait = RETRY_S

    def leave(self) -> None:
        """Stop renewing and delete the key now (best effort: else it expires)."""
        self.done.set()
        if self.thread is not None:
            self.thread.join(timeout=self.etcd.timeout_s + 1)
        if not self.lease:
            return
        with contextlib.suppress(EtcdUnavailable, EtcdError):
            self.etcd.revoke(self.lease)
