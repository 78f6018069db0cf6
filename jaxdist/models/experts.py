"""Routed experts on one device's tokens: sort by expert, one grouped matmul, combine.

The computation every MoE path shares (``models.moe`` calls it directly on one device,
``parallel.expert`` inside its ``shard_map`` around an all-to-all):

- dispatch: the tokens x k assignments are stable-sorted by expert, so each expert's rows
  are contiguous (token order breaks ties: with a capacity the earliest tokens are kept);
- compute: one grouped matmul per projection over the groups (a SwiGLU per expert); rows
  past the used groups are masked, never trusted. Which grouped matmul (``expert_compute``):
  on a GPU jaxdist's Pallas Triton grouped GEMM (``models.grouped_gemm``: each routed row's
  work once, forward and both gradients), since XLA:GPU (jaxlib 0.10.2) expands
  ``jax.lax.ragged_dot`` densely; elsewhere ``jax.lax.ragged_dot`` (XLA:CPU's is dense too:
  exact, E times the work; TPU has its own). ``JAXDIST_MOE_KERNEL=ragged_dot`` keeps
  ``ragged_dot`` on a GPU (dense, said in one line);
- combine: each assignment's row is gathered back to its (token, slot) by the inverse
  permutation and the k slots summed in float32 with their gates: no scatter-add, so the
  result does not depend on the order atomics land in.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxdist.layout.capacity import capacity_rows, ceil_scaled  # noqa: F401 - the kernels' sizes, re-exported
from jaxdist.models import fp8
from jaxdist.models.grouped_gemm import grouped_matmul
from jaxdist.models.layers import swiglu

# What a buffer row nothing was written to holds. Tests set NaN: a row that is read without
# being written (or an unused row that is not masked) then shows, where a zero would hide.
UNWRITTEN = 0.0

# (rows [r, d] grouped by expert, group sizes [G], w_gate_up, w_down) -> outputs [r, d] fp32, 0 past the groups
ExpertCompute = Callable[[jax.Array, jax.Array, jax.Array, jax.Array], jax.Array]
# (rows [r, K] grouped, weights [G, K, N], group sizes [G]) -> float32 [r, N]
GroupedMatmul = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]

KERNEL_ENV = "JAXDIST_MOE_KERNEL"  # grouped_gemm (a GPU's default) | ragged_dot


def ragged_matmul(rows: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """``jax.lax.ragged_dot`` with a float32 result."""
    return jax.lax.ragged_dot(rows, w, group_sizes, preferred_element_type=jnp.float32)


@dataclasses.dataclass(frozen=True)
class Dispatch:
    """Where each of one device's n x k assignments goes, sorted by expert."""

    order: jax.Array  # [a]: sorted position i holds assignment order[i] (= token order[i] // k, slot order[i] % k)
    expert: jax.Array  # [a]: the expert of sorted position i (non-decreasing)
    counts: jax.Array  # [E]: assignments per expert, int32
    kept: jax.Array  # [a] bool: within the expert's capacity
    rank: jax.Array  # [a]: position of sorted row i among its expert's kept rows


def dispatch(ids: jax.Array, n_experts: int, capacity: int | None) -> Dispatch:
    """Sort the assignments ``ids`` [n, k] by expert; with a ``capacity`` an expert keeps
    its first ``capacity`` rows (the earliest tokens)."""
    flat = ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    expert = flat[order]
    counts = jnp.zeros((n_experts,), jnp.int32).at[flat].add(1)
    starts = jnp.cumsum(counts) - counts
    rank = jnp.arange(flat.shape[0], dtype=jnp.int32) - starts[expert]
    kept = rank < capacity if capacity is not None else jnp.ones(flat.shape, bool)
    return Dispatch(order, expert, counts, kept, rank)


def swiglu_groups(
    rows: jax.Array, group_sizes: jax.Array, w_gate_up: jax.Array, w_down: jax.Array, matmul: GroupedMatmul = ragged_matmul
) -> jax.Array:
    """Expert e's SwiGLU on its contiguous rows (``group_sizes[e]`` of them, in order);
    rows past the groups come out 0. ``w_gate_up`` [G, d, 2, f], ``w_down`` [G, f, d];
    ``matmul``: the grouped matmul (``ragged_matmul`` or ``grouped_gemm.grouped_matmul``)."""
    g, d, _, f = w_gate_up.shape
    used = jnp.arange(rows.shape[0]) < jnp.sum(group_sizes)
    rows = jnp.where(used[:, None], rows, 0)  # unused rows never reach a product (their weight gradient included)
    # model.fp8: quantise-dequantise only (fp8 rounding, compute-dtype products: no fp8 grouped GEMM here)
    dot = lambda x, w: matmul(x, w, group_sizes)  # noqa: E731
    gate_up = fp8.grouped_dot(dot, rows, w_gate_up.reshape(g, d, 2 * f)).reshape(rows.shape[0], 2, f)
    hidden = swiglu(gate_up[:, 0], gate_up[:, 1]).astype(rows.dtype)
    out = fp8.grouped_dot(dot, hidden, w_down)
    return jnp.where(used[:, None], out, 0.0)


