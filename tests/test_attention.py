"""Attention implementations agree with attention computed one document at a time.

The Pallas kernel runs interpreted on CPU. cuDNN cannot run here; its packed call is checked
by putting a stand-in for cuDNN behind JAX's own offset conversion (``_fix_seqlen_offsets``).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.cudnn import fused_attention_stablehlo as cudnn_attention

from jaxdist.models import attention
from jaxdist.models.attention import causal_attention, choose_implementation, packed_offsets

B, T, H, KV, D = 3, 128, 4, 2, 16


def layouts(rng: np.random.Generator, t: int) -> np.ndarray:
    """[3, t] segment ids: one document; many short ones (1-6 tokens); a few long ones."""
    short = np.repeat(np.arange(t), rng.integers(1, 7, size=t))[:t]
    few = np.searchsorted(np.sort(rng.choice(np.arange(1, t), size=3, replace=False)), np.arange(t), side="right")
    return np.stack([np.zeros(t, np.int64), short, few]).astype(np.int32)


def qkv(seed: int, t: int = T, d: int = D):
    rng = np.random.default_rng(seed)
    return tuple(jnp.asarray(rng.standard_normal((B, t, h, d)), jnp.float32) for h in (H, KV, KV))


def documents(row: np.ndarray) -> list[tuple[int, int]]:
    """[start, end) of each run of equal ids."""
    starts = [0, *(np.flatnonzero(row[1:] != row[:-1]) + 1).tolist()]
    return list(zip(starts, [*starts[1:], len(row)], strict=True))


def plain_causal(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Causal softmax attention of one sequence [L, heads, D] in float64, kv heads shared by groups."""
    group = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    scores = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(q.shape[-1])
    scores = np.where(np.tril(np.ones(scores.shape[1:], bool)), scores, -np.inf)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    return np.einsum("hqk,khd->qhd", weights / weights.sum(-1, keepdims=True), v)


