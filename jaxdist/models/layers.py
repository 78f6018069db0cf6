"""The decoder's elementwise pieces and fused-projection splits, with hand-written backward
passes where autodiff's would cost memory or copies (``experiments/step_overhead.py``
measures each against the former step and PyTorch's)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np


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
def project_split(equation: str, x: jax.Array, w: jax.Array, out_axis: int, w_axis: int, sizes: tuple[int, ...]) -> tuple[jax.Array, ...]:
    """A fused projection ``einsum(equation, x, w)`` cut into parts of ``sizes`` along
    ``out_axis`` (the weight's ``w_axis``): one matmul forward. Backward, the input
    gradient is still one matmul over all parts (one all-reduce under tensor parallelism),
    while the weight gradient is one matmul per part, joined as small weight-shaped
    slices: autodiff's single weight-gradient matmul would read the joined [tokens, parts]
    gradient transposed, which XLA's CPU backend copies in full for it."""
    return split_parts(jnp.einsum(equation, x, w), out_axis, sizes)


def _project_fwd(equation, x, w, out_axis, w_axis, sizes):
    return project_split(equation, x, w, out_axis, w_axis, sizes), (x, w)


def _project_bwd(equation, out_axis, w_axis, sizes, residuals, grads):
    x, w = residuals
    inputs, out = equation.split("->")
    x_sub, w_sub = inputs.split(",")
    dx = jnp.einsum(f"{out},{w_sub}->{x_sub}", jnp.concatenate(grads, axis=out_axis), w, preferred_element_type=jnp.float32)
    dw = jnp.concatenate([jnp.einsum(f"{x_sub},{out}->{w_sub}", x, g, preferred_element_type=jnp.float32) for g in grads], axis=w_axis)
    return dx.astype(x.dtype), dw.astype(w.dtype)


project_split.defvjp(_project_fwd, _project_bwd)
