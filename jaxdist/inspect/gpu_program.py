"""What XLA:GPU made of a step: its kernels by kind and how its collectives are scheduled.

Read from the optimized, scheduled per-device HLO (``is_scheduled=true``: within a
computation, the text order is the execution order on the compute stream). Counts are per
step: an instruction inside a loop body counts trip-count times (``hlo.computation_multipliers``).

Kernels (``kernel_counts``): ``gemm`` (cuBLAS / cuBLASLt calls and Triton gemm fusions),
``gemm_fp8`` (cuBLASLt's fp8 matmul, or a Triton gemm whose dot takes f8 operands: without
a device there is no autotuner, so XLA may leave fp8 gemms to Triton), ``attention_cudnn_fwd``
/ ``attention_cudnn_bwd`` (cuDNN flash attention), ``grouped_gemm`` (a ragged/grouped
matmul kernel: a ``ragged-dot`` XLA kept, or jaxdist's Pallas Triton grouped GEMM, a Triton
call named ``jaxdist_grouped_gemm_*``), ``triton_fusion`` (other Triton kernels, Pallas included), ``other_fusion``
(XLA's loop and reduction fusions), ``copy``, ``collective`` (a start, or a synchronous
collective) and ``other`` (sorts, scatters, custom calls not named above).

Collectives (``collective_schedule``): per kind, how many start/done pairs run
asynchronously (``async``: a start not marked ``is_sync``) and ``overlapped_fraction``, the
share of that kind's bytes whose start..done window holds compute (a kernel, or a loop or
call, which holds kernels). A window that wraps around a loop body (started at the end of
one iteration, done in the next: XLA's pipelined collectives) is read around the wrap.
"""

from __future__ import annotations

import json
import re
from typing import Any

from jaxdist.inspect.collectives import COLLECTIVE_KINDS, collective_kind, collective_ops
from jaxdist.inspect.hlo import (
    ARRAY_RE,
    CALLS_RE,
    CUSTOM_CALL_TARGET_RE,
    NAME_RE,
    STRING_RE,
    HloModule,
    Instruction,
    computation_multipliers,
    is_sync,
    parse_hlo,
)

KERNEL_KINDS = (
    "gemm",
    "gemm_fp8",
    "attention_cudnn_fwd",
    "attention_cudnn_bwd",
    "grouped_gemm",
    "triton_fusion",
    "other_fusion",
    "copy",
    "collective",
    "other",
)
_FUSION_KIND_RE = re.compile(r'"fusion_backend_config":\{"kind":"([^"]+)"')
_F8_RE = re.compile(r"\bf8e\w+\[")
_KERNEL_NAME_RE = re.compile(r'\bname = "([^"]*)"')  # a Triton call's kernel name (Pallas: pallas_call's name)
GROUPED_GEMM_KERNEL = "jaxdist_grouped_gemm"  # models.grouped_gemm's kernels: _fwd, _dx, _dw
# Not kernels: bookkeeping the runtime does without a launch (views, tuples, control flow).
_NO_KERNEL = {
    "parameter",
    "constant",
    "bitcast",
    "get-tuple-element",
    "tuple",
    "while",
    "call",
    "conditional",
    "after-all",
    "partition-id",
    "replica-id",
    "opt-barrier",
    "add-dependency",
    "async-update",
    "async-done",
    "copy-done",
}
_CONTROL = ("while", "call", "conditional")


def _custom_call_kind(target: str, instruction: Instruction) -> str:
    if target == "__cublas$lt$matmul$f8":
        return "gemm_fp8"
    if target.startswith("__cublas$"):
        return "gemm_fp8" if _F8_RE.search(" ".join(instruction.operands)) else "gemm"
    if target.startswith("__cudnn$fmha"):
        return "attention_cudnn_bwd" if "Backward" in target else "attention_cudnn_fwd"
    if "ragged" in target.lower() or "grouped" in target.lower():
        return "grouped_gemm"
    if "triton" in target.lower():
        names = _KERNEL_NAME_RE.findall(instruction.attributes)  # the last: the backend config's, past its IR
        return "grouped_gemm" if names and names[-1].startswith(GROUPED_GEMM_KERNEL) else "triton_fusion"
    return "other"


