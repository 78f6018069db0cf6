"""Loss scaling for float16 compute (the role of PyTorch's GradScaler).

fp16 has 5 exponent bits: small gradients underflow to zero. The objective is multiplied
by ``scale`` before the backward pass and the gradients divided by it after. A step
whose gradients overflowed is skipped (parameters and optimizer state untouched). With
``train.loss_scale=dynamic`` the scale halves on every overflow and doubles after
``GROWTH_INTERVAL`` clean steps in a row (GradScaler's defaults); a number fixes it.
The state lives in the train state, so it is checkpointed and restored with it.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

INITIAL_SCALE = 2.0**16
GROWTH_INTERVAL = 2000
GROWTH, BACKOFF = 2.0, 0.5
MIN_SCALE = 1.0


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LossScale:
    scale: jax.Array  # float32 scalar
    clean_steps: jax.Array  # int32: steps since the last overflow or growth
    overflows: jax.Array  # int32: steps skipped for overflow so far


def initial(setting: str) -> LossScale:
    scale = INITIAL_SCALE if setting == "dynamic" else float(setting)
    return LossScale(jnp.asarray(scale, jnp.float32), jnp.zeros((), jnp.int32), jnp.zeros((), jnp.int32))


def update(state: LossScale, finite: jax.Array, dynamic: bool) -> LossScale:
    """The state after a step whose unscaled gradients were ``finite`` (or not)."""
    overflows = state.overflows + (~finite).astype(jnp.int32)
    if not dynamic:
        return LossScale(state.scale, state.clean_steps, overflows)
    clean = jnp.where(finite, state.clean_steps + 1, 0)
    grow = clean >= GROWTH_INTERVAL
    scale = jnp.where(finite, jnp.where(grow, state.scale * GROWTH, state.scale), jnp.maximum(state.scale * BACKOFF, MIN_SCALE))
    return LossScale(scale, jnp.where(grow, 0, clean), overflows)


def all_finite(tree) -> jax.Array:
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]))
