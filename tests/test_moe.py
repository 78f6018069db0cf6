"""Mixture of experts: the sorted, grouped, all-to-all path against a dense loop over experts
(every token through every expert, weighted by its gates: no sort, no grouped matmul, no
collective), on one device and split over the expert axis; then training on several meshes
against one device, the balancing statistics, the router bias and its resume."""

from __future__ import annotations

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxdist.config import ModelConfig, load_config
from jaxdist.layout.mesh import build_mesh, mesh_device_count, parse_mesh
from jaxdist.layout.sharding import rules_for
from jaxdist.layout.step_context import StepContext, installed
from jaxdist.layout.strategy import resolve_strategy
from jaxdist.models import experts as experts_lib
from jaxdist.models.moe import MoE, one_device_kernel, route
from jaxdist.parallel.expert import ExpertParallel
from jaxdist.training.run import run

from helpers import TINY, first_batch

E, K, D, F = 8, 2, 8, 16  # experts, top-k, model width, expert width
B, T = 8, 4  # batch rows x tokens: 32 tokens


def dense_loop(x, ids, gates, w_gate_up, w_down, keep=None):
    """Every token through every expert; expert e's output weighted by the gates of the
    slots that chose it (and were kept)."""
    weights = gates if keep is None else gates * keep
    y = jnp.zeros(x.shape, jnp.float32)
    for e in range(w_gate_up.shape[0]):
        gate_up = jnp.einsum("...d,dcf->...cf", x, w_gate_up[e])
        out = (jax.nn.silu(gate_up[..., 0, :]) * gate_up[..., 1, :]) @ w_down[e]
        y = y + jnp.sum(jnp.where(ids == e, weights, 0.0), axis=-1)[..., None] * out
    return y


def _weights(seed=0):
    k1, k2 = jax.random.split(jax.random.key(seed))
    return jax.random.normal(k1, (E, D, 2, F)) * D**-0.5, jax.random.normal(k2, (E, F, D)) * F**-0.5


def _routing(kind: str, seed=1):
    """ids [B, T, K] (distinct per token) and gates for a routing case."""
    rng = np.random.default_rng(seed)
    allowed = {"random": range(E), "empty experts": (1, 2, 5), "all to one": (3, 6)}[kind]
    ids = np.stack([rng.permutation(allowed)[:K] for _ in range(B * T)]).reshape(B, T, K)
    if kind == "all to one":
        ids = np.broadcast_to(np.array([3, 6]), (B, T, K)).copy()  # every token: expert 3 first, 6 second
    gates = rng.uniform(0.1, 1.0, (B, T, K)).astype(np.float32)
    return jnp.asarray(ids, jnp.int32), jnp.asarray(gates)


def _kernel(mesh_spec: str, **kw):
    sizes = parse_mesh(mesh_spec)
    mesh = build_mesh(sizes, jax.devices()[: mesh_device_count(sizes)])
    return ExpertParallel(mesh=mesh, rules=rules_for(resolve_strategy("auto", sizes)), **kw)


@pytest.fixture
def nan_sentinels(monkeypatch):
    """Buffers start as NaN: a row read before it is written, or an unused row that is not masked, shows."""
    monkeypatch.setattr(experts_lib, "UNWRITTEN", float("nan"))


EP_MESHES = {1: "data=2", 2: "expert=2,tensor=2", 4: "fsdp=2,expert=4"}


def assert_matches_dense_loop(kernel, routing: str):
    """``kernel``'s output and the gradients of the input, the gates and both expert weights
    against the dense loop over experts; returns the gradients."""
    x = jax.random.normal(jax.random.key(2), (B, T, D))
    ids, gates = _routing(routing)
    w_gate_up, w_down = _weights()
    cotangent = jax.random.normal(jax.random.key(3), (B, T, D))

    def objective(fn):
        return lambda x, gates, w1, w2: jnp.sum(fn(x, ids, gates, w1, w2) * cotangent)

    ours = jax.jit(jax.value_and_grad(objective(lambda *a: kernel(*a, 0.0)[0]), argnums=(0, 1, 2, 3)))
    reference = jax.jit(jax.value_and_grad(objective(dense_loop), argnums=(0, 1, 2, 3)))
    (value, grads), (ref_value, ref_grads) = ours(x, gates, w_gate_up, w_down), reference(x, gates, w_gate_up, w_down)
    assert np.isfinite(value)
    np.testing.assert_allclose(value, ref_value, rtol=1e-5)
    for name, got, want in zip(("input", "gates", "gate/up weights", "down weights"), grads, ref_grads, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5, err_msg=name)
    return grads


