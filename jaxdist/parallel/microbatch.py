"""Splitting a batch into microbatches (gradient accumulation, pipeline schedules)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def split_microbatches(x: jax.Array, m: int) -> jax.Array:
    """[B, ...] -> [M, B/M, ...] taking every M-th row, so each device keeps its own rows
    (a contiguous split would move rows between the devices of the batch axes)."""
    return jnp.swapaxes(x.reshape(x.shape[0] // m, m, *x.shape[1:]), 0, 1)


def merge_microbatches(x: jax.Array) -> jax.Array:
    """The inverse of ``split_microbatches``: [M, B/M, ...] -> [B, ...]."""
    return jnp.swapaxes(x, 0, 1).reshape(x.shape[0] * x.shape[1], *x.shape[2:])
