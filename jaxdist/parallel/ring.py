"""Ring attention over one mesh axis, with its backward written out (``jax.custom_vjp``).

Called inside ``shard_map`` on each device's share of the sequence. Keys, values, segment ids and
positions travel around the ring by ``ppermute`` (device i sends to i+1); each block merges into one
online softmax (``parallel.blockwise``: fp32, masked tiles skipped, rows that see nothing give 0).

Double-buffered: each step's transfer of the next block is issued before the current block's compute
and waited for after it, and an ``optimization_barrier`` at the end of every step (``Ring.step_boundary``)
holds XLA to that order. Without it XLA sees transfers that depend only on each other and chains them
back to back ahead of the blocks (an H100 program of context=4 had 18 of 23 permutes asynchronous and
10 with a block inside; tests/test_context_gpu.py).

The backward is explicit because autodiff through a merge built on a fused kernel's residual loses
the log-sum-exp's cotangent (DESIGN.md): the forward saves the output and the LSE; the backward
sends the keys around again, recomputes each block's probabilities from the LSE, accumulates dQ
locally, and carries each block's dK/dV (fp32) along with it. It takes the blocks in the order the
ring brings them with the device's own block last, so each block's dK/dV end on their owner after
context-1 shifts, none after the last compute.
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

    def step_boundary(self, computed, arriving):
        """The end of a ring step: ``(computed, arriving)`` through one ``optimization_barrier``, so
        the next step's transfers (which read ``arriving``) start only after this step's block
        compute and XLA waits for this step's transfer only after that compute. Without it XLA's
        scheduler is free to chain the transfers back to back ahead of the computes (each transfer
        depends only on the previous one), and it did: in an H100 program of context=4 only 2 of
        20 transfers had a block inside, 6 ran synchronously."""
        return jax.lax.optimization_barrier((computed, arriving))


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
        computed = computed + count
        if arriving is not None:  # ... and waited for after it
            state, block = ring.step_boundary(state, arriving)
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
    own = blockwise.keys(k, v, segment_ids, positions, tiles)
    # The blocks come in the order the ring brings them, this device's own block last: block j's dK/dV
    # start on the device after j (its first holder), travel with it, and its last holder is j, so
    # they end on their owner with no transfer after the last compute. The one transfer no block
    # compute hides is the first, issued before the loop (it reads only the forward's residuals, so
    # XLA may start it behind the layer's earlier backward work).
    block = ring.shift(own)
    dq, dkv = jnp.zeros_like(query[0], dtype=F32), None
    for step in range(ring.size):
        # This step's transfers are issued before its block's compute and waited for after it: the
        # next block's K/V, and the dK/dV accumulated so far for the block held now (they left the
        # previous holder after that holder's compute).
        arriving = ring.shift(block) if step < ring.size - 2 else own if step == ring.size - 2 else None
        travelling = ring.shift(dkv) if dkv is not None else None
        dq, dk, dv = blockwise.backward_block(dq, query, grads, block, scale)
        dkv = (dk, dv) if travelling is None else (travelling[0] + dk, travelling[1] + dv)
        if arriving is not None:
            (dq, dkv), block = ring.step_boundary((dq, dkv), arriving)
    dq = blockwise.from_query_tiles(dq).astype(q.dtype)
    return dq, blockwise.from_key_tiles(dkv[0]).astype(k.dtype), blockwise.from_key_tiles(dkv[1]).astype(v.dtype), None, None


ring_attention.defvjp(_ring_fwd, _ring_bwd)
