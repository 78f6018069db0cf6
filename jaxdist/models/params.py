"""Parameter creation shared by the models: an initialised ``nnx.Param`` with its logical axes."""

from __future__ import annotations

from collections.abc import Callable

import jax
from flax import nnx

Initializer = Callable[..., jax.Array]


def param(rngs: nnx.Rngs, init: Initializer, shape: tuple[int, ...], axes: tuple[str | None, ...], dtype) -> nnx.Param:
    return nnx.Param(init(rngs.params(), shape, dtype), axes=axes)


def fan_in_init(fan_in: int) -> Initializer:
    return jax.nn.initializers.normal(stddev=fan_in**-0.5)
