"""Checkpoints with Orbax: async saves, exact resume, restore onto another mesh.

A checkpoint (``RUN_DIR/checkpoints/STEP``) holds the train state (params, optimizer
state, step), this process's Grain iterator state (one file per process), and the
resolved config. Orbax writes each step into a temporary folder and renames it when
complete, so a process killed mid-save leaves nothing that resume would pick.
Restoring takes abstract arrays carrying the *target* shardings, so a checkpoint
written on one mesh lands directly in the shards of another (never gathered).

Between the full checkpoints, ``checkpoint.params_every_steps`` writes weights-only ones
(``RUN_DIR/params/STEP``: step, parameters, data state and config; no optimizer state),
asynchronously too; each kind keeps its own newest ``checkpoint.keep``. ``--resume auto``
only ever picks a full one.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import time
from pathlib import Path
from typing import Any

from jaxdist.cluster import recoverable
from jaxdist.errors import EXIT_CHECKPOINT, JaxdistError, RunStopped
from jaxdist.training import orbax_manager

log = logging.getLogger(__name__)
PARAMS_DIR = "params"  # RUN_DIR/params/STEP: the weights-only checkpoints beside RUN_DIR/checkpoints/STEP


class CheckpointError(RunStopped):
    """A checkpoint could not be written (the last committed one is intact)."""

    exit_code = EXIT_CHECKPOINT


class _IteratorState:
    """A snapshot of the data iterator's state, in the shape Grain's Orbax handler wants
    (``get_state() -> bytes``). Taken when the save starts, so an async save records the
    position the step consumed, not where the loader has read ahead to since."""

    def __init__(self, state: bytes = b""):
        self.state = state

    def get_state(self) -> bytes:
        return self.state

    def set_state(self, state: bytes) -> None:
        self.state = state

    def start_prefetch(self) -> None:  # Grain's handler calls this after restoring
        pass


@dataclasses.dataclass
class Restored:
    step: int
    state: Any
    data_state: dict | None  # None: no usable state for this process (resume the data from the step)
    config: dict
    path: Path
    data_problem: str | None = None  # why data_state is None
    damaged: list[int] = dataclasses.field(default_factory=list)  # newer steps that did not read back
    dropped: list[str] = dataclasses.field(default_factory=list)  # saved arrays this run does not use (``restore(drop=...)``)


class IncompatibleCheckpoint(JaxdistError):
    """A readable checkpoint whose train state does not fit this run (other shapes or
    another optimizer tree): an error, never a reason to fall back or start over."""

    def __init__(self, step: int, path: Path, differences: list[str]):
        self.step, self.path, self.differences = step, path, differences
        super().__init__(f"checkpoint step {step} ({path}) does not fit this run's train state: {'; '.join(differences)}")


class DamagedCheckpoint(Exception):
    """A checkpoint whose files cannot be read back."""


@dataclasses.dataclass(frozen=True)
class _SaveInfo:  # what Orbax's save decision policies read about a step
    step: int
    time: datetime.datetime
    metrics: dict | None = None


def checkpoint_steps(directory: Path) -> list[int]:
    """Committed checkpoint steps in a directory, oldest first (no JAX needed)."""
    if not directory.is_dir():
        return []
    return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit() and p.is_dir())


def move_aside(directory: Path, steps: list[int], kind: str) -> Path | None:
    """Move step folders out of Orbax's sight into ``directory/KIND-TIME/`` (nothing is
    deleted): ``superseded`` for a branch a resume from an older step replaces, ``damaged``
    for checkpoints that would not read back. Process 0 moves; all processes wait for it.
    Returns the folder (None when there was nothing to move)."""
    import jax

    if not steps:
        return None
    aside = directory / f"{kind}-{time.strftime('%Y%m%d-%H%M%S')}"
    if jax.process_index() == 0:
        n = 1
        while aside.exists():  # two moves within a second
            n += 1
            aside = directory / f"{kind}-{time.strftime('%Y%m%d-%H%M%S')}-{n}"
        aside.mkdir()
        for step in steps:
            (directory / str(step)).rename(aside / str(step))
    if jax.process_count() > 1:
        recoverable.sync_global(f"jaxdist: moved {kind} checkpoints aside")
    return aside


def saved_config(step_dir: Path) -> dict | None:
    """The resolved config stored with a checkpoint, read as plain JSON."""
    try:
        return json.loads((step_dir / "config" / "metadata").read_text())
    except (OSError, ValueError):
        return None


def _first_line(error: BaseException, limit: int = 200) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0][:limit]


def _clock_time(seconds: float) -> datetime.datetime:
    """A monotonic clock reading as the datetime Orbax's policies compare."""
    return datetime.datetime.fromtimestamp(seconds, datetime.UTC)


