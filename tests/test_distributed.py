"""Multi-process runs on loopback: 2 processes x 4 devices train exactly like 1 x 8,
checkpoint, stop and resume (also in 1 process), fail together, and report an
unreachable coordinator. Every process started here is cleaned up."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import psutil
import pytest

from jaxdist.config import load_config
from jaxdist.launch import free_port
from jaxdist.mesh import parse_mesh
from jaxdist.preemption import EXIT_PREEMPTED
from jaxdist.run import run
from jaxdist.xla_flags import with_gpu_defaults

from helpers import TINY

pytestmark = pytest.mark.heavy

MESH = "data=2,fsdp=4"


def _overrides(steps: int) -> list[str]:
    return [*TINY, f"train.steps={steps}", "checkpoint.every_steps=3"]


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}


def _launch(run_dir: Path, steps: int, *, nproc: int = 2) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        "jaxdist.launch",
        "--nproc",
        str(nproc),
        "--devices-per-proc",
        str(8 // nproc),
        "--",
        "--mesh",
        MESH,
        "--run-dir",
        str(run_dir),
        *_overrides(steps),
    ]
    return subprocess.Popen(cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _finish(proc: subprocess.Popen, timeout: float = 240) -> str:
    try:
        out, _ = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    return out


def _losses(run_dir: Path) -> dict[int, float]:
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {x["step"]: x["loss"] for x in lines if "loss" in x}


def _reference(steps: int, tmp_path_factory=None) -> list[float]:
    config = load_config(None, _overrides(steps))
    return run(config, parse_mesh(MESH), None, devices=jax.devices()[:8], progress=False).losses


@pytest.fixture(scope="module")
def two_process_run(tmp_path_factory):
    """Six steps by 2 processes x 4 fake devices (checkpoints at 3 and 6)."""
    run_dir = tmp_path_factory.mktemp("two-procs")
    out = _finish(_launch(run_dir, 6))
    assert "jaxdist: done at step 6" in out, out[-3000:]
    return run_dir


@pytest.fixture(scope="module")
def reference_losses():
    return _reference(10)


def test_two_processes_train_like_one(two_process_run, reference_losses):
    losses = _losses(two_process_run)
    np.testing.assert_allclose([losses[s] for s in range(1, 7)], reference_losses[:6], rtol=1e-5)
    files = sorted(p.name for p in (two_process_run / "checkpoints" / "6" / "data").glob("process_*.json"))
    assert files == ["process_0-of-2.json", "process_1-of-2.json"]  # one data state per process


def test_two_process_checkpoint_resumes_in_one_process(two_process_run, reference_losses, tmp_path):
    import shutil

    run_dir = tmp_path / "one-proc"
    shutil.copytree(two_process_run, run_dir)
    config = load_config(None, _overrides(10))
    resumed = run(config, parse_mesh(MESH), run_dir, devices=jax.devices()[:8], progress=False)
    np.testing.assert_allclose(resumed.losses, reference_losses[6:10], rtol=1e-5)


def test_two_process_run_stops_on_sigterm_and_resumes(tmp_path):
    proc = _launch(tmp_path, 500)
    deadline = time.monotonic() + 180
    while not ((tmp_path / "metrics.jsonl").exists() and len(_losses(tmp_path)) >= 2):
        assert proc.poll() is None and time.monotonic() < deadline, "the run did not start"
        time.sleep(0.2)
    os.kill(proc.pid, signal.SIGTERM)  # the launcher forwards it to both processes
    out = _finish(proc)
    assert proc.returncode == EXIT_PREEMPTED, out[-3000:]
    saved = int(out.split("state saved at step ")[1].split(";")[0])
    assert (tmp_path / "checkpoints" / str(saved)).is_dir()
    target = saved + 3
    out = _finish(_launch(tmp_path, target))
    assert f"resumed from step {saved}" in out and f"done at step {target}" in out, out[-3000:]
    losses = _losses(tmp_path)
    np.testing.assert_allclose([losses[s] for s in range(saved + 1, target + 1)], _reference(target)[saved:], rtol=1e-5)


def test_one_failing_process_stops_the_launch(tmp_path):
    proc = _launch(tmp_path, 5000)
    deadline = time.monotonic() + 180
    while not (tmp_path / "metrics.jsonl").exists():
        assert proc.poll() is None and time.monotonic() < deadline, "the run did not start"
        time.sleep(0.2)
    children = psutil.Process(proc.pid).children()
    assert len(children) == 2
    children[1].kill()
    killed_at = time.monotonic()
    _finish(proc, timeout=60)
    assert proc.returncode != 0
    assert time.monotonic() - killed_at < 30
    time.sleep(0.5)
    assert not any(c.is_running() and c.status() != psutil.STATUS_ZOMBIE for c in children)


def test_unreachable_coordinator_is_a_clear_error(tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "jaxdist.train",
        "--coordinator",
        f"127.0.0.1:{free_port()}",
        "--num-processes",
        "2",
        "--process-id",
        "1",
        "--dist-timeout",
        "5",
        "--mesh",
        "data=2",
        "--run-dir",
        str(tmp_path / "run"),
        *TINY,
    ]
    start = time.monotonic()
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "could not join the run at 127.0.0.1" in proc.stderr
    assert time.monotonic() - start < 60
    assert not (tmp_path / "run").exists()


def test_gpu_flag_set_parses_on_this_jaxlib():
    """XLA aborts on a flag it does not know: start a backend with every default set."""
    env = {**_env(), "XLA_FLAGS": with_gpu_defaults(""), "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(
        [sys.executable, "-c", "import jax; print(len(jax.devices()))"], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert env["XLA_FLAGS"].count("--xla_gpu_") >= 5
    assert with_gpu_defaults("--xla_gpu_enable_latency_hiding_scheduler=false").count("latency_hiding") == 1  # the user's value wins
