"""``python -m jaxdist.convert``: Hugging Face Llama and Mixtral checkpoints in and out.

    python -m jaxdist.convert from-hf HF_DIR OUT     # -> OUT/config.yaml, OUT/checkpoints/0 (weights)
    python -m jaxdist.convert to-hf CKPT_OR_RUN_DIR OUT [--dtype auto|float32|bfloat16|float16]

Every input is checked before OUT is created, and a failure while writing removes what
was written; ``jaxdist.hf.import_export`` does the work and says what is read, checked and kept.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import jaxdist
from jaxdist import errors
from jaxdist.errors import EXIT_OK, OneLineArgumentParser
from jaxdist.hf.files import DTYPES
from jaxdist.layout.devices import run_on_cpu_unless_gpu


def build_arg_parser() -> argparse.ArgumentParser:
    parser = OneLineArgumentParser(
        prog="python -m jaxdist.convert", description="Convert Llama and Mixtral checkpoints to and from Hugging Face."
    )
    commands = parser.add_subparsers(dest="command", required=True, parser_class=OneLineArgumentParser)
    source = commands.add_parser("from-hf", help="a Hugging Face Llama or Mixtral directory -> a jaxdist weights checkpoint")
    source.add_argument("hf_dir", type=local_path, help="a local folder")
    source.add_argument("out", type=local_path, help="a local folder")
    target = commands.add_parser(
        "to-hf", help="a jaxdist checkpoint or run directory -> a Hugging Face directory (Mixtral for an MoE model)"
    )
    target.add_argument("checkpoint", help="local, or a URL (s3://...: its newest complete step is fetched)")
    target.add_argument("out", type=local_path, help="a local folder")
    target.add_argument("--dtype", default="auto", choices=DTYPES, help="tensor dtype (auto: the imported model's, else float32)")
    for command in (parser, source, target):  # before or after the command's name
        command.add_argument(
            "--log-level",
            choices=jaxdist.LEVELS,
            default="info" if command is parser else argparse.SUPPRESS,
            help="what reaches stderr (default info)",
        )
    return parser


def local_path(text: str) -> Path:
    """A folder argument that must be local (argparse turns the error into one line)."""
    from jaxdist.storage.remote import is_remote, redact

    if is_remote(text):
        raise argparse.ArgumentTypeError(f"{redact(text)}: must be a local folder (copy it to or from object storage yourself)")
    return Path(text)


@errors.command
def main(argv: Sequence[str] | None = None) -> int:
    args = build_arg_parser().parse_args(argv)
    jaxdist.set_level(args.log_level)
    run_on_cpu_unless_gpu()  # before JAX is imported: conversion runs on this host's devices
    from jaxdist.hf.import_export import from_hf, to_hf  # imports JAX: once the platform is chosen

    if args.command == "from-hf":
        from_hf(args.hf_dir, args.out, progress=sys.stderr.isatty())
    else:
        to_hf(args.checkpoint, args.out, dtype=args.dtype)
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
