"""Weights alone: the parameters of any checkpoint, and checkpoints that hold nothing else.

``jaxdist.convert from-hf`` writes a *weights checkpoint*: an ordinary checkpoint
directory (``OUT/checkpoints/0``) whose state holds only ``step`` and ``params``, plus
the config that describes the model. ``--init-from``, ``--resume PATH``, ``generate``,
``eval`` and ``to-hf`` read the parameters of it or of any training checkpoint (for
DiLoCo, the outer parameters), straight into the shardings they are given.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from jaxdist.config import Config, config_from_dict
from jaxdist.errors import JaxdistError
from jaxdist.training.checkpoint import checkpoint_steps, saved_config
from jaxdist.training.orbax_manager import state_handler

log = logging.getLogger(__name__)


def find_checkpoint(path: str | Path) -> Path:
    """The step directory ``path`` names: a step directory itself, a checkpoints
    directory or a run directory (their newest step); in object storage, its newest complete
    copy fetched into a local cache (``checkpoint_tiers.fetch_checkpoint``)."""
    from jaxdist.storage.remote import is_remote

    if is_remote(path):
        from jaxdist.training.checkpoint_tiers import fetch_checkpoint

        return fetch_checkpoint(str(path))
    path = Path(path).absolute()  # Orbax wants absolute paths
    if path.name.isdigit() and (path / "state").is_dir():
        return path
    for directory in (path / "checkpoints", path):
        steps = checkpoint_steps(directory)
        if steps:
            return directory / str(steps[-1])
    if not path.exists():
        raise JaxdistError(f"checkpoint {path}: no such file or directory")
    raise JaxdistError(f"checkpoint {path}: not a checkpoint, a checkpoints directory or a run directory with checkpoints")


def checkpoint_config(step_dir: Path, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """The config a checkpoint was saved with, with ``key=value`` overrides on top."""
    saved = saved_config(step_dir)
    if saved is None:
        raise JaxdistError(f"checkpoint {step_dir}: its config ({step_dir / 'config'}) is missing or unreadable")
    data = saved.get("data")
    tokenizer = data.get("tokenizer") if isinstance(data, dict) else None
    if isinstance(tokenizer, str) and tokenizer not in ("", "byte") and not Path(tokenizer).is_absolute():
        # relative to the run directory (``from-hf`` writes ``hf_source/tokenizer.json``): the folder can move
        saved = {**saved, "data": {**data, "tokenizer": str(run_directory(step_dir) / tokenizer)}}
    return config_from_dict(saved, overrides)


def run_directory(step_dir: Path) -> Path:
    """The run (or converted) directory a step directory ``RUN/checkpoints/STEP`` belongs to."""
    return step_dir.parent.parent


def state_tree(step_dir: Path) -> dict:
    """The stored state's tree of array metadata (shapes, dtypes), nothing read."""
    import orbax.checkpoint as ocp

    try:
        return ocp.PyTreeCheckpointHandler().metadata(step_dir / "state").tree
    except Exception as e:  # noqa: BLE001 - any unreadable metadata is one line
        raise JaxdistError(
            f"checkpoint {step_dir}: cannot read its state ({(str(e).splitlines() or [type(e).__name__])[0][:200]})"
        ) from None


def is_weights_only(step_dir: Path) -> bool:
    """Whether a checkpoint holds parameters without optimizer state (a converted model)."""
    return "opt_state" not in state_tree(step_dir)


def param_tree_key(step_dir: Path) -> tuple[str, ...]:
    """Where a checkpoint's model parameters are in its state: ``params``, or for DiLoCo
    (whose ``params`` are per replica) the outer parameters."""
    tree = state_tree(step_dir)
    return ("outer", "params") if isinstance(tree.get("outer"), dict) and "params" in tree["outer"] else ("params",)


def _params_target(step_dir: Path, abstract_params: Any) -> dict:
    """The partial-restore target for a checkpoint's parameters; raises when they do not fit."""
    from jaxdist.models import fp8
    from jaxdist.training.checkpoint import saved_only, state_differences

    saved, key = state_tree(step_dir), param_tree_key(step_dir)
    for part in key:
        saved = saved.get(part, {})

    def nested(leaf: Any) -> dict:
        for part in reversed(key):
            leaf = {part: leaf}
        return leaf

    target = nested(abstract_params)
    # fp8 amax histories of a delayed-scaling checkpoint stay unread when this run has none (restore_params says so)
    ignore = frozenset(path for path in saved_only(nested(saved), target) if fp8.is_history_path(path))
    differences = state_differences(nested(saved), target, ignore=ignore)
    if differences:
        raise JaxdistError(f"checkpoint {step_dir}: its parameters do not fit this model: {'; '.join(differences)}")
    return target


