"""Attention of a block of queries to a block of keys, tile by tile, in XLA: the per-block kernel of
context parallelism (``parallel.context``, ``parallel.ring``).

The mask comes from segment ids and positions only, never from array indices (a split sequence may
be in load-balanced order): query i sees key j iff ``seg_i == seg_j >= 0`` and ``pos_i >= pos_j``.
A negative segment id marks padding: such a query sees no key and no query sees such a key; a row
that sees no key gets output 0 and gradient 0 (no NaN).

Queries and keys are cut into tiles of at most a limit (512 tokens by default); a sequence chunk that
no tile length near the limit divides is padded up to a multiple of one (``plan_tiles``), the padding
masked by segment id -1, so a prime length does not fall to tiles of 1 token. A pair of tiles where no
query can see any key (every key of the tile later than every query, or no shared document) is
skipped by ``lax.cond``, so the masked half of causal attention costs nothing. Scores, the running
max and the sums are fp32. The forward keeps the unnormalised online-softmax state, so blocks of keys
that arrive one after another (the ring) merge into it; ``finish`` normalises and returns the log-sum-exp from which ``backward_block``
recomputes each tile's probabilities (flash attention's backward). ``attend`` is the custom-VJP
attention of local queries to keys already in hand (the all-gather strategy).

Layouts: queries in tiles [nq, B, KV, G, bq, D] (H = KV x G heads, q head h reads kv head h // G),
keys and values [nk, B, KV, bk, D], segment ids and positions [n, B, b].
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

F32 = jnp.float32
BLOCK_SCOPE = "context_block"  # the name scope of the block computations in HLO metadata (ring_overlap_in_hlo finds them)
_BIG = jnp.iinfo(jnp.int32).max


@dataclasses.dataclass(frozen=True)
class Tiles:
    q: int  # query tile length
    kv: int  # key tile length


def tile_length(chunk: int, limit: int) -> int:
    """The tile length for a chunk of ``chunk`` tokens: the fewest tiles of at most ``limit``
    tokens, as even as possible, ceil(chunk / ceil(chunk / limit)). The chunk is padded up to a
    multiple of it (``plan_tiles``) rather than cut at a divisor: a length with no divisor near the
    limit (a prime) would otherwise take tiles of 1 token."""
    limit = max(limit, 1)
    return -(-chunk // -(-chunk // limit))


@dataclasses.dataclass(frozen=True)
class TilePlan:
    """How one chunk of a device's sequence is tiled (tiles never straddle a chunk, so the
    load-balanced order's two chunks per device are skipped or computed separately)."""

    tiles: Tiles
    chunk: int  # tokens per chunk
    padded: int  # the chunk padded to a multiple of both tile lengths; padding tokens are masked

    @property
    def pad(self) -> int:
        return self.padded - self.chunk


