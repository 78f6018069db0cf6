"""The command-line arguments shared by every tool that builds a run from a config.

``train``, ``analyze`` and the tools after them take the same ``--config``, ``--mesh``
and ``key=value`` overrides; flags and overrides mix in any order.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from jaxdist.config import Config, load_config
from jaxdist.errors import OneLineArgumentParser


def config_arg_parser(prog: str, description: str) -> argparse.ArgumentParser:
    """A parser with the flags that pick a config and a mesh, plus ``key=value`` overrides."""
    parser = OneLineArgumentParser(prog=prog, description=description)
    parser.add_argument("--config", default=None, help="preset name (configs/NAME.yaml) or YAML path; default: built-in tiny model")
    parser.add_argument(
        "--mesh", default=None, help="AxB (data x tensor), name=size,... (replica, data, pipe, fsdp, tensor; one size may be -1) or auto"
    )
    parser.add_argument("--dcn-mesh", default=None, help="the across-host part of the mesh, e.g. data=2 (default: derived)")
    parser.add_argument("--steps", type=int, default=None, help="train.steps")
    parser.add_argument("--seed", type=int, default=None, help="train.seed")
    parser.add_argument("--log-every", type=int, default=None, help="train.log_every")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. model.n_layers=2")
    return parser


def parse_args(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """Flags and ``key=value`` words in any order (plain ``parse_args`` stops collecting
    positionals at the first flag after them)."""
    return parser.parse_intermixed_args(argv)


def config_from_args(args: argparse.Namespace) -> Config:
    """The config the flags and overrides describe; the flags win over the same keys."""
    overrides = list(args.overrides)
    for flag, key in (("steps", "train.steps"), ("seed", "train.seed"), ("log_every", "train.log_every")):
        if getattr(args, flag, None) is not None:
            overrides.append(f"{key}={getattr(args, flag)}")
    if getattr(args, "mesh", None) is not None:
        overrides.append(f"parallel.mesh={args.mesh}")
    if getattr(args, "dcn_mesh", None) is not None:
        overrides.append(f"parallel.dcn_mesh={args.dcn_mesh}")
    return load_config(args.config, overrides)
