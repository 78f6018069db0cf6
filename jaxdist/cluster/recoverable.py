"""What in-process recovery relies on inside JAX (and Orbax), in one place, and the run's live membership.

``jaxdist.launch --recovery in-process`` sets ``JAXDIST_RECOVERY=in-process`` for its
processes. They then join with JAX's experimental recoverable tasks
(``jax_enable_recoverability``: the coordination service keeps running when a task dies)
and a short heartbeat, run each step inside ``jax.experimental.multihost_utils.live_devices``
(every survivor learns of a death in the same step), and, after a death, meet and exchange
small values through the coordination service's client (``jax._src.distributed``: its
barriers take the processes that must meet, and its key-value store needs no device).

These are experimental or private names (jax 0.10): ``check_jax_pieces`` names what is
missing, and ``tests/test_recovery.py`` calls it, so a JAX upgrade that moves them fails
loudly there instead of in a recovery.

After a recovery the set of live processes is smaller than JAX's ``process_count()``: the
helpers here (``allgather``, ``sync``) gather and meet over the live processes only, where
``multihost_utils.process_allgather`` would wait for the dead one.

A replacement process (``JAXDIST_REJOIN=1``, started by the launcher in the dead one's slot)
connects again under the same process index. Two things inside JAX shape how it rejoins:

- ``live_devices`` is a barrier over every *connected* process, so the replacement must not
  connect before the survivors have finished recovering (``open_slot``: the launcher starts it
  then), and must enter ``live_devices`` at once after connecting (``announce``): until it does,
  the survivors' next step waits for it.
- XLA:CPU keys its gloo communicators by the ordered device ids of a group
  (``gloo/0,2048,4096``), caches them for the process's life and writes their rendezvous keys
  once: a group with the replacement that repeats one the dead process was in would reuse a
  broken communicator (survivors) or collide with its keys (``ALREADY_EXISTS``, the
  replacement). ``fresh_device_order`` orders the grown mesh's devices so that every group
  with a replacement in it is new.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections import Counter
from collections.abc import Iterator, Sequence

import numpy as np

from jaxdist.cluster.heartbeat import ENV_DIR, ENV_RANK, fault_point  # ENV_DIR: the launcher's folder for this set

ENV_RECOVERY = "JAXDIST_RECOVERY"  # set by jaxdist.launch --recovery in-process
ENV_PEER_TIMEOUT = "JAXDIST_PEER_TIMEOUT"  # seconds: the coordination service's heartbeat timeout
ENV_REJOIN = "JAXDIST_REJOIN"  # set by the launcher for a replacement of a process the others recovered from
KV_TIMEOUT_MS = 120_000  # a survivor that never reaches an exchange: fail, not wait for good


def in_process_recovery() -> bool:
    return os.environ.get(ENV_RECOVERY) == "in-process"


def rejoining() -> bool:
    return in_process_recovery() and os.environ.get(ENV_REJOIN) == "1"


def open_slot_path(directory: str | os.PathLike, rank: int) -> str:
    return os.path.join(directory, f"open-{rank}")


def open_slot(rank: int) -> None:
    """Process 0, once the survivors of ``rank``'s death have recovered: the launcher may start
    its replacement now (connecting earlier would hold the survivors' recovery, see above)."""
    directory = os.environ.get(ENV_DIR)
    if directory:
        with open(open_slot_path(directory, rank), "w") as f:
            f.write("open\n")


def recovering_path(directory: str | os.PathLike, rank: int) -> str:
    return os.path.join(directory, f"recovering-{rank}")


def mark_recovering(step: int) -> None:
    """This survivor has entered the recovery of a death in ``step`` (then the launcher's fault
    hook for that phase): the launcher waits for it, or a later step, before it takes the
    survivors for stuck off a step boundary (``jaxdist.cluster.elastic_launch``)."""
    directory = os.environ.get(ENV_DIR)
    if directory:
        with open(recovering_path(directory, int(os.environ.get(ENV_RANK, "0") or 0)), "w") as f:
            f.write(f"{step}\n")
    fault_point("recovery", step)


def peer_timeout_s() -> int:
    return max(1, int(float(os.environ.get(ENV_PEER_TIMEOUT, "10") or 10)))


def check_jax_pieces() -> list[str]:
    """The experimental and private JAX names in-process recovery uses that this JAX lacks."""
    import jax
    from jax._src import distributed
    from jax.experimental import multihost_utils

    missing = []
    if not hasattr(multihost_utils, "live_devices") or not hasattr(multihost_utils, "ProcessFailureError"):
        missing.append("jax.experimental.multihost_utils.live_devices / ProcessFailureError")
    try:
        jax.config.jax_enable_recoverability  # noqa: B018 - the option must exist
    except AttributeError:
        missing.append("the jax_enable_recoverability option")
    if not hasattr(distributed, "global_state"):
        missing.append("jax._src.distributed.global_state")
    client_methods = ("get_live_nodes", "wait_at_barrier", "key_value_set_bytes", "blocking_key_value_get_bytes", "key_value_delete")
    from jax._src.lib import _jax

    client_type = getattr(_jax, "DistributedRuntimeClient", None)
    for method in client_methods:
        if client_type is None or not hasattr(client_type, method):
            missing.append(f"the distributed runtime client's {method}")
    try:
        from orbax.checkpoint._src.futures import synchronization

        generator = synchronization.OperationIdGenerator
        if not hasattr(generator, "_operation_id_counter") or not hasattr(generator, "get_current_operation_id"):
            missing.append("orbax's OperationIdGenerator counter")
    except ImportError:
        missing.append("orbax.checkpoint._src.futures.synchronization")
    return missing


def enable() -> None:
    """Before ``jax.distributed.initialize``: a dead task leaves the service running."""
    import jax

    missing = check_jax_pieces()
    if missing:
        from jaxdist.errors import JaxdistError

        raise JaxdistError(f"--recovery in-process needs JAX's recoverable tasks; this JAX ({jax.__version__}) lacks {'; '.join(missing)}")
    jax.config.update("jax_enable_recoverability", True)


def _client():
    from jax._src import distributed

    client = distributed.global_state.client
    if client is None:
        raise RuntimeError("the distributed runtime is not initialised")
    return client


@contextlib.contextmanager
def live_devices(devices: Sequence) -> Iterator[list]:
    """``multihost_utils.live_devices``: every live process leaves the block the same way."""
    from jax.experimental import multihost_utils

    with multihost_utils.live_devices(list(devices)) as live:
        yield live


def is_process_failure(error: BaseException) -> bool:
    from jax.experimental import multihost_utils

    return isinstance(error, multihost_utils.ProcessFailureError)


# What a collective or a coordination-service call says when the process at its other end is
# gone (gloo on CPU, NCCL on GPU, the coordination service's RPCs): a peer's death seen outside
# ``live_devices``, where JAX raises a plain runtime error rather than ProcessFailureError, and
# Orbax re-raises that error's text as a ValueError. Both start with the runtime's status code.
PEER_GONE_MARKS = ("Gloo", "gloo", "NCCL", "Connection closed", "Connection reset", "Broken pipe", "UNAVAILABLE", "DEADLINE_EXCEEDED")
_SOURCE_LOCATION = re.compile(r" ?\[[^\]]*\.(cc|h):\d+\]")  # "[external/gloo/.../pair.cc:538]"
_STATUS_CODE = re.compile(r"^(UNKNOWN|UNAVAILABLE|INTERNAL|DEADLINE_EXCEEDED|ABORTED|CANCELLED|FAILED_PRECONDITION): ")


def is_peer_failure(error: BaseException) -> bool:
    """``error``, or what it was raised from, is JAX's word that a peer process is gone."""
    return peer_failure_text(error) is not None


def peer_failure_text(error: BaseException) -> str | None:
    """The first line of JAX's word that a peer is gone in ``error``'s chain, without the C++
    source locations; None when the chain holds none."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        text = (str(error).strip().splitlines() or [""])[0]
        if is_process_failure(error) or (_STATUS_CODE.match(text) and any(mark in text for mark in PEER_GONE_MARKS)):
            return _SOURCE_LOCATION.sub("", text) or type(error).__name__
        error = error.__cause__ or error.__context__
    return None


_ABANDONED: list = []  # the JAX client and service left without a shutdown: kept referenced, never destroyed


def abandon_jax_shutdown() -> None:
    """Make JAX's exit-time shutdown a no-op in a process leaving after a peer's death: the
    client's ShutdownTask RPC fails there and the client aborts the process with a C++ check
    failure (seen with jax 0.10). The caller then exits with ``os._exit`` (no destructors)."""
    from jax._src import distributed

    state = distributed.global_state
    _ABANDONED.extend(x for x in (state.preemption_sync_manager, state.client, state.service) if x is not None)
    state.preemption_sync_manager = state.client = state.service = None


class Membership:
    """The processes that take part now: all of JAX's until a recovery shrinks the set."""

    def __init__(self):
        self.processes: list[int] | None = None  # None: every process, as JAX started them (no membership change yet)
        self.epoch = 0  # membership changes so far: names each exchange's keys and barriers
        self.calls: Counter[str] = Counter()  # every live process makes the same calls in the same order
        self.mesh_spec: str | None = None  # the run's --mesh as given (a -1 axis): sized again to the survivors
        self.groups: set[tuple[int, ...]] = set()  # every device group a mesh of this run has had (see fresh_device_order)
        self.rejoined: set[int] = set()  # processes that were replaced and rejoined: their old groups are stale

    @property
    def changed(self) -> bool:
        """A process died or rejoined: JAX's own multi-process helpers no longer fit (they use
        every process, over a device group that may be stale)."""
        return self.processes is not None

    def live_processes(self) -> list[int]:
        import jax

        return list(range(jax.process_count())) if self.processes is None else list(self.processes)

    def shrink_to(self, processes: Sequence[int]) -> None:
        self.change_to(processes, self.epoch + 1)

    def change_to(self, processes: Sequence[int], epoch: int) -> None:
        """The live processes from now on; every one of them passes the same ``epoch``."""
        self.processes, self.epoch, self.calls = sorted(processes), epoch, Counter()

    def use_mesh(self, mesh) -> None:
        """Remember ``mesh``'s device groups (a process that rejoins must be in none of them again)."""
        self.groups |= device_groups(mesh.devices)

    def sync(self, name: str, timeout_s: float = KV_TIMEOUT_MS / 1000) -> None:
        """A barrier over the live processes."""
        self.calls[name] += 1
        _client().wait_at_barrier(f"jaxdist/{self.epoch}/{name}/{self.calls[name]}", int(timeout_s * 1000), self.live_processes())

    def allgather(self, value, name: str) -> np.ndarray:
        """``value`` (a small array) from every live process, stacked in process order,
        through the coordination service's key-value store (no device, no dead peer)."""
        import jax

        mine = np.ascontiguousarray(np.asarray(value))
        client, me = _client(), jax.process_index()
        self.calls[name] += 1
        prefix = f"jaxdist/{self.epoch}/{name}/{self.calls[name]}"  # keys are written once: a fresh one per call
        client.key_value_set_bytes(f"{prefix}/{me}", mine.tobytes())
        rows = []
        for process in self.live_processes():
            raw = mine.tobytes() if process == me else client.blocking_key_value_get_bytes(f"{prefix}/{process}", KV_TIMEOUT_MS)
            rows.append(np.frombuffer(raw, dtype=mine.dtype).reshape(mine.shape))
        return np.stack(rows)

    def leave(self, timeout_s: float = 30.0) -> None:
        """At the end of the run. Recoverable tasks are not held by JAX's shutdown barrier, and
        a process that exits after process 0 (whose coordination service it must disconnect
        from) aborts: the live processes meet here, then process 0 waits until the others are
        gone (they run on this machine: in-process recovery is for one machine), at most
        ``timeout_s``."""
        import jax
        import psutil

        pids = self.allgather(np.array([os.getpid()], np.int64), "end").ravel().tolist()
        if jax.process_index() != 0:
            return
        others = []
        for pid in pids:
            with contextlib.suppress(psutil.NoSuchProcess):
                if pid != os.getpid():
                    others.append(psutil.Process(pid))
        psutil.wait_procs(others, timeout=timeout_s)


MEMBERSHIP = Membership()


def device_groups(devices: np.ndarray) -> set[tuple[int, ...]]:
    """The ordered device-id groups a collective over any set of a mesh's axes runs on (gloo's
    communicator keys): for each subset of axes, the devices along them at each index of the rest."""
    import itertools

    ids = np.vectorize(lambda d: d.id, otypes=[np.int64])(devices) if devices.dtype == object else np.asarray(devices)
    axes = range(ids.ndim)
    groups = set()
    for k in range(1, ids.ndim + 1):
        for chosen in itertools.combinations(axes, k):
            rest = [a for a in axes if a not in chosen]
            moved = np.transpose(ids, rest + list(chosen)).reshape(-1, int(np.prod([ids.shape[a] for a in chosen])))
            groups |= {tuple(int(i) for i in row) for row in moved if len(row) > 1}
    return groups


def fresh_device_order(devices: Sequence, shape: Sequence[int], used: set[tuple[int, ...]], joined: set[int], tries: int = 2000):
    """``devices`` in an order whose mesh of ``shape`` has no group that holds a device of a
    ``joined`` process and is in ``used`` (see the module's note on gloo); deterministic. None
    when no order within ``tries`` is."""
    devices = sorted(devices, key=lambda d: d.id)
    rng = np.random.default_rng(len(used))
    for attempt in range(tries):
        order = devices[attempt:] + devices[:attempt] if attempt < len(devices) else [devices[i] for i in rng.permutation(len(devices))]
        ids = np.array([d.id for d in order]).reshape(tuple(shape))
        new = {g for g in device_groups(ids) if any(i in joined for i in g)}
        if not new & used:
            return order
    return None


def orbax_operation_id() -> int:
    """Orbax's count of this process's saves: its signals between processes (the step's folder
    is created, ...) are keyed by it, so a replacement must count on from the live processes' value."""
    from orbax.checkpoint._src.futures import synchronization

    return int(synchronization.OperationIdGenerator.get_current_operation_id())


def adopt_orbax_operation_id(value: int) -> None:
    """A replacement: Orbax's next save is the live processes' next one."""
    import itertools

    from orbax.checkpoint._src.futures import synchronization

    generator = synchronization.OperationIdGenerator
    generator._operation_id_counter = itertools.count(value + 1)
    generator._operation_id = value


def announce(all_devices: Sequence) -> list:
    """A replacement, just connected: enter the survivors' next ``live_devices`` (their step
    boundary) and leave it with them; the live devices, the replacement's among them."""
    with live_devices(all_devices) as live:
        return list(live)


def publish(key: str, value: bytes) -> None:
    _client().key_value_set_bytes(f"jaxdist/{key}", value)


def read(key: str, timeout_s: float = KV_TIMEOUT_MS / 1000) -> bytes:
    return _client().blocking_key_value_get_bytes(f"jaxdist/{key}", int(timeout_s * 1000))


def forget(key: str) -> None:
    _client().key_value_delete(f"jaxdist/{key}")


def process_allgather(value, name: str) -> np.ndarray:
    """``multihost_utils.process_allgather`` while every process lives, else over the live ones."""
    if MEMBERSHIP.changed:
        return MEMBERSHIP.allgather(value, name)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(value))


def sync_global(name: str) -> None:
    """``multihost_utils.sync_global_devices`` while every process lives, else a barrier of the live ones."""
    if MEMBERSHIP.changed:
        MEMBERSHIP.sync(name)
        return
    from jax.experimental import multihost_utils

    multihost_utils.sync_global_devices(name)
