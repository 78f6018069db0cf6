"""DiLoCo: replicas train apart for H steps, then one outer step on their averaged delta.

The ``replica`` mesh axis is outermost (across regions); inside each replica any data /
fsdp / tensor layout runs the usual train step. The inner parameters and optimizer
state carry a leading replica dimension sharded over ``replica``, and the inner step is
the ordinary step under ``jax.vmap(..., spmd_axis_name="replica")``, so each replica's
computation stays on its own devices and nothing crosses the replica axis.

Every H steps a separate program (the outer step) averages the pseudo-gradient
``outer - inner_r`` over replicas (fp32, or bf16 / int8 through the compressed
reduction of ``grad_reduce``), applies it to the outer parameters with Nesterov SGD
(DiLoCo's outer optimizer), and resets every replica's inner parameters to the result.
Inner optimizer states are kept across rounds, as in the paper.

The trainer takes its replicas from ``replicas_for``: ``DiLoCo``, or ``OneModel`` (no replica
axis), which answer the same questions (how a step maps over replicas, what a fresh state
is, what the loop calls after compiling, whose metrics and parameters are the model's), so
the step itself has no DiLoCo branch.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec

from jaxdist.layout.mesh import INNER_BATCH_AXES
from jaxdist.parallel import grad_reduce, slow_link

AXIS = "replica"
log = logging.getLogger(__name__)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class OuterState:
    params: Any  # the synchronised (outer) parameters, replicated over the replica axis
    momentum: Any  # the outer optimizer's state


def outer_optimizer(parallel_cfg) -> optax.GradientTransformation:
    momentum = parallel_cfg.diloco_outer_momentum
    return optax.sgd(parallel_cfg.diloco_outer_lr, momentum=momentum or None, nesterov=momentum > 0)


def stacked_shapes(tree: Any, replicas: int) -> Any:
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct((replicas, *a.shape), a.dtype), tree)


def stacked_shardings(shardings: Any, mesh) -> Any:
    """A leading replica dimension, sharded over the replica axis, before each sharding."""
    return jax.tree.map(lambda s: NamedSharding(mesh, PartitionSpec(AXIS, *s.spec)), shardings)


def stack(tree: Any, replicas: int) -> Any:
    return jax.tree.map(lambda x: jnp.broadcast_to(x, (replicas, *x.shape)), tree)


def split_batch(batch: Any, replicas: int, mesh) -> Any:
    """[B, ...] -> [R, B/R, ...]: replica r trains on rows r*B/R ... (r+1)*B/R - 1 (its own
    slice: the batch is sharded over replica first, so this moves nothing)."""

    def split(x):
        x = x.reshape(replicas, x.shape[0] // replicas, *x.shape[1:])
        spec = PartitionSpec(AXIS, INNER_BATCH_AXES, *([None] * (x.ndim - 2)))
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))

    return jax.tree.map(split, batch)


def average_metrics(metrics: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Per-replica step metrics (on the host) -> one value each (``skipped``: any replica skipped)."""
    return {k: (np.any(v) if k == "skipped" else np.mean(v)) for k, v in metrics.items()}


def average_delta(stacked_inner: Any, outer: Any, parallel_cfg, param_shardings: Any, mesh) -> Any:
    """The replica average of ``outer - inner_r`` in fp32, crossing the replica axis as
    ``parallel.diloco_reduce`` says."""
    replicas = mesh.shape[AXIS]
    deltas = jax.tree.map(lambda o, i: o.astype(jnp.float32)[None] - i.astype(jnp.float32), outer, stacked_inner)
    if parallel_cfg.diloco_reduce == "float32":
        mean = jax.tree.map(lambda d: jnp.mean(d, axis=0), deltas)
        return jax.lax.with_sharding_constraint(mean, param_shardings)
    plan = grad_reduce.ReducePlan(parallel_cfg.diloco_reduce, (AXIS,), (), 0.0, error_feedback=False)
    device_specs = jax.tree.map(lambda s: s.spec, stacked_shardings(param_shardings, mesh))
    total, _ = grad_reduce.reduce_gradients(deltas, None, plan, param_shardings, mesh, device_specs=device_specs)
    return jax.tree.map(lambda t: t / replicas, total)


def outer_update(stacked_inner: Any, outer: OuterState, tx: optax.GradientTransformation, parallel_cfg, param_shardings, mesh):
    """(new stacked inner parameters: every replica restarts from the new outer ones, new
    outer state, the norm of the averaged delta)."""
    delta = average_delta(stacked_inner, outer.params, parallel_cfg, param_shardings, mesh)
    updates, momentum = tx.update(delta, outer.momentum, outer.params)
    params = optax.apply_updates(outer.params, updates)
    inner = jax.tree.map(lambda p, i: jnp.broadcast_to(p.astype(i.dtype), i.shape), params, stacked_inner)
    inner = jax.lax.with_sharding_constraint(inner, stacked_shardings(param_shardings, mesh))
    return inner, OuterState(params, momentum), optax.tree.norm(delta)


