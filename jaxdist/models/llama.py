"""A LLaMA-family decoder in Flax NNX: RMSNorm, RoPE, SwiGLU, grouped-query attention.

Every parameter carries ``axes`` metadata (logical names, see ``jaxdist.layout.sharding``); key activations are pinned
with ``constrain``. The layers are stacked on a leading ``layers`` axis and run with ``jax.lax.scan``, so compile time
does not grow with depth.

By default (``model.fused_projections``) each layer has one QKV and one gate/up matrix: under tensor parallelism the
input gradient of each is then one all-reduce, so a layer costs Megatron's 2 activation all-reduces forward and 2
backward instead of one per separate q, k, v, gate and up matmul (``parallel.collective_matmul``: none, the layers in
sequence-parallel form, ``models.collective_matmul``). ``model.loss_chunk`` computes the head and the cross-entropy a
sequence chunk at a time, recomputing each chunk's logits in the backward pass, so the [batch, seq, vocab] fp32 logits
never exist at once. ``model.fp8`` runs the projection matmuls through ``models.fp8`` (``model.fp8_keep_ends``: the
first and last layers run as their own segments of the stack, without it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxdist.config import ModelConfig
from jaxdist.layout.sharding import constrain
from jaxdist.models import fp8, layers
from jaxdist.models.attention import model_attention
from jaxdist.models.collective_matmul import RESIDUAL, dot_scatter, gather_dot, sequence_parallel
from jaxdist.models.fp8 import Fp8Einsum, disabled
from jaxdist.models.layers import embed_lookup, matmul, project, project_joined, rms_norm, split_parts, swiglu
from jaxdist.models.moe import REGULARIZER, MoE, moe_sums
from jaxdist.models.params import fan_in_init, param
from jaxdist.models.remat import name_layer_input, rematted


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, param_dtype, rngs: nnx.Rngs):
        self.scale = nnx.Param(jnp.ones((dim,), param_dtype), axes=("embed",), no_decay=True)
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm(x, self.scale[...], self.eps)


def rope_frequencies(cfg: ModelConfig) -> np.ndarray:
    """The head_dim/2 rotary frequencies theta^(-2i/head_dim), float32, with Llama 3's
    scaling when ``model.rope_scaling_factor`` is set: wavelengths longer than
    original_max_len / low_freq_factor are stretched by the factor, shorter than
    original_max_len / high_freq_factor kept, and the band between interpolated."""
    dim = cfg.resolved_head_dim
    freqs = (1.0 / cfg.rope_theta ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim))).astype(np.float32)
    factor = cfg.rope_scaling_factor
    if not factor:
        return freqs
    low, high, original = cfg.rope_low_freq_factor, cfg.rope_high_freq_factor, cfg.rope_original_max_len
    wavelength = 2 * np.pi / freqs
    ramp = np.clip((original / wavelength - low) / (high - low), 0.0, 1.0)  # 0: long waves (stretched), 1: short (kept)
    return ((1 - ramp) * freqs / factor + ramp * freqs).astype(np.float32)


def rope(x: jax.Array, positions: jax.Array, freqs) -> jax.Array:
    """Rotary embedding on [batch, seq, heads, head_dim] by absolute token positions [batch, seq].

    The one place the RoPE layout is decided: dimension i is paired with i + head_dim/2
    ("rotate half"), the convention of Hugging Face's Llama, so its q_proj / k_proj load
    as they are (``jaxdist.hf.llama``). Meta's original checkpoints pair 2i with 2i+1
    (interleaved); Hugging Face's conversion script permutes their rows into this order.
    """
    angles = positions[..., None].astype(jnp.float32) * jnp.asarray(freqs, jnp.float32)  # [b, t, half]
    sin, cos = jnp.sin(angles)[:, :, None, :], jnp.cos(angles)[:, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs, implementation: str = "xla"):
        d, h, kv, hd = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.resolved_head_dim
        pd = jnp.dtype(cfg.param_dtype)
        self.fused = cfg.fused_projections
        if self.fused:
            # One matrix per GQA group: its h/kv query heads, then its k and v head. Tensor
            # parallelism splits whole groups (kv_heads), so every shard holds the q, k and v
            # it needs; query head kv_index * (h/kv) + j reads kv head kv_index, the order of
            # the separate wq (``causal_attention``: head i reads kv head i // (h/kv)).
            self.wqkv = param(rngs, fan_in_init(d), (d, kv, h // kv + 2, hd), ("embed", "kv_heads", None, "head_dim"), pd)
            self.qkv_dot = Fp8Einsum(cfg.fp8, cfg.fp8_history, "wqkv")
        else:
            self.wq = param(rngs, fan_in_init(d), (d, h, hd), ("embed", "heads", "head_dim"), pd)
            self.wk = param(rngs, fan_in_init(d), (d, kv, hd), ("embed", "kv_heads", "head_dim"), pd)
            self.wv = param(rngs, fan_in_init(d), (d, kv, hd), ("embed", "kv_heads", "head_dim"), pd)
            self.q_dot, self.k_dot, self.v_dot = (Fp8Einsum(cfg.fp8, cfg.fp8_history, name) for name in ("wq", "wk", "wv"))
        self.wo = param(rngs, fan_in_init(h * hd), (h, hd, d), ("heads", "head_dim", "embed"), pd)
        self.o_dot = Fp8Einsum(cfg.fp8, cfg.fp8_history, "wo")  # model.fp8 (models.fp8); plain einsums when off
        self.rope_freqs = tuple(rope_frequencies(cfg).tolist())  # static: a numpy attribute would become NNX state
        self.dtype = dtype
        self.implementation = implementation

    def __call__(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array | None, cache: tuple | None = None):
        """Attention output [batch, seq, d_model]; with a ``cache`` (generation, see
        ``cached_attention``) also the cache with this call's keys and values written."""
        w = lambda p: p[...].astype(self.dtype)  # noqa: E731 - cast fp32 master weights to compute dtype
        if self.fused:
            b, t = x.shape[:2]
            _, kv, groups, hd = self.wqkv.shape
            sizes, args = (groups - 2, 1, 1), ("btd,dkgh->btkgh", x, w(self.wqkv))
            if sequence_parallel(cache):  # x split by sequence over tensor, qkv by kv head
                qkv = gather_dot(*args, w_split=1, out_split=2)
            else:
                qkv = project_joined(*args, 3, 2, sizes) if self.qkv_dot.plain() else self.qkv_dot(*args)
            q, k, v = split_parts(constrain(qkv, ("batch", "seq", "act_kv_heads", None, None)), 3, sizes)
            q = constrain(q.reshape(b, t, kv * (groups - 2), hd), ("batch", "seq", "act_heads", None))
            k = constrain(k[:, :, :, 0], ("batch", "seq", "act_kv_heads", None))
            v = constrain(v[:, :, :, 0], ("batch", "seq", "act_kv_heads", None))
        else:
            q = constrain(matmul(self.q_dot, "btd,dhk->bthk", x, w(self.wq)), ("batch", "seq", "act_heads", None))
            k = constrain(matmul(self.k_dot, "btd,dhk->bthk", x, w(self.wk)), ("batch", "seq", "act_kv_heads", None))
            v = constrain(matmul(self.v_dot, "btd,dhk->bthk", x, w(self.wv)), ("batch", "seq", "act_kv_heads", None))
        q, k = rope(q, positions, self.rope_freqs), rope(k, positions, self.rope_freqs)
        if cache is None:
            out = model_attention(q, k, v, segment_ids, positions, implementation=self.implementation)
        else:
            out, cache = cached_attention(q, k, v, cache)
        out = constrain(out, ("batch", "seq", "act_heads", None))
        if sequence_parallel(cache):
            return dot_scatter("bthk,hkd->btd", out, w(self.wo), h_split=2, w_split=0)
        out = matmul(self.o_dot, "bthk,hkd->btd", out, w(self.wo))
        return out if cache is None else (out, cache)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    """Keys and values of every layer, [layers, batch, max_len, kv_heads, head_dim], for
    generation. The first ``index`` positions are filled; all rows are at the same position."""

    k: jax.Array
    v: jax.Array
    index: jax.Array  # int32 scalar: where the next token's key goes

    @classmethod
    def zeros(cls, cfg: ModelConfig, batch: int, max_len: int, dtype) -> KVCache:
        shape = (cfg.n_layers, batch, max_len, cfg.n_kv_heads, cfg.resolved_head_dim)
        return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), jnp.zeros((), jnp.int32))


