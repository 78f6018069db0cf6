"""The data position saved with a checkpoint is absolute: it continues the same stream
whichever step the saving iterator was opened at, and a state that does not fit (another
worker count) resumes by step with a warning instead of feeding other batches."""

import jax
import numpy as np
import pytest

from jaxdist.config import load_config
from jaxdist.data.batches import DataStateMismatch, make_iterator
from jaxdist.data.sources import resolve_vocab
from jaxdist.layout.mesh import build_mesh, parse_mesh
from jaxdist.layout.sharding import Layout
from jaxdist.layout.strategy import resolve_strategy
from jaxdist.training.resume import continue_data


@pytest.fixture(scope="module")
def layout() -> Layout:
    sizes = parse_mesh("data=2,fsdp=2")
    return Layout(build_mesh(sizes, jax.devices()[:4]), resolve_strategy("auto", sizes))


def _config(*overrides: str):
    config = load_config(None, ["train.global_batch=8", "train.seq_len=32", *overrides])
    resolve_vocab(config)
    return config


def _inputs(iterator, n: int) -> list[np.ndarray]:
    return [np.asarray(next(iterator)["inputs"]) for _ in range(n)]


@pytest.fixture(scope="module")
def reference(layout) -> list[np.ndarray]:
    """Batches 1..8 of the uninterrupted stream."""
    iterator = make_iterator(_config(), layout)
    try:
        return _inputs(iterator, 8)
    finally:
        iterator.close()


def _assert_same(a: list[np.ndarray], b: list[np.ndarray]) -> None:
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x, y)


def test_state_of_a_sliced_iterator_continues_in_any_iterator(layout, reference):
    opened_at_3 = make_iterator(_config(), layout, start_step=3)  # what a resume by step opens
    _assert_same(_inputs(opened_at_3, 2), reference[3:5])
    state = opened_at_3.get_state()
    opened_at_3.close()
    assert state["start_step"] == 3
    fresh = make_iterator(_config(), layout)  # what the next ordinary resume opens
    fresh.set_state(state)
    _assert_same(_inputs(fresh, 3), reference[5:8])  # batches 6..8, not 3..5
    fresh.close()


def test_state_without_start_step_restores_from_step_0(layout, reference):
    iterator = make_iterator(_config(), layout, start_step=5)
    iterator.set_state({"next_index": 2})  # as older checkpoints stored it: Grain's state alone
    _assert_same(_inputs(iterator, 2), reference[2:4])
    iterator.close()


class _Restored:
    def __init__(self, step: int, data_state: dict | None, data_problem: str | None = None):
        self.step, self.data_state, self.data_problem, self.config = step, data_state, data_problem, {}


def test_another_worker_count_resumes_by_step_with_a_warning(layout, reference, capsys):
    with_workers = make_iterator(_config("data.workers=1"), layout)
    _assert_same(_inputs(with_workers, 3), reference[:3])
    state = with_workers.get_state()
    with_workers.close()
    config = _config("data.workers=0")
    iterator = make_iterator(config, layout)
    with pytest.raises(DataStateMismatch, match="data.workers=1"):
        iterator.set_state(state)  # checked by jaxdist: Grain accepts some such states (2 -> 3 workers) and feeds other batches
    capsys.readouterr()
    resumed = continue_data(iterator, _Restored(3, state), config, layout)
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("jaxdist: warning: ")]
    assert len(warnings) == 1 and "data.workers=1" in warnings[0] and "data resumed by step 3" in warnings[0], warnings
    _assert_same(_inputs(resumed, 2), reference[3:5])
    resumed.close()


def test_missing_data_state_is_reported(layout, reference, capsys):
    iterator = make_iterator(_config(), layout)
    resumed = continue_data(iterator, _Restored(4, None, "saved by 2 process(es), this run has 1"), _config(), layout)
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("jaxdist: warning: ")]
    assert len(warnings) == 1 and "saved by 2 process(es)" in warnings[0] and "checkpoint step 4" in warnings[0], warnings
    _assert_same(_inputs(resumed, 1), reference[4:5])
    resumed.close()
