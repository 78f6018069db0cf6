"""``python -m jaxdist.train``: parse -> mesh -> model -> data -> loop.

    python -m jaxdist.train [--config NAME_OR_PATH] [--mesh SPEC] [--steps N]
                            [--run-dir DIR] [--log-every N] [--seed S]
                            [--resume auto|never|STEP|PATH] [--max-restarts N] [key.sub=value ...]

Exit codes: 0 done, 2 bad input, 3 non-finite loss, 4 a checkpoint could not be
written, 75 preempted (state saved: run the same command again to resume).
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from jaxdist.config import Config, load_config
from jaxdist.errors import EXIT_BAD_INPUT, EXIT_OK, JaxdistError, NonFiniteLoss, OneLineArgumentParser
from jaxdist.mesh import MeshSizes, check_divisibility, ensure_fake_cpu_devices, gpu_plugin_installed, mesh_device_count, parse_mesh

DEFAULT_FAKE_DEVICES = 8  # `--mesh auto` without an accelerator
SUPERVISED_ENV = "JAXDIST_SUPERVISED"  # set in runs started by --max-restarts


def build_arg_parser(prog: str = "python -m jaxdist.train") -> argparse.ArgumentParser:
    parser = OneLineArgumentParser(prog=prog, description="Train a model on a device mesh.")
    parser.add_argument("--config", default=None, help="preset name (configs/NAME.yaml) or YAML path; default: built-in tiny model")
    parser.add_argument("--mesh", default=None, help="AxB (data x tensor), name=size,... (data, fsdp, tensor) or auto")
    parser.add_argument("--steps", type=int, default=None, help="train.steps")
    parser.add_argument("--seed", type=int, default=None, help="train.seed")
    parser.add_argument("--log-every", type=int, default=None, help="train.log_every")
    parser.add_argument("--run-dir", default=None, help="where metrics, config and checkpoints go (default runs/NAME-TIME)")
    parser.add_argument("--dcn-mesh", default=None, help="the across-host part of the mesh, e.g. data=2 (default: derived)")
    parser.add_argument("--coordinator", default=None, help="HOST:PORT of process 0, for a multi-process run")
    parser.add_argument("--num-processes", type=int, default=None, help="processes in the run")
    parser.add_argument("--process-id", type=int, default=None, help="this process's rank")
    parser.add_argument("--dist-timeout", type=int, default=300, help="seconds to wait for all processes to join")
    parser.add_argument("--resume", default="auto", help="auto (latest checkpoint in the run dir, if any) | never | STEP | PATH")
    parser.add_argument("--max-restarts", type=int, default=0, help="restart a crashed run from its latest checkpoint up to N times")
    parser.add_argument("--restart-delay", type=float, default=5.0, help="seconds before the first restart; doubles each time")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. model.n_layers=2")
    return parser


def config_from_args(args: argparse.Namespace) -> Config:
    overrides = list(args.overrides)
    for flag, key in (("steps", "train.steps"), ("seed", "train.seed"), ("log_every", "train.log_every")):
        if getattr(args, flag) is not None:
            overrides.append(f"{key}={getattr(args, flag)}")
    if args.mesh is not None:
        overrides.append(f"parallel.mesh={args.mesh}")
    if getattr(args, "dcn_mesh", None) is not None:
        overrides.append(f"parallel.dcn_mesh={args.dcn_mesh}")
    return load_config(args.config, overrides)


def prepare_devices(config: Config, num_processes: int = 1) -> MeshSizes | None:
    """Validate the mesh against the config; on CPU ask for enough fake devices (split
    over the processes), on GPU set the communication-overlap XLA flags.

    Runs before JAX starts its backend. Returns the mesh sizes (None for ``auto``).
    """
    sizes = parse_mesh(config.parallel.mesh)
    if config.parallel.dcn_mesh:
        parse_mesh(config.parallel.dcn_mesh)  # reject a malformed spec before JAX starts
    if sizes is not None:
        check_divisibility(sizes, config)
    if gpu_plugin_installed():
        from jaxdist.xla_flags import apply_gpu_defaults

        apply_gpu_defaults()
    elif sizes is not None:
        if mesh_device_count(sizes) % num_processes:
            raise JaxdistError(
                f"mesh {config.parallel.mesh} ({mesh_device_count(sizes)} devices) does not split over {num_processes} processes"
            )
        ensure_fake_cpu_devices(mesh_device_count(sizes) // num_processes)
    else:
        ensure_fake_cpu_devices(DEFAULT_FAKE_DEVICES)
    return sizes


def resolve_vocab(config: Config) -> None:
    """``model.vocab_size=0`` follows the data's tokenizer (padded to a multiple of 128)."""
    from jaxdist.data.sources import data_vocab_size, pad_vocab

    if config.model.kind != "llama":
        return
    needed = data_vocab_size(config)
    if config.model.vocab_size == 0:
        config.model.vocab_size = pad_vocab(needed)
    elif config.model.vocab_size < needed:
        raise JaxdistError(f"model.vocab_size ({config.model.vocab_size}) is smaller than the tokenizer's {needed} ids")


