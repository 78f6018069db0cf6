"""jaxdist's train step vs a minimal hand-written ``jax.jit`` step, and small's throughput.

    python experiments/overhead.py [--config small] [--batch 8] [--steps 5] [--repeats 5]

Prints (1) the step-time ratio jaxdist / hand-written on one device, same model, batch
and optimizer, timed interleaved (goal <= 1.05), and (2) tokens/s and MFU of the config
on 1 device and on all devices (8 fake CPU devices when there is no GPU). Medians.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import jax  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from jaxdist.config import load_config  # noqa: E402
from jaxdist.data.batches import make_iterator  # noqa: E402
from jaxdist.data.sources import resolve_vocab  # noqa: E402
from jaxdist.models import build_task  # noqa: E402
from jaxdist.training.metrics import peak_flops_per_device  # noqa: E402
from jaxdist.training.optim import make_optimizer  # noqa: E402
from jaxdist.training.run import build_trainer  # noqa: E402


def hand_written_step(task, config):
    """The plainest correct step: merge, value_and_grad of the mean loss, AdamW, donate."""
    model = task.make_model(nnx.Rngs(params=config.train.seed))
    graphdef, params = nnx.split(model)
    tx = make_optimizer(config.train)
    opt_state = tx.init(params)

    def loss_fn(p, batch):
        logits = nnx.merge(graphdef, p)(batch["inputs"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()

    def step(p, o, batch):
        loss, grads = jax.value_and_grad(loss_fn)(p, batch)
        updates, o = tx.update(grads, o, p)
        return optax.apply_updates(p, updates), o, loss

    return jax.jit(step, donate_argnums=(0, 1)), (params, opt_state)


def time_steps(run_one, steps: int) -> float:
    """Seconds per step over ``steps`` back-to-back steps (dispatch overlaps compute)."""
    start = time.perf_counter()
    out = None
    for _ in range(steps):
        out = run_one()
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / steps


def jaxdist_runner(config, devices, mesh: str | None):
    from jaxdist.layout.mesh import parse_mesh

    trainer = build_trainer(config, parse_mesh(mesh) if mesh else None, devices)
    state = trainer.init_state(config.train.seed)
    batch = next(make_iterator(config, trainer.layout))
    step = trainer.train_step.lower(state, batch).compile()
    holder = {"state": state}

    def run_one():
        holder["state"], metrics = step(holder["state"], batch)
        return metrics["loss"]

    return trainer, run_one, batch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default="small")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    # synthetic tokens: the hand-written step sees exactly the same batch (no packing masks)
    config = load_config(args.config, ["data.source=synthetic", f"train.global_batch={args.batch}", *args.overrides])
    resolve_vocab(config)
    devices = jax.devices()
    platform_name = devices[0].platform
    task = build_task(config, platform_name)
    print(
        f"hardware: {devices[0].device_kind} ({platform_name}), {len(devices)} devices, host {platform.processor() or platform.machine()} x{os.cpu_count()} cores"
    )
    print(
        f"jax {jax.__version__}; config {args.config}: {task.n_params / 1e6:.1f}M params, batch {args.batch} x seq {config.train.seq_len}"
    )

    # (1) overhead on one device, interleaved so machine noise hits both alike
    _, ours, batch = jaxdist_runner(config, devices[:1], "data=1")
    plain_step, plain_state = hand_written_step(task, config)
    plain_batch = {k: jax.device_put(v, devices[0]) for k, v in batch.items()}
    holder = {"state": plain_state}

    def plain_one():
        p, o = holder["state"]
        p, o, loss = plain_step(p, o, plain_batch)
        holder["state"] = (p, o)
        return loss

    for fn in (ours, plain_one):  # warm up (compile)
        jax.block_until_ready(fn())
    ours_t, plain_t = [], []
    for _ in range(args.repeats):
        ours_t.append(time_steps(ours, args.steps))
        plain_t.append(time_steps(plain_one, args.steps))
    ratio = statistics.median(o / p for o, p in zip(ours_t, plain_t, strict=True))
    print("\n| step (1 device) | median s/step |")
    print("| --- | --- |")
    print(f"| jaxdist train step | {statistics.median(ours_t):.4f} |")
    print(f"| hand-written jax.jit step | {statistics.median(plain_t):.4f} |")
    print(f"| ratio (goal <= 1.05) | {ratio:.3f} |")

    # (2) throughput and MFU on 1 device and on all devices
    tokens = task.tokens_per_example * args.batch
    flops = task.flops_per_example * args.batch
    print("\n| devices | mesh | median s/step | tokens/s | MFU |")
    print("| --- | --- | --- | --- | --- |")
    for n in sorted({1, len(devices)}):
        mesh = f"data={n}"
        if args.batch % n:
            continue
        _, run_one, _ = jaxdist_runner(config, devices[:n], mesh)
        jax.block_until_ready(run_one())
        t = statistics.median(time_steps(run_one, args.steps) for _ in range(args.repeats))
        peak = peak_flops_per_device(devices[:n], config.train.peak_flops)
        print(f"| {n} | {mesh} | {t:.4f} | {tokens / t:,.0f} | {flops / (t * n * peak):.3f} |")
    if platform_name == "cpu":
        print("\nCPU note: fake devices share the host's cores, so 8 devices cannot beat 1; MFU is against the measured host matmul peak.")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
