"""``python -m jaxdist.analyze``: compile the train step without running it and report
memory per device, FLOPs and the collectives XLA inserted.

    python -m jaxdist.analyze [--config NAME_OR_PATH] [--mesh SPEC] [key.sub=value ...] [--json]

Nothing is allocated: the step is lowered on abstract shapes (``jax.ShapeDtypeStruct``
with shardings) and compiled; the numbers come from the compiled per-device program.

Collectives are read from the compiled HLO text, because that is what actually runs
(XLA may split, combine or rewrite what the sharding rules imply). For each collective
the payload is the larger of its operand and result sizes, multiplied by the trip count
of every loop around it, so ``bytes`` is per device per training step and ``count`` is
the number of times a collective of that kind executes per step.

JSON fields: ``devices``, ``mesh`` (axis -> size), ``params``, ``flops_per_step`` (the
model's analytic training FLOPs for one global batch), ``memory_per_device_bytes``
(``arguments``, ``outputs``, ``temp``, ``alias`` and ``total`` = arguments + outputs -
alias + temp), ``collectives`` (kind -> ``count``, ``bytes``, ``wire_bytes``, ``largest``) and
``collectives_by_axes`` (the mesh axes a collective's groups span, e.g. ``"data"`` or
``"fsdp,tensor"`` -> ``count``, ``bytes``, ``wire_bytes``; ``jaxdist/wire.py`` says how), plus
``strategy``, ``compute_dtype``, ``param_bytes``, ``xla_flops_per_device`` and ``notes``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import sys
from collections.abc import Sequence
from typing import Any

from jaxdist.config import Config
from jaxdist.errors import EXIT_BAD_INPUT, EXIT_OK, JaxdistError
from jaxdist.mesh import MeshSizes

COLLECTIVE_KINDS = (
    "all-reduce",
    "all-gather",
    "reduce-scatter",
    "all-to-all",
    "ragged-all-to-all",
    "collective-permute",
    "collective-broadcast",
    "send",
    "recv",
)

# Bits per element of HLO primitive types; f8*/f4* variants are matched by prefix below.
_DTYPE_BITS = {
    "pred": 8,
    "s2": 2,
    "u2": 2,
    "s4": 4,
    "u4": 4,
    "s8": 8,
    "u8": 8,
    "s16": 16,
    "u16": 16,
    "f16": 16,
    "bf16": 16,
    "s32": 32,
    "u32": 32,
    "f32": 32,
    "s64": 64,
    "u64": 64,
    "f64": 64,
    "c64": 64,
    "c128": 128,
    "token": 0,
}

_ARRAY_RE = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,<=]*)\]")  # "<=" marks a bounded dynamic dim
_COMMENT_RE = re.compile(r"/\*.*?\*/")
_STRING_RE = re.compile(r'"(?:[^"\\]|\\.)*"')
_INSTRUCTION_RE = re.compile(r"^\s+(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_COMPUTATION_RE = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(")
_TRIP_COUNT_RE = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(\d+)"')
_CALLEE_RE = re.compile(
    r"\b(calls|to_apply|body|condition|true_computation|false_computation|select|scatter|comparator|"
    r"branch_computations|called_computations)=(\{[^}]*\}|%?[\w.\-]+)"
)
_NAME_RE = re.compile(r"%?([\w.\-]+)")
# async-update / async-done name the same wrapped computation as async-start: count it once.
_NO_CALL_EDGES = ("async-update", "async-done")


# -- shapes ------------------------------------------------------------------------


def dtype_bits(dtype: str) -> int:
    if dtype in _DTYPE_BITS:
        return _DTYPE_BITS[dtype]
    if dtype.startswith("f8"):  # f8e4m3fn, f8e5m2, f8e4m3b11fnuz, ...
        return 8
    if dtype.startswith("f4") or dtype.startswith("f6"):  # f4e2m1fn, f6e3m2fn, ...
        return int(dtype[1])
    raise ValueError(f"unknown HLO element type {dtype!r}")


def shape_bytes(shape: str) -> int:
    """Bytes of an HLO shape string: ``f32[8,128]{1,0}``, ``bf16[]``, or a (nested) tuple (summed)."""
    total = 0
    for dtype, dims in _ARRAY_RE.findall(_COMMENT_RE.sub("", shape)):
        elements = math.prod(int(d.removeprefix("<=")) for d in dims.split(",") if d)
        total += math.ceil(elements * dtype_bits(dtype) / 8)
    return total


# -- HLO text -> instructions and computations --------------------------------------


@dataclasses.dataclass(frozen=True)
class Instruction:
    name: str
    shape: str  # result shape text, e.g. "f32[8]{0}" or "(f32[], bf16[4,4]{1,0})"
    opcode: str
    operands: tuple[str, ...]  # operand texts: "%x", or "f32[8]{0} %x" when printed with shapes
    attributes: str  # everything after the operand list


@dataclasses.dataclass(frozen=True)
class HloModule:
    computations: dict[str, list[Instruction]]
    entry: str
    shapes: dict[str, str]  # instruction name -> result shape (names are unique per module)
    num_partitions: int | None = None  # from the module header, when printed


def _balanced(text: str, start: int) -> int:
    """Index just past the bracket group opening at ``text[start]``."""
    depth = 0
    for i in range(start, len(text)):
        if text[i] in "([{":
            depth += 1
        elif text[i] in ")]}":
            depth -= 1
            if depth == 0:
                return i + 1
    raise ValueError(f"unbalanced brackets in HLO: {text[start : start + 80]!r}")


def _split_top_level(text: str) -> list[str]:
    parts, depth, current = [], 0, []
    for ch in text:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append("".join(current).strip())
            current = []
        else:
            current.append(ch)
    if "".join(current).strip():
        parts.append("".join(current).strip())
    return parts


def parse_instruction(line: str) -> Instruction | None:
    """One HLO instruction line (``%name = SHAPE opcode(operands), attrs``), or None."""
    match = _INSTRUCTION_RE.match(_COMMENT_RE.sub("", line))
    if not match:
        return None
    name, rest = match.groups()
    end = _balanced(rest, 0) if rest.startswith("(") else rest.find(" ")
    if end <= 0:
        return None
    shape, rest = rest[:end], rest[end:].lstrip()
    op = re.match(r"([\w\-]+)\(", rest)
    if not op:
        return None
    close = _balanced(rest, op.end() - 1)
    operands = tuple(_split_top_level(rest[op.end() : close - 1]))
    return Instruction(name, shape, op.group(1), operands, rest[close:])


def parse_hlo(text: str) -> HloModule:
    computations: dict[str, list[Instruction]] = {}
    shapes: dict[str, str] = {}
    entry, current, partitions = "", None, None
    for line in text.splitlines():
        if line.startswith("HloModule "):
            found = re.search(r"\bnum_partitions=(\d+)", line)
            partitions = int(found.group(1)) if found else None
        if not line[:1].isspace():  # computation headers and module-level lines start in column 0
            header = _COMPUTATION_RE.match(line)
            if header and line.rstrip().endswith("{") and "->" in line:
                current = header.group(2)
                computations[current] = []
                entry = current if header.group(1) else entry
            elif line.startswith("}"):
                current = None
            continue
        if current is None:
            continue
        instruction = parse_instruction(line)
        if instruction is not None:
            computations[current].append(instruction)
            shapes[instruction.name] = instruction.shape
    if not entry:
        raise ValueError("no ENTRY computation in the HLO text")
    return HloModule(computations, entry, shapes, partitions)


# -- loops and calls ----------------------------------------------------------------


def trip_count(instruction: Instruction) -> int | None:
    """XLA's ``known_trip_count`` of a while loop, if it proved one."""
    match = _TRIP_COUNT_RE.search(instruction.attributes)
    return int(match.group(1)) if match else None