def build_trainer(config: Config, mesh_sizes: MeshSizes | None, devices=None):
    """Task, mesh and Trainer for ``config``; nothing is allocated yet (shapes only)."""
    import jax

    from jaxdist.mesh import auto_mesh, build_mesh
    from jaxdist.models import build_task
    from jaxdist.sharding import Layout, resolve_strategy
    from jaxdist.trainer import Trainer

    devices = list(jax.devices() if devices is None else devices)
    resolve_vocab(config)
    task = build_task(config, devices[0].platform, (mesh_sizes or {}).get("pipe", 1))
    if mesh_sizes is None:
        mesh_sizes = auto_mesh(len(devices), task.n_params)
    check_divisibility(mesh_sizes, config)
    dcn = parse_mesh(config.parallel.dcn_mesh) if config.parallel.dcn_mesh else None
    mesh = build_mesh(mesh_sizes, devices, dcn)
    layout = Layout(mesh, resolve_strategy(config.parallel.strategy, mesh_sizes))
    return Trainer(task, config, layout)


def adapt_microbatches_for_resume(config: Config, run_dir: Path | None, resume: str) -> None:
    """Elastic restart keeps the global batch: when the new mesh cannot split it into the
    configured microbatches, use the largest count that fits (pure Python, before JAX)."""
    from jaxdist.checkpoint import checkpoint_steps

    sizes, t = parse_mesh(config.parallel.mesh), config.train
    if sizes is None or run_dir is None or resume == "never" or not checkpoint_steps(run_dir / "checkpoints"):
        return
    shards = sizes["data"] * sizes["fsdp"]
    if t.global_batch % shards or t.global_batch % (shards * t.microbatches) == 0:
        return
    fitting = max(m for m in range(1, t.microbatches + 1) if t.global_batch % (shards * m) == 0)
    print(
        f"jaxdist: resuming on data x fsdp = {shards}: train.microbatches {t.microbatches} -> {fitting} keeps the global batch {t.global_batch}",
        file=sys.stderr,
    )
    t.microbatches = fitting


def _restore(trainer, config: Config, run_dir: Path, resume: str, checkpointer, log):
    """The restored checkpoint for ``--resume``, or None to start fresh."""
    from jaxdist.checkpoint import Checkpointer, parse_resume

    mode, directory, step = parse_resume(resume, run_dir / "checkpoints")
    if mode == "never":
        return None
    own = directory.absolute() == checkpointer.directory.absolute()
    source = checkpointer if own else Checkpointer(directory, config.checkpoint, read_only=True)
    try:
        if mode == "step":
            return source.restore(step, trainer.abstract_state())
        return source.restore_latest(trainer.abstract_state(), warn=log)
    finally:
        if not own:
            source.close()