def grouped_gemm_flops(result_shape: str, operand_shapes: list[str]) -> float:
    """FLOPs of one of jaxdist's grouped GEMM calls (``models.grouped_gemm``), from its shapes:
    2 x rows x each group's matrix. The rows are its row operand's (``x`` or ``dy`` [M, .]), the
    matrix the [G, A, B] array among its operands and result (forward and input gradient: the
    weights; weight gradient: the result), A x B. Rows past the groups (a static buffer's empty
    rows) are skipped at run time: with expert parallelism's buffer this is an upper bound."""
    arrays = [
        [int(d.removeprefix("<=")) for d in ds.split(",") if d]
        for shape in (*operand_shapes, result_shape)
        for _, ds in ARRAY_RE.findall(shape)
    ]
    rows = next((a[0] for a in arrays if len(a) == 2), 0)
    matrix = next((a[1] * a[2] for a in arrays if len(a) == 3), 0)
    return 2.0 * rows * matrix


def kernel_kind(instruction: Instruction, module: HloModule) -> str | None:
    """The kind of kernel an instruction launches (``KERNEL_KINDS``), or None when it launches none."""
    op = instruction.opcode
    if op in _NO_KERNEL or op.endswith("-done"):
        return None
    if collective_kind(op) is not None:
        return "collective"
    if op == "custom-call":
        target = CUSTOM_CALL_TARGET_RE.search(instruction.attributes)
        return _custom_call_kind(target.group(1) if target else "", instruction)
    if op == "fusion":
        kind = _FUSION_KIND_RE.search(instruction.attributes)
        kind = kind.group(1) if kind else ""
        if "gemm" in kind:  # __triton_gemm, __triton_nested_gemm_fusion
            return "gemm_fp8" if _fusion_takes_f8(instruction, module) else "gemm"
        if kind.startswith("__triton"):
            return "triton_fusion"
        if kind.startswith("__cudnn"):
            return "gemm"  # cuDNN GEMM fusions
        return "other_fusion"
    if op == "ragged-dot":
        return "grouped_gemm"
    if op in ("copy", "copy-start", "transpose"):
        return "copy"
    return "other"


def _fusion_takes_f8(instruction: Instruction, module: HloModule) -> bool:
    """Whether a gemm fusion's dot reads f8 operands (its fused computation's parameters or dot operands)."""
    called = CALLS_RE.search(instruction.attributes)
    if not called:
        return False
    body = module.computations.get(called.group(1).lstrip("%"), [])
    return any(i.opcode in ("parameter", "dot") and (_F8_RE.search(i.shape) or _F8_RE.search(" ".join(i.operands))) for i in body) or any(
        i.opcode == "fusion" and _fusion_takes_f8(i, module) for i in body
    )


def control_computations(module: HloModule) -> list[str]:
    """The computations whose instructions run as the program's steps: ENTRY and what loops,
    calls, conditionals and non-collective async starts run (not fused computations)."""
    seen, order, todo = set(), [], [module.entry]
    while todo:
        name = todo.pop()
        if name in seen or name not in module.computations:
            continue
        seen.add(name)
        order.append(name)
        for i in module.computations[name]:
            attributes = STRING_RE.sub('""', i.attributes)
            if i.opcode in _CONTROL:
                for key in ("body", "condition", "to_apply", "true_computation", "false_computation"):
                    todo += NAME_RE.findall(re.search(rf"\b{key}=(%?[\w.\-]+)", attributes).group(1)) if f"{key}=" in attributes else []
                branches = re.search(r"branch_computations=\{([^}]*)\}", attributes)
                todo += NAME_RE.findall(branches.group(1)) if branches else []
            elif i.opcode == "async-start" and not _wrapped_collective(i, module):
                called = CALLS_RE.search(attributes)
                todo += [called.group(1).lstrip("%")] if called else []
    return order


