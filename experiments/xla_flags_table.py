"""What each of jaxdist's GPU XLA flags changes in the compiled train step, no GPU needed.

    python experiments/xla_flags_table.py [--json PATH]          # every section below (~30 min on 2 cores)
    python experiments/xla_flags_table.py --target h100 --mesh fsdp=8 [--only NAME ...] [--try NAME=VALUE ...]
        [--config llama3-8b] [key=value ...]                     # one section of your own

Each section compiles llama3-8b's real train step with XLA:GPU for a target on this host
(``jaxdist.plan.gpu_target``: compile-only devices) once with every flag of ``GPU_FLAGS``
(``jaxdist/layout/xla_flags.py``; row ``all``), once with none of them (``none``: XLA's
defaults), once per flag with all the others (``- NAME``: that flag left at XLA's default,
what removing it from ``GPU_FLAGS`` does), and once per tried flag with all of them plus it
(``+ NAME=VALUE``). The sections: H100 on fsdp=8, fsdp=4,tensor=2 and data=2,fsdp=4 (HSDP:
all-reduces over data), A100 on fsdp=8 (where the latency-hiding scheduler is not on by
itself), tensor=8 with tensor parallelism's collective-matmul (windowed einsum) flags, and
fsdp=4,tensor=2 with ``parallel.collective_matmul=true``.
XLA:GPU compiles are deterministic, so one compile per row is the figure (no medians).

Columns, per device per step, read from the scheduled HLO (``jaxdist.inspect.gpu_program``):

- ``same``: ``=`` when the optimized HLO is identical to the ``all`` row's (the flag changed
  nothing in this program);
- ``exposed GB``: collective bytes that nothing hides: synchronous collectives and async ones
  whose start..done window holds no compute (each kind's bytes x (1 - overlapped_fraction));
- ``no-matmul GB``: the same with only matmuls, attention kernels and loops counted as compute
  (a window holding one small elementwise fusion hides little of a 100 MB gather);
- per kind ``async/count`` and ``overlapped_fraction`` (all-gather, reduce-scatter,
  all-reduce; collective-permute where a row has any: a windowed einsum turns a TP all-gather
  or reduce-scatter into a loop of permutes and partial matmuls);
- ``loops``: the trip counts of the program's loops (32 layers as 32 iterations, or as 15 of
  two layers plus peeled ones when XLA pipelines and double-buffers the layer scan);
- ``kernels`` and ``copies`` per step (``kernel_counts``: all launches, and copy kernels);
- ``temp`` and ``peak`` GiB (``compiled.memory_analysis()``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from pathlib import Path

KINDS = (("all-gather", "AG"), ("reduce-scatter", "RS"), ("all-reduce", "AR"), ("collective-permute", "CP"))
LHS = "xla_gpu_enable_latency_hiding_scheduler"
WINDOWED_EINSUM = "xla_gpu_threshold_for_windowed_einsum_mib=0"  # every einsum (xla_gpu_multi_streamed_windowed_einsum: XLA's default true)
# (target, mesh, config overrides, leave each flag out?, tried flags)
SECTIONS = (
    ("h100", "fsdp=8", (), True, (f"{LHS}=false", "xla_gpu_enable_pipelined_reduce_scatter=false")),
    ("h100", "fsdp=4,tensor=2", (), True, (f"{LHS}=false", WINDOWED_EINSUM)),
    ("h100", "data=2,fsdp=4", (), True, ()),
    ("a100", "fsdp=8", (), True, (f"{LHS}=false",)),
    ("h100", "tensor=8", ("parallel.strategy=auto",), False, (WINDOWED_EINSUM,)),
    # collective matmuls: a run gets double buffering off (layout.xla_flags.gpu_flags), GPU_FLAGS' "all" has it on
    ("h100", "fsdp=4,tensor=2", ("parallel.collective_matmul=true",), False, ("xla_gpu_enable_while_loop_double_buffering=false",)),
)


def parse_value(text: str):
    """A flag's value as a compile option (what ``gpu_target.compiler_options`` passes)."""
    return {"true": True, "false": False}.get(text, int(text) if text.lstrip("-").isdigit() else text)


