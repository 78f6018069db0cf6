"""Muon vs AdamW on the same token budget: a short learning-rate sweep for each, loss curves
and tokens/s, as the Muon papers compare them.

    python experiments/muon_vs_adamw.py [--steps 200] [--lrs 3e-3,1e-2,3e-2] [--repeats 1]
                                        [--out DIR] [--figure experiments/figures/muon_vs_adamw.png]

The model is the ``small`` preset narrowed to fit a 2-core CPU in minutes (d_model 128, 4
layers, 4 heads of 32 with 2 kv heads, 0.89M parameters; batch 32 x 128 tokens, fp32, one
device), trained on the standard-library corpus (``data.source=stdlib``, bytes). Every run sees the same batches
in the same order from the same initial weights, and the same schedule (warmup 10% of the
steps, cosine to 10% of the lr), gradient clipping 1.0 and weight decay 0.1. Muon runs with
``train.muon_scale=match_adamw`` (Moonlight's 0.2 sqrt(max(m, n))), so both optimizers share
one lr grid. The held-out tail is evaluated at the end (8 batches).

Runs are interleaved (for each lr and repeat: AdamW, then Muon), so the noise of a shared
machine falls on both alike. Printed per (optimizer, lr): the final training loss (mean of
the last 20 steps), the held-out loss, the median tokens/s (after the first 10 steps), and
the hardware and thread settings; the figure shows each run's training loss (a moving
average) and the held-out loss against the lr.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

MODEL = [
    "model.d_model=128",
    "model.n_layers=4",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "model.dtype=float32",
    "train.global_batch=32",
    "train.seq_len=128",
    "data.source=stdlib",
    "checkpoint.every_steps=0",
    "train.compile_cache=off",
    "train.log_every=1",
    "train.eval_batches=8",
]
OPTIMIZERS = ("adamw", "muon")
BATCH_TOKENS = 32 * 128
WARMUP_STEPS, LAST = 10, 20  # tokens/s after the first steps; the final loss over the last steps


def run_one(optimizer: str, lr: float, steps: int, run_dir: Path) -> dict:
    import jax

    from jaxdist.config import load_config
    from jaxdist.layout.mesh import parse_mesh
    from jaxdist.training.run import run

    overrides = [*MODEL, f"train.optimizer={optimizer}", f"train.lr={lr}", f"train.steps={steps}"]
    overrides += [f"train.warmup_steps={max(1, steps // 10)}", f"train.eval_every={steps}"]
    start = time.perf_counter()
    run(load_config("small", overrides), parse_mesh("data=1"), run_dir, devices=jax.devices()[:1], progress=False)
    return read_run(run_dir, optimizer, lr) | {"wall_s": time.perf_counter() - start}


def read_run(run_dir: Path, optimizer: str, lr: float) -> dict:
    """One run's figures, from its metrics.jsonl."""
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [x for x in lines if "loss" in x and "tokens_per_sec" in x]
    losses = [x["loss"] for x in train]
    return {
        "optimizer": optimizer,
        "lr": lr,
        "losses": losses,
        "final_loss": statistics.fmean(losses[-LAST:]),
        "eval_loss": [x["eval_loss"] for x in lines if "eval_loss" in x][-1],
        "tokens_per_sec": statistics.median(x["tokens_per_sec"] for x in train if x["step"] > WARMUP_STEPS and x["tokens_per_sec"]),
        "tokens": len(losses) * BATCH_TOKENS,
    }


def smoothed(values: list[float], decay: float = 0.9) -> list[float]:
    """An exponential moving average, bias-corrected (no drop when the first losses leave a window)."""
    out, average = [], 0.0
    for i, v in enumerate(values):
        average = decay * average + (1 - decay) * v
        out.append(average / (1 - decay ** (i + 1)))
    return out


