"""``python -m jaxdist.profile RUN_DIR [--json]``: where a traced step's time went.

Reads the traces ``python -m jaxdist.train --profile-steps A:B`` wrote into
``RUN_DIR/profile/`` and prints the bottleneck report (``jaxdist.inspect.profile_report``,
which documents every field): ``breakdown_s`` and ``fractions``, ``bound``, ``top_ops``,
``collectives``, ``predicted``, ``stragglers``, ``advice``, and the whole run's ``goodput``
(``RUN_DIR/goodput.json``); ``--json`` prints it as one JSON
object. It also writes ``RUN_DIR/profile/summary.json`` and ``RUN_DIR/profile/breakdown.png``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

import jaxdist
from jaxdist import errors
from jaxdist.errors import EXIT_OK, OneLineArgumentParser
from jaxdist.inspect.profile_report import format_summary, summarize


def build_arg_parser() -> argparse.ArgumentParser:
    parser = OneLineArgumentParser(
        prog="python -m jaxdist.profile", description="Where the traced steps' time went: compute, communication, data or host."
    )
    parser.add_argument("run_dir", help="a run directory traced with --profile-steps A:B")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--log-level", default="info", choices=jaxdist.LEVELS, help="what reaches stderr (default info)")
    return parser


@errors.command
def main(argv: Sequence[str] | None = None) -> int:
    args = build_arg_parser().parse_args(argv)
    jaxdist.set_level(args.log_level)
    summary = summarize(args.run_dir)
    print(json.dumps(summary) if args.json else format_summary(summary))
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
