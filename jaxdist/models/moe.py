"""A mixture-of-experts SwiGLU layer: a router, ``moe_experts`` routed experts, optional
shared experts, and the balancing statistics.

The router's logits are float32. ``model.moe_router=softmax`` picks the top k of the
softmax (Mixtral; renormalised over the k by default); ``sigmoid`` scores each expert on
its own and normalises the k chosen scores (DeepSeek-V3). With ``model.moe_bias_rate`` a
per-expert bias is added to the scores for choosing only (aux-loss-free balancing); it
is no parameter of the loss (no gradient) and moves by the sign rule after each step
(``balance``).

The layer knows nothing of the mesh: it computes on global arrays and hands the routed
tokens to the active expert kernel, ``models.experts.local_experts`` by default, or
``parallel.expert``'s all-to-all across the ``expert`` axis while a train step is traced.
The statistics (counts, the aux and z losses) are computed here on the global arrays,
so their values are the same on every mesh.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jaxdist.config import ModelConfig
from jaxdist.layout import step_context
from jaxdist.layout.sharding import constrain
from jaxdist.models import fp8
from jaxdist.models.experts import capacity_rows, local_experts
from jaxdist.models.fp8 import Fp8Einsum
from jaxdist.models.layers import matmul, swiglu
from jaxdist.models.params import fan_in_init, param

# The statistic holding the part of a loss sum that is a regularizer, not the data's loss
# (the balancing terms): training minimises it, eval leaves it out.
REGULARIZER = "regularizer"


class RouterBias(nnx.Variable):
    """Aux-loss-free balancing's per-expert selection bias: state, not a trained parameter."""


# (x [b, t, d], ids [b, t, k], gates [b, t, k], w_gate_up, w_down, capacity factor) -> (y [b, t, d], dropped)
ExpertKernel = Callable[..., tuple[jax.Array, jax.Array]]


def one_device_kernel(x, ids, gates, w_gate_up, w_down, capacity_factor: float):
    """All tokens and experts on one device (no ``expert`` axis, no active layout)."""
    b, t, d = x.shape
    k = ids.shape[-1]
    capacity = capacity_rows(b * t, k, w_gate_up.shape[0], capacity_factor)
    y, dropped = local_experts(x.reshape(b * t, d), ids.reshape(b * t, k), gates.reshape(b * t, k), w_gate_up, w_down, capacity)
    return y.reshape(b, t, d), dropped


