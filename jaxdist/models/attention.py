"""Causal self-attention, optionally restricted to packed documents, by one of three implementations.

A batch row may hold several documents ("packing"): ``segment_ids`` [batch, seq] numbers them
(non-decreasing along the row, e.g. 0,0,0,1,1,2,...) and a token attends only to earlier tokens
of its own document.

- ``xla``: plain XLA ops (``grouped_attention``): scores per kv-head group with the causal /
  document mask, softmax in fp32; its backward recomputes the probabilities from the saved
  log-sum-exp, as flash attention does, so a layer keeps q, k, v, output and [B,H,T]
  statistics for the backward instead of [B,H,T,T] probabilities. It still forms each
  layer's [B,H,T,T] scores, which is what runs out of memory at long sequences.
- ``cudnn``: cuDNN's fused flash attention. Packed documents use cuDNN's sequence packing
  (per-document offsets and lengths), which needs a Hopper or newer GPU and 16-bit inputs.
- ``pallas``: JAX's Pallas (Triton) flash attention, which takes segment ids directly; runs
  interpreted (slowly) on CPU so that tests can check it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_batching import custom_vmap

from jaxdist.errors import ConfigError
from jaxdist.layout import step_context
from jaxdist.layout.sharding import manual_over_the_rest, region_spec

IMPLEMENTATIONS = ("auto", "xla", "cudnn", "pallas")

# The Pallas kernel's tiles (its defaults: 128 forward, 32 backward). Triton needs power-of-two
# tiles of at least 16, so a sequence shorter than a tile must itself be such a power of two.
_PALLAS_BLOCK = 128
_PALLAS_MIN_DIM = 16


SCOPE = "attention"  # the name scope of the score computation in HLO metadata (jaxdist.plan prices it)


def model_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array | None, positions: jax.Array, *, implementation: str
) -> jax.Array:
    """What a model calls: the step's sequence kernel when one is installed (context
    parallelism, ``layout.step_context``; it needs the positions, as the tokens may be
    reordered), else ``causal_attention`` on the whole sequence."""
    kernel = step_context.current().sequence_kernel
    if kernel is not None:
        with jax.named_scope(SCOPE):
            return kernel(q, k, v, segment_ids, positions)
    return causal_attention(q, k, v, segment_ids, implementation=implementation)


def causal_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array | None = None, *, implementation: str, max_segments: int | None = None
) -> jax.Array:
    """Causal attention, within documents when ``segment_ids`` is given.

    q: [B, T, H, D]; k, v: [B, T, KV, D] with H a multiple of KV; segment_ids: [B, T] int32,
    non-decreasing along each row. Returns [B, T, H, D] in q's dtype. ``max_segments`` is only
    used by ``cudnn`` with segment ids (see ``default_max_segments``).
    """
    with jax.named_scope(SCOPE):
        return _causal_attention(q, k, v, segment_ids, implementation=implementation, max_segments=max_segments)


def _causal_attention(q, k, v, segment_ids, *, implementation: str, max_segments: int | None) -> jax.Array:
    if implementation == "xla_fp32":  # float16 on CPU (see choose_implementation)
        up = lambda x: x.astype(jnp.float32)  # noqa: E731
        return _causal_attention(up(q), up(k), up(v), segment_ids, implementation="xla", max_segments=None).astype(q.dtype)
    if implementation == "xla":
        return grouped_attention(q, k, v, segment_ids)
    if implementation == "cudnn":
        return _cudnn(q, k, v, segment_ids, default_max_segments(q.shape[1]) if max_segments is None else max_segments)
    if implementation == "pallas":
        return _pallas(q, k, v, segment_ids)
    raise ValueError(f"attention implementation must be xla, cudnn or pallas here, got {implementation!r}")


def grouped_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array | None) -> jax.Array:
    """Causal (and within-document) attention in plain XLA ops, q [B, T, H, D] over k, v
    [B, S, KV, D]: query head i reads kv head i // (H/KV), as ``jax.nn.dot_product_attention``.

    The heads are viewed as [KV, H/KV] groups (a free reshape), so GQA needs no repeated keys;
    scores [B, KV, T, H/KV, S] in fp32 keep the dot products in the order XLA's dot emits
    them (no transposes around the softmax). The backward pass recomputes the probabilities
    from the log-sum-exp (``_attention_bwd``) rather than storing them.
    """
    b, t, h, d = q.shape
    kv = k.shape[2]
    mask = _visible(segment_ids, t, k.shape[1])
    out = _attention(q.reshape(b, t, kv, h // kv, d), k, v, mask)
    return out.reshape(b, t, h, d)


def _visible(segment_ids: jax.Array | None, t: int, s: int) -> jax.Array:
    """[B or 1, T, S] boolean: causal, and within the same document when ids are given."""
    causal = jnp.arange(s)[None, :] <= jnp.arange(t)[:, None]
    if segment_ids is None:
        return causal[None]
    return causal[None] & (segment_ids[:, :, None] == segment_ids[:, None, :])


def _scores(q: jax.Array, k: jax.Array, mask: jax.Array) -> jax.Array:
    """[B, KV, T, G, S] fp32 scaled scores, masked entries at the dtype's minimum."""
    scores = jnp.einsum("btkgd,bskd->bktgs", q, k, preferred_element_type=jnp.float32) * (q.shape[-1] ** -0.5)
    return jnp.where(mask[:, None, :, None, :], scores, jnp.finfo(jnp.float32).min)


