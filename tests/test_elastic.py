"""The elastic launcher: which process counts a run can use (pure Python), bad input
(one line, exit 2, nothing started), a run that loses a process and shrinks 4 -> 2 then
grows back to 4 through --nproc-file with every step's loss unchanged, and a failure
that leaves fewer than --min-nproc. Every process started here is cleaned up."""

import contextlib
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

import jaxdist.launch as launch
from jaxdist.cluster import elastic_launch, launcher
from jaxdist.cluster.elastic import NprocFile, fit_problem, largest_usable
from jaxdist.config import load_config
from jaxdist.layout.mesh import parse_mesh
from jaxdist.training.checkpoint import checkpoint_steps
from jaxdist.training.preemption import EXIT_PREEMPTED
from jaxdist.training.run import run

from helpers import SMALL_TEXT, TINY, checked_goodput, membership_changes, subprocess_env

pytestmark = pytest.mark.heavy

MESH = "data=-1,tensor=2"  # 2 devices per process: data = nproc; 3 does not divide the batch of 8
STEPS = 20
OVERRIDES = (*TINY, *SMALL_TEXT, "train.global_batch=8", f"train.steps={STEPS}", "checkpoint.every_steps=4")


def _config(mesh: str = MESH, *extra: str):
    return load_config(None, [*OVERRIDES, f"parallel.mesh={mesh}", *extra])


# --- which counts fit (no processes) ---


def test_largest_usable_count_skips_one_the_batch_cannot_split():
    config = _config()
    assert largest_usable(config, 2, 2, 3, resuming=False) == 2  # data=3 does not divide 8
    assert largest_usable(config, 2, 1, 4, resuming=False) == 4
    assert largest_usable(config, 2, 3, 3, resuming=False) is None  # min not reachable
    assert "divisible by replica x data x fsdp x expert (3)" in fit_problem(config, 3, 2, resuming=False)


def test_a_mesh_without_a_remaining_axis_fits_only_its_own_size():
    config = _config("data=2,tensor=2")
    assert [n for n in range(1, 5) if fit_problem(config, n, 2, resuming=False) is None] == [2]
    assert largest_usable(config, 2, 3, 4, resuming=False) is None
    assert "uses 4 devices, not 6" in fit_problem(config, 3, 2, resuming=False)


def test_microbatches_adapt_only_when_resuming():
    config = _config("data=-1", "train.microbatches=4")  # 1 device per process
    assert fit_problem(config, 4, 1, resuming=False) is not None  # 8 / (4 x 4) does not divide
    assert fit_problem(config, 4, 1, resuming=True) is None  # resume lowers the microbatches to 2
    assert fit_problem(config, 16, 1, resuming=True) is not None  # but never below one example per shard


def test_nproc_file_reports_each_rewrite_and_warns_once(tmp_path, capsys):
    path = tmp_path / "nproc"
    path.write_text("4\n")
    watched = NprocFile(path)
    assert watched.changed() == 4
    assert watched.changed() is None  # not rewritten
    path.write_text("4\n")
    os.utime(path, ns=(time.time_ns(), time.time_ns() + 10**9))  # a rewrite of the same value counts
    assert watched.changed() == 4
    path.write_text("three")
    assert watched.changed() is None and watched.changed() is None
    path.write_text("0")
    assert watched.changed() is None
    warnings = capsys.readouterr().err.strip().splitlines()
    assert len(warnings) == 2 and "holds 'three', not a positive integer" in warnings[0], warnings
    assert NprocFile(tmp_path / "missing").changed() is None
    assert "cannot read --nproc-file" in capsys.readouterr().err


def _planned(tmp_path, *flags: str) -> elastic_launch.Elastic:
    argv = ["--nproc", "4", "--min-nproc", "2", "--devices-per-proc", "2", *flags, "--", "--mesh", MESH, *OVERRIDES]
    return elastic_launch.Elastic(launch.elastic_plan(launch.parse_args([*argv, "--run-dir", str(tmp_path / "run")])))


def test_each_failure_loses_a_slot_until_min_or_the_restarts_run_out(tmp_path, capsys):
    """The default mode (--recovery restart): a dead process's slot is lost."""
    killed = launcher.Ended("failure", 137, rank=3, raw_code=-signal.SIGKILL)
    elastic = _planned(tmp_path)
    assert elastic._next_count(killed, 4) == 2  # 3 cannot split the batch
    assert elastic._next_count(killed, 2) is None
    assert capsys.readouterr().err.strip() == (
        "jaxdist: error: 1 process left, --min-nproc 2 cannot be met; the run stopped before its first checkpoint: rerun to start it again"
    )
    elastic = _planned(tmp_path, "--max-restarts", "0")
    assert elastic._next_count(killed, 4) is None
    assert "rank 3 was killed by SIGKILL and --max-restarts 0 are used up" in capsys.readouterr().err


