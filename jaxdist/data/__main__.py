"""``python -m jaxdist.data COMMAND``: data tools.

    python -m jaxdist.data prepare --input GLOB [--input GLOB ...] --output DIR
        [--tokenizer FILE] [--format bin|arrayrecord] [--unit file|line]
        [--shard-tokens N] [--workers N] [--overwrite]

Exit codes: 0 done, 2 bad input (one line on stderr), 130 interrupted.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

import jaxdist
from jaxdist import errors
from jaxdist.data import prepare
from jaxdist.errors import EXIT_OK, OneLineArgumentParser

EXIT_INTERRUPTED = 130

log = logging.getLogger("jaxdist.data")  # not __name__: run as -m it is __main__, outside jaxdist's logger


def build_arg_parser(prog: str = "python -m jaxdist.data") -> argparse.ArgumentParser:
    parser = OneLineArgumentParser(prog=prog, description="Data tools for jaxdist.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=OneLineArgumentParser)
    prepare_parser = commands.add_parser(
        "prepare",
        help="tokenize text files into shards for training",
        description="Tokenize text files into shards (bin or arrayrecord) plus meta.json.",
    )
    prepare.add_arguments(prepare_parser)
    for command in (parser, prepare_parser):  # before or after the command's name
        command.add_argument(
            "--log-level",
            choices=jaxdist.LEVELS,
            default="info" if command is parser else argparse.SUPPRESS,
            help="what reaches stderr (default info)",
        )
    return parser


@errors.command
def main(argv: Sequence[str] | None = None) -> int:
    args = build_arg_parser().parse_args(argv)
    jaxdist.set_level(args.log_level)
    try:
        if args.command == "prepare":
            prepare.run_cli(args)
    except KeyboardInterrupt:
        log.info("interrupted; nothing written")
        return EXIT_INTERRUPTED
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
