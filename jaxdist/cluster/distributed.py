"""Joining a multi-process run: ``jax.distributed.initialize`` when the environment asks.

Explicit (``--coordinator HOST:PORT --num-processes N --process-id I``, or the
``JAXDIST_COORDINATOR`` / ``JAXDIST_NUM_PROCESSES`` / ``JAXDIST_PROCESS_ID`` variables
that ``jaxdist.launch`` sets) or detected by JAX itself on SLURM, Open MPI and
Kubernetes. A single process needs nothing. On CPU the processes talk through gloo.
Under SLURM and Open MPI the process count and rank come from the scheduler's variables
before JAX starts, so that each process asks for its share of the fake CPU devices.

Process 0 runs JAX's coordination service, which authenticates nobody: whoever reaches
its port can join the run, read or write the key-value store the collectives use, or
shut the run down. So it listens on one address only, never on every interface as JAX
would: ``--coordinator-bind ADDRESS`` (or ``JAXDIST_COORDINATOR_BIND``; the launcher sets
127.0.0.1), else the address the coordinator's host name resolves to on process 0 (the
node's cluster-internal address). ``0.0.0.0`` or ``::`` asks for every interface.
"""

from __future__ import annotations

import dataclasses
import errno
import ipaddress
import logging
import os
import re
import socket
import time

import jaxdist
from jaxdist.cluster import recoverable
from jaxdist.cluster.cache_key import share_cpu_cache_keys
from jaxdist.errors import JaxdistError
from jaxdist.layout.native_output import filter_descriptor

ENV_COORDINATOR = "JAXDIST_COORDINATOR"
ENV_COORDINATOR_BIND = "JAXDIST_COORDINATOR_BIND"
ENV_NUM_PROCESSES = "JAXDIST_NUM_PROCESSES"
ENV_PROCESS_ID = "JAXDIST_PROCESS_ID"
EXIT_PORT_TAKEN = 76  # process 0 found the coordinator's port taken: nothing ran; the launcher retries on another port
ENV_OUTPUT_FILTERED = "JAXDIST_OUTPUT_FILTERED"  # set by jaxdist.launch, which drops gloo's lines from its processes' output

# gloo (inside jaxlib) prints this with std::cout each time it connects a group of CPU processes
# (gloo/transport/tcp/context.cc, printConnectivityInfo): a few lines per process at start,
# unconditionally (no flag or variable turns it off). When some peer is missing it says so
# in a second line ("... is NOT connected to: [...]"), which is never hidden.
GLOO_CONNECTED = re.compile(r"\[Gloo\] Rank \d+ is connected to (\d+) peer ranks\. Expected number of connected peer ranks is : (\d+)\s*")

log = logging.getLogger(__name__)


# The fixed parts of that line, between which gloo writes the numbers (one operator<< each).
GLOO_PARTS = re.compile(r"\[Gloo\] Rank|is connected to|peer ranks\.|Expected number of connected peer ranks is :")


def is_gloo_chatter(line: str) -> bool:
    """gloo's line for a group of processes that connected completely (nothing to act on)."""
    match = GLOO_CONNECTED.fullmatch(line)
    return match is not None and match[1] == match[2]


class GlooChatter:
    """``is_gloo_chatter`` for one process's output, line by line. Two of its threads (one per
    local device of a group) may print at once, and std::cout then interleaves their lines at
    any of gloo's ``<<`` (``[Gloo] Rank [Gloo] Rank 0 is connected to 1 ...: 1`` and a next
    line ``1 is connected to ...``). A line made of nothing but those lines' parts and numbers,
    and a line of numbers alone right after one, is chatter too: which number belongs to which
    message cannot be told there, and a missing peer is said in gloo's own next line (``is NOT
    connected to``), which is never hidden."""

    def __init__(self):
        self.mixed = False  # the last line was an interleaving of gloo's lines

    def __call__(self, line: str) -> bool:
        if GLOO_CONNECTED.fullmatch(line):
            self.mixed = False
            return is_gloo_chatter(line)
        rest = GLOO_PARTS.sub(" ", line).split()
        parts = len(GLOO_PARTS.findall(line))
        was_mixed, self.mixed = self.mixed, parts > 0 and all(token.isdigit() for token in rest)
        return self.mixed or (was_mixed and bool(rest) and all(token.isdigit() for token in rest))


