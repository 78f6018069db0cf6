"""Context parallelism in training: the sequence split over a ``context`` axis trains like
one device on the default packed corpus (both attention strategies, with and without
load balancing, beside data, fsdp and tensor), the model states are sharded over
``context``, each shard holds the chunks the load balancing promises, a run resumes
onto another context size, and analyze sees the bytes that cross ``context``.

The attention kernels alone (outputs and gradients against the unsplit attention, GQA,
rows with no key, the perturbation probe) are tested in tests/test_context_attention.py.
"""

import jax
import numpy as np
import pytest
from flax import nnx

from jaxdist.config import load_config
from jaxdist.data.sources import resolve_vocab
from jaxdist.layout.mesh import mesh_device_count, parse_mesh
from jaxdist.training.aot import analyze
from jaxdist.training.run import build_trainer, run

from helpers import TINY, first_batch, train_losses

STEPS = 4
RING = ("parallel.context_strategy=ring",)
NO_BALANCE = ("parallel.context_load_balance=false",)


@pytest.fixture(scope="module")
def one_device() -> np.ndarray:
    return np.array(train_losses("data=1", (), STEPS))


@pytest.mark.parametrize(
    ("mesh", "overrides"),
    [
        ("context=4", ()),
        ("context=4", RING),
        pytest.param("context=4", NO_BALANCE, marks=pytest.mark.heavy),
        pytest.param("context=4", (*RING, *NO_BALANCE), marks=pytest.mark.heavy),
        pytest.param("data=2,context=2,tensor=2", (), marks=pytest.mark.heavy),
        pytest.param("data=2,context=2,tensor=2", RING, marks=pytest.mark.heavy),
        pytest.param("fsdp=2,context=2", (), marks=pytest.mark.heavy),
        pytest.param("fsdp=2,context=2", RING, marks=pytest.mark.heavy),
    ],
)
def test_a_context_split_trains_like_one_device(mesh, overrides, one_device):
    """fp32 on the default packed corpus (documents cross the shard and chunk edges)."""
    losses = np.array(train_losses(mesh, overrides, STEPS))
    np.testing.assert_allclose(losses, one_device, rtol=0, atol=1e-5)


def _trainer(mesh: str, *overrides: str):
    config = load_config(None, [*TINY, *overrides])
    resolve_vocab(config)
    sizes = parse_mesh(mesh)
    return config, build_trainer(config, sizes, jax.devices()[: mesh_device_count(sizes)])


@pytest.mark.parametrize(("mesh", "ways"), [("context=4", 4), ("fsdp=2,context=2", 4), ("data=2,context=2", 2)])
def test_model_states_are_sharded_over_context(mesh, ways):
    """A context group holds one copy of the parameters and Adam's moments, not one per
    device: per device, the arrays' own shards add up to 1/ways of the embedding-sized
    weights (measured from the allocated shards, not from the rules)."""
    _, trainer = _trainer(mesh)
    state = trainer.init_state(0)
    for tree in (state.params, state.opt_state):
        leaves = [x for x in jax.tree.leaves(nnx.to_pure_dict(tree) if isinstance(tree, nnx.State) else tree) if getattr(x, "ndim", 0) >= 2]
        total = sum(x.nbytes for x in leaves)
        on_device_0 = sum(s.data.nbytes for x in leaves for s in x.addressable_shards if s.device == jax.devices()[0])
        assert on_device_0 == pytest.approx(total / ways, rel=1e-6), (mesh, on_device_0, total)


