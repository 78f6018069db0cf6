"""The optimizer: AdamW, SGD or Muon (``training.muon``) with a warmup + decay schedule and
global-norm clipping."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxdist.config import TrainConfig
from jaxdist.layout.sharding import Layout
from jaxdist.models import fp8
from jaxdist.training.muon import muon_with_adamw


def lr_schedule(cfg: TrainConfig) -> optax.Schedule:
    """The learning rate of the update at optimizer count ``c`` (step ``k = c + 1``).

    Warmup: step k of the first W trains at ``lr x k / W`` (so step 1 already learns, as
    torchtitan's and Megatron's warmups do). Then, over the rest of the N schedule steps,
    with ``p = (k - W) / (N - W)``: ``cosine`` ``floor + (lr - floor)(1 + cos(pi p)) / 2``;
    ``linear`` from lr to the floor; ``constant`` lr; ``wsd`` lr until the last
    ``train.decay_fraction`` of the N steps, then linear to the floor (warmup-stable-decay).
    The floor is ``lr x train.min_lr_ratio``, reached at step N and kept after it.
    """
    peak, floor = cfg.lr, cfg.lr * cfg.min_lr_ratio
    warmup, total = cfg.warmup_steps, cfg.schedule_length()
    decay_start = max(warmup, total - cfg.decay_fraction * total)  # wsd

    def rate(count: jax.Array) -> jax.Array:
        k = jnp.asarray(count, jnp.float32) + 1.0
        p = jnp.clip((k - warmup) / max(total - warmup, 1), 0.0, 1.0)
        if cfg.schedule == "cosine":
            after = floor + (peak - floor) * 0.5 * (1.0 + jnp.cos(jnp.pi * p))
        elif cfg.schedule == "linear":
            after = peak + (floor - peak) * p
        elif cfg.schedule == "wsd":
            q = jnp.clip((k - decay_start) / max(total - decay_start, 1e-9), 0.0, 1.0)
            after = peak + (floor - peak) * q
        else:
            after = jnp.full_like(k, peak)
        return jnp.where(k <= warmup, peak * k / max(warmup, 1), after)

    return rate


def _decay_mask(params):
    """Decay matrices, not norm scales (marked ``no_decay``)."""
    return jax.tree.map(
        lambda v: v.replace(not v.get_metadata().get("no_decay", False)),
        params,
        is_leaf=lambda x: isinstance(x, nnx.Variable),
    )


def without_histories(tx: optax.GradientTransformation) -> optax.GradientTransformation:
    """``tx`` on the parameters without fp8's amax histories (``models.fp8``): its state,
    clipping and weight decay never see them, and their update is zero (the step writes
    their observed values over them, ``training.step``)."""

    def init(params):
        return tx.init(fp8.without_histories(params))

    def update(updates, state, params=None):
        histories, rest = fp8.split(updates)
        rest, state = tx.update(rest, state, None if params is None else fp8.without_histories(params))
        return fp8.merge(jax.tree.map(jnp.zeros_like, histories), rest), state

    return optax.GradientTransformation(init, update)


def make_optimizer(cfg: TrainConfig, histories: bool = False, layout: Layout | None = None) -> optax.GradientTransformation:
    """Clip (on the averaged gradient) then AdamW (weight decay decoupled: ``p -= lr * wd * p``
    beside the Adam update), or SGD with PyTorch's coupled weight decay (``torch.optim.SGD``:
    ``g += wd * p`` before the momentum trace, so the decay goes through the momentum too).
    Moments mirror the parameter tree, so their layout follows the same logical axes (see
    ``sharding.rules_for``). ``histories``: the parameters hold fp8 amax histories, kept
    out of the optimizer (``without_histories``). ``train.optimizer=muon``: Muon on the hidden
    matrices and this AdamW on the rest (``training.muon``), each matrix orthogonalised whole on
    one device of ``layout``'s mesh."""
    update = _optimizer(cfg, layout)
    return without_histories(update) if histories else update


def _optimizer(cfg: TrainConfig, layout: Layout | None) -> optax.GradientTransformation:
    if cfg.optimizer == "sgd":
        update = optax.chain(
            optax.add_decayed_weights(cfg.weight_decay, mask=_decay_mask) if cfg.weight_decay else optax.identity(),
            optax.sgd(lr_schedule(cfg), momentum=cfg.momentum or None),
        )
    else:
        update = optax.adamw(lr_schedule(cfg), b1=cfg.beta1, b2=cfg.beta2, weight_decay=cfg.weight_decay, mask=_decay_mask)
        if cfg.optimizer == "muon":
            update = muon_with_adamw(cfg, lr_schedule(cfg), update, layout)
    if cfg.grad_clip > 0:
        return optax.chain(optax.clip_by_global_norm(cfg.grad_clip), update)
    return update
