"""Live straggler detection (training/stragglers.py): the comparison itself against hand-made
windows, and 3 processes on this machine where one is slowed in its host loop (a fault hook)
or as a whole from outside (SIGSTOP / SIGCONT), after an unperturbed stretch that must name
nobody: process 0 names it within a window, in one line and a metrics.jsonl record."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from jaxdist.training.stragglers import slow_compute, stalled_from_outside, straggler, straggler_line

from helpers import TINY, subprocess_env

HOSTS = ["a", "b", "c"]
# The launched run's factor: its slowed ranks are 4x and more over the others, while the suite's
# second worker on 2 cores put an unslowed rank's probe 1.32x over the others two windows in a row.
FACTOR = 2.0
SLOW_S = 0.15  # rank 2's sleep per step: far over the floors with a second job on the machine (20 ms was missed once there)


@pytest.mark.parametrize(
    ("own_ms", "step_ms", "named"),
    [
        ([3, 3, 3], 80, None),  # even
        ([3, 3, 25], 80, 2),  # 8x the others, 22 ms, 27% of the step
        ([3, 3.5, 3.9], 80, None),  # 1.3x but 0.6 ms: noise
        ([8, 2.5, 3.5], 90, None),  # 2.7x but 5 ms (process 0's metrics on this machine): under 10 ms
        ([30, 30, 45], 400, None),  # 1.5x and 15 ms but 3.75% of a long step
        ([30, 30, 38], 100, None),  # 8% of the step but 1.27x
        ([3, 30, 45], 100, 2),  # both over: the worst is named
        ([0, 0, 0], 100, None),
    ],
)
def test_the_comparison_names_the_worst_over_the_factor_and_the_floor(own_ms, step_ms, named):
    record = straggler([x / 1e3 for x in own_ms], step_ms / 1e3, 1.3, HOSTS, (11, 20))
    assert (record or {}).get("process") == named
    if named is not None:
        assert record["host"] == HOSTS[named] and record["steps"] == [11, 20]
        assert straggler_line(record, 1.3).startswith(f"straggler: process {named} on {HOSTS[named]} spent ")


@pytest.mark.parametrize(
    ("probe_ms", "named"),
    [
        ([80, 85, 170], 2),  # 2x the others' median
        ([80, 85, 104], None),  # 1.26x: under the factor
        ([5, 5, 14], None),  # 2.8x but 9 ms: timer noise
        ([170, 80, 85], 0),
        ([80, 80, 80], None),
    ],
)
def test_the_probe_comparison_names_the_slowest_over_the_factor_and_the_floor(probe_ms, named):
    record = slow_compute([x / 1e3 for x in probe_ms], 1.3, HOSTS, (1, 20))
    assert (record or {}).get("process") == named
    if named is not None:
        assert (record["kind"], record["probe_ms"], record["steps"]) == ("compute", probe_ms[named], [1, 20])
        assert straggler_line(record, 1.3).startswith(f"straggler: process {named} on {HOSTS[named]} took {probe_ms[named]:.1f} ms")


@pytest.mark.parametrize(
    ("shares", "named"),
    [
        ([0.02, 0.03, 0.62], 2),  # stopped 60% of the window
        ([0.10, 0.12, 0.25], None),  # 2x the others but 13 points: a loaded machine's spread
        ([0.30, 0.35, 0.45], None),  # everyone stalled (the whole host): 1.3x is under the factor
        ([0.55, 0.0, 0.01], 0),
        ([0.0, 0.0, 0.0], None),
    ],
)
def test_the_stalled_comparison_names_a_share_over_the_factor_and_the_floor(shares, named):
    record = stalled_from_outside(shares, 1.3, HOSTS, (21, 40))
    assert (record or {}).get("process") == named
    if named is not None:
        assert (record["kind"], record["stalled_share"], record["steps"]) == ("stalled", shares[named], [21, 40])
        line = straggler_line(record, 1.3)
        assert line.startswith(
            f"straggler: process {named} on {HOSTS[named]} was kept from running for {100 * shares[named]:.0f}% of steps 21-40"
        )


METER = """
import sys, time
from jaxdist.training.hiccups import HiccupMeter
meter = HiccupMeter()
print("ready", flush=True)
sys.stdin.readline()
meter.take()
time.sleep(float(sys.argv[1]))
print(meter.take(), flush=True)
"""


def test_the_hiccup_meter_counts_the_time_a_process_is_stopped_from_outside_and_not_its_sleeps():
    """Two processes sleeping 2 s each, one stopped 60 ms of every 100 ms meanwhile (what a 40%
    CPU quota does): the stopped one's meter reads about 60%, the other's about nothing, or, on
    a machine loaded past its cores, what both wake late by (a fresh-clone run beside two GPU
    compiles: 0.59 and 0.21), so the stopped one reads at least 0.3 more."""
    children = [
        subprocess.Popen([sys.executable, "-c", METER, "2"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=subprocess_env())
        for _ in range(2)
    ]
    until = threading.Event()
    try:
        for child in children:
            assert child.stdout.readline().strip() == "ready"
        for child in children:
            child.stdin.write("go\n")
            child.stdin.flush()
        stopper = threading.Thread(target=_duty_cycle, args=(children[0].pid, 0.06, 0.04, until))
        stopper.start()
        time.sleep(1.9)
        until.set()
        stopper.join()
        stopped, free = (float(child.communicate(timeout=30)[0]) for child in children)
    finally:
        until.set()
        for child in children:
            if child.poll() is None:
                child.kill()
                child.communicate()
    assert 0.4 < stopped < 0.85 and stopped - free > 0.3 and free < 0.3, (stopped, free)


BUSY = """
import sys, threading, time
import numpy as np
from jaxdist.training.hiccups import HiccupMeter
meter = HiccupMeter()
def work():  # 30% of a core in numpy (the GIL released), in 10 ms periods
    a = np.random.rand(300, 300)
    while True:
        start = time.monotonic()
        while time.monotonic() - start < 0.003:
            a @ a
        time.sleep(0.007)
