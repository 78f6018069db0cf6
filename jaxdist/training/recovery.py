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

Then process 0 opens the dead process's slot and the launcher starts a replacement
(``JAXDIST_REJOIN``). It connects, enters the survivors' next step boundary (``announce``),
and every live process ``grow``s: process 0 chooses the grown mesh's device order (see
``cluster.recoverable``) and the step, and hands them to the replacement through the
coordination service; the survivors gather the state on their mesh, process 0 broadcasts it
over the grown one, the data stream is rebuilt at that step and the step recompiled. The run
goes on with every process, at the step it had reached (``reason: rejoin`` in elastic.jsonl).

A test's fault hook (``rejoin_hold``) can hold the live processes until a replacement has joined.
"""

from __future__ import annotations

import atexit
import dataclasses
import itertools
import json
import logging
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from jaxdist.cluster import recoverable
from jaxdist.cluster.heartbeat import fault_point
from jaxdist.training import precompile
from jaxdist.training.recovery_mesh import RecoveryImpossible, device_order, mesh_on
from jaxdist.training.rejoin_hold import POLL_S, RejoinHold

log = logging.getLogger(__name__)


class PeerLost(Exception):
    """A process died during ``step``; ``state`` is the state before it (valid on every survivor)."""

    def __init__(self, step: int, state: Any, failed_devices: set, detect_s: float):
        super().__init__(f"a process died during step {step}")
        self.step, self.state, self.failed_devices, self.detect_s = step, state, failed_devices, detect_s


class PeerJoined(Exception):
    """A replacement process connected before ``step``, which did not run: ``state`` is the state before it."""

    def __init__(self, step: int, state: Any, devices: list):
        super().__init__(f"a process rejoined before step {step}")
        self.step, self.state, self.devices = step, state, devices


class StepGuard:
    """Runs each step inside ``live_devices`` over every device the run started with, and waits
    for it, so that every survivor of a death leaves the same step, before its state is replaced,
    and every live process sees a replacement at the same step boundary (before the step runs)."""

    def __init__(self, all_devices: list, devices: list):
        self.all_devices = list(all_devices)  # live_devices' barrier: a replacement connected again is in it
        self.devices = list(devices)  # the mesh's: those the step runs on
        self.after_first_step = None  # set by a recovery: called once the next step is done
        self.hold = RejoinHold()  # a test's fault hook (JAXDIST_FAULT_HOLD_FOR_REJOIN)

    def __call__(self, step_fn, state, batch, step: int):
        import jax

        start = time.perf_counter()
        joined = []
        try:
            for held in itertools.count():
                with recoverable.live_devices(self.all_devices) as live:
                    current = set(self.devices)
                    joined = [d for d in live if d not in current]
                    hold = not joined and self.hold.holds(step, len(live), len(self.all_devices), held)
                    if not joined and not hold:
                        new_state, metrics = step_fn(state, batch)
                        jax.block_until_ready(metrics)  # one executable: its metrics are ready when its state is
                if not hold:
                    break
                time.sleep(POLL_S)
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
        if joined:
            raise PeerJoined(step, state, joined)
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


def reshard_from_survivors(state: Any, shardings: Any) -> tuple[Any, int]:
    """``state`` on ``shardings`` (the new mesh) from this process's shards; how many it lacked (0: complete)."""
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
    ``all_devices``: every device the run started with; ``build_trainer(sizes, devices)`` and
    ``make_batches(layout, start_step)`` come from the run."""
    membership = recoverable.MEMBERSHIP
    before = membership.live_processes()
    failed = sorted({d.process_index for d in lost.failed_devices})
    log.warning(f"process {', '.join(map(str, failed))} died during step {lost.step}; recovering in-process (--recovery in-process)")
    start = time.perf_counter()
    with recoverable.live_devices(all_devices) as live:  # every survivor gets the same set
        live = list(live)
    agree_s = time.perf_counter() - start
    survivors = sorted({d.process_index for d in live})
    if 0 not in survivors:  # unreachable in practice: the coordination service died with it
        raise RecoveryImpossible("process 0 died: it holds the coordination service, so the run restarts from its last checkpoint")
    membership.shrink_to(survivors)
    recoverable.mark_recovering(lost.step)
    sizes = mesh_on(config, len(live))
    start = time.perf_counter()
    order = device_order(live, sizes, membership)
    ahead = precompile.AHEAD.take(precompile.layout_key(survivors, order))
    wait_s = time.perf_counter() - start  # for a compile ahead still under way
    trainer = ahead.trainer if ahead else build_trainer(sizes, order)
    membership.use_mesh(trainer.layout.mesh)
    state, missing = reshard_from_survivors(lost.state, trainer.state_shardings)
    missing_anywhere = membership.allgather(np.int64(missing), "reshard")
    if missing_anywhere.any():
        raise RecoveryImpossible(
            f"{int(missing_anywhere.sum())} state shards had their only copies on process {', '.join(map(str, failed))} "
            "(the mesh shards the state across processes): the run restarts from its last checkpoint"
        )
    reshard_s = time.perf_counter() - start - wait_s
    start = time.perf_counter()
    batches = make_batches(trainer.layout, lost.step - 1)
    first = next(batches)
    step_fn = trainer.compile_step(state, first, compiled=ahead.compiled if ahead else None)
    membership.sync("compiled")  # the first step's collectives must not wait out a slower compile
    recompile_s = time.perf_counter() - start + wait_s
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
        "compiled_ahead": ahead is not None,
    }
    ahead_note = f", the step compiled ahead in {ahead.seconds:.1f}s" if ahead else ""
    log.info(
        f"elastic: {len(before)} -> {len(survivors)} processes in-process, continuing at step {lost.step} on mesh {format_mesh(sizes)} "
        f"(detect {lost.detect_s:.1f}s, agree {agree_s:.2f}s, reshard {reshard_s:.2f}s, recompile {recompile_s:.1f}s{ahead_note})"
    )
    import jax

    if jax.process_index() == 0:
        for rank in failed:  # the launcher may start its replacement now: it joins at a step boundary (``grow``)
            recoverable.open_slot(rank)
    return Recovered(trainer, state, batches, first, step_fn, record)


# -- a replacement rejoins ---------------------------------------------------------------------


@dataclasses.dataclass
class JoinPlan:
    """What process 0 decides for a grow and hands to the replacements (as JSON)."""

    epoch: int
    step: int  # the step to train next
    processes: list[int]
    joined: list[int]  # the replacements joining now
    order: list[int]  # device ids, the grown mesh's order
    groups: list[list[int]]  # every device group used so far (a later change must know them)
    rejoined: list[int]  # every process that has rejoined so far, these included
    meter: bool  # whether the run measures energy (the replacement must take part in its gathers)
    orbax_operation: int  # Orbax's save count on the live processes (``recoverable.orbax_operation_id``)

    def to_bytes(self) -> bytes:
        return json.dumps(dataclasses.asdict(self)).encode()

    @classmethod
    def from_bytes(cls, raw: bytes) -> JoinPlan:
        return cls(**json.loads(raw))


def plan_growth(joined: PeerJoined, config, all_devices: list, meter: bool) -> JoinPlan:
    """Every survivor: the grow process 0 decides (the same on each; process 0 publishes it for the replacements)."""
    import jax

    membership = recoverable.MEMBERSHIP
    new_processes = sorted(set(membership.live_processes()) | {d.process_index for d in joined.devices})
    joiners = sorted(set(new_processes) - set(membership.live_processes()))
    live = [d for d in all_devices if d.process_index in new_processes]
    sizes = mesh_on(config, len(live))
    membership.rejoined |= set(joiners)
    order = device_order(live, sizes, membership)
    plan = JoinPlan(
        epoch=membership.epoch + 1,
        step=joined.step,
        processes=new_processes,
        joined=joiners,
        order=[d.id for d in order],
        groups=sorted(list(g) for g in membership.groups),
        rejoined=sorted(membership.rejoined),
        meter=meter,
        orbax_operation=recoverable.orbax_operation_id(),
    )
    if jax.process_index() == 0:
        for rank in joiners:
            recoverable.publish(f"join/{rank}", plan.to_bytes())
    return plan


def read_join_plan() -> JoinPlan:
    """A replacement, after ``announce``: the grow process 0 decided."""
    import jax

    plan = JoinPlan.from_bytes(recoverable.read(f"join/{jax.process_index()}"))
    recoverable.MEMBERSHIP.groups = {tuple(g) for g in plan.groups}
    recoverable.MEMBERSHIP.rejoined = set(plan.rejoined)
    recoverable.adopt_orbax_operation_id(plan.orbax_operation)
    return plan


def grow(plan: JoinPlan, config, all_devices: list, build_trainer, make_batches, source=None) -> Recovered:
    """Every live process, survivors and replacements: the trainer on the grown mesh, the state
    process 0 holds (``source``: (trainer, state) on the survivors, None on a replacement), the
    data from ``plan.step``, and the step compiled."""
    import jax

    from jaxdist.layout.mesh import format_mesh

    membership = recoverable.MEMBERSHIP
    membership.change_to(plan.processes, plan.epoch)
    fault_point("rejoin", plan.step)
    by_id = {d.id: d for d in all_devices}
    order = [by_id[i] for i in plan.order]
    sizes = mesh_on(config, len(order))
    ahead = precompile.AHEAD.take(precompile.layout_key(plan.processes, order))  # the survivors' (a replacement holds none)
    trainer = ahead.trainer if ahead else build_trainer(sizes, order)
    membership.use_mesh(trainer.layout.mesh)
    start = time.perf_counter()
    host = host_copy(*source) if source is not None else None  # the survivors' collective, on their mesh
    membership.sync("ready", timeout_s=JOIN_TIMEOUT_S)  # the replacements built theirs: the broadcast's rendezvous is not timed
    wait_s = time.perf_counter() - start
    start = time.perf_counter()
    state = broadcast_state(host, trainer, order)
    broadcast_s = time.perf_counter() - start
    start = time.perf_counter()
    batches = make_batches(trainer.layout, plan.step - 1)
    first = next(batches)
    step_fn = trainer.compile_step(state, first, compiled=ahead.compiled if ahead else None)
    membership.sync("compiled")  # a replacement compiles (process 0's compile ahead wrote its program to the cache)
    recompile_s = time.perf_counter() - start
    if jax.process_index() == 0:
        for rank in plan.joined:
            recoverable.forget(f"join/{rank}")  # read by now: a later replacement of the same slot must not find it
    joined = ", ".join(map(str, plan.joined))
    record = {
        "from": len(plan.processes) - len(plan.joined),
        "to": len(plan.processes),
        "reason": "rejoin",
        "step": plan.step - 1,
        "joined_rank": plan.joined[0] if len(plan.joined) == 1 else plan.joined,
        "mesh": format_mesh(sizes),
        "seconds": {"wait": wait_s, "broadcast": broadcast_s, "recompile": recompile_s},
        "compiled_ahead": ahead is not None,
    }
    log.info(
        f"elastic: {record['from']} -> {len(plan.processes)} processes, process {joined} rejoined; continuing at "
        f"step {plan.step} on mesh {format_mesh(sizes)} (wait {wait_s:.1f}s, broadcast {broadcast_s:.2f}s, recompile {recompile_s:.1f}s)"
    )
    return Recovered(trainer, state, batches, first, step_fn, record)


JOIN_TIMEOUT_S = 300.0  # survivors wait this long for a replacement to build its trainer


def host_copy(trainer, state) -> list[np.ndarray]:
    """The survivors: every leaf of ``state`` whole on the host (gathered on their mesh)."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    whole = NamedSharding(trainer.layout.mesh, PartitionSpec())
    gathered = jax.jit(lambda tree: tree, out_shardings=jax.tree.map(lambda _: whole, state))(state)
    return [np.asarray(leaf.addressable_data(0)) for leaf in jax.tree.leaves(gathered)]


