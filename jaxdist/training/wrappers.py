"""What wraps the ordinary train step: DiLoCo (every replica steps on its own, an outer
step every H steps) and the simulated slow link (a delay after each program whose
collectives cross it)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax

from jaxdist.config import Config
from jaxdist.parallel import diloco
from jaxdist.parallel.slow_link import LinkedStep, SlowLink
from jaxdist.training.state import PER_REPLICA, TrainState

Step = Callable[[TrainState, Any], tuple[TrainState, dict[str, jax.Array]]]


def per_replica(step: Step, mesh) -> Step:
    """DiLoCo's inner step: every replica takes one ordinary step on its slice of the
    batch; nothing crosses the replica axis (vmap with ``spmd_axis_name`` keeps each
    replica on its devices)."""
    replicas = mesh.shape[diloco.AXIS]
    mapped = jax.vmap(step, in_axes=(PER_REPLICA, 0), out_axes=(PER_REPLICA, 0), spmd_axis_name=diloco.AXIS)

    def inner(state: TrainState, batch: Any):
        new, metrics = mapped(dataclasses.replace(state, outer=None), diloco.split_batch(batch, replicas, mesh))
        return dataclasses.replace(new, outer=state.outer), metrics

    return inner


def outer_step(outer_tx, parallel_cfg, param_shardings: Any, mesh) -> Callable[[TrainState], TrainState]:
    """DiLoCo's outer step: the replicas' averaged delta applied to the outer parameters,
    every replica restarted from them."""

    def outer(state: TrainState) -> TrainState:
        params, new_outer, _ = diloco.outer_update(state.params, state.outer, outer_tx, parallel_cfg, param_shardings, mesh)
        return dataclasses.replace(state, params=params, outer=new_outer)

    return outer


def host_step(config: Config, mesh, compiled: Callable, outer: Callable | None, start_step: int, say: Callable[[str], None]) -> Callable:
    """The step the loop calls: the compiled train step, plus (DiLoCo) the compiled outer
    step after every H-th, plus the simulated link's delay when one is set."""
    parallel, inner_steps = config.parallel, config.parallel.diloco_inner_steps
    link = SlowLink.from_config(parallel, diloco.AXIS if outer is not None else "data")
    if outer is None:
        if link is None:
            return compiled
        delay, count, sent = link.delay_s(compiled, mesh)
        say(
            f"jaxdist: simulated link on the data axis: {count} collectives, {sent / 2**20:.2f} MiB per device per step -> +{delay * 1e3:.1f} ms per step"
        )
        return LinkedStep(compiled, delay)
    delay = 0.0
    if link is not None:
        delay, count, sent = link.delay_s(outer, mesh)
        say(
            f"jaxdist: simulated replica link: {count} collectives, {sent / 2**20:.2f} MiB per device per outer step -> +{delay * 1e3:.1f} ms every {inner_steps} steps"
        )
    return diloco.DiLoCoStep(compiled, outer, inner_steps, start_step, delay)