def per_document(q, k, v, segment_ids) -> np.ndarray:
    """Reference: cut each document out of its row, attend within it alone, put it back."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    out = np.zeros_like(q)
    for b, row in enumerate(np.asarray(segment_ids)):
        for s, e in documents(row):
            out[b, s:e] = plain_causal(q[b, s:e], k[b, s:e], v[b, s:e])
    return out


def grads(impl: str, q, k, v, segment_ids, cotangent):
    loss = lambda q, k, v: jnp.sum(causal_attention(q, k, v, segment_ids, implementation=impl) * cotangent)  # noqa: E731
    return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)


def test_pallas_packed_matches_per_document_reference_and_xla_gradients():
    segment_ids = jnp.asarray(layouts(np.random.default_rng(0), T))
    q, k, v = qkv(0)
    out = causal_attention(q, k, v, segment_ids, implementation="pallas")
    assert out.shape == (B, T, H, D) and out.dtype == jnp.float32
    np.testing.assert_allclose(out, per_document(q, k, v, segment_ids), atol=1e-5, rtol=0)

    cotangent = jnp.asarray(np.random.default_rng(9).standard_normal(out.shape), jnp.float32)
    expected = grads("xla", q, k, v, segment_ids, cotangent)
    for name, got, want in zip("qkv", grads("pallas", q, k, v, segment_ids, cotangent), expected, strict=True):
        assert float(jnp.max(jnp.abs(want))) > 1e-2, name  # a gradient that is there to compare
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=0, err_msg=f"d{name}")


def test_pallas_without_segments_is_plain_causal():
    q, k, v = qkv(1, t=64, d=32)
    out = causal_attention(q, k, v, implementation="pallas")
    np.testing.assert_allclose(out, per_document(q, k, v, np.zeros((B, 64), np.int32)), atol=1e-5, rtol=0)


def test_xla_mask_matches_per_document_reference():
    segment_ids = jnp.asarray(layouts(np.random.default_rng(1), T))
    q, k, v = qkv(2)
    out = causal_attention(q, k, v, segment_ids, implementation="xla")
    np.testing.assert_allclose(out, per_document(q, k, v, segment_ids), atol=1e-5, rtol=0)
    # Without segment ids a row is one document; bf16 in, bf16 out.
    out = causal_attention(*(x.astype(jnp.bfloat16) for x in (q, k, v)), implementation="xla")
    assert out.dtype == jnp.bfloat16
    np.testing.assert_allclose(out.astype(jnp.float32), per_document(q, k, v, np.zeros((B, T), np.int32)), atol=5e-2, rtol=0)


def numpy_packed_offsets(segment_ids: np.ndarray, m: int) -> tuple[np.ndarray, np.ndarray]:
    """The documented convention, by a loop: starts and lengths of the first m documents, -1 after."""
    offsets, lengths = np.full((len(segment_ids), m + 1), -1), np.full((len(segment_ids), m), -1)
    for b, row in enumerate(segment_ids):
        for j, (s, e) in enumerate(documents(row)[:m]):
            offsets[b, j], lengths[b, j] = s, e - s
    return offsets, lengths


@pytest.mark.parametrize("seed", range(4))
def test_packed_offsets_matches_numpy_loop(seed):
    rng = np.random.default_rng(seed)
    segment_ids = np.concatenate([layouts(rng, 96), 3 * layouts(rng, 96)])  # also ids that skip numbers
    n_docs = [len(documents(row)) for row in segment_ids]
    assert n_docs[0] == 1 and max(n_docs) > 16  # a single-document row and one that overflows m=16
    for m in (2, 16, 96):
        offsets, lengths = packed_offsets(jnp.asarray(segment_ids), m)
        assert offsets.dtype == lengths.dtype == jnp.int32
        want_offsets, want_lengths = numpy_packed_offsets(segment_ids, m)
        np.testing.assert_array_equal(offsets, want_offsets)
        np.testing.assert_array_equal(lengths, want_lengths)
    np.testing.assert_array_equal(attention.num_segments(jnp.asarray(segment_ids)), n_docs)


def test_packed_offsets_become_cudnn_flat_layout():
    """JAX's own conversion turns them into cuDNN's form: every document's length, then 0s; every
    document's start in elements of the whole [B*T, N, D] buffer, then the buffer's end."""
    segment_ids = layouts(np.random.default_rng(5), 64)
    m = 32
    offsets, lengths = packed_offsets(jnp.asarray(segment_ids), m)
    q = jnp.zeros((3, 64, H, D), jnp.bfloat16)
    flat_len, _, flat_off, _ = jax.jit(cudnn_attention._fix_seqlen_offsets)(lengths, lengths, offsets, offsets, q, q)
    docs = [(b * 64 + s, e - s) for b, row in enumerate(segment_ids) for s, e in documents(row)]
    n = len(docs)
    assert 1 < max(len(documents(row)) for row in segment_ids) <= m
    np.testing.assert_array_equal(np.asarray(flat_len).ravel()[:n], [size for _, size in docs])
    assert not np.asarray(flat_len).ravel()[n:].any()
    np.testing.assert_array_equal(np.asarray(flat_off).ravel()[:n], [start * H * D for start, _ in docs])
    assert (np.asarray(flat_off).ravel()[n:] == 3 * 64 * H * D).all()


def fake_cudnn(query, key, value, bias, mask, q_seqlen, kv_seqlen, q_offsets, kv_offsets, *, scale, mask_type, qkv_layout):
    """Stand-in for cuDNN's packed attention: attends within each (offset, length) of the flat
    layout that JAX hands to cuDNN, causally from each document's start."""
    assert bias is None and mask is None and qkv_layout == "BTNH"
    assert mask_type == cudnn_attention.MaskType.PADDING_CAUSAL  # ragged offsets need the padding mask
    assert key.shape == value.shape == query.shape  # GQA heads repeated (jax's kv-offset stride bug)
    assert scale == pytest.approx(query.shape[-1] ** -0.5)
    np.testing.assert_array_equal(q_seqlen, kv_seqlen)
    np.testing.assert_array_equal(q_offsets, kv_offsets)
    b, t, n, d = query.shape
    lengths, _, offsets, _ = jax.jit(cudnn_attention._fix_seqlen_offsets)(q_seqlen, kv_seqlen, q_offsets, kv_offsets, query, key)
    q, k, v = (np.asarray(x, np.float64).reshape(b * t, n, d) for x in (query, key, value))
    out = np.zeros_like(q)
    for start, size in zip(np.asarray(offsets).ravel() // (n * d), np.asarray(lengths).ravel(), strict=False):
        if size > 0:
            out[start : start + size] = plain_causal(q[start : start + size], k[start : start + size], v[start : start + size])
    return jnp.asarray(out.reshape(b, t, n, d), query.dtype)


def test_cudnn_packed_call_with_stand_in(monkeypatch):
    monkeypatch.setattr(cudnn_attention, "dot_product_attention", fake_cudnn)
    segment_ids = layouts(np.random.default_rng(3), 64)
    q, k, v = qkv(4, t=64)
    n_docs = [len(documents(row)) for row in segment_ids]

    out = causal_attention(q, k, v, jnp.asarray(segment_ids), implementation="cudnn", max_segments=max(n_docs))
    np.testing.assert_allclose(out, per_document(q, k, v, segment_ids), atol=1e-5, rtol=0)

    # Too many documents for max_segments: that row is NaN, the others are still right.
    out = causal_attention(q, k, v, jnp.asarray(segment_ids), implementation="cudnn", max_segments=4)
    over = np.array(n_docs) > 4
    assert over.any() and not over.all()
    assert np.isnan(np.asarray(out)[over]).all()
    np.testing.assert_allclose(np.asarray(out)[~over], per_document(q, k, v, segment_ids)[~over], atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="max_segments"):
        causal_attention(q, k, v, jnp.asarray(segment_ids), implementation="cudnn", max_segments=1)


def test_default_max_segments():
    assert attention.default_max_segments(2048) == 64
    assert attention.default_max_segments(32) == 2


def test_pallas_rejects_unsupported_shapes():
    with pytest.raises(ValueError, match="seq_len"):
        causal_attention(*qkv(0, t=96), implementation="pallas")
    with pytest.raises(ValueError, match="head_dim"):
        causal_attention(*qkv(0, t=64, d=8), implementation="pallas")
    with pytest.raises(ValueError, match="implementation"):
        causal_attention(*qkv(0, t=64), implementation="flash")


@pytest.mark.parametrize(
    "requested, platform, dtype, head_dim, packed, cc, want",
    [
        ("auto", "gpu", jnp.bfloat16, 128, False, None, "cudnn"),
        ("auto", "gpu", jnp.float16, 72, True, "9.0", "cudnn"),
        ("auto", "gpu", jnp.bfloat16, 64, True, "10.0", "cudnn"),
        ("auto", "cpu", jnp.bfloat16, 64, True, None, "xla"),
        ("auto", "tpu", jnp.float32, 64, False, None, "xla"),
        ("xla", "gpu", jnp.bfloat16, 64, True, "9.0", "xla"),
        ("cudnn", "cpu", jnp.float32, 64, False, None, "cudnn"),
        ("pallas", "cpu", jnp.float32, 64, True, None, "pallas"),
    ],
)
def test_choose_implementation_without_note(requested, platform, dtype, head_dim, packed, cc, want):
    choice = choose_implementation(requested, platform=platform, dtype=dtype, head_dim=head_dim, packed=packed, compute_capability=cc)
    assert choice == (want, None)


@pytest.mark.parametrize(
    "dtype, head_dim, cc, reason",
    [
        (jnp.float32, 64, "9.0", "float32"),
        (jnp.bfloat16, 256, "9.0", "head_dim 256"),
        (jnp.bfloat16, 100, "9.0", "head_dim 100"),
        (jnp.bfloat16, 64, "8.0", "8.0"),
    ],
)
def test_choose_implementation_gpu_fallback_says_why(dtype, head_dim, cc, reason):
    impl, note = choose_implementation("auto", platform="gpu", dtype=dtype, head_dim=head_dim, packed=True, compute_capability=cc)
    assert impl == "xla" and reason in note and "\n" not in note


def test_choose_implementation_rejects_unknown_name():
    with pytest.raises(ValueError, match="flash"):
        choose_implementation("flash", platform="gpu", dtype=jnp.bfloat16, head_dim=64, packed=False)


def test_decoder_with_fused_packed_attention_matches_xla():
    """The whole decoder on packed documents: Pallas flash attention (interpreted on CPU)
    gives the logits of XLA's explicit-mask attention."""
    from flax import nnx

    from jaxdist.config import ModelConfig
    from jaxdist.models.llama import Llama

    cfg = ModelConfig(vocab_size=128, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2)
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, 128, (2, 64)), jnp.int32)
    segment_ids = jnp.asarray(np.sort(rng.integers(0, 4, (2, 64)), axis=1), jnp.int32)
    starts = np.concatenate([np.ones((2, 1), bool), np.diff(np.asarray(segment_ids), axis=1) != 0], axis=1)
    index = np.arange(64)
    positions = jnp.asarray(index - np.maximum.accumulate(np.where(starts, index, 0), axis=1), jnp.int32)
    logits = {impl: Llama(cfg, attention=impl, rngs=nnx.Rngs(0))(tokens, positions, segment_ids) for impl in ("xla", "pallas")}
    np.testing.assert_allclose(logits["pallas"], logits["xla"], atol=2e-5, rtol=1e-5)


