"""In-process recovery (``jaxdist.launch --recovery in-process``): the survivors of a SIGKILL go
on from the failed step without a restart, a replacement rejoins and the run grows back, with
the uninterrupted run's losses; process 0's death takes the restart path; the JAX pieces it
relies on are checked by name."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import psutil
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxdist.launch as launch
from jaxdist.cluster import recoverable
from jaxdist.config import load_config
from jaxdist.layout.mesh import parse_mesh
from jaxdist.training.recovery import reshard_from_survivors
from jaxdist.training.run import run

from helpers import SMALL_TEXT, TINY, checked_goodput, membership_changes, subprocess_env

STEPS = 12
OVERRIDES = (*TINY, *SMALL_TEXT, "train.global_batch=6", f"train.steps={STEPS}", "checkpoint.every_steps=4")
GROW_STEPS = 24
HOLD_STEP = 14  # the live processes wait before this step until the replacement has rejoined (a fault hook, not a guess)
GROW_OVERRIDES = (*TINY, *SMALL_TEXT, "train.global_batch=6", f"train.steps={GROW_STEPS}", "checkpoint.every_steps=8")
TAG = "JAXDIST_TEST_RECOVERY_RUN"  # marks every process a test run starts (Grain workers included)
LAUNCH = ["--nproc", "3", "--min-nproc", "2", "--devices-per-proc", "1", "--recovery", "in-process", "--peer-timeout", "10"]


def test_the_jax_pieces_in_process_recovery_relies_on_are_there():
    """Experimental and private JAX names (jax 0.10): a JAX that moves them fails here, loudly."""
    assert recoverable.check_jax_pieces() == []
    from jax._src.lib import _jax

    client = _jax.DistributedRuntimeClient
    for method in ("wait_at_barrier", "key_value_set_bytes", "blocking_key_value_get_bytes"):
        assert hasattr(client, method), method
    assert "process_ids" in (client.wait_at_barrier.__doc__ or ""), client.wait_at_barrier.__doc__


def test_resharding_from_the_survivors_keeps_every_value_and_counts_what_only_the_dead_held():
    """A state replicated over ``data`` rebuilds on half the devices from the shards held; one
    split 8 ways cannot be cut 4 ways from eighths (those quarters were nowhere whole)."""
    devices = jax.devices()
    values = np.arange(8 * 6, dtype=np.float32).reshape(8, 6)
    old = Mesh(np.array(devices).reshape(2, 4), ("data", "fsdp"))
    new = Mesh(np.array(devices[:4]).reshape(1, 4), ("data", "fsdp"))
    replicated = jax.device_put(values, NamedSharding(old, P("fsdp")))
    moved, missing = reshard_from_survivors({"w": replicated}, {"w": NamedSharding(new, P("fsdp"))})
    assert missing == 0
    np.testing.assert_array_equal(np.asarray(moved["w"]), values)
    assert set(moved["w"].sharding.device_set) == set(devices[:4])

    eighths = jax.device_put(values, NamedSharding(Mesh(np.array(devices), ("fsdp",)), P("fsdp")))
    _, missing = reshard_from_survivors({"w": eighths}, {"w": NamedSharding(new, P("fsdp"))})
    assert missing == 4


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--nproc", "3"], "--recovery in-process needs an elastic launch (--min-nproc M)"),
        (["--nproc", "3", "--min-nproc", "2", "--devices-per-proc", "2"], "--recovery in-process needs --devices-per-proc 1, got 2"),
        (["--nnodes", "1:2", "--rdzv", "etcd://127.0.0.1:2379", "--rdzv-id", "r"], "--recovery in-process is for processes on one machine"),
        (
            ["--nproc", "3", "--min-nproc", "2", "--devices-per-proc", "1", "--peer-timeout", "nan"],
            "--peer-timeout must be a finite number",
        ),
    ],
    ids=["not elastic", "two devices each", "across nodes", "nan timeout"],
)
def test_bad_recovery_flags_are_one_line_and_start_nothing(flags, message, tmp_path, capsys):
    assert launch.main([*flags, "--recovery", "in-process", "--", "--run-dir", str(tmp_path / "run"), *OVERRIDES]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert not (tmp_path / "run").exists()


def test_a_peer_timeout_without_in_process_recovery_says_it_has_no_effect(capsys):
    launch.parse_args(["--nproc", "2", "--peer-timeout", "3", "--", "--steps", "1"])
    assert "--peer-timeout 3 has no effect with --recovery restart" in capsys.readouterr().err


def test_a_recovered_process_exits_past_threads_blocked_on_the_dead_peer(tmp_path):
    """An Orbax save the dead process took part in leaves a thread in a barrier that waits for
    it: the run's end must not join it (the CI hang), and still runs the exit handlers."""
    script = f"""
import atexit, logging, sys, threading
from pathlib import Path
from jaxdist.training.recovery import leave_past_abandoned_saves
logging.basicConfig(level=logging.INFO, format="%(message)s")
atexit.register(lambda: Path({str(tmp_path / "handlers-ran")!r}).touch())
threading.Thread(target=threading.Event().wait, name="async_save").start()  # never returns
leave_past_abandoned_saves(0)
sys.exit(3)  # not reached
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "exiting past the threads of a save abandoned at the recovery, still waiting for the dead process: async_save" in done.stderr
    assert (tmp_path / "handlers-ran").exists()


# --- real runs: 3 processes on loopback ---


@pytest.fixture(scope="module")
def reference_losses():
    """The uninterrupted run on one device: batch k is a function of k, whatever the process count."""
    config = load_config(None, list(OVERRIDES))
    return run(config, parse_mesh("data=1"), None, devices=jax.devices()[:1], progress=False).losses


def _launch(run_dir: Path, kill: str, *extra: str, timeout: float = 420) -> subprocess.CompletedProcess:
    env = {**subprocess_env(), "JAXDIST_FAULT_KILL_AT": kill, TAG: str(run_dir)}
    cmd = [sys.executable, "-m", "jaxdist.launch", *LAUNCH, "--", "--mesh", "data=-1", "--run-dir", str(run_dir), *OVERRIDES, *extra]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, start_new_session=True)


def _left_behind(tag: str, within_s: float = 30.0) -> list[psutil.Process]:
    """The processes started with ``tag`` in their environment still running after ``within_s``."""
    deadline = time.monotonic() + within_s
    while True:
        alive = []
        for proc in psutil.process_iter():
            try:
                if proc.environ().get(TAG) == tag and proc.status() != psutil.STATUS_ZOMBIE:
                    alive.append(proc)
            except (psutil.AccessDenied, psutil.NoSuchProcess):
                continue
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.5)


def _records(run_dir: Path, name: str) -> list[dict]:
    path = run_dir / name
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def _logged_losses(run_dir: Path) -> list[tuple[int, float]]:
    return [(m["step"], m["loss"]) for m in _records(run_dir, "metrics.jsonl") if "loss" in m]


@pytest.fixture(scope="module")
def grown_reference_losses():
    config = load_config(None, list(GROW_OVERRIDES))
    return run(config, parse_mesh("data=1"), None, devices=jax.devices()[:1], progress=False).losses


@pytest.mark.heavy
def test_a_killed_process_is_recovered_in_process_then_replaced_with_the_uninterrupted_losses(tmp_path, grown_reference_losses):
    """With a Grain worker per process (data.workers=1): its data stream is rebuilt at the failed
    step and again where the replacement rejoins; the checkpoints after the rejoin are saved by
    all three (Orbax's save count carried over to the replacement). The survivors wait before
    HOLD_STEP until the replacement has joined (JAXDIST_FAULT_HOLD_FOR_REJOIN): on a loaded
    machine its start-up once took longer than the rest of the run, which then ended without it."""
    rank, step = random.choice([1, 2]), random.randint(3, 8)  # a SIGKILL of process 1 or 2 at a random step
    run_dir = tmp_path / "run"
    env = {
        **subprocess_env(),
        "JAXDIST_FAULT_KILL_AT": f"{rank}:{step}",
        "JAXDIST_FAULT_HOLD_FOR_REJOIN": str(HOLD_STEP),
        TAG: str(run_dir),
    }
    cmd = [
        sys.executable,
        "-m",
        "jaxdist.launch",
        *LAUNCH,
        "--",
        "--mesh",
        "data=-1",
        "--run-dir",
        str(run_dir),
        *GROW_OVERRIDES,
        "data.workers=1",
    ]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=420, start_new_session=True)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    assert f"rank {rank} was killed by SIGKILL; the other 2 recover in-process (--recovery in-process)" in out, out[-4000:]
    assert f"elastic: 3 -> 2 processes in-process, continuing at step {step}" in out, out[-4000:]
    assert f"starting a replacement for rank {rank}; it rejoins the live processes at their next step" in out, out[-4000:]
    assert "resumed from step" not in out  # no restart, no checkpoint read

    start, recovery, rejoin = membership_changes(run_dir)
    assert start["reason"] == "start"
    assert (recovery["reason"], recovery["from"], recovery["to"], recovery["failed_rank"], recovery["step"]) == (
        "in-process",
        3,
        2,
        rank,
        step - 1,
    )
    assert recovery["mesh"] == "data=2"
    assert set(recovery["seconds"]) == {"detect", "agree", "reshard", "recompile", "first_step"}
    # the survivors' step for data=2 was compiled in the background after the first step: taken, not compiled
    assert recovery["compiled_ahead"] is True and ", the step compiled ahead in " in out, out[-4000:]
    assert (rejoin["reason"], rejoin["from"], rejoin["to"], rejoin["joined_rank"], rejoin["mesh"]) == ("rejoin", 2, 3, rank, "data=3")
    assert step <= rejoin["step"] < HOLD_STEP  # joined at a boundary after the recovery, by the hold at the latest
    assert set(rejoin["seconds"]) == {"wait", "broadcast", "recompile", "first_step"}
    assert rejoin["compiled_ahead"] is True  # data=3 in the order process 0 chose, compiled once data=2 ran
    assert f"elastic: 2 -> 3 processes, process {rank} rejoined; continuing at step {rejoin['step'] + 1} on mesh data=3" in out

    logged = _logged_losses(run_dir)
    assert [s for s, _ in logged] == list(range(1, GROW_STEPS + 1)), logged  # every step once: none missing, none trained twice
    np.testing.assert_allclose([loss for _, loss in logged], grown_reference_losses, rtol=1e-5)
    saved = sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())
    assert saved[-1] == GROW_STEPS
    assert len(list((run_dir / "checkpoints" / str(GROW_STEPS) / "data").glob("process_*-of-3.json"))) == 3  # the replacement saved too
    assert _left_behind(str(run_dir)) == []  # no trainer, replacement or Grain worker outlives the run
    accounted = checked_goodput(run_dir, GROW_STEPS)  # one set throughout: nothing retrained, nothing lost to a restart
    assert (accounted["restarts"], accounted["recoveries"], accounted["steps"]["retrained"]) == (0, 1, 0), accounted
    assert accounted["seconds"]["recovery"] > 0 and accounted["seconds"]["rejoin"] > 0 and accounted["seconds"]["lost"] == 0, accounted


def test_device_groups_are_every_axis_subsets_rows_in_mesh_order():
    """Counted by hand for a 2x2 mesh: rows, columns and the whole mesh, each in the mesh's order."""
    ids = np.array([[4, 1], [3, 2]])
    assert recoverable.device_groups(ids) == {(4, 1), (3, 2), (4, 3), (1, 2), (4, 1, 3, 2)}


def test_a_grown_mesh_order_repeats_no_group_of_a_rejoined_process():
    """3 devices in a line: the first mesh's group (0, 1, 2) had device 1, which rejoins; any
    rotation but the first is new. With 2 devices and both orders used, none is: None (a restart)."""
    devices = [type("Device", (), {"id": i})() for i in range(3)]
    order = recoverable.fresh_device_order(devices, [3], {(0, 1, 2)}, joined={1})
    assert order is not None and tuple(d.id for d in order) != (0, 1, 2)
    assert recoverable.fresh_device_order(devices, [3], {(0, 1, 2)}, joined=set()) == devices  # nobody rejoined: as they are
    assert recoverable.fresh_device_order(devices[:2], [2], {(0, 1), (1, 0)}, joined={1}) is None
    grid = recoverable.fresh_device_order(devices + [type("Device", (), {"id": 3})()], [2, 2], {(0, 1), (2, 3), (0, 2), (1, 3)}, joined={3})
    ids = np.array([d.id for d in grid]).reshape(2, 2)
    assert not {g for g in recoverable.device_groups(ids) if 3 in g} & {(0, 1), (2, 3), (0, 2), (1, 3)}


# Deaths in every phase under --recovery in-process, each reached by the fault hook (not a race),
# several per run: each kill fires once (a kill that comes while the set is already going down
# fires in the restarted set). A death before every process's first step, in a recovery or
# rejoin under way, off a step boundary, or of rank 0 restarts; one in a step recovers
# in-process. Each run ends 0 on the uninterrupted losses with nothing left running. Between
# them rank 0 and a rank other than 0 die in each phase.
PHASE_RUNS = {
    # restarts only (no replacement ever rejoining when one of the last three dies)
    "starts-compiles-then-rank-0-step-rank-1-save-rank-2-eval": "1:0:start,0:0:start,2:0:compile,0:0:compile,0:6,1:8:save,2:12:eval",
    "inits-then-a-first-step": "0:0:init,2:0:init,1:1:step",
    "recovery-under-way-then-rank-0-eval-and-gather": "1:5,2:5:recovery,0:8:eval,0:10:gather",
    "replacement-dies-rejoining-then-gather-and-rank-0-save": "1:5,1:*:rejoin,1:10:gather,0:12:save",
    "rank-0-dies-in-a-rejoin-then-in-a-recovery": "1:5,0:*:rejoin,2:10,0:10:recovery",
}


@pytest.mark.heavy
@pytest.mark.parametrize("kills", PHASE_RUNS.values(), ids=PHASE_RUNS.keys())
def test_a_death_in_any_phase_recovers_or_restarts_and_ends_on_the_uninterrupted_losses(kills, tmp_path, reference_losses):
    run_dir = tmp_path / "run"
    env = {**subprocess_env(), "JAXDIST_FAULT_KILL_AT": kills, "JAXDIST_FAULT_KILL_ONCE": str(tmp_path / "killed"), TAG: str(run_dir)}
    env["JAXDIST_FAULT_HOLD_FOR_REJOIN"] = "8"  # after a recovery, the live processes wait for its replacement before step 8
    launch_flags = [*LAUNCH, "--max-restarts", "10"]
    extra = ["train.straggler_window=5"]  # a straggler window's gather at steps 5 and 10
    if ":eval" in kills:
        extra += ["train.eval_every=4", "train.eval_batches=1"]
    cmd = [sys.executable, "-m", "jaxdist.launch", *launch_flags, "--", "--mesh", "data=-1", "--run-dir", str(run_dir), *OVERRIDES, *extra]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, start_new_session=True)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    fired = [x for x in out.splitlines() if "fault injection (JAXDIST_FAULT_KILL_AT)" in x]
    assert len(fired) == len(kills.split(",")) == len(list(tmp_path.glob("killed.*"))), out[-4000:]  # every kill landed, once
    assert "Traceback" not in out and "Check failure" not in out, out[-4000:]
    changes = membership_changes(run_dir)
    assert {c["reason"] for c in changes} <= {"start", "in-process", "rejoin", "failure"}, changes
    # a recovery or a restart for each death; one restart for a death and the recovery it cut short
    assert 1 <= sum(c["reason"] in ("in-process", "failure") for c in changes) <= len(fired), changes
    assert all(c["to"] == 3 for c in changes if c["reason"] == "failure"), changes  # a restart keeps the set's slots
    logged = dict(_logged_losses(run_dir))  # a restart runs the steps since its checkpoint again: the last of each
    assert set(logged) == set(range(1, STEPS + 1))
    np.testing.assert_allclose([logged[s] for s in range(1, STEPS + 1)], reference_losses, rtol=1e-5)
    assert _left_behind(str(run_dir)) == []
    for kill in kills.split(","):
        _check_said(kill, out, run_dir)