def test_survivors_that_die_before_a_step_past_their_recovery_restart_without_losing_their_slots(tmp_path, capsys):
    """--recovery in-process, 4 processes: rank 3 is killed at step 5 and the others are told to
    recover; they die before any starts step 6 (the recovery came while they compiled). That is a
    failed recovery: one restart, on the set's 4 slots (a dead process is replaced, as it would
    have rejoined the recovery), not 1 slot lost per death until --min-nproc cannot be met. A
    death before every process has started its first step is a restart at once (recovery runs
    inside a step)."""
    from jaxdist.cluster.heartbeat import beat_path

    class Set:
        lost: set[int] = set()
        replaced: set[int] = set()  # no replacement rejoining
        beats, first_id, nproc = tmp_path, 0, 4

    def beats(*steps):
        for rank, step in enumerate(steps):
            beat_path(tmp_path, rank).write_text(f"{step}")

    def planned():
        flags = ["--nproc", "4", "--min-nproc", "2", "--devices-per-proc", "1", "--recovery", "in-process", "--max-restarts", "10"]
        argv = [*flags, "--", "--mesh", "data=-1", *OVERRIDES, "--run-dir", str(tmp_path / "run")]
        return elastic_launch.Elastic(launch.elastic_plan(launch.parse_args(argv)))

    elastic = planned()
    killed = launcher.Ended("failure", 137, rank=3, raw_code=-signal.SIGKILL, failed=[(3, -signal.SIGKILL)])
    beats(5, 5)  # ranks 2 and 3 still start: no live_devices to recover in yet
    assert not elastic._recovers_in_process(Set, killed, 4) and Set.lost == set()
    assert "before every process had started its first step: the run restarts" in capsys.readouterr().err
    beats(5, 5, 5, 5)
    assert elastic._recovers_in_process(Set, killed, 4) and Set.lost == {3}
    aborted = launcher.Ended("failure", 134, rank=2, raw_code=-signal.SIGABRT, failed=[(2, -signal.SIGABRT)])
    assert not elastic._recovers_in_process(Set, aborted, 4)
    assert "the in-process recovery did not get under way (rank 2 was killed by SIGABRT): restarting" in capsys.readouterr().err
    assert elastic._next_count(aborted, 4 - len(Set.lost)) == 4 and elastic.capacity == 4 and elastic.restarts == 1
    assert elastic._next_count(killed, 4) == 4  # a later death in a step: a restart, still on every slot
    # once a survivor starts a later step the recovery worked: a death then is a lost slot again
    elastic = planned()
    Set.lost = set()
    beats(5, 5, 5, 5)
    assert elastic._recovers_in_process(Set, killed, 4)
    beats(7, 7, 7, 5)
    assert elastic._recovers_in_process(Set, aborted, 4) and Set.lost == {2, 3} and elastic.capacity == 2


def test_rank_0_dying_with_a_survivor_s_exit_seen_in_the_same_poll_says_why_once(tmp_path, capsys):
    """--recovery in-process: rank 0 killed in a step takes the coordination service, and a survivor
    may exit (78) before the launcher's next poll: either way the run restarts, with one line
    saying rank 0's death is why (the exit alone said nothing)."""
    from jaxdist.cluster.heartbeat import beat_path

    class Set:
        lost: set[int] = set()
        replaced: set[int] = set()
        beats, first_id, nproc = tmp_path, 0, 3

    for rank in range(3):
        beat_path(tmp_path, rank).write_text("6")
    flags = ["--nproc", "3", "--min-nproc", "2", "--devices-per-proc", "1", "--recovery", "in-process"]
    argv = [*flags, "--", "--mesh", "data=-1", *OVERRIDES, "--run-dir", str(tmp_path / "run")]
    elastic = elastic_launch.Elastic(launch.elastic_plan(launch.parse_args(argv)))
    both = launcher.Ended("failure", 78, rank=1, raw_code=78, failed=[(1, 78), (0, -signal.SIGKILL)])
    assert not elastic._recovers_in_process(Set, both, 3)
    line = "rank 0 was killed by SIGKILL: it holds the coordination service, so the run restarts from its last checkpoint"
    assert capsys.readouterr().err.count(line) == 1
    alone = launcher.Ended("failure", 137, rank=0, raw_code=-signal.SIGKILL, failed=[(0, -signal.SIGKILL)])
    assert not elastic._recovers_in_process(Set, alone, 3)
    assert capsys.readouterr().err.count(line) == 1


