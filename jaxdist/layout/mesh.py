"""Mesh specs (``8x4``, ``data=2,fsdp=4``, ``auto``), the axes' order, and the device mesh.

Parsing is pure Python so that a spec is checked before JAX starts its backend; only
``build_mesh`` touches JAX (``jaxdist.layout.devices`` asks for fake CPU devices).
"""

from __future__ import annotations

import logging
import math
import re

from jaxdist.errors import MeshError

log = logging.getLogger(__name__)

# Mesh axes, outermost first: replica (DiLoCo's islands), data and pipe cross hosts,
# fsdp next; expert, context and tensor innermost (NVLink): expert's all-to-alls, context's
# K/V exchange and tensor's all-reduces run in every layer, on the step's critical path.
MESH_AXES = ("replica", "data", "pipe", "fsdp", "expert", "context", "tensor")
# What a positional spec means, by its number of factors.
POSITIONAL_AXES = {1: ("data",), 2: ("data", "tensor"), 3: ("data", "tensor", "pipe")}
# The axes that split the global batch: the one definition. Inside a DiLoCo replica
# (and for everything that is not DiLoCo, whose replica axis has size 1) they are data x fsdp
# x expert: the expert axis splits the batch for attention and the dense layers, so no
# device idles outside the experts, and its tokens travel to the experts by all-to-all.
BATCH_AXES = ("replica", "data", "fsdp", "expert")
INNER_BATCH_AXES = BATCH_AXES[1:]
REMAINING = -1  # an axis size meaning "the devices that remain"

MeshSizes = dict[str, int]


def parse_mesh(spec: str) -> MeshSizes | None:
    """``'8x4'`` -> data 8, tensor 4; ``'data=2,fsdp=4'`` -> named; ``'auto'`` -> None.

    One named axis may be ``-1`` (``data=-1,tensor=2``): ``resolve_mesh`` sizes it to the
    devices that remain once the device count is known.
    """
    spec = spec.strip()
    if spec == "auto":
        return None
    if re.fullmatch(r"\d+(x\d+)*", spec):
        factors = [int(f) for f in spec.split("x")]
        if len(factors) not in POSITIONAL_AXES:
            raise MeshError(
                f"mesh {spec!r}: a positional mesh is N (data), AxB (data x tensor) or AxBxC (data x tensor x pipe); name other axes, e.g. data=2,fsdp=2,tensor=2"
            )
        sizes = dict(zip(POSITIONAL_AXES[len(factors)], factors, strict=True))
    elif re.fullmatch(r"[a-z_]+=-?\d+(,[a-z_]+=-?\d+)*", spec):
        sizes = {}
        for item in spec.split(","):
            name, value = item.split("=")
            if name not in MESH_AXES:
                raise MeshError(f"mesh {spec!r}: unknown axis {name!r} (axes: {', '.join(MESH_AXES)})")
            if name in sizes:
                raise MeshError(f"mesh {spec!r}: axis {name!r} given twice")
            sizes[name] = int(value)
    else:
        raise MeshError(f"malformed mesh {spec!r}: use AxB (data x tensor), name=size,... ({', '.join(MESH_AXES)}) or auto")
    if any(v < 1 and v != REMAINING for v in sizes.values()):
        raise MeshError(f"mesh {spec!r}: axis sizes must be >= 1, or -1 for the devices that remain")
    if list(sizes.values()).count(REMAINING) > 1:
        raise MeshError(f"mesh {spec!r}: only one axis may be -1")
    return {axis: sizes.get(axis, 1) for axis in MESH_AXES}


def has_remaining_axis(sizes: MeshSizes | None) -> bool:
    return sizes is not None and REMAINING in sizes.values()


