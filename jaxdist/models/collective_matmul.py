"""Collective matmuls over ``tensor`` (``parallel.collective_matmul``): Megatron's tensor
parallelism in its sequence-parallel form, with each collective cut into collective-permutes
that run beside the matmul of the chunk already at hand.

Between layers the residual stream is split over ``tensor`` by sequence (logical ``res_seq``).
A column-parallel projection (QKV, gate/up) needs the whole sequence: ``gather_dot`` multiplies
the chunk it holds while passing it round the ring, T steps for T devices, so each chunk's
transfer runs under the previous chunk's matmul. A row-parallel projection (attention out,
down) sums partial products over ``tensor``: ``dot_scatter`` computes, at each step, the
partial sum of the chunk that a neighbour will finish, and passes the running sum on, so the
reduce-scatter is the ring itself. Plain tensor parallelism all-reduces each layer's output
whole, and that all-reduce feeds the next norm: nothing can run beside it.

The backward passes are written out: ``gather_dot``'s input gradient is a ``dot_scatter`` and
``dot_scatter``'s a ``gather_dot`` (the same rings run the other way), and each weight
gradient is one fp32-output matmul over the whole sequence (autodiff would make one per chunk,
and FSDP's partitioner would reduce each of them across devices)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from jaxdist.layout import step_context

AXIS = "tensor"
SEQ = 1  # every operand here is [batch, seq, ...]
RESIDUAL = ("batch", "res_seq", "act_embed")  # the residual stream's logical axes (res_seq: tensor's here)


def sequence_parallel(cache=None) -> bool:
    """Whether the step being traced runs its projections as collective matmuls (the layout's
    strategy says so; generation's cached attention runs plain: one token is not split)."""
    context = step_context.current()
    layout = context.layout
    return cache is None and layout is not None and layout.strategy.collective_matmul and not context.vmapped


def _spec(ndim: int, split: int) -> PartitionSpec:
    return PartitionSpec(*[AXIS if d == split else None for d in range(ndim)])


def _region(fn, args_split: tuple[tuple[int, int], ...], out_split: tuple[int, int]):
    """``fn(index, *args)`` manual over ``tensor`` alone (the batch and FSDP axes stay the
    partitioner's): ``args_split``/``out_split`` give each operand's (ndim, dimension split over
    tensor). ``index`` is this device's position on ``tensor``, handed in as data: XLA's SPMD
    partitioner refuses the partition-id that ``axis_index`` lowers to in some programs (the
    layers unrolled with host offload: "PartitionId instruction is not supported")."""
    traced = jax.sharding.get_abstract_mesh()
    # inside a region manual over other axes (the step's per-device accumulation over the batch axes): its mesh
    mesh = traced if not traced.empty and traced.manual_axes else step_context.current().layout.mesh
    region = jax.shard_map(
        lambda index, *args: fn(index[0], *args),
        mesh=mesh,
        in_specs=(PartitionSpec(AXIS), *(_spec(*a) for a in args_split)),
        out_specs=_spec(*out_split),
        axis_names={AXIS},
        check_vma=False,
    )
    return functools.partial(region, jnp.arange(mesh.shape[AXIS], dtype=jnp.int32))


def _equations(equation: str) -> tuple[str, str, str]:
    inputs, out = equation.replace(" ", "").split("->")
    x_sub, w_sub = inputs.split(",")
    return x_sub, w_sub, out


def _ring_gather(equation: str, me: jax.Array, x: jax.Array, w: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per device: (einsum of the whole sequence with ``w``, the whole sequence), from this
    device's chunk of ``x``; chunk k arrives from the next device while chunk k-1 is multiplied."""
    n = jax.lax.axis_size(AXIS)
    chunk = x.shape[SEQ]
    held, out, gathered = x, None, None
    for step in range(n):
        y = jnp.einsum(equation, held, w)
        at = ((me + step) % n) * chunk  # the chunk this device holds at this step
        if out is None:
            out = jnp.zeros((y.shape[0], n * chunk, *y.shape[2:]), y.dtype)
            gathered = jnp.zeros((x.shape[0], n * chunk, *x.shape[2:]), x.dtype)
        out = jax.lax.dynamic_update_slice_in_dim(out, y, at, SEQ)
        gathered = jax.lax.dynamic_update_slice_in_dim(gathered, held, at, SEQ)
        if step < n - 1:
            held = jax.lax.ppermute(held, AXIS, [(j, (j - 1) % n) for j in range(n)])
    return out, gathered


def _ring_scatter(equation: str, me: jax.Array, h: jax.Array, w: jax.Array) -> jax.Array:
    """Per device: this device's sequence chunk of einsum(h, w) summed over ``tensor``, the
    running sum passed to the next device after each step's partial product is added. Summed
    in ``h``'s dtype, as plain tensor parallelism's bf16 all-reduce and Megatron's
    sequence-parallel reduce-scatter are."""
    n = jax.lax.axis_size(AXIS)
    chunk = h.shape[SEQ] // n
    total = None
    for step in range(n):
        # the chunk whose sum ends, after n-1-step more hops, on the device that keeps it
        target = (me + n - 1 - step) % n
        part = jnp.einsum(equation, jax.lax.dynamic_slice_in_dim(h, target * chunk, chunk, SEQ), w)
        total = part if total is None else total + part
        if step < n - 1:
            total = jax.lax.ppermute(total, AXIS, [(j, (j + 1) % n) for j in range(n)])
    return total


# ``me`` (this device's index on tensor, int32) is an input like the operands: its cotangent is None
@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _gather_dot_local(equation: str, me: jax.Array, x: jax.Array, w: jax.Array) -> jax.Array:
    return _ring_gather(equation, me, x, w)[0]


def _gather_dot_fwd(equation, me, x, w):
    out, gathered = _ring_gather(equation, me, x, w)
    return out, (me, gathered, w)


def _gather_dot_bwd(equation, residuals, g):
    me, gathered, w = residuals
    x_sub, w_sub, out = _equations(equation)
    dx = _ring_scatter(f"{out},{w_sub}->{x_sub}", me, g, w)
    dw = jnp.einsum(f"{x_sub},{out}->{w_sub}", gathered, g, preferred_element_type=jnp.float32)
    return None, dx.astype(gathered.dtype), dw.astype(w.dtype)


_gather_dot_local.defvjp(_gather_dot_fwd, _gather_dot_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _dot_scatter_local(equation: str, me: jax.Array, h: jax.Array, w: jax.Array) -> jax.Array:
    return _ring_scatter(equation, me, h, w)


def _dot_scatter_fwd(equation, me, h, w):
    return _dot_scatter_local(equation, me, h, w), (me, h, w)


def _dot_scatter_bwd(equation, residuals, g):
    me, h, w = residuals
    h_sub, w_sub, out = _equations(equation)
    dh, g_whole = _ring_gather(f"{out},{w_sub}->{h_sub}", me, g, w)
    dw = jnp.einsum(f"{h_sub},{out}->{w_sub}", h, g_whole, preferred_element_type=jnp.float32)
    return None, dh.astype(h.dtype), dw.astype(w.dtype)


_dot_scatter_local.defvjp(_dot_scatter_fwd, _dot_scatter_bwd)


def gather_dot(equation: str, x: jax.Array, w: jax.Array, w_split: int, out_split: int) -> jax.Array:
    """A column-parallel projection ``einsum(equation, x, w)`` of ``x`` split over ``tensor`` by
    sequence ([batch, seq, ...]); ``w`` is split over ``tensor`` on dimension ``w_split``, the
    output on ``out_split`` (its sequence whole)."""
    fn = functools.partial(_gather_dot_local, equation)
    out_ndim = len(_equations(equation)[2])
    return _region(fn, ((x.ndim, SEQ), (w.ndim, w_split)), (out_ndim, out_split))(x, w)


def dot_scatter(equation: str, h: jax.Array, w: jax.Array, h_split: int, w_split: int) -> jax.Array:
    """A row-parallel projection ``einsum(equation, h, w)`` summed over ``tensor`` (``h`` split
    on ``h_split``, ``w`` on ``w_split``), returned split over ``tensor`` by sequence."""
    out_ndim = len(_equations(equation)[2])
    fn = functools.partial(_dot_scatter_local, equation)
    return _region(fn, ((h.ndim, h_split), (w.ndim, w_split)), (out_ndim, SEQ))(h, w)
