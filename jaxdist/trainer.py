"""The jitted train and eval steps, sharded state initialisation, and the training loop."""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxdist import loss_scale
from jaxdist.config import Config
from jaxdist.errors import NonFiniteLoss
from jaxdist.metrics import MetricsLogger
from jaxdist.models import Batch, Task
from jaxdist.optim import lr_schedule, make_optimizer
from jaxdist.parallel import diloco, grad_reduce
from jaxdist.parallel.microbatch import split_microbatches
from jaxdist.parallel.pipeline import loss_cotangent
from jaxdist.sharding import Layout, activation_layout, tree_shardings
from jaxdist.tracing import StepTracer


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TrainState:
    step: jax.Array
    params: Any  # nnx.State of the model's parameters
    opt_state: Any  # optax state; Adam's moments mirror ``params``
    residual: Any = None  # error feedback: per device, what gradient compression dropped ([devices, *param])
    loss_scale: Any = None  # model.dtype=float16: jaxdist.loss_scale.LossScale
    outer: Any = None  # DiLoCo: jaxdist.parallel.diloco.OuterState (params and opt_state are then per replica)


# DiLoCo's inner step maps over the replica dimension of everything but the step and the outer state.
_PER_REPLICA = TrainState(step=None, params=0, opt_state=0, residual=0, loss_scale=0, outer=None)