def route(cfg: ModelConfig, logits: jax.Array, bias: jax.Array | None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(expert ids [..., k], their gates [..., k], per-expert probabilities [..., E] for the
    aux loss) of float32 router ``logits`` [..., E]."""
    k = cfg.moe_top_k
    if cfg.moe_router == "sigmoid":
        scores = jax.nn.sigmoid(logits)
        probs = scores / jnp.sum(scores, axis=-1, keepdims=True)
    else:
        scores = probs = jax.nn.softmax(logits, axis=-1)
    choice = scores if bias is None else scores + jax.lax.stop_gradient(bias)
    _, ids = jax.lax.top_k(choice, k)
    gates = jnp.take_along_axis(scores, ids, axis=-1)
    if cfg.moe_router == "sigmoid" or cfg.moe_renormalize:
        gates = gates / jnp.sum(gates, axis=-1, keepdims=True)
    return ids, gates, probs


class MoE(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs):
        e, d, f = cfg.moe_experts, cfg.d_model, cfg.resolved_moe_mlp_dim
        pd = jnp.dtype(cfg.param_dtype)
        self.cfg, self.dtype = cfg, dtype
        self.router = param(rngs, fan_in_init(d), (d, e), ("embed", None), pd)
        self.w_gate_up = param(rngs, fan_in_init(d), (e, d, 2, f), ("expert", "embed", None, "mlp"), pd)
        self.w_down = param(rngs, fan_in_init(f), (e, f, d), ("expert", "mlp", "embed"), pd)
        if cfg.moe_shared_experts:  # s always-on SwiGLU experts = one SwiGLU of width s x f
            width = cfg.moe_shared_experts * f
            self.shared_gate_up = param(rngs, fan_in_init(d), (d, 2, width), ("embed", None, "mlp"), pd)
            self.shared_down = param(rngs, fan_in_init(width), (width, d), ("mlp", "embed"), pd)
            self.shared_gate_up_dot = Fp8Einsum(cfg.fp8, cfg.fp8_history, "shared_gate_up")
            self.shared_down_dot = Fp8Einsum(cfg.fp8, cfg.fp8_history, "shared_down")
        if cfg.moe_bias_rate > 0:
            self.bias = RouterBias(jnp.zeros((e,), jnp.float32), axes=(None,), no_decay=True)

    def __call__(self, x: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
        """(output [b, t, d], this layer's statistics: sums over the batch, see ``stats``)."""
        cfg = self.cfg
        logits = jnp.einsum("btd,de->bte", x.astype(jnp.float32), self.router[...].astype(jnp.float32))
        bias = self.bias[...] if cfg.moe_bias_rate > 0 else None
        ids, gates, probs = route(cfg, logits, bias)
        kernel = step_context.current().expert_kernel or one_device_kernel
        w = lambda p: p[...].astype(self.dtype)  # noqa: E731
        with fp8.grouped(cfg.fp8 != "off"):
            y, dropped = kernel(x, ids, gates, w(self.w_gate_up), w(self.w_down), cfg.moe_capacity_factor)
        if cfg.moe_shared_experts:
            gate_up = matmul(self.shared_gate_up_dot, "btd,dcf->btcf", x, w(self.shared_gate_up))  # f32 weight gradients
            gate_up = constrain(gate_up, ("batch", "seq", None, "act_mlp"))
            hidden = swiglu(gate_up[:, :, 0], gate_up[:, :, 1])
            y = y + matmul(self.shared_down_dot, "btf,fd->btd", hidden, w(self.shared_down))
        return y, stats(cfg, logits, ids, probs, dropped)


def stats(cfg: ModelConfig, logits: jax.Array, ids: jax.Array, probs: jax.Array, dropped: jax.Array) -> dict[str, jax.Array]:
    """One layer's balancing statistics over the batch it sees (the step's, or one microbatch's).

    ``aux``: the Switch / Megatron load-balancing loss E x sum_i f_i P_i of this batch, f_i the
    fraction of assignments routed to expert i and P_i its mean router probability (1 when
    balanced): the training objective's term; ``z``: mean logsumexp(logits)^2. Sums that add over
    microbatches (the logged metrics come from them, ``metrics_from_sums``): ``counts``
    (assignments per expert), ``probs`` (router probabilities per expert, summed over tokens),
    ``tokens`` (routed), ``dropped`` and ``assigned`` (assignments past capacity or buffer, and
    all of them)."""
    e = cfg.moe_experts
    counts = jnp.sum(jax.nn.one_hot(ids, e, dtype=jnp.float32), axis=tuple(range(ids.ndim)))
    assigned = jnp.asarray(ids.size, jnp.float32)
    prob_sums = jnp.sum(probs.reshape(-1, e), axis=0)
    tokens = jnp.asarray(ids.size // ids.shape[-1], jnp.float32)
    aux = e * jnp.sum(jax.lax.stop_gradient(counts / assigned) * prob_sums / tokens)
    z = jnp.mean(jnp.square(jax.nn.logsumexp(logits, axis=-1)))
    return {"counts": counts, "probs": prob_sums, "tokens": tokens, "aux": aux, "z": z, "dropped": dropped, "assigned": assigned}


def moe_sums(layer_stats: dict[str, jax.Array], weight: jax.Array) -> dict[str, jax.Array]:
    """The MoE statistics of one batch as sums that add over microbatches: per MoE layer the
    expert counts (also what aux-loss-free balancing moves its bias by), the router
    probabilities summed per expert and the routed tokens; the dropped and assigned counts.
    The metrics are computed from the step's sums (``metrics_from_sums``), never averaged over
    microbatches, so they do not depend on ``train.microbatches``. (``weight``: unused, kept for
    the caller's signature; the training objective's per-microbatch terms are ``aux`` and ``z``.)"""
    del weight
    return {
        "moe_counts": layer_stats["counts"],  # [moe layers, experts]
        "moe_probs": layer_stats["probs"],  # [moe layers, experts]
        "moe_tokens": layer_stats["tokens"],  # [moe layers]
        "moe_dropped": jnp.sum(layer_stats["dropped"]),
        "moe_assigned": jnp.sum(layer_stats["assigned"]),
    }


def balance_statistics(counts: jax.Array, prob_sums: jax.Array, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(aux loss, busiest expert's load over the mean), each averaged over MoE layers, from the
    per-layer counts [L, E], summed router probabilities [L, E] and routed tokens [L] of a batch:
    aux = E x sum_i f_i P_i with f_i = counts_i / sum(counts), P_i = probs_i / tokens."""
    e = counts.shape[-1]
    fraction = counts / jnp.maximum(jnp.sum(counts, axis=-1, keepdims=True), 1.0)
    mean_probs = prob_sums / jnp.maximum(tokens, 1.0)[:, None]
    aux = e * jnp.sum(fraction * mean_probs, axis=-1)
    load_max = jnp.max(counts, axis=-1) / jnp.maximum(jnp.mean(counts, axis=-1), 1e-9)
    return jnp.mean(aux), jnp.mean(load_max)


def metrics_from_sums(sums: dict[str, jax.Array], weight: jax.Array) -> dict[str, jax.Array]:
    """metrics.jsonl's MoE fields from one step's summed statistics (``moe_sums``): the whole
    step's counts and probabilities, whatever the microbatches and the mesh."""
    del weight  # the statistics are per routed token, not per target
    aux, load_max = balance_statistics(sums["moe_counts"], sums["moe_probs"], sums["moe_tokens"])
    return {
        "moe_aux_loss": aux,
        "moe_load_max": load_max,
        "moe_dropped_fraction": sums["moe_dropped"] / jnp.maximum(sums["moe_assigned"], 1.0),
    }


def update_router_bias(params, counts: jax.Array, rate: float):
    """Aux-loss-free balancing (DeepSeek-V3): each MoE layer's bias moves by ``rate`` toward
    its under-loaded experts, ``b += rate x sign(mean(counts) - counts)``, from the step's
    global counts [moe layers, experts]; the optimizer never sees it."""

    def move(leaf):
        if not isinstance(leaf, RouterBias):
            return leaf
        delta = rate * jnp.sign(jnp.mean(counts, axis=-1, keepdims=True) - counts)
        return leaf.replace(leaf[...] + delta.astype(leaf[...].dtype))

    return jax.tree.map(move, params, is_leaf=lambda x: isinstance(x, nnx.Variable))
