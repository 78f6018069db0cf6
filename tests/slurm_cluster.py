"""A one-node SLURM cluster on this machine: munged, slurmctld and slurmd in the
foreground, everything (key, sockets, state, spool, logs) in one directory, the node
being this host (``hostname -s``, its cores as CPUs) on 127.0.0.1.

By hand (as root, with the Debian packages ``slurm-wlm`` and ``munge``)::

    python tests/slurm_cluster.py start /tmp/slurm    # prints the SLURM_CONF to export
    export SLURM_CONF=/tmp/slurm/slurm.conf
    sbatch --ntasks=2 --cpus-per-task=1 configs/launch/slurm.sbatch --config tiny --mesh data=2
    python tests/slurm_cluster.py stop /tmp/slurm     # cancels the jobs, stops the daemons

In tests: ``with SlurmCluster(directory) as cluster: subprocess.run(["sbatch", ...], env=cluster.env(...))``.

Every process the cluster runs (daemons, job steps, tasks) carries ``SLURM_CONF`` naming
this cluster's slurm.conf in its environment; ``stop`` ends each of them, so nothing of
the cluster outlives it. The daemons talk over loopback only (``NoCtldInAddrAny``,
``NoInAddrAny``: they bind the address the node name resolves to, 127.0.0.1).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "srun", "squeue", "scontrol", "scancel", "sinfo")
INSTALL_HINT = "apt-get install -y slurm-wlm munge"


def missing_binaries() -> list[str]:
    """The SLURM and MUNGE programs this machine lacks (the daemons live in /usr/sbin)."""
    path = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])
    return [name for name in (*DAEMONS, *CLIENTS) if shutil.which(name, path=path) is None]


def _free_loopback_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _which(name: str) -> str:
    found = shutil.which(name, path=os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"]))
    if found is None:
        raise RuntimeError(f"{name} is not installed ({INSTALL_HINT})")
    return found


SLURM_CONF = """\
# One-node test cluster (tests/slurm_cluster.py); everything lives under {root}.
ClusterName=jaxdisttest
SlurmctldHost={node}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
CommunicationParameters=NoCtldInAddrAny,NoInAddrAny
AuthType=auth/munge
CredType=cred/munge
# cred_expire is also how long a requeued job waits before it may start again (120 s by default)
AuthInfo=socket={root}/munge/munge.socket,cred_expire=5
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/run/slurmctld.pid
SlurmdPidFile={root}/run/slurmd.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
# no cgroups: processes tracked by their parent ids, tasks not bound to CPUs
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SwitchType=switch/none
SchedulerType=sched/backfill
# a requeued job starts again within seconds of becoming eligible (defaults: 60 s and 30 s)
SchedulerParameters=sched_interval=2,bf_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
KillWait=15
MinJobAge=600
InactiveLimit=0
SlurmdTimeout=60
PlugStackConfig={root}/plugstack.conf
NodeName={node} NodeAddr=127.0.0.1 NodeHostname={node} CPUs={cpus} State=UNKNOWN
PartitionName=test Nodes={node} Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
"""


class SlurmCluster:
    """munged + slurmctld + slurmd under ``root`` (made if missing), started by ``start``
    and ended (with every job) by ``stop``; a context manager does both."""

    def __init__(self, root: Path | str):
        self.root = Path(root).resolve()
        self.conf = self.root / "slurm.conf"
        self.node = socket.gethostname().split(".")[0]
        self._procs: dict[str, subprocess.Popen] = {}

    # --- environment for clients and jobs ---

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """``base`` (default: this process's environment) pointed at this cluster; jobs
        submitted with it keep ``SLURM_CONF`` (sbatch exports the environment)."""
        env = dict(os.environ if base is None else base)
        env["SLURM_CONF"] = str(self.conf)
        env["PATH"] = os.pathsep.join([env.get("PATH", ""), "/usr/sbin", "/sbin"])
        for key in [k for k in env if k.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_")) and k != "SLURM_CONF"]:
            del env[key]  # a cluster of our own: nothing of an enclosing job's
        return env

    def client(self, *args: str, timeout: float = 30, check: bool = True) -> subprocess.CompletedProcess:
        """Run a SLURM client command (sinfo, squeue, scontrol, scancel, sbatch) against this cluster."""
        proc = subprocess.run(list(args), env=self.env(), capture_output=True, text=True, timeout=timeout)
        if check and proc.returncode != 0:
            raise RuntimeError(f"{' '.join(args)} exited {proc.returncode}: {proc.stderr.strip()}")
        return proc

    # --- start / stop ---

    def start(self, timeout: float = 60) -> SlurmCluster:
        missing = missing_binaries()
        if missing:
            raise RuntimeError(f"missing {', '.join(missing)} ({INSTALL_HINT})")
        self._prepare_directory()
        detached = {"start_new_session": True, "stdin": subprocess.DEVNULL}
        log = self.root / "log"
        try:
            self._spawn(
                "munged",
                [
                    _which("munged"),
                    "--foreground",
                    "--force",  # running as root; the key and directories are ours
                    f"--socket={self.root}/munge/munge.socket",
                    f"--key-file={self.root}/munge/munge.key",
                    f"--pid-file={self.root}/run/munged.pid",
                    f"--log-file={log}/munged.log",
                    f"--seed-file={self.root}/munge/munged.seed",
                    "--num-threads=2",
                ],
                detached,
            )
            self._wait_for(lambda: (self.root / "munge/munge.socket").exists(), "munged's socket", timeout)
            self._spawn("slurmctld", [_which("slurmctld"), "-D", "-i", "-f", str(self.conf)], detached)
            self._wait_for(lambda: self.client("sinfo", "-h", check=False).returncode == 0, "slurmctld to answer", timeout)
            self._spawn("slurmd", [_which("slurmd"), "-D", "-f", str(self.conf), "-N", self.node], detached)
            self._wait_for(self._node_idle, f"node {self.node} to be idle in sinfo", timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _prepare_directory(self) -> None:
        for sub in ("munge", "state", "spool", "log", "run"):
            (self.root / sub).mkdir(parents=True, exist_ok=True, mode=0o700)
        self.root.chmod(0o700)
        key = self.root / "munge/munge.key"
        if not key.exists():
            key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        (self.root / "plugstack.conf").write_text("")  # none of the host's SPANK plugins
        self.conf.write_text(
            SLURM_CONF.format(
                root=self.root,
                node=self.node,
                cpus=os.cpu_count() or 1,
                ctld_port=_free_loopback_port(),
                slurmd_port=_free_loopback_port(),
            )
        )

    def _spawn(self, name: str, cmd: list[str], popen_kwargs: dict) -> None:
        out = open(self.root / "log" / f"{name}.out", "ab")  # noqa: SIM115 - the daemon owns it
        env = self.env()
        self._procs[name] = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, **popen_kwargs)
        out.close()
        pids = self._read_pids()
        pids[name] = self._procs[name].pid
        (self.root / "run" / "pids.json").write_text(json.dumps(pids))

    def _read_pids(self) -> dict[str, int]:
        path = self.root / "run" / "pids.json"
        return json.loads(path.read_text()) if path.exists() else {}

    def _wait_for(self, ready, what: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            for name, proc in self._procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited {proc.returncode} while waiting for {what}: {self._log_tail(name)}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"timed out after {timeout:.0f}s waiting for {what}")
            time.sleep(0.25)

    def _node_idle(self) -> bool:
        proc = self.client("sinfo", "-h", "-N", "-n", self.node, "-o", "%T", check=False)
        return proc.returncode == 0 and proc.stdout.strip() == "idle"

    def _log_tail(self, name: str, lines: int = 5) -> str:
        text = ""
        for path in (self.root / "log" / f"{name}.out", self.root / "log" / f"{name}.log"):
            if path.exists():
                text += path.read_text(errors="replace")
        return " | ".join(text.strip().splitlines()[-lines:])

    def processes(self) -> list[psutil.Process]:
        """Every process of this cluster: the daemons and anything whose environment
        names this cluster's slurm.conf (job shells, srun, slurmstepd, tasks)."""
        found = {}
        pids = self._read_pids()
        for name, pid in pids.items():
            with contextlib.suppress(psutil.Error):
                proc = psutil.Process(pid)
                if name in " ".join(proc.cmdline()):
                    found[pid] = proc
        me = os.getpid()
        for proc in psutil.process_iter():
            if proc.pid == me or proc.pid in found:
                continue
            with contextlib.suppress(psutil.Error):
                if proc.environ().get("SLURM_CONF") == str(self.conf):
                    found[proc.pid] = proc
        return list(found.values())

    def stop(self, timeout: float = 30) -> None:
        """Cancel every job, stop the daemons, then end whatever of the cluster is left."""
        if "slurmctld" in self._procs or "slurmctld" in self._read_pids():
            with contextlib.suppress(Exception):
                self.client("scancel", "--full", "--signal=KILL", "--user=root", timeout=10, check=False)
                self.client("scancel", "--user=root", timeout=10, check=False)
        for name in reversed(DAEMONS):  # slurmd first: it is the parent of the job steps
            pid = self._procs[name].pid if name in self._procs else self._read_pids().get(name)
            if pid is None:
                continue
            with contextlib.suppress(psutil.Error):
                proc = psutil.Process(pid)
                if name in " ".join(proc.cmdline()):
                    proc.terminate()
                    try:
                        proc.wait(timeout=timeout / 3)
                    except psutil.TimeoutExpired:
                        proc.kill()
                        proc.wait(timeout=5)
        for proc in self._procs.values():
            with contextlib.suppress(Exception):
                proc.wait(timeout=1)
        left = self.processes()
        for proc in left:
            with contextlib.suppress(psutil.Error):
                proc.kill()
        psutil.wait_procs(left, timeout=5)
        self._procs.clear()
        with contextlib.suppress(FileNotFoundError):
            (self.root / "run" / "pids.json").unlink()

    def __enter__(self) -> SlurmCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in ("start", "stop"):
        print("usage: python tests/slurm_cluster.py start|stop DIR", file=sys.stderr)
        return 2
    action, root = argv
    cluster = SlurmCluster(root)
    try:
        if action == "start":
            cluster.start()
            print(f"export SLURM_CONF={cluster.conf}")
        else:
            cluster.stop()
    except RuntimeError as e:
        print(f"slurm_cluster: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.exit(main(sys.argv[1:]))