@jax.custom_vjp
def _attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    return _attention_fwd(q, k, v, mask)[0]


def _attention_fwd(q, k, v, mask):
    scores = _scores(q, k, mask)
    peak = jnp.max(scores, axis=-1, keepdims=True)  # every row sees at least its own token
    weights = jnp.exp(scores - peak)
    total = jnp.sum(weights, axis=-1, keepdims=True)
    out = jnp.einsum("bktgs,bskd->bktgd", (weights / total).astype(v.dtype), v, preferred_element_type=jnp.float32)
    out = jnp.transpose(out, (0, 2, 1, 3, 4)).astype(q.dtype)
    lse = peak + jnp.log(total)  # [B, KV, T, G, 1]
    return out, (q, k, v, mask, out, lse)


def _attention_bwd(residuals, d_out):
    """Flash attention's backward without tiles: the probabilities recomputed from the
    log-sum-exp (one [B,H,T,S] matmul) instead of read back from memory."""
    q, k, v, mask, out, lse = residuals
    probs = jnp.exp(_scores(q, k, mask) - lse)  # [B, KV, T, G, S]
    # Products with the [.., T, G, S] matrices are written with them as the right operand, in
    # their stored order (dv, dk come out as [B, KV, D, S] and are transposed, small): written
    # the other way, XLA's CPU dot copies the probability matrix transposed first.
    dv = jnp.einsum("btkgd,bktgs->bkds", d_out, probs.astype(v.dtype), preferred_element_type=jnp.float32).transpose(0, 3, 1, 2)
    d_probs = jnp.einsum("btkgd,bskd->bktgs", d_out, v, preferred_element_type=jnp.float32)
    row = jnp.einsum("btkgd,btkgd->bktg", d_out.astype(jnp.float32), out.astype(jnp.float32))  # sum_s p dp = <d_out, out>
    d_scores = (probs * (d_probs - row[..., None]) * (q.shape[-1] ** -0.5)).astype(q.dtype)
    dq = jnp.einsum("bktgs,bskd->bktgd", d_scores, k, preferred_element_type=jnp.float32).transpose(0, 2, 1, 3, 4)
    dk = jnp.einsum("btkgd,bktgs->bkds", q, d_scores, preferred_element_type=jnp.float32).transpose(0, 3, 1, 2)
    mask_zero = np.zeros(mask.shape, jax.dtypes.float0)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), mask_zero


_attention.defvjp(_attention_fwd, _attention_bwd)


def document_causal_mask(segment_ids: jax.Array) -> jax.Array:
    """[B, 1, T, T] boolean mask: causal and within the same document."""
    t = segment_ids.shape[1]
    same_doc = segment_ids[:, :, None] == segment_ids[:, None, :]
    return (jnp.tril(jnp.ones((t, t), dtype=bool)) & same_doc)[:, None]


def num_segments(segment_ids: jax.Array) -> jax.Array:
    """[B] number of documents in each row (a new one starts wherever the id changes)."""
    return 1 + jnp.sum(segment_ids[:, 1:] != segment_ids[:, :-1], axis=1, dtype=jnp.int32)


