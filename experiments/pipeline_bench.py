"""Pipeline schedules side by side: executed FLOPs against the ideal, bubble, step time, temp memory.

    python experiments/pipeline_bench.py [--steps 5] [--layers 8] [--schedules 1f1b,zb1,zbv]

For each schedule and (S stages, M microbatches, V virtual stages, 1F1B's recompute): the
matmul FLOPs one device executes per step (``jaxdist.plan.hlo_cost.program_cost``: every
dot of the compiled step, times the trip counts of the loops around it) over the ideal,
the same model's one-device step FLOPs / S (a ``conditional`` at its costliest branch: zb1's and
zbv's slots run one branch per device, and a lockstep tick lasts as long as the costliest); beside it 1 + the schedule's bubble and what
the tick algebra predicts (``jaxdist.parallel.pipeline_schedule.executed_over_ideal``, the head's
share taken from the one-device program); the median step time and its ratio to one
device; XLA's per-device temp memory. On fake CPU devices all stages share the host's
cores, so the pipeline cannot run faster than one device: CPU timings only show the
schedules' overheads, not their speedups; the FLOPs ratio and the memory carry over.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import jax  # noqa: E402

from jaxdist.config import load_config  # noqa: E402
from jaxdist.data.batches import make_iterator  # noqa: E402
from jaxdist.inspect.hlo import callees, computation_multipliers, parse_hlo  # noqa: E402
from jaxdist.layout.mesh import mesh_device_count, parse_mesh  # noqa: E402
from jaxdist.parallel.pipeline_schedule import executed_over_ideal, pipeline_spec  # noqa: E402
from jaxdist.plan.hlo_cost import program_cost  # noqa: E402
from jaxdist.training.run import build_trainer  # noqa: E402

CASES = [  # (schedule, S, M, V, recompute)
    ("gpipe", 2, 2, 1, False),
    ("gpipe", 2, 8, 1, False),
    ("circular", 2, 8, 2, False),
    ("1f1b", 2, 8, 1, False),
    ("1f1b", 2, 8, 1, True),
    ("1f1b", 2, 8, 2, False),
    ("gpipe", 4, 16, 1, False),
    ("circular", 4, 16, 2, False),
    ("1f1b", 4, 16, 1, False),
    ("1f1b", 4, 16, 1, True),
    ("1f1b", 4, 16, 2, False),
    ("1f1b", 4, 16, 2, True),
    ("1f1b", 4, 8, 1, False),
    ("zb1", 2, 8, 1, False),
    ("zb1", 4, 8, 1, False),
    ("zb1", 4, 16, 1, False),
    ("zbv", 2, 8, 2, False),
    ("zbv", 4, 8, 2, False),
    ("zbv", 4, 16, 2, False),
]


def measure(overrides: list[str], mesh: str, steps: int, together_share: float = 1.0) -> tuple[float, int, float, float]:
    """(median step s, temp bytes, executed matmul FLOPs per device, the head's part of them)."""
    config = load_config(None, overrides)
    sizes = parse_mesh(mesh)
    trainer = build_trainer(config, sizes, jax.devices()[: mesh_device_count(sizes)])
    state = trainer.init_state(0)
    batches = make_iterator(config, trainer.layout)
    batch = next(batches)
    batches.close()
    compiled = trainer.train_step.lower(state, batch).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes
    module = parse_hlo(compiled.as_text())
    m, t = config.model, config.train
    head = 6.0 * t.global_batch * t.seq_len * m.d_model * m.vocab_size  # forward + both backward products of the head
    state, metrics = compiled(state, batch)
    jax.block_until_ready(metrics)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        state, metrics = compiled(state, batch)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - start)
    return statistics.median(times), temp, lockstep_matmul_flops(module, together_share), head


def lockstep_matmul_flops(module, together_share: float = 1.0) -> float:
    """The matmul FLOPs one device executes per step, a ``conditional`` counted at its costliest
    branch: zb1's and zbv's slots pick one branch per device (a forward, a B or a W), and lockstep
    ticks last as long as the costliest. A conditional with collectives inside is one every device
    takes together (the zero-bubble schedules' head): its costliest branch is counted in ``together_share`` of its
    executions (the share of ticks that run the head). (``program_cost`` counts every branch: an
    upper bound.)"""
    counts = computation_multipliers(module)
    total = program_cost(module).matmul_flops
    for name, body in module.computations.items():
        for instruction in (i for i in body if i.opcode == "conditional"):
            branches = [b for b, _ in callees(instruction)]
            flops = [program_cost(dataclasses.replace(module, entry=b)).matmul_flops for b in branches]
            share = together_share if any(_has_collective(module, b) for b in branches) else 1.0
            total -= counts.get(name, 0) * (sum(flops) - share * max(flops))
    return total


def _has_collective(module, name: str) -> bool:
    for instruction in module.computations[name]:
        if instruction.opcode.startswith(("all-gather", "reduce-scatter", "all-reduce", "collective-permute")):
            return True
        if any(_has_collective(module, callee) for callee, _ in callees(instruction)):
            return True
    return False


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--schedules", default="", help="comma-separated: only these schedules' rows (default: every row)")
    args = parser.parse_args()
    only = set(filter(None, args.schedules.split(",")))
    base = [
        "data.source=synthetic",
        "model.dtype=float32",
        f"model.n_layers={args.layers}",
        "model.d_model=128",
        "train.global_batch=32",
        "train.seq_len=64",
    ]
    print(f"hardware: {jax.devices()[0].device_kind}, {jax.device_count()} fake devices, {os.cpu_count()} cores; jax {jax.__version__}")
    print(f"model: {args.layers} layers, d_model 128, batch 32 x 64, fp32 (CPU timing is only indicative)\n")
    plain, plain_temp, plain_flops, head = measure(base, "data=1", args.steps)
    layer_share = 1 - head / plain_flops
    print(f"one device: {plain_flops / 1e9:.2f} GFLOP of matmuls per step, the head {1 - layer_share:.1%} of them\n")
    print(
        "| schedule | S | M | V | recompute | ticks | bubble | executed / ideal | 1 + bubble | tick algebra | median step s | vs no pipeline | temp MB |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    print(f"| none (1 device) | 1 | - | - | - | - | - | 1.000 | - | - | {plain:.3f} | 1.00 | {plain_temp / 2**20:.1f} |", flush=True)
    for schedule, s, m, v, recompute in CASES:
        if only and schedule not in only:
            continue
        overrides = [
            *base,
            f"parallel.schedule={schedule}",
            f"parallel.pipeline_microbatches={m}",
            f"parallel.virtual_stages={v}",
            *([f"parallel.pipeline_recompute={str(recompute).lower()}"] if schedule == "1f1b" else []),
        ]
        spec = pipeline_spec(load_config(None, overrides).parallel, s)
        step, temp, flops, _ = measure(overrides, f"pipe={s}", args.steps, m / spec.ticks if schedule in ("zb1", "zbv") else 1.0)
        ratio = flops / (plain_flops / s)
        label = "interleaved 1f1b" if spec.interleaved else schedule
        keep = ("recompute" if recompute else "keep") if schedule == "1f1b" else "-"
        print(
            f"| {label} | {s} | {m} | {v} | {keep} | {spec.ticks} | {spec.bubble:.1%} | {ratio:.3f} | {1 + spec.bubble:.3f} "
            f"| {executed_over_ideal(spec, layer_share):.3f} | {step:.3f} | {step / plain:.2f} | {temp / 2**20:.1f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
