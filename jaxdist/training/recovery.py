"""In-process recovery: the survivors of a dead process go on training without a restart
(``jaxdist.launch --recovery in-process``; the JAX pieces are in ``cluster.recoverable``).

Each step runs inside ``live_devices`` and to completion (``StepGuard``), on a step compiled
without buffer donation, so when a peer dies every survivor leaves the same step with
``PeerLost`` and still holds the state before it. ``recover`` then

1. agrees on the live devices (one more ``live_devices`` block: every survivor gets the same set);
2. sizes the mesh spec's ``-1`` axis to them, as an elastic restart would (a mesh that does not fit,
   or a dead process 0, which holds the coordination service, means a restart instead);
3. builds the state on the new mesh from each survivor's own shards (no checkpoint read); when a
   shard's only copies were on the dead process, every survivor says so and exits
   ``EXIT_RECOVERY`` for the launcher's restart path;
4. rebuilds the data stream at the failed step (batch k is a function of k) and recompiles;

and the loop continues from the step that failed: no step is trained twice, and the data
order is the one an elastic restart would give. Process 0 appends the recovery to
``RUN_DIR/elastic.jsonl`` with the seconds of each phase once the first step after it is done.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from jaxdist.cluster import recoverable
from jaxdist.errors import EXIT_RECOVERY, JaxdistError

log = logging.getLogger(__name__)


class RecoveryImpossible(JaxdistError):
    exit_code = EXIT_RECOVERY


class PeerLost(Exception):
    """A process died during ``step``; ``state`` is the state before it (valid on every survivor)."""

    def __init__(self, step: int, state: Any, failed_devices: set, detect_s: float):
        super().__init__(f"a process died during step {step}")
        self.step, self.state, self.failed_devices, self.detect_s = step, state, failed_devices, detect_s


class StepGuard:
    """Runs each step inside ``live_devices`` and waits for it, so that every survivor of a
    death leaves the same step, before its state is replaced."""

    def __init__(self, devices: list):
        self.devices = list(devices)
        self.after_first_step = None  # set by a recovery: called once the next step is done

    def __call__(self, step_fn, state, batch, step: int):
        import jax

        start = time.perf_counter()
        try:
            with recoverable.live_devices(self.devices):
                new_state, metrics = step_fn(state, batch)
                jax.block_until_ready(metrics)  # one executable: its metrics are ready when its state is
        except Exception as e:
            if recoverable.is_process_failure(e):
                raise PeerLost(step, state, set(e.failed_devices), time.perf_counter() - start) from None
            if "Gloo" not in str(e) and "NCCL" not in str(e):
                raise
            # a collective gave up while every process lives: a peer slower than --peer-timeout, not a dead one
            first_line = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
            raise RecoveryImpossible(
                f"a collective of step {step} failed with every process alive ({first_line}): a peer was slower than "
                f"--peer-timeout {recoverable.peer_timeout_s()}s; the run restarts from its last checkpoint (raise --peer-timeout)"
            ) from None
        if self.after_first_step is not None:
            done, self.after_first_step = self.after_first_step, None
            done(time.perf_counter() - start)
        return new_state, metrics


@dataclasses.dataclass
class Recovered:
    trainer: Any
    state: Any
    batches: Any  # the data stream from the failed step on
    first_batch: Any
    step_fn: Any
    record: dict  # elastic.jsonl's fields so far (the first step's seconds are added after it)


def mesh_on(config, n_devices: int) -> dict[str, int]:
    """The mesh spec sized to ``n_devices`` (a ``-1`` axis takes what remains), or why not."""
    from jaxdist.layout.mesh import format_mesh, mesh_device_count, parse_mesh, resolve_mesh

    text = recoverable.MEMBERSHIP.mesh_spec or config.parallel.mesh  # the user's spec: the config holds what -1 became
    spec = parse_mesh(text)
    if spec is None:
        raise RecoveryImpossible("--mesh auto cannot be sized to the survivors: give the run a mesh such as data=-1")
    try:
        sizes = resolve_mesh(spec, n_devices)
    except JaxdistError as e:
        raise RecoveryImpossible(f"the mesh {text} does not fit the {n_devices} live devices ({e})") from None
    if mesh_device_count(sizes) != n_devices:
        raise RecoveryImpossible(f"the mesh {format_mesh(sizes)} uses {mesh_device_count(sizes)} devices, not the {n_devices} live ones")
    return sizes


def reshard_from_survivors(state: Any, shardings: Any) -> tuple[Any, int]:
    """``state`` on ``shardings`` (the new mesh) from the shards this process holds; the
    number of shards it needed and does not hold (0: complete)."""
    import jax
    from jax.sharding import SingleDeviceSharding

    missing = 0

    def move(array, sharding):
        nonlocal missing
        held = {}
        for shard in array.addressable_shards:  # this process's own copies, by the part of the array they hold
            held.setdefault(_key(shard.index, array.shape), shard)
        pieces = []
        for device, index in sharding.addressable_devices_indices_map(array.shape).items():
            shard = held.get(_key(index, array.shape))
            if shard is None:
                missing += 1
                pieces.append(jax.device_put(np.zeros(_shape(index, array.shape), array.dtype), SingleDeviceSharding(device)))
            else:
                pieces.append(jax.device_put(shard.data, SingleDeviceSharding(device)))
        return jax.make_array_from_single_device_arrays(array.shape, sharding, pieces)

    moved = jax.tree.map(move, state, shardings)
    return moved, missing


def _key(index: tuple, shape: tuple) -> tuple:
    """The part of an array a shard holds, as (start, stop) per dimension."""
    return tuple(s.indices(n)[:2] for s, n in zip(index, shape, strict=False))


def _shape(index: tuple, shape: tuple) -> tuple:
    return tuple(len(range(*s.indices(n))) for s, n in zip(index, shape, strict=False))


def recover(lost: PeerLost, config, all_devices: list, build_trainer, make_batches) -> Recovered:
    """The survivors' trainer, state, data and step after ``lost`` (see the module's steps);
    ``build_trainer(sizes, devices)`` and ``make_batches(layout, start_step)`` come from the run."""
    before = sorted({d.process_index for d in all_devices})
    failed = sorted({d.process_index for d in lost.failed_devices})
    log.warning(f"process {', '.join(map(str, failed))} died during step {lost.step}; recovering in-process (--recovery in-process)")
    start = time.perf_counter()
    with recoverable.live_devices(all_devices) as live:  # every survivor gets the same set
        live = list(live)
    agree_s = time.perf_counter() - start
    survivors = sorted({d.process_index for d in live})
    if 0 not in survivors:  # unreachable in practice: the coordination service died with it
        raise RecoveryImpossible("process 0 died: it holds the coordination service, so the run restarts from its last checkpoint")
    recoverable.MEMBERSHIP.shrink_to(survivors)
    sizes = mesh_on(config, len(live))
    start = time.perf_counter()
    trainer = build_trainer(sizes, live)
    state, missing = reshard_from_survivors(lost.state, trainer.state_shardings)
    missing_anywhere = recoverable.MEMBERSHIP.allgather(np.int64(missing), "reshard")
    if missing_anywhere.any():
        raise RecoveryImpossible(
            f"{int(missing_anywhere.sum())} state shards had their only copies on process {', '.join(map(str, failed))} "
            "(the mesh shards the state across processes): the run restarts from its last checkpoint"
        )
    reshard_s = time.perf_counter() - start
    start = time.perf_counter()
    batches = make_batches(trainer.layout, lost.step - 1)
    first = next(batches)
    step_fn = trainer.compile_step(state, first)
    recoverable.MEMBERSHIP.sync("compiled")  # the first step's collectives must not wait out a slower compile
    recompile_s = time.perf_counter() - start
    from jaxdist.layout.mesh import format_mesh

    record = {
        "from": len(before),
        "to": len(survivors),
        "reason": "in-process",
        "step": lost.step - 1,
        "failed_rank": failed[0] if len(failed) == 1 else failed,
        "exit_code": None,
        "mesh": format_mesh(sizes),
        "seconds": {"detect": lost.detect_s, "agree": agree_s, "reshard": reshard_s, "recompile": recompile_s},
    }
    log.info(
        f"elastic: {len(before)} -> {len(survivors)} processes in-process, continuing at step {lost.step} on mesh {format_mesh(sizes)} "
        f"(detect {lost.detect_s:.1f}s, agree {agree_s:.2f}s, reshard {reshard_s:.2f}s, recompile {recompile_s:.1f}s)"
    )
    return Recovered(trainer, state, batches, first, step_fn, record)


def write_record(run_dir: Path | None, record: dict, first_step_s: float) -> None:
    """Process 0: the recovery's line in ``RUN_DIR/elastic.jsonl``, with its first step's seconds."""
    import jax

    from jaxdist.cluster.elastic import record as append

    if run_dir is None or jax.process_index() != 0:
        return
    seconds = {**record["seconds"], "first_step": first_step_s}
    append(run_dir, **{**record, "seconds": {k: round(v, 3) for k, v in seconds.items()}})


def train_recovering(
    run_loop, trainer, state, first, batches, step_fn, hooks, *, config, run_dir, checkpointer, build_trainer, make_batches, make_eval
):
    """``run_loop(trainer, state, batches, step_fn)`` (the training loop) to its end, recovering
    in-process each time a peer dies; (the loop's result over every segment, the data stream
    in use at the end, for the caller to close)."""
    import itertools

    devices = list(trainer.layout.mesh.devices.flat)
    hooks.guard = StepGuard(devices)
    log.info(
        "in-process recovery: each step runs to completion inside live_devices and keeps its input state "
        "(no buffer donation: one more copy of the state per device)"
    )
    losses, eval_losses = [], {}
    while True:
        try:
            result = run_loop(trainer, state, itertools.chain([first], batches), step_fn)
        except PeerLost as lost:
            partial = getattr(lost, "partial", None)
            if partial is not None:
                losses += partial.losses
                eval_losses.update(partial.eval_losses)
            batches.close()
            recovered = recover(lost, config, devices, build_trainer, make_batches)
            trainer, state, batches, first, step_fn = (
                recovered.trainer, recovered.state, recovered.batches, recovered.first_batch, recovered.step_fn
            )  # fmt: skip
            devices = list(trainer.layout.mesh.devices.flat)
            hooks.guard.devices = devices
            hooks.guard.after_first_step = lambda seconds, record=recovered.record: write_record(run_dir, record, seconds)
            hooks.eval_batches = make_eval(trainer.layout)
            hooks.data_state = batches.get_state
            if hooks.config_dict is not None:  # the checkpoints' saved config says the mesh they were saved on
                hooks.config_dict = {**hooks.config_dict, "parallel": {**hooks.config_dict["parallel"], "mesh": recovered.record["mesh"]}}
            if checkpointer is not None:
                checkpointer.use_processes(recoverable.MEMBERSHIP.live_processes(), recoverable.MEMBERSHIP.epoch)
            continue
        result.losses, result.eval_losses = losses + result.losses, {**eval_losses, **result.eval_losses}
        return result, batches


def leave_past_abandoned_saves(exit_code: int) -> None:
    """At the end of a recovered run: a checkpoint save the dead process took part in left Orbax
    threads blocked in a barrier that waits for it (a C++ call no signal interrupts; its
    timeout is minutes). Python's exit would join them, so a process that has any exits now,
    after its exit handlers, with ``exit_code``; otherwise this returns."""
    blocked = [t.name for t in threading.enumerate() if t.is_alive() and not t.daemon and t is not threading.main_thread()]
    if not blocked:
        return
    log.info(f"exiting past the threads of a save abandoned at the recovery, still waiting for the dead process: {', '.join(blocked)}")
    atexit._run_exitfuncs()  # what exit would run after joining the threads: logging, the stdout filter, JAX, Grain
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(exit_code)
