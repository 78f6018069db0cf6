"""A task whose attention is split over the mesh's ``context`` axis.

The sequence of every token array is sharded over ``context`` (the layout's rules and
``data.loader.split_sequences``: positions carried, load-balanced order); the model's
attention is replaced, while its loss is traced, by ``parallel.context``'s kernel, which
sees the local queries and the whole sequence's keys (gathered, or passed around a ring).
Everything else in the decoder is per token and needs nothing: XLA reduces the loss, the
token count and the gradients over the batch axes and ``context`` as for any global array.
"""

from __future__ import annotations

import dataclasses
import logging

import jax

from jaxdist.config import Config
from jaxdist.layout.mesh import BATCH_AXES

log = logging.getLogger(__name__)


def with_context_attention(task, config: Config, mesh: jax.sharding.Mesh):
    from jaxdist.parallel.context import ContextAttention

    p = config.parallel
    heads_axis = "tensor" if mesh.shape["tensor"] > 1 else None  # validate: heads and kv heads divide over tensor
    kernel = ContextAttention(
        mesh=mesh,
        strategy=p.context_strategy,
        implementation=task.attention or "xla",
        requested=config.model.attention,
        batch_axes=BATCH_AXES,
        heads_axis=heads_axis,
        kv_heads_axis=heads_axis,
    )
    inner_spec = task.batch_spec

    def batch_spec(global_batch: int) -> dict[str, jax.ShapeDtypeStruct]:
        spec = dict(inner_spec(global_batch))
        spec.setdefault("positions", jax.ShapeDtypeStruct(spec["inputs"].shape, "int32"))  # the loader always carries them
        return spec

    order = "load-balanced (shard r holds chunks r and 2N-1-r)" if p.context_load_balance else "in order (no load balancing)"
    log.info(f"{kernel.kernel_note(config.train.seq_len)}; sequence {order}")
    return dataclasses.replace(task, sequence_kernel=kernel, batch_spec=batch_spec)