@pytest.mark.parametrize("routing", ["random", "empty experts", "all to one"])
@pytest.mark.parametrize("ep", [1, 2, 4])
def test_experts_match_a_dense_loop_with_their_gradients(ep, routing, nan_sentinels):
    grads = assert_matches_dense_loop(_kernel(EP_MESHES[ep]), routing)
    if routing == "empty experts":  # experts nobody chose get exactly zero gradient
        unused = [e for e in range(E) if e not in (1, 2, 5)]
        assert not np.any(np.asarray(grads[2])[unused]) and not np.any(np.asarray(grads[3])[unused])


def test_the_moe_layer_and_its_router_gradient_match_on_one_device_and_split_over_experts(nan_sentinels):
    cfg = ModelConfig(d_model=D, moe_experts=E, moe_top_k=K, moe_mlp_dim=F, moe_shared_experts=1)
    graphdef, params = nnx.split(MoE(cfg, jnp.float32, nnx.Rngs(0)))
    x = jax.random.normal(jax.random.key(4), (B, T, D))
    cotangent = jax.random.normal(jax.random.key(5), (B, T, D))
    kernel = _kernel("data=2,expert=4")

    def reference(params, x):  # route as the layer does, then the dense loop, plus the shared expert
        layer = nnx.merge(graphdef, params)
        logits = jnp.einsum("btd,de->bte", x, layer.router[...])
        ids, gates, _ = route(cfg, logits, None)
        y = dense_loop(x, ids, gates, layer.w_gate_up[...], layer.w_down[...])
        gate_up = jnp.einsum("btd,dcf->btcf", x, layer.shared_gate_up[...])
        return jnp.sum((y + (jax.nn.silu(gate_up[..., 0, :]) * gate_up[..., 1, :]) @ layer.shared_down[...]) * cotangent)

    def ours(params, x, kernel):
        with installed(StepContext(expert_kernel=kernel)):
            y, _ = nnx.merge(graphdef, params)(x)
        return jnp.sum(y * cotangent)

    want = jax.jit(jax.grad(reference, argnums=(0, 1)))(params, x)
    for k in (one_device_kernel, kernel):
        got = jax.jit(jax.grad(lambda p, x, k=k: ours(p, x, k), argnums=(0, 1)))(params, x)
        for path, g, w in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5, err_msg=jax.tree_util.keystr(path[0]))
    assert np.any(np.asarray(want[0]["router"][...]))  # the router does learn through the gates


def _identity(rows, group_sizes, w_gate_up, w_down):
    used = jnp.arange(rows.shape[0]) < jnp.sum(group_sizes)
    return jnp.where(used[:, None], rows, 0.0).astype(jnp.float32)


@pytest.mark.parametrize("mesh", ["data=1", "expert=4", "data=2,expert=4"])
def test_dispatch_then_combine_with_uniform_gates_gives_back_the_input_exactly(mesh, nan_sentinels):
    kernel = _kernel(mesh, compute=_identity)
    x = jax.random.normal(jax.random.key(6), (B, T, D))
    ids, _ = _routing("random")
    gates = jnp.full((B, T, K), 1.0 / K)
    cotangent = jax.random.normal(jax.random.key(7), (B, T, D))
    w_gate_up, w_down = _weights()
    y, dropped = jax.jit(lambda x: kernel(x, ids, gates, w_gate_up, w_down, 0.0))(x)
    np.testing.assert_array_equal(y, x)
    assert float(dropped) == 0
    grad = jax.jit(jax.grad(lambda x: jnp.sum(kernel(x, ids, gates, w_gate_up, w_down, 0.0)[0] * cotangent)))(x)
    np.testing.assert_array_equal(grad, cotangent)


def _kept(ids: np.ndarray, capacity: int, shards: int) -> np.ndarray:
    """Which assignments an expert keeps: per device (the batch split ``shards`` ways), the
    first ``capacity`` in token order, then slot order."""
    keep = np.zeros(ids.shape, np.float32)
    for rows in np.split(np.arange(ids.shape[0]), shards):
        seen = np.zeros(E, int)
        for index in np.ndindex(ids[rows].shape):
            e = ids[rows][index]
            keep[rows[index[0]], *index[1:]] = seen[e] < capacity
            seen[e] += 1
    return keep


