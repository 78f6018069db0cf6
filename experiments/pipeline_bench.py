"""Pipeline schedules side by side: step time, bubble, temp memory.

    python experiments/pipeline_bench.py [--steps 5] [--layers 8]

For each schedule and (S stages, M microbatches, V virtual stages): the median step
time, the step time relative to the same model without a pipe axis on one device, the
schedule's bubble (idle share of its ticks), and XLA's per-device temp memory. On fake
CPU devices all stages share the host's cores, so the pipeline cannot run faster than
one device: CPU timings only show the schedules' overheads, not their speedups.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import jax  # noqa: E402

from jaxdist.config import load_config  # noqa: E402
from jaxdist.data.pipeline import make_iterator  # noqa: E402
from jaxdist.layout.mesh import mesh_device_count, parse_mesh  # noqa: E402
from jaxdist.models import pipeline_spec  # noqa: E402
from jaxdist.training.run import build_trainer  # noqa: E402

CASES = [  # (schedule, S, M, V)
    ("gpipe", 2, 2, 1),
    ("gpipe", 2, 8, 1),
    ("circular", 2, 8, 2),
    ("1f1b", 2, 8, 1),
    ("gpipe", 4, 16, 1),
    ("circular", 4, 16, 2),
    ("1f1b", 4, 16, 1),
]


def measure(overrides: list[str], mesh: str, steps: int) -> tuple[float, int]:
    config = load_config(None, overrides)
    sizes = parse_mesh(mesh)
    trainer = build_trainer(config, sizes, jax.devices()[: mesh_device_count(sizes)])
    state = trainer.init_state(0)
    batches = make_iterator(config, trainer.layout)
    batch = next(batches)
    batches.close()
    compiled = trainer.train_step.lower(state, batch).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes
    state, metrics = compiled(state, batch)
    jax.block_until_ready(metrics)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        state, metrics = compiled(state, batch)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - start)
    return statistics.median(times), temp


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--layers", type=int, default=8)
    args = parser.parse_args()
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
    plain, plain_temp = measure(base, "data=1", args.steps)
    print("| schedule | S | M | V | ticks | bubble | median step s | vs no pipeline | temp MB |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    print(f"| none (1 device) | 1 | - | - | - | - | {plain:.3f} | 1.00 | {plain_temp / 2**20:.1f} |", flush=True)
    for schedule, s, m, v in CASES:
        overrides = [*base, f"parallel.schedule={schedule}", f"parallel.pipeline_microbatches={m}", f"parallel.virtual_stages={v}"]
        step, temp = measure(overrides, f"pipe={s}", args.steps)
        spec = pipeline_spec(load_config(None, overrides), s)
        print(
            f"| {schedule} | {s} | {m} | {v} | {spec.ticks} | {spec.bubble:.1%} | {step:.3f} | {step / plain:.2f} | {temp / 2**20:.1f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
