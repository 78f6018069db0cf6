"""How good is ``jaxdist.plan``'s cost model? Predicted vs measured step times.

    python experiments/plan_validation.py [--cpu] [--gpu] [--plans] [--results DIR] [--write-readme]

- ``--cpu``: every jaxdist point of issue 11's scaling sweep (``experiments/results/scaling/
  results.jsonl``, measured on this host: fake devices and multi-process gloo runs) is
  compiled again from its run's config.yaml and priced with the ``cpu-local`` profile,
  measured now by ``jaxdist.plan.measure``. Prints the ratio per point and the median
  absolute error.
- ``--gpu``: published GPU runs rebuilt as jaxdist configs (model shapes, batch, sequence,
  mesh, remat, fp8), each compiled by XLA:GPU for its target (``plan.gpu_target``: the run's GPU
  count and hosts) and priced from that program (``plan.cost``): predicted vs published, with the
  predicted time by kernel class (where a miss is).
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
FAKE_DEVICES = 8  # the scaling sweep's largest mesh (the published GPU runs compile for their target's devices)
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={FAKE_DEVICES}".strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")  # the CUDA plugin's "no driver" info lines

BEGIN, END = "<!-- plan-validation:begin -->", "<!-- plan-validation:end -->"

# Published runs, rebuilt. Sources: NVIDIA JAX-Toolbox docs/frameworks/maxtext/README.md
# (Llama2-7B, 8 x H100 80G SXM, BF16, seq 4096, 2 per GPU, FSDP 8, flash attention,
# remat minimal_flash, 0.721 s/step); torchtitan docs/performance.md (Llama 3.1 8B, 8 x H100
# 96 GB HBM2e at 500 W, FSDP, bf16, local batch 2, seq 8192, selective AC, no compile:
# 5,762 tokens/s/GPU); Megatron-LM README model table (GPT, vocab 131072, seq 4096, H100:
# 1.7B on 48 GPUs DP 48 -> 408.8 TFLOP/s/GPU; 7.1B on 96 GPUs TP 2 x DP 48 -> 465.9);
# Megatron-Bridge 25.11 docs/performance-summary.md (DGX-H100: LLAMA3_8B, 8 GPUs, FP8-CS, GBS 128,
# MBS 1, seq 8192, FSDP, TP/PP/CP 1, GA 16: 14,451 tokens/s/GPU, 744 model TFLOP/s/GPU; its recipe
# scripts/performance/configs/llama/llama3_workload_base_configs.py recomputes 5 of the 32 layers);
# torchtitan benchmarks/llama3-8b_h200_202506_trainy-whitefiber.md (Llama 3.1 8B, 4 hosts x 8 H200,
# FSDP, local batch 2, seq 8192, float8 with float8 FSDP all-gathers, torch.compile, llama3_8b.toml's
# selective activation checkpointing: 10,938 tokens/s/GPU).
# GPT's 4d GELU MLP is a SwiGLU of width 8d/3 here (the same matmul FLOPs and parameters); Megatron's
# distributed optimizer (ZeRO-1) is plain data parallelism here: the same gradient bytes per step.
# FP8-CS (per-tensor current scaling) is model.fp8=current.
PUBLISHED = [
    {
        "name": "MaxText Llama2-7B, 8 H100",
        "hardware": "h100",
        "overrides": [
            "model.vocab_size=32000", "model.d_model=4096", "model.n_layers=32", "model.n_heads=32", "model.n_kv_heads=32",
            "model.mlp_dim=11008", "model.rope_theta=10000", "train.seq_len=4096", "train.global_batch=16",
            "parallel.mesh=fsdp=8", "model.remat=save_matmuls", "model.scan_layers=false",
        ],
        "published": {"step_time_s": 0.721},
        "note": "JAX-Toolbox table: 0.721 s/step, 22.19 sequences/s (DESIGN.md quotes 492 TFLOP/s/GPU for MaxText's run); "
        "jaxdist's layers in a Python loop (0.707 s in its layer scan)",
    },
    {
        "name": "torchtitan Llama 3.1 8B, 8 H100 (HBM2e, 500 W)",
        "hardware": "h100-hbm2e",
        "overrides": [
            "model.vocab_size=128256", "model.d_model=4096", "model.n_layers=32", "model.n_heads=32", "model.n_kv_heads=8",
            "model.mlp_dim=14336", "model.rope_theta=500000", "train.seq_len=8192", "train.global_batch=16",
            "parallel.mesh=fsdp=8", "model.remat=save_matmuls", "model.scan_layers=false",
        ],
        "published": {"tokens_per_sec_per_device": 5762},
        "note": "torchtitan table 1: FSDP, no torch.compile; jaxdist's layers in a Python loop (8,012 in its layer scan)",
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
    {
        "name": "Megatron-LM GPT 1.7B, 48 H100, jaxdist's layout",
        "hardware": "h100",
        "overrides": [
            "model.vocab_size=131072", "model.d_model=2048", "model.n_layers=24", "model.n_heads=16", "model.n_kv_heads=16",
            "model.mlp_dim=5464", "train.seq_len=4096", "train.global_batch=192", "parallel.mesh=data=6,fsdp=8",
            "model.remat=none",
        ],
        "published": {"tflops_per_device": 408.8},
        "note": "the same job on the layout jaxdist's planner picks for it (python -m jaxdist.plan --gpus 48 --hardware h100 "
        "with these model keys): FSDP within each host, data parallel across the 6; Megatron's own layout is the DP 48 row",
    },
    {
        "name": "Megatron-LM GPT 7.1B, 96 H100, jaxdist's layout",
        "hardware": "h100",
        "overrides": [
            "model.vocab_size=131072", "model.d_model=4096", "model.n_layers=30", "model.n_heads=32", "model.n_kv_heads=32",
            "model.mlp_dim=10928", "train.seq_len=4096", "train.global_batch=192", "parallel.mesh=data=12,fsdp=8",
            "model.remat=save_matmuls", "model.scan_layers=false",
        ],
        "published": {"tflops_per_device": 465.9},
        "note": "the same job on the fastest layout tried: FSDP within each host, data parallel across the 12, the layers in "
        "a Python loop (427.0 in the layer scan); Megatron's own layout is the TP 2 x DP 48 row",
    },
    {
        "name": "Megatron-Bridge Llama3 8B FP8, 8 H100",
        "hardware": "h100",
        "overrides": [
            "model.vocab_size=128256", "model.d_model=4096", "model.n_layers=32", "model.n_heads=32", "model.n_kv_heads=8",
            "model.mlp_dim=14336", "model.rope_theta=500000", "train.seq_len=8192", "train.global_batch=128",
            "train.microbatches=16", "parallel.mesh=fsdp=8", "model.remat=none", "model.fp8=current", "model.fp8_keep_ends=false",
            "model.scan_layers=false",
        ],
        "published": {"tokens_per_sec_per_device": 14451},
        "note": "Megatron-Bridge 25.11 performance summary, DGX-H100: FP8 current scaling, GBS 128, MBS 1, GA 16, FSDP, "
        "744 model TFLOP/s/GPU; its recipe recomputes 5 of 32 layers (none here); every layer in fp8 (Megatron-Core's default); "
        "jaxdist's layers in a Python loop (12,030 in its layer scan)",
    },
    {
        "name": "torchtitan Llama 3.1 8B float8 + compile, 32 H200",
        "hardware": "h200",
        "overrides": [
            "model.vocab_size=128256", "model.d_model=4096", "model.n_layers=32", "model.n_heads=32", "model.n_kv_heads=8",
            "model.mlp_dim=14336", "model.rope_theta=500000", "train.seq_len=8192", "train.global_batch=64",
            "parallel.mesh=fsdp=32", "model.remat=save_matmuls", "model.fp8=current", "model.fp8_keep_ends=false",
        ],
        "published": {"tokens_per_sec_per_device": 10938},
        "note": "torchtitan benchmarks (Trainy, WhiteFiber): 4 nodes x 8 H200, FSDP, local batch 2, float8 (and float8 "
        "FSDP all-gathers), torch.compile, selective activation checkpointing; every layer but the head in fp8 (torchao's default)",
    },
]  # fmt: skip


def priced(config, hardware, gpus_per_node: int | None = None, target=None):
    """(prediction, compile summary) of one config on one hardware profile; ``target``
    (``plan.search.GpuTarget``): compiled by XLA:GPU for it, else against fake CPU devices."""
    import dataclasses

    from jaxdist.plan.cost import predict_summary
    from jaxdist.plan.hlo_cost import ProgramCost
    from jaxdist.plan.search import compile_summary

    summary, _ = compile_summary(config, target=target)
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


KERNEL_CLASSES = {  # the classes a miss is named by: the planner's kernel kinds, grouped
    "GEMM (bf16)": ("gemm", "grouped_gemm"),
    "GEMM (fp8)": ("gemm_fp8",),
    "attention (cuDNN)": ("attention_cudnn_fwd", "attention_cudnn_bwd"),
    "memory-bound fusions": ("triton_fusion", "other_fusion", "copy", "other"),
}


def kernel_classes(p) -> dict[str, float]:
    """Predicted busy seconds per step by kernel class, plus the exposed collectives."""
    kinds = p.kernel_s or {}
    out = {name: sum(kinds.get(k, 0.0) for k in members) for name, members in KERNEL_CLASSES.items()}
    return {name: s for name, s in out.items() if s} | {"exposed collectives": p.comm_exposed_s}


def validate_gpu() -> list[dict]:
    from jaxdist.config import load_config
    from jaxdist.layout.mesh import mesh_device_count, parse_mesh
    from jaxdist.plan.gpu_target import prepare_target
    from jaxdist.plan.hardware import load_hardware
    from jaxdist.plan.search import GpuTarget

    prepare_target()  # the plugin is needed; JAX_PLATFORMS=cpu is already set
    out = []
    for run in PUBLISHED:
        config = load_config(None, ["data.source=synthetic", "model.dtype=bfloat16", *run["overrides"]])
        hardware = load_hardware(run["hardware"])
        gpus = mesh_device_count(parse_mesh(config.parallel.mesh))
        p, summary = priced(config, hardware, target=GpuTarget(hardware, gpus, min(gpus, hardware.gpus_per_node)))
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
                "parts": ", ".join(f"{name} {s:.3f} s" for name, s in kernel_classes(p).items())
                + f" (collectives {p.comm_s:.3f} s in all)",
                "step_time_s": p.step_time_s,
                "peak_gib": summary["memory"]["peak"] / 2**30,
                "kernels": summary["kernels"],
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
    errors = [abs(r["error"]) for r in rows]
    lines = [
        f"Median absolute error **{statistics.median(errors):.0%}** over {len(rows)} runs; "
        f"{sum(e <= 0.15 for e in errors)} of {len(rows)} within 15%.",
        "",
        "| run | hardware | metric | published | predicted | jaxdist predicted / anchor published | error | predicted MFU | XLA:GPU peak "
        "| where a step's time goes (predicted, per device) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        *(
            f"| {r['name']} | {r['hardware']} | {r['metric']} | {r['published']:,} | {_figure(r['predicted'])} "
            f"| {r['predicted'] / r['published']:.2f} | {r['error']:+.0%} "
            f"| {r['mfu']:.0%} | {r['peak_gib']:.1f} GiB | {r['parts']} |"
            for r in rows
        ),
        "",
        "Configurations (jaxdist keys):",
        "",
        *(f"- {r['name']}: `{r['config']}` ({r['note']})" for r in rows),
    ]
    return "\n".join(lines)


def _figure(x: float) -> str:
    return f"{x:,.0f}" if x >= 1000 else f"{x:,.1f}" if x >= 10 else f"{x:.3f}"


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


CPU_HEADING = "#### This host: the scaling sweep's CPU points"
GPU_HEADING = "#### Published GPU runs, rebuilt as jaxdist configs"
PLANS_HEADING = "#### The planner's choices (H100)"
HEADINGS = (CPU_HEADING, GPU_HEADING, PLANS_HEADING)  # the README block's sections, in order


def kept_section(heading: str) -> str | None:
    """The README block's section under ``heading`` as it stands (up to the next section), if it has one."""
    readme = (HERE / "README.md").read_text()
    block = readme.split(BEGIN, 1)[1].split(END, 1)[0] if BEGIN in readme else ""
    if heading not in block:
        return None
    section = block.split(heading, 1)[1]
    for following in HEADINGS[HEADINGS.index(heading) + 1 :]:
        section = section.split(following, 1)[0]
    return heading + section.rstrip("\n") + "\n"


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
    if args.cpu and not (args.results / "results.jsonl").is_file():
        print(f"no scaling sweep at {args.results} (python experiments/scaling.py makes it): the CPU table is kept as it was")
        args.cpu = False
    builders = {
        CPU_HEADING: (args.cpu, lambda: cpu_table(*validate_cpu(args.results))),
        GPU_HEADING: (args.gpu, lambda: gpu_table(validate_gpu())),
        PLANS_HEADING: (args.plans, plans),
    }
    sections = []
    for heading, (wanted, build) in builders.items():
        if wanted:
            sections += [heading, "", build(), ""]
        elif args.write_readme and (kept := kept_section(heading)):  # a section not rerun stays as it was
            sections.append(kept)
    text = "\n".join(sections)
    print(text)
    if args.write_readme:
        from compression_bench import write_readme

        write_readme(text, BEGIN, END)
    return 0


if __name__ == "__main__":
    sys.exit(main())
