"""Logical axis names -> mesh axes: one rules table decides every layout.

Models name the axes of parameters and activations (``embed``, ``mlp``, ``heads``,
``batch``, ...). DP, ZeRO-1, FSDP (ZeRO-3) and Megatron TP differ only in the rules
below, never in model code.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Sequence
from typing import Any

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxdist.layout import step_context
from jaxdist.layout.mesh import BATCH_AXES, INNER_BATCH_AXES
from jaxdist.layout.strategy import Strategy

MeshAxes = tuple[str, ...] | None
Rules = dict[str, MeshAxes]

# Every logical name a model may use, and where it goes under plain data parallelism.
_BASE_RULES: Rules = {
    # activations
    "batch": INNER_BATCH_AXES,  # DiLoCo's vmap adds the replica axis in front
    "seq": None,
    "res_seq": None,  # the residual stream's sequence between layers (split over tensor by collective matmuls)
    "act_embed": None,
    "act_heads": None,
    "act_kv_heads": None,
    "act_mlp": None,
    "act_vocab": None,
    "act_channels": None,
    # parameters
    "layers": ("pipe",),  # stacked layers: stage s holds a contiguous block (no-op without a pipe axis)
    "vocab": None,
    "embed": None,  # the dimension FSDP / ZeRO shard
    "heads": None,
    "kv_heads": None,
    "head_dim": None,
    "mlp": None,
    "expert": ("expert",),  # an MoE layer's experts: split over the expert axis (no-op without one)
    "conv": None,  # conv kernel spatial dims
    "channels_in": None,
    "channels": None,  # conv output channels: sharded like embed
    "classes": None,
}

# Megatron tensor parallelism: column-split QKV and MLP-in, row-split attention-out and
# MLP-out, vocab-split embedding and head; the matching activations stay split.
_TENSOR_RULES: Rules = {
    "heads": ("tensor",),
    "kv_heads": ("tensor",),
    "mlp": ("tensor",),
    "vocab": ("tensor",),
    "act_heads": ("tensor",),
    "act_kv_heads": ("tensor",),
    "act_mlp": ("tensor",),
    "act_vocab": ("tensor",),
}


def rules_for(strategy: Strategy, *, optimizer_state: bool = False) -> Rules:
    """The rules table for parameters (or, with ``optimizer_state``, for Adam's moments)."""
    rules = dict(_BASE_RULES)
    if strategy.tensor:
        rules.update(_TENSOR_RULES)
    if strategy.collective_matmul:
        rules["res_seq"] = ("tensor",)
    if strategy.zero == "fsdp":
        rules["embed"] = rules["channels"] = ("fsdp",)
    elif strategy.zero == "zero1" and optimizer_state:
        rules["embed"] = rules["channels"] = INNER_BATCH_AXES
    if strategy.context:
        # The sequence is split over context; the model states are sharded over it too, the
        # way FSDP shards them, so a context group holds one copy of them, not N.
        rules["seq"] = rules["res_seq"] = ("context",)
        rules["embed"] = (*(rules["embed"] or ()), "context")
        rules["channels"] = rules["embed"]
    return rules


def logical_to_spec(
    axes: Sequence[str | None], shape: Sequence[int], rules: Rules, mesh: Mesh, *, not_divisible: list | None = None
) -> PartitionSpec:
    """Map logical names to a PartitionSpec; skip size-1 axes, reused axes and non-divisors
    (each non-divisor is appended to ``not_divisible`` as (name, dim, mesh axis, size))."""
    used: set[str] = set()
    spec: list[Any] = []
    for name, dim in zip(axes, shape, strict=True):
        if name is not None and name not in rules:
            raise KeyError(f"logical axis {name!r} has no sharding rule")
        chosen = []
        for mesh_axis in (rules.get(name) or ()) if name else ():
            size = mesh.shape[mesh_axis]
            if size == 1 or mesh_axis in used:
                continue
            if dim % (size * _prod(mesh.shape[a] for a in chosen)):
                if not_divisible is not None:
                    not_divisible.append((name, dim, mesh_axis, size))
                continue
            chosen.append(mesh_axis)
        used.update(chosen)
        spec.append(tuple(chosen) if len(chosen) > 1 else (chosen[0] if chosen else None))
    return PartitionSpec(*spec)


def _prod(values) -> int:
    out = 1
    for v in values:
        out *= v
    return out


def _is_variable(x: Any) -> bool:
    return isinstance(x, nnx.Variable)


def tree_shardings(tree: Any, rules: Rules, mesh: Mesh, *, replicated: dict[tuple, str] | None = None) -> Any:
    """NamedShardings for a pytree whose nnx Variables carry ``axes`` metadata; others replicate.

    A dimension a rule would shard but its mesh axis does not divide stays replicated over
    that axis; ``replicated`` collects one line per (name, dim, axis) saying so.
    """

    def one(path, leaf: Any) -> Any:
        if _is_variable(leaf):
            axes = leaf.get_metadata().get("axes")
            value = leaf.get_value() if hasattr(leaf, "get_value") else leaf.value
            shape = getattr(value, "shape", ())
            if axes is None or len(axes) != len(shape):
                return leaf.replace(NamedSharding(mesh, PartitionSpec()))
            skipped: list = []
            spec = logical_to_spec(axes, shape, rules, mesh, not_divisible=skipped)
            for name, dim, axis, size in skipped if replicated is not None else ():
                replicated.setdefault(
                    (name, dim, axis),
                    f"{jax.tree_util.keystr(path)}: its {name!r} dimension ({dim}) does not divide over mesh axis "
                    f"{axis!r} ({size}); replicated over {axis!r}",
                )
            return leaf.replace(NamedSharding(mesh, spec))
        return NamedSharding(mesh, PartitionSpec())

    return jax.tree_util.tree_map_with_path(one, tree, is_leaf=_is_variable)


@dataclasses.dataclass(frozen=True)
class Layout:
    """A mesh plus the rules for parameters, optimizer state and activations."""

    mesh: Mesh
    strategy: Strategy
    context_load_balance: bool = False  # token arrays arrive in the load-balanced order (parallel.context)

    @property
    def param_rules(self) -> Rules:
        return rules_for(self.strategy)

    @property
    def opt_rules(self) -> Rules:
        return rules_for(self.strategy, optimizer_state=True)

    def batch_sharding(self, ndim: int) -> NamedSharding:
        # replica first: DiLoCo's replica r reads the r-th contiguous slice of the global batch;
        # a token array's second dimension is the sequence, split over context when there is one
        seq = ("context",) if self.strategy.context and ndim >= 2 else ()
        return NamedSharding(self.mesh, PartitionSpec(BATCH_AXES, *seq, *([None] * (ndim - 1 - len(seq)))))

    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, PartitionSpec())

    def constrain(self, x: jax.Array, axes: Sequence[str | None]) -> jax.Array:
        mesh, sizes = self.mesh, self.mesh
        traced = jax.sharding.get_abstract_mesh()
        if not traced.empty and traced.manual_axes:
            # inside shard_map (a pipeline stage): its mesh, and only its automatic axes
            mesh = traced
            sizes = types.SimpleNamespace(shape={a: (1 if a in traced.manual_axes else n) for a, n in traced.shape.items()})
        spec = logical_to_spec(axes, x.shape, self.param_rules, sizes)
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def active_layout() -> Layout:
    """The layout the current step is traced under (pipelining needs its mesh)."""
    layout = step_context.current().layout
    if layout is None:
        raise RuntimeError("pipeline parallelism runs inside jaxdist's train/eval step (no layout installed)")
    return layout


