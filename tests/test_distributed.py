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

from jaxdist.cluster.launcher import free_port
from jaxdist.config import load_config
from jaxdist.layout.mesh import parse_mesh
from jaxdist.layout.xla_flags import COLLECTIVE_TIMEOUTS, with_collective_timeouts, with_gpu_defaults
from jaxdist.training.checkpoint import checkpoint_steps
from jaxdist.training.compile_cache import enable_compile_cache
from jaxdist.training.preemption import EXIT_PREEMPTED
from jaxdist.training.run import run

from helpers import SMALL_TEXT, TINY, subprocess_env

pytestmark = pytest.mark.heavy

MESH = "data=2,fsdp=4"


def _overrides(steps: int) -> list[str]:
    """Every run here trains on one 10-step schedule (2 warmup steps), whatever its
    train.steps, so a run stopped early and resumed must land on the same learning rates."""
    return [*TINY, *SMALL_TEXT, f"train.steps={steps}", "train.warmup_steps=2", "train.schedule_steps=10", "checkpoint.every_steps=3"]


@pytest.fixture(scope="module", autouse=True)
def compile_cache(tmp_path_factory):
    """XLA's persistent compilation cache in this process (as any run with a run directory
    turns it on; an earlier one is kept): the in-process runs of one config compile once.
    The launches below use it too: process 0 of each finds the parameter init compiled."""
    return enable_compile_cache(load_config(None, []), tmp_path_factory.mktemp("compile_cache"))


def _env() -> dict[str, str]:
    return subprocess_env()


def _launch(run_dir: Path, steps: int, cache: Path, *, nproc: int = 2, env: dict[str, str] | None = None) -> subprocess.Popen:
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
        f"train.compile_cache={cache}",
    ]
    return subprocess.Popen(
        cmd, env={**_env(), **(env or {})}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )


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


# Process 1's checkpoint clock runs a million times faster than process 0's: on its own
# clock every step is an hour after the last save, on process 0's none is.
SKEWED_CLOCK = """
import sys, time, types
import jaxdist.training.checkpoint
from jaxdist.train import main

if sys.argv[1] == "1":
    real, start = time.monotonic, time.monotonic()
    fast = types.SimpleNamespace(**{k: getattr(time, k) for k in dir(time) if not k.startswith("_")})
    fast.monotonic = lambda: start + (real() - start) * 1e6
    jaxdist.training.checkpoint.time = fast
sys.exit(main(sys.argv[2:]))
"""


def _start_skewed(run_dir: Path, steps: int, cache: Path, *overrides: str) -> list[tuple[subprocess.Popen, Path]]:
    """Two processes of one run, started without the launcher so that each can run a
    wrapper (see SKEWED_CLOCK); each writes its output to RUN_DIR/../NAME-rankI.log."""
    script = run_dir.parent / "skewed_clock.py"
    script.write_text(SKEWED_CLOCK)
    port, procs = free_port(), []
    for rank in range(2):
        env = {
            **_env(),
            "JAXDIST_COORDINATOR": f"127.0.0.1:{port}",
            "JAXDIST_NUM_PROCESSES": "2",
            "JAXDIST_PROCESS_ID": str(rank),
            "XLA_FLAGS": subprocess_env(devices=4)["XLA_FLAGS"],
            "PYTHONUNBUFFERED": "1",
        }
        log = run_dir.parent / f"{run_dir.name}-rank{rank}.log"
        cmd = [sys.executable, str(script), str(rank), "--mesh", MESH, "--run-dir", str(run_dir), *_overrides(steps)]
        cmd += [f"train.compile_cache={cache}", *overrides]
        with open(log, "w") as out:
            procs.append((subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True), log))
    return procs


def _finish_all(procs: list[tuple[subprocess.Popen, Path]], timeout: float = 240) -> list[str]:
    """Wait for every process (killing all of them at the deadline); their outputs."""
    deadline = time.monotonic() + timeout
    try:
        for proc, _ in procs:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for proc, _ in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    return [log.read_text() for _, log in procs]


