"""The decoder's hand-written backward passes (RMSNorm, SwiGLU) against autodiff through
the plain formulas, in fp32 and bf16."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxdist.models.layers import rms_norm, swiglu


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
