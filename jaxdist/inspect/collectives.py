"""The collectives of a compiled program: kind, payload, how often they run per step,
the mesh axes their groups span and the bytes each device sends (``wire``).

For each collective the payload is the larger of its operand and result sizes,
multiplied by the trip count of every loop around it, so ``bytes`` is per device per
training step and ``count`` the number of times a collective of that kind executes.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

from jaxdist.inspect.hlo import ARRAY_RE, NAME_RE, STRING_RE, HloModule, Instruction, computation_multipliers, parse_hlo, shape_bytes
from jaxdist.inspect.wire import device_groups, group_size, spanned_axes, wire_bytes

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


def collective_kind(opcode: str) -> str | None:
    """``all-gather`` / ``all-gather-start`` -> ``all-gather``; ``-done`` and others -> None."""
    base = opcode.removesuffix("-start")
    return base if base in COLLECTIVE_KINDS else None


def _operand_bytes(operand: str, module: HloModule) -> int:
    if ARRAY_RE.search(operand):  # printed with its shape
        return shape_bytes(operand.rsplit("%", 1)[0] if "%" in operand else operand)
    name = NAME_RE.match(operand.strip())
    return shape_bytes(module.shapes.get(name.group(1), "")) if name else 0


def _async_results(module: HloModule) -> dict[str, str]:
    """``-start`` name -> result shape of the ``-done`` that finishes it (the real result;
    a start's own shape bundles operands and context buffers)."""
    results = {}
    for body in module.computations.values():
        for i in body:
            if i.opcode.endswith("-done") and i.operands:
                name = NAME_RE.match(i.operands[0].split()[-1])
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


@dataclasses.dataclass(frozen=True)
class CollectiveOp:
    kind: str  # one of COLLECTIVE_KINDS
    name: str  # HLO instruction name
    bytes: int  # payload of one execution (larger of operands and result)
    executions: int  # times it runs per step (product of enclosing loop trip counts)
    computation: str
    group_size: int | None = None  # devices per replica group (None: not printed, device count unknown)
    axes: tuple[str, ...] | None = None  # mesh axes the groups span (None without a mesh)
    wire_bytes: int | None = None  # one execution's bytes on the wire per device (jaxdist/inspect/wire.py)


def collective_ops(module: HloModule, mesh_shape: dict[str, int] | None = None) -> list[CollectiveOp]:
    """Every collective the program runs (async ``-start`` forms once, ``-done`` ignored),
    with its groups' size, the mesh axes they span and its wire bytes."""
    devices = math.prod(mesh_shape.values()) if mesh_shape else module.num_partitions
    async_results = _async_results(module)
    ops = []
    for computation, executions in computation_multipliers(module).items():
        for instruction in module.computations.get(computation, []):
            kind = collective_kind(instruction.opcode)
            if kind is not None:
                payload = collective_payload(instruction, module, async_results)
                groups = device_groups(STRING_RE.sub('""', instruction.attributes), devices)
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


def collectives_by_axes(ops: Sequence[CollectiveOp]) -> dict[str, dict[str, Any]]:
    """Per set of mesh axes spanned ("data", "fsdp,tensor", ...): count, bytes and wire bytes per step,
    and the same per collective kind under ``kinds`` (an axis carries several: the expert axis both
    the experts' all-to-alls and, as a batch axis, gradient all-reduces)."""
    out: dict[str, dict[str, Any]] = {}
    for op in ops:
        if op.executions and op.axes is not None:
            entry = out.setdefault(",".join(op.axes) or "none", {"count": 0, "bytes": 0, "wire_bytes": 0, "kinds": {}})
            for totals in (entry, entry["kinds"].setdefault(op.kind, {"count": 0, "bytes": 0, "wire_bytes": 0})):
                totals["count"] += op.executions
                totals["bytes"] += op.executions * op.bytes
                totals["wire_bytes"] += op.executions * (op.wire_bytes or 0)
    return out


def hlo_collectives(hlo_text: str) -> dict[str, dict[str, int]]:
    return collective_stats(collective_ops(parse_hlo(hlo_text)))
