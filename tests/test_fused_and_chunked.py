"""Fused QKV and gate/up projections and the chunked cross-entropy (``model.fused_projections``,
``model.loss_chunk``): the same math as the separate projections and the whole-sequence
loss, fewer tensor-parallel all-reduces and less temp memory."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxdist.config import ModelConfig, load_config
from jaxdist.data.sources import resolve_vocab
from jaxdist.inspect.collectives import collective_ops
from jaxdist.inspect.hlo import parse_hlo
from jaxdist.layout.mesh import parse_mesh
from jaxdist.models.counts import count_params
from jaxdist.models.llama import Llama
from jaxdist.training.aot import analyze, compile_train_step

from helpers import TINY, first_batch_grads


def _relative_close(got, want, tol: float = 1e-5) -> None:
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape
    assert np.linalg.norm(got - want) <= tol * np.linalg.norm(want), (np.linalg.norm(got - want), np.linalg.norm(want))


# -- fused vs separate projections ------------------------------------------------------


def _fuse(params: dict, q_per_kv: int) -> dict:
    """Separate-projection parameters (pure dict, layers stacked) in the fused layout:
    wqkv[..., kv, j] = wq head kv * q_per_kv + j for j < q_per_kv, then wk, wv; w_gate_up = [gate, up]."""
    out = jax.tree.map(lambda x: x, params)
    attn, mlp = out["blocks"]["attn"], out["blocks"]["mlp"]
    wq, wk, wv = attn.pop("wq"), attn.pop("wk"), attn.pop("wv")
    layers, d, kv, hd = wk.shape
    attn["wqkv"] = jnp.concatenate([wq.reshape(layers, d, kv, q_per_kv, hd), wk[:, :, :, None], wv[:, :, :, None]], axis=3)
    mlp["w_gate_up"] = jnp.stack([mlp.pop("w_gate"), mlp.pop("w_up")], axis=2)
    return out


def _unfuse(params: dict, q_per_kv: int) -> dict:
    """The inverse of ``_fuse`` (for mapping fused gradients back)."""
    out = jax.tree.map(lambda x: x, params)
    attn, mlp = out["blocks"]["attn"], out["blocks"]["mlp"]
    wqkv = attn.pop("wqkv")
    layers, d, kv, _, hd = wqkv.shape
    attn["wq"] = wqkv[:, :, :, :q_per_kv].reshape(layers, d, kv * q_per_kv, hd)
    attn["wk"], attn["wv"] = wqkv[:, :, :, q_per_kv], wqkv[:, :, :, q_per_kv + 1]
    gate_up = mlp.pop("w_gate_up")
    mlp["w_gate"], mlp["w_up"] = gate_up[:, :, 0], gate_up[:, :, 1]
    return out


def _outputs(model: Llama, batch: dict) -> tuple[jax.Array, jax.Array, dict]:
    """(logits, mean loss, its gradients as a pure dict), jitted."""
    graphdef, params = nnx.split(model, nnx.Param)

    @jax.jit
    def run(params):
        def loss(params):
            total, weight, _ = nnx.merge(graphdef, params).loss(batch)
            return total / weight

        value, grads = jax.value_and_grad(loss)(params)
        return nnx.merge(graphdef, params)(batch["inputs"]), value, grads

    logits, value, grads = run(params)
    return logits, value, nnx.to_pure_dict(grads)


@pytest.mark.parametrize("n_kv_heads", [2])  # 4 query heads per kv head: a wrong grouping cannot pass
def test_fused_projections_match_separate_ones(n_kv_heads):
    kw = dict(vocab_size=256, d_model=64, n_layers=2, n_heads=8, n_kv_heads=n_kv_heads, dtype="float32")
    separate = Llama(ModelConfig(**kw, fused_projections=False), rngs=nnx.Rngs(0))
    fused_cfg = ModelConfig(**kw, fused_projections=True)
    fused = Llama(fused_cfg, rngs=nnx.Rngs(1))
    q_per_kv = 8 // n_kv_heads
    # its own initialisation: the same parameter count and fan-in scale as the separate matrices
    assert sum(x.size for x in jax.tree.leaves(nnx.state(fused, nnx.Param))) == count_params(fused_cfg)
    assert fused.blocks.attn.wqkv.shape == (2, 64, n_kv_heads, q_per_kv + 2, 8)
    assert float(jnp.std(fused.blocks.attn.wqkv[...])) == pytest.approx(64**-0.5, rel=0.05)
    assert float(jnp.std(fused.blocks.mlp.w_gate_up[...])) == pytest.approx(64**-0.5, rel=0.05)

    separate_params = nnx.to_pure_dict(nnx.state(separate, nnx.Param))
    state = nnx.state(fused, nnx.Param)
    nnx.replace_by_pure_dict(state, _fuse(separate_params, q_per_kv))
    nnx.update(fused, state)

    tokens = jax.random.randint(jax.random.key(1), (2, 33), 0, 256)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    fused_logits, fused_loss, fused_grads = _outputs(fused, batch)
    logits, loss, grads = _outputs(separate, batch)
    np.testing.assert_allclose(fused_logits, logits, atol=1e-5, rtol=0)
    np.testing.assert_allclose(fused_loss, loss, rtol=1e-6)
    back = _unfuse(fused_grads, q_per_kv)
    for (path, g), (ref_path, r) in zip(jax.tree_util.tree_leaves_with_path(back), jax.tree_util.tree_leaves_with_path(grads), strict=True):
        assert path == ref_path
        _relative_close(g, r)


# -- chunked vs whole-sequence cross-entropy -----------------------------------------------


@pytest.fixture(scope="module")
def whole_sequence():
    """The unchunked loss and gradients on one device (seq_len 32)."""
    return first_batch_grads("data=1")[1:]


@pytest.mark.parametrize("chunk", [12], ids=["remainder"])  # two whole chunks in the scan, then an 8-token tail
def test_chunked_loss_matches_whole_sequence_on_a_tensor_mesh(chunk, whole_sequence):
    trainer, loss, grads = first_batch_grads("data=2,tensor=2", f"model.loss_chunk={chunk}")
    assert "tensor" in trainer.param_shardings["head"].get_value().spec  # the head's vocab axis is split
    ref_loss, ref_grads = whole_sequence
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True):
        _relative_close(g, r)


@pytest.mark.heavy
def test_chunked_loss_under_the_one_f_one_b_pipeline(whole_sequence):
    """The pipeline's last stage calls ``model.head_loss`` inside ``shard_map`` (1F1B takes its gradient there)."""
    overrides = ("model.loss_chunk=12", "parallel.schedule=1f1b", "parallel.pipeline_microbatches=2")
    _, loss, grads = first_batch_grads("data=2,pipe=2", *overrides)
    ref_loss, ref_grads = whole_sequence
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True):
        _relative_close(g, r)


