"""jaxdist under a real SLURM scheduler (tests/slurm_cluster.py: munged, slurmctld and
slurmd on this machine, loopback only): the repository's template, submitted with sbatch,
runs 2 tasks through srun that JAX's SLURM detection joins and that train like 1 process;
a SIGTERM to the job (scancel --signal=TERM) and the time-limit warning save, requeue and
resume to the uninterrupted losses; a cancelled job saves and stays cancelled. Every job
is cancelled and every process of the cluster ended, even when a test fails.

The SLURM environment's effect before JAX starts (the fake CPU devices split by
SLURM_NTASKS, the GPUs a task drives, the coordinator's bind) is checked without a
cluster, at the top."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from slurm_cluster import INSTALL_HINT, SlurmCluster, missing_binaries

from jaxdist.cluster import distributed
from jaxdist.config import load_config
from jaxdist.layout import devices

from helpers import TINY, subprocess_env, train_losses

REPO = Path(__file__).resolve().parents[1]
TEMPLATE = REPO / "configs" / "launch" / "slurm.sbatch"
CPU_JOB = ("--nodes=1", "--ntasks-per-node=2", "--cpus-per-task=1")  # overrides the template's GPU-node lines
MESH = "data=2"
START_S = 300  # a job's start to its first steps: two JAX processes and a compile, with a second job on the machine
WARNING_S = 300  # the time-limit warning's lead (--signal=B:USR1@300): the save's time before the limit
SCHEDULE = 120  # every run here shares one schedule (and so one compiled program), whatever its train.steps


# --- the SLURM environment, before JAX starts (no cluster needed) ---

SRUN_ENV = {  # what srun -n 2 sets for task 1 on one node (the variables JAX's detection reads)
    "SLURM_JOB_ID": "4242",
    "SLURM_STEP_NODELIST": "localhost",
    "SLURM_STEP_NUM_NODES": "1",
    "SLURM_STEP_TASKS_PER_NODE": "2",
    "SLURM_NODEID": "0",
    "SLURM_NTASKS": "2",
    "SLURM_PROCID": "1",
    "SLURM_LOCALID": "1",
}


def _args(**overrides):
    import argparse

    values = {"coordinator": None, "num_processes": None, "process_id": None, "coordinator_bind": None, "dist_timeout": 30}
    return argparse.Namespace(**{**values, **overrides})


@pytest.fixture
def srun_task(monkeypatch):
    for key in [k for k in os.environ if k.startswith(("SLURM_", "OMPI_", "JAXDIST_"))]:
        monkeypatch.delenv(key)
    for key, value in SRUN_ENV.items():
        monkeypatch.setenv(key, value)
    return monkeypatch


def test_srun_tasks_know_their_count_and_rank_before_jax_starts(srun_task):
    group = distributed.process_group_from(_args())
    assert (group.coordinator, group.num_processes, group.process_id) == (None, 2, 1)  # the coordinator: JAX's detection


def test_srun_tasks_each_ask_for_their_share_of_the_fake_devices(srun_task, capsys):
    """data=4 over 2 tasks: 2 fake CPU devices each, even where XLA_FLAGS asked for 8 (the
    mesh's first 4 devices would all be task 0's: task 1 would hold none of the batch)."""
    srun_task.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    srun_task.setattr(devices, "backend_started", lambda: False)  # this test process has started JAX
    srun_task.setattr(devices, "gpu_plugin_installed", lambda: False)
    config = load_config(None, [*TINY, f"parallel.mesh={'data=4'}"])
    group = distributed.process_group_from(_args())
    devices.prepare_devices(config, group.num_processes)
    assert devices.forced_host_device_count() == 2
    assert "2 fake CPU devices" in capsys.readouterr().err


def test_a_bad_slurm_rank_is_one_line(srun_task):
    srun_task.setenv("SLURM_PROCID", "2")
    with pytest.raises(distributed.JaxdistError, match=r"SLURM_PROCID=2 is not in \[0, SLURM_NTASKS=2\)"):
        distributed.process_group_from(_args())


@pytest.mark.parametrize(
    ("tasks_per_node", "node", "gpus_per_task", "expected"),
    [
        ("1(x4)", "2", "", None),  # the template: one task per node drives all its GPUs (JAX alone: only GPU 0)
        ("8", "0", "", [1]),  # one task per GPU: JAX's choice, GPU SLURM_LOCALID
        ("8(x2),1", "1", "", [1]),
        ("8(x2),1", "2", "", None),  # the last node runs one task
        ("2", "0", "4", None),  # --gpus-per-task: SLURM bound each task its own GPUs
        ("garbled", "0", "", [1]),
    ],
)
def test_the_gpus_a_slurm_task_drives(srun_task, tasks_per_node, node, gpus_per_task, expected):
    srun_task.setenv("SLURM_STEP_TASKS_PER_NODE", tasks_per_node)
    srun_task.setenv("SLURM_NODEID", node)
    if gpus_per_task:
        srun_task.setenv("SLURM_GPUS_PER_TASK", gpus_per_task)
    group, local = distributed._detected(distributed.process_group_from(_args()))
    assert (group.num_processes, group.process_id, local) == (2, 1, expected)


def test_a_one_node_step_binds_its_loopback_coordinator_without_a_warning(srun_task, capsys):
    """On one node a coordinator name that resolves to 127.0.0.1 (as /etc/hosts often maps
    the host's name) reaches every task; with several nodes it is still a warning."""
    srun_task.setenv("SLURM_PROCID", "0")
    srun_task.setenv("SLURM_LOCALID", "0")
    group, _ = distributed._detected(distributed.process_group_from(_args()))
    hostname_like = distributed.dataclasses.replace(group, coordinator=group.coordinator.replace("localhost", "node0"))
    srun_task.setattr(distributed.socket, "getaddrinfo", lambda *a, **k: [(distributed.socket.AF_INET, 0, 0, "", ("127.0.0.1", 0))])
    port = group.coordinator.rsplit(":", 1)[1]
    assert distributed.bind_address(hostname_like) == f"127.0.0.1:{port}"
    assert "loopback" not in capsys.readouterr().err
    srun_task.setenv("SLURM_STEP_NUM_NODES", "2")
    distributed.bind_address(hostname_like)
    assert "processes on other machines cannot reach it" in capsys.readouterr().err


# --- a real cluster ---


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    missing = missing_binaries()
    if missing:
        pytest.skip(f"SLURM is not installed (no {', '.join(missing)}): {INSTALL_HINT}")
    if os.geteuid() != 0:
        pytest.skip("the test SLURM cluster runs its daemons as root (SlurmUser=root): run the tests as root")
    # a short path: slurmstepd's socket names under the spool directory must fit a sockaddr_un
    root = Path(os.environ.get("TMPDIR", "/tmp")) / f"jaxdist-slurm-{os.getpid()}"
    cluster = SlurmCluster(root)
    try:
        yield cluster.start()
    finally:
        cluster.stop()
        left = cluster.processes()
        shutil.rmtree(root, ignore_errors=True)
        assert not left, f"processes of the SLURM cluster left: {[p.pid for p in left]}"


@pytest.fixture
def jobs(cluster):
    """Job ids a test submits; each is cancelled (and waited for) afterwards."""
    ids: list[str] = []
    yield ids
    for job in ids:
        cluster.client("scancel", "--full", "--signal=KILL", job, check=False)
        cluster.client("scancel", job, check=False)
    deadline = time.monotonic() + 30
    while ids and cluster.client("squeue", "--noheader", "--jobs", ",".join(ids), check=False).stdout.strip():
        assert time.monotonic() < deadline, "cancelled jobs still in the queue after 30 s"
        time.sleep(0.25)


def _overrides(steps: int, latency_ms: float = 0) -> list[str]:
    return [
        *TINY,
        "data.source=synthetic",
        f"train.steps={steps}",
        "train.warmup_steps=2",
        f"train.schedule_steps={SCHEDULE}",
        "checkpoint.every_steps=1000",  # saves only on a signal and at the end
        f"data.synthetic_latency_ms={latency_ms}",
    ]


@pytest.fixture(scope="module")
def reference() -> list[float]:
    """One process on 2 of this session's fake devices: the losses every SLURM run must give."""
    return list(train_losses(MESH, tuple(_overrides(SCHEDULE)[len(TINY) :]), steps=SCHEDULE))


def _submit(cluster: SlurmCluster, jobs: list[str], tmp_path: Path, steps: int, *sbatch_options: str, latency_ms: float = 0, python=None):
    """sbatch the template from this directory (its jaxdist, as ``python -m`` imports it)."""
    env = cluster.env(subprocess_env())
    env.update(RUN_DIR=str(tmp_path / "run"), JAXDIST_PYTHON=str(python or sys.executable))
    cmd = ["sbatch", "--parsable", f"--output={tmp_path / 'job.out'}", f"--chdir={os.getcwd()}", *CPU_JOB, *sbatch_options]
    cmd += [str(TEMPLATE), "--config", "tiny", "--mesh", MESH, *_overrides(steps, latency_ms)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    job = proc.stdout.strip().split(";")[0]
    jobs.append(job)
    return job


def _job(cluster: SlurmCluster, job: str) -> dict[str, str]:
    out = cluster.client("scontrol", "--oneliner", "show", "job", job).stdout
    return dict(re.findall(r"(\w+)=(\S*)", out))


def _output(tmp_path: Path) -> str:
    path = tmp_path / "job.out"
    return path.read_text(errors="replace") if path.exists() else ""


def _wait(what: str, ready, tmp_path: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        assert time.monotonic() < deadline, f"timed out after {timeout:.0f}s waiting for {what}; job output:\n{_output(tmp_path)[-4000:]}"
        time.sleep(0.25)


def _wait_done(cluster: SlurmCluster, job: str, tmp_path: Path, timeout: float = 150) -> dict[str, str]:
    _wait(
        f"job {job} to end",
        lambda: not cluster.client("squeue", "--noheader", "--jobs", job, check=False).stdout.strip(),
        tmp_path,
        timeout,
    )
    return _job(cluster, job)


def _losses(run_dir: Path) -> dict[int, float]:
    path = run_dir / "metrics.jsonl"
    lines = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
    return {x["step"]: x["loss"] for x in lines if "loss" in x}  # a resumed run's lines come later


def _saved_step(out: str) -> int:
    saved = re.findall(r"state saved at step (\d+)", out)
    assert saved, out[-4000:]
    return int(saved[0])


@pytest.mark.heavy
def test_sbatch_runs_two_srun_tasks_that_train_like_one_process(cluster, jobs, reference, tmp_path):
    job = _submit(cluster, jobs, tmp_path, 4, "--time=5")
    info = _wait_done(cluster, job, tmp_path)
    out = _output(tmp_path)
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "0"), out[-4000:]
    assert "mesh data=2 (2 cpu)" in out  # one fake device per task: the 2 tasks joined one mesh
    assert "[Gloo]" not in out  # gloo's connection lines stay out of the job's output (--log-level debug shows them)
    losses = _losses(tmp_path / "run")
    np.testing.assert_allclose([losses[s] for s in range(1, 5)], reference[:4], rtol=1e-5)


@pytest.mark.heavy
def test_a_sigterm_to_the_job_saves_requeues_and_resumes(cluster, jobs, reference, tmp_path):
    """``scancel --signal=TERM JOBID`` (SLURM's preemption signal, to the tasks): they agree
    on a step, save, exit 75; the template requeues the job, which resumes and finishes."""
    steps = 60  # the processes agree on a step some steps after the signal (7 here)
    job = _submit(cluster, jobs, tmp_path, steps, "--time=5")
    _wait("step 2", lambda: len(_losses(tmp_path / "run")) >= 2, tmp_path, START_S)
    cluster.client("scancel", "--signal=TERM", job)
    info = _wait_done(cluster, job, tmp_path, timeout=START_S)
    out = _output(tmp_path)
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "1"), out[-4000:]
    assert f"jaxdist: saved on SIGTERM; requeueing job {job}" in out
    assert 2 <= _saved_step(out) < steps, out[-4000:]
    assert "exited with exit code 75" in out.lower()
    losses = _losses(tmp_path / "run")
    np.testing.assert_allclose([losses[s] for s in range(1, steps + 1)], reference[:steps], rtol=1e-5)


@pytest.mark.heavy
def test_the_time_limit_warning_saves_requeues_and_finishes(cluster, jobs, reference, tmp_path):
    """``--signal=B:USR1@300``: SLURM warns the batch shell 300 s before the time limit
    (checking every 30 s); the template asks the tasks to save and requeues. Once training
    runs, the test cuts the limit to 4-5 minutes past the job's elapsed time, so the warning
    is due at slurmctld's next check and the save has minutes before the limit itself, however
    long the start took; the requeued run gets a long limit again (a full slot) and finishes."""
    steps = 120  # ~0.3 s each: still training at the next check, up to 30 s on
    job = _submit(cluster, jobs, tmp_path, steps, "--time=15", f"--signal=B:USR1@{WARNING_S}", latency_ms=75)
    _wait("step 1", lambda: len(_losses(tmp_path / "run")) >= 1, tmp_path, START_S)
    # the limit is counted from the job's start: from its elapsed time, not a fixed 2 minutes,
    # or a start slowed by a second job on the machine left too little time to save
    limit_min = (_elapsed_s(_job(cluster, job)["RunTime"]) + WARNING_S) // 60
    cluster.client("scontrol", "update", f"JobId={job}", f"TimeLimit={limit_min}")
    _wait("the requeue", lambda: _job(cluster, job)["Restarts"] == "1", tmp_path, WARNING_S)
    cluster.client("scontrol", "update", f"JobId={job}", "TimeLimit=15")
    info = _wait_done(cluster, job, tmp_path, timeout=START_S)
    out = _output(tmp_path)
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "1"), out[-4000:]
    assert f"jaxdist: saved before the time limit; requeueing job {job}" in out
    assert 1 <= _saved_step(out) < steps, out[-4000:]
    losses = _losses(tmp_path / "run")
    np.testing.assert_allclose([losses[s] for s in range(1, steps + 1)], reference[:steps], rtol=1e-5)