@pytest.mark.parametrize("mesh,shards", [("data=1", 1), ("expert=2", 2), ("data=2,expert=2", 4)])
def test_capacity_drops_the_latest_tokens_and_counts_them(mesh, shards, nan_sentinels):
    kernel = _kernel(mesh)
    x = jax.random.normal(jax.random.key(8), (B, T, D))
    ids, gates = _routing("empty experts")  # three experts share 64 assignments: most overflow
    w_gate_up, w_down = _weights()
    factor = 1.0
    tokens = B * T // shards
    capacity = -(-tokens * K // E)  # ceil(tokens x k / experts x 1.0)
    keep = _kept(np.asarray(ids), capacity, shards)
    y, dropped = jax.jit(lambda x: kernel(x, ids, gates, w_gate_up, w_down, factor))(x)
    assert float(dropped) == ids.size - keep.sum() > 0  # counted: kept + dropped = all assignments
    np.testing.assert_allclose(y, dense_loop(x, ids, gates, w_gate_up, w_down, jnp.asarray(keep)), rtol=1e-5, atol=1e-6)


def test_a_stated_buffer_drops_what_overflows_and_counts_it(nan_sentinels):
    kernel = _kernel("expert=4", buffer_factor=1.0)  # each destination takes its even share, no more
    x = jax.random.normal(jax.random.key(9), (B, T, D))
    ids, gates = _routing("all to one")  # experts 3 and 6: devices 1 and 3 get everything
    w_gate_up, w_down = _weights()
    y, dropped = jax.jit(lambda x: kernel(x, ids, gates, w_gate_up, w_down, 0.0))(x)
    # each device's 8 tokens send 8 rows to expert 3's device and 8 to expert 6's; the buffer holds 8 x 2 / 4 = 4 per destination
    assert float(dropped) == 4 * (16 - 2 * 4)
    assert np.all(np.isfinite(y))


# --- training ------------------------------------------------------------------------------

MOE = (
    "model.moe_experts=4",
    "model.moe_top_k=2",
    "model.moe_mlp_dim=64",
    "model.moe_aux_loss_coef=0.01",
    "model.moe_z_loss_coef=0.001",
    "model.moe_bias_rate=0.01",
    "train.warmup_steps=1",
)
STEPS = 4


def _train(run_dir, mesh: str, *overrides: str, stop: int = STEPS):
    config = load_config(
        None, [*TINY, *MOE, f"train.steps={STEPS}", "checkpoint.every_steps=2", f"train.stop_after_step={stop}", *overrides]
    )
    sizes = parse_mesh(mesh)
    return run(config, sizes, run_dir, devices=jax.devices()[: mesh_device_count(sizes)], progress=False)


def _metrics(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]


def _bias(run_dir) -> np.ndarray:
    from helpers import load_model

    return np.asarray(load_model(run_dir).blocks.mlp.bias[...])


@pytest.fixture(scope="module")
def one_device(tmp_path_factory):
    out = tmp_path_factory.mktemp("moe_one_device")
    return out, _train(out, "data=1").losses


@pytest.mark.parametrize("mesh", ["expert=4", "data=2,expert=2,tensor=2", "fsdp=2,expert=4"])
@pytest.mark.heavy
def test_moe_training_on_expert_meshes_matches_one_device(one_device, tmp_path, mesh, capfd):
    reference_dir, reference = one_device
    losses = _train(tmp_path, mesh).losses
    np.testing.assert_allclose(losses, reference, rtol=1e-5)
    err = capfd.readouterr().err  # the weaker CPU path and the dispatch are each said in one line
    assert "jaxdist: MoE on CPU: jax.lax.ragged_dot runs as a dense expansion" in err
    assert f"over expert={parse_mesh(mesh)['expert']}" in err and "all-to-all dispatch" in err
    if mesh == "data=2,expert=2,tensor=2":  # the balancing statistics and the bias they moved are the mesh's too
        ours, theirs = _metrics(tmp_path), _metrics(reference_dir)
        for key in ("moe_aux_loss", "moe_load_max", "moe_dropped_fraction"):
            np.testing.assert_allclose([m[key] for m in ours], [m[key] for m in theirs], rtol=1e-5, err_msg=key)
        np.testing.assert_allclose(_bias(tmp_path), _bias(reference_dir), atol=1e-7)


def test_the_router_bias_moves_toward_idle_experts_and_resumes_bitwise(one_device, tmp_path):
    reference_dir, reference = one_device
    metrics = _metrics(reference_dir)
    assert all(m["moe_dropped_fraction"] == 0 for m in metrics)  # dropless
    assert all(m["moe_load_max"] >= 1 and m["moe_aux_loss"] > 0 for m in metrics)
    bias = _bias(reference_dir)
    assert bias.shape == (2, 4) and np.any(bias)  # [moe layers, experts], moved 4 steps by +-0.01
    steps = bias / 0.01
    np.testing.assert_allclose(steps, np.round(steps), atol=1e-4)  # only the sign rule moved it: no optimizer, no decay
    assert np.abs(bias).max() <= 0.04 + 1e-6
    first = _train(tmp_path, "data=1", stop=2)
    resumed = _train(tmp_path, "data=1")
    np.testing.assert_array_equal(first.losses + resumed.losses, reference)
    np.testing.assert_array_equal(_bias(tmp_path), bias)


def test_the_sign_rule_raises_the_bias_of_under_loaded_experts():
    from jaxdist.models.moe import RouterBias, update_router_bias

    params = {"bias": RouterBias(jnp.zeros((2, 4))), "w": nnx.Param(jnp.ones(3))}
    counts = jnp.array([[10.0, 2.0, 6.0, 6.0], [0.0, 0.0, 0.0, 8.0]])
    moved = update_router_bias(params, counts, 0.5)
    np.testing.assert_array_equal(moved["bias"][...], [[-0.5, 0.5, 0.0, 0.0], [0.5, 0.5, 0.5, -0.5]])
    np.testing.assert_array_equal(moved["w"][...], np.ones(3))


def test_eval_loss_is_the_data_loss_without_the_balancing_terms():
    from jaxdist.data.sources import resolve_vocab
    from jaxdist.training.run import build_trainer

    def eval_loss(*coefs: str) -> float:
        config = load_config(None, [*TINY, *MOE, *coefs])
        resolve_vocab(config)
        trainer = build_trainer(config, parse_mesh("expert=2"), jax.devices()[:2])
        params = trainer.init_state(0).params
        loss_sum, weight = np.asarray(trainer.eval_step(params, first_batch(config, trainer.layout)))
        return float(loss_sum / weight)

    heavy = eval_loss("model.moe_aux_loss_coef=1.0", "model.moe_z_loss_coef=1.0")  # would add ~1 + z to the loss
    np.testing.assert_allclose(heavy, eval_loss("model.moe_aux_loss_coef=0", "model.moe_z_loss_coef=0"), rtol=1e-6)


# --- the balancing statistics are the whole step's ------------------------------------------

BALANCE = (*TINY, *MOE, "train.global_batch=8", "data.source=synthetic")


@functools.cache
def _first_step(microbatches: int):
    """(initial params, the batch, metrics and router bias after one step) at ``microbatches``."""
    from jaxdist.data.sources import resolve_vocab
    from jaxdist.training.run import build_trainer

    config = load_config(None, [*BALANCE, f"train.microbatches={microbatches}"])
    resolve_vocab(config)
    trainer = build_trainer(config, parse_mesh("data=1"), jax.devices()[:1])
    state = trainer.init_state(0)
    batch = first_batch(config, trainer.layout)
    params = jax.device_get(state.params)  # before the step donates them
    state, metrics = trainer.train_step(state, batch)
    bias = np.asarray(nnx.to_pure_dict(jax.device_get(state.params))["blocks"]["mlp"]["bias"])
    return trainer, params, jax.device_get(batch), jax.device_get(metrics), bias


@functools.cache
def _router_logits() -> np.ndarray:
    """Every MoE layer's router logits [layers, B, T, E] on the whole first batch, at init."""
    from jaxdist.models import llama, moe

    trainer, params, batch, _, _ = _first_step(1)

    def with_logits(cfg, logits, ids, probs, dropped):
        return {**stats(cfg, logits, ids, probs, dropped), "logits": logits}

    stats = moe.stats
    patch = pytest.MonkeyPatch()
    patch.setattr(moe, "stats", with_logits)  # the layer hands its logits out through the layer scan
    patch.setattr(llama, "moe_sums", lambda layer_stats, weight: layer_stats)
    try:
        _, _, layer_stats = jax.jit(lambda p, b: nnx.merge(trainer.graphdef, p).loss(b))(params, batch)
    finally:
        patch.undo()
    return np.asarray(layer_stats["logits"], np.float64)


def _numpy_balance(logits: np.ndarray, k: int) -> tuple[float, float, np.ndarray]:
    """(aux loss, busiest expert over the mean, counts [layers, E]) of the whole batch, from the router logits."""
    e = logits.shape[-1]
    flat = logits.reshape(logits.shape[0], -1, e)
    probs = np.exp(flat - flat.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    chosen = np.argsort(-probs, axis=-1, kind="stable")[..., :k]
    counts = np.stack([np.bincount(c.reshape(-1), minlength=e) for c in chosen]).astype(np.float64)
    aux = e * np.sum(counts / counts.sum(-1, keepdims=True) * probs.mean(1), axis=-1)
    return float(aux.mean()), float((counts.max(-1) / counts.mean(-1)).mean()), counts


@pytest.mark.parametrize("microbatches", [1, 2, pytest.param(4, marks=pytest.mark.heavy)])
def test_balancing_metrics_are_the_whole_steps_for_any_microbatch_count(microbatches):
    """moe_aux_loss and moe_load_max equal a numpy computation from the router outputs of the
    whole batch (not a mean of per-microbatch values), so they are the same for 1, 2 and 4
    microbatches; the router bias moves by the whole step's counts."""
    *_, metrics, bias = _first_step(microbatches)
    aux, load_max, counts = _numpy_balance(_router_logits(), k=2)
    assert load_max > 1  # unbalanced: per-microbatch maxima would differ from the step's
    np.testing.assert_allclose(metrics["moe_aux_loss"], aux, rtol=1e-5)
    np.testing.assert_allclose(metrics["moe_load_max"], load_max, rtol=1e-6)
    assert metrics["moe_dropped_fraction"] == 0  # dropless
    np.testing.assert_array_equal(bias, np.float32(0.01) * np.sign(counts.mean(-1, keepdims=True) - counts).astype(np.float32))
    reference = _first_step(1)[3]
    for key in ("moe_aux_loss", "moe_load_max", "moe_dropped_fraction"):
        np.testing.assert_allclose(metrics[key], reference[key], rtol=1e-6, err_msg=key)


def test_microbatched_balancing_loss_says_it_uses_each_microbatchs_counts():
    from jaxdist.models import microbatch_balancing_note

    note = microbatch_balancing_note(load_config(None, [*BALANCE, "train.microbatches=2"]))
    assert note and "train.microbatches=2" in note and "each microbatch's expert counts" in note and "\n" not in note
    assert microbatch_balancing_note(load_config(None, [*BALANCE, "train.microbatches=1"])) is None
    assert microbatch_balancing_note(load_config(None, [*BALANCE, "train.microbatches=2", "model.moe_aux_loss_coef=0"])) is None


# --- capacity and buffer rows: exact ceilings ------------------------------------------------


def _ceil_decimal(rows: int, factor: str, divisor: int) -> int:
    """ceil(rows x factor / divisor) in integers, the factor read as the decimal it is written as."""
    whole, _, fraction = factor.partition(".")
    numerator, denominator = int(whole + fraction), 10 ** len(fraction)
    return max(1, -(-rows * numerator // (denominator * divisor)))


# (tokens, k, experts, factor, the hand count): the two cases, products a float lands a
# hair above an integer (50 x 1.1 = 55.00000000000001), and the minimum of one row
CAPACITY = [
    (33, 1, 4, "1.1", 10),  # 36.3 / 4 = 9.075
    (11, 1, 2, "1.5", 9),  # 16.5 / 2 = 8.25
    (50, 1, 1, "1.1", 55),
    (45, 1, 3, "2.2", 33),
    (25, 1, 1, "2.2", 55),
    (7, 2, 4, "1.25", 5),  # 17.5 / 4 = 4.375
    (16, 2, 8, "1.0", 4),
    (30, 1, 3, "0.1", 1),
    (1, 1, 64, "0.5", 1),
]


@pytest.mark.parametrize("tokens, k, experts, factor, want", CAPACITY)
def test_capacity_rows_is_the_exact_ceiling(tokens, k, experts, factor, want):
    assert _ceil_decimal(tokens * k, factor, experts) == want  # the table's hand counts
    assert experts_lib.capacity_rows(tokens, k, experts, float(factor)) == want
    assert experts_lib.capacity_rows(tokens, k, experts, 0.0) is None  # dropless


# (tokens, k, experts, expert axis, factor, the hand count), none capped by the worst case
BUFFER = [(45, 1, 6, 3, "2.2", 33), (50, 2, 4, 2, "1.1", 55), (10, 2, 8, 4, "1.25", 7), (33, 1, 8, 4, "1.1", 10)]


@pytest.mark.parametrize("tokens, k, experts, ep, factor, want", BUFFER)
def test_buffer_rows_is_the_exact_ceiling(tokens, k, experts, ep, factor, want):
    from jaxdist.parallel.expert import buffer_rows

    assert _ceil_decimal(tokens * k, factor, ep) == want
    assert buffer_rows(tokens, k, experts, ep, None, float(factor)) == want
