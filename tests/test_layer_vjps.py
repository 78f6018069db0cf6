"""The decoder's hand-written backward passes (RMSNorm, SwiGLU, the projections' fp32 weight
gradients, the embedding lookup) against autodiff through the plain formulas, in fp32 and bf16;
and, in the model's gradient program, that every weight gradient leaves its matmul in fp32 and the
embedding table is gathered in the compute dtype (what ``tests/test_gpu_precision.py`` checks in
the compiled GPU program: XLA:CPU promotes bf16 reductions, so no CPU run shows the dtype that
crosses devices)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxdist.config import ModelConfig
from jaxdist.models.layers import cross_entropy_sum, embed_lookup, project, rms_norm, swiglu, swiglu_joined
from jaxdist.models.llama import Llama

from helpers import jaxpr_equations


def plain_rms_norm(x, scale, eps, dtype):
    x32 = x.astype(jnp.float32)
    return (x32 / jnp.sqrt(jnp.mean(x32**2, axis=-1, keepdims=True) + eps) * scale.astype(jnp.float32)).astype(dtype)


def plain_swiglu(gate, up):
    return gate * (1 / (1 + jnp.exp(-gate))) * up


def _probe(shape, seed):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_rms_norm_value_and_gradients_equal_autodiff(dtype):
    x = (_probe((3, 5, 16), 0) * 3).astype(dtype)
    scale = 1 + _probe((16,), 1) * 0.1
    probe = _probe((3, 5, 16), 2)
    tol = 1e-5 if dtype == jnp.float32 else 2e-2

    def objective(f):
        return lambda x, scale: jnp.sum(jnp.sin(f(x, scale, 1e-5, dtype).astype(jnp.float32)) * probe)

    np.testing.assert_allclose(
        rms_norm(x, scale, 1e-5, dtype).astype(jnp.float32), plain_rms_norm(x, scale, 1e-5, dtype).astype(jnp.float32), rtol=tol, atol=tol
    )
    got = jax.grad(objective(rms_norm), argnums=(0, 1))(x, scale)
    want = jax.grad(objective(plain_rms_norm), argnums=(0, 1))(x, scale)
    assert got[0].dtype == dtype and got[1].dtype == jnp.float32
    for g, w in zip(got, want, strict=True):
        assert float(jnp.max(jnp.abs(w.astype(jnp.float32)))) > 1e-2
        np.testing.assert_allclose(g.astype(jnp.float32), w.astype(jnp.float32), rtol=tol, atol=tol * 10)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_swiglu_value_and_gradients_equal_autodiff(dtype):
    gate, up = (_probe((4, 7, 24), s).astype(dtype) * 2 for s in (3, 4))
    probe = _probe((4, 7, 24), 5)
    tol = 1e-5 if dtype == jnp.float32 else 3e-2

    def objective(f):
        return lambda gate, up: jnp.sum(f(gate, up).astype(jnp.float32) * probe)

    np.testing.assert_allclose(swiglu(gate, up).astype(jnp.float32), plain_swiglu(gate, up).astype(jnp.float32), rtol=tol, atol=tol)
    got = jax.grad(objective(swiglu), argnums=(0, 1))(gate, up)
    want = jax.grad(objective(plain_swiglu), argnums=(0, 1))(gate, up)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == dtype
        np.testing.assert_allclose(g.astype(jnp.float32), w.astype(jnp.float32), rtol=tol, atol=tol * 10)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_joined_swiglu_value_and_gradient_equal_autodiff_on_the_two_halves(dtype):
    gate_up = (_probe((4, 7, 2, 24), 6) * 2).astype(dtype)  # the fp8 MLP's joined product, [b, t, 2, f]
    probe = _probe((4, 7, 24), 7)
    tol = 1e-5 if dtype == jnp.float32 else 3e-2

    def objective(f):
        return lambda gate_up: jnp.sum(f(gate_up).astype(jnp.float32) * probe)

    plain = lambda gate_up: plain_swiglu(gate_up[:, :, 0], gate_up[:, :, 1])  # noqa: E731
    np.testing.assert_allclose(swiglu_joined(gate_up, 2).astype(jnp.float32), plain(gate_up).astype(jnp.float32), rtol=tol, atol=tol)
    got = jax.grad(objective(lambda x: swiglu_joined(x, 2)))(gate_up)
    want = jax.grad(objective(plain))(gate_up)
    assert got.dtype == dtype and got.shape == gate_up.shape
    assert float(jnp.max(jnp.abs(want[:, :, 1].astype(jnp.float32)))) > 1e-2  # both halves carry a gradient
    np.testing.assert_allclose(got.astype(jnp.float32), want.astype(jnp.float32), rtol=tol, atol=tol * 10)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_cross_entropy_sum_and_its_gradient_equal_optax_on_fp32_logits(dtype):
    logits = (_probe((3, 6, 11), 8) * 4).astype(dtype)
    logits = logits.at[..., 9:].set(-jnp.inf)  # an imported vocabulary's padding rows (never targets)
    targets = jnp.asarray(np.random.default_rng(9).integers(0, 9, (3, 6)), jnp.int32)
    mask = jnp.asarray(np.random.default_rng(10).integers(0, 2, (3, 6)), jnp.float32)

    def reference(logits):  # what the model computed before: optax on the logits cast to fp32
        return jnp.sum(optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets) * mask)

    ours = lambda logits: cross_entropy_sum(logits, targets, mask)  # noqa: E731
    np.testing.assert_allclose(ours(logits), reference(logits), rtol=1e-6)
    got, want = jax.grad(ours)(logits), jax.grad(reference)(logits)
    assert got.dtype == dtype
    assert float(jnp.max(jnp.abs(want.astype(jnp.float32)))) > 1e-2
    assert not np.any(np.asarray(got[..., 9:], np.float32))  # no gradient into the padding
    assert not np.any(np.asarray(got, np.float32)[np.asarray(mask) == 0])  # nor into masked tokens
    tol = 1e-6 if dtype == jnp.float32 else 1e-2
    np.testing.assert_allclose(got.astype(jnp.float32), want.astype(jnp.float32), rtol=tol, atol=tol)


# -- projections and the embedding: fp32 weight gradients ------------------------------------

PROJECTIONS = ["bthk,hkd->btd", "btf,fd->btd", "btd,dv->btv", "btd,dkgh->btkgh"]  # wo, w_down, the head, fused qkv
SHAPES = {"b": 2, "t": 5, "h": 3, "k": 4, "d": 6, "f": 7, "v": 9, "g": 2}


def _operands(equation, seed):
    (x_sub, w_sub), out = equation.split("->")[0].split(","), equation.split("->")[1]
    shape = lambda sub: tuple(SHAPES[c] for c in sub)  # noqa: E731
    return _probe(shape(x_sub), seed), _probe(shape(w_sub), seed + 1), _probe(shape(out), seed + 2)


def plain_project(equation, x, w):
    return jnp.einsum(equation, x, w.astype(x.dtype))


@pytest.mark.parametrize("equation", PROJECTIONS)
def test_project_value_and_gradients_equal_autodiff_in_fp32(equation):
    x, w, probe = _operands(equation, 10)

    def objective(f):
        return lambda x, w: jnp.sum(jnp.tanh(f(equation, x, w)) * probe)

    np.testing.assert_array_equal(project(equation, x, w), plain_project(equation, x, w))
    got = jax.grad(objective(project), argnums=(0, 1))(x, w)
    want = jax.grad(objective(plain_project), argnums=(0, 1))(x, w)
    for g, r in zip(got, want, strict=True):
        assert g.dtype == jnp.float32 and float(jnp.max(jnp.abs(r))) > 1e-2
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("equation", PROJECTIONS)
def test_project_in_bf16_keeps_the_input_gradient_and_sums_the_weight_gradient_in_fp32(equation):
    """bf16 compute: the output and the input gradient are autodiff's (bf16 matmuls), the weight
    gradient is the exact sum of the bf16 products (float64 here) to fp32 precision, returned in
    the weight's dtype: fp32 for an fp32 master weight (the head), bf16 for a cast one (the layers)."""
    x, w, probe = _operands(equation, 20)
    x = x.astype(jnp.bfloat16)
    probe = probe.astype(jnp.bfloat16).astype(jnp.float32)  # the output gradient: exact in bf16

    def objective(f):
        return lambda x, w: jnp.sum(f(equation, x, w).astype(jnp.float32) * probe)

    np.testing.assert_array_equal(project(equation, x, w).astype(jnp.float32), plain_project(equation, x, w).astype(jnp.float32))
    dx, dw = jax.grad(objective(project), argnums=(0, 1))(x, w)
    auto_dx, auto_dw = jax.grad(objective(plain_project), argnums=(0, 1))(x, w)
    assert dx.dtype == jnp.bfloat16 and dw.dtype == jnp.float32
    np.testing.assert_allclose(dx.astype(jnp.float32), auto_dx.astype(jnp.float32), rtol=1e-2, atol=1e-2)
    (x_sub, w_sub), out = equation.split("->")[0].split(","), equation.split("->")[1]
    exact = np.einsum(f"{x_sub},{out}->{w_sub}", np.asarray(x.astype(jnp.float32), np.float64), np.asarray(probe, np.float64))
    np.testing.assert_allclose(dw, exact, rtol=1e-6, atol=1e-6)
    # autodiff's bf16 matmul rounds the weight gradient to bf16 (what crossed devices before)
    assert float(np.max(np.abs(np.asarray(auto_dw, np.float64) - exact))) > 1e-3
    _, dw_cast = jax.grad(objective(project), argnums=(0, 1))(x, w.astype(jnp.bfloat16))
    assert dw_cast.dtype == jnp.bfloat16
    np.testing.assert_allclose(dw_cast.astype(jnp.float32), exact, rtol=8e-3, atol=1e-6)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_embed_lookup_value_and_table_gradient_equal_autodiff(dtype):
    """Repeated tokens: their rows' gradients add up in the table's fp32, as autodiff of the lookup
    on the fp32 table (cast after it) does."""
    table = _probe((11, 6), 30)
    tokens = jnp.asarray(np.random.default_rng(31).integers(0, 11, (3, 13)), jnp.int32)
    probe = _probe((3, 13, 6), 32)

    def plain(table, tokens, dtype):
        return jnp.take(table, tokens, axis=0).astype(dtype)

    def objective(f):
        return lambda table: jnp.sum(f(table, tokens, dtype).astype(jnp.float32) * probe)

    got = embed_lookup(table, tokens, dtype)
    assert got.dtype == dtype
    np.testing.assert_array_equal(got.astype(jnp.float32), plain(table, tokens, dtype).astype(jnp.float32))
    d_table = jax.grad(objective(embed_lookup))(table)
    assert d_table.dtype == jnp.float32 and len(set(tokens.ravel().tolist())) < tokens.size
    np.testing.assert_allclose(d_table, jax.grad(objective(plain))(table), rtol=1e-6, atol=1e-6)


