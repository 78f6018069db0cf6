"""The training loop: steps until ``train.steps`` (or ``train.stop_after_step``), with
metrics fetched only at log points, evaluation, checkpoints (full and weights-only),
preemption, the energy meter, the profile window and the launcher's heartbeat around them."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from jaxdist.cluster.heartbeat import beat, fault_point
from jaxdist.errors import NonFiniteLoss
from jaxdist.inspect.trace_capture import StepTracer
from jaxdist.models import Batch
from jaxdist.training.dpo import REWARD_METRICS
from jaxdist.training.energy import IntervalEnergy, energy_fields
from jaxdist.training.metrics import MetricsLogger
from jaxdist.training.preemption import Preempted
from jaxdist.training.recovery import PeerJoined, PeerLost
from jaxdist.training.state import TrainState
from jaxdist.training.stragglers import straggler_line

if TYPE_CHECKING:
    from jaxdist.training.step import Trainer

log = logging.getLogger(__name__)

# metrics.jsonl's MoE fields (models.moe.metrics_from_sums), logged when the step returns them
MOE_METRICS = {"moe_aux_loss", "moe_load_max", "moe_dropped_fraction"}


@dataclasses.dataclass
class LoopResult:
    state: TrainState
    losses: list[float]
    eval_losses: dict[int, float]
    skipped_steps: int = 0


@dataclasses.dataclass
class LoopHooks:
    """What the loop may do besides training: evaluate, checkpoint, notice preemption."""

    eval_batches: Callable[[], Iterator[Batch]] | None = None
    checkpointer: Any = None  # jaxdist.training.checkpoint.Checkpointer
    data_state: Callable[[], dict] | None = None  # the data iterator's state after the last batch taken
    config_dict: dict | None = None
    preemption: Any = None  # jaxdist.training.preemption.PreemptionWatcher
    tracer: StepTracer = dataclasses.field(default_factory=StepTracer)  # --profile-steps
    energy: IntervalEnergy | None = None  # the GPUs' energy meter per log interval (None: not measured)
    stragglers: Any = None  # jaxdist.training.stragglers.StragglerWatch (several processes)
    guard: Any = None  # jaxdist.training.recovery.StepGuard (--recovery in-process): each step inside live_devices
    membership_record: Callable[..., None] | None = None  # a line in RUN_DIR/elastic.jsonl (process 0): stragglers
    harness: Any = None  # jaxdist.training.harness_eval.HarnessDuringTraining (train.harness_tasks)


def train_loop(
    trainer: Trainer,
    state: TrainState,
    batches: Iterator[Batch],
    *,
    steps: int,
    logger: MetricsLogger,
    flops_per_step: float,
    peak_flops: float,
    tokens_per_step: int,
    step_fn: Callable | None = None,
    hooks: LoopHooks | None = None,
    fp8_peak_flops: float | None = None,
) -> LoopResult:
    """Train until step ``steps`` (the state may start later, when resumed).

    Metrics are fetched only at log points, so the host keeps dispatching ahead of the
    devices in between, and a plain log point is fetched one step late, once the next
    step is queued; eval, checkpoint, preemption and the last step are log points fetched
    at once, so a non-finite loss is always caught before a state is saved. The interval of a log
    point ends once its results are on the host; the next one starts at that instant when
    its step already runs (deferred log points: the intervals tile the wall clock), or
    after the eval and saves of a log point read at once, so step time, power and energy
    per token are of training alone.
    ``fp8_peak_flops``: with fp8 matmuls, also log ``mfu_fp8_peak`` against this peak.
    """
    cfg, hooks = trainer.config.train, hooks or LoopHooks()
    step_fn = step_fn or trainer.train_step
    checkpointer, tracer, stragglers = hooks.checkpointer, hooks.tracer, hooks.stragglers
    n_devices = trainer.layout.mesh.size
    start_step = int(jax.device_get(state.step))
    end = min(steps, cfg.stop_after_step or steps)  # train.stop_after_step: a planned interruption, saved like the end
    result = LoopResult(state, [], {})
    pending: list[dict[str, jax.Array]] = []
    energy = hooks.energy or IntervalEnergy()
    energy.start()
    data_wait = 0.0
    skips_in_a_row = 0

    # A plain log point (nothing to evaluate or save) is read back one step late, after the
    # next step is dispatched, so the devices never idle while the host fetches and writes
    # metrics (with train.log_every=1 every step is a log point). Eval, save, preemption and
    # the last step read at once: a non-finite loss is still caught before any save.
    deferred: tuple[int, list, float] | None = None

    def write_window(window_end: int, window: list, waited_total: float, *, next_running: bool) -> None:
        with tracer.phase("log"):
            nonlocal skips_in_a_row
            fetched = trainer.fetch_metrics(window)
            # The window ends once its last step is done; when the next step already runs
            # (a deferred log point), its window starts at that same instant.
            seconds, joules = energy.lap() if next_running else energy.stop()
            for offset, m in enumerate(fetched):
                skips_in_a_row = _check_step(m, window_end - len(fetched) + 1 + offset, skips_in_a_row, cfg, result, checkpointer)
            timing = (seconds, joules, waited_total, flops_per_step, peak_flops, fp8_peak_flops)
            record = _window_record(fetched, tokens_per_step, n_devices, timing, result.skipped_steps)
            logger.log(window_end, {**record, "wall_time": round(time.time(), 3), "window_steps": len(fetched)})
            logger.advance(len(fetched))

    for step in range(start_step + 1, end + 1):
        beat(step)
        with tracer.step(step):
            with tracer.phase("data"):
                wait_start = time.perf_counter()
                if stragglers is not None:
                    stragglers.injected_delay(step)
                batch = next(batches)
                waited = time.perf_counter() - wait_start
            data_wait += waited
            tracer.data_waited(step, waited)
            with tracer.phase("dispatch"):
                dispatch_start = time.perf_counter()
                if hooks.guard is None:
                    state, metrics = step_fn(state, batch)
                else:
                    try:
                        state, metrics = hooks.guard(step_fn, state, batch, step)
                    except (PeerLost, PeerJoined) as lost:  # the live processes go on from this step (training.recovery)
                        if deferred is not None:
                            write_window(*deferred, next_running=False)
                        lost.partial = result
                        raise
                # Free the batch now, while the step runs: freeing device arrays gives the GIL up,
                # and done inside the next ``next(batches)`` it handed the GIL to the read-ahead
                # thread (woken by that same next) and the loop waited for its Python work.
                del batch
                if stragglers is not None:  # this step's own host work: its data and its dispatch
                    stragglers.host_work(waited + time.perf_counter() - dispatch_start)
            fault_point("step", step)  # the step dispatched (under in-process recovery: done)
            pending.append(metrics)
            if deferred is not None:  # the previous log point, now that this step is queued behind it
                write_window(*deferred, next_running=True)
                deferred = None

            last = step == end
            eval_now = hooks.eval_batches is not None and cfg.eval_every > 0 and step % cfg.eval_every == 0
            harness_now = hooks.harness is not None and hooks.harness.due(step, last)
            preempt = hooks.preemption is not None and hooks.preemption.requested(step)
            save_now = checkpointer is not None and (last or preempt or checkpointer.due(step))
            params_now = checkpointer is not None and not save_now and checkpointer.params_due(step)  # weights only
            sync_now = last or eval_now or harness_now or save_now or params_now or preempt
            # a guarded step (in-process recovery) is done already: nothing runs behind a deferred read
            log_point = step % cfg.log_every == 0
            if log_point and not sync_now and hooks.guard is None:
                deferred, pending, data_wait = (step, pending, data_wait), [], 0.0
            elif sync_now or log_point:
                write_window(step, pending, data_wait, next_running=False)
                pending = []
                eval_metrics = None
                if eval_now:
                    with tracer.phase("eval"), timed(logger, step, "eval"):
                        fault_point("eval", step)
                        result.eval_losses[step] = evaluate(trainer, state, hooks.eval_batches())
                    eval_metrics = {"eval_loss": result.eval_losses[step]}
                    logger.log(step, eval_metrics)
                if harness_now:
                    with tracer.phase("eval"), timed(logger, step, "eval"):
                        scores = hooks.harness(trainer, step, trainer.synchronized_params(state))
                    logger.log(step, scores)
                if save_now or params_now:
                    with tracer.phase("checkpoint"), timed(logger, step, "checkpoint"):
                        fault_point("save", step)
                        if not bool(trainer.params_finite(state.params)):
                            raise NonFiniteLoss(f"parameters became non-finite at step {step}; not saving them{_last_saved(checkpointer)}")
                        if save_now:
                            checkpointer.save(step, state, hooks.data_state(), hooks.config_dict, metrics=eval_metrics)
                        else:
                            weights = {"step": state.step, "params": trainer.synchronized_params(state)}
                            checkpointer.save_params(step, weights, hooks.data_state(), hooks.config_dict)
                if preempt:
                    if checkpointer is None:  # library use without a run directory: nothing to save
                        raise Preempted(step, hooks.preemption.reason, saved=False)
                    checkpointer.wait()
                    raise Preempted(step, hooks.preemption.reason)
                energy.start()
                data_wait = 0.0
        for record in stragglers.step_done(step, state) if stragglers is not None else ():
            log.warning(straggler_line(record, stragglers.factor))
            logger.log(step, {"straggler": record})
            if hooks.membership_record is not None:
                hooks.membership_record(reason="straggler", step=step, **record)
        if stragglers is not None and (measures := stragglers.take_measures()) is not None:
            logger.log(step, {"straggler_measures": measures})
        tracer.after_step(step, state)
    result.state = state
    return result


@contextlib.contextmanager
def timed(logger, step: int, kind: str):
    """The block's wall time as a ``goodput_span`` line of ``kind`` (``cluster.goodput``)."""
    wall, start = time.time(), time.perf_counter()
    try:
        yield
    finally:
        logger.span(step, kind, wall, time.perf_counter() - start)


