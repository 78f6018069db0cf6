"""``python -m jaxdist.commbench``: the bandwidth of each collective over each mesh axis, before a run pays for it.

    python -m jaxdist.commbench [--mesh SPEC] [--sizes 1K:64M] [--iters 20] [--warmup 5]
        [--hardware h100|h200|a100|cpu-local] [--out PATH] [--json]

Times all-reduce, all-gather, reduce-scatter, all-to-all and collective-permute over every
mesh axis of more than one device, for every power of 2 between the two sizes, and prints
per axis and size the algorithm and bus bandwidth as nccl-tests defines them, beside the
planner's hardware profile for that link (``jaxdist.plan.link_bench`` says how). ``--out
PATH`` writes a link profile the planner uses instead of the datasheet
(``python -m jaxdist.plan --links PATH``); ``--json`` prints it on stdout as one JSON object
instead of the table, as every jaxdist CLI's ``--json`` does. ``--json PATH``, the old
spelling of ``--out PATH``, still writes the file, with a one-line deprecation note.

Launched like a training run, one process per device or host: under ``jaxdist.launch
--module jaxdist.commbench``, SLURM's ``srun`` or with ``--coordinator`` /
``--num-processes`` / ``--process-id``; it joins the process group as ``jaxdist.train``
does. Without an accelerator the mesh gets fake CPU devices.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence

import jaxdist
from jaxdist import errors
from jaxdist.cli import add_process_group_flags, parse_args
from jaxdist.cluster.distributed import process_group_from
from jaxdist.errors import EXIT_OK, JaxdistError, OneLineArgumentParser
from jaxdist.layout.devices import run_on_cpu_unless_gpu

log = logging.getLogger("jaxdist.commbench")  # not __name__: run as -m it is __main__, outside jaxdist's logger

DEFAULT_SIZES = "1K:64M"


def build_arg_parser():
    parser = OneLineArgumentParser(prog="python -m jaxdist.commbench", description="Time the collectives over each mesh axis.")
    parser.add_argument("--mesh", default="data=-1", help="name=size,... or AxB (default data=-1: every device on one axis)")
    parser.add_argument(
        "--sizes", default=DEFAULT_SIZES, help=f"A:B, the powers of 2 from A to B bytes, or one size; K/M/G (default {DEFAULT_SIZES})"
    )
    parser.add_argument("--iters", type=int, default=20, help="timed runs per point; the median is reported (default 20)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed runs per point after the compile (default 5)")
    parser.add_argument("--hardware", default=None, help="planner profile to compare with (default: the devices' own; cpu-local if cached)")
    parser.add_argument("--out", default=None, metavar="PATH", help="write the link profile the planner reads (--links PATH)")
    # --json alone prints the profile (const "-": stdout); --json PATH is the deprecated spelling of --out PATH
    parser.add_argument("--json", nargs="?", const="-", default=None, metavar="PATH", help="print the link profile as one JSON object")
    add_process_group_flags(parser)
    parser.add_argument("--log-level", default="info", choices=jaxdist.LEVELS, help="what reaches stderr (default info)")
    return parser


@errors.command
def main(argv: Sequence[str] | None = None) -> int:
    run_on_cpu_unless_gpu()  # before JAX is imported: without a GPU, the CUDA plugin stays unloaded
    from jaxdist.plan.link_bench import Sweep, commbench, format_report, parse_sizes  # imports JAX: once the platform is chosen

    args = parse_args(build_arg_parser(), argv)
    jaxdist.set_level(args.log_level)
    if args.iters < 1 or args.warmup < 0:
        raise JaxdistError(f"--iters must be >= 1 and --warmup >= 0, got {args.iters} and {args.warmup}")
    sweep = Sweep(tuple(parse_sizes(args.sizes)), args.iters, args.warmup)
    report, hardware = commbench(args.mesh, sweep, process_group_from(args), args.hardware, outputs(args))
    if report is None:  # not process 0
        return EXIT_OK
    if "-" not in outputs(args):
        print(format_report(report, hardware))
    if args.json not in (None, "-"):
        log.warning(f"--json PATH is deprecated: --out {args.json} writes the link profile, --json alone prints it")
    return EXIT_OK


def outputs(args) -> dict[str, str]:
    """Where the link profile goes (a path, or - for stdout) -> the flag that asked for it."""
    out = {args.out: "--out"} if args.out else {}
    if args.json is not None:
        if args.json != "-" and args.out:
            raise JaxdistError(f"--json {args.json} and --out {args.out}: --out PATH writes the profile (--json PATH is its old spelling)")
        out[args.json] = "--json"
    return out


if __name__ == "__main__":
    sys.exit(main())
