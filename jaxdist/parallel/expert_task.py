"""A task whose MoE layers dispatch their tokens with ``parallel.expert`` (the step installs its kernel)."""

from __future__ import annotations

import dataclasses
import logging

import jax

from jaxdist.config import Config
from jaxdist.layout.sharding import rules_for
from jaxdist.layout.strategy import resolve_strategy
from jaxdist.models.experts import kernel_note

log = logging.getLogger(__name__)


def with_expert_parallelism(task, config: Config, mesh: jax.sharding.Mesh):
    from jaxdist.parallel.expert import ExpertParallel

    rules = rules_for(resolve_strategy(config.parallel.strategy, dict(mesh.shape)))
    kernel = ExpertParallel(mesh=mesh, rules=rules, buffer_factor=config.parallel.expert_buffer_factor)
    if kernel.ep > 1:
        log.info(kernel.note(config.model.moe_experts))
    dense = kernel_note(kernel.platform, config.model.moe_experts // kernel.ep)  # where the grouped matmuls run densely
    if dense:
        log.info(dense)
    return dataclasses.replace(task, expert_kernel=kernel)
