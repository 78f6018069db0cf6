"""Goodput: where a run's wall time went, from the first process start to the end, across
restarts and in-process recoveries, read from the run's own records (nothing estimated).

The sources, all in the run directory:

- ``metrics.jsonl``, written by process 0: each log window's line carries its end
  (``wall_time``), its steps (``window_steps``), their mean time and data wait; a
  ``goodput_span`` line for each start-up (from the process's creation to its first restore),
  restore, compile, evaluation and blocking part of a checkpoint save.
- ``elastic.jsonl``, written by the launcher and process 0: when the run started, and each
  in-process recovery or rejoin with the seconds of its phases.

``account`` sorts them into shares of the wall time. A window whose steps a later window
trains again (a restart from an earlier checkpoint) is ``retrained``; the time between the
last record of a set that failed and the next set's processes starting is ``lost`` (the
failed steps in flight, the launcher noticing, stopping the others and starting again); the
other stretches between records are named by where they lie (``account``). What no record
explains is ``idle``. ``goodput`` is the productive step time over the wall time.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

log = logging.getLogger(__name__)

SPANS = ("startup", "restore", "compile", "eval", "checkpoint")
# a set's start-up is two spans: process creation to the restore ("startup", one per process set)
# and the restore to the compile ("setup": state, data, first batch), both counted as start-up
FILE = "goodput.json"
# in-process records' phases (elastic.jsonl ``seconds``): their first step after is a training step
RECOVERY_PHASES = {"in-process": ("detect", "agree", "reshard", "recompile"), "rejoin": ("wait", "broadcast", "recompile")}


def span_record(kind: str, start: float, seconds: float) -> dict:
    """A ``goodput_span`` line's value: ``kind`` (one of SPANS) from ``start`` (epoch seconds)."""
    return {"kind": kind, "start": round(start, 3), "seconds": round(seconds, 4)}