@pytest.fixture(scope="module")
def two_process_run(tmp_path_factory, compile_cache):
    """Six steps by 2 processes x 4 fake devices (checkpoints at 3 and 6), saving every
    hour too, by clocks that disagree (SKEWED_CLOCK)."""
    run_dir = tmp_path_factory.mktemp("two-procs") / "run"
    procs = _start_skewed(run_dir, 6, compile_cache, "checkpoint.every_minutes=60", "checkpoint.keep=10")
    start = time.monotonic()
    outputs = _finish_all(procs)
    took = time.monotonic() - start
    assert [p.returncode for p, _ in procs] == [0, 0], f"after {took:.0f}s: " + "\n".join(o[-2000:] for o in outputs)
    assert "jaxdist: done at step 6" in outputs[0], outputs[0][-3000:]
    return run_dir


@pytest.fixture(scope="module")
def reference_losses():
    return _reference(10)


def test_two_processes_train_like_one(two_process_run, reference_losses):
    losses = _losses(two_process_run)
    np.testing.assert_allclose([losses[s] for s in range(1, 7)], reference_losses[:6], rtol=1e-5)
    files = sorted(p.name for p in (two_process_run / "checkpoints" / "6" / "data").glob("process_*.json"))
    assert files == ["process_0-of-2.json", "process_1-of-2.json"]  # one data state per process


def test_time_based_saves_follow_process_0s_clock(two_process_run):
    """Process 1 alone would save every step; the run saved where process 0's clock said
    (never, within an hour): the step saves only, written by both processes."""
    checkpoints = two_process_run / "checkpoints"
    assert checkpoint_steps(checkpoints) == [3, 6]
    for step in (3, 6):
        assert sorted(p.name for p in (checkpoints / str(step) / "data").glob("*.json")) == ["process_0-of-2.json", "process_1-of-2.json"]


def test_two_process_checkpoint_resumes_in_one_process_twice(two_process_run, reference_losses, tmp_path, capsys):
    """2 processes -> 1 process (their data states do not fit 1 process: the data resumes
    by step, with a warning) -> 1 process again, from the data state saved after that
    fallback: every step sees the uninterrupted run's batch."""
    import shutil

    from jaxdist.data.batches import make_iterator
    from jaxdist.training.run import build_trainer

    run_dir = tmp_path / "one-proc"
    shutil.copytree(two_process_run, run_dir)
    devices = jax.devices()[:8]
    first = run(load_config(None, _overrides(8)), parse_mesh(MESH), run_dir, devices=devices, progress=False)
    warnings = [line for line in capsys.readouterr().err.splitlines() if "data resumed by step" in line]
    assert len(warnings) == 1 and "checkpoint step 6" in warnings[0] and "saved by 2 process" in warnings[0], warnings
    np.testing.assert_allclose(first.losses, reference_losses[6:8], rtol=1e-5)

    # The data state saved at step 8 is absolute: restored into a fresh iterator it
    # continues with global batch 9, exactly where the uninterrupted stream is.
    saved = json.loads((run_dir / "checkpoints" / "8" / "data" / "process_0-of-1.json").read_text())
    config = load_config(None, _overrides(10))
    layout = build_trainer(config, parse_mesh(MESH), devices).layout
    uninterrupted, restored = make_iterator(config, layout), make_iterator(config, layout)
    restored.set_state(saved)
    for _ in range(8):
        next(uninterrupted)
    for _ in range(2):  # batches 9 and 10
        np.testing.assert_array_equal(np.asarray(next(restored)["inputs"]), np.asarray(next(uninterrupted)["inputs"]))
    uninterrupted.close()
    restored.close()

    second = run(config, parse_mesh(MESH), run_dir, devices=devices, progress=False)
    assert "data resumed by step" not in capsys.readouterr().err  # its own data state this time
    np.testing.assert_allclose(second.losses, reference_losses[8:10], rtol=1e-5)