def variants(only: list[str] | None, tries: list[str] | tuple[str, ...]) -> list[tuple[str, dict]]:
    """(row label, the compile options) for every row of one section (``only``: the flags left
    out in turn, None for every one)."""
    from jaxdist.layout.xla_flags import GPU_FLAGS

    every = {name: parse_value(value) for name, value in GPU_FLAGS.items()}
    rows = [("all", every), ("none", {})]
    for name in GPU_FLAGS:
        if only is None or name in only:
            rows.append((f"- {name}", {k: v for k, v in every.items() if k != name}))
    for item in tries:
        name, _, value = item.partition("=")
        rows.append((f"+ {name}={value}", every | {name: parse_value(value)}))
    return rows


def measure(config_name: str, mesh: str, target: str, options: dict, overrides: list[str], hlo_out: Path | None = None) -> dict:
    """One target compile with exactly ``options`` (jaxdist's own defaults off for it)."""
    from jaxdist.config import load_config
    from jaxdist.data.sources import resolve_vocab
    from jaxdist.layout.mesh import mesh_device_count, parse_mesh
    from jaxdist.plan.gpu_target import compile_for_target, target_hardware, target_report

    config = load_config(config_name, list(overrides))
    resolve_vocab(config)
    hardware = target_hardware(target)
    sizes = parse_mesh(mesh)
    gpus = mesh_device_count(sizes)
    os.environ["JAXDIST_XLA_DEFAULTS"] = "0"  # the row's options only: compiler_options adds nothing
    started = time.monotonic()
    trainer, compiled, used = compile_for_target(config, sizes, hardware, gpus, 8, options)
    report = target_report(trainer, compiled, hardware, used, 8)
    hlo = compiled.as_text()
    if hlo_out is not None:
        hlo_out.write_text(hlo)
    memory = compiled.memory_analysis()
    out = {
        "hlo_sha": hashlib.sha256(hlo.encode()).hexdigest()[:16],
        "compile_s": time.monotonic() - started,
        "temp_bytes": int(memory.temp_size_in_bytes),
        "peak_bytes": int(report["memory_per_device_bytes"]["peak"]),
        "kinds": {},
        "exposed_bytes": 0.0,
        "kernels": sum(report["kernels"].values()),
        "copies": report["kernels"]["copy"],
        "matmul_exposed_bytes": matmul_exposed_bytes(hlo, report["mesh"]),
        "loops": loop_trip_counts(hlo),
    }
    for kind, entry in report["collectives"].items():
        if not entry["bytes"]:
            continue
        fraction = entry.get("overlapped_fraction") or 0.0
        out["exposed_bytes"] += entry["bytes"] * (1.0 - fraction)
        out["kinds"][kind] = {"count": entry["count"], "async": entry["async"], "bytes": entry["bytes"], "overlapped_fraction": fraction}
    return out


HEAVY_KERNELS = ("gemm", "gemm_fp8", "attention_cudnn_fwd", "attention_cudnn_bwd", "grouped_gemm")


def matmul_exposed_bytes(hlo: str, mesh: dict[str, int]) -> float:
    """Exposed collective bytes when only matmuls, attention and loops hide a collective: the
    schedule read again with every other kernel (elementwise, reduction, copy fusions) left out
    of the control computations."""
    from jaxdist.inspect.collectives import collective_ops
    from jaxdist.inspect.gpu_program import collective_schedule, kernel_kind
    from jaxdist.inspect.hlo import HloModule, parse_hlo

    module = parse_hlo(hlo)

    def kept(instruction) -> bool:
        if instruction.opcode.startswith("async-"):
            return True  # XLA:GPU's wrapped async collectives (and their done)
        kind = kernel_kind(instruction, module)
        return kind is None or kind == "collective" or kind in HEAVY_KERNELS

    thinned = HloModule(
        {name: [i for i in body if kept(i)] for name, body in module.computations.items()},
        module.entry,
        module.shapes,
        module.num_partitions,
    )
    schedule = collective_schedule(thinned, mesh)
    total = {}
    for op in collective_ops(module, mesh):
        total[op.kind] = total.get(op.kind, 0) + op.executions * op.bytes
    return sum(total[kind] * (1.0 - (entry["overlapped_fraction"] or 0.0)) for kind, entry in schedule.items() if total.get(kind))


def loop_trip_counts(hlo: str) -> list[int]:
    """The trip counts of the program's loops (the layer scans: 32 layers run as 32
    iterations, or 15 of two layers each plus two peeled ones when XLA double-buffers them)."""
    import re

    return [int(n) for n in re.findall(r'known_trip_count":\{"n":"(\d+)"\}', hlo)]