def _array_shapes(tree: Any) -> dict[str, tuple[int, ...]]:
    """Path (``params/blocks/...``) -> shape of every array in a stored tree or a state."""
    import orbax.checkpoint as ocp

    if not isinstance(tree, dict):
        tree = ocp.tree.serialize_tree(tree, keep_empty_nodes=True)
    return {"/".join(map(str, k)): tuple(v.shape) for k, v in ocp.tree.to_flat_dict(tree).items() if hasattr(v, "shape")}


def saved_only(saved_tree: Any, abstract_state: Any) -> list[str]:
    """The paths of the arrays a checkpoint holds that the state a run expects does not."""
    return sorted(_array_shapes(saved_tree).keys() - _array_shapes(abstract_state).keys())


def state_differences(saved_tree: Any, abstract_state: Any, limit: int = 3, *, ignore: frozenset[str] = frozenset()) -> list[str]:
    """How a checkpoint's stored tree (Orbax array metadata) differs from the state a run
    expects: arrays missing on either side and arrays of another shape, a few of each.
    Dtypes may differ (the restore casts). ``ignore``: saved arrays the run drops."""
    have, want = _array_shapes(saved_tree), _array_shapes(abstract_state)
    have = {k: v for k, v in have.items() if k not in ignore}

    def listed(what: str, items: list[str]) -> list[str]:
        if not items:
            return []
        more = f" and {len(items) - limit} more" if len(items) > limit else ""
        return [f"{len(items)} {what}: {', '.join(items[:limit])}{more}"]

    def ordered(keys) -> list[str]:  # the parameters first: they name the model change
        return sorted(keys, key=lambda k: (not k.startswith("params/"), k))

    return [
        *listed("arrays this run needs are not in the checkpoint", ordered(want.keys() - have.keys())),
        *listed("arrays in the checkpoint are not in this run", ordered(have.keys() - want.keys())),
        *listed(
            "arrays have other shapes (checkpoint vs this run)",
            [f"{k} {have[k]} vs {want[k]}" for k in ordered(have.keys() & want.keys()) if have[k] != want[k]],
        ),
    ]


def params_directory(checkpoints: Path) -> Path:
    """Where the weights-only checkpoints of the run whose full ones are in ``checkpoints`` go."""
    return Path(checkpoints).parent / PARAMS_DIR


