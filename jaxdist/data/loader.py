"""Per-process numpy batches -> global ``jax.Array`` batches laid out over the mesh.

Each process hands JAX only the rows its devices hold
(``jax.make_array_from_process_local_data``); nothing is gathered on one host.
"""

from __future__ import annotations

import jax
import numpy as np

from jaxdist.layout.sharding import Layout
from jaxdist.parallel.context import reorder


def process_rows(sharding: jax.sharding.Sharding, global_shape: tuple[int, ...]) -> slice:
    """The contiguous block of batch rows that this process's devices hold."""
    rows = [idx[0] for idx in sharding.addressable_devices_indices_map(global_shape).values()]
    starts = [r.start or 0 for r in rows]
    stops = [global_shape[0] if r.stop is None else r.stop for r in rows]
    return slice(min(starts), max(stops))


def split_sequences(local: dict[str, np.ndarray], context: int, load_balance: bool) -> dict[str, np.ndarray]:
    """Token arrays [rows, seq] ready to be split over a context axis of size ``context``.

    Positions are carried (RoPE and the attention mask read them, never array indices);
    with ``load_balance`` every token array is reordered so that shard r holds sequence
    chunks r and 2N-1-r (a causal mask makes the last chunks the most work). Targets were
    shifted before: the reorder moves (input, target) pairs together.
    """
    if context == 1:
        return local
    out = dict(local)
    seq = next(v.shape[1] for v in local.values() if v.ndim >= 2)
    if "positions" not in out:
        out["positions"] = np.broadcast_to(np.arange(seq, dtype=np.int32), (len(out["inputs"]), seq))
    if load_balance:
        out = {k: (reorder(np.asarray(v), context, axis=1) if v.ndim >= 2 else v) for k, v in out.items()}
    return out


def to_global(local: dict[str, np.ndarray], layout: Layout, global_batch: int) -> dict[str, jax.Array]:
    local = split_sequences({k: np.asarray(v) for k, v in local.items()}, layout.mesh.shape.get("context", 1), layout.context_load_balance)
    shardings = {key: layout.batch_sharding(value.ndim) for key, value in local.items()}
    if jax.process_count() == 1:
        # One process holds the whole batch: one transfer call for every key (it runs on the
        # read-ahead thread, where each Python-level call is GIL time taken from the loop).
        if any(len(value) != global_batch for value in local.values()):
            raise ValueError(f"a single process feeds the whole batch of {global_batch} rows, got {[len(v) for v in local.values()]}")
        return jax.device_put(local, shardings)
    return {
        key: jax.make_array_from_process_local_data(shardings[key], np.asarray(value), (global_batch, *np.shape(value)[1:]))
        for key, value in local.items()
    }
