"""Hugging Face Llama and Mixtral checkpoints without PyTorch: a writer of small random
ones, and a numpy forward pass written from the Hugging Face models' definitions
(rotate-half RoPE, ``repeat_kv`` GQA, Llama 3 inverse-frequency scaling, [out, in] linear
weights; Mixtral's sparse MoE block: a softmax over the experts, its top k renormalised
to sum to 1, each chosen expert's ``w2(silu(w1 x) * w3 x)``), so tests can check jaxdist's
conversion against the checkpoint's own tensors. ``tests/test_hf_parity.py`` checks this
reference against ``transformers`` itself."""

from __future__ import annotations

import json
import math
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


def hf_config(*, vocab=1000, d=64, layers=2, heads=8, kv_heads=2, mlp=160, tied=False, scaling=LLAMA3_SCALING, dtype="float32") -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": d,
        "intermediate_size": mlp,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": d // heads,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": scaling,
        "tie_word_embeddings": tied,
        "max_position_embeddings": 2048,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": dtype,
    }


def mixtral_config(
    *, vocab=250, d=32, layers=2, heads=4, kv_heads=2, mlp=48, experts=4, top_k=2, tied=False, dtype="float32", sliding_window=None
) -> dict:
    """A small Mixtral ``config.json`` (the fields ``MixtralConfig`` writes)."""
    return {
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "vocab_size": vocab,
        "hidden_size": d,
        "intermediate_size": mlp,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": d // heads,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": 1e6,
        "sliding_window": sliding_window,
        "num_local_experts": experts,
        "num_experts_per_tok": top_k,
        "router_jitter_noise": 0.0,
        "router_aux_loss_coef": 0.02,
        "output_router_logits": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": tied,
        "max_position_embeddings": 4096,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": dtype,
    }