def callees(instruction: Instruction) -> list[tuple[str, int]]:
    """Computations this instruction runs, with how many times each runs per execution.

    A while body runs trip-count times (its condition once more); fusions, calls,
    conditional branches and reducers inherit the caller's count (a conditional's
    branches are all counted: an upper bound). An unknown trip count counts as 1.
    """
    if instruction.opcode in _NO_CALL_EDGES:
        return []
    trips = trip_count(instruction) if instruction.opcode == "while" else None
    attributes = _STRING_RE.sub('""', instruction.attributes)  # op names in metadata may contain "body="
    edges = []
    for key, value in _CALLEE_RE.findall(attributes):
        factor = 1
        if trips is not None and key == "body":
            factor = trips
        elif trips is not None and key == "condition":
            factor = trips + 1
        edges.extend((name, factor) for name in _NAME_RE.findall(value))
    return edges


def loops_without_trip_count(module: HloModule) -> int:
    return sum(1 for body in module.computations.values() for i in body if i.opcode == "while" and trip_count(i) is None)


# -- collectives ----------------------------------------------------------------------


def collective_kind(opcode: str) -> str | None:
    """``all-gather`` / ``all-gather-start`` -> ``all-gather``; ``-done`` and others -> None."""
    base = opcode.removesuffix("-start")
    return base if base in COLLECTIVE_KINDS else None


