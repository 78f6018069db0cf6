"""The train state and its layout: what a step carries, with every part's shapes and
shardings known before anything is allocated.

Parts: the step count, the parameters and optimizer state (Adam's moments follow the
parameters' logical axes), gradient compression's per-device residuals, fp16's loss
scale, and DiLoCo's outer state. Under DiLoCo the parameters, the optimizer state and
the loss scale carry a leading replica dimension sharded over the ``replica`` axis.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec

from jaxdist.layout.mesh import INNER_BATCH_AXES
from jaxdist.layout.sharding import Layout, tree_shardings
from jaxdist.parallel import diloco, grad_reduce
from jaxdist.training import loss_scale

log = logging.getLogger(__name__)

HOST_MEMORY, DEVICE_MEMORY = "pinned_host", "device"  # train.optimizer_offload: where the optimizer state lives, is updated


def in_memory(sharding: NamedSharding, kind: str) -> NamedSharding:
    """``sharding`` in memory ``kind``. Compile-only devices (a GPU target compiled here)
    describe no memories, and a sharding on them drops its kind; one on their abstract mesh
    keeps it (the step is then lowered under ``jax.set_mesh``: ``needs_mesh_context``)."""
    placed = sharding.with_memory_kind(kind)
    if placed.memory_kind == kind:
        return placed
    return NamedSharding(sharding.mesh.abstract_mesh, sharding.spec, memory_kind=kind)


def needs_mesh_context(shardings: Any) -> bool:
    """Whether any of ``shardings`` is on an abstract mesh (``in_memory``)."""
    return any(isinstance(s, NamedSharding) and isinstance(s.mesh, AbstractMesh) for s in jax.tree.leaves(shardings))


@dataclasses.dataclass
class TrainState:
    step: jax.Array
    params: Any  # nnx.State of the model's parameters
    opt_state: Any  # optax state; Adam's moments mirror ``params``
    residual: Any = None  # error feedback: per device, what gradient compression dropped ([devices, *param]), unscaled
    loss_scale: Any = None  # model.dtype=float16: jaxdist.training.loss_scale.LossScale
    outer: Any = None  # DiLoCo: jaxdist.parallel.diloco.OuterState (params and opt_state are then per replica)
    reference: Any = None  # train.objective=dpo: the frozen reference model's parameters (sharded as ``params``)


_ALWAYS = ("step", "params", "opt_state", "residual", "loss_scale", "outer")


def _flatten_state(state: TrainState):
    """A state's children by field name; ``reference`` only when there is one, so a state without
    it has the tree (and a checkpoint the structure) it had before the field existed."""
    names = _ALWAYS + (("reference",) if state.reference is not None else ())
    return [(jax.tree_util.GetAttrKey(name), getattr(state, name)) for name in names], len(names)


jax.tree_util.register_pytree_with_keys(TrainState, _flatten_state, lambda _, children: TrainState(*children))


# DiLoCo's inner step maps over the replica dimension of everything but the step and the outer state.
PER_REPLICA = TrainState(step=None, params=0, opt_state=0, residual=0, loss_scale=0, outer=None)


def optimizer_step(opt_state: Any) -> jax.Array:
    """The update count the optimizer's schedule reads (optax keeps it in its states)."""
    counts = optax.tree_utils.tree_get_all_with_path(opt_state, "count")
    return counts[-1][1] if counts else jnp.zeros((), jnp.int32)


def residual_shapes(abstract_params: Any, devices: int) -> Any:
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct((devices, *a.shape), jnp.float32), abstract_params)


