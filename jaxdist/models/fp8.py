"""fp8 matmuls (``model.fp8``): one ``custom_vjp`` einsum with per-tensor scalar scales.

Forward: the input and the weight are quantised to e4m3 (max 448), the output gradient in
the backward to e5m2 (max 57344); each scale is amax / fp8 max. The dots take the fp8
arrays themselves (``scaled_dot``: f32 accumulation, the product of the two scales applied
to the output), so XLA:GPU can only run them as fp8 GEMMs, 3 per matmul (the forward and
the two backward dots, never e5m2 x e5m2): a Triton fp8 gemm fusion or cuBLASLt's fp8
matmul (``__cublas$lt$matmul$f8``), whichever its autotuner picks. Operands dequantised
before the dot (convert -> multiply -> dot) were taken by a bf16 Triton gemm instead
(``tests/test_fp8_gpu.py``). On GPUs below compute capability 8.9 XLA would compute fp8
dots in f16: ``models.build_task`` refuses them. XLA:CPU upcasts but keeps fp8's rounding,
so CPU runs see its error.

- ``current``: each scale from this call's amax (stateless). Each quantisation waits for
  its tensor's amax (a global max: an all-reduce where the tensor is split), so those
  all-reduces sit on the critical path and XLA runs most of them synchronously.
- ``delayed``: each matmul holds an ``Fp8History`` [3, H] (input, weight, output
  gradient; newest first), the scale comes from the history's max alone (1 while the
  history is empty: step 0, Transformer Engine's start), so this call's amax only feeds
  the new history and its all-reduce leaves the critical path. The history is state, not
  a parameter: its "gradient" is the new history with this call's amax in front (Flax's
  overwrite-with-gradient pattern), combined by max wherever gradients add
  (microbatches, the batch axes' reduction) and written over the old value after the
  update; the optimizer never sees it (``training.optim``).

The amaxes are ``jnp.max`` over global arrays, so under GSPMD they are already reduced
over every mesh axis the tensor is split on. Flax's ``fp8_ops`` gives the quantise and
scale arithmetic.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from flax.linen import fp8_ops

from jaxdist.layout import step_context

log = logging.getLogger(__name__)

MODES = ("off", "current", "delayed")
E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
GEMMS_PER_MATMUL = 3  # forward, input gradient, weight gradient
WEIGHT_SCOPE = "fp8_weight_quantize"  # the named scope of a weight's quantisation
FP8_MIN_CAPABILITY = "8.9"  # fp8 GEMMs (cuBLASLt's and Triton's) need Ada or Hopper; below, XLA computes fp8 dots in f16


def fp8_capable(compute_capability: str) -> bool:
    """Whether GPUs of ``compute_capability`` (e.g. "9.0") run fp8 GEMMs."""
    version = lambda text: tuple(int(x) for x in str(text).split(".")[:2])  # noqa: E731
    return version(compute_capability) >= version(FP8_MIN_CAPABILITY)


class Fp8History(nnx.Variable):
    """Delayed scaling's amax histories of one fp8 matmul, [3, H] (rows: input, weight,
    output gradient; newest first): state, not a trained parameter."""


def is_history(x: Any) -> bool:
    return isinstance(x, Fp8History)


def has_history(tree: Any) -> bool:
    return any(is_history(x) for x in jax.tree.leaves(tree, is_leaf=is_history))


def is_history_path(path: str) -> bool:
    """Whether a checkpoint's array path (``params/blocks/attn/o_dot/history/value``) is an
    fp8 amax history (``Fp8History`` attributes are named ``history``)."""
    return "history" in path.split("/")


def holds_history(saved_tree: Any) -> bool:
    """Whether a checkpoint's stored tree (nested dicts of metadata) holds fp8 histories."""
    return isinstance(saved_tree, dict) and any(k == "history" or holds_history(v) for k, v in saved_tree.items())


# -- arithmetic --------------------------------------------------------------------------


def amax(x: jax.Array) -> jax.Array:
    return jnp.max(jnp.abs(x)).astype(jnp.float32)


def scale_for(current: jax.Array, history: jax.Array | None, dtype) -> jax.Array:
    """amax / fp8 max of ``dtype``: current scaling's from ``current`` (this call's amax),
    delayed scaling's from the ``history``'s max alone, so that no quantisation waits for
    this call's amax (its all-reduce only feeds the new history, and XLA overlaps it or moves
    it out of the layer loop); 1 while the history holds nothing yet (step 0, Transformer
    Engine's start) or nothing finite, and for an all-zero tensor."""
    fmax = fp8_ops.get_fp8_max(dtype, jnp.float32)
    return fp8_ops.compute_scale(current if history is None else jnp.max(history, axis=-1), jnp.ones((), jnp.float32), fmax)


