"""One training process from its command-line arguments: supervise it (``--max-restarts``),
join the process group, size the mesh to the devices, adapt a resume to it, run, and
turn the outcome into an exit code.

The order matters before JAX starts its backend: the mesh and the config are checked
and the fake CPU devices requested first (errors then cost no backend start-up); on a
GPU a ``-1`` axis can only be sized once ``jax.distributed`` has joined the processes.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from jaxdist.cli import config_from_args
from jaxdist.cluster.heartbeat import install_stack_dump
from jaxdist.cluster.supervise import SUPERVISED_ENV
from jaxdist.errors import EXIT_BAD_INPUT, EXIT_OK, JaxdistError, NonFiniteLoss


def train_process(args: argparse.Namespace, argv: list[str]) -> int:
    """Run the training ``args`` describe (``argv``: the same, as given, for a supervisor
    that restarts them); returns the exit code (``jaxdist.train``'s table)."""
    from jaxdist.training.checkpoint import CheckpointError
    from jaxdist.training.preemption import Preempted

    install_stack_dump()  # under jaxdist.launch: SIGUSR1 prints the Python stacks of a stalled process
    try:
        if args.profile_steps is not None:
            args.overrides.append(f"train.profile_steps={args.profile_steps}")
        config = config_from_args(args)
        from jaxdist.training.run import default_run_dir

        run_dir = Path(args.run_dir) if args.run_dir else default_run_dir(config)
        if args.max_restarts > 0 and not os.environ.get(SUPERVISED_ENV):
            from jaxdist.cluster.supervise import supervise

            return supervise(argv, run_dir, args.max_restarts, args.restart_delay)
        result = _join_and_run(args, config, run_dir)
    except (JaxdistError, NonFiniteLoss, CheckpointError) as e:
        print(f"jaxdist: error: {e}", file=sys.stderr)
        return getattr(e, "exit_code", EXIT_BAD_INPUT)
    except Preempted as e:
        print(f"jaxdist: {e}; run the same command to resume", file=sys.stderr)
        return e.exit_code
    import jax

    if result.losses and jax.process_index() == 0:
        t = config.train
        end = t.stop_after_step if 0 < t.stop_after_step < t.steps else t.steps
        print(f"jaxdist: done at step {end}; loss {result.losses[0]:.4f} -> {result.losses[-1]:.4f}", file=sys.stderr)
    return EXIT_OK


def _join_and_run(args: argparse.Namespace, config, run_dir: Path):
    from jaxdist.cluster.distributed import hide_gloo_lines, initialize, process_group_from
    from jaxdist.data.sources import resolve_vocab
    from jaxdist.layout.devices import prepare_devices, settle_remaining_axis
    from jaxdist.layout.mesh import has_remaining_axis, parse_mesh
    from jaxdist.layout.validate import check_config_on_mesh
    from jaxdist.training.resume import adapt_microbatches_for_resume
    from jaxdist.training.run import run

    group = process_group_from(args)
    hide_gloo_lines(args.log_level, group)  # before initialize: gloo prints at the first collectives
    num_processes = group.num_processes if group and group.num_processes else 1
    quiet = bool(group and group.process_id)  # only process 0 says what a -1 axis became
    settle_remaining_axis(config, num_processes, quiet=quiet)
    adapt_microbatches_for_resume(config, run_dir, args.resume)
    if parse_mesh(config.parallel.mesh) is not None:
        resolve_vocab(config)  # the tensor axis's check sees the vocab before JAX starts
    sizes = prepare_devices(config, num_processes)
    initialize(group)
    if has_remaining_axis(sizes):  # GPU: the device count is known now
        import jax

        settle_remaining_axis(config, num_processes, jax.device_count(), quiet=jax.process_index() != 0)
        adapt_microbatches_for_resume(config, run_dir, args.resume)
        sizes = parse_mesh(config.parallel.mesh)
        check_config_on_mesh(config, sizes)
    interactive = sys.stderr.isatty()
    return run(config, sizes, run_dir, resume=args.resume, progress=interactive, print_lines=not interactive, init_from=args.init_from)
