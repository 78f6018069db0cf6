"""The bottleneck report of a traced run: where each traced step's time went.

Reads the traces ``python -m jaxdist.train --profile-steps A:B`` wrote into
``RUN_DIR/profile/process_<i>/`` (one per process, with ``window.json``) and process 0's
``RUN_DIR/profile/analysis.json`` (what ``jaxdist.analyze`` expects of the step), and
reports, per traced step and averaged: ``breakdown_s`` and ``fractions``, ``bound``,
``top_ops``, ``collectives``, ``predicted``, ``stragglers``, ``advice``, and the whole run's
``goodput`` (``RUN_DIR/goodput.json``, written when the run ends; None before). ``summarize``
writes ``RUN_DIR/profile/summary.json`` (what it returns) and
``RUN_DIR/profile/breakdown.png`` itself; the training loop calls it at the end of the
traced window, ``python -m jaxdist.profile`` recomputes both (``format_summary`` is its table).

Reader: ``jax.profiler.ProfileData`` (jaxlib's C++ XSpace reader, the format TensorBoard's
profile plugin and XProf open): it ships with jax, so no extra dependency and no
hand-written protobuf parsing; it gives raw events with their stats (``hlo_op``,
``run_id``, ``step_num``), which is all the breakdown needs. See
``jaxdist/inspect/trace_reader.py`` for what is read from which plane.

Definitions (per process, per device, per traced step k; seconds on that process's trace clock):

- op: a leaf XLA op execution on the device (ops that contain others, like ``while``,
  are dropped). Collectives (``all-reduce``, ``all-gather``, ``reduce-scatter``,
  ``all-to-all``, ``collective-permute``, send/recv, their -start/-done forms, NCCL
  kernels) are communication; every other op is compute. One device may run several
  ops at once (CPU threads, GPU streams): times are unions of intervals, never sums.
- step k's ops: the ops of every execution the host dispatched inside step k's
  ``train_step`` annotation (matched by ``run_id`` on CPU, by CUPTI ``correlation_id``
  on GPU), so a loop that dispatches ahead still charges each execution to its step.
- step window on device d: from the end of d's last op of step k-1 to the end of d's
  last op of step k. The first traced step starts at the host's ``train_step``
  annotation (or when d finished work dispatched before the window, if later). So each
  window holds the wait for its own batch and its own device work, and the windows tile
  the device timeline. ``step_time_s`` is the mean window.
- compute: time some compute op runs and no collective does.
- communication_overlapped: time a collective and a compute op both run (useful work
  goes on: it is compute time too).
- communication_exposed: time a collective runs and no compute op does.
- data_wait: time the device runs no op while the host is inside a ``jaxdist/data``
  annotation (waiting for the next batch).
- idle: the rest of the window: the device runs nothing and the host is not waiting
  for data (dispatch, logging, checkpointing, Python): host overhead.
  The five are disjoint and sum to the window; ``fractions`` divide each by it.
  Averages: ``breakdown_s`` is the mean over all (device, step) windows of all
  processes, ``fractions`` = summed seconds / summed windows.
- bound, from the averaged fractions, with C = compute + communication_overlapped,
  X = communication_exposed, D = data_wait, I = idle:
  ``data`` if D >= 0.25 and D >= max(C, X, I); else ``host`` if I >= 0.25 and
  I >= max(C, X, D); else ``communication`` if X > C; else ``compute``.
- predicted: compute = FLOPs per device (XLA's cost analysis of the compiled step, else
  the model FLOPs / devices) / ``peak_flops_per_device`` (the peak MFU uses);
  communication = collective bytes per device per step (``wire_bytes`` where analyze
  gives them, else ``bytes``) / a bandwidth: on GPU a table (NVLink ~450 GB/s per GPU
  per direction on H100/H200, 300 on A100; InfiniBand NDR ~50 GB/s per GPU when the
  traces come from more than one host); on CPU measured when the report is made: a host
  memory copy for one process (its fake devices exchange buffers through that memory),
  a local TCP stream for several (gloo), split over the devices of a process, which
  share it. Ratios are measured / predicted; on CPU the measured collective time also
  holds the wait for the slowest peer (see ``sync_wait_s``), so expect ratios > 1.
- collectives: per kind and per device per step: ``count``, ``time_s`` (union),
  ``exposed_s``, ``bytes`` (from analyze), ``achieved_gb_per_s`` = bytes / time_s; on
  CPU ``sync_wait_s`` is the part spent waiting for the other devices to arrive.
- stragglers: per process, the mean window (``step_time_s``) and the window less exposed
  communication (``work_s``: a fast process waits for a slow one inside collectives, so
  synchronous processes share a step time and differ in work); slowest vs median of each.
- also: ``steps`` (the breakdown per traced step), ``host_phases_s`` (mean host seconds
  per step in each ``jaxdist/<phase>`` annotation), ``top_ops`` (per device per step,
  share of all op time), ``notes`` (caveats for this run).

On CPU fake devices the devices of a process share its cores: a device waiting for a
core shows as idle, and a collective holds the wait for the slowest device's thread, so
DP over 8 fake devices on 2 cores looks communication-heavy. Compare runs on the same
machine rather than reading absolute shares.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from jaxdist.cluster import goodput
from jaxdist.errors import JaxdistError
from jaxdist.inspect import bottleneck as report
from jaxdist.inspect.advice import advice
from jaxdist.inspect.plot import write_plot
from jaxdist.inspect.trace_reader import find_traces, read_json, read_process

READER = "jax.profiler.ProfileData"


def summarize(run_dir: str | Path, *, write: bool = True) -> dict[str, Any]:
    """The bottleneck report of the traced steps in ``run_dir``; with ``write``, also
    ``RUN_DIR/profile/summary.json`` and ``RUN_DIR/profile/breakdown.png``.

    Raises JaxdistError (one line) when the run directory, its trace or its JSON files
    are missing or unreadable."""
    run_dir = Path(run_dir)
    traces = [read_process(i, d, f) for i, d, f in find_traces(run_dir)]
    count = _process_count(traces)
    if count:  # process_<i> directories left by an earlier run with more processes
        traces = [t for t in traces if t.index < count]
        missing = sorted(set(range(count)) - {t.index for t in traces})
        if missing:
            where = run_dir / "profile" / f"process_{missing[0]}"
            raise JaxdistError(
                f"the traced run had {count} processes, but process {missing[0]}'s trace is missing "
                f"(no {where}/plugins/profile/*/*.xplane.pb)" + (f"; {len(missing) - 1} more missing" if len(missing) > 1 else "")
            )
    analysis = read_json(run_dir / "profile" / "analysis.json")
    items = [it for t in traces for it in report.device_steps(t)]
    if not items:
        raise JaxdistError(f"the trace in {run_dir / 'profile'} has no device ops in the traced steps")

    window = next((t.window for t in traces if t.window), {})
    local_devices = max(len(t.window.get("local_device_ids") or t.devices) for t in traces)
    ctx = {
        "platform": next((t.platform for t in traces), "cpu"),
        "device_kind": next((t.device_kind for t in traces if t.device_kind), ""),
        "hosts": len({t.host for t in traces}),
        "processes": len(traces),
        "local_devices": local_devices,
        "strategy": window.get("strategy") or analysis.get("strategy"),
        "mesh": window.get("mesh") or analysis.get("mesh") or {},
        "config": window.get("config") or {},
        "threads": window.get("threads") or {},
    }
    seconds = report.mean_seconds(items)
    fractions = report.fractions_of(seconds)
    steps = report.per_step(items)
    step_s = sum(seconds.values())
    bound, reason = report.classify(fractions)
    phases = report.host_phases(traces)
    first = min(min(t.steps) for t in traces)
    last = max(max(t.steps) for t in traces)
    summary: dict[str, Any] = {
        "run_dir": str(run_dir),
        "reader": READER,
        "platform": ctx["platform"],
        "strategy": ctx["strategy"],
        "mesh": ctx["mesh"],
        "first_step": first,
        "last_step": last,
        "processes": len(traces),
        "devices": len({(t.index, d) for t in traces for d in t.devices}),
        "step_time_s": step_s,
        "fractions": fractions,
        "breakdown_s": seconds,
        "bound": bound,
        "bound_reason": reason,
        "steps": steps,
        "host_phases_s": phases,
        "top_ops": report.top_ops(traces, len(items)),
        "collectives": report.collectives(traces, items, analysis),
        "predicted": report.predicted(analysis, seconds, step_s, ctx),
        "stragglers": report.stragglers(traces, items),
        "advice": advice(bound, fractions, phases, step_s, ctx),
        "goodput": read_json(run_dir / goodput.FILE) or None,  # the whole run's wall time, where it went (at its end)
        "notes": _notes(traces, items, ctx),
        "traces": [str(t.trace_file) for t in traces],
    }
    summary = _rounded(summary)
    if write:
        profile = run_dir / "profile"
        summary["files"] = {"summary": str(profile / "summary.json"), "plot": None}
        try:
            title = f"{run_dir.name}: steps {first}-{last}, {summary['devices']} devices, bound: {bound}"
            write_plot(profile / "breakdown.png", steps, items, title)
            summary["files"]["plot"] = str(profile / "breakdown.png")
        except OSError as e:
            summary["files"]["note"] = f"could not write breakdown.png: {e.strerror or e}"
        try:
            (profile / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
        except OSError as e:  # a read-only run directory: the report is still printed
            summary["files"] = {"summary": None, "plot": None, "note": f"could not write summary.json: {e.strerror or e}"}
    return summary


def _process_count(traces: list) -> int | None:
    """How many processes the traced run had: process 0's window says (another process's
    when process 0's trace is the one missing); None for traces without window.json."""
    counts = {t.index: t.window.get("process_count") for t in traces if t.window.get("process_count")}
    if not counts:
        return None
    return int(counts.get(0) or max(counts.values()))


