"""Where a run starts: fresh, or from a checkpoint (its state and its data position).

Used by ``jaxdist.training.run``; kept apart so that the rules for resuming -- which checkpoint,
what happens on another mesh or process count -- live in one small module.
"""

from __future__ import annotations

import logging
from pathlib import Path

from jaxdist.config import Config
from jaxdist.errors import JaxdistError
from jaxdist.layout.mesh import MeshSizes

log = logging.getLogger(__name__)


def adapt_microbatches_for_resume(config: Config, sizes: MeshSizes | None) -> None:
    """Elastic restart keeps the global batch: when the new mesh cannot split it into the
    configured microbatches (and, on a pipe axis, the pipeline's microbatches), use the
    largest count that fits (pure Python, before JAX; ``run_plan.resolve_run`` calls it
    for a run that resumes)."""
    from jaxdist.layout.validate import batch_shards, fitting_microbatches

    t = config.train
    if sizes is None:
        return
    fitting = fitting_microbatches(config, sizes)
    if fitting is None or fitting == t.microbatches:
        return  # fits as configured, or nothing fits (check_config_on_mesh says why)
    log.info(
        f"resuming on replica x data x fsdp x expert = {batch_shards(sizes)}: train.microbatches {t.microbatches} -> {fitting} "
        f"keeps the global batch {t.global_batch}"
    )
    t.microbatches = fitting


def restore_checkpoint(trainer, config: Config, run_dir: Path, resume: str, checkpointer, weights_dir: Path | None = None):
    """The restored checkpoint for ``--resume``, or None to start fresh (only when there
    is no checkpoint of either kind). A checkpoint that does not fit this run's state is
    an error, as is a damaged one asked for by step, or every checkpoint being damaged.
    ``weights_dir``: a weights-only checkpoint named to resume from (``weights_resume``)."""
    from jaxdist.training.checkpoint import Checkpointer, DamagedCheckpoint, IncompatibleCheckpoint, parse_resume

    if weights_dir is not None:
        restored = restore_weights(trainer, config, weights_dir)
        if checkpointer is not None:  # None: a library run without a run directory
            own = checkpointer.params_dir is not None and weights_dir.parent.absolute() == checkpointer.params_dir.absolute()
            _set_aside_other_branches(checkpointer, restored, own, weights_only=True)
        return restored
    mode, directory, step = parse_resume(resume, run_dir / "checkpoints")
    if mode == "never":
        return None
    if mode == "auto" and not checkpointer.steps() and checkpointer.params_steps():
        light = checkpointer.params_steps()
        raise JaxdistError(
            f"--resume auto: {run_dir} has weights-only checkpoints (steps {', '.join(map(str, light))}) but no full one to resume "
            f"exactly; --resume params:{light[-1]} continues from those weights with a fresh optimizer, or use --resume never with a new --run-dir"
        )
    from jaxdist.models import fp8

    own = directory.absolute() == checkpointer.directory.absolute()
    source = checkpointer if own else Checkpointer(directory, config.checkpoint, read_only=True)
    drop = fp8.is_history_path  # a delayed-scaling checkpoint resumed without delayed scaling: its histories stay unread
    try:
        if mode == "step":
            restored = source.restore(step, trainer.restore_target, drop=drop)
        else:
            restored = source.restore_latest(trainer.restore_target, drop=drop)
        if restored is not None:
            if restored.dropped:
                log.info(
                    f"checkpoint step {restored.step} holds {len(restored.dropped)} fp8 amax histories (model.fp8=delayed) that this run "
                    f"(model.fp8={config.model.fp8}) does not use; dropped"
                )
            restored.state = trainer.adapt_restored(restored.state)
            _set_aside_other_branches(checkpointer, restored, own)
        return restored
    except DamagedCheckpoint as e:  # asked for by step: no fallback
        raise JaxdistError(f"--resume {resume}: checkpoint step {step} is damaged ({e}); nothing was deleted") from None
    except IncompatibleCheckpoint as e:
        raise JaxdistError(
            f"{e}{_config_changes(e.path, config)}; resume with the settings it was saved with, or use --resume never with a new --run-dir"
        ) from None
    finally:
        if not own:
            source.close()