def test_each_context_shard_holds_chunks_r_and_2n_minus_1_minus_r():
    """The first batch on context=4 against the same batch read unsplit: device r's slice
    of every token array is chunks r and 7-r of the sequence (targets stay paired with
    their inputs, positions are carried), and without load balancing it is chunk r."""
    config, plain = _trainer("data=1")
    reference = jax.device_get(first_batch(config, plain.layout))
    seq, chunk = config.train.seq_len, config.train.seq_len // 8
    for balance, expected in ((True, lambda r: [r, 7 - r]), (False, lambda r: [2 * r, 2 * r + 1])):
        config, trainer = _trainer("context=4", f"parallel.context_load_balance={str(balance).lower()}")
        batch = first_batch(config, trainer.layout)
        assert set(batch) == {*reference, "positions"}
        for key in batch:
            want_full = reference[key] if key in reference else np.broadcast_to(np.arange(seq), reference["inputs"].shape)
            for shard in batch[key].addressable_shards:
                r = shard.index[1].start // (seq // 4)
                columns = np.concatenate([np.arange(c * chunk, (c + 1) * chunk) for c in expected(r)])
                np.testing.assert_array_equal(np.asarray(shard.data), want_full[shard.index[0]][:, columns], err_msg=f"{key} shard {r}")


def test_the_split_says_which_attention_and_kernel_it_uses(capsys):
    _trainer("context=4", *RING)
    err = capsys.readouterr().err
    [line] = [line for line in err.splitlines() if line.startswith("jaxdist: context attention:")]
    assert line.startswith("jaxdist: context attention: ring over context=4, per-block kernel xla"), line
    assert "(tiles of 4x4 tokens, fp32 scores" in line, line  # the real tiles: 32 tokens over 8 chunks of 4
    assert line.endswith("; sequence load-balanced (shard r holds chunks r and 2N-1-r)"), line


@pytest.mark.heavy
@pytest.mark.parametrize("strategy", ["all_to_all", "ring"])
def test_accumulation_on_a_data_axis_beside_context_trains_like_one_device_and_says_how_it_reduces(strategy, one_device, capsys):
    """Replicated parameters with microbatches reduce their gradients once per step inside a
    region manual over the batch axes; the context kernels are shard_maps over the whole mesh and
    cannot nest there (the planner's 8B search found this layout failing to trace), so the
    gradients are reduced per microbatch and one line says so."""
    config = load_config(None, [*TINY, f"train.steps={STEPS}", f"parallel.context_strategy={strategy}", "train.microbatches=2"])
    sizes = parse_mesh("data=2,context=2")
    losses = run(config, sizes, None, devices=jax.devices()[:4], progress=False).losses
    np.testing.assert_allclose(losses, one_device, rtol=0, atol=1e-5)
    assert "gradients are reduced after each microbatch, not once per step as replicated parameters allow, because of a context axis" in (
        capsys.readouterr().err
    )


@pytest.mark.heavy
def test_resume_onto_another_context_size(tmp_path):
    """Four steps on context=4 stopped after 2, resumed on fsdp=2,context=2: the losses
    of the uninterrupted context=4 run (which equal one device's)."""
    common = (f"train.steps={STEPS}", "train.warmup_steps=1", "checkpoint.every_steps=2")

    def go(mesh: str, *extra: str):
        config = load_config(None, [*TINY, *common, *extra])
        sizes = parse_mesh(mesh)
        return run(config, sizes, tmp_path, devices=jax.devices()[: mesh_device_count(sizes)], progress=False).losses

    first = go("context=4", "train.stop_after_step=2")
    resumed = go("fsdp=2,context=2")
    reference = train_losses("context=4", ("train.warmup_steps=1", "checkpoint.every_steps=2"), STEPS)
    np.testing.assert_allclose(first + resumed, reference, rtol=0, atol=1e-5)


@pytest.mark.parametrize(("overrides", "kind"), [((), "all-gather"), (RING, "collective-permute")])
def test_analyze_counts_the_key_value_traffic_over_context(overrides, kind):
    """XLA's compiled step: the all-gather strategy gathers K/V over context, the ring
    permutes them around it; the ring has no K/V all-gathers (only the parameters', which
    FSDP-over-context gathers too)."""
    config = load_config(None, [*TINY, *overrides])
    resolve_vocab(config)
    report = analyze(config, parse_mesh("context=4"), jax.devices()[:4])
    by_axes = report["collectives_by_axes"]
    assert "context" in by_axes, by_axes
    assert report["collectives"][kind]["count"] > 0
    if kind == "collective-permute":
        assert report["collectives"]["collective-permute"]["bytes"] > 0
