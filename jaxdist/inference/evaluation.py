"""A checkpoint's loss and perplexity on held-out data (``python -m jaxdist.eval``).

Each held-out window of ``train.seq_len`` tokens (``jaxdist.data.batches.held_out``) is
scored once, in order, in at most ``train.eval_batches`` batches of ``train.global_batch``
(the last one padded), the same ones for every checkpoint, so two checkpoints compare
directly. ``tokens`` counts the targets actually scored (predictions across an end of
document carry no loss).
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jaxdist.config import Config
from jaxdist.data.batches import eval_batches, held_out
from jaxdist.errors import JaxdistError
from jaxdist.inference.loading import load

log = logging.getLogger(__name__)


def evaluate(config: Config, step_dir: Path) -> dict[str, Any]:
    """Score the checkpoint in ``step_dir`` (its ``config`` as ``jaxdist.inference.loading.load_config``
    gives it): ``loss`` (mean per scored token), ``perplexity``, ``tokens``, ``batches``,
    ``windows``, ``checkpoint`` and ``step``; one line says so when the split holds
    fewer batches than asked. Raises JaxdistError (one line) for bad data or a split that
    scores no token."""
    loaded = load(config, step_dir)
    trainer = loaded.trainer
    split = held_out(config)
    if split.batches < split.asked:
        log.info(
            f"the held-out split has {split.examples} window(s) of {config.train.seq_len} tokens: "
            f"{split.batches} batch(es) of {config.train.global_batch}, not the {split.asked} asked; each window is scored once"
        )
    totals = np.zeros(2, np.float64)
    for batch in eval_batches(config, trainer.layout, split):
        totals += np.asarray(jax.device_get(trainer.eval_step(loaded.params, batch)), np.float64)
    if totals[1] == 0:
        raise JaxdistError("the held-out windows hold no scored token (every target is an end of document)")
    loss = float(totals[0] / totals[1])
    return {
        "loss": loss,
        "perplexity": math.exp(loss),
        "tokens": int(totals[1]),
        "batches": split.batches,
        "windows": split.examples,
        "checkpoint": str(step_dir),
        "step": loaded.step,
    }