def check_params_fit(step_dir: Path, abstract_params: Any) -> None:
    """Raise (one line) unless the checkpoint's parameters fit ``abstract_params`` (fp8
    histories it lacks start empty); reads metadata only."""
    from jaxdist.models import fp8

    if _histories_missing(step_dir, abstract_params) is not None:
        abstract_params = fp8.split(abstract_params)[1]
    _params_target(step_dir, abstract_params)


def restore_params(step_dir: Path, abstract_params: Any) -> Any:
    """The parameters of a checkpoint, read into the shapes, dtypes (cast) and shardings of
    ``abstract_params`` (an ``nnx.State`` of ``jax.ShapeDtypeStruct``); the rest of its
    state is not read. A DiLoCo checkpoint gives its outer (synchronised) parameters."""

    import jax
    import jax.numpy as jnp

    from jaxdist.models import fp8

    histories = _histories_missing(step_dir, abstract_params)
    if histories is not None:  # weights of a run without delayed fp8: its amax histories start empty
        rest = restore_params(step_dir, fp8.split(abstract_params)[1])
        log.info(
            f"{step_dir} has no fp8 amax histories (model.fp8=delayed): they start empty (the next step quantises with scale 1 and fills them)"
        )
        return fp8.merge(jax.tree.map(lambda a: jax.jit(lambda: jnp.zeros(a.shape, a.dtype), out_shardings=a.sharding)(), histories), rest)
    restored = read_arrays(step_dir, _params_target(step_dir, abstract_params))
    if not fp8.has_history(abstract_params) and fp8.holds_history(_saved_params(step_dir)):
        log.info(f"{step_dir} holds fp8 amax histories (model.fp8=delayed) that this model does not use: dropped")
    for part in param_tree_key(step_dir):
        restored = restored[part]
    return restored


def _saved_params(step_dir: Path) -> dict:
    saved = state_tree(step_dir)
    for part in param_tree_key(step_dir):
        saved = saved.get(part, {})
    return saved


def _histories_missing(step_dir: Path, abstract_params: Any):
    """The fp8 histories ``abstract_params`` holds when the checkpoint holds none (else None)."""
    from jaxdist.models import fp8

    if not fp8.has_history(abstract_params):
        return None
    return None if fp8.holds_history(_saved_params(step_dir)) else fp8.split(abstract_params)[0]


def read_arrays(step_dir: Path, target: dict) -> dict:
    """The arrays of a checkpoint's state that ``target`` (a nested dict of abstract arrays,
    a subset of the stored tree) names, cast and sharded as it says."""
    import orbax.checkpoint as ocp

    handler = ocp.PyTreeCheckpointHandler()
    try:
        args = ocp.args.PyTreeRestore(item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target), partial_restore=True)
        return handler.restore(step_dir / "state", args=args)
    except Exception as e:  # noqa: BLE001 - damaged files are one line, nothing is changed
        raise JaxdistError(
            f"checkpoint {step_dir}: cannot read its parameters ({(str(e).splitlines() or [type(e).__name__])[0][:200]})"
        ) from None
    finally:
        handler.close()


def save_weights(run_dir: Path, params: Any, config: Config, step: int = 0) -> Path:
    """Write ``params`` as a weights checkpoint ``RUN_DIR/checkpoints/STEP`` with its
    config (and ``RUN_DIR/config.yaml``); returns the step directory."""
    import jax.numpy as jnp
    import orbax.checkpoint as ocp
    import yaml

    directory = (Path(run_dir) / "checkpoints").absolute()
    # At most ~1 GB of arrays in flight while writing: the host already holds the whole output.
    handlers = {"state": state_handler(save_concurrent_gb=1), "config": ocp.JsonCheckpointHandler()}
    with ocp.CheckpointManager(directory, item_handlers=handlers) as manager:
        state = {"step": jnp.asarray(step, jnp.int32), "params": params}
        manager.save(step, args=ocp.args.Composite(state=ocp.args.PyTreeSave(state), config=ocp.args.JsonSave(config.to_dict())))
        manager.wait_until_finished()
    (Path(run_dir) / "config.yaml").write_text(yaml.safe_dump(config.to_dict(), sort_keys=False))
    return directory / str(step)
