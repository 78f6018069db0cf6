"""Figures for ``experiments/scaling.py --plots`` (matplotlib, Agg): PNGs from results.jsonl lines.

- ``scaling_throughput.png``: tokens/s vs devices, one line per (framework, strategy), one
  panel per (mode, kind);
- ``scaling_efficiency.png``: scaling efficiency vs devices, same panels, 1.0 drawn;
- ``scaling_memory.png``: model states per device vs devices, measured points per strategy
  (one panel per mode; jaxdist: ``jaxdist.analyze``'s arguments, i.e. weights + Adam moments
  as sharded; PyTorch: params + grads + Adam) with formula lines: weights + Adam in fp32
  as run (dashed: 12P, 4P + 8P/N, 12P/N) and the ZeRO paper's mixed-precision model states
  (dotted: 16P, 4P + 12P/N, 2P + 14P/N, 16P/N);
- ``scaling_comm.png``: bytes each device sends per step vs devices (``jaxdist.analyze``'s
  wire bytes), with the DP reference 2(N-1)/N x 4P (a ring all-reduce of fp32 gradients).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from scaling_analytic import ZERO_PAPER, ZERO_STATES_FP32  # noqa: E402

SINGLE = "single"
ORDER = ("dp", "zero1", "fsdp", "tp", "pipe-1f1b", "pipe-gpipe", "dp+tp", "fsdp+tp", "3d")


def _ok(r: dict) -> bool:
    return r.get("status") == "ok" and isinstance(r.get("step_time_s"), int | float)


def _family(fw: str) -> str:
    return "pytorch" if fw.startswith("pytorch") else fw


def series(rows: list[dict], value: str, mode: str, kind: str | None) -> dict[tuple[str, str], list[tuple[int, float]]]:
    """(framework, strategy) -> sorted (devices, value) for one panel; the 1-device ``single``
    line starts the series of every strategy of its framework family."""
    sel = [r for r in rows if r.get("mode") == mode and (kind is None or r.get("kind") == kind) and r.get(value) is not None]
    if value in ("step_time_s", "tokens_per_sec", "efficiency"):
        sel = [r for r in sel if _ok(r)]
    singles = {_family(r["framework"]): r for r in sel if r.get("strategy") == SINGLE}
    out: dict[tuple[str, str], dict[int, float]] = {}
    for r in sel:
        if r.get("strategy") == SINGLE:
            continue
        out.setdefault((r["framework"], r["strategy"]), {})[r["devices"]] = float(r[value])
    for (fw, _), pts in out.items():
        base = singles.get(_family(fw))
        if base is not None:
            pts.setdefault(1, float(base[value]))
    if not out:  # only 1-device runs
        out = {(r["framework"], SINGLE): {1: float(r[value])} for r in singles.values()}
    return {k: sorted(v.items()) for k, v in sorted(out.items(), key=lambda kv: (kv[0][0], _rank(kv[0][1])))}


def _rank(strategy: str) -> tuple:
    return (ORDER.index(strategy), "") if strategy in ORDER else (len(ORDER), strategy)


def _panels(rows: list[dict]) -> list[tuple[str, str]]:
    modes = [m for m in ("strong", "weak") if any(r.get("mode") == m for r in rows)]
    kinds = [k for k in ("fake", "proc") if any(r.get("kind") == k for r in rows)]
    return [(m, k) for m in modes for k in kinds if any(r.get("mode") == m and r.get("kind") == k for r in rows)]


def _style(fw: str) -> dict:
    return {"linestyle": "-" if fw == "jaxdist" else "--", "marker": "o" if fw == "jaxdist" else "s"}


def _grid(n: int):
    import matplotlib.pyplot as plt

    cols = min(n, 2)
    rows = max(1, -(-n // cols))
    fig, axes = plt.subplots(rows, cols, figsize=(6.5 * cols, 4.4 * rows), squeeze=False)
    return fig, [ax for row in axes for ax in row]


def _devices_axis(ax, devices: list[int]) -> None:
    ax.set_xscale("log", base=2)
    ax.set_xticks(devices)
    ax.set_xticklabels([str(d) for d in devices])
    ax.set_xlabel("devices")
    ax.grid(True, alpha=0.3)


def _per_panel(rows: list[dict], value: str, ylabel: str, title: str, path: Path, ideal: float | None = None) -> Path | None:
    import matplotlib.pyplot as plt

    panels = _panels(rows)
    if not panels:
        return None
    fig, axes = _grid(len(panels))
    devices = sorted({r["devices"] for r in rows if r.get("devices")})
    for ax, (mode, kind) in zip(axes, panels, strict=False):
        for (fw, strategy), pts in series(rows, value, mode, kind).items():
            xs, ys = zip(*pts, strict=True)
            ax.plot(xs, ys, label=f"{fw} {strategy}" if fw != "jaxdist" else strategy, **_style(fw))
        if ideal is not None:
            ax.axhline(ideal, color="grey", linewidth=0.8)
        _devices_axis(ax, devices)
        ax.set_ylabel(ylabel)
        ax.set_title(f"{mode} scaling, {kind}")
        ax.legend(fontsize=7, ncol=2)
    for ax in axes[len(panels) :]:
        ax.set_visible(False)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _states(row: dict) -> float | None:
    """Model states per device: jaxdist's step arguments (weights + Adam moments), PyTorch's params + grads + Adam."""
    return row.get("states_bytes_per_device") if row.get("framework") == "jaxdist" else row.get("memory_per_device_bytes")


def _memory(rows: list[dict], path: Path) -> Path | None:
    import matplotlib.pyplot as plt

    rows = [{**r, "states": _states(r)} for r in rows]
    modes = [m for m in ("strong", "weak") if any(r.get("mode") == m and r.get("states") for r in rows)]
    if not modes:
        return None
    fig, axes = _grid(len(modes))
    devices = sorted({r["devices"] for r in rows if r.get("devices")})
    params = sorted({r["params"] for r in rows if r.get("framework") == "jaxdist" and r.get("params")})
    for ax, mode in zip(axes, modes, strict=False):
        for (fw, strategy), pts in series(_one_per_kind(rows), "states", mode, None).items():
            xs, ys = zip(*pts, strict=True)
            ax.plot(xs, [y / 2**20 for y in ys], label=f"{fw} {strategy}" if fw != "jaxdist" else strategy, **_style(fw))
        if len(params) == 1:
            p = params[0]
            xs = devices
            for name, f in ZERO_STATES_FP32.items():
                ax.plot(xs, [f(p, n) / 2**20 for n in xs], color="black", linestyle="--", linewidth=0.8, alpha=0.6)
                ax.annotate(name, (xs[-1], f(p, xs[-1]) / 2**20), fontsize=6, alpha=0.7)
            for name, f in ZERO_PAPER.items():
                ax.plot(xs, [f(p, n) / 2**20 for n in xs], color="grey", linestyle=":", linewidth=0.8)
                ax.annotate(name, (xs[-1], f(p, xs[-1]) / 2**20), fontsize=6, color="grey")
        _devices_axis(ax, devices)
        ax.set_yscale("log")
        ax.set_ylabel("MiB per device")
        ax.set_title(f"{mode} scaling (P = {params[0]:,})" if len(params) == 1 else f"{mode} scaling")
        ax.legend(fontsize=7, ncol=2)
    for ax in axes[len(modes) :]:
        ax.set_visible(False)
    fig.suptitle(
        "model states per device: jaxdist.analyze arguments (fp32 weights + Adam), PyTorch params + grads + Adam;\n"
        "dashed: weights + Adam in fp32 (12P, 4P + 8P/N, 12P/N); dotted: the ZeRO paper's 16P, 4P + 12P/N, 2P + 14P/N, 16P/N",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _one_per_kind(rows: list[dict]) -> list[dict]:
    """Compile-time numbers do not depend on the kind: keep one line per (framework, mode, strategy, devices)."""
    seen, out = set(), []
    for r in sorted(rows, key=lambda r: str(r.get("kind"))):
        key = (r.get("framework"), r.get("mode"), r.get("strategy"), r.get("devices"))
        if key not in seen:
            seen.add(key)
            out.append({**r, "kind": None})
    return out


def _comm(rows: list[dict], path: Path) -> Path | None:
    import matplotlib.pyplot as plt

    modes = [m for m in ("strong", "weak") if any(r.get("mode") == m and r.get("comm_bytes_per_step") is not None for r in rows)]
    if not modes:
        return None
    fig, axes = _grid(len(modes))
    devices = sorted({r["devices"] for r in rows if r.get("devices")})
    params = sorted({r["params"] for r in rows if r.get("framework") == "jaxdist" and r.get("params")})
    for ax, mode in zip(axes, modes, strict=False):
        for (fw, strategy), pts in series(_one_per_kind(rows), "comm_bytes_per_step", mode, None).items():
            pts = [(x, y) for x, y in pts if x > 1]
            if not pts:
                continue
            xs, ys = zip(*pts, strict=True)
            ax.plot(xs, [y / 2**20 for y in ys], label=f"{fw} {strategy}" if fw != "jaxdist" else strategy, **_style(fw))
        if len(params) == 1:
            xs = [n for n in devices if n > 1]
            ys = [2 * (n - 1) / n * 4 * params[0] / 2**20 for n in xs]
            ax.plot(xs, ys, color="black", linestyle="--", linewidth=0.8, label="DP ring all-reduce 2(N-1)/N x 4P")
        _devices_axis(ax, devices)
        ax.set_ylabel("MiB per device per step")
        ax.set_title(f"{mode} scaling")
        ax.legend(fontsize=7, ncol=2)
    for ax in axes[len(modes) :]:
        ax.set_visible(False)
    fig.suptitle("bytes each device sends per step (jaxdist.analyze wire bytes; PyTorch: its payload on a ring)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def draw_all(rows: list[dict], folder: Path) -> list[Path]:
    """Write the four figures into ``folder`` (created); the paths written."""
    import matplotlib

    matplotlib.use("Agg")
    folder.mkdir(parents=True, exist_ok=True)
    made = [
        _per_panel(rows, "tokens_per_sec", "tokens / s", "throughput vs devices", folder / "scaling_throughput.png"),
        _per_panel(
            rows, "efficiency", "efficiency", "scaling efficiency (strong t1/(N tN), weak t1/tN)", folder / "scaling_efficiency.png", 1.0
        ),
        _memory(rows, folder / "scaling_memory.png"),
        _comm(rows, folder / "scaling_comm.png"),
    ]
    return [p for p in made if p is not None]