def cached_attention(q: jax.Array, k: jax.Array, v: jax.Array, cache: tuple) -> tuple[jax.Array, tuple]:
    """Attention of ``q`` [b, t, h, hd] at positions index..index+t-1 over one layer of the
    cache, after writing this call's ``k``, ``v`` there. ``cache`` is (all layers' keys,
    values, layer, index); only the t new positions are written, so a donated cache is
    updated in place."""
    keys, values, layer, index = cache
    t, max_len = q.shape[1], keys.shape[2]
    keys = jax.lax.dynamic_update_slice(keys, k[None].astype(keys.dtype), (layer, 0, index, 0, 0))
    values = jax.lax.dynamic_update_slice(values, v[None].astype(values.dtype), (layer, 0, index, 0, 0))
    layer_keys = constrain(keys[layer].astype(q.dtype), ("batch", None, "act_kv_heads", None))
    layer_values = constrain(values[layer].astype(q.dtype), ("batch", None, "act_kv_heads", None))
    visible = jnp.arange(max_len)[None, :] <= (index + jnp.arange(t))[:, None]  # causal; nothing past the filled part
    out = jax.nn.dot_product_attention(q, layer_keys, layer_values, mask=visible[None, None], implementation="xla")
    return out, (keys, values, layer, index)


class MLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs):
        d, f = cfg.d_model, cfg.resolved_mlp_dim
        pd = jnp.dtype(cfg.param_dtype)
        self.fused = cfg.fused_projections
        if self.fused:  # [:, 0] gate, [:, 1] up: one matmul, one input-gradient all-reduce under TP
            self.w_gate_up = param(rngs, fan_in_init(d), (d, 2, f), ("embed", None, "mlp"), pd)
            self.gate_up_dot = Fp8Einsum(cfg.fp8, cfg.fp8_history, "w_gate_up")
        else:
            self.w_gate = param(rngs, fan_in_init(d), (d, f), ("embed", "mlp"), pd)
            self.w_up = param(rngs, fan_in_init(d), (d, f), ("embed", "mlp"), pd)
            self.gate_dot, self.up_dot = Fp8Einsum(cfg.fp8, cfg.fp8_history, "w_gate"), Fp8Einsum(cfg.fp8, cfg.fp8_history, "w_up")
        self.w_down = param(rngs, fan_in_init(f), (f, d), ("mlp", "embed"), pd)
        self.down_dot = Fp8Einsum(cfg.fp8, cfg.fp8_history, "w_down")
        self.dtype = dtype

    def __call__(self, x: jax.Array) -> jax.Array:
        if not self.fused:
            gate = matmul(self.gate_dot, "btd,df->btf", x, self.w_gate[...].astype(self.dtype))
            up = matmul(self.up_dot, "btd,df->btf", x, self.w_up[...].astype(self.dtype))
            return self._down(swiglu(gate, up))
        args = ("btd,dcf->btcf", x, self.w_gate_up[...].astype(self.dtype))
        if not self.gate_up_dot.plain():  # fp8: the joined gradient is written (and quantised) whole, in one pass
            return self._down(layers.swiglu_joined(constrain(self.gate_up_dot(*args), ("batch", "seq", None, "act_mlp")), 2))
        # bf16/fp32: the halves apart (the joined pass costs XLA:CPU's step ~4% and buys XLA:GPU's nothing clear)
        joined = gather_dot(*args, w_split=2, out_split=3) if sequence_parallel() else project_joined(*args, 2, 1, (1, 1))
        parts = split_parts(joined, 2, (1, 1))
        gate, up = (constrain(part[:, :, 0], ("batch", "seq", "act_mlp")) for part in parts)
        return self._down(swiglu(gate, up))

    def _down(self, hidden: jax.Array) -> jax.Array:
        hidden = constrain(hidden, ("batch", "seq", "act_mlp"))
        args = ("btf,fd->btd", hidden, self.w_down[...].astype(self.dtype))
        return dot_scatter(*args, h_split=2, w_split=0) if sequence_parallel() else matmul(self.down_dot, *args)