def hide_gloo_lines(log_level: str, group: ProcessGroup | None) -> None:
    """Keep gloo's connection lines out of this process's stdout unless ``log_level`` is
    debug: in a multi-process run not started by ``jaxdist.launch`` (SLURM, Kubernetes,
    explicit flags; the launcher filters its processes' output itself). gloo writes them
    from C++, so Python cannot intercept them: file descriptor 1 becomes a pipe that a
    daemon thread copies line by line to the real stdout, dropping those lines. At exit
    what is left in the pipe is copied (up to a second) and stdout restored."""
    if group is None or log_level == "debug" or os.environ.get(ENV_OUTPUT_FILTERED):
        return
    filter_descriptor(1, GlooChatter)


class CoordinatorPortTaken(JaxdistError):
    """The coordinator's address:port is in use by another program (one line, exit 76)."""

    exit_code = EXIT_PORT_TAKEN


@dataclasses.dataclass(frozen=True)
class ProcessGroup:
    coordinator: str | None  # None: let JAX detect the cluster (SLURM, Open MPI, Kubernetes)
    num_processes: int | None
    process_id: int | None
    timeout_s: int = 300
    bind: str | None = None  # the address process 0's coordinator listens on (None: its host's address)


def _cluster_detected() -> bool:
    """A multi-process launch by a scheduler whose environment JAX can read."""
    env = os.environ
    if int(env.get("SLURM_NTASKS", "1") or 1) > 1 and "SLURM_STEP_NODELIST" in env:
        return True
    if int(env.get("OMPI_COMM_WORLD_SIZE", "1") or 1) > 1:
        return True
    return "JOBSET_NAME" in env and "KUBERNETES_SERVICE_HOST" in env


def _scheduler_ranks() -> tuple[int | None, int | None]:
    """(process count, this process's rank) from SLURM's or Open MPI's environment, the
    variables JAX's detection reads, known before JAX starts: the fake CPU devices are split
    by them (None, None where only JAX can tell, as on Kubernetes)."""
    env = os.environ
    for count, rank in (("SLURM_NTASKS", "SLURM_PROCID"), ("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK")):
        if int(env.get(count, "1") or 1) > 1 and rank in env:
            num, pid = int(env[count]), int(env[rank])
            if not 0 <= pid < num:
                raise JaxdistError(f"{rank}={pid} is not in [0, {count}={num})")
            return num, pid
    return None, None


def _slurm_local_devices(jax_choice: list[int] | None) -> list[int] | None:
    """The GPUs a SLURM task drives. JAX gives each task one, number SLURM_LOCALID: right
    with one task per GPU, but a task alone on its node (the template's one task per node)
    would drive 1 of its 8 GPUs, and a task SLURM bound its own GPUs to (--gpus-per-task)
    may not have that number. Those drive every GPU they see (None)."""
    env = os.environ
    if "SLURM_STEP_NODELIST" not in env or jax_choice is None:
        return jax_choice
    tasks_here = _slurm_tasks_on_this_node()
    if tasks_here == 1 or env.get("SLURM_GPUS_PER_TASK"):
        return None
    return jax_choice


def _slurm_tasks_on_this_node() -> int | None:
    """SLURM's task count on this node: SLURM_STEP_TASKS_PER_NODE (e.g. ``4(x2),1``) at SLURM_NODEID."""
    spec, node = os.environ.get("SLURM_STEP_TASKS_PER_NODE", ""), os.environ.get("SLURM_NODEID", "")
    counts: list[int] = []
    for part in spec.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if match is None:
            return None
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts[int(node)] if node.isdigit() and int(node) < len(counts) else None


