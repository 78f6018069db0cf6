"""Measure this host on the spot: the ``cpu-local`` hardware profile of the cost model.

    python -m jaxdist.plan.measure [--quick] [--refresh] [--json]

The cost model predicts a step's time from a compiled XLA program's FLOPs, bytes accessed
and collectives, so the profile holds what XLA on this host sustains for each:

- ``matmul_flops_per_s`` (fp32) and ``matmul_flops_per_s_bf16``: a jitted ``jnp.dot`` of
  square matrices in this process (default threading: all cores), best of the repeats.
- ``memory_bytes_per_s``: a jitted in-place elementwise op over a large fp32 array,
  bytes read + written, best of the repeats.
- ``collective_latency_s`` / ``collective_bytes_per_s``: an all-reduce between separate
  processes over gloo on loopback, fitted as ``time = latency + wire_bytes / bandwidth``
  with ``wire_bytes = 2 (N - 1) / N x buffer bytes`` (what one device sends in a ring).
- ``fake_device_collective_latency_s`` / ``fake_device_collective_bytes_per_s``: the same
  fit for fake CPU devices inside one process (they exchange through memory copies).

Thread settings are left as they are and recorded under ``threads``. The profile is
cached per host (``load_or_measure``); the collectives run in subprocesses that are
always killed and reaped, so none outlives a failure or a timeout.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.metadata
import json
import logging
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from jaxdist.inspect.wire import RING_FACTOR
from jaxdist.plan.allreduce import all_reduce_points
from jaxdist.plan.hlo_cost import program_cost

CACHE_FILE = "cpu-local.json"
ENV_CACHE_DIR = "JAXDIST_CACHE_DIR"

log = logging.getLogger("jaxdist.plan.measure")  # not __name__: run as -m it is __main__, outside jaxdist's logger

# Sizes and repeats per mode. Matmuls: square sides; memory: fp32 array bytes;
# collectives: all-reduce buffer bytes per device.
FULL = {
    "matmul_sides": (1024, 2048),
    "curve_sides": (32, 64, 128, 256, 512),
    "memory_bytes": 256 * 2**20,
    "collective_bytes": (4 * 2**10, 32 * 2**10, 256 * 2**10, 2 * 2**20, 16 * 2**20),
    "collective_repeats": 30,  # small gloo messages are noisy on a busy host: many repeats, median
    "repeats": 30,  # best of many: on a shared host noise only ever adds time
    "budget_s": 6.0,
}
QUICK = {
    "matmul_sides": (512, 1024),
    "curve_sides": (64, 256),
    "memory_bytes": 64 * 2**20,
    "collective_bytes": (4 * 2**10, 256 * 2**10, 4 * 2**20),
    "collective_repeats": 10,
    "repeats": 3,
    "budget_s": 1.0,
}


# ----------------------------------------------------------------------------- timing


def best_time(fn: Callable[[], Any], *, repeats: int, budget_s: float) -> tuple[float, list[float]]:
    """Best wall time of ``fn()`` (which must block until its result is ready) over up
    to ``repeats`` timed calls after one untimed warm-up call (the compile); stops
    early once ``budget_s`` is spent, after at least two timed calls. The best, not the
    mean: on a shared machine noise only ever adds time."""
    fn()  # warm-up: compile and first-touch allocations stay out of the timing
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < repeats and (len(times) < 2 or time.perf_counter() - start < budget_s):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times), times


def fit_latency_bandwidth(points: Sequence[Sequence[float]]) -> tuple[float, float]:
    """``(latency_s, bytes_per_s)`` of ``time = latency + bytes / bandwidth`` fitted to
    ``(bytes, seconds)`` points by least squares on the relative error (weights 1/t^2):
    the sizes span orders of magnitude, and plain least squares would let the largest
    message decide the latency too. A negative intercept (noise) is refitted through
    the origin; a fit with no bandwidth signal raises ValueError."""
    xs = [float(x) for x, _ in points]
    ts = [float(t) for _, t in points]
    if len(xs) < 2 or len(set(xs)) < 2 or min(ts) <= 0:
        raise ValueError(f"need >= 2 distinct sizes with positive times, got {list(points)}")
    ws = [1.0 / (t * t) for t in ts]
    sw = sum(ws)
    mx = sum(w * x for w, x in zip(ws, xs, strict=True)) / sw
    mt = sum(w * t for w, t in zip(ws, ts, strict=True)) / sw
    sxx = sum(w * (x - mx) ** 2 for w, x in zip(ws, xs, strict=True))
    sxt = sum(w * (x - mx) * (t - mt) for w, x, t in zip(ws, xs, ts, strict=True))
    slope = sxt / sxx
    latency = mt - slope * mx
    if latency < 0:  # constrained to latency >= 0: the best line through the origin
        latency = 0.0
        slope = sum(w * x * t for w, x, t in zip(ws, xs, ts, strict=True)) / sum(w * x * x for w, x in zip(ws, xs, strict=True))
    if slope <= 0:
        raise ValueError(f"time does not grow with size, no bandwidth to fit: {list(points)}")
    return latency, 1.0 / slope


def ring_wire_bytes(buffer_bytes: float, n: int) -> float:
    """Bytes one device sends in a ring all-reduce of a ``buffer_bytes`` buffer over ``n`` devices."""
    return RING_FACTOR["all-reduce"](n) * buffer_bytes


# ----------------------------------------------------------------------------- compute and memory


def measure_matmul(sides: Sequence[int], dtype: str, *, repeats: int, budget_s: float) -> tuple[float, list[dict[str, Any]]]:
    """Best FLOP/s of a jitted square ``jnp.dot`` (2 n^3 FLOPs) over the sizes, and the raw points."""
    dot = jax.jit(jnp.dot)
    raw = []
    for n in sides:
        a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32).astype(dtype)
        b = jax.random.normal(jax.random.key(1), (n, n), jnp.float32).astype(dtype)
        best, times = best_time(lambda a=a, b=b: dot(a, b).block_until_ready(), repeats=repeats, budget_s=budget_s)
        raw.append({"n": n, "dtype": dtype, "flops": 2.0 * n**3, "best_s": best, "times_s": times})
    return max(p["flops"] / p["best_s"] for p in raw), raw


def measure_op_overhead(*, ops: int = 256, repeats: int, budget_s: float) -> tuple[float, dict[str, Any]]:
    """Seconds per executed op: a jitted chain of ``ops`` dependent 8x8 matmuls with a tanh
    (negligible arithmetic), divided by the ops the compiled program executes as the cost
    model counts them (``hlo_cost.program_cost``)."""

    def chain(x):
        for _ in range(ops):
            x = jnp.tanh(x @ x)
        return x

    x = jnp.eye(8, dtype=jnp.float32) * 0.5
    compiled = jax.jit(chain).lower(x).compile()
    executed = max(program_cost(compiled.as_text()).op_executions, 1.0)
    best, times = best_time(lambda: compiled(x).block_until_ready(), repeats=repeats, budget_s=budget_s)
    return best / executed, {"chain": ops, "ops_executed": executed, "best_s": best, "times_s": times}


def measure_fusions(*, repeats: int, budget_s: float) -> tuple[float, list[dict[str, Any]]]:
    """Bytes/s (read + written) XLA:CPU sustains on the memory-bound ops a training step is
    made of: a scale-and-shift, a transpose and a softmax-like exp of a max-shifted row, on
    activation-sized arrays (1 and 8 MB). Their geometric mean: streaming copies alone run
    several times faster than transposes and transcendentals do."""
    ops = {
        "scale": lambda x: x * 1.0001 + 1.0,
        "transpose": lambda x: jnp.swapaxes(x, -1, -2) * 2.0,
        "softmax-like": lambda x: jnp.exp(x - x.max(-1, keepdims=True)),
    }
    raw = []
    for shape in ((2048, 128), (16, 8, 128, 128)):
        x = jnp.ones(shape, jnp.float32)
        for name, fn in ops.items():
            compiled = jax.jit(fn).lower(x).compile()
            best, _ = best_time(lambda c=compiled, x=x: c(x).block_until_ready(), repeats=max(repeats, 50), budget_s=budget_s)
            raw.append({"op": name, "shape": list(shape), "bytes": 2 * x.size * 4, "best_s": best})
    rate = math.exp(sum(math.log(p["bytes"] / p["best_s"]) for p in raw) / len(raw))
    return rate, raw


def measure_memory(nbytes: int, *, repeats: int, budget_s: float) -> tuple[float, dict[str, Any]]:
    """Best bytes/s (read + written) of a jitted elementwise op over an fp32 array of
    ``nbytes``. The input is donated, so XLA updates it in place: fresh output pages
    (page faults) would otherwise be timed as memory traffic."""
    scale = jax.jit(lambda x: x * 1.0000001 + 1e-7, donate_argnums=0)
    state = [jnp.ones((nbytes // 4,), jnp.float32)]

    def step() -> None:
        state[0] = scale(state[0])
        state[0].block_until_ready()

    best, times = best_time(step, repeats=repeats, budget_s=budget_s)
    moved = 2.0 * (nbytes // 4) * 4
    return moved / best, {"bytes_moved": moved, "best_s": best, "times_s": times}


# ----------------------------------------------------------------------------- collectives


def measure_collective(
    mode: str, n: int, sizes: Sequence[int], *, repeats: int, timeout_s: float
) -> tuple[float, float, list[list[float]]]:
    """``(latency_s, bytes_per_s, raw points)`` of an all-reduce over ``n`` devices: ``n``
    gloo processes of one device each (``mode="gloo"``) or one process with ``n`` fake
    devices (``mode="fake"``), timed in subprocesses (``jaxdist.plan.allreduce``).
    Bandwidth is in ring wire bytes (``ring_wire_bytes``)."""
    points, what = all_reduce_points(mode, n, sizes, repeats=repeats, timeout_s=timeout_s)
    try:
        latency, bandwidth = fit_latency_bandwidth([(ring_wire_bytes(b, n), t) for b, t in points])
    except ValueError as e:
        raise RuntimeError(f"{what}: {e}") from None
    return latency, bandwidth, points


# ----------------------------------------------------------------------------- the profile


def host_string() -> str:
    """A short description of this host: CPU model, cores, jax version (the cache key)."""
    model = "unknown CPU"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
            if line.lower().startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    try:
        jax_version = importlib.metadata.version("jax")
    except importlib.metadata.PackageNotFoundError:
        jax_version = "?"
    return f"{model}, {cpu_count()} cores, jax {jax_version}"


def cpu_count() -> int:
    """Cores this process may run on (the affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def measure_host(*, quick: bool = False, processes: int = 2, timeout_s: float = 120.0) -> dict[str, Any]:
    """Measure this host now and return the ``cpu-local`` profile (floats in SI units:
    FLOP/s, bytes/s, seconds) with the raw timing points under ``raw``. ``processes``
    is the number of gloo processes (and of fake devices) the all-reduces run over;
    ``timeout_s`` bounds each of the two collective measurements."""
    cfg = QUICK if quick else FULL
    t_start = time.perf_counter()
    reps = {"repeats": cfg["repeats"], "budget_s": cfg["budget_s"]}
    f32, raw_f32 = measure_matmul(cfg["matmul_sides"], "float32", **reps)
    # small matmuls run far below the peak on a CPU: the rate per call size, for the cost model
    _, raw_curve = measure_matmul(cfg["curve_sides"], "float32", **reps)
    overhead, raw_overhead = measure_op_overhead(**reps)
    fusions, raw_fusions = measure_fusions(**reps)
    bf16, raw_bf16 = measure_matmul(cfg["matmul_sides"], "bfloat16", **reps)
    mem, raw_mem = measure_memory(cfg["memory_bytes"], **reps)
    coll = {"repeats": cfg["collective_repeats"], "timeout_s": timeout_s}
    lat, bw, raw_gloo = measure_collective("gloo", processes, cfg["collective_bytes"], **coll)
    fake_lat, fake_bw, raw_fake = measure_collective("fake", processes, cfg["collective_bytes"], **coll)
    return {
        "name": "cpu-local",
        "matmul_flops_per_s": f32,
        "matmul_flops_per_s_bf16": bf16,
        "matmul_curve": [[p["flops"], p["flops"] / p["best_s"]] for p in raw_curve + raw_f32],
        "op_overhead_s": overhead,
        "fusion_bytes_per_s": fusions,
        "memory_bytes_per_s": mem,
        "collective_latency_s": lat,
        "collective_bytes_per_s": bw,
        "fake_device_collective_latency_s": fake_lat,
        "fake_device_collective_bytes_per_s": fake_bw,
        "collective_processes": processes,
        "cores": cpu_count(),
        "host": host_string(),
        "jax_version": jax.__version__,
        "quick": quick,
        "threads": {name: os.environ.get(name) for name in ("OMP_NUM_THREADS", "XLA_FLAGS")},
        "measured_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "measure_s": time.perf_counter() - t_start,
        "raw": {
            "matmul": raw_f32 + raw_bf16 + raw_curve,
            "op_overhead": raw_overhead,
            "fusions": raw_fusions,
            "memory": raw_mem,
            # [buffer bytes per device, median seconds]; the fits use ring wire bytes
            "all_reduce_gloo": raw_gloo,
            "all_reduce_fake_devices": raw_fake,
        },
    }


def default_cache() -> Path:
    """``$JAXDIST_CACHE_DIR/cpu-local.json``, else ``~/.cache/jaxdist/cpu-local.json``."""
    root = os.environ.get(ENV_CACHE_DIR)
    return Path(root) / CACHE_FILE if root else Path.home() / ".cache" / "jaxdist" / CACHE_FILE


def _cached(path: Path, quick: bool) -> dict[str, Any] | None:
    """The profile in ``path`` if it was measured on this host (same host string and
    cores) and is good enough (a quick profile does not answer a full request)."""
    try:
        profile = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(profile, dict) or profile.get("host") != host_string() or profile.get("cores") != cpu_count():
        return None
    if profile.get("quick") and not quick:
        return None
    if any(key not in profile for key in ("matmul_curve", "op_overhead_s", "fusion_bytes_per_s")):  # from an older jaxdist: measure again
        return None
    return profile


def load_or_measure(cache: Path | None = None, *, refresh: bool = False, quick: bool = False) -> dict[str, Any]:
    """The cached profile of this host, measured (and written, atomically) when the cache
    is absent, unreadable, from another host, or ``refresh`` is set."""
    path = Path(cache) if cache is not None else default_cache()
    if not refresh and (profile := _cached(path, quick)) is not None:
        return profile
    text = json.dumps(measure_host(quick=quick), indent=1) + "\n"
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(text)
        os.replace(tmp, path)  # readers never see half a file
    except OSError as e:  # the measurement is still good: use it, measure again next time
        log.warning(f"could not write the profile cache {path}: {e}")
        with contextlib.suppress(OSError):
            tmp.unlink()
    return json.loads(text)  # exactly what a later call reads from the cache


def format_profile(profile: dict[str, Any]) -> str:
    """A short human-readable table of a profile."""

    def si(value: float, unit: str) -> str:
        if not math.isfinite(value):
            return f"{value} {unit}"
        for factor, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
            if abs(value) >= factor:
                return f"{value / factor:.2f} {prefix}{unit}"
        return f"{value:.3g} {unit}"

    n = profile.get("collective_processes", 2)
    rows = [
        ("host", profile["host"]),
        ("measured at", f"{profile['measured_at']}{' (quick)' if profile.get('quick') else ''}"),
        ("matmul fp32", si(profile["matmul_flops_per_s"], "FLOP/s")),
        ("matmul bf16", si(profile["matmul_flops_per_s_bf16"], "FLOP/s")),
        ("memory", si(profile["memory_bytes_per_s"], "B/s")),
        (
            f"all-reduce, {n} gloo processes",
            f"{profile['collective_latency_s'] * 1e6:.0f} us + {si(profile['collective_bytes_per_s'], 'B/s')}",
        ),
        (
            f"all-reduce, {n} fake devices",
            f"{profile['fake_device_collective_latency_s'] * 1e6:.0f} us + {si(profile['fake_device_collective_bytes_per_s'], 'B/s')}",
        ),
        ("threads", ", ".join(f"{k}={v}" for k, v in profile.get("threads", {}).items())),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m jaxdist.plan.measure``: print this host's profile (cached unless --refresh)."""
    parser = argparse.ArgumentParser(prog="python -m jaxdist.plan.measure", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller sizes and fewer repeats (~10-20 s)")
    parser.add_argument("--refresh", action="store_true", help="measure again even when a cached profile exists")
    parser.add_argument("--json", action="store_true", help="print the profile as JSON")
    parser.add_argument("--cache", type=Path, default=None, help=f"cache file (default: {default_cache()})")
    args = parser.parse_args(argv)
    try:
        profile = load_or_measure(args.cache, refresh=args.refresh, quick=args.quick)
    except RuntimeError as e:
        log.error(str(e))
        return 1
    print(json.dumps(profile, indent=1) if args.json else format_profile(profile))
    return 0


if __name__ == "__main__":
    sys.exit(main())