def resolve_mesh(sizes: MeshSizes, n_devices: int) -> MeshSizes:
    """Size the ``-1`` axis (if any) so that the mesh uses all ``n_devices``."""
    if not has_remaining_axis(sizes):
        return sizes
    fixed = math.prod(v for v in sizes.values() if v != REMAINING)
    if n_devices % fixed:
        raise MeshError(f"mesh {format_mesh(sizes)}: the other axes ({fixed} devices) do not divide the {n_devices} devices")
    return {a: (n_devices // fixed if v == REMAINING else v) for a, v in sizes.items()}


def format_mesh(sizes: MeshSizes) -> str:
    named = [f"{a}={s}" for a, s in sizes.items() if s != 1]
    return ",".join(named) or "data=1"


def mesh_device_count(sizes: MeshSizes) -> int:
    return math.prod(sizes.values())


def auto_mesh(n_devices: int, n_params: int) -> MeshSizes:
    """Small models replicate (plain DP is fastest); past 1B params shard them (ZeRO-3)."""
    axis = "fsdp" if n_params > 1_000_000_000 else "data"
    return {a: (n_devices if a == axis else 1) for a in MESH_AXES}


def split_across_hosts(sizes: MeshSizes, n_hosts: int, dcn: MeshSizes | None = None) -> tuple[MeshSizes, MeshSizes]:
    """(within-host, across-host) sizes per axis; their product is ``sizes``.

    Derived when not given: data crosses hosts first, then fsdp, so tensor-parallel
    collectives stay on NVLink. Returns a warning-worthy split only if tensor must cross.
    """
    if dcn is None:
        dcn, remaining = {}, n_hosts
        for axis in MESH_AXES:  # outermost first: data, pipe, fsdp, then (only if forced) tensor
            factor = math.gcd(sizes[axis], remaining)
            dcn[axis], remaining = factor, remaining // factor
        if remaining > 1:
            raise MeshError(f"mesh {format_mesh(sizes)} cannot be split over {n_hosts} hosts (processes)")
    else:
        dcn = {a: dcn.get(a, 1) for a in MESH_AXES}
        if math.prod(dcn.values()) != n_hosts:
            raise MeshError(f"--dcn-mesh {format_mesh(dcn)} spans {math.prod(dcn.values())} hosts but the run has {n_hosts} processes")
        for axis in MESH_AXES:
            if sizes[axis] % dcn[axis]:
                raise MeshError(f"--dcn-mesh: {axis}={dcn[axis]} does not divide the mesh's {axis}={sizes[axis]}")
    ici = {a: sizes[a] // dcn[a] for a in MESH_AXES}
    return ici, dcn


def build_mesh(sizes: MeshSizes, devices=None, dcn: MeshSizes | None = None, *, ordered: bool = False):
    """A ``jax.sharding.Mesh`` with every axis present (size 1 if unused), Auto axis types.

    With several processes the mesh is hybrid: each axis is split into a within-host
    and an across-host part (JAX's hybrid device mesh, a process per granule).
    ``ordered``: ``devices`` (one per process) are laid out in the order given, which an
    in-process recovery chose (``cluster.recoverable.fresh_device_order``).
    """
    import jax
    from jax.experimental import mesh_utils
    from jax.sharding import AxisType, Mesh

    available = jax.devices() if devices is None else list(devices)
    needed = mesh_device_count(sizes)
    if needed > len(available):
        kind = available[0].platform
        hint = "" if kind != "cpu" else " (set XLA_FLAGS=--xla_force_host_platform_device_count before JAX starts)"
        raise MeshError(f"mesh {format_mesh(sizes)} needs {needed} devices but {len(available)} {kind} devices are visible{hint}")
    if needed < len(available) and available[0].platform != "cpu" and devices is None:
        raise MeshError(f"mesh {format_mesh(sizes)} uses {needed} of the {len(available)} visible devices; size it to all of them")
    axis_types = (AxisType.Auto,) * len(MESH_AXES)
    processes = len({d.process_index for d in available[:needed]})
    if ordered:
        import numpy as np

        return Mesh(np.array(available[:needed]).reshape(tuple(sizes[a] for a in MESH_AXES)), MESH_AXES, axis_types=axis_types)
    if processes == 1:
        shape = tuple(sizes[a] for a in MESH_AXES)
        return jax.make_mesh(shape, MESH_AXES, axis_types=axis_types, devices=available[:needed])
    ici, dcn = split_across_hosts(sizes, processes, dcn)
    if dcn["tensor"] > 1:
        log.warning(f"the tensor axis spans {dcn['tensor']} hosts; its per-layer all-reduces will cross the network")
    grid = mesh_utils.create_hybrid_device_mesh(
        [ici[a] for a in MESH_AXES], [dcn[a] for a in MESH_AXES], available[:needed], process_is_granule=True
    )
    return Mesh(grid, MESH_AXES, axis_types=axis_types)
