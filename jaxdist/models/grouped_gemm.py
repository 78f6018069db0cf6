"""The experts' grouped GEMM on an NVIDIA GPU: Pallas Triton kernels, forward and backward.

XLA:GPU (jaxlib 0.10.2) compiles ``jax.lax.ragged_dot`` densely: its ``RaggedDotRewriter``
broadcasts the rows to [rows, groups, K], masks the other groups' rows and runs one dense dot
(the weight gradient likewise, as a batched dot over the groups), so a device with E local
experts does E times the expert FLOPs. JAX's ``jax_ragged_dot_use_gpu_pallas_triton_lowering``
names a module that the 0.10.2 wheel does not ship (ModuleNotFoundError when set), XLA's
``xla_gpu_experimental_use_ragged_dot_fusion`` (cuDNN) takes only bf16/f16-output forward
and input-gradient dots (the weight gradient stays dense) and needs a GPU to compile, and
``xla_gpu_experimental_use_ragged_dot_grouped_gemm`` is hipBLASLt (ROCm) only.

These kernels do each routed row's work once (up to the rows of one tile per group boundary):

- ``grouped_matmul(x [M, K], w [G, K, N], sizes [G])`` -> float32 [M, N]: the rows of group g
  (contiguous, ``sizes[g]`` of them, in order) times ``w[g]``; rows past ``sum(sizes)`` come
  out 0. One program per (row tile, group) pair that meets, and per column tile: a tile that
  straddles a group boundary runs once per group, each time storing only its group's rows.
- its VJP: the input gradient ``dy @ w[g]^T`` is the same kernel reading ``w`` transposed; the
  weight gradient ``x[rows of g]^T dy[rows of g]`` has one program per (group, K tile, N tile)
  looping over that group's rows only. Both multiply in the compute dtype (the float32 output
  gradient is rounded to it, as a bf16 GEMM's would be) and accumulate in float32.

``interpret=True`` runs the same kernels through Pallas' interpreter (any backend: the CPU
tests), in a host callback per device (the interpreter cannot trace inside a ``shard_map``
that checks which mesh axes values vary over) and with the operands padded so no block reads
past an array (a GPU's masked loads never touch those addresses; the interpreter would clamp
the block instead). The callback runs a computation of its own, so XLA:CPU needs a thread
beyond one per device (``NPROC`` above the device count; ``tests/conftest.py`` sets it):
with exactly one per device, every device's execution holds one and the callbacks wait
forever. What the interpreter cannot check is the Triton lowering itself: the
kernels are compiled for GPU targets in ``tests/test_moe_gpu.py`` but have not run on a GPU here.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

KERNEL_NAME = "jaxdist_grouped_gemm"  # the Triton custom call's name in the HLO (inspect.gpu_program counts it)


def _block(size: int, cap: int) -> int:
    """A power-of-two block (Triton's dot wants >= 16) no larger than ``cap``."""
    return max(16, min(cap, 1 << max(0, size - 1).bit_length()))


def _pad_to(a: jax.Array, axis: int, size: int) -> jax.Array:
    if a.shape[axis] >= size:
        return a
    widths = [(0, 0)] * a.ndim
    widths[axis] = (0, size - a.shape[axis])
    return jnp.pad(a, widths)


def _out_shape(shape: tuple[int, ...], dtype, *operands: jax.Array) -> jax.ShapeDtypeStruct:
    """A kernel's result varies over the mesh axes any operand varies over (inside a
    ``shard_map`` with ``check_vma``, Pallas needs it said; elsewhere it is empty)."""
    types = [jax.typeof(o).mat for o in operands]
    varying = frozenset().union(*(t.varying for t in types))
    return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=types[0].update(varying=varying, unreduced=frozenset(), reduced=frozenset()))


def _call(kernel, out_shape: jax.ShapeDtypeStruct, grid, params, interpret: bool, name: str, *operands: jax.Array) -> jax.Array:
    """``pallas_call`` of ``kernel`` over ``operands``. Interpreted, the kernel runs on each
    device's concrete operands in a host callback: Pallas' interpreter is not aware of the mesh
    axes a ``shard_map`` (with ``check_vma``) says values vary over, and refuses to trace there."""
    if not interpret:
        return pl.pallas_call(kernel, out_shape=out_shape, grid=grid, compiler_params=params, name=name)(*operands)
    plain = jax.ShapeDtypeStruct(out_shape.shape, out_shape.dtype)
    run = jax.jit(pl.pallas_call(kernel, out_shape=plain, grid=grid, interpret=True, name=name))
    out = jax.pure_callback(lambda *ops: np.asarray(run(*ops)), plain, *operands, vmap_method="sequential")
    return _vary(out, out_shape.manual_axis_type.varying)  # a callback's result is said to vary over nothing


