"""What in-process recovery relies on inside JAX, in one place, and the run's live membership.

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
"""

from __future__ import annotations

import contextlib
import os
from collections import Counter
from collections.abc import Iterator, Sequence

import numpy as np

ENV_RECOVERY = "JAXDIST_RECOVERY"  # set by jaxdist.launch --recovery in-process
ENV_PEER_TIMEOUT = "JAXDIST_PEER_TIMEOUT"  # seconds: the coordination service's heartbeat timeout
KV_TIMEOUT_MS = 120_000  # a survivor that never reaches an exchange: fail, not wait for good


def in_process_recovery() -> bool:
    return os.environ.get(ENV_RECOVERY) == "in-process"


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


class Membership:
    """The processes that take part now: all of JAX's until a recovery shrinks the set."""

    def __init__(self):
        self.processes: list[int] | None = None  # None: every process (nobody was lost)
        self.epoch = 0  # recoveries so far: names each exchange's keys and barriers
        self.calls: Counter[str] = Counter()  # every live process makes the same calls in the same order
        self.mesh_spec: str | None = None  # the run's --mesh as given (a -1 axis): sized again to the survivors

    @property
    def shrunk(self) -> bool:
        return self.processes is not None

    def live_processes(self) -> list[int]:
        import jax

        return list(range(jax.process_count())) if self.processes is None else list(self.processes)

    def shrink_to(self, processes: Sequence[int]) -> None:
        self.processes, self.epoch = sorted(processes), self.epoch + 1

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


def process_allgather(value, name: str) -> np.ndarray:
    """``multihost_utils.process_allgather`` while every process lives, else over the live ones."""
    if MEMBERSHIP.shrunk:
        return MEMBERSHIP.allgather(value, name)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(value))


def sync_global(name: str) -> None:
    """``multihost_utils.sync_global_devices`` while every process lives, else a barrier of the live ones."""
    if MEMBERSHIP.shrunk:
        MEMBERSHIP.sync(name)
        return
    from jax.experimental import multihost_utils

    multihost_utils.sync_global_devices(name)
