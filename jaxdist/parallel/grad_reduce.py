"""Gradient reduction across the batch axes in bfloat16, int8 or top-k, with error feedback.

``parallel.grad_reduce=float32`` is GSPMD's own reduction (``jaxdist.training.step``). The
other modes need to choose what crosses the wire, so here each device first computes
its own, unreduced gradient (``per_device_gradients``: a ``shard_map`` over the batch
axes whose outputs gain a leading device axis), then ``reduce_gradients`` reduces them
in a second ``shard_map`` where every device sees its flat local piece:

- ``bfloat16`` and ``int8`` (ZeRO++'s qgZ): encode (bf16; or int8 with one fp32 scale
  per ``BLOCK`` values), all-to-all so that each device receives 1/n of the vector from
  everyone, decode and sum in fp32 (nothing is summed in low precision), encode that
  sum, all-gather it: 1/2 and about 1/4 of an fp32 all-reduce's bytes. ``fp4`` (DiLoCo's
  outer average only): e2m1 codes, two to a byte, with one fp32 scale per ``FP4_BLOCK``
  values: about 1/7 of fp32's bytes.
- ``topk``: the vector is cut into n chunks; each device keeps the largest
  ``fraction`` of every block of ``TOPK_BLOCK`` values (fp32 values + 16-bit indices),
  all-to-all hands chunk j to device j, which sums what it received, keeps the largest
  ``fraction`` of each block of the sum and all-gathers those. Bytes: about 1.5 x
  fraction of an fp32 all-reduce, whatever n is (an all-gather of every device's picks
  would grow with n).

Error feedback: what a device's compression dropped -- and, for the chunk it owns, what
re-compressing the sum dropped -- is its residual, added to its next gradient. The
dropped part of the *sum* may sit on one device because the next step sums again.

``compress_axes=dcn`` (hierarchical): fp32 reduce-scatter over the batch axes inside a
host, the compressed reduction of that shard across hosts, fp32 all-gather inside.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxdist.config import Config
from jaxdist.errors import MeshError
from jaxdist.layout.mesh import INNER_BATCH_AXES
from jaxdist.parallel.microbatch import accumulate, split_for_accumulation

log = logging.getLogger(__name__)

BLOCK = 256  # int8: values per fp32 scale (1.6% overhead)
TOPK_BLOCK = 4096  # topk: entries are chosen per block of this many values (indices fit 16 bits)
MODES = ("float32", "bfloat16", "int8", "topk")
FP4_BLOCK = 64  # fp4: values per fp32 scale (1/8 more bytes)
# e2m1's magnitudes (OCP MX FP4): a code's low three bits index them, its fourth is the sign
FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)


@dataclasses.dataclass(frozen=True)
class ReducePlan:
    mode: str  # bfloat16 | int8 | topk
    compressed_axes: tuple[str, ...]  # batch axes the compressed reduction crosses
    full_axes: tuple[str, ...]  # batch axes reduced in fp32 first (inside a host, compress_axes=dcn)
    topk_fraction: float
    error_feedback: bool

    @property
    def axes(self) -> tuple[str, ...]:
        return self.full_axes + self.compressed_axes


def plan_reduction(parallel_cfg, mesh_sizes: dict[str, int], dcn_sizes: dict[str, int] | None) -> ReducePlan:
    """The reduction ``parallel.*`` asks for on this mesh (``dcn_sizes``: the across-host
    part, None on one host; ``compress_axes=dcn`` then compresses nothing). Raises
    ValueError for a DCN split the scheme cannot follow."""
    batch = tuple(a for a in INNER_BATCH_AXES if mesh_sizes.get(a, 1) > 1)
    if parallel_cfg.compress_axes == "all":
        compressed = batch
    elif not dcn_sizes:  # one process: nothing crosses hosts
        compressed = ()
    else:
        compressed = tuple(a for a in batch if dcn_sizes.get(a, 1) > 1)
        split = [a for a in compressed if dcn_sizes[a] != mesh_sizes[a]]
        if split:
            raise ValueError(
                f"parallel.compress_axes=dcn needs each batch axis to lie wholly across or wholly inside hosts; "
                f"{', '.join(f'{a}={mesh_sizes[a]} spans {dcn_sizes[a]} hosts' for a in split)} (e.g. --mesh data=HOSTS,fsdp=DEVICES_PER_HOST)"
            )
    feedback = parallel_cfg.error_feedback
    if feedback is None:
        feedback = parallel_cfg.grad_reduce in ("int8", "topk")
    full = tuple(a for a in batch if a not in compressed)
    return ReducePlan(parallel_cfg.grad_reduce, compressed, full, parallel_cfg.grad_topk_fraction, bool(feedback))


# -- the collectives (inside shard_map: x is this device's flat fp32 vector) ----------------


def _axis_size(axes: tuple[str, ...]) -> int:
    return math.prod(jax.lax.axis_size(a) for a in axes) if axes else 1


class _Codec:
    """How a chunk of fp32 values is sent: ``encode`` -> arrays to move, ``decode`` back."""

    def __init__(self, mode: str):
        self.mode = mode
        self.unit = {"int8": BLOCK, "fp4": FP4_BLOCK}.get(mode, 1)  # chunk lengths must be multiples of this

    def encode(self, x: jax.Array) -> tuple[jax.Array, ...]:
        if self.mode == "bfloat16":
            # Round to nearest even on the raw bits: integer ops vectorise on XLA's CPU backend
            # where bf16 converts do not, and XLA cannot move an up-cast before the collective.
            bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
            bits = bits + jnp.uint32(0x7FFF) + ((bits >> 16) & jnp.uint32(1))
            return ((bits >> 16).astype(jnp.uint16),)
        if self.mode == "fp4":
            return _fp4_encode(x)
        blocks = x.reshape(*x.shape[:-1], -1, BLOCK)
        scale = jnp.max(jnp.abs(blocks), axis=-1, keepdims=True) / 127.0
        q = jnp.round(blocks / jnp.where(scale > 0, scale, 1.0)).astype(jnp.int8)
        return q, scale

    def decode(self, parts: tuple[jax.Array, ...]) -> jax.Array:
        if self.mode == "bfloat16":
            return jax.lax.bitcast_convert_type(parts[0].astype(jnp.uint32) << 16, jnp.float32)
        if self.mode == "fp4":
            return _fp4_decode(*parts)
        q, scale = parts
        blocks = q.astype(jnp.float32) * scale
        return blocks.reshape(*blocks.shape[:-2], -1)


def _fp4_encode(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """[..., m] -> (uint8 [..., m / FP4_BLOCK, FP4_BLOCK / 2]: two e2m1 codes a byte, fp32
    scales [..., m / FP4_BLOCK, 1]); each magnitude rounds to the nearest e2m1 value."""
    blocks = x.reshape(*x.shape[:-1], -1, FP4_BLOCK)
    scale = jnp.max(jnp.abs(blocks), axis=-1, keepdims=True) / FP4_VALUES[-1]
    q = blocks / jnp.where(scale > 0, scale, 1.0)
    midpoints = jnp.asarray((FP4_VALUES[1:] + FP4_VALUES[:-1]) / 2)
    code = jnp.searchsorted(midpoints, jnp.abs(q)).astype(jnp.uint8) | jnp.where(q < 0, jnp.uint8(8), jnp.uint8(0))
    pairs = code.reshape(*code.shape[:-1], FP4_BLOCK // 2, 2)
    return pairs[..., 0] | (pairs[..., 1] << 4), scale


def _fp4_decode(packed: jax.Array, scale: jax.Array) -> jax.Array:
    code = jnp.stack([packed & 15, packed >> 4], axis=-1).reshape(*packed.shape[:-1], FP4_BLOCK)
    value = jnp.asarray(FP4_VALUES)[code & 7] * jnp.where(code >= 8, -1.0, 1.0) * scale
    return value.reshape(*value.shape[:-2], -1)


def _quantized_allreduce(chunks: jax.Array, axes: tuple[str, ...], codec: _Codec) -> tuple[jax.Array, jax.Array]:
    """chunks [n, m] -> (sum over devices [n, m], what was dropped here). Only encoded values
    cross the wire, and sums are taken in fp32 (XLA's CPU all-reduce would promote bf16 to
    fp32 on the wire; an all-to-all and an all-gather move exactly what they are given)."""
    encoded = codec.encode(chunks)
    dropped = chunks - codec.decode(encoded)
    received = codec.decode(tuple(jax.lax.all_to_all(p, axes, 0, 0, tiled=True) for p in encoded))
    owned = jnp.sum(received, axis=0)  # fp32 sum of everyone's copy of my chunk
    owned_encoded = codec.encode(owned)
    dropped = dropped.at[jax.lax.axis_index(axes)].add(owned - codec.decode(owned_encoded))
    total = codec.decode(tuple(jax.lax.all_gather(p, axes) for p in owned_encoded))
    return total, dropped


def _top_entries(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """(values, uint16 indices) of the k largest |x| along the last axis (a TOPK_BLOCK)."""
    _, index = jax.lax.top_k(jnp.abs(x), k)
    return jnp.take_along_axis(x, index, axis=-1), index.astype(jnp.uint16)


def _scatter_blocks(values: jax.Array, index: jax.Array) -> jax.Array:
    """[..., k] values at [..., k] in-block indices -> dense [..., TOPK_BLOCK]."""
    lead = jnp.indices(values.shape, sparse=True)[:-1]
    return jnp.zeros((*values.shape[:-1], TOPK_BLOCK), values.dtype).at[(*lead, index.astype(jnp.int32))].set(values)


def _topk_allreduce(chunks: jax.Array, axes: tuple[str, ...], fraction: float) -> tuple[jax.Array, jax.Array]:
    """chunks [n, m] (m a multiple of TOPK_BLOCK) -> (sum over devices, what was dropped
    here). Selection is per block of TOPK_BLOCK values: small sorts (XLA's CPU top-k over a
    whole chunk took seconds) and 16-bit indices."""
    n, m = chunks.shape
    k = max(1, round(fraction * TOPK_BLOCK))
    blocks = chunks.reshape(n, m // TOPK_BLOCK, TOPK_BLOCK)
    values, index = _top_entries(blocks, k)
    dropped = blocks - _scatter_blocks(values, index)
    values, index = jax.lax.all_to_all(values, axes, 0, 0, tiled=True), jax.lax.all_to_all(index, axes, 0, 0, tiled=True)
    owned = jnp.sum(_scatter_blocks(values, index), axis=0)  # everyone's picks in my chunk, summed
    kept, kept_index = _top_entries(owned, k)
    dropped = dropped.at[jax.lax.axis_index(axes)].add(owned - _scatter_blocks(kept, kept_index))
    total = _scatter_blocks(jax.lax.all_gather(kept, axes), jax.lax.all_gather(kept_index, axes))
    return total.reshape(n, m), dropped.reshape(n, m)


def _compressed_allreduce(x: jax.Array, plan: ReducePlan) -> tuple[jax.Array, jax.Array]:
    """x [L] -> (sum over ``plan.compressed_axes``, what this device's compression dropped)."""
    axes = plan.compressed_axes
    if not axes:
        return x, jnp.zeros_like(x)
    n = _axis_size(axes)
    codec = None if plan.mode == "topk" else _Codec(plan.mode)
    padded = jnp.pad(x, (0, -x.size % (n * (codec.unit if codec else TOPK_BLOCK)))).reshape(n, -1)
    if codec is None:
        total, dropped = _topk_allreduce(padded, axes, plan.topk_fraction)
    else:
        total, dropped = _quantized_allreduce(padded, axes, codec)
    return total.reshape(-1)[: x.size], dropped.reshape(-1)[: x.size]


def _reduce_flat(x: jax.Array, residual: jax.Array | None, plan: ReducePlan) -> tuple[jax.Array, jax.Array | None]:
    """One leaf on one device: (the reduced vector, the new residual)."""
    size = x.size
    if plan.full_axes:  # hierarchical: fp32 inside a host first, then compress this device's shard
        parts = _axis_size(plan.full_axes)
        x = jnp.pad(x, (0, -size % parts))
        shard = jax.lax.psum_scatter(x, plan.full_axes, scatter_dimension=0, tiled=True)
        start = jax.lax.axis_index(plan.full_axes) * shard.size
        if residual is not None:
            padded_residual = jnp.pad(residual, (0, -size % parts))
            shard = shard + jax.lax.dynamic_slice(padded_residual, (start,), (shard.size,))
        total, dropped = _compressed_allreduce(shard, plan)
        total = jax.lax.all_gather(total, plan.full_axes, tiled=True)[:size]
        if residual is None:
            return total, None
        # only this device's shard of the residual is ever used: the rest stays zero
        return total, jax.lax.dynamic_update_slice(jnp.zeros_like(padded_residual), dropped, (start,))[:size]
    if residual is not None:
        x = x + residual
    total, dropped = _compressed_allreduce(x, plan)
    return total, (dropped if residual is not None else None)


# -- the two shard_maps ---------------------------------------------------------------------


def _strip_batch_axes(spec: PartitionSpec) -> tuple:
    """A parameter's spec without the batch axes (FSDP's)."""

    def keep(entry):
        if entry is None:
            return None
        names = tuple(a for a in (entry if isinstance(entry, tuple) else (entry,)) if a not in INNER_BATCH_AXES)
        return names if len(names) > 1 else (names[0] if names else None)

    return tuple(keep(e) for e in spec)


def per_device_shardings(param_shardings: Any, mesh) -> Any:
    """Shardings of per-device gradients / residuals: a leading axis over the batch axes,
    the parameter's tensor (and other non-batch) sharding after it."""
    return jax.tree.map(lambda s: NamedSharding(mesh, PartitionSpec(INNER_BATCH_AXES, *_strip_batch_axes(s.spec))), param_shardings)


def per_device_gradients(grad_fn: Callable, params: Any, batch: Any, mesh, microbatched: bool) -> tuple[jax.Array, jax.Array, Any, Any]:
    """(loss sum, weight, statistics) summed over devices and each device's own gradient sum, stacked on
    a leading device axis. ``grad_fn(params, batch) -> ((loss_sum, weight, stats), grads)``;
    ``microbatched``: ``batch`` leaves are [M, B/M, ...], scanned locally."""

    def local(params, rows):
        if microbatched:
            loss_sum, weight, stats, grads = accumulate(grad_fn, params, rows)
        else:
            (loss_sum, weight, stats), grads = grad_fn(params, rows)
        loss_sum, weight, stats = jax.lax.psum((loss_sum, weight, stats), INNER_BATCH_AXES)
        return loss_sum, weight, stats, jax.tree.map(lambda g: g[None].astype(jnp.float32), grads)

    rows = PartitionSpec(None, INNER_BATCH_AXES) if microbatched else PartitionSpec(INNER_BATCH_AXES)
    return jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(PartitionSpec(), rows),  # FSDP shards are gathered once, at entry
        out_specs=(PartitionSpec(), PartitionSpec(), PartitionSpec(), PartitionSpec(INNER_BATCH_AXES)),
        axis_names=set(INNER_BATCH_AXES),
        check_vma=False,
    )(params, batch)


