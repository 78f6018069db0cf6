"""The seed's data-parallel case study: the ResNet classifier on 8 devices, set up naively,
with jaxdist's defaults, and with the best options, each with the profile's bound.

    python experiments/resnet_case_study.py [--out OUT] [--steps 30] [--repeats 2] [--latency-ms 1.0] [--json]

Every variant is ``python -m jaxdist.train --config resnet --mesh data=8`` (8 fake CPU devices
here, real GPUs where there are some) on synthetic images whose every read waits
``--latency-ms`` (``data.synthetic_latency_ms``: decoding / slow storage, so that input
handling costs what it costs in a real image pipeline), with 2 steps traced by
``jaxdist.profile`` right after the warmup:

- naive: the seed's starting point: no read-ahead and no worker processes (the host reads
  and decodes the next batch only after the step finished: ``data.prefetch=0
  data.workers=0``), the host waits for every step's loss (``train.log_every=1``), fp32;
- defaults: jaxdist as installed: batches read ahead by a background thread (``prefetch
  2``), loss fetched every step, compute dtype ``auto`` (bf16 on GPU, fp32 on CPU, where
  XLA has no fast bf16 kernels);
- best: 4 batches read ahead, the host syncs every 10 steps;
- best+workers: the same with 2 Grain worker processes decoding in parallel (on a host
  with cores to spare the usual fix; on a 2-core host they take cores from the step).

The variants run interleaved, ``--repeats`` times (a shared host drifts): a variant is
reported by its run with the lower-median step time (each run's step time is the median
after the warm-up; with 2 repeats the faster run). Printed per variant: that step time,
images/s, speed-up over naive, the profile's bound and its fractions; ``efficiency`` is the share of the traced step the devices spent
computing (compute + overlapped communication; ``jaxdist.profile``'s fractions), the part
of a step that scales with devices: the quantity the seed's "50% -> 85% of linear" is about.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from scaling import Runner, _cpu_model, read_metrics  # noqa: E402

VARIANTS = {
    "naive": ["data.workers=0", "data.prefetch=0", "train.log_every=1", "model.dtype=float32"],
    "defaults": [],
    "best": ["data.prefetch=4", "train.log_every=10"],
    "best+workers": ["data.workers=2", "data.prefetch=4", "train.log_every=10"],
}
WARMUP, PROFILE_STEPS = 3, 2
GLOBAL_BATCH = 64  # configs/resnet.yaml


def run_variant(name: str, overrides: list[str], args: argparse.Namespace, runner: Runner, repeat: int = 0) -> dict:
    run_dir = args.out / f"{name}_r{repeat}"
    shutil.rmtree(run_dir, ignore_errors=True)
    window = (WARMUP + 1, WARMUP + PROFILE_STEPS)
    total = WARMUP + PROFILE_STEPS + 1 + args.steps
    cmd = [sys.executable, "-m", "jaxdist.train", "--config", "resnet", "--mesh", "data=8", "--steps", str(total)]
    cmd += ["--run-dir", str(run_dir), "--profile-steps", f"{window[0]}:{window[1]}", "checkpoint.every_steps=0"]
    cmd += ["train.compile_cache=off", f"data.synthetic_latency_ms={args.latency_ms:g}", *overrides]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # jaxdist asks for the 8 devices itself
    rc, line = runner.run(cmd, env, args.out / f"{name}_r{repeat}.log")
    row = {"variant": name, "overrides": overrides, "command": " ".join(cmd[1:]).replace(str(args.out), "OUT")}
    if rc != 0:
        return {**row, "status": f"failed: exit {rc}: {line}"}
    # a metrics line is the mean step time since the previous one (train.log_every steps):
    # keep the lines whose whole span lies after the warm-up, the traced steps and the step after
    every = next((int(o.split("=")[1]) for o in overrides if o.startswith("train.log_every=")), 1)
    timed = [t for step, t in sorted(read_metrics(run_dir).items()) if step - every >= window[1] + 1]
    summary = json.loads((run_dir / "profile" / "summary.json").read_text())
    fractions = summary["fractions"]
    row.update(
        status="ok",
        step_time_s=statistics.median(timed),
        step_times_s=timed,
        images_per_sec=GLOBAL_BATCH / statistics.median(timed),
        bound=summary["bound"],
        fractions=fractions,
        efficiency=fractions["compute"] + fractions["communication_overlapped"],
        advice=[a.get("action") if isinstance(a, dict) else a for a in summary.get("advice", [])][:2],
    )
    return row


def median_run(runs: list[dict]) -> dict:
    """The repeat whose step time is the median (lower middle for an even count), with every repeat's time."""
    ok = sorted((r for r in runs if r["status"] == "ok"), key=lambda r: r["step_time_s"])
    if not ok:
        return runs[-1]
    return {**ok[(len(ok) - 1) // 2], "repeat_step_times_s": [r["step_time_s"] for r in runs if r["status"] == "ok"]}


def table(rows: list[dict], latency_ms: float) -> str:
    naive = next((r for r in rows if r["variant"] == "naive" and r["status"] == "ok"), None)
    lines = [
        f"ResNet (configs/resnet.yaml), data=8, global batch {GLOBAL_BATCH}, synthetic images read at {latency_ms:g} ms each",
        "",
        "| set-up | step | images/s | speed-up | bound | compute | data wait | comm exposed | idle | efficiency |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| {r['variant']} | {r['status']} | | | | | | | | |")
            continue
        f = r["fractions"]
        speed = f"{naive['step_time_s'] / r['step_time_s']:.2f}x" if naive else "—"
        lines.append(
            f"| {r['variant']} | {r['step_time_s'] * 1e3:.0f} ms | {r['images_per_sec']:.0f} | {speed} | {r['bound']} | "
            f"{f['compute']:.0%} | {f['data_wait']:.0%} | {f['communication_exposed']:.0%} | {f['idle']:.0%} | {r['efficiency']:.0%} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python experiments/resnet_case_study.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=None, help="run directories and logs (default: a temporary folder)")
    p.add_argument("--steps", type=int, default=30, help="timed steps per variant (after warmup and the traced steps)")
    p.add_argument("--repeats", type=int, default=2, help="runs per variant, interleaved")
    p.add_argument("--latency-ms", type=float, default=1.0, help="wait per image read (data.synthetic_latency_ms)")
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma list of " + ",".join(VARIANTS))
    p.add_argument("--json", action="store_true", help="print the rows as JSON lines after the table")
    args = p.parse_args(argv)
    chosen = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in chosen if v not in VARIANTS]
    if unknown:
        p.error(f"unknown variant(s) {', '.join(unknown)}")
    temp = None
    if args.out is None:
        temp = tempfile.TemporaryDirectory(prefix="resnet_case_")
        args.out = Path(temp.name)
    args.out.mkdir(parents=True, exist_ok=True)
    runner = Runner(timeout_s=1800)
    cores = os.cpu_count()
    print(f"host: {_cpu_model()}, {cores} cores, Python {platform.python_version()}; 8 fake CPU devices in one process", flush=True)
    runs: dict[str, list[dict]] = {name: [] for name in chosen}
    for repeat in range(args.repeats):
        for name in chosen:
            r = run_variant(name, VARIANTS[name], args, runner, repeat)
            runs[name].append(r)
            done = f"{r['step_time_s'] * 1e3:.0f} ms/step, bound {r['bound']}" if r["status"] == "ok" else r["status"]
            print(f"[{repeat + 1}/{args.repeats}] {name}: {done}", flush=True)
    rows = [median_run(runs[name]) for name in chosen]
    print()
    print(table(rows, args.latency_ms))
    if args.json:
        for r in rows:
            print(json.dumps(r))
    if temp is not None:
        temp.cleanup()
    return 0 if all(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except subprocess.SubprocessError as e:
        sys.exit(f"resnet_case_study: {e}")
