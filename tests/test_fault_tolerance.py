"""Killed, preempted and supervised runs, as real processes: SIGTERM saves and exits
with the preempted code; random SIGKILLs (some during saves) lose nothing; the
supervisor restarts a crashed run. Every process started here is cleaned up."""

import contextlib
import json
import os
import random
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
from jaxdist.layout.mesh import parse_mesh
from jaxdist.training.checkpoint import checkpoint_steps
from jaxdist.training.preemption import EXIT_PREEMPTED
from jaxdist.training.run import run

from helpers import TINY, subprocess_env

pytestmark = pytest.mark.heavy

MESH = "data=2,fsdp=2"


def _overrides(steps: int) -> list[str]:
    return [*TINY, f"train.steps={steps}", "checkpoint.every_steps=2"]


def _start(run_dir: Path, steps: int, *extra: str) -> subprocess.Popen:
    env = subprocess_env()
    cmd = [sys.executable, "-m", "jaxdist.train", "--mesh", MESH, "--run-dir", str(run_dir), *extra, *_overrides(steps)]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def _metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip().endswith("}") and '"loss"' in line]


def _wait_for(predicate, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not reached")
        time.sleep(0.05)


def _kill_group(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=30)


@pytest.fixture
def processes():
    started: list[subprocess.Popen] = []
    yield started
    for proc in started:
        with contextlib.suppress(ProcessLookupError, subprocess.TimeoutExpired):
            _kill_group(proc)


def _reference_final_loss(steps: int) -> float:
    config = load_config(None, _overrides(steps))
    return run(config, parse_mesh(MESH), None, devices=jax.devices()[:4], progress=False).losses[-1]


def test_sigterm_finishes_the_step_saves_and_exits_preempted(tmp_path, processes):
    proc = _start(tmp_path, 400)
    processes.append(proc)
    _wait_for(lambda: len(_metrics(tmp_path)) >= 3 or proc.poll() is not None)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == EXIT_PREEMPTED, err[-2000:]
    saved = checkpoint_steps(tmp_path / "checkpoints")
    assert saved and "state saved at step" in err
    step = int(err.split("state saved at step ")[1].split(";")[0])
    assert saved[-1] == step and (tmp_path / "checkpoints" / str(step) / "state").is_dir()
    assert step < 400


def test_random_sigkills_lose_nothing(tmp_path, processes):
    steps, rng = 40, random.Random(0)
    for _ in range(2):  # two kills at random moments, then a run to the end
        before = checkpoint_steps(tmp_path / "checkpoints")
        proc = _start(tmp_path, steps)
        processes.append(proc)
        # kill at a random moment once this attempt has made progress (saves happen every 2 steps)
        _wait_for(lambda b=before, p=proc: checkpoint_steps(tmp_path / "checkpoints") != b or p.poll() is not None)
        time.sleep(rng.uniform(0.0, 0.6))
        _kill_group(proc)
    proc = _start(tmp_path, steps)
    processes.append(proc)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-2000:]
    final = [m for m in _metrics(tmp_path) if m.get("step") == steps and "loss" in m][-1]
    np.testing.assert_allclose(final["loss"], _reference_final_loss(steps), rtol=1e-6)


def test_supervisor_restarts_a_killed_run(tmp_path, processes):
    steps = 120  # the kill lands at the first checkpoint (step 2 or soon after): mid-run even on a loaded machine
    sup = _start(tmp_path, steps, "--max-restarts", "2", "--restart-delay", "0.1")
    processes.append(sup)
    _wait_for(lambda: checkpoint_steps(tmp_path / "checkpoints") or sup.poll() is not None)
    trainers = [p for p in psutil.Process(sup.pid).children() if "jaxdist.train" in " ".join(p.cmdline())]
    assert len(trainers) == 1, sup.poll()
    trainers[0].kill()
    _, err = sup.communicate(timeout=300)
    assert sup.returncode == 0, err[-2000:]
    assert "restart 1/2 from the latest checkpoint" in err, err[-2000:]
    assert "resumed from step" in err
    assert [m for m in _metrics(tmp_path) if m.get("step") == steps]
    assert not psutil.pid_exists(trainers[0].pid) or trainers[0].status() == psutil.STATUS_ZOMBIE
