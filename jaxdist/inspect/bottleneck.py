"""From per-process traces to the report: per device and step breakdown, averages,
top ops, collectives, predicted vs measured, stragglers and the bound.

The definitions are documented in ``jaxdist/inspect/profile_report.py``; this module implements them.
"""

from __future__ import annotations

import functools
import math
import socket
import statistics
import threading
import time
from bisect import bisect_left
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from jaxdist.inspect.trace_reader import PHASES, PRE, Op, ProcessTrace

CATEGORIES = ("compute", "communication_exposed", "communication_overlapped", "data_wait", "idle")
BOUND_MIN_SHARE = 0.25  # data / host must hold at least this share of the step (and the largest one)
TOP_OPS = 10

# Link bandwidth per GPU, per direction (bytes/s): NVLink within a node, InfiniBand across.
NVLINK_BYTES_PER_S = {"B200": 900e9, "H200": 450e9, "H100": 450e9, "A100": 300e9, "V100": 150e9}
NVLINK_DEFAULT = 450e9  # NVLink 4 (H100 / H200 SXM)
INFINIBAND_BYTES_PER_S = 50e9  # NDR: 8 x 400 Gb/s per 8-GPU node = ~50 GB/s per GPU

Interval = tuple[float, float]


# --- interval arithmetic (lists of (start, end), merged = sorted and disjoint) ---------


def merge(ivs: list[Interval]) -> list[Interval]:
    out: list[Interval] = []
    for s, e in sorted(ivs):
        if e <= s:
            continue
        if out and s <= out[-1][1]:
            if e > out[-1][1]:
                out[-1] = (out[-1][0], e)
        else:
            out.append((s, e))
    return out


def length(ivs: list[Interval]) -> float:
    return sum(e - s for s, e in ivs)


def clip(ivs: list[Interval], lo: float, hi: float) -> list[Interval]:
    return [(max(s, lo), min(e, hi)) for s, e in ivs if e > lo and s < hi]


def intersect(a: list[Interval], b: list[Interval]) -> list[Interval]:
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        s, e = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if s < e:
            out.append((s, e))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def subtract(a: list[Interval], b: list[Interval]) -> list[Interval]:
    out, j = [], 0
    for s, e in a:
        while j < len(b) and b[j][1] <= s:
            j += 1
        k, cur = j, s
        while k < len(b) and b[k][0] < e:
            if b[k][0] > cur:
                out.append((cur, b[k][0]))
            cur = max(cur, b[k][1])
            k += 1
        if cur < e:
            out.append((cur, e))
    return out


# --- the breakdown of one step on one device --------------------------------------------


@dataclass
class DeviceStep:
    process: int
    device: int
    step: int
    lo: float  # the step's window on this device's timeline
    hi: float
    seconds: dict[str, float]  # CATEGORIES -> seconds; they sum to hi - lo
    compute: list[Interval] = field(default_factory=list)  # merged, for the timeline plot
    communication: list[Interval] = field(default_factory=list)
    data_wait: list[Interval] = field(default_factory=list)
    by_kind: dict[str, tuple[float, float]] = field(default_factory=dict)  # collective kind -> (time, exposed)

    @property
    def window_s(self) -> float:
        return self.hi - self.lo


def device_steps(trace: ProcessTrace) -> list[DeviceStep]:
    """Every (device, traced step) window of one process with its breakdown.

    Window of step k on device d: from the end of d's work for the previous traced step
    (for the first one: the host's ``train_step`` start, or later if d was still busy with
    work dispatched before the window) to the end of d's last op dispatched in step k."""
    data = merge(trace.phases.get("data", []))
    ks = list(trace.steps)
    out = []
    for device, ops in trace.devices.items():
        by_step: dict[int, list[Op]] = defaultdict(list)
        pre_end = -math.inf
        for op in ops:
            if op.step == PRE:
                pre_end = max(pre_end, op.end)
            elif op.step is not None:
                by_step[op.step].append(op)
        lo = trace.steps[ks[0]][0]
        if by_step.get(ks[0]):
            lo = min(max(lo, pre_end), min(op.start for op in by_step[ks[0]]))
        starts = [op.start for op in ops]
        longest = max((op.end - op.start for op in ops), default=0.0)
        for k in ks:
            if not by_step.get(k):
                continue  # nothing ran for this step here: its time falls into the next window
            hi = max(op.end for op in by_step[k])
            if hi <= lo:
                continue  # finished before the previous step did (concurrent executions): no window of its own
            first = bisect_left(starts, lo - longest)
            last = bisect_left(starts, hi)
            out.append(_breakdown(trace.index, device, k, lo, hi, ops[first:last], data))
            lo = hi
    return out


