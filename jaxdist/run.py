"""One training run as a library: devices, trainer, data, resume, the loop.

``python -m jaxdist.train`` is a thin CLI over ``run``; ``analyze``, ``supervise`` and
the experiments import ``prepare_devices`` and ``build_trainer`` from here.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import sys
import time
from pathlib import Path

from jaxdist.config import Config
from jaxdist.distributed import ENV_PROCESS_ID
from jaxdist.errors import JaxdistError
from jaxdist.mesh import (
    MeshSizes,
    ensure_fake_cpu_devices,
    forced_host_device_count,
    format_mesh,
    gpu_plugin_installed,
    has_remaining_axis,
    mesh_device_count,
    parse_mesh,
    resolve_mesh,
)
from jaxdist.validate import check_config_on_mesh

DEFAULT_FAKE_DEVICES = 8  # `--mesh auto` without an accelerator


def prepare_devices(config: Config, num_processes: int = 1) -> MeshSizes | None:
    """Validate the mesh against the config; on CPU ask for enough fake devices (split
    over the processes), on GPU set the communication-overlap XLA flags.

    Runs before JAX starts its backend. Returns the mesh sizes (None for ``auto``; on GPU
    a ``-1`` axis stays unresolved until ``settle_remaining_axis`` sees the devices).
    """
    settle_remaining_axis(config, num_processes)
    sizes = parse_mesh(config.parallel.mesh)
    if has_remaining_axis(sizes):  # GPU: sized and checked once the backend has started
        from jaxdist.xla_flags import apply_gpu_defaults

        apply_gpu_defaults()
        return sizes
    if config.parallel.dcn_mesh:
        parse_mesh(config.parallel.dcn_mesh)  # reject a malformed spec before JAX starts
    if sizes is not None:
        resolve_vocab(config)
        check_config_on_mesh(config, sizes)  # warnings are printed once, by build_trainer
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


def settle_remaining_axis(config: Config, num_processes: int = 1, n_devices: int | None = None) -> None:
    """Size a ``-1`` mesh axis and write the concrete mesh into the config (so the saved
    config.yaml says what ran). On CPU the device count is the fake devices per process x
    processes, known before JAX starts; on GPU it waits for ``n_devices``."""
    sizes = parse_mesh(config.parallel.mesh)
    if not has_remaining_axis(sizes):
        return
    if n_devices is None:
        if gpu_plugin_installed():
            return
        n_devices = (forced_host_device_count() or DEFAULT_FAKE_DEVICES) * num_processes
    resolved = resolve_mesh(sizes, n_devices)
    if os.environ.get(ENV_PROCESS_ID, "0") == "0":
        print(f"jaxdist: mesh {config.parallel.mesh} on {n_devices} devices is {format_mesh(resolved)}", file=sys.stderr)
    config.parallel.mesh = format_mesh(resolved)


def resolve_vocab(config: Config) -> None:
    """``model.vocab_size=0`` follows the data's tokenizer (padded to a multiple of 128)."""
    from jaxdist.data.sources import data_vocab_size, pad_vocab, record_tokenizer

    if config.model.kind != "llama":
        return
    record_tokenizer(config)  # the run's saved config names the data's tokenizer, for generate and eval
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
    from jaxdist.parallel import parallelize
    from jaxdist.sharding import Layout, resolve_strategy
    from jaxdist.trainer import Trainer

    devices = list(jax.devices() if devices is None else devices)
    resolve_vocab(config)
    task = build_task(config, devices[0].platform)
    if mesh_sizes is None:
        mesh_sizes = auto_mesh(len(devices), task.n_params)
    for line in (*task.notes, *check_config_on_mesh(config, mesh_sizes)):
        if jax.process_index() == 0:
            print(line, file=sys.stderr)
    dcn = parse_mesh(config.parallel.dcn_mesh) if config.parallel.dcn_mesh else None
    mesh = build_mesh(mesh_sizes, devices, dcn)
    layout = Layout(mesh, resolve_strategy(config.parallel.strategy, mesh_sizes))
    return Trainer(parallelize(task, config, mesh_sizes), config, layout)


def compile_cache_dir(config: Config, run_dir: Path | None) -> Path | None:
    """Where XLA's persistent compilation cache goes, checked (nothing is created yet).

    ``train.compile_cache``: ``auto`` (``RUN_DIR/xla_cache``; none without a run dir),
    ``off``, or a directory. The cache holds native code that XLA loads and runs, so a
    directory someone else can write to is refused: it must be this user's, and not
    group- or world-writable.
    """
    choice = config.train.compile_cache
    if choice == "off" or (choice == "auto" and run_dir is None):
        return None
    path = run_dir / "xla_cache" if choice == "auto" else Path(choice)
    _check_private(path)
    return path


