"""The read-ahead thread: what it hands the loop equals reading in step (batches and
states), it adds no GIL-bound Grain threads beside itself, it stops cleanly, and the loop
frees each batch before it asks for the next one (freeing device arrays gives the GIL up:
inside ``next`` that let the just-woken read-ahead thread run while the loop waited)."""

import threading
import time
import types
import weakref

import jax
import numpy as np
import pytest

from jaxdist.data.batches import make_iterator
from jaxdist.data.loader import split_sequences, to_global
from jaxdist.data.synthetic import SlowReads, SyntheticTokens
from jaxdist.training.loop import train_loop
from jaxdist.training.metrics import MetricsLogger

from helpers import SMALL_TEXT
from helpers import data_config as _config
from helpers import data_layout as _layout


def _host(batch: dict) -> dict:
    return {key: np.asarray(value) for key, value in batch.items()}


def _threads(prefix: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(prefix) and t.is_alive()]


@pytest.mark.parametrize("source", [SMALL_TEXT, ("data.source=synthetic",)], ids=["packed", "synthetic"])
def test_read_ahead_hands_the_loop_what_reading_in_step_gives(source):
    """prefetch=2 against prefetch=0 (no thread, today's order): the same batches, the same
    shardings, and after each batch the same state (what the loop consumed, not what was
    read ahead); a state taken mid-way resumes a read-ahead iterator identically."""
    layout = _layout()
    in_step = make_iterator(_config(*source, "data.prefetch=0"), layout)
    ahead = make_iterator(_config(*source, "data.prefetch=2"), layout)
    states = []
    for _ in range(5):
        a, b = next(in_step), next(ahead)
        assert a.keys() == b.keys()
        for key in a:
            np.testing.assert_array_equal(np.asarray(a[key]), np.asarray(b[key]), err_msg=key)
            assert b[key].sharding.is_equivalent_to(a[key].sharding, a[key].ndim)
        assert ahead.get_state() == in_step.get_state()
        states.append(ahead.get_state())
    expected = [_host(next(in_step)) for _ in range(3)]
    resumed = make_iterator(_config(*source, "data.prefetch=2"), layout)
    resumed.set_state(states[-1])
    for want in expected:
        got = _host(next(resumed))
        for key in want:
            np.testing.assert_array_equal(got[key], want[key], err_msg=key)
    for iterator in (in_step, ahead, resumed):
        iterator.close()


@pytest.mark.parametrize("mesh", ["data=2,fsdp=2", "data=2,context=2"])
def test_one_transfer_equals_the_per_key_process_local_arrays(mesh):
    """One process: ``to_global``'s single device_put gives the arrays (values and layout)
    that ``make_array_from_process_local_data`` per key gives, context reorder included."""
    layout = _layout(mesh)
    rng = np.random.default_rng(0)
    local = {
        "inputs": rng.integers(0, 100, (8, 32), dtype=np.int32),
        "targets": rng.integers(0, 100, (8, 32), dtype=np.int32),
        "loss_mask": rng.random((8, 32)).astype(np.float32),
    }
    got = to_global(local, layout, 8)
    prepared = split_sequences(local, layout.mesh.shape.get("context", 1), layout.context_load_balance)
    assert got.keys() == prepared.keys()
    for key, value in prepared.items():
        want = jax.make_array_from_process_local_data(layout.batch_sharding(value.ndim), np.asarray(value), value.shape)
        np.testing.assert_array_equal(np.asarray(got[key]), np.asarray(want), err_msg=key)
        assert got[key].sharding == want.sharding
    with pytest.raises(ValueError, match="16"):
        to_global(local, layout, 16)


def test_no_grain_read_threads_beside_the_read_ahead_thread_unless_reads_wait():
    layout = _layout()
    iterator = make_iterator(_config(*SMALL_TEXT), layout)
    next(iterator)
    assert _threads("jaxdist-prefetch") and not _threads("grain-prefetch")
    iterator.close()
    slow = make_iterator(_config("data.source=synthetic", "data.synthetic_latency_ms=1"), layout)
    next(slow)
    assert _threads("grain-prefetch")  # waits overlap across threads
    slow.close()
    from jaxdist.data.batches import read_threads

    assert read_threads(SyntheticTokens(64, 8), 4) == 0 and read_threads(SlowReads(SyntheticTokens(64, 8), 0.001), 4) == 4


def test_close_stops_a_read_ahead_thread_blocked_on_a_full_queue():
    iterator = make_iterator(_config(*SMALL_TEXT, "data.prefetch=2"), _layout())
    next(iterator)
    deadline = time.monotonic() + 30
    while not iterator._queue.full() and time.monotonic() < deadline:  # the thread now waits in put
        time.sleep(0.01)
    assert iterator._queue.full()
    thread = iterator._thread
    iterator.close()
    assert not thread.is_alive() and iterator._thread is None


class _Batch:
    """A stand-in batch that can be watched with a weak reference."""


def test_loop_frees_each_batch_before_asking_for_the_next():
    """Each ``next(batches)`` finds the batch of the step before already freed."""
    previous: list[weakref.ref] = []
    alive_at_next = []

    def batches():
        while True:
            if previous:
                alive_at_next.append(previous[-1]() is not None)
            batch = _Batch()
            previous.append(weakref.ref(batch))
            yield batch
            del batch

    cfg = types.SimpleNamespace(stop_after_step=0, log_every=1, eval_every=0, max_skips=0)
    trainer = types.SimpleNamespace(
        config=types.SimpleNamespace(train=cfg),
        layout=types.SimpleNamespace(mesh=types.SimpleNamespace(size=1)),
        train_step=lambda state, batch: (types.SimpleNamespace(step=state.step + 1), {"loss": 1.0, "grad_norm": 0.0, "lr": 0.1}),
        fetch_metrics=list,
    )
    state = types.SimpleNamespace(step=0)
    result = train_loop(
        trainer,
        state,
        batches(),
        steps=4,
        logger=MetricsLogger(None, 4, enabled=False),
        flops_per_step=1.0,
        peak_flops=1.0,
        tokens_per_step=1,
    )
    assert result.losses == [1.0] * 4
    assert alive_at_next == [False, False, False]