def _params(bm: int, bn: int, dtype) -> plt.CompilerParams:
    # f32 tiles are twice the bytes: two pipeline stages keep them in an A100's shared memory
    return plt.CompilerParams(num_warps=8 if bm * bn >= 128 * 128 else 4, num_stages=2 if jnp.dtype(dtype).itemsize > 2 else 3)


def work_items(sizes: jax.Array, rows: int, bm: int) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """(tile, group, first row, end row) of each (row tile, group) pair that meets, padded to the
    static bound ceil(rows / bm) + G with empty items (no rows). The rows past the groups form a
    last pseudo-group (index G) whose programs only write zeros."""
    g = sizes.shape[0]
    total = jnp.sum(sizes)
    extended = jnp.concatenate([sizes.astype(jnp.int32), (rows - total)[None].astype(jnp.int32)])
    ends = jnp.cumsum(extended)
    starts = ends - extended
    first, last = starts // bm, (ends - 1) // bm
    count = jnp.where(extended > 0, last - first + 1, 0)  # tiles each group meets: consecutive groups share at most one
    item_end = jnp.cumsum(count)
    n = pl.cdiv(rows, bm) + g
    index = jnp.arange(n, dtype=jnp.int32)
    group = jnp.minimum(jnp.sum(index[:, None] >= item_end[None, :], axis=1), g).astype(jnp.int32)  # the item's group
    valid = index < item_end[-1]
    tile = first[group] + index - (item_end[group] - count[group])
    lo = jnp.maximum(starts[group], tile * bm)
    hi = jnp.minimum(ends[group], tile * bm + bm)
    return (jnp.where(valid, tile, 0), jnp.where(valid, group, g), jnp.where(valid, lo, 0), jnp.where(valid, hi, 0))