def run(
    config: Config,
    mesh_sizes: MeshSizes | None,
    run_dir: Path | None,
    *,
    devices=None,
    progress: bool = True,
    resume: str = "auto",
    print_lines: bool = False,
):
    """Train ``config`` on a mesh until ``train.steps``; returns the loop's result.

    With a run directory: checkpoints under it, resumes per ``resume``, and saves and
    raises ``Preempted`` on SIGTERM / SIGINT.
    """
    import jax

    from jaxdist.checkpoint import Checkpointer, checkpoint_steps, parse_resume, warn
    from jaxdist.data.pipeline import eval_batches, make_iterator
    from jaxdist.mesh import format_mesh
    from jaxdist.metrics import MetricsLogger, peak_flops_per_device
    from jaxdist.preemption import PreemptionWatcher
    from jaxdist.trainer import LoopHooks, train_loop

    trainer = build_trainer(config, mesh_sizes, devices)
    task, layout, mesh = trainer.task, trainer.layout, trainer.layout.mesh
    devices = list(mesh.devices.flat)
    batches = make_iterator(config, layout)  # opens the data: its errors come before anything is written
    if run_dir is not None:
        mode, _, _ = parse_resume(resume, run_dir / "checkpoints")
        if mode == "never" and checkpoint_steps(run_dir / "checkpoints"):
            raise JaxdistError(f"--resume never: {run_dir} already has checkpoints; choose another --run-dir")

    is_main = jax.process_index() == 0
    checkpointer = None
    if run_dir is not None:
        if is_main:
            _create_run_dir(run_dir, config)
        checkpointer = Checkpointer(run_dir / "checkpoints", config.checkpoint)
    t = config.train
    logger = MetricsLogger(run_dir, t.steps, enabled=is_main, progress=progress, print_lines=print_lines)
    try:
        restored = _restore(trainer, config, run_dir, resume, checkpointer, warn) if checkpointer else None
        if restored is None:
            state = trainer.init_state(t.seed)
        else:
            state = restored.state
            batches = _continue_data(batches, restored, config, layout, warn)
            saved_mesh = restored.config.get("parallel", {}).get("mesh", "?")
            logger.message(f"jaxdist: resumed from step {restored.step} ({restored.path}; saved on mesh {saved_mesh})")
            logger.advance(restored.step)
        logger.message(
            f"jaxdist: {config.name} | {trainer.n_params / 1e6:.2f}M params | mesh {format_mesh(dict(mesh.shape))} "
            f"({mesh.size} {devices[0].platform}) | strategy {layout.strategy} | run dir {run_dir}"
        )
        first = next(batches)
        compile_start = time.perf_counter()
        step_fn = trainer.train_step.lower(state, first).compile()
        logger.message(f"jaxdist: train step compiled in {time.perf_counter() - compile_start:.1f}s")
        hooks = LoopHooks(
            eval_batches=lambda: eval_batches(config, layout),
            checkpointer=checkpointer,
            data_state=batches.get_state,
            config_dict=config.to_dict(),
        )
        with PreemptionWatcher(multi_process=jax.process_count() > 1) as hooks.preemption:
            return train_loop(
                trainer,
                state,
                itertools.chain([first], batches),
                step_fn=step_fn,
                steps=t.steps,
                logger=logger,
                flops_per_step=task.flops_per_example * t.global_batch,
                peak_flops=peak_flops_per_device(devices, t.peak_flops),
                tokens_per_step=task.tokens_per_example * t.global_batch,
                hooks=hooks,
            )
    finally:
        batches.close()
        if checkpointer is not None:
            checkpointer.wait()
            checkpointer.close()
        logger.close()


def _continue_data(batches, restored, config: Config, layout, log):
    """Put the data stream where the checkpoint left it: Grain's own state when this
    process layout wrote one, else the step (batch k is a function of k alone)."""
    saved_batch = restored.config.get("train", {}).get("global_batch")
    if saved_batch not in (None, config.train.global_batch):
        log(
            f"jaxdist: warning: train.global_batch changed {saved_batch} -> {config.train.global_batch}; the data stream restarts its order at step {restored.step}"
        )
    if restored.data_state is not None:
        try:
            batches.set_state(restored.data_state)
            return batches
        except Exception:  # noqa: BLE001 - e.g. another worker count: fall back to the step
            pass
    from jaxdist.data.pipeline import make_iterator

    batches.close()
    return make_iterator(config, layout, start_step=restored.step)


def _create_run_dir(run_dir: Path, config: Config) -> None:
    import yaml

    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(yaml.safe_dump(config.to_dict(), sort_keys=False))
    except OSError as e:
        raise JaxdistError(f"cannot write run directory {run_dir}: {e.strerror}") from None


def default_run_dir(config: Config) -> Path:
    return Path("runs") / f"{config.name}-{time.strftime('%Y%m%d-%H%M%S')}"


def main(argv: Sequence[str] | None = None) -> int:
    from jaxdist.checkpoint import CheckpointError
    from jaxdist.preemption import Preempted

    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = build_arg_parser().parse_args(argv)
        config = config_from_args(args)
        run_dir = Path(args.run_dir) if args.run_dir else default_run_dir(config)
        if args.max_restarts > 0 and not os.environ.get(SUPERVISED_ENV):
            from jaxdist.supervise import supervise

            return supervise(argv, run_dir, args.max_restarts, args.restart_delay)
        from jaxdist.distributed import initialize, process_group_from

        group = process_group_from(args)
        adapt_microbatches_for_resume(config, run_dir, args.resume)
        sizes = prepare_devices(config, group.num_processes if group and group.num_processes else 1)
        initialize(group)
        interactive = sys.stderr.isatty()
        result = run(config, sizes, run_dir, resume=args.resume, progress=interactive, print_lines=not interactive)
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
