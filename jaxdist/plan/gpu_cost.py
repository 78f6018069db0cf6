"""XLA:GPU's program, read kernel by kernel in schedule order (``plan.cost`` replays it).

A GPU plan compiles each layout for the target (``plan.gpu_target``); its optimized, scheduled
per-device HLO (``is_scheduled``: within a computation the text order is the compute stream's
order) becomes a ``hlo_cost.ProgramCost`` whose ``schedule`` lists, per computation that runs on
the compute stream (ENTRY, loop bodies, calls, branches), its kernels, collective starts and
dones, loops and conditionals. Each kernel (``jaxdist.inspect.gpu_program.kernel_kind`` names the
kinds) carries the work that prices it:

- a GEMM: its FLOPs from its dot's shapes (a Triton gemm fusion's fused dots, a cuBLAS call's
  ``dot_dimension_numbers``); ``gemm_fp8`` where its operands are fp8;
- a cuDNN flash-attention call: from its score shape ([batch, heads, queries, keys]) and head
  size, forward 4 and backward 10 FLOPs per score and head dimension (2 and 5 matmuls), a causal
  mask skipping ``CAUSAL_SKIP`` of them;
- a grouped GEMM (``ragged-dot``): each row once;
- every kernel: the bytes it reads and writes, counted as ``hlo_cost`` counts XLA:CPU's ops
  (sliced reads, in-place updates); a memory-bound fusion is priced by them.

Loops keep XLA's trip counts; where XLA:GPU leaves one out (a loop it peeled, as gradient
accumulation's) it is read from the loop's condition (``loop_trips``).
"""

from __future__ import annotations

import dataclasses
import math
import re

from jaxdist.inspect.collectives import CollectiveOp, collective_kind, collective_ops
from jaxdist.inspect.gpu_program import grouped_gemm_flops, kernel_kind
from jaxdist.inspect.hlo import (
    ARRAY_RE,
    CALLS_RE,
    COMMENT_RE,
    CUSTOM_CALL_TARGET_RE,
    HloModule,
    Instruction,
    attribute_computations,
    computation_multipliers,
    dtype_bits,
    is_sync,
    loop_trips,
    parse_hlo,
    shape_bytes,
)
from jaxdist.inspect.host_offload import host_transfer
from jaxdist.plan.hlo_cost import ProgramCost, _operand_name, _operand_shape, _traffic, dims, dot_flops

CAUSAL_SKIP = 0.5  # share of attention work a causal kernel skips (whole blocks above the diagonal; 0.5 - 1/(2 x tiles))
# FLOPs of a cuDNN flash-attention call per score and head dimension: forward QK^T and PV (2 x 2);
# backward S = QK^T recomputed, dP, dV, dQ, dK (5 x 2)
FMHA_FLOPS = {"attention_cudnn_fwd": 4.0, "attention_cudnn_bwd": 10.0}
MATMUL_KINDS = ("gemm", "gemm_fp8", "grouped_gemm", "attention_cudnn_fwd", "attention_cudnn_bwd")
_GEMM_CONTRACTING_RE = re.compile(r'"lhs_contracting_dimensions"\s*:\s*\[([^\]]*)\]')
_FMHA_SCORES_RE = re.compile(r'"intermediate_tensor_shape"\s*:\s*\{[^{}]*?"dimensions"\s*:\s*\[([^\]]*)\]')
_MASK_RE = re.compile(r'"mask_type"\s*:\s*"(\w+)"')


def _result_bytes(shape: str) -> int:
    """Bytes a cuBLAS or cuDNN call writes: its result's arrays but the byte workspace (u8 / s8)."""
    arrays = ARRAY_RE.findall(COMMENT_RE.sub("", shape))
    return sum(
        math.prod(int(d.removeprefix("<=")) for d in ds.split(",") if d) * dtype_bits(dtype) // 8
        for dtype, ds in arrays
        if dtype not in ("u8", "s8")
    )


def _numbers(text: str) -> list[int]:
    return [int(n) for n in re.findall(r"\d+", text)]


def _fused_flops(name: str, module: HloModule, seen: frozenset[str] = frozenset()) -> float:
    """FLOPs of the dots a fused computation runs (nested fusions included)."""
    total = 0.0
    for i in module.computations.get(name, []):
        if i.opcode in ("dot", "ragged-dot"):
            total += dot_flops(i, module)
        for callee in CALLS_RE.findall(i.attributes):
            if callee not in seen:
                total += _fused_flops(callee, module, seen | {name})
    return total


