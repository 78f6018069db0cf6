"""Streaming DiLoCo: the model in fragments synced on their own offsets, each fragment's
average applied some inner steps after it is sent, and the average sent in low precision.

Checked against other paths: every fragment synced at once is DiLoCo's whole-model outer
step bit for bit; one fragment and no overlap is today's DiLoCo (its own tests, and the run
here); the fragments' offsets show in which slices the replicas agree; a sync sends a
fragment's bytes (XLA's compiled programs); fp4 rounds as ml_dtypes' float4_e2m1fn does."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxdist.config import load_config
from jaxdist.errors import ConfigError
from jaxdist.inspect.step_report import build_report
from jaxdist.layout.mesh import mesh_device_count, parse_mesh
from jaxdist.parallel import diloco, grad_reduce
from jaxdist.parallel.diloco_fragments import split_into_fragments
from jaxdist.training.aot import compile_train_step
from jaxdist.training.run import run

from helpers import TINY

STREAM = ("parallel.diloco_inner_steps=4", "parallel.diloco_fragments=2")


def _run(mesh: str, *overrides: str, steps: int, run_dir=None):
    config = load_config(None, [*TINY, f"train.steps={steps}", *overrides])
    sizes = parse_mesh(mesh)
    return run(config, sizes, run_dir, devices=jax.devices()[: mesh_device_count(sizes)], progress=False)


def _tree(rng, replicas: int | None = None):
    lead = () if replicas is None else (replicas,)
    return {
        "blocks": {"w": rng.normal(size=(*lead, 4, 3, 8)).astype(np.float32), "norm": rng.normal(size=(*lead, 4, 8)).astype(np.float32)},
        "embed": rng.normal(size=(*lead, 10, 8)).astype(np.float32),
        "head": rng.normal(size=(*lead, 8, 10)).astype(np.float32),
    }


def test_fragments_share_the_bytes_and_cover_every_parameter_once():
    """Layers go round robin, the embedding and head to different fragments; every element
    of every leaf is in exactly one fragment."""
    params = _tree(np.random.default_rng(0))
    for count in (1, 2, 3, 4):
        fragments = split_into_fragments(params, count, inner_steps=8)
        assert [f.offset for f in fragments] == [f * 8 // count for f in range(count)]
        seen = jax.tree.map(lambda x: np.zeros(x.shape, int), params)
        for f in fragments:
            ones = [np.ones(x.shape, int) for x in f.take(params)]
            seen = jax.tree.map(lambda a, b: a + b, seen, f.put(jax.tree.map(np.zeros_like, seen), ones))
        jax.tree.map(lambda s: np.testing.assert_array_equal(s, 1), seen)
        loads = [f.bytes for f in fragments]
        assert sum(loads) == sum(x.nbytes for x in jax.tree.leaves(params))
    two = split_into_fragments(params, 2, inner_steps=8)
    assert two[0].whole is False and split_into_fragments(params, 1, 8)[0].whole
    layers = [sorted({p.layers for p in f.pieces if p.layers}) for f in two]
    assert layers == [[(0, 2)], [(1, 3)]], layers  # strided
    with pytest.raises(ConfigError, match=r"diloco_fragments=9: the model has 6 parts to share out \(4 layers and 2 other tensors\)"):
        split_into_fragments(params, 9, inner_steps=16)
    with pytest.raises(ConfigError, match="exceeds parallel.diloco_inner_steps=2"):
        split_into_fragments(params, 3, inner_steps=2)


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_every_fragment_synced_at_once_is_the_whole_models_outer_step(momentum):
    """The outer step fragment by fragment (each one's delta averaged over the replicas, its
    slices of the outer parameters and momentum updated, its inner slices reset) on the
    same state gives DiLoCo's whole-model outer step: bit for bit with plain SGD, within two
    ulps with Nesterov momentum (XLA fuses its multiply-adds differently per program shape)."""
    rng = np.random.default_rng(1)
    mesh = Mesh(np.array(jax.devices()[:2]), ("replica",))
    cfg = load_config(None, [f"parallel.diloco_outer_momentum={momentum}", "parallel.diloco_inner_steps=4"]).parallel
    tx = diloco.outer_optimizer(cfg)
    outer_params, inner = _tree(rng), _tree(rng, replicas=2)
    state = diloco.OuterState(outer_params, tx.init(outer_params))
    if momentum:  # a momentum that is not zero, so that each fragment's slice of it matters
        state = diloco.OuterState(outer_params, jax.tree.map(lambda m: m + 0.1, state.momentum))
    shardings = jax.tree.map(lambda _: NamedSharding(mesh, PartitionSpec()), outer_params)
    whole_inner, whole_outer, _ = jax.jit(lambda i, s: diloco.outer_update(i, s, tx, cfg, shardings, mesh))(inner, state)
    for count in (2, 3):
        part_inner, part_state = inner, state
        for fragment in split_into_fragments(outer_params, count, inner_steps=4):
            _, part_shardings = fragment.abstract(outer_params, shardings)

            def step(i, s, fragment=fragment, part_shardings=part_shardings):
                delta = diloco.fragment_delta(i, s, fragment, cfg, part_shardings, mesh)
                return diloco.apply_fragment(i, s, fragment, delta, tx, 0.0, part_shardings, mesh)

            part_inner, part_state = jax.jit(step)(part_inner, part_state)
        for a, b in ((part_inner, whole_inner), (part_state.params, whole_outer.params), (part_state.momentum, whole_outer.momentum)):
            jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-6 if momentum else 0), jax.device_get(a), jax.device_get(b))


def test_fp4_rounds_each_block_as_ml_dtypes_e2m1_does():
    """fp4's codes, decoded: each value divided by its block's scale (max |x| / 6) rounds to
    the e2m1 value ml_dtypes' float4_e2m1fn rounds it to; two codes a byte."""
    rng = np.random.default_rng(2)
    x = (rng.normal(size=(3, 4 * grad_reduce.FP4_BLOCK)) * rng.uniform(0.01, 100, size=(3, 1))).astype(np.float32)
    codec = grad_reduce._Codec("fp4")
    packed, scale = codec.encode(jnp.asarray(x))
    assert packed.dtype == jnp.uint8 and packed.shape == (3, 4, grad_reduce.FP4_BLOCK // 2)
    blocks = x.reshape(3, 4, grad_reduce.FP4_BLOCK)
    ref_scale = np.abs(blocks).max(-1, keepdims=True) / 6.0
    expected = (blocks / ref_scale).astype(ml_dtypes.float4_e2m1fn).astype(np.float32) * ref_scale
    np.testing.assert_allclose(np.asarray(codec.decode((packed, scale))), expected.reshape(3, -1), rtol=1e-6)


def _params(tree) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(jax.device_get(nnx.to_pure_dict(tree)))]


