"""``python -m jaxdist.launch``: N training processes on this machine, as one run.

    python -m jaxdist.launch --nproc 2 [--devices-per-proc 4] -- --mesh data=2,fsdp=4 --steps 20

Each process joins through a coordinator on a free loopback port (gloo collectives on
CPU fake devices); every output line is prefixed with its rank; SIGINT / SIGTERM are
forwarded; when one process fails the others are stopped and the launcher exits with
the first failure's code. Children die with the launcher, so none is ever orphaned.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

from jaxdist.distributed import ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID
from jaxdist.errors import EXIT_BAD_INPUT, JaxdistError, OneLineArgumentParser

GRACE_S = 10.0  # after asking the others to stop, how long before they are killed
_PR_SET_PDEATHSIG = 1


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _die_with_parent() -> None:
    """In the child, before exec: the kernel kills it if the launcher dies (even SIGKILL)."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _pump(rank: int, stream, out) -> None:
    for line in iter(stream.readline, ""):
        out.write(f"[rank {rank}] {line}")
        out.flush()


class Launcher:
    def __init__(self, nproc: int, train_args: list[str], devices_per_proc: int | None, port: int | None):
        self.nproc, self.train_args = nproc, train_args
        self.devices_per_proc, self.port = devices_per_proc, port or free_port()
        self.procs: list[subprocess.Popen] = []

    def _env(self, rank: int) -> dict[str, str]:
        env = dict(os.environ)
        env.update({ENV_COORDINATOR: f"127.0.0.1:{self.port}", ENV_NUM_PROCESSES: str(self.nproc), ENV_PROCESS_ID: str(rank)})
        env["PYTHONUNBUFFERED"] = "1"
        if self.devices_per_proc:
            flags = " ".join(t for t in env.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in t)
            env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={self.devices_per_proc}".strip()
        return env

    def start(self) -> None:
        for rank in range(self.nproc):
            proc = subprocess.Popen(
                [sys.executable, "-m", "jaxdist.train", *self.train_args],
                env=self._env(rank),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                preexec_fn=_die_with_parent,
            )
            self.procs.append(proc)
            threading.Thread(target=_pump, args=(rank, proc.stdout, sys.stdout), daemon=True).start()

    def signal_all(self, signum: int) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signum)

    def stop_all(self) -> None:
        self.signal_all(signal.SIGTERM)
        deadline = time.monotonic() + GRACE_S
        while any(p.poll() is None for p in self.procs) and time.monotonic() < deadline:
            time.sleep(0.1)
        self.signal_all(signal.SIGKILL)
        for proc in self.procs:
            proc.wait()

    def wait(self) -> int:
        """The first non-zero exit code (others are then stopped), else 0."""
        while True:
            codes = [p.poll() for p in self.procs]
            failed = [(rank, c) for rank, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                rank, code = failed[0]
                if any(c is None for c in codes):
                    print(f"jaxdist.launch: rank {rank} exited with code {code}; stopping the others", file=sys.stderr, flush=True)
                    self.stop_all()
                return code if code > 0 else 128 - code
            if all(c == 0 for c in codes):
                return 0
            time.sleep(0.1)


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = OneLineArgumentParser(prog="python -m jaxdist.launch", description="Run N training processes on this machine.")
    parser.add_argument("--nproc", type=int, required=True, help="number of processes")
    parser.add_argument("--devices-per-proc", type=int, default=None, help="fake CPU devices per process (default: mesh size / nproc)")
    parser.add_argument("--port", type=int, default=None, help="coordinator port on 127.0.0.1 (default: a free one)")
    parser.add_argument("train_args", nargs=argparse.REMAINDER, help="-- then the arguments of python -m jaxdist.train")
    args = parser.parse_args(argv)
    if args.train_args[:1] == ["--"]:
        args.train_args = args.train_args[1:]
    if args.nproc < 1:
        raise JaxdistError(f"--nproc must be >= 1, got {args.nproc}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = parse_args(sys.argv[1:] if argv is None else argv)
    except JaxdistError as e:
        print(f"jaxdist: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    launcher = Launcher(args.nproc, args.train_args, args.devices_per_proc, args.port)
    forwarded = {s: signal.signal(s, lambda signum, frame: launcher.signal_all(signum)) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        launcher.start()
        return launcher.wait()
    finally:
        for s, handler in forwarded.items():
            signal.signal(s, handler)
        if any(p.poll() is None for p in launcher.procs):
            launcher.stop_all()


if __name__ == "__main__":
    sys.exit(main())