# -- what the compiled step moves and holds -------------------------------------------------


def _activation_all_reduces_per_layer(*overrides: str) -> float:
    """Activation all-reduces over 'tensor' per layer of one train step (forward + backward).

    Counted: all-reduces whose groups span exactly the tensor axis, inside the layer scans
    (run ``n_layers`` times: the forward scan and the backward scan), of payload a multiple of
    one [batch, seq, d_model] fp32 activation (a tuple all-reduce of k activations counts k).
    On data=1 there is no gradient reduction over a batch axis, and with TP the weights are
    split or replicated so their gradients need no reduction of activation size; the
    embedding's and the head's all-reduces run outside the layer loop and are not counted.
    """
    config = load_config(None, [*TINY, "model.scan_layers=true", *overrides])
    resolve_vocab(config)
    sizes = parse_mesh("data=1,tensor=2")
    trainer, compiled = compile_train_step(config, sizes, jax.devices()[:2])
    layers, m = config.model.n_layers, config.model
    activation = config.train.global_batch * config.train.seq_len * m.d_model * 4
    ops = collective_ops(parse_hlo(compiled.as_text()), {a: int(n) for a, n in trainer.layout.mesh.shape.items()})
    count = 0
    for op in ops:
        if op.kind == "all-reduce" and op.axes == ("tensor",) and op.executions == layers and op.bytes % activation == 0:
            count += op.executions * op.bytes // activation
    return count / layers


