"""Faults on the paths a cluster user walks, tested as they happen.

The launcher's coordinator listens on loopback only; killing the launcher (or the
supervisor) ALONE, with SIGKILL, ends every process it started (trainers, Grain workers,
resource trackers) within seconds; a stalled rank is noticed, every rank's Python stacks
are printed and the run is stopped; a rank that exits 75 lets the others finish saving; a
coordinator port taken at start costs nothing; a bad --nproc-file is one warning; the
supervisor forwards --resume=VALUE; the SLURM template requeues after a timely save; the
JobSet admits only its own pods. Launcher logic runs against stub trainers (a script in
place of the Python interpreter, as the launcher starts ``sys.executable -m jaxdist.train``);
the faults themselves against real runs. Every process started here is cleaned up.
"""

import contextlib
import ipaddress
import json
import os
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml

import jaxdist
import jaxdist.launch as launch
import jaxdist.train as train_cli
from jaxdist.cli import train_arg_parser
from jaxdist.cluster import distributed, elastic, launcher, supervise
from jaxdist.cluster.elastic import NprocFile
from jaxdist.errors import JaxdistError
from jaxdist.training.checkpoint import checkpoint_steps
from jaxdist.training.preemption import EXIT_PREEMPTED

from helpers import SMALL_TEXT, TINY, run_stub_launcher, subprocess_env

REPO = Path(jaxdist.__file__).resolve().parents[1]  # the checkout under test (its configs/launch templates)
OVERRIDES = (*TINY, *SMALL_TEXT, "train.global_batch=8", "checkpoint.every_steps=1000")
ELASTIC_TRAIN_ARGS = ("--mesh", "data=-1,tensor=2", *OVERRIDES, "train.steps=5")


def _env(**extra: str) -> dict[str, str]:
    env = subprocess_env()
    return {**env, **extra}


def _alive(procs: list[psutil.Process]) -> list[psutil.Process]:
    out = []
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
    return out


def _left_after(procs: list[psutil.Process], seconds: float) -> list[str]:
    """Those of ``procs`` still running after ``seconds`` ("PID COMMAND"; each is then killed)."""
    deadline = time.monotonic() + seconds
    while _alive(procs) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = []
    for p in _alive(procs):
        with contextlib.suppress(psutil.NoSuchProcess):
            left.append(f"{p.pid} {' '.join(p.cmdline())[:120]}")
            p.kill()
    return left


@pytest.fixture
def started():
    """Popen objects (each in its own session) killed with their descendants afterwards."""
    procs: list[subprocess.Popen] = []
    yield procs
    for proc in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            family = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
            for p in family:
                with contextlib.suppress(psutil.NoSuchProcess):
                    p.kill()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


# --- pure logic, no processes ---

# Every numeric launcher flag: nan, inf, negative and (where invalid) zero are one line and exit 2
# before anything starts. (flags, the message); a nan once slipped through every "< 0" check.
PLAIN = ["--nproc", "2"]
NODES = ["--nnodes", "1:2", "--rdzv", "etcd://127.0.0.1:1", "--rdzv-id", "numbers"]  # checked before etcd is asked
SECONDS = "must be a finite number of seconds"
BAD_NUMBERS = {
    "hang timeout nan": ([*PLAIN, "--hang-timeout", "nan"], f"--hang-timeout {SECONDS} >= 0 (0: no hang watch), got nan"),
    "hang timeout inf": ([*PLAIN, "--hang-timeout", "inf"], f"--hang-timeout {SECONDS} >= 0 (0: no hang watch), got inf"),
    "hang timeout negative": ([*PLAIN, "--hang-timeout", "-1"], f"--hang-timeout {SECONDS} >= 0 (0: no hang watch), got -1"),
    "first step timeout nan": ([*PLAIN, "--first-step-timeout", "nan"], f"--first-step-timeout {SECONDS} > 0, got nan"),
    "first step timeout inf": ([*PLAIN, "--first-step-timeout", "1e999"], f"--first-step-timeout {SECONDS} > 0, got inf"),
    "first step timeout zero": ([*PLAIN, "--first-step-timeout", "0"], f"--first-step-timeout {SECONDS} > 0, got 0"),
    "rdzv settle nan": ([*NODES, "--rdzv-settle", "nan"], f"--rdzv-settle {SECONDS} >= 0 (0: no settle window), got nan"),
    "rdzv settle inf": ([*NODES, "--rdzv-settle", "inf"], f"--rdzv-settle {SECONDS} >= 0 (0: no settle window), got inf"),
    "rdzv settle negative": ([*NODES, "--rdzv-settle", "-0.5"], f"--rdzv-settle {SECONDS} >= 0 (0: no settle window), got -0.5"),
    "rdzv timeout nan": ([*NODES, "--rdzv-timeout", "nan"], f"--rdzv-timeout {SECONDS} > 0, got nan"),
    "rdzv timeout inf": ([*NODES, "--rdzv-timeout=-inf"], f"--rdzv-timeout {SECONDS} > 0, got -inf"),
    "rdzv timeout zero": ([*NODES, "--rdzv-timeout", "0"], f"--rdzv-timeout {SECONDS} > 0, got 0"),
    "nproc zero": (["--nproc", "0"], "--nproc must be >= 1, got 0"),
    "nproc nan": (["--nproc", "nan"], "argument --nproc: invalid int value: 'nan'"),
    "devices per proc zero": ([*PLAIN, "--devices-per-proc", "0"], "--devices-per-proc must be >= 1, got 0"),
    "devices per proc negative": ([*NODES, "--devices-per-proc", "-2"], "--devices-per-proc must be >= 1, got -2"),
    "nproc per node zero": ([*NODES, "--nproc-per-node", "0"], "--nproc-per-node must be >= 1, got 0"),
    "max restarts negative": ([*NODES, "--max-restarts", "-1"], "--max-restarts must be >= 0, got -1"),
    "min nproc zero": ([*PLAIN, "--min-nproc", "0", "--devices-per-proc", "2"], "--min-nproc must be from 1 to --nproc (2), got 0"),
    "port zero": ([*PLAIN, "--port", "0"], "--port must be from 1 to 65535, got 0"),
    "port too large": ([*PLAIN, "--port", "65536"], "--port must be from 1 to 65535, got 65536"),
    "peer timeout zero": ([*PLAIN, "--peer-timeout", "0"], f"--peer-timeout {SECONDS} > 0, got 0"),
    "straggler factor nan": ([*PLAIN, "--straggler-factor", "nan"], "--straggler-factor must be a finite number >= 1, got nan"),
    "straggler factor below 1": ([*PLAIN, "--straggler-factor", "0.5"], "--straggler-factor must be a finite number >= 1, got 0.5"),
    "straggler window negative": ([*PLAIN, "--straggler-window", "-1"], "--straggler-window must be >= 0, got -1"),
}