def _set_aside_other_branches(checkpointer, restored, own: bool, *, weights_only: bool = False) -> None:
    """The run continues from ``restored``: its own checkpoints of either kind that are not
    on this branch (newer steps, or every step when it resumes from another run's) and the
    damaged ones it fell back from are moved aside, so the new branch's saves happen and
    ``--resume auto`` never picks them (nothing is deleted). ``own``: ``restored`` is this
    run's (of the kind ``weights_only`` says)."""
    from jaxdist.training.checkpoint import move_aside

    damaged = restored.damaged if own else []
    why = f"the run continues from {restored.path}" if not own else f"the run continues from step {restored.step}"
    # A full checkpoint at the weights-only one's step is another branch's state: newer, as it were.
    full_kept = (lambda s: s < restored.step) if weights_only else (lambda s: s <= restored.step)
    other = [s for s in checkpointer.steps() if s not in damaged and not (own and full_kept(s))]
    light = [s for s in checkpointer.params_steps() if not (own and s <= restored.step)]
    moves = [(checkpointer.directory, "damaged", damaged, "they do not read back"), (checkpointer.directory, "superseded", other, why)]
    if checkpointer.params_dir is not None:
        moves.append((checkpointer.params_dir, "superseded", light, why))
    for directory, kind, steps, reason in moves:
        aside = move_aside(directory, steps, kind)
        if aside is not None:
            what = "weights-only checkpoint" if directory == checkpointer.params_dir else "checkpoint"
            log.info(f"{what} step(s) {', '.join(map(str, steps))} moved to {aside} ({reason}; nothing was deleted)")
    if damaged or other or light:
        checkpointer.reload()


# Keys that change between the runs of one training without changing the state's shape.
_RESUME_NOISE = {
    "train.steps",
    "train.schedule_steps",
    "train.stop_after_step",
    "train.log_every",
    "train.microbatches",
    "train.compile_cache",
    "parallel.mesh",
    "parallel.dcn_mesh",
}


def _config_changes(step_dir: Path, config: Config, limit: int = 4) -> str:
    """`` (config changed since: key old -> new, ...)`` for the model, train and parallel
    keys, as a hint to what made the state differ; empty when nothing is known."""
    from jaxdist.training.checkpoint import saved_config

    def flat(tree: dict, prefix: str = "") -> dict:
        out = {}
        for key, value in tree.items():
            if isinstance(value, dict):
                out.update(flat(value, f"{prefix}{key}."))
            else:
                out[f"{prefix}{key}"] = value
        return out

    saved = saved_config(step_dir)
    if not saved:
        return ""
    old, new = flat({k: saved.get(k, {}) for k in ("model", "train", "parallel")}), flat(config.to_dict())
    changed = [f"{k} {old[k]} -> {new[k]}" for k in sorted(old.keys() & new.keys()) if old[k] != new[k] and k not in _RESUME_NOISE]
    if not changed:
        return ""
    more = f", {len(changed) - limit} more" if len(changed) > limit else ""
    return f" (config changed since: {', '.join(changed[:limit])}{more})"


def schedule_change(restored, config: Config) -> str | None:
    """One line when the learning-rate schedule differs from the checkpoint's: its length
    (a resume with another ``--steps`` re-stretches the decay unless it is pinned), its
    shape, warmup or floor."""
    saved = restored.config.get("train", {})
    if "steps" not in saved:
        return None
    t = config.train
    before = saved.get("schedule_steps") or saved["steps"]
    now = t.schedule_length()
    if before != now:
        return (
            f"the learning-rate schedule now spans {now} steps; checkpoint step {restored.step} was trained on one of {before} "
            f"(set train.schedule_steps={before} to keep it)"
        )
    shape = ("schedule", "warmup_steps", "min_lr_ratio", "decay_fraction", "lr")
    changed = [f"train.{k} {saved[k]} -> {getattr(t, k)}" for k in shape if k in saved and saved[k] != getattr(t, k)]
    if not changed:
        return None
    return f"the learning-rate schedule changed since checkpoint step {restored.step} ({', '.join(changed)}); the new one applies from here"


PARAMS_RESUME = "params:"  # --resume params:STEP: this run's weights-only checkpoint STEP