class Trainer:
    """Owns the layout of the train state and the compiled steps for one task and mesh."""

    def __init__(self, task: Task, config: Config, layout: Layout):
        self.task, self.config, self.layout = task, config, layout
        self.microbatches = config.train.microbatches
        abstract_model = nnx.eval_shape(lambda: task.make_model(nnx.Rngs(0)))
        self.graphdef, abstract_params = nnx.split(abstract_model)
        self._abstract_params = abstract_params
        self.tx = make_optimizer(config.train)
        self.schedule = lr_schedule(config.train)
        abstract_opt = jax.eval_shape(self.tx.init, abstract_params)
        self.n_params = sum(math.prod(x.shape) for x in jax.tree.leaves(abstract_params))
        mesh = layout.mesh
        replicated: dict[tuple, str] = {}  # no silent replication: one line per dimension a mesh axis cannot split
        self.param_shardings = tree_shardings(abstract_params, layout.param_rules, mesh, replicated=replicated)
        self.reduce_plan, self._plan_notes = reduce_plan(config, mesh)
        self.dynamic_scale = config.model.dtype == "float16" and config.train.loss_scale == "dynamic"
        abstract_residual = residual_shardings = abstract_scale = scale_shardings = None
        if self.reduce_plan is not None and self.reduce_plan.error_feedback:
            residual_shardings = grad_reduce.per_device_shardings(self.param_shardings, mesh)
            abstract_residual = self._residual_shapes(abstract_params, self.reduce_devices)
        if config.model.dtype == "float16":
            abstract_scale = jax.eval_shape(lambda: loss_scale.initial(config.train.loss_scale))
            scale_shardings = jax.tree.map(lambda _: layout.replicated(), abstract_scale)
        self.state_shardings = TrainState(
            step=layout.replicated(),
            params=self.param_shardings,
            opt_state=tree_shardings(abstract_opt, layout.opt_rules, mesh, replicated=replicated),
            residual=residual_shardings,
            loss_scale=scale_shardings,
        )
        self._abstract = TrainState(jax.ShapeDtypeStruct((), jnp.int32), abstract_params, abstract_opt, abstract_residual, abstract_scale)
        self.inner_steps = config.parallel.diloco_inner_steps  # DiLoCo's H; 0: every step is synchronous
        if self.inner_steps:
            self._per_replica_state(abstract_params, replicated)
        if jax.process_index() == 0:
            for line in (*replicated.values(), *self._reduction_notes()):
                print(line, file=sys.stderr)
        # DiLoCo's metrics stay per replica: averaging them in the step would cross the replica axis every step.
        metric_sharding = NamedSharding(mesh, PartitionSpec(diloco.AXIS)) if self.inner_steps else layout.replicated()
        self.train_step = jax.jit(
            self._diloco_inner_step if self.inner_steps else self._train_step,
            in_shardings=(self.state_shardings, None),
            out_shardings=(self.state_shardings, metric_sharding),
            donate_argnums=0,
        )
        self.eval_step = jax.jit(self._eval_step, in_shardings=(self.param_shardings, None), out_shardings=layout.replicated())
        # Checked before each save: a finite loss does not prove the update it caused was finite.
        self.params_finite = jax.jit(
            lambda params: jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(params)])),
            in_shardings=(self.state_shardings.params,),
        )

    def _per_replica_state(self, abstract_params: Any, replicated: dict) -> None:
        """DiLoCo: params, optimizer state and loss scale gain a leading replica dimension
        (sharded over the replica axis); the outer parameters and momentum are added."""
        mesh, replicas = self.layout.mesh, self.layout.mesh.shape[diloco.AXIS]
        self.outer_tx = diloco.outer_optimizer(self.config.parallel)
        abstract_momentum = jax.eval_shape(self.outer_tx.init, abstract_params)
        per_replica = lambda tree: None if tree is None else diloco.stacked_shapes(tree, replicas)  # noqa: E731
        stacked = lambda tree: None if tree is None else diloco.stacked_shardings(tree, mesh)  # noqa: E731
        a, s = self._abstract, self.state_shardings
        self._abstract = TrainState(
            a.step,
            per_replica(a.params),
            per_replica(a.opt_state),
            None,
            per_replica(a.loss_scale),
            diloco.OuterState(abstract_params, abstract_momentum),
        )
        self.state_shardings = TrainState(
            s.step,
            stacked(s.params),
            stacked(s.opt_state),
            None,
            stacked(s.loss_scale),
            diloco.OuterState(
                self.param_shardings, tree_shardings(abstract_momentum, self.layout.param_rules, mesh, replicated=replicated)
            ),
        )
        self.outer_step = jax.jit(
            self._diloco_outer_step, in_shardings=(self.state_shardings,), out_shardings=self.state_shardings, donate_argnums=0
        )

    # -- state ---------------------------------------------------------------------

    def init_state(self, seed: int, params: Any = None) -> TrainState:
        """A fresh state inside ``jit``, straight into its shardings: parameters initialised
        from ``seed``, or the given ``params`` (``--init-from``) with a fresh optimizer."""

        def init(params) -> TrainState:
            if params is None:
                params = nnx.state(self.task.make_model(nnx.Rngs(params=seed)))
            extras = self._extras()
            if self.inner_steps:  # every replica starts from the same parameters
                replicas = self.layout.mesh.shape[diloco.AXIS]
                outer = diloco.OuterState(params, self.outer_tx.init(params))
                opt_state = diloco.stack(self.tx.init(params), replicas)
                return TrainState(jnp.zeros((), jnp.int32), diloco.stack(params, replicas), opt_state, None, extras.loss_scale, outer)
            return TrainState(jnp.zeros((), jnp.int32), params, self.tx.init(params), extras.residual, extras.loss_scale)

        if params is None:
            return jax.jit(lambda: init(None), out_shardings=self.state_shardings)()
        return jax.jit(init, in_shardings=(self.param_shardings,), out_shardings=self.state_shardings)(params)

    def abstract_params(self) -> Any:
        """The model's parameters as they are outside DiLoCo's replica stacking: shapes,
        dtypes and shardings (what ``--init-from`` reads a checkpoint into)."""
        return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), self._abstract_params, self.param_shardings)

    def _extras(self) -> TrainState:
        """Fresh residuals (zeros) and loss scale (one per replica under DiLoCo), shaped as
        in the state; the rest of the state left empty."""
        residual = scale = None
        if self._abstract.residual is not None:
            residual = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), self._abstract.residual)
        if self._abstract.loss_scale is not None:
            scale = loss_scale.initial(self.config.train.loss_scale)
            if self.inner_steps:
                scale = diloco.stack(scale, self.layout.mesh.shape[diloco.AXIS])
        return TrainState(None, None, None, residual, scale)

    def _loss_scale_target(self) -> Any:
        """The loss scale as a checkpoint stores it (stacked per replica under DiLoCo), for
        reading one whether or not this run uses it."""
        scale = jax.eval_shape(lambda: loss_scale.initial("dynamic"))
        shardings = jax.tree.map(lambda _: self.layout.replicated(), scale)
        if self.inner_steps:
            scale = diloco.stacked_shapes(scale, self.layout.mesh.shape[diloco.AXIS])
            shardings = diloco.stacked_shardings(shardings, self.layout.mesh)
        return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), scale, shardings)

    def init_extras(self) -> TrainState:
        shardings = TrainState(None, None, None, self.state_shardings.residual, self.state_shardings.loss_scale)
        return jax.jit(self._extras, out_shardings=shardings)()

    # -- gradient compression's residuals --------------------------------------------

    @property
    def reduce_devices(self) -> int:
        """How many devices each hold a residual: the batch axes' size."""
        return math.prod(self.layout.mesh.shape[a] for a in grad_reduce.BATCH_AXES)

    @staticmethod
    def _residual_shapes(abstract_params: Any, devices: int) -> Any:
        return jax.tree.map(lambda a: jax.ShapeDtypeStruct((devices, *a.shape), jnp.float32), abstract_params)

    def _reduction_notes(self) -> list[str]:
        plan = self.reduce_plan
        lines = list(self._plan_notes)
        if self.inner_steps and self.microbatches > 1 and self.layout.strategy.zero in ("dp", "zero1"):
            lines.append(
                "jaxdist: DiLoCo with train.microbatches > 1: gradients are reduced inside each replica once per microbatch, "
                "not once per step (the per-device accumulation cannot run under the replica vmap)"
            )
        if plan is None:
            return lines
        if self.layout.strategy.zero == "fsdp":
            lines.append(
                f"jaxdist: parallel.grad_reduce={plan.mode} with fsdp: parameters are gathered once per step and gradients all-reduced "
                "(ZeRO-2-like memory during the step), not FSDP's per-layer gather and reduce-scatter"
            )
        if self.config.parallel.compress_axes == "dcn" and plan.full_axes:
            lines.append(
                f"jaxdist: gradients reduce in float32 over {','.join(plan.full_axes)} (inside hosts) and in {plan.mode} over "
                f"{','.join(plan.compressed_axes) or 'nothing'} (across hosts)"
            )
        return lines

    def restore_target(self, saved_tree: Any) -> Any:
        """The abstract state to restore a checkpoint into: this run's, except that the
        residuals and the loss scale are read as the checkpoint has them (or not at all);
        ``adapt_restored`` then re-spreads, initialises or drops them for this run."""
        target = self.abstract_state()
        if hasattr(saved_tree, "keys"):  # the loss scale is read when saved (adapt_restored keeps or drops it)
            target = dataclasses.replace(target, loss_scale=self._loss_scale_target() if saved_tree.get("loss_scale") else None)
        saved = _saved_residual_devices(saved_tree)
        if saved is None:
            return dataclasses.replace(target, residual=None)
        if target.residual is not None and saved == self.reduce_devices:
            return target
        # Another device count, or a run without compression: read them as saved (kept
        # whole on every device only when the device count changed), then adapt or drop.
        shardings = grad_reduce.per_device_shardings(self.param_shardings, self.layout.mesh)
        if saved != self.reduce_devices:
            shardings = jax.tree.map(lambda s: NamedSharding(self.layout.mesh, PartitionSpec(None, *s.spec[1:])), shardings)
        residual = jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), self._residual_shapes(self._abstract.params, saved), shardings
        )
        return dataclasses.replace(target, residual=residual)

    def adapt_restored(self, state: TrainState, log: Callable[[str], None]) -> TrainState:
        """Residuals saved on another device count: what all devices still owed the model
        (their sum) is kept and spread evenly over this run's devices. Residuals or a loss
        scale the checkpoint does not have start fresh, saying so."""
        wants_residual, wants_scale = self._abstract.residual is not None, self._abstract.loss_scale is not None
        if (state.residual is None and wants_residual) or (state.loss_scale is None and wants_scale):
            fresh = self.init_extras()  # only when the checkpoint lacks them: zeros cost a gradient's memory
        if state.residual is not None and not wants_residual:
            log("jaxdist: warning: the checkpoint's error-feedback residuals are not used by this run (no compression); dropped")
            state = dataclasses.replace(state, residual=None)
        if state.loss_scale is not None and not wants_scale:
            log("jaxdist: the checkpoint's loss scale is not used by this run (not float16)")
            state = dataclasses.replace(state, loss_scale=None)
        if state.residual is None and wants_residual:
            log("jaxdist: the checkpoint has no error-feedback residuals (saved without compression); they start at zero")
            state = dataclasses.replace(state, residual=fresh.residual)
        if state.loss_scale is None and wants_scale:
            start = float(np.max(jax.device_get(fresh.loss_scale.scale)))
            log(f"jaxdist: the checkpoint has no loss scale (saved without float16); it starts at {start:g}")
            state = dataclasses.replace(state, loss_scale=fresh.loss_scale)
        if state.residual is None:
            return state
        saved = jax.tree.leaves(state.residual)[0].shape[0]
        if saved == self.reduce_devices:
            return state
        n = self.reduce_devices
        respread = jax.jit(
            lambda r: jax.tree.map(lambda x: jnp.broadcast_to(jnp.sum(x, 0) / n, (n, *x.shape[1:])), r),
            out_shardings=self.state_shardings.residual,
        )
        log(f"jaxdist: error-feedback residuals were saved on {saved} devices; their sum is spread evenly over this run's {n}")
        return dataclasses.replace(state, residual=respread(state.residual))

    def abstract_state(self) -> TrainState:
        """Shapes, dtypes and shardings of the state, with nothing allocated."""
        return jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
            self._abstract,
            self.state_shardings,
        )

    def abstract_batch(self, global_batch: int) -> dict[str, jax.ShapeDtypeStruct]:
        """Shapes and shardings of one global batch (for compiling without data)."""
        return {
            k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=self.layout.batch_sharding(len(v.shape)))
            for k, v in self.task.batch_spec(global_batch).items()
        }

    # -- steps ---------------------------------------------------------------------

    def _loss(self, params: Any, batch: Batch) -> tuple[jax.Array, jax.Array]:
        return self.task.loss_fn(nnx.merge(self.graphdef, params), batch)

    def _grad_fn(self, scale: jax.Array | None = None) -> Callable:
        """``(params, batch) -> ((loss sum, weight), gradients of the loss sum x scale)``."""
        if scale is None:
            return jax.value_and_grad(self._loss, has_aux=True)

        def objective(params, batch):
            with loss_cotangent(scale):  # 1F1B runs its backward inside the forward: it needs the scale now
                loss_sum, weight = self._loss(params, batch)
            return loss_sum * scale, (loss_sum, weight)

        grad_fn = jax.value_and_grad(objective, has_aux=True)

        def scaled(params, batch):
            (_, aux), grads = grad_fn(params, batch)
            return aux, grads

        return scaled

    def _split_microbatches(self, x: jax.Array) -> jax.Array:
        """[B, ...] -> [M, B/M, ...] taking every M-th row, so each device keeps its rows."""
        x = split_microbatches(x, self.microbatches)
        spec = PartitionSpec(None, ("data", "fsdp"), *([None] * (x.ndim - 2)))
        return jax.lax.with_sharding_constraint(x, NamedSharding(self.layout.mesh, spec))

    def _summed_grads(self, params: Any, batch: Batch, scale: jax.Array | None = None) -> tuple[jax.Array, jax.Array, Any]:
        """Sum of losses, their weight, and gradients of the sum (x ``scale``), accumulated over microbatches."""
        grad_fn = self._grad_fn(scale)
        if self.microbatches == 1:
            (loss_sum, weight), grads = grad_fn(params, batch)
            return loss_sum, weight, grads
        if self._accumulate_locally:
            return self._summed_grads_reduced_once(params, batch, grad_fn)

        def accumulate(carry, microbatch):
            loss_acc, weight_acc, grad_acc = carry
            (loss_sum, weight), grads = grad_fn(params, microbatch)
            return (loss_acc + loss_sum, weight_acc + weight, jax.tree.map(jnp.add, grad_acc, grads)), None

        zeros = jax.lax.with_sharding_constraint(jax.tree.map(jnp.zeros_like, params), self.param_shardings)
        init = (jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32), zeros)
        (loss_sum, weight, grads), _ = jax.lax.scan(accumulate, init, jax.tree.map(self._split_microbatches, batch))
        return loss_sum, weight, grads

    def _reduced_grads(self, params: Any, batch: Batch, residual: Any, scale: jax.Array | None) -> tuple[jax.Array, jax.Array, Any, Any]:
        """(loss sum, weight, summed gradients, new residuals): GSPMD's fp32 reduction, or
        per-device gradients reduced by ``parallel.grad_reduce``."""
        if self.reduce_plan is None:
            return (*self._summed_grads(params, batch, scale), residual)
        microbatched = self.microbatches > 1
        rows = jax.tree.map(self._split_microbatches, batch) if microbatched else batch
        loss_sum, weight, local = grad_reduce.per_device_gradients(self._grad_fn(scale), params, rows, self.layout.mesh, microbatched)
        # Residuals are kept unscaled (gradient units of the loss sum): under fp16 the scale
        # moves between steps, and a residual carried in the old scale's units would count
        # twice after an overflow halves it (half after growth).
        if scale is not None and residual is not None:
            residual = jax.tree.map(lambda r: r * scale, residual)
        grads, residual = grad_reduce.reduce_gradients(local, residual, self.reduce_plan, self.param_shardings, self.layout.mesh)
        if scale is not None and residual is not None:
            residual = jax.tree.map(lambda r: r / scale, residual)
        return loss_sum, weight, grads, residual

    def loss_and_grads(self, params: Any, batch: Batch, loss_scale: float | None = None) -> tuple[jax.Array, Any]:
        """Mean loss and its gradients (what one train step would apply, with zero
        residuals), for checks. ``loss_scale``: take them of the mean loss x that scale
        (fp16 loss scaling; the gradients are returned unscaled)."""
        scale = None if loss_scale is None else jnp.asarray(loss_scale, jnp.float32) / self._targets_per_step
        with activation_layout(self.layout):
            loss_sum, weight, grads, _ = self._reduced_grads(params, batch, self._extras().residual, scale)
        divisor = weight if scale is None else weight * scale
        return loss_sum / weight, jax.tree.map(lambda g: g / divisor.astype(g.dtype), grads)

    @property
    def _accumulate_locally(self) -> bool:
        """Replicated parameters (DP, ZeRO-1), no pipeline: accumulate each device's own
        gradients and reduce across the batch axes once per step, like DDP's no_sync."""
        # (Not under DiLoCo's vmap: the shard_map over data/fsdp cannot take the replica dimension.
        # Not without a batch axis either: nothing to reduce, and XLA 0.10's partitioner rejects
        # the auto tensor axis's collectives inside a region manual over size-1 axes only.)
        mesh = self.layout.mesh.shape
        batch_shards = mesh.get("data", 1) * mesh.get("fsdp", 1)
        return self.layout.strategy.zero in ("dp", "zero1") and mesh.get("pipe", 1) == 1 and not self.inner_steps and batch_shards > 1

    def _summed_grads_reduced_once(self, params: Any, batch: Batch, grad_fn: Callable) -> tuple[jax.Array, jax.Array, Any]:
        batch_axes = ("data", "fsdp")

        def per_device(params, microbatches):
            def accumulate(carry, microbatch):
                (loss_sum, weight), grads = grad_fn(params, microbatch)
                return jax.tree.map(jnp.add, carry, (loss_sum, weight, grads)), None

            zeros = (jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, params))
            sums, _ = jax.lax.scan(accumulate, zeros, microbatches)
            return jax.lax.psum(sums, batch_axes)

        rows = PartitionSpec(None, batch_axes)
        reduce_once = jax.shard_map(
            per_device,
            mesh=self.layout.mesh,
            in_specs=(PartitionSpec(), rows),
            out_specs=PartitionSpec(),
            axis_names=set(batch_axes),
            check_vma=False,
        )
        return reduce_once(params, jax.tree.map(self._split_microbatches, batch))

    def _train_step(self, state: TrainState, batch: Batch) -> tuple[TrainState, dict[str, jax.Array]]:
        # fp16: scale the objective to the mean loss x scale (GradScaler's convention), whatever the batch
        scale = None if state.loss_scale is None else state.loss_scale.scale / self._targets_per_step
        with activation_layout(self.layout):
            loss_sum, weight, grads, residual = self._reduced_grads(state.params, batch, state.residual, scale)
        divisor = weight if scale is None else weight * scale
        grads = jax.tree.map(lambda g: g / divisor.astype(g.dtype), grads)
        updates, opt_state = self.tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        loss, grad_norm = loss_sum / weight, optax.tree.norm(grads)
        # The rate this update used: the optimizer's own step count, which skipped steps do not advance.
        metrics = {"loss": loss, "grad_norm": grad_norm, "lr": self.schedule(optimizer_step(state.opt_state))}
        new_scale = state.loss_scale
        if state.loss_scale is not None:
            metrics["loss_scale"] = state.loss_scale.scale
            new_scale = loss_scale.update(state.loss_scale, jnp.isfinite(grad_norm), self.dynamic_scale)
        if self.config.train.nonfinite == "skip" or state.loss_scale is not None:  # drop a non-finite update; the step still counts
            finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
            keep = lambda new, old: jnp.where(finite, new, old)  # noqa: E731
            params, opt_state, residual = (
                jax.tree.map(keep, *pair) for pair in ((params, state.params), (opt_state, state.opt_state), (residual, state.residual))
            )
            metrics["skipped"] = ~finite
        return TrainState(state.step + 1, params, opt_state, residual, new_scale), metrics

    @property
    def _targets_per_step(self) -> float:
        return float(self.task.tokens_per_example * self.config.train.global_batch)

    # -- DiLoCo ----------------------------------------------------------------------

    def _diloco_inner_step(self, state: TrainState, batch: Batch) -> tuple[TrainState, dict[str, jax.Array]]:
        """Every replica takes one ordinary step on its slice of the batch; nothing crosses
        the replica axis (vmap with ``spmd_axis_name`` keeps each replica on its devices)."""
        replicas = self.layout.mesh.shape[diloco.AXIS]
        rows = diloco.split_batch(batch, replicas, self.layout.mesh)
        inner = dataclasses.replace(state, outer=None)
        step = jax.vmap(self._train_step, in_axes=(_PER_REPLICA, 0), out_axes=(_PER_REPLICA, 0), spmd_axis_name=diloco.AXIS)
        new, metrics = step(inner, rows)
        return dataclasses.replace(new, outer=state.outer), metrics

    def _diloco_outer_step(self, state: TrainState) -> TrainState:
        params, outer, _ = diloco.outer_update(
            state.params, state.outer, self.outer_tx, self.config.parallel, self.param_shardings, self.layout.mesh
        )
        return dataclasses.replace(state, params=params, outer=outer)

    def fetch_metrics(self, pending: list[dict[str, jax.Array]]) -> list[dict[str, Any]]:
        """The metrics of the steps since the last log point, on the host. DiLoCo's are per
        replica: gathered here (at log points only) and averaged."""
        if not self.inner_steps:
            return jax.device_get(pending)
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            pending = multihost_utils.process_allgather(pending, tiled=True)
        return [diloco.average_metrics(m) for m in jax.device_get(pending)]

    def synchronized_params(self, state: TrainState) -> Any:
        """The parameters of the model being trained: DiLoCo's outer ones, else the params."""
        return state.outer.params if self.inner_steps else state.params

    def compile_step(self, state: TrainState, batch: Batch, logger=None) -> Callable:
        """The step the loop calls: the compiled train step, plus (DiLoCo) the outer step
        after every H-th, plus the simulated replica link's delay when one is set."""
        compiled = self.train_step.lower(state, batch).compile()
        mesh, parallel = self.layout.mesh, self.config.parallel
        link = diloco.SlowLink.from_config(parallel, diloco.AXIS if self.inner_steps else "data")
        say = (logger.message if logger is not None else print) if jax.process_index() == 0 else (lambda _: None)
        if not self.inner_steps:
            if link is None:
                return compiled
            delay, count, sent = link.delay_s(compiled, mesh)
            say(
                f"jaxdist: simulated link on the data axis: {count} collectives, {sent / 2**20:.2f} MiB per device per step -> +{delay * 1e3:.1f} ms per step"
            )
            return diloco.LinkedStep(compiled, delay)
        outer = self.outer_step.lower(state).compile()
        delay = 0.0
        if link is not None:
            delay, count, sent = link.delay_s(outer, mesh)
            say(
                f"jaxdist: simulated replica link: {count} collectives, {sent / 2**20:.2f} MiB per device per outer step -> +{delay * 1e3:.1f} ms every {self.inner_steps} steps"
            )
        return diloco.DiLoCoStep(compiled, outer, self.inner_steps, int(jax.device_get(state.step)), delay)

    def _eval_step(self, params: Any, batch: Batch) -> jax.Array:
        with activation_layout(self.layout):
            loss_sum, weight = self._loss(params, batch)
        return jnp.stack([loss_sum, weight])


