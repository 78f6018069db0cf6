"""``--max-restarts N``: rerun a crashed single-node run from its latest checkpoint.

The supervisor runs the same command as a child process (with the run directory made
explicit and ``--resume auto``), forwards SIGINT / SIGTERM to it, and restarts it with
exponential backoff when it crashes. A clean exit, bad input, a non-finite loss (it
would recur) and preemption (the node is going away; the scheduler requeues) end it.
On clusters, SLURM ``--requeue`` or a JobSet restart policy plays this role. The run
dies with the supervisor (even on SIGKILL), so a requeued job never finds an old one
still writing to the run directory.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from jaxdist.cluster.heartbeat import ENV_DIR
from jaxdist.cluster.lifetime import die_with_parent
from jaxdist.errors import EXIT_BAD_INPUT, EXIT_NONFINITE, EXIT_OK, EXIT_PREEMPTED

SUPERVISED_ENV = "JAXDIST_SUPERVISED"  # set in the runs the supervisor starts, so they do not supervise again
FINAL_EXIT_CODES = {EXIT_OK, EXIT_BAD_INPUT, EXIT_NONFINITE, EXIT_PREEMPTED}
MAX_DELAY_S = 300.0


log = logging.getLogger(__name__)


def accounted_outside() -> bool:
    """Whether a launcher or supervisor accounts for the whole run's goodput (over every process set)."""
    return bool(os.environ.get(ENV_DIR) or os.environ.get(SUPERVISED_ENV))


def child_argv(argv: list[str], run_dir: Path | str) -> list[str]:
    """The same arguments without the supervisor's own, with --run-dir and --resume auto."""
    out, skip = [], False
    for i, arg in enumerate(argv):
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in ("--max-restarts", "--restart-delay", "--run-dir", "--resume"):
            skip = "=" not in arg and i + 1 < len(argv)
            continue
        out.append(arg)
    return [*out, "--run-dir", str(run_dir), "--resume", "auto"]


def user_resume(argv: list[str]) -> str | None:
    """The --resume the user gave (``--resume X``, ``--resume=X``, an abbreviation; the last
    wins), read as ``jaxdist.train`` reads it; None when absent."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--resume", default=None)
    return parser.parse_known_args(argv)[0].resume


def supervise(argv: list[str], run_dir: Path | str, max_restarts: int, delay: float) -> int:
    """Run and restart the training ``argv`` describes (see the module doc); the exit status.
    At the end ``RUN_DIR/goodput.json`` accounts every start's time (a local run directory)."""
    started = time.time()
    try:
        return _supervise(argv, run_dir, max_restarts, delay)
    finally:
        if isinstance(run_dir, Path) or "://" not in str(run_dir):
            from jaxdist.cluster import goodput

            if Path(run_dir).is_dir():
                goodput.write(Path(run_dir), started, time.time())


def _supervise(argv: list[str], run_dir: Path | str, max_restarts: int, delay: float) -> int:
    args = child_argv(argv, run_dir)
    first_resume = user_resume(argv)
    if first_resume is not None:  # honour --resume on the first start only
        args[-1] = first_resume
    env = {**os.environ, SUPERVISED_ENV: "1"}
    restarts = 0
    while True:
        child = subprocess.Popen([sys.executable, "-m", "jaxdist.train", *args], env=env, preexec_fn=die_with_parent(os.getpid()))
        forwarded: list[int] = []

        def forward(signum, frame, child=child, forwarded=forwarded):  # noqa: ARG001
            forwarded.append(signum)
            child.send_signal(signum)

        previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            code = child.wait()
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
        if code in FINAL_EXIT_CODES or forwarded:
            return code if code >= 0 else 128 - code
        if restarts >= max_restarts:
            log.info(f"run failed with exit code {code}; giving up after {restarts} restarts")
            return code if code > 0 else 1
        restarts += 1
        wait = min(delay * 2 ** (restarts - 1), MAX_DELAY_S)
        log.info(f"run failed with exit code {code}; restart {restarts}/{max_restarts} from the latest checkpoint in {wait:.0f}s")
        time.sleep(wait)
        args[-1] = "auto"
