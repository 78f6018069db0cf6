"""The Trainer: for one task, config and layout it assembles the train step from its
parts and compiles it; it also initialises, restores and evaluates the state.

The step is ``update(reduction(grad_fn(loss)))``:

- the loss: the task's ``loss_fn`` on the merged model (``jaxdist.models``; a pipeline
  schedule is applied to it from outside, ``jaxdist.parallel.parallelize``);
- its gradients and their reduction over the batch axes, microbatches accumulated
  (``gradients``: XLA's reduction or a compressed codec);
- the update (``update``: optax, fp16's loss scale, dropping a non-finite update);
- wrapped for DiLoCo and the simulated slow link (``wrappers``).

A new axis or number format adds a part or a rule there, not a branch here.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxdist.config import Config
from jaxdist.inspect.gpu_program import kernel_counts
from jaxdist.layout.sharding import Layout, activation_layout
from jaxdist.models import Batch, Task, fp8
from jaxdist.models.moe import REGULARIZER
from jaxdist.parallel import diloco
from jaxdist.training import gradients, migrate, wrappers
from jaxdist.training.optim import lr_schedule, make_optimizer
from jaxdist.training.state import StateLayout, TrainState
from jaxdist.training.update import Update


class Trainer:
    """Owns the layout of the train state and the compiled steps for one task and mesh."""

    def __init__(self, task: Task, config: Config, layout: Layout):
        self.task, self.config, self.layout = task, config, layout
        self.microbatches = config.train.microbatches
        self.inner_steps = config.parallel.diloco_inner_steps  # DiLoCo's H; 0: every step is synchronous
        self.graphdef, abstract_params = nnx.split(nnx.eval_shape(lambda: task.make_model(nnx.Rngs(0))))
        self.n_params = sum(math.prod(x.shape) for x in jax.tree.leaves(fp8.without_histories(abstract_params)))
        self.tx, self.schedule = make_optimizer(config.train, fp8.has_history(abstract_params)), lr_schedule(config.train)
        self.outer_tx = diloco.outer_optimizer(config.parallel) if self.inner_steps else None
        self.reduce_plan, plan_notes = gradients.reduce_plan(config, layout.mesh)
        float16 = config.train.loss_scale if config.model.dtype == "float16" else None
        error_feedback = self.reduce_plan is not None and self.reduce_plan.error_feedback
        self.state_layout = StateLayout(
            abstract_params, self.tx, layout, error_feedback=error_feedback, float16=float16, outer_tx=self.outer_tx
        )
        self.param_shardings, self.state_shardings = self.state_layout.param_shardings, self.state_layout.shardings
        self.reduction = gradients.reduction_for(config, layout, self.param_shardings, self.reduce_plan, bool(self.inner_steps))
        self.update = Update(
            self.tx, self.schedule, float16 == "dynamic", config.train.nonfinite == "skip", task.metrics_from, task.after_update
        )
        if jax.process_index() == 0:
            notes = gradients.reduction_notes(config, layout, self.reduce_plan, bool(self.inner_steps))
            for line in (*self.state_layout.replicated.values(), *plan_notes, *notes):
                print(line, file=sys.stderr)
        step = wrappers.per_replica(self._train_step, layout.mesh) if self.inner_steps else self._train_step
        self.train_step = jax.jit(
            step,
            in_shardings=(self.state_shardings, None),
            out_shardings=(self.state_shardings, self.state_layout.metric_sharding()),
            donate_argnums=0,
        )
        if self.inner_steps:
            outer = wrappers.outer_step(self.outer_tx, config.parallel, self.param_shardings, layout.mesh)
            self.outer_step = jax.jit(outer, in_shardings=(self.state_shardings,), out_shardings=self.state_shardings, donate_argnums=0)
        self.eval_step = jax.jit(self._eval_step, in_shardings=(self.param_shardings, None), out_shardings=layout.replicated())
        # Checked before each save: a finite loss does not prove the update it caused was finite.
        self.params_finite = jax.jit(
            lambda params: jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(params)])),
            in_shardings=(self.state_shardings.params,),
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
                replicas = self.state_layout.replicas
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
        return self.state_layout.with_shardings(self.state_layout.abstract_params, self.param_shardings)

    def abstract_state(self) -> TrainState:
        """Shapes, dtypes and shardings of the state, with nothing allocated."""
        return self.state_layout.abstract_state()

    def abstract_batch(self, global_batch: int) -> dict[str, jax.ShapeDtypeStruct]:
        """Shapes and shardings of one global batch (for compiling without data)."""
        return {
            k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=self.layout.batch_sharding(len(v.shape)))
            for k, v in self.task.batch_spec(global_batch).items()
        }

    def _extras(self) -> TrainState:
        return self.state_layout.fresh_extras(self.config.train.loss_scale)

    def init_extras(self) -> TrainState:
        """Fresh residuals and loss scale, in their shardings."""
        shardings = TrainState(None, None, None, self.state_shardings.residual, self.state_shardings.loss_scale)
        return jax.jit(self._extras, out_shardings=shardings)()

    def restore_target(self, saved_tree: Any) -> TrainState:
        """The abstract state a checkpoint is read into (``migrate.restore_target``)."""
        return migrate.restore_target(self.state_layout, saved_tree)

    def adapt_restored(self, state: TrainState, log: Callable[[str], None]) -> TrainState:
        """A restored state made this run's (``migrate.adapt_restored``)."""
        return migrate.adapt_restored(self.state_layout, state, self.init_extras, log)

    # -- steps ---------------------------------------------------------------------

    def _loss(self, params: Any, batch: Batch) -> tuple[jax.Array, jax.Array, dict[str, jax.Array]]:
        return self.task.loss_fn(nnx.merge(self.graphdef, params), batch)

    @property
    def _targets_per_step(self) -> float:
        return float(self.task.tokens_per_example * self.config.train.global_batch)

    def _train_step(self, state: TrainState, batch: Batch) -> tuple[TrainState, dict[str, jax.Array]]:
        # fp16: scale the objective to the mean loss x scale (GradScaler's convention), whatever the batch
        scale = None if state.loss_scale is None else state.loss_scale.scale / self._targets_per_step
        with activation_layout(self.layout):
            loss_sum, weight, stats, grads, residual = self.reduction(
                gradients.grad_fn(self._loss, scale), state.params, batch, state.residual, scale
            )
        return self.update(state, loss_sum, weight, stats, grads, residual, scale)

    def loss_and_grads(self, params: Any, batch: Batch, loss_scale: float | None = None) -> tuple[jax.Array, Any]:
        """Mean loss and its gradients (what one train step would apply, with zero
        residuals), for checks. ``loss_scale``: take them of the mean loss x that scale
        (fp16 loss scaling; the gradients are returned unscaled)."""
        scale = None if loss_scale is None else jnp.asarray(loss_scale, jnp.float32) / self._targets_per_step
        with activation_layout(self.layout):
            loss_sum, weight, _, grads, _ = self.reduction(
                gradients.grad_fn(self._loss, scale), params, batch, self._extras().residual, scale
            )
        divisor = weight if scale is None else weight * scale
        return loss_sum / weight, fp8.map_gradients(lambda g: g / divisor.astype(g.dtype), grads)

    def _eval_step(self, params: Any, batch: Batch) -> jax.Array:
        with activation_layout(self.layout):
            loss_sum, weight, stats = self._loss(params, batch)
        # the data's loss only: MoE's balancing terms are in the training objective, not in eval_loss
        loss_sum = loss_sum - stats.get(REGULARIZER, 0.0)
        return jnp.stack([loss_sum, weight])

    def compile_step(self, state: TrainState, batch: Batch, logger=None) -> Callable:
        """The step the loop calls (``wrappers.host_step``), compiled for ``state``."""
        compiled = self.train_step.lower(state, batch).compile()
        outer = self.outer_step.lower(state).compile() if self.inner_steps else None
        say = (logger.message if logger is not None else print) if jax.process_index() == 0 else (lambda _: None)
        if self.config.model.fp8 != "off" and self.layout.mesh.devices.flat[0].platform == "gpu":
            gemms = kernel_counts(compiled.as_text())["gemm_fp8"]  # XLA falls back to f16 silently: count what it made
            note = fp8.fp8_gemm_note(self.config.model, gemms, self.microbatches)
            if note:
                say(note)
        return wrappers.host_step(self.config, self.layout.mesh, compiled, outer, int(jax.device_get(state.step)), say)

    # -- results ---------------------------------------------------------------------

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
