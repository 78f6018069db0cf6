"""What every pipeline schedule shares: the stage-major weight layout, ring shifts over
``pipe``, and the head and loss spread over the stages (1/S of every sequence each)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxdist.parallel.schedule import PipelineSpec


def stage_major(layer_params: Any, spec: PipelineSpec) -> Any:
    """[L, ...] -> [S, V, K, ...] with chunk (s, v) = layers (v S + s) K ... (v S + s + 1) K.

    For V = 1 this is a free reshape of the pipe-sharded layer axis; for V > 1 the
    interleaved order differs from the contiguous storage and XLA moves the weights.
    """
    s, v = spec.stages, spec.virtual

    def one(x):
        k = x.shape[0] // (s * v)
        return jnp.swapaxes(x.reshape(v, s, k, *x.shape[1:]), 0, 1)

    return jax.tree.map(one, layer_params)


def layer_major(staged: Any, like: Any) -> Any:
    """The inverse of ``stage_major``: [S, V, K, ...] -> [L, ...], in ``like``'s dtypes."""
    return jax.tree.map(lambda g, p: jnp.swapaxes(g, 0, 1).reshape(p.shape).astype(p.dtype), staged, like)


def index(tree: Any, i: jax.Array) -> Any:
    return jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, i, 0, keepdims=False), tree)


def shift(x: Any, stages: int, step: int) -> Any:
    """Send to the stage ``step`` further along the ring (1: right, -1: left); the ends wrap."""
    return jax.lax.ppermute(x, "pipe", [(j, (j + step) % stages) for j in range(stages)])


def set_where(buffer: jax.Array, i: jax.Array, cond: jax.Array, value: jax.Array) -> jax.Array:
    """``buffer`` with row i set to ``value`` where ``cond`` (in place: only the row is touched)."""
    return buffer.at[i].set(jnp.where(cond, value.astype(buffer.dtype), buffer[i]))


def my_piece(x: jax.Array, axis: int, stages: int) -> jax.Array:
    """This stage's 1/S of ``x`` along ``axis`` (the sequence), the part of the head it runs."""
    n = x.shape[axis] // stages
    return jax.lax.dynamic_slice_in_dim(x, jax.lax.axis_index("pipe") * n, n, axis)


def from_last_stage(y: jax.Array, axis: int, stages: int) -> jax.Array:
    """The last stage's ``y``, cut along ``axis`` into S pieces, piece s to stage s (a reduce-scatter)."""
    last = jax.lax.axis_index("pipe") == stages - 1
    return jax.lax.psum_scatter(jnp.where(last, y, jnp.zeros_like(y)), "pipe", scatter_dimension=axis, tiled=True)