def _operand_bytes(operand: str, module: HloModule) -> int:
    if _ARRAY_RE.search(operand):  # printed with its shape
        return shape_bytes(operand.rsplit("%", 1)[0] if "%" in operand else operand)
    name = _NAME_RE.match(operand.strip())
    return shape_bytes(module.shapes.get(name.group(1), "")) if name else 0


def _async_results(module: HloModule) -> dict[str, str]:
    """``-start`` name -> result shape of the ``-done`` that finishes it (the real result;
    a start's own shape bundles operands and context buffers)."""
    results = {}
    for body in module.computations.values():
        for i in body:
            if i.opcode.endswith("-done") and i.operands:
                name = _NAME_RE.match(i.operands[0].split()[-1])
                if name:
                    results[name.group(1)] = i.shape
    return results


def collective_payload(instruction: Instruction, module: HloModule, async_results: dict[str, str]) -> int:
    """Larger of operand and result bytes (tuples and variadic operands summed)."""
    operands = sum(_operand_bytes(op, module) for op in instruction.operands)
    result_shape = instruction.shape
    if instruction.opcode.endswith("-start"):
        result_shape = async_results.get(instruction.name, result_shape)
    return max(operands, shape_bytes(result_shape))


def empty_collectives() -> dict[str, dict[str, int]]:
    return {kind: {"count": 0, "bytes": 0, "wire_bytes": 0, "largest": 0} for kind in COLLECTIVE_KINDS}


def computation_multipliers(module: HloModule) -> dict[str, int]:
    """How many times each computation reachable from ENTRY runs per execution of the
    program: the sum over its call sites of the caller's count times the loop trip count."""
    edges = {name: [edge for i in body for edge in callees(i)] for name, body in module.computations.items()}
    order: list[str] = []  # post-order: every callee before its callers
    seen: set[str] = set()

    def visit(name: str) -> None:
        seen.add(name)
        for callee, _ in edges.get(name, []):
            if callee not in seen:
                visit(callee)
        order.append(name)

    visit(module.entry)
    counts = dict.fromkeys(order, 0)
    counts[module.entry] = 1
    for name in reversed(order):  # callers before callees (HLO call graphs are acyclic)
        for callee, factor in edges.get(name, []):
            if callee in counts:
                counts[callee] += counts[name] * factor
    return counts


@dataclasses.dataclass(frozen=True)
class CollectiveOp:
    kind: str  # one of COLLECTIVE_KINDS
    name: str  # HLO instruction name
    bytes: int  # payload of one execution (larger of operands and result)
    executions: int  # times it runs per step (product of enclosing loop trip counts)
    computation: str
    group_size: int | None = None  # devices per replica group (None: not printed, device count unknown)
    axes: tuple[str, ...] | None = None  # mesh axes the groups span (None without a mesh)
    wire_bytes: int | None = None  # one execution's bytes on the wire per device (jaxdist/wire.py)


