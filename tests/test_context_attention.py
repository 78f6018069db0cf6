"""Context-parallel attention (parallel.context, parallel.ring, parallel.blockwise) against the unsplit
attention (models.attention.causal_attention, fp32, XLA): outputs and dq/dk/dv of both strategies,
on packed documents of uneven lengths, in order and load-balanced, with GQA, on several meshes; the
document mask (a perturbation probe), padding rows, the order functions, the skipped tiles and the
ring's collective-permutes."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxdist.inspect.collectives import collective_ops
from jaxdist.inspect.hlo import parse_hlo
from jaxdist.models.attention import causal_attention
from jaxdist.parallel.context import STRATEGIES, ContextAttention, load_balance_order, reorder, restore_order, ring_overlap_in_hlo

from helpers import context_mesh, packed_ids

B, T, H, KV, D = 4, 48, 4, 2, 8
# Documents per row: uneven lengths that line up neither with the 8 chunks of 6 tokens (context=4,
# load-balanced) nor with the shards; one row is a single document.
DOCUMENTS = [[5, 13, 2, 19, 9], [48], [1, 1, 30, 16], [7, 20, 21]]
TOL = 1e-5

MESHES = {  # name -> (mesh shape over data, context, tensor; kv_heads_axis)
    "context4": ((1, 4, 1), "tensor"),  # kv_heads 2 < context 4
    "data2_context2_tensor2": ((2, 2, 2), "tensor"),  # heads and kv heads over tensor
    "context2_tensor4": ((1, 2, 4), None),  # kv_heads 2 not divisible by tensor 4: each device takes its kv head
}


@pytest.fixture(scope="module")
def inputs():
    rng = np.random.default_rng(0)
    q = rng.normal(size=(B, T, H, D)).astype(np.float32)
    k, v = (rng.normal(size=(B, T, KV, D)).astype(np.float32) for _ in range(2))
    cotangent = rng.normal(size=(B, T, H, D)).astype(np.float32)
    segments, positions = packed_ids(DOCUMENTS)
    return q, k, v, segments, positions, cotangent


def _with_grads(attention):
    """jit: (q, k, v, segment_ids, positions, cotangent) -> (out, dq, dk, dv)."""

    def run(q, k, v, segments, positions, cotangent):
        out, vjp = jax.vjp(lambda q, k, v: attention(q, k, v, segments, positions), q, k, v)
        return (out, *vjp(cotangent))

    return jax.jit(run)


@functools.cache
def _reference():
    return _with_grads(lambda q, k, v, s, p: causal_attention(q, k, v, s, implementation="xla"))


@functools.cache
def _split(mesh_name: str, strategy: str, tile: int = 512):
    shape, kv_axis = MESHES[mesh_name]
    attention = ContextAttention(
        context_mesh(shape), strategy, batch_axes=("data",), heads_axis="tensor", kv_heads_axis=kv_axis, block_q=tile, block_kv=tile
    )
    return attention, _with_grads(attention)


def _run_split(mesh_name, strategy, args, balanced: bool, tile: int = 512):
    attention, run = _split(mesh_name, strategy, tile)
    n = attention.context_size
    if balanced:
        args = [reorder(a, n) for a in args]
    results = [np.asarray(x) for x in run(*args)]
    return [restore_order(r, n) for r in results] if balanced else results


def _assert_close(got, want, what):
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        assert np.isfinite(g).all(), f"{what}: {name} has non-finite values"
        np.testing.assert_allclose(g, w, atol=TOL, rtol=0, err_msg=f"{what}: {name}")


CASES = [(m, s, 512) for m in MESHES for s in STRATEGIES] + [("context4", s, 3) for s in STRATEGIES]  # tile 3: several tiles per chunk


@pytest.mark.parametrize(("mesh_name", "strategy", "tile"), CASES)
def test_outputs_and_gradients_match_unsplit_attention(inputs, mesh_name, strategy, tile):
    want = [np.asarray(x) for x in _reference()(*inputs)]
    for balanced in (False, True):
        got = _run_split(mesh_name, strategy, list(inputs), balanced, tile)
        _assert_close(got, want, f"{strategy} on {mesh_name}, tile {tile}, load-balanced={balanced}")


# 44 tokens: load-balanced on context=2 each chunk has 11 (a prime), and in order on context=4 each
# device has 11, so no tile length near 4 divides it: the chunks are padded to 12 (tiles of 4).
T_PRIME = 44
DOCUMENTS_PRIME = [[5, 13, 2, 15, 9], [44], [1, 1, 30, 12], [7, 20, 17]]


@pytest.fixture(scope="module")
def prime_inputs():
    rng = np.random.default_rng(1)
    q = rng.normal(size=(B, T_PRIME, H, D)).astype(np.float32)
    k, v = (rng.normal(size=(B, T_PRIME, KV, D)).astype(np.float32) for _ in range(2))
    cotangent = rng.normal(size=(B, T_PRIME, H, D)).astype(np.float32)
    return (q, k, v, *packed_ids(DOCUMENTS_PRIME), cotangent)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize(("mesh_name", "orders"), [("data2_context2_tensor2", (False, True)), ("context4", (False,))])
def test_padded_tiles_match_unsplit_attention_on_a_length_no_tile_divides(prime_inputs, mesh_name, orders, strategy):
    """Chunks of 11 tokens with tiles of at most 4: padded to 12 and cut in tiles of 4 (not 1);
    the outputs and dq/dk/dv equal the unsplit attention's, in order and load-balanced."""
    attention, _ = _split(mesh_name, strategy, 4)
    plan = attention.tile_plan(T_PRIME // attention.context_size)
    assert (plan.chunk, plan.padded, plan.tiles.q, plan.tiles.kv) == (11, 12, 4, 4)
    want = [np.asarray(x) for x in _reference()(*prime_inputs)]
    for balanced in orders:
        got = _run_split(mesh_name, strategy, list(prime_inputs), balanced, 4)
        _assert_close(got, want, f"{strategy} on {mesh_name}, 11-token chunks, load-balanced={balanced}")


def test_a_prime_chunk_gets_tiles_near_the_limit_and_the_note_names_them(prime_inputs):
    """The issue's case: 2,084 tokens on context=2 are chunks of 521 (a prime), which the old
    divisor rule cut into 1x1 tiles; now 2 tiles of 261 over a chunk padded to 522, as the note says.
    On the small case the ring computes 3 x 3 tile pairs per chunk pair, not 11 x 11."""
    from jaxdist.parallel.blockwise import plan_tiles, tile_length

    assert tile_length(521, 512) == 261
    assert plan_tiles(521, 512, 512).padded == 522
    for chunk, limit in [(2048, 512), (768, 512), (1000, 512), (6, 3), (1, 512), (521, 600)]:
        plan = plan_tiles(chunk, limit, limit)
        n = -(-chunk // limit)  # the fewest tiles within the limit
        assert plan.tiles.q == plan.tiles.kv == -(-chunk // n) <= limit and plan.padded - chunk < n
    note = ContextAttention(context_mesh((1, 2, 1)), "ring", batch_axes=("data",)).kernel_note(2084)
    assert "tiles of 261x261 tokens, each 521-token chunk padded to 522" in note and "up to" not in note
    assert "tiles of 512x512 tokens, fp32" in ContextAttention(context_mesh((1, 2, 1)), "ring", batch_axes=("data",)).kernel_note(4096)
    q, k, v, _, _, _ = prime_inputs
    positions = np.broadcast_to(np.arange(T_PRIME, dtype=np.int32), (B, T_PRIME))
    attention = ContextAttention(context_mesh((1, 4, 1)), "ring", batch_axes=("data",), block_q=4, block_kv=4)
    computed = attention.tile_pairs_computed(q, k, v, np.zeros((B, T_PRIME), np.int32), positions)
    # in order, device r's 3 query tiles see the 3 tiles of each earlier device and 6 of its own
    assert computed.tolist() == [[6 + 9 * r for r in range(4)]]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_padding_rows_see_nothing_and_stay_finite(inputs, strategy):
    """Negative segment ids mark padding: those rows give 0 (no NaN, in forward and backward),
    nobody sees them, and every other row and gradient equals the unsplit attention's."""
    q, k, v, segments, positions, cotangent = inputs
    segments = segments.copy()
    padding = np.zeros_like(segments, bool)
    padding[0, 40:] = True  # the tail of a row (a shard and a half under load balancing)
    padding[2, 10:13] = True  # inside a document
    segments[padding] = -1
    cotangent = np.where(padding[:, :, None, None], 0.0, cotangent).astype(np.float32)  # padding carries no loss
    # The reference lets padding tokens see each other; with a zero cotangent there, its gradients
    # are those of attention where padding sees nothing.
    want = [np.asarray(x) for x in _reference()(q, k, v, segments, positions, cotangent)]
    got = _run_split("context4", strategy, [q, k, v, segments, positions, cotangent], balanced=True)
    assert np.all(got[0][padding] == 0.0)
    want[0] = np.where(padding[:, :, None, None], 0.0, want[0])
    _assert_close(got, want, f"{strategy} with padding")


def test_one_document_per_row_without_segment_ids(inputs):
    q, k, v, _, _, cotangent = inputs
    positions = np.broadcast_to(np.arange(T, dtype=np.int32), (B, T))
    attention = ContextAttention(context_mesh((1, 4, 1)), "ring", batch_axes=("data",))
    run = _with_grads(lambda q, k, v, s, p: attention(q, k, v, None, p))
    reference = _with_grads(lambda q, k, v, s, p: causal_attention(q, k, v, None, implementation="xla"))
    want = [np.asarray(x) for x in reference(q, k, v, None, positions, cotangent)]
    args = [reorder(a, 4) for a in (q, k, v, positions, cotangent)]
    got = [restore_order(np.asarray(x), 4) for x in run(args[0], args[1], args[2], None, args[3], args[4])]
    _assert_close(got, want, "ring without segment ids")


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_perturbing_one_token_moves_only_its_document(inputs, strategy):
    """Catches a split that replaced the document mask with plain causal attention: a later
    document would then see the changed token."""
    q, k, v, segments, positions, cotangent = inputs
    row, token = 0, 9  # document 1 of row 0 spans tokens 5..17
    q2, k2, v2 = q.copy(), k.copy(), v.copy()
    q2[row, token] += 3.0
    k2[row, token] += 3.0
    v2[row, token] += 3.0
    before = _run_split("data2_context2_tensor2", strategy, [q, k, v, segments, positions, cotangent], balanced=True)[0]
    after = _run_split("data2_context2_tensor2", strategy, [q2, k2, v2, segments, positions, cotangent], balanced=True)[0]
    moved = np.abs(after - before).max(axis=(2, 3))  # [B, T]
    document = (segments == segments[row, token]) & (np.arange(T) >= token) & (np.arange(B)[:, None] == row)
    assert np.all(moved[~document] == 0.0), f"tokens outside the document moved: {np.argwhere(moved > 0)[:5].tolist()}"
    assert np.all(moved[document] > 1e-3)


def test_order_round_trip_and_chunks():
    for n, seq_len in [(1, 6), (2, 24), (4, 48)]:
        index = np.arange(seq_len, dtype=np.int32)
        order = load_balance_order(seq_len, n)
        assert sorted(order.tolist()) == index.tolist()  # a permutation
        np.testing.assert_array_equal(restore_order(reorder(index, n, axis=0), n, axis=0), index)
        tokens = np.stack([index, index + 1000])  # [batch, seq]: along axis 1 by default, jax arrays too
        np.testing.assert_array_equal(np.asarray(restore_order(reorder(jnp.asarray(tokens), n), n)), tokens)
        chunks = index.reshape(2 * n, -1)
        shards = reorder(index, n, axis=0).reshape(n, -1)
        for r in range(n):
            np.testing.assert_array_equal(shards[r], np.concatenate([chunks[r], chunks[2 * n - 1 - r]]))


def test_order_rejects_a_length_the_chunks_do_not_divide():
    with pytest.raises(ValueError) as error:
        load_balance_order(30, 4)
    message = str(error.value)
    assert "30" in message and "8" in message and "\n" not in message


def test_ring_skips_fully_masked_tiles_and_load_balancing_evens_them(inputs):
    """One document per row, tiles of one chunk (6 tokens) on context=4: 8 x 8 = 64 tile pairs,
    36 of them at or below the diagonal. In order, device r computes 4r+3 of them; load-balanced,
    every device computes 9."""
    q, k, v, _, _, _ = inputs
    positions = np.broadcast_to(np.arange(T, dtype=np.int32), (B, T))
    segments = np.zeros((B, T), np.int32)
    attention = ContextAttention(context_mesh((1, 4, 1)), "ring", batch_axes=("data",), block_q=6, block_kv=6)
    in_order = attention.tile_pairs_computed(q, k, v, segments, positions)
    balanced = attention.tile_pairs_computed(*(reorder(a, 4) for a in (q, k, v, segments, positions)))
    assert in_order.tolist() == [[3, 7, 11, 15]]
    assert balanced.tolist() == [[9, 9, 9, 9]]


def test_ring_program_sends_blocks_over_context_only():
    """The forward sends K, V, segment ids and positions context-1 times; the backward adds dK and
    dV (fp32) context-1 times: a device's own block comes last, so they end on their owner with no
    last shift (XLA may merge the backward's resend of K/V with the forward's)."""
    mesh = context_mesh((2, 2, 2))
    attention = ContextAttention(mesh, "ring", batch_axes=("data",))
    shapes = [((B, T, H, D), "float32"), ((B, T, KV, D), "float32"), ((B, T, KV, D), "float32"), ((B, T), "int32"), ((B, T), "int32")]
    args = [jax.ShapeDtypeStruct(s, d) for s, d in shapes]
    local_kv = (B // 2) * (T // 2) * (KV // 2) * D * 4
    block = 2 * local_kv + 2 * (B // 2) * (T // 2) * 4  # k, v, segment ids, positions
    n = 2

    def permutes(fn):
        ops = collective_ops(parse_hlo(jax.jit(fn).lower(*args).compile().as_text()), dict(mesh.shape))
        ops = [op for op in ops if op.kind == "collective-permute"]
        assert ops and all(op.axes == ("context",) for op in ops)
        return sum(op.bytes * op.executions for op in ops)

    assert permutes(attention) == (n - 1) * block
    grads = permutes(jax.grad(lambda q, k, v, s, p: jnp.sum(attention(q, k, v, s, p) ** 2), argnums=(0, 1, 2)))
    assert (n - 1) * block + (n - 1) * 2 * local_kv <= grads <= 2 * (n - 1) * block + (n - 1) * 2 * local_kv


_SCHEDULED = """HloModule m, is_scheduled=true, num_partitions=4

ENTRY %main (p: f32[8]) -> f32[8] {
  %p = f32[8]{0} parameter(0)
  %cp-start = (f32[8]{0}, f32[8]{0}) collective-permute-start(%p), channel_id=1, source_target_pairs={{0,1},{1,2},{2,3},{3,0}}
  %f = f32[8]{0} fusion(%p), kind=kLoop, calls=%fused, metadata={op_name="jit(step)/context_attention/context_block/dot_general"}
  %cp-done = f32[8]{0} collective-permute-done(%cp-start)
  %cp-start.1 = (f32[8]{0}, f32[8]{0}) collective-permute-start(%cp-done), channel_id=2, source_target_pairs={{0,1},{1,2},{2,3},{3,0}}
  %g = f32[8]{0} fusion(%f), kind=kLoop, calls=%fused, metadata={op_name="jit(step)/mlp/dot_general"}
  %cp-done.1 = f32[8]{0} collective-permute-done(%cp-start.1)
  ROOT %out = f32[8]{0} add(%cp-done.1, %g)
}
"""


def test_ring_overlap_in_hlo_reads_the_schedule():
    """Of two async permutes, only the first has attention-block compute scheduled inside it."""
    found = ring_overlap_in_hlo(_SCHEDULED, {"context": 4})
    assert found == {"collective_permutes": 2, "over_context": 2, "async_pairs": 2, "overlapped_pairs": 1, "synchronous": 0}


def test_bad_arguments_are_one_line_errors(inputs):
    mesh = context_mesh((2, 2, 2))
    q, k, v, segments, positions, _ = inputs
    cases = [
        (lambda: ContextAttention(mesh, "ulysses"), "ulysses"),
        (lambda: ContextAttention(mesh, "ring", batch_axes=("fsdp",)), "fsdp"),
        (lambda: ContextAttention(mesh, "ring", kv_heads_axis="data"), "kv_heads_axis"),
        (lambda: ContextAttention(mesh, "ring", batch_axes=("data",))(q[:3], k[:3], v[:3], segments[:3], positions[:3]), "batch (3)"),
        (lambda: ContextAttention(mesh, "ring", batch_axes=("data",))(q[:, :45], k[:, :45], v[:, :45], None, positions[:, :45]), "(45)"),
        (lambda: ContextAttention(context_mesh((1, 2, 4)), "ring", batch_axes=("data",))(q, k, v, segments, positions), "kv_heads (2)"),
    ]
    for make, expected in cases:
        with pytest.raises(ValueError) as error:
            make()
        assert expected in str(error.value) and "\n" not in str(error.value), str(error.value)


def test_kernel_note_names_the_kernel_and_an_unused_choice():
    mesh = context_mesh((1, 4, 1))
    note = ContextAttention(mesh, "ring", batch_axes=("data",)).kernel_note()
    assert note.startswith("context attention: ring over context=4, per-block kernel xla") and "\n" not in note
    assert "cudnn" not in note
    assert (
        "model.attention=cudnn is not used"
        in ContextAttention(mesh, "all_gather", implementation="cudnn", batch_axes=("data",)).kernel_note()
    )


def test_the_rings_backward_hands_dk_dv_to_their_owners_in_context_minus_one_shifts():
    """The backward alone (the forward's residuals given) on context=4: K, V and their ids take the
    3 shifts the forward took, and dK/dV (fp32) 3 more: each block's gradient starts on its first
    holder and its last holder is its owner, so nothing moves after the last block (a ring reduction's
    n-1 hops). The ring before sent them 4 times, the last after all compute."""
    n = 4
    attention = ContextAttention(context_mesh((1, n, 1)), "ring", batch_axes=("data",))
    shapes = [((B, T, H, D), "float32"), ((B, T, KV, D), "float32"), ((B, T, KV, D), "float32"), ((B, T), "int32"), ((B, T), "int32")]
    args = [jax.ShapeDtypeStruct(s, d) for s, d in shapes]
    local_kv = B * (T // n) * KV * D * 4
    block = 2 * local_kv + 2 * B * (T // n) * 4  # k, v, segment ids, positions

    def backward(q, k, v, segments, positions, cotangent):
        return jax.vjp(lambda q, k, v: attention(q, k, v, segments, positions), q, k, v)[1]

    vjp = jax.eval_shape(backward, *args, args[0])
    lowered = jax.jit(lambda f, g: f(g)).lower(vjp, args[0])
    ops = collective_ops(parse_hlo(lowered.compile().as_text()), {"data": 1, "context": n, "tensor": 1})
    permutes = [op for op in ops if op.kind == "collective-permute"]
    assert permutes and all(op.axes == ("context",) for op in permutes)
    assert sum(op.bytes * op.executions for op in permutes) == (n - 1) * block + (n - 1) * 2 * local_kv


_SCHEDULED_LOOP = """HloModule m, is_scheduled=true, num_partitions=4

%body (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %p = (s32[], f32[8]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = f32[8]{0} get-tuple-element(%p), index=1
  %cp-start = (f32[8]{0}, f32[8]{0}) collective-permute-start(%x), channel_id=1, source_target_pairs={{0,1},{1,2},{2,3},{3,0}}, backend_config={"collective_backend_config":{"is_sync":false}}
  %f = f32[8]{0} fusion(%x), kind=kLoop, calls=%fused, metadata={op_name="jit(step)/context_attention/context_block/dot_general"}
  %cp-done = f32[8]{0} collective-permute-done(%cp-start)
  %cp-start.1 = (f32[8]{0}, f32[8]{0}) collective-permute-start(%cp-done), channel_id=2, source_target_pairs={{0,1},{1,2},{2,3},{3,0}}, backend_config={"collective_backend_config":{"is_sync":true}}
  %cp-done.1 = f32[8]{0} collective-permute-done(%cp-start.1)
  %out = f32[8]{0} add(%cp-done.1, %f)
  ROOT %t = (s32[], f32[8]) tuple(%i, %out)
}

%cond (q: (s32[], f32[8])) -> pred[] {
  %q = (s32[], f32[8]) parameter(0)
  ROOT %c = pred[] constant(true)
}

ENTRY %main (x0: f32[8]) -> (s32[], f32[8]) {
  %x0 = f32[8]{0} parameter(0)
  %zero = s32[] constant(0)
  %init = (s32[], f32[8]) tuple(%zero, %x0)
  ROOT %w = (s32[], f32[8]) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
}
"""


def test_ring_overlap_in_hlo_counts_sync_starts_as_synchronous_and_loop_trips():
    """In a loop of 3: an async permute around a block (overlapped) and one XLA marked is_sync (it found
    nothing to hide it behind and runs it in line): 6 permutes per step, 3 async and overlapped, 3 synchronous."""
    found = ring_overlap_in_hlo(_SCHEDULED_LOOP, {"context": 4})
    assert found == {"collective_permutes": 6, "over_context": 6, "async_pairs": 3, "overlapped_pairs": 3, "synchronous": 3}