def _lines(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut by a kill
            continue
    return out


def _intervals(run_dir: Path) -> list[dict]:
    """Every timed record as {kind, start, end, (productive, steps, wait)}, by start."""
    out = []
    for record in _lines(run_dir / "metrics.jsonl"):
        span = record.get("goodput_span")
        if isinstance(span, dict):
            out.append({"kind": span["kind"], "start": span["start"], "end": span["start"] + span["seconds"]})
        elif "wall_time" in record and "window_steps" in record:
            n = int(record["window_steps"])
            seconds, wait = record["step_time_s"] * n, record.get("data_wait_s", 0.0) * n
            first = record["step"] - n + 1
            out.append(
                {
                    "kind": "steps",
                    "start": record["wall_time"] - seconds,
                    "end": record["wall_time"],
                    "wait": wait,
                    "steps": (first, record["step"]),
                }
            )
    for record in _lines(run_dir / "elastic.jsonl"):
        phases = RECOVERY_PHASES.get(record.get("reason"))
        if phases and isinstance(record.get("seconds"), dict):
            seconds = record["seconds"]
            spent = sum(seconds.get(p, 0.0) for p in phases)
            end = record["time"] - seconds.get("first_step", 0.0)  # written once the first step after it was done
            out.append({"kind": "recovery" if record["reason"] == "in-process" else "rejoin", "start": end - spent, "end": end})
    return sorted(out, key=lambda x: x["start"])


def run_started(run_dir: Path) -> float | None:
    """When the launcher first started this run (its first ``start`` record), if it did."""
    starts = [r["time"] for r in _lines(run_dir / "elastic.jsonl") if r.get("reason") == "start" and "time" in r]
    return min(starts) if starts else None


def account(run_dir: Path, start: float, end: float) -> dict:
    """``goodput.json``'s content for the run in ``run_dir`` from ``start`` to ``end`` (epoch seconds)."""
    intervals = [x for x in _intervals(run_dir) if x["end"] > start and x["start"] < end]
    # the run's first process may be created a moment before the launcher's start record
    start = min([start, *(x["start"] for x in intervals if x["kind"] == "startup")])
    keys = ("productive", "retrained", "data_wait", "loop_host", *SPANS, "recovery", "rejoin", "lost", "shutdown", "idle")
    seconds = dict.fromkeys(keys, 0.0)
    windows = [x for x in intervals if x["kind"] == "steps"]
    steps = {"productive": 0, "retrained": 0}
    for i, window in enumerate(windows):
        window["key"] = "retrained" if any(later["steps"][0] <= window["steps"][1] for later in windows[i + 1 :]) else "productive"
        steps[window["key"]] += window["steps"][1] - window["steps"][0] + 1
    # One pass in time: each record counts for the part of it no earlier record covered (the
    # shares partition the wall time). What lies between records is named by where it lies:
    # before a set's processes start, lost to the restart (the first set's: its launch); before
    # a recovery or rejoin, part of it (the failed step, unwinding, the exchange before its
    # timed phases); between records of the training loop, the loop's own host work (metrics,
    # logging, the data iterator); after the last step, shutdown (final waits, processes leaving).
    last_step_end = max((w["end"] for w in windows), default=start)
    loop_kinds = ("steps", "eval", "checkpoint")
    first_startup = next((x for x in intervals if x["kind"] == "startup"), None)
    reached, previous = start, None
    for x in intervals:
        if x["start"] > reached:
            gap, kind = x["start"] - reached, "idle"
            if x["kind"] == "startup":
                kind = "startup" if x is first_startup else "lost"
            elif x["kind"] in ("recovery", "rejoin"):
                kind = x["kind"]
            elif reached >= last_step_end:
                kind = "shutdown"
            elif x["kind"] in loop_kinds and previous in (*loop_kinds, "setup", "compile", "recovery", "rejoin"):
                kind = "loop_host"
            seconds[kind] += gap
        covered = max(0.0, min(x["end"], end) - max(x["start"], reached))
        if x["kind"] == "steps":
            wait = min(x["wait"], covered)
            seconds["data_wait"] += wait
            seconds[x["key"]] += covered - wait
        else:
            seconds["startup" if x["kind"] == "setup" else x["kind"]] += covered
        reached, previous = max(reached, min(x["end"], end)), x["kind"]
    seconds["shutdown"] += max(0.0, end - reached)
    wall = end - start
    return {
        "goodput": seconds["productive"] / wall if wall > 0 else 0.0,
        "wall_s": round(wall, 3),
        "seconds": {k: round(v, 3) for k, v in seconds.items()},
        "shares": {k: round(v / wall, 4) if wall > 0 else 0.0 for k, v in seconds.items()},
        "steps": steps,
        "restarts": max(0, sum(x["kind"] == "startup" for x in intervals) - 1),
        "recoveries": sum(x["kind"] == "recovery" for x in intervals),
    }


def summary_line(result: dict) -> str:
    """The run's one line: goodput and the shares that took time, largest first."""
    shares = sorted(((k, v) for k, v in result["shares"].items() if k != "productive" and v >= 0.005), key=lambda kv: -kv[1])
    rest = ", ".join(f"{k.replace('_', ' ')} {v:.0%}" for k, v in shares)
    return f"goodput {result['goodput']:.0%} of {result['wall_s']:.1f}s" + (f" ({rest})" if rest else "") + f"; {FILE} has every share"


def write(run_dir: Path, start: float, end: float) -> dict | None:
    """Account the run, write ``RUN_DIR/goodput.json`` and say its line; None (and one line) when it cannot."""
    try:
        result = account(run_dir, start, end)
        (run_dir / FILE).write_text(json.dumps(result, indent=1) + "\n")
    except (OSError, KeyError, TypeError, ValueError) as e:
        log.warning(f"no {FILE} for this run ({type(e).__name__}: {e})")
        return None
    log.info(summary_line(result))
    return result
