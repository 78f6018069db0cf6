"""Hugging Face Mixtral <-> jaxdist's MoE decoder: the config fields and the expert tensors.

Pure numpy, like ``jaxdist.hf.llama`` (whose attention, norm, embedding and head mapping
Mixtral shares); ``jaxdist.hf.import_export`` does the reading, sharding and writing.

What Hugging Face's ``MixtralSparseMoeBlock`` computes, and where it lands in jaxdist:

- the router ``block_sparse_moe.gate.weight`` [E, d] (``nn.Linear``): a softmax over all E
  experts, the top ``num_experts_per_tok`` of it, divided by their sum. That is
  ``model.moe_router=softmax`` with ``model.moe_renormalize=true``; jaxdist's ``router``
  is the transpose, [d, E];
- expert j's ``w2(silu(w1 x) * w3 x)``: ``w1`` (gate) and ``w3`` (up) [f, d] become
  ``w_gate_up[j, :, 0]`` and ``w_gate_up[j, :, 1]`` ([E, d, 2, f]), ``w2`` [d, f] becomes
  ``w_down[j]`` [f, d]; every layer is an MoE layer, with no shared expert, no capacity
  (nothing dropped) and no selection bias.

transformers 5 holds the experts fused in memory (``mlp.experts.gate_up_proj``) but reads
and writes checkpoints in these per-expert names. Mixtral's sliding window is refused
where it applies: jaxdist's attention is full causal.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator

import numpy as np

from jaxdist.config import ModelConfig
from jaxdist.errors import JaxdistError
from jaxdist.hf import llama
from jaxdist.hf.llama import Path, Stacked, fail, layer_name, linear, linear_t, positive_int

# config.json fields to-hf writes back as imported: Llama's, and the settings of Hugging Face's own router
# loss (a different sum from model.moe_aux_loss_coef's, so neither is converted into the other)
KEPT_FIELDS = (*llama.KEPT_FIELDS, "router_aux_loss_coef", "output_router_logits")
# MixtralConfig's defaults where they differ from Llama's (a config.json may leave them out)
DEFAULTS = {"rope_theta": 1e6, "rms_norm_eps": 1e-5, "num_key_value_heads": 8, "max_position_embeddings": 4096 * 32}


def _moe(name: str) -> str:
    return f"block_sparse_moe.{name}"


def model_config_from_hf(hf: dict, source: str = "config.json") -> ModelConfig:
    """The jaxdist MoE decoder for a Hugging Face Mixtral ``config.json``; anything it
    cannot reproduce exactly is refused in one line."""
    kind = hf.get("model_type")
    if kind != "mixtral":
        raise fail(source, f"model_type {kind!r} is not a Mixtral checkpoint")
    hf = {**DEFAULTS, **hf}
    cfg = llama.decoder_config(hf, source, rope_types=("default",))
    experts = positive_int(hf, "num_local_experts", source, default=8)
    top_k = positive_int(hf, "num_experts_per_tok", source, default=2)
    if top_k > experts:
        raise fail(source, f"num_experts_per_tok {top_k} is more than num_local_experts {experts}")
    window, longest = hf.get("sliding_window"), positive_int(hf, "max_position_embeddings", source)
    if window is not None:
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise fail(source, f"sliding_window {window!r} is not null or a positive integer")
        if window < longest:
            raise fail(
                source,
                f"sliding_window {window} is shorter than max_position_embeddings {longest}: "
                "jaxdist's attention is full causal, so positions past the window would differ",
            )
    cfg.moe_experts, cfg.moe_top_k, cfg.moe_mlp_dim = experts, top_k, cfg.mlp_dim
    cfg.moe_router, cfg.moe_renormalize = "softmax", True
    return cfg


def training_notes(hf: dict) -> list[str]:
    """What Hugging Face applies only while training and a converted model does not carry
    (the forward pass is the same without them): one line each."""

    def positive(key: str) -> bool:
        value = hf.get(key)
        return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0

    notes = []
    if positive("router_jitter_noise"):
        notes.append(f"router_jitter_noise {hf['router_jitter_noise']} is not carried over: jaxdist's router adds no noise")
    if positive("attention_dropout"):
        notes.append(f"attention_dropout {hf['attention_dropout']} is not carried over: jaxdist's attention has no dropout")
    if hf.get("output_router_logits") is True and positive("router_aux_loss_coef"):
        notes.append(
            f"router_aux_loss_coef {hf['router_aux_loss_coef']} is not carried over: set model.moe_aux_loss_coef to train with one"
        )
    return notes


def check_exportable(cfg: ModelConfig, source: str) -> None:
    """Raise (one line) unless ``cfg`` is an MoE decoder that Mixtral's config can express."""
    unsupported = [
        (cfg.moe_router != "softmax", f"model.moe_router={cfg.moe_router} (Mixtral's router is a softmax)"),
        (not cfg.moe_renormalize, "model.moe_renormalize=false (Mixtral renormalises the top-k gates)"),
        (cfg.moe_shared_experts > 0, f"model.moe_shared_experts={cfg.moe_shared_experts} (Mixtral has no shared experts)"),
        (cfg.moe_first_dense > 0, f"model.moe_first_dense={cfg.moe_first_dense} (every Mixtral layer is an MoE layer)"),
        (cfg.moe_capacity_factor > 0, f"model.moe_capacity_factor={cfg.moe_capacity_factor:g} (Mixtral drops no tokens)"),
        (cfg.moe_bias_rate > 0, f"model.moe_bias_rate={cfg.moe_bias_rate:g} (Mixtral's router has no selection bias)"),
        (cfg.rope_scaling_factor > 0, "model.rope_scaling_factor > 0 (jaxdist writes Mixtral with plain RoPE only)"),
    ]
    for bad, what in unsupported:
        if bad:
            raise JaxdistError(f"{source}: {what}: Mixtral cannot express this model")


