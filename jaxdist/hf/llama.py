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
import re
from collections.abc import Callable, Iterator

import numpy as np

from jaxdist.config import ModelConfig
from jaxdist.errors import JaxdistError

VOCAB_MULTIPLE = 128
# config.json fields of an imported model that to-hf writes back as they were (token ids, the length it was made for)
KEPT_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id", "max_position_embeddings")
Path = tuple[str, ...]  # a parameter's path in the model's state, e.g. ("blocks", "attn", "wqkv")


def fail(source: str, message: str) -> JaxdistError:
    return JaxdistError(f"{source}: {message}")


def model_config_from_hf(hf: dict, source: str = "config.json") -> ModelConfig:
    """The jaxdist model for a Hugging Face Llama ``config.json``; anything this model
    cannot reproduce exactly is refused in one line."""
    kind = hf.get("model_type")
    if kind != "llama":
        raise fail(source, f"model_type {kind!r} is not a Llama checkpoint (model_type 'llama' and 'mixtral' convert)")
    for flag in ("attention_bias", "mlp_bias"):
        if hf.get(flag):
            raise fail(source, f"{flag} is true: jaxdist's Llama has no biases")
    return decoder_config(hf, source, rope_types=("default", "llama3"))


def decoder_config(hf: dict, source: str, rope_types: tuple[str, ...]) -> ModelConfig:
    """The fields a Llama-style decoder's ``config.json`` shares (Llama, Mixtral): sizes,
    GQA, RMSNorm, the vocab padded to 128 and RoPE (of one of ``rope_types``)."""
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise fail(source, f"hidden_act {act!r}: jaxdist's Llama uses SwiGLU (silu)")
    d, heads = positive_int(hf, "hidden_size", source), positive_int(hf, "num_attention_heads", source)
    kv_heads = positive_int(hf, "num_key_value_heads", source, default=heads)
    head_dim = positive_int(hf, "head_dim", source, default=d // heads or None)  # Hugging Face's default
    try:
        cfg = ModelConfig(
            kind="llama",
            d_model=d,
            n_layers=positive_int(hf, "num_hidden_layers", source),
            n_heads=heads,
            n_kv_heads=kv_heads,
            head_dim=head_dim,
            mlp_dim=positive_int(hf, "intermediate_size", source),
            rope_theta=float(hf.get("rope_theta", 10000.0)),
            norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        )
    except (TypeError, ValueError) as e:
        raise fail(source, f"malformed field ({e})") from None
    vocab = positive_int(hf, "vocab_size", source)
    if cfg.n_heads % cfg.n_kv_heads:
        raise fail(source, f"num_attention_heads {cfg.n_heads} is not a multiple of num_key_value_heads {cfg.n_kv_heads}")
    cfg.vocab_size = -(-vocab // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
    cfg.valid_vocab = vocab if cfg.vocab_size != vocab else 0
    _read_rope(cfg, hf, source, rope_types)
    return cfg


def _read_rope(cfg: ModelConfig, hf: dict, source: str, rope_types: tuple[str, ...]) -> None:
    scaling = hf.get("rope_scaling") or hf.get("rope_parameters")
    if scaling is not None and not isinstance(scaling, dict):
        raise fail(source, f"rope_scaling {scaling!r} is not a mapping")
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type not in rope_types:
        supported = " and ".join(rope_types) + (" are" if len(rope_types) > 1 else " is")
        raise fail(source, f"rope_scaling type {rope_type!r} is not supported ({supported})")
    try:
        if rope_type == "llama3":
            cfg.rope_scaling_factor = float(scaling["factor"])
            cfg.rope_low_freq_factor = float(scaling.get("low_freq_factor", 1.0))
            cfg.rope_high_freq_factor = float(scaling.get("high_freq_factor", 4.0))
            cfg.rope_original_max_len = int(scaling.get("original_max_position_embeddings", 8192))
            cfg.rope_theta = float(scaling.get("rope_theta", cfg.rope_theta))
        elif scaling and "rope_theta" in scaling:  # transformers >= 5 keeps rope_theta in rope_parameters
            cfg.rope_theta = float(scaling["rope_theta"])
    except KeyError as e:
        raise fail(source, f"rope_scaling lacks {e.args[0]!r}") from None
    except (TypeError, ValueError) as e:
        raise fail(source, f"malformed rope_scaling ({e})") from None


def positive_int(hf: dict, key: str, source: str, default: int | None = None) -> int:
    """A size field: a JSON integer >= 1 (``default`` when absent or null)."""
    value = hf.get(key)
    if value is None:
        if default is None:
            raise fail(source, f"missing field {key!r}")
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise fail(source, f"{key} {value!r} is not a positive integer")
    return value


def hf_config(cfg: ModelConfig, *, dtype: str, max_positions: int, extra: dict | None = None) -> dict:
    """A Hugging Face ``config.json`` for ``cfg`` (``extra``: fields kept from an imported
    config, e.g. token ids)."""
    out = decoder_hf_config(cfg, dtype=dtype, max_positions=max_positions, extra=extra)
    out.update(
        architectures=["LlamaForCausalLM"], model_type="llama", intermediate_size=cfg.resolved_mlp_dim, attention_bias=False, mlp_bias=False
    )
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


def decoder_hf_config(cfg: ModelConfig, *, dtype: str, max_positions: int, extra: dict | None = None) -> dict:
    """The ``config.json`` fields a Llama-style decoder shares (sizes, GQA, RoPE base, norm)."""
    out = dict(extra or {})
    out.update(
        hidden_size=cfg.d_model,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_kv_heads,
        head_dim=cfg.resolved_head_dim,
        vocab_size=cfg.valid_vocab or cfg.vocab_size,
        rope_theta=cfg.rope_theta,
        rms_norm_eps=cfg.norm_eps,
        tie_word_embeddings=cfg.tie_embeddings,
        hidden_act="silu",
        max_position_embeddings=max(max_positions, int(out.get("max_position_embeddings", 0))),
        torch_dtype=dtype,
    )
    out.pop("rope_parameters", None)
    return out


# ---------------------------------------------------------------------------------------------
# Tensors


def layer_name(i: int, name: str) -> str:
    return f"model.layers.{i}.{name}"


def decoder_tensor_shapes(cfg: ModelConfig, mlp: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """Every tensor of a Llama-style checkpoint of ``cfg`` with Hugging Face's shape
    (``nn.Linear`` weights [out, in]), each layer's MLP tensors given by ``mlp``."""
    d, h, kv, hd = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.resolved_head_dim
    vocab = cfg.valid_vocab or cfg.vocab_size
    per_layer = {
        "self_attn.q_proj.weight": (h * hd, d),
        "self_attn.k_proj.weight": (kv * hd, d),
        "self_attn.v_proj.weight": (kv * hd, d),
        "self_attn.o_proj.weight": (d, h * hd),
        **mlp,
        "input_layernorm.weight": (d,),
        "post_attention_layernorm.weight": (d,),
    }
    shapes = {"model.embed_tokens.weight": (vocab, d), "model.norm.weight": (d,)}
    shapes |= {layer_name(i, name): shape for i in range(cfg.n_layers) for name, shape in per_layer.items()}
    return shapes if cfg.tie_embeddings else {**shapes, "lm_head.weight": (vocab, d)}


def hf_tensor_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a Hugging Face Llama checkpoint of ``cfg`` has, in the shapes ``LlamaForCausalLM`` loads."""
    d, f = cfg.d_model, cfg.resolved_mlp_dim
    return decoder_tensor_shapes(cfg, {"mlp.gate_proj.weight": (f, d), "mlp.up_proj.weight": (f, d), "mlp.down_proj.weight": (d, f)})


_LAYER_INDEX = re.compile(r"model\.layers\.(\d+)\.")


def check_tensors(
    cfg: ModelConfig,
    present: dict[str, tuple[int, ...]],
    source: str,
    config_source: str = "config.json",
    shapes: Callable[[ModelConfig], dict[str, tuple[int, ...]]] = hf_tensor_shapes,
) -> None:
    """Raise (one line, naming the tensor) unless the checkpoint's tensors (name -> shape,
    from the safetensors headers) are the ones ``shapes(cfg)`` lists, each in its shape.

    The layer count is checked against the layers present first, so an absurd
    ``num_hidden_layers`` fails without building a list of that many names."""
    layers = {int(m[1]) for name in present if (m := _LAYER_INDEX.match(name))}
    if cfg.n_layers != len(layers) or layers != set(range(len(layers))):
        found = f"layers {min(layers)}..{max(layers)}" if layers else "no layers"
        raise fail(config_source, f"num_hidden_layers is {cfg.n_layers}, but the checkpoint holds {found} ({len(layers)} in all)")
    want = shapes(cfg)
    missing = [name for name in want if name not in present]
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise fail(source, f"tensors missing from the checkpoint: {', '.join(missing[:3])}{more}")
    for name, shape in want.items():
        if tuple(present[name]) != shape:
            raise fail(source, f"tensor {name} has shape {tuple(present[name])}; {config_source} makes it {shape}")


def _pad_rows(x: np.ndarray, rows: int) -> np.ndarray:
    return x if x.shape[0] == rows else np.concatenate([x, np.zeros((rows - x.shape[0], *x.shape[1:]), x.dtype)])


@dataclasses.dataclass(frozen=True)
class Stacked:
    """A layer-stacked parameter, given one layer at a time (``layer(i)``), so that the
    whole stack never has to exist on the host besides its destination."""

    layers: int
    layer: Callable[[int], np.ndarray]


def linear(read: Callable[[str], np.ndarray], i: int, name: str) -> np.ndarray:
    """Layer ``i``'s ``nn.Linear`` weight ``name`` as jaxdist's [in, out]."""
    return read(layer_name(i, name)).T


def from_hf(cfg: ModelConfig, read: Callable[[str], np.ndarray]) -> Iterator[tuple[Path, np.ndarray | Stacked]]:
    """jaxdist's parameters one at a time, assembled from the Hugging Face tensors
    ``read(name)`` returns (in their own dtype); the layer stacks as ``Stacked``."""
    yield from decoder_from_hf(cfg, read)
    L = cfg.n_layers
    if cfg.fused_projections:
        gate_up = lambda i: np.stack([linear(read, i, "mlp.gate_proj.weight"), linear(read, i, "mlp.up_proj.weight")], 1)  # noqa: E731
        yield ("blocks", "mlp", "w_gate_up"), Stacked(L, gate_up)
    else:
        yield ("blocks", "mlp", "w_gate"), Stacked(L, lambda i: linear(read, i, "mlp.gate_proj.weight"))
        yield ("blocks", "mlp", "w_up"), Stacked(L, lambda i: linear(read, i, "mlp.up_proj.weight"))
    yield ("blocks", "mlp", "w_down"), Stacked(L, lambda i: linear(read, i, "mlp.down_proj.weight"))


def decoder_from_hf(cfg: ModelConfig, read: Callable[[str], np.ndarray]) -> Iterator[tuple[Path, np.ndarray | Stacked]]:
    """Every parameter but the MLPs': embedding, attention, norms and head."""
    d, h, kv, hd, L = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.resolved_head_dim, cfg.n_layers

    def stacked(one: Callable[[int], np.ndarray]) -> Stacked:
        return Stacked(L, one)

    def q(i: int) -> np.ndarray:
        return linear(read, i, "self_attn.q_proj.weight").reshape(d, h, hd)

    def kv_proj(i: int, which: str) -> np.ndarray:
        return linear(read, i, f"self_attn.{which}_proj.weight").reshape(d, kv, hd)

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
    else:
        yield ("blocks", "attn", "wq"), stacked(q)
        yield ("blocks", "attn", "wk"), stacked(lambda i: kv_proj(i, "k"))
        yield ("blocks", "attn", "wv"), stacked(lambda i: kv_proj(i, "v"))
    yield ("blocks", "attn", "wo"), stacked(lambda i: linear(read, i, "self_attn.o_proj.weight").reshape(h, hd, d))
    yield ("blocks", "attn_norm", "scale"), stacked(lambda i: read(layer_name(i, "input_layernorm.weight")))
    yield ("blocks", "mlp_norm", "scale"), stacked(lambda i: read(layer_name(i, "post_attention_layernorm.weight")))
    yield ("final_norm", "scale"), read("model.norm.weight")
    if not cfg.tie_embeddings:
        yield ("head",), _pad_rows(read("lm_head.weight"), cfg.vocab_size).T


def linear_t(x: np.ndarray) -> np.ndarray:
    """jaxdist's [in, out] -> Hugging Face's [out, in], contiguous for safetensors."""
    return np.ascontiguousarray(x.T)


def to_hf(cfg: ModelConfig, param: Callable[[Path], np.ndarray]) -> Iterator[tuple[str, np.ndarray]]:
    """The Hugging Face tensors, one at a time, from jaxdist's ``param(path)`` (whole
    stacked arrays; padding rows of the vocab dropped)."""
    yield from decoder_to_hf(cfg, param)
    if cfg.fused_projections:
        gate_up = param(("blocks", "mlp", "w_gate_up"))
        w_gate, w_up = gate_up[:, :, 0], gate_up[:, :, 1]
    else:
        w_gate, w_up = param(("blocks", "mlp", "w_gate")), param(("blocks", "mlp", "w_up"))
    w_down = param(("blocks", "mlp", "w_down"))
    for i in range(cfg.n_layers):
        yield layer_name(i, "mlp.gate_proj.weight"), linear_t(w_gate[i])
        yield layer_name(i, "mlp.up_proj.weight"), linear_t(w_up[i])
        yield layer_name(i, "mlp.down_proj.weight"), linear_t(w_down[i])


def decoder_to_hf(cfg: ModelConfig, param: Callable[[Path], np.ndarray]) -> Iterator[tuple[str, np.ndarray]]:
    """Every Hugging Face tensor but the MLPs': embedding, attention, norms and head."""
    d, h, kv, hd, L = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.resolved_head_dim, cfg.n_layers
    vocab = cfg.valid_vocab or cfg.vocab_size
    yield "model.embed_tokens.weight", param(("embed",))[:vocab]
    if not cfg.tie_embeddings:
        yield "lm_head.weight", param(("head",))[:, :vocab].T
    yield "model.norm.weight", param(("final_norm", "scale"))
    if cfg.fused_projections:
        wqkv = param(("blocks", "attn", "wqkv"))
        wq = wqkv[:, :, :, : h // kv].reshape(L, d, h, hd)
        wk, wv = wqkv[:, :, :, h // kv], wqkv[:, :, :, h // kv + 1]
    else:
        wq, wk, wv = (param(("blocks", "attn", n)) for n in ("wq", "wk", "wv"))
    wo = param(("blocks", "attn", "wo"))
    attn_norm, mlp_norm = param(("blocks", "attn_norm", "scale")), param(("blocks", "mlp_norm", "scale"))
    for i in range(L):
        yield layer_name(i, "self_attn.q_proj.weight"), linear_t(wq[i].reshape(d, h * hd))
        yield layer_name(i, "self_attn.k_proj.weight"), linear_t(wk[i].reshape(d, kv * hd))
        yield layer_name(i, "self_attn.v_proj.weight"), linear_t(wv[i].reshape(d, kv * hd))
        yield layer_name(i, "self_attn.o_proj.weight"), linear_t(wo[i].reshape(h * hd, d))
        yield layer_name(i, "input_layernorm.weight"), attn_norm[i]
        yield layer_name(i, "post_attention_layernorm.weight"), mlp_norm[i]
