"""The gradients of one step and how they cross devices: the loss's gradient function
(fp16's loss scale included), gradient accumulation over ``train.microbatches``, and the
reduction over the batch axes, XLA's own or a compressed codec.

Every reduction takes ``(grad_fn, params, batch, residual, scale)`` and returns the summed
loss, its weight (the targets counted), the model's summed statistics (MoE balancing;
``{}`` for a dense model), the summed gradients of ``loss sum x scale`` and the new
residuals:

- ``XlaReduction``: GSPMD places the reduction (all-reduce, or FSDP's reduce-scatter).
  For replicated parameters (DP, ZeRO-1) with several microbatches each device first
  accumulates its own gradients and they are reduced once per step, like DDP's
  ``no_sync``.
- ``CompressedReduction``: each device's own gradients, reduced by
  ``parallel.grad_reduce`` (bf16 / int8 / top-k) with error feedback.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from jaxdist.config import Config
from jaxdist.errors import MeshError
from jaxdist.layout.mesh import INNER_BATCH_AXES
from jaxdist.models import fp8
from jaxdist.parallel import grad_reduce
from jaxdist.parallel.microbatch import accumulate, split_microbatches
from jaxdist.parallel.pipeline import loss_cotangent

GradFn = Callable[[Any, Any], tuple[tuple[jax.Array, jax.Array, Any], Any]]  # (params, batch) -> ((loss sum, weight, stats), grads)


def grad_fn(loss: Callable, scale: jax.Array | None = None) -> GradFn:
    """``(params, batch) -> ((loss sum, weight, stats), gradients of the loss sum x scale)``
    for ``loss(params, batch) -> (loss sum, weight, stats)``."""

    def objective(params, batch):
        with loss_cotangent(scale):  # 1F1B runs its backward inside the forward: it needs the scale now
            loss_sum, weight, stats = loss(params, batch)
        return loss_sum if scale is None else loss_sum * scale, (loss_sum, weight, stats)

    scaled = jax.value_and_grad(objective, has_aux=True)

    def unwrapped(params, batch):
        (_, aux), grads = scaled(params, batch)
        return aux, grads

    return unwrapped


def split_for_accumulation(batch: Any, microbatches: int, mesh) -> Any:
    """[B, ...] -> [M, B/M, ...] taking every M-th row, so each device keeps its rows."""

    def split(x: jax.Array) -> jax.Array:
        x = split_microbatches(x, microbatches)
        spec = PartitionSpec(None, INNER_BATCH_AXES, *([None] * (x.ndim - 2)))
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))

    return jax.tree.map(split, batch)


class XlaReduction:
    """GSPMD's fp32 reduction; ``reduce_once``: accumulate per device, reduce once."""

    def __init__(self, microbatches: int, mesh, param_shardings: Any, reduce_once: bool):
        self.microbatches, self.mesh, self.param_shardings, self.reduce_once = microbatches, mesh, param_shardings, reduce_once

    def __call__(self, grad_fn: GradFn, params: Any, batch: Any, residual: Any, scale: jax.Array | None):
        if self.microbatches == 1:
            (loss_sum, weight, stats), grads = grad_fn(params, batch)
            return loss_sum, weight, stats, grads, residual
        microbatches = split_for_accumulation(batch, self.microbatches, self.mesh)
        if self.reduce_once:
            return (*self._reduced_once(grad_fn, params, microbatches), residual)
        zeros = jax.lax.with_sharding_constraint(jax.tree.map(jnp.zeros_like, params), self.param_shardings)
        return (*accumulate(grad_fn, params, microbatches, zeros), residual)

    def _reduced_once(self, grad_fn: GradFn, params: Any, microbatches: Any):
        def per_device(params, microbatches):
            return fp8.reduce_over(accumulate(grad_fn, params, microbatches), INNER_BATCH_AXES)  # psum; fp8 observations: pmax

        reduce_once = jax.shard_map(
            per_device,
            mesh=self.mesh,
            in_specs=(PartitionSpec(), PartitionSpec(None, INNER_BATCH_AXES)),
            out_specs=PartitionSpec(),  # loss sum, weight, statistics (sums over the batch) and gradients, reduced
            axis_names=set(INNER_BATCH_AXES),
            check_vma=False,
        )
        return reduce_once(params, microbatches)


