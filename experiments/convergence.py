"""Long convergence comparisons: each weaker-precision or less-synchronised mode against its
full-precision, fully-synchronised reference, at the lengths the issues set their goals at.

    python experiments/convergence.py [--only grad_reduce,fp8,diloco,fp16] [--steps-scale 1.0]

These runs used to be tests (hundreds of steps each, ~8 minutes of a 2-core CI machine); the
suite keeps short versions of the same comparisons (tests/test_grad_reduce.py, test_fp8.py,
test_diloco.py, test_loss_scale.py) and this script the goals' full lengths. Each comparison
prints its runs' final losses, the gap to the reference and the bound it is held to, and
the script exits 1 when a bound is missed (so it can gate a release by hand).

The model is the tests' tiny decoder (d_model 64, 2 layers, 8 heads with 4 kv heads, batch
16 x 32 tokens) on the standard-library corpus, on fake CPU devices in this one process,
compiled with XLA's default optimisation. A run's loss is the mean of its last 10 steps'
losses unless the row says held-out.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")  # fake CPU devices, even where a GPU plugin is installed
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

TINY = [
    "model.d_model=64",
    "model.n_layers=2",
    "model.n_heads=8",
    "model.n_kv_heads=4",
    "model.dtype=float32",
    "train.global_batch=16",
    "train.seq_len=32",
    "checkpoint.every_steps=0",
    "train.compile_cache=off",
]
LAST = 10  # steps whose losses are averaged for a run's final loss


@dataclass
class Comparison:
    """Runs on one mesh, the first the reference; ``bounds``: name -> (low, high) of the gap
    (run / reference - 1); ``held_out``: compare the held-out loss at the last step instead."""

    mesh: str
    steps: int
    common: tuple[str, ...]
    runs: dict[str, tuple[str, ...]]
    bounds: dict[str, tuple[float, float]]
    held_out: bool = False
    run_meshes: dict[str, str] = field(default_factory=dict)  # a run on another mesh than ``mesh``
    relations: list[tuple[str, str, float]] = field(default_factory=list)  # (worse, better, by at least)


COMPARISONS = {
    # issue 12: compressed gradient reductions, fp32 compute on data=2
    "grad_reduce": Comparison(
        mesh="data=2",
        steps=200,
        common=("train.log_every=10",),
        runs={
            "float32": (),
            "bfloat16": ("parallel.grad_reduce=bfloat16",),
            "int8": ("parallel.grad_reduce=int8",),
            "topk": ("parallel.grad_reduce=topk",),
            "topk without error feedback": ("parallel.grad_reduce=topk", "parallel.error_feedback=false"),
        },
        bounds={"bfloat16": (-0.01, 0.01), "int8": (-0.03, 0.03), "topk": (-1.0, 0.25)},
        relations=[("topk without error feedback", "topk", 0.03)],
    ),
    # issue 33: fp8 projections (every layer) against bf16 on one device
    "fp8": Comparison(
        mesh="data=1",
        steps=300,
        common=("model.dtype=bfloat16", "train.log_every=10"),
        runs={
            "bf16": (),
            "current": ("model.fp8=current", "model.fp8_keep_ends=false"),
            "delayed": ("model.fp8=delayed", "model.fp8_keep_ends=false"),
        },
        bounds={"current": (-0.02, 0.02), "delayed": (-0.02, 0.02)},
    ),
    # issue 13: two DiLoCo replicas syncing every 20 steps against DDP, held-out loss
    "diloco": Comparison(
        mesh="data=2",
        run_meshes={"diloco": "replica=2"},
        steps=600,
        common=("train.lr=3e-3", "train.warmup_steps=20", "train.log_every=100", "train.eval_batches=8"),
        runs={
            "ddp": (),
            "diloco": ("parallel.diloco_inner_steps=20", "parallel.diloco_outer_lr=0.7", "parallel.diloco_outer_momentum=0.5"),
        },
        bounds={"diloco": (-1.0, 0.05)},
        held_out=True,
    ),
    # issue 21: float16 with a dynamic loss scale against float32 on data=2
    "fp16": Comparison(
        mesh="data=2",
        steps=200,
        common=("train.log_every=10",),
        runs={"float32": (), "float16": ("model.dtype=float16",)},
        bounds={"float16": (-0.03, 0.03)},
    ),
}


def final_loss(comparison: Comparison, name: str, steps: int) -> tuple[float, float]:
    """(the run's final loss, its seconds)."""
    import jax
    import numpy as np

    from jaxdist.config import load_config
    from jaxdist.layout.mesh import mesh_device_count, parse_mesh
    from jaxdist.training.run import run

    mesh = comparison.run_meshes.get(name, comparison.mesh)
    overrides = [*TINY, f"train.steps={steps}", *comparison.common, *comparison.runs[name]]
    if comparison.held_out:
        overrides.append(f"train.eval_every={steps}")  # one held-out evaluation, at the end
    sizes = parse_mesh(mesh)
    start = time.perf_counter()
    result = run(load_config(None, overrides), sizes, None, devices=jax.devices()[: mesh_device_count(sizes)], progress=False)
    seconds = time.perf_counter() - start
    if comparison.held_out:
        return float(result.eval_losses[steps]), seconds
    return float(np.mean(result.losses[-LAST:])), seconds


def run_comparison(name: str, scale: float) -> bool:
    comparison = COMPARISONS[name]
    steps = max(20, round(comparison.steps * scale))
    losses, seconds = {}, {}
    for run_name in comparison.runs:
        losses[run_name], seconds[run_name] = final_loss(comparison, run_name, steps)
    reference = next(iter(comparison.runs))
    gap = {run_name: losses[run_name] / losses[reference] - 1 for run_name in losses}
    ok = True
    print(f"\n### {name}: {steps} steps, {'held-out loss' if comparison.held_out else f'mean of the last {LAST} losses'}\n")
    print("| run | loss | gap to " + reference + " | bound | seconds | |")
    print("|---|---|---|---|---|---|")
    for run_name in comparison.runs:
        bound = comparison.bounds.get(run_name)
        held = bound is None or bound[0] <= gap[run_name] <= bound[1]
        ok &= held
        shown = "" if bound is None else f"[{bound[0]:+.0%}, {bound[1]:+.0%}]"
        print(
            f"| {run_name} | {losses[run_name]:.5f} | {gap[run_name]:+.3%} | {shown} | {seconds[run_name]:.0f} | {'' if held else 'MISSED'} |"
        )
    for worse, better, margin in comparison.relations:
        held = gap[worse] > gap[better] + margin
        ok &= held
        print(f"\n{worse} behind {better} by {gap[worse] - gap[better]:+.2%} (at least {margin:+.0%}): {'held' if held else 'MISSED'}")
    return ok


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default=",".join(COMPARISONS), help="comma-separated: " + ", ".join(COMPARISONS))
    parser.add_argument("--steps-scale", type=float, default=1.0, help="multiply every comparison's steps (the goals hold at 1.0)")
    args = parser.parse_args(argv)
    names = [n for n in args.only.split(",") if n]
    unknown = sorted(set(names) - set(COMPARISONS))
    if unknown:
        parser.error(f"unknown comparison {', '.join(unknown)}; choose from {', '.join(COMPARISONS)}")
    import jax

    print(
        f"host: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; jax {jax.__version__}; "
        f"{jax.device_count()} fake {jax.devices()[0].platform} devices in one process; "
        f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}; OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}; "
        f"`python experiments/convergence.py --only {','.join(names)} --steps-scale {args.steps_scale:g}`"
    )
    results = {name: run_comparison(name, args.steps_scale) for name in names}
    missed = [name for name, ok in results.items() if not ok]
    print(
        f"\n{len(names) - len(missed)} of {len(names)} comparisons within their bounds"
        + (f"; missed: {', '.join(missed)}" if missed else "")
    )
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
