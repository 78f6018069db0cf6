"""The launcher's flags for what happens when a process dies or lags (``--recovery``,
``--peer-timeout``, ``--drop-stragglers``), checked on one machine's launch: each combination
that cannot act is one line (an error, or a warning where the run can still go on)."""

from __future__ import annotations

import argparse
import logging

from jaxdist.errors import JaxdistError

DEFAULT_PEER_TIMEOUT_S = 10.0  # --recovery in-process: how soon a survivor gives up on a silent peer

log = logging.getLogger(__name__)


def check_recovery_flags(args: argparse.Namespace) -> None:
    """``args``: one machine's launch, ``args.elastic`` decided."""
    if args.recovery == "restart":
        if args.peer_timeout != DEFAULT_PEER_TIMEOUT_S:
            log.warning(f"--peer-timeout {args.peer_timeout:g} has no effect with --recovery restart (it is in-process recovery's)")
    elif not args.elastic:
        raise JaxdistError("--recovery in-process needs an elastic launch (--min-nproc M): the survivors go on with fewer processes")
    elif args.devices_per_proc != 1:
        raise JaxdistError(
            f"--recovery in-process needs --devices-per-proc 1, got {args.devices_per_proc}: with several devices per process, "
            "gloo aborts a survivor when a peer dies (jax 0.10)"
        )
    if args.drop_stragglers and not args.elastic:
        raise JaxdistError("--drop-stragglers needs an elastic launch (--min-nproc M): the run goes on with fewer processes")
    if args.drop_stragglers and args.recovery == "in-process":
        log.warning(
            "--drop-stragglers with --recovery in-process: a straggler is left out at the next restart, "
            "not at an in-process recovery or rejoin (those keep the set's slots)"
        )