def test_xla_kernel_matches_jax_attention_outputs_and_gradients():
    """The recomputing backward (``grouped_attention``) against autodiff through
    ``jax.nn.dot_product_attention`` with the same document mask (an independent path)."""
    segment_ids = jnp.asarray(layouts(np.random.default_rng(3), T))
    q, k, v = qkv(4)
    cotangent = jnp.asarray(np.random.default_rng(5).standard_normal((B, T, H, D)), jnp.float32)

    def reference(q, k, v):
        mask = attention.document_causal_mask(segment_ids)
        return jax.nn.dot_product_attention(q, k, v, mask=mask, implementation="xla")

    def ours(q, k, v):
        return causal_attention(q, k, v, segment_ids, implementation="xla")

    np.testing.assert_allclose(ours(q, k, v), reference(q, k, v), atol=1e-5, rtol=0)
    want = jax.grad(lambda *a: jnp.sum(reference(*a) * cotangent), argnums=(0, 1, 2))(q, k, v)
    got = jax.grad(lambda *a: jnp.sum(ours(*a) * cotangent), argnums=(0, 1, 2))(q, k, v)
    for name, g, w in zip("qkv", got, want, strict=True):
        assert float(jnp.max(jnp.abs(w))) > 1e-2, name
        np.testing.assert_allclose(g, w, atol=2e-5, rtol=0, err_msg=f"d{name}")
    # bf16 in: bf16 gradients, close to the fp32 ones
    low = jax.grad(lambda *a: jnp.sum(ours(*a).astype(jnp.float32) * cotangent), argnums=(0, 1, 2))(
        *(x.astype(jnp.bfloat16) for x in (q, k, v))
    )
    for name, g, w in zip("qkv", low, want, strict=True):
        assert g.dtype == jnp.bfloat16
        np.testing.assert_allclose(g.astype(jnp.float32), w, atol=0.1, rtol=0.05, err_msg=f"bf16 d{name}")


