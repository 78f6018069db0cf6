"""A run resolved once, then frozen: what the arguments, the run directory and the devices decide.

``resolve_run`` turns a loaded config, a run directory and ``--resume`` / ``--init-from``
into a ``RunPlan``:

- the mesh: a ``-1`` axis sized to the devices (on CPU the fake devices per process x
  processes, known before JAX starts; on GPU a second call once ``jax.distributed`` has
  joined the processes and the device count is known);
- the microbatches: a resume onto a mesh that cannot split the global batch as configured
  takes the largest count that can (the global batch, so the math, stays);
- the start: ``fresh``, ``init-from`` (another checkpoint's weights, a fresh optimizer),
  ``resume`` (this run's or a named full checkpoint) or ``weights-only`` (a weights-only
  checkpoint continued with a fresh optimizer);
- the data's tokenizer and the vocabulary it needs, the learning-rate schedule's length.

The plan's config is a frozen copy (``jaxdist.config.freeze``): nothing changes it after
this, so what ``config.yaml`` and every checkpoint record is what ran. The caller's config
is left as it was given. Pure Python up to the checkpoint listing: it runs before JAX starts.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Literal

from jaxdist.config import Config, freeze, unfrozen
from jaxdist.data.sources import resolve_vocab
from jaxdist.errors import JaxdistError
from jaxdist.layout.devices import settle_remaining_axis
from jaxdist.layout.mesh import MeshSizes, parse_mesh
from jaxdist.training.checkpoint import checkpoint_steps
from jaxdist.training.resume import adapt_microbatches_for_resume, weights_resume

log = logging.getLogger(__name__)

Start = Literal["fresh", "init-from", "resume", "weights-only"]


@dataclasses.dataclass(frozen=True)
class RunPlan:
    config: Config  # frozen
    mesh_sizes: MeshSizes | None  # None: --mesh auto (sized from the model once the devices are known)
    run_dir: Path | None  # None: a library run that writes nothing
    start: Start
    resume: str  # --resume as the run uses it: auto | never | STEP | PATH (weights-only ones are taken apart)
    init_from: str | None  # the checkpoint whose weights start a fresh run
    weights_dir: Path | None  # the weights-only step directory a weights-only start continues from
    durable_dir: str | None = None  # with checkpoint.local_dir: the run directory checkpoints are copied to (run_dir is the local tier)


def derive(config: Config) -> None:
    """What a config derives from its data before anything runs (``--print-config`` shows
    it too): the tokenizer the data is made with, the vocabulary it needs, the schedule's length."""
    resolve_vocab(config)
    config.train.schedule_steps = config.train.schedule_length()  # saved: a resume with another --steps keeps it


def resolve_run(
    config: Config,
    run_dir: Path | None,
    *,
    resume: str = "auto",
    init_from: str | None = None,
    mesh_sizes: MeshSizes | None = None,
    num_processes: int = 1,
    n_devices: int | None = None,
    quiet: bool = False,
    durable_dir: str | None = None,
) -> RunPlan:
    """The run ``config`` describes, resolved and frozen. ``mesh_sizes``: a library caller's
    mesh (else ``parallel.mesh``); ``n_devices``: the devices a ``-1`` axis fills (None: known
    before JAX starts on CPU, left unsized on GPU); ``quiet``: not process 0 (only it says
    what a ``-1`` axis became); ``durable_dir``: the durable tier behind the local ``run_dir``
    (``checkpoint_tiers.run_tiers``), already prepared (``prepare_local_tier``)."""
    config = unfrozen(config)
    if mesh_sizes is None:
        settle_remaining_axis(config, num_processes, n_devices, quiet=quiet)
        mesh_sizes = parse_mesh(config.parallel.mesh)
    resume, init_from, weights_dir = weights_resume(resume, init_from, run_dir)
    own = run_dir is not None and resume != "never" and bool(checkpoint_steps(run_dir / "checkpoints"))
    if weights_dir is not None and config.train.objective == "dpo":
        raise JaxdistError(
            f"--resume {resume}: a weights-only checkpoint holds no reference model, so it cannot continue a train.objective=dpo run "
            "exactly; resume from a full checkpoint, or start a new run from these weights with --init-from"
        )
    if weights_dir is not None:
        start: Start = "weights-only"
    elif own or resume not in ("auto", "never"):
        start = "resume"
    elif init_from:
        start = "init-from"
    else:
        start = "fresh"
    if own:  # this run's own checkpoints, perhaps saved on another mesh
        adapt_microbatches_for_resume(config, mesh_sizes)
    derive(config)
    return RunPlan(freeze(config), mesh_sizes, run_dir, start, resume, init_from, weights_dir, durable_dir)