def reduce_gradients(grads: Any, residual: Any, plan: ReducePlan, param_shardings: Any, mesh, device_specs: Any = None) -> tuple[Any, Any]:
    """Per-device gradients [n, ...] -> (their sum, replicated over the batch axes and then
    laid out like the parameters; the new residuals, or None without error feedback).
    ``device_specs``: the stacked inputs' specs when their leading axis is not the batch
    axes' (DiLoCo's replica deltas)."""
    if device_specs is None:
        device_specs = jax.tree.map(lambda s: s.spec, per_device_shardings(param_shardings, mesh))
    summed_specs = jax.tree.map(lambda s: PartitionSpec(*s[1:]), device_specs)

    def local(grads, residual=None):
        # One flat buffer for every leaf: a few large collectives rather than one per tensor.
        leaves, treedef = jax.tree.flatten(grads)
        offsets = np.cumsum([0] + [x.size for x in leaves])

        def flat(xs):
            return jnp.concatenate([x.reshape(-1) for x in xs])

        def unflat(v, drop_device_axis: bool):
            pieces = [
                v[a:b].reshape(x.shape[1:] if drop_device_axis else x.shape)
                for a, b, x in zip(offsets[:-1], offsets[1:], leaves, strict=True)
            ]
            return jax.tree.unflatten(treedef, pieces)

        total, new_residual = _reduce_flat(flat(leaves), None if residual is None else flat(jax.tree.leaves(residual)), plan)
        totals = unflat(total, drop_device_axis=True)
        return totals if residual is None else (totals, unflat(new_residual, drop_device_axis=False))

    if residual is None:
        totals = jax.shard_map(local, mesh=mesh, in_specs=(device_specs,), out_specs=summed_specs, check_vma=False)(grads)
    else:
        totals, residual = jax.shard_map(
            local, mesh=mesh, in_specs=(device_specs, device_specs), out_specs=(summed_specs, device_specs), check_vma=False
        )(grads, residual)
    return jax.lax.with_sharding_constraint(totals, param_shardings), residual


