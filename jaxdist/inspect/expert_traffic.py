"""The experts' all-to-all traffic of a compiled step against the analytical count.

Per MoE layer a device sends its tokens' k copies to the experts and gets the results back:
two all-to-alls of T x k x d elements in the compute dtype forward (T = tokens per device),
two again backward (their transposes), and two more forward with remat (the layer's forward
runs again). ``parallel.expert`` also exchanges each row's local expert id (one int32 per
row) once per forward. Its send buffer holds R rows per destination, not T x k / expert:
with ``parallel.expert_buffer_factor=1`` (and T x k divisible by the expert axis) they are the
same, so the compiled bytes equal the analytical count.

XLA:CPU promotes bf16 all-to-alls to f32 (as it does all-reduces): a bf16 model's measured
token bytes are then twice the analytical ones, which the section says (``moved_dtype``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from jaxdist.config import Config
from jaxdist.inspect.collectives import CollectiveOp
from jaxdist.inspect.hlo import ARRAY_RE, HloModule
from jaxdist.layout.mesh import BATCH_AXES
from jaxdist.models.experts import capacity_rows
from jaxdist.parallel.expert import buffer_rows

AXIS = "expert"


def transfers_per_layer(remat: str) -> int:
    """Token all-to-alls per MoE layer and step: dispatch and return, forward and backward,
    and the recomputed forward's two under remat."""
    forwards = 1 + (remat != "none")
    return 2 * forwards + 2


def tokens_per_device(config: Config, mesh_shape: dict[str, int]) -> int:
    """Tokens one device routes per step (all microbatches): the batch axes and context split them."""
    shards = math.prod(mesh_shape.get(a, 1) for a in (*BATCH_AXES, "context"))
    return config.train.global_batch * config.train.seq_len // shards


def moe_layers_per_device(config: Config, mesh_shape: dict[str, int]) -> int:
    m = config.model
    return (m.n_layers - m.moe_first_dense) // mesh_shape.get("pipe", 1) if m.moe_experts else 0


def analytical_all_to_all_bytes(config: Config, mesh_shape: dict[str, int], compute_bytes: int) -> float:
    """Token bytes one device's all-to-alls over ``expert`` carry per step: transfers x T x k x d x b
    per MoE layer (none without an expert axis)."""
    if mesh_shape.get(AXIS, 1) <= 1:
        return 0.0
    m = config.model
    per_transfer = tokens_per_device(config, mesh_shape) * m.moe_top_k * m.d_model * compute_bytes
    return float(moe_layers_per_device(config, mesh_shape) * transfers_per_layer(m.remat) * per_transfer)


def _element_type(op: CollectiveOp, module: HloModule) -> str:
    found = ARRAY_RE.search(module.shapes.get(op.name, ""))
    return found.group(1) if found else "?"


def expert_section(config: Config, ops: Sequence[CollectiveOp], module: HloModule, mesh_shape: dict[str, int], compute_bytes: int):
    """The report's ``experts`` section: the all-to-alls over ``expert`` measured in the compiled
    program (tokens and the int32 ids apart) next to the analytical count."""
    m, ep = config.model, mesh_shape.get(AXIS, 1)
    over = [op for op in ops if op.kind == "all-to-all" and op.executions and op.axes is not None and AXIS in op.axes]
    ids = [op for op in over if _element_type(op, module).startswith(("s", "u"))]
    tokens = [op for op in over if op not in ids]
    measured = sum(op.executions * op.bytes for op in tokens)
    id_bytes = sum(op.executions * op.bytes for op in ids)
    analytical = analytical_all_to_all_bytes(config, mesh_shape, compute_bytes)
    layers, microbatches = moe_layers_per_device(config, mesh_shape), max(config.train.microbatches, 1)
    rows_per_call = tokens_per_device(config, mesh_shape) // microbatches
    capacity = capacity_rows(rows_per_call, m.moe_top_k, m.moe_experts, m.moe_capacity_factor)
    moved = sorted({_element_type(op, module) for op in tokens})
    return {
        "experts": m.moe_experts,
        "expert_axis": ep,
        "experts_per_device": m.moe_experts // ep,
        "top_k": m.moe_top_k,
        "moe_layers_per_device": layers,
        "tokens_per_device": tokens_per_device(config, mesh_shape),
        "buffer_factor": config.parallel.expert_buffer_factor,
        "buffer_rows_per_destination": buffer_rows(
            rows_per_call, m.moe_top_k, m.moe_experts, ep, capacity, config.parallel.expert_buffer_factor
        ),
        "transfers_per_layer": transfers_per_layer(m.remat) if ep > 1 else 0,
        "analytical_bytes": analytical,
        "measured_bytes": measured,
        "id_bytes": id_bytes,
        "measured_over_analytical": measured / analytical if analytical else None,
        "id_share": id_bytes / (measured + id_bytes) if measured + id_bytes else 0.0,
        "moved_dtype": ",".join(moved) if moved else None,
    }


def format_section(section: dict[str, Any], human_bytes) -> list[str]:
    s = section
    head = f"experts         {s['experts']} over expert={s['expert_axis']} ({s['experts_per_device']} per device), top-{s['top_k']}"
    if s["expert_axis"] <= 1:
        return [head + ", no expert axis: no all-to-all"]
    ratio = f"{s['measured_over_analytical']:.3f}" if s["measured_over_analytical"] is not None else "?"
    return [
        head,
        f"  all-to-all    tokens {human_bytes(s['measured_bytes'])} ({s['moved_dtype']}) vs analytical "
        f"{human_bytes(s['analytical_bytes'])} = {s['transfers_per_layer']} x T k d b x {s['moe_layers_per_device']} layers "
        f"(T={s['tokens_per_device']:,}): ratio {ratio}; ids {human_bytes(s['id_bytes'])} ({s['id_share']:.1%})",
    ]
