"""The train step compiled from abstract shapes, with nothing allocated and no data
read, and its report: what ``python -m jaxdist.analyze``, the planner and the tests
compile to see memory, FLOPs and collectives before any GPU hour is spent."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from jaxdist.config import Config
from jaxdist.inspect.step_report import build_report
from jaxdist.layout.mesh import MeshSizes
from jaxdist.training.run import build_trainer


def compile_train_step(config: Config, mesh_sizes: MeshSizes | None, devices: Sequence[Any] | None = None) -> tuple[Any, Any]:
    """The Trainer and its train step compiled from abstract shapes (nothing allocated).

    Call after JAX has enough devices for the mesh (the CLI runs ``prepare_devices``).
    """
    trainer = build_trainer(config, mesh_sizes, devices)
    batch = trainer.abstract_batch(config.train.global_batch)
    return trainer, trainer.compiled_train_step(trainer.abstract_state(), batch)


def analyze(config: Config, mesh_sizes: MeshSizes | None, devices: Sequence[Any] | None = None, *, with_hlo: bool = False):
    """Compile ``config``'s train step on a mesh from abstract shapes and report on it
    (``with_hlo``: and the optimized HLO text, as a pair)."""
    trainer, compiled = compile_train_step(config, mesh_sizes, devices)
    report = build_report(trainer, compiled)
    return (report, compiled.as_text()) if with_hlo else report
