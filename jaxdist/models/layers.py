"""The decoder's elementwise pieces, projections and embedding lookup, with hand-written
backward passes where autodiff's would cost memory or copies (``experiments/step_overhead.py``
measures each against the former step and PyTorch's), or would reduce weight gradients
across devices in bf16.

Gradient precision: every weight gradient here comes out of an fp32-output matmul (or an
fp32 scatter-add for the embedding). Under data or FSDP parallelism each device's weight
gradient is a partial sum, and XLA's partitioner reduces it (all-reduce, reduce-scatter)
right where the matmul produces it: autodiff's transpose of a bf16 matmul would hand it a
bf16 partial sum, so the gradients would cross devices in bf16 although
``parallel.grad_reduce=float32`` (XLA:CPU promotes bf16 reductions, so only a GPU program
shows it: ``tests/test_gpu_precision.py``)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxdist.layout.sharding import constrain, summed_into_layout


def rms_norm(x: jax.Array, scale: jax.Array, eps: float, dtype=None) -> jax.Array:
    """x / rms(x) * scale, computed in fp32, returned in ``dtype`` (default x's)."""
    return _rms_norm(x, scale, eps, jnp.dtype(x.dtype if dtype is None else dtype))


# RMSNorm and SwiGLU take hand-written backward passes that keep only their inputs (and the
# norm's [.., 1] reciprocal rms): autodiff would keep every fp32 intermediate, and inside
# the layer scan each becomes a stacked [layers, batch, seq, width] buffer that is
# zero-filled, then written and read slice by slice (experiments/step_overhead.py).
@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _rms_norm(x: jax.Array, scale: jax.Array, eps: float, dtype) -> jax.Array:
    return _rms_norm_fwd(x, scale, eps, dtype)[0]


def _rms_norm_fwd(x, scale, eps, dtype):
    x32 = x.astype(jnp.float32)
    inv = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (x32 * inv * scale.astype(jnp.float32)).astype(dtype), (x, scale, inv)


def _rms_norm_bwd(eps, dtype, residuals, g):
    x, scale, inv = residuals
    normed = x.astype(jnp.float32) * inv
    g32 = g.astype(jnp.float32)
    d_scale = jnp.sum(g32 * normed, axis=tuple(range(x.ndim - 1)))
    d_normed = g32 * scale.astype(jnp.float32)
    dx = inv * (d_normed - normed * jnp.mean(d_normed * normed, axis=-1, keepdims=True))
    return dx.astype(x.dtype), d_scale.astype(scale.dtype)


_rms_norm.defvjp(_rms_norm_fwd, _rms_norm_bwd)


@jax.custom_vjp
def swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
    """silu(gate) * up, in the inputs' dtype."""
    return jax.nn.silu(gate) * up


def _swiglu_fwd(gate, up):
    return swiglu(gate, up), (gate, up)


def _swiglu_bwd(residuals, g):
    gate, up = residuals
    gate32, up32, g32 = gate.astype(jnp.float32), up.astype(jnp.float32), g.astype(jnp.float32)
    sig = jax.nn.sigmoid(gate32)
    d_gate = g32 * up32 * sig * (1 + gate32 * (1 - sig))  # d silu(z) / dz = s (1 + z (1 - s))
    return d_gate.astype(gate.dtype), (g32 * gate32 * sig).astype(up.dtype)


swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def swiglu_joined(gate_up: jax.Array, axis: int) -> jax.Array:
    """``swiglu`` of a joined projection's output: index 0 of ``axis`` is the gate, 1 the up
    part (that axis is dropped). Its backward is one elementwise expression over the joined
    shape (the sigmoid recomputed per element), so XLA:GPU writes the joined gradient once, in
    the compute dtype; ``swiglu``'s two gradients shared the sigmoid, which XLA kept as an fp32
    tensor of its own, and were then joined by a copy."""
    gate, up = (jax.lax.index_in_dim(gate_up, i, axis, keepdims=False) for i in (0, 1))
    return swiglu(gate, up)


def _swiglu_joined_fwd(gate_up, axis):
    return swiglu_joined(gate_up, axis), gate_up


def _swiglu_joined_bwd(axis, gate_up, g):
    x32 = gate_up.astype(jnp.float32)
    gate, up = (jnp.broadcast_to(jax.lax.index_in_dim(x32, i, axis), x32.shape) for i in (0, 1))
    g32 = jnp.broadcast_to(jnp.expand_dims(g, axis).astype(jnp.float32), x32.shape)
    sig = jax.nn.sigmoid(gate)
    is_gate = jax.lax.broadcasted_iota(jnp.int32, x32.shape, axis) == 0
    # d/d gate: g up s (1 + z (1 - s)) (d silu(z) / dz = s (1 + z (1 - s))); d/d up: g silu(gate)
    d_gate_up = (g32 * sig * jnp.where(is_gate, up * (1 + gate * (1 - sig)), gate)).astype(gate_up.dtype)
    # written in the compute dtype: without the barrier XLA:GPU joins the fp8 amax that
    # follows into this fusion and hands the quantisation the fp32 values (twice the bytes)
    return (jax.lax.optimization_barrier(d_gate_up),)


swiglu_joined.defvjp(_swiglu_joined_fwd, _swiglu_joined_bwd)


@jax.custom_vjp
def cross_entropy_sum(logits: jax.Array, targets: jax.Array, mask: jax.Array) -> jax.Array:
    """Sum over tokens of ``mask`` x (logsumexp(logits) - logits[target]), in fp32 from the
    logits in their own dtype (the head's bf16 output: the values an fp32 cast would hold).
    Backward, mask x (softmax - onehot(target)) in one elementwise pass written in the logits'
    dtype; autodiff's kept the fp32 log-softmax, scattered the targets' gradient into a
    vocabulary-wide zero tensor and added them: each a [tokens, vocab] fp32 pass of its own
    (the largest memory-bound kernels of a 128k-vocabulary step on a GPU)."""
    return _cross_entropy_fwd(logits, targets, mask)[0]


def _cross_entropy_fwd(logits, targets, mask):
    x = logits.astype(jnp.float32)
    lse = jax.nn.logsumexp(x, axis=-1)
    picked = _picked(x, targets)
    return jnp.sum((lse - picked) * mask), (logits, targets, mask, lse)


def _picked(x: jax.Array, targets: jax.Array) -> jax.Array:
    """``x[..., targets]``. Inside a region manual over some mesh axes (the pipeline's, over
    pipe) XLA's SPMD partitioner aborts on the batched gather when two other axes shard the
    logits (pipe=2,fsdp=2,tensor=2: a CHECK in spmd_partitioner_util.cc, jaxlib 0.10.2, on CPU
    and GPU); there the target's logit is taken by a masked sum over the vocabulary, the same
    value (one term is not zero). Elsewhere the gather reads one logit per token."""
    traced = jax.sharding.get_abstract_mesh()
    if not traced.empty and traced.manual_axes:
        target = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1) == targets[..., None]
        return jnp.sum(jnp.where(target, x, 0.0), axis=-1)
    return jnp.take_along_axis(x, targets[..., None], axis=-1)[..., 0]


