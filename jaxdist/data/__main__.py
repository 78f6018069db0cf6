"""``python -m jaxdist.data COMMAND``: data tools.

    python -m jaxdist.data prepare --input GLOB [--input GLOB ...] --output DIR
        [--tokenizer FILE] [--format bin|arrayrecord] [--unit file|line]
        [--shard-tokens N] [--workers N] [--overwrite]

Exit codes: 0 done, 2 bad input (one line on stderr), 130 interrupted.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from jaxdist.errors import EXIT_BAD_INPUT, EXIT_OK, JaxdistError, OneLineArgumentParser

EXIT_INTERRUPTED = 130


def build_arg_parser(prog: str = "python -m jaxdist.data") -> argparse.ArgumentParser:
    from jaxdist.data import prepare

    parser = OneLineArgumentParser(prog=prog, description="Data tools for jaxdist.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=OneLineArgumentParser)
    prepare.add_arguments(
        commands.add_parser(
            "prepare",
            help="tokenize text files into shards for training",
            description="Tokenize text files into shards (bin or arrayrecord) plus meta.json.",
        )
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from jaxdist.data import prepare

    try:
        args = build_arg_parser().parse_args(argv)
        if args.command == "prepare":
            prepare.run_cli(args)
    except JaxdistError as e:
        print(f"jaxdist: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print("jaxdist: interrupted; nothing written", file=sys.stderr)
        return EXIT_INTERRUPTED
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