# -- the step's reduction ---------------------------------------------------------------------


class CompressedReduction:
    """The step's reduction (``training.step``) under ``parallel.grad_reduce``'s codec: each
    device's own gradients, then ``reduce_gradients``."""

    def __init__(self, plan: ReducePlan, microbatches: int, mesh, param_shardings: Any):
        self.plan, self.microbatches, self.mesh, self.param_shardings = plan, microbatches, mesh, param_shardings

    def __call__(self, grad_fn: Callable, params: Any, batch: Any, residual: Any, scale: jax.Array | None):
        microbatched = self.microbatches > 1
        rows = split_for_accumulation(batch, self.microbatches, self.mesh) if microbatched else batch
        loss_sum, weight, stats, local = per_device_gradients(grad_fn, params, rows, self.mesh, microbatched)
        # Residuals are kept unscaled (gradient units of the loss sum): under fp16 the scale
        # moves between steps, and a residual carried in the old scale's units would count
        # twice after an overflow halves it (half after growth).
        if scale is not None and residual is not None:
            residual = jax.tree.map(lambda r: r * scale, residual)
        grads, residual = reduce_gradients(local, residual, self.plan, self.param_shardings, self.mesh)
        if scale is not None and residual is not None:
            residual = jax.tree.map(lambda r: r / scale, residual)
        return loss_sum, weight, stats, grads, residual


