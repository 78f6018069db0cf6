"""Ring attention over one mesh axis, with its backward written out (``jax.custom_vjp``).

Called inside ``shard_map`` on each device's share of the sequence. Keys, values, segment ids and
positions travel around the ring by ``ppermute`` (device i sends to i+1); each step's transfer is
issued before that step's block is computed, so XLA can overlap the two. The blocks merge into one
online softmax (``parallel.blockwise``: fp32, masked tiles skipped, rows that see nothing give 0).

The backward is explicit because autodiff through a merge built on a fused kernel's residual loses
the log-sum-exp's cotangent (DESIGN.md): the forward saves the output and the LSE; the backward
sends the keys around again, recomputes each block's probabilities from the LSE, accumulates dQ
locally, and carries each block's dK/dV (fp32) along with it, with one last shift so that they land
on the device that owns the block.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jaxdist.parallel import blockwise
from jaxdist.parallel.blockwise import F32, Tiles


@dataclasses.dataclass(frozen=True)
class Ring:
    axis: str  # the mesh axis the sequence is split over
    size: int  # its size
    tiles: Tiles

    def shift(self, tree):
        """Every array to the next device on the ring (i -> i+1)."""
        if self.size == 1:
            return tree
        return jax.lax.ppermute(tree, self.axis, perm=[(i, (i + 1) % self.size) for i in range(self.size)])


def ring_forward(ring: Ring, q, k, v, segment_ids, positions):
    """(output [B,T,H,D], lse tiles, tile pairs computed) on this device; the count is what the
    tests read to see that masked tiles are skipped."""
    kv_heads, scale = k.shape[2], q.shape[-1] ** -0.5
    query = blockwise.queries(q, segment_ids, positions, ring.tiles, kv_heads)
    block = blockwise.keys(k, v, segment_ids, positions, ring.tiles)
    state, computed = blockwise.init_state(query[0]), 0
    for step in range(ring.size):
        arriving = ring.shift(block) if step < ring.size - 1 else None  # issued before this block's compute
        state, count = blockwise.forward_block(state, query, block, scale)
        computed, block = computed + count, arriving
    out, lse = blockwise.finish(state, q.dtype)
    return blockwise.from_query_tiles(out), lse, computed


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def ring_attention(ring: Ring, q, k, v, segment_ids, positions) -> jax.Array:
    """Attention of this device's queries to the whole sequence, whose shares sit on the devices of
    ``ring.axis`` (shapes as ``ContextAttention``, local)."""
    return ring_forward(ring, q, k, v, segment_ids, positions)[0]


def _ring_fwd(ring, q, k, v, segment_ids, positions):
    out, lse, _ = ring_forward(ring, q, k, v, segment_ids, positions)
    return out, (q, k, v, segment_ids, positions, out, lse)


def _ring_bwd(ring, residuals, dout):
    q, k, v, segment_ids, positions, out, lse = residuals
    kv_heads, scale, tiles = k.shape[2], q.shape[-1] ** -0.5, ring.tiles
    query = blockwise.queries(q, segment_ids, positions, tiles, kv_heads)
    dout_tiles = blockwise.query_tiles(dout, tiles.q, kv_heads)
    grads = (dout_tiles, lse, blockwise.output_terms(blockwise.query_tiles(out, tiles.q, kv_heads), dout_tiles))
    block = blockwise.keys(k, v, segment_ids, positions, tiles)
    dq = jnp.zeros_like(query[0], dtype=F32)
    dkv = (jnp.zeros_like(block[0], dtype=F32), jnp.zeros_like(block[1], dtype=F32))  # travels with its block
    for step in range(ring.size):
        arriving = ring.shift(block) if step < ring.size - 1 else None
        dq, dk, dv = blockwise.backward_block(dq, query, grads, block, scale)
        # The block held now belongs to the device `step` places back; after this shift its
        # gradient sits with the next holder, and after the last step's shift with its owner.
        dkv, block = ring.shift((dkv[0] + dk, dkv[1] + dv)), arriving
    dq = blockwise.from_query_tiles(dq).astype(q.dtype)
    return dq, blockwise.from_key_tiles(dkv[0]).astype(k.dtype), blockwise.from_key_tiles(dkv[1]).astype(v.dtype), None, None


ring_attention.defvjp(_ring_fwd, _ring_bwd)
