"""``python -m jaxdist.train``: the command line over ``jaxdist.training.process``.

    python -m jaxdist.train [--config NAME_OR_PATH] [--mesh SPEC] [--steps N]
                            [--run-dir DIR] [--log-every N] [--seed S]
                            [--resume auto|never|STEP|PATH|params:STEP] [--init-from CKPT] [--max-restarts N]
                            [--print-config] [--log-level debug|info|warning|error]
                            [--coordinator HOST:PORT --num-processes N --process-id I [--coordinator-bind ADDRESS]]
                            [key.sub=value ...]

Flags and ``key=value`` overrides mix in any order. Exit codes: 0 done, 2 bad input,
3 non-finite loss, 4 a checkpoint could not be written, 75 preempted (state saved: run
the same command again to resume), 76 process 0 found the coordinator's port taken
(nothing ran; ``jaxdist.launch`` retries on another port).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from jaxdist.cli import parse_args, resolved_config_yaml, train_arg_parser
from jaxdist.errors import EXIT_BAD_INPUT, JaxdistError

build_arg_parser = train_arg_parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = parse_args(build_arg_parser(), argv)
        if args.print_config:
            print(resolved_config_yaml(args), end="")
            return 0
    except JaxdistError as e:
        print(f"jaxdist: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    from jaxdist.training.process import train_process

    return train_process(args, argv)


if __name__ == "__main__":
    sys.exit(main())
