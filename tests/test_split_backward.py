"""The backward pass cut in two for zero-bubble schedules (``parallel.split_backward``): a
stage of the tiny Llama (2 layers in one scan, as the pipelines run them), its ``jax.vjp``
against B (the input gradient) and W (the weight gradients from B's interface): the same
values, and by XLA's own FLOP count nothing computed twice (B + W = the whole backward)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxdist.config import load_config
from jaxdist.models import build_task
from jaxdist.parallel.pipeline_parts import StageResiduals
from jaxdist.parallel.split_backward import split_backward

from helpers import TINY


def _flops(fn, *args) -> float:
    cost = jax.jit(fn).lower(*args).compile().cost_analysis()
    return float((cost[0] if isinstance(cost, list | tuple) else cost)["flops"])


@pytest.mark.parametrize("remat", ["none", "full"])
def test_b_and_w_give_the_vjp_and_compute_the_backward_once(remat):
    config = load_config(None, [*TINY, "model.vocab_size=256", f"model.remat={remat}"])
    model = build_task(config).make_model(nnx.Rngs(0))
    graphdef, stacked = model.layer_stack()
    b, t, d = 2, config.train.seq_len, config.model.d_model
    h = jax.random.normal(jax.random.key(1), (b, t, d))
    aux = {"positions": jnp.broadcast_to(jnp.arange(t), (b, t))}
    residuals = StageResiduals(functools.partial(model.run_layers, graphdef))
    y, kept = residuals.forward(stacked, h, aux)
    cotangent = jax.random.normal(jax.random.key(2), y.shape)
    split = split_backward(residuals.backward, stacked, kept, cotangent)
    flat = jax.tree.leaves((stacked, kept, cotangent))

    gx, interface = jax.jit(split.b)(flat)
    grads = jax.jit(split.w)(flat, interface)
    want_grads, want_gx = jax.jit(residuals.backward)(stacked, kept, cotangent)
    np.testing.assert_allclose(gx, want_gx, rtol=1e-5, atol=1e-6)
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert [x.shape for x in interface] == [s.shape for s in split.interface_shapes]

    w_only = [x if k in split.w_inputs else None for k, x in enumerate(flat)]  # W reads nothing else
    chex_grads = jax.jit(split.w)(w_only, interface)
    for got, want in zip(jax.tree.leaves(chex_grads), jax.tree.leaves(want_grads), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)

    whole = _flops(residuals.backward, stacked, kept, cotangent)
    b_flops, w_flops = _flops(split.b, flat), _flops(split.w, flat, interface)
    assert b_flops + w_flops == pytest.approx(whole, rel=0.01), (b_flops, w_flops, whole)
    assert 0.25 * whole < w_flops < 0.6 * whole  # the weight gradients' dots: about half the matmul work