def test_packed_offsets_are_split_over_the_batch_like_the_segment_ids():
    """JAX's cuDNN call partitions with its operands' shardings as it finds them; built by a scatter,
    the offsets came out whole on every device (P()) beside batch-split queries, so each device's
    call read all rows' documents against its own rows. Built row by row they follow the segment ids."""
    from jax.sharding import AxisType, NamedSharding, PartitionSpec

    mesh = jax.make_mesh((2, 2), ("data", "tensor"), axis_types=(AxisType.Auto,) * 2)
    segment_ids = jax.ShapeDtypeStruct((4, 64), jnp.int32, sharding=NamedSharding(mesh, PartitionSpec("data")))
    compiled = jax.jit(lambda s: packed_offsets(s, 4)).lower(segment_ids).compile()
    assert [s.spec for s in compiled.output_shardings] == [PartitionSpec("data"), PartitionSpec("data")]


@pytest.mark.parametrize(
    "dtype, head_dim, cc, reason",
    [
        (jnp.bfloat16, 64, "8.0", "packed documents (sequence packing) needs compute capability >= 9.0 (Hopper), these GPUs are 8.0"),
        (jnp.float32, 64, "9.0", "needs bf16/fp16 compute, got float32"),
        (jnp.bfloat16, 192, "8.0", "head_dim <= 128 and a multiple of 8, got 192"),
        (jnp.bfloat16, 100, "9.0", "head_dim <= 256 and a multiple of 8, got 100"),
    ],
)
def test_explicit_cudnn_that_cudnn_would_refuse_is_one_config_error(dtype, head_dim, cc, reason):
    """Refused before anything is traced (JAX's own check fails inside the trace, with a traceback);
    what cuDNN takes passes, on a GPU whose capability is unknown too, and on CPU (the stand-in tests)."""
    from jaxdist.errors import ConfigError

    with pytest.raises(ConfigError) as error:
        choose_implementation("cudnn", platform="gpu", dtype=dtype, head_dim=head_dim, packed=True, compute_capability=cc)
    assert str(error.value).startswith("model.attention=cudnn: ") and reason in str(error.value) and "\n" not in str(error.value)
    for ok in ("9.0", None):
        assert choose_implementation("cudnn", platform="gpu", dtype=jnp.bfloat16, head_dim=64, packed=True, compute_capability=ok) == (
            "cudnn",
            None,
        )
    assert choose_implementation("cudnn", platform="cpu", dtype=dtype, head_dim=head_dim, packed=True, compute_capability=cc)[0] == "cudnn"


