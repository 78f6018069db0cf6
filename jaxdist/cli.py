"""The command-line arguments shared by every tool that builds a run from a config.

``train``, ``analyze`` and the tools after them take the same ``--config``, ``--mesh``
and ``key=value`` overrides; flags and overrides mix in any order.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence

from jaxdist.config import Config, load_config
from jaxdist.errors import OneLineArgumentParser

log = logging.getLogger(__name__)


def config_arg_parser(prog: str, description: str) -> argparse.ArgumentParser:
    """A parser with the flags that pick a config and a mesh, plus ``key=value`` overrides."""
    parser = OneLineArgumentParser(prog=prog, description=description)
    parser.add_argument("--config", default=None, help="preset name (configs/NAME.yaml) or YAML path; default: built-in tiny model")
    parser.add_argument(
        "--mesh",
        default=None,
        help="AxB (data x tensor), name=size,... (replica, data, pipe, fsdp, expert, context, tensor; one size may be -1) or auto",
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
    flags = {"steps": "train.steps", "seed": "train.seed", "log_every": "train.log_every"}
    flags |= {"straggler_factor": "train.straggler_factor", "straggler_window": "train.straggler_window"}
    for flag, key in flags.items():
        if getattr(args, flag, None) is not None:
            overrides.append(f"{key}={getattr(args, flag)}")
    if getattr(args, "mesh", None) is not None:
        overrides.append(f"parallel.mesh={args.mesh}")
    if getattr(args, "dcn_mesh", None) is not None:
        overrides.append(f"parallel.dcn_mesh={args.dcn_mesh}")
    return load_config(args.config, overrides)


def train_arg_parser(prog: str = "python -m jaxdist.train") -> argparse.ArgumentParser:
    """``python -m jaxdist.train``'s flags (the launchers parse a run's arguments with it too)."""
    parser = config_arg_parser(prog, "Train a model on a device mesh.")
    parser.add_argument("--run-dir", default=None, help="where metrics, config and checkpoints go (default runs/NAME-TIME)")
    add_process_group_flags(parser)
    parser.add_argument(
        "--resume",
        default="auto",
        help="auto (latest full checkpoint in the run dir, if any) | never | STEP | PATH | params:STEP (this run's weights-only checkpoint)",
    )
    parser.add_argument("--init-from", default=None, metavar="CKPT", help="start from this checkpoint's weights (fresh optimizer, step 0)")
    parser.add_argument("--max-restarts", type=int, default=0, help="restart a crashed run from its latest checkpoint up to N times")
    parser.add_argument("--restart-delay", type=float, default=5.0, help="seconds before the first restart; doubles each time")
    parser.add_argument("--profile-steps", default=None, metavar="A:B", help="trace steps A..B into RUN_DIR/profile (train.profile_steps)")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config as YAML and exit (nothing runs)")
    parser.add_argument("--straggler-factor", type=float, default=None, help="train.straggler_factor (several processes)")
    parser.add_argument("--straggler-window", type=int, default=None, help="train.straggler_window (0: off)")
    parser.add_argument(
        "--log-level",
        default="info",
        choices=("debug", "info", "warning", "error"),
        help="what reaches stderr: debug adds the collectives' own connection lines (gloo)",
    )
    return parser


def resolved_config_yaml(args: argparse.Namespace) -> str:
    """``--print-config``: the config the arguments describe, with what the run derives
    before JAX starts (the vocabulary from the tokenizer, the schedule's length), as YAML."""
    from jaxdist.training.run_plan import derive

    if getattr(args, "profile_steps", None) is not None:
        args.overrides.append(f"train.profile_steps={args.profile_steps}")
    from jaxdist.layout import devices
    from jaxdist.layout.mesh import has_remaining_axis, parse_mesh
    from jaxdist.layout.validate import check_config_on_mesh

    config = config_from_args(args)
    derive(config)
    # the run's own sizing and checks, so what prints is what would run: a -1 axis over the
    # devices JAX would see (the driver's count, or the fake CPU devices), without starting JAX
    gpus = devices.cuda_device_count() if devices.gpu_plugin_installed() else None
    devices.settle_remaining_axis(config, n_devices=gpus or None)
    if config.parallel.dcn_mesh:
        parse_mesh(config.parallel.dcn_mesh)
    sizes = parse_mesh(config.parallel.mesh)
    if sizes is not None and not has_remaining_axis(sizes):
        for line in check_config_on_mesh(config, sizes):
            log.warning(line)
    return config.to_yaml()


def add_process_group_flags(parser: argparse.ArgumentParser) -> None:
    """The flags of a multi-process run (``jaxdist.cluster.distributed.process_group_from`` reads them)."""
    parser.add_argument("--coordinator", default=None, help="HOST:PORT of process 0, for a multi-process run")
    parser.add_argument(
        "--coordinator-bind",
        default=None,
        metavar="ADDRESS",
        help="the one address process 0's coordinator listens on (default: what the coordinator's host resolves to; 0.0.0.0: every interface)",
    )
    parser.add_argument("--num-processes", type=int, default=None, help="processes in the run")
    parser.add_argument("--process-id", type=int, default=None, help="this process's rank")
    parser.add_argument("--dist-timeout", type=int, default=300, help="seconds to wait for all processes to join")