def _notes(traces: list, items: list, ctx: dict[str, Any]) -> list[str]:
    """Caveats a reader of this report needs."""
    notes = []
    cores = ctx["threads"].get("cpu_count")
    if ctx["platform"] == "cpu" and cores and ctx["local_devices"] > int(cores):
        notes.append(
            f"{ctx['local_devices']} CPU devices share {cores} cores per process: a device waiting for a core shows as idle, "
            "or inside a collective as communication (sync_wait_s)"
        )
    expected = sum(len(t.devices) * len(t.steps) for t in traces)
    if len(items) < expected:
        notes.append(f"{expected - len(items)} (device, step) pairs ran no op: their time is counted in the next step's window")
    return notes


def _rounded(value: Any) -> Any:
    if isinstance(value, float):
        return float(f"{value:.6g}") if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_rounded(v) for v in value]
    return value


# --- the readable table ---------------------------------------------------------------------


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.2f} ms"


def _x(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.2f}x"


def format_summary(s: dict[str, Any]) -> str:
    lines = [
        f"jaxdist profile: {s['run_dir']}  steps {s['first_step']}-{s['last_step']}, {s['processes']} process(es), "
        f"{s['devices']} device(s), {s['platform']}, strategy {s['strategy']}",
        f"step time {_ms(s['step_time_s'])}   bound: {s['bound'].upper()}  ({s['bound_reason']})",
        "",
        f"{'':26}{'mean/step':>12}{'share':>8}" + "".join(f"{'step ' + str(st['step']):>11}" for st in s["steps"]),
    ]
    for c in report.CATEGORIES:
        row = f"{c.replace('_', ' '):26}{_ms(s['breakdown_s'][c]):>12}{s['fractions'][c]:>8.1%}"
        lines.append(row + "".join(f"{st['fractions'][c]:>11.1%}" for st in s["steps"]))
    lines.append(f"{'step time':26}{_ms(s['step_time_s']):>12}{'':8}" + "".join(f"{_ms(st['step_time_s']):>11}" for st in s["steps"]))
    lines += ["", "host per step: " + ", ".join(f"{k} {_ms(v)}" for k, v in s["host_phases_s"].items())]
    lines += ["", "top ops (per device per step):"]
    for op in s["top_ops"]:
        lines.append(f"  {op['name'][:48]:48} {op['kind']:20} {_ms(op['time_s']):>11} {op['share']:>7.1%}")
    if s["collectives"]:
        lines += ["", "collectives (per device per step):"]
        for kind, c in s["collectives"].items():
            bw = "-" if c["achieved_gb_per_s"] is None else f"{c['achieved_gb_per_s']:.2f} GB/s"
            size = "-" if c["bytes"] is None else f"{c['bytes'] / 2**20:.2f} MiB"
            wait = f", waiting for peers {_ms(c['sync_wait_s'])}" if "sync_wait_s" in c else ""
            lines.append(f"  {kind:20} x{c['count']:<6g} {_ms(c['time_s']):>11} (exposed {_ms(c['exposed_s'])}{wait})  {size:>11}  {bw}")
    p = s["predicted"]
    lines += ["", "predicted vs measured (per device per step):"]
    if p.get("available"):
        lines.append(
            f"  compute        {_ms(p['compute_s']):>11} predicted ({p['flops_source']} FLOPs / peak)  {_ms(p['measured_compute_s']):>11} measured  {_x(p['compute_ratio'])}"
        )
        lines.append(
            f"  communication  {_ms(p['communication_s']):>11} predicted  {_ms(p['measured_communication_s']):>11} measured  {_x(p['communication_ratio'])}"
        )
        lines.append(f"                 at {p['bandwidth_source']}")
        mfu = "-" if p["mfu"] is None else f"{p['mfu']:.1%}"
        lines.append(
            f"  step           {_ms(p['step_s']):>11} predicted (no overlap)  {_ms(p['measured_step_s']):>11} measured  {_x(p['step_ratio'])}   MFU {mfu}"
        )
    else:
        lines.append(f"  {p.get('note')}")
    st = s["stragglers"]
    if len(st.get("processes", [])) > 1:
        lines += ["", "processes:"]
        for r in st["processes"]:
            lines.append(
                f"  process {r['process']} ({r['host']}): step {_ms(r['step_time_s'])}, work {_ms(r['work_s'])}, host step {_ms(r['host_step_s'])}"
            )
        lines.append(
            f"  slowest: process {st['slowest']} at {_x(st['slowest_vs_median'])} the median; most work: process {st['most_work']} at {_x(st['most_work_vs_median'])}"
        )
    lines += [f"note: {n}" for n in s.get("notes", [])]
    good = s.get("goodput")
    lines += [
        "",
        f"the whole run: {goodput.summary_line(good)}" if good else f"the whole run: no {goodput.FILE} yet (written when the run ends)",
    ]
    lines += ["", "try:"]
    lines += [f"  - {a['key']}: {a['action']} ({a['reason']})" for a in s["advice"]]
    files = s.get("files") or {}
    if files.get("summary"):
        lines += ["", f"wrote {files['summary']}" + (f" and {files['plot']}" if files.get("plot") else "")]
    if files.get("note"):
        lines.append(f"note: {files['note']}")
    return "\n".join(lines)