def check_bind_host(host: str) -> str:
    """A --coordinator-bind value: a host name or an IP address, without a port."""
    bare = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        ipaddress.ip_address(bare)
        return bare
    except ValueError:
        pass
    if not bare or ":" in bare or any(c.isspace() for c in bare):
        raise JaxdistError(f"--coordinator-bind {host!r}: expected an address or host name of this machine, without a port")
    return bare


def process_group_from(args) -> ProcessGroup | None:
    """Flags first, then jaxdist's environment variables, then cluster detection."""
    env = os.environ
    coordinator = args.coordinator or env.get(ENV_COORDINATOR)
    num = args.num_processes if args.num_processes is not None else env.get(ENV_NUM_PROCESSES)
    pid = args.process_id if args.process_id is not None else env.get(ENV_PROCESS_ID)
    bind = getattr(args, "coordinator_bind", None) or env.get(ENV_COORDINATOR_BIND) or None
    bind = check_bind_host(bind) if bind is not None else None
    timeout = args.dist_timeout
    if coordinator or num is not None or pid is not None:
        if not (coordinator and num is not None and pid is not None):
            raise JaxdistError("a multi-process run needs all of --coordinator HOST:PORT, --num-processes N and --process-id I")
        if ":" not in coordinator:
            raise JaxdistError(f"--coordinator {coordinator!r}: expected HOST:PORT")
        num, pid = int(num), int(pid)
        if num < 1 or not 0 <= pid < num:
            raise JaxdistError(f"--process-id {pid} must be in [0, --num-processes {num})")
        return ProcessGroup(coordinator, num, pid, timeout, bind) if num > 1 else None
    if _cluster_detected():
        num, pid = _scheduler_ranks()
        return ProcessGroup(None, num, pid, timeout, bind)
    return None


def wait_for_coordinator(address: str, timeout_s: float) -> bool:
    """Poll until the coordinator accepts TCP connections (True) or time runs out."""
    host, port = address.rsplit(":", 1)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=1.0):
                return True
        except OSError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.2)


def _detected(group: ProcessGroup) -> tuple[ProcessGroup, list[int] | None]:
    """The coordinator address, process count, rank and local devices JAX would detect
    (SLURM, Open MPI, Kubernetes), so that process 0 knows where its coordinator listens."""
    # JAX's own detection (jax.distributed.initialize calls the same); imported here because the
    # launcher imports this module and never starts JAX
    from jax._src import clusters

    coordinator, num, pid, local = clusters.ClusterEnv.auto_detect_unset_distributed_params(
        None, group.num_processes, group.process_id, None, None, group.timeout_s
    )
    if coordinator is None or num is None or pid is None:
        raise JaxdistError(
            "JAX found no coordinator in this cluster's environment: pass --coordinator HOST:PORT, --num-processes, --process-id"
        )
    group = dataclasses.replace(group, coordinator=coordinator, num_processes=int(num), process_id=int(pid))
    return group, _slurm_local_devices(list(local) if local is not None else None)


