"""Dense vs MoE at equal active parameters, and the MoE over expert parallelism 1/2/4/8, on 8
fake CPU devices: tokens/s, memory per device, and the all-to-all share of the step.

    python experiments/moe_bench.py [--steps 16] [--profile 10:13] [--eps 1,2,4,8]
        [--plot experiments/figures/moe_bench.png] [--json PATH]

Every case trains the same decoder (``MODEL``: d_model 64, 2 layers, batch 16 x 64, fp32) on
all 8 devices in one process, one after the other, with the same data:

- ``dense``: a SwiGLU MLP of width k x moe_mlp_dim (128), so it has the MoE's active parameters;
- ``moe ep=E``: 8 experts of width 64, top-2, dropless, mesh ``data=8/E,expert=E``
  (``parallel.expert_buffer_factor=2``: twice the even share per destination, counted overflow).

tokens/s is the median of the steps after the first two (metrics.jsonl's ``step_time_s``);
memory per device the compiled step's total (``profile/analysis.json``, what
``python -m jaxdist.analyze`` reports); the all-to-all share the traced steps' all-to-all time
over the step time (``jaxdist.inspect.profile_report.summarize``, what ``python -m jaxdist.profile``
prints). Fake devices share the host's cores, and XLA:CPU runs ``ragged_dot`` as a dense
product over every local expert (E/ep times the expert FLOPs), so read the ratios measured side
by side here, not absolutes, and not a GPU's speed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEVICES = 8
if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={DEVICES}".strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

from jaxdist.config import load_config  # noqa: E402
from jaxdist.layout.mesh import parse_mesh  # noqa: E402

MIB = 2**20
MODEL = [
    "data.source=synthetic",
    "model.vocab_size=256",
    "model.d_model=64",
    "model.n_layers=2",
    "model.n_heads=8",
    "model.n_kv_heads=4",
    "model.dtype=float32",
    "train.global_batch=16",
    "train.seq_len=64",
    "train.log_every=1",
    "checkpoint.every_steps=0",
]
EXPERTS, TOP_K, EXPERT_WIDTH = 8, 2, 64
MOE = [f"model.moe_experts={EXPERTS}", f"model.moe_top_k={TOP_K}", f"model.moe_mlp_dim={EXPERT_WIDTH}", "parallel.expert_buffer_factor=2"]
DENSE = [f"model.mlp_dim={TOP_K * EXPERT_WIDTH}"]


def host_line() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return (
        f"host: {cpu}, {cores} cores usable ({os.cpu_count()} online); jax {jax.__version__}, {jax.device_count()} fake "
        f"{jax.devices()[0].platform} devices in one process sharing those cores (one XLA:CPU thread pool); "
        f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}; OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}"
    )


def cases(eps: list[int]) -> list[tuple[str, str, list[str]]]:
    out = [("dense", f"data={DEVICES}", DENSE)]
    return out + [(f"moe ep={ep}", f"data={DEVICES // ep},expert={ep}" if ep < DEVICES else f"expert={ep}", MOE) for ep in eps]


def measure(name: str, mesh: str, extra: list[str], steps: int, window: str, root: Path) -> dict:
    from jaxdist.inspect.profile_report import summarize
    from jaxdist.models.counts import count_params
    from jaxdist.training.run import run

    config = load_config(None, [*MODEL, *extra, f"train.steps={steps}", f"train.profile_steps={window}", f"parallel.mesh={mesh}"])
    run_dir = root / name.replace(" ", "_").replace("=", "")
    sizes = parse_mesh(mesh)
    run(config, sizes, run_dir, devices=jax.devices()[:DEVICES], progress=False)
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    times = [r["step_time_s"] for r in lines if "step_time_s" in r and r.get("step", 0) > 2]
    step_s = statistics.median(times)
    analysis = json.loads((run_dir / "profile" / "analysis.json").read_text())
    summary = summarize(run_dir, write=False)
    a2a = summary["collectives"].get("all-to-all", {})
    comm = sum(entry.get("time_s", 0.0) for entry in summary["collectives"].values())
    traced = summary["step_time_s"]
    return {
        "case": name,
        "mesh": mesh,
        "params": count_params(config.model),
        "active_params": count_params(config.model, active=True),
        "step_time_s": step_s,
        "tokens_per_sec": config.train.global_batch * config.train.seq_len / step_s,
        "memory_per_device_bytes": analysis["memory_per_device_bytes"]["total"],
        "all_to_all_bytes": analysis["collectives"]["all-to-all"]["bytes"],
        "traced_step_s": traced,
        "all_to_all_s": a2a.get("time_s", 0.0),
        "all_to_all_share": a2a.get("time_s", 0.0) / traced if traced else 0.0,
        "communication_share": comm / traced if traced else 0.0,
        "bound": summary["bound"],
        "moe_dropped_fraction": next((r["moe_dropped_fraction"] for r in reversed(lines) if "moe_dropped_fraction" in r), None),
    }


def table(rows: list[dict]) -> str:
    dense = rows[0]
    lines = [
        "| case | mesh | params (active) | tokens/s | vs dense | memory/device MiB | all-to-all MiB/step | all-to-all share | all collectives share | dropped |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        dropped = "—" if r["moe_dropped_fraction"] is None else f"{r['moe_dropped_fraction']:.3f}"
        lines.append(
            f"| {r['case']} | `{r['mesh']}` | {r['params']:,} ({r['active_params']:,}) | {r['tokens_per_sec']:,.0f} | "
            f"{r['tokens_per_sec'] / dense['tokens_per_sec']:.2f} | {r['memory_per_device_bytes'] / MIB:.2f} | "
            f"{r['all_to_all_bytes'] / MIB:.2f} | {r['all_to_all_share']:.1%} | {r['communication_share']:.1%} | {dropped} |"
        )
    return "\n".join(lines)


def plot(rows: list[dict], path: Path, host: str) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(12, 4), layout="constrained")
    FigureCanvasAgg(fig)
    speed, memory, share = fig.subplots(1, 3)
    labels = [r["case"] for r in rows]
    colors = ["#8c8c8c"] + ["#4878d0"] * (len(rows) - 1)
    speed.bar(labels, [r["tokens_per_sec"] for r in rows], color=colors)
    speed.set_ylabel("tokens/s (median step)")
    memory.bar(labels, [r["memory_per_device_bytes"] / MIB for r in rows], color=colors)
    memory.set_ylabel("memory per device, MiB (compiled)")
    share.bar(labels, [100 * r["all_to_all_share"] for r in rows], color="#d65f5f", label="all-to-all")
    share.bar(labels, [100 * (r["communication_share"] - r["all_to_all_share"]) for r in rows],
              bottom=[100 * r["all_to_all_share"] for r in rows], color="#ee854a", label="other collectives")  # fmt: skip
    share.set_ylabel("% of the traced step")
    share.legend(fontsize="small")
    for ax in (speed, memory, share):
        ax.tick_params(axis="x", rotation=30)
    fig.suptitle(f"dense vs MoE (8 experts, top-2) at equal active parameters, {DEVICES} fake CPU devices\n{host[:150]}", fontsize="small")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--profile", default="10:13", help="traced steps A:B (the profile report's window)")
    parser.add_argument("--eps", default="1,2,4,8", help="expert-parallel sizes (each divides 8)")
    parser.add_argument("--plot", default=str(HERE / "figures" / "moe_bench.png"))
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    eps = [int(e) for e in args.eps.split(",") if e]
    if any(e < 1 or DEVICES % e or EXPERTS % e for e in eps):
        print(f"jaxdist: error: --eps {args.eps}: each must divide {DEVICES} devices and {EXPERTS} experts", file=sys.stderr)
        return 2
    host = host_line()
    print(host, flush=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="moe-bench-") as root:
        for name, mesh, extra in cases(eps):
            rows.append(measure(name, mesh, extra, args.steps, args.profile, Path(root)))
            print(f"{name}: {rows[-1]['tokens_per_sec']:,.0f} tokens/s", flush=True)
    print(table(rows))
    if args.plot:
        plot(rows, Path(args.plot), host)
        print(f"figure: {args.plot}")
    if args.json:
        Path(args.json).write_text(json.dumps({"host": host, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
