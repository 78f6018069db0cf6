"""``data.reference_logps``: DPO's reference log-probabilities computed once and stored beside
the data, in place of the frozen reference model in the train state (``training.dpo``).

Before the data is opened (``ensure_reference_logps``): with a file at the path, a run reads it
and checks it holds these pairs' rows (``data.reference_logps``); a fresh run also checks that
its reference (``--init-from``'s checkpoint, or the seed and the model's configuration) is the
one the file was computed from, and a resumed run, whose reference was its initial weights,
trusts the file it started with. Without a file, a fresh run computes it from its initial
weights in one pass over every pair, in order, on the run's mesh (the same forward as the
default mode's reference, each row alone), process 0 writes it, and training starts; a resumed
run without it is refused in one line (its initial weights are gone).

The steps then read each row's reference log-probability from the batch: the train state holds
no copy of the weights, a checkpoint no reference, and a step runs no reference forward.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils

from jaxdist.cluster import recoverable
from jaxdist.config import Config
from jaxdist.data import reference_logps
from jaxdist.data.batches import HeldOut, PaddedExamples, eval_batches
from jaxdist.data.preference import PreferencePairs, preference_pairs
from jaxdist.errors import JaxdistError
from jaxdist.layout.step_context import installed
from jaxdist.training.checkpoint import checkpoint_steps
from jaxdist.training.checkpoint_tiers import durable_steps
from jaxdist.training.dpo import row_logps
from jaxdist.training.resume import initial_weights
from jaxdist.training.weights import find_checkpoint

log = logging.getLogger(__name__)


def reference_identity(config: Config, init_from: str | None) -> dict:
    """What the run's reference is: its initial weights, named by where they come from."""
    identity = (
        {"init_from": str(find_checkpoint(init_from))} if init_from else {"seed": config.train.seed, "model": config.to_dict()["model"]}
    )
    return json.loads(json.dumps(identity))  # as the file's JSON gives it back (lists, not tuples)


def ensure_reference_logps(trainer: Any, config: Config, plan: Any) -> None:
    """The file of ``data.reference_logps`` for the pairs and reference of the run ``plan``
    (``run_plan.RunPlan``) describes: checked, or computed and written."""
    init_from, path = plan.init_from, config.data.reference_logps
    own = plan.run_dir is not None and bool(checkpoint_steps(plan.run_dir / "checkpoints"))
    resuming = recoverable.rejoining() or own or bool(plan.durable_dir and durable_steps(plan.durable_dir))
    if "://" in path:
        raise JaxdistError(f"data.reference_logps {path}: a local path (the file is read by every process at start)")
    pairs = preference_pairs(config, with_reference=False)
    digest, rows = pairs.digest(), 2 * len(pairs)
    if Path(path).exists():
        _, meta = reference_logps.read(path, digest, rows)
        identity = reference_identity(config, init_from)
        if not resuming and meta.get("reference") != identity:
            raise JaxdistError(
                f"data.reference_logps {path} holds the log-probabilities of another reference ({_describe(meta.get('reference'))}), "
                f"not this run's ({_describe(identity)}): give a new path to compute them"
            )
        log.info(f"data.reference_logps: {rows} rows' reference log-probabilities from {path} (no reference model in the train state)")
        return
    if resuming:
        raise JaxdistError(
            f"data.reference_logps {path}: no such file, and a resumed run no longer has the initial weights it was computed from"
        )
    logps = compute(trainer, config, init_from, pairs)
    if jax.process_index() == 0:
        reference_logps.write(path, logps, digest, reference_identity(config, init_from))
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices("jaxdist: data.reference_logps written")
    log.info(f"data.reference_logps: {rows} rows' reference log-probabilities computed from the initial weights, written to {path}")


def compute(trainer: Any, config: Config, init_from: str | None, pairs: PreferencePairs) -> np.ndarray:
    """Every row's log-probability under the run's initial weights [2 x pairs], in pair order."""
    params = trainer.init_state(config.train.seed, initial_weights(trainer, init_from) if init_from else None).params

    def logps(params: Any, batch: dict) -> jax.Array:
        with installed(trainer.context()):
            return row_logps(nnx.merge(trainer.graphdef, params), batch)

    forward = jax.jit(logps, in_shardings=(trainer.param_shardings, None), out_shardings=trainer.layout.replicated())
    per_batch = config.train.global_batch // PreferencePairs.rows_per_example
    batches = -(-len(pairs) // per_batch)  # the last one padded (padding rows have no loss mask: 0)
    split = HeldOut(PaddedExamples(pairs, batches * per_batch), batches, len(pairs), batches)
    found = [np.asarray(forward(params, batch)) for batch in eval_batches(config, trainer.layout, split)]
    return np.concatenate(found)[: 2 * len(pairs)].astype(np.float32)


def _describe(reference: Any) -> str:
    if isinstance(reference, dict) and reference.get("init_from"):
        return f"--init-from {reference['init_from']}"
    if isinstance(reference, dict) and "seed" in reference:
        return f"seed {reference['seed']} and the model configuration it was computed with"
    return "unknown"