def _rows_kernel(tile_ref, group_ref, lo_ref, hi_ref, x_ref, w_ref, o_ref, *, bm, bn, bk, k, n, groups, transpose_w):
    item, j = pl.program_id(0), pl.program_id(1)
    tile, group, lo, hi = tile_ref[item], group_ref[item], lo_ref[item], hi_ref[item]
    rows = tile * bm + jnp.arange(bm)
    row_ok = (rows >= lo) & (rows < hi)
    cols = j * bn + jnp.arange(bn)
    col_ok = cols < n
    weight = jnp.minimum(group, groups - 1)  # the pseudo-group past the groups reads nothing

    def step(kk, acc):
        ks = kk * bk + jnp.arange(bk)
        k_ok = ks < k
        a = plt.load(x_ref.at[pl.ds(tile * bm, bm), pl.ds(kk * bk, bk)], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        if transpose_w:  # w [G, N, K] read as [bk, bn]
            b = plt.load(w_ref.at[weight, pl.ds(j * bn, bn), pl.ds(kk * bk, bk)], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
            return acc + plt.dot(a, b, trans_b=True)
        b = plt.load(w_ref.at[weight, pl.ds(kk * bk, bk), pl.ds(j * bn, bn)], mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        return acc + plt.dot(a, b)

    steps = (group < groups).astype(jnp.int32) * pl.cdiv(k, bk)  # (jnp.where of two constants lowers to i1 in Pallas Triton)
    acc = jax.lax.fori_loop(jnp.int32(0), steps, step, jnp.zeros((bm, bn), jnp.float32))
    plt.store(o_ref.at[pl.ds(tile * bm, bm), pl.ds(j * bn, bn)], acc.astype(o_ref.dtype), mask=row_ok[:, None] & col_ok[None, :])


def _rows(x, w, sizes, out_dtype, transpose_w: bool, interpret: bool) -> jax.Array:
    """out[r] = x[r] @ w[g] (``transpose_w``: @ w[g]^T) for the rows r of group g; 0 past the groups."""
    m, k = x.shape
    n = w.shape[1] if transpose_w else w.shape[2]
    groups = w.shape[0]
    bm, bn, bk = _block(m, 128), _block(n, 128), _block(k, 64)
    tile, group, lo, hi = work_items(sizes, m, bm)
    rows_p, k_p, n_p = (pl.cdiv(m, bm) * bm, pl.cdiv(k, bk) * bk, pl.cdiv(n, bn) * bn) if interpret else (m, k, n)
    x = _pad_to(_pad_to(x, 0, rows_p), 1, k_p)
    w = _pad_to(_pad_to(w, 1, n_p if transpose_w else k_p), 2, k_p if transpose_w else n_p)
    kernel = functools.partial(_rows_kernel, bm=bm, bn=bn, bk=bk, k=k, n=n, groups=groups, transpose_w=transpose_w)
    shape = _out_shape((rows_p, n_p), out_dtype, sizes, x, w)
    name = f"{KERNEL_NAME}_{'dx' if transpose_w else 'fwd'}"
    out = _call(kernel, shape, (tile.shape[0], pl.cdiv(n, bn)), _params(bm, bn, x.dtype), interpret, name, tile, group, lo, hi, x, w)
    return out[:m, :n]


def _weights_kernel(start_ref, size_ref, x_ref, dy_ref, o_ref, *, bm, bk, bn, k, n):
    group, kt, nt = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    start, size = start_ref[group], size_ref[group]
    k_ok = kt * bk + jnp.arange(bk) < k
    n_ok = nt * bn + jnp.arange(bn) < n

    def step(t, acc):
        first = start + t * bm
        ok = first + jnp.arange(bm) < start + size
        a = plt.load(x_ref.at[pl.ds(first, bm), pl.ds(kt * bk, bk)], mask=ok[:, None] & k_ok[None, :], other=0.0)
        b = plt.load(dy_ref.at[pl.ds(first, bm), pl.ds(nt * bn, bn)], mask=ok[:, None] & n_ok[None, :], other=0.0)
        return acc + plt.dot(a, b, trans_a=True)

    acc = jax.lax.fori_loop(jnp.int32(0), pl.cdiv(size, bm).astype(jnp.int32), step, jnp.zeros((bk, bn), jnp.float32))
    plt.store(o_ref.at[group, pl.ds(kt * bk, bk), pl.ds(nt * bn, bn)], acc.astype(o_ref.dtype), mask=k_ok[:, None] & n_ok[None, :])


def _weights(x, dy, sizes, out_dtype, interpret: bool) -> jax.Array:
    """dw[g] = x[rows of g]^T @ dy[rows of g], [G, K, N]; an empty group's is 0."""
    (m, k), n, groups = x.shape, dy.shape[1], sizes.shape[0]
    bm, bk, bn = _block(m, 64), _block(k, 64), _block(n, 128)
    sizes = sizes.astype(jnp.int32)
    starts = jnp.cumsum(sizes) - sizes
    k_p, n_p = (pl.cdiv(k, bk) * bk, pl.cdiv(n, bn) * bn) if interpret else (k, n)
    if interpret:  # a group's last block may start anywhere: room for a whole block past the rows
        x, dy = _pad_to(x, 0, m + bm), _pad_to(dy, 0, m + bm)
    x, dy = _pad_to(x, 1, k_p), _pad_to(dy, 1, n_p)
    kernel = functools.partial(_weights_kernel, bm=bm, bk=bk, bn=bn, k=k, n=n)
    shape = _out_shape((groups, k_p, n_p), out_dtype, sizes, x, dy)
    grid = (groups, pl.cdiv(k, bk), pl.cdiv(n, bn))
    out = _call(kernel, shape, grid, _params(bk, bn, x.dtype), interpret, f"{KERNEL_NAME}_dw", starts, sizes, x, dy)
    return out[:, :k, :n]


def grouped_matmul(x: jax.Array, w: jax.Array, sizes: jax.Array, interpret: bool = False) -> jax.Array:
    """float32 [M, N]: row r of group g (contiguous groups of ``sizes``) times ``w[g]`` [K, N];
    rows past ``sum(sizes)`` are 0. ``x`` and ``w`` share a dtype. Inside a ``shard_map`` the
    operands are first made to vary over the same mesh axes (as any JAX op's are), so the
    gradient of an operand that does not vary (weights replicated over a batch axis) is summed
    over them by that cast's transpose."""
    dtype = jnp.result_type(x, w)  # as ragged_dot promotes its operands
    x, w = x.astype(dtype), w.astype(dtype)
    varying = frozenset().union(*(jax.typeof(a).mat.varying for a in (x, w, sizes)))
    x, w, sizes = (_vary(a, varying) for a in (x, w, sizes))
    return _grouped_matmul(x, w, sizes, interpret)


def _vary(a: jax.Array, axes: frozenset) -> jax.Array:
    missing = tuple(sorted(axes - jax.typeof(a).mat.varying))
    return jax.lax.pcast(a, missing, to="varying") if missing else a


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _grouped_matmul(x: jax.Array, w: jax.Array, sizes: jax.Array, interpret: bool) -> jax.Array:
    return _rows(x, w, sizes, jnp.float32, False, interpret)


def _forward(x, w, sizes, interpret):
    return _rows(x, w, sizes, jnp.float32, False, interpret), (x, w, sizes)


def _backward(interpret, residuals, dy):
    x, w, sizes = residuals
    dy = dy.astype(x.dtype)
    dx = _rows(dy, w, sizes, x.dtype, True, interpret)
    dw = _weights(x, dy, sizes, w.dtype, interpret)
    return dx, dw, None


_grouped_matmul.defvjp(_forward, _backward)
