"""The training loop's host side: plain log points are read back one step late (the
devices never wait for the host's metrics), and a non-finite loss still stops the run
before a save. A fake trainer records when steps are dispatched and metrics fetched."""

import types

import pytest

from jaxdist.errors import NonFiniteLoss
from jaxdist.training.energy import IntervalEnergy
from jaxdist.training.loop import LoopHooks, train_loop
from jaxdist.training.metrics import MetricsLogger


class _Batch:
    pass


def _fake_trainer(events: list, losses: dict[int, float]):
    """A trainer whose step and metrics fetch record when they happen."""
    cfg = types.SimpleNamespace(stop_after_step=0, log_every=1, eval_every=0, max_skips=0)

    def train_step(state, batch):
        step = state.step + 1
        events.append(("dispatch", step))
        return types.SimpleNamespace(step=step), {"loss": losses.get(step, 1.0), "grad_norm": 0.0, "lr": 0.1, "step": step}

    def fetch_metrics(window):
        events.append(("fetch", [m["step"] for m in window]))
        return list(window)

    return types.SimpleNamespace(
        config=types.SimpleNamespace(train=cfg),
        layout=types.SimpleNamespace(mesh=types.SimpleNamespace(size=1)),
        train_step=train_step,
        fetch_metrics=fetch_metrics,
    )


def _run_fake(trainer, steps, checkpointer=None, logger=None, energy=None):
    def batches():
        while True:
            yield _Batch()

    hooks = LoopHooks(checkpointer=checkpointer, data_state=lambda: {}, config_dict={}, energy=energy)
    return train_loop(
        trainer,
        types.SimpleNamespace(step=0),
        batches(),
        steps=steps,
        logger=logger or MetricsLogger(None, steps, enabled=False),
        flops_per_step=1.0,
        peak_flops=1.0,
        tokens_per_step=1,
        hooks=hooks,
    )


def test_plain_log_points_are_fetched_after_the_next_step_is_dispatched():
    """With train.log_every=1 the host never waits for step s before queueing s+1; the last
    step is fetched at once."""
    events: list = []
    result = _run_fake(_fake_trainer(events, {}), steps=4)
    assert events == [
        ("dispatch", 1),
        ("dispatch", 2),
        ("fetch", [1]),
        ("dispatch", 3),
        ("fetch", [2]),
        ("dispatch", 4),
        ("fetch", [3]),
        ("fetch", [4]),
    ]
    assert result.losses == [1.0] * 4


def test_a_non_finite_loss_read_late_still_stops_before_the_save():
    """The loss of step 2 is NaN, a save is due at step 3: the deferred read of step 2
    happens before step 3's save, which never starts."""
    events: list = []

    class Checkpointer:
        last_saved_step = None

        def due(self, step):
            return step == 3

        def params_due(self, step):
            return False

        def save(self, *args, **kwargs):
            events.append(("save",))

    trainer = _fake_trainer(events, {2: float("nan")})
    trainer.params_finite = lambda params: True
    with pytest.raises(NonFiniteLoss, match="step 2"):
        _run_fake(trainer, steps=5, checkpointer=Checkpointer())
    assert ("save",) not in events and events[-1] == ("fetch", [2])


def test_step_times_tile_the_wall_clock():
    """A fake clock: each step's results reach the host 10 s after the previous ones, and
    writing a log line takes 3 s while the next step runs. The logged step times must add
    up to the whole span (the old loop left each line's writing out: 10 - 3 = 7 s a step)."""
    clock = [0.0]
    events: list = []
    trainer = _fake_trainer(events, {})
    fetch = trainer.fetch_metrics

    def slow_fetch(window):  # waiting for the device: the step finishes 10 s after the last
        clock[0] = 10.0 * window[-1]["step"]
        return fetch(window)

    trainer.fetch_metrics = slow_fetch
    lines = []

    class SlowLogger(MetricsLogger):
        def log(self, step, values):
            lines.append((step, clock[0], values["step_time_s"]))
            clock[0] += 3.0  # writing the line

    steps = 6
    _run_fake(trainer, steps, logger=SlowLogger(None, steps, enabled=False), energy=IntervalEnergy(clock=lambda: clock[0]))
    assert [s for s, _, _ in lines] == list(range(1, steps + 1))
    assert sum(t for _, _, t in lines) == pytest.approx(10.0 * steps)
    assert [t for _, _, t in lines] == pytest.approx([10.0] * steps)
