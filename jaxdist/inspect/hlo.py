"""XLA's HLO text, read: instructions, computations, loops and their trip counts.

The compiled per-device program is what actually runs (XLA may split, combine or
rewrite what the sharding rules imply), so the reports read its text rather than the
program JAX traced. ``computation_multipliers`` says how many times each computation
runs per execution, loop trip counts multiplied in.
"""

from __future__ import annotations

import dataclasses
import math
import re

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

ARRAY_RE = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,<=]*)\]")  # "<=" marks a bounded dynamic dim
COMMENT_RE = re.compile(r"/\*.*?\*/")
STRING_RE = re.compile(r'"(?:[^"\\]|\\.)*"')
_INSTRUCTION_RE = re.compile(r"^\s+(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_COMPUTATION_RE = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(")
_TRIP_COUNT_RE = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(\d+)"')
_CALLEE_RE = re.compile(
    r"\b(calls|to_apply|body|condition|true_computation|false_computation|select|scatter|comparator|"
    r"branch_computations|called_computations)=(\{[^}]*\}|%?[\w.\-]+)"
)
NAME_RE = re.compile(r"%?([\w.\-]+)")
CALLS_RE = re.compile(r"\bcalls=%?([\w.\-]+)")  # a fusion's or async op's called computation
CUSTOM_CALL_TARGET_RE = re.compile(r'custom_call_target="([^"]+)"')
_IS_SYNC_RE = re.compile(r'"is_sync"\s*:\s*(true|false)')


def is_sync(attributes: str) -> bool:
    """Whether an async collective's start was marked synchronous (XLA:GPU runs it in place, no overlap)."""
    found = _IS_SYNC_RE.search(attributes)
    return bool(found and found.group(1) == "true")


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
    for dtype, dims in ARRAY_RE.findall(COMMENT_RE.sub("", shape)):
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


def split_top_level(text: str) -> list[str]:
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
    match = _INSTRUCTION_RE.match(COMMENT_RE.sub("", line))
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
    operands = tuple(split_top_level(rest[op.end() : close - 1]))
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
    attributes = STRING_RE.sub('""', instruction.attributes)  # op names in metadata may contain "body="
    edges = []
    for key, value in _CALLEE_RE.findall(attributes):
        factor = 1
        if trips is not None and key == "body":
            factor = trips
        elif trips is not None and key == "condition":
            factor = trips + 1
        edges.extend((name, factor) for name in NAME_RE.findall(value))
    return edges


def _operand_name(operand: str) -> str | None:
    match = NAME_RE.match(operand.split()[-1]) if operand.strip() else None
    return match.group(1) if match else None


def attribute_computations(instruction: Instruction, key: str) -> list[str]:
    """The computations an attribute names (``body=%b``, ``branch_computations={%x, %y}``)."""
    found = re.search(rf"\b{key}=(\{{[^}}]*\}}|%?[\w.\-]+)", STRING_RE.sub('""', instruction.attributes))
    return NAME_RE.findall(found.group(1)) if found else []


_INDUCTION_RE = re.compile(r'"known_induction_variable"\s*:\s*\{\s*"tuple_index"\s*:\s*"(\d+)"')
_DIRECTION_RE = re.compile(r"direction=(\w+)")
_CONSTANT_RE = re.compile(r"^\s*(-?\d+)\s*$")


def _constant(name: str | None, body: dict[str, Instruction]) -> int | None:
    """The integer constant ``name`` is, through copies and bitcasts (None if it is not one)."""
    while name in body and body[name].opcode in ("copy", "bitcast", "convert"):
        name = _operand_name(body[name].operands[0]) if body[name].operands else None
    i = body.get(name) if name else None
    found = _CONSTANT_RE.match(i.operands[0]) if i is not None and i.opcode == "constant" and i.operands else None
    return int(found.group(1)) if found else None


def loop_trips(instruction: Instruction, module: HloModule, caller: list[Instruction]) -> int:
    """A while loop's trip count: XLA's ``known_trip_count``, or, where XLA:GPU leaves it out (a
    loop it peeled, as gradient accumulation's), read from the loop: its condition compares the
    induction variable with a constant (``i < N``), from the constant it starts at. 1 if neither."""
    known = trip_count(instruction)
    if known is not None:
        return known
    condition = [i for c in attribute_computations(instruction, "condition") for i in module.computations.get(c, [])]
    root = condition[-1] if condition else None
    if root is not None and root.opcode == "fusion":  # the compare fused, as XLA:GPU does
        condition = [i for c in CALLS_RE.findall(root.attributes) for i in module.computations.get(c, [])]
        root = condition[-1] if condition else None
    if root is None or root.opcode != "compare" or len(root.operands) != 2:
        return 1
    direction = _DIRECTION_RE.search(root.attributes)
    bound = _constant(_operand_name(root.operands[1]), {i.name: i for i in condition})
    induction = _INDUCTION_RE.search(instruction.attributes)
    index = int(induction.group(1)) if induction else 0
    scope = {i.name: i for i in caller}
    init_tuple = scope.get(_operand_name(instruction.operands[0])) if instruction.operands else None
    start = 0
    if init_tuple is not None and init_tuple.opcode == "tuple" and index < len(init_tuple.operands):
        start = _constant(_operand_name(init_tuple.operands[index]), scope) or 0
    if bound is None or not direction or direction.group(1) not in ("LT", "LE"):
        return 1
    return max(bound - start + (direction.group(1) == "LE"), 1)


def loops_without_trip_count(module: HloModule) -> int:
    return sum(1 for body in module.computations.values() for i in body if i.opcode == "while" and trip_count(i) is None)


def computation_multipliers(module: HloModule) -> dict[str, int]:
    """How many times each computation reachable from ENTRY runs per execution of the
    program: the sum over its call sites of the caller's count times the loop trip count
    (``loop_trips``: XLA's, or read from a loop XLA:GPU peeled and left without one)."""
    edges: dict[str, list[tuple[str, int]]] = {}
    for name, body in module.computations.items():
        edges[name] = []
        for i in body:
            found = callees(i)
            if i.opcode == "while" and trip_count(i) is None:
                trips, bodies = loop_trips(i, module, body), set(attribute_computations(i, "body"))
                found = [(callee, trips if callee in bodies else trips + 1) for callee, _ in found]
            edges[name] += found
    order: list[str] = []  # post-order: every callee before its callers
    seen: set[str] = set()
    todo = [(module.entry, False)]
    while todo:  # without recursion: deep call graphs
        name, expanded = todo.pop()
        if expanded:
            order.append(name)
            continue
        if name in seen:
            continue
        seen.add(name)
        todo.append((name, True))
        todo += [(callee, False) for callee, _ in edges.get(name, []) if callee not in seen]
    counts = dict.fromkeys(order, 0)
    counts[module.entry] = 1
    for name in reversed(order):  # callers before callees (HLO call graphs are acyclic)
        for callee, factor in edges.get(name, []):
            if callee in counts:
                counts[callee] += counts[name] * factor
    return counts