def _check_private(path: Path) -> None:
    import stat

    try:
        info = path.stat()
    except (FileNotFoundError, NotADirectoryError):
        return  # created private (0700) by enable_compile_cache (or the run directory cannot be, said later)
    except OSError as e:
        raise JaxdistError(f"train.compile_cache {path}: {e.strerror}") from None
    if not stat.S_ISDIR(info.st_mode):
        raise JaxdistError(f"train.compile_cache {path} is not a directory")
    if info.st_uid != os.getuid():
        raise JaxdistError(
            f"train.compile_cache {path} belongs to another user (uid {info.st_uid}): XLA would run the native code it holds; "
            "use a directory of your own (the default, train.compile_cache=auto, is RUN_DIR/xla_cache)"
        )
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise JaxdistError(
            f"train.compile_cache {path} is writable by others (mode {stat.S_IMODE(info.st_mode):o}): XLA would run whatever native "
            f"code is put there; chmod go-w {path}, or use a private directory"
        )


def enable_compile_cache(config: Config, run_dir: Path | None) -> Path | None:
    """Turn on XLA's persistent compilation cache, so a restarted run does not compile
    again (see ``compile_cache_dir``). The cache is per process: the first run that sets
    it wins."""
    import jax

    path = compile_cache_dir(config, run_dir)
    if path is None:
        return None
    if jax.config.jax_compilation_cache_dir:
        return Path(jax.config.jax_compilation_cache_dir)
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as e:
        raise JaxdistError(f"train.compile_cache {path}: cannot create it ({e.strerror})") from None
    _check_private(path)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    return path


