"""From a batch source to global ``jax.Array`` batches laid out over the mesh.

Each process hands JAX only the rows its devices hold
(``jax.make_array_from_process_local_data``); the source decides the global batch, so
step k sees the same data whatever the number of processes.
"""

from __future__ import annotations

from collections.abc import Iterator

import jax
import numpy as np

from jaxdist.config import Config
from jaxdist.data.synthetic import SyntheticImages, SyntheticTokens
from jaxdist.sharding import Layout


def make_source(config: Config):
    m = config.model
    if m.kind == "resnet":
        return SyntheticImages(m.image_size, m.num_classes, seed=config.train.seed)
    return SyntheticTokens(m.vocab_size, config.train.seq_len, seed=config.train.seed)


def process_rows(sharding: jax.sharding.Sharding, global_shape: tuple[int, ...]) -> slice:
    """The contiguous block of batch rows that this process's devices hold."""
    rows = [idx[0] for idx in sharding.addressable_devices_indices_map(global_shape).values()]
    starts = [r.start or 0 for r in rows]
    stops = [global_shape[0] if r.stop is None else r.stop for r in rows]
    return slice(min(starts), max(stops))


def to_global(batch: dict[str, np.ndarray], layout: Layout) -> dict[str, jax.Array]:
    out = {}
    for key, value in batch.items():
        sharding = layout.batch_sharding(value.ndim)
        local = value[process_rows(sharding, value.shape)]
        out[key] = jax.make_array_from_process_local_data(sharding, local, value.shape)
    return out


def global_batches(
    source, layout: Layout, global_batch: int, *, start_step: int, split: str = "train", limit: int | None = None
) -> Iterator[dict[str, jax.Array]]:
    """Batches for steps start_step+1, start_step+2, ... (``limit`` of them, or forever)."""
    step = start_step
    while limit is None or step < start_step + limit:
        step += 1
        yield to_global(source.batch(step, global_batch, split=split), layout)
