"""Training across regions: DDP vs DiLoCo over a simulated slow link.

    python experiments/cross_region.py [--steps 300] [--latency-ms 50] [--gbps 1]
                                       [--cases ddp,h1,h10,...] [--out DIR] [--write-readme]

Two "regions" of 2 processes each (4 processes x 1 CPU device over gloo, ``jaxdist.launch``):

- ``ddp``: ``--mesh data=4``; every step's gradient all-reduce crosses the link;
- ``hN``: DiLoCo, ``--mesh replica=2,data=2``, ``parallel.diloco_inner_steps=N``: inside a
  region the usual data-parallel step, across regions one outer step every N steps;
- ``h10-int8``: the same with the outer average crossing in int8;
- ``h10-stream2``, ``h10-stream4``: streaming DiLoCo, the model in 2 or 4 fragments, each
  synced at its own offset in the round of 10 steps (``parallel.diloco_fragments``);
- ``h10-stream4-tau2``: 4 fragments, each applied 2 steps after it is sent, the link's time
  beside those steps (``parallel.diloco_overlap_steps=2``); ``-fp4``: the average in fp4.

The link is simulated (``parallel.replica_link_latency_ms`` / ``replica_link_gbps``): after
each program whose collectives cross it, every process sleeps latency x collectives +
bytes / bandwidth, with the collectives and bytes read from the compiled program
(``jaxdist/parallel/slow_link.py: SlowLink``). Loopback itself is not slowed. Not charged to
the link: the metrics gathered at log points (a few floats every ``train.log_every``
steps).

Printed per case: bytes each device sends over the link per step and at most in one
sync (the link's peak use), seconds of link time per step, median step time, wall time to reach the target loss (DDP's final loss + 5%,
smoothed over 3 log points), the final loss; plus a PNG of loss against wall time, against
step and against bytes sent over the link.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from compression_bench import start_bench, write_readme  # noqa: E402
from scaling import Runner, host_line  # noqa: E402

MODEL = ["model.d_model=128", "model.n_layers=4", "model.n_heads=4", "model.n_kv_heads=2", "model.dtype=float32"]
MODEL += ["train.seq_len=32", "train.global_batch=16", "data.source=stdlib", "checkpoint.every_steps=0", "train.compile_cache=off"]
MODEL += ["train.lr=3e-3", "train.warmup_steps=20"]
CASES = {
    "ddp": ("data=4", []),
    "h1": ("replica=2,data=2", ["parallel.diloco_inner_steps=1"]),
    "h10": ("replica=2,data=2", ["parallel.diloco_inner_steps=10"]),
    "h50": ("replica=2,data=2", ["parallel.diloco_inner_steps=50"]),
    "h10-int8": ("replica=2,data=2", ["parallel.diloco_inner_steps=10", "parallel.diloco_reduce=int8"]),
    "h10-stream2": ("replica=2,data=2", ["parallel.diloco_inner_steps=10", "parallel.diloco_fragments=2"]),
    "h10-stream4": ("replica=2,data=2", ["parallel.diloco_inner_steps=10", "parallel.diloco_fragments=4"]),
    "h10-stream4-tau2": (
        "replica=2,data=2",
        ["parallel.diloco_inner_steps=10", "parallel.diloco_fragments=4", "parallel.diloco_overlap_steps=2"],
    ),
    "h10-stream4-tau2-fp4": (
        "replica=2,data=2",
        [
            "parallel.diloco_inner_steps=10",
            "parallel.diloco_fragments=4",
            "parallel.diloco_overlap_steps=2",
            "parallel.diloco_outer_dtype=fp4",
        ],
    ),
}
LINK_LINE = re.compile(r"simulated (?:replica )?link.*?: (\d+) collectives, ([\d.]+) MiB per device per (outer )?step -> \+([\d.]+) ms")
PEAK = re.compile(r"at most ([\d.]+) MiB a sync")
README = HERE / "README.md"
BEGIN, END = "<!-- cross-region:begin -->", "<!-- cross-region:end -->"
SMOOTH = 3


def run_case(name: str, args: argparse.Namespace, runner: Runner) -> dict | None:
    mesh, extra = CASES[name]
    run_dir = args.out / name
    shutil.rmtree(run_dir, ignore_errors=True)
    link = [f"parallel.replica_link_latency_ms={args.latency_ms}", f"parallel.replica_link_gbps={args.gbps}"]
    train = ["--mesh", mesh, "--steps", str(args.steps), "--run-dir", str(run_dir), f"train.log_every={args.log_every}"]
    outer = (
        [f"parallel.diloco_outer_lr={args.outer_lr}", f"parallel.diloco_outer_momentum={args.outer_momentum}"] if "replica" in mesh else []
    )
    cmd = [sys.executable, "-m", "jaxdist.launch", "--nproc", "4", "--devices-per-proc", "1", "--", *train, *MODEL, *link, *extra, *outer]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    log = args.out / f"{name}.log"
    rc, line = runner.run(cmd, env, log)
    if rc != 0:
        print(f"  {name}: exit {rc}: {line}", file=sys.stderr)
        return None
    match = LINK_LINE.search(log.read_text())
    if match is None:
        print(f"  {name}: no simulated-link line in {log}", file=sys.stderr)
        return None
    h = int(next((x.split("=")[1] for x in extra if x.startswith("parallel.diloco_inner_steps=")), 1))
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    records = [r for r in records if "loss" in r]
    wall, steps, losses, last = 0.0, [], [], 0
    walls = []
    for r in records:  # step_time_s is the window's mean; the window ends at this log point
        wall += r["step_time_s"] * (r["step"] - last)
        last = r["step"]
        walls.append(wall)
        steps.append(r["step"])
        losses.append(r["loss"])
    peak = PEAK.search(match.string[match.start() : match.string.find("\n", match.start())])
    return {
        "link_bytes_per_step": float(match.group(2)) * 2**20 / h,
        "link_bytes_per_sync": float(peak.group(1) if peak else match.group(2)) * 2**20,
        "link_s_per_step": float(match.group(4)) / 1e3 / h,
        "step_time_s": statistics.median(r["step_time_s"] for r in records[1:]),
        "steps": steps,
        "wall_s": walls,
        "losses": losses,
        "final_loss": statistics.fmean(losses[-SMOOTH:]),
    }


def smoothed(losses: list[float]) -> list[float]:
    return [statistics.fmean(losses[max(0, i - SMOOTH + 1) : i + 1]) for i in range(len(losses))]


def time_to(result: dict, target: float) -> float | None:
    for wall, loss in zip(result["wall_s"], smoothed(result["losses"]), strict=True):
        if loss <= target:
            return wall
    return None


def table(results: dict, args: argparse.Namespace, info: dict, target: float) -> str:
    lines = [
        f"{host_line(info)}; 4 processes x 1 CPU device (2 regions x 2), link {args.latency_ms:g} ms / {args.gbps:g} Gbit/s "
        f"(simulated), {args.steps} steps; DiLoCo outer lr {args.outer_lr:g}, Nesterov momentum {args.outer_momentum:g}; "
        f"target loss {target:.3f} (DDP's final + 5%); `python experiments/cross_region.py --steps {args.steps} "
        f"--latency-ms {args.latency_ms:g} --gbps {args.gbps:g} --outer-lr {args.outer_lr:g} --outer-momentum {args.outer_momentum:g}`",
        "",
        "| case | link bytes / step | vs DDP | most in one sync | link time / step | step time (median) | wall time to target | vs DDP | final loss |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    base = results.get("ddp")
    base_time = time_to(base, target) if base else None
    for name in CASES:
        r = results.get(name)
        if r is None:
            continue
        reached = time_to(r, target)
        ratio = f"{r['link_bytes_per_step'] / base['link_bytes_per_step']:.3f}" if base else "—"
        speed = f"{base_time / reached:.2f}x faster" if base_time and reached else "—"
        lines.append(
            f"| {name} | {r['link_bytes_per_step'] / 2**20:.3f} MiB | {ratio} | {r['link_bytes_per_sync'] / 2**20:.3f} MiB | "
            f"{r['link_s_per_step'] * 1e3:.1f} ms | "
            f"{r['step_time_s'] * 1e3:.0f} ms | {f'{reached:.0f} s' if reached else 'not reached'} | {speed} | {r['final_loss']:.3f} |"
        )
    return "\n".join(lines)


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_time, by_step, by_bytes) = plt.subplots(1, 3, figsize=(16, 4))
    for name, r in results.items():
        by_time.plot(r["wall_s"], smoothed(r["losses"]), label=name)
        by_step.plot(r["steps"], smoothed(r["losses"]), label=name)
        by_bytes.plot([s * r["link_bytes_per_step"] / 2**20 for s in r["steps"]], smoothed(r["losses"]), label=name)
    by_time.set(xlabel="wall time (s)", ylabel="training loss (smoothed)", title="loss vs wall time")
    by_step.set(xlabel="step", title="loss vs step")
    by_bytes.set(xlabel="MiB sent over the link per device", xscale="log", title="loss vs bytes moved")
    by_time.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python experiments/cross_region.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--latency-ms", type=float, default=50.0)
    p.add_argument("--gbps", type=float, default=1.0)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--outer-lr", type=float, default=0.7, help="parallel.diloco_outer_lr")
    p.add_argument("--outer-momentum", type=float, default=0.5, help="parallel.diloco_outer_momentum (the paper's 0.9 suits H=500)")
    p.add_argument("--cases", default=",".join(CASES), help="comma list of " + ",".join(CASES))
    p.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    p.add_argument("--out", type=Path, default=None, help="run directories and logs (default: a temporary folder)")
    p.add_argument("--write-readme", action="store_true", help=f"put the table in {README.relative_to(HERE.parent)}")
    args = p.parse_args(argv)
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    if unknown := [c for c in cases if c not in CASES]:
        p.error(f"unknown case(s) {', '.join(unknown)}")
    temp, info = start_bench(args, "cross_region_")  # the temporary folder lives until main returns
    runner, results = Runner(args.timeout), {}
    for name in cases:
        r = run_case(name, args, runner)
        if r is not None:
            results[name] = r
            print(
                f"  {name}: step {r['step_time_s'] * 1e3:.0f} ms, link {r['link_s_per_step'] * 1e3:.1f} ms/step, final loss {r['final_loss']:.3f}",
                flush=True,
            )
    if not results:
        return 1
    target = (results["ddp"]["final_loss"] if "ddp" in results else min(r["final_loss"] for r in results.values())) * 1.05
    text = table(results, args, info, target)
    print(text)
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    figure = HERE / "figures" / "cross_region.png"
    plot(results, figure)
    print(f"figure: {figure}")
    if args.write_readme:
        write_readme(text, BEGIN, END)
    return 0


if __name__ == "__main__":
    sys.exit(main())