def draw(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (curves, sweep) = plt.subplots(1, 2, figsize=(11, 4.2))
    colors = {"adamw": "tab:blue", "muon": "tab:red"}
    lrs = sorted({r["lr"] for r in results})
    for r in results:
        if r.get("repeat", 0):
            continue
        shade = 0.35 + 0.65 * (lrs.index(r["lr"]) + 1) / len(lrs)
        tokens = [(i + 1) * r["tokens"] / len(r["losses"]) / 1e6 for i in range(len(r["losses"]))]
        label = f"{r['optimizer']} lr {r['lr']:g}"
        curves.plot(tokens, smoothed(r["losses"]), color=colors[r["optimizer"]], alpha=shade, lw=1.2, label=label)
    curves.set_xlabel("tokens (millions; the same batches for every run)")
    curves.set_ylabel("training loss (moving average, 0.9)")
    curves.set_ylim(top=3.2)
    curves.legend(fontsize=8, ncol=2)
    curves.set_title("loss curves")
    for optimizer in OPTIMIZERS:
        points = [(lr, statistics.median(r["eval_loss"] for r in results if r["optimizer"] == optimizer and r["lr"] == lr)) for lr in lrs]
        sweep.plot([p[0] for p in points], [p[1] for p in points], "o-", color=colors[optimizer], label=optimizer)
    sweep.set_xscale("log")
    sweep.set_xticks(lrs, [f"{lr:g}" for lr in lrs])
    sweep.minorticks_off()
    sweep.set_xlabel("train.lr")
    sweep.set_ylabel("held-out loss at the end")
    sweep.set_title("learning-rate sweep")
    sweep.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def settings() -> str:
    import jax

    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError, StopIteration), open("/proc/cpuinfo") as info:
        cpu = next(line.split(":", 1)[1].strip() for line in info if line.startswith("model name"))
    return (
        f"{cpu}, {os.cpu_count()} cores (usable {len(os.sched_getaffinity(0))}), {jax.devices()[0].platform} x 1 device, "
        f"jax {jax.__version__}; XLA_FLAGS={os.environ.get('XLA_FLAGS')!r}, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')!r} "
        "(XLA's CPU thread pool sized to the host's cores)"
    )


def table(results: list[dict]) -> str:
    lines = [
        "| optimizer | lr | final train loss | held-out loss | tokens/s (median) | runs |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for optimizer in OPTIMIZERS:
        for lr in sorted({r["lr"] for r in results}):
            runs = [r for r in results if r["optimizer"] == optimizer and r["lr"] == lr]
            final = statistics.median(r["final_loss"] for r in runs)
            held = statistics.median(r["eval_loss"] for r in runs)
            speed = statistics.median(r["tokens_per_sec"] for r in runs)
            lines.append(f"| {optimizer} | {lr:g} | {final:.4f} | {held:.4f} | {speed:,.0f} | {len(runs)} |")
    return "\n".join(lines)


def sweep(lrs: list[float], args: argparse.Namespace) -> list[dict]:
    out = args.out or Path(tempfile.mkdtemp(prefix="muon_vs_adamw-"))
    results = []
    for repeat in range(args.repeats):
        for lr in lrs:
            for optimizer in OPTIMIZERS:
                r = run_one(optimizer, lr, args.steps, out / f"{optimizer}-{lr:g}-{repeat}")
                r["repeat"] = repeat
                results.append(r)
                print(
                    f"{optimizer} lr {lr:g} (repeat {repeat}): loss {r['final_loss']:.4f}, held-out {r['eval_loss']:.4f}, "
                    f"{r['tokens_per_sec']:,.0f} tokens/s, {r['wall_s']:.0f} s",
                    file=sys.stderr,
                )
    print(f"run directories: {out}", file=sys.stderr)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--lrs", default="3e-3,1e-2,3e-2")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None, help="run directories (default: a temporary folder)")
    parser.add_argument("--figure", type=Path, default=HERE / "figures" / "muon_vs_adamw.png")
    parser.add_argument("--redraw", type=Path, default=None, help="redraw from an earlier run's directories (its --out)")
    args = parser.parse_args()
    lrs = [float(x) for x in args.lrs.split(",")]
    if args.redraw:  # the figure and the table again, from the run directories of an earlier run
        results = []
        for run_dir in sorted(args.redraw.iterdir()):
            optimizer, lr, repeat = run_dir.name.split("-")
            results.append(read_run(run_dir, optimizer, float(lr)) | {"repeat": int(repeat)})
    else:
        results = sweep(lrs, args)
    draw(results, args.figure)
    tokens = results[0]["tokens"]
    print(f"{settings()}\n{tokens // BATCH_TOKENS} steps x 32 x 128 = {tokens:,} tokens per run; figure: {args.figure}\n")
    print(table(results))
    best = {o: min((r for r in results if r["optimizer"] == o), key=lambda r: r["eval_loss"]) for o in OPTIMIZERS}
    speed = {o: statistics.median(r["tokens_per_sec"] for r in results if r["optimizer"] == o) for o in OPTIMIZERS}
    print(
        f"\nbest held-out loss: adamw {best['adamw']['eval_loss']:.4f} (lr {best['adamw']['lr']:g}), "
        f"muon {best['muon']['eval_loss']:.4f} (lr {best['muon']['lr']:g}); "
        f"muon's tokens/s / adamw's (medians over all runs): {speed['muon'] / speed['adamw']:.3f}"
    )


if __name__ == "__main__":
    main()
