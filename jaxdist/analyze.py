"""``python -m jaxdist.analyze``: compile the train step without running it and report
memory per device, FLOPs and the collectives XLA inserted.

    python -m jaxdist.analyze [--config NAME_OR_PATH] [--mesh SPEC] [key.sub=value ...] [--json]

Nothing is allocated: the step is lowered on abstract shapes (``jax.ShapeDtypeStruct``
with shardings) and compiled; the numbers come from the compiled per-device program
(``jaxdist.inspect.step_report`` lists the JSON fields).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence

from jaxdist.cli import config_arg_parser, config_from_args, parse_args
from jaxdist.errors import EXIT_BAD_INPUT, EXIT_OK, JaxdistError


def build_arg_parser():
    parser = config_arg_parser(
        "python -m jaxdist.analyze", "Compile the train step on abstract shapes and report memory, FLOPs and collectives."
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = parse_args(build_arg_parser(), argv)
        config = config_from_args(args)
        from jaxdist.inspect.step_report import format_report
        from jaxdist.layout.devices import prepare_devices
        from jaxdist.training.compiled import analyze

        sizes = prepare_devices(config)  # before JAX starts: fake CPU devices for the mesh
        report = analyze(config, sizes)
    except JaxdistError as e:
        print(f"jaxdist: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(json.dumps(report) if args.json else format_report(report))
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
