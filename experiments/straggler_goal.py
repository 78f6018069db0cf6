"""Straggler detection's goal, counted: is a process slowed from outside named within two
windows, and does an unperturbed run name nobody, each under a second job's load?

    python experiments/straggler_goal.py [--runs 10] [--window 20] [--load 1] [--cases stop,quota40,quota15,none] [--model tiny|busy]

Each run launches 3 processes of the tiny model (``--model busy``: one wide and long enough that
each process computes for most of its step; ``--mesh data=3``, one CPU device each,
``--straggler-window`` steps per window) beside ``--load`` busy processes (the second job).
Once step ``window + 5`` is logged, rank 1 is slowed from outside:

- ``stop``: SIGSTOP 60 ms of every 100 ms (SIGCONT between);
- ``quotaNN``: moved into a cgroup holding it to NN% of one CPU (``cpu.max`` under cgroup v2,
  ``cpu.cfs_quota_us`` under v1, a 100 ms period); skipped in one line where no cgroup can be
  made. The share of periods it was throttled in is printed: a quota above what the process
  uses anyway slows nothing, and then naming nobody is right;
- ``none``: left alone.

A slowed run counts as named when rank 1 is named (any kind) at the end of the first or second
window that ends after the slowing began, and nobody else is ever named; an unperturbed run counts
when nobody is named at all. Printed: a markdown table with the kinds that named and the step
time after the slowing over the step time before it (medians), the machine and the thread
settings.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

MODELS = {
    # the suite's tiny model: its process wants less than 40% of a CPU here, so a 40% quota barely binds
    "tiny": ("model.d_model=64", "model.n_layers=2", "model.n_heads=8", "model.n_kv_heads=4", "model.dtype=float32", "train.seq_len=32"),
    # wider and longer: each process computes for most of its step, so the quotas bind
    "busy": ("model.d_model=256", "model.n_layers=4", "model.n_heads=8", "model.n_kv_heads=4", "model.dtype=float32", "train.seq_len=128"),
}
CGROUP_ROOTS = (Path("/sys/fs/cgroup/cpu"), Path("/sys/fs/cgroup"))  # v1's cpu controller, else v2's unified tree


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["XLA_FLAGS"] = re.sub(r"--xla_force_host_platform_device_count=\d+", "", env.get("XLA_FLAGS", "")).strip()
    return env


def logged_steps(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(json.JSONDecodeError):
            rows.append(json.loads(line))
    return rows


def duty_cycle(pid: int, stop_s: float, run_s: float, until: threading.Event) -> None:
    try:
        while not until.is_set():
            os.kill(pid, signal.SIGSTOP)
            time.sleep(stop_s)
            os.kill(pid, signal.SIGCONT)
            time.sleep(run_s)
    except ProcessLookupError:
        return
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)


class Quota:
    """A cgroup holding its processes to ``share`` of one CPU; removed on ``close``."""

    def __init__(self, share: float, period_us: int = 100_000):
        self.path = None
        for root in CGROUP_ROOTS:
            v1 = (root / "cpu.cfs_quota_us").exists()
            if not (v1 or (root / "cgroup.controllers").exists()):
                continue
            path = root / f"jaxdist-straggler-goal-{os.getpid()}"
            try:
                path.mkdir()
                if v1:
                    (path / "cpu.cfs_period_us").write_text(str(period_us))
                    (path / "cpu.cfs_quota_us").write_text(str(int(share * period_us)))
                else:
                    (path / "cpu.max").write_text(f"{int(share * period_us)} {period_us}")
            except OSError:
                with contextlib.suppress(OSError):
                    path.rmdir()
                continue
            self.path = path
            return

    def add(self, pid: int) -> None:
        (self.path / "cgroup.procs").write_text(str(pid))  # the process with all its threads

    def throttled_share(self) -> float:
        """The share of the quota's periods so far in which it held its processes back."""
        stat = dict(line.split() for line in (self.path / "cpu.stat").read_text().splitlines() if len(line.split()) == 2)
        if "nr_periods" in stat:  # v1, and v2's cpu.stat alike
            return int(stat.get("nr_throttled", 0)) / max(int(stat["nr_periods"]), 1)
        return float("nan")

    def close(self) -> None:
        if self.path is None:
            return
        parent = self.path.parent
        for pid in (self.path / "cgroup.procs").read_text().split():
            with contextlib.suppress(OSError):
                (parent / "cgroup.procs").write_text(pid)
        with contextlib.suppress(OSError):
            self.path.rmdir()


