"""The optimizers against hand computations (PyTorch's SGD, AdamW's decoupled decay), and
the learning-rate schedule across a resume: its length is saved, a resume that changes it
says so, and ``train.schedule_steps`` keeps it."""

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxdist.config import load_config
from jaxdist.layout.mesh import parse_mesh
from jaxdist.training.optim import lr_schedule, make_optimizer
from jaxdist.training.run import run

from helpers import TINY

LR, WD, MOMENTUM, MIN_RATIO, STEPS = 0.1, 0.05, 0.9, 0.1, 4


class _Two(nnx.Module):
    """A matrix (decayed) and a norm scale (not decayed)."""

    def __init__(self):
        self.w = nnx.Param(jnp.asarray([[1.0, -2.0], [0.5, 3.0]]))
        self.scale = nnx.Param(jnp.asarray([1.0, 2.0]), no_decay=True)


GRADS = [np.asarray(g, np.float32) for g in ([[0.3, -0.1], [0.2, 0.4]], [[-0.2, 0.5], [0.1, 0.0]], [[0.05, 0.05], [-0.3, 0.2]])]
SCALE_GRADS = [np.asarray(g, np.float32) for g in ([0.1, -0.2], [0.3, 0.1], [-0.1, 0.0])]


def _with(w, scale) -> _Two:
    model = _Two()
    model.w[...], model.scale[...] = jnp.asarray(w), jnp.asarray(scale)
    return model


def _cosine(t: int) -> float:
    """warmup 0, cosine from LR down to LR * MIN_RATIO over STEPS updates (count t from 0:
    the update of step t + 1, so the last step trains at the floor)."""
    return LR * (MIN_RATIO + (1 - MIN_RATIO) * 0.5 * (1 + math.cos(math.pi * min(t + 1, STEPS) / STEPS)))


def _optax_run(optimizer: str) -> tuple[np.ndarray, np.ndarray]:
    cfg = load_config(
        None,
        [
            f"train.optimizer={optimizer}",
            f"train.lr={LR}",
            f"train.weight_decay={WD}",
            f"train.momentum={MOMENTUM}" if optimizer == "sgd" else "train.beta1=0.9",
            "train.warmup_steps=0",
            "train.grad_clip=0",
            f"train.min_lr_ratio={MIN_RATIO}",
            f"train.steps={STEPS}",
        ],
    ).train
    params = nnx.state(_Two(), nnx.Param)
    tx = make_optimizer(cfg)
    state = tx.init(params)
    for g, gs in zip(GRADS, SCALE_GRADS, strict=True):
        grads = nnx.state(_with(g, gs), nnx.Param)
        updates, state = tx.update(grads, state, params)
        params = jax.tree.map(lambda p, u: p + u, params, updates)
    return np.asarray(params["w"][...]), np.asarray(params["scale"][...])


def test_sgd_weight_decay_is_pytorchs_coupled_decay():
    """torch.optim.SGD(lr, momentum, weight_decay): g += wd * p; buf = mu * buf + g (buf = g
    at the first step); p -= lr * buf. The decay goes through the momentum; norm scales
    are not decayed."""
    w, scale = np.asarray([[1.0, -2.0], [0.5, 3.0]]), np.asarray([1.0, 2.0])
    buf_w = buf_s = None
    for t, (g, gs) in enumerate(zip(GRADS, SCALE_GRADS, strict=True)):
        g = g + WD * w
        buf_w = g if buf_w is None else MOMENTUM * buf_w + g
        buf_s = gs if buf_s is None else MOMENTUM * buf_s + gs
        w, scale = w - _cosine(t) * buf_w, scale - _cosine(t) * buf_s
    got_w, got_scale = _optax_run("sgd")
    np.testing.assert_allclose(got_w, w, rtol=1e-6)
    np.testing.assert_allclose(got_scale, scale, rtol=1e-6)


def test_adamw_weight_decay_is_decoupled():
    """AdamW (Loshchilov & Hutter): p -= lr * (m_hat / (sqrt(v_hat) + eps) + wd * p); the
    decay is never seen by the moments."""
    b1, b2, eps = 0.9, 0.95, 1e-8
    w = np.asarray([[1.0, -2.0], [0.5, 3.0]])
    m = v = np.zeros_like(w)
    for t, g in enumerate(GRADS):
        m, v = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
        m_hat, v_hat = m / (1 - b1 ** (t + 1)), v / (1 - b2 ** (t + 1))
        w = w - _cosine(t) * (m_hat / (np.sqrt(v_hat) + eps) + WD * w)
    np.testing.assert_allclose(_optax_run("adamw")[0], w, rtol=1e-5)


# -- the schedule across a resume ----------------------------------------------------------

SCHEDULE = (*TINY, "train.warmup_steps=2", "checkpoint.every_steps=100")