def broadcast_state(host: list[np.ndarray] | None, trainer, order: list) -> Any:
    """The state on ``trainer``'s shardings, from process 0's ``host`` copy: its bytes summed over
    the grown mesh with every other process's zeros (one all-reduce, exact for any dtype).
    Not ``multihost_utils.broadcast_one_to_all``: its mesh is ``jax.devices()`` in their own
    order, a device group the dead process was in (a stale gloo communicator, see ``recoverable``)."""
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    abstract = trainer.abstract_state()
    leaves, treedef = jax.tree.flatten(abstract)
    fits = host is None or [(h.shape, h.dtype) for h in host] == [(tuple(a.shape), np.dtype(a.dtype)) for a in leaves]
    if not recoverable.MEMBERSHIP.allgather(np.int32(fits), "state-fits").all():
        raise RecoveryImpossible("the grown mesh's state has other shapes than the survivors' (a per-device part): the run restarts")
    nbytes = [int(np.prod(a.shape, dtype=np.int64)) * np.dtype(a.dtype).itemsize for a in leaves]
    words = (sum(nbytes) + 3) // 4
    mine = np.zeros(words * 4, np.uint8)
    me = jax.process_index()
    if me == 0:
        mine[: sum(nbytes)] = np.concatenate([np.frombuffer(np.ascontiguousarray(h).tobytes(), np.uint8) for h in host] or [mine[:0]])
    mesh = Mesh(np.array(order), ("all",))
    local = [d for d in order if d.process_index == me]
    pieces = [jax.device_put((mine if (me == 0 and i == 0) else np.zeros_like(mine)).view(np.int32)[None], d) for i, d in enumerate(local)]
    spread = jax.make_array_from_single_device_arrays((len(order), words), NamedSharding(mesh, PartitionSpec("all")), pieces)
    summed = jax.jit(jax.shard_map(lambda x: jax.lax.psum(x, "all"), mesh=mesh, in_specs=PartitionSpec("all"), out_specs=PartitionSpec()))(
        spread
    )
    raw = np.asarray(summed.addressable_data(0)).reshape(-1).view(np.uint8)
    arrays, offset = [], 0
    for a, sharding, size in zip(leaves, jax.tree.leaves(trainer.state_shardings), nbytes, strict=True):
        whole = np.frombuffer(raw[offset : offset + size].tobytes(), np.dtype(a.dtype)).reshape(a.shape)
        arrays.append(jax.make_array_from_callback(tuple(a.shape), sharding, lambda index, whole=whole: whole[index]))
        offset += size
    return jax.tree.unflatten(treedef, arrays)