class Checkpointer:
    """Saves on a schedule (steps and/or minutes), keeps the last N (and optionally the
    best by eval loss), restores the newest readable checkpoint. With ``params_dir`` and
    ``checkpoint.params_every_steps`` it also writes weights-only checkpoints there."""

    def __init__(
        self,
        directory: Path,
        cfg,
        *,
        read_only: bool = False,
        params_dir: Path | None = None,
        processes: tuple[list[int], int] | None = None,
    ):
        """``processes``: (the live processes, the membership epoch) for a process that rejoined
        an in-process recovered run (``use_processes``)."""
        import orbax.checkpoint as ocp
        from orbax.checkpoint import checkpoint_managers as cm

        self.directory = Path(directory)
        self.cfg = cfg
        self._ocp = ocp
        self.manager = orbax_manager.manager(self.directory, cfg, read_only=read_only, keep_best=cfg.keep_best, processes=processes)
        self.params_dir = Path(params_dir) if params_dir is not None else None
        every = getattr(cfg, "params_every_steps", 0)
        wants_params = self.params_dir and every > 0 and not read_only
        self.params_manager = orbax_manager.manager(self.params_dir, cfg, read_only=False, processes=processes) if wants_params else None
        # Time-based saves: process 0's clock decides, through Orbax's policy (which
        # broadcasts the primary host's decision), so every process saves the same steps.
        self._minutes_policy = cm.ContinuousCheckpointingPolicy(minimum_interval_secs=60 * cfg.every_minutes)
        self._decision_context = cm.DecisionContext(
            is_saving_in_progress=False,
            reached_preemption=False,
            multiprocessing_options=ocp.options.MultiprocessingOptions(
                **({} if processes is None else {"primary_host": 0, "active_processes": set(processes[0])})
            ),
        )
        self._last_save_time = time.monotonic()
        self.replicator = None  # checkpoint_tiers.Replicator: copies saved steps to the durable tier (process 0)
        self.reload()

    def use_processes(self, live: list[int], epoch: int) -> None:
        """After an in-process recovery: save with the live processes alone. A save the dead
        process took part in is abandoned (never committed; the newest committed step stands)."""
        import orbax.checkpoint as ocp

        self.manager = orbax_manager.manager(
            self.directory, self.cfg, read_only=False, keep_best=self.cfg.keep_best, processes=(live, epoch)
        )
        if self.params_manager is not None:
            self.params_manager = orbax_manager.manager(self.params_dir, self.cfg, read_only=False, processes=(live, epoch))
        self._decision_context = dataclasses.replace(
            self._decision_context,
            multiprocessing_options=ocp.options.MultiprocessingOptions(primary_host=0, active_processes=set(live)),
        )

    def reload(self) -> None:
        """Re-read the committed steps (after some were moved aside)."""
        self.manager.reload()
        self.last_saved_step: int | None = self.manager.latest_step()
        self._existing_steps = set(self.manager.all_steps())  # from earlier runs: never overwritten
        if self.params_manager is not None:
            self.params_manager.reload()
        self._existing_params_steps = set(self.params_steps())

    def params_steps(self) -> list[int]:
        """The committed weights-only checkpoints' steps, oldest first."""
        return checkpoint_steps(self.params_dir) if self.params_dir is not None else []

    def steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    # -- saving ---------------------------------------------------------------------

    def due(self, step: int) -> bool:
        """Whether to save at ``step``; the same answer on every process (the save is
        collective). Call it at the same steps on all processes."""
        if self.cfg.every_steps > 0 and step % self.cfg.every_steps == 0:
            return True
        if self.cfg.every_minutes <= 0:
            return False
        import jax

        now, saving = time.monotonic(), self.manager.is_saving_in_progress()
        if jax.process_count() == 1:
            return not saving and now - self._last_save_time >= 60 * self.cfg.every_minutes
        previous = _SaveInfo(self.last_saved_step or 0, _clock_time(self._last_save_time))
        context = dataclasses.replace(self._decision_context, is_saving_in_progress=saving)
        return self._minutes_policy.should_save(_SaveInfo(step, _clock_time(now)), [previous], context=context)

    def params_due(self, step: int) -> bool:
        """Whether to write a weights-only checkpoint at ``step`` (the loop skips it where a full one is saved)."""
        return self.params_manager is not None and step % self.cfg.params_every_steps == 0

    def save_params(self, step: int, weights: dict, data_state: dict, config: dict) -> None:
        """Start a weights-only save of ``weights`` ({step, params}), async like ``save``."""
        import grain.checkpoint as grain_checkpoint

        ocp = self._ocp
        if step in self._existing_params_steps:  # as for full checkpoints: a bug, never an overwrite
            raise CheckpointError(
                f"saving weights-only checkpoint at step {step} in {self.params_dir} refused: it already holds one from an earlier run"
            )
        args = ocp.args.Composite(
            state=ocp.args.PyTreeSave(weights),
            data=grain_checkpoint.CheckpointSave(_IteratorState(json.dumps(data_state).encode())),
            config=ocp.args.JsonSave(config),
        )
        try:
            self.params_manager.save(step, args=args, force=True)
        except Exception as e:  # noqa: BLE001 - any failure to write becomes one clear line
            raise CheckpointError(f"saving weights-only checkpoint at step {step} in {self.params_dir} failed ({_first_line(e)})") from None

    def save(self, step: int, state: Any, data_state: dict, config: dict, metrics: dict | None = None) -> None:
        """Start saving (returns once the arrays are copied off the devices when async)."""
        ocp = self._ocp
        import grain.checkpoint as grain_checkpoint

        if step == self.last_saved_step:
            return
        if step in self._existing_steps:  # the resume moves other branches aside: this is a bug, never an overwrite
            raise CheckpointError(
                f"saving checkpoint at step {step} in {self.directory} refused: it already holds a checkpoint from an earlier run"
            )
        args = ocp.args.Composite(
            state=ocp.args.PyTreeSave(state),
            data=grain_checkpoint.CheckpointSave(_IteratorState(json.dumps(data_state).encode())),
            config=ocp.args.JsonSave(config),
        )
        try:
            self.manager.save(step, args=args, metrics=metrics, force=True)
        except Exception as e:  # noqa: BLE001 - any failure to write becomes one clear line
            raise CheckpointError(self._failure(step, e)) from None
        self._last_save_time = time.monotonic()
        self.last_saved_step = step
        if self.replicator is not None:
            self.replicator.submit(step)

    def wait(self) -> None:
        """Block until every started save (of both kinds) has committed."""
        try:
            self.manager.wait_until_finished()
        except Exception as e:  # noqa: BLE001
            raise CheckpointError(self._failure(self.last_saved_step, e)) from None
        if self.params_manager is not None:
            try:
                self.params_manager.wait_until_finished()
            except Exception as e:  # noqa: BLE001
                raise CheckpointError(f"saving a weights-only checkpoint in {self.params_dir} failed ({_first_line(e)})") from None
        if self.replicator is not None and self.last_saved_step is not None:
            self.replicator.submit(self.last_saved_step, last=True)  # the last save is always copied
            self.replicator.wait()

    def _failure(self, step: int | None, error: Exception) -> str:
        committed = [s for s in checkpoint_steps(self.directory) if s != step]
        last = f"last good checkpoint: step {committed[-1]}" if committed else "no earlier checkpoint"
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        return f"saving checkpoint at step {step} in {self.directory} failed ({reason}); {last}"

    def close(self) -> None:
        self.manager.close()
        if self.replicator is not None:
            self.replicator.close()
        if self.params_manager is not None:
            self.params_manager.close()

    # -- restoring ------------------------------------------------------------------

    def restore(self, step: int, abstract_state: Any, *, drop=None) -> Restored:
        """One step, into the shardings of ``abstract_state`` (or of ``abstract_state(saved
        tree)`` when it is a callable: a target that depends on what was saved). Raises
        ``IncompatibleCheckpoint`` when its stored tree does not fit (checked before any
        array is read) and ``DamagedCheckpoint`` when its files cannot be read. ``drop``:
        a predicate on array paths the checkpoint may hold and this run leaves unread
        (listed in ``Restored.dropped``)."""
        ocp = self._ocp
        step_dir = self.directory / str(step)
        try:
            saved_tree = self.manager.item_metadata(step)["state"]
        except Exception as e:  # noqa: BLE001 - unreadable metadata: a damaged checkpoint
            raise DamagedCheckpoint(f"{step_dir / 'state'}: {_first_line(e)}") from None
        if callable(abstract_state):
            abstract_state = abstract_state(saved_tree)
        dropped = []
        if saved_tree is not None:
            dropped = [path for path in saved_only(saved_tree, abstract_state) if drop is not None and drop(path)]
            differences = state_differences(saved_tree, abstract_state, ignore=frozenset(dropped))
            if differences:
                raise IncompatibleCheckpoint(step, step_dir, differences)
        error = None
        try:
            if dropped:  # a subset of what was saved: Orbax's partial restore reads only the target's arrays
                state = _partial_restore(step_dir / "state", abstract_state)
            else:
                state = self.manager.restore(step, args=ocp.args.Composite(state=_whole_restore(ocp, abstract_state)))["state"]
        except Exception as e:  # noqa: BLE001 - damaged files; agreed on below
            error = f"{step_dir / 'state'}: {_first_line(e)}"
        if not _all_processes_ok(error is None):  # fall back together, or not at all
            raise DamagedCheckpoint(error or "unreadable on another process")
        data_state, data_problem = self._restore_data(step)
        return Restored(step, state, data_state, saved_config(step_dir) or {}, step_dir, data_problem, dropped=dropped)

    def _restore_data(self, step: int) -> tuple[dict | None, str | None]:
        return read_data_state(self.directory / str(step))

    def restore_latest(self, abstract_state: Any, *, drop=None) -> Restored | None:
        """The newest checkpoint that reads back, or None when there is none.

        A damaged one is reported and the previous one tried (nothing is deleted; the
        damaged steps are listed in ``Restored.damaged``); one that does not fit this run
        raises ``IncompatibleCheckpoint``; when every checkpoint is damaged this raises
        rather than start over from step 0.
        """
        steps = sorted(self.manager.all_steps())
        damaged = []
        for step in reversed(steps):
            try:
                restored = self.restore(step, abstract_state, drop=drop)
                restored.damaged = damaged
                return restored
            except DamagedCheckpoint as e:
                damaged.append(step)
                log.warning(f"checkpoint step {step} is damaged ({e}); trying the previous one (nothing is deleted)")
        if not steps:
            return None
        raise JaxdistError(
            f"no checkpoint in {self.directory} can be read (steps {', '.join(map(str, sorted(damaged)))} are damaged; nothing was deleted); "
            "to start over use --resume never with a new --run-dir"
        )


