"""Kill -> next step: in-process recovery against the restart path, side by side in one run.

    python experiments/recovery_bench.py [--repeats 2] [--steps 60] [--kill-step 17] [--peer-timeout 10]

Each repeat launches the same elastic 3-process run (``--nproc 3 --min-nproc 2
--devices-per-proc 1``, ``--mesh data=-1``, the tiny model on the stdlib corpus, a
checkpoint every 10 steps) twice, once per ``--recovery`` mode, with rank 2 SIGKILLed when
it reaches ``--kill-step`` (the ``JAXDIST_FAULT_KILL_AT`` hook, which prints its line just
before the kill). From the launcher's output, timestamped as it arrives, it reports the
seconds from the kill to the next logged step, and to the failed step being done (the
restart path trains the steps since its last checkpoint again first), plus the phase
seconds in-process recovery writes to ``elastic.jsonl``. In-process, the launcher then starts a
replacement that rejoins: the seconds from the kill until the first step on 3 processes again
is done, and the grow's phases, are reported too. Medians over the repeats; the thread
settings and the machine are printed with them.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

STEP_LINE = re.compile(r"\[rank 0\] step (\d+) \|")
KILL_LINE = "fault injection (JAXDIST_FAULT_KILL_AT)"
GROWN_LINE = re.compile(r"elastic: 2 -> 3 processes, process \d+ rejoined; continuing at step (\d+)")


def one_run(mode: str, args: argparse.Namespace, run_dir: Path) -> dict:
    env = {**os.environ, "JAXDIST_FAULT_KILL_AT": f"2:{args.kill_step}", "PYTHONUNBUFFERED": "1"}
    launch = ["--nproc", "3", "--min-nproc", "2", "--devices-per-proc", "1", "--recovery", mode, "--peer-timeout", str(args.peer_timeout)]
    train = ["--config", "tiny", "--mesh", "data=-1", "--steps", str(args.steps), "--run-dir", str(run_dir)]
    train += ["train.global_batch=6", "checkpoint.every_steps=10", "train.log_every=1"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "jaxdist.launch", *launch, "--", *train],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    killed = next_step = failed_step_done = grown_at = grown_step_done = None
    out = open(run_dir.parent / f"{run_dir.name}.log", "w")  # noqa: SIM115 - closed below
    for line in proc.stdout:
        now = time.monotonic()
        out.write(line)
        if KILL_LINE in line:
            killed = now
        grown = GROWN_LINE.search(line)
        if grown:
            grown_at = int(grown.group(1))
        match = STEP_LINE.search(line)
        if match and killed is not None:
            step = int(match.group(1))
            # the lines of the steps just before the kill may print after it (a race; without the guard a log
            # line trails its step by one): a new step is the failed one or later, or a replay from a checkpoint
            if step >= args.kill_step or step < args.kill_step - 3:
                next_step = next_step or now
            if step == args.kill_step and failed_step_done is None:
                failed_step_done = now
            if grown_at is not None and step == grown_at and grown_step_done is None:
                grown_step_done = now
    proc.wait()
    out.close()
    if proc.returncode != 0 or killed is None or failed_step_done is None:
        raise SystemExit(f"{mode}: the run failed (exit {proc.returncode}); see {run_dir} and {out.name}")
    records = [json.loads(x) for x in (run_dir / "elastic.jsonl").read_text().splitlines()]
    recovery = next((r for r in records if r["reason"] == "in-process"), {})
    rejoin = next((r for r in records if r["reason"] == "rejoin"), {})
    phases, grow = recovery.get("seconds"), rejoin.get("seconds")
    regrown = None if grown_step_done is None else grown_step_done - killed
    return {
        "next_step_s": next_step - killed,
        "failed_step_s": failed_step_done - killed,
        "phases": phases,
        "regrown_s": regrown,
        "grow": grow,
        "compiled_ahead": (recovery.get("compiled_ahead"), rejoin.get("compiled_ahead")),  # (recovery, rejoin)
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--kill-step", type=int, default=17)
    parser.add_argument("--peer-timeout", type=float, default=10.0)
    parser.add_argument("--runs", default=None, help="keep the run directories and logs here (default: a temporary folder)")
    parser.add_argument("--modes", default="in-process,restart", help="which --recovery modes, comma-separated")
    args = parser.parse_args()
    results: dict[str, list[dict]] = {mode: [] for mode in args.modes.split(",")}
    with tempfile.TemporaryDirectory() if args.runs is None else contextlib.nullcontext(args.runs) as tmp:
        Path(tmp).mkdir(parents=True, exist_ok=True)
        for repeat in range(args.repeats):
            for mode in results:  # side by side: each repeat runs both
                results[mode].append(one_run(mode, args, Path(tmp) / f"{mode}-{repeat}"))
                print(f"repeat {repeat} {mode}: {results[mode][-1]}", flush=True)
    threads = {k: os.environ.get(k, "unset") for k in ("XLA_FLAGS", "OMP_NUM_THREADS")}
    print(f"\nmachine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; thread settings: {threads}")
    print(
        f"3 processes x 1 CPU device, tiny model, rank 2 killed at step {args.kill_step}, checkpoint every 10, --peer-timeout {args.peer_timeout:g}"
    )
    print(f"{'mode':<12} {'kill -> next step (s)':>22} {'kill -> failed step done (s)':>30}")
    for mode, runs in results.items():
        print(
            f"{mode:<12} {statistics.median(r['next_step_s'] for r in runs):>22.1f} {statistics.median(r['failed_step_s'] for r in runs):>30.1f}"
        )
    phases = [r["phases"] for r in results.get("in-process", []) if r["phases"]]
    if phases:
        print("in-process phases (median s): " + ", ".join(f"{k} {statistics.median(p[k] for p in phases):.2f}" for k in phases[0]))
        runs = [r for r in results["in-process"] if r["phases"]]
        beyond = statistics.median(r["next_step_s"] - r["phases"]["detect"] for r in runs)
        ahead = [r["compiled_ahead"] for r in runs]
        print(
            f"in-process, kill -> next step beyond the detection (median s): {beyond:.1f}; step compiled ahead (recovery, rejoin): {ahead}"
        )
    regrown = [r["regrown_s"] for r in results.get("in-process", []) if r["regrown_s"] is not None]
    grows = [r["grow"] for r in results.get("in-process", []) if r["grow"]]
    if regrown:
        print(
            f"in-process, kill -> first step on 3 processes again (median s): {statistics.median(regrown):.1f} ({len(regrown)} of the runs rejoined)"
        )
    if grows:
        print("rejoin phases (median s): " + ", ".join(f"{k} {statistics.median(g[k] for g in grows):.2f}" for k in grows[0]))


if __name__ == "__main__":
    main()