# ---------------------------------------------------------------------------------------------
# cuDNN


def default_max_segments(seq_len: int) -> int:
    """Documents per row that the cuDNN packed call makes room for: one per 32 tokens (at least 2).

    It is a static shape, and it costs memory: cuDNN keeps softmax statistics of shape
    [B * max_segments, H, T] float32 per layer, so max_segments = T would be as large as the
    scores that flash attention avoids. T // 32 keeps them at 1/16 of bf16 [B,H,T,T] scores.
    A row with more documents gets NaN output (see ``_cudnn_packed``), never a wrong one.
    """
    return max(2, seq_len // 32)


@functools.partial(jax.jit, static_argnames="max_segments")
def packed_offsets(segment_ids: jax.Array, max_segments: int) -> tuple[jax.Array, jax.Array]:
    """Per-row document starts and lengths in the convention of cuDNN sequence packing in JAX.

    With M = max_segments, returns (offsets [B, M+1], lengths [B, M]), both int32: offsets[b, j]
    is the index within row b of the first token of its j-th document, lengths[b, j] that
    document's token count; unused entries are -1, so the last column of offsets is always -1.
    (``jax._src.cudnn.fused_attention_stablehlo`` shifts the valid entries of all rows together
    into cuDNN's flat [total documents] form.) Documents past the M-th are left out.

    Built row by row with no sort and no scatter: document j starts where the tokens of the
    documents before it end, so its offset is the count of the row's tokens whose document index
    (a cumulative sum of the starts) is below j, and a count of the whole row (t) means "no such
    document". A comparison and a sum along the sequence are one reduction kernel on a GPU (a
    sort of the row was the largest kernel of the step and a fifth of its compile), and the sharding
    partitioner splits them over the batch axes as it splits the segment ids: JAX's cuDNN call
    takes their sharding as it finds it (a scatter-built form was left whole on every device, each
    device's call then reading every row's documents against its own rows;
    ``tests/test_context_gpu.py`` checks the per-device operands).
    """
    b, t = segment_ids.shape
    starts = jnp.concatenate([jnp.ones((b, 1), bool), segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)
    document = jnp.cumsum(starts, axis=1, dtype=jnp.int32) - 1  # each token's document index in its row
    documents = jnp.arange(max_segments + 1, dtype=jnp.int32)
    # first[b, j]: where row b's j-th document starts, t where it has fewer than j + 1
    first = jnp.sum(document[:, None, :] < documents[None, :, None], axis=2, dtype=jnp.int32)
    valid = first[:, :-1] < t
    lengths = jnp.where(valid, first[:, 1:] - first[:, :-1], -1)
    offsets = jnp.concatenate([jnp.where(valid, first[:, :-1], -1), jnp.full((b, 1), -1, jnp.int32)], axis=1)
    return offsets, lengths


def _cudnn(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array | None, max_segments: int) -> jax.Array:
    """cuDNN's flash attention, packed or not. Inside a pipeline stage (a region manual over
    'pipe' only) JAX's cuDNN partitioning rule fails, so there the call runs manual over the
    remaining axes too (``sharding.manual_over_the_rest``): batch and heads split as the
    activations are; kv heads the tensor axis cannot split are repeated to the query heads first."""
    heads, kv_heads = ("batch", "seq", "act_heads", None), ("batch", "seq", "act_kv_heads", None)
    q_spec, kv_spec = region_spec(heads, q.shape), region_spec(kv_heads, k.shape)
    if q_spec is not None and q_spec[2] != kv_spec[2]:  # the heads split, the kv heads not: each device needs its groups'
        repeat = q.shape[2] // k.shape[2]
        k, v = jnp.repeat(k, repeat, axis=2), jnp.repeat(v, repeat, axis=2)
        kv_heads = heads
    if segment_ids is None:
        call = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")  # noqa: E731
        return manual_over_the_rest(call, (heads, kv_heads, kv_heads), heads)(q, k, v)
    call = lambda q, k, v, ids: _cudnn_packed(q, k, v, ids, max_segments)  # noqa: E731
    if step_context.current().vmapped:
        call = batching_itself(call)
    return manual_over_the_rest(call, (heads, kv_heads, kv_heads, ("batch", "seq")), heads)(q, k, v, segment_ids)


def _cudnn_packed(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array, max_segments: int) -> jax.Array:
    # A private JAX module: jax.nn.dot_product_attention does not expose sequence packing (jax 0.10).
    from jax._src.cudnn import fused_attention_stablehlo as cudnn_attention

    if max_segments < 2:  # with one segment JAX treats the call as unpacked
        raise ValueError(f"max_segments must be at least 2 for cuDNN sequence packing, got {max_segments}")
    # jax <= 0.11.0 scales kv_offsets by the query head count (fixed upstream in jax-ml/jax#39521),
    # which reads the wrong keys under grouped-query attention: give k and v all H heads.
    repeat = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, repeat, axis=2), jnp.repeat(v, repeat, axis=2)
    offsets, lengths = packed_offsets(segment_ids, max_segments)
    # Ragged offsets need cuDNN's padding mask (lengths), hence PADDING_CAUSAL; causal is then
    # applied inside each document, which is causal in the row restricted to that document.
    out = cudnn_attention.dot_product_attention(
        q, k, v, None, None, lengths, lengths, offsets, offsets,
        scale=q.shape[-1] ** -0.5, mask_type=cudnn_attention.MaskType.PADDING_CAUSAL, qkv_layout="BTNH",
    )  # fmt: skip
    # A row with more than max_segments documents is only partly covered: make it loudly NaN
    # (a non-finite loss stops or skips the step) rather than silently wrong.
    overflow = num_segments(segment_ids) > max_segments
    return jnp.where(overflow[:, None, None, None], jnp.nan, out).astype(q.dtype)


def batching_itself(call):
    """``call(q, k, v, segment_ids)`` as one that ``jax.vmap`` folds into its batch rows.

    JAX's batching rule for cuDNN attention (jax 0.10-0.11) reshapes the packed form's
    per-document lengths to one value per row and leaves the offsets as they are, so under
    ``vmap`` (DiLoCo's replicas) the packed call fails to trace. Here the forward and the
    backward are each a ``custom_vmap`` whose rule merges the mapped axis into the batch
    (every input leads with it), and a ``custom_vjp`` joins them: its backward computes the
    forward again (``jax.vjp`` of ``call``) rather than keep cuDNN's statistics, one more
    attention forward per layer."""

    def folded(f):
        g = custom_vmap(f)

        @g.def_vmap
        def rule(axis_size, in_batched, *args):
            args = [a if batched else jnp.broadcast_to(a, (axis_size, *a.shape)) for batched, a in zip(in_batched, args, strict=True)]
            out = g(*(a.reshape(axis_size * a.shape[1], *a.shape[2:]) for a in args))
            unfold = lambda o: o.reshape(axis_size, o.shape[0] // axis_size, *o.shape[1:])  # noqa: E731
            return jax.tree.map(unfold, out), jax.tree.map(lambda _: True, out)

        return g

    forward = folded(call)
    backward = folded(lambda q, k, v, ids, grad: jax.vjp(lambda q, k, v: call(q, k, v, ids), q, k, v)[1](grad))

    @jax.custom_vjp
    def attention(q, k, v, ids):
        return forward(q, k, v, ids)

    def attention_fwd(q, k, v, ids):
        return forward(q, k, v, ids), (q, k, v, ids)

    def attention_bwd(residuals, grad):
        return (*backward(*residuals, grad), None)

    attention.defvjp(attention_fwd, attention_bwd)
    return attention


# ---------------------------------------------------------------------------------------------
# Pallas


def _pallas(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array | None) -> jax.Array:
    from jax.experimental.pallas.ops.gpu import attention as pallas_attention

    t, d = q.shape[1], q.shape[-1]
    if not (t % _PALLAS_BLOCK == 0 or (_PALLAS_MIN_DIM <= t < _PALLAS_BLOCK and t & (t - 1) == 0)):
        raise ValueError(f"pallas attention needs seq_len a multiple of {_PALLAS_BLOCK} or a power of two in [16, 128), got {t}")
    if d < _PALLAS_MIN_DIM:
        raise ValueError(f"pallas attention needs head_dim >= {_PALLAS_MIN_DIM}, got {d}")
    repeat = q.shape[2] // k.shape[2]  # the kernel wants as many kv heads as query heads
    k, v = jnp.repeat(k, repeat, axis=2), jnp.repeat(v, repeat, axis=2)
    return pallas_attention.mha(q, k, v, segment_ids, sm_scale=d**-0.5, causal=True, interpret=jax.default_backend() == "cpu")


# ---------------------------------------------------------------------------------------------
# Choice


def cudnn_refusal(*, dtype, head_dim: int, packed: bool, compute_capability: str | None) -> str | None:
    """Why JAX's cuDNN flash attention would refuse this configuration on GPUs of ``compute_capability``
    (its own checks, ``jax._src.cudnn.fused_attention_stablehlo``: 16-bit inputs, head_dim a multiple of
    8 up to 128, 256 on Hopper, packed documents on Hopper or newer), or None; an unknown capability
    (None) is not held against it."""
    cc = None if compute_capability is None else tuple(int(x) for x in compute_capability.split("."))
    if jnp.dtype(dtype).itemsize != 2:
        return f"cuDNN flash attention needs bf16/fp16 compute, got {jnp.dtype(dtype).name}"
    limit = 256 if cc is not None and cc >= (9, 0) else 128
    if head_dim > limit or head_dim % 8:
        return f"cuDNN flash attention needs head_dim <= {limit} and a multiple of 8, got {head_dim}"
    if packed and cc is not None and cc < (9, 0):
        return f"cuDNN flash attention on packed documents (sequence packing) needs compute capability >= 9.0 (Hopper), these GPUs are {compute_capability}"
    return None


def choose_implementation(
    requested: str, *, platform: str, dtype, head_dim: int, packed: bool, compute_capability: str | None = None
) -> tuple[str, str | None]:
    """(implementation, note) for ``model.attention`` = auto | xla | cudnn | pallas.

    Explicit choices are returned as they are, except ``cudnn`` on GPUs whose cuDNN attention
    would refuse the configuration (``cudnn_refusal``): a ``ConfigError``, one line, before
    anything is compiled, rather than JAX's error from inside the trace. ``auto`` is cudnn on a
    GPU when it applies (16-bit dtype, head_dim <= 128 and a multiple of 8, and for packed
    documents a Hopper or newer GPU, ``compute_capability`` >= "9.0": the mesh's devices',
    required then), else xla. When auto falls back to xla on a GPU, the note says why and which
    kernel runs instead, in one line; else it is None.
    """
    if requested not in IMPLEMENTATIONS:
        raise ValueError(f"model.attention must be one of {', '.join(IMPLEMENTATIONS)}, got {requested!r}")
    if platform == "cpu" and jnp.dtype(dtype) == jnp.float16 and requested in ("auto", "xla"):
        return "xla_fp32", "attention: float16 on CPU: scores are computed in float32 (XLA's CPU dot has no f16 x f16 -> f32 form)"
    if requested == "cudnn" and platform == "gpu":
        reason = cudnn_refusal(dtype=dtype, head_dim=head_dim, packed=packed, compute_capability=compute_capability)
        if reason:
            fix = "model.attention=auto runs XLA's attention here" + (", or data.document_mask=false" if packed else "")
            raise ConfigError(f"model.attention=cudnn: {reason}; {fix}")
    if requested != "auto":
        return requested, None
    if platform != "gpu":
        return "xla", None
    instead = "attention runs XLA's kernel (model.attention=xla), which materialises [batch, heads, seq, seq] scores per layer"
    if jnp.dtype(dtype).itemsize != 2:
        return "xla", f"attention: {jnp.dtype(dtype).name} compute, cuDNN flash attention needs bf16/fp16; {instead}"
    if head_dim > 128 or head_dim % 8:
        return "xla", f"attention: head_dim {head_dim} does not suit cuDNN (<= 128, multiple of 8); {instead}"
    if packed:
        cc = compute_capability
        if cc is None:
            raise ValueError("attention: packed documents on a GPU need the devices' compute capability to choose a kernel")
        if tuple(int(x) for x in cc.split(".")) < (9, 0):
            return (
                "xla",
                f"attention: cuDNN sequence packing (packed documents) needs compute capability >= 9.0, these GPUs are {cc}; "
                f"{instead} (try model.attention=pallas)",
            )
    return "cudnn", None
