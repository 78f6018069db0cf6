"""Pipeline parallelism over the ``pipe`` mesh axis: GPipe, circular and 1F1B.

Applied from outside the model (``pipelined_loss``), to any model that exposes its parts
(``StagedModel``: embedding, stacked blocks, head and loss), the way torchtitan's
parallelize step does. The decoder's stacked layers ([L, ...], ``layers`` sharded over ``pipe``) are cut into
S stages of L/S layers. Inside ``jax.shard_map`` -- manual over ``pipe`` only, so the
data / fsdp / tensor axes stay with the partitioner inside each stage -- a scan of
ticks runs every stage in lockstep and ``ppermute`` moves activations to the next
stage (and, in 1F1B, cotangents to the previous one).

- ``gpipe``: every microbatch through every stage, the backward pass from autodiff.
  Ticks M + S - 1; bubble (S-1)/(M+S-1); keeps O(M) microbatches of activations.
- ``circular``: each device holds V chunks of L/(S V) layers; a microbatch loops the
  ring V times. Bubble (S-1)/(V M + S - 1). Needs M >= S (a microbatch waits at stage 0
  for its next lap).
- ``1f1b``: forward and backward interleaved in one explicit schedule (lockstep SPMD):
  at tick t stage s runs the forward of microbatch t-s and the backward of microbatch
  t-(2S-2-s); inputs wait in a ring of 2S slots and the stage is recomputed in the
  backward with ``jax.vjp``; the last stage turns its output into the loss and the
  cotangent in the same tick. Ticks M + 2S - 2, so its bubble (2S-2)/(M+2S-2) is larger
  than GPipe's, but only O(S) stage inputs are alive instead of O(M).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec

from jaxdist.layout.sharding import active_layout
from jaxdist.parallel.microbatch import merge_microbatches, split_microbatches
from jaxdist.parallel.schedule import PipelineSpec

# -- layouts ------------------------------------------------------------------------------


def stage_major(layer_params: Any, spec: PipelineSpec) -> Any:
    """[L, ...] -> [S, V, K, ...] with chunk (s, v) = layers (v S + s) K ... (v S + s + 1) K.

    For V = 1 this is a free reshape of the pipe-sharded layer axis; for V > 1 the
    circular order differs from the contiguous storage and XLA moves the weights.
    """
    s, v = spec.stages, spec.virtual

    def one(x):
        k = x.shape[0] // (s * v)
        return jnp.swapaxes(x.reshape(v, s, k, *x.shape[1:]), 0, 1)

    return jax.tree.map(one, layer_params)


def _index(tree: Any, i: jax.Array) -> Any:
    return jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, i, 0, keepdims=False), tree)


def _shift(x: jax.Array, stages: int, step: int) -> jax.Array:
    """Send to the stage ``step`` further along the ring (1: right, -1: left)."""
    return jax.lax.ppermute(x, "pipe", [(j, (j + step) % stages) for j in range(stages)])


def _where(cond, new: Any, old: Any) -> Any:
    return jax.tree.map(lambda a, b: jnp.where(cond, a, b), new, old)


# -- GPipe and circular: forward schedule, backward by autodiff ----------------------------

StageFn = Callable[[Any, jax.Array, dict[str, jax.Array]], jax.Array]


def pipeline_forward(
    stage_fn: StageFn, layer_params: Any, x: jax.Array, aux: dict[str, jax.Array], spec: PipelineSpec, mesh: Mesh
) -> jax.Array:
    """All L layers applied to x [B, T, D] through the pipeline; returns [B, T, D]."""
    S, M, V = spec.stages, spec.microbatches, spec.virtual
    staged = stage_major(layer_params, spec)
    x_mb = split_microbatches(x, M)
    aux_mb = {k: split_microbatches(v, M) for k, v in aux.items()}

    def per_stage(params, x_mb, aux_mb):
        params = jax.tree.map(lambda p: p[0], params)  # this stage's [V, K, ...]
        s = jax.lax.axis_index("pipe")

        def tick(carry, t):
            inbox, outputs, received = carry
            # what arrived at stage 0 from the last stage: a microbatch due for its next lap
            arrived = t - S
            lap_due = (s == 0) & (arrived >= 0) & (arrived < (V - 1) * M)
            slot = jnp.clip(arrived, 0, V * M - 1) % M
            inbox = jnp.where(lap_due, inbox.at[slot].set(received), inbox)

            i = t - s  # this stage's iteration: microbatch i % M on chunk i // M
            valid = (i >= 0) & (i < V * M)
            i = jnp.clip(i, 0, V * M - 1)
            m, v = i % M, i // M
            first_lap_input = jnp.where(v == 0, x_mb[m], inbox[m])
            h = jnp.where(s == 0, first_lap_input, received)
            out = stage_fn(_index(params, v), h, _index(aux_mb, m))
            done = valid & (s == S - 1) & (v == V - 1)
            outputs = jnp.where(done, outputs.at[m].set(out), outputs)
            return (inbox, outputs, _shift(out, S, 1)), None

        zeros = jnp.zeros_like(x_mb)
        (_, outputs, _), _ = jax.lax.scan(tick, (zeros, zeros, jnp.zeros_like(x_mb[0])), jnp.arange(spec.ticks))
        return jax.lax.psum(jnp.where(s == S - 1, outputs, 0), "pipe")  # every stage gets the result

    run = jax.shard_map(
        per_stage,
        mesh=mesh,
        in_specs=(PartitionSpec("pipe"), PartitionSpec(), PartitionSpec()),
        out_specs=PartitionSpec(),
        axis_names={"pipe"},
        check_vma=False,
    )
    return merge_microbatches(run(staged, x_mb, aux_mb))


# -- 1F1B: explicit forward/backward schedule ------------------------------------------------

HeadLossFn = Callable[[Any, jax.Array, dict[str, jax.Array]], jax.Array]  # (head params, y, targets) -> loss sum


# The cotangent the loss sum's gradient is taken with while a loss is traced (fp16 loss
# scaling: the objective is loss x scale). 1F1B computes its backward inside the forward
# pass, before autodiff hands it that cotangent, so the scale has to reach it this way:
# otherwise its fp16 cotangents would run unscaled and underflow.
_COTANGENT = contextvars.ContextVar("jaxdist_loss_cotangent", default=None)


@contextlib.contextmanager
def loss_cotangent(scale: jax.Array | None):
    """Trace a loss whose gradient will be taken of ``loss sum x scale`` (None: 1)."""
    token = _COTANGENT.set(scale)
    try:
        yield
    finally:
        _COTANGENT.reset(token)


def _one_f_one_b(stage_fn, head_loss_fn, spec: PipelineSpec, mesh: Mesh, layer_params, head_params, x, aux, targets, seed):
    """(loss sum, and the gradients of loss sum x ``seed`` by layer params, head params and x)."""
    S, M = spec.stages, spec.microbatches
    ring_size = 2 * S
    staged = jax.tree.map(lambda p: p[:, 0], stage_major(layer_params, spec))  # [S, K, ...]
    x_mb = split_microbatches(x, M)
    aux_mb = {k: split_microbatches(v, M) for k, v in aux.items()}
    targets_mb = {k: split_microbatches(v, M) for k, v in targets.items()}

    def per_stage(params, head_params, x_mb, aux_mb, targets_mb, seed):
        params = jax.tree.map(lambda p: p[0], params)
        s = jax.lax.axis_index("pipe")

        def head_grad(head_params, y, targets):  # the backward starts from ``seed``, as autodiff's would
            value, vjp = jax.vjp(lambda hp, yy: head_loss_fn(hp, yy, targets), head_params, y)
            return value, vjp(seed.astype(value.dtype))

        def tick(carry, t):
            ring, act_in, cot_in, loss, g_params, g_head, dx = carry
            # forward of microbatch f; the last stage also takes the loss and its cotangent
            f = t - s
            f_valid = (f >= 0) & (f < M)
            fm = jnp.clip(f, 0, M - 1)
            h = jnp.where(s == 0, x_mb[fm], act_in)
            ring = jnp.where(f_valid, ring.at[fm % ring_size].set(h), ring)
            y = stage_fn(params, h, _index(aux_mb, fm))

            # Every stage evaluates the head (SPMD lockstep); only the last stage's counts.
            # (lax.cond here trips XLA's SPMD partitioner once tensor/data axes are auto.)
            value, (dh, dy) = head_grad(head_params, y, _index(targets_mb, fm))
            is_loss_tick = (s == S - 1) & f_valid
            value = jnp.where(is_loss_tick, value, 0.0)
            dh = jax.tree.map(lambda g: jnp.where(is_loss_tick, g, 0), dh)
            loss, g_head = loss + value, jax.tree.map(jnp.add, g_head, dh)

            # backward of microbatch b, recomputing the stage from its saved input
            b = t - (2 * S - 2 - s)
            b_valid = (b >= 0) & (b < M)
            bm = jnp.clip(b, 0, M - 1)
            cot = jnp.where(s == S - 1, dy, cot_in)
            aux_b = _index(aux_mb, bm)
            _, vjp = jax.vjp(lambda p, h_in: stage_fn(p, h_in, aux_b), params, ring[bm % ring_size])
            gp, gx = vjp(cot.astype(y.dtype))
            g_params = jax.tree.map(lambda acc, g: acc + jnp.where(b_valid, g, 0), g_params, gp)
            dx = jnp.where((s == 0) & b_valid, dx.at[bm].set(gx), dx)
            return (ring, _shift(y, S, 1), _shift(gx, S, -1), loss, g_params, g_head, dx), None

        mb_shape = x_mb.shape[1:]
        init = (
            jnp.zeros((ring_size, *mb_shape), x_mb.dtype),
            jnp.zeros(mb_shape, x_mb.dtype),
            jnp.zeros(mb_shape, x_mb.dtype),
            jnp.zeros((), jnp.float32),
            jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params),
            jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), head_params),
            jnp.zeros_like(x_mb),
        )
        (_, _, _, loss, g_params, g_head, dx), _ = jax.lax.scan(tick, init, jnp.arange(spec.ticks))
        # loss, head grads and dx each live on one stage; sums over this device's batch
        # rows are completed over 'data' once, after the schedule (like DDP's bucket)
        loss = jax.lax.psum(loss, ("pipe", "data"))
        g_head = jax.lax.psum(g_head, ("pipe", "data"))
        g_params = jax.lax.psum(g_params, "data")
        dx = jax.lax.psum(dx, "pipe")
        return loss, jax.tree.map(lambda g: g[None], g_params), g_head, dx

    # Manual over 'data' as well: XLA's SPMD partitioner (jaxlib 0.10) fails a check when
    # it has to place the per-microbatch gradient reductions over data inside this
    # loop while tensor is partitioned too; reducing explicitly at the end avoids it.
    rows = PartitionSpec(None, "data")
    run = jax.shard_map(
        per_stage,
        mesh=mesh,
        in_specs=(PartitionSpec("pipe"), PartitionSpec(), rows, rows, rows, PartitionSpec()),
        out_specs=(PartitionSpec(), PartitionSpec("pipe"), PartitionSpec(), rows),
        axis_names={"pipe", "data"},
        check_vma=False,
    )
    loss, g_staged, g_head, dx = run(staged, head_params, x_mb, aux_mb, targets_mb, seed)
    # back to the [L, ...] layer layout of the parameters
    g_layers = jax.tree.map(lambda g, p: g.reshape(p.shape).astype(p.dtype), g_staged, layer_params)
    g_head = jax.tree.map(lambda g, p: g.astype(p.dtype), g_head, head_params)
    return loss, g_layers, g_head, merge_microbatches(dx).astype(x.dtype)


def one_f_one_b_loss(stage_fn: StageFn, head_loss_fn: HeadLossFn, spec: PipelineSpec, mesh: Mesh):
    """loss(layer_params, head_params, x, aux, targets, seed) -> summed loss, whose gradient
    comes from the explicit 1F1B schedule (computed together with the loss), started from
    the cotangent ``seed`` (the loss scale autodiff will bring; its own cotangent then
    only rescales, by g / seed)."""

    @jax.custom_vjp
    def loss(layer_params, head_params, x, aux, targets, seed):
        return _one_f_one_b(stage_fn, head_loss_fn, spec, mesh, layer_params, head_params, x, aux, targets, seed)[0]

    def forward(layer_params, head_params, x, aux, targets, seed):
        value, g_layers, g_head, dx = _one_f_one_b(stage_fn, head_loss_fn, spec, mesh, layer_params, head_params, x, aux, targets, seed)
        return value, (g_layers, g_head, dx, aux, targets, seed)

    def backward(residuals, g):
        g_layers, g_head, dx, aux, targets, seed = residuals
        factor = g / seed  # 1 when autodiff brings the seed itself

        def scale(tree):
            return jax.tree.map(lambda x: (x * factor).astype(x.dtype), tree)

        def no_gradient(tree):  # integer inputs (positions, targets) take float0 zeros
            return jax.tree.map(
                lambda x: np.zeros(x.shape, jax.dtypes.float0) if not jnp.issubdtype(x.dtype, jnp.floating) else jnp.zeros_like(x), tree
            )

        return scale(g_layers), scale(g_head), scale(dx), no_gradient(aux), no_gradient(targets), jnp.zeros_like(seed)

    loss.defvjp(forward, backward)
    return loss


# -- applying a schedule to a model from outside ------------------------------------------


class StagedModel(Protocol):
    """The parts a model exposes so that a schedule can run it (``models.llama.Llama`` does)."""

    def embed_tokens(self, batch: dict[str, jax.Array]) -> tuple[jax.Array, dict[str, jax.Array]]: ...  # (x, per-row aux)

    def layer_stack(self) -> tuple[Any, Any]: ...  # (graphdef, params stacked on a leading layer axis)

    def run_layers(self, graphdef: Any, stacked: Any, x: jax.Array, aux: dict[str, jax.Array]) -> jax.Array: ...

    def head_params(self) -> Any: ...

    def head_loss(self, head: Any, y: jax.Array, targets: dict[str, jax.Array]) -> jax.Array: ...  # summed loss

    def loss_targets(self, batch: dict[str, jax.Array]) -> tuple[dict[str, jax.Array], jax.Array]: ...  # (targets, weight)


def pipelined_loss(spec: PipelineSpec) -> Callable[[StagedModel, dict[str, jax.Array]], tuple[jax.Array, jax.Array, dict]]:
    """A task loss ``(model, batch) -> (loss sum, weight, {})`` that runs the model's layers
    through ``spec``'s schedule over the mesh's pipe axis; embedding and head run outside
    the pipeline (GPipe, circular) or on the last stage (1F1B)."""

    def loss(model: StagedModel, batch: dict[str, jax.Array]) -> tuple[jax.Array, jax.Array, dict]:
        x, aux = model.embed_tokens(batch)
        graphdef, stacked = model.layer_stack()
        stage = functools.partial(model.run_layers, graphdef)
        targets, weight = model.loss_targets(batch)
        mesh = active_layout().mesh
        if spec.schedule == "1f1b":
            seed = _COTANGENT.get()
            seed = jnp.ones((), jnp.float32) if seed is None else jnp.asarray(seed, jnp.float32)
            return one_f_one_b_loss(stage, model.head_loss, spec, mesh)(stacked, model.head_params(), x, aux, targets, seed), weight, {}
        y = pipeline_forward(stage, stacked, x, aux, spec, mesh)
        return model.head_loss(model.head_params(), y, targets), weight, {}  # dense layers only (validate: no MoE here)

    return loss