@pytest.mark.heavy
def test_fused_projections_need_two_all_reduces_each_way_per_layer():
    fused = _activation_all_reduces_per_layer()
    separate = _activation_all_reduces_per_layer("model.fused_projections=false")
    print(f"activation all-reduces over tensor per layer (forward + backward): fused {fused}, separate {separate}")
    assert fused == 4  # Megatron: 2 forward (attention out, MLP out) + 2 backward (QKV in, gate/up in)
    assert separate > fused


def test_loss_chunk_lowers_temp_memory():
    """With a vocabulary large enough that the [batch, seq, vocab] fp32 logits dominate."""

    def temp(chunk: int) -> int:
        config = load_config(None, [*TINY, "model.vocab_size=16384", f"model.loss_chunk={chunk}"])
        return analyze(config, parse_mesh("data=1"), jax.devices()[:1])["memory_per_device_bytes"]["temp"]

    logits = 16 * 32 * 16384 * 4  # global_batch x seq_len x vocab, fp32: 32 MiB
    whole, chunked = temp(0), temp(8)
    print(f"temp memory: whole sequence {whole / 2**20:.1f} MiB, loss_chunk=8 {chunked / 2**20:.1f} MiB")
    assert whole - chunked >= logits  # at least one full logits buffer fewer
    assert chunked < 0.5 * whole


# -- bad input ----------------------------------------------------------------------------------


def test_negative_loss_chunk_is_one_line_and_exit_2(tmp_path, capsys):
    from jaxdist.train import main

    run_dir = tmp_path / "run"
    assert main(["model.loss_chunk=-1", "--run-dir", str(run_dir), "--steps", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("jaxdist: error: ") and "model.loss_chunk must be >= 0" in err[0], err
    assert not run_dir.exists()


def test_split_parts_gradient_equals_slicing():
    """The fused projections' split joins its parts' gradients by one concatenate; the
    result equals autodiff through plain slices."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxdist.models.layers import split_parts

    x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 3, 2, 6, 4)), jnp.float32)
    weights = [
        jnp.asarray(np.random.default_rng(i).standard_normal(s), jnp.float32)
        for i, s in enumerate([(2, 3, 2, 4, 4), (2, 3, 2, 1, 4), (2, 3, 2, 1, 4)])
    ]

    def objective(split):
        return lambda x: sum(jnp.sum(jnp.sin(p) * w) for p, w in zip(split(x), weights, strict=True))

    sliced = lambda x: (x[:, :, :, :4], x[:, :, :, 4:5], x[:, :, :, 5:])  # noqa: E731
    parts = split_parts(x, 3, (4, 1, 1))
    for got, want in zip(parts, sliced(x), strict=True):
        np.testing.assert_array_equal(got, want)
    np.testing.assert_allclose(jax.grad(objective(lambda x: split_parts(x, 3, (4, 1, 1))))(x), jax.grad(objective(sliced))(x), rtol=1e-6)


def test_project_joined_gradients_equal_autodiff_through_the_fused_einsum():
    """The fused projection's custom backward (input gradient over all parts at once, weight
    gradient per part), cut by ``split_parts``, against autodiff through one einsum and plain slices."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxdist.models.layers import project_joined, split_parts

    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((2, 5, 8)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((8, 2, 4, 3)), jnp.float32)  # [d, kv, groups + 2, head_dim]
    probes = [jnp.asarray(rng.standard_normal((2, 5, 2, n, 3)), jnp.float32) for n in (2, 1, 1)]

    def objective(project):
        return lambda x, w: sum(jnp.sum(jnp.tanh(p) * c) for p, c in zip(project(x, w), probes, strict=True))

    def reference(x, w):
        y = jnp.einsum("btd,dkgh->btkgh", x, w)
        return y[:, :, :, :2], y[:, :, :, 2:3], y[:, :, :, 3:]

    ours = lambda x, w: split_parts(project_joined("btd,dkgh->btkgh", x, w, 3, 2, (2, 1, 1)), 3, (2, 1, 1))  # noqa: E731
    for got, want in zip(ours(x, w), reference(x, w), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-6)
    got = jax.grad(objective(ours), argnums=(0, 1))(x, w)
    want = jax.grad(objective(reference), argnums=(0, 1))(x, w)
    for g, r in zip(got, want, strict=True):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-6)