def test_a_death_while_a_replacement_rejoins_restarts_at_once(tmp_path, capsys):
    """--recovery in-process: rank 1's replacement is still rejoining (started, no step of its
    own yet) when it, or a live process, dies. The live processes wait for it at the grow's
    barrier, which no death interrupts: a restart at once, not a recovery they cannot start."""
    from jaxdist.cluster.heartbeat import beat_path

    class Set:
        lost: set[int] = set()
        replaced = {1}
        beats, first_id, nproc = tmp_path, 0, 3

    for rank in (0, 2):  # the replacement's beat file is gone until its own first step
        beat_path(tmp_path, rank).write_text("9 1")
    flags = ["--nproc", "3", "--min-nproc", "1", "--devices-per-proc", "1", "--recovery", "in-process", "--max-restarts", "10"]
    argv = [*flags, "--", "--mesh", "data=-1", *OVERRIDES, "--run-dir", str(tmp_path / "run")]
    for dead in (1, 2):
        elastic = elastic_launch.Elastic(launch.elastic_plan(launch.parse_args(argv)))
        ended = launcher.Ended("failure", 137, rank=dead, raw_code=-signal.SIGKILL, failed=[(dead, -signal.SIGKILL)])
        assert not elastic._recovers_in_process(Set, ended, 3) and Set.lost == set()
        said = f"rank {dead} was killed by SIGKILL while rank 1's replacement was rejoining: the run restarts from its last checkpoint"
        assert said in capsys.readouterr().err
    beat_path(tmp_path, 1).write_text("10 10")  # its first step: it has rejoined, a death is recovered again
    ended = launcher.Ended("failure", 137, rank=2, raw_code=-signal.SIGKILL, failed=[(2, -signal.SIGKILL)])
    assert elastic_launch.Elastic(launch.elastic_plan(launch.parse_args(argv)))._recovers_in_process(Set, ended, 3)


def test_survivors_stuck_off_a_step_boundary_after_a_death_restart_once_the_bound_passes(tmp_path, capsys, monkeypatch):
    """--recovery in-process: rank 2 dies while the others wait in an Orbax save's barrier for it
    (seen in a random-kill run: no error ever comes, the run sat there). Until the bound they are
    given time; a survivor that entered the recovery (its recovering-R file) or started a later
    step is progress; with neither by the bound, one line and a restart that keeps the slots."""
    import os

    from jaxdist.cluster.heartbeat import beat_path
    from jaxdist.cluster.recoverable import recovering_path

    class Set:
        lost: set[int] = set()
        replaced: set[int] = set()
        beats, first_id, nproc = tmp_path, 0, 3
        killed = False

        def kill_all(self):
            self.killed = True

    def beats(*steps):
        for rank, step in enumerate(steps):
            beat_path(tmp_path, rank).write_text(f"{step}")

    flags = ["--nproc", "3", "--min-nproc", "2", "--devices-per-proc", "1", "--recovery", "in-process", "--max-restarts", "10"]
    argv = [*flags, "--", "--mesh", "data=-1", *OVERRIDES, "--run-dir", str(tmp_path / "run")]
    died = launcher.Ended("failure", 137, rank=2, raw_code=-signal.SIGKILL, failed=[(2, -signal.SIGKILL)])
    clock = [1000.0]
    monkeypatch.setattr(elastic_launch.time, "monotonic", lambda: clock[0])
    for progress in ("none", "recovering", "later step"):
        gen, elastic = Set(), elastic_launch.Elastic(launch.elastic_plan(launch.parse_args(argv)))
        Set.lost = set()
        beats(9, 9, 9)
        assert elastic._recovers_in_process(gen, died, 3)
        bound = 2 * 10 + elastic_launch.RECOVERY_START_GRACE_S  # --peer-timeout 10
        clock[0] += bound - 1
        assert not elastic._recovery_stuck(gen)  # still within the bound
        if progress == "recovering":
            with open(recovering_path(tmp_path, 1), "w") as f:
                f.write("9\n")
            os.utime(recovering_path(tmp_path, 1))
        elif progress == "later step":
            beats(10, 9, 9)
        clock[0] += 2
        assert elastic._recovery_stuck(gen) == (progress == "none"), progress
        if progress == "none":
            ended = elastic._restart_stuck_recovery(gen)
            assert gen.killed and (ended.kind, ended.rank, ended.raw_code) == ("failure", 2, -signal.SIGKILL)
            said = capsys.readouterr().err
            assert "the survivors of rank 2's death reached no step boundary in 80s" in said, said
            elastic._next_count(ended, 3 - len(Set.lost))
            assert elastic.capacity == 3 and elastic.restarts == 1  # one restart (the recovery counted it), the slots kept
        for path in tmp_path.glob("recovering-*"):
            path.unlink()


