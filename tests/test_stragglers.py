"""Live straggler detection (training/stragglers.py): the comparison itself against hand-made
windows, and 3 processes on this machine where one is slowed in its host loop (a fault hook,
after an unperturbed stretch that must name nobody): process 0 names it within a window, in
one line and a metrics.jsonl record."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from jaxdist.training.stragglers import straggler, straggler_line

from helpers import TINY, subprocess_env

HOSTS = ["a", "b", "c"]


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


def _launch(run_dir, steps: int, window: int, env: dict | None = None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "jaxdist.launch", "--nproc", "3", "--devices-per-proc", "1", "--", "--mesh", "data=3"]
    args = ["--run-dir", str(run_dir), "--steps", str(steps), "--straggler-window", str(window), *TINY, "train.global_batch=12"]
    return subprocess.Popen(
        [*cmd, *args], env={**subprocess_env(), **(env or {})}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def _stragglers(run_dir) -> list[dict]:
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{"step": x["step"], **x["straggler"]} for x in lines if "straggler" in x]


@pytest.mark.heavy
def test_a_rank_slow_in_its_host_loop_is_named_and_nobody_before(tmp_path):
    """Windows of 10 steps, ending at multiples of 10 on every process: 1-10 warms up, 11-40 are
    unperturbed (nobody named), then rank 2 sleeps 20 ms in each step's host work from step 41:
    named for steps 41-50 and 51-60 (and 61-70; step 71, the run's end and its save, is in no window)."""
    proc = _launch(tmp_path / "run", 71, 10, {"JAXDIST_FAULT_SLOW": "2:0.02:41"})
    out = proc.communicate(timeout=300)[0]
    assert proc.returncode == 0, out[-3000:]
    named = _stragglers(tmp_path / "run")
    assert {(50, 2), (60, 2)} <= {(x["step"], x["process"]) for x in named} and {x["process"] for x in named} == {2}, named
    assert min(x["step"] for x in named) == 50  # nobody in the unperturbed windows
    assert all(x["own_ms_per_step"] > 20 and x["host"] for x in named)
    lines = [line for line in out.splitlines() if "straggler: process 2" in line]
    assert len(lines) == len(named) and "over steps 41-50" in lines[0], out[-3000:]
    assert not [line for line in out.splitlines() if "straggler: process" in line and "process 2" not in line]
    membership = [json.loads(x) for x in (tmp_path / "run" / "elastic.jsonl").read_text().splitlines()]
    assert [(x["step"], x["process"]) for x in membership if x["reason"] == "straggler"] == [(x["step"], x["process"]) for x in named]
