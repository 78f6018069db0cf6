"""Is the input pipeline ever the bottleneck?

    python experiments/data_throughput.py [--steps 50] [--batches 200]

Prints (1) loader tokens/s (Grain, standard-library corpus, packing + document masks,
global arrays on 8 fake devices) with 0, 1 and 2 worker processes, next to the tokens/s
the `small` train step consumes here; (2) data_wait_s as a share of step time over a
training run of `small` and of `tiny` (goal < 2%); (3) `prepare` throughput in MB/s.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import jax  # noqa: E402

from jaxdist.config import load_config  # noqa: E402
from jaxdist.data.pipeline import make_iterator  # noqa: E402
from jaxdist.data.prepare import prepare  # noqa: E402
from jaxdist.data.sources import stdlib_files  # noqa: E402
from jaxdist.layout.mesh import parse_mesh  # noqa: E402
from jaxdist.training.run import build_trainer, run  # noqa: E402


def loader_tokens_per_sec(config, layout, batches: int) -> float:
    iterator = make_iterator(config, layout)
    jax.block_until_ready(next(iterator))  # start-up (worker processes, corpus) not timed
    start = time.perf_counter()
    for _ in range(batches):
        jax.block_until_ready(next(iterator))
    seconds = time.perf_counter() - start
    iterator.close()
    return batches * config.train.global_batch * config.train.seq_len / seconds


def wait_share(preset: str, steps: int, overrides: list[str]) -> tuple[float, float, float]:
    """Median step time, median data wait, and total wait / total step time of a run."""
    with tempfile.TemporaryDirectory() as tmp:
        config = load_config(preset, [f"train.steps={steps}", "train.log_every=1", *overrides])
        run(config, parse_mesh("data=8"), Path(tmp), progress=False)
        lines = [json.loads(line) for line in (Path(tmp) / "metrics.jsonl").read_text().splitlines()]
    lines = [x for x in lines if "loss" in x][1:]  # the first step pays one-off start-up
    step = [x["step_time_s"] for x in lines]
    wait = [x["data_wait_s"] for x in lines]
    return statistics.median(step), statistics.median(wait), sum(wait) / sum(step)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--batches", type=int, default=200)
    parser.add_argument("--small-batch", type=int, default=8)
    args = parser.parse_args()
    print(f"hardware: {jax.devices()[0].device_kind}, {jax.device_count()} devices, {os.cpu_count()} cores; jax {jax.__version__}")

    small = load_config("small", [f"train.global_batch={args.small_batch}"])
    trainer = build_trainer(small, parse_mesh("data=8"))
    print(f"\n(1) loader throughput, stdlib corpus, batch {small.train.global_batch} x {small.train.seq_len}, {args.batches} batches")
    print("| workers | loader tokens/s |")
    print("| --- | --- |")
    for workers in (0, 1, 2):
        config = load_config("small", [f"train.global_batch={args.small_batch}", f"data.workers={workers}"])
        config.model.vocab_size = small.model.vocab_size
        print(f"| {workers} | {loader_tokens_per_sec(config, trainer.layout, args.batches):,.0f} |", flush=True)

    print(f"\n(2) data wait over a {args.steps}-step run on data=8 (first step excluded)")
    print("| preset | median step s | median data_wait s | wait / step time (goal < 2%) | train tokens/s |")
    print("| --- | --- | --- | --- | --- |")
    for preset, overrides in (("small", [f"train.global_batch={args.small_batch}"]), ("tiny", [])):
        step, wait, share = wait_share(preset, args.steps, overrides)
        cfg = load_config(preset, overrides)
        print(
            f"| {preset} | {step:.4f} | {wait:.5f} | {share:.2%} | {cfg.train.global_batch * cfg.train.seq_len / step:,.0f} |", flush=True
        )

    print("\n(3) prepare: byte-level tokenization of the standard library into .bin shards")
    files = stdlib_files()
    megabytes = sum(f.stat().st_size for f in files) / 1e6
    out = Path(tempfile.mkdtemp()) / "stdlib"
    start = time.perf_counter()
    meta = prepare([str(f) for f in files], str(out), progress=False)
    seconds = time.perf_counter() - start
    shutil.rmtree(out.parent)
    print(f"{len(files)} files, {megabytes:.1f} MB -> {meta['tokens']:,} tokens in {seconds:.2f} s: {megabytes / seconds:.1f} MB/s")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
