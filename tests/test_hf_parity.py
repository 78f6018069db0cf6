"""Parity with ``transformers``' own PyTorch Llama and Mixtral (needs the ``hf`` extra: torch
and transformers). CI installs neither; ``tests/test_hf.py`` and ``tests/test_hf_mixtral.py``
run the same checks there against ``tests/hf_reference.py``, which the logit tests here hold
to ``transformers``."""

from __future__ import annotations

import logging

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import hf_reference as ref  # noqa: E402

from jaxdist import convert  # noqa: E402
from jaxdist import generate as generate_cli  # noqa: E402

from helpers import TINY, load_model  # noqa: E402

VOCAB = 1000  # not a multiple of 128


def build_hf_llama(directory, *, tied: bool):
    torch.manual_seed(int(tied))
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,  # grouped-query attention
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tied,
        max_position_embeddings=2048,
        initializer_range=0.15,  # far from uniform logits, so greedy choices are clear
        rope_scaling=dict(ref.LLAMA3_SCALING),
    )
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(directory, max_shard_size="200KB")  # several shards and an index
    return model


@pytest.fixture(scope="module", params=["untied", "tied"])
def pair(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    model = build_hf_llama(root / "hf", tied=request.param == "tied")
    assert convert.main(["from-hf", str(root / "hf"), str(root / "out")]) == 0
    return model, root


@pytest.mark.heavy
def test_logits_match_transformers_on_a_long_prompt(pair):
    model, root = pair
    ids = np.random.default_rng(0).integers(0, VOCAB, (2, 400))
    with torch.no_grad():
        want = model(torch.tensor(ids)).logits.numpy()
    got = np.asarray(load_model(root / "out")(jnp.asarray(ids)))[..., :VOCAB]
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    np.testing.assert_allclose(ref.logits(*ref.read_llama(root / "hf"), ids), want, atol=1e-4, rtol=0)  # the CI reference


def test_greedy_tokens_match_transformers_generate(pair, capsys):
    model, root = pair
    prompt = [int(i) for i in np.random.default_rng(1).integers(0, VOCAB, 40)]
    with torch.no_grad():
        want = model.generate(torch.tensor([prompt]), max_new_tokens=32, min_new_tokens=32, do_sample=False, pad_token_id=0)
    argv = ["--checkpoint", str(root / "out"), "--prompt-ids", ",".join(map(str, prompt)), "--max-new-tokens", "32", "--json"]
    assert generate_cli.main(argv) == 0
    import json

    assert json.loads(capsys.readouterr().out)["ids"] == want[0, len(prompt) :].tolist()


def test_generation_stops_where_transformers_generate_does(pair, capsys, tmp_path):
    """A generation_config.json eos_token_id list (as Llama 3's): jaxdist stops where
    transformers' generate does, returning its tokens before the eos."""
    import json
    import shutil

    model, root = pair
    prompt = [int(i) for i in np.random.default_rng(3).integers(0, VOCAB, 20)]
    with torch.no_grad():
        free = model.generate(torch.tensor([prompt]), max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0)
    free = free[0, len(prompt) :].tolist()
    k = next(k for k in range(1, 8) if free[k] not in free[:k])
    eos = [next(i for i in range(VOCAB) if i not in free), free[k]]  # an id not produced, then the k-th token
    with torch.no_grad():
        want = model.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False, pad_token_id=0, eos_token_id=eos)
    want = want[0, len(prompt) :].tolist()
    shutil.copytree(root / "out", tmp_path / "out")
    (tmp_path / "out" / "hf_source" / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    argv = ["--checkpoint", str(tmp_path / "out"), "--prompt-ids", ",".join(map(str, prompt)), "--max-new-tokens", "32", "--json"]
    assert generate_cli.main(argv) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["ids"] == (want[:-1] if want[-1] in eos else want) and got["decoded"] == len(want)


def test_a_jaxdist_trained_run_exports_to_transformers(tmp_path, caplog):
    from jaxdist.config import load_config
    from jaxdist.layout.mesh import parse_mesh
    from jaxdist.training.run import run

    config = load_config(None, (*TINY, "train.steps=3", "checkpoint.every_steps=3", "model.rope_theta=50000"))
    run(config, parse_mesh("data=2,tensor=2"), tmp_path / "run", progress=False)
    assert convert.main(["to-hf", str(tmp_path / "run"), str(tmp_path / "hf")]) == 0
    with caplog.at_level(logging.WARNING, logger="transformers"):
        model, info = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert info["missing_keys"] == set() and info["unexpected_keys"] == set() and not info["mismatched_keys"]
    warned = [r.getMessage() for r in caplog.records if r.name.startswith("transformers") and r.levelno >= logging.WARNING]
    assert not warned, warned
    ids = np.random.default_rng(2).integers(0, 257, (2, 200))
    with torch.no_grad():
        want = model.eval()(torch.tensor(ids)).logits.numpy()
    np.testing.assert_allclose(np.asarray(load_model(tmp_path / "run")(jnp.asarray(ids))), want, atol=1e-4, rtol=0)


# ---------------------------------------------------------------------------------------------
# Mixtral (MixtralForCausalLM: a softmax router, its top 2 renormalised, per-expert SwiGLU)

MIXTRAL_VOCAB = 250  # not a multiple of 128


def _mapping_warnings(caplog) -> list[str]:
    """transformers' warnings that a checkpoint's names or shapes did not fit the model."""
    words = ("not initialized", "not used", "newly initialized", "mismatch")
    messages = [r.getMessage() for r in caplog.records if r.name.startswith("transformers") and r.levelno >= logging.WARNING]
    return [m for m in messages if any(w in m for w in words)]


@pytest.fixture(scope="module")
def mixtral_pair(tmp_path_factory):
    """A Mixtral checkpoint in the hub's layout (per-expert w1/w2/w3, as Mixtral-8x7B's),
    loaded by transformers and converted by jaxdist."""
    root = tmp_path_factory.mktemp("mixtral")
    config = ref.mixtral_config(vocab=MIXTRAL_VOCAB, d=64, heads=8, kv_heads=2, mlp=96, experts=4, top_k=2)
    ref.write_random_mixtral(root / "hf", config)
    model, info = transformers.MixtralForCausalLM.from_pretrained(root / "hf", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert convert.main(["from-hf", str(root / "hf"), str(root / "out")]) == 0
    return model.float().eval(), root


def test_mixtral_logits_match_transformers(mixtral_pair):
    model, root = mixtral_pair
    ids = np.random.default_rng(0).integers(0, MIXTRAL_VOCAB, (2, 200))
    with torch.no_grad():
        want = model(torch.tensor(ids)).logits.float().numpy()
    got = np.asarray(load_model(root / "out")(jnp.asarray(ids)))[..., :MIXTRAL_VOCAB]
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    np.testing.assert_allclose(ref.logits(*ref.read_llama(root / "hf"), ids), want, atol=1e-4, rtol=0)  # the CI reference


def test_mixtral_greedy_tokens_match_transformers_generate(mixtral_pair, capsys):
    """Greedy decoding with the KV cache: the tokens transformers' generate picks, up to its
    eos (config.json's eos_token_id 2), which jaxdist leaves out of ``ids``."""
    import json

    model, root = mixtral_pair
    prompt = [int(i) for i in np.random.default_rng(1).integers(3, MIXTRAL_VOCAB, 30)]
    with torch.no_grad():
        want = model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False, pad_token_id=0, eos_token_id=2)
    want = want[0, len(prompt) :].tolist()
    argv = ["--checkpoint", str(root / "out"), "--prompt-ids", ",".join(map(str, prompt)), "--max-new-tokens", "24", "--json"]
    assert generate_cli.main(argv) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["ids"] == (want[:-1] if want[-1] == 2 else want) and got["decoded"] == len(want)


def test_transformers_saved_mixtral_converts(tmp_path):
    """What ``save_pretrained`` writes (transformers 4: these names; 5: its fused experts
    written back as them) converts, and the logits agree."""
    torch.manual_seed(0)
    config = transformers.MixtralConfig(
        vocab_size=MIXTRAL_VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=2048,
        initializer_range=0.15,  # a router far from uniform, so near-ties in the top 2 are rare
    )
    model = transformers.MixtralForCausalLM(config).eval()
    model.save_pretrained(tmp_path / "hf", max_shard_size="200KB")  # several shards and an index
    assert convert.main(["from-hf", str(tmp_path / "hf"), str(tmp_path / "out")]) == 0
    ids = np.random.default_rng(2).integers(0, MIXTRAL_VOCAB, (2, 120))
    with torch.no_grad():
        want = model(torch.tensor(ids)).logits.float().numpy()
    np.testing.assert_allclose(np.asarray(load_model(tmp_path / "out")(jnp.asarray(ids)))[..., :MIXTRAL_VOCAB], want, atol=1e-4, rtol=0)


@pytest.mark.heavy
def test_a_jaxdist_trained_moe_run_exports_to_transformers_mixtral(tmp_path, caplog):
    from jaxdist.config import load_config
    from jaxdist.layout.mesh import parse_mesh
    from jaxdist.training.run import run

    moe = ("model.moe_experts=4", "model.moe_top_k=2", "model.moe_mlp_dim=64")
    config = load_config(None, (*TINY, *moe, "train.steps=3", "checkpoint.every_steps=3", "model.rope_theta=50000"))
    run(config, parse_mesh("data=2,expert=2"), tmp_path / "run", progress=False)
    assert convert.main(["to-hf", str(tmp_path / "run"), str(tmp_path / "hf")]) == 0
    with caplog.at_level(logging.WARNING, logger="transformers"):
        model, info = transformers.MixtralForCausalLM.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert not _mapping_warnings(caplog), _mapping_warnings(caplog)
    assert (model.config.num_local_experts, model.config.num_experts_per_tok, model.config.intermediate_size) == (4, 2, 64)
    ids = np.random.default_rng(2).integers(0, 257, (2, 200))
    with torch.no_grad():
        want = model.float().eval()(torch.tensor(ids)).logits.numpy()
    np.testing.assert_allclose(np.asarray(load_model(tmp_path / "run")(jnp.asarray(ids))), want, atol=1e-4, rtol=0)


def test_a_tied_llama_starts_as_close_to_uniform_as_transformers_does():
    """``model.tie_embeddings=true`` at init: the first loss on random tokens is within one nat
    of transformers' own tied Llama of the same shapes (its default init), and both near
    ln(vocab) (jaxdist's tied table started at std 1 once: 28.7 nats on 256 tokens)."""
    from flax import nnx

    from jaxdist.config import ModelConfig
    from jaxdist.models.llama import Llama

    vocab, d = 512, 64
    ids = np.random.default_rng(0).integers(0, vocab, (4, 65))
    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=d, intermediate_size=192, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=4, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    with torch.no_grad():
        theirs = float(transformers.LlamaForCausalLM(config)(torch.tensor(ids), labels=torch.tensor(ids)).loss)
    cfg = ModelConfig(vocab_size=vocab, d_model=d, n_layers=2, n_heads=8, n_kv_heads=4, mlp_dim=192, tie_embeddings=True)
    model = Llama(cfg, rngs=nnx.Rngs(0))
    logits = np.asarray(model(jnp.asarray(ids[:, :-1])), np.float64)
    logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) - logits.max(-1, keepdims=True)
    ours = float(-np.take_along_axis(logp, ids[:, 1:, None], -1).mean())
    assert abs(ours - theirs) < 1.0 and abs(ours - np.log(vocab)) < 1.0, (ours, theirs, np.log(vocab))