def weights_resume(resume: str, init_from: str | None, run_dir: Path | None = None) -> tuple[str, str | None, Path | None]:
    """``--resume`` naming a weights-only checkpoint: ``params:STEP`` (this run's
    ``RUN_DIR/params/STEP``) or a PATH that holds weights only. One at step 0 (a converted
    model) starts from its weights as ``--init-from PATH`` would; one at a later step (a
    light checkpoint) continues the run from it (``restore_weights``). Returns (resume,
    init_from, weights step directory to continue from)."""
    from jaxdist.training.checkpoint import PARAMS_DIR, checkpoint_steps
    from jaxdist.training.weights import find_checkpoint, is_weights_only

    if resume.startswith(PARAMS_RESUME):
        step = resume.removeprefix(PARAMS_RESUME)
        directory = (run_dir / PARAMS_DIR).absolute() if run_dir is not None else None
        have = checkpoint_steps(directory) if directory is not None else []
        if not step.isdigit() or int(step) not in have:
            where = f"in {directory} (have {', '.join(map(str, have)) or 'none'})" if directory is not None else "without a --run-dir"
            raise JaxdistError(f"--resume {resume}: no weights-only checkpoint at step {step} {where}")
        step_dir = directory / str(int(step))
    elif resume in ("auto", "never") or resume.isdigit():
        return resume, init_from, None
    else:
        step_dir = find_checkpoint(resume)
        if not is_weights_only(step_dir):
            return resume, init_from, None
    if init_from:
        raise JaxdistError(f"--resume {resume} holds weights only; give it as --init-from, not with another --init-from {init_from}")
    if int(step_dir.name) == 0:
        log.info(f"--resume {resume} holds weights only: starting from them at step 0 with a fresh optimizer (as --init-from)")
        return "auto", resume, None
    return resume, None, step_dir


def restore_weights(trainer, config: Config, step_dir: Path):
    """A run continued from a weights-only checkpoint: its parameters, step and data
    position, with a fresh optimizer (zero moments, its learning-rate schedule from the
    start) and fresh loss scale / residuals; said in one line."""
    import jax
    import jax.numpy as jnp

    from jaxdist.training.checkpoint import Restored, read_data_state, saved_config
    from jaxdist.training.weights import restore_params

    step = int(step_dir.name)
    state = trainer.init_state(config.train.seed, restore_params(step_dir, trainer.abstract_params()))
    state.step = jax.jit(lambda: jnp.asarray(step, jnp.int32), out_shardings=trainer.state_shardings.step)()
    data_state, data_problem = read_data_state(step_dir)
    log.info(
        f"{step_dir} holds weights only: continuing from its weights at step {step}; the optimizer state starts fresh "
        "(zero moments, its learning-rate schedule from the start)"
    )
    return Restored(step, state, data_state, saved_config(step_dir) or {}, step_dir, data_problem)


def initial_weights(trainer, init_from: str):
    """The parameters ``--init-from`` names, read into this run's shardings."""
    from jaxdist.training.weights import find_checkpoint, restore_params

    step_dir = find_checkpoint(init_from)
    params = restore_params(step_dir, trainer.abstract_params())
    log.info(f"weights from {step_dir}; optimizer state fresh, starting at step 0")
    return params


def continue_data(batches, restored, config: Config, layout):
    """Put the data stream where the checkpoint left it: from the data state saved by
    this process layout, else -- saying so -- by step (batch k is a function of k alone)."""
    saved_batch = restored.config.get("train", {}).get("global_batch")
    if saved_batch not in (None, config.train.global_batch):
        log.warning(
            f"train.global_batch changed {saved_batch} -> {config.train.global_batch}; the data stream restarts its order at step {restored.step}"
        )
    problem = restored.data_problem or "none saved"
    if restored.data_state is not None:
        try:
            batches.set_state(restored.data_state)
            return batches
        except Exception as e:  # noqa: BLE001 - e.g. another worker count: resume by step, saying so
            problem = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
    from jaxdist.data.batches import make_iterator

    log.warning(f"data state of checkpoint step {restored.step} not restored ({problem}); data resumed by step {restored.step}")
    batches.close()
    return make_iterator(config, layout, start_step=restored.step)