def record(history: jax.Array, observed: jax.Array) -> jax.Array:
    """The history with ``observed`` in front and the oldest entry dropped."""
    return jnp.concatenate([observed[None].astype(history.dtype), history[:-1]])


def qdq(x: jax.Array, dtype, scale: jax.Array) -> jax.Array:
    """x rounded to the fp8 ``dtype`` under ``scale`` (clipped to its range), back in x's dtype."""
    return fp8_ops.dequantize(fp8_ops.quantize(x, dtype, scale, x.dtype), x.dtype, scale)


# -- the fp8 einsum ----------------------------------------------------------------------


def transposed_equations(equation: str) -> tuple[str, str]:
    """The einsums of the input and weight gradients of ``equation`` ("lhs,rhs->out"):
    "out,rhs->lhs" and "lhs,out->rhs", each again one dot of two operands. Needs every
    index of an operand in the other operand or the output (none summed inside one operand)."""
    inputs, out = equation.replace(" ", "").split("->")
    lhs, rhs = inputs.split(",")
    for own, others in ((lhs, rhs + out), (rhs, lhs + out)):
        if "." in own or len(set(own)) != len(own) or not set(own) <= set(others):
            raise ValueError(f"fp8_einsum: {equation!r} is not a plain two-operand contraction (an index summed within one operand)")
    return f"{out},{rhs}->{lhs}", f"{lhs},{out}->{rhs}"


def quantize(x: jax.Array, dtype, scale: jax.Array) -> jax.Array:
    """x / scale in float32, clipped to ``dtype``'s range, rounded to ``dtype`` (an fp8 array)."""
    return fp8_ops.quantize(x, dtype, scale, jnp.float32)


def scaled_dot(equation: str, a: jax.Array, b: jax.Array, scale: jax.Array, dtype) -> jax.Array:
    """``einsum(equation, a, b) * scale`` of two fp8 arrays, in ``dtype``: the dot's operands
    stay fp8 in the program (accumulated in f32, rounded to ``dtype``, then scaled by the
    product of the two per-tensor scales), so XLA:GPU can only run it as an fp8 GEMM (a
    Triton fp8 gemm fusion or cuBLASLt's fp8 matmul): no dequantised bf16 operand exists
    for a bf16 kernel to take. The output in ``dtype`` keeps a tensor-parallel partial
    sum's all-reduce at the compute dtype's width."""
    y = jnp.einsum(equation, a, b, preferred_element_type=dtype)
    return (y.astype(jnp.float32) * scale).astype(dtype)


class QuantizedWeight(NamedTuple):
    """A weight rounded to e4m3 ahead of its matmuls (``quantize_weight``): the fp8 values,
    their scale and the weight's amax (recorded in a delayed history). Per-layer stacks
    of these ([layers, ...], [layers], [layers]) are sliced by the layer scan."""

    values: jax.Array
    scale: jax.Array
    seen: jax.Array


def quantize_weight(w: jax.Array, history: jax.Array | None = None, stacked: bool = False) -> QuantizedWeight:
    """``w`` in e4m3 under its scale (current scaling: its amax; delayed: ``history``, its
    [H] or per layer [layers, H] amaxes). ``stacked``: ``w`` is [layers, ...], one scale
    per layer. Quantised where the weight is (under FSDP, each device its shard), so what
    the layer loop gathers is fp8; no gradient flows through it (``fp8_einsum``'s weight
    gradient goes to ``w`` directly, straight through the rounding)."""
    w, history = jax.lax.stop_gradient((w, history))  # the history's "gradient" is only what _backward records
    with jax.named_scope(WEIGHT_SCOPE):  # named in the compiled program's metadata and in profiles
        seen = jnp.max(jnp.abs(w), axis=tuple(range(1, w.ndim)) if stacked else None).astype(jnp.float32)
        scale = scale_for(seen, history, E4M3)
        values = quantize(w, E4M3, scale.reshape(scale.shape + (1,) * (w.ndim - scale.ndim)))
    return QuantizedWeight(values, scale, seen)