@pytest.mark.parametrize("case", BAD_NUMBERS, ids=list(BAD_NUMBERS))
def test_every_numeric_flag_is_checked(case, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(launcher.subprocess, "Popen", lambda *a, **k: pytest.fail("the launcher started a process"))
    flags, message = BAD_NUMBERS[case]
    assert launch.main([*flags, "--", "--mesh", "data=-1,tensor=2", *OVERRIDES, "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"jaxdist: error: {message}"], err
    assert not (tmp_path / "run").exists()


def test_gloos_connection_line_is_chatter_unless_a_peer_is_missing():
    line = "[Gloo] Rank 3 is connected to 7 peer ranks. Expected number of connected peer ranks is : 7\n"
    assert distributed.is_gloo_chatter(line)
    assert not distributed.is_gloo_chatter(line.replace("to 7 peer", "to 6 peer"))  # one missing: kept, with gloo's next line
    assert not distributed.is_gloo_chatter("[Gloo] Rank 3 is NOT connected to: [5]\n")
    assert not distributed.is_gloo_chatter("[rank 0] step 1 | loss 5.9\n")


def test_two_threads_interleaved_gloo_lines_are_chatter_and_a_missing_peer_is_still_said():
    """As seen from a process with two devices in a group: std::cout mixes the two threads'
    lines at any of gloo's ``<<`` (both mixes below were seen in real runs)."""
    start = "[Gloo] Rank {} is connected to {} peer ranks. Expected number of connected peer ranks is : "
    at_the_count = [start.format(1, 1) + start.format(0, 1) + "1\n", "1\n"]
    at_the_rank = [
        "[Gloo] Rank [Gloo] Rank 0 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1\n",
        "1 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1\n",
    ]
    at_the_expected = [  # a fresh-clone run's: the other thread's rank between "peer ranks. " and "Expected"
        "[Gloo] Rank [Gloo] Rank 0 is connected to 1 peer ranks. 1Expected number of connected peer ranks is : 1\n",
        " is connected to 1 peer ranks. Expected number of connected peer ranks is : 1\n",
    ]
    for mixed in (at_the_count, at_the_rank, at_the_expected):
        chatter = distributed.GlooChatter()
        assert [chatter(line) for line in (*mixed, "step 1 | loss 5.9\n", "1\n")] == [True, True, False, False]
    chatter = distributed.GlooChatter()
    assert not chatter(start.format(3, 6) + "7\n")  # one whole line: a missing peer is shown
    assert chatter(start.format(1, 1) + start.format(0, 0) + "1\n") and chatter("1\n")  # mixed: which count is whose is unknown
    assert not chatter("[Gloo] Rank 0 is NOT connected to: [1]\n")  # gloo's own line for the missing peer: always shown


def test_launcher_notes_follow_the_log_level(capsys):
    try:
        for level, shown in (("debug", True), ("info", True), ("warning", False), ("error", False)):
            jaxdist.set_level(level)  # what launch --log-level sets
            launcher.log.info("a note")
            launcher.log.error("an error")
            assert capsys.readouterr().err.splitlines() == [
                *(["jaxdist: a note"] if shown else []),
                "jaxdist: error: an error",
            ]
    finally:
        jaxdist.set_level("info")


# A process of a run not started by jaxdist.launch (SLURM, Kubernetes): gloo's lines come from C++
# (file descriptor 1, not sys.stdout), the way this script writes them.
HIDE_GLOO = """
import os, sys
from jaxdist.cluster.distributed import ProcessGroup, hide_gloo_lines
hide_gloo_lines(sys.argv[1], ProcessGroup("127.0.0.1:1", 2, 0))
os.write(1, b"[Gloo] Rank 0 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1\\n")
print("from python", flush=True)
os.write(1, b"[Gloo] Rank 0 is connected to 0 peer ranks. Expected number of connected peer ranks is : 1\\n")
os.write(1, b"the last line, without a newline")
"""


@pytest.mark.parametrize("level", ["info", "debug"])
def test_a_train_process_keeps_gloos_lines_off_its_stdout(level):
    env = {k: v for k, v in subprocess_env().items() if k != distributed.ENV_OUTPUT_FILTERED}
    out = subprocess.run([sys.executable, "-c", HIDE_GLOO, level], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    connected = "[Gloo] Rank 0 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1"
    assert (connected in lines) == (level == "debug"), lines
    assert "from python" in lines and lines[-1] == "the last line, without a newline"  # nothing else lost, in order
    assert "[Gloo] Rank 0 is connected to 0 peer ranks. Expected number of connected peer ranks is : 1" in lines


def test_a_non_utf8_nproc_file_is_one_warning_and_keeps_the_count(tmp_path, capsys):
    path = tmp_path / "nproc"
    path.write_bytes(b"\xff\xfe4\n")
    watched = NprocFile(path)
    assert watched.changed() is None
    path.write_bytes("\u0663".encode())  # ARABIC-INDIC DIGIT THREE: int() would take it
    os.utime(path, ns=(time.time_ns(), time.time_ns() + 10**9))
    assert watched.changed() is None
    path.write_text("3\n")
    os.utime(path, ns=(time.time_ns(), time.time_ns() + 2 * 10**9))
    assert watched.changed() == 3
    warnings = capsys.readouterr().err.strip().splitlines()
    assert len(warnings) == 2 and all("not a positive integer; keeping the current process count" in w for w in warnings), warnings


def test_the_hang_watch_gives_the_first_step_its_own_allowance(tmp_path):
    from jaxdist.cluster.heartbeat import ProgressWatch, beat_path

    def beat(rank: int, step: int, age_s: float) -> None:
        beat_path(tmp_path, rank).write_text(f"{step}\n")
        os.utime(beat_path(tmp_path, rank), (time.time() - age_s, time.time() - age_s))

    watch = ProgressWatch(tmp_path, 2, hang_timeout_s=5, first_step_timeout_s=60)
    watch.started = time.time() - 30
    beat(0, 1, age_s=20)  # rank 0 is in its first step; rank 1 has not beaten at all
    assert watch.stalled([True, True]) is None  # within the first-step allowance
    beat(1, 1, age_s=20)
    beat(0, 2, age_s=1)
    assert watch.stalled([True, True]) is None  # rank 1 still in its first step: everyone waits for it
    watch.started = time.time() - 61
    stall = watch.stalled([True, True])
    assert (stall.rank, stall.first, stall.limit_s) == (1, True, 60)
    beat(1, 3, age_s=6)  # both past their first step: the hang timeout counts from each one's last beat
    beat(0, 4, age_s=6)
    stall = watch.stalled([True, True])
    assert (stall.rank, stall.step, stall.first) == (1, 3, False)  # the one furthest behind
    assert watch.stalled([True, False]).rank == 0  # a finished process is not stalled
    beat(0, 5, age_s=1)
    assert watch.stalled([True, False]) is None


def _group(coordinator: str, bind: str | None = None) -> distributed.ProcessGroup:
    args = train_arg_parser().parse_args(["--coordinator", coordinator, "--num-processes", "2", "--process-id", "0"])
    args.coordinator_bind = bind
    return distributed.process_group_from(args)


def test_the_coordinator_binds_one_address(monkeypatch):
    monkeypatch.delenv("JAXDIST_COORDINATOR_BIND", raising=False)
    with socket.socket() as probe:  # a port free now
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    assert distributed.bind_address(_group(f"localhost:{port}")) == f"127.0.0.1:{port}"  # the coordinator host's address, not [::]
    assert distributed.bind_address(_group(f"127.0.0.1:{port}", "0.0.0.0")) == f"0.0.0.0:{port}"  # every interface only when asked
    monkeypatch.setenv("JAXDIST_COORDINATOR_BIND", "127.0.0.1")  # what jaxdist.launch sets
    assert _group(f"localhost:{port}").bind == "127.0.0.1"
    with pytest.raises(JaxdistError, match="without a port"):
        _group(f"localhost:{port}", "127.0.0.1:80")
    with pytest.raises(JaxdistError, match="cannot listen on 192.0.2.1"):  # TEST-NET-1: not this machine's
        distributed.bind_address(_group(f"localhost:{port}", "192.0.2.1"))
    # SLURM (JAX's detection): process 0 listens on the address of the step's first node.
    slurm = {
        "SLURM_JOB_ID": "4242",
        "SLURM_STEP_NODELIST": "localhost,node2",
        "SLURM_NTASKS": "2",
        "SLURM_PROCID": "0",
        "SLURM_LOCALID": "0",
    }
    for key, value in slurm.items():
        monkeypatch.setenv(key, value)
    group, local_devices = distributed._detected(distributed.ProcessGroup(None, None, None, 30))
    slurm_port = 4242 % 2**12 + 65535 - 2**12 + 1  # JAX's port for the job
    assert (group.coordinator, group.num_processes, group.process_id, local_devices) == (f"localhost:{slurm_port}", 2, 0, [0])
    assert distributed.bind_address(group) == f"127.0.0.1:{slurm_port}"


def test_the_jobset_admits_only_its_own_pods():
    docs = list(yaml.safe_load_all((REPO / "configs/launch/jobset.yaml").read_text()))
    jobset = next(d for d in docs if d["kind"] == "JobSet")
    (policy,) = [d for d in docs if d["kind"] == "NetworkPolicy"]
    own_pods = {"jobset.sigs.k8s.io/jobset-name": jobset["metadata"]["name"]}
    assert policy["spec"]["podSelector"]["matchLabels"] == own_pods
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    sources = [source for rule in policy["spec"]["ingress"] for source in rule["from"]]
    assert sources == [{"podSelector": {"matchLabels": own_pods}}]  # no ipBlock, no other namespace
    container = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0]
    assert "--coordinator-bind=$(POD_IP)" in container["args"]
    pod_ip = next(e for e in container["env"] if e["name"] == "POD_IP")
    assert pod_ip["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"


class _FakeRun:
    """Stands in for the supervised run's Popen: records its arguments, exits with the next code."""

    calls: list[list[str]] = []
    codes: list[int] = []

    def __init__(self, cmd, **kwargs):
        self.calls.append(list(cmd))
        self.code = self.codes.pop(0)

    def wait(self):
        return self.code

    def send_signal(self, signum):
        pass


@pytest.mark.parametrize("resume", ["never", "/some/run/checkpoints/8"])
def test_the_supervisor_forwards_resume_equals_value(resume, tmp_path, monkeypatch):
    monkeypatch.delenv(supervise.SUPERVISED_ENV, raising=False)
    monkeypatch.setattr(supervise.subprocess, "Popen", _FakeRun)
    _FakeRun.calls, _FakeRun.codes = [], [1, 0]  # a crash, then a clean run
    argv = ["--max-restarts", "1", "--restart-delay", "0", f"--resume={resume}", "--run-dir", str(tmp_path / "run"), *TINY]
    assert train_cli.main(argv) == 0
    first, second = _FakeRun.calls
    assert first[-2:] == ["--resume", resume] and not any(a.startswith("--resume=") for a in first)
    assert second[-2:] == ["--resume", "auto"]  # a restart continues from the run's own newest checkpoint


# --- the SLURM template's shell logic, with stub srun / scontrol on PATH ---

STUB_SRUN = """#!/bin/bash
echo "$@" > "$STUB_LOG/srun.args"
echo $$ > "$STUB_LOG/srun.pid"
case "$STUB_MODE" in
  save-on-term) trap 'echo TERM >> "$STUB_LOG/srun.signals"; exit 75' TERM
                touch "$STUB_LOG/srun.ready"
                while :; do sleep 0.05; done ;;
  *) exit "$STUB_MODE" ;;
esac
"""


def _slurm(tmp_path: Path, mode: str, warn: bool) -> tuple[int, str, Path]:
    stubs, log = tmp_path / "bin", tmp_path / "log"
    stubs.mkdir()
    log.mkdir()
    stub_scancel = '#!/bin/bash\nkill -TERM "$(cat "$STUB_LOG/srun.pid")"\n'  # the template signals the tasks through scancel
    scontrol = '#!/bin/bash\necho "$@" >> "$STUB_LOG/scontrol"\n'
    for name, body in (("srun", STUB_SRUN), ("scontrol", scontrol), ("scancel", stub_scancel), ("squeue", "#!/bin/bash\nexit 1\n")):
        (stubs / name).write_text(body)
        (stubs / name).chmod(stat.S_IRWXU)
    env = {**os.environ, "PATH": f"{stubs}:{os.environ['PATH']}", "STUB_LOG": str(log), "STUB_MODE": mode}
    env.update({"SLURM_JOB_ID": "4242", "SLURM_JOB_NAME": "jaxdist", "RUN_DIR": str(tmp_path / "run")})
    cmd = ["bash", str(REPO / "configs/launch/slurm.sbatch"), "--config", "tiny"]
    with open(log / "stderr", "w") as err:  # a file: a stub task left behind must not hold a pipe open
        proc = subprocess.Popen(cmd, env=env, stderr=err, start_new_session=True)
    try:
        if warn:  # SLURM's --signal=B:USR1@120: the batch shell alone gets the warning
            deadline = time.monotonic() + 30
            while not (log / "srun.ready").exists():
                assert proc.poll() is None and time.monotonic() < deadline, "srun did not start"
                time.sleep(0.05)
            proc.send_signal(signal.SIGUSR1)
        proc.wait(timeout=30)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    return proc.returncode, (log / "stderr").read_text(), log


def test_slurm_template_requeues_after_a_save_before_the_time_limit(tmp_path):
    code, err, log = _slurm(tmp_path, "save-on-term", warn=True)
    assert code == EXIT_PREEMPTED, err
    assert (log / "srun.signals").read_text().split() == ["TERM"]  # forwarded to the tasks once
    assert (log / "scontrol").read_text().split() == ["requeue", "4242"]
    srun_args = (log / "srun.args").read_text().split()
    assert "--kill-on-bad-exit=1" not in srun_args and "--kill-on-bad-exit" not in srun_args  # a save is never a kill
    assert srun_args[-2:] == ["--config", "tiny"] and f"--run-dir {tmp_path / 'run'}" in " ".join(srun_args)


@pytest.mark.parametrize("exit_code", [0, 1, EXIT_PREEMPTED])
def test_slurm_template_does_not_requeue_without_the_warning(exit_code, tmp_path):
    code, err, log = _slurm(tmp_path, str(exit_code), warn=False)
    assert code == exit_code, err
    assert not (log / "scontrol").exists()  # e.g. scancel: its tasks saved, the job ends


# --- the launcher's logic against stub trainers ---


@pytest.mark.parametrize("mode", ["plain", "elastic"])
def test_a_rank_that_exits_75_lets_the_others_finish_their_save(mode, tmp_path):
    body = """
    if rank == 1:
        sys.exit(75)  # saved its part first
    signal.signal(signal.SIGTERM, lambda *a: open(f"{log}/rank0.signalled", "w").close())
    time.sleep(3)  # rank 0 is still committing
    open(f"{log}/rank0.saved", "w").close()
    sys.exit(75)
    """
    flags = ["--nproc", "2"] if mode == "plain" else ["--nproc", "2", "--min-nproc", "1", "--devices-per-proc", "2"]
    train = ["--steps", "5"] if mode == "plain" else [*ELASTIC_TRAIN_ARGS, "--run-dir", str(tmp_path / "run")]
    code, out = run_stub_launcher(tmp_path, body, [*flags, "--", *train], patch="L.GRACE_S = 0.5")
    assert code == EXIT_PREEMPTED, out
    assert (tmp_path / "log/rank0.saved").exists(), out  # not killed mid-commit
    assert not (tmp_path / "log/rank0.signalled").exists()  # nor asked to stop
    assert "stopping the others" not in out
    assert "rank 1 saved and exited (75); waiting up to 120s for the others to finish saving" in out


@pytest.mark.parametrize("mode", ["plain", "elastic"])
def test_processes_that_ignore_a_forwarded_sigterm_are_killed_after_the_grace(mode, tmp_path):
    """A process stuck past its exit (e.g. a thread in a barrier that waits for a dead peer)
    must not hold a launcher that was asked to stop."""
    body = """
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    open(f"{log}/rank{rank}.started", "w").close()
    time.sleep(600)
    """
    flags = ["--nproc", "2"] if mode == "plain" else ["--nproc", "2", "--min-nproc", "1", "--devices-per-proc", "2"]
    train = ["--steps", "5"] if mode == "plain" else [*ELASTIC_TRAIN_ARGS, "--run-dir", str(tmp_path / "run")]
    started, start = [tmp_path / f"log/rank{rank}.started" for rank in (0, 1)], time.monotonic()
    code, out = run_stub_launcher(tmp_path, body, [*flags, "--", *train], patch="L.SAVE_GRACE_S = 1", term_when=started)
    assert time.monotonic() - start < 30, out
    assert code == 128 + signal.SIGKILL, out
    assert "rank 0, 1 still running 1s after the signal; killing them" in out


def test_a_save_that_never_finishes_is_stopped_after_the_grace(tmp_path):
    body = """
    if rank == 1:
        sys.exit(75)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    time.sleep(600)
    """
    code, out = run_stub_launcher(tmp_path, body, ["--nproc", "2", "--", "--steps", "5"], patch="L.GRACE_S = 0.5; L.SAVE_GRACE_S = 1")
    assert code == 128 + signal.SIGKILL, out
    assert "rank 0 did not finish saving within 1s; stopping it" in out


@pytest.mark.parametrize("level", ["info", "debug"])
def test_gloos_connection_lines_show_only_at_debug(level, tmp_path):
    """Trainers print gloo's lines as gloo does (stdout, from C++); the launcher keeps the
    complete-mesh ones out of its output unless --log-level debug."""
    body = """
    os.write(1, f"[Gloo] Rank {rank} is connected to 1 peer ranks. Expected number of connected peer ranks is : 1\\n".encode())
    if rank == 1:
        os.write(1, b"[Gloo] Rank 1 is connected to 0 peer ranks. Expected number of connected peer ranks is : 1\\n")
    print("training", flush=True)
    """
    code, out = run_stub_launcher(tmp_path, body, ["--nproc", "2", "--log-level", level, "--", "--steps", "5"])
    assert code == 0, out
    lines = out.splitlines()
    complete = [f"[rank {r}] [Gloo] Rank {r} is connected to 1 peer ranks. Expected number of connected peer ranks is : 1" for r in (0, 1)]
    assert all((line in lines) == (level == "debug") for line in complete), out
    missing = "[rank 1] [Gloo] Rank 1 is connected to 0 peer ranks. Expected number of connected peer ranks is : 1"
    assert missing in lines  # a peer missing: shown
    assert "[rank 0] training" in lines and "[rank 1] training" in lines


# Stands in for process 0's coordinator: it listens on the port it was told, sharing it (as
# gRPC does, SO_REUSEPORT) with the launcher's reservation; a taken port is exit 76.
COORDINATOR_STUB = """
if rank == 0:
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, int(port)))
    except OSError:
        sys.exit(76)
    sock.listen()
with open(f"{log}/ports", "a") as f:
    f.write(f"{rank} {port}\\n")
"""


@pytest.mark.parametrize("mode", ["plain", "elastic"])
def test_a_taken_port_at_the_probe_is_skipped(mode, tmp_path):
    """The launcher probes the address the coordinator binds (127.0.0.1) and holds the port:
    a port some program listens on is never handed to the coordinator."""
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    patch = f"real = L.free_port; ports = [{port}]; L.free_port = lambda host='127.0.0.1': ports.pop() if ports else real(host)"
    flags = ["--nproc", "2"] if mode == "plain" else ["--nproc", "2", "--min-nproc", "2", "--devices-per-proc", "2"]
    train = ["--steps", "5"] if mode == "plain" else [*ELASTIC_TRAIN_ARGS, "--run-dir", str(tmp_path / "run")]
    with taken:
        code, out = run_stub_launcher(tmp_path, COORDINATOR_STUB, [*flags, "--", *train], patch=patch)
    assert code == 0, out
    used = {line.split()[1] for line in (tmp_path / "log/ports").read_text().splitlines()}
    assert len(used) == 1 and used != {str(port)}


@pytest.mark.parametrize("mode", ["plain", "elastic"])
def test_a_coordinator_that_could_not_bind_starts_again_on_a_new_port(mode, tmp_path):
    """The race after the probe: process 0 exits 76 (port taken, nothing ran); the set
    starts again on another port, and an elastic run loses no slot and counts no restart."""
    body = """
    if rank == 0:
        with open(f"{log}/attempts", "a") as f:
            f.write(f"{port}\\n")
        try:  # the first attempt only: another program took the port after the launcher's probe
            os.close(os.open(f"{log}/raced", os.O_CREAT | os.O_EXCL))
            sys.exit(76)
        except FileExistsError:
            open(f"{log}/listening-{port}", "w").close()
    deadline = time.monotonic() + 30
    while not os.path.exists(f"{log}/listening-{port}"):  # the others wait for the coordinator
        assert time.monotonic() < deadline
        time.sleep(0.05)
    """
    flags = ["--nproc", "2"] if mode == "plain" else ["--nproc", "2", "--min-nproc", "2", "--devices-per-proc", "2", "--max-restarts", "0"]
    run_dir = tmp_path / "run"
    train = ["--steps", "5"] if mode == "plain" else [*ELASTIC_TRAIN_ARGS, "--run-dir", str(run_dir)]
    code, out = run_stub_launcher(tmp_path, body, [*flags, "--", *train])
    assert code == 0, out
    ports = (tmp_path / "log/attempts").read_text().split()
    assert len(ports) == 2 and ports[0] != ports[1], ports
    assert f"the coordinator's port {ports[0]} was taken before it could listen; starting again on another port" in out
    if mode == "elastic":
        changes = [json.loads(line) for line in (run_dir / "elastic.jsonl").read_text().splitlines()]
        assert [(c["reason"], c["to"], c["restarts"]) for c in changes] == [("start", 2, 0)]


def test_an_elastic_run_restarts_without_a_stalled_rank(tmp_path):
    """The hang watch in the elastic loop: rank 1 stalls at step 3 (the fault-injection hook
    of jaxdist.cluster.heartbeat); its stacks are printed, the set is stopped, and the run goes on
    with one process (the stalled rank's slot is lost, as a crashed one's)."""
    body = """
    from jaxdist.cluster.heartbeat import beat, install_stack_dump
    install_stack_dump()
    for step in range(1, 6):
        beat(step)
        time.sleep(0.1)
    """
    run_dir = tmp_path / "run"
    flags = ["--nproc", "2", "--min-nproc", "1", "--devices-per-proc", "2", "--hang-timeout", "1"]
    code, out = run_stub_launcher(
        tmp_path, body, [*flags, "--", *ELASTIC_TRAIN_ARGS, "--run-dir", str(run_dir)], JAXDIST_FAULT_STALL_AT="1:3"
    )
    assert code == 0, out
    changes = [json.loads(line) for line in (run_dir / "elastic.jsonl").read_text().splitlines()]
    assert [(c["reason"], c["to"]) for c in changes] == [("start", 2), ("hang", 1)], changes
    assert changes[1]["failed_rank"] == 1 and changes[1]["restarts"] == 1
    assert "jaxdist: rank 1 made no progress for" in out and "at step 2 (--hang-timeout 1)" in out
    dump = [line for line in out.splitlines() if line.startswith("[rank 1] ")]
    assert any("most recent call first" in line for line in dump) and any("heartbeat.py" in line for line in dump), out[-3000:]


def test_a_killed_rank_is_blamed_before_the_peer_that_aborted_after_it(tmp_path):
    """Rank 3 is killed; rank 0 aborts after it (as JAX does when a peer's heartbeat stops).
    Both exits reach the launcher in one look: the killed rank is the failure the elastic record
    names, not the lower rank that aborted. "One look" is made certain, not raced: rank 0 stops
    the launcher (SIGSTOP) before either dies, and a helper (the stub again) resumes it once both
    are zombies (under load, rank 0's abort was once seen a look before rank 3's kill)."""
    body = """
    def dead(pid):  # a zombie: its exit waits for its (stopped) parent to collect it
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"

    def wait_for(check):
        deadline = time.monotonic() + 30
        while not check() and time.monotonic() < deadline:
            time.sleep(0.005)

    if "STUB_RESUME" in os.environ:  # the helper: resume the launcher once rank 0 is dead
        aborted, launcher = map(int, os.environ["STUB_RESUME"].split(":"))
        wait_for(lambda: dead(aborted))
        os.kill(launcher, signal.SIGCONT)
        sys.exit(0)
    nproc = int(os.environ["JAXDIST_NUM_PROCESSES"])
    if nproc == 4 and rank == 3:
        wait_for(lambda: os.path.exists(f"{log}/launcher.stopped"))
        with open(f"{log}/rank3.pid.part", "w") as f:
            f.write(str(os.getpid()))
        os.replace(f"{log}/rank3.pid.part", f"{log}/rank3.pid")
        os.kill(os.getpid(), signal.SIGKILL)
    if nproc == 4 and rank == 0:
        import subprocess
        launcher = os.getppid()
        os.kill(launcher, signal.SIGSTOP)
        open(f"{log}/launcher.stopped", "w").close()
        wait_for(lambda: os.path.exists(f"{log}/rank3.pid") and dead(int(open(f"{log}/rank3.pid").read())))
        helper_env = {**os.environ, "STUB_RESUME": f"{os.getpid()}:{launcher}"}
        subprocess.Popen([sys.argv[0]], env=helper_env, start_new_session=True)
        os.abort()
    if nproc == 4:
        time.sleep(30)
    """
    run_dir = tmp_path / "run"
    flags = ["--nproc", "4", "--min-nproc", "2", "--devices-per-proc", "2"]
    code, out = run_stub_launcher(tmp_path, body, [*flags, "--", *ELASTIC_TRAIN_ARGS, "--run-dir", str(run_dir)])
    assert code == 0, out
    changes = [json.loads(line) for line in (run_dir / "elastic.jsonl").read_text().splitlines()]
    assert [(c["reason"], c["to"]) for c in changes] == [("start", 4), ("failure", 2)], changes
    assert (changes[1]["failed_rank"], changes[1]["exit_code"]) == (3, -signal.SIGKILL), changes
    assert "jaxdist: rank 3 was killed by SIGKILL" in out, out


# --- real processes ---


def test_process_0_reports_a_taken_coordinator_port(tmp_path):
    """Where JAX itself would crash (SIGSEGV binding a taken address) or listen on every
    interface, process 0 says in one line that the port is taken and exits 76."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cmd = [sys.executable, "-m", "jaxdist.train", "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", "0"]
        cmd += ["--dist-timeout", "10", "--mesh", "data=2", "--run-dir", str(tmp_path / "run"), *TINY]
        proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 76, proc.stderr[-2000:]  # jaxdist.cluster.distributed.EXIT_PORT_TAKEN
    errors = [line for line in proc.stderr.splitlines() if line.startswith("jaxdist: error: ")]
    assert errors == [
        f"jaxdist: error: coordinator port {port} on 127.0.0.1 is taken: another program listens there (--coordinator 127.0.0.1:{port})"
    ]
    assert not (tmp_path / "run").exists()


@pytest.fixture(scope="module")
def compile_cache(tmp_path_factory):
    """One XLA cache for the launches below: the 2-process program compiles once."""
    return tmp_path_factory.mktemp("xla_cache")


def _launch(tmp_path: Path, cache: Path, *flags: str, steps: int = 400, extra=(), env=None) -> tuple[subprocess.Popen, Path, Path]:
    run_dir, log = tmp_path / "run", tmp_path / "launch.log"
    cmd = [sys.executable, "-m", "jaxdist.launch", "--nproc", "2", "--devices-per-proc", "2", *flags, "--"]
    cmd += [
        "--mesh",
        "data=2,tensor=2",
        "--run-dir",
        str(run_dir),
        *OVERRIDES,
        f"train.steps={steps}",
        f"train.compile_cache={cache}",
        *extra,
    ]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, env=_env(**(env or {})), stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    return proc, run_dir, log


def _steps_logged(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return sum('"loss"' in line for line in path.read_text().splitlines()) if path.exists() else 0


def _wait_for(predicate, proc: subprocess.Popen, timeout: float, what: str, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert proc.poll() is None, f"the launcher exited ({proc.returncode}) before {what}:\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"not within {timeout}s: {what}\n{log.read_text()[-3000:]}"
        time.sleep(0.2)


def _trainers(launcher: subprocess.Popen) -> dict[int, psutil.Process]:
    return {int(p.environ()["JAXDIST_PROCESS_ID"]): p for p in psutil.Process(launcher.pid).children()}


@pytest.fixture(scope="module")
def running_launch(tmp_path_factory, compile_cache):
    """A 2-process launch with one Grain worker per process, trained for a few steps."""
    tmp_path = tmp_path_factory.mktemp("launch")
    proc, run_dir, log = _launch(tmp_path, compile_cache, extra=["data.workers=1"])
    try:
        _wait_for(lambda: _steps_logged(run_dir) >= 2, proc, 240, "two steps", log)
        yield proc, log
    finally:
        with contextlib.suppress(psutil.NoSuchProcess):
            for p in [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]:
                with contextlib.suppress(psutil.NoSuchProcess):
                    p.kill()
        proc.wait(timeout=30)


@pytest.mark.heavy
def test_the_launchers_coordinator_listens_on_loopback_only(running_launch):
    proc, log = running_launch
    rank0 = _trainers(proc)[0]
    port = int(rank0.environ()["JAXDIST_COORDINATOR"].rsplit(":", 1)[1])
    listening = {c.laddr.ip for c in rank0.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN and c.laddr.port == port}
    addresses = {ipaddress.ip_address(ip).ipv4_mapped or ipaddress.ip_address(ip) for ip in listening}  # gRPC may use ::ffff:127.0.0.1
    assert addresses == {ipaddress.ip_address("127.0.0.1")}, (listening, log.read_text()[-2000:])  # not [::] (every interface)


@pytest.mark.heavy
def test_a_real_launch_prints_no_gloo_lines(running_launch):
    """After two steps gloo has connected the processes (a line per process and group, from C++)."""
    proc, log = running_launch
    text = log.read_text()
    assert "[rank 0] step 1 |" in text and "[Gloo]" not in text, text[-3000:]


@pytest.mark.heavy
def test_killing_the_launcher_alone_ends_every_process_it_started(running_launch):
    proc, log = running_launch
    family = psutil.Process(proc.pid).children(recursive=True)
    commands = [" ".join(p.cmdline()) for p in family]
    assert sum("jaxdist.train" in c for c in commands) == 2, commands
    assert sum("spawn_main" in c for c in commands) >= 2 and any("resource_tracker" in c for c in commands), commands  # Grain workers
    os.kill(proc.pid, signal.SIGKILL)  # the launcher alone, not its process group
    proc.wait(timeout=30)
    assert not _left_after(family, 5.0)


@pytest.mark.heavy
def test_killing_the_supervisor_alone_ends_its_run(tmp_path, started):
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "jaxdist.train", "--max-restarts", "2", "--mesh", "data=2", "--run-dir", str(run_dir), *OVERRIDES]
    cmd += ["train.steps=400", "data.workers=1"]
    log = tmp_path / "train.log"
    with open(log, "w") as out:
        sup = subprocess.Popen(cmd, env=_env(), stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    started.append(sup)
    _wait_for(lambda: _steps_logged(run_dir) >= 2, sup, 240, "two steps", log)
    family = psutil.Process(sup.pid).children(recursive=True)
    commands = [" ".join(p.cmdline()) for p in family]
    assert sum("jaxdist.train" in c for c in commands) == 1 and any("spawn_main" in c for c in commands), commands
    os.kill(sup.pid, signal.SIGKILL)
    sup.wait(timeout=30)
    assert not _left_after(family, 5.0)


@pytest.mark.heavy
def test_a_stalled_rank_is_dumped_and_the_run_stopped(tmp_path, compile_cache, started):
    proc, run_dir, log = _launch(tmp_path, compile_cache, "--hang-timeout", "5", env={"JAXDIST_FAULT_STALL_AT": "1:3"})
    started.append(proc)
    proc.wait(timeout=300)
    out = log.read_text()
    assert proc.returncode == 128 + signal.SIGKILL, out[-3000:]
    assert "jaxdist: fault injection (JAXDIST_FAULT_STALL_AT): rank 1 stalls at step 3" in out
    (line,) = [line for line in out.splitlines() if line.startswith("jaxdist: rank 1 made no progress")]
    assert "at step 2 (--hang-timeout 5); every rank's Python stacks follow, then the run is stopped" in line
    for rank in (0, 1):  # faulthandler's dump of every thread, from both ranks, through the launcher's output
        dump = [line for line in out.splitlines() if line.startswith(f"[rank {rank}] ") and "most recent call first" in line]
        assert dump, out[-4000:]
    assert any(line.startswith("[rank 1] ") and "heartbeat.py" in line for line in out.splitlines())  # where it stalls
    # rank 0 waits in the training loop (for the collective of a step it dispatched, or for its metrics)
    assert any(line.startswith("[rank 0] ") and "loop.py" in line and "train_loop" in line for line in out.splitlines())


@pytest.mark.heavy
def test_one_preempted_rank_lets_the_run_save_and_exit_75(tmp_path, compile_cache, started):
    """SIGTERM to rank 1 alone (e.g. its node is reclaimed): every rank saves the same step
    and exits 75; the launcher waits for all of them and exits 75, killing nobody."""
    proc, run_dir, log = _launch(tmp_path, compile_cache)
    started.append(proc)
    _wait_for(lambda: _steps_logged(run_dir) >= 2, proc, 240, "two steps", log)
    _trainers(proc)[1].send_signal(signal.SIGTERM)
    proc.wait(timeout=180)
    out = log.read_text()
    assert proc.returncode == EXIT_PREEMPTED, out[-3000:]
    assert "stopping the others" not in out and "killing the others" not in out
    saved = {
        line.split("] ", 1)[0]: int(line.split("state saved at step ")[1].split(";")[0])
        for line in out.splitlines()
        if "state saved at step" in line
    }
    assert set(saved) == {"[rank 0", "[rank 1"} and len(set(saved.values())) == 1, saved
    step = saved["[rank 0"]
    assert checkpoint_steps(run_dir / "checkpoints")[-1] == step
    assert len(list((run_dir / "checkpoints" / str(step) / "data").glob("process_*.json"))) == 2  # both processes' data state


def test_the_hang_watch_knows_a_process_is_past_its_first_step_without_seeing_it(tmp_path, monkeypatch):
    """The first beats can come faster than the launcher polls: a process's beat says its
    own first step, so a watch that first reads "step 2" still knows step 1 is done."""
    from jaxdist.cluster import heartbeat
    from jaxdist.cluster.heartbeat import ProgressWatch, beat_path

    monkeypatch.setenv(heartbeat.ENV_DIR, str(tmp_path))
    monkeypatch.setenv(heartbeat.ENV_RANK, "0")
    monkeypatch.delenv(heartbeat.ENV_STALL, raising=False)
    writer = heartbeat._Beat()
    watch = ProgressWatch(tmp_path, 1, hang_timeout_s=5, first_step_timeout_s=600)
    for step in (7, 8):  # a resumed run starting at 7; the watch polls only after step 8 began
        writer(step)
    assert beat_path(tmp_path, 0).read_text() == "8 7\n"
    old = time.time() - 10
    os.utime(beat_path(tmp_path, 0), (old, old))
    stall = watch.stalled([True])
    assert stall is not None and (stall.rank, stall.step, stall.first, stall.limit_s) == (0, 8, False, 5)
    os.close(writer.fd)


def test_the_launchers_processes_get_collective_timeouts_sized_from_the_hang_limits(monkeypatch):
    """Each process's XLA_FLAGS begin with the collective timeouts: twice --hang-timeout (at least
    a minute, so the hang watch names a stalled rank first); the first collective's from
    --first-step-timeout; none without a hang watch; a value the user set is kept."""
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_collective_call_terminate_timeout_seconds=7 intra_op_parallelism_threads=1")
    watched = launcher.Launcher(2, [], 1, hang=launcher.HangLimits(300, 900))
    unwatched = launcher.Launcher(2, [], 1)
    try:
        flags = watched._env(0)["XLA_FLAGS"].split()
        assert flags[:3] == [
            "--xla_cpu_collective_timeout_seconds=600",
            "--xla_gpu_nccl_termination_timeout_seconds=600",
            "--xla_gpu_first_collective_call_terminate_timeout_seconds=1800",
        ]
        assert "--xla_cpu_collective_call_terminate_timeout_seconds=7" in flags
        assert launcher.collective_timeouts(launcher.HangLimits(5, 0)) == (60.0, 60.0)
        assert "collective_timeout" not in unwatched._env(0)["XLA_FLAGS"]
    finally:
        watched.close()
        unwatched.close()


def test_a_replacement_still_starting_when_the_run_ends_is_stopped_and_the_run_is_done(tmp_path):
    """--recovery in-process: rank 2 dies, process 0 opens its slot (``recoverable.open_slot``'s
    file), the launcher starts a replacement (JAXDIST_REJOIN=1) that never connects, and the
    others finish: the replacement is stopped in one line and the run ends 0, not as a failure."""
    body = """
    beats = os.environ["JAXDIST_HEARTBEAT_DIR"]
    if os.environ.get("JAXDIST_REJOIN") != "1":  # every process has started its first step (as a trainer beats)
        with open(os.path.join(beats, f"rank-{rank}"), "w") as f:
            f.write("0 0")
        while not all(os.path.exists(os.path.join(beats, f"rank-{r}")) for r in range(3)):
            time.sleep(0.05)
    if os.environ.get("JAXDIST_REJOIN") == "1":
        open(f"{log}/replacement.{rank}", "w").close()
        time.sleep(60)  # still starting (it never connects)
    if rank == 2:
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)
    if rank == 0:
        time.sleep(1.5)  # the survivors recovered: the slot opens
        open(os.path.join(beats, "open-2"), "w").close()
        while not os.path.exists(f"{log}/replacement.2"):
            time.sleep(0.05)
    time.sleep(0.5)
    """
    flags = ["--nproc", "3", "--min-nproc", "2", "--devices-per-proc", "1", "--recovery", "in-process"]
    train = ["--mesh", "data=-1", *OVERRIDES, "train.global_batch=6", "train.steps=5", "--run-dir", str(tmp_path / "run")]
    code, out = run_stub_launcher(tmp_path, body, [*flags, "--", *train])
    assert code == 0, out
    assert "rank 2 was killed by SIGKILL; the other 2 recover in-process (--recovery in-process)" in out, out
    assert "starting a replacement for rank 2; it rejoins the live processes at their next step" in out, out
    assert "rank 2's replacement did not join before the run ended; the run is done" in out, out
    assert (tmp_path / "log" / "replacement.2").exists()


def test_a_death_that_would_leave_one_process_restarts_instead_of_recovering_in_process(tmp_path):
    """--recovery in-process, 2 processes, --min-nproc 1: rank 1 dies after the first step. One
    survivor cannot go on in place (Orbax refuses a mesh of one process's devices while JAX
    runs two: "Cannot serialize host local jax.Array", seen at its next save), so the launcher
    says so in one line and restarts the run, on both slots (the dead process is started again)."""
    body = """
    beats = os.environ["JAXDIST_HEARTBEAT_DIR"]
    with open(os.path.join(beats, f"rank-{rank}"), "w") as f:
        f.write("1 1")
    if os.path.exists(f"{log}/killed"):  # the restarted set
        open(f"{log}/restarted.{rank}", "w").close()
        sys.exit(0)
    while not all(os.path.exists(os.path.join(beats, f"rank-{r}")) for r in range(2)):
        time.sleep(0.05)
    if rank == 1:
        open(f"{log}/killed", "w").close()
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)  # killed by the launcher
    """
    flags = ["--nproc", "2", "--min-nproc", "1", "--devices-per-proc", "1", "--recovery", "in-process"]
    train = ["--mesh", "data=-1", *OVERRIDES, "train.global_batch=6", "train.steps=5", "--run-dir", str(tmp_path / "run")]
    code, out = run_stub_launcher(tmp_path, body, [*flags, "--", *train])
    assert code == 0, out
    said = "rank 1 was killed by SIGKILL: one process would be left, and Orbax cannot save a mesh of one process's devices"
    assert said in out and "recover in-process" not in out, out
    assert "elastic: 2 -> 2 processes, resuming at step 0" in out, out
    assert (tmp_path / "log" / "restarted.0").exists() and (tmp_path / "log" / "restarted.1").exists()


def test_a_persistent_straggler_is_left_out_at_the_next_membership_change(tmp_path):
    """--drop-stragglers: process 0 (the stub) names process 2 a straggler at the end of two
    windows in a row (steps 10 and 20, windows of 10), then rank 1 dies: the next set leaves
    out the dead slot and the straggler's (3 -> 1), said in one line and in the change's record."""
    run_dir = tmp_path / "run"
    body = """
    import json
    run = os.environ["STUB_RUN"]
    if os.environ["JAXDIST_NUM_PROCESSES"] != "3":  # the next set: it trains to the end
        sys.exit(0)
    if rank == 0:
        with open(f"{run}/elastic.jsonl", "a") as out:
            for step in (10, 20):
                out.write(json.dumps({"reason": "straggler", "step": step, "process": 2, "kind": "host"}) + "\\n")
        open(f"{log}/named", "w").close()
    while not os.path.exists(f"{log}/named"):
        time.sleep(0.05)
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(30)
    """
    flags = ["--nproc", "3", "--min-nproc", "1", "--devices-per-proc", "1", "--drop-stragglers", "--straggler-window", "10"]
    train = ["--mesh", "data=-1", *OVERRIDES, "train.global_batch=6", "train.steps=5", "--run-dir", str(run_dir)]
    code, out = run_stub_launcher(tmp_path, body, [*flags, "--", *train], STUB_RUN=str(run_dir))
    assert code == 0, out
    line = "process 2 was named a straggler at the end of two windows in a row (steps 1-20); its slot is left out of the next set (--drop-stragglers)"
    assert sum(line in x for x in out.splitlines()) == 1, out
    changes = [c for c in (json.loads(x) for x in (run_dir / "elastic.jsonl").read_text().splitlines()) if c["reason"] != "straggler"]
    assert [(c["reason"], c["from"], c["to"], c.get("dropped_straggler")) for c in changes] == [
        ("start", None, 3, None),
        ("failure", 3, 1, 2),
    ]


def test_a_straggler_named_once_is_not_left_out(tmp_path):
    """Windows that are not in a row (steps 10 and 30) are not persistent: the next set keeps the slot."""
    named = [{"process": 2, "step": 10}, {"process": 2, "step": 30}, {"process": 1, "step": 40}]
    assert elastic.persistent_straggler(named, 10) is None
    assert elastic.persistent_straggler([*named, {"process": 1, "step": 50}], 10) == (1, 31, 50)


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (["--nproc", "2", "--drop-stragglers"], "jaxdist: error: --drop-stragglers needs an elastic launch (--min-nproc M)"),
        (
            ["--nproc", "2", "--min-nproc", "1", "--devices-per-proc", "1", "--recovery", "in-process", "--drop-stragglers"],
            "a straggler is left out at the next restart, not at an in-process recovery or rejoin",
        ),
        (
            ["--nnodes", "1:2", "--rdzv", "etcd://127.0.0.1:2379", "--rdzv-id", "r", "--drop-stragglers"],
            "--drop-stragglers has no effect across nodes (--nnodes)",
        ),
    ],
    ids=["not elastic", "in-process", "across nodes"],
)
def test_drop_stragglers_where_it_cannot_act_says_so_in_one_line(flags, said, capsys):
    try:
        launch.parse_args([*flags, "--", "--steps", "1"])
    except JaxdistError as e:
        print(f"jaxdist: error: {e}", file=sys.stderr)
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and said in err[0], err
