"""What does tracing cost, and where does a real step's time go?

    python experiments/profile_overhead.py [--steps 12] [--window 6:8] [--batch 8]

Trains `small` (24M) on synthetic tokens with ``--profile-steps`` in the middle of the
run, twice: in one process on 8 fake CPU devices (``data=8``) and as 2 processes x 4
devices over gloo (``jaxdist.launch``). From each run's ``metrics.jsonl`` (logged every
step) it compares the median step time inside the traced window with the median outside
it (goal: tracing costs < 10%); the step after the window is left out (the report is
made there) and so are the first two (compilation warm-up). Then it prints the report's
breakdown for each run. CPU timings are noisy: read the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

COMMON = ["--config", "small", "data.source=synthetic", "model.dtype=float32", "checkpoint.every_steps=0", "--log-every", "1"]


def train(run_dir: Path, nproc: int, steps: int, window: str, batch: int) -> None:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    args = [*COMMON, "--mesh", "data=2,fsdp=4" if nproc > 1 else "data=8", "--steps", str(steps), "--profile-steps", window]
    args += ["--run-dir", str(run_dir), f"train.global_batch={batch}", "train.seq_len=256"]
    if nproc > 1:
        cmd = [sys.executable, "-m", "jaxdist.launch", "--nproc", str(nproc), "--devices-per-proc", str(8 // nproc), "--", *args]
    else:
        cmd = [sys.executable, "-m", "jaxdist.train", *args]
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=3600)


def overhead(run_dir: Path, window: str) -> tuple[float, float]:
    first, last = (int(x) for x in window.split(":"))
    times = {m["step"]: m["step_time_s"] for m in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "loss" in m}
    traced = [t for s, t in times.items() if first <= s <= last]
    untraced = [t for s, t in times.items() if s > 2 and not first <= s <= last + 1]
    return statistics.median(traced), statistics.median(untraced)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--window", default="6:8")
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args()
    print(f"host: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; model small, batch {args.batch} x 256, fp32")
    print(
        "| run | traced step (median) | untraced step (median) | tracing overhead | bound | compute | comm exposed | comm overlapped | data wait | idle |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory() as root:
        for name, nproc in (("1 process, data=8", 1), ("2 processes x 4, data=2,fsdp=4", 2)):
            run_dir = Path(root) / f"p{nproc}"
            train(run_dir, nproc, args.steps, args.window, args.batch)
            traced, untraced = overhead(run_dir, args.window)
            summary = json.loads((run_dir / "profile" / "summary.json").read_text())
            f = summary["fractions"]
            shares = " | ".join(
                f"{f[k]:.0%}" for k in ("compute", "communication_exposed", "communication_overlapped", "data_wait", "idle")
            )
            print(f"| {name} | {traced:.3f} s | {untraced:.3f} s | {traced / untraced - 1:+.1%} | {summary['bound']} | {shares} |")


if __name__ == "__main__":
    main()