def test_a_save_for_the_file_picks_the_largest_usable_count(tmp_path):
    elastic = _planned(tmp_path, "--nproc-file", str(tmp_path / "nproc"))
    saved = launcher.Ended("saved", EXIT_PREEMPTED, raw_code=EXIT_PREEMPTED)
    elastic.capacity = 3
    assert elastic._next_count(saved, 4) == 2 and elastic.restarts == 0  # asked for: not a restart
    elastic.capacity = 1
    assert elastic._next_count(saved, 2) is None


# --- bad input: one line, exit 2, nothing started (in-process; starting a process fails the test) ---

BAD = {
    "min above nproc": (["--nproc", "4", "--min-nproc", "5", "--devices-per-proc", "2"], "--min-nproc must be from 1 to --nproc (4)"),
    "min zero": (["--nproc", "4", "--min-nproc", "0", "--devices-per-proc", "2"], "--min-nproc must be from 1"),
    "file without min": (["--nproc", "4", "--nproc-file", "F", "--devices-per-proc", "2"], "need --min-nproc"),
    "no devices per proc": (["--nproc", "4", "--min-nproc", "2"], "needs --devices-per-proc"),
    "negative restarts": (
        ["--nproc", "4", "--min-nproc", "2", "--devices-per-proc", "2", "--max-restarts", "-1"],
        "--max-restarts must be",
    ),
    "first count does not fit": (["--nproc", "3", "--min-nproc", "2", "--devices-per-proc", "2"], "--nproc 3 cannot run this training"),
    "auto mesh": (["--nproc", "2", "--min-nproc", "1", "--devices-per-proc", "2", "--", "--mesh", "auto"], "--mesh auto cannot be sized"),
    "bad train args": (["--nproc", "2", "--min-nproc", "1", "--devices-per-proc", "2", "--", "model.n_layer=2"], "unknown config key"),
}