def _window_record(fetched: list[dict], tokens_per_step: int, n_devices: int, timing: tuple, skipped_steps: int) -> dict:
    """metrics.jsonl's line for a window of steps: the last step's values, the window's
    mean step time, data wait, MFU and energy."""
    seconds, joules, waited, flops_per_step, peak_flops, fp8_peak_flops = timing
    step_time, last = seconds / len(fetched), fetched[-1]
    record = {
        "loss": float(last["loss"]),
        "grad_norm": float(last["grad_norm"]),
        "lr": float(last["lr"]),
        "tokens_per_sec": tokens_per_step / step_time,
        "step_time_s": step_time,
        "data_wait_s": waited / len(fetched),
        "mfu": flops_per_step / (step_time * n_devices * peak_flops),
        **energy_fields(joules, seconds, tokens_per_step * len(fetched)),
    }
    if fp8_peak_flops is not None:  # NaN (null) where the device has no fp8 peak
        record["mfu_fp8_peak"] = flops_per_step / (step_time * n_devices * fp8_peak_flops)
    if "loss_scale" in last:
        record["loss_scale"] = float(last["loss_scale"])
    for key in MOE_METRICS & last.keys():
        record[key] = float(last[key])
    for key in (k for k in REWARD_METRICS if k in last):  # train.objective=dpo (training.dpo)
        record[key] = float(last[key])
    if "skipped" in last:
        record["skipped_steps"] = skipped_steps
    return record


