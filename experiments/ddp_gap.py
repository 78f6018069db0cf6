"""jaxdist's 2-process overhead beside PyTorch DDP's, measured side by side, with the knobs
that move it.

    python experiments/ddp_gap.py [--repeats 2] [--steps 12] [--variants default,layer-loop,scheduler-off]

The issue-11 model (the sweep's ``small-cpu``: d_model 128, 4 layers, 8 heads / 4 kv heads,
vocab 256, seq 128, fp32, AdamW, synthetic data), 8 sequences per process:

- PyTorch: one process with one thread, then DDP over gloo with 2 processes of one
  thread each (``experiments/torch_baseline.py``);
- jaxdist, per variant: one process pinned to one core (``taskset``: what each of two
  processes gets on a 2-core host), one process free to use both cores, then 2 processes
  x 1 device over gloo (``jaxdist.launch``).

Variants: ``default`` (jaxdist as shipped), ``layer-loop`` (``model.scan_layers=false``),
``scheduler-off`` (``--xla_cpu_enable_concurrency_optimized_scheduler=false``: faster, but
deadlocks fsdp x tensor meshes on jaxlib 0.10.2, so not a default). The
cases run interleaved, ``--repeats`` times each; printed: the median step time of each
case (median over repeats of each run's median after the warm-up) and the 2-process
overhead over the 1-process step.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from scaling import Runner, _cpu_model, _version, read_metrics  # noqa: E402

MODEL = ["model.d_model=128", "model.n_layers=4", "model.n_heads=8", "model.n_kv_heads=4", "model.vocab_size=256"]
MODEL += ["model.dtype=float32", "train.seq_len=128", "data.source=synthetic", "checkpoint.every_steps=0", "train.compile_cache=off"]
TORCH_DIMS = ["--d-model", "128", "--layers", "4", "--heads", "8", "--kv-heads", "4", "--vocab", "256", "--seq-len", "128"]
VARIANTS = {  # name -> (extra XLA flags, config overrides)
    "default": ("", []),
    "layer-loop": ("", ["model.scan_layers=false"]),
    "scheduler-off": ("--xla_cpu_enable_concurrency_optimized_scheduler=false", []),
}
PER_PROCESS_BATCH, WARMUP = 8, 3


def jaxdist_case(label: str, nproc: int, pinned: bool, variant: str, args: argparse.Namespace) -> dict:
    flags, overrides = VARIANTS[variant]
    return {
        "label": label,
        "framework": "jaxdist",
        "variant": variant,
        "nproc": nproc,
        "pinned": pinned,
        "flags": flags,
        "overrides": overrides,
    }


def run_jaxdist(case: dict, args: argparse.Namespace, runner: Runner, tag: str) -> float | None:
    run_dir = args.out / tag
    shutil.rmtree(run_dir, ignore_errors=True)
    train = ["--mesh", f"data={case['nproc']}", "--steps", str(WARMUP + args.steps), "--run-dir", str(run_dir), "--log-every", "1"]
    train += [*MODEL, f"train.global_batch={PER_PROCESS_BATCH * case['nproc']}", *case["overrides"]]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    if case["nproc"] == 1:
        cmd = [sys.executable, "-m", "jaxdist.train", *train]
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count=1 {case['flags']}".strip()
    else:  # jaxdist.launch adds the device count
        cmd = [sys.executable, "-m", "jaxdist.launch", "--nproc", str(case["nproc"]), "--devices-per-proc", "1", "--", *train]
        if case["flags"]:
            env["XLA_FLAGS"] = case["flags"]
    if case["pinned"]:
        cmd = ["taskset", "-c", "0", *cmd]
    rc, line = runner.run(cmd, env, args.out / f"{tag}.log")
    if rc != 0:
        print(f"  {case['label']}: exit {rc}: {line}", file=sys.stderr)
        return None
    times = [t for step, t in read_metrics(run_dir).items() if step > WARMUP]
    return statistics.median(times) if times else None


def run_torch(case: dict, args: argparse.Namespace, runner: Runner, tag: str) -> float | None:
    strategy = "single" if case["nproc"] == 1 else "ddp"
    cmd = [sys.executable, str(HERE / "torch_baseline.py"), "--json", "--nproc", str(case["nproc"]), "--strategy", strategy]
    cmd += [*TORCH_DIMS, "--global-batch", str(PER_PROCESS_BATCH * case["nproc"]), "--steps", str(args.steps)]
    cmd += ["--warmup", str(WARMUP), "--threads", "1", "--no-compute-only"]
    stdout = args.out / f"{tag}.json"
    rc, line = runner.run(cmd, dict(os.environ), args.out / f"{tag}.log", stdout=stdout)
    if rc != 0:
        print(f"  {case['label']}: exit {rc}: {line}", file=sys.stderr)
        return None
    return json.loads(stdout.read_text())["step_time_s"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python experiments/ddp_gap.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--steps", type=int, default=12, help="timed steps per run (after 3 warm-up steps)")
    p.add_argument("--variants", default="default,layer-loop", help="comma list of " + ",".join(VARIANTS))
    p.add_argument("--out", type=Path, default=None, help="run directories and logs (default: a temporary folder)")
    args = p.parse_args(argv)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    if unknown := [v for v in variants if v not in VARIANTS]:
        p.error(f"unknown variant(s) {', '.join(unknown)}")
    if _version("torch") is None:
        p.error("PyTorch is not installed (pip install -e '.[compare]')")
    temp = tempfile.TemporaryDirectory(prefix="ddp_gap_") if args.out is None else None
    args.out = Path(temp.name) if temp else args.out
    args.out.mkdir(parents=True, exist_ok=True)

    cases = [
        {"label": "PyTorch, 1 process, 1 thread", "framework": "pytorch", "nproc": 1},
        {"label": "PyTorch DDP, 2 processes x 1 thread", "framework": "pytorch", "nproc": 2},
    ]
    for v in variants:
        cases += [
            jaxdist_case(f"jaxdist {v}, 1 process pinned to 1 core", 1, True, v, args),
            jaxdist_case(f"jaxdist {v}, 1 process, all cores", 1, False, v, args),
            jaxdist_case(f"jaxdist {v}, 2 processes x 1 device", 2, False, v, args),
        ]
    print(
        f"host: {_cpu_model()}, {os.cpu_count()} cores; jax {_version('jax')}, torch {_version('torch')}; {PER_PROCESS_BATCH} x 128 tokens per process"
    )
    runner, results = Runner(timeout_s=900), {c["label"]: [] for c in cases}
    for r in range(args.repeats):
        for i, case in enumerate(cases):
            run = run_torch if case["framework"] == "pytorch" else run_jaxdist
            t = run(case, args, runner, f"r{r}_c{i}")
            if t is not None:
                results[case["label"]].append(t)
            print(f"  [{r + 1}/{args.repeats}] {case['label']}: " + (f"{t * 1e3:.0f} ms" if t else "failed"), flush=True)
    med = {k: statistics.median(v) if v else None for k, v in results.items()}

    def overhead(two: str, one: str) -> str:
        return "—" if not med[two] or not med[one] else f"{med[two] - med[one]:+.3f} s ({med[two] / med[one] - 1:+.0%})"

    print("\n| case | median step | runs |")
    print("| --- | --- | --- |")
    for label, times in results.items():
        print(
            f"| {label} | "
            + ("failed" if not med[label] else f"{med[label] * 1e3:.0f} ms")
            + f" | {', '.join(f'{t * 1e3:.0f}' for t in times)} |"
        )
    print("\n| 2-process overhead over the 1-process step | over 1 process pinned to 1 core | over 1 process on all cores |")
    print("| --- | --- | --- |")
    torch_over = overhead("PyTorch DDP, 2 processes x 1 thread", "PyTorch, 1 process, 1 thread")
    print(f"| PyTorch DDP (1-thread processes) | {torch_over} | — |")
    for v in variants:
        two = f"jaxdist {v}, 2 processes x 1 device"
        pinned, free = overhead(two, f"jaxdist {v}, 1 process pinned to 1 core"), overhead(two, f"jaxdist {v}, 1 process, all cores")
        print(f"| jaxdist {v} | {pinned} | {free} |")
    if temp:
        temp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
