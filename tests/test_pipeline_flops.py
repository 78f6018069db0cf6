"""The pipeline does no extra work: the matmul FLOPs one device executes per step (every dot of
the compiled loss-and-gradients, times its loops' trip counts, as the planner counts them)
against the model's FLOPs / S, checked against the tick algebra by hand."""

import jax
import pytest

from jaxdist.config import load_config
from jaxdist.data.sources import resolve_vocab
from jaxdist.layout.mesh import mesh_device_count, parse_mesh
from jaxdist.plan.hlo_cost import program_cost
from jaxdist.training.run import build_trainer

from helpers import TINY, first_batch

pytestmark = pytest.mark.heavy

LAYERS = ("model.n_layers=4",)
CASES = {  # name: (overrides, V, recompute)
    "gpipe": (("parallel.schedule=gpipe",), 1, False),
    "circular": (("parallel.schedule=circular", "parallel.virtual_stages=2"), 2, False),
    "1f1b": (("parallel.schedule=1f1b",), 1, False),
    "1f1b-recompute": (("parallel.schedule=1f1b", "parallel.pipeline_recompute=true"), 1, True),
    "interleaved-1f1b": (("parallel.schedule=1f1b", "parallel.virtual_stages=2"), 2, False),
}
S, M = 2, 4


def _matmul_flops(mesh: str, *overrides: str) -> tuple[float, object]:
    config = load_config(None, [*TINY, *LAYERS, *overrides])
    resolve_vocab(config)
    sizes = parse_mesh(mesh)
    trainer = build_trainer(config, sizes, jax.devices()[: mesh_device_count(sizes)])
    state = trainer.init_state(0)
    batch = first_batch(config, trainer.layout)
    compiled = jax.jit(trainer.loss_and_grads).lower(state.params, batch).compile()
    return program_cost(compiled.as_text()).matmul_flops, config


@pytest.fixture(scope="module")
def plain():
    """(the one-device step's matmul FLOPs, the head's part: forward and both backward products, 6 B T d V)."""
    flops, config = _matmul_flops("data=1")
    m, t = config.model, config.train
    return flops, 6.0 * t.global_batch * t.seq_len * m.d_model * m.vocab_size


@pytest.mark.parametrize("name", sorted(CASES))
def test_executed_flops_follow_the_tick_algebra(plain, name):
    """executed / ideal = (layers x (V M + S - 1) / (V M) + head) / model: every device runs
    V M + S - 1 chunk steps, V M of them useful, and the head and loss once per microbatch,
    1/S on each stage (recomputing: the cool-down in the middle's loop, see schedule.py). Without recompute that is within 1 + bubble plus the
    lockstep's bubble^2 / (1 - bubble) (the masked ticks execute: V M + S - 1 steps of work
    for V M of use is 1 / (1 - bubble)). The old code ran the head on every stage (and 1F1B
    also every tick, plus the stage's forward twice)."""
    model, head = plain
    overrides, virtual, recompute = CASES[name]
    flops, _ = _matmul_flops(f"pipe={S}", *overrides, f"parallel.pipeline_microbatches={M}")
    ratio = flops / (model / S)
    units, ticks = virtual * M + S - 1, virtual * M + virtual * S + S - 2
    if recompute:  # a chunk forward (F) in every tick, recomputed forward and backward (3F) in the V M + S - 1 backward ticks
        expected = ((model - head) * (ticks + 3 * units) / (3 * virtual * M) + head * (M + virtual * S - 1) / M) / model
    else:
        expected = ((model - head) * units / (virtual * M) + head) / model
    assert ratio == pytest.approx(expected, rel=0.01), (ratio, expected)
    assert head / model > 0.05  # the head is large enough here that running it on every stage would show
    bubble = (S - 1) / units
    if not recompute:
        assert ratio <= 1 + bubble + bubble**2 / (1 - bubble) + 1e-6, (ratio, bubble)
