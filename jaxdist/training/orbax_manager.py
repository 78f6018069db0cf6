"""The Orbax checkpoint manager a run saves through, with the preemption question left to
the training loop, and the handler of its train state (``state_handler``).

Orbax asks JAX's preemption sync point itself: in ``save`` and, on the primary process,
from the thread that finalises an async save, with that save's step. The sync manager
keeps one step counter per process, the last step it was asked about from any thread,
and when a preemption notice comes each process publishes that counter; the agreed
step is the largest plus one. A finalising thread that asks about step 112 while the
loop is at 114 publishes 112: the agreed step can then be one this process's loop has
already passed, so it trains on while the others save, and the run hangs in the next
collective. Only the loop asks here (``preemption.PreemptionWatcher.requested``, once a
step, in step order); Orbax's own questions are answered False (it uses the answer for a
log line, a metric and ``should_save``, which jaxdist bypasses with ``force=True``).
"""

from __future__ import annotations

import functools
from pathlib import Path


@functools.cache
def _manager_class() -> type:
    import orbax.checkpoint as ocp

    class LoopAsksThePreemptionSyncPoint(ocp.CheckpointManager):
        def reached_preemption(self, step: int) -> bool:
            return False

    return LoopAsksThePreemptionSyncPoint


def manager(directory: Path, cfg, *, read_only: bool, keep_best: int = 0, processes: tuple[list[int], int] | None = None):
    """An Orbax manager of checkpoints with the train state, data state and config items;
    ``processes``: (the live processes, the recovery epoch) after an in-process recovery, so that
    Orbax's barriers wait for them alone."""
    import grain.checkpoint as grain_checkpoint
    import orbax.checkpoint as ocp
    from orbax.checkpoint import checkpoint_managers as cm

    policies = [cm.LatestN(n=cfg.keep)]
    if keep_best:
        policies.append(cm.BestN(get_metric_fn=lambda m: m["eval_loss"], reverse=True, n=keep_best, keep_checkpoints_without_metrics=False))
    options = ocp.CheckpointManagerOptions(
        enable_async_checkpointing=cfg.async_save,
        preservation_policy=cm.AnyPreservationPolicy(policies),
        read_only=read_only,
        create=not read_only and processes is None,  # Orbax refuses to create it for a subset of the processes (it exists)
    )
    if processes is not None:
        live, epoch = processes
        options.multiprocessing_options = ocp.options.MultiprocessingOptions(
            primary_host=0, active_processes=set(live), barrier_sync_key_prefix=f"recovery{epoch}"
        )
    handlers = {
        "state": state_handler(),
        "data": grain_checkpoint.CheckpointHandler(),
        "config": ocp.JsonCheckpointHandler(),
    }
    return _manager_class()(Path(directory).absolute(), options=options, item_handlers=handlers)


def state_handler(save_concurrent_gb: int = 96):
    """Orbax's handler of a train state (``ocp.args.PyTreeSave`` / ``PyTreeRestore``): the
    standard one's types, with each array written from one replica's shards. Orbax's own default
    splits a replicated array among its replicas' devices to copy it to the host in parallel,
    except where ``JAX_PLATFORMS`` names a GPU (where it chose not to); on CPU devices, which are
    one host's memory, the split gains nothing and costs a compiled slice per array and device in
    every process that saves (64 of the 70 compiles of a tiny model's 3-step run on 8 devices)."""
    import jax
    import numpy as np
    import orbax.checkpoint as ocp

    th = ocp.type_handlers
    registry = th.create_type_handler_registry(
        *((kind, th.ScalarHandler()) for kind in (int, float, bytes, np.number)),
        (np.ndarray, th.NumpyHandler()),
        (jax.Array, th.ArrayHandler(use_replica_parallel=False)),
        (str, th.StringHandler()),
    )
    return ocp.PyTreeCheckpointHandler(
        save_concurrent_gb=save_concurrent_gb, restore_concurrent_gb=96, type_handler_registry=registry, use_ocdbt=True
    )
