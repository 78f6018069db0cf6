"""``train.objective=dpo``: Direct Preference Optimization on chosen/rejected pairs.

The batch holds pairs as adjacent rows (2i chosen, 2i+1 rejected; ``data.preference``), the loss
mask on the answers' tokens. Each row's log-probability ``log pi(answer | prompt)`` is the sum of
its answer tokens' log-probabilities, for the policy and for the frozen reference model; with
the margin ``delta = (pi_c - ref_c) - (pi_r - ref_r)``:

- sigmoid: ``-(1 - ls) log sigmoid(beta delta) - ls log sigmoid(-beta delta)`` (``ls``:
  ``train.dpo_label_smoothing``: cDPO's conservative form; TRL 1.16's ``sigmoid`` has none);
- ipo: ``(delta' - 1 / (2 beta))^2``, where ``delta'`` divides each answer's log-ratio by its
  token count (as TRL does).

The loss is summed over pairs with their count as its weight, so the step's mean is per pair.
The metrics are TRL's: ``rewards/chosen`` and ``rewards/rejected`` (beta x (pi - ref) of the
summed log-probabilities, whatever the loss; means),
``rewards/accuracies`` (the share of pairs whose chosen reward is the higher) and
``rewards/margins``; they travel as sums through the step's statistics (``Task.metrics_from``).

The reference model is the run's initial weights (``--init-from``'s, or the seed's), kept in the
train state (``TrainState.reference``): sharded as the parameters, no optimizer state, no
gradient. It is the default, rather than reference log-probabilities computed once and stored
beside the data, because it needs no pass before training and no file that could go stale
against the data or the tokenizer, and because it is checkpointed with the rest of the state: a
resume is exact without ``--init-from`` being given again (or its checkpoint still existing).
Its price is a second forward pass per step (no backward) and one more copy of the weights in
device memory and in each full checkpoint. Its log-probabilities are computed in the same step,
under ``stop_gradient`` (``step.Trainer._with_reference``). ``data.reference_logps`` trades
those for a file computed once from the same initial weights (``training.reference_pass``):
the batch then carries each row's reference log-probability and the state no reference.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from jaxdist.config import Config
from jaxdist.data import reference_logps
from jaxdist.layout import step_context
from jaxdist.models import Batch, Stats, Task

REFERENCE = reference_logps.KEY  # the batch key: each row's reference log-probability
REWARD_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins")


def row_logps(model: nnx.Module, batch: Batch) -> jax.Array:
    """Each row's answer log-probability [rows]: the sum over the loss mask (on a pipe axis, through
    the pipeline's forward: ``parallel.pipeline.pipelined_row_logps``)."""
    kernel = step_context.current().row_logps_kernel
    if kernel is not None:
        return kernel(model, batch)
    return jnp.sum(model.target_logps(batch) * batch["loss_mask"], axis=-1)


def with_reference(model: nnx.Module, batch: Batch) -> Batch:
    """``batch`` with the reference model's row log-probabilities, outside the gradient."""
    return {**batch, REFERENCE: jax.lax.stop_gradient(row_logps(model, batch))}


def pair_terms(
    policy: jax.Array, reference: jax.Array, *, beta: float, label_smoothing: float, loss: str, counts: jax.Array | None = None
) -> tuple[jax.Array, Stats]:
    """(per-pair losses, the reward metrics' sums over pairs) from row log-probabilities [2 x pairs]
    (``counts``: each row's answer tokens, which IPO divides its log-ratio by; None: 1)."""
    policy, reference = policy.reshape(-1, 2), reference.reshape(-1, 2)
    chosen, rejected = beta * (policy[:, 0] - reference[:, 0]), beta * (policy[:, 1] - reference[:, 1])
    delta = (policy[:, 0] - reference[:, 0]) - (policy[:, 1] - reference[:, 1])
    if loss == "ipo":
        ratios = (policy - reference) / (1.0 if counts is None else jnp.maximum(counts.reshape(-1, 2), 1.0))
        losses = (ratios[:, 0] - ratios[:, 1] - 1.0 / (2.0 * beta)) ** 2
    else:
        losses = -(1.0 - label_smoothing) * jax.nn.log_sigmoid(beta * delta) - label_smoothing * jax.nn.log_sigmoid(-beta * delta)
    sums = {
        "rewards/chosen": jnp.sum(chosen),
        "rewards/rejected": jnp.sum(rejected),
        "rewards/accuracies": jnp.sum((chosen > rejected).astype(jnp.float32)),
        "rewards/margins": jnp.sum(chosen - rejected),
    }
    return losses, sums


def dpo_loss(model: nnx.Module, batch: Batch, *, beta: float, label_smoothing: float, loss: str) -> tuple[jax.Array, jax.Array, Stats]:
    """(the pairs' summed loss, their count, the reward metrics' sums): a ``Task.loss_fn``."""
    counts = jnp.sum(batch["loss_mask"], axis=-1)
    losses, sums = pair_terms(
        row_logps(model, batch), batch[REFERENCE], beta=beta, label_smoothing=label_smoothing, loss=loss, counts=counts
    )
    return jnp.sum(losses), jnp.asarray(losses.shape[0], jnp.float32), sums


def reward_metrics(stats: Stats, pairs: jax.Array) -> dict[str, jax.Array]:
    """The reward metrics (means over the step's pairs) from their sums: a ``Task.metrics_from``."""
    return {key: stats[key] / pairs for key in REWARD_METRICS}


def preference_task(task: Task, config: Config) -> Task:
    """``task`` (the decoder's) trained with ``train.objective=dpo``; itself for ``lm``."""
    t = config.train
    if t.objective != "dpo":
        return task
    loss_fn = functools.partial(dpo_loss, beta=t.dpo_beta, label_smoothing=t.dpo_label_smoothing, loss=t.dpo_loss)
    if config.data.reference_logps:  # read from the batch (data.reference_logps): no reference model, no second forward
        spec = task.batch_spec
        stored = lambda b: {**spec(b), REFERENCE: jax.ShapeDtypeStruct((b,), jnp.float32)}  # noqa: E731
        return dataclasses.replace(task, loss_fn=loss_fn, metrics_from=reward_metrics, batch_spec=stored)
    return dataclasses.replace(
        task,
        loss_fn=loss_fn,
        metrics_from=reward_metrics,
        with_reference=with_reference,
        flops_per_example=task.flops_per_example * 4 / 3,  # the reference's forward: a third of a training step's FLOPs
    )