def reduce_plan(config: Config, mesh) -> ReducePlan | None:
    """The compressed gradient reduction ``parallel.grad_reduce`` asks for (None: GSPMD's fp32),
    saying in one line when it reduces less than asked."""
    p = config.parallel
    if p.grad_reduce == "float32":
        return None
    hosts = _hosts_along_axes(mesh) if jax.process_count() > 1 else None
    try:
        plan = plan_reduction(p, dict(mesh.shape), hosts)
    except ValueError as e:
        raise MeshError(str(e)) from None
    if p.compress_axes == "dcn" and not plan.compressed_axes:
        where = "one process" if hosts is None else "no batch axis crosses processes"
        log.info(
            f"parallel.compress_axes=dcn on {where}: no gradient crosses hosts, so nothing is compressed "
            f"(parallel.grad_reduce={p.grad_reduce} has no effect); gradients reduce in float32"
        )
        return None
    return plan


def not_once_per_step(config: Config, mesh_shape: dict[str, int], replicas: int) -> list[str]:
    """Why replicated parameters' gradients cannot be accumulated per device and reduced once per
    step (DDP's no_sync) on this layout: the reduction then runs after each microbatch."""
    reasons = {
        "DiLoCo's replicas (the per-device accumulation cannot run under the replica vmap)": bool(replicas),
        "a pipe axis": mesh_shape.get("pipe", 1) > 1,
        "MoE layers (their routing statistics are global)": config.model.kind == "llama" and config.model.moe_experts > 0,
        "a context axis (its attention is a shard_map over the whole mesh, which cannot nest in one over the batch axes)": (
            mesh_shape.get("context", 1) > 1
        ),
    }
    return [reason for reason, holds in reasons.items() if holds]