@pytest.mark.heavy
def test_each_fragment_syncs_at_its_own_offset():
    """H=4, 2 fragments: fragment 1 syncs after steps 2 and 6, fragment 0 after step 4. After
    step 6 the replicas agree with the outer parameters on fragment 1's slices and differ on
    fragment 0's; the same run with one fragment synced everything after step 4, and so
    agrees nowhere after 6."""
    result = _run("replica=2", *STREAM, steps=6)
    fragments = split_into_fragments(nnx.to_pure_dict(result.state.outer.params), 2, 4)
    inner, outer = nnx.to_pure_dict(result.state.params), nnx.to_pure_dict(result.state.outer.params)
    synced, trained_apart = fragments[1], fragments[0]
    for r in range(2):
        for a, b in zip(synced.take(inner, lead=1), synced.take(outer), strict=True):
            np.testing.assert_array_equal(np.asarray(a)[r], np.asarray(b))
    for a in trained_apart.take(inner, lead=1):
        assert not np.array_equal(np.asarray(a)[0], np.asarray(a)[1])
    one = _run("replica=2", "parallel.diloco_inner_steps=4", steps=6)
    assert result.losses[:2] == one.losses[:2] and result.losses[2] != one.losses[2]  # fragment 1's sync after step 2
    assert not any(np.array_equal(x[0], x[1]) for x in _params(one.state.params) if x.ndim > 1)