def fp8_einsum(
    equation: str, x: jax.Array, w: jax.Array, history: jax.Array | None = None, quantized: QuantizedWeight | None = None
) -> jax.Array:
    """``jnp.einsum(equation, x, w)`` with e4m3 operands and an e5m2 output gradient.
    ``history``: delayed scaling's [3, H] amax histories (None: current scaling); its
    cotangent is the history with this call's three amaxes recorded. ``quantized``: ``w``
    already in e4m3 (once per step, before the microbatch and layer loops), else
    quantised here."""
    if x.dtype != w.dtype:
        raise TypeError(f"fp8_einsum: operands in one compute dtype, got {x.dtype} and {w.dtype}")
    if quantized is None:
        quantized = quantize_weight(w, None if history is None else history[1])
    return _fp8_dot(equation, x, w, quantized, history)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fp8_dot(equation: str, x: jax.Array, w: jax.Array, quantized: QuantizedWeight, history: jax.Array | None) -> jax.Array:
    """The fp8 product of x and ``quantized``; ``w`` (its compute-dtype original, never read
    forward) receives the weight gradient."""
    return _forward(equation, x, w, quantized, history)[0]


def _forward(equation, x, w, quantized, history):
    transposed_equations(equation)  # refuse what the backward could not express as two dots
    seen_x = amax(x)
    scale_x = scale_for(seen_x, None if history is None else history[0], E4M3)
    q_x = quantize(x, E4M3, scale_x)
    y = scaled_dot(equation, q_x, quantized.values, scale_x * quantized.scale, x.dtype)
    return y, (q_x, quantized.values, scale_x, quantized.scale, seen_x, quantized.seen, history)


def _backward(equation, residuals, g):
    q_x, q_w, scale_x, scale_w, seen_x, seen_w, history = residuals
    dtype = g.dtype  # the operands' compute dtype (the output's)
    seen_g = amax(g)
    scale_g = scale_for(seen_g, None if history is None else history[2], E5M2)
    q_g = quantize(g, E5M2, scale_g)
    input_grad, weight_grad = transposed_equations(equation)
    dx = scaled_dot(input_grad, q_g, q_w, scale_g * scale_w, dtype)  # e5m2 x e4m3 (never e5m2 x e5m2)
    dw = scaled_dot(weight_grad, q_x, q_g, scale_x * scale_g, dtype)
    if history is None:
        return dx, dw, None, None
    return dx, dw, None, jnp.stack([record(history[0], seen_x), record(history[1], seen_w), record(history[2], seen_g)])


_fp8_dot.defvjp(_forward, _backward)


@jax.custom_vjp
def qdq_forward(x: jax.Array) -> jax.Array:
    """x rounded to e4m3 under its current per-tensor scale; the gradient passes through."""
    return qdq(x, E4M3, scale_for(amax(x), None, E4M3))


qdq_forward.defvjp(lambda x: (qdq_forward(x), None), lambda _, g: (g,))


@jax.custom_vjp
def qdq_gradient(y: jax.Array) -> jax.Array:
    """The identity whose backward rounds the cotangent to e5m2 under its current scale."""
    return y


qdq_gradient.defvjp(lambda y: (y, None), lambda _, g: (qdq(g, E5M2, scale_for(amax(g), None, E5M2)),))


# -- in the model ------------------------------------------------------------------------


def disabled():
    """Within this block (while tracing), fp8 matmuls run in the compute dtype
    (``model.fp8_keep_ends``' first and last layers)."""
    return step_context.changed(fp8_off=True)


def active() -> bool:
    return not step_context.current().fp8_off


def grouped(enabled: bool):
    """Within this block (while tracing), the routed experts' grouped matmuls
    (``models.experts.swiglu_groups``) quantise-dequantise their operands when ``enabled``."""
    return step_context.changed(fp8_grouped=enabled and active())


def grouped_active() -> bool:
    return step_context.current().fp8_grouped


def grouped_dot(dot: Callable[[jax.Array, jax.Array], jax.Array], x: jax.Array, w: jax.Array) -> jax.Array:
    """``dot(x, w)`` (a ``jax.lax.ragged_dot``) with fp8 rounding when ``grouped_active``:
    x and w rounded to e4m3 and the output gradient to e5m2, each under its current
    per-tensor scale; the products run in the compute dtype (XLA has no fp8 grouped GEMM)."""
    if not grouped_active():
        return dot(x, w)
    return qdq_gradient(dot(qdq_forward(x), qdq_forward(w)))