def _fmha_flops(instruction: Instruction, kind: str, module: HloModule) -> float:
    """A cuDNN flash-attention call's FLOPs as the kernel runs them (a causal mask's skipped blocks left out)."""
    scores = _FMHA_SCORES_RE.search(instruction.attributes)
    head = dims(instruction.shape)
    if scores and head:
        elements = math.prod(_numbers(scores.group(1)))
    else:  # Q [batch, queries, heads, head dim] and K [batch, keys, kv heads, head dim]
        q = dims(_operand_shape(instruction.operands[0], module)) if instruction.operands else []
        k = dims(_operand_shape(instruction.operands[1], module)) if len(instruction.operands) > 1 else []
        if not q or not k or len(q[0]) != 4 or len(k[0]) != 4:
            return 0.0
        elements, head = q[0][0] * q[0][2] * q[0][1] * k[0][1], q
    mask = _MASK_RE.search(instruction.attributes)
    causal = bool(mask and "CAUSAL" in mask.group(1))
    return FMHA_FLOPS[kind] * elements * head[0][-1] * (1 - CAUSAL_SKIP * causal)


def kernel_work(instruction: Instruction, kind: str, module: HloModule) -> tuple[float, float]:
    """(FLOPs, bytes read and written) of one launch of a kernel of ``kind``."""
    op = instruction.opcode
    if op == "custom-call":
        target = CUSTOM_CALL_TARGET_RE.search(instruction.attributes)
        target = target.group(1) if target else ""
        nbytes = _result_bytes(instruction.shape) + sum(shape_bytes(_operand_shape(o, module)) for o in instruction.operands)
        if kind in FMHA_FLOPS:
            return _fmha_flops(instruction, kind, module), nbytes
        if kind == "grouped_gemm":  # jaxdist's Pallas grouped GEMM: each row once (gpu_program.grouped_gemm_flops)
            return grouped_gemm_flops(instruction.shape, [_operand_shape(o, module) for o in instruction.operands]), nbytes
        return (dot_flops(instruction, module, _GEMM_CONTRACTING_RE) if target.startswith("__cublas$") else 0.0), nbytes
    if op == "copy-start":
        return 0.0, 2.0 * sum(shape_bytes(_operand_shape(o, module)) for o in instruction.operands)
    flops = 0.0
    if op == "fusion":
        flops = sum(_fused_flops(callee, module) for callee in CALLS_RE.findall(instruction.attributes))
    elif op in ("dot", "ragged-dot"):
        flops = dot_flops(instruction, module)
    return flops, float(_traffic(instruction, module)[0])


def _wrapped(instruction: Instruction, module: HloModule) -> Instruction | None:
    """The collective an ``async-start`` runs (XLA:GPU's async reduce-scatter / all-to-all form)."""
    body = [i for callee in attribute_computations(instruction, "calls") for i in module.computations.get(callee, [])]
    return next((i for i in body if collective_kind(i.opcode) is not None), None)


def gpu_schedule(module: HloModule, ops: list[CollectiveOp]) -> dict[str, tuple[tuple, ...]]:
    """Per computation run on the compute stream (ENTRY, loop bodies, calls, branches), its events
    in schedule order (``is_scheduled``: the text order is the stream's order):

    - ``("k", kind, flops, bytes)``: a kernel (``kernel_work``);
    - ``("s", i)`` / ``("d", i)``: collective ``ops[i]`` starts asynchronously / is waited for;
      ``("c", i)``: it runs synchronously (no done, or ``is_sync``);
    - ``("hs", name, bytes)`` / ``("hd", name)``: a transfer to or from host memory (an offloaded
      value) starts on the copy engine / is waited for; ``("hc", bytes)``: one run synchronously;
    - ``("l", computation, trips)``: a loop body (or a call, once);
    - ``("b", (computation, ...))``: a conditional's branches.
    """
    index = {op.name: k for k, op in enumerate(ops)}
    instructions = [i for body in module.computations.values() for i in body]
    done = {_operand_name(i.operands[0]) for i in instructions if i.opcode.endswith("-done") and i.operands}
    started: dict[str, int] = {}  # an async start's name -> its collective's index
    for i in instructions:
        inner = _wrapped(i, module) if i.opcode == "async-start" else (i if collective_kind(i.opcode) else None)
        if inner is not None and inner.name in index and i.name in done and not is_sync(i.attributes):
            started[i.name] = index[inner.name]
    host_started: set[str] = set()
    schedule: dict[str, tuple[tuple, ...]] = {}
    todo = [module.entry]
    while todo:
        name = todo.pop()
        if name in schedule or name not in module.computations:
            continue
        events: list[tuple] = []
        for i in module.computations[name]:
            op = i.opcode
            if op in ("while", "call", "conditional") or (op == "async-start" and _wrapped(i, module) is None):
                if op == "while":
                    bodies = [(b, loop_trips(i, module, module.computations[name])) for b in attribute_computations(i, "body")]
                elif op == "conditional":
                    branches = attribute_computations(i, "branch_computations") or [
                        *attribute_computations(i, "true_computation"),
                        *attribute_computations(i, "false_computation"),
                    ]
                    todo += branches
                    events.append(("b", tuple(branches)))
                    continue
                else:  # a call, or an async computation (run inline: an upper bound)
                    bodies = [(c, 1) for c in attribute_computations(i, "to_apply" if op == "call" else "calls")]
                for body, trips in bodies:
                    todo.append(body)
                    events.append(("l", body, trips))
                continue
            if i.name in started:
                events.append(("s", started[i.name]))
                continue
            if op.endswith("-done"):
                origin = _operand_name(i.operands[0]) if i.operands else None
                if origin in started:
                    events.append(("d", started[origin]))
                elif origin in host_started:
                    events.append(("hd", origin))
                continue
            transfer = host_transfer(i, module)
            if transfer is not None:  # on a copy engine, not the compute stream
                _, is_async, moved = transfer
                if is_async and i.name in done:
                    host_started.add(i.name)
                    events.append(("hs", i.name, float(moved)))
                else:
                    events.append(("hc", float(moved)))
                continue
            inner = _wrapped(i, module) if op == "async-start" else (i if collective_kind(op) else None)
            if inner is not None:
                if inner.name in index:
                    events.append(("c", index[inner.name]))
                continue
            kind = kernel_kind(i, module)
            if kind is not None:
                events.append(("k", kind, *kernel_work(i, kind, module)))
        schedule[name] = tuple(events)
    return schedule