def _elapsed_s(run_time: str) -> int:
    """Seconds of SLURM's ``[D-]HH:MM:SS`` (scontrol's RunTime)."""
    days, _, clock = run_time.rpartition("-")
    hours, minutes, seconds = (int(x) for x in clock.split(":"))
    return int(days or 0) * 86400 + hours * 3600 + minutes * 60 + seconds


STUB_TRAINER = """#!/bin/bash
# stands in for python: saves on SIGTERM (exit 75), else waits
trap 'echo "task $SLURM_PROCID saved"; exit 75' TERM
echo "task $SLURM_PROCID started"
while :; do sleep 0.1; done
"""


@pytest.mark.heavy
def test_a_cancelled_job_saves_and_stays_cancelled(cluster, jobs, tmp_path):
    """``scancel JOBID`` signals the batch shell and the tasks, then ends the job: the tasks
    save, and the template must not requeue it (SLURM would run a job its user cancelled)."""
    stub = tmp_path / "stub-python"
    stub.write_text(STUB_TRAINER)
    stub.chmod(stat.S_IRWXU)
    job = _submit(cluster, jobs, tmp_path, 4, "--time=5", python=stub)
    _wait("both tasks", lambda: _output(tmp_path).count("started") == 2, tmp_path, 30)
    cluster.client("scancel", job)
    info = _wait_done(cluster, job, tmp_path, timeout=60)
    out = _output(tmp_path)
    assert (info["JobState"], info["Restarts"]) == ("CANCELLED", "0"), out
    assert out.count("saved") >= 2 and "not requeued: submit the same command again to resume" in out, out
    assert "requeueing" not in out and "jaxdist: error" not in out, out