def bind_address(group: ProcessGroup) -> str:
    """``ADDRESS:PORT`` for process 0's coordinator, checked free on this machine; raises
    ``CoordinatorPortTaken`` when another program holds the port, ``JaxdistError`` when the
    address is not one of this machine's."""
    host, port = group.coordinator.rsplit(":", 1)
    host, port = host.strip("[]"), int(port)
    chosen = group.bind or host
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(chosen, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as e:
        raise JaxdistError(
            f"coordinator address {chosen!r} does not resolve here ({e.strerror}); pass --coordinator-bind ADDRESS"
        ) from None
    address = sockaddr[0]
    flag = "--coordinator-bind" if group.bind else f"--coordinator {group.coordinator}"
    if ipaddress.ip_address(address).is_loopback and not _is_loopback_name(chosen) and not _one_slurm_node():
        log.warning(
            f"{flag}: {chosen} is {address} (loopback) on this machine: processes on other machines "
            "cannot reach it; pass --coordinator-bind with this node's cluster address"
        )
    _check_port_free(family, address, port, flag)
    return f"[{address}]:{port}" if family == socket.AF_INET6 else f"{address}:{port}"


def _one_slurm_node() -> bool:
    """A SLURM step on one node: its processes reach a loopback coordinator."""
    return os.environ.get("SLURM_STEP_NUM_NODES") == "1" and "SLURM_STEP_NODELIST" in os.environ


def _is_loopback_name(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost" or host.endswith(".localhost")


def _check_port_free(family: int, address: str, port: int, flag: str) -> None:
    """Nothing listens on ADDRESS:PORT and it can be bound (sharing it, as gRPC does, with
    the launcher's reservation of the port). A small window stays open until JAX binds."""
    probe_host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(address, address)
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.settimeout(1.0)
        listening = sock.connect_ex((probe_host, port)) == 0
    if listening:
        raise CoordinatorPortTaken(f"coordinator port {port} on {address} is taken: another program listens there ({flag})")
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        try:
            sock.bind((address, port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise CoordinatorPortTaken(f"coordinator port {port} on {address} is taken ({flag})") from None
            raise JaxdistError(
                f"the coordinator cannot listen on {address}:{port} ({e.strerror}); pass --coordinator-bind ADDRESS"
            ) from None


def initialize(group: ProcessGroup | None) -> None:
    """Join the process group (call before anything asks JAX for devices)."""
    if group is None:
        return
    import jax  # here, not at the top: the launcher imports this module and never starts JAX

    # JAX aborts the process (no exception) when the coordinator never answers, so the
    # other ranks first check that it is reachable and fail with one line if not.
    if group.coordinator and group.process_id and not wait_for_coordinator(group.coordinator, group.timeout_s):
        raise JaxdistError(
            f"process {group.process_id} of {group.num_processes} could not join the run at {group.coordinator} "
            f"within {group.timeout_s}s (nothing listens there; is process 0 running?)"
        )
    local_devices = None
    if group.coordinator is None:
        try:
            group, local_devices = _detected(group)
        except (ImportError, AttributeError, TypeError) as e:  # JAX moved its private detection: let it detect alone
            log.warning(
                f"cannot ask JAX for the cluster's coordinator ahead ({type(e).__name__}); "
                "process 0's coordinator listens on every interface: pass --coordinator HOST:PORT to choose one"
            )
    # JAX would listen on every interface ([::]) and crashes (SIGSEGV) when a given address is
    # taken, so process 0 picks the address and checks the port first.
    bind = bind_address(group) if group.coordinator and group.process_id == 0 else None

    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU collectives across processes
    recovery = {}
    if recoverable.in_process_recovery():  # a dead peer leaves the others running (jaxdist.launch --recovery in-process)
        recoverable.enable()
        recovery = {"heartbeat_timeout_seconds": recoverable.peer_timeout_s()}
    try:
        jax.distributed.initialize(
            coordinator_address=group.coordinator,
            num_processes=group.num_processes,
            process_id=group.process_id,
            local_device_ids=local_devices,
            initialization_timeout=group.timeout_s,
            coordinator_bind_address=bind,
            **recovery,
        )
    except Exception as e:  # noqa: BLE001 - a connection failure surfaces as various runtime errors
        who = f"process {group.process_id} of {group.num_processes}" if group.num_processes else "this process"
        where = group.coordinator or "the cluster's coordinator"
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
        if "Failed to start RPC server" in reason:  # the port was taken after the check
            raise CoordinatorPortTaken(f"coordinator port of {group.coordinator} was taken before it could listen ({reason})") from None
        raise JaxdistError(f"{who} could not join the run at {where} within {group.timeout_s}s ({reason})") from None
    jaxdist.set_process_index(jax.process_index())  # from here on only process 0 speaks (but for every_process lines)
    share_cpu_cache_keys()  # CPU processes find each other's compiled programs (process 0 writes them)