def write_random_llama(directory: Path, config: dict, seed: int = 0, shards: int = 2) -> dict[str, np.ndarray]:
    """A random checkpoint in Hugging Face's layout (safetensors shards + index); returns its
    tensors. A Mixtral ``config`` gets Mixtral's tensors (router and per-expert w1, w2, w3)."""
    rng = np.random.default_rng(seed)
    d, f, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    hd = config["head_dim"]
    h, kv = config["num_attention_heads"], config["num_key_value_heads"]
    dtype = ml_dtypes.bfloat16 if config["torch_dtype"] == "bfloat16" else np.float32

    def w(*shape, scale=None):
        return (rng.standard_normal(shape) * (scale or shape[-1] ** -0.5)).astype(dtype)

    def mlp(prefix: str) -> dict[str, np.ndarray]:
        if config["model_type"] != "mixtral":
            return {
                prefix + "mlp.gate_proj.weight": w(f, d),
                prefix + "mlp.up_proj.weight": w(f, d),
                prefix + "mlp.down_proj.weight": w(d, f),
            }
        moe = prefix + "block_sparse_moe."
        tensors = {moe + "gate.weight": w(config["num_local_experts"], d, scale=1.0)}  # a router far from uniform
        for j in range(config["num_local_experts"]):
            tensors |= {
                moe + f"experts.{j}.w1.weight": w(f, d),
                moe + f"experts.{j}.w2.weight": w(d, f),
                moe + f"experts.{j}.w3.weight": w(f, d),
            }
        return tensors

    tensors = {"model.embed_tokens.weight": w(v, d, scale=1.0), "model.norm.weight": (1 + 0.1 * rng.standard_normal(d)).astype(dtype)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors |= {
            p + "self_attn.q_proj.weight": w(h * hd, d),
            p + "self_attn.k_proj.weight": w(kv * hd, d),
            p + "self_attn.v_proj.weight": w(kv * hd, d),
            p + "self_attn.o_proj.weight": w(d, h * hd),
            **mlp(p),
            p + "input_layernorm.weight": (1 + 0.1 * rng.standard_normal(d)).astype(dtype),
            p + "post_attention_layernorm.weight": (1 + 0.1 * rng.standard_normal(d)).astype(dtype),
        }
    if not config["tie_word_embeddings"]:
        tensors["lm_head.weight"] = w(v, d)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    names = list(tensors)
    weight_map = {}
    for k in range(shards):
        file = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        part = names[k::shards]
        save_file({n: tensors[n] for n in part}, directory / file, metadata={"format": "pt"})
        weight_map |= dict.fromkeys(part, file)
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return tensors


def write_random_mixtral(directory: Path, config: dict | None = None, seed: int = 0, shards: int = 2) -> dict[str, np.ndarray]:
    """A random Mixtral checkpoint in the Hugging Face hub's layout (``mixtral_config()`` by default)."""
    config = mixtral_config() if config is None else config
    assert config["model_type"] == "mixtral", config["model_type"]
    return write_random_llama(directory, config, seed, shards)


def read_llama(directory: Path) -> tuple[dict, dict[str, np.ndarray]]:
    """(config.json, every tensor) of a Hugging Face directory."""
    config = json.loads((directory / "config.json").read_text())
    index = json.loads((directory / "model.safetensors.index.json").read_text())["weight_map"]
    tensors = {}
    for name, file in index.items():
        with safe_open(directory / file, framework="numpy") as f:
            tensors[name] = f.get_tensor(name)
    return config, tensors


def write_tokenizer(path: Path, vocab: int) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<unk>", "<s>", "</s>", *(f"w{i}" for i in range(vocab - 3))]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(path))


def _inverse_frequencies(config: dict) -> np.ndarray:
    dim = config["head_dim"]
    parameters = config.get("rope_parameters") or {}  # transformers >= 5 writes rope_parameters
    theta = config.get("rope_theta") or parameters["rope_theta"]
    inv = 1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    s = config.get("rope_scaling") or (parameters if parameters.get("rope_type") == "llama3" else None)
    if not s:
        return inv
    old = s["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old / s["low_freq_factor"], old / s["high_freq_factor"]
    out = []
    for f in inv:
        wavelen = 2 * math.pi / f
        if wavelen < high_wavelen:
            out.append(f)
        elif wavelen > low_wavelen:
            out.append(f / s["factor"])
        else:
            smooth = (old / wavelen - s["low_freq_factor"]) / (s["high_freq_factor"] - s["low_freq_factor"])
            out.append((1 - smooth) * f / s["factor"] + smooth * f)
    return np.asarray(out)


def logits(config: dict, tensors: dict[str, np.ndarray], ids: np.ndarray) -> np.ndarray:
    """[batch, seq, vocab] float64 logits of the Hugging Face Llama for ``ids`` [batch, seq]."""
    t32 = {k: np.asarray(v, np.float64) for k, v in tensors.items()}
    h, kv, hd, eps = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"], config["rms_norm_eps"]
    b, t = ids.shape

    def rms(x, weight):
        return weight * (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps))

    def rotate_half(x):
        half = x.shape[-1] // 2
        return np.concatenate([-x[..., half:], x[..., :half]], axis=-1)

    angles = np.arange(t)[:, None] * _inverse_frequencies(config)[None, :]
    emb = np.concatenate([angles, angles], axis=-1)  # [t, hd]
    cos, sin = np.cos(emb)[None, None], np.sin(emb)[None, None]
    causal = np.tril(np.ones((t, t), bool))
    x = t32["model.embed_tokens.weight"][ids]
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        y = rms(x, t32[p + "input_layernorm.weight"])
        q = (y @ t32[p + "self_attn.q_proj.weight"].T).reshape(b, t, h, hd).transpose(0, 2, 1, 3)
        k = (y @ t32[p + "self_attn.k_proj.weight"].T).reshape(b, t, kv, hd).transpose(0, 2, 1, 3)
        v = (y @ t32[p + "self_attn.v_proj.weight"].T).reshape(b, t, kv, hd).transpose(0, 2, 1, 3)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        k, v = np.repeat(k, h // kv, axis=1), np.repeat(v, h // kv, axis=1)  # repeat_kv
        scores = np.where(causal, q @ k.transpose(0, 1, 3, 2) / math.sqrt(hd), -np.inf)
        scores = np.exp(scores - scores.max(-1, keepdims=True))
        attn = (scores / scores.sum(-1, keepdims=True)) @ v
        x = x + attn.transpose(0, 2, 1, 3).reshape(b, t, h * hd) @ t32[p + "self_attn.o_proj.weight"].T
        y = rms(x, t32[p + "post_attention_layernorm.weight"])
        if config["model_type"] == "mixtral":
            x = x + _sparse_moe(config, t32, p + "block_sparse_moe.", y)
        else:
            x = x + _swiglu(y, *(t32[p + f"mlp.{n}_proj.weight"] for n in ("gate", "up", "down")))
    head = t32["model.embed_tokens.weight"] if config["tie_word_embeddings"] else t32["lm_head.weight"]
    return rms(x, t32["model.norm.weight"]) @ head.T


def _swiglu(y: np.ndarray, gate: np.ndarray, up: np.ndarray, down: np.ndarray) -> np.ndarray:
    g = y @ gate.T
    return (g / (1 + np.exp(-g)) * (y @ up.T)) @ down.T


def _sparse_moe(config: dict, t32: dict[str, np.ndarray], prefix: str, y: np.ndarray) -> np.ndarray:
    """Mixtral's MoE block on ``y`` [b, t, d]: the router's softmax over all experts, its
    top k divided by their sum, the k chosen experts' SwiGLUs summed with those weights."""
    e, k = config["num_local_experts"], config["num_experts_per_tok"]
    z = y @ t32[prefix + "gate.weight"].T  # [b, t, E]
    probs = np.exp(z - z.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    chosen = np.argsort(-probs, axis=-1, kind="stable")[..., :k]  # [b, t, k]
    weights = np.take_along_axis(probs, chosen, axis=-1)
    weights /= weights.sum(-1, keepdims=True)
    experts = np.stack([_swiglu(y, *(t32[prefix + f"experts.{j}.{n}.weight"] for n in ("w1", "w3", "w2"))) for j in range(e)])
    picked = np.take_along_axis(np.moveaxis(experts, 0, -2), chosen[..., None], axis=-2)  # [b, t, k, d]
    return np.sum(picked * weights[..., None], axis=-2)


def greedy(config: dict, tensors: dict[str, np.ndarray], prompt: list[int], new_tokens: int) -> list[int]:
    """The ``new_tokens`` ids greedy decoding appends to ``prompt`` (the whole sequence rerun each step)."""
    ids = list(prompt)
    vocab = config["vocab_size"]
    for _ in range(new_tokens):
        ids.append(int(np.argmax(logits(config, tensors, np.asarray([ids]))[0, -1, :vocab])))
    return ids[len(prompt) :]


def mean_loss(config: dict, tensors: dict[str, np.ndarray], inputs: np.ndarray, targets: np.ndarray, mask: np.ndarray) -> float:
    """Mean next-token cross-entropy over the unmasked targets."""
    z = logits(config, tensors, inputs)
    z = z - z.max(-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    picked = np.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    return float(-(picked * mask).sum() / mask.sum())
