"""Read the trace one process wrote into ``RUN_DIR/profile/process_<i>/``.

The reader is JAX's own ``jax.profiler.ProfileData`` (the XSpace protobuf behind
TensorBoard's profile plugin / XProf, parsed by jaxlib's C++ code): it ships with jax,
needs no extra package, and gives the raw events with their stats (``hlo_op``,
``run_id``, ``step_num``...). No hand-written protobuf parsing happens here.

What is taken from a trace (timestamps are the trace's own clock, in seconds):
- host plane ``/host:CPU``: the ``train_step`` annotations (stat ``step_num``), the
  ``jaxdist/<phase>`` annotations, and the dispatch events
  (``...Executable::Execute`` with stat ``run_id``; on GPU the CUPTI launch events with
  ``correlation_id``);
- device ops: on CPU the XLA op events on the host plane (stats ``hlo_op``,
  ``device_ordinal``, ``run_id``); on GPU the ``/device:GPU:<n>`` planes (kernels with
  ``hlo_op`` from XLA's annotations, or the derived ``XLA Ops`` line where present).
  Ops that contain other ops on the same thread (``while``, ``call``, ``conditional``)
  are dropped: only leaf ops count, so a loop around a collective does not hide it.
"""

from __future__ import annotations

import json
import math
import re
from bisect import bisect_right
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jaxdist.errors import JaxdistError

HOST_PLANE = "/host:CPU"
STEP_EVENT = "train_step"
PHASE_PREFIX = "jaxdist/"
PHASES = ("data", "dispatch", "log", "checkpoint", "eval")
PRE = -1  # an op dispatched before the traced window (still running when tracing began)

# Collective kinds by HLO op name prefix (async forms add -start / -done).
COLLECTIVE_KINDS = (
    "all-reduce",
    "all-gather",
    "reduce-scatter",
    "ragged-all-to-all",
    "all-to-all",
    "collective-permute",
    "collective-broadcast",
    "send",
    "recv",
)
# NCCL kernel names on GPU (ncclDevKernel_AllReduce_Sum_f32_RING_LL, ...).
_NCCL_KINDS = (
    ("AllReduce", "all-reduce"),
    ("AllGather", "all-gather"),
    ("ReduceScatter", "reduce-scatter"),
    ("Broadcast", "collective-broadcast"),
    ("SendRecv", "collective-permute"),
    ("Send", "send"),
    ("Recv", "recv"),
)
_CONTROL_FLOW = re.compile(r"^(while|conditional|call)(\.\d+)?$")
_DISPATCH = "Executable::Execute"


@dataclass
class Op:
    """One leaf XLA op execution on one device."""

    name: str  # the HLO op, e.g. "fusion.12", "all-reduce.3"
    module: str  # e.g. "jit__train_step"
    kind: str  # "compute" or a collective kind ("all-reduce", ...)
    start: float  # seconds on the trace clock
    end: float
    step: int | None = None  # traced step; PRE: dispatched before the window; None: after it
    sync_wait: float = 0.0  # seconds of the op spent waiting for peers to arrive (CPU rendezvous)


@dataclass
class ProcessTrace:
    """What one process's trace says, reduced to what the report needs."""

    index: int
    trace_file: Path
    host: str  # from the trace file name (<host>.xplane.pb)
    window: dict[str, Any]  # window.json ({} when absent)
    steps: dict[int, tuple[float, float]]  # traced step -> host span of its train_step annotation
    phases: dict[str, list[tuple[float, float]]]  # "data", "dispatch", ... -> host intervals
    devices: dict[int, list[Op]] = field(default_factory=dict)  # global device id -> ops sorted by start
    platform: str = "cpu"
    device_kind: str = ""  # GPU model from the device plane, when the trace says


def collective_kind(name: str) -> str | None:
    """The collective kind of an HLO op or NCCL kernel name, or None for compute."""
    base = name.lstrip("%")
    for kind in COLLECTIVE_KINDS:
        if base.startswith(kind) and (len(base) == len(kind) or base[len(kind)] in ".-_"):
            return "all-to-all" if kind == "ragged-all-to-all" else kind
    if "nccl" in base.lower():
        for marker, kind in _NCCL_KINDS:
            if marker in base:
                return kind
        return "all-reduce"
    return None


