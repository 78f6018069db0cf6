"""How good is ``jaxdist.plan``'s cost model? Predicted vs measured step times.

    python experiments/plan_validation.py [--cpu] [--gpu] [--plans] [--results DIR] [--write-readme]

- ``--cpu``: every jaxdist point of issue 11's scaling sweep (``experiments/results/scaling/
  results.jsonl``, measured on this host: fake devices and multi-process gloo runs) is
  compiled again from its run's config.yaml and priced with the ``cpu-local`` profile,
  measured now by ``jaxdist.plan.measure``. Prints the ratio per point and the median
  absolute error.
- ``--gpu``: published GPU runs rebuilt as jaxdist configs (model shapes, batch, sequence,
  mesh, remat) and priced with the H100 profiles: predicted vs published.
- ``--plans``: the planner's choice for llama3-8b on 8 H100 and llama3-70b on 64 H100.

Compiles are cached (``~/.cache/jaxdist/plan``); the figures go to stdout, and with
``--write-readme`` into experiments/README.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT))
FAKE_DEVICES = 96  # the largest published mesh rebuilt here (Megatron's 7.1B row)
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={FAKE_DEVICES}".strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

BEGIN, END = "<!-- plan-validation:begin -->", "<!-- plan-validation:end -->"

# Published runs, rebuilt. Sources: NVIDIA JAX-Toolbox docs/frameworks/maxtext/README.md
# (Llama2-7B, 8 x H100 80G SXM, BF16, seq 4096, 2 per GPU, FSDP 8, flash attention,
# remat minimal_flash, 0.721 s/step); torchtitan docs/performance.md (Llama 3.1 8B, 8 x H100
# 96 GB HBM2e at 500 W, FSDP, bf16, local batch 2, seq 8192, selective AC, no compile:
# 5,762 tokens/s/GPU); Megatron-LM README model table (GPT, vocab 131072, seq 4096, H100:
# 1.7B on 48 GPUs DP 48 -> 408.8 TFLOP/s/GPU; 7.1B on 96 GPUs TP 2 x DP 48 -> 465.9).
# GPT's 4d GELU MLP is a SwiGLU of width 8d/3 here (the same matmul FLOPs and parameters); Megatron's
# distributed optimizer (ZeRO-1) is plain data parallelism here: the same gradient bytes per step.
PUBLISHED = [
    {
        "name": "MaxText Llama2-7B, 8 H100",
        "hardware": "h100",
        "overrides": [
            "model.vocab_size=32000", "model.d_model=4096", "model.n_layers=32", "model.n_heads=32", "model.n_kv_heads=32",
            "model.mlp_dim=11008", "model.rope_theta=10000", "train.seq_len=4096", "train.global_batch=16",
            "parallel.mesh=fsdp=8", "model.remat=save_matmuls",
        ],
        "published": {"step_time_s": 0.721},
        "note": "JAX-Toolbox table: 0.721 s/step, 22.19 sequences/s (DESIGN.md quotes 492 TFLOP/s/GPU for MaxText's run)",
    },
    {
        "name": "torchtitan Llama 3.1 8B, 8 H100 (HBM2e, 500 W)",
        "hardware": "h100-hbm2e",
        "overrides": [
            "model.vocab_size=128256", "model.d_model=4096", "model.n_layers=32", "model.n_heads=32", "model.n_kv_heads=8",
            "model.mlp_dim=14336", "model.rope_theta=500000", "train.seq_len=8192", "train.global_batch=16",
            "parallel.mesh=fsdp=8", "model.remat=save_matmuls",
        ],
        "published": {"tokens_per_sec_per_device": 5762},
        "note": "torchtitan table 1: FSDP, no torch.compile",
    },
    {
        "name": "Megatron-LM GPT 1.7B, 48 H100",
        "hardware": "h100",
        "overrides": [
            "model.vocab_size=131072", "model.d_model=2048", "model.n_layers=24", "model.n_heads=16", "model.n_kv_heads=16",
            "model.mlp_dim=5464", "train.seq_len=4096", "train.global_batch=192", "parallel.mesh=data=48",
            "parallel.strategy=dp", "model.remat=save_matmuls",
        ],
        "published": {"tflops_per_device": 408.8},
        "note": "Megatron-LM model table: TP 1, PP 1, DP 48, batch 192, 41% MFU",
    },
    {
        "name": "Megatron-LM GPT 7.1B, 96 H100",
        "hardware": "h100",
        "overrides": [
            "model.vocab_size=131072", "model.d_model=4096", "model.n_layers=30", "model.n_heads=32", "model.n_kv_heads=32",
            "model.mlp_dim=10928", "train.seq_len=4096", "train.global_batch=192", "parallel.mesh=data=48,tensor=2",
            "parallel.strategy=dp", "model.remat=save_matmuls",
        ],
        "published": {"tflops_per_device": 465.9},
        "note": "Megatron-LM model table: TP 2, PP 1, DP 48, batch 192, 47% MFU",
    },
]  # fmt: skip


def priced(config, hardware, gpus_per_node: int | None = None):
    """(prediction, compile summary) of one config on one hardware profile."""
    import dataclasses

    from jaxdist.plan.cost import predict_summary
    from jaxdist.plan.hlo_cost import ProgramCost
    from jaxdist.plan.search import compile_summary

    summary, _ = compile_summary(config)
    if gpus_per_node is not None:
        hardware = dataclasses.replace(hardware, gpus_per_node=gpus_per_node)
    p = predict_summary(ProgramCost.from_dict(summary["program"]), hardware, summary)
    return p, summary


# ---------------------------------------------------------------------------------------------
# This host


def run_name(row: dict) -> str | None:
    found = re.search(r"--run-dir OUT/runs/(\S+)", row.get("command", ""))
    return found.group(1) if found else None


def validate_cpu(results: Path) -> tuple[list[dict], dict]:
    from jaxdist.config import load_config
    from jaxdist.plan.hardware import cpu_local
    from jaxdist.plan.measure import load_or_measure

    profile = load_or_measure()
    hardware = cpu_local(profile)
    rows = [json.loads(line) for line in (results / "results.jsonl").read_text().splitlines() if line.strip()]
    points = []
    for row in rows:
        name = run_name(row)
        if row["framework"] != "jaxdist" or row["status"] != "ok" or name is None:
            continue
        config = load_config(str(results / "runs" / name / "config.yaml"), ["checkpoint.every_steps=0", "train.profile_steps="])
        per_process = row["devices"] // row["processes"]
        p, _ = priced(config, hardware, gpus_per_node=per_process)
        points.append(
            {
                "point": f"{row['kind']} {row['mode']} {row['strategy']} n={row['devices']}",
                "mesh": row["mesh"],
                "measured_s": row["step_time_s"],
                "predicted_s": p.step_time_s,
                "ratio": p.step_time_s / row["step_time_s"],
                "compute_s": p.compute_s,
                "comm_s": p.comm_exposed_s,
            }
        )
        print(
            f"{points[-1]['point']:<34} {row['mesh']:<28} measured {row['step_time_s']:.3f} s  predicted {p.step_time_s:.3f} s  ratio {points[-1]['ratio']:.2f}",
            flush=True,
        )
    return points, profile


def cpu_table(points: list[dict], profile: dict) -> str:
    errors = [abs(p["ratio"] - 1) for p in points]
    by_kind = {k: [abs(p["ratio"] - 1) for p in points if p["point"].startswith(k)] for k in ("fake", "proc")}
    lines = [
        f"cpu-local profile ({profile['host']}, measured {profile['measured_at'][:16]}): fp32 matmul "
        f"{profile['matmul_flops_per_s'] / 1e9:.0f} GFLOP/s, memory {profile['memory_bytes_per_s'] / 1e9:.1f} GB/s, "
        f"gloo all-reduce {profile['collective_latency_s'] * 1e3:.2f} ms + {profile['collective_bytes_per_s'] / 1e9:.2f} GB/s, "
        f"fake-device all-reduce {profile['fake_device_collective_latency_s'] * 1e3:.2f} ms + {profile['fake_device_collective_bytes_per_s'] / 1e9:.1f} GB/s.",
        "",
        f"Median absolute error: **{statistics.median(errors):.0%}** over {len(points)} points "
        f"(fake devices {statistics.median(by_kind['fake']):.0%}, processes {statistics.median(by_kind['proc']):.0%}); "
        f"{sum(e <= 0.25 for e in errors)} of {len(points)} within 25%.",
        "",
        "| point | mesh | measured s | predicted s | predicted / measured |",
        "| --- | --- | --- | --- | --- |",
        *(f"| {p['point']} | {p['mesh']} | {p['measured_s']:.3f} | {p['predicted_s']:.3f} | {p['ratio']:.2f} |" for p in points),
    ]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Published GPU runs


def validate_gpu() -> list[dict]:
    from jaxdist.config import load_config
    from jaxdist.plan.hardware import load_hardware

    out = []
    for run in PUBLISHED:
        config = load_config(None, ["data.source=synthetic", "model.dtype=bfloat16", *run["overrides"]])
        hardware = load_hardware(run["hardware"])
        p, summary = priced(config, hardware)
        devices = math.prod(summary["mesh"].values())
        predicted = {
            "step_time_s": p.step_time_s,
            "tokens_per_sec_per_device": p.tokens_per_sec_per_device,
            "tflops_per_device": summary["model_flops_per_step"] / p.step_time_s / devices / 1e12,
        }
        ((metric, published),) = run["published"].items()
        out.append(
            {
                "name": run["name"],
                "hardware": hardware.name,
                "metric": metric,
                "published": published,
                "predicted": predicted[metric],
                "error": predicted[metric] / published - 1,
                "mfu": p.mfu,
                "bound": p.bound,
                "parts": f"matmul {p.matmul_s:.3f} s, memory {p.memory_s:.3f} s, collectives {p.comm_s:.3f} s ({p.comm_exposed_s:.3f} exposed)",
                "config": " ".join(o for o in run["overrides"]),
                "note": run["note"],
            }
        )
        print(
            f"{run['name']}: {metric} published {published} predicted {predicted[metric]:.3f} ({out[-1]['error']:+.0%}); {out[-1]['parts']}",
            flush=True,
        )
    return out


def gpu_table(rows: list[dict]) -> str:
    lines = [
        "| run | hardware | metric | published | predicted | error | predicted MFU | where the time goes (predicted) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
        *(
            f"| {r['name']} | {r['hardware']} | {r['metric']} | {r['published']:,} | {r['predicted']:,.3f} | {r['error']:+.0%} | {r['mfu']:.0%} | {r['parts']} |"
            for r in rows
        ),
        "",
        "Configurations (jaxdist keys):",
        "",
        *(f"- {r['name']}: `{r['config']}` ({r['note']})" for r in rows),
    ]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# The planner's choices


def plans() -> str:
    import types

    from jaxdist.plan.__main__ import format_table, plan

    lines = []
    for config, gpus in (("llama3-8b", 8), ("llama3-70b", 64)):
        args = types.SimpleNamespace(
            config=config,
            gpus=gpus,
            hardware="h100",
            gpus_per_node=None,
            global_batch=None,
            top=5,
            time_budget=900.0,
            max_compiles=12,
            json=True,
            overrides=[],
        )
        result = plan(args)
        table = format_table(result, 5)
        print(table, flush=True)
        lines += ["```", table, "```", ""]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true")
    parser.add_argument("--gpu", action="store_true")
    parser.add_argument("--plans", action="store_true")
    parser.add_argument("--results", type=Path, default=HERE / "results" / "scaling")
    parser.add_argument("--write-readme", action="store_true")
    args = parser.parse_args()
    if not (args.cpu or args.gpu or args.plans):
        args.cpu = args.gpu = args.plans = True
    sections = []
    if args.cpu:
        points, profile = validate_cpu(args.results)
        sections += ["#### This host: the scaling sweep's CPU points", "", cpu_table(points, profile), ""]
    if args.gpu:
        sections += ["#### Published GPU runs, rebuilt as jaxdist configs", "", gpu_table(validate_gpu()), ""]
    if args.plans:
        sections += ["#### The planner's choices (H100)", "", plans()]
    text = "\n".join(sections)
    print(text)
    if args.write_readme:
        from compression_bench import write_readme

        write_readme(text, BEGIN, END)
    return 0


if __name__ == "__main__":
    sys.exit(main())
