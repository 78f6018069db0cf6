"""Is the input pipeline ever the bottleneck?

    python experiments/data_throughput.py [--steps 50] [--batches 200] [--repeats 3] [--code DIR] [--only-wait] [--only-store]

Prints (1) loader tokens/s (Grain, standard-library corpus, packing + document masks,
global arrays on 8 fake devices) with 0, 1 and 2 worker processes, next to the tokens/s
the `small` train step consumes here; (2) data_wait_s as a share of step time over a
training run of `small` and of `tiny` (goal < 2%); (2b) the same on `--mesh data=2` the way
a user runs it (`python -m jaxdist.train`, 2 fake CPU devices, `train.log_every=1`): `tiny`
on the packed default corpus and on `data.source=synthetic` (60 steps, the first 10 left
out) and `small` (goal < 1%), each the median of `--repeats` runs; `--code DIR` runs that
CLI from another checkout (before/after a change); (3) `prepare` throughput in MB/s; (4) the
data wait of `tiny` on prepared shards read from local disk and from an S3 server on loopback
(`--only-store`: that table alone).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import jax  # noqa: E402

from jaxdist.config import load_config  # noqa: E402
from jaxdist.data.batches import make_iterator  # noqa: E402
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


def cli_wait_share(code: Path, preset: str, steps: int, skip: int, overrides: list[str]) -> tuple[float, float, float]:
    """``python -m jaxdist.train --mesh data=2`` from checkout ``code`` (2 fake CPU devices, as
    the CLI sets them): median step time, median data wait, total wait / total step time
    over the steps after the first ``skip``."""
    env = dict(os.environ, PYTHONPATH=str(code))
    env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f)
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "jaxdist.train", "--config", preset, "--mesh", "data=2", "--run-dir", f"{tmp}/run"]
        cmd += [f"train.steps={steps}", "train.log_every=1", "train.compile_cache=off", *overrides]
        subprocess.run(cmd, cwd=code, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=1800)
        lines = [json.loads(line) for line in (Path(tmp) / "run" / "metrics.jsonl").read_text().splitlines()]
    lines = [x for x in lines if "loss" in x][skip:]
    step = [x["step_time_s"] for x in lines]
    wait = [x["data_wait_s"] for x in lines]
    return statistics.median(step), statistics.median(wait), sum(wait) / sum(step)


def cli_wait_table(code: Path, repeats: int, small_batch: int, small_steps: int) -> None:
    print(f"\n(2b) data wait on --mesh data=2 (python -m jaxdist.train, train.log_every=1), {code}; medians of {repeats} runs")
    print("| run | steps (left out) | median step s | median data_wait s | wait / step time (goal < 1%) | runs' shares |")
    print("| --- | --- | --- | --- | --- | --- |")
    cases = (
        ("tiny, packed stdlib corpus", "tiny", 60, 10, []),
        ("tiny, synthetic", "tiny", 60, 10, ["data.source=synthetic"]),
        (f"small (batch {small_batch}), packed stdlib corpus", "small", small_steps, 2, [f"train.global_batch={small_batch}"]),
    )
    for name, preset, steps, skip, overrides in cases:
        runs = [cli_wait_share(code, preset, steps, skip, overrides) for _ in range(repeats)]
        step, wait, share = (statistics.median(r[i] for r in runs) for i in range(3))
        shares = ", ".join(f"{r[2]:.2%}" for r in runs)
        print(f"| {name} | {steps} ({skip}) | {step:.4f} | {wait:.5f} | {share:.2%} | {shares} |", flush=True)


def store_table(steps: int, repeats: int) -> None:
    """(4) tiny on prepared .bin shards read from local disk and from an S3 server on loopback
    (moto's, in its own process), data=8: the data wait share side by side."""
    import s3fs
    from local_s3 import local_s3

    with local_s3("bench"):
        fs = s3fs.S3FileSystem(endpoint_url=os.environ["AWS_ENDPOINT_URL"])
        local = Path(tempfile.mkdtemp()) / "stdlib"
        prepare([str(f) for f in stdlib_files()[:400]], str(local), progress=False, shard_tokens=2**20)
        for f in sorted(local.iterdir()):
            fs.put_file(str(f), f"bench/stdlib/{f.name}")
        print(
            f"\n(4) data wait of tiny on data=8 over {steps} steps (first excluded), prepared shards local vs S3 on loopback; median of {repeats}"
        )
        print("| shards | median step s | median data_wait s | wait / step time |")
        print("| --- | --- | --- | --- |")
        for name, path in (("local disk", str(local)), ("s3:// (moto, loopback)", "s3://bench/stdlib")):
            runs = [wait_share("tiny", steps, ["data.source=tokens", f"data.path={path}"]) for _ in range(repeats)]
            step, wait, share = (statistics.median(r[i] for r in runs) for i in range(3))
            print(f"| {name} | {step:.4f} | {wait:.5f} | {share:.2%} |", flush=True)
        shutil.rmtree(local.parent)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--batches", type=int, default=200)
    parser.add_argument("--small-batch", type=int, default=8)
    parser.add_argument("--small-steps", type=int, default=12, help="steps of the data=2 small runs (the first 2 left out)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per data=2 case (the CPU may be shared: medians)")
    parser.add_argument("--code", type=Path, default=Path(__file__).resolve().parents[1], help="checkout whose CLI the data=2 runs use")
    parser.add_argument("--only-wait", action="store_true", help="only the data=2 data-wait table (2b)")
    parser.add_argument("--only-store", action="store_true", help="only the local vs S3 shards table (4; needs the storage and dev extras)")
    args = parser.parse_args()
    print(f"hardware: {jax.devices()[0].device_kind}, {jax.device_count()} devices, {os.cpu_count()} cores; jax {jax.__version__}")
    print(f"threads: XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}")
    if args.only_store:
        store_table(args.steps, args.repeats)
        return
    if args.only_wait:
        cli_wait_table(args.code.resolve(), args.repeats, args.small_batch, args.small_steps)
        return

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
    cli_wait_table(args.code.resolve(), args.repeats, args.small_batch, args.small_steps)

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
    store_table(args.steps, args.repeats)


if __name__ == "__main__":
    main()
