"""A checkpoint's loss and perplexity on held-out data, or its scores on lm-evaluation-harness
tasks (``python -m jaxdist.eval``, ``--tasks``: ``jaxdist.inference.harness``).

Each held-out window of ``train.seq_len`` tokens (``jaxdist.data.batches.held_out``) is
scored once, in order, in at most ``train.eval_batches`` batches of ``train.global_batch``
(the last one padded), the same ones for every checkpoint, so two checkpoints compare
directly. ``tokens`` counts the targets actually scored (predictions across an end of
document carry no loss).
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jaxdist.config import Config
from jaxdist.data.batches import eval_batches, held_out
from jaxdist.data.chat_template import find_chat_template
from jaxdist.data.tokenizers import load_tokenizer
from jaxdist.errors import JaxdistError
from jaxdist.inference import harness
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


def evaluate_tasks(
    config: Config,
    step_dir: Path,
    tasks: list[str],
    *,
    include_path: str | None = None,
    num_fewshot: int | None = None,
    limit: int | None = None,
    apply_chat_template: bool = False,
    batch_size: int = 16,
) -> dict[str, Any]:
    """lm-evaluation-harness ``tasks`` on the checkpoint in ``step_dir``: ``tasks`` ({task:
    {metric: value}}), ``checkpoint``, ``step``, ``seconds``; written to ``RUN_DIR/eval/STEP.json``
    when the checkpoint is a run's (``eval_file`` says where). The model reads at most
    ``train.seq_len`` tokens; the run's tokenizer turns text into ids."""
    harness.go_offline()
    tokenizer = load_tokenizer(config.data.tokenizer or None)
    template = find_chat_template(config.data.chat_template, config.data.tokenizer) if apply_chat_template else None
    loaded = load(config, step_dir, used_keys=("data.chat_template",) if apply_chat_template else ())
    scorer = harness.Scorer(loaded.trainer, loaded.params, config.train.seq_len, batch_size)
    lm = harness.adapter(scorer, harness.HarnessText(tokenizer, template, name=tokenizer.name))
    start = time.perf_counter()
    results = harness.run_tasks(
        lm, tasks, include_path=include_path, num_fewshot=num_fewshot, limit=limit, apply_chat_template=apply_chat_template
    )
    result = {"tasks": results, "checkpoint": str(step_dir), "step": loaded.step, "seconds": round(time.perf_counter() - start, 3)}
    path = harness.write_results(step_dir, result)
    return {**result, "eval_file": str(path) if path else None}