def _wrapped_collective(instruction: Instruction, module: HloModule) -> Instruction | None:
    """The collective an ``async-start`` runs (XLA:GPU's async reduce-scatter / all-to-all form)."""
    called = CALLS_RE.search(instruction.attributes)
    body = module.computations.get(called.group(1).lstrip("%"), []) if called else []
    return next((i for i in body if collective_kind(i.opcode) is not None), None)


def kernel_counts(hlo_text: str | HloModule) -> dict[str, int]:
    """Kernels per step by kind (``KERNEL_KINDS``), loop trip counts included."""
    module = parse_hlo(hlo_text) if isinstance(hlo_text, str) else hlo_text
    multipliers = computation_multipliers(module)
    counts = dict.fromkeys(KERNEL_KINDS, 0)
    for name in control_computations(module):
        times = multipliers.get(name, 0)
        for i in module.computations[name]:
            kind = "collective" if i.opcode == "async-start" and _wrapped_collective(i, module) else kernel_kind(i, module)
            if kind is not None:
                counts[kind] += times
    return counts


def _operand_names(instruction: Instruction) -> list[str]:
    return [m.group(1) for op in instruction.operands if (m := NAME_RE.match(op.split()[-1]))]


def _window_has_compute(body: list[Instruction], start: int, done: int, module: HloModule) -> bool:
    between = body[start + 1 : done] if done > start else body[start + 1 :] + body[:done]
    for i in between:
        if i.opcode in _CONTROL:
            return True
        kind = kernel_kind(i, module)
        if kind is not None and kind != "collective":
            return True
    return False


def collective_schedule(
    hlo_text: str | HloModule, mesh_shape: dict[str, int] | None = None, in_loops: bool = False
) -> dict[str, dict[str, Any]]:
    """Per collective kind: ``count`` (executions per step), ``async`` (asynchronous start/done
    pairs per step) and ``overlapped_fraction`` (bytes whose window holds compute / all bytes
    of the kind; None when the kind moves nothing). ``in_loops``: only the collectives a loop
    runs (more than once a step), e.g. a pipeline's stage-to-stage permutes."""
    module = parse_hlo(hlo_text) if isinstance(hlo_text, str) else hlo_text
    multipliers = computation_multipliers(module)
    ops = {op.name: op for op in collective_ops(module, mesh_shape)}
    wrapper_of = {}  # a wrapped collective's computation -> its async-start
    for body in module.computations.values():
        for i in body:
            if i.opcode == "async-start" and (inner := _wrapped_collective(i, module)) is not None:
                wrapper_of[inner.name] = i.name
    position = {i.name: (name, k) for name, body in module.computations.items() for k, i in enumerate(body)}
    done_of = {}
    for name, body in module.computations.items():
        for k, i in enumerate(body):
            if i.opcode.endswith("-done"):
                for operand in _operand_names(i):
                    done_of[operand] = (name, k)
    out = {kind: {"count": 0, "async": 0, "bytes": 0, "overlapped_bytes": 0} for kind in COLLECTIVE_KINDS}
    for op in ops.values():
        times, entry = op.executions, out[op.kind]
        if in_loops and times <= 1:
            continue
        entry["count"] += times
        entry["bytes"] += times * op.bytes
        start_name = wrapper_of.get(op.name, op.name)
        start_at, done_at = position.get(start_name), done_of.get(start_name)
        if start_at is None or done_at is None:
            continue  # a synchronous collective: no start/done pair
        start_instruction = module.computations[start_at[0]][start_at[1]]
        if is_sync(start_instruction.attributes):
            continue
        entry["async"] += times
        same = start_at[0] == done_at[0]
        if not same or _window_has_compute(module.computations[start_at[0]], start_at[1], done_at[1], module):
            entry["overlapped_bytes"] += times * op.bytes
    del multipliers
    return {
        kind: {
            "count": v["count"],
            "async": v["async"],
            "overlapped_fraction": (v["overlapped_bytes"] / v["bytes"]) if v["bytes"] else None,
        }
        for kind, v in out.items()
    }


def xla_flags_in_force(options: dict[str, Any]) -> dict[str, str]:
    """The compiler options a target compile used, as XLA_FLAGS-style strings."""
    return {name: json.dumps(value) if isinstance(value, bool) else str(value) for name, value in sorted(options.items())}
