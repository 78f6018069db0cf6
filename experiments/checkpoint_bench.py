"""What does a checkpoint cost the training loop?

    python experiments/checkpoint_bench.py [--repeats 3] [--mesh fsdp=8]
    python experiments/checkpoint_bench.py --store [--models small,large]   # local disk vs a copy to s3

For `small` and a larger model (~206M parameters, a 2.0 GB full checkpoint) on fake CPU
devices, for both kinds of checkpoint -- full (params + AdamW moments + step, the
training's exact state) and weights-only (``checkpoint.params_every_steps``: step and
params) -- the time the loop is blocked by an async save (the stall) against a
synchronous save of the same state (goal: stall <= 10% of the sync save), the time the
async save takes to commit in the background, restore time into the shardings (a full
state; the params for weights-only), and the bytes written per checkpoint. Medians of
``--repeats``. ``--store``: the loop's step time with saves to local disk against saves
copied to an S3 server on loopback behind the run (the two-tier checkpoints).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import jax  # noqa: E402

from jaxdist.config import load_config  # noqa: E402
from jaxdist.data.batches import make_iterator  # noqa: E402
from jaxdist.layout.mesh import parse_mesh  # noqa: E402
from jaxdist.training.checkpoint import Checkpointer  # noqa: E402
from jaxdist.training.run import build_trainer  # noqa: E402
from jaxdist.training.weights import restore_params  # noqa: E402

KINDS = ("full", "weights-only")

MODELS = {
    "small": ("small", []),
    "large": ("small", ["model.d_model=1024", "model.n_layers=12", "model.n_heads=16", "model.n_kv_heads=8", "model.vocab_size=32768"]),
}


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def bench(name: str, mesh: str, repeats: int, root: Path) -> dict[str, dict]:
    preset, overrides = MODELS[name]
    config = load_config(preset, ["data.source=synthetic", "train.global_batch=8", "train.seq_len=64", *overrides])
    trainer = build_trainer(config, parse_mesh(mesh))
    state = trainer.init_state(0)
    batches = make_iterator(config, trainer.layout)
    for _ in range(2):  # real Adam moments (zeros would compress away)
        state, _ = trainer.train_step(state, next(batches))
    batches.close()
    jax.block_until_ready(state)
    data_state, config_dict = {"next_index": 0}, config.to_dict()
    weights = {"step": state.step, "params": state.params}  # what the loop's weights-only save writes
    out = {kind: {"params": trainer.n_params} for kind in KINDS}
    for kind in KINDS:
        for mode in ("sync", "async"):
            config.checkpoint.async_save = mode == "async"
            config.checkpoint.keep = repeats + 1
            config.checkpoint.params_every_steps = 1
            directory = root / f"{name}-{kind}-{mode}"
            checkpointer = Checkpointer(directory / "checkpoints", config.checkpoint, params_dir=directory / "params")
            blocked, total = [], []
            for step in range(1, repeats + 1):
                start = time.perf_counter()
                if kind == "full":
                    checkpointer.save(step, state, data_state, config_dict)
                else:
                    checkpointer.save_params(step, weights, data_state, config_dict)
                blocked.append(time.perf_counter() - start)
                checkpointer.wait()
                total.append(time.perf_counter() - start)
            out[kind][f"{mode}_blocked_s"] = statistics.median(blocked)
            out[kind][f"{mode}_total_s"] = statistics.median(total)
            step_dir = directory / ("checkpoints" if kind == "full" else "params") / "1"
            out[kind]["bytes"] = dir_bytes(step_dir)
            restore = []
            for step in range(1, repeats + 1):
                start = time.perf_counter()
                if kind == "full":
                    restored = checkpointer.restore(step, trainer.abstract_state()).state
                else:
                    restored = restore_params(step_dir.parent / str(step), trainer.abstract_params())
                jax.block_until_ready(restored)
                restore.append(time.perf_counter() - start)
            out[kind]["restore_s"] = statistics.median(restore)
            checkpointer.close()
            shutil.rmtree(directory)
    return out


def store_bench(name: str, mesh: str, steps: int, every: int, root: Path) -> None:
    """The loop with a full save every ``every`` steps: no checkpoint, saved to local disk, and
    saved to local disk then copied to an S3 server on loopback (``checkpoint.local_dir`` with
    an ``s3://`` run directory): the median step with and without a save in it, and the copies."""
    from local_s3 import local_s3

    from jaxdist.training.checkpoint_tiers import Replicator

    preset, overrides = MODELS[name]
    config = load_config(preset, ["data.source=synthetic", "train.global_batch=8", "train.seq_len=64", *overrides])
    config.checkpoint.keep = 2
    trainer = build_trainer(config, parse_mesh(mesh))
    batches = make_iterator(config, trainer.layout)
    batch = next(batches)
    batches.close()
    step_fn = trainer.compile_step(trainer.init_state(0), batch)
    print(f"\n{name} ({trainer.n_params / 1e6:.0f}M params) on {mesh}: {steps} steps, a full save every {every}; medians")
    print("| checkpoints | step s (no save) | step s (with a save) | stall s | copy to s3 s (median) | end wait s |")
    print("| --- | --- | --- | --- | --- | --- |")
    with local_s3("bench"):
        for mode in ("none", "local disk", "local disk + s3 copy"):
            state = trainer.init_state(0)
            checkpointer = None
            if mode != "none":
                directory = root / f"store-{mode.replace(' ', '-').replace('+', '')}"
                checkpointer = Checkpointer(directory / "checkpoints", config.checkpoint)
                if mode.endswith("copy"):
                    checkpointer.replicator = Replicator(directory, f"s3://bench/{directory.name}", 0, config.checkpoint.keep)
            plain, saving = [], []
            for step in range(1, steps + 1):
                start = time.perf_counter()
                state, metrics = step_fn(state, batch)
                jax.block_until_ready(metrics)
                save = checkpointer is not None and step % every == 0
                if save:
                    checkpointer.save(step, state, {"next_index": step}, config.to_dict())
                (saving if save else plain).append(time.perf_counter() - start)
            start = time.perf_counter()
            copies = []
            if checkpointer is not None:
                checkpointer.wait()
                copies = list(checkpointer.replicator.copy_seconds.values()) if checkpointer.replicator else []
                checkpointer.close()
            end_wait = time.perf_counter() - start
            with_save = statistics.median(saving) if saving else float("nan")
            copy = f"{statistics.median(copies):.2f} ({len(copies)} copies)" if copies else "-"
            print(
                f"| {mode} | {statistics.median(plain):.3f} | {with_save:.3f} | {with_save - statistics.median(plain):.3f} | {copy} | "
                f"{end_wait:.2f} |",
                flush=True,
            )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--mesh", default="fsdp=8")
    parser.add_argument("--models", default="small,large")
    parser.add_argument("--store", action="store_true", help="only the loop's stall saving to local disk vs copying to s3 (moto)")
    parser.add_argument("--store-steps", type=int, default=40)
    args = parser.parse_args()
    print(
        f"hardware: {jax.devices()[0].device_kind}, {jax.device_count()} devices, {os.cpu_count()} cores; jax {jax.__version__}; mesh {args.mesh}"
    )
    if args.store:
        root = Path(tempfile.mkdtemp(prefix="jaxdist-ckpt-bench-"))
        try:
            for name in args.models.split(","):
                store_bench(name, args.mesh, args.store_steps, 5, root)
        finally:
            shutil.rmtree(root, ignore_errors=True)
        return
    root = Path(tempfile.mkdtemp(prefix="jaxdist-ckpt-bench-"))
    print(
        "| model | params | kind | bytes/checkpoint | sync save s | async stall s | stall / sync (goal <= 10%) | async commit s | restore s |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    try:
        for name in args.models.split(","):
            for kind, r in bench(name, args.mesh, args.repeats, root).items():
                print(
                    f"| {name} | {r['params'] / 1e6:.0f}M | {kind} | {r['bytes'] / 1e9:.3f} GB | {r['sync_total_s']:.2f} | "
                    f"{r['async_blocked_s']:.3f} | {r['async_blocked_s'] / r['sync_total_s']:.1%} | {r['async_total_s']:.2f} | {r['restore_s']:.2f} |",
                    flush=True,
                )
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