def test_two_process_run_saves_on_ctrl_c_and_resumes(tmp_path, reference_losses, compile_cache):
    """Ctrl-C (SIGINT, forwarded by the launcher to every process) takes the SIGTERM path:
    JAX's preemption sync point picks one step for all processes, they save it and exit
    with the preempted code, and the run resumes from it exactly."""
    proc = _launch(tmp_path, 500, compile_cache)
    deadline = time.monotonic() + 180
    while not ((tmp_path / "metrics.jsonl").exists() and len(_losses(tmp_path)) >= 2):
        assert proc.poll() is None and time.monotonic() < deadline, "the run did not start"
        time.sleep(0.2)
    os.kill(proc.pid, signal.SIGINT)
    out = _finish(proc)
    assert proc.returncode == EXIT_PREEMPTED, out[-3000:]
    saved_steps = {int(part.split(";")[0]) for part in out.split("state saved at step ")[1:]}
    assert len(saved_steps) == 1 and out.count("SIGINT received") == 2, out[-3000:]  # both ranks, one step
    (saved,) = saved_steps
    files = sorted(p.name for p in (tmp_path / "checkpoints" / str(saved) / "data").glob("process_*.json"))
    assert files == ["process_0-of-2.json", "process_1-of-2.json"]
    target = saved + 3
    out = _finish(_launch(tmp_path, target, compile_cache, env={"JAX_DEBUG_LOG_MODULES": "jax._src.compiler"}))
    assert f"resumed from step {saved}" in out and f"done at step {target}" in out, out[-3000:]
    # the restarted process 1 takes the step process 0 compiled and wrote (each keyed its own before)
    hits = [x for x in out.splitlines() if x.startswith("[rank 1]") and "Persistent compilation cache hit for 'jit__train_step'" in x]
    assert hits, [x for x in out.splitlines() if "jit__train_step" in x]
    losses = _losses(tmp_path)
    # Both launches train on the 10-step schedule (train.schedule_steps), so the module's
    # reference is this run's too (one in-process reference run, not two).
    reference = reference_losses if target <= 10 else _reference(target)
    np.testing.assert_allclose([losses[s] for s in range(saved + 1, target + 1)], reference[saved:target], rtol=1e-5)


def test_one_failing_process_stops_the_launch(tmp_path, compile_cache):
    proc = _launch(tmp_path, 5000, compile_cache)
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
    env = {**_env(), "XLA_FLAGS": with_collective_timeouts(with_gpu_defaults(""), 60, 600), "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(
        [sys.executable, "-c", "import jax; print(len(jax.devices()))"], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert env["XLA_FLAGS"].count("--xla_gpu_") >= 5 and all(f"--{name}=" in env["XLA_FLAGS"] for name in COLLECTIVE_TIMEOUTS)
    assert with_gpu_defaults("--xla_gpu_enable_latency_hiding_scheduler=false").count("latency_hiding") == 1  # the user's value wins


_STOPPED_PEER = """
import os, signal, sys, time
import jax, numpy as np
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(sys.argv[1], 2, int(sys.argv[2]))
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
mesh = Mesh(np.array(jax.devices()), ("d",))
x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("d")), np.ones((1, 4), np.float32))
total = jax.jit(lambda a: a.sum(0), out_shardings=NamedSharding(mesh, P()))
total(x).block_until_ready()
if jax.process_index() == 1:
    os.kill(os.getpid(), signal.SIGSTOP)  # alive but gone: never enters the next all-reduce
start = time.monotonic()
try:
    total(x + 1).block_until_ready()
    print("NO ERROR", flush=True)
except Exception as e:
    print(f"FAILED AFTER {time.monotonic() - start:.1f} {str(e).splitlines()[0][:200]}", flush=True)
os._exit(0)  # the coordination service's shutdown would wait for the stopped peer
"""


def test_a_collective_whose_peer_is_gone_fails_within_the_stated_time():
    """The launcher's collective timeouts (sized from --hang-timeout) put first in XLA_FLAGS, even
    behind a token XLA stops reading at: process 0's all-reduce with a stopped peer fails after
    the timeout (5 s here), not XLA's 30 minutes."""
    flags = with_collective_timeouts("--xla_force_host_platform_device_count=1 intra_op_parallelism_threads=1", 5, 60)
    env = {**_env(), "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}
    address = f"127.0.0.1:{free_port()}"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _STOPPED_PEER, address, str(i)], env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
        )
        for i in range(2)
    ]
    try:
        out = procs[0].communicate(timeout=120)[0]
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    line = next(x for x in out.splitlines() if x.startswith(("FAILED AFTER", "NO ERROR")))
    assert line.startswith("FAILED AFTER") and "Timed out" in line, line
    assert 4.5 <= float(line.split()[2]) < 30, line