def _cross_entropy_bwd(residuals, g):
    logits, targets, mask, lse = residuals
    x = logits.astype(jnp.float32)
    target = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1) == targets[..., None]
    d_logits = (jnp.exp(x - lse[..., None]) - target) * (g * mask)[..., None]
    return d_logits.astype(logits.dtype), None, None


cross_entropy_sum.defvjp(_cross_entropy_fwd, _cross_entropy_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def split_parts(x: jax.Array, axis: int, sizes: tuple[int, ...]) -> tuple[jax.Array, ...]:
    """``x`` cut along ``axis`` into consecutive parts of ``sizes``. Its backward pass joins
    the parts' gradients with one concatenate: autodiff's own (a zero-padded copy of each,
    then their sum) costs three full-size passes per fused projection on XLA's CPU backend."""
    starts = np.cumsum((0, *sizes[:-1]))
    return tuple(jax.lax.slice_in_dim(x, int(a), int(a) + n, axis=axis) for a, n in zip(starts, sizes, strict=True))


def _split_fwd(x, axis, sizes):
    return split_parts(x, axis, sizes), None


def _split_bwd(axis, sizes, _, grads):
    return (jnp.concatenate(grads, axis=axis),)


split_parts.defvjp(_split_fwd, _split_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 3, 4, 5))
def project_joined(equation: str, x: jax.Array, w: jax.Array, out_axis: int, w_axis: int, sizes: tuple[int, ...]) -> jax.Array:
    """A fused projection ``einsum(equation, x, w)`` whose output joins parts of ``sizes`` along
    ``out_axis`` (the weight's ``w_axis``), cut afterwards (``split_parts``). One matmul forward,
    whose whole output is what ``model.remat=save_matmuls`` keeps (parts cut inside this rule are
    not matmul outputs to the policy, so the backward would recompute the matmul for them).
    Backward, the input gradient is one fp32-output matmul over all parts (one fp32 all-reduce
    under tensor parallelism), and the weight gradient one matmul per part, joined as small
    weight-shaped slices: autodiff's single weight-gradient matmul would read the joined
    [tokens, parts] gradient transposed, which XLA's CPU backend copies in full for it."""
    return jnp.einsum(equation, x, w)


def _joined_fwd(equation, x, w, out_axis, w_axis, sizes):
    return jnp.einsum(equation, x, w), (x, w)


def _joined_bwd(equation, out_axis, w_axis, sizes, residuals, g):
    x, w = residuals
    inputs, out = equation.split("->")
    x_sub, w_sub = inputs.split(",")
    dx = jnp.einsum(f"{out},{w_sub}->{x_sub}", g, w, preferred_element_type=jnp.float32)
    parts = split_parts(g, out_axis, sizes)
    dw = jnp.concatenate(
        [jnp.einsum(f"{x_sub},{out}->{w_sub}", x, part, preferred_element_type=jnp.float32) for part in parts], axis=w_axis
    )
    return dx.astype(x.dtype), dw.astype(w.dtype)