@pytest.mark.parametrize(("dtype", "head_dim", "cc"), [(jnp.float32, 64, "9.0"), (jnp.bfloat16, 256, "9.0"), (jnp.bfloat16, 64, "8.0")])
def test_auto_fallback_names_the_kernel_that_runs(dtype, head_dim, cc):
    impl, note = choose_implementation("auto", platform="gpu", dtype=dtype, head_dim=head_dim, packed=True, compute_capability=cc)
    assert impl == "xla" and "runs XLA's kernel (model.attention=xla)" in note and "\n" not in note, note


def test_packed_attention_that_batches_itself_matches_a_loop_over_the_mapped_axis():
    """``batching_itself`` (what cuDNN's packed call is wrapped in under DiLoCo's vmap, where JAX's
    own batching rule fails) with XLA's kernel inside: outputs and gradients under ``vmap`` equal
    the same call made replica by replica, and the outputs the per-document reference; segment
    ids shared by the replicas (not mapped) as well."""
    rng = np.random.default_rng(7)
    replicas = [qkv(seed, t=64) for seed in (8, 9)]
    q, k, v = (jnp.stack(x) for x in zip(*replicas, strict=True))
    ids = jnp.asarray(np.stack([layouts(rng, 64), layouts(rng, 64)]))
    cotangent = jnp.asarray(rng.standard_normal(q.shape[1:]), jnp.float32)
    call = attention.batching_itself(lambda q, k, v, ids: attention.grouped_attention(q, k, v, ids))

    def loss(q, k, v, ids):
        return jnp.sum(call(q, k, v, ids) * cotangent)

    for shared in (False, True):
        row_ids = ids[:1].repeat(2, 0) if shared else ids
        out = jax.jit(jax.vmap(call, in_axes=(0, 0, 0, None if shared else 0)))(q, k, v, ids[0] if shared else ids)
        got = jax.jit(jax.vmap(jax.grad(loss, argnums=(0, 1, 2)), in_axes=(0, 0, 0, None if shared else 0)))(
            q, k, v, ids[0] if shared else ids
        )
        for r in range(2):
            np.testing.assert_allclose(out[r], per_document(q[r], k[r], v[r], row_ids[r]), atol=1e-5, rtol=0)
            want = grads("xla", q[r], k[r], v[r], row_ids[r], cotangent)
            for g, w in zip(got, want, strict=True):
                np.testing.assert_allclose(g[r], w, atol=1e-5, rtol=1e-5)
