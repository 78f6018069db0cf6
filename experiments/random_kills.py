"""Random kills under ``--recovery in-process`` (or the default mode): does every run still end
on the uninterrupted losses, with no process left behind?

    python experiments/random_kills.py [--kills 20] [--mode in-process] [--seed 0] [--steps 200] [--nproc 4]

One elastic run of ``--nproc`` processes (``--nproc 4 --min-nproc 1 --devices-per-proc 1 --max-restarts 100``,
``--mesh data=-1``, the tiny model on the stdlib corpus, ``data.workers=1``, a checkpoint every
3 steps) is SIGKILLed from outside at random moments, 4-15 s apart: a trainer of a random rank,
or (one kill in four) the launcher alone, after which the same command is started again, as a
scheduler would (it resumes from the run directory). A run that finishes before the kills are
spent is followed by a fresh one. After each run: its logged losses (the last logged value of
each step: a restart trains the steps since its checkpoint again) against an uninterrupted
one-device run's (rtol 1e-5), the processes it started still alive 30 s after its
launcher ended (orphans; killed then), and the Python tracebacks and C++ check failures its
output shows (the launcher's, with its processes' lines).

Per kill: what the victim was doing (``start-up`` before its first step, ``step`` once it
beats, or the ``launcher``), how the run went on (``in-process``, ``restart``, ``relaunch``
after a launcher kill, or ``none`` when it ended first), and the seconds from the kill until
the run logged a step past the furthest it had reached once the launcher had reacted to the
death (the time the kill cost).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
TAG = "JAXDIST_RANDOM_KILLS_RUN"  # marks every process a run starts (trainers, Grain workers)
TRAIN = [
    "--config",
    "tiny",
    "--mesh",
    "data=-1",
    "checkpoint.every_steps=3",
    "data.workers=1",
    "train.global_batch=12",
    "train.log_every=1",
]


def _env(run_dir: Path) -> dict[str, str]:
    env = {**os.environ, TAG: str(run_dir), "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT)}
    env.pop("XLA_FLAGS", None)  # the launcher gives each process its own devices
    return env


def _launch(args, run_dir: Path, log) -> subprocess.Popen:
    launch = ["--nproc", str(args.nproc), "--min-nproc", "1", "--devices-per-proc", "1", "--max-restarts", "100", "--recovery", args.mode]
    cmd = [sys.executable, "-m", "jaxdist.launch", *launch, "--", *TRAIN, "--steps", str(args.steps), "--run-dir", str(run_dir)]
    return subprocess.Popen(cmd, env=_env(run_dir), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _tagged(run_dir: Path) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get(TAG) == str(run_dir) and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except (psutil.AccessDenied, psutil.NoSuchProcess):
            continue
    return found


def _trainers(launcher: subprocess.Popen) -> dict[int, psutil.Process]:
    """rank -> its trainer process (the launcher's children with a process id)."""
    found = {}
    try:
        for child in psutil.Process(launcher.pid).children():
            rank = child.environ().get("JAXDIST_PROCESS_ID")
            if rank is not None and child.status() != psutil.STATUS_ZOMBIE:
                found[int(rank)] = child
    except (psutil.AccessDenied, psutil.NoSuchProcess):
        pass
    return found


def _logged(run_dir: Path) -> dict[int, float]:
    path = run_dir / "metrics.jsonl"
    losses = {}
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue  # a line cut by a kill
            if "loss" in record:
                losses[record["step"]] = record["loss"]
    return losses


def _beat_started(trainer: psutil.Process) -> bool:
    """Whether this trainer has started a step (its heartbeat file holds one)."""
    try:
        env = trainer.environ()
        beat = Path(env["JAXDIST_HEARTBEAT_DIR"]) / f"rank-{env['JAXDIST_PROCESS_ID']}"
        return bool(beat.read_text().split())
    except (OSError, KeyError, psutil.Error):
        return False


def _launcher_said(log_path: Path, offset: int) -> bool:
    """Whether the launcher wrote a line of its own (not a trainer's ``[rank R]``) since ``offset``."""
    return any(line.startswith("jaxdist: ") for line in log_path.read_text(errors="replace")[offset:].splitlines())


def _how_it_went_on(log_path: Path, offset: int) -> str:
    text = log_path.read_text()[offset:]
    if "recover in-process" in text:
        return "in-process"
    if "elastic:" in text and "resuming at step" in text:
        return "restart"
    return "none"


def _orphans(run_dir: Path, within_s: float = 30.0) -> int:
    deadline = time.monotonic() + within_s
    while (left := _tagged(run_dir)) and time.monotonic() < deadline:
        time.sleep(0.5)
    for proc in left:
        proc.kill()
    return len(left)


def reference_losses(steps: int) -> list[float]:
    script = (
        "import json, sys, jax\n"
        "from jaxdist.config import load_config\nfrom jaxdist.layout.mesh import parse_mesh\nfrom jaxdist.training.run import run\n"
        f"config = load_config('tiny', {[o for o in TRAIN[4:] if not o.startswith('data.workers')] + [f'train.steps={steps}']!r})\n"
        "print('LOSSES ' + json.dumps(run(config, parse_mesh('data=1'), None, devices=jax.devices()[:1], progress=False).losses))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], env={**_env(Path("reference")), "JAX_PLATFORMS": "cpu"}, capture_output=True, text=True, check=True
    )
    (line,) = [x for x in done.stdout.splitlines() if x.startswith("LOSSES ")]
    return json.loads(line.removeprefix("LOSSES "))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--mode", choices=("in-process", "restart"), default="in-process")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument(
        "--nproc",
        type=int,
        default=4,
        help="processes at the start (in-process needs 2 survivors; the default mode loses a slot per death)",
    )
    parser.add_argument("--out", type=Path, default=None, help="keep the runs here (default: a temporary folder)")
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    out = args.out or Path(tempfile.mkdtemp(prefix="random-kills-"))
    out.mkdir(parents=True, exist_ok=True)
    print(
        f"host: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; {args.nproc} trainer processes x 1 CPU device; "
        f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}; --recovery {args.mode}; seed {args.seed}; runs in {out}",
        flush=True,
    )
    reference = reference_losses(args.steps)
    kills, runs = [], []
    run_index = 0
    while len(kills) < args.kills:
        run_dir, run_index = out / f"run{run_index}", run_index + 1
        log_path = run_dir.with_suffix(".log")
        run = {"run": run_dir.name, "launches": 0, "orphans": 0}
        with open(log_path, "w") as log:
            launcher = None
            while True:
                if launcher is None:
                    launcher, run["launches"] = _launch(args, run_dir, log), run["launches"] + 1
                time.sleep(rng.uniform(4, 15))
                if launcher.poll() is not None or len(kills) >= args.kills:
                    break
                furthest = max(_logged(run_dir), default=0)
                trainers = _trainers(launcher)
                offset = log_path.stat().st_size
                if rng.random() < 0.25 or not trainers:
                    victim, phase = "launcher", "launcher"
                    os.kill(launcher.pid, signal.SIGKILL)
                    launcher.wait()
                    run["orphans"] += _orphans(run_dir)
                    launcher = None
                else:
                    rank = rng.choice(sorted(trainers))
                    victim, phase = f"rank {rank}", "step" if _beat_started(trainers[rank]) else "start-up"
                    trainers[rank].kill()
                killed_at = time.monotonic()
                kill = {"run": run_dir.name, "victim": victim, "phase": phase, "at_step": furthest}
                kills.append(kill)
                # how it went on, and what it cost: once the launcher has said what it does about the
                # death (a step in flight may still be logged before the others notice), until a
                # step past the furthest logged by then
                reacted_at = None
                while time.monotonic() - killed_at < 600:
                    if launcher is None:
                        launcher, run["launches"] = _launch(args, run_dir, log), run["launches"] + 1
                    if launcher.poll() is not None:
                        break
                    logged_max = max(_logged(run_dir), default=0)
                    if reacted_at is None and (victim == "launcher" or _launcher_said(log_path, offset)):
                        reacted_at = max(logged_max, furthest)
                    if reacted_at is not None and logged_max > reacted_at:
                        break
                    time.sleep(0.2)
                kill["cost_s"] = round(time.monotonic() - killed_at, 1)
                kill["went_on"] = "relaunch" if victim == "launcher" else _how_it_went_on(log_path, offset)
                print(json.dumps(kill), flush=True)
            if launcher.poll() is None:  # the kills are spent: let it finish
                launcher.wait(timeout=1800)
            run["exit"] = launcher.returncode
            run["orphans"] += _orphans(run_dir)
        logged = _logged(run_dir)
        text = log_path.read_text(errors="replace")
        # what a user would see besides the one-line errors: Python tracebacks and C++ check failures
        run["tracebacks"] = text.count("Traceback (most recent call last)") + text.count("Check failure")
        run["steps_logged"] = len(logged)
        run["finished"] = run["exit"] == 0 and sorted(logged) == list(range(1, args.steps + 1))
        if run["finished"]:
            worst = max(abs(logged[s] / reference[s - 1] - 1) for s in logged)
            run["max_rel_loss_diff"] = worst
            run["matches_uninterrupted"] = worst <= 1e-5
        runs.append(run)
        print(json.dumps(run), flush=True)

    print("\n| phase killed | kills | went on in-process | restart | relaunch | none | median cost (s) |")
    print("|---|---|---|---|---|---|---|")
    for phase in ("start-up", "step", "launcher"):
        group = [k for k in kills if k["phase"] == phase]
        if group:
            ways = collections.Counter(k["went_on"] for k in group)
            cost = statistics.median(k["cost_s"] for k in group)
            print(
                f"| {phase} | {len(group)} | {ways['in-process']} | {ways['restart']} | {ways['relaunch']} | {ways['none']} | {cost:.1f} |"
            )
    good = [r for r in runs if r.get("matches_uninterrupted")]
    orphans = sum(r["orphans"] for r in runs)
    tracebacks = sum(r["tracebacks"] for r in runs)
    print(
        f"\n{len(kills)} kills over {len(runs)} run(s): {len(good)} of {len(runs)} finished on the uninterrupted losses (rtol 1e-5); "
        f"{orphans} orphaned processes; {tracebacks} tracebacks or C++ check failures printed"
    )
    return 0 if len(good) == len(runs) and orphans == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