def plan_tiles(chunk: int, limit_q: int, limit_kv: int) -> TilePlan:
    """Tiles of at most ``limit_q`` x ``limit_kv`` tokens for chunks of ``chunk`` tokens: the
    smaller limit sets the padded chunk (fewest tiles, padding below one token per tile); the other
    tile is the largest multiple of that tile that divides the padded chunk within its limit."""
    small = tile_length(chunk, min(limit_q, limit_kv))
    count = -(-chunk // small)
    padded = count * small
    large = small * max(m for m in range(1, count + 1) if count % m == 0 and small * m <= max(limit_q, limit_kv, 1))
    q, kv = (small, large) if limit_q <= limit_kv else (large, small)
    return TilePlan(Tiles(q, kv), chunk, padded)


def pad_chunks(x: jax.Array, chunks: int, padded: int, value=0) -> jax.Array:
    """[B, chunks x c, ...] -> [B, chunks x padded, ...]: each chunk filled up to ``padded`` tokens
    with ``value`` (segment ids: -1, which masks the padding: it sees nothing and nobody sees it)."""
    b, t = x.shape[:2]
    c = t // chunks
    if padded == c:
        return x
    x = x.reshape(b, chunks, c, *x.shape[2:])
    widths = [(0, 0), (0, 0), (0, padded - c)] + [(0, 0)] * (x.ndim - 3)
    return jnp.pad(x, widths, constant_values=value).reshape(b, chunks * padded, *x.shape[3:])


def unpad_chunks(x: jax.Array, chunks: int, chunk: int) -> jax.Array:
    """The inverse of ``pad_chunks``: the first ``chunk`` tokens of each chunk."""
    b, t = x.shape[:2]
    padded = t // chunks
    if padded == chunk:
        return x
    return x.reshape(b, chunks, padded, *x.shape[2:])[:, :, :chunk].reshape(b, chunks * chunk, *x.shape[2:])


# -- layouts ------------------------------------------------------------------------------------


def query_tiles(q: jax.Array, tile: int, kv_heads: int) -> jax.Array:
    """[B, T, H, D] -> [T/tile, B, KV, H/KV, tile, D]."""
    b, t, h, d = q.shape
    return q.reshape(b, t // tile, tile, kv_heads, h // kv_heads, d).transpose(1, 0, 3, 4, 2, 5)


def from_query_tiles(x: jax.Array) -> jax.Array:
    n, b, kv, g, tile, d = x.shape
    return x.transpose(1, 0, 4, 2, 3, 5).reshape(b, n * tile, kv * g, d)


def key_tiles(k: jax.Array, tile: int) -> jax.Array:
    """[B, T, KV, D] -> [T/tile, B, KV, tile, D]."""
    b, t, kv, d = k.shape
    return k.reshape(b, t // tile, tile, kv, d).transpose(1, 0, 3, 2, 4)


def from_key_tiles(x: jax.Array) -> jax.Array:
    n, b, kv, tile, d = x.shape
    return x.transpose(1, 0, 3, 2, 4).reshape(b, n * tile, kv, d)


def token_tiles(x: jax.Array, tile: int) -> jax.Array:
    """[B, T] -> [T/tile, B, tile]."""
    b, t = x.shape
    return x.reshape(b, t // tile, tile).transpose(1, 0, 2)


def queries(q, segment_ids, positions, tiles: Tiles, kv_heads: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    return query_tiles(q, tiles.q, kv_heads), token_tiles(segment_ids, tiles.q), token_tiles(positions, tiles.q)


def keys(k, v, segment_ids, positions, tiles: Tiles) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    return key_tiles(k, tiles.kv), key_tiles(v, tiles.kv), token_tiles(segment_ids, tiles.kv), token_tiles(positions, tiles.kv)


# -- the mask and the skip test -----------------------------------------------------------------


def _visible(seg_q, pos_q, seg_k, pos_k) -> jax.Array:
    """[B, bq], [B, bk] -> [B, 1, 1, bq, bk] (broadcasts over kv heads and groups)."""
    same = (seg_q[:, :, None] == seg_k[:, None, :]) & (seg_q[:, :, None] >= 0)
    return (same & (pos_q[:, :, None] >= pos_k[:, None, :]))[:, None, None]


def may_see(seg_q, pos_q, seg_k, pos_k) -> jax.Array:
    """Scalar bool: can any query of the tile see any key of the tile, in any row? Two necessary
    conditions, O(tile): (seg, pos) of some query is lexicographically >= that of some key (a
    visible pair has equal segments and pos_q >= pos_k), and the segment ranges overlap."""
    valid_q, valid_k = seg_q >= 0, seg_k >= 0
    q_max_seg = jnp.max(jnp.where(valid_q, seg_q, -1), axis=1)
    q_pos_at_max = jnp.max(jnp.where(valid_q & (seg_q == q_max_seg[:, None]), pos_q, -1), axis=1)
    q_min_seg = jnp.min(jnp.where(valid_q, seg_q, _BIG), axis=1)
    k_min_seg = jnp.min(jnp.where(valid_k, seg_k, _BIG), axis=1)
    k_pos_at_min = jnp.min(jnp.where(valid_k & (seg_k == k_min_seg[:, None]), pos_k, _BIG), axis=1)
    k_max_seg = jnp.max(jnp.where(valid_k, seg_k, -1), axis=1)
    later_or_equal = (q_max_seg > k_min_seg) | ((q_max_seg == k_min_seg) & (q_pos_at_max >= k_pos_at_min))
    overlap = (k_max_seg >= q_min_seg) & (q_max_seg >= 0) & (k_max_seg >= 0)
    return jnp.any(later_or_equal & overlap)


def _scores(q, k, scale: float) -> jax.Array:
    return jnp.einsum("bkgqd,bksd->bkgqs", q, k, preferred_element_type=F32) * scale


# -- forward ------------------------------------------------------------------------------------


def init_state(q_tiles: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(acc [nq,B,KV,G,bq,D], running max m, running sum denom) in fp32; zeros_like keeps the
    inputs' varying mesh axes, which a scan carry inside shard_map must match."""
    acc = jnp.zeros_like(q_tiles, dtype=F32)
    rows = acc[..., 0]
    return acc, jnp.full_like(rows, -jnp.inf), jnp.zeros_like(rows)


def forward_block(state, query, key_block, scale: float):
    """Merge one block of keys into the online-softmax state of all query tiles.
    Returns (state, number of tile pairs computed)."""

    def per_query_tile(x):
        q, seg_q, pos_q, acc, m, denom = x

        def step(carry, y):
            acc, m, denom, computed = carry
            k, v, seg_k, pos_k = y

            def compute(acc, m, denom):
                s = jnp.where(_visible(seg_q, pos_q, seg_k, pos_k), _scores(q, k, scale), -jnp.inf)
                m_new = jnp.maximum(m, jnp.max(s, axis=-1))
                m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)  # a row with nothing seen yet: exp(-inf) = 0
                p = jnp.exp(s - m_safe[..., None])
                correction = jnp.exp(m - m_safe)
                pv = jnp.einsum("bkgqs,bksd->bkgqd", p.astype(v.dtype), v, preferred_element_type=F32)
                return acc * correction[..., None] + pv, m_new, denom * correction + jnp.sum(p, axis=-1)

            seen = may_see(seg_q, pos_q, seg_k, pos_k)
            acc, m, denom = jax.lax.cond(seen, compute, lambda *c: c, acc, m, denom)
            return (acc, m, denom, computed + seen.astype(jnp.int32)), None

        computed = jnp.zeros_like(seg_q[0, 0]) + jnp.zeros_like(key_block[2][0, 0, 0])  # the varying axes of both
        (acc, m, denom, computed), _ = jax.lax.scan(step, (acc, m, denom, computed), key_block)
        return acc, m, denom, computed

    q_tiles, seg_q, pos_q = query
    with jax.named_scope(BLOCK_SCOPE):
        acc, m, denom, computed = jax.lax.map(per_query_tile, (q_tiles, seg_q, pos_q, *state))
    return (acc, m, denom), jnp.sum(computed)


def finish(state, dtype) -> tuple[jax.Array, jax.Array]:
    """(output tiles in ``dtype``, log-sum-exp [nq,B,KV,G,bq] fp32, -inf where a row saw no key)."""
    acc, m, denom = state
    seen = denom > 0
    out = jnp.where(seen[..., None], acc / jnp.where(seen, denom, 1.0)[..., None], 0.0)
    lse = jnp.where(seen, m + jnp.log(jnp.where(seen, denom, 1.0)), -jnp.inf)
    return out.astype(dtype), lse


# -- backward -----------------------------------------------------------------------------------


def output_terms(out_tiles: jax.Array, dout_tiles: jax.Array) -> jax.Array:
    """rowsum(dO * O) in fp32, the softmax backward's correction term."""
    return jnp.sum(dout_tiles.astype(F32) * out_tiles.astype(F32), axis=-1)


def backward_block(dq_tiles, query, grads, key_block, scale: float):
    """One block of keys' part of the gradients: returns (dq_tiles + this block's part, dk tiles,
    dv tiles), fp32. ``grads`` = (dout tiles, lse tiles, output_terms)."""
    k_tiles, v_tiles = key_block[0], key_block[1]

    def per_query_tile(carry, x):
        dk, dv = carry
        q, seg_q, pos_q, dout, lse, delta, dq = x
        lse_safe = jnp.where(jnp.isfinite(lse), lse, 0.0)  # rows that saw nothing: p is masked to 0 anyway

        def step(dq, y):
            k, v, seg_k, pos_k = y

            def compute(dq):
                s = _scores(q, k, scale)
                p = jnp.exp(jnp.where(_visible(seg_q, pos_q, seg_k, pos_k), s - lse_safe[..., None], -jnp.inf))
                dv_tile = jnp.einsum("bkgqs,bkgqd->bksd", p.astype(dout.dtype), dout, preferred_element_type=F32)
                dp = jnp.einsum("bkgqd,bksd->bkgqs", dout, v, preferred_element_type=F32)
                ds = p * (dp - delta[..., None]) * scale
                dq = dq + jnp.einsum("bkgqs,bksd->bkgqd", ds.astype(k.dtype), k, preferred_element_type=F32)
                dk_tile = jnp.einsum("bkgqs,bkgqd->bksd", ds.astype(q.dtype), q, preferred_element_type=F32)
                return dq, dk_tile, dv_tile

            def skip(dq):
                return dq, jnp.zeros_like(k, dtype=F32), jnp.zeros_like(v, dtype=F32)

            dq, dk_tile, dv_tile = jax.lax.cond(may_see(seg_q, pos_q, seg_k, pos_k), compute, skip, dq)
            return dq, (dk_tile, dv_tile)

        dq, (dk_block, dv_block) = jax.lax.scan(step, dq, key_block)
        return (dk + dk_block, dv + dv_block), dq

    q_tiles, seg_q, pos_q = query
    dout, lse, delta = grads
    zeros = (jnp.zeros_like(k_tiles, dtype=F32), jnp.zeros_like(v_tiles, dtype=F32))
    with jax.named_scope(BLOCK_SCOPE):
        (dk, dv), dq_tiles = jax.lax.scan(per_query_tile, zeros, (q_tiles, seg_q, pos_q, dout, lse, delta, dq_tiles))
    return dq_tiles, dk, dv


# -- attention to keys in hand (custom VJP) -----------------------------------------------------


def attention_forward(tiles: Tiles, q, k, v, seg_q, pos_q, seg_k, pos_k):
    """(output [B,Tq,H,D], lse tiles, tile pairs computed) of local queries over the keys given."""
    query = queries(q, seg_q, pos_q, tiles, k.shape[2])
    state, computed = forward_block(init_state(query[0]), query, keys(k, v, seg_k, pos_k, tiles), q.shape[-1] ** -0.5)
    out, lse = finish(state, q.dtype)
    return from_query_tiles(out), lse, computed


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def attend(tiles: Tiles, q, k, v, seg_q, pos_q, seg_k, pos_k) -> jax.Array:
    """Masked attention of q [B,Tq,H,D] to k, v [B,Tk,KV,D] (see the module docstring)."""
    return attention_forward(tiles, q, k, v, seg_q, pos_q, seg_k, pos_k)[0]


def _attend_fwd(tiles, q, k, v, seg_q, pos_q, seg_k, pos_k):
    out, lse, _ = attention_forward(tiles, q, k, v, seg_q, pos_q, seg_k, pos_k)
    return out, (q, k, v, seg_q, pos_q, seg_k, pos_k, out, lse)


def _attend_bwd(tiles, residuals, dout):
    q, k, v, seg_q, pos_q, seg_k, pos_k, out, lse = residuals
    kv_heads = k.shape[2]
    query = queries(q, seg_q, pos_q, tiles, kv_heads)
    dout_tiles = query_tiles(dout, tiles.q, kv_heads)
    grads = (dout_tiles, lse, output_terms(query_tiles(out, tiles.q, kv_heads), dout_tiles))
    dq, dk, dv = backward_block(jnp.zeros_like(query[0], dtype=F32), query, grads, keys(k, v, seg_k, pos_k, tiles), q.shape[-1] ** -0.5)
    dq, dk, dv = from_query_tiles(dq).astype(q.dtype), from_key_tiles(dk).astype(k.dtype), from_key_tiles(dv).astype(v.dtype)
    return dq, dk, dv, None, None, None, None


attend.defvjp(_attend_fwd, _attend_bwd)