def say_what_reduces(config: Config, layout, plan: ReducePlan | None, replicas: int) -> None:
    """One line for each weaker path the reduction takes."""
    shape = dict(layout.mesh.shape)
    batch_shards = math.prod(shape.get(a, 1) for a in INNER_BATCH_AXES)
    held = not_once_per_step(config, shape, replicas)
    if plan is None and held and batch_shards > 1 and config.train.microbatches > 1 and layout.strategy.zero in ("dp", "zero1"):
        log.info(
            f"train.microbatches={config.train.microbatches}: gradients are reduced after each microbatch, not once per step "
            f"as replicated parameters allow, because of {' and '.join(held)}"
        )
    if plan is None:
        return
    if layout.strategy.zero == "fsdp":
        log.info(
            f"parallel.grad_reduce={plan.mode} with fsdp: parameters are gathered once per step and gradients all-reduced "
            "(ZeRO-2-like memory during the step), not FSDP's per-layer gather and reduce-scatter"
        )
    if config.parallel.compress_axes == "dcn" and plan.full_axes:
        log.info(
            f"gradients reduce in float32 over {','.join(plan.full_axes)} (inside hosts) and in {plan.mode} over "
            f"{','.join(plan.compressed_axes) or 'nothing'} (across hosts)"
        )


def _hosts_along_axes(mesh) -> dict[str, int]:
    """For each mesh axis, how many processes the devices along it belong to."""
    devices = mesh.devices
    out = {}
    for i, axis in enumerate(mesh.axis_names):
        line = devices[tuple(slice(None) if j == i else 0 for j in range(devices.ndim))]
        out[axis] = len({d.process_index for d in line})
    return out
