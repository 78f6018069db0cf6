"""``python -m jaxdist.analyze``: compile the train step without running it and report
memory per device, FLOPs and the collectives XLA inserted.

    python -m jaxdist.analyze [--config NAME_OR_PATH] [--mesh SPEC] [key.sub=value ...] [--json]
                              [--target h100|h200|a100|h100-hbm2e [--gpus N] [--gpus-per-node 8] [--hlo-out PATH]]

Nothing is allocated: the step is lowered on abstract shapes (``jax.ShapeDtypeStruct``
with shardings) and compiled; the numbers come from the compiled per-device program
(``jaxdist.inspect.step_report`` lists the JSON fields). With ``--target`` XLA:GPU compiles
it for that GPU on this host, no GPU needed (``jaxdist.plan.gpu_target``): the report adds
the target, the peak memory and whether it fits, the kernels and the collectives' overlap.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Sequence

import jaxdist
from jaxdist import errors
from jaxdist.cli import config_arg_parser, config_from_args, parse_args
from jaxdist.data.sources import resolve_vocab
from jaxdist.errors import EXIT_OK, JaxdistError
from jaxdist.layout.devices import prepare_devices, settle_remaining_axis
from jaxdist.layout.mesh import mesh_device_count, parse_mesh
from jaxdist.plan.gpu_target import compile_for_target, prepare_target, target_hardware, target_report

log = logging.getLogger("jaxdist.analyze")  # not __name__: run as -m it is __main__, outside jaxdist's logger


def build_arg_parser():
    parser = config_arg_parser(
        "python -m jaxdist.analyze", "Compile the train step on abstract shapes and report memory, FLOPs and collectives."
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.add_argument("--target", default=None, help="compile for this GPU without one: h100 | h200 | a100 | h100-hbm2e")
    parser.add_argument("--gpus", type=int, default=None, help="--target: GPUs in the run (default: the mesh's devices, else 8)")
    parser.add_argument("--gpus-per-node", type=int, default=8, help="--target: GPUs per host (a multi-node target's hosts)")
    parser.add_argument("--hlo-out", default=None, metavar="PATH", help="write the optimized per-device HLO text here")
    parser.add_argument("--log-level", default="info", choices=jaxdist.LEVELS, help="what reaches stderr (default info)")
    return parser


@errors.command
def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(build_arg_parser(), argv)
    jaxdist.set_level(args.log_level)
    config = config_from_args(args)
    # Before JAX starts: the compile-only route needs JAX_PLATFORMS=cpu and the CUDA plugin;
    # a run on this host's devices, fake CPU devices for the mesh (and no plugin).
    if args.target is not None:
        prepare_target()
        report, hlo = _analyze_target(args, config)
    else:
        if args.gpus is not None:
            raise JaxdistError("--gpus needs --target (without one the mesh runs on this host's devices)")
        sizes = prepare_devices(config)
        from jaxdist.training.aot import analyze  # imports JAX: once the platform is chosen

        report, hlo = analyze(config, sizes, with_hlo=True)
    from jaxdist.inspect.step_report import format_report  # imports JAX: once the platform is chosen

    if args.hlo_out:
        _write(args.hlo_out, hlo)
    print(json.dumps(report) if args.json else format_report(report))
    return EXIT_OK


def _analyze_target(args, config):
    hardware = target_hardware(args.target)
    sizes = parse_mesh(config.parallel.mesh)
    if args.gpus is not None and args.gpus < 1:  # 0 is a count like -4, not "the default"
        raise JaxdistError(f"--gpus {args.gpus}: the run needs at least one GPU")
    default = mesh_device_count(sizes) if sizes is not None and -1 not in sizes.values() else 8
    gpus = default if args.gpus is None else args.gpus
    if sizes is not None and -1 in sizes.values():
        settle_remaining_axis(config, 1, gpus)
        sizes = parse_mesh(config.parallel.mesh)
    resolve_vocab(config)
    trainer, compiled, options = compile_for_target(config, sizes, hardware, gpus, args.gpus_per_node)
    report = target_report(trainer, compiled, hardware, options, args.gpus_per_node)
    if not report["fits"]:
        log.info(f"{config.name} does not fit {hardware.name}: {report['fits_note']}")
    return report, compiled.as_text()


def _write(path: str, text: str) -> None:
    try:
        with open(path, "w") as f:
            f.write(text)
    except OSError as e:
        raise JaxdistError(f"--hlo-out {path}: {e.strerror}") from None


if __name__ == "__main__":
    sys.exit(main())