def find_traces(run_dir: Path) -> list[tuple[int, Path, Path]]:
    """(process index, process directory, newest .xplane.pb) for every process that traced."""
    if not run_dir.is_dir():
        raise JaxdistError(f"run directory {run_dir} does not exist")
    profile = run_dir / "profile"
    found = []
    for proc_dir in sorted(profile.glob("process_*")) if profile.is_dir() else []:
        match = re.fullmatch(r"process_(\d+)", proc_dir.name)
        files = sorted(proc_dir.glob("plugins/profile/*/*.xplane.pb"), key=lambda p: (p.parent.name, p.name))
        if match and files:
            found.append((int(match[1]), proc_dir, files[-1]))
    if not found:
        raise JaxdistError(f"no trace in {profile} (capture one with: python -m jaxdist.train ... --profile-steps A:B)")
    return sorted(found)


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object from ``path``; {} when the file is absent, JaxdistError when unreadable."""
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise JaxdistError(f"cannot read {path}: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    if not isinstance(value, dict):
        raise JaxdistError(f"{path}: expected a JSON object")
    return value


def read_process(index: int, proc_dir: Path, trace_file: Path) -> ProcessTrace:
    """Parse one process's trace (and its window.json) into a ProcessTrace."""
    from jax.profiler import ProfileData  # here: the profile command imports this module, and no JAX at its start

    window = read_json(proc_dir / "window.json")
    try:
        data = ProfileData.from_file(str(trace_file))
    except Exception as e:  # jaxlib raises RuntimeError subclasses for unreadable files
        raise JaxdistError(f"cannot read trace {trace_file}: {(str(e).splitlines() or [type(e).__name__])[0]}") from None
    host = data.find_plane_with_name(HOST_PLANE)
    if host is None:
        raise JaxdistError(f"trace {trace_file} has no {HOST_PLANE} plane: not a jax.profiler trace")

    steps: dict[int, tuple[float, float]] = {}
    phases: dict[str, list[tuple[float, float]]] = defaultdict(list)
    dispatch: dict[int, float] = {}  # run_id -> first host dispatch time
    launch: dict[int, float] = {}  # CUPTI correlation id -> host launch time
    raw: list[tuple[dict[str, Any], Op, int | None]] = []  # (stats, op, raw device) for every leaf op
    for line in host.lines:
        line_ops: list[tuple[dict[str, Any], Op]] = []
        waits: list[tuple[float, float]] = []
        for ev in line.events:
            name = ev.name
            start, end = ev.start_ns * 1e-9, ev.end_ns * 1e-9
            if name == STEP_EVENT:
                k = dict(ev.stats).get("step_num")
                if k is not None and int(k) not in steps:
                    steps[int(k)] = (start, end)
            elif name.startswith(PHASE_PREFIX):
                phases[name[len(PHASE_PREFIX) :]].append((start, end))
            elif name.startswith("Wait: pending_threads"):
                waits.append((start, end))
            else:
                stats = dict(ev.stats)
                if "correlation_id" in stats:  # a GPU launch (it may carry hlo_op too: not a device op)
                    cid = int(stats["correlation_id"])
                    launch[cid] = min(start, launch.get(cid, math.inf))
                elif "hlo_op" in stats and "device_ordinal" in stats:  # an XLA:CPU op
                    line_ops.append((stats, _make_op(str(stats["hlo_op"]), stats, start, end)))
                elif "run_id" in stats and _DISPATCH in name and not name.startswith("["):
                    run_id = int(stats["run_id"])
                    dispatch[run_id] = min(start, dispatch.get(run_id, math.inf))
        for stats, op in _leaves(line_ops, waits):
            raw.append((stats, op, _int(stats.get("device_ordinal"))))

    platform, device_kind = "cpu", ""
    for plane in data.planes:
        match = re.fullmatch(r"/device:([A-Z]+):(\d+)", plane.name)
        if not match:
            continue
        platform = match[1].lower()
        device_kind = device_kind or _device_kind(plane)
        lines = list(plane.lines)
        derived = [ln for ln in lines if ln.name == "XLA Ops"]
        for line in derived or lines:
            line_ops = []
            for ev in line.events:
                stats = dict(ev.stats)
                name = str(stats.get("hlo_op") or "")
                if not name and (derived or "nccl" in ev.name.lower()):
                    name = ev.name  # derived XLA Ops events are named by the op
                if name:
                    line_ops.append((stats, _make_op(name, stats, ev.start_ns * 1e-9, ev.end_ns * 1e-9, kernel=ev.name)))
            for stats, op in _leaves(line_ops, []):
                raw.append((stats, op, int(match[2])))

    first, last = window.get("first_step"), window.get("last_step")
    if first is not None and last is not None:
        steps = {k: v for k, v in steps.items() if int(first) <= k <= int(last)}
    if not steps:
        raise JaxdistError(f"trace {trace_file} has no '{STEP_EVENT}' step annotations for the traced steps")
    trace = ProcessTrace(index, trace_file, trace_file.name.removesuffix(".xplane.pb"), window, dict(sorted(steps.items())), dict(phases))
    trace.platform = str(window.get("platform") or platform)
    trace.device_kind = device_kind
    _assign_steps(trace, raw, dispatch, launch)
    return trace


