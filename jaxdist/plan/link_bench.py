"""The links of a mesh, measured as nccl-tests measures them (the work of ``python -m jaxdist.commbench``).

For each mesh axis of more than one device, each collective and each size S of the sweep,
one jitted ``shard_map`` over the whole mesh runs that one collective over that axis (every
group of the axis at once, as a training step does). It is compiled, run ``warmup`` times,
then timed ``iters`` times, each call waiting for its result (``block_until_ready``); the
time is the median, and with several processes the slowest process's median (a collective
waits for every member, and so does a step).

Byte counts and bus bandwidth are nccl-tests' (its doc/PERFORMANCE.md), for ``n`` devices on
the axis; float32 elements, S rounded down to a multiple of 4n bytes as nccl-tests rounds its
counts to the ranks (sizes that round to one S are measured once, and one line says so):

    collective          S (bytes)                                         busbw / algbw
    all-reduce          each device's buffer (in and out)                 2(n-1)/n
    all-gather          each device's result: n x its input              (n-1)/n
    reduce-scatter      each device's input: n x its result              (n-1)/n
    all-to-all          each device's buffer (n blocks of S/n)           (n-1)/n
    collective-permute  each device's buffer, sent to the next on a ring  1

``algbw = S / time``; ``busbw`` is comparable across collectives and device counts, and to a
link's bandwidth per device and direction: what the planner's hardware profiles quote. S is
also what ``jaxdist.inspect.collectives`` reports for a compiled collective (the larger of
operand and result), so the planner prices a training step's collectives on these figures.

An axis crosses the *inter-node* link when a group of it spans more than one node: a host on
GPUs (NVLink within it), a process on CPU (fake devices in one process exchange through
memory, processes through gloo over TCP: the ``cpu-local`` profile's two links).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import os
import re
import socket
import statistics
import sys
import time
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxdist.cluster.distributed import initialize
from jaxdist.cluster.heartbeat import beat, install_stack_dump
from jaxdist.errors import JaxdistError
from jaxdist.inspect.collectives import collective_ops
from jaxdist.inspect.hlo import parse_hlo
from jaxdist.inspect.wire import RING_FACTOR
from jaxdist.layout.devices import DEFAULT_FAKE_DEVICES, ensure_fake_cpu_devices, forced_host_device_count, gpu_plugin_installed
from jaxdist.layout.mesh import build_mesh, format_mesh, has_remaining_axis, mesh_device_count, parse_mesh, resolve_mesh
from jaxdist.plan.cost import collective_time
from jaxdist.plan.hardware import CPU_LOCAL, Hardware, cpu_local, default_hardware, load_hardware
from jaxdist.plan.link_profile import link_profile
from jaxdist.plan.measure import _cached, cpu_count, default_cache, host_string

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
ELEMENT_BYTES = 4  # float32
DTYPE = "float32"

log = logging.getLogger(__name__)
_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}
_SIZE_RE = re.compile(r"(\d+)([KMG]?)B?", re.IGNORECASE)


# ----------------------------------------------------------------------------- sizes and bytes


def parse_size(text: str) -> int:
    """``4096``, ``4K``, ``16M``, ``1G`` (binary units, as nccl-tests') -> bytes."""
    match = _SIZE_RE.fullmatch(text.strip())
    if not match:
        raise JaxdistError(f"--sizes: {text!r} is not a size (bytes, or a number with K, M or G: 1K, 64M, 1G)")
    return int(match.group(1)) * _UNITS[match.group(2).upper()]


def parse_sizes(spec: str) -> list[int]:
    """``A:B`` -> every power of 2 from A to B (bytes; K/M/G suffixes); ``A`` -> [A]."""
    lo_text, sep, hi_text = spec.partition(":")
    lo = parse_size(lo_text)
    hi = parse_size(hi_text) if sep else lo
    if lo < 1:
        raise JaxdistError(f"--sizes {spec}: sizes must be >= 1 byte")
    if lo > hi:
        raise JaxdistError(f"--sizes {spec}: the first size is larger than the last")
    if not sep:
        return [lo]
    sizes = [1 << k for k in range((lo - 1).bit_length(), hi.bit_length()) if lo <= 1 << k <= hi]
    if not sizes:
        raise JaxdistError(f"--sizes {spec}: no power of 2 lies between {lo} and {hi} bytes")
    return sizes


def buffer_elements(size: int, n: int) -> int:
    """Elements of S for ``n`` devices: ``size`` bytes rounded down to a multiple of n elements (at least n)."""
    return max(size // ELEMENT_BYTES // n, 1) * n


def axis_elements(sizes: Sequence[int], n: int) -> list[int]:
    """The distinct S (elements) the sweep measures over an axis of ``n`` devices: sizes that
    round to the same buffer are one point, not several rows of the same measurement."""
    return list(dict.fromkeys(buffer_elements(size, n) for size in sizes))


def rounding_note(sizes: Sequence[int], axes: dict[str, int]) -> str | None:
    """One line naming the requested sizes that an axis measures at another size (None if none)."""
    parts = []
    for axis, n in axes.items():
        rounded: dict[int, list[int]] = {}
        for size in sizes:
            measured = buffer_elements(size, n) * ELEMENT_BYTES
            if measured != size:
                rounded.setdefault(measured, []).append(size)
        if rounded:
            groups = ", ".join(f"{'/'.join(format_size(s) for s in asked)} -> {format_size(m)}" for m, asked in rounded.items())
            parts.append(f"{axis}={n}: {groups}")
    if not parts:
        return None
    return (
        f"note: sizes are whole float32 elements, a multiple of 4 x n bytes over n devices (as nccl-tests counts), "
        f"and a size measured twice is one row: {'; '.join(parts)}"
    )


def local_shapes(kind: str, elements: int, n: int) -> tuple[int, int]:
    """(input, output) elements per device of ``kind`` whose S is ``elements``."""
    if kind == "all-gather":
        return elements // n, elements
    if kind == "reduce-scatter":
        return elements, elements // n
    return elements, elements


def bus_bandwidth(kind: str, algbw: float, n: int) -> float:
    return algbw * RING_FACTOR[kind](n)


# ----------------------------------------------------------------------------- the programs


def _collective(kind: str, axis: str, n: int):
    if kind == "all-reduce":
        return lambda x: jax.lax.psum(x, axis)
    if kind == "all-gather":
        return lambda x: jax.lax.all_gather(x, axis, tiled=True)
    if kind == "reduce-scatter":
        return lambda x: jax.lax.psum_scatter(x, axis, scatter_dimension=0, tiled=True)
    if kind == "all-to-all":
        return lambda x: jax.lax.all_to_all(x, axis, 0, 0, tiled=True)
    if kind == "collective-permute":
        return lambda x: jax.lax.ppermute(x, axis, [(i, (i + 1) % n) for i in range(n)])
    raise ValueError(f"unknown collective {kind!r}")


def program(mesh, axis: str, kind: str, elements: int):
    """``(jitted function, its input)``: one ``kind`` over ``axis`` on every device of
    ``mesh``, S = ``elements`` float32 elements (``local_shapes`` per device)."""
    n = mesh.shape[axis]
    spec = P(tuple(mesh.axis_names))  # each device holds one block of the 1-D array
    fn = jax.jit(jax.shard_map(_collective(kind, axis, n), mesh=mesh, in_specs=spec, out_specs=spec))
    local, _ = local_shapes(kind, elements, n)
    sharding = NamedSharding(mesh, spec)
    x = jax.make_array_from_callback((mesh.size * local,), sharding, lambda index: np.ones((local,), np.float32))
    return fn, x


def compiled_kinds(compiled) -> list[str]:
    """The collectives XLA's compiled program runs (``jaxdist.inspect``'s reading of its HLO)."""
    return sorted({op.kind for op in collective_ops(parse_hlo(compiled.as_text()))})


def median_time(run: Callable[[], Any], *, iters: int, warmup: int) -> float:
    for _ in range(warmup):
        run()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


# ----------------------------------------------------------------------------- links


def node_ids() -> list[int]:
    """A node id per process: the process itself on CPU, its host on GPUs (hosts exchanged once)."""
    if jax.process_count() == 1 or jax.devices()[0].platform == "cpu":
        return list(range(jax.process_count()))
    mine = np.array([zlib.crc32(socket.gethostname().encode()) & 0x7FFFFFFF], np.int32)
    return [int(h) for h in np.asarray(multihost_utils.process_allgather(mine)).reshape(-1)]


def axis_links(mesh) -> dict[str, str]:
    """``intra_node`` or ``inter_node`` per mesh axis: whether a group of it spans nodes."""
    nodes = node_ids()
    out = {}
    for i, axis in enumerate(mesh.axis_names):
        groups = np.moveaxis(mesh.devices, i, -1).reshape(-1, mesh.shape[axis])
        crosses = any(len({nodes[d.process_index] for d in group}) > 1 for group in groups)
        out[axis] = "inter_node" if crosses else "intra_node"
    return out


# ----------------------------------------------------------------------------- the sweep


@dataclasses.dataclass(frozen=True)
class Sweep:
    sizes: tuple[int, ...]
    iters: int = 20
    warmup: int = 5
    kinds: tuple[str, ...] = KINDS


def run_commbench(mesh, sweep: Sweep, *, on_point: Callable[[int], None] = lambda i: None) -> dict[str, Any]:
    """Time every collective over every axis of ``mesh`` of more than one device, for every
    size; the report (``results``: one row per axis x collective x size, the slowest
    process's median). ``on_point(i)`` is called before the i-th point (the hang watch's beat)."""
    links = axis_links(mesh)
    axes = [a for a in mesh.axis_names if mesh.shape[a] > 1]
    note = rounding_note(sweep.sizes, {a: int(mesh.shape[a]) for a in axes})
    if note:
        log.info(note)
    rows, medians, warned = [], [], set()
    for axis in axes:
        n = mesh.shape[axis]
        for kind in sweep.kinds:
            for elements in axis_elements(sweep.sizes, n):
                on_point(len(rows) + 1)
                fn, x = program(mesh, axis, kind, elements)
                compiled = fn.lower(x).compile()
                ran = compiled_kinds(compiled)
                if ran != [kind] and (axis, kind) not in warned:
                    warned.add((axis, kind))
                    log.warning(f"{kind} over {axis} compiled to {', '.join(ran) or 'no collective'} on this backend; its row times that")
                medians.append(median_time(lambda c=compiled, x=x: c(x).block_until_ready(), iters=sweep.iters, warmup=sweep.warmup))
                rows.append(
                    {
                        "axis": axis,
                        "kind": kind,
                        "group_size": n,
                        "link": links[axis],
                        "bytes": elements * ELEMENT_BYTES,
                        "compiled_as": ran,
                    }
                )
                del fn, x, compiled
    for row, t in zip(rows, _slowest(medians), strict=True):
        algbw = row["bytes"] / t
        row |= {"time_s": t, "algbw": algbw, "busbw": bus_bandwidth(row["kind"], algbw, row["group_size"])}
    return {
        "platform": jax.devices()[0].platform,
        "device_kind": jax.devices()[0].device_kind,
        "devices": mesh.size,
        "processes": jax.process_count(),
        "mesh": {a: int(mesh.shape[a]) for a in mesh.axis_names if mesh.shape[a] > 1},
        "dtype": DTYPE,
        "iters": sweep.iters,
        "warmup": sweep.warmup,
        "results": rows,
        **_host(),
    }


def _slowest(medians: list[float]) -> list[float]:
    """Each point's largest median over the processes."""
    if jax.process_count() == 1 or not medians:
        return medians
    gathered = np.asarray(multihost_utils.process_allgather(np.asarray(medians, np.float32)))
    return [float(t) for t in gathered.reshape(jax.process_count(), -1).max(axis=0)]


def _host() -> dict[str, Any]:
    return {
        "host": host_string(),
        "cores": cpu_count(),
        "jax_version": jax.__version__,
        "threads": {name: os.environ.get(name) for name in ("OMP_NUM_THREADS", "XLA_FLAGS")},
        "measured_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }


# ----------------------------------------------------------------------------- the planner's side


def planner_columns(rows: list[dict[str, Any]], hardware: Hardware) -> None:
    """Add the planner's view of each row: its link's datasheet bandwidth and efficiency, and the
    bus bandwidth of the time the cost model predicts (``jaxdist.plan.cost.collective_time``)."""
    for row in rows:
        link = getattr(hardware, row["link"])
        bus_bytes = row["bytes"] * RING_FACTOR[row["kind"]](row["group_size"])
        predicted = collective_time(row["kind"], bus_bytes, row["group_size"], link)
        row |= {
            "datasheet_bytes_per_s": link.bandwidth * link.efficiency,
            "planner_time_s": predicted,
            "planner_busbw": bus_bytes / predicted,
        }


def format_size(size: int) -> str:
    for unit, factor in (("G", 2**30), ("M", 2**20), ("K", 2**10)):
        if size >= factor and size % factor == 0:
            return f"{size // factor}{unit}"
    return str(size)


def format_report(report: dict[str, Any], hardware: Hardware | None) -> str:
    mesh = ",".join(f"{a}={s}" for a, s in report["mesh"].items())
    lines = [
        f"commbench: {report['devices']} {report['platform']} devices in {report['processes']} process(es), mesh {mesh}; "
        f"{report['dtype']}, median of {report['iters']} runs after {report['warmup']} warm-up; {report['host']}",
        f"threads: {', '.join(f'{k}={v}' for k, v in report['threads'].items())}",
    ]
    for axis in report["mesh"]:
        rows = [r for r in report["results"] if r["axis"] == axis]
        link = rows[0]["link"]
        head = f"axis {axis} ({rows[0]['group_size']} devices, {link.replace('_', '-')} link)"
        if hardware is not None:
            datasheet = getattr(hardware, link)
            head += f"; planner profile {hardware.key}: {datasheet.bandwidth / 1e9:.3g} GB/s x {datasheet.efficiency:g}, {datasheet.latency * 1e6:.3g} us per ring step"
        lines += [
            "",
            head,
            f"  {'collective':<19}{'size':>6}{'time us':>11}{'algbw GB/s':>12}{'busbw GB/s':>12}" + ("  planner busbw" if hardware else ""),
        ]
        for r in rows:
            line = (
                f"  {r['kind']:<19}{format_size(r['bytes']):>6}{r['time_s'] * 1e6:>11.1f}{r['algbw'] / 1e9:>12.3f}{r['busbw'] / 1e9:>12.3f}"
            )
            if hardware is not None:
                line += f"  {r['planner_busbw'] / 1e9:>13.3f}"
            lines.append(line)
    return "\n".join(lines)


def check_host_memory(sizes: Sequence[int], devices_here: int) -> None:
    """On CPU the devices share this host's memory: a sweep whose largest point (input,
    output and the copy in flight, per device) does not fit is refused before it starts."""
    need = 3 * max(sizes) * devices_here
    try:
        available = next(int(line.split()[1]) * 1024 for line in open("/proc/meminfo") if line.startswith("MemAvailable:"))  # noqa: SIM115
    except (OSError, StopIteration, ValueError):
        return
    if need > available:
        raise JaxdistError(
            f"--sizes up to {format_size(max(sizes))} on {devices_here} CPU devices needs ~{need / 2**30:.1f} GiB; "
            f"{available / 2**30:.1f} GiB is available"
        )


# ----------------------------------------------------------------------------- one run, from the command line's values


def planner_hardware(key: str | None) -> Hardware | None:
    """The profile to print beside the measurements; ``cpu-local`` only from this host's cache
    (measuring it here would start JAX before the process group is joined)."""
    if key != CPU_LOCAL:
        return load_hardware(key) if key else None
    profile = _cached(default_cache(), quick=True)
    if profile is None:
        raise JaxdistError(
            f"no cpu-local profile of this host is cached in {default_cache()} (python -m jaxdist.plan.measure writes it; or pass --hardware)"
        )
    return cpu_local(profile)


def check_output(path: str | None, flag: str = "--out") -> None:
    """``--out PATH`` can be written (checked before anything runs; ``-`` is stdout)."""
    if path is None or path == "-":
        return
    target = Path(path)
    if target.is_dir():
        raise JaxdistError(f"{flag} {path}: is a directory")
    if not target.parent.is_dir():
        raise JaxdistError(f"{flag} {path}: no directory {target.parent}")
    if not os.access(target.parent, os.W_OK):
        raise JaxdistError(f"{flag} {path}: cannot write in {target.parent}")


def write_json(path: str, data: dict[str, Any]) -> None:
    """Atomically: a reader (the planner) never sees half a file."""
    text = json.dumps(data, indent=1) + "\n"
    if path == "-":
        sys.stdout.write(text)
        return
    target = Path(path)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, target)


def commbench(
    mesh_spec: str, sweep: Sweep, group, hardware_key: str | None, outputs: dict[str, str] | None = None
) -> tuple[dict | None, Hardware | None]:
    """Measure the links of ``mesh_spec`` as one process of ``group`` (None: alone): fake CPU
    devices or GPUs arranged first, the process group joined as the trainer joins it; returns
    process 0's report (None on the others) and the planner profile beside it. ``outputs``
    (path or ``-`` for stdout -> the flag that named it) get the link profile; a profile with no
    link in it (nothing the planner could read) is an error and nothing is written."""
    outputs = outputs or {}
    install_stack_dump()  # under jaxdist.launch: its hang watch's SIGUSR1 prints the stacks, as a trainer's does
    sizes = parse_mesh(mesh_spec)
    if sizes is None:
        raise JaxdistError("--mesh auto: name the axes to measure (default data=-1: every device on one axis)")
    for path, flag in outputs.items():
        check_output(path, flag)
    key = hardware_key
    hardware = planner_hardware(key) if key else None
    processes = group.num_processes if group is not None and group.num_processes else 1
    if not gpu_plugin_installed():  # CPU: the fake devices per process are known before JAX starts
        if has_remaining_axis(sizes):
            sizes = resolve_mesh(sizes, (forced_host_device_count() or DEFAULT_FAKE_DEVICES) * processes)
        if mesh_device_count(sizes) % processes:
            raise JaxdistError(f"mesh {format_mesh(sizes)} ({mesh_device_count(sizes)} devices) does not split over {processes} processes")
        check_host_memory(sweep.sizes, mesh_device_count(sizes) // processes)
        ensure_fake_cpu_devices(mesh_device_count(sizes) // processes)
    initialize(group)  # only process 0 speaks from here
    if has_remaining_axis(sizes):
        sizes = resolve_mesh(sizes, jax.device_count())
    if all(size == 1 for size in sizes.values()):
        raise JaxdistError(f"mesh {format_mesh(sizes)} has no axis of more than one device: nothing to measure")
    mesh = build_mesh(sizes)
    if outputs and max(len(axis_elements(sweep.sizes, n)) for n in mesh.shape.values() if n > 1) < 2:
        # a link is fitted as latency + bytes / bandwidth: one size per axis gives no bandwidth, and the planner no link
        raise JaxdistError(f"{' and '.join(outputs.values())}: a link profile needs two sizes or more per axis; --sizes measures one")
    if key is None:
        key = default_hardware(jax.devices()[0].platform, jax.devices()[0].device_kind)
        try:
            hardware = planner_hardware(key)
        except JaxdistError as e:
            log.warning(f"the planner's column is left out: {e}")
        if key is None:
            log.warning(f"no planner profile for {jax.devices()[0].device_kind}; pass --hardware to compare")
    report = run_commbench(mesh, sweep, on_point=beat)
    if jax.process_index() != 0:
        return None, hardware
    report["hardware"] = hardware.key if hardware else None
    if hardware is not None:
        planner_columns(report["results"], hardware)
    if outputs:
        left_out: list[str] = []
        profile = link_profile(report, left_out=left_out)
        if not profile["links"]:  # the planner refuses such a file: write none rather than one it cannot read
            raise JaxdistError(f"no link profile written: {'; '.join(left_out)}; measure a wider range of --sizes")
        for why in left_out:
            log.warning(f"{why}; measure a wider range of --sizes")
        for path in outputs:
            write_json(path, profile)
    return report, hardware