def _whole_restore(ocp, abstract_state: Any):
    """Orbax's arguments to read a stored state into ``abstract_state``'s shapes and shardings."""
    return ocp.args.PyTreeRestore(item=abstract_state, restore_args=ocp.checkpoint_utils.construct_restore_args(abstract_state))


def _partial_restore(state_dir: Path, abstract_state: Any) -> Any:
    """The arrays of ``abstract_state`` from a stored state that holds more."""
    import orbax.checkpoint as ocp

    handler = ocp.PyTreeCheckpointHandler()
    try:
        restore_args = ocp.checkpoint_utils.construct_restore_args(abstract_state)
        return handler.restore(state_dir, args=ocp.args.PyTreeRestore(item=abstract_state, restore_args=restore_args, partial_restore=True))
    finally:
        handler.close()


def read_data_state(step_dir: Path) -> tuple[dict | None, str | None]:
    """This process's data-iterator state saved in a checkpoint (either kind), or why there is none to use."""
    import grain.checkpoint as grain_checkpoint
    import jax

    data_dir = Path(step_dir) / "data"
    index, count = jax.process_index(), jax.process_count()
    if not (data_dir / f"process_{index}-of-{count}.json").exists():
        written = sorted({p.name.split("-of-")[-1].removesuffix(".json") for p in data_dir.glob("process_*-of-*.json")})
        by = f"saved by {' or '.join(written)} process(es)" if written else "no data state saved"
        return None, f"{by}, this run has {count}"
    try:
        holder = _IteratorState()
        grain_checkpoint.CheckpointHandler().restore(data_dir, args=grain_checkpoint.CheckpointRestore(holder))
        return json.loads(holder.state.decode()), None
    except Exception as e:  # noqa: BLE001 - reported by the caller, which resumes the data by step
        return None, f"{data_dir} is unreadable ({_first_line(e)})"


def _all_processes_ok(ok: bool) -> bool:
    """Whether ``ok`` holds on every process (a collective when there are several)."""
    import jax

    if jax.process_count() == 1:
        return ok
    import numpy as np

    return bool(np.all(recoverable.process_allgather(np.int32(ok), "checkpoint-ok")))


def parse_resume(resume: str, checkpoints: Path) -> tuple[str, Path, int | None]:
    """``auto`` | ``never`` | STEP | PATH -> (mode, checkpoint directory, step). (``params:STEP``
    and weights-only PATHs are taken apart before: ``resume.weights_resume``.)"""
    if resume in ("auto", "never"):
        return resume, checkpoints, None
    if resume.isdigit():
        step = int(resume)
        if step not in checkpoint_steps(checkpoints):
            raise JaxdistError(
                f"--resume {step}: no checkpoint at step {step} in {checkpoints} (have {checkpoint_steps(checkpoints) or 'none'})"
            )
        return "step", checkpoints, step
    path = Path(resume)
    if path.name.isdigit() and path.is_dir():
        return "step", path.parent, int(path.name)
    if checkpoint_steps(path):
        return "latest", path, None
    raise JaxdistError(f"--resume {resume!r}: not auto, never, a step, or a checkpoint directory")
