"""Parallelism applied to a task from outside its model (the model knows nothing of it)."""

from __future__ import annotations

import dataclasses

from jaxdist.config import Config
from jaxdist.layout.mesh import MeshSizes
from jaxdist.parallel.schedule import pipeline_spec


def parallelize(task, config: Config, mesh_sizes: MeshSizes):
    """The task with its loss run through the pipeline schedule when the mesh has a pipe
    axis; data, FSDP and tensor parallelism need nothing here (they are sharding rules)."""
    spec = pipeline_spec(config.parallel, mesh_sizes.get("pipe", 1))
    if spec is None:
        return task
    from jaxdist.parallel.pipeline import pipelined_loss

    return dataclasses.replace(task, loss_fn=pipelined_loss(spec))