def write_record(run_dir: Path | None, record: dict, first_step_s: float) -> None:
    """Process 0: the recovery's line in ``RUN_DIR/elastic.jsonl``, with its first step's seconds."""
    import jax

    from jaxdist.cluster.elastic import record as append

    if run_dir is None or jax.process_index() != 0:
        return
    seconds = {**record["seconds"], "first_step": first_step_s}
    append(run_dir, **{**record, "seconds": {k: round(v, 3) for k, v in seconds.items()}})


def train_recovering(
    run_loop, trainer, state, first, batches, step_fn, hooks, *, config, run_dir, checkpointer, build_trainer, make_batches, make_eval,
    joined: Recovered | None = None,
):  # fmt: skip
    """``run_loop(trainer, state, batches, step_fn)`` (the training loop) to its end, recovering
    in-process each time a peer dies and growing each time a replacement rejoins; (the loop's
    result over every segment, the data stream in use at the end, for the caller to close).
    ``joined``: a replacement's start (``grow``'s result), in place of the trainer and state."""
    import jax

    all_devices = list(jax.devices())  # live_devices' list: a replacement connecting again is seen in it
    hooks.guard = StepGuard(all_devices, list(trainer.layout.mesh.devices.flat))
    if joined is None:
        recoverable.MEMBERSHIP.use_mesh(trainer.layout.mesh)
        log.info(
            "in-process recovery: each step runs to completion inside live_devices and keeps its input state "
            "(no buffer donation: one more copy of the state per device)"
        )

    def after_first_step(seconds: float, record: dict | None = None) -> None:
        if record is not None:
            write_record(run_dir, record, seconds)
        precompile.compile_recoveries_ahead(config, all_devices, build_trainer)

    hooks.guard.after_first_step = after_first_step
    losses, eval_losses = [], {}
    changed = joined
    try:
        while True:
            if changed is not None:
                trainer, state, batches, first, step_fn = (
                    changed.trainer,
                    changed.state,
                    changed.batches,
                    changed.first_batch,
                    changed.step_fn,
                )
                hooks.guard.devices = list(trainer.layout.mesh.devices.flat)
                hooks.guard.after_first_step = lambda seconds, record=changed.record: after_first_step(seconds, record)
                hooks.eval_batches = make_eval(trainer.layout)
                hooks.data_state = batches.get_state
                if hooks.config_dict is not None:  # the checkpoints' saved config says the mesh they were saved on
                    hooks.config_dict = {**hooks.config_dict, "parallel": {**hooks.config_dict["parallel"], "mesh": changed.record["mesh"]}}
                if checkpointer is not None and changed is not joined:  # a replacement opened its own on the live processes
                    checkpointer.use_processes(recoverable.MEMBERSHIP.live_processes(), recoverable.MEMBERSHIP.epoch)
            try:
                result = run_loop(trainer, state, itertools.chain([first], batches), step_fn)
            except (PeerLost, PeerJoined) as event:
                partial = getattr(event, "partial", None)
                if partial is not None:
                    losses += partial.losses
                    eval_losses.update(partial.eval_losses)
                batches.close()
                if isinstance(event, PeerLost):
                    changed = recover(event, config, all_devices, build_trainer, make_batches)
                else:
                    plan = plan_growth(event, config, all_devices, meter=getattr(hooks.energy, "meter", None) is not None)
                    changed = grow(plan, config, all_devices, build_trainer, make_batches, source=(trainer, event.state))
                continue
            result.losses, result.eval_losses = losses + result.losses, {**eval_losses, **result.eval_losses}
            return result, batches
    finally:
        precompile.AHEAD.stop()  # its compile must not outlive the run


def join_running(config, build_trainer, make_batches) -> tuple[Recovered, bool]:
    """A replacement, connected and announced: its part of the grow; and whether the run measures energy."""
    import jax

    plan = read_join_plan()
    log.info(f"rejoining the run at step {plan.step} with processes {', '.join(map(str, plan.processes))}")
    return grow(plan, config, list(jax.devices()), build_trainer, make_batches), plan.meter


def leave_past_abandoned_saves(exit_code: int, always: bool = False) -> None:
    """At the end of a recovered run: a checkpoint save the dead process took part in left Orbax
    threads blocked in a barrier that waits for it (a C++ call no signal interrupts). Python's exit
    would join them: with any (or ``always``) exit now, after the exit handlers, with ``exit_code``."""
    blocked = [t.name for t in threading.enumerate() if t.is_alive() and not t.daemon and t is not threading.main_thread()]
    if not blocked and not always:
        return
    if blocked:
        log.info(f"exiting past the threads of a save abandoned at the recovery, still waiting for the dead process: {', '.join(blocked)}")
    atexit._run_exitfuncs()  # what exit would run after joining the threads: logging, the stdout filter, JAX, Grain
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(exit_code)
