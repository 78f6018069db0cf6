"""Splitting a batch into microbatches (gradient accumulation, pipeline schedules)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from jaxdist.layout.mesh import INNER_BATCH_AXES
from jaxdist.models.fp8 import add_gradients


def split_microbatches(x: jax.Array, m: int) -> jax.Array:
    """[B, ...] -> [M, B/M, ...] taking every M-th row, so each device keeps its own rows
    (a contiguous split would move rows between the devices of the batch axes)."""
    return jnp.swapaxes(x.reshape(x.shape[0] // m, m, *x.shape[1:]), 0, 1)


def split_for_accumulation(batch: Any, microbatches: int, mesh) -> Any:
    """A batch's every array [B, ...] -> [M, B/M, ...] (``split_microbatches``), each device's rows
    kept on it (the microbatch axis unsharded, the rows over the batch axes)."""

    def split(x: jax.Array) -> jax.Array:
        x = split_microbatches(x, microbatches)
        spec = PartitionSpec(None, INNER_BATCH_AXES, *([None] * (x.ndim - 2)))
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))

    return jax.tree.map(split, batch)


def merge_microbatches(x: jax.Array) -> jax.Array:
    """The inverse of ``split_microbatches``: [M, B/M, ...] -> [B, ...]."""
    return jnp.swapaxes(x, 0, 1).reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def accumulate(grad_fn: Callable, params: Any, microbatches: Any, zeros: Any = None) -> tuple[jax.Array, jax.Array, Any, Any]:
    """Gradient accumulation, the one scan every path uses: (loss sum, weight, statistics,
    gradients) summed over the leading axis of ``microbatches``, for ``grad_fn(params,
    microbatch) -> ((loss sum, weight, statistics), grads)``. ``zeros``: the gradient
    accumulator's start (default: zeros like ``params``; GSPMD callers pass one constrained
    to the parameters' layout). fp8 amax observations (``models.fp8``) combine by max. A
    ``grad_fn.before_loop(params)`` context (``training.step.grad_fn``) is entered around the
    loop: what it computes from ``params`` (fp8's quantised weights) is done once, not per
    microbatch."""

    def add(carry, microbatch):
        (loss_sum, weight, stats), grads = grad_fn(params, microbatch)
        return add_gradients(carry, (loss_sum, weight, stats, grads)), None

    grads = jax.tree.map(jnp.zeros_like, params) if zeros is None else zeros
    first = jax.tree.map(lambda x: x[0], microbatches)
    (_, _, stats_shape), _ = jax.eval_shape(grad_fn, params, first)
    stats = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), stats_shape)
    with getattr(grad_fn, "before_loop", lambda params: contextlib.nullcontext())(params):
        sums, _ = jax.lax.scan(add, (jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32), stats, grads), microbatches)
    return sums
