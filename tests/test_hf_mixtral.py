"""Hugging Face Mixtral in and out, checked against the checkpoint's own tensors (no PyTorch):
``jaxdist.convert from-hf`` / ``to-hf`` on ``model_type: mixtral``, ``generate`` and ``eval``
on the converted MoE decoder, and the Mixtral configs jaxdist refuses. ``tests/hf_reference.py``
holds the numpy Mixtral (router softmax, top k renormalised, per-expert SwiGLU);
``tests/test_hf_parity.py`` holds it and jaxdist against ``transformers``' MixtralForCausalLM."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import hf_reference as ref
import jax
import numpy as np
import pytest

from jaxdist import convert
from jaxdist import eval as eval_cli
from jaxdist import generate as generate_cli

from helpers import load_model, subprocess_env

VARIANTS = {
    # 4 experts, top 2, GQA 4/2, a vocab 128 does not divide, untied head, fp32, a tokenizer
    "untied": dict(vocab=250, experts=4, top_k=2, kv_heads=2),
    # 8 experts, top 3, tied embeddings, bf16 weights, a vocab of whole 128s
    "tied": dict(vocab=256, experts=8, top_k=3, kv_heads=4, tied=True, dtype="bfloat16"),
}


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """variant -> (Hugging Face directory, converted jaxdist directory)."""
    root = tmp_path_factory.mktemp("mixtral")
    out = {}
    for name, kwargs in VARIANTS.items():
        hf_dir = root / f"hf-{name}"
        ref.write_random_mixtral(hf_dir, ref.mixtral_config(**kwargs), seed=len(name))
        if name == "untied":
            ref.write_tokenizer(hf_dir / "tokenizer.json", kwargs["vocab"])
        assert convert.main(["from-hf", str(hf_dir), str(root / name)]) == 0
        out[name] = (hf_dir, root / name)
    return out


@pytest.mark.parametrize("variant", VARIANTS)
def test_from_hf_logits_match_the_numpy_mixtral(converted, variant):
    hf_dir, out = converted[variant]
    config, tensors = ref.read_llama(hf_dir)
    model = load_model(out)
    assert (model.cfg.moe_experts, model.cfg.moe_top_k, model.cfg.moe_router, model.cfg.moe_renormalize) == (
        config["num_local_experts"],
        config["num_experts_per_tok"],
        "softmax",
        True,
    )
    ids = np.random.default_rng(1).integers(0, config["vocab_size"], (2, 96))
    want = ref.logits(config, tensors, ids)
    got = np.asarray(model(jax.numpy.asarray(ids)))
    vocab = config["vocab_size"]
    np.testing.assert_allclose(got[..., :vocab], want, atol=1e-4, rtol=0)
    assert np.isneginf(got[..., vocab:]).all()  # padding ids are never predicted


@pytest.mark.parametrize("variant", VARIANTS)
def test_to_hf_reproduces_every_tensor_and_the_config(converted, variant, tmp_path):
    hf_dir, out = converted[variant]
    assert convert.main(["to-hf", str(out), str(tmp_path / "back")]) == 0
    config, tensors = ref.read_llama(hf_dir)
    back_config, back = ref.read_llama(tmp_path / "back")
    assert sorted(back) == sorted(tensors)
    for name, tensor in tensors.items():
        assert back[name].dtype == tensor.dtype and back[name].shape == tensor.shape, name
        assert np.array_equal(back[name].view(np.uint8), tensor.view(np.uint8)), name  # bit for bit
    assert back_config["architectures"] == ["MixtralForCausalLM"]
    assert back_config["sliding_window"] is None and back_config["rope_scaling"] is None
    same = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    same += ("num_key_value_heads", "head_dim", "num_local_experts", "num_experts_per_tok", "rope_theta", "rms_norm_eps")
    same += ("tie_word_embeddings", "eos_token_id", "bos_token_id", "max_position_embeddings", "router_aux_loss_coef", "torch_dtype")
    for key in same:
        assert back_config[key] == config[key], key
    assert (tmp_path / "back" / "tokenizer.json").is_file() == (variant == "untied")


@pytest.mark.parametrize(("variant", "mesh"), [("untied", "1"), ("tied", "expert=2,tensor=2")])
def test_greedy_generate_matches_the_numpy_mixtral(converted, variant, mesh, capsys):
    hf_dir, out = converted[variant]
    config, tensors = ref.read_llama(hf_dir)
    prompt = [int(i) for i in np.random.default_rng(4).integers(3, config["vocab_size"], 12)]
    want = ref.greedy(config, tensors, prompt, 10)
    if 2 in want:  # eos: generation stops there and leaves it out
        want = want[: want.index(2)]
    argv = ["--checkpoint", str(out), "--mesh", mesh, "--prompt-ids", ",".join(map(str, prompt)), "--max-new-tokens", "10", "--json"]
    assert generate_cli.main(argv) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["ids"] == want and len(want) >= 5


def test_eval_scores_the_held_out_batches_as_the_numpy_mixtral(converted, capsys):
    from jaxdist.config import load_config
    from jaxdist.data.batches import eval_batches
    from jaxdist.layout.mesh import parse_mesh
    from jaxdist.training.run import build_trainer

    hf_dir, out = converted["untied"]
    keys = ["data.source=synthetic", "train.global_batch=4", "train.seq_len=24", "train.eval_batches=2"]
    assert eval_cli.main(["--checkpoint", str(out), "--mesh", "expert=2", "--json", *keys]) == 0
    result = json.loads(capsys.readouterr().out)
    config = load_config(str(out / "config.yaml"), keys)
    batches = list(eval_batches(config, build_trainer(config, parse_mesh("1")).layout))
    model = ref.read_llama(hf_dir)
    losses = [ref.mean_loss(*model, *(np.asarray(jax.device_get(b[k])) for k in ("inputs", "targets")), np.ones((4, 24))) for b in batches]
    assert result["tokens"] == 2 * 4 * 24
    assert result["loss"] == pytest.approx(np.mean(losses), rel=1e-5)


def test_a_jaxdist_moe_checkpoint_exports_to_mixtral_and_back(tmp_path):
    """jaxdist -> Hugging Face -> jaxdist: an MoE checkpoint (separate q/k/v projections,
    experts narrower than the dense width) exports to a Mixtral folder whose numpy forward
    pass is the checkpoint's model, and converting that folder back gives every parameter
    bit for bit. (A trained run's export against transformers: tests/test_hf_parity.py.)"""
    from flax import nnx

    from jaxdist.config import load_config
    from jaxdist.models.llama import Llama
    from jaxdist.training.weights import save_weights

    from helpers import TINY

    moe = ("model.moe_experts=4", "model.moe_top_k=2", "model.moe_mlp_dim=40", "model.fused_projections=false", "model.vocab_size=384")
    config = load_config(None, (*TINY, *moe, "model.rope_theta=50000", "model.norm_eps=1e-6"))
    model = Llama(config.model, rngs=nnx.Rngs(7))
    save_weights(tmp_path / "ckpt", nnx.state(model, nnx.Param), config)
    assert convert.main(["to-hf", str(tmp_path / "ckpt"), str(tmp_path / "hf")]) == 0
    hf_config, tensors = ref.read_llama(tmp_path / "hf")
    assert (hf_config["model_type"], hf_config["num_local_experts"], hf_config["num_experts_per_tok"]) == ("mixtral", 4, 2)
    assert (hf_config["intermediate_size"], hf_config["rope_theta"], hf_config["rms_norm_eps"]) == (40, 50000.0, 1e-6)
    ids = np.random.default_rng(3).integers(0, hf_config["vocab_size"], (2, 40))
    np.testing.assert_allclose(np.asarray(model(jax.numpy.asarray(ids))), ref.logits(hf_config, tensors, ids), atol=1e-4, rtol=0)
    assert convert.main(["from-hf", str(tmp_path / "hf"), str(tmp_path / "back")]) == 0
    back = load_model(tmp_path / "back")
    assert back.cfg.fused_projections  # imported in jaxdist's default layout: q, k and v in one matrix (rounding differs)
    np.testing.assert_allclose(np.asarray(back(jax.numpy.asarray(ids))), np.asarray(model(jax.numpy.asarray(ids))), atol=1e-5, rtol=0)
    assert convert.main(["to-hf", str(tmp_path / "back"), str(tmp_path / "hf-again")]) == 0
    again = ref.read_llama(tmp_path / "hf-again")[1]
    assert sorted(again) == sorted(tensors) and all(np.array_equal(again[n], tensors[n]) for n in tensors)


# ---------------------------------------------------------------------------------------------
# What jaxdist refuses


def _broken(root: Path, how: str) -> Path:
    """A Mixtral directory (4 experts, 2 layers) damaged in one way."""
    hf_dir = root / "hf"
    ref.write_random_mixtral(hf_dir, ref.mixtral_config(vocab=128))
    config = json.loads((hf_dir / "config.json").read_text())
    if how == "top_k > experts":
        config["num_experts_per_tok"] = 5
    elif how == "sliding window applies":
        config["sliding_window"] = 1024  # max_position_embeddings 4096
    elif how == "more experts than the tensors":
        config["num_local_experts"] = 8
    elif how == "experts 1e9":
        config["num_local_experts"] = 10**9
    elif how == "llama3 rope":
        config["rope_scaling"] = dict(ref.LLAMA3_SCALING)
    elif how == "relu experts":
        config["hidden_act"] = "relu"
    elif how == "missing expert tensor":
        index = json.loads((hf_dir / "model.safetensors.index.json").read_text())
        del index["weight_map"]["model.layers.1.block_sparse_moe.experts.3.w2.weight"]
        (hf_dir / "model.safetensors.index.json").write_text(json.dumps(index))
    else:
        raise AssertionError(how)
    (hf_dir / "config.json").write_text(json.dumps(config))
    return hf_dir


BAD_SOURCES = {
    "top_k > experts": "num_experts_per_tok 5 is more than num_local_experts 4",
    "sliding window applies": "sliding_window 1024 is shorter than max_position_embeddings 4096: jaxdist's attention is full causal",
    "more experts than the tensors": "num_local_experts is 8, but the checkpoint holds experts 0..3 (4 in all)",
    "experts 1e9": "num_local_experts is 1000000000, but the checkpoint holds experts 0..3 (4 in all)",
    "llama3 rope": "rope_scaling type 'llama3' is not supported (default is)",
    "relu experts": "hidden_act 'relu': jaxdist's Llama uses SwiGLU (silu)",
    "missing expert tensor": "tensors missing from the checkpoint: model.layers.1.block_sparse_moe.experts.3.w2.weight",
}


@pytest.mark.parametrize("how", BAD_SOURCES)
def test_bad_mixtral_is_one_line_and_writes_nothing(how, tmp_path, capsys):
    hf_dir = _broken(tmp_path, how)
    assert convert.main(["from-hf", str(hf_dir), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("jaxdist: error:") and BAD_SOURCES[how] in err[0], err
    assert not (tmp_path / "out").exists()


def test_the_cli_exits_2_with_one_line(tmp_path):
    hf_dir = _broken(tmp_path, "top_k > experts")
    cmd = [sys.executable, "-m", "jaxdist.convert", "from-hf", str(hf_dir), str(tmp_path / "out")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=subprocess_env())
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [f"jaxdist: error: {hf_dir / 'config.json'}: {BAD_SOURCES['top_k > experts']}"]
    assert not (tmp_path / "out").exists()


UNEXPRESSIBLE = {
    "moe_router": ("sigmoid", "model.moe_router=sigmoid (Mixtral's router is a softmax)"),
    "moe_renormalize": (False, "model.moe_renormalize=false (Mixtral renormalises the top-k gates)"),
    "moe_shared_experts": (1, "model.moe_shared_experts=1 (Mixtral has no shared experts)"),
    "moe_first_dense": (1, "model.moe_first_dense=1 (every Mixtral layer is an MoE layer)"),
    "moe_capacity_factor": (1.25, "model.moe_capacity_factor=1.25 (Mixtral drops no tokens)"),
    "moe_bias_rate": (0.001, "model.moe_bias_rate=0.001 (Mixtral's router has no selection bias)"),
    "rope_scaling_factor": (8.0, "model.rope_scaling_factor > 0 (jaxdist writes Mixtral with plain RoPE only)"),
}


@pytest.mark.parametrize("key", UNEXPRESSIBLE)
def test_to_hf_refuses_an_moe_model_mixtral_cannot_express(converted, key, tmp_path, capsys):
    _, out = converted["untied"]
    ckpt = tmp_path / "ckpt"
    shutil.copytree(out, ckpt)
    saved = ckpt / "checkpoints" / "0" / "config" / "metadata"
    config = json.loads(saved.read_text())
    value, message = UNEXPRESSIBLE[key]
    config["model"][key] = value
    saved.write_text(json.dumps(config))
    assert convert.main(["to-hf", str(ckpt), str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        len(err) == 1
        and err[0].startswith("jaxdist: error: checkpoint ")
        and err[0].endswith(f"{message}: Mixtral cannot express this model")
    )
    assert not (tmp_path / "hf").exists()


def test_training_only_settings_are_named_when_not_carried_over(tmp_path, capsys):
    """Router jitter, attention dropout and Hugging Face's router loss act only in training:
    the forward pass converts exactly, and each one left behind is named in one line."""
    hf_dir = tmp_path / "hf"
    config = ref.mixtral_config(vocab=128) | {"router_jitter_noise": 0.01, "attention_dropout": 0.1, "output_router_logits": True}
    ref.write_random_mixtral(hf_dir, config)
    assert convert.main(["from-hf", str(hf_dir), str(tmp_path / "out")]) == 0
    err = capsys.readouterr().err
    for line in (
        "router_jitter_noise 0.01 is not carried over: jaxdist's router adds no noise",
        "attention_dropout 0.1 is not carried over: jaxdist's attention has no dropout",
        "router_aux_loss_coef 0.02 is not carried over: set model.moe_aux_loss_coef to train with one",
    ):
        assert f"jaxdist: {hf_dir / 'config.json'}: {line}" in err