project_joined.defvjp(_joined_fwd, _joined_bwd)


def _transposed_equations(equation: str) -> tuple[str, str]:
    """(input-gradient, weight-gradient) einsum equations of ``x,w->out``: each index of one
    operand must appear in the other or in the output (a projection's)."""
    inputs, out = equation.replace(" ", "").split("->")
    x_sub, w_sub = inputs.split(",")
    if not (set(x_sub) <= set(w_sub + out) and set(w_sub) <= set(x_sub + out)):
        raise ValueError(f"project: {equation!r} sums an index out of one operand alone")
    return f"{out},{w_sub}->{x_sub}", f"{x_sub},{out}->{w_sub}"


def project(equation: str, x: jax.Array, w: jax.Array) -> jax.Array:
    """``einsum(equation, x, w)`` in ``x``'s dtype (``w`` is cast to it: an fp32 master weight
    may be passed as it is), whose weight gradient is an fp32-output matmul returned in
    ``w``'s dtype. The forward matmul and the input gradient are autodiff's (bf16 outputs
    under bf16 compute: Megatron's tensor-parallel activation all-reduces stay bf16); the
    weight gradient is the same tensor-core matmul with an fp32 store, so the partial sums
    reduced across the batch axes are fp32 (module docstring)."""
    return _project(equation, jnp.dtype(w.dtype), x, w)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _project(equation: str, w_dtype, x: jax.Array, w: jax.Array) -> jax.Array:
    return jnp.einsum(equation, x, w.astype(x.dtype))


def _project_one_fwd(equation, w_dtype, x, w):
    w = w.astype(x.dtype)  # kept as autodiff keeps it: the cast (under FSDP, gathered) weight
    return jnp.einsum(equation, x, w), (x, w)


def _project_one_bwd(equation, w_dtype, residuals, g):
    x, w = residuals
    dx_equation, dw_equation = _transposed_equations(equation)
    dx = jnp.einsum(dx_equation, g, w)
    dw = jnp.einsum(dw_equation, x, g, preferred_element_type=jnp.float32)
    return dx.astype(x.dtype), dw.astype(w_dtype)


_project.defvjp(_project_one_fwd, _project_one_bwd)


def matmul(dot, equation: str, x: jax.Array, w: jax.Array) -> jax.Array:
    """A model projection: through ``dot`` (a ``models.fp8.Fp8Einsum``) when it runs fp8,
    else ``project`` (fp32 weight gradient)."""
    return project(equation, x, w) if dot.plain() else dot(equation, x, w)


def embed_lookup(table: jax.Array, tokens: jax.Array, dtype) -> jax.Array:
    """Rows ``tokens`` of ``table`` in ``dtype``. The table is cast before it is laid out for
    the lookup (gathered over FSDP, split over ``tensor`` by vocabulary), so that all-gather
    moves the compute dtype; the gradient is scattered and reduced in the table's dtype
    (fp32 master weights: an fp32 scatter-add and reduce-scatter), as autodiff of the lookup
    on the uncast table would."""
    return _embed_lookup(table, tokens, jnp.dtype(dtype))


def _lookup(table: jax.Array, tokens: jax.Array) -> jax.Array:
    # Gather the table over FSDP first: a lookup into a vocab-split table then needs only a
    # masked gather plus one all-reduce over 'tensor'.
    return jnp.take(constrain(table, ("vocab", None)), tokens, axis=0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _embed_lookup(table: jax.Array, tokens: jax.Array, dtype) -> jax.Array:
    return _lookup(table.astype(dtype), tokens)


def _embed_fwd(table, tokens, dtype):
    return _embed_lookup(table, tokens, dtype), (table, tokens)


def _embed_bwd(dtype, residuals, g):
    table, tokens = residuals
    abstract = jax.ShapeDtypeStruct(table.shape, table.dtype)

    def scattered(tokens, g, blocks):  # the lookup's transpose, into this device's rows of the table
        (start, rows), _ = blocks
        local = jnp.where((tokens >= start) & (tokens < start + rows), tokens - start, rows)  # rows: dropped
        return jnp.zeros((rows, table.shape[1]), table.dtype).at[local].add(g.astype(table.dtype), mode="drop")

    # Each device's scatter is a partial sum over its tokens: reduce-scattered into the table's
    # shards (FSDP's) and all-reduced over the other batch axes, rather than all-reduced whole
    # (a vocab-sized fp32 table) over every batch axis, as the partitioner does with a scatter.
    summed = summed_into_layout(scattered, (tokens, g), (("batch", "seq"), ("batch", "seq", "act_embed")), ("vocab", "embed"), table.shape)
    if summed is not None:
        return summed, None
    (d_table,) = jax.linear_transpose(lambda t: _lookup(t, tokens), abstract)(g.astype(table.dtype))
    return d_table, None


_embed_lookup.defvjp(_embed_fwd, _embed_bwd)
