"""The update of one step: gradients of the summed loss -> the mean loss's gradients ->
optax (clipping, AdamW or SGD, the schedule) -> new parameters; fp16's loss scale moves
with whether the gradients were finite, and a non-finite update is dropped (the step
still counts) when ``train.nonfinite=skip`` or under fp16. fp8's amax histories take
their observed values (their "gradients") over the old ones, outside the optimizer."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from jaxdist.models import fp8
from jaxdist.training import loss_scale
from jaxdist.training.state import TrainState, optimizer_step


@dataclasses.dataclass(frozen=True)
class Update:
    tx: optax.GradientTransformation
    schedule: Callable[[jax.Array], jax.Array]  # the learning rate at an optimizer step count
    dynamic_scale: bool  # fp16 with train.loss_scale=dynamic
    skip_nonfinite: bool  # train.nonfinite=skip
    # the model's statistics (sums over the batch) -> its metrics (MoE balancing); and what moves
    # after the optimizer from them (aux-loss-free balancing's router bias)
    metrics_from: Callable[[dict[str, jax.Array], jax.Array], dict[str, jax.Array]] | None = None
    after_update: Callable[[Any, dict[str, jax.Array]], Any] | None = None

    def __call__(
        self,
        state: TrainState,
        loss_sum: jax.Array,
        weight: jax.Array,
        stats: dict[str, jax.Array],
        grads: Any,
        residual: Any,
        scale: jax.Array | None,
    ) -> tuple[TrainState, dict[str, jax.Array]]:
        divisor = weight if scale is None else weight * scale
        grads = fp8.map_gradients(lambda g: g / divisor.astype(g.dtype), grads)  # fp8 observations are values, not sums
        updates, opt_state = self.tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        params = fp8.overwrite_histories(params, grads)
        if self.after_update is not None:
            params = self.after_update(params, stats)
        loss, grad_norm = loss_sum / weight, optax.tree.norm(fp8.without_histories(grads))
        # The rate this update used: the optimizer's own step count, which skipped steps do not advance.
        metrics = {"loss": loss, "grad_norm": grad_norm, "lr": self.schedule(optimizer_step(state.opt_state))}
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
                jax.tree.map(keep, *pair) for pair in ((params, state.params), (opt_state, state.opt_state), (residual, state.residual))
            )
            metrics["skipped"] = ~finite
        return TrainState(state.step + 1, params, opt_state, residual, new_scale), metrics
