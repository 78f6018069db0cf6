"""One training step, top to bottom, and the Trainer that compiles it.

    loss -> gradients (microbatches) -> reduction -> update

- **loss**: the task's loss on the merged model, traced under one ``StepContext``
  (``layout.step_context``: the activation layout, context and expert parallelism's kernels,
  fp16's loss scale), installed here once per step. A pipeline schedule is the task's loss
  itself (``parallel.parallelize`` applied it from outside, as it set the kernels).
- **gradients**: of the loss sum x fp16's scale; with ``train.microbatches`` one scan adds
  the microbatches' (``parallel.microbatch.accumulate``).
- **reduction**: how gradients cross devices: GSPMD's own (the default: XLA places the
  all-reduce or FSDP's reduce-scatter), a per-device accumulation reduced once (replicated
  parameters), or a compressed codec (``parallel.grad_reduce.CompressedReduction``).
- **update**: optax (clipping, AdamW or SGD, the schedule), fp16's loss scale, a non-finite
  update dropped, fp8's amax histories written, MoE's router bias moved. With
  ``train.optimizer_offload`` the optimizer state comes from host memory for the update
  once the gradients exist and goes back (``training.state.StateLayout.opt_on_device``).

What wraps a whole step comes from outside too: DiLoCo's per-replica step and outer sync
(``parallel.diloco.Replicas``) and the simulated slow link (``parallel.slow_link``). No
feature adds a branch to ``train_step``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import PartitionSpec

from jaxdist.cluster.recoverable import in_process_recovery
from jaxdist.config import Config
from jaxdist.inspect.gpu_program import collective_schedule, kernel_counts
from jaxdist.layout.mesh import INNER_BATCH_AXES
from jaxdist.layout.sharding import Layout
from jaxdist.layout.step_context import StepContext, installed
from jaxdist.models import Batch, Task, fp8
from jaxdist.models.moe import REGULARIZER
from jaxdist.parallel import diloco, grad_reduce, slow_link
from jaxdist.parallel.microbatch import accumulate, split_for_accumulation
from jaxdist.plan.latency_profile import compile_on_devices
from jaxdist.training import loss_scale, migrate
from jaxdist.training.optim import lr_schedule, make_optimizer
from jaxdist.training.state import PER_REPLICA, StateLayout, TrainState, optimizer_step

log = logging.getLogger(__name__)

GradFn = Callable[[Any, Any], tuple[tuple[jax.Array, jax.Array, Any], Any]]  # (params, batch) -> ((loss sum, weight, stats), grads)


# -- gradients ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class grad_fn:  # noqa: N801 - used as the function it stands for
    """``(params, batch) -> ((loss sum, weight, stats), gradients of the loss sum x scale)``;
    ``before_loop(params)``: a context that a microbatch loop is traced in, holding what is
    computed once per step outside it (``parallel.microbatch.accumulate``)."""

    loss: Callable
    scale: jax.Array | None = None
    before_loop: Callable[[Any], contextlib.AbstractContextManager] = lambda params: contextlib.nullcontext()

    def __call__(self, params, batch):
        (_, aux), grads = jax.value_and_grad(self._objective, has_aux=True)(params, batch)
        return aux, grads

    def _objective(self, params, batch):
        loss_sum, weight, stats = self.loss(params, batch)
        return loss_sum if self.scale is None else loss_sum * self.scale, (loss_sum, weight, stats)


# -- reduction: (grad_fn, params, batch, residual, scale) -> (loss sum, weight, stats, grads, residual)


class XlaReduction:
    """GSPMD's fp32 reduction; ``reduce_once``: each device accumulates its own gradients over
    the microbatches and they are reduced once per step (replicated parameters, as DDP's no_sync)."""

    def __init__(self, microbatches: int, mesh, param_shardings: Any, reduce_once: bool):
        self.microbatches, self.mesh, self.param_shardings, self.reduce_once = microbatches, mesh, param_shardings, reduce_once

    def __call__(self, grad_fn: GradFn, params: Any, batch: Any, residual: Any, scale: jax.Array | None):
        if self.microbatches == 1:
            (loss_sum, weight, stats), grads = grad_fn(params, batch)
            return loss_sum, weight, stats, grads, residual
        microbatches = split_for_accumulation(batch, self.microbatches, self.mesh)
        if self.reduce_once:
            return (*self._reduced_once(grad_fn, params, microbatches), residual)
        zeros = jax.lax.with_sharding_constraint(jax.tree.map(jnp.zeros_like, params), self.param_shardings)
        return (*accumulate(grad_fn, params, microbatches, zeros), residual)

    def _reduced_once(self, grad_fn: GradFn, params: Any, microbatches: Any):
        def per_device(params, microbatches):
            return fp8.reduce_over(accumulate(grad_fn, params, microbatches), INNER_BATCH_AXES)  # psum; fp8 observations: pmax

        reduce_once = jax.shard_map(
            per_device,
            mesh=self.mesh,
            in_specs=(PartitionSpec(), PartitionSpec(None, INNER_BATCH_AXES)),
            out_specs=PartitionSpec(),  # loss sum, weight, statistics (sums over the batch) and gradients, reduced
            axis_names=set(INNER_BATCH_AXES),
            check_vma=False,
        )
        return reduce_once(params, microbatches)


def choose_reduction(config: Config, layout: Layout, param_shardings: Any, plan: grad_reduce.ReducePlan | None, replicas: int):
    """The reduction a config asks for on this layout: the compressed codec, else XLA's, reduced
    once per step where parameters are replicated. (Not under DiLoCo's vmap: the shard_map over
    data/fsdp cannot take the replica dimension; not without a batch axis: nothing to reduce,
    and XLA 0.10's partitioner rejects the auto tensor axis's collectives in a region manual
    over size-1 axes only; not for MoE: its router statistics and dispatch are global; not with a
    context axis: its attention is a shard_map over the whole mesh, which cannot run inside one
    manual over the batch axes: ``grad_reduce.not_once_per_step``, said in one line by
    ``grad_reduce.say_what_reduces``.)"""
    mesh, microbatches = layout.mesh, config.train.microbatches
    if plan is not None:
        return grad_reduce.CompressedReduction(plan, microbatches, mesh, param_shardings)
    batch_shards = math.prod(mesh.shape.get(a, 1) for a in INNER_BATCH_AXES)
    replicated = layout.strategy.zero in ("dp", "zero1")
    reduce_once = replicated and batch_shards > 1 and not grad_reduce.not_once_per_step(config, mesh.shape, replicas)
    return XlaReduction(microbatches, mesh, param_shardings, reduce_once)


# -- update --------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Update:
    """Gradients of the summed loss -> the mean loss's -> optax -> new parameters; fp16's loss
    scale moves with whether the gradients were finite, and a non-finite update is dropped
    (the step still counts) under ``train.nonfinite=skip`` or fp16. fp8's amax histories take
    their observed values (their "gradients") over the old ones, outside the optimizer."""

    tx: optax.GradientTransformation
    schedule: Callable[[jax.Array], jax.Array]  # the learning rate at an optimizer step count
    dynamic_scale: bool  # fp16 with train.loss_scale=dynamic
    skip_nonfinite: bool  # train.nonfinite=skip
    # the model's statistics (sums over the batch) -> its metrics (MoE balancing); and what moves
    # after the optimizer from them (aux-loss-free balancing's router bias)
    metrics_from: Callable[[dict[str, jax.Array], jax.Array], dict[str, jax.Array]] | None = None
    after_update: Callable[[Any, dict[str, jax.Array]], Any] | None = None
    opt_on_device: Callable[[Any, Any], Any] = lambda opt_state, grads: opt_state  # train.optimizer_offload: host -> device

    def __call__(self, state: TrainState, loss_sum, weight, stats, grads, residual, scale) -> tuple[TrainState, dict[str, jax.Array]]:
        divisor = weight if scale is None else weight * scale
        grads = fp8.map_gradients(lambda g: g / divisor.astype(g.dtype), grads)  # fp8 observations are values, not sums
        old_opt_state = self.opt_on_device(state.opt_state, grads)
        updates, opt_state = self.tx.update(grads, old_opt_state, state.params)
        params = fp8.overwrite_histories(optax.apply_updates(state.params, updates), grads)
        if self.after_update is not None:
            params = self.after_update(params, stats)
        loss, grad_norm = loss_sum / weight, optax.tree.norm(fp8.without_histories(grads))
        # The rate this update used: the optimizer's own step count, which skipped steps do not advance.
        metrics = {"loss": loss, "grad_norm": grad_norm, "lr": self.schedule(optimizer_step(old_opt_state))}
        if self.metrics_from is not None:
            metrics.update(self.metrics_from(stats, weight))
        new_scale = state.loss_scale
        if state.loss_scale is not None:
            metrics["loss_scale"] = state.loss_scale.scale
            new_scale = loss_scale.update(state.loss_scale, jnp.isfinite(grad_norm), self.dynamic_scale)
        if self.skip_nonfinite or state.loss_scale is not None:  # drop a non-finite update; the step still counts
            finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
            keep = lambda new, old: jnp.where(finite, new, old)  # noqa: E731
            params, opt_state, residual = (
                jax.tree.map(keep, *pair) for pair in ((params, state.params), (opt_state, old_opt_state), (residual, state.residual))
            )
            metrics["skipped"] = ~finite
        return dataclasses.replace(
            state, step=state.step + 1, params=params, opt_state=opt_state, residual=residual, loss_scale=new_scale
        ), metrics


# a weaker path, said in one line: the state moves, but to the memory it was already in
OFFLOAD_SAVES_NOTHING = (
    "train.optimizer_offload: {platform} devices have no memory apart from the host's, so the optimizer state "
    "kept in pinned host memory saves no device memory here (the same values, one more copy per step)"
)


# -- the Trainer -----------------------------------------------------------------------------


class Trainer:
    """For one task, config and layout: the train state's layout, the step (``train_step``)
    jitted with it, and the state's init, restore and evaluation."""

    def __init__(self, task: Task, config: Config, layout: Layout):
        self.task, self.config, self.layout = task, config, layout
        self.microbatches = config.train.microbatches
        self.graphdef, abstract_params = nnx.split(nnx.eval_shape(lambda: task.make_model(nnx.Rngs(0))))
        self.n_params = sum(math.prod(x.shape) for x in jax.tree.leaves(fp8.without_histories(abstract_params)))
        self.tx, self.schedule = make_optimizer(config.train, fp8.has_history(abstract_params), layout), lr_schedule(config.train)
        self.replicas = diloco.replicas_for(config.parallel, layout.mesh)  # DiLoCo, or one model
        self.reduce_plan = grad_reduce.reduce_plan(config, layout.mesh)
        float16 = config.train.loss_scale if config.model.dtype == "float16" else None
        error_feedback = self.reduce_plan is not None and self.reduce_plan.error_feedback
        self.state_layout = StateLayout(
            abstract_params,
            self.tx,
            layout,
            error_feedback=error_feedback,
            float16=float16,
            outer_tx=self.replicas.outer_tx,
            outer_pending=self.replicas.pending_layout,
            optimizer_offload=config.train.optimizer_offload,
            reference=task.with_reference is not None,
        )
        self.param_shardings, self.state_shardings = self.state_layout.param_shardings, self.state_layout.shardings
        self.reduction = choose_reduction(config, layout, self.param_shardings, self.reduce_plan, self.replicas.count)
        self.update = Update(
            self.tx,
            self.schedule,
            float16 == "dynamic",
            config.train.nonfinite == "skip",
            task.metrics_from,
            task.after_update,
            self.state_layout.opt_on_device,
        )
        grad_reduce.say_what_reduces(config, layout, self.reduce_plan, self.replicas.count)
        platform = layout.mesh.devices.flat[0].platform
        if config.train.optimizer_offload and platform != "gpu":
            log.info(OFFLOAD_SAVES_NOTHING.format(platform=platform))
        self.state_layout.say_replicated()
        self.train_step = jax.jit(
            self.replicas.per_replica(self._train_step, layout.mesh, PER_REPLICA),
            in_shardings=(self.state_shardings, None),
            out_shardings=(self.state_shardings, self.state_layout.metric_sharding()),
            donate_argnums=() if in_process_recovery() else 0,  # recovery goes on from the failed step's input state
        )
        self.eval_step = jax.jit(self._eval_step, in_shardings=(self.param_shardings, None), out_shardings=layout.replicated())
        # Checked before each save: a finite loss does not prove the update it caused was finite.
        self.params_finite = jax.jit(
            lambda params: jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(params)])),
            in_shardings=(self.state_shardings.params,),
        )

    def context(self, loss_cotangent: jax.Array | None = None, vmapped: bool = False) -> StepContext:
        """What the step installs while it is traced (``layout.step_context``)."""
        task = self.task
        return StepContext(
            self.layout, task.sequence_kernel, task.expert_kernel, task.row_logps_kernel, loss_cotangent=loss_cotangent, vmapped=vmapped
        )

    # -- the step: loss -> gradients -> reduction -> update -------------------------------

    def _loss(self, params: Any, batch: Batch) -> tuple[jax.Array, jax.Array, dict[str, jax.Array]]:
        return self.task.loss_fn(nnx.merge(self.graphdef, params), batch)

    def _before_microbatches(self, params: Any) -> contextlib.AbstractContextManager:
        """The microbatch loop traced with the fp8 weights quantised once, before it (not in
        each microbatch)."""
        if self.config.model.fp8 == "off":
            return contextlib.nullcontext()
        model = nnx.merge(self.graphdef, params)
        return fp8.stacks_quantized(model.quantize_fp8()) if hasattr(model, "quantize_fp8") else contextlib.nullcontext()

    def _scale(self, scale: jax.Array | None) -> jax.Array | None:
        """fp16: the objective is the mean loss x the loss scale (GradScaler's convention), whatever the batch."""
        return None if scale is None else scale / float(self.task.tokens_per_example * self.config.train.global_batch)

    def _with_reference(self, reference: Any, batch: Batch) -> Batch:
        """The batch with what the loss reads from the frozen reference model (``Task.with_reference``;
        computed in the step, outside the gradient); the batch itself without one."""
        if reference is None:
            return batch
        return self.task.with_reference(nnx.merge(self.graphdef, reference), batch)

    def _train_step(self, state: TrainState, batch: Batch) -> tuple[TrainState, dict[str, jax.Array]]:
        scale = self._scale(None if state.loss_scale is None else state.loss_scale.scale)
        with installed(self.context(scale, vmapped=self.replicas.count > 0)):  # DiLoCo vmaps this step over its replicas
            batch = self._with_reference(state.reference, batch)
            loss_sum, weight, stats, grads, residual = self.reduction(
                grad_fn(self._loss, scale, self._before_microbatches), state.params, batch, state.residual, scale
            )
        return self.update(state, loss_sum, weight, stats, grads, residual, scale)

    def loss_and_grads(self, params: Any, batch: Batch, loss_scale: float | None = None, reference: Any = None) -> tuple[jax.Array, Any]:
        """Mean loss and its gradients (what one train step would apply, with zero residuals),
        for checks. ``loss_scale``: of the mean loss x that scale (returned unscaled);
        ``reference``: the frozen reference model's parameters (train.objective=dpo)."""
        scale = self._scale(None if loss_scale is None else jnp.asarray(loss_scale, jnp.float32))
        with installed(self.context(scale)):
            batch = self._with_reference(reference, batch)
            gradients = grad_fn(self._loss, scale, self._before_microbatches)
            loss_sum, weight, _, grads, _ = self.reduction(gradients, params, batch, self._extras().residual, scale)
        divisor = weight if scale is None else weight * scale
        return loss_sum / weight, fp8.map_gradients(lambda g: g / divisor.astype(g.dtype), grads)

    def _eval_step(self, params: Any, batch: Batch) -> jax.Array:
        with installed(self.context()):
            loss_sum, weight, stats = self._loss(params, batch)
        # the data's loss only: MoE's balancing terms are in the training objective, not in eval_loss
        return jnp.stack([loss_sum - stats.get(REGULARIZER, 0.0), weight])

    def compiled_train_step(self, state: Any, batch: Any) -> Any:
        """The train step compiled for ``state`` and ``batch`` (arrays or abstract shapes), on GPUs
        with XLA's scheduler given the planner's costs (``train.latency_profile``)."""
        mesh = self.layout.mesh
        return compile_on_devices(
            self.train_step.lower(state, batch),
            self.config.train.latency_profile,
            dict(mesh.shape),
            mesh.devices.flat[0],
            jax.local_device_count(),
        )

    def compile_step(self, state: TrainState, batch: Batch, compiled: Any = None) -> Callable:
        """The step the loop calls, compiled for ``state`` (or ``compiled``, the train step
        compiled ahead): the train step, wrapped by DiLoCo's outer sync and the simulated link
        when they apply."""
        compiled = compiled or self.compiled_train_step(state, batch)
        if self.config.model.fp8 != "off" and self.layout.mesh.devices.flat[0].platform == "gpu":
            # XLA runs an fp8 dot it cannot give an fp8 GEMM in f16, silently: count what it made
            fp8.say_fp8_gemms(self.config.model, kernel_counts(compiled.as_text())["gemm_fp8"], self.microbatches)
            fp8.say_amax_sync(self.config.model, collective_schedule(compiled.as_text()).get("all-reduce", {}))
        link = slow_link.SlowLink.from_config(self.config.parallel, self.replicas.link_axis)
        return self.replicas.host_step(compiled, state, self.layout.mesh, int(jax.device_get(state.step)), link, self.state_layout)

    # -- state ---------------------------------------------------------------------------

    def init_state(self, seed: int, params: Any = None) -> TrainState:
        """A fresh state inside ``jit``, straight into its shardings: parameters initialised
        from ``seed``, or the given ``params`` (``--init-from``) with a fresh optimizer."""

        def init(params) -> TrainState:
            if params is None:
                params = nnx.state(self.task.make_model(nnx.Rngs(params=seed)))
            extras = self._extras()
            params, opt_state, outer = self.replicas.fresh(params, self.tx.init(params))
            residual = None if outer is not None else extras.residual  # DiLoCo reduces inside replicas in fp32
            # train.objective=dpo: the reference is the initial weights, a copy of its own (the step donates params)
            reference = jax.tree.map(jnp.copy, params) if self.state_layout.abstract.reference is not None else None
            return TrainState(jnp.zeros((), jnp.int32), params, opt_state, residual, extras.loss_scale, outer, reference)

        if params is None:
            return jax.jit(lambda: init(None), out_shardings=self.state_shardings)()
        return jax.jit(init, in_shardings=(self.param_shardings,), out_shardings=self.state_shardings)(params)

    def abstract_params(self) -> Any:
        """The model's parameters as they are outside DiLoCo's replica stacking: shapes, dtypes
        and shardings (what ``--init-from`` reads a checkpoint into)."""
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

    def adapt_restored(self, state: TrainState) -> TrainState:
        """A restored state made this run's (``migrate.adapt_restored``)."""
        return migrate.adapt_restored(self.state_layout, state, self.init_extras)

    # -- results -------------------------------------------------------------------------

    def fetch_metrics(self, pending: list[dict[str, jax.Array]]) -> list[dict[str, Any]]:
        """The metrics of the steps since the last log point, on the host (DiLoCo's averaged over replicas)."""
        return self.replicas.fetch_metrics(pending)

    def synchronized_params(self, state: TrainState) -> Any:
        """The parameters of the model being trained (DiLoCo's outer ones)."""
        return self.replicas.model_params(state)