threading.Thread(target=work, daemon=True).start()
print("ready", flush=True)
sys.stdin.readline()
meter.take()
time.sleep(2)
print(meter.take(), flush=True)
"""


def _cpu_quota_group(share: float) -> Path | None:
    """A cgroup (v1's cpu controller, else v2) holding its processes to ``share`` of one CPU; None
    where this user cannot make one."""
    for root, v1 in ((Path("/sys/fs/cgroup/cpu"), True), (Path("/sys/fs/cgroup"), False)):
        if not (root / ("cpu.cfs_quota_us" if v1 else "cgroup.controllers")).exists():
            continue
        group = root / f"jaxdist-test-{os.getpid()}"
        try:
            group.mkdir()
            if v1:
                (group / "cpu.cfs_period_us").write_text("100000")
                (group / "cpu.cfs_quota_us").write_text(str(int(share * 100000)))
            else:
                (group / "cpu.max").write_text(f"{int(share * 100000)} 100000")
            return group
        except OSError:
            with contextlib.suppress(OSError):
                group.rmdir()
    return None


def test_the_meter_counts_a_cpu_quota_that_throttles_a_process():
    """Two processes each wanting 30% of a core, one held to 15% by a cgroup's quota: the
    throttled one's stalled share (the kernel's throttled time, or the meter's late wakes) is far
    over the free one's. The free one's is not zero on a loaded machine: its meter wakes late when
    the suite's other processes hold both cores (0.11 in one fresh-clone run), so the comparison is
    a ratio, not a bound on the free share."""
    group = _cpu_quota_group(0.15)
    if group is None:
        pytest.skip("no cgroup with a cpu controller can be made here (needs root or a delegated cgroup)")
    children = [
        subprocess.Popen([sys.executable, "-c", BUSY], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=subprocess_env())
        for _ in range(2)
    ]
    try:
        (group / "cgroup.procs").write_text(str(children[0].pid))
        for child in children:
            assert child.stdout.readline().strip() == "ready"
        for child in children:
            child.stdin.write("go\n")
            child.stdin.flush()
        throttled, free = (float(child.communicate(timeout=60)[0]) for child in children)
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
                child.communicate()
        with contextlib.suppress(OSError):
            group.rmdir()
    assert throttled > 0.3 and throttled > 3 * free, (throttled, free)


def _launch(run_dir, steps: int, window: int, env: dict | None = None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "jaxdist.launch", "--nproc", "3", "--devices-per-proc", "1", "--", "--mesh", "data=3"]
    args = ["--run-dir", str(run_dir), "--steps", str(steps), "--straggler-window", str(window), *TINY, "train.global_batch=12"]
    args.append(f"train.straggler_factor={FACTOR}")
    return subprocess.Popen(
        [*cmd, *args], env={**subprocess_env(), **(env or {})}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def _stragglers(run_dir) -> list[dict]:
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{"step": x["step"], **x["straggler"]} for x in lines if "straggler" in x]


def _duty_cycle(pid: int, stop_s: float, run_s: float, until: threading.Event) -> None:
    """SIGSTOP / SIGCONT ``pid`` in turn: a process whose CPU share is cut from outside."""
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


@pytest.mark.heavy
def test_a_rank_slow_in_its_host_loop_and_one_slowed_from_outside_are_each_named_by_their_kind(tmp_path):
    """One run, windows of 10 steps ending at multiples of 10 on every process (1-10 warms up,
    11-20 unperturbed: nobody named), one perturbation after the other (with two of three slow
    the others' median is no baseline):
    - rank 2 sleeps SLOW_S in each step's host work in steps 21-40 (the fault hook): ``host``
      names it at the end of the second of those windows (over the factor in both), nobody else
      before the slowing (process 0's own time was once over the factor in 11-20 alone);
    - rank 1 is stopped 50 ms of every 65 ms from outside (SIGSTOP / SIGCONT, as a CPU quota or a
      throttled device would slow it) once step 42 is logged; its running stretches (15 ms) are
      shorter than the probe's chain (25-100 ms here), which with 30 ms stretches could run
      within one and slip past (a fresh-clone run under the suite's own load named nobody): ``compute`` names it once its probe
      was over the factor at the end of two windows in a row (``host`` may too: on CPU its host
      loop is stopped as well), and never names rank 2; ``stalled`` names it at the end of every
      window it was stopped through, and nobody else in any window."""
    run_dir = tmp_path / "run"
    proc = _launch(run_dir, 71, 10, {"JAXDIST_FAULT_SLOW": f"2:{SLOW_S}:21:40"})
    until = threading.Event()
    try:
        deadline = time.monotonic() + 240
        while not _logged_step(run_dir, 42):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0][-3000:]
            time.sleep(0.1)
        (rank1,) = [p for p in psutil.Process(proc.pid).children() if p.environ().get("JAXDIST_PROCESS_ID") == "1"]
        started = max(json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines() if '"loss"' in x)
        threading.Thread(target=_duty_cycle, args=(rank1.pid, 0.05, 0.015, until), daemon=True).start()
        out = proc.communicate(timeout=300)[0]
    finally:
        until.set()
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, out[-3000:]
    named = _stragglers(run_dir)
    host = [x for x in named if x["kind"] == "host"]
    compute = [x for x in named if x["kind"] == "compute"]
    stalled = [x for x in named if x["kind"] == "stalled"]

    slow_host = [x for x in host if x["process"] == 2]
    windows = [x["step"] for x in slow_host]
    assert windows == [40] and {x["process"] for x in host} <= {1, 2}, host  # over in 21-30 and in 31-40
    assert all(x["steps"][1] > started for x in host if x["process"] == 1), host  # nobody else; rank 1 only once stopped
    assert all(x["own_ms_per_step"] > 1e3 * SLOW_S and x["host"] for x in slow_host)
    host_lines = [line for line in out.splitlines() if "straggler: process 2 on" in line]
    assert len(host_lines) == 1 and "two windows in a row (steps 21-40)" in host_lines[0], out[-3000:]

    assert compute and {x["process"] for x in compute} == {1}, compute
    assert min(x["steps"][0] for x in compute) > started - 20, (started, compute)  # nobody before the slowing
    assert all(x["probe_ms"] > FACTOR * x["others_probe_ms"] for x in compute)
    assert sum("straggler: process 1 on" in line and "slowed as a whole" in line for line in out.splitlines()) == len(compute)

    # stalled: rank 1 in every window that ends after the slowing began, the first one included
    # when most of it was slowed, and nobody else ever (rank 2's sleeps are its own work)
    full_windows = set(range((started + 9) // 10 * 10 + 10, 71, 10))  # those beginning after the step last logged
    assert {x["process"] for x in stalled} == {1} and full_windows <= {x["step"] for x in stalled} <= full_windows | {
        full_windows and min(full_windows) - 10
    }, (started, stalled)
    assert all(x["stalled_share"] > 0.4 and x["others_stalled_share"] < 0.2 for x in stalled if x["step"] in full_windows), stalled
    assert sum("straggler: process 1 on" in line and "was kept from running" in line for line in out.splitlines()) == len(stalled)

    # every compared window's measures, the named records among them
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    measures = {x["step"]: x["straggler_measures"] for x in lines if "straggler_measures" in x}
    assert sorted(measures) == list(range(20, 71, 10)) and all(m["processes"] == [0, 1, 2] for m in measures.values()), measures
    assert all(measures[x["step"]]["stalled_share"][1] == x["stalled_share"] for x in stalled)
    # before the slowing, every process's share below what the stopped one shows once stopped (a
    # machine loaded past its cores stalls everyone a little: 0.12-0.25 beside two GPU compiles)
    stopped_shares = [x["stalled_share"] for x in stalled if x["step"] in full_windows]
    assert all(max(m["stalled_share"]) < min(stopped_shares) / 2 for step, m in measures.items() if step <= started), measures

    membership = [json.loads(x) for x in (run_dir / "elastic.jsonl").read_text().splitlines()]
    assert [(x["step"], x["process"], x["kind"]) for x in membership if x["reason"] == "straggler"] == [
        (x["step"], x["process"], x["kind"]) for x in named
    ]


def _logged_step(run_dir, step: int) -> bool:
    path = run_dir / "metrics.jsonl"
    return path.exists() and any(f'"step": {step},' in x and '"loss"' in x for x in path.read_text().splitlines())
