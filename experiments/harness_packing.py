"""lm-eval log-likelihood requests packed into rows against one request a row, side by side.

    python experiments/harness_packing.py [--devices 1,8] [--repeats 3]

The same ``Scorer`` (``jaxdist.inference.harness``), the same 512 short requests (``abc=``
then ``abc`` or ``cba``, as ``dpo_eval.py``'s multiple choice asks them: 4 context and 3
continuation tokens), the tiny model at ``train.seq_len=16``, ``batch_size`` 16, on
``data=DEVICES`` fake CPU devices. Printed per device count: requests per second (median of
the repeats, after a warm-up that compiles), rows run, and the largest difference between the
two ways' log-likelihoods. Each device count runs in a process of its own.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import subprocess
import sys
import time

MODEL = ["model.d_model=64", "model.n_layers=2", "model.n_heads=8", "model.n_kv_heads=4", "model.dtype=float32"]


def measure(devices: int, repeats: int) -> None:
    import jax

    from jaxdist.config import load_config
    from jaxdist.inference import harness
    from jaxdist.layout.mesh import parse_mesh
    from jaxdist.training.run import build_trainer

    overrides = [*MODEL, "train.seq_len=16", "train.global_batch=32", "data.source=synthetic", "model.vocab_size=384"]
    trainer = build_trainer(load_config(None, overrides), parse_mesh(f"data={devices}"), jax.devices()[:devices])
    scorer = harness.Scorer(trainer, trainer.init_state(0).params, 16, batch_size=16)
    rng, requests = random.Random(0), []
    for _ in range(256):
        word = [rng.randrange(97, 105) for _ in range(3)]
        requests += [([*word, 61], word), ([*word, 61], word[::-1])]

    def one_a_row(lengths):
        return [(harness.bucket(lengths[batch[0]], 16), [[i] for i in batch]) for batch in scorer._batches(lengths)]

    ways = {"packed": scorer._packed_batches, "one a row": one_a_row}
    results = {}
    for _ in range(repeats):
        for name, batches in ways.items():
            scorer._packed_batches = batches
            scorer.loglikelihood(requests[:32])  # the shapes compiled
            rows, start = scorer.rows_scored, time.perf_counter()
            got = scorer.loglikelihood(requests)
            results.setdefault(name, []).append((len(requests) / (time.perf_counter() - start), scorer.rows_scored - rows, got))
    for name, runs in results.items():
        rate = statistics.median(r[0] for r in runs)
        print(f"| {devices} | {name} | {rate:,.0f} | {runs[0][1]} |", flush=True)
    packed, plain = results["packed"][0][2], results["one a row"][0][2]
    diff = max(abs(a[0] - b[0]) for a, b in zip(packed, plain, strict=True))
    print(
        f"<!-- {devices} devices: largest log-likelihood difference {diff:.2e}, greedy flags equal: {[a[1] for a in packed] == [b[1] for b in plain]} -->"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", default="1,8")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        measure(args.child, args.repeats)
        return 0
    print("| devices | requests | requests/s (median) | rows |")
    print("|---|---|---|---|")
    for devices in (int(d) for d in args.devices.split(",")):
        env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}", "JAX_PLATFORMS": "cpu"}
        subprocess.run([sys.executable, __file__, "--child", str(devices), "--repeats", str(args.repeats)], env=env, check=True)
    threads = {k: os.environ.get(k, "unset") for k in ("OMP_NUM_THREADS",)}
    print(f"\nmachine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}; thread settings: {threads}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
