"""What each ``parallel.grad_reduce`` mode buys: bytes on the wire, step time, the profile's
communication share, and what it costs in loss.

    python experiments/compression_bench.py [--procs 2,4] [--modes float32,bfloat16,int8,topk]
                                           [--steps 60] [--repeats 1] [--out DIR] [--write-readme]

A communication-heavy set-up (the one ``tests/test_profile.py`` proves communication-bound):
a 512-wide, 2-layer decoder, one 16-token sequence per process, fp32 compute, AdamW,
the stdlib corpus, N processes x 1 device over gloo (``jaxdist.launch``). Each run traces
two steps with ``--profile-steps`` (so ``profile/analysis.json`` holds the compiled step's
collectives and ``profile/summary.json`` the measured fractions) and trains ``--steps``
steps. Printed per (processes, mode), modes interleaved and repeated:

- wire bytes per device per step (``jaxdist.analyze`` on the compiled program), and the
  ratio to float32's;
- step time: the median over the timed steps (after a warm-up, without the profile
  window), median over repeats; the ratio to float32's at the same process count;
- communication share of the traced steps (exposed + overlapped);
- loss: the mean of the last 10 losses, and its gap to float32's.

Thread settings: each process is a separate XLA CPU client whose thread pool sees every
core; ``--xla_force_host_platform_device_count=1`` per process (what the launcher sets).
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

from scaling import Runner, hardware_info, host_line, read_metrics  # noqa: E402

MODEL = ["model.d_model=512", "model.n_layers=2", "model.n_heads=8", "model.n_kv_heads=4", "model.dtype=float32"]
MODEL += ["train.seq_len=16", "data.source=stdlib", "checkpoint.every_steps=0", "train.compile_cache=off", "train.log_every=1"]
MODES = ("float32", "bfloat16", "int8", "topk")
WARMUP, PROFILE_WINDOW, LAST = 5, (6, 7), 10
README = HERE / "README.md"
BEGIN, END = "<!-- compression:begin -->", "<!-- compression:end -->"


def run_case(nproc: int, mode: str, args: argparse.Namespace, runner: Runner, tag: str) -> dict | None:
    run_dir = args.out / tag
    shutil.rmtree(run_dir, ignore_errors=True)
    train = ["--mesh", f"data={nproc}", "--steps", str(args.steps), "--run-dir", str(run_dir)]
    train += ["--profile-steps", f"{PROFILE_WINDOW[0]}:{PROFILE_WINDOW[1]}", *MODEL, f"train.global_batch={nproc}"]
    train += [f"parallel.grad_reduce={mode}"]
    cmd = [sys.executable, "-m", "jaxdist.launch", "--nproc", str(nproc), "--devices-per-proc", "1", "--", *train]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # the launcher sets one device per process
    rc, line = runner.run(cmd, env, args.out / f"{tag}.log")
    if rc != 0:
        print(f"  {nproc} processes, {mode}: exit {rc}: {line}", file=sys.stderr)
        return None
    times = [t for step, t in read_metrics(run_dir).items() if step > WARMUP and not PROFILE_WINDOW[0] <= step <= PROFILE_WINDOW[1] + 1]
    losses = [json.loads(x)["loss"] for x in (run_dir / "metrics.jsonl").read_text().splitlines() if '"loss"' in x]
    analysis = json.loads((run_dir / "profile" / "analysis.json").read_text())
    summary = json.loads((run_dir / "profile" / "summary.json").read_text())
    fractions = summary["fractions"]
    return {
        "step_time_s": statistics.median(times),
        "wire_bytes": sum(s["wire_bytes"] or 0 for s in analysis["collectives"].values() if s["count"]),
        "communication_share": fractions["communication_exposed"] + fractions["communication_overlapped"],
        "bound": summary["bound"],
        "loss": statistics.fmean(losses[-LAST:]),
        "params": analysis["params"],
    }


def table(results: dict, args: argparse.Namespace, info: dict) -> str:
    lines = [
        f"{host_line(info)}; {args.steps} steps, {args.repeats} repeat(s), modes interleaved; "
        "`python experiments/compression_bench.py " + f"--procs {args.procs} --steps {args.steps} --repeats {args.repeats}`",
        "",
        "| processes | mode | wire bytes / step | vs float32 | step time | vs float32 | communication share | bound | loss (last 10) | vs float32 |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for nproc in sorted({n for n, _ in results}):
        base = results.get((nproc, "float32"))
        for mode in args.modes:
            r = results.get((nproc, mode))
            if r is None:
                lines.append(f"| {nproc} | {mode} | failed | | | | | | | |")
                continue
            rel = lambda key, r=r, base=base: f"{r[key] / base[key]:.3f}" if base else "—"  # noqa: E731
            gap = f"{r['loss'] / base['loss'] - 1:+.2%}" if base else "—"
            lines.append(
                f"| {nproc} | {mode} | {r['wire_bytes'] / 2**20:.2f} MiB | {rel('wire_bytes')} | {r['step_time_s'] * 1e3:.0f} ms | "
                f"{rel('step_time_s')} | {r['communication_share']:.0%} | {r['bound']} | {r['loss']:.3f} | {gap} |"
            )
    return "\n".join(lines)


def start_bench(args: argparse.Namespace, prefix: str):
    """``args.out`` made (a temporary folder when not given: keep the returned handle
    alive), the host printed; returns (the temporary folder or None, the host info)."""
    temp = tempfile.TemporaryDirectory(prefix=prefix) if args.out is None else None
    args.out = Path(temp.name) if temp else args.out
    args.out.mkdir(parents=True, exist_ok=True)
    info = hardware_info("cpu")
    print(f"host: {host_line(info)}; threads: {info['threads']['jaxdist proc']}", flush=True)
    return temp, info


def write_readme(text: str, begin: str = BEGIN, end: str = END) -> None:
    """Put ``text`` between the markers in experiments/README.md (appended the first time)."""
    readme = README.read_text()
    block = f"{begin}\n{text}\n{end}"
    if begin in readme:
        head, rest = readme.split(begin, 1)
        readme = head + block + rest.split(end, 1)[1]
    else:
        readme += f"\n{block}\n"
    README.write_text(readme)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python experiments/compression_bench.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--procs", default="2,4", help="comma list of process counts")
    p.add_argument("--modes", default=",".join(MODES), help="comma list of " + ",".join(MODES))
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--timeout", type=float, default=900, help="seconds per run")
    p.add_argument("--out", type=Path, default=None, help="run directories and logs (default: a temporary folder)")
    p.add_argument("--write-readme", action="store_true", help=f"put the table in {README.relative_to(HERE.parent)}")
    args = p.parse_args(argv)
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if unknown := [m for m in args.modes if m not in MODES]:
        p.error(f"unknown mode(s) {', '.join(unknown)}")
    if args.steps < PROFILE_WINDOW[1] + WARMUP:
        p.error(f"--steps must be at least {PROFILE_WINDOW[1] + WARMUP}")
    procs = [int(n) for n in args.procs.split(",")]
    temp, info = start_bench(args, "compression_bench_")

    runner, runs = Runner(args.timeout), {}
    for repeat in range(args.repeats):
        for nproc in procs:
            for mode in args.modes:
                r = run_case(nproc, mode, args, runner, f"p{nproc}-{mode}-r{repeat}")
                print(f"  {nproc} processes, {mode}, repeat {repeat + 1}: {r}", flush=True)
                if r is not None:
                    runs.setdefault((nproc, mode), []).append(r)
    results = {}
    for key, rs in runs.items():
        results[key] = {**rs[0], "step_time_s": statistics.median(r["step_time_s"] for r in rs)}
        results[key]["communication_share"] = statistics.median(r["communication_share"] for r in rs)
    text = table(results, args, info)
    print(text)
    (args.out / "results.json").write_text(json.dumps({f"{n}/{m}": r for (n, m), r in results.items()}, indent=1))
    if args.write_readme:
        write_readme(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