@pytest.mark.heavy
def test_an_overlapped_average_lands_its_steps_later_and_a_resume_in_flight_is_exact(tmp_path):
    """One fragment, H=4, sent after step 4 and applied after step 6 (tau=2), plain outer SGD
    with lr 0.5: after step 5 the outer parameters are still the initial ones and the
    average is pending; after step 6 they moved by exactly -0.5 x that average, whatever the
    replicas did in steps 5 and 6. A run stopped after step 5, with the average in flight,
    resumes to the uninterrupted run's losses and state bit for bit."""
    overlap = ("parallel.diloco_inner_steps=4", "parallel.diloco_overlap_steps=2", "parallel.diloco_outer_momentum=0")
    overlap += ("parallel.diloco_outer_lr=0.5", "checkpoint.every_steps=100", "parallel.diloco_outer_dtype=int8")
    at5 = _run("replica=2", *overlap, "train.stop_after_step=5", steps=8, run_dir=tmp_path / "run")
    whole = _run("replica=2", *overlap, steps=8)
    six = _run("replica=2", *overlap, steps=6)
    fresh = _run("replica=2", *overlap, steps=1)
    (pending,) = at5.state.outer.pending
    assert any(np.abs(np.asarray(p)).max() > 0 for p in pending)
    start = _params(fresh.state.outer.params)  # the outer parameters move at outer steps only
    for a, b in zip(_params(at5.state.outer.params), start, strict=True):
        np.testing.assert_array_equal(a, b)
    for moved, before, delta in zip(_params(six.state.outer.params), start, pending, strict=True):
        np.testing.assert_allclose(moved, before - 0.5 * np.asarray(delta), rtol=1e-6, atol=1e-7)
    resumed = _run("replica=2", *overlap, steps=8, run_dir=tmp_path / "run")
    assert resumed.losses == whole.losses[5:]
    for a, b in ((resumed.state.outer, whole.state.outer), (resumed.state.params, whole.state.params)):
        jax.tree.map(np.testing.assert_array_equal, jax.device_get(a), jax.device_get(b))


def _diloco_report(*overrides: str) -> dict:
    config = load_config(None, [*TINY, "model.n_layers=8", *overrides])
    sizes = parse_mesh("replica=2,data=2")
    trainer, compiled = compile_train_step(config, sizes, jax.devices()[: mesh_device_count(sizes)])
    return build_report(trainer, compiled)["diloco"]


@pytest.mark.heavy
def test_a_sync_sends_one_fragments_bytes():
    """XLA's compiled outer programs: with P fragments the most one sync sends across the
    replica axis is the whole model's bytes / P (within 15%: the embedding and the head are
    parts of their own, here each a quarter of a layer pair), and a round sends what one
    whole-model sync does; fp4 sends under a sixth of fp32's."""
    whole = _diloco_report("parallel.diloco_inner_steps=4")
    assert whole["fragments"] == 1 and whole["peak_sync_cross_replica_wire_bytes"] == whole["outer_cross_replica_wire_bytes"]
    for count in (2, 4):
        streamed = _diloco_report("parallel.diloco_inner_steps=4", f"parallel.diloco_fragments={count}")
        assert streamed["fragments"] == count
        assert streamed["peak_sync_cross_replica_wire_bytes"] <= 1.15 * whole["outer_cross_replica_wire_bytes"] / count, streamed
        assert streamed["outer_cross_replica_wire_bytes"] == pytest.approx(whole["outer_cross_replica_wire_bytes"], rel=0.02)
    fp4 = _diloco_report("parallel.diloco_inner_steps=4", "parallel.diloco_outer_dtype=fp4")
    assert 0.12 < fp4["outer_cross_replica_wire_bytes"] / whole["outer_cross_replica_wire_bytes"] < 1 / 6, fp4
    assert fp4["outer_reduce"] == "fp4"


@pytest.mark.parametrize(
    "overrides, message",
    [
        (("parallel.diloco_overlap_steps=4",), "parallel.diloco_overlap_steps=4 must be below parallel.diloco_inner_steps=4"),
        (("parallel.diloco_outer_dtype=fp4", "parallel.diloco_reduce=int8"), "disagree: set one"),
    ],
)
def test_streaming_settings_that_cannot_work_are_refused_in_one_line(overrides, message):
    with pytest.raises(ConfigError, match=message):
        _run("replica=2", "parallel.diloco_inner_steps=4", *overrides, steps=1)


def test_the_outer_optimizer_updates_elementwise():
    """What fragment-wise outer steps rely on: optax's SGD with Nesterov momentum updates each
    element from its own delta and momentum, so a slice of the state updates alone."""
    tx = optax.sgd(0.7, momentum=0.9, nesterov=True)
    x, g = jnp.arange(6.0), jnp.linspace(-1, 1, 6)
    state = jax.tree.map(lambda m: m + 0.3, tx.init(x))
    whole, _ = tx.update(g, state, x)
    part, _ = tx.update(g[2:4], jax.tree.map(lambda m: m[2:4], state), x[2:4])
    np.testing.assert_array_equal(np.asarray(whole)[2:4], np.asarray(part))