def hf_config(cfg: ModelConfig, *, dtype: str, max_positions: int, extra: dict | None = None) -> dict:
    """A Hugging Face Mixtral ``config.json`` for ``cfg``."""
    out = llama.decoder_hf_config(cfg, dtype=dtype, max_positions=max_positions, extra=extra)
    out.update(
        architectures=["MixtralForCausalLM"],
        model_type="mixtral",
        intermediate_size=cfg.resolved_moe_mlp_dim,
        num_local_experts=cfg.moe_experts,
        num_experts_per_tok=cfg.moe_top_k,
        sliding_window=None,
        router_jitter_noise=0.0,
        attention_dropout=0.0,
        rope_scaling=None,
    )
    return out


def hf_tensor_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a Hugging Face Mixtral checkpoint of ``cfg`` has, in the shapes ``MixtralForCausalLM`` loads."""
    d, f, e = cfg.d_model, cfg.resolved_moe_mlp_dim, cfg.moe_experts
    mlp = {_moe("gate.weight"): (e, d)}
    for j in range(e):
        mlp |= {_moe(f"experts.{j}.w1.weight"): (f, d), _moe(f"experts.{j}.w2.weight"): (d, f), _moe(f"experts.{j}.w3.weight"): (f, d)}
    return llama.decoder_tensor_shapes(cfg, mlp)


_EXPERT_INDEX = re.compile(r"model\.layers\.\d+\.block_sparse_moe\.experts\.(\d+)\.")


def check_tensors(cfg: ModelConfig, present: dict[str, tuple[int, ...]], source: str, config_source: str = "config.json") -> None:
    """As ``llama.check_tensors``, the expert count checked against the experts present
    first (an absurd ``num_local_experts`` fails before a list of that many names exists)."""
    experts = {int(m[1]) for name in present if (m := _EXPERT_INDEX.match(name))}
    if cfg.moe_experts != len(experts) or experts != set(range(len(experts))):
        found = f"experts {min(experts)}..{max(experts)}" if experts else "no experts"
        raise fail(config_source, f"num_local_experts is {cfg.moe_experts}, but the checkpoint holds {found} ({len(experts)} in all)")
    llama.check_tensors(cfg, present, source, config_source, shapes=hf_tensor_shapes)


def from_hf(cfg: ModelConfig, read: Callable[[str], np.ndarray]) -> Iterator[tuple[Path, np.ndarray | Stacked]]:
    """jaxdist's parameters one at a time from the Hugging Face tensors ``read(name)``
    returns; the layer stacks as ``Stacked`` (one layer's experts at a time)."""
    yield from llama.decoder_from_hf(cfg, read)
    experts, L = range(cfg.moe_experts), cfg.n_layers

    def gate_up(i: int) -> np.ndarray:  # [E, d, 2, f]
        w = lambda j, n: linear(read, i, _moe(f"experts.{j}.{n}.weight"))  # noqa: E731
        return np.stack([np.stack([w(j, "w1"), w(j, "w3")], 1) for j in experts])

    yield ("blocks", "mlp", "router"), Stacked(L, lambda i: linear(read, i, _moe("gate.weight")))
    yield ("blocks", "mlp", "w_gate_up"), Stacked(L, gate_up)
    yield ("blocks", "mlp", "w_down"), Stacked(L, lambda i: np.stack([linear(read, i, _moe(f"experts.{j}.w2.weight")) for j in experts]))


def to_hf(cfg: ModelConfig, param: Callable[[Path], np.ndarray]) -> Iterator[tuple[str, np.ndarray]]:
    """The Hugging Face Mixtral tensors, one at a time, from jaxdist's ``param(path)``."""
    yield from llama.decoder_to_hf(cfg, param)
    router, gate_up, down = (param(("blocks", "mlp", n)) for n in ("router", "w_gate_up", "w_down"))
    for i in range(cfg.n_layers):
        yield layer_name(i, _moe("gate.weight")), linear_t(router[i])
        for j in range(cfg.moe_experts):
            yield layer_name(i, _moe(f"experts.{j}.w1.weight")), linear_t(gate_up[i, j, :, 0])
            yield layer_name(i, _moe(f"experts.{j}.w2.weight")), linear_t(down[i, j])
            yield layer_name(i, _moe(f"experts.{j}.w3.weight")), linear_t(gate_up[i, j, :, 1])