def collective_ops(module: HloModule, mesh_shape: dict[str, int] | None = None) -> list[CollectiveOp]:
    """Every collective the program runs (async ``-start`` forms once, ``-done`` ignored),
    with its groups' size, the mesh axes they span and its wire bytes."""
    from jaxdist.wire import device_groups, group_size, spanned_axes, wire_bytes

    devices = math.prod(mesh_shape.values()) if mesh_shape else module.num_partitions
    async_results = _async_results(module)
    ops = []
    for computation, executions in computation_multipliers(module).items():
        for instruction in module.computations.get(computation, []):
            kind = collective_kind(instruction.opcode)
            if kind is not None:
                payload = collective_payload(instruction, module, async_results)
                groups = device_groups(_STRING_RE.sub('""', instruction.attributes), devices)
                n = group_size(kind, groups)
                axes = spanned_axes(groups, mesh_shape)
                ops.append(CollectiveOp(kind, instruction.name, payload, executions, computation, n, axes, wire_bytes(kind, payload, n)))
    return ops


def collective_stats(ops: Sequence[CollectiveOp]) -> dict[str, dict[str, int | None]]:
    """Per kind (every kind, zero when absent): ``count`` executions per step, ``bytes`` payload
    per device per step, ``wire_bytes`` sent per device per step (None when a group size is
    unknown), ``largest`` payload of a single execution."""
    stats: dict[str, dict[str, Any]] = empty_collectives()
    for op in ops:
        if op.executions:
            kind = stats[op.kind]
            kind["count"] += op.executions
            kind["bytes"] += op.executions * op.bytes
            kind["largest"] = max(kind["largest"], op.bytes)
            if kind["wire_bytes"] is not None:
                kind["wire_bytes"] = None if op.wire_bytes is None else kind["wire_bytes"] + op.executions * op.wire_bytes
    return stats


def collectives_by_axes(ops: Sequence[CollectiveOp]) -> dict[str, dict[str, int]]:
    """Per set of mesh axes spanned ("data", "fsdp,tensor", ...): count, bytes and wire bytes per step."""
    out: dict[str, dict[str, int]] = {}
    for op in ops:
        if op.executions and op.axes is not None:
            entry = out.setdefault(",".join(op.axes) or "none", {"count": 0, "bytes": 0, "wire_bytes": 0})
            entry["count"] += op.executions
            entry["bytes"] += op.executions * op.bytes
            entry["wire_bytes"] += op.executions * (op.wire_bytes or 0)
    return out


def hlo_collectives(hlo_text: str) -> dict[str, dict[str, int]]:
    return collective_stats(collective_ops(parse_hlo(hlo_text)))


# -- the analysis -----------------------------------------------------------------------


def _memory(compiled: Any) -> dict[str, int]:
    """``total`` = arguments + outputs - alias + temp: everything the step holds at once,
    counting a donated argument that becomes an output (aliased) only once."""
    stats = compiled.memory_analysis()
    arguments, outputs = int(stats.argument_size_in_bytes), int(stats.output_size_in_bytes)
    alias, temp = int(stats.alias_size_in_bytes), int(stats.temp_size_in_bytes)
    return {"arguments": arguments, "outputs": outputs, "temp": temp, "alias": alias, "total": arguments + outputs - alias + temp}


def _xla_flops(compiled: Any) -> float | None:
    cost = compiled.cost_analysis()
    if isinstance(cost, list | tuple):  # older JAX: one dict per program
        cost = cost[0] if cost else {}
    flops = (cost or {}).get("flops")
    return float(flops) if flops is not None else None


def _param_bytes(trainer: Any) -> int:
    import jax

    state = trainer.abstract_state()
    params = state.outer.params if getattr(state, "outer", None) is not None else state.params  # DiLoCo: one model, not R
    return sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(params))


def _notes(report: dict[str, Any], config: Config, unknown_loops: int) -> list[str]:
    """What a reader needs to interpret the numbers, from what this compile actually shows."""
    notes = []
    collectives, on_cpu = report["collectives"], report["platform"] == "cpu"
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
    if on_cpu and config.model.kind == "llama":
        notes.append("temp memory reflects XLA's CPU attention, which materialises [batch, heads, seq, seq] scores (no flash attention)")
    if unknown_loops:
        notes.append(f"{unknown_loops} while loop(s) without a known trip count were counted once")
    notes.append("xla_flops_per_device is XLA's cost analysis of the per-device program; it counts each loop body once")
    return notes