class StateLayout:
    """Shapes (``abstract``) and shardings (``shardings``) of every part of the state, and
    one line for each dimension a mesh axis cannot split (``replicated``: no silent
    replication)."""

    def __init__(
        self,
        abstract_params: Any,
        tx: optax.GradientTransformation,
        layout: Layout,
        *,
        error_feedback: bool,
        float16: str | None,
        outer_tx: optax.GradientTransformation | None = None,
        outer_pending: Callable[[Any, Any], tuple[Any, Any]] | None = None,
        optimizer_offload: bool = False,
        reference: bool = False,
    ):
        mesh = layout.mesh
        self.layout, self.abstract_params = layout, abstract_params
        self.replicated: dict[tuple, str] = {}
        self.param_shardings = tree_shardings(abstract_params, layout.param_rules, mesh, replicated=self.replicated)
        abstract_opt = jax.eval_shape(tx.init, abstract_params)
        self.reduce_devices = math.prod(mesh.shape[a] for a in INNER_BATCH_AXES)  # devices that each hold a residual
        residual = residual_shardings = scale = scale_shardings = None
        if error_feedback:
            residual_shardings = grad_reduce.per_device_shardings(self.param_shardings, mesh)
            residual = residual_shapes(abstract_params, self.reduce_devices)
        if float16 is not None:  # train.loss_scale
            scale = jax.eval_shape(lambda: loss_scale.initial(float16))
            scale_shardings = jax.tree.map(lambda _: layout.replicated(), scale)
        opt_shardings = tree_shardings(abstract_opt, layout.opt_rules, mesh, replicated=self.replicated)
        # train.optimizer_offload: the state lives in host memory; the update works on a copy
        # in device memory (``opt_on_device``) and its result goes back (the step's out_shardings)
        self.opt_device_shardings = None
        if optimizer_offload:
            self.opt_device_shardings = jax.tree.map(lambda s: in_memory(s, DEVICE_MEMORY), opt_shardings)
            opt_shardings = jax.tree.map(lambda s: in_memory(s, HOST_MEMORY), opt_shardings)
        # train.objective=dpo: the frozen reference model, shaped and sharded as the parameters
        kept, kept_shardings = (abstract_params, self.param_shardings) if reference else (None, None)
        self.abstract = TrainState(jax.ShapeDtypeStruct((), jnp.int32), abstract_params, abstract_opt, residual, scale, reference=kept)
        self.shardings = TrainState(
            layout.replicated(), self.param_shardings, opt_shardings, residual_shardings, scale_shardings, reference=kept_shardings
        )
        self.replicas = mesh.shape[diloco.AXIS] if outer_tx is not None else 0
        if outer_tx is not None:
            self._stack_per_replica(outer_tx, outer_pending)

    def _stack_per_replica(self, outer_tx: optax.GradientTransformation, outer_pending) -> None:
        """DiLoCo: params, optimizer state and loss scale gain a leading replica dimension;
        the outer parameters and momentum are added (and streaming DiLoCo's averages on their
        way, ``outer_pending``)."""
        mesh, replicas = self.layout.mesh, self.replicas
        abstract_momentum = jax.eval_shape(outer_tx.init, self.abstract_params)
        momentum_shardings = tree_shardings(abstract_momentum, self.layout.param_rules, mesh, replicated=self.replicated)

        def per_replica(tree):
            return None if tree is None else diloco.stacked_shapes(tree, replicas)

        def stacked(tree):
            return None if tree is None else diloco.stacked_shardings(tree, mesh)

        a, s = self.abstract, self.shardings
        pending, pending_shardings = outer_pending(self.abstract_params, self.param_shardings) if outer_pending else (None, None)
        outer = diloco.OuterState(self.abstract_params, abstract_momentum, pending)
        self.abstract = TrainState(a.step, per_replica(a.params), per_replica(a.opt_state), None, per_replica(a.loss_scale), outer)
        outer_shardings = diloco.OuterState(self.param_shardings, momentum_shardings, pending_shardings)
        self.shardings = TrainState(s.step, stacked(s.params), stacked(s.opt_state), None, stacked(s.loss_scale), outer_shardings)

    def opt_on_device(self, opt_state: Any, grads: Any) -> Any:
        """The optimizer state in device memory for the update (itself when it lives there),
        brought once the gradients exist: XLA's scheduler would otherwise start the copies at
        the top of the step, to hide them, and hold the state through the forward and backward,
        the peak it is offloaded to lower."""
        if self.opt_device_shardings is None:
            return opt_state
        opt_state, _ = jax.lax.optimization_barrier((opt_state, grads))
        return jax.device_put(opt_state, self.opt_device_shardings)

    def with_shardings(self, abstract: Any, shardings: Any) -> Any:
        return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)

    def abstract_state(self) -> TrainState:
        """Shapes, dtypes and shardings of the state, with nothing allocated."""
        return self.with_shardings(self.abstract, self.shardings)

    def fresh_extras(self, loss_scale_setting: str) -> TrainState:
        """Fresh residuals (zeros) and loss scale (one per replica under DiLoCo), shaped as
        in the state; the rest of the state left empty. Trace under ``jit``."""
        residual = scale = None
        if self.abstract.residual is not None:
            residual = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), self.abstract.residual)
        if self.abstract.loss_scale is not None:
            scale = loss_scale.initial(loss_scale_setting)
            if self.replicas:
                scale = diloco.stack(scale, self.replicas)
        return TrainState(None, None, None, residual, scale)

    def loss_scale_target(self) -> Any:
        """The loss scale as a checkpoint stores it (stacked per replica under DiLoCo), for
        reading one whether or not this run uses it."""
        scale = jax.eval_shape(lambda: loss_scale.initial("dynamic"))
        shardings = jax.tree.map(lambda _: self.layout.replicated(), scale)
        if self.replicas:
            scale = diloco.stacked_shapes(scale, self.replicas)
            shardings = diloco.stacked_shardings(shardings, self.layout.mesh)
        return self.with_shardings(scale, shardings)

    def say_replicated(self) -> None:
        """One line for each dimension a mesh axis cannot split (no silent replication)."""
        for line in self.replicated.values():
            log.warning(line)

    def metric_sharding(self) -> NamedSharding:
        """DiLoCo's metrics stay per replica: averaging them in the step would cross the
        replica axis every step."""
        mesh = self.layout.mesh
        return NamedSharding(mesh, PartitionSpec(diloco.AXIS)) if self.replicas else self.layout.replicated()