def gpu_program_cost(hlo_text: str | HloModule, mesh_shape: dict[str, int] | None = None) -> ProgramCost:
    """XLA:GPU's scheduled program: its schedule (``gpu_schedule``) and per-step totals (loop
    trip counts multiplied in): ``matmul_flops`` (GEMMs and attention), ``attention_flops`` (the
    cuDNN calls' FLOPs as they run: a causal kernel's skipped blocks are not in it, unlike
    XLA:CPU's full scores), ``fp8_flops``, ``memory_bytes`` (the other kernels' bytes) and the
    collectives."""
    module = parse_hlo(hlo_text) if isinstance(hlo_text, str) else hlo_text
    counts = computation_multipliers(module)
    ops = [dataclasses.replace(op, executions=counts.get(op.computation, 0)) for op in collective_ops(module, mesh_shape)]
    schedule = gpu_schedule(module, ops)
    matmul = attention = fp8 = memory = launches = 0.0
    dots: dict[float, float] = {}
    for name, events in schedule.items():
        executions = counts.get(name, 0)
        for e in events:
            if e[0] != "k":
                continue
            _, kind, flops, nbytes = e
            launches += executions
            if kind in FMHA_FLOPS:
                attention += executions * flops
                matmul += executions * flops
            elif kind in MATMUL_KINDS or flops:
                matmul += executions * flops
                fp8 += executions * flops if kind == "gemm_fp8" else 0.0
                dots[flops] = dots.get(flops, 0) + executions
            else:
                memory += executions * nbytes
    f32 = frozenset(op.name for op in ops if _op_moves_f32(op, module))
    return ProgramCost(
        matmul,
        attention,
        memory,
        0.0,
        0.0,
        tuple(ops),
        frozenset(name for name, n in counts.items() if n > 1),
        f32,
        tuple(sorted(dots.items())),
        launches,
        schedule=tuple(sorted(schedule.items())),
        entry=module.entry,
        fp8_flops=fp8,
    )


def _op_moves_f32(op: CollectiveOp, module: HloModule) -> bool:
    return module.shapes.get(op.name, "").lstrip("(").startswith("f32")


def schedule_kernel_counts(cost: ProgramCost) -> dict[str, float]:
    """Kernels per step by kind in a GPU program's schedule (loops' trip counts, a conditional's branches averaged)."""
    events, memo = dict(cost.schedule), {}

    def counts(name: str) -> dict[str, float]:
        if name not in memo:
            memo[name], out = {}, {}
            for e in events.get(name, ()):
                parts = [({e[1]: 1.0}, 1.0)] if e[0] == "k" else []
                parts += [(counts(e[1]), e[2])] if e[0] == "l" else []
                parts += [(counts(b), 1 / len(e[1])) for b in e[1]] if e[0] == "b" else []
                for part, times in parts:
                    for kind, n in part.items():
                        out[kind] = out.get(kind, 0.0) + times * n
            memo[name] = out
        return memo[name]

    return dict(sorted(counts(cost.entry).items()))
