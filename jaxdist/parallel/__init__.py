"""Parallelism applied to a task from outside its model (the model knows nothing of it)."""

from __future__ import annotations

import dataclasses

from jaxdist.config import Config
from jaxdist.parallel.pipeline_schedule import pipeline_spec


def parallelize(task, config: Config, mesh):
    """The task with its loss run through the pipeline schedule when the mesh has a pipe
    axis, its attention split over the sequence when it has a context axis, and an MoE
    model's experts dispatched per device (all-to-all over an expert axis); data,
    FSDP and tensor parallelism need nothing here (they are sharding rules)."""
    sizes = dict(mesh.shape)
    if config.model.kind == "llama" and config.model.moe_experts:
        from jaxdist.parallel.expert import with_expert_parallelism

        task = with_expert_parallelism(task, config, mesh)
    if sizes.get("context", 1) > 1:
        from jaxdist.parallel.context import with_context_attention

        task = with_context_attention(task, config, mesh)
    spec = pipeline_spec(config.parallel, sizes.get("pipe", 1))
    if spec is None:
        return task
    from jaxdist.parallel.pipeline import pipelined_loss, pipelined_row_logps

    if config.train.objective == "dpo":  # the task's own loss, on rows whose log-probabilities come through the pipeline
        return dataclasses.replace(task, row_logps_kernel=pipelined_row_logps(spec))
    return dataclasses.replace(task, loss_fn=pipelined_loss(spec))