def one_run(case: str, args: argparse.Namespace, run_dir: Path) -> dict:
    launch = [sys.executable, "-m", "jaxdist.launch", "--nproc", "3", "--devices-per-proc", "1", "--", "--mesh", "data=3"]
    train = ["--run-dir", str(run_dir), "--steps", str(args.steps), "--straggler-window", str(args.window), *MODELS[args.model]]
    train += ["train.global_batch=12", "train.log_every=1"]
    load = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.load)]
    log = open(run_dir.with_suffix(".log"), "w")  # noqa: SIM115 (closed below)
    proc = subprocess.Popen([*launch, *train], env=child_env(), stdout=log, stderr=subprocess.STDOUT)
    until, quota, started = threading.Event(), None, None
    try:
        deadline = time.monotonic() + 600
        while case != "none" and started is None:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the run ended before step {args.window + 5}: see {log.name}")
            steps = [r["step"] for r in logged_steps(run_dir) if "loss" in r]
            if steps and max(steps) >= args.window + 5:
                (rank1,) = [p for p in psutil.Process(proc.pid).children() if p.environ().get("JAXDIST_PROCESS_ID") == "1"]
                if case == "stop":
                    threading.Thread(target=duty_cycle, args=(rank1.pid, 0.06, 0.04, until), daemon=True).start()
                else:
                    quota = Quota(int(case.removeprefix("quota")) / 100)
                    quota.add(rank1.pid)
                started = max(steps)
            time.sleep(0.05)
        proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        until.set()
        throttled = None
        if quota is not None:
            throttled = quota.throttled_share()
            quota.close()
        for p in (proc, *load):
            if p.poll() is None:
                p.kill()
                p.wait()
        log.close()
    rows = logged_steps(run_dir)
    named = [{"step": r["step"], **r["straggler"]} for r in rows if "straggler" in r]
    if case == "none":
        return {"ok": not named, "named": named, "load": os.getloadavg()[0]}
    times = [(r["step"], r["step_time_s"]) for r in rows if "step_time_s" in r and r["step"] > args.window]  # past the warm-up
    before = statistics.median([t for step, t in times if step <= started] or [float("nan")])
    after = statistics.median([t for step, t in times if step > started + 2] or [float("nan")])
    first_end = (started // args.window + 1) * args.window  # the first window ending after the slowing began
    in_time = [x for x in named if x["process"] == 1 and x["step"] <= first_end + args.window]
    others = [x for x in named if x["process"] != 1]
    first = min((x["step"] for x in in_time), default=None)
    # the measures of the windows after the slowing: rank 1's stalled share and probe against the others'
    measures = [(r["step"], r["straggler_measures"]) for r in rows if "straggler_measures" in r and r["step"] > started]
    result = {"ok": bool(in_time) and not others, "named": named, "first": first, "started": started, "slowdown": after / before}
    return {**result, "throttled": throttled, "load": os.getloadavg()[0], "measures": measures}


def machine() -> str:
    model = next(
        (line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("model name")), "?"
    )
    return f"{model}, {os.cpu_count()} cores, {platform.system()} {platform.release()}, Python {platform.python_version()}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--window", type=int, default=20)
    parser.add_argument("--steps", type=int, default=70)
    parser.add_argument("--load", type=int, default=1, help="busy processes beside each run (the second job)")
    parser.add_argument("--cases", default="stop,quota40,quota15,none")
    parser.add_argument(
        "--model", choices=sorted(MODELS), default="tiny", help="tiny: the suite's; busy: one a 40%% quota holds back in most periods"
    )
    args = parser.parse_args()
    cases = args.cases.split(",")
    if any(case.startswith("quota") for case in cases):
        probe = Quota(0.4)
        if probe.path is None:
            print("quota: skipped, no cgroup with a cpu controller can be made here (needs root or a delegated cgroup)")
            cases = [case for case in cases if not case.startswith("quota")]
        probe.close()
    results: dict[str, list[dict]] = {case: [] for case in cases}
    with tempfile.TemporaryDirectory() as tmp:
        for run in range(args.runs):
            for case in cases:
                result = one_run(case, args, Path(tmp) / f"{case}-{run}")
                results[case].append(result)
                kinds = sorted({(x["process"], x["kind"], x["step"]) for x in result["named"]})
                extra = f"; step time x{result['slowdown']:.2f}" if "slowdown" in result else ""
                if result.get("throttled") is not None:
                    extra += f"; throttled in {100 * result['throttled']:.0f}% of periods"
                extra += f"; load average {result['load']:.1f}"
                for step, m in result.get("measures", []):
                    extra += f"; at {step} stalled {m['stalled_share']} probe ms {[round(x) for x in m['probe_ms']]}"
                verdict = "ok" if result["ok"] else "MISSED"
                print(f"{case} run {run + 1}: {verdict}; slowed after step {result.get('started')}{extra}; named {kinds}", flush=True)
    loads = [r["load"] for rows in results.values() for r in rows]
    print(f"\nmachine: {machine()}; load: {args.load} busy process(es); 3 training processes of the {args.model} model, 1 CPU device each")
    print(f"1-minute load average at the runs' ends: median {statistics.median(loads):.1f}, max {max(loads):.1f}")
    print(f"thread settings: XLA_FLAGS={child_env()['XLA_FLAGS']!r}, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}\n")
    print(
        "| case | runs | goal met | first named at (windows after the slowing) | kinds that named rank 1 "
        "| step time after / before (median) | periods throttled (median) |"
    )
    print("|---|---|---|---|---|---|---|")
    for case, rows in results.items():
        met = sum(r["ok"] for r in rows)
        if case == "none":
            print(f"| unperturbed | {len(rows)} | {met} named nobody | | | | |")
            continue
        windows = sorted((r["first"] - (r["started"] // args.window) * args.window) // args.window for r in rows if r["first"])
        kinds = sorted({x["kind"] for r in rows for x in r["named"] if x["process"] == 1})
        label = "stopped 60 of every 100 ms" if case == "stop" else f"{case.removeprefix('quota')}% CPU quota"
        slowdown = statistics.median(r["slowdown"] for r in rows)
        throttled = [r["throttled"] for r in rows if r.get("throttled") is not None]
        throttled_text = f"{100 * statistics.median(throttled):.0f}%" if throttled else ""
        print(f"| {label} | {len(rows)} | {met} named in time | {windows} | {', '.join(kinds)} | {slowdown:.2f} | {throttled_text} |")


if __name__ == "__main__":
    main()