def _check_said(kill: str, out: str, run_dir: Path) -> None:
    """The lines a death says. Rank 0 in a step: one line, the restart. Another rank entering a
    save or an evaluation: the survivors' collectives fail outside a step, where JAX cannot
    recover in place, so each says so in one line and exits 78 for the launcher's restart, its
    traceback kept in its peer-failure file, not printed (the launcher kills the other survivor
    once the first leaves: it may not have said it yet)."""
    rank, _, phase = (kill.split(":") + ["step"])[:3]
    if rank == "0" and phase == "step":
        line = "rank 0 was killed by SIGKILL: it holds the coordination service, so the run restarts from its last checkpoint"
        assert sum(line in x for x in out.splitlines()) == 1, out[-4000:]
    elif rank != "0" and phase in ("save", "eval"):
        what = {"save": "a checkpoint save", "eval": "an evaluation"}[phase]
        lines = [x for x in out.splitlines() if f"a peer process was lost during {what} (" in x]
        said = {int(x.split("]")[0].removeprefix("[rank ")) for x in lines}
        assert said and said <= {0, 1, 2} - {int(rank)}, out[-4000:]
        assert all("leaving for the launcher's restart (exit 78)" in x for x in lines), lines
        for survivor in said:
            assert "Traceback" in (run_dir / f"peer-failure.rank-{survivor}.txt").read_text()
