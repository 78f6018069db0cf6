"""``RUN_DIR/profile/breakdown.png``: the breakdown per traced step (stacked bars) and one
step's timeline per device. Drawn with matplotlib's Agg canvas, so no display and no
change to the process's pyplot backend."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from jaxdist.inspect.bottleneck import CATEGORIES, DeviceStep, intersect

COLORS = {
    "compute": "#4878d0",
    "communication_exposed": "#d65f5f",
    "communication_overlapped": "#ee854a",
    "data_wait": "#6acc64",
    "idle": "#c8c8c8",
}
MAX_ROWS = 16


def write_plot(path: Path, steps: list[dict[str, Any]], items: list[DeviceStep], title: str) -> None:
    step = _typical_step(steps)
    rows = sorted((it for it in items if it.step == step), key=lambda it: (it.process, it.device))[:MAX_ROWS]
    fig = Figure(figsize=(12, 4.5 + 0.28 * len(rows)), layout="constrained")
    FigureCanvasAgg(fig)
    bars, timeline = fig.subplots(2, 1, height_ratios=[3, 1 + 0.25 * len(rows)])

    labels = [str(s["step"]) for s in steps]
    bottom = [0.0] * len(steps)
    for category in CATEGORIES:
        heights = [s["breakdown_s"][category] * 1e3 for s in steps]
        bars.bar(labels, heights, bottom=bottom, color=COLORS[category], label=category.replace("_", " "))
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    bars.set_xlabel("traced step")
    bars.set_ylabel("ms per step (mean over devices)")
    bars.set_title(title)
    bars.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small")

    for row, it in enumerate(rows):

        def rel(ivs: list[tuple[float, float]], it: DeviceStep = it) -> list[tuple[float, float]]:
            return [((s - it.lo) * 1e3, (e - s) * 1e3) for s, e in ivs]

        timeline.broken_barh(rel(it.compute), (row - 0.4, 0.8), color=COLORS["compute"])
        timeline.broken_barh(rel(it.communication), (row - 0.4, 0.8), color=COLORS["communication_exposed"])
        timeline.broken_barh(rel(intersect(it.compute, it.communication)), (row - 0.4, 0.8), color=COLORS["communication_overlapped"])
        timeline.broken_barh(rel(it.data_wait), (row - 0.4, 0.8), color=COLORS["data_wait"])
    timeline.set_yticks(range(len(rows)), [f"p{it.process} dev {it.device}" for it in rows], fontsize="small")
    timeline.set_ylim(len(rows) - 0.5, -0.5)
    timeline.set_xlim(0, max((it.window_s for it in rows), default=0.0) * 1e3 or 1.0)
    timeline.set_xlabel(f"ms since the start of step {step} on each device (colors as above; blank: idle)")
    fig.savefig(path, dpi=110)


def _typical_step(steps: list[dict[str, Any]]) -> int:
    """The step whose time is the median (ties: the later one, past any warm-up)."""
    ranked = sorted(steps, key=lambda s: (s["step_time_s"], s["step"]))
    return ranked[len(ranked) // 2]["step"]
