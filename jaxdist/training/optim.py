"""The optimizer: AdamW (or SGD) with linear warmup + cosine decay and global-norm clipping."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxdist.config import TrainConfig
from jaxdist.models import fp8


def schedule_length(cfg: TrainConfig) -> int:
    """Steps the warmup + cosine schedule spans: ``train.schedule_steps``, else ``train.steps``."""
    return cfg.schedule_steps or cfg.steps


def lr_schedule(cfg: TrainConfig) -> optax.Schedule:
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=cfg.lr,
        warmup_steps=cfg.warmup_steps,
        decay_steps=max(schedule_length(cfg), cfg.warmup_steps + 1),
        end_value=cfg.lr * cfg.min_lr_ratio,
    )


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
    their observed values over them, ``training.update``)."""

    def init(params):
        return tx.init(fp8.without_histories(params))

    def update(updates, state, params=None):
        histories, rest = fp8.split(updates)
        rest, state = tx.update(rest, state, None if params is None else fp8.without_histories(params))
        return fp8.merge(jax.tree.map(jnp.zeros_like, histories), rest), state

    return optax.GradientTransformation(init, update)


def make_optimizer(cfg: TrainConfig, histories: bool = False) -> optax.GradientTransformation:
    """Clip (on the averaged gradient) then AdamW (weight decay decoupled: ``p -= lr * wd * p``
    beside the Adam update), or SGD with PyTorch's coupled weight decay (``torch.optim.SGD``:
    ``g += wd * p`` before the momentum trace, so the decay goes through the momentum too).
    Moments mirror the parameter tree, so their layout follows the same logical axes (see
    ``sharding.rules_for``). ``histories``: the parameters hold fp8 amax histories, kept
    out of the optimizer (``without_histories``)."""
    update = _optimizer(cfg)
    return without_histories(update) if histories else update


def _optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    if cfg.optimizer == "sgd":
        update = optax.chain(
            optax.add_decayed_weights(cfg.weight_decay, mask=_decay_mask) if cfg.weight_decay else optax.identity(),
            optax.sgd(lr_schedule(cfg), momentum=cfg.momentum or None),
        )
    else:
        update = optax.adamw(lr_schedule(cfg), b1=cfg.beta1, b2=cfg.beta2, weight_decay=cfg.weight_decay, mask=_decay_mask)
    if cfg.grad_clip > 0:
        return optax.chain(optax.clip_by_global_norm(cfg.grad_clip), update)
    return update