def kernel_choice(platform: str) -> str:
    """The grouped matmul the experts use on ``platform`` (a device's ``platform``):
    ``grouped_gemm`` on a GPU unless ``JAXDIST_MOE_KERNEL=ragged_dot``; ``ragged_dot`` elsewhere."""
    wanted = os.environ.get(KERNEL_ENV, "").strip().lower()
    if wanted not in ("", "grouped_gemm", "ragged_dot"):
        raise ValueError(f"{KERNEL_ENV}={wanted!r}: grouped_gemm or ragged_dot")
    if platform in ("gpu", "cuda") and wanted != "ragged_dot":
        return "grouped_gemm"
    return "ragged_dot"


def expert_compute(platform: str, interpret: bool = False) -> ExpertCompute:
    """The experts' computation on ``platform`` (``kernel_choice``); ``interpret``: the Pallas
    kernels through Pallas' interpreter, on any backend (tests)."""
    if kernel_choice(platform) == "grouped_gemm" or interpret:
        return functools.partial(swiglu_groups, matmul=lambda x, w, sizes: grouped_matmul(x, w, sizes, interpret))
    return swiglu_groups


def kernel_note(platform: str, local_experts: int) -> str | None:
    """One line where the experts' grouped matmuls run densely on ``platform`` (None where they do not)."""
    if platform == "cpu":
        return (
            "MoE on CPU: jax.lax.ragged_dot runs as a dense expansion (every local expert on every row, "
            f"{local_experts}x the expert FLOPs); results are exact, timings are not a GPU's"
        )
    if platform in ("gpu", "cuda") and kernel_choice(platform) == "ragged_dot":
        return (
            f"MoE on GPU with {KERNEL_ENV}=ragged_dot: XLA:GPU expands jax.lax.ragged_dot densely (every local "
            f"expert on every row, {local_experts}x the expert FLOPs, forward and backward); the default is jaxdist's grouped GEMM"
        )
    return None


def combine(per_row: jax.Array, d: Dispatch, gates: jax.Array, dtype) -> jax.Array:
    """Tokens' outputs [n, D] from the sorted rows' results ``per_row`` [a, D] (dropped rows
    already 0): unsorted by the inverse permutation, the k slots summed in fp32 with their gates."""
    n, k = gates.shape
    unsorted = per_row[jnp.argsort(d.order)]  # a gather: assignment j's row
    out = jnp.einsum("nkd,nk->nd", unsorted.reshape(n, k, -1).astype(jnp.float32), gates.astype(jnp.float32))
    return out.astype(dtype)


def local_experts(
    x: jax.Array,
    ids: jax.Array,
    gates: jax.Array,
    w_gate_up: jax.Array,
    w_down: jax.Array,
    capacity: int | None,
    reduce_hidden: Callable[[jax.Array], jax.Array] = lambda y: y,
    compute: ExpertCompute | None = None,
) -> tuple[jax.Array, jax.Array]:
    """(outputs [n, d], assignments dropped) of tokens ``x`` [n, d] routed to ``ids`` [n, k]
    with ``gates`` [n, k] over all the experts held here. ``reduce_hidden``: the sum over a
    split expert width (tensor parallelism) of each row's partial output; ``compute``: the
    experts (None: ``expert_compute`` of the default backend; tests put the identity there)."""
    compute = compute or expert_compute(jax.default_backend())
    n_experts = w_gate_up.shape[0]
    d = dispatch(ids, n_experts, capacity)
    kept_counts = d.counts if capacity is None else jnp.minimum(d.counts, capacity)
    starts = jnp.cumsum(kept_counts) - kept_counts
    rows_total = d.order.shape[0]
    # kept rows packed per expert; dropped ones out of range, each its own (the scatter's unique_indices holds)
    slot = jnp.where(d.kept, starts[d.expert] + d.rank, rows_total + jnp.arange(rows_total))
    token_rows = x[d.order // ids.shape[1]]
    packed = jnp.full((rows_total, x.shape[1]), UNWRITTEN, x.dtype).at[slot].set(token_rows, mode="drop", unique_indices=True)
    out = reduce_hidden(compute(packed, kept_counts, w_gate_up, w_down))
    per_row = jnp.where(d.kept[:, None], out[jnp.minimum(slot, rows_total - 1)], 0.0)
    return combine(per_row, d, gates, x.dtype), jnp.sum(~d.kept).astype(jnp.float32)
