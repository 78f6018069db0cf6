"""DPO with the reference model in the train state against stored reference log-probabilities
(``data.reference_logps``), side by side.

    python experiments/dpo_reference.py [--devices 8] [--steps 20] [--d-model 256]

The same pairs (256 rule pairs: ``abc=`` then ``abc`` chosen, another word rejected), the same
decoder (4 layers, ``--d-model`` wide, float32) on ``fsdp=DEVICES`` fake CPU devices, global batch
32 rows. Printed per mode: the median step time after a compiling warm-up step, the train state's
bytes on one device, and for the stored mode the one-off pass that computes the file; then the
ratios, the steps after which the pass has paid for itself, and the largest difference between
the two modes' losses. Runs in a process of its own (the fake device count is set before JAX).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def measure(devices: int, steps: int, d_model: int) -> None:
    import jax
    import numpy as np

    from jaxdist.config import load_config
    from jaxdist.data import reference_logps
    from jaxdist.data.batches import make_iterator
    from jaxdist.data.preference import preference_pairs
    from jaxdist.layout.mesh import parse_mesh
    from jaxdist.training import reference_pass
    from jaxdist.training.run import build_trainer

    rng, letters = random.Random(0), "abcdefgh"
    work = Path(tempfile.mkdtemp(prefix="dpo_reference-"))
    with open(work / "pairs.jsonl", "w") as out:
        for _ in range(256):
            word, other = ("".join(rng.choice(letters) for _ in range(3)) for _ in range(2))
            out.write(json.dumps({"prompt": f"{word}=", "chosen": word, "rejected": other}) + "\n")
    model = [f"model.d_model={d_model}", "model.n_layers=4", "model.n_heads=8", "model.n_kv_heads=4", "model.dtype=float32"]
    base = [*model, "train.objective=dpo", "data.source=preference", f"data.path={work / 'pairs.jsonl'}"]
    base += ["train.seq_len=64", "train.global_batch=32", "train.warmup_steps=0", "train.lr=1e-3"]
    stored = work / "pairs.reference.npz"
    rows = []
    for mode, extra in (("reference model in the state", []), ("stored log-probabilities", [f"data.reference_logps={stored}"])):
        config = load_config(None, [*base, *extra])
        trainer = build_trainer(config, parse_mesh(f"fsdp={devices}"), jax.devices()[:devices])
        pass_s = None
        if extra:
            start = time.perf_counter()
            pairs = preference_pairs(config, with_reference=False)
            logps = reference_pass.compute(trainer, config, None, pairs)
            reference_logps.write(stored, logps, pairs.digest(), reference_pass.reference_identity(config, None))
            pass_s = time.perf_counter() - start
        state = trainer.init_state(config.train.seed)
        state_bytes = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(state))
        batches = make_iterator(config, trainer.layout)
        times, losses = [], []
        for _ in range(steps + 1):
            batch = next(batches)
            start = time.perf_counter()
            state, metrics = trainer.train_step(state, batch)
            losses.append(float(jax.device_get(metrics["loss"])))
            times.append(time.perf_counter() - start)
        batches.close()
        rows.append((mode, statistics.median(times[1:]), state_bytes, pass_s, np.asarray(losses)))
    print(f"| mode ({devices} devices, d_model {d_model}) | step s (median) | state bytes / device | one-off pass s |")
    print("|---|---|---|---|")
    for mode, step_s, state_bytes, pass_s, _ in rows:
        print(f"| {mode} | {step_s:.4f} | {state_bytes:,} | {'-' if pass_s is None else f'{pass_s:.2f}'} |")
    (_, in_state_s, in_state_bytes, _, a), (_, stored_s, stored_bytes, pass_s, b) = rows
    saved = in_state_s - stored_s
    print(
        f"\nstored / in-state: step time {stored_s / in_state_s:.2f}x, state bytes {stored_bytes / in_state_bytes:.2f}x; "
        f"the pass is paid back after {pass_s / saved:.0f} steps" + ("" if saved > 0 else " (never: no step time saved)")
    )
    print(f"largest loss difference over {steps + 1} steps: {np.max(np.abs(a - b)):.2e}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        measure(args.devices, args.steps, args.d_model)
        return 0
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={args.devices}", "JAX_PLATFORMS": "cpu"}
    argv = [sys.executable, __file__, "--child", "--devices", str(args.devices), "--steps", str(args.steps), "--d-model", str(args.d_model)]
    subprocess.run(argv, env=env, check=True)
    threads = {k: os.environ.get(k, "unset") for k in ("OMP_NUM_THREADS",)}
    print(f"\nmachine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}; thread settings: {threads}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