def _breakdown(process: int, device: int, step: int, lo: float, hi: float, ops: list[Op], data: list[Interval]) -> DeviceStep:
    compute = clip(merge([(op.start, op.end) for op in ops if op.kind == "compute"]), lo, hi)
    kinds: dict[str, list[Interval]] = defaultdict(list)
    for op in ops:
        if op.kind != "compute":
            kinds[op.kind].append((op.start, op.end))
    communication = clip(merge([iv for ivs in kinds.values() for iv in ivs]), lo, hi)
    overlapped = length(intersect(compute, communication))
    exposed = length(communication) - overlapped
    busy = merge(compute + communication)
    waiting = intersect(subtract([(lo, hi)], busy), clip(data, lo, hi))
    seconds = {
        "compute": length(compute) - overlapped,
        "communication_exposed": exposed,
        "communication_overlapped": overlapped,
        "data_wait": length(waiting),
    }
    seconds["idle"] = max(0.0, (hi - lo) - sum(seconds.values()))
    by_kind = {}
    for kind, ivs in kinds.items():
        merged = clip(merge(ivs), lo, hi)
        by_kind[kind] = (length(merged), length(subtract(merged, compute)))
    return DeviceStep(process, device, step, lo, hi, seconds, compute, communication, waiting, by_kind)


# --- averages -----------------------------------------------------------------------------


def fractions_of(seconds: dict[str, float]) -> dict[str, float]:
    total = sum(seconds[c] for c in CATEGORIES)
    return {c: (seconds[c] / total if total > 0 else 0.0) for c in CATEGORIES}


def mean_seconds(items: list[DeviceStep]) -> dict[str, float]:
    n = max(len(items), 1)
    return {c: sum(it.seconds[c] for it in items) / n for c in CATEGORIES}


def per_step(items: list[DeviceStep]) -> list[dict[str, Any]]:
    steps: dict[int, list[DeviceStep]] = defaultdict(list)
    for it in items:
        steps[it.step].append(it)
    out = []
    for k in sorted(steps):
        seconds = mean_seconds(steps[k])
        out.append(
            {
                "step": k,
                "step_time_s": statistics.fmean(it.window_s for it in steps[k]),
                "breakdown_s": seconds,
                "fractions": fractions_of(seconds),
            }
        )
    return out


def classify(fractions: dict[str, float]) -> tuple[str, str]:
    """The bound and a one-line reason; the rule is documented in jaxdist/inspect/profile_report.py."""
    c = fractions["compute"] + fractions["communication_overlapped"]
    x = fractions["communication_exposed"]
    d = fractions["data_wait"]
    i = fractions["idle"]
    if d >= BOUND_MIN_SHARE and d >= max(c, x, i):
        return "data", f"data wait {d:.0%} of the step is its largest share"
    if i >= BOUND_MIN_SHARE and i >= max(c, x, d):
        return "host", f"devices idle {i:.0%} of the step (not waiting for data): the host does not keep them fed"
    if x > c:
        return "communication", f"exposed communication {x:.0%} > compute {c:.0%}"
    return "compute", f"compute {c:.0%} >= exposed communication {x:.0%}; data {d:.0%}, idle {i:.0%}"


def host_phases(traces: list[ProcessTrace]) -> dict[str, float]:
    """Mean seconds per step the host spent in each jaxdist/<phase> annotation; "other" is
    the rest of the train_step span (Python between phases)."""
    totals: dict[str, float] = defaultdict(float)
    n = 0
    for trace in traces:
        for lo, hi in trace.steps.values():
            n += 1
            inside = 0.0
            for phase, ivs in trace.phases.items():
                t = length(clip(merge(ivs), lo, hi))
                totals[phase] += t
                inside += t
            totals["other"] += max(0.0, (hi - lo) - inside)
    names = [p for p in PHASES if p in totals] + sorted(p for p in totals if p not in PHASES and p != "other") + ["other"]
    return {p: totals[p] / max(n, 1) for p in names}


