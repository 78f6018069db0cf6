"""Per-process numpy batches -> global ``jax.Array`` batches laid out over the mesh.

Each process hands JAX only the rows its devices hold
(``jax.make_array_from_process_local_data``); nothing is gathered on one host.
"""

from __future__ import annotations

import jax
import numpy as np

from jaxdist.layout.sharding import Layout


def process_rows(sharding: jax.sharding.Sharding, global_shape: tuple[int, ...]) -> slice:
    """The contiguous block of batch rows that this process's devices hold."""
    rows = [idx[0] for idx in sharding.addressable_devices_indices_map(global_shape).values()]
    starts = [r.start or 0 for r in rows]
    stops = [global_shape[0] if r.stop is None else r.stop for r in rows]
    return slice(min(starts), max(stops))


def to_global(local: dict[str, np.ndarray], layout: Layout, global_batch: int) -> dict[str, jax.Array]:
    out = {}
    for key, value in local.items():
        value = np.asarray(value)
        global_shape = (global_batch, *value.shape[1:])
        out[key] = jax.make_array_from_process_local_data(layout.batch_sharding(value.ndim), value, global_shape)
    return out