def _check_step(metrics: dict, step: int, skips_in_a_row: int, cfg, result: LoopResult, checkpointer) -> int:
    """Record one step's loss; stop on a non-finite loss (or too many skipped steps in a
    row). Returns the new count of skipped steps in a row."""
    loss = float(metrics["loss"])
    if not math.isfinite(loss) and "skipped" not in metrics:
        raise NonFiniteLoss(
            f"loss is {loss} at step {step}; stopping (lower train.lr, check the data, or train.nonfinite=skip){_last_saved(checkpointer)}"
        )
    skipped = bool(metrics.get("skipped", False))
    result.skipped_steps += skipped
    skips_in_a_row = skips_in_a_row + 1 if skipped else 0
    if skips_in_a_row > cfg.max_skips:
        raise NonFiniteLoss(
            f"{skips_in_a_row} non-finite steps in a row up to step {step} (train.max_skips={cfg.max_skips}); stopping{_last_saved(checkpointer)}"
        )
    result.losses.append(loss)
    return skips_in_a_row


def _last_saved(checkpointer) -> str:
    step = checkpointer.last_saved_step if checkpointer is not None else None
    return f"; last checkpoint: step {step}" if step else ""


def evaluate(trainer: Trainer, state: TrainState, batches: Iterator[Batch]) -> float:
    params = trainer.synchronized_params(state)
    totals = sum(np.asarray(jax.device_get(trainer.eval_step(params, b)), np.float64) for b in batches)
    return float(totals[0] / totals[1])