def cell(row: dict, kind: str) -> str:
    entry = row["kinds"].get(kind)
    if entry is None:
        return "-"
    return f"{entry['async']}/{entry['count']} {entry['overlapped_fraction']:.2f}"


def table(config_name: str, sections: list[tuple[str, str, list[str], list[tuple[str, dict]]]]) -> str:
    lines = []
    for target, mesh, overrides, rows in sections:
        reference = rows[0][1]["hlo_sha"]
        kinds = [(kind, short) for kind, short in KINDS if kind != "collective-permute" or any(kind in r["kinds"] for _, r in rows)]
        lines += [
            f"{config_name} on {mesh}{''.join(f' {o}' for o in overrides)} ({target}):",
            "",
            "| flags | same | exposed GB | no-matmul GB | "
            + " | ".join(f"{short} async/n overlap" for _, short in kinds)
            + " | loops | kernels | copies | temp GiB | peak GiB |",
            "| --- | --- | --- | --- | " + " | ".join("---" for _ in kinds) + " | --- | --- | --- | --- | --- |",
        ]
        for label, row in rows:
            same = "=" if row["hlo_sha"] == reference and label != "all" else ""
            cells = " | ".join(cell(row, kind) for kind, _ in kinds)
            lines.append(
                f"| `{label}` | {same} | {row['exposed_bytes'] / 1e9:.2f} | {row['matmul_exposed_bytes'] / 1e9:.2f} | {cells} | "
                f"{','.join(map(str, row['loops'])) or '-'} | {row['kernels']} | {row['copies']} | "
                f"{row['temp_bytes'] / 2**30:.2f} | {row['peak_bytes'] / 2**30:.2f} |"
            )
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="llama3-8b")
    parser.add_argument("--target", default=None, help="one section of your own: this target (h100 | h200 | a100 | h100-hbm2e)")
    parser.add_argument("--mesh", action="append", default=None, help="one section per mesh (repeatable) instead of the default sections")
    parser.add_argument("--only", action="append", default=None, help="leave out only these flags (default: each in turn)")
    parser.add_argument("--no-leave-out", action="store_true", help="no '- NAME' rows (only all, none and --try)")
    parser.add_argument("--try", dest="tries", action="append", default=[], metavar="NAME=VALUE", help="a row with all flags plus this one")
    parser.add_argument("--hlo-dir", default=None, help="write each row's optimized HLO here (to diff two rows)")
    parser.add_argument("--json", default=None, help="also write the rows here")
    parser.add_argument("overrides", nargs="*", help="config key=value overrides")
    args = parser.parse_args(argv)

    from jaxdist.plan.gpu_target import prepare_target

    prepare_target()
    import jax

    if args.target or args.mesh or args.tries or args.only or args.no_leave_out:
        plan = [(args.target or "h100", mesh, (), not args.no_leave_out, tuple(args.tries)) for mesh in args.mesh or ["fsdp=8"]]
    else:
        plan = list(SECTIONS)
    print(f"xla_flags_table: {args.config}, jax {jax.__version__}, {time.strftime('%Y-%m-%d')}", file=sys.stderr)
    sections = []
    for target, mesh, overrides, leave_out, tries in plan:
        rows = []
        for label, options in variants(args.only if leave_out else [], tries):
            hlo_out = None
            if args.hlo_dir:
                Path(args.hlo_dir).mkdir(parents=True, exist_ok=True)
                hlo_out = Path(args.hlo_dir) / f"{target}_{mesh}_{label.replace(' ', '').replace('=', '-')}.hlo"
            row = measure(args.config, mesh, target, options, [*overrides, *args.overrides], hlo_out)
            rows.append((label, row))
            print(f"  {target} {mesh} {label}: {row['compile_s']:.0f} s", file=sys.stderr, flush=True)
        sections.append((target, mesh, [*overrides, *args.overrides], rows))
    print(f"{args.config}, jax {jax.__version__}, {time.strftime('%Y-%m-%d')}\n")
    print(table(args.config, sections))
    if args.json:
        rows_json = [{"target": t, "mesh": m, "overrides": o, "rows": dict(rows)} for t, m, o, rows in sections]
        Path(args.json).write_text(json.dumps(rows_json, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