def constrain(x: jax.Array, axes: Sequence[str | None]) -> jax.Array:
    """Pin an activation's layout by logical names; a no-op outside a step (no layout installed)."""
    layout = step_context.current().layout
    return x if layout is None else layout.constrain(x, axes)


def _partly_manual() -> tuple[Any, Any, Layout] | None:
    """(the traced mesh, its sizes with manual axes as 1, the active layout) inside a region manual
    over some mesh axes (a pipeline stage), else None."""
    traced = jax.sharding.get_abstract_mesh()
    layout = step_context.current().layout
    if traced.empty or not traced.manual_axes or layout is None:
        return None
    sizes = types.SimpleNamespace(shape={a: (1 if a in traced.manual_axes else n) for a, n in traced.shape.items()})
    return traced, sizes, layout


def region_spec(axes: Sequence[str | None], shape: Sequence[int]) -> PartitionSpec | None:
    """The spec of an activation of logical ``axes`` over the automatic axes of a partly manual
    region (``manual_over_the_rest``'s in-spec), or None outside one."""
    region = _partly_manual()
    return None if region is None else logical_to_spec(axes, shape, region[2].param_rules, region[1])


def manual_over_the_rest(fn, arg_axes: Sequence[Sequence[str | None] | None], out_axes: Sequence[str | None]):
    """``fn`` made manual over every mesh axis a region leaves automatic, when traced inside a
    region manual over some (a pipeline stage); else ``fn`` itself. For kernels whose own
    partitioning rule cannot run in a partly manual region: JAX 0.10's cuDNN attention reads a
    ``NamedSharding``'s spec and finds a ``GSPMDSharding`` there. ``arg_axes``: each argument's
    logical axes (None: replicated); the specs come from the active layout's rules."""
    region = _partly_manual()
    if region is None:
        return fn
    traced, sizes, layout = region
    rest = tuple(a for a in traced.axis_names if a not in traced.manual_axes)

    def wrapped(*args):
        specs = tuple(
            PartitionSpec() if axes is None else logical_to_spec(axes, x.shape, layout.param_rules, sizes)
            for x, axes in zip(args, arg_axes, strict=True)
        )
        out_spec = logical_to_spec(out_axes, args[0].shape[: len(out_axes)], layout.param_rules, sizes)
        return jax.shard_map(fn, mesh=traced, in_specs=specs, out_specs=out_spec, axis_names=set(rest), check_vma=False)(*args)

    return wrapped


