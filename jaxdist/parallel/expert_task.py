"""A task whose MoE layers dispatch their tokens with ``parallel.expert`` while its loss is traced."""

from __future__ import annotations

import dataclasses

import jax

from jaxdist.config import Config
from jaxdist.layout.sharding import rules_for
from jaxdist.layout.strategy import resolve_strategy
from jaxdist.models.experts import kernel_note
from jaxdist.models.moe import expert_kernel


def with_expert_parallelism(task, config: Config, mesh: jax.sharding.Mesh):
    from jaxdist.parallel.expert import ExpertParallel

    rules = rules_for(resolve_strategy(config.parallel.strategy, dict(mesh.shape)))
    kernel = ExpertParallel(mesh=mesh, rules=rules, buffer_factor=config.parallel.expert_buffer_factor)
    inner_loss = task.loss_fn

    def loss_fn(model, batch):
        with expert_kernel(kernel):
            return inner_loss(model, batch)

    notes = [f"jaxdist: {kernel.note(config.model.moe_experts)}"] if kernel.ep > 1 else []
    dense = kernel_note(kernel.platform, config.model.moe_experts // kernel.ep)  # where the grouped matmuls run densely
    notes += [dense] if dense else []
    return dataclasses.replace(task, loss_fn=loss_fn, notes=(*task.notes, *notes))