class CompressedReduction:
    """Per-device gradients, reduced by ``parallel.grad_reduce``'s codec."""

    def __init__(self, plan: grad_reduce.ReducePlan, microbatches: int, mesh, param_shardings: Any):
        self.plan, self.microbatches, self.mesh, self.param_shardings = plan, microbatches, mesh, param_shardings

    def __call__(self, grad_fn: GradFn, params: Any, batch: Any, residual: Any, scale: jax.Array | None):
        microbatched = self.microbatches > 1
        rows = split_for_accumulation(batch, self.microbatches, self.mesh) if microbatched else batch
        loss_sum, weight, stats, local = grad_reduce.per_device_gradients(grad_fn, params, rows, self.mesh, microbatched)
        # Residuals are kept unscaled (gradient units of the loss sum): under fp16 the scale
        # moves between steps, and a residual carried in the old scale's units would count
        # twice after an overflow halves it (half after growth).
        if scale is not None and residual is not None:
            residual = jax.tree.map(lambda r: r * scale, residual)
        grads, residual = grad_reduce.reduce_gradients(local, residual, self.plan, self.param_shardings, self.mesh)
        if scale is not None and residual is not None:
            residual = jax.tree.map(lambda r: r / scale, residual)
        return loss_sum, weight, stats, grads, residual


def reduction_for(config: Config, layout, param_shardings: Any, plan: grad_reduce.ReducePlan | None, diloco: bool):
    """The reduction a config asks for on this layout."""
    mesh = layout.mesh
    microbatches = config.train.microbatches
    if plan is not None:
        return CompressedReduction(plan, microbatches, mesh, param_shardings)
    # Replicated parameters, no pipeline: accumulate each device's own gradients and reduce
    # once per step. (Not under DiLoCo's vmap: the shard_map over data/fsdp cannot take the
    # replica dimension. Not without a batch axis either: nothing to reduce, and XLA 0.10's
    # partitioner rejects the auto tensor axis's collectives inside a region manual over
    # size-1 axes only.)
    shape = mesh.shape
    batch_shards = math.prod(shape.get(a, 1) for a in INNER_BATCH_AXES)
    # (Not for MoE: its router statistics and expert dispatch are global, not per device.)
    moe = config.model.kind == "llama" and config.model.moe_experts > 0
    reduce_once = layout.strategy.zero in ("dp", "zero1") and shape.get("pipe", 1) == 1 and not diloco and batch_shards > 1 and not moe
    return XlaReduction(microbatches, mesh, param_shardings, reduce_once)


def reduce_plan(config: Config, mesh) -> tuple[grad_reduce.ReducePlan | None, list[str]]:
    """The compressed gradient reduction ``parallel.grad_reduce`` asks for (None: GSPMD's
    fp32), and the lines to say when it reduces less than asked."""
    p = config.parallel
    if p.grad_reduce == "float32":
        return None, []
    hosts = _hosts_along_axes(mesh) if jax.process_count() > 1 else None
    try:
        plan = grad_reduce.plan_reduction(p, dict(mesh.shape), hosts)
    except ValueError as e:
        raise MeshError(str(e)) from None
    if p.compress_axes == "dcn" and not plan.compressed_axes:
        where = "one process" if hosts is None else "no batch axis crosses processes"
        return None, [
            f"jaxdist: parallel.compress_axes=dcn on {where}: no gradient crosses hosts, so nothing is compressed "
            f"(parallel.grad_reduce={p.grad_reduce} has no effect); gradients reduce in float32"
        ]
    return plan, []


def reduction_notes(config: Config, layout, plan: grad_reduce.ReducePlan | None, diloco: bool) -> list[str]:
    """One line for each weaker path the reduction takes."""
    lines = []
    if diloco and config.train.microbatches > 1 and layout.strategy.zero in ("dp", "zero1"):
        lines.append(
            "jaxdist: DiLoCo with train.microbatches > 1: gradients are reduced inside each replica once per microbatch, "
            "not once per step (the per-device accumulation cannot run under the replica vmap)"
        )
    if plan is None:
        return lines
    if layout.strategy.zero == "fsdp":
        lines.append(
            f"jaxdist: parallel.grad_reduce={plan.mode} with fsdp: parameters are gathered once per step and gradients all-reduced "
            "(ZeRO-2-like memory during the step), not FSDP's per-layer gather and reduce-scatter"
        )
    if config.parallel.compress_axes == "dcn" and plan.full_axes:
        lines.append(
            f"jaxdist: gradients reduce in float32 over {','.join(plan.full_axes)} (inside hosts) and in {plan.mode} over "
            f"{','.join(plan.compressed_axes) or 'nothing'} (across hosts)"
        )
    return lines


def _hosts_along_axes(mesh) -> dict[str, int]:
    """For each mesh axis, how many processes the devices along it belong to."""
    devices = mesh.devices
    out = {}
    for i, axis in enumerate(mesh.axis_names):
        line = devices[tuple(slice(None) if j == i else 0 for j in range(devices.ndim))]
        out[axis] = len({d.process_index for d in line})
    return out