def summed_into_layout(local_sum, operands: Sequence[jax.Array], operand_axes: Sequence[Sequence[str | None]], out_axes, out_shape):
    """A parameter-shaped sum over ``operands`` (logical ``operand_axes``), laid out as a parameter
    of logical ``out_axes``, each device summing its own part: ``local_sum(*parts, blocks)`` gives
    the partial sum of the block ``blocks`` ((start, size) per dimension) that this device keeps
    of the mesh axes that do not split the operands (``tensor``'s piece of a vocabulary); the
    partial sums are then reduce-scattered over the axes that split both the operands and the
    parameter (FSDP's) and all-reduced over the other axes that split the operands. Left to the
    partitioner, a partial sum formed by a scatter is all-reduced whole first. None outside a
    plain step (no layout, a vmapped or partly manual trace), where the operands lie whole on
    every device, or where one dimension is split both ways."""
    context = step_context.current()
    layout = context.layout
    traced = jax.sharding.get_abstract_mesh()
    if layout is None or context.vmapped or (not traced.empty and traced.manual_axes):
        return None
    mesh, rules = layout.mesh, layout.param_rules
    in_specs = [logical_to_spec(axes, x.shape, rules, mesh) for x, axes in zip(operands, operand_axes, strict=True)]
    summing = {a for spec in in_specs for entry in spec for a in _axes_of(entry)}
    out_spec = logical_to_spec(out_axes, out_shape, rules, mesh)
    per_dim = [_axes_of(entry) for entry in out_spec]
    if not summing or any(set(axes) & summing and set(axes) - summing for axes in per_dim):
        return None
    scattered = [axes if set(axes) <= summing else () for axes in per_dim]
    summed_only = tuple(a for a in mesh.axis_names if a in summing and not any(a in axes for axes in scattered))

    def per_device(*parts):
        blocks = []
        for dim, axes in zip(out_shape, per_dim, strict=True):
            owned = () if set(axes) <= summing else axes
            size = dim // _prod(mesh.shape[a] for a in owned)
            blocks.append((_linear_index(owned) * size, size))
        total = local_sum(*parts, tuple(blocks))
        for dim, axes in enumerate(scattered):
            if axes:
                total = jax.lax.psum_scatter(total, axes, scatter_dimension=dim, tiled=True)
        return jax.lax.psum(total, summed_only) if summed_only else total

    return jax.shard_map(per_device, mesh=mesh, in_specs=tuple(in_specs), out_specs=out_spec, check_vma=False)(*operands)


def _axes_of(entry) -> tuple[str, ...]:
    return (entry,) if isinstance(entry, str) else tuple(entry or ())


def _linear_index(axes: Sequence[str]):
    """This device's index over ``axes`` taken together, the first the major (a PartitionSpec's order)."""
    index = 0
    for a in axes:
        index = index * jax.lax.axis_size(a) + jax.lax.axis_index(a)
    return index