def reduce_plan(config: Config, mesh) -> tuple[grad_reduce.ReducePlan | None, list[str]]:
    """The compressed gradient reduction ``parallel.grad_reduce`` asks for (None: GSPMD's
    fp32), and the lines to say when it reduces less than asked."""
    p = config.parallel
    if p.grad_reduce == "float32":
        return None, []
    hosts = _hosts_along_axes(mesh) if jax.process_count() > 1 else None
    try:
        plan = grad_reduce.plan_reduction(p, dict(mesh.shape), hosts)
    except ValueError as e:
        from jaxdist.errors import MeshError

        raise MeshError(str(e)) from None
    if p.compress_axes == "dcn" and not plan.compressed_axes:
        where = "one process" if hosts is None else "no batch axis crosses processes"
        return None, [
            f"jaxdist: parallel.compress_axes=dcn on {where}: no gradient crosses hosts, so nothing is compressed "
            f"(parallel.grad_reduce={p.grad_reduce} has no effect); gradients reduce in float32"
        ]
    return plan, []


def _hosts_along_axes(mesh) -> dict[str, int]:
    """For each mesh axis, how many processes the devices along it belong to."""
    devices = mesh.devices
    out = {}
    for i, axis in enumerate(mesh.axis_names):
        line = devices[tuple(slice(None) if j == i else 0 for j in range(devices.ndim))]
        out[axis] = len({d.process_index for d in line})
    return out