def top_ops(traces: list[ProcessTrace], n_device_steps: int) -> list[dict[str, Any]]:
    totals: dict[tuple[str, str, str], list[float]] = defaultdict(lambda: [0.0, 0])
    for trace in traces:
        for ops in trace.devices.values():
            for op in ops:
                if op.step not in (PRE, None):
                    entry = totals[(op.name, op.module, op.kind)]
                    entry[0] += op.end - op.start
                    entry[1] += 1
    grand = sum(t for t, _ in totals.values()) or 1.0
    n = max(n_device_steps, 1)
    ranked = sorted(totals.items(), key=lambda kv: -kv[1][0])[:TOP_OPS]
    return [
        {"name": name, "module": module, "kind": kind, "time_s": t / n, "share": t / grand, "count": c / n}
        for (name, module, kind), (t, c) in ranked
    ]


def collectives(traces: list[ProcessTrace], items: list[DeviceStep], analysis: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per kind, per device per step: count and time from the trace, bytes from analyze."""
    n = max(len(items), 1)
    count: dict[str, int] = defaultdict(int)
    wait: dict[str, float] = defaultdict(float)
    for trace in traces:
        for ops in trace.devices.values():
            for op in ops:
                if op.kind != "compute" and op.step not in (PRE, None):
                    count[op.kind] += 1
                    wait[op.kind] += op.sync_wait
    timed: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for it in items:
        for kind, (t, exposed) in it.by_kind.items():
            timed[kind][0] += t
            timed[kind][1] += exposed
    planned = analysis.get("collectives") or {}
    kinds = sorted(set(count) | {k for k, v in planned.items() if isinstance(v, dict) and v.get("count")})
    out = {}
    for kind in kinds:
        t, exposed = timed[kind][0] / n, timed[kind][1] / n
        plan = planned.get(kind) or {}
        entry: dict[str, Any] = {"count": count[kind] / n, "time_s": t, "exposed_s": exposed}
        if wait[kind] > 0:
            entry["sync_wait_s"] = wait[kind] / n
        entry["bytes"] = plan.get("bytes")
        if plan.get("wire_bytes") is not None:
            entry["wire_bytes"] = plan["wire_bytes"]
        entry["planned_count"] = plan.get("count")
        entry["achieved_gb_per_s"] = plan["bytes"] / t / 1e9 if plan.get("bytes") and t > 0 else None
        out[kind] = entry
    return out


# --- predicted vs measured ---------------------------------------------------------------


@functools.cache
def host_copy_bandwidth(nbytes: int = 32 * 2**20, repeats: int = 3) -> float:
    """Bytes per second one host memory copy moves (best of ``repeats``): what fake CPU
    devices of one process exchange collective buffers through."""
    src = np.ones(nbytes // 4, np.float32)
    dst = np.empty_like(src)
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best


@functools.cache
def loopback_bandwidth(nbytes: int = 32 * 2**20, chunk: int = 2**20) -> float:
    """Bytes per second a local TCP connection carries: what gloo uses between the
    processes of a CPU run on one machine."""
    server = socket.create_server(("127.0.0.1", 0))
    received = [0]

    def drain() -> None:
        conn, _ = server.accept()
        with conn:
            while received[0] < nbytes and (data := conn.recv(chunk)):
                received[0] += len(data)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    payload = b"\0" * chunk
    with socket.create_connection(server.getsockname()) as client:
        t0 = time.perf_counter()
        for _ in range(nbytes // chunk):
            client.sendall(payload)
        reader.join(timeout=30)
        elapsed = time.perf_counter() - t0
    server.close()
    return received[0] / elapsed if elapsed > 0 else math.inf


def link_bandwidth(platform: str, device_kind: str, hosts: int, processes: int, local_devices: int) -> tuple[float, str]:
    """The bandwidth (bytes/s per device) collectives are predicted at, and where it comes from."""
    if platform == "gpu":
        if hosts > 1:
            return INFINIBAND_BYTES_PER_S, f"InfiniBand NDR ~{INFINIBAND_BYTES_PER_S / 1e9:.0f} GB/s per GPU ({hosts} hosts; table)"
        bw = NVLINK_BYTES_PER_S.get(device_kind, NVLINK_DEFAULT)
        return bw, f"NVLink ~{bw / 1e9:.0f} GB/s per GPU per direction ({device_kind or 'H100-class'}; table)"
    share = max(local_devices, 1)
    if processes > 1:  # gloo over TCP
        bw = loopback_bandwidth()
        return bw / share, f"local TCP (gloo) measured now, {bw / 1e9:.2f} GB/s split over {share} device(s) per process"
    bw = host_copy_bandwidth()
    return bw / share, f"host memory copy measured now, {bw / 1e9:.1f} GB/s split over {share} device(s) of the host"


def predicted(analysis: dict[str, Any], measured: dict[str, float], step_s: float, ctx: dict[str, Any]) -> dict[str, Any]:
    if not analysis:
        return {"available": False, "note": "no profile/analysis.json: nothing to compare with"}
    devices = max(int(analysis.get("devices") or 1), 1)
    peak = _number(analysis.get("peak_flops_per_device"))
    model_flops = (_number(analysis.get("flops_per_step")) or 0.0) / devices
    xla_flops = _number(analysis.get("xla_flops_per_device"))
    flops, source = (xla_flops, "xla") if xla_flops else (model_flops, "model")
    compute_s = flops / peak if peak and flops else None
    bandwidth, bandwidth_source = link_bandwidth(ctx["platform"], ctx["device_kind"], ctx["hosts"], ctx["processes"], ctx["local_devices"])
    comm_bytes = 0.0
    for entry in (analysis.get("collectives") or {}).values():
        if isinstance(entry, dict):
            comm_bytes += float(entry.get("wire_bytes") if entry.get("wire_bytes") is not None else entry.get("bytes") or 0)
    diloco = analysis.get("diloco") or {}
    cross_replica = _number(diloco.get("cross_replica_wire_bytes_per_step")) or 0.0
    comm_bytes += cross_replica  # DiLoCo's outer step, amortised over its H inner steps
    comm_s = comm_bytes / bandwidth
    measured_compute = measured["compute"] + measured["communication_overlapped"]
    measured_comm = measured["communication_exposed"] + measured["communication_overlapped"]
    step_pred = (compute_s or 0.0) + comm_s
    out = {
        "available": True,
        "peak_flops_per_device": peak,
        "flops_per_device": flops,
        "flops_source": source,
        "compute_s": compute_s,
        "measured_compute_s": measured_compute,
        "compute_ratio": _ratio(measured_compute, compute_s),
        "communication_bytes": comm_bytes,
        "bandwidth_bytes_per_s": bandwidth,
        "bandwidth_source": bandwidth_source,
        "communication_s": comm_s,
        "measured_communication_s": measured_comm,
        "communication_ratio": _ratio(measured_comm, comm_s),
        "step_s": step_pred,
        "step_s_full_overlap": max(compute_s or 0.0, comm_s),
        "measured_step_s": step_s,
        "step_ratio": _ratio(step_s, step_pred),
        "mfu": model_flops / step_s / peak if peak and model_flops and step_s > 0 else None,
    }
    if diloco:
        out["cross_replica_bytes_per_step"] = cross_replica
        out["diloco_inner_steps"] = diloco.get("inner_steps")
    return out


def _number(value: Any) -> float | None:
    try:
        x = float(value)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) and x > 0 else None


def _ratio(measured: float, predicted_s: float | None) -> float | None:
    return measured / predicted_s if predicted_s else None


# --- stragglers ---------------------------------------------------------------------------


def stragglers(traces: list[ProcessTrace], items: list[DeviceStep]) -> dict[str, Any]:
    """Each process's mean step window and its "work" (the window less exposed
    communication, which is where a fast process waits for a slow one)."""
    rows = []
    for trace in traces:
        mine = [it for it in items if it.process == trace.index]
        if not mine:
            continue
        walls = [float(v) for k, v in (trace.window.get("step_wall_s") or {}).items() if int(k) in trace.steps]
        rows.append(
            {
                "process": trace.index,
                "host": trace.host,
                "step_time_s": statistics.fmean(it.window_s for it in mine),
                "work_s": statistics.fmean(it.window_s - it.seconds["communication_exposed"] for it in mine),
                "host_step_s": statistics.fmean(walls) if walls else None,
            }
        )
    if not rows:
        return {"processes": []}
    median = statistics.median(r["step_time_s"] for r in rows)
    median_work = statistics.median(r["work_s"] for r in rows)
    slowest = max(rows, key=lambda r: r["step_time_s"])
    most_work = max(rows, key=lambda r: r["work_s"])
    return {
        "processes": rows,
        "median_step_time_s": median,
        "slowest": slowest["process"],
        "slowest_vs_median": slowest["step_time_s"] / median if median > 0 else None,
        "most_work": most_work["process"],
        "most_work_vs_median": most_work["work_s"] / median_work if median_work > 0 else None,
    }
