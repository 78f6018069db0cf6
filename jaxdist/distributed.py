"""Joining a multi-process run: ``jax.distributed.initialize`` when the environment asks.

Explicit (``--coordinator HOST:PORT --num-processes N --process-id I``, or the
``JAXDIST_COORDINATOR`` / ``JAXDIST_NUM_PROCESSES`` / ``JAXDIST_PROCESS_ID`` variables
that ``jaxdist.launch`` sets) or detected by JAX itself on SLURM, Open MPI and
Kubernetes. A single process needs nothing. On CPU the processes talk through gloo.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import time

from jaxdist.errors import JaxdistError

ENV_COORDINATOR = "JAXDIST_COORDINATOR"
ENV_NUM_PROCESSES = "JAXDIST_NUM_PROCESSES"
ENV_PROCESS_ID = "JAXDIST_PROCESS_ID"


@dataclasses.dataclass(frozen=True)
class ProcessGroup:
    coordinator: str | None  # None: let JAX detect the cluster (SLURM, Open MPI, Kubernetes)
    num_processes: int | None
    process_id: int | None
    timeout_s: int = 300


def _cluster_detected() -> bool:
    """A multi-process launch by a scheduler whose environment JAX can read."""
    env = os.environ
    if int(env.get("SLURM_NTASKS", "1") or 1) > 1 and "SLURM_STEP_NODELIST" in env:
        return True
    if int(env.get("OMPI_COMM_WORLD_SIZE", "1") or 1) > 1:
        return True
    return "JOBSET_NAME" in env and "KUBERNETES_SERVICE_HOST" in env


def process_group_from(args) -> ProcessGroup | None:
    """Flags first, then jaxdist's environment variables, then cluster detection."""
    env = os.environ
    coordinator = args.coordinator or env.get(ENV_COORDINATOR)
    num = args.num_processes if args.num_processes is not None else env.get(ENV_NUM_PROCESSES)
    pid = args.process_id if args.process_id is not None else env.get(ENV_PROCESS_ID)
    timeout = args.dist_timeout
    if coordinator or num is not None or pid is not None:
        if not (coordinator and num is not None and pid is not None):
            raise JaxdistError("a multi-process run needs all of --coordinator HOST:PORT, --num-processes N and --process-id I")
        if ":" not in coordinator:
            raise JaxdistError(f"--coordinator {coordinator!r}: expected HOST:PORT")
        num, pid = int(num), int(pid)
        if num < 1 or not 0 <= pid < num:
            raise JaxdistError(f"--process-id {pid} must be in [0, --num-processes {num})")
        return ProcessGroup(coordinator, num, pid, timeout) if num > 1 else None
    if _cluster_detected():
        return ProcessGroup(None, None, None, timeout)
    return None


def wait_for_coordinator(address: str, timeout_s: float) -> bool:
    """Poll until the coordinator accepts TCP connections (True) or time runs out."""
    host, port = address.rsplit(":", 1)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host, int(port)), timeout=1.0):
                return True
        except OSError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.2)


def initialize(group: ProcessGroup | None) -> None:
    """Join the process group (call before anything asks JAX for devices)."""
    if group is None:
        return
    import jax

    # JAX aborts the process (no exception) when the coordinator never answers, so the
    # other ranks first check that it is reachable and fail with one line if not.
    if group.coordinator and group.process_id and not wait_for_coordinator(group.coordinator, group.timeout_s):
        raise JaxdistError(
            f"process {group.process_id} of {group.num_processes} could not join the run at {group.coordinator} "
            f"within {group.timeout_s}s (nothing listens there; is process 0 running?)"
        )

    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU collectives across processes
    where = group.coordinator or "the cluster's coordinator"
    try:
        jax.distributed.initialize(
            coordinator_address=group.coordinator,
            num_processes=group.num_processes,
            process_id=group.process_id,
            initialization_timeout=group.timeout_s,
        )
    except Exception as e:  # noqa: BLE001 - a connection failure surfaces as various runtime errors
        who = f"process {group.process_id} of {group.num_processes}" if group.num_processes else "this process"
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
        raise JaxdistError(f"{who} could not join the run at {where} within {group.timeout_s}s ({reason})") from None
