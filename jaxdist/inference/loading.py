"""A checkpoint's model on a mesh, for the tools that only run it (``generate``, ``eval``).

The config is the one saved with the checkpoint, with ``key=value`` overrides (its
``data.tokenizer`` is the run's tokenizer: neither tool reads the training data unless
asked to score it); the parallel section is reset to a plain mesh (``--mesh``, default one device), so a
DiLoCo or compressed-gradient training run loads like any other. The parameters are
read straight into that mesh's shardings.

Importing this module does not import JAX: ``generate`` and ``eval`` parse their arguments
and read the checkpoint's config with it before the platform is chosen.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Collection
from pathlib import Path
from typing import Any

from jaxdist import LEVELS
from jaxdist.cli import parse_args
from jaxdist.config import Config, ParallelConfig
from jaxdist.data.sources import record_tokenizer
from jaxdist.errors import JaxdistError, OneLineArgumentParser
from jaxdist.layout.devices import prepare_devices
from jaxdist.training.run import build_trainer
from jaxdist.training.weights import checkpoint_config, find_checkpoint, restore_params


def checkpoint_arg_parser(prog: str, description: str) -> argparse.ArgumentParser:
    parser = OneLineArgumentParser(prog=prog, description=description)
    parser.add_argument("--checkpoint", required=True, help="a run directory, its checkpoints directory, or one step directory")
    parser.add_argument("--mesh", default="1", help="devices to run on, e.g. tensor=2 (default: one device)")
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    parser.add_argument("--log-level", default="info", choices=LEVELS, help="what reaches stderr (default info)")
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="key=value",
        help="config overrides (key=value) on top of the checkpoint's, e.g. data.path=... data.chat_template=FILE",
    )
    return parser


@dataclasses.dataclass
class Loaded:
    config: Config
    step_dir: Path
    step: int
    trainer: Any  # jaxdist.training.step.Trainer: the model's graph, layout and parameter shardings
    params: Any


def load_config(parser: argparse.ArgumentParser, argv) -> tuple[argparse.Namespace, Config, Path]:
    """Arguments, the checkpoint's config for this run, and its step directory (no JAX yet)."""
    args = parse_args(parser, argv)
    step_dir = find_checkpoint(args.checkpoint)
    config = checkpoint_config(step_dir, args.overrides)
    if config.model.kind != "llama":
        raise JaxdistError(f"checkpoint {step_dir}: model.kind {config.model.kind!r}; only language models generate and evaluate here")
    record_tokenizer(config)  # what older runs left unsaid (bytes); a run saves its own
    config.parallel = ParallelConfig(mesh=args.mesh)
    return args, config, step_dir


def load(config: Config, step_dir: Path, used_keys: Collection[str] = ()) -> Loaded:
    """Devices, the model's layout and its parameters from the checkpoint. ``used_keys``:
    keys the caller reads itself (not warned about as having no effect)."""
    sizes = prepare_devices(config)
    trainer = build_trainer(config, sizes, used_keys=used_keys)
    params = restore_params(step_dir, trainer.abstract_params())
    return Loaded(config, step_dir, int(step_dir.name), trainer, params)
