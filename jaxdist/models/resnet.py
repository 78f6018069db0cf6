"""A small ResNet image classifier (CIFAR-style: 3 stages, basic blocks) in Flax NNX.

GroupNorm instead of BatchNorm: the train step stays a pure function of the parameters
(no running statistics to carry or to synchronise across data-parallel replicas).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxdist.config import ModelConfig


def _groups(channels: int) -> int:
    """Up to 8 groups of at least 4 channels (1-channel groups would erase colour)."""
    return next(g for g in (8, 4, 2, 1) if channels % g == 0 and channels // g >= 4 or g == 1)


class ConvNorm(nnx.Module):
    """3x3 (or 1x1) convolution followed by GroupNorm; ``stride`` downsamples."""

    def __init__(self, cin: int, cout: int, *, kernel: int = 3, stride: int = 1, dtype, rngs: nnx.Rngs):
        init = jax.nn.initializers.he_normal()
        self.kernel = nnx.Param(
            init(rngs.params(), (kernel, kernel, cin, cout), jnp.float32), axes=("conv", "conv", "channels_in", "channels")
        )
        self.scale = nnx.Param(jnp.ones((cout,)), axes=("channels",), no_decay=True)
        self.bias = nnx.Param(jnp.zeros((cout,)), axes=("channels",), no_decay=True)
        self.stride, self.groups, self.dtype = stride, _groups(cout), dtype

    def __call__(self, x: jax.Array) -> jax.Array:
        y = jax.lax.conv_general_dilated(
            x.astype(self.dtype),
            self.kernel[...].astype(self.dtype),
            window_strides=(self.stride, self.stride),
            padding="SAME",
            dimension_numbers=("NHWC", "HWIO", "NHWC"),
        )
        b, h, w, c = y.shape
        g = y.astype(jnp.float32).reshape(b, h, w, self.groups, c // self.groups)
        mean = g.mean(axis=(1, 2, 4), keepdims=True)
        var = g.var(axis=(1, 2, 4), keepdims=True)
        g = ((g - mean) * jax.lax.rsqrt(var + 1e-5)).reshape(b, h, w, c)
        return (g * self.scale[...] + self.bias[...]).astype(self.dtype)


class BasicBlock(nnx.Module):
    def __init__(self, cin: int, cout: int, stride: int, dtype, rngs: nnx.Rngs):
        self.conv1 = ConvNorm(cin, cout, stride=stride, dtype=dtype, rngs=rngs)
        self.conv2 = ConvNorm(cout, cout, dtype=dtype, rngs=rngs)
        self.shortcut = ConvNorm(cin, cout, kernel=1, stride=stride, dtype=dtype, rngs=rngs) if (stride != 1 or cin != cout) else None

    def __call__(self, x: jax.Array) -> jax.Array:
        residual = x if self.shortcut is None else self.shortcut(x)
        return jax.nn.relu(self.conv2(jax.nn.relu(self.conv1(x))) + residual)


class ResNet(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
        widths = cfg.resnet_widths
        self.stem = ConvNorm(3, widths[0], dtype=dtype, rngs=rngs)
        blocks, cin = [], widths[0]
        for stage, width in enumerate(widths):
            for i in range(cfg.resnet_blocks):
                blocks.append(BasicBlock(cin, width, 2 if (i == 0 and stage > 0) else 1, dtype, rngs))
                cin = width
        self.blocks = nnx.List(blocks)
        init = jax.nn.initializers.normal(cin**-0.5)
        self.head = nnx.Param(init(rngs.params(), (cin, cfg.num_classes), jnp.float32), axes=("channels", "classes"))
        self.dtype = dtype

    def __call__(self, images: jax.Array) -> jax.Array:
        """Logits [batch, classes] in float32 for images [batch, H, W, 3]."""
        x = jax.nn.relu(self.stem(images))
        for block in self.blocks:
            x = block(x)
        pooled = x.astype(jnp.float32).mean(axis=(1, 2))
        return pooled @ self.head[...]


def _conv_shapes(cfg: ModelConfig) -> list[tuple[int, int, int, int]]:
    """(kernel, cin, cout, output side) of every convolution, for FLOP counting."""
    side, widths = cfg.image_size, cfg.resnet_widths
    convs = [(3, 3, widths[0], side)]
    cin = widths[0]
    for stage, width in enumerate(widths):
        for i in range(cfg.resnet_blocks):
            stride = 2 if (i == 0 and stage > 0) else 1
            side = side // stride
            convs += [(3, cin, width, side), (3, width, width, side)]
            if stride != 1 or cin != width:
                convs.append((1, cin, width, side))
            cin = width
    return convs


def flops_per_image(cfg: ModelConfig) -> float:
    """Training FLOPs per image: 3 x (2 x MACs) of the convolutions and the head."""
    forward = sum(2 * k * k * cin * cout * side * side for k, cin, cout, side in _conv_shapes(cfg))
    forward += 2 * cfg.resnet_widths[-1] * cfg.num_classes
    return 3.0 * forward


def count_params(cfg: ModelConfig) -> int:
    convs = sum(k * k * cin * cout + 2 * cout for k, cin, cout, _ in _conv_shapes(cfg))
    return convs + cfg.resnet_widths[-1] * cfg.num_classes
