"""One training run, from its command line (``train_process``) or as a library (``run``).

``python -m jaxdist.train`` calls ``train_process``: supervise the run (``--max-restarts``),
choose the platform, resolve the run once (``training.run_plan``: the mesh, the start, the
microbatches, the vocabulary; its config frozen from then on), join the process group, then
``run_resolved``: the Trainer (``training.step``), the data, the start, the loop. ``run`` is
the same for a library caller. The analysis, the planner and the tools build a Trainer with
``build_trainer``.

The order matters before JAX starts its backend: the mesh and the config are checked and
the platform chosen (fake CPU devices, or the GPU flags) first, so errors cost no backend
start-up; on a GPU a ``-1`` axis can only be sized once ``jax.distributed`` has joined the
processes. This module is imported before that, so it imports JAX inside its functions.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import logging
import os
import sys
import time
from collections.abc import Collection
from pathlib import Path

from jaxdist.cli import config_from_args
from jaxdist.cluster import recoverable
from jaxdist.cluster.heartbeat import fault_point
from jaxdist.config import Config, is_frozen
from jaxdist.errors import EXIT_OK, JaxdistError
from jaxdist.layout.mesh import MeshSizes, parse_mesh
from jaxdist.layout.validate import check_config_on_mesh
from jaxdist.training.run_plan import RunPlan, resolve_run

log = logging.getLogger(__name__)


# -- the command line ------------------------------------------------------------------------


def train_process(args: argparse.Namespace, argv: list[str]) -> int:
    """Run the training ``args`` describe (``argv``: the same, as given, for a supervisor that
    restarts them); the exit code (``jaxdist.train``'s table). Errors are raised (the CLI's
    ``errors.command`` says them in one line)."""
    from jaxdist.cluster.heartbeat import install_stack_dump
    from jaxdist.cluster.supervise import SUPERVISED_ENV

    install_stack_dump()  # under jaxdist.launch: SIGUSR1 prints the Python stacks of a stalled process
    fault_point("start")
    if args.profile_steps is not None:
        args.overrides.append(f"train.profile_steps={args.profile_steps}")
    config = config_from_args(args)
    recoverable.MEMBERSHIP.mesh_spec = config.parallel.mesh  # as given: an in-process recovery sizes its -1 axis again
    run_dir, durable = run_directories(args.run_dir, config)
    if args.max_restarts > 0 and not os.environ.get(SUPERVISED_ENV):
        from jaxdist.cluster.supervise import supervise

        return supervise(argv, durable or run_dir, args.max_restarts, args.restart_delay)
    if durable:
        from jaxdist.training.checkpoint_tiers import prepare_local_tier

        prepare_local_tier(run_dir, durable, args.resume)
    from jaxdist.training.peer_failure import quiet_lost_peer_tracebacks

    quiet_lost_peer_tracebacks(run_dir)  # a peer's death mid-commit: Orbax's thread prints one line, not a traceback
    if recoverable.in_process_recovery():
        from jaxdist import errors
        from jaxdist.training.peer_failure import exit_past_abandoned_saves

        if exit_past_abandoned_saves not in errors.BEFORE_ERROR_EXIT:
            errors.BEFORE_ERROR_EXIT.append(exit_past_abandoned_saves)
    try:
        plan = _join(args, config, run_dir, durable)
        interactive = sys.stderr.isatty()
        result = run_resolved(plan, progress=interactive, print_lines=not interactive, started=process_started())
        import jax

        if recoverable.in_process_recovery() and jax.process_count() > 1:
            recoverable.MEMBERSHIP.leave()  # recoverable tasks skip JAX's shutdown barrier: the live ones meet here
    except Exception as e:
        if not (recoverable.in_process_recovery() and recoverable.is_peer_failure(e)):
            raise
        from jaxdist.training.peer_failure import leave_for_a_restart

        return leave_for_a_restart(e, run_dir)  # a death off a step boundary: the launcher restarts
    if result.losses:
        t = plan.config.train
        end = t.stop_after_step if 0 < t.stop_after_step < t.steps else t.steps
        log.info(f"done at step {end}; loss {result.losses[0]:.4f} -> {result.losses[-1]:.4f}")
    if recoverable.MEMBERSHIP.changed:
        from jaxdist.training.recovery import leave_past_abandoned_saves

        leave_past_abandoned_saves(EXIT_OK)
    return EXIT_OK


def run_directories(run_dir: str | None, config: Config) -> tuple[Path, str | None]:
    """(the folder the run writes to, the durable tier its checkpoints are copied to or None)
    for ``--run-dir`` (None: a new ``runs/NAME-TIME``) and ``checkpoint.local_dir``."""
    from jaxdist.training.checkpoint_tiers import run_tiers

    return run_tiers(run_dir or str(default_run_dir(config)), config.checkpoint.local_dir)


def _join(args: argparse.Namespace, config: Config, run_dir: Path, durable: str | None = None) -> RunPlan:
    """Choose the platform, resolve the run, join the process group: the run's plan, its
    mesh sized to the devices (on GPU a ``-1`` axis is sized once the processes have joined)."""
    from jaxdist.cluster.distributed import hide_gloo_lines, initialize, process_group_from
    from jaxdist.layout.devices import prepare_devices, run_on_cpu_unless_gpu
    from jaxdist.layout.mesh import has_remaining_axis

    group = process_group_from(args)
    hide_gloo_lines(args.log_level, group)  # before initialize: gloo prints at the first collectives
    num_processes = group.num_processes if group and group.num_processes else 1
    quiet = bool(group and group.process_id)  # only process 0 says what a -1 axis became
    parse_mesh(config.parallel.mesh)  # a malformed mesh is said before anything else
    run_on_cpu_unless_gpu()  # before anything imports JAX (a weights-only --resume PATH is read with it)
    plan = resolve_run(
        config, run_dir, resume=args.resume, init_from=args.init_from, num_processes=num_processes, quiet=quiet, durable_dir=durable
    )
    prepare_devices(plan.config, num_processes)
    initialize(group)
    fault_point("init")
    if recoverable.rejoining():  # a replacement: into the survivors' next step boundary at once (they wait for it)
        import jax

        recoverable.announce(jax.devices())
    if has_remaining_axis(plan.mesh_sizes):  # GPU: the device count is known now
        import jax

        plan = resolve_run(
            config,
            run_dir,
            resume=args.resume,
            init_from=args.init_from,
            num_processes=num_processes,
            n_devices=jax.device_count(),
            quiet=jax.process_index() != 0,
            durable_dir=durable,
        )
        check_config_on_mesh(plan.config, plan.mesh_sizes)
    return plan


# -- the run -----------------------------------------------------------------------------------


def build_trainer(config: Config, mesh_sizes: MeshSizes | None, devices=None, *, ordered: bool = False, used_keys: Collection[str] = ()):
    """The Trainer for ``config`` on a mesh of ``devices`` (default: JAX's); nothing is
    allocated yet (shapes only). ``ordered``: the mesh takes ``devices`` in their order (``build_mesh``)."""
    import jax

    from jaxdist.data.sources import resolve_vocab
    from jaxdist.layout.mesh import auto_mesh, build_mesh
    from jaxdist.layout.sharding import Layout
    from jaxdist.layout.strategy import resolve_strategy
    from jaxdist.models import build_task
    from jaxdist.parallel import parallelize
    from jaxdist.training.dpo import preference_task
    from jaxdist.training.step import Trainer

    devices = list(jax.devices() if devices is None else devices)
    if not is_frozen(config):  # a tool's config (analyze, plan); a run's plan is resolved already
        resolve_vocab(config)
    task = preference_task(build_task(config, devices[0].platform, getattr(devices[0], "compute_capability", None)), config)
    if mesh_sizes is None:
        mesh_sizes = auto_mesh(len(devices), task.n_params)
    for line in check_config_on_mesh(config, mesh_sizes, used_keys):  # raises before anything is built
        log.warning(line)
    dcn = parse_mesh(config.parallel.dcn_mesh) if config.parallel.dcn_mesh else None
    mesh = build_mesh(mesh_sizes, devices, dcn, ordered=ordered)
    strategy = resolve_strategy(config.parallel.strategy, mesh_sizes, config.parallel.collective_matmul)
    layout = Layout(mesh, strategy, context_load_balance=config.parallel.context_load_balance)
    return Trainer(parallelize(task, config, mesh), config, layout)


def run(
    config: Config,
    mesh_sizes: MeshSizes | None,
    run_dir: Path | str | None,
    *,
    devices=None,
    progress: bool = True,
    resume: str = "auto",
    print_lines: bool = False,
    init_from: str | None = None,
):
    """Train ``config`` on a mesh until ``train.steps``; returns the loop's result.

    With a run directory: checkpoints under it (full ones and, with
    ``checkpoint.params_every_steps``, weights-only ones), resumes per ``resume`` (auto |
    never | STEP | PATH | params:STEP), and saves and raises ``Preempted`` on SIGTERM /
    SIGINT. ``init_from``: a checkpoint whose weights start the run (fresh optimizer,
    step 0) when the run has no checkpoint of its own. ``config`` is not changed: the run
    uses its resolved, frozen copy (``run_plan.resolve_run``). ``run_dir`` may be a URL
    (with ``checkpoint.local_dir``: ``training.checkpoint_tiers``).
    """
    started = time.time()
    durable = None
    if run_dir is not None:
        run_dir, durable = run_directories(str(run_dir), config)
        if durable:
            from jaxdist.training.checkpoint_tiers import prepare_local_tier

            prepare_local_tier(run_dir, durable, resume)
    plan = resolve_run(config, run_dir, resume=resume, init_from=init_from, mesh_sizes=mesh_sizes, durable_dir=durable)
    return run_resolved(plan, devices=devices, progress=progress, print_lines=print_lines, started=started)


def process_started() -> float:
    """When this process was created (epoch seconds): its start-up counts from there (``cluster.goodput``).
    On Linux from its start in clock ticks since boot against the boot clock (10 ms); psutil's
    create_time adds the boot time, which the kernel gives in whole seconds (up to 1 s off)."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22: starttime
        return time.time() - (time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError, AttributeError):
        import psutil

        return psutil.Process().create_time()


def run_resolved(plan: RunPlan, *, devices=None, progress: bool = True, print_lines: bool = False, started: float | None = None):
    """Train the resolved run ``plan`` describes (``run``'s work once the plan is made).
    ``started``: when the run's start-up began (epoch seconds; None: now); from it to the end
    ``RUN_DIR/goodput.json`` accounts the wall time, unless a launcher or supervisor accounts
    for the whole run (``cluster.goodput``)."""
    import jax

    from jaxdist.cluster.elastic import record as elastic_record
    from jaxdist.cluster.recoverable import in_process_recovery
    from jaxdist.data.batches import eval_batches, make_iterator
    from jaxdist.layout.mesh import format_mesh
    from jaxdist.storage.remote import redact
    from jaxdist.training.checkpoint import Checkpointer, checkpoint_steps, params_directory, parse_resume
    from jaxdist.training.checkpoint_tiers import durable_steps, replicator_for
    from jaxdist.training.compile_cache import compile_cache_dir, enable_compile_cache
    from jaxdist.training.energy import IntervalEnergy, agree_on_meter, open_meter
    from jaxdist.training.harness_eval import HarnessDuringTraining
    from jaxdist.training.loop import LoopHooks, LoopResult, timed, train_loop
    from jaxdist.training.metrics import MetricsLogger, fp8_peak_flops_per_device, peak_flops_per_device
    from jaxdist.training.preemption import PreemptionWatcher
    from jaxdist.training.recovery import join_running, train_recovering
    from jaxdist.training.reference_pass import ensure_reference_logps
    from jaxdist.training.resume import continue_data, initial_weights, restore_checkpoint, schedule_change
    from jaxdist.training.stragglers import StragglerWatch
    from jaxdist.training.wandb_log import check_wandb, open_wandb_run

    config, run_dir, resume, init_from, weights_dir = plan.config, plan.run_dir, plan.resume, plan.init_from, plan.weights_dir
    check_wandb(config, run_dir, jax.process_index())  # log.wandb without the package: one line before anything is built
    compile_cache_dir(config, run_dir)  # refused before anything is written
    trainer = build_trainer(config, plan.mesh_sizes, devices)
    task, layout, mesh = trainer.task, trainer.layout, trainer.layout.mesh
    devices = list(mesh.devices.flat)
    if config.data.reference_logps and config.train.objective == "dpo":  # checked, or computed from the initial weights
        ensure_reference_logps(trainer, config, plan)
    batches = make_iterator(config, layout)  # opens the data: its errors come before anything is written
    harness_eval = HarnessDuringTraining.from_config(config, run_dir, jax.process_index() == 0)  # unknown tasks: refused here
    if run_dir is not None and weights_dir is None:
        mode, _, _ = parse_resume(resume, run_dir / "checkpoints")
        if mode == "never" and (checkpoint_steps(run_dir / "checkpoints") or checkpoint_steps(params_directory(run_dir / "checkpoints"))):
            raise JaxdistError(f"--resume never: {run_dir} already has checkpoints; choose another --run-dir")
        if mode == "never" and plan.durable_dir and durable_steps(plan.durable_dir):
            raise JaxdistError(f"--resume never: {redact(plan.durable_dir)} already has checkpoints; choose another --run-dir")
    if weights_dir is not None or (init_from and (run_dir is None or not checkpoint_steps(run_dir / "checkpoints"))):
        from jaxdist.training.weights import check_params_fit, find_checkpoint

        check_params_fit(weights_dir or find_checkpoint(init_from), trainer.abstract_params())  # before anything is written

    is_main = jax.process_index() == 0
    rejoin = recoverable.rejoining()  # a replacement: the state, step and mesh come from the live processes

    def open_checkpointer(processes=None):
        checkpointer = Checkpointer(
            run_dir / "checkpoints", config.checkpoint, params_dir=params_directory(run_dir / "checkpoints"), processes=processes
        )
        if plan.durable_dir:
            checkpointer.replicator = replicator_for(run_dir, plan.durable_dir, config.checkpoint)
        return checkpointer

    checkpointer = None
    if run_dir is not None:
        if is_main:
            create_run_dir(run_dir)
        if not rejoin:  # a replacement opens its own once it knows the live processes (Orbax meets them)
            checkpointer = open_checkpointer()
    enable_compile_cache(config, run_dir)
    t = config.train
    logger = MetricsLogger(run_dir, t.steps, enabled=is_main, progress=progress, print_lines=print_lines)
    stopped_by = None  # the exception that ends the run, if one does (the W&B run is then marked failed)
    started = time.time() if started is None else started
    logger.span(0, "startup", started, time.time() - started)
    trained = False  # the loop ran to its end (a finished run, rerun, keeps its goodput.json)
    try:
        with logger.messages_above_the_bar():
            with timed(logger, 0, "restore"):
                restored = (
                    restore_checkpoint(trainer, config, run_dir, resume, checkpointer, weights_dir)
                    if (checkpointer or weights_dir) and not rejoin
                    else None
                )
            restored_at = time.time()  # start-up goes on (state, data, first batch) until the compile
            if restored is not None and restored.step >= min(t.steps, t.stop_after_step or t.steps):  # a finished run, rerun
                why = f"train.stop_after_step={t.stop_after_step}" if 0 < t.stop_after_step < t.steps else f"train.steps={t.steps}"
                logger.advance(restored.step)
                log.info(f"already at step {restored.step} ({why}): nothing to train")
                return LoopResult(restored.state, [], {})  # no losses: the caller says nothing more
            if run_dir is not None and is_main:  # after the resume check: a rejected config does not overwrite the saved one
                write_config(run_dir, config)
            # log.wandb: after the resume check (a rejected or finished run opens none), before any compile
            logger.mirror = open_wandb_run(config, run_dir, plan.durable_dir, jax.process_index())
            joined = None
            if rejoin:
                batches.close()
                joined, measured = join_running(
                    config,
                    build_trainer=lambda sizes, live: build_trainer(config, sizes, live, ordered=True),
                    make_batches=lambda layout, start: make_iterator(config, layout, start_step=start),
                )
                trainer, state, batches = joined.trainer, joined.state, joined.batches
                if run_dir is not None:
                    checkpointer = open_checkpointer((recoverable.MEMBERSHIP.live_processes(), recoverable.MEMBERSHIP.epoch))
            elif restored is None:
                state = trainer.init_state(t.seed, initial_weights(trainer, init_from) if init_from else None)
            else:
                if init_from:
                    log.info(f"--init-from {init_from} is not used: the run resumes from its own checkpoint step {restored.step}")
                state = restored.state
                batches = continue_data(batches, restored, config, layout)
                saved_mesh = restored.config.get("parallel", {}).get("mesh", "?")
                log.info(f"resumed from step {restored.step} ({restored.path}; saved on mesh {saved_mesh})")
                change = schedule_change(restored, config)
                if change:
                    log.info(change)
                logger.advance(restored.step)
            where = f"{redact(plan.durable_dir)} (saved first to {run_dir})" if plan.durable_dir else run_dir
            log.info(
                f"{config.name} | {trainer.n_params / 1e6:.2f}M params | mesh {format_mesh(dict(mesh.shape))} "
                f"({mesh.size} {devices[0].platform}) | strategy {layout.strategy} | run dir {where}"
            )
            compiled_at = [time.time()]  # from the compile to the loop: set-up too (the energy meter, the hooks)
            if joined is not None:
                first, step_fn = joined.first_batch, joined.step_fn
                meter, no_meter = open_meter(devices) if measured else (None, "the run does not measure it")
            else:
                first = next(batches)
                logger.span(0, "setup", restored_at, time.time() - restored_at)
                compile_start = time.perf_counter()
                fault_point("compile")
                with timed(logger, int(jax.device_get(state.step)), "compile"):
                    step_fn = trainer.compile_step(state, first)
                compiled_at = [time.time()]
                log.info(f"train step compiled in {time.perf_counter() - compile_start:.1f}s")
                meter, no_meter = agree_on_meter(*open_meter(devices))
            if meter is None:
                log.info(f"energy is not measured ({no_meter}): joules_per_token and power_w are null")
            hooks = LoopHooks(
                eval_batches=lambda: eval_batches(config, layout),
                checkpointer=checkpointer,
                data_state=batches.get_state,
                config_dict=config.to_dict(),
                tracer=profile_window(trainer, step_fn, run_dir, int(jax.device_get(state.step))),
                energy=IntervalEnergy(meter),
                stragglers=StragglerWatch(t.straggler_factor, t.straggler_window),
                membership_record=(lambda **fields: elastic_record(run_dir, **fields)) if run_dir is not None else None,
                harness=harness_eval,
            )

            def run_loop(trainer, state, batches, step_fn):
                if compiled_at:
                    logger.span(0, "setup", compiled_at[0], time.time() - compiled_at.pop())
                return train_loop(
                    trainer,
                    state,
                    batches,
                    step_fn=step_fn,
                    steps=t.steps,
                    logger=logger,
                    flops_per_step=task.flops_per_example * t.global_batch,
                    peak_flops=peak_flops_per_device(devices, t.peak_flops),
                    tokens_per_step=task.tokens_per_example * t.global_batch,
                    hooks=hooks,
                    fp8_peak_flops=fp8_peak_flops_per_device(devices) if config.model.fp8 != "off" else None,
                )

            with PreemptionWatcher(multi_process=jax.process_count() > 1) as hooks.preemption, contextlib.closing(hooks.tracer):
                if in_process_recovery() and jax.process_count() > 1:  # jaxdist.launch --recovery in-process
                    result, batches = train_recovering(
                        run_loop, trainer, state, first, batches, step_fn, hooks,
                        config=config, run_dir=run_dir, checkpointer=checkpointer,
                        build_trainer=lambda sizes, live: build_trainer(config, sizes, live, ordered=True),
                        make_batches=lambda layout, start: make_iterator(config, layout, start_step=start),
                        make_eval=lambda layout: lambda: eval_batches(config, layout),
                        joined=joined,
                    )  # fmt: skip
                else:
                    result = run_loop(trainer, state, itertools.chain([first], batches), step_fn)
            trained = True
            if 0 < t.stop_after_step < t.steps:
                saved = "; saved, run again without train.stop_after_step to continue" if checkpointer else ""
                log.info(f"stopped after step {t.stop_after_step} of {t.steps} (train.stop_after_step){saved}")
            return result
    except BaseException as e:
        stopped_by = e
        raise
    finally:
        batches.close()
        if checkpointer is not None and not _saves_abandoned(stopped_by):
            with timed(logger, 0, "checkpoint"):
                checkpointer.wait()
            checkpointer.close()
        logger.close(error=stopped_by)
        if run_dir is not None and is_main and trained:
            from jaxdist.cluster import goodput
            from jaxdist.cluster.supervise import accounted_outside

            if not accounted_outside():
                goodput.write(run_dir, started, time.time())


def _saves_abandoned(error: BaseException | None) -> bool:
    """Whether the run ends on a peer's death under in-process recovery (a death off a step
    boundary, for the launcher's restart): a save the dead process took part in never commits,
    and waiting for it would block in Orbax's barrier for the dead process (seen: a kill during
    a save's commit left the survivors waiting there instead of exiting 78)."""
    return error is not None and recoverable.in_process_recovery() and recoverable.is_peer_failure(error)


def profile_window(trainer, compiled_step, run_dir: Path | None, start_step: int):
    """The tracer for ``train.profile_steps`` (a no-op without one); process 0 writes the
    compiled step's analysis now and the bottleneck report when the window closes."""
    import json

    import jax

    from jaxdist.config import profile_window as parse_window
    from jaxdist.inspect.trace_capture import ProfileWindow, StepTracer

    config = trainer.config
    if not config.train.profile_steps or run_dir is None:
        return StepTracer()
    first, last = parse_window(config.train.profile_steps)
    if start_step >= last:
        log.warning(f"resumed at step {start_step}, past the profile window {first}:{last}; not tracing")
        return StepTracer()
    if start_step >= first:
        log.info(f"resumed inside the profile window: tracing steps {start_step + 1}:{last}")
        first = start_step + 1
    out_dir = run_dir / "profile"
    is_main = jax.process_index() == 0
    if is_main:
        from jaxdist.inspect.step_report import build_report
        from jaxdist.training.metrics import peak_flops_per_device

        out_dir.mkdir(parents=True, exist_ok=True)
        analysis = build_report(trainer, compiled_step)
        analysis["peak_flops_per_device"] = peak_flops_per_device(list(trainer.layout.mesh.devices.flat), config.train.peak_flops)
        (out_dir / "analysis.json").write_text(json.dumps(analysis, indent=1))

    def summarise() -> None:
        if not is_main:
            return
        from jaxdist.inspect.profile_report import summarize

        try:
            report = summarize(run_dir)  # writes profile/summary.json and breakdown.png
        except JaxdistError as e:  # a report that cannot be made must not stop the training
            log.warning(f"no profile report ({e}); the trace is in {out_dir}")
            return
        shares = ", ".join(f"{k} {v:.0%}" for k, v in report["fractions"].items())
        log.info(f"profile of steps {first}:{last}: {report['bound']}-bound ({shares}); python -m jaxdist.profile {run_dir}")

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
    try:
        (run_dir / "config.yaml").write_text(config.to_yaml())
    except OSError as e:
        raise JaxdistError(f"cannot write run directory {run_dir}: {e.strerror}") from None


def default_run_dir(config: Config) -> Path:
    return Path("runs") / f"{config.name}-{time.strftime('%Y%m%d-%H%M%S')}"
