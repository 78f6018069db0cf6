"""``python -m jaxdist.train`` (``jaxdist train``): the command line over ``jaxdist.training.run``.

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

import jaxdist
from jaxdist.cli import parse_args, resolved_config_yaml, train_arg_parser
from jaxdist.errors import EXIT_OK, command

build_arg_parser = train_arg_parser


@command
def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(build_arg_parser(), argv)
    jaxdist.set_level(args.log_level)
    if args.print_config:
        print(resolved_config_yaml(args), end="")
        return EXIT_OK
    from jaxdist.training.run import train_process  # after the arguments: JAX must not start on bad input

    return train_process(args, argv)


if __name__ == "__main__":
    sys.exit(main())