def _make_op(name: str, stats: dict[str, Any], start: float, end: float, kernel: str = "") -> Op:
    kind = collective_kind(name) or (collective_kind(kernel) if kernel else None) or "compute"
    return Op(name, str(stats.get("hlo_module", "")), kind, start, end)


def _int(value: Any) -> int | None:
    return None if value is None else int(value)


def _device_kind(plane: Any) -> str:
    for _, value in plane.stats:
        text = str(value)
        for kind in ("B200", "H200", "H100", "A100", "V100", "L40", "A10"):
            if kind in text:
                return kind
    return ""


def _leaves(line_ops: list[tuple[dict[str, Any], Op]], waits: list[tuple[float, float]]) -> list[tuple[dict[str, Any], Op]]:
    """The ops of one thread that contain no other op, with the rendezvous waits inside them."""
    line_ops.sort(key=lambda so: (so[1].start, -so[1].end))
    container = [False] * len(line_ops)
    stack: list[int] = []
    for i, (_, op) in enumerate(line_ops):
        while stack and line_ops[stack[-1]][1].end <= op.start:
            stack.pop()
        if stack and op.end <= line_ops[stack[-1]][1].end:
            container[stack[-1]] = True
        stack.append(i)
    leaves = [so for so, c in zip(line_ops, container, strict=True) if not c and not _CONTROL_FLOW.match(so[1].name)]
    starts = [op.start for _, op in leaves]
    for start, end in waits:
        i = bisect_right(starts, start) - 1
        if i >= 0 and leaves[i][1].kind != "compute" and end <= leaves[i][1].end:
            leaves[i][1].sync_wait += end - start
    return leaves


def _global_id(raw: int, local_ids: list[int]) -> int:
    """CPU traces name devices by global id; GPU planes by local ordinal."""
    if raw in local_ids or not 0 <= raw < len(local_ids):
        return raw
    return local_ids[raw]


def _assign_steps(
    trace: ProcessTrace, raw: list[tuple[dict[str, Any], Op, int | None]], dispatch: dict[int, float], launch: dict[int, float]
) -> None:
    """Give every op the traced step whose host span saw it dispatched.

    Dispatch time: the host ``Execute`` event with the op's ``run_id`` (CPU), else the
    host launch with its ``correlation_id`` (GPU), else (no ids at all) the op's own start.
    An id with no host event was dispatched before tracing began (PRE)."""
    ks = list(trace.steps)
    starts = [trace.steps[k][0] for k in ks]
    last_end = trace.steps[ks[-1]][1]

    def step_of(t: float) -> int | None:
        if t < starts[0]:
            return PRE
        if t > last_end:
            return None
        return ks[bisect_right(starts, t) - 1]

    def dispatched(stats: dict[str, Any], op: Op) -> float:
        if "run_id" in stats:
            return dispatch.get(int(stats["run_id"]), -math.inf)
        if "correlation_id" in stats:
            return launch.get(int(stats["correlation_id"]), -math.inf)
        return op.start

    for stats, op, _ in raw:
        op.step = step_of(dispatched(stats, op))
    if raw and not any(op.step not in (PRE, None) for _, op, _ in raw):
        for _, op, _ in raw:  # ids present but never matched on the host: fall back to op times
            op.step = step_of(op.start)

    local_ids = [int(d) for d in trace.window.get("local_device_ids") or []]
    devices: dict[int, list[Op]] = defaultdict(list)
    for _, op, device in raw:
        devices[_global_id(device if device is not None else 0, local_ids)].append(op)
    trace.devices = {d: sorted(ops, key=lambda o: o.start) for d, ops in sorted(devices.items())}