def _saved_residual_devices(saved_tree: Any) -> int | None:
    """The leading (device) dimension of a checkpoint's residuals, if it has any."""
    residual = saved_tree.get("residual") if hasattr(saved_tree, "get") else None  # Orbax's tree metadata is dict-like
    shapes = [getattr(x, "shape", None) for x in jax.tree.leaves(residual)] if residual else []
    shapes = [s for s in shapes if s]
    return shapes[0][0] if shapes else None


def optimizer_step(opt_state: Any) -> jax.Array:
    """The update count the optimizer's schedule reads (optax keeps it in its states)."""
    counts = optax.tree_utils.tree_get_all_with_path(opt_state, "count")
    return counts[-1][1] if counts else jnp.zeros((), jnp.int32)


@dataclasses.dataclass
class LoopResult:
    state: TrainState
    losses: list[float]
    eval_losses: dict[int, float]
    skipped_steps: int = 0


@dataclasses.dataclass
class LoopHooks:
    """What the loop may do besides training: evaluate, checkpoint, notice preemption."""

    eval_batches: Callable[[], Iterator[Batch]] | None = None
    checkpointer: Any = None  # jaxdist.checkpoint.Checkpointer
    data_state: Callable[[], dict] | None = None  # the data iterator's state after the last batch taken
    config_dict: dict | None = None
    preemption: Any = None  # jaxdist.preemption.PreemptionWatcher
    tracer: StepTracer = dataclasses.field(default_factory=StepTracer)  # --profile-steps