class Fp8Einsum(nnx.Module):
    """One projection's einsum under ``model.fp8``; under delayed scaling it holds the
    matmul's amax histories. ``weight``: the name of its weight in the module that holds
    both (``quantize_stack`` finds the weight through it)."""

    def __init__(self, mode: str, history_length: int, weight: str):
        self.mode, self.weight = mode, weight
        if mode == "delayed":
            self.history = Fp8History(jnp.zeros((3, history_length), jnp.float32), axes=(None, None), no_decay=True)

    def plain(self) -> bool:
        """Whether this call runs as a plain einsum (fp8 off, or disabled here)."""
        return self.mode == "off" or not active()

    def __call__(self, equation: str, x: jax.Array, w: jax.Array) -> jax.Array:
        if self.plain():
            return jnp.einsum(equation, x, w)
        history = self.history[...] if self.mode == "delayed" else None
        quantized = (step_context.current().fp8_weights or {}).get(id(self))
        return fp8_einsum(equation, x, w.astype(x.dtype), history, quantized)


# -- weights quantised once per step ---------------------------------------------------------
#
# A layer's fp8 weight is quantised before the layer loop, where it is sharded (FSDP's
# all-gather then moves e4m3 bytes, half of bf16's: torchtitan's float8 all-gather), and,
# with ``train.microbatches``, before the microbatch loop (Transformer Engine's weight cache:
# one quantisation per step, not per microbatch).


def _dots(stack: nnx.Module) -> Iterator[tuple[str, nnx.Module, Fp8Einsum]]:
    """(path, holder, dot) of each fp8 einsum in ``stack`` that runs fp8."""
    for path, node in nnx.iter_graph(stack):
        if isinstance(node, Fp8Einsum) and node.mode != "off":
            holder = stack
            for name in path[:-1]:
                holder = getattr(holder, name)
            yield "/".join(map(str, path)), holder, node


def quantize_stack(stack: nnx.Module) -> dict[str, QuantizedWeight]:
    """Every fp8 weight of a layer stack (a module whose parameters are [layers, ...], cast
    to the compute dtype) quantised per layer, keyed by its einsum's path."""
    quantized = {}
    for path, holder, dot in _dots(stack):
        history = dot.history[...][:, 1] if dot.mode == "delayed" else None  # [layers, H]: the weights' row
        quantized[path] = quantize_weight(getattr(holder, dot.weight)[...], history, stacked=True)
    return quantized


@contextlib.contextmanager
def quantized_in(block: nnx.Module, quantized: dict[str, QuantizedWeight] | None) -> Iterator[None]:
    """Within this block (while tracing), ``block``'s fp8 einsums take their weights from
    ``quantized`` (one layer's slice of ``quantize_stack``)."""
    if not quantized:
        yield
        return
    by_dot = {id(dot): quantized[path] for path, _, dot in _dots(block) if path in quantized}
    with step_context.changed(fp8_weights=by_dot):
        yield


@contextlib.contextmanager
def stacks_quantized(stacks: tuple[dict[str, QuantizedWeight], ...] | None) -> Iterator[None]:
    """Within this block (while tracing), the model's layer stacks take their fp8 weights from
    ``stacks`` (its ``quantize_fp8``, computed once per step outside the microbatch loop)."""
    with step_context.changed(fp8_stacks=stacks):
        yield


def hoisted_stacks() -> tuple[dict[str, QuantizedWeight], ...] | None:
    return step_context.current().fp8_stacks


# -- in the train step -------------------------------------------------------------------


def map_gradients(fn: Callable[[jax.Array], jax.Array], grads: Any) -> Any:
    """``fn`` on every gradient leaf but the fp8 histories' observations (left as they are)."""
    return jax.tree.map(lambda g: g if is_history(g) else jax.tree.map(fn, g), grads, is_leaf=is_history)


def add_gradients(a: Any, b: Any) -> Any:
    """a + b leaf by leaf, except the fp8 observations: their max."""
    return jax.tree.map(
        lambda x, y: x.replace(jnp.maximum(x[...], y[...])) if is_history(x) else jax.tree.map(jnp.add, x, y), a, b, is_leaf=is_history
    )


def reduce_over(tree: Any, axes) -> Any:
    """``psum`` over ``axes`` inside a ``shard_map``, except the fp8 observations: ``pmax``."""
    return jax.tree.map(
        lambda x: x.replace(jax.lax.pmax(x[...], axes)) if is_history(x) else jax.lax.psum(x, axes), tree, is_leaf=is_history
    )


