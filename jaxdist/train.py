"""``python -m jaxdist.train``: the command line over ``jaxdist.run``.

    python -m jaxdist.train [--config NAME_OR_PATH] [--mesh SPEC] [--steps N]
                            [--run-dir DIR] [--log-every N] [--seed S]
                            [--resume auto|never|STEP|PATH] [--init-from CKPT] [--max-restarts N]
                            [--coordinator HOST:PORT --num-processes N --process-id I [--coordinator-bind ADDRESS]]
                            [key.sub=value ...]

Flags and ``key=value`` overrides mix in any order. Exit codes: 0 done, 2 bad input,
3 non-finite loss, 4 a checkpoint could not be written, 75 preempted (state saved: run
the same command again to resume), 76 process 0 found the coordinator's port taken
(nothing ran; ``jaxdist.launch`` retries on another port).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from jaxdist.cli import config_arg_parser, config_from_args, parse_args
from jaxdist.errors import EXIT_BAD_INPUT, EXIT_OK, JaxdistError, NonFiniteLoss
from jaxdist.heartbeat import install_stack_dump
from jaxdist.supervise import SUPERVISED_ENV


def build_arg_parser(prog: str = "python -m jaxdist.train") -> argparse.ArgumentParser:
    parser = config_arg_parser(prog, "Train a model on a device mesh.")
    parser.add_argument("--run-dir", default=None, help="where metrics, config and checkpoints go (default runs/NAME-TIME)")
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
    parser.add_argument("--resume", default="auto", help="auto (latest checkpoint in the run dir, if any) | never | STEP | PATH")
    parser.add_argument("--init-from", default=None, metavar="CKPT", help="start from this checkpoint's weights (fresh optimizer, step 0)")
    parser.add_argument("--max-restarts", type=int, default=0, help="restart a crashed run from its latest checkpoint up to N times")
    parser.add_argument("--restart-delay", type=float, default=5.0, help="seconds before the first restart; doubles each time")
    parser.add_argument("--profile-steps", default=None, metavar="A:B", help="trace steps A..B into RUN_DIR/profile (train.profile_steps)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from jaxdist.checkpoint import CheckpointError
    from jaxdist.preemption import Preempted

    argv = list(sys.argv[1:] if argv is None else argv)
    install_stack_dump()  # under jaxdist.launch: SIGUSR1 prints the Python stacks of a stalled process
    try:
        args = parse_args(build_arg_parser(), argv)
        if args.profile_steps is not None:
            args.overrides.append(f"train.profile_steps={args.profile_steps}")
        config = config_from_args(args)
        from jaxdist.mesh import has_remaining_axis, parse_mesh
        from jaxdist.run import default_run_dir, prepare_devices, run, settle_remaining_axis
        from jaxdist.validate import check_config_on_mesh

        run_dir = Path(args.run_dir) if args.run_dir else default_run_dir(config)
        if args.max_restarts > 0 and not os.environ.get(SUPERVISED_ENV):
            from jaxdist.supervise import supervise

            return supervise(argv, run_dir, args.max_restarts, args.restart_delay)
        from jaxdist.distributed import initialize, process_group_from
        from jaxdist.resume import adapt_microbatches_for_resume

        group = process_group_from(args)
        num_processes = group.num_processes if group and group.num_processes else 1
        settle_remaining_axis(config, num_processes)
        adapt_microbatches_for_resume(config, run_dir, args.resume)
        sizes = prepare_devices(config, num_processes)
        initialize(group)
        if has_remaining_axis(sizes):  # GPU: the device count is known now
            import jax

            settle_remaining_axis(config, num_processes, jax.device_count())
            adapt_microbatches_for_resume(config, run_dir, args.resume)
            sizes = parse_mesh(config.parallel.mesh)
            check_config_on_mesh(config, sizes)
        interactive = sys.stderr.isatty()
        result = run(
            config, sizes, run_dir, resume=args.resume, progress=interactive, print_lines=not interactive, init_from=args.init_from
        )
    except (JaxdistError, NonFiniteLoss, CheckpointError) as e:
        print(f"jaxdist: error: {e}", file=sys.stderr)
        return getattr(e, "exit_code", EXIT_BAD_INPUT)
    except Preempted as e:
        print(f"jaxdist: {e}; run the same command to resume", file=sys.stderr)
        return e.exit_code
    import jax

    if result.losses and jax.process_index() == 0:
        print(f"jaxdist: done at step {config.train.steps}; loss {result.losses[0]:.4f} -> {result.losses[-1]:.4f}", file=sys.stderr)
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
