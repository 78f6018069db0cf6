"""What a GPU program keeps in host memory and how it moves it there and back.

XLA marks a buffer in pinned host memory with memory space 5 in its layout
(``bf16[32,1,8192,4096]{3,2,1,0:S(5)}``). An offload checkpoint policy (``model.remat=offload_*``)
makes XLA:GPU write each kept value into such a buffer and read it back for the backward;
scheduled asynchronously, each transfer is a ``*-start`` / ``*-done`` pair (a
dynamic-update-slice into the host buffer, a dynamic-slice out of it, or a copy) with
kernels running in between, so the transfer overlaps compute.

``host_offload`` reads, per step (loop trip counts included): the bytes of the host
buffers the program allocates, the transfers each way with the device-side bytes they move,
and how many of them are asynchronous.
"""

from __future__ import annotations

import re
from typing import Any

from jaxdist.inspect.gpu_program import control_computations
from jaxdist.inspect.hlo import HloModule, Instruction, computation_multipliers, parse_hlo, shape_bytes, split_top_level

HOST_SPACE = ":S(5)}"  # memory space 5: pinned host
_ARRAY_RE = re.compile(r"\w+\[[\d,]*\]\{[^}]*\}")
_TRANSFERS = ("copy", "dynamic-update-slice", "dynamic-slice", "fusion")


def _arrays(shape: str) -> list[str]:
    return _ARRAY_RE.findall(shape)


def _host_bytes(shape: str) -> int:
    return sum(shape_bytes(a) for a in _arrays(shape) if a.endswith(HOST_SPACE))


def _device_bytes(shape: str) -> int:
    return sum(shape_bytes(a) for a in _arrays(shape) if not a.endswith(HOST_SPACE))


def _start_parts(instruction: Instruction) -> tuple[str, str]:
    """An async start's (operands, output) shape text: a ``copy-start`` is ``(destination,
    source, context)``, other starts ``((operands...), output, context...)``."""
    shape = instruction.shape
    parts = split_top_level(shape[1:-1]) if shape.startswith("(") else [shape]
    if len(parts) < 2:
        return "", parts[0]
    return (parts[1], parts[0]) if instruction.opcode == "copy-start" else (parts[0], parts[1])


def host_transfer(instruction: Instruction, module: HloModule) -> tuple[str, bool, int] | None:
    """(direction 'to_host' | 'from_host', asynchronous, device-side bytes moved), or None."""
    if instruction.opcode.endswith("-start") and instruction.opcode.removesuffix("-start") in _TRANSFERS:
        operands, output = _start_parts(instruction)
        if HOST_SPACE in output and _device_bytes(operands):
            return "to_host", True, _device_bytes(operands)
        if HOST_SPACE in operands and HOST_SPACE not in output:
            return "from_host", True, _device_bytes(output)
        return None
    if instruction.opcode in _TRANSFERS:  # synchronous: the result's memory space against its operands'
        operands = [module.shapes.get(op.split()[-1].lstrip("%"), "") for op in instruction.operands]
        if HOST_SPACE in instruction.shape:
            moved = sum(_device_bytes(s) for s in operands)
            return ("to_host", False, moved) if moved else None
        if any(HOST_SPACE in s for s in operands):
            return "from_host", False, _device_bytes(instruction.shape)
    return None


def host_offload(hlo_text: str | HloModule) -> dict[str, Any]:
    """``host_bytes`` (host buffers the program allocates, per step), and for ``to_host`` and
    ``from_host``: ``count`` (transfers per step), ``async`` (of them, start/done pairs) and
    ``bytes`` (the device-side bytes they move per step)."""
    module = parse_hlo(hlo_text) if isinstance(hlo_text, str) else hlo_text
    multipliers = computation_multipliers(module)
    out: dict[str, Any] = {"host_bytes": 0, **{d: {"count": 0, "async": 0, "bytes": 0} for d in ("to_host", "from_host")}}
    for name in control_computations(module):  # a fusion's inside runs in its kernel, counted once
        times = multipliers.get(name, 0)
        for i in module.computations[name]:
            if i.opcode == "custom-call" and '"AllocateBuffer"' in i.attributes:
                out["host_bytes"] += times * _host_bytes(i.shape)
            found = host_transfer(i, module)
            if found is not None:
                direction, is_async, moved = found
                out[direction]["count"] += times
                out[direction]["async"] += times * is_async
                out[direction]["bytes"] += times * moved
    return out