class DiLoCoStep:
    """The host side of a DiLoCo round: the inner step every step, the outer step (and
    the link's delay) after every H-th; the round position follows the global step, so a
    run resumed mid-round finishes that round exactly as it would have."""

    def __init__(self, inner: Callable, outer: Callable, inner_steps: int, start_step: int, link_delay_s: float = 0.0):
        self.inner, self.outer, self.inner_steps = inner, outer, inner_steps
        self.step, self.link_delay_s = start_step, link_delay_s
        self.compiled = inner  # what the analysis reads; it compiles the outer step itself

    def __call__(self, state, batch):
        state, metrics = self.inner(state, batch)
        self.step += 1
        if self.step % self.inner_steps == 0:
            state = self.outer(state)
            if self.link_delay_s:
                slow_link.wait_for_link(state, self.link_delay_s)
        return state, metrics


# -- the trainer's replicas: one model, or DiLoCo's ---------------------------------------


class OneModel:
    """No replica axis: every step is synchronous and the state is the model's."""

    count = 0
    outer_tx = None
    link_axis = "data"  # a simulated slow link (experiments) crosses the data axis

    def per_replica(self, step: Callable, mesh, state_axes) -> Callable:
        return step

    def fresh(self, params, opt_state) -> tuple[Any, Any, Any]:
        """(params, optimizer state, outer state) of a fresh start."""
        return params, opt_state, None

    def host_step(self, compiled, state, mesh, start_step: int, link: slow_link.SlowLink | None, state_layout=None) -> Callable:
        if link is None:
            return compiled
        delay, count, sent = link.delay_s(compiled, mesh)
        log.info(
            f"simulated link on the data axis: {count} collectives, {sent / 2**20:.2f} MiB per device per step -> +{delay * 1e3:.1f} ms per step"
        )
        return slow_link.LinkedStep(compiled, delay)

    def fetch_metrics(self, pending: list) -> list:
        return jax.device_get(pending)

    def model_params(self, state):
        return state.params


class DiLoCo(OneModel):
    """``parallel.diloco_inner_steps`` = H local steps per replica, then the outer step."""

    link_axis = AXIS

    def __init__(self, parallel_cfg, mesh):
        self.parallel_cfg, self.inner_steps, self.count = parallel_cfg, parallel_cfg.diloco_inner_steps, mesh.shape[AXIS]
        self.outer_tx = outer_optimizer(parallel_cfg)

    def per_replica(self, step: Callable, mesh, state_axes) -> Callable:
        """Every replica takes one ordinary step on its slice of the batch; nothing crosses the
        replica axis (vmap with ``spmd_axis_name`` keeps each replica on its devices).
        ``state_axes``: the state's mapped axes (``training.state.PER_REPLICA``)."""
        mapped = jax.vmap(step, in_axes=(state_axes, 0), out_axes=(state_axes, 0), spmd_axis_name=AXIS)

        def inner(state, batch):
            new, metrics = mapped(dataclasses.replace(state, outer=None), split_batch(batch, self.count, mesh))
            return dataclasses.replace(new, outer=state.outer), metrics

        return inner

    def fresh(self, params, opt_state) -> tuple[Any, Any, Any]:
        """Every replica starts from the same parameters; the outer ones are those too."""
        return stack(params, self.count), stack(opt_state, self.count), OuterState(params, self.outer_tx.init(params))

    def outer_program(self, state_layout) -> Callable:
        """The outer step, jitted: the replicas' averaged delta applied to the outer parameters,
        every replica restarted from them."""
        param_shardings, mesh = state_layout.param_shardings, state_layout.layout.mesh

        def outer(state):
            params, new_outer, _ = outer_update(state.params, state.outer, self.outer_tx, self.parallel_cfg, param_shardings, mesh)
            return dataclasses.replace(state, params=params, outer=new_outer)

        shardings = state_layout.shardings
        return jax.jit(outer, in_shardings=(shardings,), out_shardings=shardings, donate_argnums=0)

    def host_step(self, compiled, state, mesh, start_step: int, link: slow_link.SlowLink | None, state_layout=None) -> Callable:
        outer = self.outer_program(state_layout).lower(state).compile()
        delay = 0.0
        if link is not None:
            delay, count, sent = link.delay_s(outer, mesh)
            log.info(
                f"simulated replica link: {count} collectives, {sent / 2**20:.2f} MiB per device per outer step -> "
                f"+{delay * 1e3:.1f} ms every {self.inner_steps} steps"
            )
        return DiLoCoStep(compiled, outer, self.inner_steps, start_step, delay)

    def fetch_metrics(self, pending: list) -> list:
        """Per-replica metrics, gathered (at log points only) and averaged."""
        if jax.process_count() > 1:
            pending = multihost_utils.process_allgather(pending, tiled=True)
        return [average_metrics(m) for m in jax.device_get(pending)]

    def model_params(self, state):
        return state.outer.params


def replicas_for(parallel_cfg, mesh) -> OneModel:
    return DiLoCo(parallel_cfg, mesh) if parallel_cfg.diloco_inner_steps else OneModel()