class Block(nnx.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x)); the MLP is a
    mixture of experts (``models.moe``) in an MoE layer."""

    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs, attention: str = "xla", moe: bool = False):
        pd = jnp.dtype(cfg.param_dtype)
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps, pd, rngs)
        self.attn = Attention(cfg, dtype, rngs, attention)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps, pd, rngs)
        self.moe = moe
        self.mlp = MoE(cfg, dtype, rngs) if moe else MLP(cfg, dtype, rngs)

    def __call__(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array | None, cache: tuple | None = None):
        """(output, the MoE layer's statistics or {}); with a ``cache``, (output, cache)."""
        if cache is None:
            x = x + self.attn(self.attn_norm(x), positions, segment_ids)
        else:
            attended, cache = self.attn(self.attn_norm(x), positions, segment_ids, cache)
            x = x + attended
        stats = {}
        if self.moe:
            mixed, stats = self.mlp(self.mlp_norm(x))
            x = x + mixed
        else:
            x = x + self.mlp(self.mlp_norm(x))
        x = constrain(x, RESIDUAL)
        return (x, stats) if cache is None else (x, cache)


class Llama(nnx.Module):
    """The decoder, exposing its parts (embedding, stacked blocks, head and loss) so that
    parallelism can be applied from outside (``jaxdist.parallel.pipeline``)."""

    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, attention: str = "xla", rngs: nnx.Rngs):
        """``attention``: the implementation (``models.attention.choose_implementation`` picks it)."""
        pd = jnp.dtype(cfg.param_dtype)
        self.cfg = cfg
        self.dtype = dtype
        # tied, the table is also the head: it starts at the head's scale (unit-variance logits)
        embed_std = cfg.d_model**-0.5 if cfg.tie_embeddings else 1.0
        self.embed = param(rngs, jax.nn.initializers.normal(embed_std), (cfg.vocab_size, cfg.d_model), ("vocab", "embed"), pd)
        # An MoE model's leading model.moe_first_dense layers keep a dense MLP: a stack of their own
        if cfg.moe_experts and cfg.moe_first_dense:
            self.dense_blocks = _stacked_blocks(cfg, dtype, attention, rngs, cfg.moe_first_dense, moe=False)
        self.blocks = _stacked_blocks(cfg, dtype, attention, rngs, cfg.n_layers - self._dense_depth, moe=cfg.moe_experts > 0)
        self.final_norm = RMSNorm(cfg.d_model, cfg.norm_eps, pd, rngs)
        if not cfg.tie_embeddings:
            self.head = param(rngs, fan_in_init(cfg.d_model), (cfg.d_model, cfg.vocab_size), ("embed", "vocab"), pd)

    @property
    def _dense_depth(self) -> int:
        return self.cfg.moe_first_dense if self.cfg.moe_experts else 0

    def __call__(self, tokens: jax.Array, positions: jax.Array | None = None, segment_ids: jax.Array | None = None) -> jax.Array:
        """Logits [batch, seq, vocab] in float32 for tokens [batch, seq]."""
        batch = {"inputs": tokens, "positions": positions, "segment_ids": segment_ids}
        x, aux = self.embed_tokens({k: v for k, v in batch.items() if v is not None})
        x, _ = self._all_layers(x, aux)
        return self._logits(self.head_params(), x)

    def loss(self, batch: dict[str, jax.Array]) -> tuple[jax.Array, jax.Array, dict[str, jax.Array]]:
        """(sum of next-token cross-entropy over unmasked targets plus, for MoE, the
        balancing losses per target; their count; MoE statistics as sums, see ``moe_sums``)."""
        targets, weight = self.loss_targets(batch)
        x, aux = self.embed_tokens(batch)
        y, layer_stats = self._all_layers(x, aux)
        loss_sum = self.head_loss(self.head_params(), y, targets)
        if not layer_stats:
            return loss_sum, weight, {}
        cfg = self.cfg
        balancing = cfg.moe_aux_loss_coef * jnp.mean(layer_stats["aux"]) + cfg.moe_z_loss_coef * jnp.mean(layer_stats["z"])
        sums = moe_sums(layer_stats, weight)
        sums[REGULARIZER] = weight * balancing  # in the loss sum, not the data's loss: eval leaves it out
        return loss_sum + sums[REGULARIZER], weight, sums

    def target_logps(self, batch: dict[str, jax.Array]) -> jax.Array:
        """The log-probability of each target, [batch, seq] float32, unmasked (preference objectives sum them)."""
        y, _ = self._all_layers(*self.embed_tokens(batch))
        return self.head_target_logps(self.head_params(), y, batch["targets"])

    def head_target_logps(self, head: dict[str, jax.Array], y: jax.Array, targets: jax.Array) -> jax.Array:
        """The log-probability of each of ``targets`` [batch, seq] under the head on the final activations ``y``."""
        return -optax.softmax_cross_entropy_with_integer_labels(self._logits(head, y), targets)

    def _all_layers(self, x: jax.Array, aux: dict[str, jax.Array]) -> tuple[jax.Array, dict[str, jax.Array]]:
        """Every layer (the dense leading stack first), and the MoE layers' statistics stacked [moe layers, ...]."""
        stacks = self._stacks()
        hoisted = fp8.hoisted_stacks()  # quantised before the microbatch loop, else before each stack's layer loop
        for i, (graphdef, stacked) in enumerate(stacks):
            quantized = hoisted[i] if hoisted is not None else self._quantized(graphdef, stacked)
            x, stats = self.layers(graphdef, stacked, x, aux, self._kept_ends(i, len(stacks)), quantized)
        return constrain(x, ("batch", "seq", "act_embed")), stats  # the head takes the sequence whole

    def _quantized(self, graphdef, stacked) -> dict | None:
        """The fp8 weights of a layer stack quantised per layer where they lie (None: fp8 off)."""
        return fp8.quantize_stack(nnx.merge(graphdef, stacked)) if self.cfg.fp8 != "off" else None

    def quantize_fp8(self) -> tuple[dict, ...]:
        """Each layer stack's fp8 weights quantised (``fp8.quantize_stack``): what a train step
        computes once, before its microbatch loop (``fp8.stacks_quantized``)."""
        return tuple(self._quantized(graphdef, stacked) for graphdef, stacked in self._stacks())

    def _kept_ends(self, stack: int, stacks: int) -> tuple[bool, bool]:
        """Whether stack ``stack`` of ``stacks`` runs its (first, last) layer outside fp8:
        ``model.fp8_keep_ends`` keeps the model's first and last layers in the compute dtype."""
        keep = self.cfg.fp8 != "off" and self.cfg.fp8_keep_ends
        return keep and stack == 0, keep and stack == stacks - 1

    def decode(self, tokens: jax.Array, cache: KVCache) -> tuple[jax.Array, KVCache]:
        """Logits [batch, t, vocab] of ``tokens`` [batch, t] placed at positions ``cache.index``.., attending to the cached
        keys and values before them; returns the cache with these tokens' keys and values added (prefill: t = prompt
        length; then one token per call)."""
        b, t = tokens.shape
        positions = jnp.broadcast_to(cache.index + jnp.arange(t), (b, t))
        x, _ = self.embed_tokens({"inputs": tokens, "positions": positions})

        def layer(graphdef, carry, xs):
            h, keys, values = carry
            params, i = xs
            h, (keys, values, _, _) = nnx.merge(graphdef, params)(h, positions, None, (keys, values, i, cache.index))
            return (h, keys, values), None

        keys, values, first = cache.k, cache.v, 0
        stacks = self._stacks()  # the dense leading stack of an MoE model, then the main one
        for n, (graphdef, stacked) in enumerate(stacks):
            depth = jax.tree.leaves(stacked)[0].shape[0]
            xs = (stacked, first + jnp.arange(depth))
            for start, stop, plain in layer_segments(depth, *self._kept_ends(n, len(stacks))):
                with disabled() if plain else contextlib.nullcontext():
                    part = jax.tree.map(lambda a, start=start, stop=stop: a[start:stop], xs)
                    (x, keys, values), _ = jax.lax.scan(functools.partial(layer, graphdef), (x, keys, values), part)
            first += depth
        return self._logits(self.head_params(), x), KVCache(keys, values, cache.index + t)

    def _stacks(self):
        """(graphdef, stacked params) of each layer stack, in order."""
        dense = [nnx_split_cast(self.dense_blocks, self.dtype)] if self._dense_depth else []
        return [*dense, self.layer_stack()]

    # -- the parts -------------------------------------------------------------------

    def embed_tokens(self, batch: dict[str, jax.Array]) -> tuple[jax.Array, dict[str, jax.Array]]:
        """(activations [batch, seq, d_model], per-row positions and segment ids) of ``batch['inputs']``."""
        tokens = batch["inputs"]
        positions = batch.get("positions")
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
        x = embed_lookup(self.embed[...], tokens, self.dtype)  # the table gathered in the compute dtype
        aux = {"positions": positions}
        if batch.get("segment_ids") is not None:
            aux["segment_ids"] = batch["segment_ids"]
        return constrain(x, ("batch", "seq", "act_embed")), aux

    def layer_stack(self):
        """(graphdef, stacked block parameters) with matrices cast to the compute dtype."""
        return nnx_split_cast(self.blocks, self.dtype)

    def run_layers(self, graphdef, stacked, x: jax.Array, aux: dict[str, jax.Array]) -> jax.Array:
        """The layers of ``stacked`` applied in order (what a pipeline stage runs)."""
        return self.layers(graphdef, stacked, x, aux)[0]

    def layers(
        self,
        graphdef,
        stacked,
        x: jax.Array,
        aux: dict[str, jax.Array],
        plain_ends: tuple[bool, bool] = (False, False),
        quantized: dict | None = None,
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """The layers of ``stacked`` (leading axis) applied in order, and their MoE statistics stacked. ``plain_ends``: run
        the (first, last) layer without fp8, as its own segment of the stack (``model.fp8_keep_ends``: one parameter stack,
        so checkpoints do not depend on it). ``quantized``: the stack's fp8 weights (``fp8.quantize_stack``; None: each
        matmul quantises its own)."""
        segments = layer_segments(jax.tree.leaves(stacked)[0].shape[0], *plain_ends)
        if segments == [(0, segments[0][1], False)]:
            return self._layer_segment(graphdef, (stacked, quantized), x, aux)
        per_segment = []
        for start, stop, plain in segments:
            with disabled() if plain else contextlib.nullcontext():
                part = jax.tree.map(lambda a, start=start, stop=stop: a[start:stop], (stacked, None if plain else quantized))
                x, segment_stats = self._layer_segment(graphdef, part, x, aux)
            per_segment.append(segment_stats)
        return x, jax.tree.map(lambda *xs: jnp.concatenate(xs), *per_segment) if per_segment[0] else {}

    def _layer_segment(self, graphdef, stacked, x: jax.Array, aux: dict[str, jax.Array]) -> tuple[jax.Array, dict[str, jax.Array]]:
        """The layers of ``stacked`` (parameters, quantised fp8 weights or None): one scan, or with ``model.scan_layers=false``
        a Python loop, which compiles each layer separately (compile time grows with depth) but saves the scan's stacked
        residual buffers: on XLA's CPU backend their zero-fills and dynamic-update-slices cost a quarter of a small model's
        step (experiments/README.md)."""
        positions = aux["positions"]
        segment_ids = aux.get("segment_ids")

        def layer(h: jax.Array, xs) -> tuple[jax.Array, dict[str, jax.Array]]:
            params, quantized = xs
            block = nnx.merge(graphdef, params)
            with fp8.quantized_in(block, quantized):
                return block(name_layer_input(h), positions, segment_ids)

        layer = rematted(layer, self.cfg.remat, in_scan=self.cfg.scan_layers)
        if self.cfg.scan_layers:
            return jax.lax.scan(layer, x, stacked)
        depth = jax.tree.leaves(stacked[0])[0].shape[0]
        per_layer = []
        for i in range(depth):
            x, layer_stats = layer(x, jax.tree.map(lambda p, i=i: p[i], stacked))
            per_layer.append(layer_stats)
        return x, jax.tree.map(lambda *xs: jnp.stack(xs), *per_layer) if per_layer[0] else {}

    def head_params(self) -> dict[str, jax.Array]:
        head = self.embed[...].T if self.cfg.tie_embeddings else self.head[...]
        return {"norm": self.final_norm.scale[...], "head": head}

    def head_loss(self, head: dict[str, jax.Array], y: jax.Array, targets: dict[str, jax.Array]) -> jax.Array:
        """Summed cross-entropy of the final activations ``y`` under ``targets``.

        With ``model.loss_chunk`` = c > 0 the sequence is cut into chunks of c tokens (the
        last one shorter when c does not divide it) and a scan takes each chunk's loss under
        ``jax.checkpoint``: only one chunk's [batch, c, vocab] logits are alive at a time, in
        the forward and (recomputed) in the backward pass.
        """

        def chunk_loss(head: dict[str, jax.Array], y: jax.Array, targets: dict[str, jax.Array]) -> jax.Array:
            return layers.cross_entropy_sum(self._logits(head, y, self.dtype), targets["targets"], targets["loss_mask"])

        chunk, seq = self.cfg.loss_chunk, y.shape[1]
        if chunk <= 0 or chunk >= seq:
            return chunk_loss(head, y, targets)
        chunk_loss = jax.checkpoint(chunk_loss, prevent_cse=False)
        n, whole = seq // chunk, seq // chunk * chunk

        def chunks(x: jax.Array) -> jax.Array:  # [B, n c, ...] -> [n, B, c, ...]
            return jnp.moveaxis(x[:, :whole].reshape(x.shape[0], n, chunk, *x.shape[2:]), 1, 0)

        def step(total: jax.Array, xs) -> tuple[jax.Array, None]:
            y_c, targets_c = xs
            return total + chunk_loss(head, constrain(y_c, ("batch", "seq", "act_embed")), targets_c), None

        total, _ = jax.lax.scan(step, jnp.zeros((), jnp.float32), (chunks(y), jax.tree.map(chunks, targets)))
        if whole < seq:
            total = total + chunk_loss(head, y[:, whole:], jax.tree.map(lambda x: x[:, whole:], targets))
        return total

    @staticmethod
    def loss_targets(batch: dict[str, jax.Array]) -> tuple[dict[str, jax.Array], jax.Array]:
        """(targets and their loss mask, the number of unmasked targets)."""
        mask = batch.get("loss_mask", jnp.ones(batch["targets"].shape, jnp.float32))
        return {"targets": batch["targets"], "loss_mask": mask}, jnp.sum(mask).astype(jnp.float32)

    def _logits(self, head: dict[str, jax.Array], x: jax.Array, dtype=jnp.float32) -> jax.Array:
        x = rms_norm(x, head["norm"], self.cfg.norm_eps, self.dtype)
        logits = project("btd,dv->btv", x, head["head"]).astype(dtype)
        valid = self.cfg.valid_vocab
        if valid and valid < logits.shape[-1]:  # padding rows of an imported vocab: never predicted, never sampled
            logits = jnp.where(jnp.arange(logits.shape[-1]) < valid, logits, -jnp.inf)
        return constrain(logits, ("batch", "seq", "act_vocab"))


def layer_segments(depth: int, plain_first: bool, plain_last: bool) -> list[tuple[int, int, bool]]:
    """A stack of ``depth`` layers as runs (start, stop, without fp8): the first and the
    last layer on their own when asked, the rest together."""
    plain = [(plain_first and i == 0) or (plain_last and i == depth - 1) for i in range(depth)]
    segments, start = [], 0
    for i in range(1, depth + 1):
        if i == depth or plain[i] != plain[start] or plain[i]:
            segments.append((start, i, plain[start]))
            start = i
    return segments


def nnx_split_cast(blocks: nnx.Module, dtype):
    """(graphdef, stacked block parameters) with matrices cast to the compute dtype before
    the layer loop, so that FSDP's per-layer all-gathers move bf16 shards, not fp32 master
    weights (norm scales and router biases, marked ``no_decay``, stay as they are)."""
    graphdef, stacked = nnx.split(blocks)
    stacked = jax.tree.map(
        lambda v: v if v.get_metadata().get("no_decay") else v.replace(v[...].astype(dtype)),
        stacked,
        is_leaf=lambda x: isinstance(x, nnx.Variable),
    )
    return graphdef, stacked


def _stacked_blocks(cfg: ModelConfig, dtype, attention: str, rngs: nnx.Rngs, depth: int, moe: bool) -> Block:
    """``depth`` blocks whose parameters are stacked on a leading ``layers`` axis."""
    keys = jax.random.split(rngs.params(), depth)

    def one(key: jax.Array):
        return nnx.split(Block(cfg, dtype, nnx.Rngs(params=key), attention, moe))

    graphdef, _ = nnx.split(nnx.eval_shape(lambda: Block(cfg, dtype, nnx.Rngs(0), attention, moe)))
    stacked = jax.vmap(lambda k: one(k)[1])(keys)
    stacked = jax.tree.map(
        lambda v: v.replace(v[...], axes=("layers", *v.get_metadata()["axes"])),
        stacked,
        is_leaf=lambda x: isinstance(x, nnx.Variable),
    )
    return nnx.merge(graphdef, stacked)
