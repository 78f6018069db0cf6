"""Where a run starts: fresh, or from a checkpoint (its state and its data position).

Used by ``jaxdist.run``; kept apart so that the rules for resuming -- which checkpoint,
what happens on another mesh or process count -- live in one small module.
"""

from __future__ import annotations

import sys
from pathlib import Path

from jaxdist.config import Config
from jaxdist.mesh import parse_mesh


def adapt_microbatches_for_resume(config: Config, run_dir: Path | None, resume: str) -> None:
    """Elastic restart keeps the global batch: when the new mesh cannot split it into the
    configured microbatches, use the largest count that fits (pure Python, before JAX)."""
    from jaxdist.checkpoint import checkpoint_steps

    sizes, t = parse_mesh(config.parallel.mesh), config.train
    if sizes is None or run_dir is None or resume == "never" or not checkpoint_steps(run_dir / "checkpoints"):
        return
    shards = sizes["data"] * sizes["fsdp"]
    if t.global_batch % shards or t.global_batch % (shards * t.microbatches) == 0:
        return
    fitting = max(m for m in range(1, t.microbatches + 1) if t.global_batch % (shards * m) == 0)
    print(
        f"jaxdist: resuming on data x fsdp = {shards}: train.microbatches {t.microbatches} -> {fitting} keeps the global batch {t.global_batch}",
        file=sys.stderr,
    )
    t.microbatches = fitting


def restore_checkpoint(trainer, config: Config, run_dir: Path, resume: str, checkpointer, log):
    """The restored checkpoint for ``--resume``, or None to start fresh."""
    from jaxdist.checkpoint import Checkpointer, parse_resume

    mode, directory, step = parse_resume(resume, run_dir / "checkpoints")
    if mode == "never":
        return None
    own = directory.absolute() == checkpointer.directory.absolute()
    source = checkpointer if own else Checkpointer(directory, config.checkpoint, read_only=True)
    try:
        if mode == "step":
            return source.restore(step, trainer.abstract_state())
        return source.restore_latest(trainer.abstract_state(), warn=log)
    finally:
        if not own:
            source.close()


def continue_data(batches, restored, config: Config, layout, log):
    """Put the data stream where the checkpoint left it: Grain's own state when this
    process layout wrote one, else the step (batch k is a function of k alone)."""
    saved_batch = restored.config.get("train", {}).get("global_batch")
    if saved_batch not in (None, config.train.global_batch):
        log(
            f"jaxdist: warning: train.global_batch changed {saved_batch} -> {config.train.global_batch}; the data stream restarts its order at step {restored.step}"
        )
    if restored.data_state is not None:
        try:
            batches.set_state(restored.data_state)
            return batches
        except Exception:  # noqa: BLE001 - e.g. another worker count: fall back to the step
            pass
    from jaxdist.data.pipeline import make_iterator

    batches.close()
    return make_iterator(config, layout, start_step=restored.step)
