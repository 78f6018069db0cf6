"""A checkpoint's state brought to this run: the parts a run adds or drops between
resumes (gradient compression's residuals, fp16's loss scale) are read as saved, then
re-spread, started fresh or dropped, each in one line.

Residuals saved on another device count keep what all devices still owed the model
(their sum), spread evenly over this run's devices.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxdist.models import fp8
from jaxdist.parallel import grad_reduce
from jaxdist.training.state import StateLayout, TrainState, residual_shapes

log = logging.getLogger(__name__)


def restore_target(state_layout: StateLayout, saved_tree: Any) -> TrainState:
    """The abstract state to restore a checkpoint into: this run's, except that the
    residuals and the loss scale are read as the checkpoint has them (or not at all);
    ``adapt_restored`` then re-spreads, initialises or drops them for this run."""
    target = state_layout.abstract_state()
    if hasattr(saved_tree, "keys"):  # the loss scale is read when saved (adapt_restored keeps or drops it)
        target = dataclasses.replace(target, loss_scale=state_layout.loss_scale_target() if saved_tree.get("loss_scale") else None)
        if fp8.has_history(target.params) and not fp8.holds_history(saved_tree.get("params")):
            target = dataclasses.replace(target, params=fp8.split(target.params)[1])  # adapt_restored adds empty histories
    saved = _saved_residual_devices(saved_tree)
    if saved is None:
        return dataclasses.replace(target, residual=None)
    if target.residual is not None and saved == state_layout.reduce_devices:
        return target
    # Another device count, or a run without compression: read them as saved (kept whole
    # on every device only when the device count changed), then adapt or drop.
    mesh = state_layout.layout.mesh
    shardings = grad_reduce.per_device_shardings(state_layout.param_shardings, mesh)
    if saved != state_layout.reduce_devices:
        shardings = jax.tree.map(lambda s: NamedSharding(mesh, PartitionSpec(None, *s.spec[1:])), shardings)
    residual = state_layout.with_shardings(residual_shapes(state_layout.abstract_params, saved), shardings)
    return dataclasses.replace(target, residual=residual)


def adapt_restored(state_layout: StateLayout, state: TrainState, fresh_extras: Callable[[], TrainState]) -> TrainState:
    """``state`` as this run needs it: residuals and loss scale kept, re-spread, started
    fresh (``fresh_extras()``, only when the checkpoint lacks them: zeros cost a
    gradient's memory) or dropped, saying so."""
    wants_residual, wants_scale = state_layout.abstract.residual is not None, state_layout.abstract.loss_scale is not None
    if fp8.has_history(state_layout.abstract.params) and not fp8.has_history(state.params):
        histories = fp8.split(state_layout.abstract_state().params)[0]
        empty = jax.jit(
            lambda: jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), histories),
            out_shardings=fp8.split(state_layout.shardings.params)[0],
        )()
        log.info(
            "the checkpoint has no fp8 amax histories (saved without model.fp8=delayed): they start empty (the next step quantises with scale 1 and fills them)"
        )
        state = dataclasses.replace(state, params=fp8.merge(empty, state.params))
    if (state.residual is None and wants_residual) or (state.loss_scale is None and wants_scale):
        fresh = fresh_extras()
    if state.residual is not None and not wants_residual:
        log.warning("the checkpoint's error-feedback residuals are not used by this run (no compression); dropped")
        state = dataclasses.replace(state, residual=None)
    if state.loss_scale is not None and not wants_scale:
        log.info("the checkpoint's loss scale is not used by this run (not float16)")
        state = dataclasses.replace(state, loss_scale=None)
    if state.residual is None and wants_residual:
        log.info("the checkpoint has no error-feedback residuals (saved without compression); they start at zero")
        state = dataclasses.replace(state, residual=fresh.residual)
    if state.loss_scale is None and wants_scale:
        start = float(np.max(jax.device_get(fresh.loss_scale.scale)))
        log.info(f"the checkpoint has no loss scale (saved without float16); it starts at {start:g}")
        state = dataclasses.replace(state, loss_scale=fresh.loss_scale)
    if state.residual is None:
        return state
    saved, n = jax.tree.leaves(state.residual)[0].shape[0], state_layout.reduce_devices
    if saved == n:
        return state
    respread = jax.jit(
        lambda r: jax.tree.map(lambda x: jnp.broadcast_to(jnp.sum(x, 0) / n, (n, *x.shape[1:])), r),
        out_shardings=state_layout.shardings.residual,
    )
    log.info(f"error-feedback residuals were saved on {saved} devices; their sum is spread evenly over this run's {n}")
    return dataclasses.replace(state, residual=respread(state.residual))


def _saved_residual_devices(saved_tree: Any) -> int | None:
    """The leading (device) dimension of a checkpoint's residuals, if it has any."""
    residual = saved_tree.get("residual") if hasattr(saved_tree, "get") else None  # Orbax's tree metadata is dict-like
    shapes = [getattr(x, "shape", None) for x in jax.tree.leaves(residual)] if residual else []
    shapes = [s for s in shapes if s]
    return shapes[0][0] if shapes else None
