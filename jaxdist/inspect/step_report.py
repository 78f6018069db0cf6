"""The report on one compiled train step: memory per device, FLOPs, the collectives by
kind and by mesh axes, the pipeline's ticks, DiLoCo's cross-replica traffic, and notes on
what the backend did (``python -m jaxdist.analyze`` prints it).

JSON fields: ``devices``, ``mesh`` (axis -> size), ``params``, ``flops_per_step`` (the
model's analytic training FLOPs for one global batch), ``memory_per_device_bytes``
(``arguments``, ``outputs``, ``temp``, ``alias`` and ``total`` = arguments + outputs -
alias + temp), ``collectives`` (kind -> ``count``, ``bytes``, ``wire_bytes``, ``largest``) and
``collectives_by_axes`` (the mesh axes a collective's groups span, e.g. ``"data"`` or
``"fsdp,tensor"`` -> ``count``, ``bytes``, ``wire_bytes`` and the same per kind under ``kinds``;
``jaxdist/inspect/wire.py`` says how), plus ``strategy``, ``compute_dtype``, ``param_bytes``,
``xla_flops_per_device`` and ``notes``; an MoE model adds ``experts`` (its all-to-alls over the
expert axis against the analytical count, ``jaxdist.inspect.expert_traffic``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax

from jaxdist.config import Config
from jaxdist.inspect.collectives import CollectiveOp, collective_ops, collective_stats, collectives_by_axes
from jaxdist.inspect.expert_traffic import expert_section, format_section
from jaxdist.inspect.hlo import loops_without_trip_count, parse_hlo
from jaxdist.models import compute_dtype
from jaxdist.parallel.pipeline_schedule import pipeline_spec


def memory(compiled: Any) -> dict[str, int]:
    """``total`` = arguments + outputs - alias + temp: everything the step holds at once,
    counting a donated argument that becomes an output (aliased) only once."""
    stats = compiled.memory_analysis()
    arguments, outputs = int(stats.argument_size_in_bytes), int(stats.output_size_in_bytes)
    alias, temp = int(stats.alias_size_in_bytes), int(stats.temp_size_in_bytes)
    report = {"arguments": arguments, "outputs": outputs, "temp": temp, "alias": alias, "total": arguments + outputs - alias + temp}
    host = _host_state_bytes(stats) + int(getattr(stats, "host_temp_size_in_bytes", 0))
    if host:  # train.optimizer_offload's state, an offload policy's buffers: in host memory, not in the above
        report["host"] = host
    return report


def _host_state_bytes(stats: Any) -> int:
    """The step's arguments and outputs in host memory (``train.optimizer_offload``), a donated
    one that becomes an output counted once."""
    size = lambda name: int(getattr(stats, name, 0))  # noqa: E731 - older JAX has no host fields
    return size("host_argument_size_in_bytes") + size("host_output_size_in_bytes") - size("host_alias_size_in_bytes")


def device_peak(compiled: Any) -> int:
    """The step's peak in device memory. XLA's ``peak_memory_in_bytes`` also counts the
    arguments and outputs that live in host memory (seen on XLA:GPU: a 256 MiB host argument
    adds 256 MiB to it), which take no device memory."""
    stats = compiled.memory_analysis()
    return int(stats.peak_memory_in_bytes) - _host_state_bytes(stats)


def _xla_flops(compiled: Any) -> float | None:
    cost = compiled.cost_analysis()
    if isinstance(cost, list | tuple):  # older JAX: one dict per program
        cost = cost[0] if cost else {}
    flops = (cost or {}).get("flops")
    return float(flops) if flops is not None else None


def _param_bytes(trainer: Any) -> int:
    state = trainer.abstract_state()
    params = state.outer.params if getattr(state, "outer", None) is not None else state.params  # DiLoCo: one model, not R
    return sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(params))


def _notes(report: dict[str, Any], config: Config, unknown_loops: int, attention: str | None = None) -> list[str]:
    """What a reader needs to interpret the numbers, from what this compile actually shows
    (``attention``: the decoder's attention implementation, the task's choice)."""
    notes = []
    collectives, on_cpu = report["collectives"], report["platform"] == "cpu"
    experts = report.get("experts")
    if experts and experts["moved_dtype"] == "f32" and report["compute_dtype"] != "float32":
        notes.append(
            f"the experts' all-to-alls move f32 where the model computes in {report['compute_dtype']}: XLA's "
            f"{report['platform'].upper()} backend promotes them, so their bytes are twice the analytical count (a GPU moves "
            f"{report['compute_dtype']})"
        )
    if report["strategy"].startswith("fsdp") and collectives["reduce-scatter"]["count"] == 0:
        notes.append(
            f"no reduce-scatter: XLA's {report['platform'].upper()} backend reduces the FSDP gradients with all-reduce + "
            "dynamic-slice, which moves about twice the bytes of a reduce-scatter (XLA's GPU pipeline is expected to "
            "form reduce-scatters)"
        )
    if on_cpu and report["compute_dtype"] == "bfloat16":
        notes.append(
            "XLA's CPU backend runs bf16 dots in f32 and promotes bf16 all-reduces to f32, so weight all-gathers and "
            "activation all-reduces here move f32 where a GPU can move bf16 (up to twice the bytes of a GPU run)"
        )
    # Only plain XLA attention holds the scores: a context axis runs parallel.blockwise's tiles instead
    # (one tile pair's scores at a time), and a Pallas kernel is blockwise too.
    if on_cpu and config.model.kind == "llama" and report["mesh"].get("context", 1) == 1 and attention in ("xla", "xla_fp32", None):
        notes.append("temp memory reflects XLA's CPU attention, which materialises [batch, heads, seq, seq] scores (no flash attention)")
    if unknown_loops:
        notes.append(f"{unknown_loops} while loop(s) without a known trip count were counted once")
    notes.append("xla_flops_per_device is XLA's cost analysis of the per-device program; it counts each loop body once")
    return notes


def build_report(trainer: Any, compiled: Any) -> dict[str, Any]:
    """The analysis of one compiled train step (the CLI's JSON object)."""
    config, mesh = trainer.config, trainer.layout.mesh
    compiled = getattr(compiled, "compiled", compiled)  # a step wrapper (DiLoCo, simulated link): its train step
    module = parse_hlo(compiled.as_text())
    platform = mesh.devices.flat[0].platform
    mesh_shape = {axis: int(size) for axis, size in mesh.shape.items()}
    ops = collective_ops(module, mesh_shape)
    report = {
        "config": config.name,
        "devices": int(mesh.size),
        "mesh": {axis: int(size) for axis, size in mesh.shape.items()},
        "strategy": str(trainer.layout.strategy),
        "platform": platform,
        "compute_dtype": str(compute_dtype(config, platform)),
        "params": int(trainer.n_params),
        "param_bytes": int(_param_bytes(trainer)),
        "global_batch": config.train.global_batch,
        "microbatches": config.train.microbatches,
        "flops_per_step": float(trainer.task.flops_per_example * config.train.global_batch),
        "xla_flops_per_device": _xla_flops(compiled),
        "memory_per_device_bytes": memory(compiled),
        "collectives": collective_stats(ops),
        "collectives_by_axes": collectives_by_axes(ops),
    }
    if config.model.kind == "llama" and config.model.moe_experts:
        itemsize = 4 if report["compute_dtype"] == "float32" else 2
        report["experts"] = expert_section(config, ops, module, mesh_shape, itemsize)
    spec = pipeline_of(trainer)
    if spec is not None:
        report["pipeline"] = {
            "stages": spec.stages,
            "microbatches": spec.microbatches,
            "virtual_stages": spec.virtual,
            "schedule": spec.schedule,
            "ticks": spec.ticks,
            "bubble": spec.bubble,
            "chunk_steps": spec.work_units,  # forward + backward of one chunk, masked ones included, per device
            "recompute": spec.recompute if spec.schedule == "1f1b" else None,
        }
    if trainer.replicas.count:
        report["diloco"] = _diloco_section(trainer, ops, mesh_shape)
    report["notes"] = _notes(report, config, loops_without_trip_count(module), getattr(trainer.task, "attention", None))
    return report


def _diloco_section(trainer: Any, inner_ops: Sequence[CollectiveOp], mesh_shape: dict[str, int]) -> dict[str, Any]:
    """DiLoCo's traffic: the inner step's collectives (above) never span the replica axis;
    the outer steps', one per fragment per H steps, do. Per-step figures amortise them over H;
    ``peak_sync_cross_replica_wire_bytes`` is the most one sync sends (streaming: a fragment's)."""
    abstract = trainer.abstract_state()
    sends = [p.send.lower(abstract).compile() for p in trainer.replicas.outer_programs(trainer.state_layout)]
    per_fragment = [collective_ops(parse_hlo(c.as_text()), mesh_shape) for c in sends]
    outer_ops = [op for ops in per_fragment for op in ops]
    h = trainer.replicas.inner_steps

    def across(ops):
        return [op for op in ops if op.axes and "replica" in op.axes]

    fragment_bytes = [sum(op.executions * (op.wire_bytes or 0) for op in across(ops)) for ops in per_fragment]
    outer_bytes = sum(fragment_bytes)
    p = trainer.config.parallel
    return {
        "inner_steps": h,
        "outer_reduce": p.diloco_outer_dtype or p.diloco_reduce,
        "fragments": len(sends),
        "overlap_steps": p.diloco_overlap_steps,
        "inner_cross_replica_collectives": sum(op.executions for op in across(inner_ops)),
        "outer_collectives": collective_stats(outer_ops),
        "outer_collectives_by_axes": collectives_by_axes(outer_ops),
        "outer_cross_replica_wire_bytes": outer_bytes,
        "fragment_cross_replica_wire_bytes": fragment_bytes,
        "peak_sync_cross_replica_wire_bytes": max(fragment_bytes),
        "cross_replica_wire_bytes_per_step": outer_bytes / h,
    }


def pipeline_of(trainer: Any):
    """The trainer's pipeline schedule (None without a pipe axis)."""
    return pipeline_spec(trainer.config.parallel, int(trainer.layout.mesh.shape.get("pipe", 1)))


# -- output -------------------------------------------------------------------------------


def _human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _exposed_by_kind(report: dict[str, Any]) -> str:
    kinds = sorted(((s.get("exposed_s") or 0.0, kind) for kind, s in report["collectives"].items()), reverse=True)
    return ", ".join(f"{kind} {seconds * 1e3:.1f} ms" for seconds, kind in kinds if seconds > 0)


def format_report(report: dict[str, Any]) -> str:
    mesh = ",".join(f"{a}={s}" for a, s in report["mesh"].items())
    mem = report["memory_per_device_bytes"]
    lines = [
        f"config          {report['config']}",
        f"mesh            {mesh} ({report['devices']} {report['platform']} devices), strategy {report['strategy']}",
        f"params          {report['params']:,} ({_human_bytes(report['param_bytes'])})",
        f"flops/step      {report['flops_per_step']:.4g} (model, global batch {report['global_batch']})",
        "memory/device   " + ", ".join(f"{k} {_human_bytes(mem[k])}" for k in ("arguments", "outputs", "temp", "total")),
        "",
        f"{'collective':<22}{'count/step':>12}{'buffer bytes':>16}{'wire bytes':>16}   (per device per step)",
    ]
    active = {kind: stats for kind, stats in report["collectives"].items() if stats["count"]}
    for kind, stats in active.items():
        wire = "?" if stats["wire_bytes"] is None else _human_bytes(stats["wire_bytes"])
        lines.append(f"{kind:<22}{stats['count']:>12,}{_human_bytes(stats['bytes']):>16}{wire:>16}")
    if not active:
        lines.append("(none)")
    for axes, stats in report.get("collectives_by_axes", {}).items():
        lines.append(
            f"{'  over ' + axes:<22}{stats['count']:>12,}{_human_bytes(stats['bytes']):>16}{_human_bytes(stats['wire_bytes']):>16}"
        )
        kinds = stats.get("kinds", {})
        for kind, by_kind in kinds.items() if len(kinds) > 1 else ():
            lines.append(
                f"{'    ' + kind:<22}{by_kind['count']:>12,}{_human_bytes(by_kind['bytes']):>16}{_human_bytes(by_kind['wire_bytes']):>16}"
            )
    if "experts" in report:
        lines += ["", *format_section(report["experts"], _human_bytes)]
    if "pipeline" in report:
        p = report["pipeline"]
        lines += [
            "",
            f"pipeline        {p['schedule']}: S={p['stages']} M={p['microbatches']} V={p['virtual_stages']}, {p['ticks']} ticks, bubble {p['bubble']:.1%}"
            + ({True: ", stage forward recomputed", False: ", stage activations kept"}.get(p.get("recompute"), "")),
        ]
    if "diloco" in report:
        d = report["diloco"]
        lines += [
            "",
            f"diloco          H={d['inner_steps']}: the step above crosses replica "
            f"{d['inner_cross_replica_collectives'] or 'never'}{' times' if d['inner_cross_replica_collectives'] else ''}; the outer step sends "
            f"{_human_bytes(d['outer_cross_replica_wire_bytes'])} ({d['outer_reduce']}) across it every {d['inner_steps']} steps "
            f"= {_human_bytes(d['cross_replica_wire_bytes_per_step'])} per step",
        ]
        if d["fragments"] > 1 or d["overlap_steps"]:
            lines.append(
                f"                streaming: {d['fragments']} fragments on their own offsets, at most "
                f"{_human_bytes(d['peak_sync_cross_replica_wire_bytes'])} a sync, each applied {d['overlap_steps']} steps after it is sent"
            )
    if "target" in report:  # analyze --target: XLA:GPU's program
        t = report["target"]
        kernels = ", ".join(f"{kind} {n:,}" for kind, n in report["kernels"].items() if n)
        overlap = ", ".join(
            f"{kind} {s['async']}/{s['count']} async, {s['overlapped_fraction']:.0%} overlapped"
            for kind, s in report["collectives"].items()
            if s["count"] and s.get("overlapped_fraction") is not None
        )
        lines += [
            "",
            f"target          {t['description']} (compute capability {t['compute_capability']}), {t['hosts']} host(s) of {t['gpus_per_node']}",
            f"fits            {'yes' if report['fits'] else 'NO'}: {report['fits_note']}",
            f"kernels/step    {kernels}",
            f"overlap         {overlap or 'no collectives'}",
            f"exposed         {report['exposed_s'] * 1e3:.1f} ms of a {report['step_s'] * 1e3:.1f} ms step predicted "
            f"({report['exposed_fraction']:.0%})" + (f": {exposed}" if (exposed := _exposed_by_kind(report)) else ""),
        ]
        offload = report.get("host_offload") or {}
        if offload.get("host_bytes") or offload.get("to_host", {}).get("count"):
            to, back = offload["to_host"], offload["from_host"]
            lines.append(
                f"host offload    {_human_bytes(offload['host_bytes'])} kept in host memory; per step {to['count']} transfers to it "
                f"({to['async']} async, {_human_bytes(to['bytes'])}) and {back['count']} back ({back['async']} async, {_human_bytes(back['bytes'])}), "
                f"{offload.get('exposed_s', 0.0) * 1e3:.1f} ms exposed"
            )
    lines += ["", *(f"note: {n}" for n in report["notes"])]
    return "\n".join(lines)
