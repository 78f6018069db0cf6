"""``python -m jaxdist.launch``: N training processes on this machine, as one run, or this
node's share of an elastic run across nodes (``--nnodes``, below).

    python -m jaxdist.launch --nproc 2 [--devices-per-proc 4] -- --mesh data=2,fsdp=4 --steps 20

Each process joins through a coordinator that listens on 127.0.0.1 only, on a free port
the launcher holds for the run (gloo collectives on CPU fake devices); every output line
is prefixed with its rank; SIGINT / SIGTERM are forwarded; when one process fails the
others are stopped and the launcher exits with the first failure's code. A process that
exits 75 has saved its part of a checkpoint: nobody is signalled, the others get 120 s
to finish theirs, then the launcher exits 75. When process 0 finds the
coordinator's port taken (exit 76, nothing ran) the set starts again on another port,
not counted as a failure. Every process the run starts (trainers, their Grain workers)
dies within a second of the launcher, even when it is killed with SIGKILL. gloo's
"[Gloo] Rank N is connected to M peer ranks" lines (printed by jaxlib's gloo from C++,
without a switch) are left out of the output unless ``--log-level debug``; ``warning`` and
``error`` also hide the launcher's own notes. A run whose run directory already holds its
last step (``train.steps``, or ``train.stop_after_step``) starts nothing: one line,
``already at step N``, exit 0 (also elastic and across nodes, with no record written).
Every numeric flag must be a finite number in its range (nan, inf, a negative or a zero
where it means nothing: one line, exit 2).

Hangs: each process beats once per step (``jaxdist.cluster.heartbeat``); when one makes no
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
as ``jaxdist.train`` checks them (``jaxdist.cluster.elastic``). ``--nproc`` must be usable; it is
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
- ``--drop-stragglers``: a process that process 0 named a straggler (``straggler`` records in
  ``RUN_DIR/elastic.jsonl``, see ``training.stragglers``) at the end of two windows in a row
  is left out at the next membership change: its slot is lost as a dead one's (one line; the
  change's record has ``dropped_straggler``). With ``--recovery in-process`` that is the next
  restart (said at start); across nodes it has no effect (said at start).
- Each change prints ``elastic: 4 -> 2 processes, resuming at step N`` (N: the newest
  checkpoint) and appends a JSON line to ``RUN_DIR/elastic.jsonl``: ``time``, ``from``,
  ``to``, ``reason`` (start | failure | hang | grow | shrink; the first start has ``from`` null),
  ``step``, ``failed_rank``, ``exit_code``, ``mesh``, ``restarts``.

Across nodes (TorchElastic's model; one launcher per node, every one with the same arguments):

    python -m jaxdist.launch --nnodes 1:4 --nproc-per-node 2 [--devices-per-proc 4] \\
        --rdzv etcd://HOST:2379[,HOST2:2379] --rdzv-id RUN [--coordinator-bind ADDRESS] [--rdzv-timeout 600] \\
        [--rdzv-settle 5] [--max-restarts 3] [--rdzv-cacert CA --rdzv-cert CERT --rdzv-key KEY] \\
        -- --mesh data=-1,tensor=2 --run-dir /shared/runs/RUN ...

- Rendezvous (``jaxdist.cluster.rendezvous``, etcd's v3 JSON gateway over HTTP; several
  endpoints, comma-separated, are one etcd cluster's members: a request that one does not
  answer goes to the next): each launcher registers under ``/jaxdist/RUN/`` on a lease of 5 s
  that a thread renews, with a hash of its training arguments (and K and devices per
  process); a launcher killed even by SIGKILL drops out when its lease expires. A launcher
  whose hash differs from the running generation's (or, before one, from the first
  node's) does not join: one line, exit 2; the others never count it and go on. The lowest
  free node (join order) proposes a generation by an etcd transaction: the member nodes in rank order
  (at most MAX; the largest count whose processes the run fits, as above), the coordinator
  (its own address, ``--coordinator-bind``, default the address this host uses to reach
  etcd, on a port it holds) and the world size nodes x K. A first generation, or one with
  new nodes, waits until the membership has not changed for ``--rdzv-settle`` seconds.
  Each member starts its K processes with global ids node_rank x K + local; node 0's
  coordinator listens on that one address. The run directory is the same path on every
  node (shared storage) and must be given (``--run-dir``); the first generation keeps the
  user's ``--resume``, later ones resume from the newest checkpoint.
- A generation ends for everyone at the first report (etcd: created once): a process fails
  or hangs, or a member's lease is gone (a node lost) -> every node kills its processes
  and the next generation starts from the last checkpoint (a restart, counted against
  ``--max-restarts``, default 3); a node waits to join and a larger node count fits (node
  0 checks, after the settle window, up to MAX) -> every process saves (SIGTERM, exit 75)
  and the run grows; SIGINT / SIGTERM to a launcher -> the run saves, that node leaves and
  the others go on without it. The mesh's -1 axis, the microbatches and the data by step
  adapt as in the elastic launch above. Each generation prints one line on every node and
  node 0 appends one record to ``RUN_DIR/elastic.jsonl``: the fields above plus
  ``generation``, ``nodes``, ``from_nodes``, ``node_ids`` (rank order), ``left``, ``joined``,
  ``node`` (where the change came from: the node of the failed process, the one lost, the one
  that left or joined); ``reason`` start | failure | hang | lost | grow | leave.
- etcd is needed only for these changes: while it does not answer the processes go on (one
  line when it goes, one when it is back; a lease that expired meanwhile is granted again
  and the node registered again; right after an outage a member's key may be missing for
  5 s before that node counts as lost). Fewer than MIN nodes (or no node count that fits) for
  ``--rdzv-timeout`` seconds between generations: one line and exit 75 (the last
  checkpoint stands: rerun to resume). etcd unreachable at start, a malformed ``--rdzv``,
  ``--nnodes 3:2``, no ``--rdzv-id`` or no ``--run-dir``: one line, exit 2, nothing started.
- Exit codes per launcher: 0 the run finished (or had finished before it started); 75 it
  saved and stopped (this node left, the run was preempted from outside, or fewer than MIN
  nodes); 2 bad input, or a launcher whose arguments differ from the run's; a process's own
  code for 3 (non-finite loss) and 4 (checkpoint not written); the failure's code when
  ``--max-restarts`` is used up.
- Trust: etcd authenticates nobody by default; whoever can write its keys can steer the
  launchers (a generation names the coordinator every process connects to). Keep etcd on
  the job's private network with the coordinator port, or serve it over TLS with
  ``--client-cert-auth`` and give every launcher ``--rdzv-cacert CA --rdzv-cert CERT
  --rdzv-key KEY`` (etcd's user/role login is not used: the gateway does not pass a
  certificate's name on). The launchers listen on nothing themselves.

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
import contextlib
import io
import logging
import math
import os
import re
import socket
import sys
from collections.abc import Sequence
from pathlib import Path

import jaxdist
from jaxdist import errors
from jaxdist.cli import config_from_args, train_arg_parser
from jaxdist.cli import parse_args as parse_train_args
from jaxdist.cluster import elastic
from jaxdist.cluster.elastic_launch import ElasticPlan, run_elastic
from jaxdist.cluster.etcd import Etcd, Tls, parse_endpoints
from jaxdist.cluster.launcher import HangLimits, run_plain
from jaxdist.cluster.node_launch import NodePlan, check_local_address, route_address, run_node
from jaxdist.cluster.recovery_flags import DEFAULT_PEER_TIMEOUT_S, check_recovery_flags
from jaxdist.cluster.rendezvous import check_name
from jaxdist.cluster.supervise import child_argv
from jaxdist.errors import JaxdistError, OneLineArgumentParser
from jaxdist.training.run import run_directories

log = logging.getLogger("jaxdist.launch")  # not __name__: run as -m it is __main__, outside jaxdist's logger

DEFAULT_MAX_RESTARTS = 3
MODULES = ("jaxdist.train", "jaxdist.commbench")  # --module: the programs a plain launch can run
DEFAULT_HANG_TIMEOUT_S = 1800.0
DEFAULT_FIRST_STEP_TIMEOUT_S = 3600.0
DEFAULT_RDZV_TIMEOUT_S = 600.0
DEFAULT_RDZV_SETTLE_S = 5.0
LOCAL_FLAGS = ("nproc", "min_nproc", "nproc_file", "port")  # one machine's; --nnodes takes the others
NODE_FLAGS = (
    "nproc_per_node",
    "rdzv",
    "rdzv_id",
    "node_id",
    "coordinator_bind",
    "rdzv_timeout",
    "rdzv_settle",
    "rdzv_cacert",
    "rdzv_cert",
    "rdzv_key",
)
# Every number the launcher takes, checked before anything starts: a nan passes any plain
# comparison (``nan < 0`` is False) and inf would mean "never"; both are bad input.
SECONDS_FLAGS = {  # flag: (the lowest value, whether it is allowed, what it means)
    "hang_timeout": (0.0, True, "0: no hang watch"),
    "first_step_timeout": (0.0, False, ""),
    "rdzv_timeout": (0.0, False, ""),
    "rdzv_settle": (0.0, True, "0: no settle window"),
    "peer_timeout": (0.0, False, ""),
}
COUNT_FLAGS = {
    "nproc": 1,
    "devices_per_proc": 1,
    "nproc_per_node": 1,
    "max_restarts": 0,
    "straggler_window": 0,
}  # --min-nproc: with --nproc below


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = OneLineArgumentParser(
        prog="python -m jaxdist.launch", description="Run N training processes on this machine, or this node's share of a run across nodes."
    )
    parser.add_argument("--nproc", type=int, default=None, help="number of processes (elastic: the first and largest count)")
    parser.add_argument(
        "--devices-per-proc", type=int, default=None, help="fake CPU devices per process (default: mesh size / nproc; --nnodes: 1)"
    )
    nodes = parser.add_argument_group("across nodes (one launcher per node, an etcd rendezvous)")
    nodes.add_argument("--nnodes", default=None, metavar="MIN:MAX", help="the fewest and the most nodes of the run (N: exactly N)")
    nodes.add_argument("--nproc-per-node", type=int, default=None, metavar="K", help="processes this launcher starts (default 1)")
    nodes.add_argument(
        "--rdzv",
        default=None,
        metavar="etcd://HOST:PORT[,HOST:PORT]",
        help="the etcd server of the rendezvous (several: an etcd cluster's members, tried in turn)",
    )
    nodes.add_argument("--rdzv-id", default=None, metavar="ID", help="the run's name in etcd: the same on every node")
    nodes.add_argument("--node-id", default=None, help="this node's name in the rendezvous (default HOSTNAME-PID)")
    nodes.add_argument(
        "--coordinator-bind", default=None, metavar="ADDRESS", help="this node's cluster address (default: the one that reaches etcd)"
    )
    nodes.add_argument("--rdzv-cacert", default=None, metavar="FILE", help="HTTPS to etcd: the CA file its certificate is checked with")
    nodes.add_argument("--rdzv-cert", default=None, metavar="FILE", help="HTTPS: this client's certificate (etcd --client-cert-auth)")
    nodes.add_argument("--rdzv-key", default=None, metavar="FILE", help="HTTPS: the key of --rdzv-cert")
    nodes.add_argument(
        "--rdzv-timeout", type=float, default=DEFAULT_RDZV_TIMEOUT_S, metavar="S", help="stop when fewer than MIN nodes for S seconds"
    )
    nodes.add_argument(
        "--rdzv-settle",
        type=float,
        default=DEFAULT_RDZV_SETTLE_S,
        metavar="S",
        help=f"membership unchanged this long before a generation starts or grows (default {DEFAULT_RDZV_SETTLE_S:g})",
    )
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
    parser.add_argument(
        "--recovery",
        default="restart",
        choices=("restart", "in-process"),
        help="elastic, after a process dies: restart the set from the last checkpoint (default), or in-process: the survivors "
        "go on from the failed step without a restart and a replacement rejoins them (one device per process; process 0's death "
        "still restarts)",
    )
    parser.add_argument(
        "--peer-timeout",
        type=float,
        default=DEFAULT_PEER_TIMEOUT_S,
        metavar="S",
        help=f"--recovery in-process: seconds a collective or the coordination service waits for a silent peer (default {DEFAULT_PEER_TIMEOUT_S:g})",
    )
    parser.add_argument(
        "--straggler-factor",
        type=float,
        default=None,
        metavar="F",
        help="name a process whose own work per step is F times the others' median (train.straggler_factor, default 1.3)",
    )
    parser.add_argument(
        "--straggler-window", type=int, default=None, metavar="N", help="steps per straggler comparison (train.straggler_window; 0: off)"
    )
    parser.add_argument(
        "--drop-stragglers",
        action="store_true",
        help="elastic: a process named a straggler at the end of two windows in a row is left out at the next membership change "
        "(the next set has one process fewer)",
    )
    parser.add_argument(
        "--module",
        default="jaxdist.train",
        choices=MODULES,
        help="what each process runs (default jaxdist.train; jaxdist.commbench: the links)",
    )
    parser.add_argument(
        "--log-level",
        default="info",
        choices=jaxdist.LEVELS,
        help="info (default): the launcher's notes, without gloo's connection lines; debug: with them; warning, error: fewer notes",
    )
    parser.add_argument("train_args", nargs=argparse.REMAINDER, help="-- then the arguments of python -m jaxdist.train")
    args = parser.parse_args(argv)
    if args.train_args[:1] == ["--"]:
        args.train_args = args.train_args[1:]
    for flag in ("straggler_factor", "straggler_window"):  # the launcher's spelling of the training keys
        if getattr(args, flag) is not None:
            args.train_args.append(f"train.{flag}={getattr(args, flag)}")
    _check_numbers(args)
    args.hang = HangLimits(args.hang_timeout, args.first_step_timeout) if args.hang_timeout > 0 else None
    restarting = [f"--{k.replace('_', '-')}" for k in ("nnodes", "min_nproc", "max_restarts", "nproc_file") if getattr(args, k) is not None]
    if args.module != "jaxdist.train" and restarting:
        raise JaxdistError(f"--module {args.module} runs once on a fixed set of processes: {restarting[0]} restarts training runs only")
    args.nodes = args.nnodes is not None
    args.elastic = False
    if args.nodes:
        _check_node_args(args, parser)
        if args.drop_stragglers:
            log.warning("--drop-stragglers has no effect across nodes (--nnodes): stragglers are named there, not left out")
        return args
    given = [f"--{k.replace('_', '-')}" for k in NODE_FLAGS if getattr(args, k) != parser.get_default(k)]
    if given:
        raise JaxdistError(f"{given[0]} belongs to a run across nodes: it needs --nnodes MIN:MAX")
    if args.nproc is None:
        raise JaxdistError("give --nproc N (processes on this machine) or --nnodes MIN:MAX (one launcher per node, with --rdzv)")
    args.elastic = any(getattr(args, k) is not None for k in ("min_nproc", "max_restarts", "nproc_file"))
    if args.elastic:
        _check_elastic_args(args)
    check_recovery_flags(args)
    return args


def _check_numbers(args: argparse.Namespace) -> None:
    """Each numeric flag finite and in range (one line, exit 2)."""
    for name, (low, inclusive, meaning) in SECONDS_FLAGS.items():
        value = getattr(args, name)
        if not (math.isfinite(value) and (value >= low if inclusive else value > low)):
            bound = f"{'>=' if inclusive else '>'} {low:g}{f' ({meaning})' if meaning else ''}"
            raise JaxdistError(f"--{name.replace('_', '-')} must be a finite number of seconds {bound}, got {value:g}")
    for name, low in COUNT_FLAGS.items():
        value = getattr(args, name)
        if value is not None and value < low:
            raise JaxdistError(f"--{name.replace('_', '-')} must be >= {low}, got {value}")
    if args.straggler_factor is not None and not (math.isfinite(args.straggler_factor) and args.straggler_factor >= 1):
        raise JaxdistError(f"--straggler-factor must be a finite number >= 1, got {args.straggler_factor:g}")
    if args.port is not None and not 1 <= args.port <= 65535:
        raise JaxdistError(f"--port must be from 1 to 65535, got {args.port}")


def _parse_nnodes(text: str) -> tuple[int, int]:
    low, sep, high = text.partition(":")
    if not sep:
        high = low
    if not (low.isascii() and low.isdigit() and high.isascii() and high.isdigit()):
        raise JaxdistError(f"--nnodes {text!r}: expected MIN:MAX or N (positive integers)")
    low_n, high_n = int(low), int(high)
    if not 1 <= low_n <= high_n:
        raise JaxdistError(f"--nnodes {text}: MIN must be from 1 to MAX, got {low_n}:{high_n}")
    return low_n, high_n


def _check_node_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """--nnodes: the flags of a run across nodes, checked before anything is started or registered."""
    if args.recovery == "in-process":
        raise JaxdistError("--recovery in-process is for processes on one machine (--nproc with --min-nproc); across nodes runs restart")
    mixed = [f"--{k.replace('_', '-')}" for k in LOCAL_FLAGS if getattr(args, k) is not None]
    if mixed:
        raise JaxdistError(f"{mixed[0]} is for processes on one machine; with --nnodes give --nproc-per-node K")
    args.min_nodes, args.max_nodes = _parse_nnodes(args.nnodes)
    if args.rdzv is None:
        raise JaxdistError("--nnodes needs --rdzv etcd://HOST:PORT (the rendezvous every node's launcher joins)")
    args.etcd_endpoints = parse_endpoints(args.rdzv)
    args.etcd_host, args.etcd_port = args.etcd_endpoints[0]
    if args.rdzv_id is None:
        raise JaxdistError("--nnodes needs --rdzv-id ID (the run's name in etcd: the same on every node)")
    check_name(args.rdzv_id, "--rdzv-id")
    args.node_id = check_name(args.node_id or _default_node_id(), "--node-id")
    args.nproc_per_node = 1 if args.nproc_per_node is None else args.nproc_per_node
    args.devices_per_proc = 1 if args.devices_per_proc is None else args.devices_per_proc
    if (args.rdzv_cert or args.rdzv_key) and not (args.rdzv_cacert and args.rdzv_cert and args.rdzv_key):
        raise JaxdistError("--rdzv-cert and --rdzv-key go together, with --rdzv-cacert (HTTPS to etcd)")


def _default_node_id() -> str:
    host = re.sub(r"[^A-Za-z0-9._-]", "-", socket.gethostname()).strip(".-_") or "node"
    return f"{host[:100]}-{os.getpid()}"


def _check_elastic_args(args: argparse.Namespace) -> None:
    if args.min_nproc is None:
        raise JaxdistError("--nproc-file and --max-restarts need --min-nproc M (the fewest processes the run may continue with)")
    if not 1 <= args.min_nproc <= args.nproc:
        raise JaxdistError(f"--min-nproc must be from 1 to --nproc ({args.nproc}), got {args.min_nproc}")
    if args.devices_per_proc is None:
        raise JaxdistError("an elastic launch (--min-nproc) needs --devices-per-proc K >= 1: the device count of each process count")


def elastic_plan(args: argparse.Namespace) -> ElasticPlan:
    """Parse the train args as ``jaxdist.train`` does (no JAX) and fix the run directory."""
    train = parse_train_args(train_arg_parser(), args.train_args)
    if train.profile_steps is not None:
        train.overrides.append(f"train.profile_steps={train.profile_steps}")
    config = config_from_args(train)
    run_dir, durable = run_directories(train.run_dir, config)  # the launcher's records go to the local tier
    return ElasticPlan(
        config=config,
        run_dir=run_dir,
        child_args=child_argv(list(args.train_args), durable or run_dir),  # the launcher restarts: no --max-restarts inside
        first_resume=train.resume,
        max_nproc=args.nproc,
        min_nproc=args.min_nproc,
        devices_per_proc=args.devices_per_proc,
        max_restarts=DEFAULT_MAX_RESTARTS if args.max_restarts is None else args.max_restarts,
        nproc_file=Path(args.nproc_file) if args.nproc_file else None,
        port=args.port,
        hang=args.hang,
        recovery=args.recovery,
        peer_timeout_s=args.peer_timeout,
        drop_stragglers=args.drop_stragglers,
    )


def node_plan(args: argparse.Namespace) -> NodePlan:
    """--nnodes: the train args parsed as ``jaxdist.train`` does (no JAX); the run directory
    must be given (every node writes the same one)."""
    train = parse_train_args(train_arg_parser(), args.train_args)
    if not train.run_dir:
        raise JaxdistError("--nnodes needs the run's --run-dir DIR after --, on storage every node shares")
    if train.profile_steps is not None:
        train.overrides.append(f"train.profile_steps={train.profile_steps}")
    config = config_from_args(train)
    elastic.mesh_for(config, args.min_nodes * args.nproc_per_node, args.devices_per_proc)  # --mesh auto: one line here
    address = args.coordinator_bind or route_address(args.etcd_host, args.etcd_port)  # the first endpoint's route
    check_local_address(address)
    run_dir, durable = run_directories(train.run_dir, config)
    return NodePlan(
        config=config,
        run_dir=run_dir,
        child_args=child_argv(list(args.train_args), durable or run_dir),
        first_resume=train.resume,
        min_nodes=args.min_nodes,
        max_nodes=args.max_nodes,
        nproc_per_node=args.nproc_per_node,
        devices_per_proc=args.devices_per_proc,
        etcd=Etcd(
            args.etcd_host,
            args.etcd_port,
            tls=Tls(args.rdzv_cacert, args.rdzv_cert, args.rdzv_key) if args.rdzv_cacert else None,
            others=args.etcd_endpoints[1:],
        ),
        run_id=args.rdzv_id,
        node_id=args.node_id,
        address=address,
        rdzv_timeout_s=args.rdzv_timeout,
        settle_s=args.rdzv_settle,
        max_restarts=DEFAULT_MAX_RESTARTS if args.max_restarts is None else args.max_restarts,
        hang=args.hang,
    )


def finished_plain(args: argparse.Namespace) -> tuple[int, str] | None:
    """A plain launch of a finished run: (its step, the line that says so); None to start the
    processes (also when the training arguments do not parse: each process says why, as before)."""
    if args.module != "jaxdist.train":
        return None
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # a --help among them: the processes print it
            train = parse_train_args(train_arg_parser(), args.train_args)
        if not train.run_dir:
            return None  # a new runs/NAME-TIME directory
        config = config_from_args(train)
    except (JaxdistError, SystemExit):
        return None
    step = elastic.finished_step(config, run_directories(train.run_dir, config)[0], train.resume)
    return None if step is None else (step, elastic.finished_line(config, step))


@errors.command
def main(argv: Sequence[str] | None = None) -> int:
    jaxdist.set_level("info")  # until the arguments say otherwise (a bad one is an error at any level)
    args = parse_args(sys.argv[1:] if argv is None else argv)
    jaxdist.set_level(args.log_level)
    plan = elastic_plan(args) if args.elastic else None
    nodes = node_plan(args) if args.nodes else None
    finished = finished_plain(args) if plan is None and nodes is None else None
    if nodes is not None:
        return run_node(nodes)
    if plan is not None:
        return run_elastic(plan)
    if finished is not None:  # nothing to start: the processes would only compile and exit
        log.info(finished[1])
        return 0
    return run_plain(args.nproc, args.train_args, args.devices_per_proc, args.port, args.hang, args.module)


if __name__ == "__main__":
    sys.exit(main())