@pytest.fixture
def no_processes(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the launcher started a process")

    monkeypatch.setattr(launcher.subprocess, "Popen", refuse)


@pytest.mark.parametrize("case", BAD, ids=list(BAD))
def test_bad_input_is_one_line_and_exit_2(case, tmp_path, capsys, no_processes):
    flags, message = BAD[case]
    train = flags[flags.index("--") + 1 :] if "--" in flags else []
    flags = flags[: flags.index("--")] if "--" in flags else flags
    argv = [*flags, "--", "--mesh", MESH, *OVERRIDES, "--run-dir", str(tmp_path / "run"), *train]
    assert launch.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert not (tmp_path / "run").exists()


def test_a_file_below_min_at_launch_starts_nothing(tmp_path, capsys, no_processes):
    (tmp_path / "nproc").write_text("1")
    argv = ["--nproc", "4", "--min-nproc", "2", "--devices-per-proc", "2", "--nproc-file", str(tmp_path / "nproc")]
    assert launch.main([*argv, "--", "--mesh", MESH, *OVERRIDES, "--run-dir", str(tmp_path / "run")]) == EXIT_PREEMPTED
    assert "--nproc-file says 1 process, --min-nproc 2 cannot be met; nothing started" in capsys.readouterr().err


# --- real runs on loopback ---


@pytest.fixture(scope="module")
def compile_cache(tmp_path_factory):
    """One XLA cache for the runs below: the 2-process program compiles once."""
    return tmp_path_factory.mktemp("xla_cache")


@pytest.fixture
def launched():
    started: list[subprocess.Popen] = []

    def start(run_dir: Path, nproc: int, *flags: str, cache: Path) -> subprocess.Popen:
        cmd = [sys.executable, "-m", "jaxdist.launch", "--nproc", str(nproc), "--devices-per-proc", "2", *flags]
        cmd += ["--", "--mesh", MESH, "--run-dir", str(run_dir), *OVERRIDES, f"train.compile_cache={cache}"]
        env = subprocess_env()
        with open(run_dir.parent / f"{run_dir.name}.log", "w") as log:
            proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        started.append(proc)
        return proc

    yield start
    for proc in started:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


def _wait_for(predicate, proc: subprocess.Popen, timeout: float, what: str) -> float:
    """Seconds until ``predicate()``; fails if the launcher exits first or time runs out."""
    start = time.monotonic()
    while not predicate():
        assert proc.poll() is None, f"the launcher exited ({proc.returncode}) before: {what}"
        assert time.monotonic() - start < timeout, f"not within {timeout}s: {what}"
        time.sleep(0.1)
    return time.monotonic() - start


def _kill_rank(launcher: subprocess.Popen, rank: int) -> psutil.Process:
    trainers = psutil.Process(launcher.pid).children()
    (victim,) = [p for p in trainers if p.environ().get("JAXDIST_PROCESS_ID") == str(rank)]
    victim.kill()
    return victim


def _log(run_dir: Path) -> str:
    return (run_dir.parent / f"{run_dir.name}.log").read_text()


def _metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [json.loads(line) for line in lines if line.strip().endswith("}") and '"loss"' in line]  # the training lines


def test_a_failure_below_min_stops_at_the_last_checkpoint(tmp_path, launched, compile_cache):
    run_dir = tmp_path / "run"
    proc = launched(run_dir, 2, "--min-nproc", "2", cache=compile_cache)
    _wait_for(lambda: checkpoint_steps(run_dir / "checkpoints"), proc, 240, "the first checkpoint")
    _kill_rank(proc, 1)
    killed_at = time.monotonic()
    proc.wait(timeout=30)
    took = time.monotonic() - killed_at
    out = _log(run_dir)
    assert proc.returncode == 128 + signal.SIGKILL, out[-3000:]
    assert took < 30
    step = checkpoint_steps(run_dir / "checkpoints")[-1]  # nothing was deleted
    line = f"jaxdist: error: 1 process left, --min-nproc 2 cannot be met; the run stopped at its last checkpoint (step {step}): rerun to resume"
    assert line in out.splitlines(), out[-3000:]
    assert [c["reason"] for c in membership_changes(run_dir)] == ["start"]


def test_shrinks_on_a_failure_and_grows_back_with_the_same_losses(tmp_path, launched, compile_cache):
    run_dir, nproc_file = tmp_path / "run", tmp_path / "nproc"
    nproc_file.write_text("4\n")
    proc = launched(run_dir, 4, "--min-nproc", "2", "--nproc-file", str(nproc_file), cache=compile_cache)
    _wait_for(lambda: checkpoint_steps(run_dir / "checkpoints"), proc, 240, "the first checkpoint")
    _kill_rank(proc, 3)
    _wait_for(lambda: len(membership_changes(run_dir)) == 2, proc, 60, "the relaunch with 2 processes")
    logged = len(_metrics(run_dir))
    _wait_for(lambda: len(_metrics(run_dir)) > logged, proc, 120, "a step by 2 processes")
    nproc_file.write_text("4\n")  # the same value again: a rewrite means "4 are available now"
    proc.wait(timeout=240)
    out = _log(run_dir)
    assert proc.returncode == 0, out[-3000:]

    start, failure, grow = membership_changes(run_dir)
    assert (start["reason"], start["from"], start["to"]) == ("start", None, 4)
    assert (failure["reason"], failure["from"], failure["to"], failure["failed_rank"]) == ("failure", 4, 2, 3), failure
    assert failure["exit_code"] == -signal.SIGKILL and failure["mesh"] == "data=2,tensor=2"
    assert (grow["reason"], grow["from"], grow["to"], grow["exit_code"]) == ("grow", 2, 4, EXIT_PREEMPTED), grow
    assert 4 <= failure["step"] < grow["step"] < STEPS
    assert f"jaxdist: elastic: 4 -> 2 processes, resuming at step {failure['step']}" in out
    assert f"jaxdist: elastic: 2 -> 4 processes, resuming at step {grow['step']}" in out
    assert f"resumed from step {grow['step']}" in out and f"done at step {STEPS}" in out

    # Every logged step (re-run steps twice) has the uninterrupted run's loss.
    reference = run(load_config(None, list(OVERRIDES)), parse_mesh("tensor=2"), None, devices=jax.devices()[:2], progress=False).losses
    logged = [(m["step"], m["loss"]) for m in _metrics(run_dir) if "loss" in m]
    assert {s for s, _ in logged} == set(range(1, STEPS + 1))
    np.testing.assert_allclose([loss for _, loss in logged], [reference[s - 1] for s, _ in logged], rtol=1e-4)
    # goodput.json accounts for the three sets' wall time (the steps trained again after the kill, if
    # it came after a logged step past the checkpoint, are retrained: checked_goodput counts them)
    accounted = checked_goodput(run_dir, STEPS)
    assert accounted["restarts"] == 2 and accounted["seconds"]["lost"] > 0 and accounted["seconds"]["compile"] > 0, accounted