def run(
    config: Config,
    mesh_sizes: MeshSizes | None,
    run_dir: Path | None,
    *,
    devices=None,
    progress: bool = True,
    resume: str = "auto",
    print_lines: bool = False,
    init_from: str | None = None,
):
    """Train ``config`` on a mesh until ``train.steps``; returns the loop's result.

    With a run directory: checkpoints under it, resumes per ``resume``, and saves and
    raises ``Preempted`` on SIGTERM / SIGINT. ``init_from``: a checkpoint whose weights
    start the run (fresh optimizer, step 0) when the run has no checkpoint of its own.
    """
    import jax

    from jaxdist.checkpoint import Checkpointer, checkpoint_steps, parse_resume, warn
    from jaxdist.data.pipeline import eval_batches, make_iterator
    from jaxdist.mesh import format_mesh
    from jaxdist.metrics import MetricsLogger, peak_flops_per_device
    from jaxdist.optim import schedule_length
    from jaxdist.preemption import PreemptionWatcher
    from jaxdist.resume import continue_data, initial_weights, restore_checkpoint, schedule_change, weights_resume
    from jaxdist.trainer import LoopHooks, train_loop

    resume, init_from = weights_resume(resume, init_from, warn)
    compile_cache_dir(config, run_dir)  # refused before anything is written
    config.train.schedule_steps = schedule_length(config.train)  # config.yaml and checkpoints record what the run uses
    trainer = build_trainer(config, mesh_sizes, devices)
    task, layout, mesh = trainer.task, trainer.layout, trainer.layout.mesh
    devices = list(mesh.devices.flat)
    batches = make_iterator(config, layout)  # opens the data: its errors come before anything is written
    if run_dir is not None:
        mode, _, _ = parse_resume(resume, run_dir / "checkpoints")
        if mode == "never" and checkpoint_steps(run_dir / "checkpoints"):
            raise JaxdistError(f"--resume never: {run_dir} already has checkpoints; choose another --run-dir")
    if init_from and (run_dir is None or not checkpoint_steps(run_dir / "checkpoints")):
        from jaxdist.weights import check_params_fit, find_checkpoint

        check_params_fit(find_checkpoint(init_from), trainer.abstract_params())  # before anything is written

    is_main = jax.process_index() == 0
    checkpointer = None
    if run_dir is not None:
        if is_main:
            create_run_dir(run_dir)
        checkpointer = Checkpointer(run_dir / "checkpoints", config.checkpoint)
    enable_compile_cache(config, run_dir)
    t = config.train
    logger = MetricsLogger(run_dir, t.steps, enabled=is_main, progress=progress, print_lines=print_lines)
    try:
        restored = restore_checkpoint(trainer, config, run_dir, resume, checkpointer, warn) if checkpointer else None
        if run_dir is not None and is_main:  # after the resume check: a rejected config does not overwrite the saved one
            write_config(run_dir, config)
        if restored is None:
            state = trainer.init_state(t.seed, initial_weights(trainer, init_from, logger.message) if init_from else None)
        else:
            if init_from:
                logger.message(
                    f"jaxdist: --init-from {init_from} is not used: the run resumes from its own checkpoint step {restored.step}"
                )
            state = restored.state
            batches = continue_data(batches, restored, config, layout, warn)
            saved_mesh = restored.config.get("parallel", {}).get("mesh", "?")
            logger.message(f"jaxdist: resumed from step {restored.step} ({restored.path}; saved on mesh {saved_mesh})")
            change = schedule_change(restored, config)
            if change:
                logger.message(change)
            logger.advance(restored.step)
        logger.message(
            f"jaxdist: {config.name} | {trainer.n_params / 1e6:.2f}M params | mesh {format_mesh(dict(mesh.shape))} "
            f"({mesh.size} {devices[0].platform}) | strategy {layout.strategy} | run dir {run_dir}"
        )
        first = next(batches)
        compile_start = time.perf_counter()
        step_fn = trainer.compile_step(state, first, logger)
        logger.message(f"jaxdist: train step compiled in {time.perf_counter() - compile_start:.1f}s")
        hooks = LoopHooks(
            eval_batches=lambda: eval_batches(config, layout),
            checkpointer=checkpointer,
            data_state=batches.get_state,
            config_dict=config.to_dict(),
            tracer=profile_window(trainer, step_fn, run_dir, int(jax.device_get(state.step)), logger),
        )
        with PreemptionWatcher(multi_process=jax.process_count() > 1) as hooks.preemption, contextlib.closing(hooks.tracer):
            result = train_loop(
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
        if 0 < t.stop_after_step < t.steps:
            saved = "; saved, run again without train.stop_after_step to continue" if checkpointer else ""
            logger.message(f"jaxdist: stopped after step {t.stop_after_step} of {t.steps} (train.stop_after_step){saved}")
        return result
    finally:
        batches.close()
        if checkpointer is not None:
            checkpointer.wait()
            checkpointer.close()
        logger.close()


def profile_window(trainer, compiled_step, run_dir: Path | None, start_step: int, logger):
    """The tracer for ``train.profile_steps`` (a no-op without one); process 0 writes the
    compiled step's analysis now and the bottleneck report when the window closes."""
    import json

    import jax

    from jaxdist.config import profile_window as parse_window
    from jaxdist.tracing import ProfileWindow, StepTracer

    config = trainer.config
    if not config.train.profile_steps or run_dir is None:
        return StepTracer()
    first, last = parse_window(config.train.profile_steps)
    if start_step >= last:
        logger.message(f"jaxdist: warning: resumed at step {start_step}, past the profile window {first}:{last}; not tracing")
        return StepTracer()
    if start_step >= first:
        logger.message(f"jaxdist: resumed inside the profile window: tracing steps {start_step + 1}:{last}")
        first = start_step + 1
    out_dir = run_dir / "profile"
    is_main = jax.process_index() == 0
    if is_main:
        from jaxdist.analyze import build_report
        from jaxdist.metrics import peak_flops_per_device

        out_dir.mkdir(parents=True, exist_ok=True)
        analysis = build_report(trainer, compiled_step)
        analysis["peak_flops_per_device"] = peak_flops_per_device(list(trainer.layout.mesh.devices.flat), config.train.peak_flops)
        (out_dir / "analysis.json").write_text(json.dumps(analysis, indent=1))

    def summarise() -> None:
        if not is_main:
            return
        from jaxdist.profile import summarize

        try:
            report = summarize(run_dir)  # writes profile/summary.json and breakdown.png
        except JaxdistError as e:  # a report that cannot be made must not stop the training
            logger.message(f"jaxdist: warning: no profile report ({e}); the trace is in {out_dir}")
            return
        shares = ", ".join(f"{k} {v:.0%}" for k, v in report["fractions"].items())
        logger.message(f"jaxdist: profile of steps {first}:{last}: {report['bound']}-bound ({shares}); python -m jaxdist.profile {run_dir}")

    facts = {
        "mesh": {a: int(n) for a, n in trainer.layout.mesh.shape.items()},
        "strategy": str(trainer.layout.strategy),
        "platform": trainer.layout.mesh.devices.flat[0].platform,
        "config": config.to_dict(),
    }
    return ProfileWindow(first, last, out_dir, facts, on_done=summarise)


def create_run_dir(run_dir: Path) -> None:
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise JaxdistError(f"cannot write run directory {run_dir}: {e.strerror}") from None


def write_config(run_dir: Path, config: Config) -> None:
    import yaml

    try:
        (run_dir / "config.yaml").write_text(yaml.safe_dump(config.to_dict(), sort_keys=False))
    except OSError as e:
        raise JaxdistError(f"cannot write run directory {run_dir}: {e.strerror}") from None


def default_run_dir(config: Config) -> Path:
    return Path("runs") / f"{config.name}-{time.strftime('%Y%m%d-%H%M%S')}"
