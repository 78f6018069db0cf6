"""Why is a 2-process jaxdist step on this CPU slower than PyTorch DDP? The gradient
all-reduce alone, XLA's gloo collectives beside torch.distributed's, pinned and not.

    python experiments/cpu_allreduce.py [--mib 3.25] [--arrays 32] [--repeats 10]

Starts 2 processes on loopback for each case and prints the median time of one
all-reduce of ``--mib`` MiB split into ``--arrays`` arrays (XLA combines them into one
tuple all-reduce, as it does with a model's gradients), with every process free to use
both cores, and with each process pinned to its own core (``taskset``), which is what a
process gets when two of them share two busy cores during training.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import subprocess
import sys
import time

WORKER = r"""
import os, sys, time, statistics
framework, rank, port, mib, arrays, repeats = sys.argv[1], int(sys.argv[2]), sys.argv[3], float(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6])
elems = int(mib * 2**20 / 4 / arrays)
times = []
if framework == "jax":
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", 2, rank)
    mesh = jax.make_mesh((2,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
    xs = [jax.make_array_from_process_local_data(NamedSharding(mesh, P("d")), np.ones((1, elems), np.float32), (2, elems)) for _ in range(arrays)]
    reduce = jax.jit(lambda xs: [jnp.sum(x, axis=0) for x in xs], out_shardings=NamedSharding(mesh, P()))
    run = lambda: jax.block_until_ready(reduce(xs))
else:
    import torch, torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    xs = [torch.ones(elems) for _ in range(arrays)]
    run = lambda: [dist.all_reduce(x) for x in xs]
run()
for _ in range(repeats):
    start = time.perf_counter(); run(); times.append(time.perf_counter() - start)
if rank == 0:
    print(statistics.median(times))
"""


def case(framework: str, pinned: bool, args) -> float:
    port = str(random.randint(20000, 30000))
    procs = []
    for rank in range(2):
        cmd = [sys.executable, "-c", WORKER, framework, str(rank), port, str(args.mib), str(args.arrays), str(args.repeats)]
        if pinned:
            cmd = ["taskset", "-c", str(rank % os.cpu_count()), *cmd]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True))
    try:
        out = procs[0].communicate(timeout=300)[0]
        procs[1].wait(timeout=60)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    time.sleep(1)
    return float(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=float, default=3.25)
    parser.add_argument("--arrays", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    frameworks = ["jax"] + (["torch"] if _has_torch() else [])
    print(f"{os.cpu_count()} cores; {args.mib} MiB in {args.arrays} arrays, 2 processes on loopback, median of {args.repeats}")
    print("| framework | free to use every core | each process pinned to one core |")
    print("| --- | --- | --- |")
    for framework in frameworks:
        free = case(framework, False, args)
        pinned = case(framework, True, args) if shutil.which("taskset") else float("nan")
        print(f"| {framework} gloo | {free * 1e3:.1f} ms | {pinned * 1e3:.1f} ms |")


def _has_torch() -> bool:
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


if __name__ == "__main__":
    main()