def compile_train_step(config: Config, mesh_sizes: MeshSizes | None, devices: Sequence[Any] | None = None) -> tuple[Any, Any]:
    """The Trainer and its train step compiled from abstract shapes (nothing allocated).

    Call after JAX has enough devices for the mesh (the CLI runs ``prepare_devices``).
    """
    from jaxdist.run import build_trainer

    trainer = build_trainer(config, mesh_sizes, devices)
    batch = trainer.abstract_batch(config.train.global_batch)
    return trainer, trainer.train_step.lower(trainer.abstract_state(), batch).compile()


def build_report(trainer: Any, compiled: Any) -> dict[str, Any]:
    """The analysis of one compiled train step (the CLI's JSON object)."""
    from jaxdist.models import compute_dtype

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
        "memory_per_device_bytes": _memory(compiled),
        "collectives": collective_stats(ops),
        "collectives_by_axes": collectives_by_axes(ops),
    }
    spec = _pipeline_of(trainer)
    if spec is not None:
        report["pipeline"] = {
            "stages": spec.stages,
            "microbatches": spec.microbatches,
            "virtual_stages": spec.virtual,
            "schedule": spec.schedule,
            "ticks": spec.ticks,
            "bubble": spec.bubble,
        }
    if getattr(trainer, "inner_steps", 0):
        report["diloco"] = _diloco_section(trainer, ops, mesh_shape)
    report["notes"] = _notes(report, config, loops_without_trip_count(module))
    return report


def _diloco_section(trainer: Any, inner_ops: Sequence[CollectiveOp], mesh_shape: dict[str, int]) -> dict[str, Any]:
    """DiLoCo's traffic: the inner step's collectives (above) never span the replica axis;
    the outer step's, run once per H steps, do. Per-step figures amortise them over H."""
    outer = trainer.outer_step.lower(trainer.abstract_state()).compile()
    outer_ops = collective_ops(parse_hlo(outer.as_text()), mesh_shape)
    h = trainer.inner_steps

    def across(ops):
        return [op for op in ops if op.axes and "replica" in op.axes]

    outer_bytes = sum(op.executions * (op.wire_bytes or 0) for op in across(outer_ops))
    return {
        "inner_steps": h,
        "outer_reduce": trainer.config.parallel.diloco_reduce,
        "inner_cross_replica_collectives": sum(op.executions for op in across(inner_ops)),
        "outer_collectives": collective_stats(outer_ops),
        "outer_collectives_by_axes": collectives_by_axes(outer_ops),
        "outer_cross_replica_wire_bytes": outer_bytes,
        "cross_replica_wire_bytes_per_step": outer_bytes / h,
    }


def _pipeline_of(trainer: Any):
    from jaxdist.parallel.schedule import pipeline_spec

    return pipeline_spec(trainer.config.parallel, int(trainer.layout.mesh.shape.get("pipe", 1)))


def analyze(config: Config, mesh_sizes: MeshSizes | None, devices: Sequence[Any] | None = None) -> dict[str, Any]:
    """Compile ``config``'s train step on a mesh from abstract shapes and report on it."""
    return build_report(*compile_train_step(config, mesh_sizes, devices))


# -- output -------------------------------------------------------------------------------


def _human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


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
    if "pipeline" in report:
        p = report["pipeline"]
        lines += [
            "",
            f"pipeline        {p['schedule']}: S={p['stages']} M={p['microbatches']} V={p['virtual_stages']}, {p['ticks']} ticks, bubble {p['bubble']:.1%}",
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
    lines += ["", *(f"note: {n}" for n in report["notes"])]
    return "\n".join(lines)


def build_arg_parser():
    from jaxdist.cli import config_arg_parser

    parser = config_arg_parser(
        "python -m jaxdist.analyze", "Compile the train step on abstract shapes and report memory, FLOPs and collectives."
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from jaxdist.cli import config_from_args, parse_args
    from jaxdist.run import prepare_devices

    try:
        args = parse_args(build_arg_parser(), argv)
        config = config_from_args(args)
        sizes = prepare_devices(config)  # before JAX starts: fake CPU devices for the mesh
        report = analyze(config, sizes)
    except JaxdistError as e:
        print(f"jaxdist: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(json.dumps(report) if args.json else format_report(report))
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
