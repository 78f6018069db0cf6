"""What every pipeline schedule shares: the stage-major weight layout, ring shifts over
``pipe``, the head and loss spread over the stages (1/S of every sequence each), and the
dtype its sums over ``pipe`` run in.

bf16 sums over pipe: XLA:CPU computes bf16 all-reduces and reduce-scatters in float32 (its
AllReducePromotion pass), rebuilding each reducer as one binary op with the opcode of the old
reducer's root. In a ``shard_map`` manual over only some of the mesh's axes, as the pipelines'
are (data / fsdp / tensor stay with the partitioner; axes of size 1 count too), Shardy wraps
the reducer's add in a sharding annotation that becomes its root, a ``copy``, and the pass
aborts the process ("Invalid binary instruction opcode copy", jaxlib 0.10.2). So on CPU the
pipelines sum bf16 in float32 themselves (``sum_dtype``), as the pass would have: the same
numbers. XLA:GPU sums bf16 natively (it promotes only 16-bit integers), so there the sums
stay bf16 and the program is unchanged. The sums: the reduce-scatter to the head
(``from_last_stage``), 1F1B's input gradient (``psum_in``) and autodiff's transposes of
inputs replicated over a manual axis (``promote``: GPipe's input and head parameters).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jaxdist.parallel.pipeline_schedule import PipelineSpec


def stage_major(layer_params: Any, spec: PipelineSpec) -> Any:
    """[L, ...] -> [S, V, K, ...] with chunk (s, v) = layers (v S + s) K ... (v S + s + 1) K
    (zbv: chunk (s, 1) is chunk 2 S - 1 - s, the V's way back up).

    For V = 1 this is a free reshape of the pipe-sharded layer axis; for V > 1 the
    interleaved order differs from the contiguous storage and XLA moves the weights.
    """
    s, v = spec.stages, spec.virtual

    def one(x):
        k = x.shape[0] // (s * v)
        return jnp.swapaxes(_v_shaped(x.reshape(v, s, k, *x.shape[1:]), spec), 0, 1)

    return jax.tree.map(one, layer_params)


def _v_shaped(chunks: jax.Array, spec: PipelineSpec) -> jax.Array:
    """[V, S, ...] chunks with zbv's second leg reversed over the devices (its own inverse)."""
    return jnp.stack([chunks[0], jnp.flip(chunks[1], 0)]) if spec.schedule == "zbv" else chunks


def layer_major(staged: Any, like: Any, spec: PipelineSpec) -> Any:
    """The inverse of ``stage_major``: [S, V, K, ...] -> [L, ...], in ``like``'s dtypes."""

    return jax.tree.map(lambda g, p: _v_shaped(jnp.swapaxes(g, 0, 1), spec).reshape(p.shape).astype(p.dtype), staged, like)


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


def from_last_stage(y: jax.Array, axis: int, stages: int, dtype: jnp.dtype, source: int | None = None) -> jax.Array:
    """The last stage's ``y`` (or stage ``source``'s), cut along ``axis`` into S pieces, piece s
    to stage s (a reduce-scatter, summed in ``dtype``: ``sum_dtype``)."""
    last = jax.lax.axis_index("pipe") == (stages - 1 if source is None else source)
    mine = jax.lax.psum_scatter(jnp.where(last, y, jnp.zeros_like(y)).astype(dtype), "pipe", scatter_dimension=axis, tiled=True)
    return mine.astype(y.dtype)


def psum_in(x: jax.Array, axes: str | tuple[str, ...], dtype: jnp.dtype) -> jax.Array:
    """``psum`` over ``axes``, summed in ``dtype`` (``sum_dtype``), in ``x``'s dtype."""
    return jax.lax.psum(x.astype(dtype), axes).astype(x.dtype)


def sum_dtype(dtype: jnp.dtype, mesh: Mesh) -> jnp.dtype:
    """The dtype a pipeline sums ``dtype`` over its manual axes in: float32 for bf16 on CPU
    (see the module's docstring), ``dtype`` itself otherwise."""
    if dtype == jnp.bfloat16 and mesh.devices.flat[0].platform == "cpu":
        return jnp.dtype(jnp.float32)
    return jnp.dtype(dtype)


def promote(tree: Any, mesh: Mesh) -> Any:
    """``tree`` in ``sum_dtype``: a ``shard_map`` input replicated over a manual axis, whose
    gradient autodiff sums over that axis (the body casts it back with ``restore``)."""
    return jax.tree.map(lambda x: x.astype(sum_dtype(x.dtype, mesh)), tree)


def restore(tree: Any, like: Any) -> Any:
    """``tree`` in ``like``'s dtypes (undoes ``promote``)."""
    return jax.tree.map(lambda x, y: x.astype(y.dtype), tree, like)


class StageResiduals:
    """A chunk's ``jax.vjp`` split into what changes per microbatch (kept in the ring) and
    the chunk's weights (``jax.vjp`` forwards its primal inputs into the residuals by
    identity; they are put back from the chunk's weights in the backward, never copied
    into the ring)."""

    def __init__(self, stage_fn):
        self.stage_fn = stage_fn
        self.treedef = None
        self.layout: list[int | None] = []  # per vjp leaf: the index of the weight leaf it is, or None (kept)

    def forward(self, params: Any, h: jax.Array, aux: dict[str, jax.Array]) -> tuple[jax.Array, list[jax.Array]]:
        y, vjp = jax.vjp(lambda p, x: self.stage_fn(p, x, aux), params, h)
        leaves, treedef = jax.tree_util.tree_flatten(vjp)
        weights = {id(w): k for k, w in enumerate(jax.tree.leaves(params))}
        # the structure of this trace's vjp (its backward in the same tick rebuilds from it)
        self.treedef, self.layout = treedef, [weights.get(id(leaf)) for leaf in leaves]
        return y, [leaf for leaf, w in zip(leaves, self.layout, strict=True) if w is None]

    def backward(self, params: Any, kept: list[jax.Array], cotangent: jax.Array) -> tuple[Any, jax.Array]:
        weights, kept = jax.tree.leaves(params), iter(kept)
        leaves = [next(kept) if w is None else weights[w] for w in self.layout]
        return jax.tree_util.tree_unflatten(self.treedef, leaves)(cotangent)