def split(tree: Any) -> tuple[Any, Any]:
    """(the fp8 histories, everything else) of a parameter-shaped ``nnx.State``."""
    return nnx.split_state(tree, Fp8History, ...)


def merge(histories: Any, rest: Any) -> Any:
    return nnx.merge_state(histories, rest)


def without_histories(tree: Any) -> Any:
    return split(tree)[1] if has_history(tree) else tree


def overwrite_histories(params: Any, grads: Any) -> Any:
    """The parameters with each fp8 history replaced by its observed new value (its
    "gradient"), the rest as they are."""
    return jax.tree.map(lambda p, g: p.replace(g[...]) if is_history(p) else p, params, grads, is_leaf=is_history)


# -- on GPU: did every fp8 matmul become an fp8 GEMM? --------------------------------------


def matmuls_per_layer(cfg, moe_layer: bool) -> int:
    """The fp8 einsums of one decoder layer (the routed experts' grouped matmuls are
    quantise-dequantise only: not counted)."""
    attention = 2 if cfg.fused_projections else 4
    if moe_layer:
        return attention + (2 if cfg.moe_shared_experts else 0)
    return attention + (2 if cfg.fused_projections else 3)


def fp8_matmuls(cfg) -> int:
    """The fp8 einsums one forward pass of ``cfg`` runs: every layer's, but
    ``model.fp8_keep_ends``' bf16 first and last layers."""
    if cfg.fp8 == "off":
        return 0
    dense = cfg.moe_first_dense if cfg.moe_experts else cfg.n_layers
    kept = {0, cfg.n_layers - 1} if cfg.fp8_keep_ends else set()
    return sum(matmuls_per_layer(cfg, moe_layer=i >= dense) for i in range(cfg.n_layers) if i not in kept)


def expected_fp8_gemms(cfg, microbatches: int = 1) -> int:
    """The fp8 GEMMs one train step of ``cfg`` runs at least (``inspect.gpu_program.kernel_counts``'
    ``gemm_fp8``, loop trip counts included): 3 per fp8 einsum and microbatch (activation
    recomputation, ``model.remat``, adds forward GEMMs on top)."""
    return GEMMS_PER_MATMUL * fp8_matmuls(cfg) * microbatches


def fp8_gemm_note(cfg, gemm_fp8: int, microbatches: int = 1) -> str | None:
    """One line when a compiled step runs fewer fp8 GEMMs (``gemm_fp8``: ``kernel_counts``' count
    per step, cuBLASLt fp8 calls and Triton gemms on f8 operands) than ``cfg`` asks for."""
    expected = expected_fp8_gemms(cfg, microbatches)
    if gemm_fp8 >= expected:
        return None
    return (
        f"model.fp8={cfg.fp8}: the compiled step runs {gemm_fp8} fp8 GEMMs per step, expected {expected} "
        f"({GEMMS_PER_MATMUL} per fp8 matmul and microbatch); XLA computes the others in bf16/f16 "
        f"(fp8 GEMMs need compute capability {FP8_MIN_CAPABILITY}+ and CUDA 12)"
    )


def say_fp8_gemms(cfg, gemm_fp8: int, microbatches: int = 1) -> None:
    """``fp8_gemm_note`` as a warning line, when there is one."""
    note = fp8_gemm_note(cfg, gemm_fp8, microbatches)
    if note:
        log.warning(note)


def amax_sync_note(cfg, all_reduce: dict) -> str | None:
    """One line for current scaling when the compiled step's all-reduces (``all_reduce``:
    ``inspect.gpu_program.collective_schedule``'s entry) run synchronously: each quantisation
    waits for its tensor's amax, reduced across devices, and XLA:GPU cannot hide that wait."""
    sync = all_reduce.get("count", 0) - all_reduce.get("async", 0)
    if cfg.fp8 != "current" or sync <= 0:
        return None
    return (
        f"model.fp8=current: {sync} of {all_reduce['count']} all-reduces per step run synchronously (each quantisation waits "
        "for its tensor's amax across devices); model.fp8=delayed takes them off the critical path"
    )


def say_amax_sync(cfg, all_reduce: dict) -> None:
    """``amax_sync_note`` as a warning line, when there is one."""
    note = amax_sync_note(cfg, all_reduce)
    if note:
        log.warning(note)