# -- in the model's gradient program -----------------------------------------------------------


@pytest.mark.parametrize("fused", [True, False])
def test_the_models_weight_gradients_leave_their_matmuls_in_fp32_and_the_table_is_gathered_in_bf16(fused):
    """A bf16 decoder's gradient program: each weight-shaped matmul output (a weight gradient, the
    partial sum XLA reduces across the batch axes) is fp32, every projection's included; the
    embedding's lookup reads a bf16 table (the FSDP all-gather moves bf16) and its gradient is an
    fp32 scatter-add."""
    cfg = ModelConfig(vocab_size=96, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, mlp_dim=48, fused_projections=fused)
    graphdef, params = nnx.split(Llama(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 96, (2, 5)), jnp.int32)

    def loss(params):
        return nnx.merge(graphdef, params).loss({"inputs": tokens, "targets": tokens})[0]

    jaxpr = jax.make_jaxpr(jax.grad(loss))(params).jaxpr
    # the weight-gradient matmuls' outputs: d 32, 4 heads / 2 kv heads of 8, mlp 48, vocab 96; the
    # fused qkv [d, kv, 2 q + k + v, 8] and gate/up [d, 2, f] take theirs per part (project_joined).
    # Matched by their dimensions in any order (autodiff's transposed matmul may permute them).
    parts = {(32, 2, 2, 8), (32, 2, 1, 8), (32, 1, 48)} if fused else {(32, 4, 8), (32, 2, 8), (32, 48)}
    expected = {tuple(sorted(shape)) for shape in parts | {(4, 8, 32), (48, 32), (32, 96)}}  # + wo, w_down, the head
    weight_grads: dict[tuple, set[str]] = {}
    for out in (eqn.outvars[0].aval for eqn in jaxpr_equations(jaxpr) if eqn.primitive.name == "dot_general"):
        if tuple(sorted(out.shape)) in expected:
            weight_grads.setdefault(tuple(sorted(out.shape)), set()).add(str(out.dtype))
    assert set(weight_grads) == expected, weight_grads
    assert all(dtypes == {"float32"} for dtypes in weight_grads.values()), weight_grads
    table = [
        e for e in jaxpr_equations(jaxpr) if e.primitive.name in ("gather", "scatter-add") and tuple(e.invars[0].aval.shape) == (96, 32)
    ]
    assert sorted((e.primitive.name, str(e.invars[0].aval.dtype)) for e in table) == [("gather", "bfloat16"), ("scatter-add", "float32")]
