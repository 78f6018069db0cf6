"""The all-reduce timings of the ``cpu-local`` profile, in separate processes: N gloo
processes of one CPU device each, joined through a coordinator on 127.0.0.1, or one
process with N fake CPU devices (``jaxdist.plan.measure`` fits their latency and
bandwidth). Every worker dies with the process that started it, and is killed and reaped
on the way out of ``all_reduce_points``, whatever happens.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxdist.cluster.launcher import free_port
from jaxdist.cluster.lifetime import die_with_parent

RESULT_MARK = "JAXDIST_MEASURE "  # prefixes the one JSON line a worker prints
PACKAGE_ROOT = Path(__file__).resolve().parents[2]  # the folder holding this jaxdist: the workers import the same one


# ----------------------------------------------------------------------------- the workers


def worker_main(argv: Sequence[str]) -> None:
    """A collective-timing subprocess: ``PARENT_PID MODE N PROCESS_ID PORT REPEATS TIMEOUT_S SIZE...``.

    MODE ``gloo``: one of N processes (one CPU device each) joined through a coordinator
    on 127.0.0.1:PORT. MODE ``fake``: one process with N fake CPU devices. The process
    holding device 0 prints ``RESULT_MARK`` + JSON with the ``[bytes, median seconds]``
    points of each all-reduce size."""
    parent_pid, mode, n, pid, port, repeats, timeout_s, *sizes = argv
    # The kernel kills this worker when the measuring process dies (even by SIGKILL). Set
    # here rather than in a preexec_fn: forking a multithreaded JAX parent to run Python
    # code before exec is unsafe.
    die_with_parent(int(parent_pid))()
    if mode not in ("gloo", "fake"):
        raise ValueError(f"unknown worker mode {mode!r} (gloo or fake)")
    n, pid, repeats = int(n), int(pid), int(repeats)
    if mode == "gloo":
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(
            coordinator_address=f"127.0.0.1:{port}",
            num_processes=n,
            process_id=pid,
            initialization_timeout=max(int(float(timeout_s)), 1),
        )
    points = _time_all_reduce(n, [int(s) for s in sizes], repeats)
    if jax.process_index() == 0:
        print(RESULT_MARK + json.dumps({"mode": mode, "n": n, "points": points, "jax": jax.__version__}), flush=True)
    if mode == "gloo":
        jax.distributed.shutdown()


def _time_all_reduce(n: int, sizes: Sequence[int], repeats: int) -> list[list[float]]:
    """``[buffer_bytes, median_seconds]`` of a jitted psum over a 1-D fp32 array sharded
    across ``n`` devices (``sizes`` bytes per device). The median, not the best: the
    collective waits for the slowest process, and the median is what a step sees."""
    mesh = jax.make_mesh((n,), ("x",))
    sharding = NamedSharding(mesh, P("x"))
    all_reduce = jax.jit(jax.shard_map(lambda a: jax.lax.psum(a, "x"), mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    points = []
    for size in sizes:
        per_device = max(size // 4, 1)
        x = jax.make_array_from_callback((n * per_device,), sharding, lambda idx, k=per_device: np.ones((k,), np.float32))
        for _ in range(2):  # compile, then one run that lines the processes up
            all_reduce(x).block_until_ready()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            all_reduce(x).block_until_ready()
            times.append(time.perf_counter() - t0)
        points.append([float(per_device * 4), statistics.median(times)])
        del x
    return points


# ----------------------------------------------------------------------------- the parent


def worker_env(devices: int) -> dict[str, str]:
    """This environment with ``devices`` fake CPU devices and the CPU platform (other
    XLA flags, thread settings included, are kept)."""
    env = dict(os.environ)
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", env.get("XLA_FLAGS", "")).split()
    env["XLA_FLAGS"] = " ".join([*flags, f"--xla_force_host_platform_device_count={devices}"])
    env["JAX_PLATFORMS"] = "cpu"
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    return env


def _worker_command(args: Sequence[object]) -> list[str]:
    """The command line of a worker: ``worker_main`` of this very jaxdist (its folder goes
    first on the worker's path), whatever the working directory or the installed one."""
    boot = (
        f"import sys; sys.path.insert(0, {str(PACKAGE_ROOT)!r}); from jaxdist.plan.allreduce import worker_main; worker_main(sys.argv[1:])"
    )
    return [sys.executable, "-c", boot, str(os.getpid()), *map(str, args)]


def _stderr_reason(path: Path) -> str:
    """The most telling line of a worker's stderr: the last one that looks like an error."""
    try:
        lines = [line.strip() for line in path.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return "no stderr"
    errors = [line for line in lines if re.search(r"error|exception|fail|abort", line, re.IGNORECASE)]
    return ((errors or lines or ["no output"])[-1])[:200]


def run_workers(commands: Sequence[list[str]], env: dict[str, str], timeout_s: float, what: str) -> dict[str, Any]:
    """Run the worker processes together and return the JSON result the first one
    prints. Every process is killed and reaped on the way out, whatever happens; a
    failure or a timeout raises a one-line RuntimeError."""
    procs: list[subprocess.Popen] = []
    with tempfile.TemporaryDirectory(prefix="jaxdist-measure-") as tmp:
        outs = [Path(tmp, f"{i}.out") for i in range(len(commands))]
        errs = [Path(tmp, f"{i}.err") for i in range(len(commands))]
        try:
            for cmd, out, err in zip(commands, outs, errs, strict=True):
                # Files, not pipes: a chatty worker cannot block on a full pipe.
                with out.open("wb") as fo, err.open("wb") as fe:
                    procs.append(subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=fo, stderr=fe))
            deadline = time.monotonic() + timeout_s
            while True:
                codes = [p.poll() for p in procs]  # every process, every round: one failure ends the wait
                failed = [i for i, code in enumerate(codes) if code not in (None, 0)]
                if failed:
                    i = failed[0]
                    raise RuntimeError(f"{what}: process {i} exited with code {codes[i]} ({_stderr_reason(errs[i])})")
                if all(code == 0 for code in codes):
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{what}: timed out after {timeout_s:g}s")
                time.sleep(0.05)
            lines = [line for line in outs[0].read_text(errors="replace").splitlines() if line.startswith(RESULT_MARK)]
            if not lines:
                raise RuntimeError(f"{what}: process 0 printed no result ({_stderr_reason(errs[0])})")
            return json.loads(lines[-1][len(RESULT_MARK) :])
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
            for p in procs:
                p.wait()


def all_reduce_points(mode: str, n: int, sizes: Sequence[int], *, repeats: int, timeout_s: float) -> tuple[list[list[float]], str]:
    """The ``[buffer bytes per device, median seconds]`` of an all-reduce of each size over
    ``n`` devices: ``n`` gloo processes of one device each (``mode="gloo"``) or one process
    with ``n`` fake devices (``mode="fake"``); and what ran, for a message about them."""
    if n < 2:
        raise ValueError(f"a collective needs at least 2 devices, got {n}")
    port = free_port() if mode == "gloo" else 0
    tail = [port, repeats, timeout_s, *sizes]
    if mode == "gloo":
        commands = [_worker_command([mode, n, i, *tail]) for i in range(n)]
        env = worker_env(1)
        what = f"all-reduce over {n} gloo processes on 127.0.0.1:{port}"
    else:
        commands = [_worker_command([mode, n, 0, *tail])]
        env = worker_env(n)
        what = f"all-reduce over {n} fake CPU devices"
    return run_workers(commands, env, timeout_s, what)["points"], what
