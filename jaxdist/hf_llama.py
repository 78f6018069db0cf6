"""Hugging Face Llama <-> jaxdist: the config fields and every tensor's name and layout.

Pure numpy; ``jaxdist.convert`` does the reading, sharding and writing. Layouts:

- Hugging Face stores ``nn.Linear`` weights as [out, in]; jaxdist's matrices are [in, out]
  with the head axes split out (``wq`` [d_model, heads, head_dim], ``wo`` [heads, head_dim,
  d_model]), stacked over layers on a leading axis.
- With ``model.fused_projections`` (the default) q, k and v are one matrix per GQA group,
  ``wqkv`` [d_model, kv_heads, heads/kv_heads + 2, head_dim]: group g holds query heads
  g*(h/kv) .. g*(h/kv)+h/kv-1, then k head g, then v head g. Hugging Face's ``repeat_kv``
  pairs query head i with kv head i // (h/kv): the same grouping. Gate and up are
  ``w_gate_up`` [d_model, 2, mlp_dim] (0: gate, 1: up).
- RoPE needs no permutation: jaxdist rotates half-dimensions like Hugging Face's Llama
  (``jaxdist.models.llama.rope`` is where that is decided).
- The vocab is padded to a multiple of 128 (tensor parallelism splits it); the padding
  rows are zero, ``model.valid_vocab`` masks their logits, and ``to-hf`` drops them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator

import numpy as np

from jaxdist.config import ModelConfig
from jaxdist.errors import JaxdistError

VOCAB_MULTIPLE = 128
Path = tuple[str, ...]  # a parameter's path in the model's state, e.g. ("blocks", "attn", "wqkv")


def _fail(source: str, message: str) -> JaxdistError:
    return JaxdistError(f"{source}: {message}")


def model_config_from_hf(hf: dict, source: str = "config.json") -> ModelConfig:
    """The jaxdist model for a Hugging Face Llama ``config.json``; anything this model
    cannot reproduce exactly is refused in one line."""
    kind = hf.get("model_type")
    if kind != "llama":
        raise _fail(source, f"model_type {kind!r} is not a Llama checkpoint (only model_type 'llama' converts)")
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise _fail(source, f"hidden_act {act!r}: jaxdist's Llama uses SwiGLU (silu)")
    for flag in ("attention_bias", "mlp_bias"):
        if hf.get(flag):
            raise _fail(source, f"{flag} is true: jaxdist's Llama has no biases")
    try:
        d, heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
        cfg = ModelConfig(
            kind="llama",
            d_model=d,
            n_layers=int(hf["num_hidden_layers"]),
            n_heads=heads,
            n_kv_heads=int(hf.get("num_key_value_heads") or heads),
            head_dim=int(hf.get("head_dim") or d // heads),
            mlp_dim=int(hf["intermediate_size"]),
            rope_theta=float(hf.get("rope_theta", 10000.0)),
            norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        )
        vocab = int(hf["vocab_size"])
    except KeyError as e:
        raise _fail(source, f"missing field {e.args[0]!r}") from None
    except (TypeError, ValueError) as e:
        raise _fail(source, f"malformed field ({e})") from None
    if cfg.n_heads % cfg.n_kv_heads:
        raise _fail(source, f"num_attention_heads {cfg.n_heads} is not a multiple of num_key_value_heads {cfg.n_kv_heads}")
    cfg.vocab_size = -(-vocab // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
    cfg.valid_vocab = vocab if cfg.vocab_size != vocab else 0
    scaling = hf.get("rope_scaling") or hf.get("rope_parameters")
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type == "llama3":
        cfg.rope_scaling_factor = float(scaling["factor"])
        cfg.rope_low_freq_factor = float(scaling.get("low_freq_factor", 1.0))
        cfg.rope_high_freq_factor = float(scaling.get("high_freq_factor", 4.0))
        cfg.rope_original_max_len = int(scaling.get("original_max_position_embeddings", 8192))
        cfg.rope_theta = float(scaling.get("rope_theta", cfg.rope_theta))
    elif rope_type != "default":
        raise _fail(source, f"rope_scaling type {rope_type!r} is not supported (default and llama3 are)")
    elif scaling and "rope_theta" in scaling:  # transformers >= 5 keeps rope_theta in rope_parameters
        cfg.rope_theta = float(scaling["rope_theta"])
    return cfg


def hf_config(cfg: ModelConfig, *, dtype: str, max_positions: int, extra: dict | None = None) -> dict:
    """A Hugging Face ``config.json`` for ``cfg`` (``extra``: fields kept from an imported
    config, e.g. token ids)."""
    out = dict(extra or {})
    out.update(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        hidden_size=cfg.d_model,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_kv_heads,
        head_dim=cfg.resolved_head_dim,
        intermediate_size=cfg.resolved_mlp_dim,
        vocab_size=cfg.valid_vocab or cfg.vocab_size,
        rope_theta=cfg.rope_theta,
        rms_norm_eps=cfg.norm_eps,
        tie_word_embeddings=cfg.tie_embeddings,
        hidden_act="silu",
        attention_bias=False,
        mlp_bias=False,
        max_position_embeddings=max(max_positions, int(out.get("max_position_embeddings", 0))),
        torch_dtype=dtype,
    )
    out.pop("rope_parameters", None)
    out["rope_scaling"] = (
        {
            "rope_type": "llama3",
            "factor": cfg.rope_scaling_factor,
            "low_freq_factor": cfg.rope_low_freq_factor,
            "high_freq_factor": cfg.rope_high_freq_factor,
            "original_max_position_embeddings": cfg.rope_original_max_len,
        }
        if cfg.rope_scaling_factor
        else None
    )
    return out


# ---------------------------------------------------------------------------------------------
# Tensors


def _layer(i: int, name: str) -> str:
    return f"model.layers.{i}.{name}"


def hf_tensor_names(cfg: ModelConfig) -> list[str]:
    """Every tensor a Hugging Face checkpoint of ``cfg`` has."""
    per_layer = [
        "self_attn.q_proj.weight",
        "self_attn.k_proj.weight",
        "self_attn.v_proj.weight",
        "self_attn.o_proj.weight",
        "mlp.gate_proj.weight",
        "mlp.up_proj.weight",
        "mlp.down_proj.weight",
        "input_layernorm.weight",
        "post_attention_layernorm.weight",
    ]
    names = ["model.embed_tokens.weight", "model.norm.weight", *(_layer(i, n) for i in range(cfg.n_layers) for n in per_layer)]
    return names if cfg.tie_embeddings else [*names, "lm_head.weight"]


def _pad_rows(x: np.ndarray, rows: int) -> np.ndarray:
    return x if x.shape[0] == rows else np.concatenate([x, np.zeros((rows - x.shape[0], *x.shape[1:]), x.dtype)])


@dataclasses.dataclass(frozen=True)
class Stacked:
    """A layer-stacked parameter, given one layer at a time (``layer(i)``), so that the
    whole stack never has to exist on the host besides its destination."""

    layers: int
    layer: Callable[[int], np.ndarray]


def from_hf(cfg: ModelConfig, read: Callable[[str], np.ndarray]) -> Iterator[tuple[Path, np.ndarray | Stacked]]:
    """jaxdist's parameters one at a time, assembled from the Hugging Face tensors
    ``read(name)`` returns (in their own dtype); the layer stacks as ``Stacked``."""
    d, h, kv, hd, L = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.resolved_head_dim, cfg.n_layers

    def stacked(one: Callable[[int], np.ndarray]) -> Stacked:
        return Stacked(L, one)

    def q(i: int) -> np.ndarray:
        return read(_layer(i, "self_attn.q_proj.weight")).T.reshape(d, h, hd)

    def kv_proj(i: int, which: str) -> np.ndarray:
        return read(_layer(i, f"self_attn.{which}_proj.weight")).T.reshape(d, kv, hd)

    def linear(i: int, name: str) -> np.ndarray:
        return read(_layer(i, name)).T

    yield ("embed",), _pad_rows(read("model.embed_tokens.weight"), cfg.vocab_size)
    if cfg.fused_projections:
        yield (
            ("blocks", "attn", "wqkv"),
            stacked(
                lambda i: np.concatenate(
                    [q(i).reshape(d, kv, h // kv, hd), kv_proj(i, "k")[:, :, None], kv_proj(i, "v")[:, :, None]], axis=2
                )
            ),
        )
        yield (
            ("blocks", "mlp", "w_gate_up"),
            stacked(lambda i: np.stack([linear(i, "mlp.gate_proj.weight"), linear(i, "mlp.up_proj.weight")], 1)),
        )
    else:
        yield ("blocks", "attn", "wq"), stacked(q)
        yield ("blocks", "attn", "wk"), stacked(lambda i: kv_proj(i, "k"))
        yield ("blocks", "attn", "wv"), stacked(lambda i: kv_proj(i, "v"))
        yield ("blocks", "mlp", "w_gate"), stacked(lambda i: linear(i, "mlp.gate_proj.weight"))
        yield ("blocks", "mlp", "w_up"), stacked(lambda i: linear(i, "mlp.up_proj.weight"))
    yield ("blocks", "attn", "wo"), stacked(lambda i: linear(i, "self_attn.o_proj.weight").reshape(h, hd, d))
    yield ("blocks", "mlp", "w_down"), stacked(lambda i: linear(i, "mlp.down_proj.weight"))
    yield ("blocks", "attn_norm", "scale"), stacked(lambda i: read(_layer(i, "input_layernorm.weight")))
    yield ("blocks", "mlp_norm", "scale"), stacked(lambda i: read(_layer(i, "post_attention_layernorm.weight")))
    yield ("final_norm", "scale"), read("model.norm.weight")
    if not cfg.tie_embeddings:
        yield ("head",), _pad_rows(read("lm_head.weight"), cfg.vocab_size).T


def to_hf(cfg: ModelConfig, param: Callable[[Path], np.ndarray]) -> Iterator[tuple[str, np.ndarray]]:
    """The Hugging Face tensors, one at a time, from jaxdist's ``param(path)`` (whole
    stacked arrays; padding rows of the vocab dropped)."""
    d, h, kv, hd, L = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.resolved_head_dim, cfg.n_layers
    vocab = cfg.valid_vocab or cfg.vocab_size
    yield "model.embed_tokens.weight", param(("embed",))[:vocab]
    if not cfg.tie_embeddings:
        yield "lm_head.weight", param(("head",))[:, :vocab].T
    yield "model.norm.weight", param(("final_norm", "scale"))

    def linear_t(x: np.ndarray) -> np.ndarray:  # [in, out] -> HF's [out, in], contiguous for safetensors
        return np.ascontiguousarray(x.T)

    if cfg.fused_projections:
        wqkv, gate_up = param(("blocks", "attn", "wqkv")), param(("blocks", "mlp", "w_gate_up"))
        wq = wqkv[:, :, :, : h // kv].reshape(L, d, h, hd)
        wk, wv = wqkv[:, :, :, h // kv], wqkv[:, :, :, h // kv + 1]
        w_gate, w_up = gate_up[:, :, 0], gate_up[:, :, 1]
    else:
        wq, wk, wv = (param(("blocks", "attn", n)) for n in ("wq", "wk", "wv"))
        w_gate, w_up = param(("blocks", "mlp", "w_gate")), param(("blocks", "mlp", "w_up"))
    wo, w_down = param(("blocks", "attn", "wo")), param(("blocks", "mlp", "w_down"))
    attn_norm, mlp_norm = param(("blocks", "attn_norm", "scale")), param(("blocks", "mlp_norm", "scale"))
    for i in range(L):
        yield _layer(i, "self_attn.q_proj.weight"), linear_t(wq[i].reshape(d, h * hd))
        yield _layer(i, "self_attn.k_proj.weight"), linear_t(wk[i].reshape(d, kv * hd))
        yield _layer(i, "self_attn.v_proj.weight"), linear_t(wv[i].reshape(d, kv * hd))
        yield _layer(i, "self_attn.o_proj.weight"), linear_t(wo[i].reshape(h * hd, d))
        yield _layer(i, "mlp.gate_proj.weight"), linear_t(w_gate[i])
        yield _layer(i, "mlp.up_proj.weight"), linear_t(w_up[i])
        yield _layer(i, "mlp.down_proj.weight"), linear_t(w_down[i])
        yield _layer(i, "input_layernorm.weight"), attn_norm[i]
        yield _layer(i, "post_attention_layernorm.weight"), mlp_norm[i]
