"""Long sequences on CPU fake devices: memory per device and step time vs sequence length, by
context size and strategy; and the planner beside torchtitan's context-parallel table.

    python experiments/long_context.py [--seq 1024,2048,4096] [--contexts 1,2,4,8]
        [--strategies all_gather,ring,all_to_all] [--budget-mib 64] [--steps 3] [--remat none]
        [--plot experiments/figures/long_context.png] [--json PATH]
    python experiments/long_context.py --torchtitan [--max-compiles 4]

The sweep: a small decoder (``MODEL``, fp32, one sequence per step) is compiled for every
context size (context=1 is the plain model on one device) and strategy (all_gather, ring and
all_to_all, Ulysses), at every sequence length the split divides (2 x context chunks); per device it
reports the compiled program's memory
(``jaxdist.inspect.step_report.build_report``'s ``memory_per_device_bytes``, what
``python -m jaxdist.analyze`` prints) and the bytes its collectives move over ``context``, then
times a few steps. From the memory it gives the longest sequence that fits ``--budget-mib`` per
device: the longest measured, and the one a quadratic fit of the measured totals reaches. Fake
devices share the host's cores, so the step times show what the split costs, never a speed-up.

``--torchtitan``: torchtitan's Llama 3.1 8B rows (8 H100, local batch 1, full activation
checkpointing, FSDP x CP = 8 at 32K-256K tokens) rebuilt as jaxdist configs, compiled against 8
fake devices and priced by ``jaxdist.plan.cost`` on the ``h100-hbm2e`` profile; and what
``python -m jaxdist.plan`` picks for each row (its screen, then ``--max-compiles`` compiles).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
FAKE_DEVICES = 8
if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={FAKE_DEVICES}".strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jaxdist.config import load_config  # noqa: E402
from jaxdist.layout.mesh import mesh_device_count, parse_mesh  # noqa: E402

MIB = 2**20
STRATEGIES = ("all_gather", "ring", "all_to_all")  # parallel.context_strategy
MODEL = [
    "data.source=synthetic",
    "model.vocab_size=256",
    "model.d_model=64",
    "model.n_layers=2",
    "model.n_heads=8",
    "model.n_kv_heads=4",
    "model.dtype=float32",
    "train.global_batch=1",
]

# torchtitan docs/performance.md, table 2: Llama 3.1 8B, 8 x H100 (96 GB HBM2e, 500 W), FSDP + CP +
# torch.compile + Float8, local batch 1, full activation checkpointing: (fsdp, cp, seq, tokens/s/GPU).
TORCHTITAN = [(8, 1, 32768, 3890), (4, 2, 65536, 2540), (2, 4, 131072, 1071), (1, 8, 262144, 548)]
LLAMA_8B = [
    "model.vocab_size=128256", "model.d_model=4096", "model.n_layers=32", "model.n_heads=32", "model.n_kv_heads=8",
    "model.mlp_dim=14336", "model.rope_theta=500000", "model.remat=full", "model.loss_chunk=4096",
]  # fmt: skip


def host_line() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return (
        f"host: {cpu}, {cores} cores usable ({os.cpu_count()} online); jax {jax.__version__}, {jax.device_count()} fake "
        f"{jax.devices()[0].platform} devices sharing those cores (XLA:CPU's thread pool, one per process); "
        f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}; OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}"
    )


# ---------------------------------------------------------------------------------------------
# The CPU sweep


def case_overrides(seq: int, context: int, strategy: str, remat: str) -> tuple[str, list[str]]:
    mesh = f"context={context}" if context > 1 else "data=1"
    overrides = [*MODEL, f"train.seq_len={seq}", f"model.remat={remat}", f"parallel.mesh={mesh}"]
    if context > 1:
        overrides.append(f"parallel.context_strategy={strategy}")
    return mesh, overrides


def measure(seq: int, context: int, strategy: str, remat: str, steps: int) -> dict:
    from jaxdist.data.batches import make_iterator
    from jaxdist.inspect.step_report import build_report
    from jaxdist.plan.hlo_cost import program_cost
    from jaxdist.training.run import build_trainer

    mesh, overrides = case_overrides(seq, context, strategy, remat)
    config = load_config(None, overrides)
    sizes = parse_mesh(mesh)
    trainer = build_trainer(config, sizes, jax.devices()[: mesh_device_count(sizes)])
    state = trainer.init_state(0)
    batches = make_iterator(config, trainer.layout)
    batch = next(batches)
    batches.close()
    start = time.perf_counter()
    compiled = trainer.train_step.lower(state, batch).compile()
    compile_s = time.perf_counter() - start
    report = build_report(trainer, compiled)
    state, metrics = compiled(state, batch)  # warm-up
    jax.block_until_ready(metrics)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        state, metrics = compiled(state, batch)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - start)
    step = statistics.median(times)
    over_context = report["collectives_by_axes"].get("context", {}).get("bytes", 0)
    cost = program_cost(compiled.as_text(), {a: int(n) for a, n in trainer.layout.mesh.shape.items()})
    kv = sum(op.executions * op.bytes for op in cost.collectives if op.name in cost.attention_collectives)
    return {
        "context": context,
        "strategy": strategy if context > 1 else "-",
        "seq_len": seq,
        "memory": report["memory_per_device_bytes"],
        "context_bytes": over_context,
        "attention_bytes": kv,
        "step_time_s": step,
        "tokens_per_sec": seq / step,
        "loss": float(metrics["loss"]),
        "compile_s": compile_s,
    }


def longest_fitting(points: list[dict], budget: float, divisor: int) -> tuple[int | None, int | None]:
    """(the longest measured sequence whose total fits ``budget``, the longest a quadratic fit of
    total(seq) through the measured points reaches, rounded down to a multiple of ``divisor``)."""
    fits = [p["seq_len"] for p in points if p["memory"]["total"] <= budget]
    measured = max(fits) if fits else None
    if len(points) < 3:
        return measured, None
    seqs = np.array([p["seq_len"] for p in points], float)
    a, b, c = np.polyfit(seqs, np.array([p["memory"]["total"] for p in points], float), 2)
    roots = [r.real for r in np.roots([a, b, c - budget]) if abs(r.imag) < 1e-9 and r.real > 0]
    if not roots:
        return measured, None
    return measured, int(min(roots) // divisor * divisor)


def sweep(args) -> list[dict]:
    rows = []
    for context in args.contexts:
        for strategy in args.strategies if context > 1 else ["-"]:
            for seq in args.seq:
                if seq % (2 * context):
                    print(f"skipped: seq {seq} is not divisible by 2 x context = {2 * context}", file=sys.stderr)
                    continue
                row = measure(seq, context, strategy, args.remat, args.steps)
                rows.append(row)
                print(
                    f"context={context} {row['strategy']:<10} seq {seq:>6}: total {row['memory']['total'] / MIB:8.1f} MiB "
                    f"(temp {row['memory']['temp'] / MIB:.1f}), step {row['step_time_s']:.3f} s, compile {row['compile_s']:.1f} s",
                    flush=True,
                )
    return rows


def sweep_tables(rows: list[dict], budget_mib: float) -> str:
    lines = [
        "| context | strategy | seq | temp MiB | total MiB | over context MiB/step (attention's own) | step s | tokens/s | loss |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        m = r["memory"]
        lines.append(
            f"| {r['context']} | {r['strategy']} | {r['seq_len']:,} | {m['temp'] / MIB:.1f} | {m['total'] / MIB:.1f} | "
            f"{r['context_bytes'] / MIB:.2f} ({r['attention_bytes'] / MIB:.2f}) | {r['step_time_s']:.3f} | {r['tokens_per_sec']:,.0f} | {r['loss']:.4f} |"
        )
    lines += [
        "",
        f"Longest sequence within {budget_mib:g} MiB per device (compiled total):",
        "",
        "| context | strategy | longest measured | quadratic fit of the measured totals |",
        "| --- | --- | --- | --- |",
    ]
    for (context, strategy), points in _groups(rows).items():
        measured, fitted = longest_fitting(points, budget_mib * MIB, 2 * context)
        lines.append(
            f"| {context} | {strategy} | {f'{measured:,}' if measured else 'none measured'} | {f'{fitted:,}' if fitted else 'no fit'} |"
        )
    return "\n".join(lines)


def _groups(rows: list[dict]) -> dict[tuple[int, str], list[dict]]:
    groups: dict[tuple[int, str], list[dict]] = {}
    for r in rows:
        groups.setdefault((r["context"], r["strategy"]), []).append(r)
    return groups


def plot(rows: list[dict], path: Path, budget_mib: float, title: str) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no plot drawn (pip install matplotlib)"
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for (context, strategy), points in _groups(rows).items():
        label = "context=1" if context == 1 else f"context={context} {strategy}"
        style = {"ring": "--", "all_to_all": ":"}.get(strategy, "-")
        seqs = [p["seq_len"] for p in points]
        left.plot(seqs, [p["memory"]["total"] / MIB for p in points], style, marker="o", label=label)
        right.plot(seqs, [p["step_time_s"] for p in points], style, marker="o", label=label)
    left.axhline(budget_mib, color="grey", linewidth=0.8, linestyle=":")
    left.set(yscale="log", xlabel="sequence length (tokens)", ylabel="compiled memory per device (MiB)")
    right.set(yscale="log", xlabel="sequence length (tokens)", ylabel="step time (s, fake devices share the cores)")
    seqs = sorted({r["seq_len"] for r in rows})
    for ax in (left, right):
        ax.grid(True, which="both", alpha=0.3)
        ax.set_xscale("log", base=2)
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_xticks(seqs, [f"{s // 1024}K" if s % 1024 == 0 else str(s) for s in seqs])
    left.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    return f"plot: {path}"


# ---------------------------------------------------------------------------------------------
# torchtitan's table, priced


def torchtitan_rows(max_compiles: int) -> str:
    import types

    from jaxdist.plan.__main__ import plan
    from jaxdist.plan.cost import predict_summary
    from jaxdist.plan.hardware import load_hardware
    from jaxdist.plan.hlo_cost import ProgramCost
    from jaxdist.plan.search import compile_summary

    hardware = load_hardware("h100-hbm2e")
    lines = [
        f"Priced on `{hardware.key}` ({hardware.name}); jaxdist config: `{' '.join(LLAMA_8B)}` plus the row's sequence, mesh "
        "and strategy (`model.dtype=bfloat16`, global batch = fsdp).",
        "",
        "| torchtitan row | seq | published tok/s/GPU | jaxdist layout | predicted tok/s/GPU | error | MFU | matmul s | memory s "
        "| K/V over context s (exposed) | other collectives s (exposed) | with a flash per-block kernel: tok/s/GPU (error) "
        "| planner's pick (predicted tok/s/GPU) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for fsdp, cp, seq, published in TORCHTITAN:
        mesh = f"fsdp={fsdp},context={cp}" if cp > 1 else f"fsdp={fsdp}"
        base = [*LLAMA_8B, "data.source=synthetic", "model.dtype=bfloat16", f"train.seq_len={seq}", f"train.global_batch={fsdp}"]
        for strategy in ("all_gather", "ring") if cp > 1 else ("-",):
            overrides = [*base, f"parallel.mesh={mesh}"] + ([f"parallel.context_strategy={strategy}"] if cp > 1 else [])
            summary, _ = compile_summary(load_config(None, overrides))
            cost = ProgramCost.from_dict(summary["program"])
            p = predict_summary(cost, hardware, summary)
            kv, other = _collective_split(cost, hardware, summary["mesh"], p)
            # the same program with the attention scores kept on chip, as a flash kernel per block would
            flash_cost = dataclasses.replace(cost, memory_bytes=cost.memory_bytes - cost.score_bytes, score_bytes=0.0, skippable_bytes=0.0)
            flash = predict_summary(flash_cost, hardware, summary).tokens_per_sec_per_device
            label = f"{mesh} {strategy}" if cp > 1 else mesh
            print(f"torchtitan FSDP {fsdp} CP {cp} seq {seq}: {label}: {p.tokens_per_sec_per_device:,.0f} tok/s/GPU", flush=True)
            pick = ""
            if strategy in ("-", "all_gather"):  # once per row
                args = types.SimpleNamespace(
                    config=None, gpus=8, hardware=hardware.key, gpus_per_node=None, global_batch=None, top=1, time_budget=1800.0,
                    max_compiles=max_compiles, json=True, overrides=[*base, "parallel.mesh=auto"], links=None,
                )  # fmt: skip
                best = (plan(args, log=lambda m: print(m, file=sys.stderr))["candidates"] or [None])[0]
                pick = "none fits" if best is None else (
                    f"{best['mesh']}{' ' + best['context_strategy'] if best['context_strategy'] else ''} "
                    f"remat={best['remat']} mb={best['microbatches']} ({best['tokens_per_sec_per_device']:,.0f})"
                )  # fmt: skip
            lines.append(
                f"| FSDP {fsdp}, CP {cp} | {seq:,} | {published:,} | {label} | {p.tokens_per_sec_per_device:,.0f} | "
                f"{p.tokens_per_sec_per_device / published - 1:+.0%} | {p.mfu:.0%} | {p.matmul_s:.2f} | {p.memory_s:.2f} | "
                f"{kv[0]:.2f} ({kv[1]:.2f}) | {other[0]:.2f} ({other[1]:.2f}) | {flash:,.0f} ({flash / published - 1:+.0%}) | {pick} |"
            )
    return "\n".join(lines)


def _collective_split(cost, hardware, mesh_shape, prediction) -> tuple[tuple[float, float], tuple[float, float]]:
    """((time, exposed) of attention's collectives over context, (time, exposed) of the others), as
    ``jaxdist.plan.cost.predict`` prices them (exposure shared out by time where both hide)."""
    from jaxdist.plan.cost import _gpu_bytes_factor, _hideable, _op_time, node_split

    crossing = node_split(mesh_shape, hardware.gpus_per_node)
    parts = {True: [0.0, 0.0], False: [0.0, 0.0]}  # in attention: [critical, hideable]
    for op in cost.collectives:
        t = op.executions * _op_time(op, hardware, crossing) * _gpu_bytes_factor(op, cost, hardware)
        parts[op.name in cost.attention_collectives][1 if _hideable(op, cost, hardware) else 0] += t
    hidden_exposed = prediction.comm_exposed_s - parts[True][0] - parts[False][0]
    hideable = parts[True][1] + parts[False][1]
    out = []
    for key in (True, False):
        share = parts[key][1] / hideable if hideable else 0.0
        out.append((sum(parts[key]), parts[key][0] + share * hidden_exposed))
    return out[0], out[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python experiments/long_context.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", default="1024,2048,4096", help="comma list of sequence lengths")
    parser.add_argument("--contexts", default="1,2,4,8", help="comma list of context sizes (1: no split, one device)")
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    parser.add_argument("--remat", default="none", choices=("none", "save_matmuls", "full"))
    parser.add_argument("--steps", type=int, default=3, help="timed steps per case (after one warm-up)")
    parser.add_argument("--budget-mib", type=float, default=64.0, help="memory per device the longest-sequence column fits")
    parser.add_argument("--plot", type=Path, default=HERE / "figures" / "long_context.png")
    parser.add_argument("--json", type=Path, default=None, help="write the measured rows here")
    parser.add_argument("--torchtitan", action="store_true", help="price torchtitan's context-parallel rows instead")
    parser.add_argument("--max-compiles", type=int, default=4, help="--torchtitan: the planner's compiles per row")
    args = parser.parse_args(argv)
    print(host_line(), flush=True)
    if args.torchtitan:
        print(torchtitan_rows(args.max_compiles))
        return 0
    try:
        args.seq = [int(s) for s in args.seq.split(",") if s.strip()]
        args.contexts = [int(c) for c in args.contexts.split(",") if c.strip()]
    except ValueError as e:
        parser.error(f"--seq and --contexts take comma lists of integers ({e})")
    args.strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    if bad := [s for s in args.strategies if s not in STRATEGIES]:
        parser.error(f"unknown strategy {', '.join(bad)} ({', '.join(STRATEGIES)})")
    if bad := [c for c in args.contexts if c < 1 or c > jax.device_count()]:
        parser.error(f"context sizes must be 1..{jax.device_count()} (the fake devices), got {bad}")
    if args.steps < 1 or args.budget_mib <= 0 or not args.seq or min(args.seq) < 2:
        parser.error("--steps >= 1, --budget-mib > 0 and sequence lengths >= 2")
    model = ", ".join(w.split(".", 1)[1] for w in MODEL[1:])
    print(f"model: {model}, remat {args.remat}; {args.steps} timed steps per case, median", flush=True)
    start = time.perf_counter()
    rows = sweep(args)
    print(f"\n{sweep_tables(rows, args.budget_mib)}\n")
    print(plot(rows, args.plot, args.budget_mib, f"jaxdist long_context.py: {model} (CPU fake devices)"))
    print(f"sweep took {time.perf_counter() - start:.0f} s")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