def train_loop(
    trainer: Trainer,
    state: TrainState,
    batches: Iterator[Batch],
    *,
    steps: int,
    logger: MetricsLogger,
    flops_per_step: float,
    peak_flops: float,
    tokens_per_step: int,
    step_fn: Callable | None = None,
    hooks: LoopHooks | None = None,
) -> LoopResult:
    """Train until step ``steps`` (the state may start later, when resumed).

    Metrics are fetched only at log points, so the host keeps dispatching ahead of the
    devices in between; eval, checkpoint and preemption steps are log points too, so
    a non-finite loss is always caught before a state is saved.
    """
    from jaxdist.preemption import Preempted

    cfg, hooks = trainer.config.train, hooks or LoopHooks()
    step_fn = step_fn or trainer.train_step
    checkpointer, tracer = hooks.checkpointer, hooks.tracer
    n_devices = trainer.layout.mesh.size
    start_step = int(jax.device_get(state.step))
    end = min(steps, cfg.stop_after_step or steps)  # train.stop_after_step: a planned interruption, saved like the end
    result = LoopResult(state, [], {})
    pending: list[dict[str, jax.Array]] = []
    window_start, data_wait = time.perf_counter(), 0.0
    skips_in_a_row = 0
    from jaxdist.heartbeat import beat  # progress for jaxdist.launch --hang-timeout (a no-op outside it)

    for step in range(start_step + 1, end + 1):
        beat(step)
        with tracer.step(step):
            with tracer.phase("data"):
                wait_start = time.perf_counter()
                batch = next(batches)
                waited = time.perf_counter() - wait_start
            data_wait += waited
            tracer.data_waited(step, waited)
            with tracer.phase("dispatch"):
                state, metrics = step_fn(state, batch)
            pending.append(metrics)

            last = step == end
            eval_now = hooks.eval_batches is not None and cfg.eval_every > 0 and step % cfg.eval_every == 0
            preempt = hooks.preemption is not None and hooks.preemption.requested(step)
            save_now = checkpointer is not None and (last or preempt or checkpointer.due(step))
            if step % cfg.log_every == 0 or last or eval_now or save_now:
                # Log point: wait for the devices, check and write this window's metrics.
                with tracer.phase("log"):
                    fetched = trainer.fetch_metrics(pending)
                    pending.clear()
                    step_time = (time.perf_counter() - window_start) / len(fetched)
                    for offset, m in enumerate(fetched):
                        skips_in_a_row = _check_step(m, step - len(fetched) + 1 + offset, skips_in_a_row, cfg, result, checkpointer)
                    record = {
                        "loss": float(fetched[-1]["loss"]),
                        "grad_norm": float(fetched[-1]["grad_norm"]),
                        "lr": float(fetched[-1]["lr"]),
                        "tokens_per_sec": tokens_per_step / step_time,
                        "step_time_s": step_time,
                        "data_wait_s": data_wait / len(fetched),
                        "mfu": flops_per_step / (step_time * n_devices * peak_flops),
                    }
                    if "loss_scale" in fetched[-1]:
                        record["loss_scale"] = float(fetched[-1]["loss_scale"])
                    if "skipped" in fetched[-1]:
                        record["skipped_steps"] = result.skipped_steps
                    logger.log(step, record)
                    logger.advance(len(fetched))
                eval_metrics = None
                if eval_now:
                    with tracer.phase("eval"):
                        result.eval_losses[step] = evaluate(trainer, state, hooks.eval_batches())
                    eval_metrics = {"eval_loss": result.eval_losses[step]}
                    logger.log(step, eval_metrics)
                if save_now:
                    with tracer.phase("checkpoint"):
                        if not bool(trainer.params_finite(state.params)):
                            raise NonFiniteLoss(f"parameters became non-finite at step {step}; not saving them{_last_saved(checkpointer)}")
                        checkpointer.save(step, state, hooks.data_state(), hooks.config_dict, metrics=eval_metrics)
                if preempt:
                    if checkpointer is None:  # library use without a run directory: nothing to save
                        raise Preempted(step, hooks.preemption.reason, saved=False)
                    checkpointer.wait()
                    raise Preempted(step, hooks.preemption.reason)
                window_start, data_wait = time.perf_counter(), 0.0
        tracer.after_step(step, state)
    result.state = state
    return result