def _lrs(run_dir, *overrides: str, resume: str = "auto", capsys=None) -> tuple[list[float], str]:
    config = load_config(None, [*SCHEDULE, *overrides])
    run(config, parse_mesh("data=1"), run_dir, devices=jax.devices()[:1], progress=False, resume=resume)
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [x["lr"] for x in lines if "lr" in x], capsys.readouterr().err if capsys else ""


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> list[float]:
    return _lrs(tmp_path_factory.mktemp("whole"), "train.steps=10")[0]


def test_a_stop_after_step_resumes_on_the_same_schedule(tmp_path, uninterrupted, capsys):
    _lrs(tmp_path, "train.steps=10", "train.stop_after_step=4", capsys=capsys)
    lrs, err = _lrs(tmp_path, "train.steps=10", capsys=capsys)
    assert lrs == uninterrupted  # bitwise: steps 1-4, then 5-10 on the same cosine
    assert "learning-rate schedule" not in err
    assert uninterrupted[4] > uninterrupted[9]  # past the warmup: the cosine matters here


def test_a_resume_with_other_steps_says_the_schedule_changed(tmp_path, uninterrupted, capsys):
    _lrs(tmp_path, "train.steps=4", capsys=capsys)
    lrs, err = _lrs(tmp_path, "train.steps=10", capsys=capsys)
    lines = [x for x in err.splitlines() if "learning-rate schedule" in x]
    assert len(lines) == 1 and "now spans 10 steps" in lines[0] and "one of 4" in lines[0] and "train.schedule_steps=4" in lines[0], lines
    assert lrs[4:] == uninterrupted[4:]  # re-stretched to 10 steps: the uninterrupted 10-step run's rates


def test_schedule_steps_keeps_the_saved_schedule(tmp_path, capsys):
    first, _ = _lrs(tmp_path, "train.steps=4", capsys=capsys)
    lrs, err = _lrs(tmp_path, "train.steps=8", "train.schedule_steps=4", capsys=capsys)
    assert "learning-rate schedule" not in err
    lr, floor = 3e-3, 3e-3 * 0.1  # the TINY lr and its cosine floor (min_lr_ratio 0.1)
    assert lrs[:4] == first and lrs[4:] == pytest.approx([floor] * 4, rel=1e-6)
    assert first[:2] == pytest.approx([lr / 2, lr]) and first[3] == pytest.approx(floor)  # warmup 1/2, the peak; the floor at step 4


# -- the schedules' shapes, by hand ------------------------------------------------------------

# lr 1, 2 warmup steps, 10 schedule steps, floor 0.1, wsd decaying over the last 3 steps;
# steps 1..12 (two past the schedule's end). Cosine: 0.1 + 0.45 (1 + cos(pi (k - 2) / 8)).
BY_HAND = {
    "cosine": [0.5, 1.0, 0.96575, 0.86820, 0.72221, 0.55, 0.37779, 0.23180, 0.13425, 0.1, 0.1, 0.1],
    "linear": [0.5, 1.0, 0.8875, 0.775, 0.6625, 0.55, 0.4375, 0.325, 0.2125, 0.1, 0.1, 0.1],
    "wsd": [0.5, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.7, 0.4, 0.1, 0.1, 0.1],
    "constant": [0.5, 1.0] + [1.0] * 10,
}


@pytest.mark.parametrize("schedule", sorted(BY_HAND))
def test_each_schedule_against_a_hand_computation(schedule):
    cfg = load_config(
        None,
        [
            f"train.schedule={schedule}",
            "train.lr=1",
            "train.warmup_steps=2",
            "train.steps=10",
            "train.min_lr_ratio=0.1",
            "train.decay_fraction=0.3",
        ],
    ).train
    rate = lr_schedule(cfg)
    got = [float(rate(jnp.asarray(count))) for count in range(12)]  # the update of step count + 1
    np.testing.assert_allclose(got, BY_HAND[schedule], atol=1e-5)


def test_a_resume_with_another_schedule_shape_says_so(tmp_path, capsys):
    """train.schedule is saved with the checkpoint; resuming with another says so in one line
    and the new shape applies from the next step."""
    _lrs(tmp_path, "train.steps=6", "train.stop_after_step=3", capsys=capsys)
    lrs, err = _lrs(tmp_path, "train.steps=6", "train.schedule=constant", capsys=capsys)
    lines = [x for x in err.splitlines() if "learning-rate schedule changed" in x]
    assert len(lines) == 1 and "train.schedule cosine -> constant" in lines[0], err
    assert lrs[3:] == pytest.approx([3e-3] * 3)  # constant at the peak after the 2 warmup steps
    assert lrs[:3] == pytest.approx([1.5e-3, 3e-3, 3e-3 * (0.1 + 0.45 * (1 + math.cos(math.pi / 4)))])  # cosine over 6 steps
