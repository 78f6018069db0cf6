"""``parallel.strategy`` -> how parameters and optimizer state are sharded (pure Python:
the validation before JAX starts and the sharding rules both read it)."""

from __future__ import annotations

import dataclasses

from jaxdist.layout.mesh import MeshSizes

ZERO_STAGES = ("dp", "zero1", "fsdp")


def zero_stage(strategy: str, sizes: MeshSizes) -> str:
    """``parallel.strategy`` -> dp | zero1 | fsdp (``auto``: fsdp when the mesh has an fsdp axis)."""
    zero = next((p for p in strategy.split("+") if p in ZERO_STAGES), "auto")
    if zero == "auto":
        zero = "fsdp" if sizes.get("fsdp", 1) > 1 else "dp"
    return zero


@dataclasses.dataclass(frozen=True)
class Strategy:
    zero: str  # dp | zero1 | fsdp
    tensor: bool
    context: bool = False  # the sequence split over a context axis; model states sharded over it as FSDP does
    collective_matmul: bool = False  # tensor parallelism in sequence-parallel form, as collective matmuls (models.collective_matmul)

    def __str__(self) -> str:
        return self.zero + ("+tp" if self.tensor else "") + ("+sp" if self.collective_matmul else "") + ("+cp" if self.context else "")


def resolve_strategy(name: str, mesh_sizes: dict[str, int], collective_matmul: bool = False) -> Strategy:
    """``auto`` shards params over ``fsdp`` when that axis exists; TP follows the ``tensor``
    axis. Whether the strategy fits the mesh is ``validate.check_config_on_mesh``'s job."""
    tensor = mesh_sizes.get("tensor", 1) > 1
    return Strategy(zero_stage(name, mesh_sizes), tensor, mesh_sizes.get("context", 1) > 1, collective_matmul and tensor)