@pytest.mark.heavy
def test_no_process_of_a_stopped_cluster_survives(tmp_path):
    """The cluster script's own guarantee, as a user would run it (start, a job, stop)."""
    if missing_binaries() or os.geteuid() != 0:
        pytest.skip(f"SLURM is not installed or not root: {INSTALL_HINT}")
    root = Path(os.environ.get("TMPDIR", "/tmp")) / f"jaxdist-slurm-script-{os.getpid()}"
    script = [sys.executable, str(REPO / "tests" / "slurm_cluster.py")]
    try:
        started = subprocess.run([*script, "start", str(root)], capture_output=True, text=True, timeout=90)
        assert started.returncode == 0 and started.stdout.strip() == f"export SLURM_CONF={root / 'slurm.conf'}", started.stderr
        cluster = SlurmCluster(root)
        cluster.client("sbatch", "--wrap=sleep 300", f"--output={tmp_path / 'sleep.out'}")
        _wait("the job to run", lambda: "RUNNING" in cluster.client("squeue", "-h", "-o", "%T").stdout, tmp_path, 30)
        # the daemons, and the job's slurmstepd, shell and sleep (squeue says RUNNING a moment before they all exist)
        _wait("the job's processes", lambda: len(cluster.processes()) > 3, tmp_path, 30)
        stopped = subprocess.run([*script, "stop", str(root)], capture_output=True, text=True, timeout=90)
        assert stopped.returncode == 0, stopped.stderr
        assert not cluster.processes()
    finally:
        with contextlib.suppress(Exception):
            SlurmCluster(root).stop()
        shutil.rmtree(root, ignore_errors=True)