def _check_step(metrics: dict, step: int, skips_in_a_row: int, cfg, result: LoopResult, checkpointer) -> int:
    """Record one step's loss; stop on a non-finite loss (or too many skipped steps in a
    row). Returns the new count of skipped steps in a row."""
    loss = float(metrics["loss"])
    if not math.isfinite(loss) and "skipped" not in metrics:
        raise NonFiniteLoss(
            f"loss is {loss} at step {step}; stopping (lower train.lr, check the data, or train.nonfinite=skip){_last_saved(checkpointer)}"
        )
    skipped = bool(metrics.get("skipped", False))
    result.skipped_steps += skipped
    skips_in_a_row = skips_in_a_row + 1 if skipped else 0
    if skips_in_a_row > cfg.max_skips:
        raise NonFiniteLoss(
            f"{skips_in_a_row} non-finite steps in a row up to step {step} (train.max_skips={cfg.max_skips}); stopping{_last_saved(checkpointer)}"
        )
    result.losses.append(loss)
    return skips_in_a_row


def _last_saved(checkpointer) -> str:
    step = checkpointer.last_saved_step if checkpointer is not None else None
    return f"; last checkpoint: step {step}" if step else ""


def evaluate(trainer: Trainer, state: TrainState, batches: Iterator[Batch]) -> float:
    params = trainer.synchronized_params(state)
    totals = sum(np.asarray(jax.device_get(trainer.eval_step(params, b)), np.float64) for b in batches)
    return float(totals[0] / totals[1])
